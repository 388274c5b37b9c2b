"""A local stand-in for an SGLang server (and a minimal OpenAI `/v1/completions`), with fault injection.

SGLang itself cannot run on these CPU machines, so the SGLang engine is tested against this server, which
implements the documented native contract (docs.sglang.io "SGLang Native APIs" / "Sampling Parameters",
io_struct.GenerateReqInput):
  POST /generate {"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature", "top_p",
                  "stop_token_ids", ...}} -> {"text", "output_ids", "meta_info": {"id", "finish_reason":
                  {"type": "stop", "matched": id} | {"type": "length", "length": n}, "prompt_tokens",
                  "completion_tokens", "e2e_latency"}}   (output_ids keep the matched stop token, as SGLang's do)
  GET /health, GET /get_model_info {"model_path", ...}, POST /tokenize {"prompt"} -> {"tokens", "count"}
Tokens come from a real model (greedy/sampled through eagle_lib.engines.embedded.EmbeddedEngine, one request at a time).

Faults are planned per prompt (key = `prompt_key(input_ids)`): a list of actions consumed one per request,
then "ok"; optionally a random rate of transient faults. Actions: ok, 500, 502, 503, 429, 400, 404,
malformed (200, not JSON), bad_schema (200, no output_ids), out_of_vocab, abort, reset (connection closed),
timeout (answer after `timeout_sleep_s`); streamed only: hang (nothing after the first event for
`timeout_sleep_s`), cut (the connection closed after the first event).

Streaming (``stream: true``) as the real servers do it: Server-Sent Events ``data: {json}``, then ``data: [DONE]``.
/generate sends the first token at once, then an event per `stream_interval` tokens (sampling param, default 1)
holding every id so far (SGLang's default; `Faults.incremental`: only the new ones, as
``--incremental-streaming-output``), `meta_info.completion_tokens` the count so far and `finish_reason` null
until the last event, which is the non-streamed reply; /v1/completions sends one event per token with that
token's `token_ids` and the finish_reason / stop_reason in the last (vLLM's shape). `Faults.token_delay_s`:
seconds per token streamed (a slow but steady server).

Run standalone:  python -m tests.support.sglang_standin --model DIR --port P [--faults JSON] [--tokenizer DIR]
                 [--api-key-env VAR] [--trust-remote-code]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

TRANSIENT = ["500", "503", "429", "reset"]
STATE: web.AppKey = web.AppKey("state", object)


def prompt_key(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


@dataclass
class Faults:
    plans: dict[str, list[str]] = field(default_factory=dict)
    random_rate: float = 0.0
    random_actions: list[str] = field(default_factory=lambda: list(TRANSIENT))
    seed: int = 0
    timeout_sleep_s: float = 5.0
    delay_s: float = 0.0  # added to every request (slow server)
    trim_stop: bool = False  # reply without the matched stop token (the engine must restore it)
    token_delay_s: float = 0.0  # streamed: seconds per token
    incremental: bool = False  # streamed /generate: each event holds only its new ids

    @classmethod
    def from_json(cls, text: str) -> Faults:
        return cls(**json.loads(text)) if text else cls()


class StandIn:
    """The server state: model, tokenizer, fault plans, request log."""

    def __init__(
        self,
        model_dir: str,
        tokenizer_dir: str | None = None,
        faults: Faults | None = None,
        api_key: str | None = None,
        trust_remote_code: bool = False,
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.model_dir, self.api_key = model_dir, api_key  # api_key: 401 without it, as SGLang's --api-key
        kw = {"trust_remote_code": trust_remote_code}
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir, **kw)
        text = self.model.config.get_text_config()  # a multimodal wrapper's (Kimi-K2.5) language model config
        self.vocab_size, self.max_len = text.vocab_size, text.max_position_embeddings
        self.faults = faults or Faults()
        self.rng = random.Random(self.faults.seed)
        self.counts: dict[str, int] = {}
        self.log: list[tuple[str, str]] = []  # (prompt key, action)
        self.lock = threading.Lock()

    def action_for(self, ids: list[int]) -> str:
        key = prompt_key(ids)
        with self.lock:
            n = self.counts.get(key, 0)
            self.counts[key] = n + 1
            plan = self.faults.plans.get(key, [])
            act = plan[n] if n < len(plan) else "ok"
            if act == "ok" and self.faults.random_rate and self.rng.random() < self.faults.random_rate:
                act = self.rng.choice(self.faults.random_actions)
            self.log.append((key, act))
        return act

    def run_model(self, ids: list[int], sp: dict, seed: int) -> tuple[list[int], str]:
        from eagle_lib.engines.base import Request, Sampling
        from eagle_lib.engines.embedded import EmbeddedEngine

        s = Sampling(
            float(sp.get("temperature", 1.0)),
            float(sp.get("top_p", 1.0)),
            int(sp.get("max_new_tokens", 128)),
            seed,
            tuple(sp.get("stop_token_ids") or ()),
        )
        (res,) = list(EmbeddedEngine(self.model, s, batch_size=1).generate([Request("x", ids)]))
        if not hasattr(res, "output_ids"):
            raise web.HTTPBadRequest(text=json.dumps({"error": res.detail}))
        return res.output_ids, res.finish_reason


async def _fault_reply(app, request: web.Request, act: str) -> web.Response | None:
    st: StandIn = app[STATE]
    if act in ("500", "502", "503"):
        return web.Response(status=int(act), text="Internal Server Error")
    if act == "429":
        return web.Response(status=429, text="Too Many Requests", headers={"Retry-After": "0"})
    if act in ("400", "404"):
        return web.json_response({"error": {"message": f"stand-in {act}"}}, status=int(act))
    if act == "malformed":
        return web.Response(status=200, text="{not json", content_type="application/json")
    if act == "reset":
        request.transport.abort()  # the client sees the connection drop mid-request
        return web.Response(status=500)
    if act == "timeout":
        await asyncio.sleep(st.faults.timeout_sleep_s)
    return None


async def _idle(request: web.Request, seconds: float) -> None:
    """Sleep `seconds`, or until the client hangs up."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and request.transport is not None and not request.transport.is_closing():
        await asyncio.sleep(0.05)


