"""The two HTTP APIs of stage 03 on `eagle_lib.engines.http.HttpEngine`: SGLang's native `/generate` (`SGLangEngine`)
and OpenAI-compatible `/v1/completions` with token ids (`OpenAIEngine`, vLLM), each streamed (``stream: true``,
merged back into the shape of the non-streamed reply, which `parse` then reads) or not."""

from __future__ import annotations

import json

from eagle_lib.engines import fingerprint as fpr
from eagle_lib.engines.base import EngineError, Request
from eagle_lib.engines.exchange import excerpt
from eagle_lib.engines.faults import Rejected
from eagle_lib.engines.http import HttpEngine

# SGLang: one streamed event per this many tokens (its per-request `stream_interval`; the first token comes at
# once). Its default stream repeats every id so far in each event: per token that would be O(n^2) bytes, ~1 GB
# for a 16K-token answer; per 64 tokens ~25 MB, and at the seeds' slowest 4.5 tokens/s an event every ~15 s,
# far inside `stall_s`.
STREAM_EVERY = 64
PROBE_TEXT = "Hello, world! The quick brown fox jumps over 13 lazy dogs: déjà vu, 東京, ```code```."


def probe_ids(tokenizer) -> tuple[str, list[int]]:
    """A probe text with the target's special tokens, and its ids under the target tokenizer (`check`'s
    tokenizer probe: the server's ids for the text must be these)."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t][:8]
    text = PROBE_TEXT + "".join(specials)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


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
        if self.stream:
            sp["stream_interval"] = STREAM_EVERY
        return {"input_ids": req.prompt_ids, "sampling_params": sp, "stream": self.stream}

    def merge(self, acc: dict | None, event: dict) -> dict:
        """SGLang streams every id so far in each event (its default), or only the new ones
        (``--incremental-streaming-output``); `meta_info.completion_tokens` (the count so far) tells which."""
        ids = event.get("output_ids")
        if not isinstance(ids, list):
            raise Rejected("malformed", f"stream event without output_ids: {excerpt(json.dumps(event))}")
        prev = acc["output_ids"] if acc else []
        n = (event.get("meta_info") or {}).get("completion_tokens")
        if isinstance(n, int) and n != len(ids) and n == len(prev) + len(ids):
            ids = prev + ids  # the new ids only
        elif not (isinstance(n, int) and n == len(ids)) and ids[: len(prev)] != prev:
            ids = prev + ids  # no count to go by: an event that does not repeat the ids so far adds to them
        return {**event, "output_ids": ids}

    def count(self, acc: dict) -> int:
        return len(acc["output_ids"])

    def parse(self, req: Request, data) -> tuple[list[int], str]:
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        try:
            ids, fr = data["output_ids"], data["meta_info"]["finish_reason"]
        except (KeyError, TypeError):
            raise Rejected(
                "malformed", f"no output_ids / meta_info.finish_reason in {excerpt(json.dumps(data))}"
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
        await self.get_health(session, url)
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
        return {"url": url, "model": served, "fingerprint": await self.fingerprint(session, url, tokenizer)}

    def fingerprint_body(self, ids: list[int]) -> dict:
        return fpr.sglang_body(ids)

    def read_fingerprint(self, ids: list[int], data) -> fpr.Fingerprint:
        return fpr.from_sglang(ids, data)

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
            "stream": self.stream,
        }
        if self.send_seed and s.temperature > 0:
            body["seed"] = s.seed_for(req.id)
        return body

    def merge(self, acc: dict | None, event: dict) -> dict:
        """vLLM streams each choice's new `token_ids` per event and its finish_reason / stop_reason in the last
        one; an event without choices (usage) adds nothing. Without token ids in an event the merged answer has
        none (`parse` rejects it as it rejects such a reply)."""
        prev = acc["choices"][0] if acc else {"token_ids": [], "finish_reason": None}
        if not event.get("choices"):
            return acc or {**event, "choices": [prev]}
        c = event["choices"][0]
        ids = c.get("token_ids")
        ok = isinstance(ids, list) and isinstance(prev["token_ids"], list)
        merged = {**c, "token_ids": prev["token_ids"] + ids if ok else None}
        if c.get("finish_reason") is None and prev.get("finish_reason") is not None:
            merged |= {"finish_reason": prev["finish_reason"], "stop_reason": prev.get("stop_reason")}
        return {**event, "choices": [merged]}

    def count(self, acc: dict) -> int:
        return len(acc["choices"][0]["token_ids"] or [])

    def parse(self, req: Request, data) -> tuple[list[int], str]:
        try:
            choice = data["choices"][0]
            ids, finish = choice["token_ids"], choice["finish_reason"]
        except (KeyError, IndexError, TypeError):
            raise Rejected(
                "malformed", f"no choices[0].token_ids / finish_reason in {excerpt(json.dumps(data))}"
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
            await self.get_health(session, url)
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
        fp = await self.fingerprint(session, url, tokenizer)
        return {"url": url, "model": self.model, "max_model_len": max_len, "fingerprint": fp}

    def fingerprint_body(self, ids: list[int]) -> dict:
        return fpr.openai_body(self.model, ids)

    def read_fingerprint(self, ids: list[int], data) -> fpr.Fingerprint:
        return fpr.from_openai(ids, data)
