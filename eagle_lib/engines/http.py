"""HTTP engines for stage 03: the shared machinery (`HttpEngine`); SGLang native `/generate` and OpenAI-compatible
`/v1/completions` (vLLM) are `eagle_lib.engines.http_apis`.

Token ids go out (`input_ids` / `prompt` as an id list) and come back (`output_ids` / `choices[0].token_ids`
with `return_token_ids`), so no text is ever re-tokenized. Many servers share one work queue, each with
`concurrency` requests in flight, so faster servers take more work.

Health is per server, not per request (`faults.ServerHealth`, whose docstring has the rules): a server that is
refused or times out is taken out of rotation at once, one that resets, answers 5xx, cuts its body short or
rejects requests after `faults.IN_A_ROW` in a row; a 429 only pauses its workers. While out, its workers take
no work and a prober re-checks it (the engine's full probe: health, model, tokenizer, fingerprint) after an
exponential backoff (`backoff_s` doubling up to `backoff_max_s`, with jitter, growing each time it fails again
before answering). Answers are streamed (``stream``, `eagle_lib.engines.exchange`), so a slow answer that keeps
delivering tokens is told from a dead server: a server with no new token on any of its streams for `stall_s` is
out at once, and one attempt's total deadline follows `max_new_tokens` and the run's measured rates
(`eagle_lib.engines.deadline`). A request is charged a retry only for what is its own: its total deadline
passed, or a server fault from a server that already failed it once; at `max_retries` charged retries it is a
Failure "retries_exhausted". A rejection (other 4xx, abort, malformed reply) fails a
request only when a second one confirms it, from another server where one is in rotation. Nothing is lost or
duplicated: a request is in the queue, in flight on one worker, or emitted once. With no server in rotation (or
all of them answering 429) for `all_down_s`, generate() raises EngineError (03 then stops; a restart resumes);
so it does as soon as the failures are clearly past `max_error_fraction` (`faults.ErrorBudget`).

`check()` probes every server before any work: a server that is down or not answering starts out of rotation
(reported, and probed again during the run; it says nothing about the target); one that serves another
vocabulary or another model (`eagle_lib.engines.fingerprint`: the probe's log-probs, checked on every live
server, mid-run too), or no server at all answering -> EngineError naming each.
"""

from __future__ import annotations

import abc
import asyncio
import queue
import random
import threading
import time
from collections.abc import Iterator

import aiohttp

from eagle_lib.engines import client, exchange
from eagle_lib.engines import fingerprint as fpr
from eagle_lib.engines.base import EngineError, Failure, Request, Result, Sampling
from eagle_lib.engines.deadline import Deadlines
from eagle_lib.engines.faults import ErrorBudget, Rejected, Retryable, ServerHealth, WorkItem, WorkQueue

PROGRESS_S = 5.0  # in-flight streams' token counts go to 03's ledger this often (`on_progress`)


