"""HTTP engines for stage 03: SGLang native `/generate` and OpenAI-compatible `/v1/completions` (vLLM).

Token ids go out (`input_ids` / `prompt` as an id list) and come back (`output_ids` / `choices[0].token_ids`
with `return_token_ids`), so no text is ever re-tokenized. Many servers share one work queue, each with
`concurrency` requests in flight, so faster servers take more work. Faults:
- timeouts, refused/reset connections, HTTP 5xx and 429: retried with exponential backoff and jitter (on any
  server: the request goes back to the shared queue), up to `max_retries`; then a Failure "retries_exhausted";
- other 4xx, non-JSON or wrongly shaped replies, ids outside the vocabulary: a Failure with the reason, at once.
`check()` probes every server before any work: down, not answering, or tokenizing a probe text differently
from the target tokenizer (a different model) -> EngineError naming the server.
"""

from __future__ import annotations

import abc
import asyncio
import json
import queue
import random
import threading
import time
from collections.abc import Iterator

import aiohttp

from eagle_lib.engines import client
from eagle_lib.engines.base import EngineError, Failure, Request, Result, Sampling

PROBE_TEXT = "Hello, world! The quick brown fox jumps over 13 lazy dogs: déjà vu, 東京, ```code```."


class Retryable(Exception):
    """A transient fault: try again later (maybe elsewhere)."""

    def __init__(self, detail: str, retry_after: float = 0.0):
        super().__init__(detail)
        self.retry_after = retry_after


class Rejected(Exception):
    """A permanent fault for this request: goes to errors.jsonl with `reason`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def probe_ids(tokenizer) -> tuple[str, list[int]]:
    """A probe text with the target's special tokens, and its ids under the target tokenizer."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t][:8]
    text = PROBE_TEXT + "".join(specials)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _excerpt(body: bytes | str, n: int = 300) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return text[:n].replace("\n", " ")


def _retry_after(resp: aiohttp.ClientResponse) -> float:
    try:
        return float(resp.headers.get("Retry-After", 0))
    except ValueError:
        return 0.0