async def _stream(request: web.Request, events: list[tuple[int, dict]], act: str) -> web.StreamResponse:
    """Send (tokens, event) pairs as SSE, each after `token_delay_s` x its tokens, then [DONE]."""
    st: StandIn = request.app[STATE]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        for k, (n, event) in enumerate(events):
            await asyncio.sleep(st.faults.token_delay_s * n)
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if k == 0 and act == "cut":
                request.transport.abort()
                return resp
            if k == 0 and act == "hang":
                await _idle(request, st.faults.timeout_sleep_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionError, RuntimeError):  # the client hung up (a stall or deadline on its side)
        pass
    return resp


def _sglang_events(st: StandIn, final: dict, every: int) -> list[tuple[int, dict]]:
    """The events of a streamed /generate: the first token, then every `every` tokens, then `final`."""
    out = final.get("output_ids", [])
    cuts = sorted({1, *range(every, len(out), every)} - {len(out)}) if len(out) > 1 else []
    events, sent = [], 0
    for c in cuts:
        ids = out[sent:c] if st.faults.incremental else out[:c]
        meta = final["meta_info"] | {"finish_reason": None, "completion_tokens": c}
        events.append((c - sent, {"text": st.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta}))
        sent = c
    if st.faults.incremental and "output_ids" in final:
        final = final | {"output_ids": out[sent:]}
    return [*events, (len(out) - sent, final)]


async def generate(request: web.Request) -> web.Response:
    app = request.app
    st: StandIn = app[STATE]
    body = await request.json()
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        return web.json_response({"error": {"message": "input_ids must be a list of ints"}}, status=400)
    if max(ids) >= st.vocab_size:
        return web.json_response({"error": {"message": "token id out of vocabulary"}}, status=400)
    act = st.action_for(ids)
    if st.faults.delay_s:
        await asyncio.sleep(st.faults.delay_s)
    reply = await _fault_reply(app, request, act)
    if reply is not None:
        return reply
    sp = body.get("sampling_params", {})
    t0 = time.monotonic()
    out, finish = await asyncio.get_running_loop().run_in_executor(
        None, st.run_model, ids, sp, int(sp.get("sampling_seed", 0))
    )
    fr = {"type": "stop", "matched": out[-1]} if finish == "stop" else {"type": "length", "length": len(out)}
    if act == "abort":
        fr = {"type": "abort", "message": "stand-in abort"}
    if act == "out_of_vocab":
        out = out[:-1] + [st.vocab_size + 7]
    if st.faults.trim_stop and finish == "stop":
        out = out[:-1]
    meta = {
        "id": f"req-{len(st.log)}",
        "finish_reason": fr,
        "prompt_tokens": len(ids),
        "completion_tokens": len(out),
        "cached_tokens": 0,
        "e2e_latency": time.monotonic() - t0,
    }
    text = st.tokenizer.decode(out, skip_special_tokens=bool(sp.get("skip_special_tokens", True)))
    reply = {"text": text, "meta_info": meta} | ({} if act == "bad_schema" else {"output_ids": out})
    if body.get("stream"):
        return await _stream(request, _sglang_events(st, reply, int(sp.get("stream_interval") or 1)), act)
    return web.json_response(reply)