class HttpEngine(abc.ABC):
    """Shared machinery; subclasses define the endpoint, payload, reply parsing and the probe."""

    name = "http"
    path = ""
    on_start = None  # callable(id, server url) or None: called at each attempt (03's ledger)
    # callable([(id, tokens so far)]) or None: streams in flight, every PROGRESS_S (ledger)
    on_progress = None

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
        all_down_s: float = 1800.0,
        max_error_fraction: float | None = None,
        stream: bool = True,
        stall_s: float = 300.0,
        min_tokens_per_s: float = 1.0,
    ):
        if not urls:
            raise EngineError(f"engine {self.name}: no server URLs given (server_urls is empty)")
        self.urls = [u.rstrip("/") for u in urls]
        self._calls = 0  # generate() calls so far (rotates which server a call starts with)
        self.sampling, self.vocab_size, self.concurrency = sampling, vocab_size, concurrency
        self.timeout_s, self.connect_timeout_s, self.stream = timeout_s, connect_timeout_s, stream
        # stall and total deadlines of one attempt; timeout_s is the total's floor
        self.deadlines = Deadlines(sampling.max_new_tokens, stall_s, timeout_s, min_tokens_per_s)
        self._inflight: dict[str, int] = {}  # streamed requests in flight: tokens so far
        self.max_retries, self.backoff_s, self.backoff_max_s = max_retries, backoff_s, backoff_max_s
        self.api_key, self.model, self.send_seed = api_key, model, send_seed
        self.retries = 0  # total charged retries of the last generate()
        self.all_down_s = all_down_s
        self.health = {u: ServerHealth(u) for u in self.urls}  # kept across generate() calls (datasets)
        self._tokenizer = None  # check()'s: the prober re-runs the full probe before a server gets work again
        self.fingerprints: dict[str, fpr.Fingerprint] = {}  # check()'s, per live server
        self.reference: fpr.Fingerprint | None = None  # what every server must match (`fingerprint.settle`)
        # every outcome of this engine's runs (all datasets): stop early once failures are clearly too many
        self.budget = None if max_error_fraction is None else ErrorBudget(max_error_fraction)

    # ---- subclass hooks -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def payload(self, req: Request) -> dict:
        """The JSON body of one generation request."""

    @abc.abstractmethod
    def parse(self, req: Request, data) -> tuple[list[int], str]:
        """(output_ids, finish_reason) from a 200 reply; raise Rejected('malformed', ...) when it is not one."""

    @abc.abstractmethod
    def merge(self, acc: dict | None, event: dict) -> dict:
        """The streamed answer so far with one more event, in the shape of the non-streamed reply (`parse` reads
        the last one exactly as it reads that reply)."""

    @abc.abstractmethod
    def count(self, acc: dict) -> int:
        """Output tokens in a merged answer so far."""

    @abc.abstractmethod
    async def probe(self, session: aiohttp.ClientSession, url: str, tokenizer) -> dict:
        """Health + model + tokenizer + fingerprint check of one server ({url, model, ..., fingerprint});
        raises EngineError naming it."""

    @abc.abstractmethod
    def fingerprint_body(self, ids: list[int]) -> dict:
        """The request that scores the fingerprint probe `ids` (teacher-forced log-probs + greedy ids)."""

    @abc.abstractmethod
    def read_fingerprint(self, ids: list[int], data) -> fpr.Fingerprint:
        """The Fingerprint in a reply to `fingerprint_body` (raises fingerprint.FingerprintError)."""

    # ---- shared helpers -------------------------------------------------------------------------------------
    def _session(self, timeout_s: float | None = None) -> aiohttp.ClientSession:
        """A session whose requests time out after `timeout_s` (None: generation, watched by `supervise`)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self.connect_timeout_s)
        headers = client.bearer(self.api_key)
        return aiohttp.ClientSession(
            timeout=timeout, headers=headers, connector=aiohttp.TCPConnector(limit=0)
        )

    async def get_health(self, session, url: str) -> None:
        """GET /health: any 2xx body is healthy (SGLang answers empty, sglang-router "OK", vLLM empty)."""
        await self.request_json(session, "GET", url + "/health", json_reply=False)

    async def request_json(
        self, session, method: str, url: str, body: dict | None = None, json_reply: bool = True
    ):
        """One HTTP exchange (`exchange.request_json`): JSON on 200 (`json_reply`; else None); Retryable for
        transient faults; Rejected for the rest."""
        return await exchange.request_json(session, method, url, body, json_reply)

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

    # ---- probe ----------------------------------------------------------------------------------------------
    async def fingerprint(self, session, url: str, tokenizer) -> fpr.Fingerprint:
        """The server's answer to the fingerprint probe; EngineError when it is not the reference's model."""
        ids = fpr.probe_ids(tokenizer)
        data = await self.request_json(session, "POST", url + self.path, self.fingerprint_body(ids))
        try:
            fp = self.read_fingerprint(ids, data)
        except fpr.FingerprintError as e:
            raise EngineError(f"{url}: its answer to the fingerprint probe is unusable: {e}") from None
        if self.reference is not None and (why := fpr.difference(self.reference, fp)):
            raise EngineError(f"{url}: serves another model than this run's target: {why}")
        return fp

    def check(self, tokenizer) -> dict:
        """Probe every server. Down or not answering: out of rotation from the start (reported; probed again
        during the run; it says nothing about the target). EngineError when a server serves another vocabulary
        or another model than the other live servers (or the reference) or rejects the probe, or when none is
        up (each URL's error)."""
        self._tokenizer = tokenizer

        async def probe_all():
            async with self._session(timeout_s=self._probe_timeout()) as s:
                return await asyncio.gather(*(self._probe_one(s, u, tokenizer) for u in self.urls))

        infos = exchange.run_sync(probe_all())
        wrong = [i["error"] for i in infos if "error" in i and not i.get("down")]
        down = [i for i in infos if i.get("down")]
        if wrong or len(down) == len(infos):
            raise EngineError(
                f"engine {self.name}: health probe failed:\n  "
                + "\n  ".join(i["error"] for i in infos if "error" in i)
            )
        self.fingerprints = {i["url"]: i["fingerprint"] for i in infos if "fingerprint" in i}
        if self.reference is None:
            self.reference = fpr.consensus(self.fingerprints)
        for i in infos:
            if "fingerprint" in i:
                i["fingerprint"] = i["fingerprint"].kind  # the record: how it was checked
        now = time.monotonic()
        for i in down:
            self.health[i["url"]].fault(now, i["kind"], i["error"], self._delay(0), at_once=True)
        return {"engine": self.name, "servers": infos, "down_at_start": [i["url"] for i in down]}

    def _probe_timeout(self) -> float:
        return max(30.0, self.connect_timeout_s * 3)

    def _delay(self, level: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2**level) * random.uniform(0.5, 1.5)

    async def _probe_one(self, session, url: str, tokenizer) -> dict:
        try:
            return await self.probe(session, url, tokenizer)
        except EngineError as e:
            return {"url": url, "error": str(e)}
        except Retryable as e:
            return {
                "url": url,
                "error": f"{url}: server is down or not answering ({e})",
                "down": True,
                "kind": e.kind,
            }
        except Rejected as e:
            return {"url": url, "error": f"{url}: probe rejected ({e})"}

    def server_stats(self) -> list[dict]:
        """Per server: answered, tokens, tokens/s per request, failures by kind, time out of rotation."""
        now = time.monotonic()
        return [h.record(now) for h in self.health.values()]

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
        work = WorkQueue()
        for r in requests:
            work.put(WorkItem(r))
        state = {"left": len(requests), "all_down_since": None}
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
            probers = [asyncio.create_task(self._prober(url, state, stop)) for url in order]
            tasks = workers + probers + [asyncio.create_task(self._report(state, stop))]
            try:  # until all are emitted, or the first error (all down for all_down_s, too many failures)
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    t.result()
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _report(self, state: dict, stop: threading.Event) -> None:
        """Every PROGRESS_S: the token counts of the streams in flight to `on_progress` (03's ledger)."""
        last = time.monotonic()
        while state["left"] > 0 and not stop.is_set():
            await asyncio.sleep(0.1)  # not PROGRESS_S at once: generate() ends when the last answer is in
            if time.monotonic() - last < PROGRESS_S:
                continue
            last = time.monotonic()
            if self.on_progress and (counts := [(i, n) for i, n in self._inflight.items() if n]):
                self.on_progress(counts)

    async def _prober(self, url: str, state: dict, stop: threading.Event) -> None:
        """While `url` is out of rotation: the full probe at its backoff time; back in rotation when it passes.
        Also the all-servers-down deadline."""
        h = self.health[url]
        async with self._session(timeout_s=self._probe_timeout()) as session:
            while state["left"] > 0 and not stop.is_set():
                now = time.monotonic()
                if all(not x.healthy or x.throttles for x in self.health.values()):  # out, or answering 429
                    state["all_down_since"] = state["all_down_since"] or now
                    if now - state["all_down_since"] > self.all_down_s:
                        errs = "; ".join(f"{x.url}: {x.last_error}" for x in self.health.values())
                        raise EngineError(f"engine {self.name}: no server in rotation (or all answering 429) "
                                          f"for {self.all_down_s:.0f} s ({errs})")  # fmt: skip
                else:
                    state["all_down_since"] = None
                if h.healthy or now < h.next_probe:
                    await asyncio.sleep(0.1)
                    continue
                try:
                    if self._tokenizer is not None:
                        await self.probe(session, url, self._tokenizer)
                    else:
                        await self.get_health(session, url)
                    h.back(time.monotonic())
                except (Retryable, Rejected, EngineError) as e:
                    h.level += 1
                    h.last_error = str(e)[:300]
                    h.next_probe = time.monotonic() + self._delay(h.level)

    async def _worker(self, session, url: str, work: WorkQueue, state: dict, emit, stop) -> None:
        h = self.health[url]
        while state["left"] > 0 and not stop.is_set():
            if not h.available(time.monotonic()):  # out of rotation (the prober decides), or after a 429
                await asyncio.sleep(0.1)
                continue
            it = await work.take(lambda x: not self._elsewhere(x, url), timeout_s=0.2)
            if it is None:
                continue  # other workers may still put retried requests back
            if not h.available(time.monotonic()):  # taken out while this worker waited: back, uncharged
                work.put(it, first=True)
                continue
            it.t0 = it.t0 or time.monotonic()  # latency counts from the first attempt, retries included
            if self.on_start:
                self.on_start(it.req.id, url)  # 03's ledger: every attempt (readers keep the latest start)
            item = await self._attempt(session, url, it, work)
            if item is None:
                continue  # back in the queue
            state["left"] -= 1
            emit(item)
            if self.budget is not None:
                self.budget.add(item.reason if isinstance(item, Failure) else None)
                if isinstance(item, Failure) and self.budget.exceeded():
                    raise EngineError(f"engine {self.name}: {self.budget.summary()}: stopped early (the answers "
                                      "are kept, a restart resumes; see errors.jsonl and meta servers)")  # fmt: skip

    def _elsewhere(self, it: WorkItem, url: str) -> bool:
        """`url` rejected it once, and another server in rotation has not: that one gives the second opinion."""
        now = time.monotonic()
        return url in it.rejected_on and any(
            u not in it.rejected_on and self.health[u].available(now) for u in self.urls
        )

    async def _attempt(self, session, url: str, it: WorkItem, work: WorkQueue) -> Result | Failure | None:
        """One try of a request on `url`: its Result or Failure, or None when it went back to the queue."""
        h, sent = self.health[url], time.monotonic()
        try:
            ids, finish = self.parse(it.req, await self._exchange(session, url, it.req, sent))
        except Rejected as e:
            h.fault(time.monotonic(), e.reason, str(e), self._delay(h.level), at_once=False)
            if it.rejected_on:  # the second rejection confirms the first: the request's own
                return Failure(it.req.id, e.reason, e.detail, url, it.attempt)
            it.rejected_on = it.rejected_on | {url}
            work.put(it, first=True)  # its second opinion now, not after the whole queue
            return None
        except Retryable as e:
            return self._retry(url, it, e, work)
        now = time.monotonic()
        h.answer(len(ids), now - sent)
        self.deadlines.observe(len(ids), now - sent)
        return Result(it.req.id, ids, finish, now - it.t0, url, it.attempt)

    async def _exchange(self, session, url: str, req: Request, sent: float):
        """One request's reply (streamed and merged, or one JSON document), under its deadlines."""
        h, body = self.health[url], self.payload(req)
        if not self.stream:
            return await exchange.supervise(self.request_json(session, "POST", url + self.path, body), h,
                                            self.deadlines, sent, streamed=False)  # fmt: skip

        def tokens(n: int) -> None:
            h.last_token = time.monotonic()
            self._inflight[req.id] = n

        h.stream_started(sent)
        self._inflight[req.id] = 0
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s)
        try:
            return await exchange.supervise(
                exchange.request_stream(session, url + self.path, body, self.merge, self.count, tokens, timeout),
                h, self.deadlines, sent, streamed=True,
            )  # fmt: skip
        finally:
            h.stream_ended()
            self._inflight.pop(req.id, None)

    def _retry(self, url: str, it: WorkItem, e: Retryable, work: WorkQueue) -> Failure | None:
        """A transient fault (rules: `eagle_lib.engines.faults`): back to the queue, charged when it is the
        request's own; a Failure at max_retries charged retries."""
        h, now = self.health[url], time.monotonic()
        if e.kind == "http_429":  # back-pressure: nobody's fault
            h.throttle(now, str(e), max(e.retry_after, self._delay(h.throttles)))
            work.put(it)
            return None
        at_once = e.kind in ("refused", "timeout", "stall")
        h.fault(now, e.kind, str(e), max(e.retry_after, self._delay(h.level)), at_once)
        charged = e.kind in ("timeout", "deadline") or (e.kind != "refused" and url in it.failed_on)
        it.failed_on = it.failed_on | {url}
        if charged and it.attempt >= self.max_retries:
            return Failure(
                it.req.id, "retries_exhausted", f"{self.max_retries} retries, last: {e}", url, it.attempt
            )
        it.attempt += charged
        self.retries += charged
        work.put(it)
        return None