class HttpEngine(abc.ABC):
    """Shared machinery; subclasses define the endpoint, payload, reply parsing and the probe."""

    name = "http"
    path = ""
    on_start = None  # callable(id, server url) or None: called at each attempt (03's ledger)

    def __init__(
        self,
        urls: list[str],
        sampling: Sampling,
        *,
        vocab_size: int,
        concurrency: int = 8,
        timeout_s: float = 1800.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 6,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        api_key: str | None = None,
        model: str = "",
        send_seed: bool = True,
    ):
        if not urls:
            raise EngineError(f"engine {self.name}: no server URLs given (server_urls is empty)")
        self.urls = [u.rstrip("/") for u in urls]
        self._calls = 0  # generate() calls so far (rotates which server a call starts with)
        self.sampling, self.vocab_size, self.concurrency = sampling, vocab_size, concurrency
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.max_retries, self.backoff_s, self.backoff_max_s = max_retries, backoff_s, backoff_max_s
        self.api_key, self.model, self.send_seed = api_key, model, send_seed
        self.retries = 0  # total retried attempts of the last generate()

    # ---- subclass hooks -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def payload(self, req: Request) -> dict:
        """The JSON body of one generation request."""

    @abc.abstractmethod
    def parse(self, req: Request, data) -> tuple[list[int], str]:
        """(output_ids, finish_reason) from a 200 reply; raise Rejected('malformed', ...) when it is not one."""

    @abc.abstractmethod
    async def probe(self, session: aiohttp.ClientSession, url: str, tokenizer) -> dict:
        """Health + model + tokenizer check of one server; raises EngineError naming it."""

    # ---- shared helpers -------------------------------------------------------------------------------------
    def _session(self, timeout_s: float | None = None) -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, connect=self.connect_timeout_s)
        headers = client.bearer(self.api_key)
        return aiohttp.ClientSession(
            timeout=timeout, headers=headers, connector=aiohttp.TCPConnector(limit=0)
        )

    async def request_json(self, session, method: str, url: str, body: dict | None = None):
        """One HTTP exchange: JSON on 200; Retryable for transient faults; Rejected for the rest."""
        try:
            async with session.request(method, url, json=body) as resp:
                raw = await resp.read()
                if resp.status == 429 or resp.status >= 500:
                    raise Retryable(f"HTTP {resp.status} from {url}: {_excerpt(raw)}", _retry_after(resp))
                if resp.status >= 400:
                    raise Rejected(f"http_{resp.status}", _excerpt(raw))
        except (
            aiohttp.ClientConnectionError,
            aiohttp.ClientPayloadError,
            TimeoutError,
            ConnectionError,
        ) as e:
            raise Retryable(f"{type(e).__name__} on {url}: {e}") from None
        if not raw.strip():
            return None  # e.g. /health answers 200 with an empty body
        try:
            return json.loads(raw)
        except ValueError:
            raise Rejected("malformed", f"reply is not JSON: {_excerpt(raw, 120)!r}") from None

    def check_ids(self, ids, finish: str) -> list[int]:
        """Validate output ids: a non-empty list of ints inside the vocabulary, no longer than asked."""
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise Rejected("malformed", f"output ids are not a non-empty list of ints: {str(ids)[:120]}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise Rejected(
                "malformed", f"output ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        if len(ids) > self.sampling.max_new_tokens:
            raise Rejected(
                "malformed", f"{len(ids)} output ids > max_new_tokens {self.sampling.max_new_tokens}"
            )
        if finish not in ("stop", "length"):
            raise Rejected(f"finish_{finish}", f"finish reason {finish!r} (expected stop or length)")
        return ids

    def backoff(self, attempt: int, retry_after: float) -> float:
        """Exponential backoff with +-50% jitter, at least the server's Retry-After."""
        base = min(self.backoff_max_s, self.backoff_s * 2**attempt)
        return max(retry_after, base * random.uniform(0.5, 1.5))

    # ---- probe ----------------------------------------------------------------------------------------------
    def check(self, tokenizer) -> dict:
        """Probe every server; raise EngineError listing each one that is down or serves another vocabulary."""

        async def probe_all():
            async with self._session(timeout_s=max(30.0, self.connect_timeout_s * 3)) as s:
                return await asyncio.gather(*(self._probe_one(s, u, tokenizer) for u in self.urls))

        infos = _run_sync(probe_all())
        bad = [i["error"] for i in infos if "error" in i]
        if bad:
            raise EngineError(f"engine {self.name}: health probe failed:\n  " + "\n  ".join(bad))
        return {"engine": self.name, "servers": infos}

    async def _probe_one(self, session, url: str, tokenizer) -> dict:
        try:
            return await self.probe(session, url, tokenizer)
        except EngineError as e:
            return {"url": url, "error": str(e)}
        except Retryable as e:
            return {"url": url, "error": f"{url}: server is down or not answering ({e})"}
        except Rejected as e:
            return {"url": url, "error": f"{url}: probe rejected ({e})"}

    def compare_tokens(self, url: str, served: str, server_ids, local_ids: list[int]) -> None:
        """The server must tokenize the probe text exactly as the target tokenizer does."""
        if server_ids != local_ids:
            first = next(
                (i for i, (a, b) in enumerate(zip(server_ids or [], local_ids, strict=False)) if a != b), None
            )
            raise EngineError(
                f"{url}: serves {served!r}, whose vocabulary does not match the target tokenizer: the probe text "
                f"tokenizes to {str(server_ids)[:80]} on the server vs {str(local_ids)[:80]} locally "
                f"(first difference at position {first})"
            )

    # ---- generation -----------------------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> Iterator[Result | Failure]:
        """Yield one Result or Failure per request as they complete (an event loop runs in a worker thread)."""
        out: queue.Queue = queue.Queue()
        stop = threading.Event()
        done = object()

        def target():
            try:
                asyncio.run(self._run_all(list(requests), out.put, stop))
            except BaseException as e:  # re-raised in the consumer's thread
                out.put(e)
            finally:
                out.put(done)

        thread = threading.Thread(target=target, name=f"{self.name}-engine", daemon=True)
        thread.start()
        try:
            while (item := out.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join(timeout=30)

    async def _run_all(self, requests: list[Request], emit, stop: threading.Event) -> None:
        self.retries = 0
        work: asyncio.Queue = asyncio.Queue()
        for r in requests:
            work.put_nowait((r, 0, None))
        state = {"left": len(requests)}
        async with self._session() as session:
            # server-interleaved, starting one server further each call: small batches (a dataset's last turns)
            # are spread over every server instead of always landing on the first ones
            k = self._calls % len(self.urls)
            self._calls += 1
            order = self.urls[k:] + self.urls[:k]
            workers = [
                asyncio.create_task(self._worker(session, url, work, state, emit, stop))
                for _ in range(self.concurrency)
                for url in order
            ]
            await asyncio.gather(*workers)

    async def _worker(self, session, url: str, work: asyncio.Queue, state: dict, emit, stop) -> None:
        while state["left"] > 0 and not stop.is_set():
            try:
                req, attempt, t0 = await asyncio.wait_for(work.get(), timeout=0.2)
            except TimeoutError:
                continue  # other workers may still put retried requests back
            t0 = t0 or time.monotonic()  # latency counts from the first attempt, retries included
            if self.on_start:
                self.on_start(req.id, url)  # 03's ledger: every attempt (readers keep the latest start)
            try:
                data = await self.request_json(session, "POST", url + self.path, self.payload(req))
                ids, finish = self.parse(req, data)
                item = Result(req.id, ids, finish, time.monotonic() - t0, url, attempt)
            except Rejected as e:
                item = Failure(req.id, e.reason, e.detail, url, attempt)
            except Retryable as e:
                if attempt < self.max_retries:
                    self.retries += 1
                    work.put_nowait((req, attempt + 1, t0))
                    await asyncio.sleep(
                        self.backoff(attempt, e.retry_after)
                    )  # this server rests, others go on
                    continue
                item = Failure(
                    req.id, "retries_exhausted", f"{self.max_retries} retries, last: {e}", url, attempt
                )
            state["left"] -= 1
            emit(item)


def _run_sync(coro):
    """Run a coroutine to completion from sync code, also inside Jupyter's running event loop."""
    box: dict = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class SGLangEngine(HttpEngine):
    """SGLang native API: POST /generate {input_ids, sampling_params} -> {text, output_ids, meta_info}."""

    name = "sglang"
    path = "/generate"

    def payload(self, req: Request) -> dict:
        s = self.sampling
        sp = {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stop_token_ids": list(s.stop_token_ids),
            "skip_special_tokens": False,
        }
        if self.send_seed and s.temperature > 0:
            sp["sampling_seed"] = s.seed_for(req.id)
        return {"input_ids": req.prompt_ids, "sampling_params": sp, "stream": False}

    def parse(self, req: Request, data) -> tuple[list[int], str]:
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        try:
            ids, fr = data["output_ids"], data["meta_info"]["finish_reason"]
        except (KeyError, TypeError):
            raise Rejected(
                "malformed", f"no output_ids / meta_info.finish_reason in {_excerpt(json.dumps(data))}"
            ) from None
        if not isinstance(fr, dict) or "type" not in fr:
            raise Rejected("malformed", f"meta_info.finish_reason is not {{type: ...}}: {str(fr)[:120]}")
        if fr["type"] == "abort":
            raise Rejected("finish_abort", str(fr.get("message", fr))[:300])
        matched = fr.get("matched")
        if (
            fr["type"] == "stop"
            and isinstance(matched, int)
            and isinstance(ids, list)
            and ids[-1:] != [matched]
        ):
            ids = ids + [matched]  # a reply that trimmed the matched stop token: the record keeps it
        return self.check_ids(ids, fr["type"]), fr["type"]

    async def probe(self, session, url: str, tokenizer) -> dict:
        await self.request_json(session, "GET", url + "/health")
        info = await self.request_json(session, "GET", url + "/get_model_info")
        served = str((info or {}).get("model_path", "?"))
        text, local = probe_ids(tokenizer)
        try:
            reply = await self.request_json(
                session, "POST", url + "/tokenize", {"prompt": text, "add_special_tokens": False}
            )
            self.compare_tokens(url, served, reply.get("tokens") if isinstance(reply, dict) else None, local)
        except Rejected as e:
            if e.reason != "http_404":
                raise
            await self._probe_by_generation(session, url, served, local)
        return {"url": url, "model": served}

    async def _probe_by_generation(self, session, url: str, served: str, local: list[int]) -> None:
        """Servers without /tokenize: the highest target id must be accepted and replies stay in the vocabulary."""
        body = {
            "input_ids": local + [self.vocab_size - 1],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        }
        try:
            data = await self.request_json(session, "POST", url + self.path, body)
            self.parse(Request("probe", body["input_ids"]), data)
        except Rejected as e:
            raise EngineError(f"{url}: serves {served!r}, which rejects target token ids ({e})") from None


class OpenAIEngine(HttpEngine):
    """OpenAI-compatible completions with token ids (vLLM): prompt = id list, return_token_ids = true."""

    name = "openai"
    path = "/v1/completions"

    def payload(self, req: Request) -> dict:
        s = self.sampling
        body = {
            "model": self.model,
            "prompt": req.prompt_ids,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stop_token_ids": list(s.stop_token_ids),
            "return_token_ids": True,
            "skip_special_tokens": False,
            "n": 1,
            "stream": False,
        }
        if self.send_seed and s.temperature > 0:
            body["seed"] = s.seed_for(req.id)
        return body

    def parse(self, req: Request, data) -> tuple[list[int], str]:
        try:
            choice = data["choices"][0]
            ids, finish = choice["token_ids"], choice["finish_reason"]
        except (KeyError, IndexError, TypeError):
            raise Rejected(
                "malformed", f"no choices[0].token_ids / finish_reason in {_excerpt(json.dumps(data))}"
            ) from None
        stop_reason = choice.get("stop_reason")
        if (
            finish == "stop"
            and isinstance(stop_reason, int)
            and isinstance(ids, list)
            and ids[-1:] != [stop_reason]
        ):
            ids = ids + [stop_reason]  # the record keeps the stop token
        return self.check_ids(ids, finish), finish

    async def probe(self, session, url: str, tokenizer) -> dict:
        try:
            await self.request_json(session, "GET", url + "/health")
        except Rejected as e:  # /health is vLLM's; other OpenAI-compatible servers may lack it
            if e.reason != "http_404":
                raise
        models = await self.request_json(session, "GET", url + "/v1/models")
        names = [m.get("id") for m in (models or {}).get("data", []) if isinstance(m, dict)]
        if not names:
            raise EngineError(f"{url}: /v1/models lists no model")
        if self.model and self.model not in names:
            raise EngineError(f"{url}: serves {names}, not the configured served_model {self.model!r}")
        self.model = self.model or names[0]
        text, local = probe_ids(tokenizer)
        reply = await self.request_json(
            session,
            "POST",
            url + "/tokenize",
            {"model": self.model, "prompt": text, "add_special_tokens": False},
        )
        self.compare_tokens(url, self.model, reply.get("tokens") if isinstance(reply, dict) else None, local)
        max_len = next((m.get("max_model_len") for m in models["data"] if m.get("id") == self.model), None)
        return {"url": url, "model": self.model, "max_model_len": max_len}