async def completions(request: web.Request) -> web.Response:
    """Minimal OpenAI /v1/completions with token-id prompts and return_token_ids (vLLM's extension)."""
    st: StandIn = request.app[STATE]
    body = await request.json()
    ids = body["prompt"]
    act = st.action_for(ids)
    reply = await _fault_reply(request.app, request, act)
    if reply is not None:
        return reply
    sp = {
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_new_tokens": body.get("max_tokens", 16),
        "stop_token_ids": body.get("stop_token_ids"),
    }
    out, finish = await asyncio.get_running_loop().run_in_executor(
        None, st.run_model, ids, sp, body.get("seed") or 0
    )
    choice = {
        "index": 0,
        "text": st.tokenizer.decode(out),
        "finish_reason": finish,
        "stop_reason": out[-1] if finish == "stop" else None,
        "prompt_token_ids": ids,
    }
    if act != "bad_schema":
        choice["token_ids"] = out
    if body.get("stream"):  # one token per event, the finish in the last
        events = [(1, {"id": "cmpl-standin", "object": "text_completion", "model": body.get("model"), "choices": [
            {"index": 0, "text": st.tokenizer.decode([t]), "finish_reason": None, "stop_reason": None}
            | ({} if act == "bad_schema" else {"token_ids": [t]})]}) for t in out]  # fmt: skip
        last = events[-1][1]["choices"][0]
        last |= {"finish_reason": finish, "stop_reason": choice["stop_reason"]}
        return await _stream(request, events, act)
    return web.json_response(
        {"id": "cmpl-standin", "object": "text_completion", "model": body.get("model"), "choices": [choice]}
    )


async def tokenize(request: web.Request) -> web.Response:
    st: StandIn = request.app[STATE]
    body = await request.json()
    ids = st.tokenizer(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))[
        "input_ids"
    ]
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": st.max_len})


@web.middleware
async def require_key(request: web.Request, handler):
    """With an API key set, every endpoint but /health answers 401 unless the request carries it."""
    key = request.app[STATE].api_key
    if key and request.path != "/health" and request.headers.get("Authorization") != f"Bearer {key}":
        return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
    return await handler(request)


def make_app(state: StandIn) -> web.Application:
    app = web.Application(middlewares=[require_key])
    app[STATE] = state
    name = state.model_dir.rstrip("/").split("/")[-1]
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)

    async def health(_):
        return web.Response(text="")

    async def model_info(_):
        return web.json_response(
            {"model_path": state.model_dir, "tokenizer_path": state.model_dir, "is_generation": True}
        )

    async def list_models(_):
        n_ctx = state.max_len
        return web.json_response(
            {"object": "list", "data": [{"id": name, "object": "model", "max_model_len": n_ctx}]}
        )

    app.router.add_get("/health", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/v1/models", list_models)
    return app


class ServerThread:
    """Run a stand-in in a background thread on 127.0.0.1 (unit tests): `with ServerThread(state) as url:`."""

    def __init__(self, state: StandIn, port: int = 0):
        self.state, self.port = state, port
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _serve(self):
        runner = web.AppRunner(make_app(self.state))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        await site.start()
        self.port = runner.addresses[0][1]
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> str:
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("stand-in server did not start")
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--faults", default="")
    ap.add_argument("--api-key-env", default="", help="environment variable holding the key (401 without it)")
    ap.add_argument("--trust-remote-code", action="store_true")
    a = ap.parse_args()
    key = os.environ[a.api_key_env] if a.api_key_env else None
    web.run_app(
        make_app(StandIn(a.model, a.tokenizer, Faults.from_json(a.faults), key, a.trust_remote_code)),
        host="127.0.0.1",
        port=a.port,
        print=None,
    )


if __name__ == "__main__":
    main()
