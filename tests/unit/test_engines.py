"""Engines: embedded greedy == model.generate; sampling; HTTP engines against a local SGLang stand-in with faults."""

from __future__ import annotations

import json
import socket
from collections import Counter

import numpy as np
import pytest
import torch
from aiohttp import web

from eagle_lib.engines.base import EngineError, Failure, Request, Result, Sampling
from eagle_lib.engines.embedded import EmbeddedEngine, _pick_tokens
from eagle_lib.engines.faults import IN_A_ROW, ErrorBudget, cut_short
from eagle_lib.engines.http_apis import OpenAIEngine, SGLangEngine
from tests.support import models as tiny_models
from tests.support.sglang_standin import STATE, Faults, ServerThread, StandIn, prompt_key
from tests.support.tiny import SPECIALS, build_tokenizer, build_world, make_prompts

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = build_world(tmp_path_factory.mktemp("tiny") / "w")
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, tok, model


@pytest.fixture(scope="module")
def prompts(world):
    _, tok, _ = world
    return make_prompts(tok, 20, seed=1, max_words=30)


def frequent_token(model, prompts) -> int:
    """A token the random model emits early for several prompts: used as a stop id so some rows stop."""
    first = []
    for p in prompts[:6]:
        ids = torch.tensor([p["prompt_ids"]])
        g = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3, pad_token_id=0
        )
        first += g[0, len(p["prompt_ids"]) :].tolist()
    return max(set(first), key=first.count)


def hf_greedy(model, ids: list[int], max_new: int, stop: list[int]) -> list[int]:
    """The reference: transformers' own generate, one unpadded prompt at a time."""
    x = torch.tensor([ids])  # an explicit mask: without one, generate treats every pad-id token as padding
    g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                       eos_token_id=stop, pad_token_id=0)  # fmt: skip
    out = g[0, len(ids) :].tolist()
    return out[: out.index(stop[0]) + 1] if stop[0] in out else out  # generate pads finished rows; none here


def reqs(prompts) -> list[Request]:
    return [Request(p["id"], p["prompt_ids"]) for p in prompts]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_embedded_greedy_equals_generate(world, prompts, batch_size):
    _, _, model = world
    stop = [frequent_token(model, prompts)]
    eng = EmbeddedEngine(
        model, Sampling(max_new_tokens=24, stop_token_ids=tuple(stop)), batch_size=batch_size
    )
    got = {r.id: r for r in eng.generate(reqs(prompts))}
    assert sorted(got) == sorted(p["id"] for p in prompts)
    reasons = set()
    for p in prompts:
        ref = hf_greedy(model, p["prompt_ids"], 24, stop)
        r = got[p["id"]]
        assert r.output_ids == ref, p["id"]
        assert r.finish_reason == ("stop" if ref[-1] == stop[0] else "length")
        reasons.add(r.finish_reason)
    assert reasons == {"stop", "length"}  # both paths exercised, incl. rows dropped mid-batch


def test_embedded_equals_generate_on_a_left_padded_batch(world, prompts):
    """HF's own batched generate (left padding, attention mask) gives the same ids as the engine."""
    _, tok, model = world
    batch = prompts[:6]
    width = max(len(p["prompt_ids"]) for p in batch)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p["prompt_ids"])) + p["prompt_ids"] for p in batch])
    mask = (
        torch.arange(width)[None, :] >= torch.tensor([width - len(p["prompt_ids"]) for p in batch])[:, None]
    ).long()
    g = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0
    )
    eng = EmbeddedEngine(model, Sampling(max_new_tokens=16), batch_size=4)
    got = {r.id: r.output_ids for r in eng.generate(reqs(batch))}
    for i, p in enumerate(batch):
        assert got[p["id"]] == g[i, width:].tolist()


def test_continuous_batching_respects_the_limits(world, prompts):
    """Rows join as others finish (more prefills than static batches), never beyond batch_size / token budget."""
    _, _, model = world
    stop = (frequent_token(model, prompts),)
    eng = EmbeddedEngine(
        model, Sampling(max_new_tokens=10, stop_token_ids=stop), batch_size=4, max_batch_tokens=600
    )
    calls = []  # (rows, new tokens, attended width) of every forward call

    def record(_module, _args, kw):
        calls.append((kw["input_ids"].shape[0], kw["input_ids"].shape[1], kw["attention_mask"].shape[1]))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        got = list(eng.generate(reqs(prompts)))
    finally:
        hook.remove()
    assert sorted(r.id for r in got) == sorted(p["id"] for p in prompts)
    assert max(rows for rows, _, _ in calls) <= 4
    assert all(rows * width <= 600 or rows == 1 for rows, _, width in calls)
    n_prefills = sum(t > 1 for _, t, _ in calls)
    assert n_prefills > -(-len(prompts) // 4)  # more prefills than static batches: rows were refilled


def test_context_window_limits(world, prompts):
    _, _, model = world
    p = prompts[0]["prompt_ids"]
    eng = EmbeddedEngine(model, Sampling(max_new_tokens=50), max_model_len=len(p) + 5)
    long = Request("long", p + p)
    out = {r.id: r for r in eng.generate([Request("a", p), long, Request("empty", [])])}
    assert (
        isinstance(out["a"], Result) and len(out["a"].output_ids) == 5 and out["a"].finish_reason == "length"
    )
    assert isinstance(out["long"], Failure) and out["long"].reason == "prompt_too_long"
    assert out["empty"].reason == "empty_prompt"


def test_sampling_is_per_sample_reproducible(world, prompts):
    _, _, model = world
    s = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=12, seed=3)
    a = {r.id: r.output_ids for r in EmbeddedEngine(model, s, batch_size=1).generate(reqs(prompts[:6]))}
    b = {r.id: r.output_ids for r in EmbeddedEngine(model, s, batch_size=6).generate(reqs(prompts[:6]))}
    c = {
        r.id: r.output_ids
        for r in EmbeddedEngine(model, Sampling(0.9, 0.95, 12, seed=4)).generate(reqs(prompts[:6]))
    }
    greedy = {
        r.id: r.output_ids
        for r in EmbeddedEngine(model, Sampling(max_new_tokens=12)).generate(reqs(prompts[:6]))
    }
    assert a == b  # seed per sample id: batching does not change the draw
    assert a != c and a != greedy


def test_top_p_sampling_matches_the_nucleus_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0])
    t, top_p, n = 0.7, 0.8, 6000
    p = np.exp(logits.numpy() / t)
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]  # smallest prefix with mass >= top_p
    ref = np.zeros_like(p)
    ref[keep] = p[keep] / p[keep].sum()
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    got = _pick_tokens(logits.repeat(n, 1), Sampling(temperature=t, top_p=top_p), gens).numpy()
    freq = np.bincount(got, minlength=5) / n
    assert np.abs(freq - ref).max() < 0.03
    assert freq[ref == 0].sum() == 0


def test_check_rejects_a_model_smaller_than_the_tokenizer(world, tmp_path):
    _, tok, model = world
    assert EmbeddedEngine(model, Sampling()).check(tok)["model_vocab"] >= len(tok)
    small = tiny_models.llama(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=1)  # fmt: skip
    with pytest.raises(EngineError, match="vocabulary"):
        EmbeddedEngine(small, Sampling()).check(tok)


# ---------------------------------------------------------------- HTTP engines against the SGLang stand-in


@pytest.fixture(scope="module")
def standin(world):
    d, _, _ = world
    return StandIn(str(d))


def embedded_ref(model, prompts, s: Sampling) -> dict[str, Result]:
    return {r.id: r for r in EmbeddedEngine(model, s, batch_size=1).generate(reqs(prompts))}


def http(cls, url, s, **kw):
    kw = {
        "vocab_size": 264,
        "concurrency": 3,
        "timeout_s": 2.0,
        "backoff_s": 0.01,
        "backoff_max_s": 0.05,
    } | kw
    return cls([url] if isinstance(url, str) else url, s, **kw)


@pytest.mark.parametrize("cls", [SGLangEngine, OpenAIEngine])
def test_http_engine_ids_equal_embedded(world, prompts, standin, cls):
    _, tok, model = world
    s = Sampling(max_new_tokens=16, stop_token_ids=(frequent_token(model, prompts),))
    ref = embedded_ref(model, prompts[:8], s)
    standin.faults = Faults()
    with ServerThread(standin) as url:
        eng = http(cls, url, s)
        info = eng.check(tok)
        got = list(eng.generate(reqs(prompts[:8])))
    assert info["servers"][0]["url"] == url
    assert sorted(r.id for r in got) == sorted(ref)
    for r in got:
        assert (r.output_ids, r.finish_reason) == (ref[r.id].output_ids, ref[r.id].finish_reason)


def test_sglang_payload_follows_the_native_contract():
    s = Sampling(temperature=0.5, top_p=0.9, max_new_tokens=7, seed=1, stop_token_ids=(3,))
    body = SGLangEngine(["http://x"], s, vocab_size=10).payload(Request("a", [1, 2]))
    assert body["input_ids"] == [1, 2]
    sp = body["sampling_params"]
    assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"], sp["stop_token_ids"]) == (7, 0.5, 0.9, [3])
    assert sp["sampling_seed"] == s.seed_for("a")


@pytest.mark.slow
def test_transient_faults_are_retried_until_success(world, prompts, standin):
    _, tok, model = world
    s = Sampling(max_new_tokens=10)
    ps = prompts[:8]
    plans = {
        prompt_key(p["prompt_ids"]): plan
        for p, plan in zip(
            ps,
            [
                ["500"],
                ["503", "502"],
                ["429", "429"],
                ["reset"],
                ["timeout"],
                ["500", "reset", "429"],
                [],
                [],
            ],
            strict=True,
        )
    }
    standin.faults = Faults(plans=plans, timeout_sleep_s=3.0)
    standin.counts.clear()
    with ServerThread(standin) as url:
        # not streamed: its deadline max(timeout_s, stall_s + max_new_tokens / rate) is 1 s
        eng = http(SGLangEngine, url, s, timeout_s=1.0, stream=False, stall_s=0.5, min_tokens_per_s=100.0)
        got = {r.id: r for r in eng.generate(reqs(ps))}
    ref = embedded_ref(model, ps, s)
    assert all(isinstance(r, Result) for r in got.values())
    assert {k: r.output_ids for k, r in got.items()} == {k: r.output_ids for k, r in ref.items()}
    # charged: a fault from the server that already failed the request (the second 5xx or reset of one
    # request), and the timeout; not a 429, not a request's first fault on a server (issue 42 item 7)
    assert eng.retries == 3 and got[ps[5]["id"]].retries == 1 and got[ps[2]["id"]].retries == 0


def test_permanent_faults_become_failures_with_reasons(world, prompts, standin):
    """A rejection confirmed by a second one is the request's: a Failure with its reason, never charged."""
    s = Sampling(max_new_tokens=10)
    acts = ["400", "404", "malformed", "bad_schema", "out_of_vocab", "abort", "ok"]
    ps = prompts[: len(acts)]
    standin.faults = Faults(
        plans={prompt_key(p["prompt_ids"]): [a, a] for p, a in zip(ps, acts, strict=True)}
    )
    standin.counts.clear()
    with ServerThread(standin) as url:
        got = {r.id: r for r in http(SGLangEngine, url, s).generate(reqs(ps))}
    reasons = [got[p["id"]].reason if isinstance(got[p["id"]], Failure) else "ok" for p in ps]
    assert reasons == ["http_400", "http_404", "malformed", "malformed", "malformed", "finish_abort", "ok"]
    assert all(got[p["id"]].retries == 0 for p in ps)  # never charged
    assert [standin.counts[prompt_key(p["prompt_ids"])] for p in ps] == [2] * 6 + [1]


def test_retries_are_bounded(world, prompts, standin):
    p = prompts[0]
    standin.faults = Faults(plans={prompt_key(p["prompt_ids"]): ["500"] * 10})
    standin.counts.clear()
    with ServerThread(standin) as url:
        (r,) = http(SGLangEngine, url, Sampling(max_new_tokens=4), max_retries=3).generate(reqs([p]))
    assert isinstance(r, Failure) and r.reason == "retries_exhausted" and r.retries == 3
    assert standin.counts[prompt_key(p["prompt_ids"])] == 5  # its first 500 uncharged, then 1 + 3 retries


def test_trimmed_stop_token_is_restored(world, prompts, standin):
    _, _, model = world
    s = Sampling(max_new_tokens=16, stop_token_ids=(frequent_token(model, prompts),))
    standin.faults = Faults(trim_stop=True)
    with ServerThread(standin) as url:
        got = {r.id: r for r in http(SGLangEngine, url, s).generate(reqs(prompts[:6]))}
    ref = embedded_ref(model, prompts[:6], s)
    assert any(r.finish_reason == "stop" for r in ref.values())
    assert {k: r.output_ids for k, r in got.items()} == {k: r.output_ids for k, r in ref.items()}


def test_a_batch_smaller_than_all_slots_reaches_every_server(world, prompts, standin):
    """6 requests, 3 servers x 3 slots: each server answers 2 (the workers were made server by server, so the
    first server's slots took all of a small batch and the last server idled: found on the mini-Kimi run)."""
    s = Sampling(max_new_tokens=4)
    standin.faults = Faults()
    with ServerThread(standin) as a, ServerThread(standin) as b, ServerThread(standin) as c:
        got = list(http(SGLangEngine, [a, b, c], s).generate(reqs(prompts[:6])))
    assert Counter(r.server for r in got) == {a: 2, b: 2, c: 2}
    with ServerThread(standin) as a2, ServerThread(standin) as b2, ServerThread(standin) as c2:
        eng = http(
            SGLangEngine, [a2, b2, c2], s
        )  # one request per call (a last turn): each starts further on
        singles = [r.server for p in prompts[:3] for r in eng.generate(reqs([p]))]
    assert sorted(singles) == sorted([a2, b2, c2])


def test_a_failing_server_does_not_lose_work(world, prompts, standin):
    _, _, model = world
    d, _, _ = world
    broken = StandIn(str(d), faults=Faults(random_rate=1.0, random_actions=["503"]))
    s = Sampling(max_new_tokens=8)
    with ServerThread(standin) as good, ServerThread(broken) as bad:
        standin.faults = Faults()
        got = list(http(SGLangEngine, [bad, good], s, max_retries=20).generate(reqs(prompts[:10])))
    assert all(isinstance(r, Result) and r.server == good for r in got)
    assert len(got) == 10 and len(broken.log) > 0


def test_probe_fails_fast_when_the_server_is_down(world, monkeypatch):
    """Fast = no retry and no backoff wait (counted, not timed: a clock would race the machine's load)."""
    _, tok, _ = world
    waits = []
    monkeypatch.setattr(SGLangEngine, "_delay", lambda self, *a: waits.append(a) or 0.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(EngineError, match="down or not answering"):
            SGLangEngine([f"http://127.0.0.1:{port}"], Sampling(), vocab_size=264).check(tok)
    assert waits == []


@pytest.mark.parametrize("cls", [SGLangEngine, OpenAIEngine])
def test_probe_rejects_a_server_with_another_vocabulary(world, tmp_path, cls):
    d, tok, _ = world
    other = tmp_path / "other_tok"
    build_tokenizer(other, specials=list(reversed(SPECIALS)))  # same bytes, special ids permuted
    with ServerThread(StandIn(str(d), tokenizer_dir=str(other))) as url:
        with pytest.raises(EngineError, match="vocabulary does not match"):
            cls([url], Sampling(), vocab_size=264).check(tok)


def dead_url() -> tuple[socket.socket, str]:
    """A port bound but not listening: connections are refused (keep the socket open while in use)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def standin_process(model_dir, port: int, delay_s: float):
    """A stand-in in its own process (so it can be SIGKILLed), once it answers /health."""
    import json
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from eagle_lib.pipeline import REPO_ROOT

    cmd = [sys.executable, "-m", "tests.support.sglang_standin", "--model", str(model_dir), "--port", str(port),
           "--faults", json.dumps({"delay_s": delay_s})]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "stand-in process exited"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("stand-in process did not start")


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [1.0])
def test_a_dead_server_and_one_killed_mid_run_cost_no_retries(world, prompts, delay_s):
    """The fault test of issue 24: three servers, one dead from the start, one SIGKILLed mid-run (its in-flight
    requests reset) and restarted on its port, answers slow enough (delay_s) that the dead one's workers would
    otherwise win the queue. Every prompt is answered once, no retry is charged to any request, the outputs
    equal a fault-free run's (greedy), and the dead server is out of rotation, not hammered (the old engine
    charged every failed attempt on it to the request and failed 3.8% of the prompts)."""
    import os
    import signal
    import threading
    import time

    from eagle_lib.engines.vllm_server import free_port

    d, tok, model = world
    s = Sampling(max_new_tokens=6)
    ps = prompts[:16]
    ref = embedded_ref(model, ps, s)
    sock, dead = dead_url()
    port = free_port()
    flaky, procs = f"http://127.0.0.1:{port}", [standin_process(d, port, delay_s)]
    try:
        with sock, ServerThread(StandIn(str(d), faults=Faults(delay_s=delay_s))) as live:
            eng = http(SGLangEngine, [dead, flaky, live], s, concurrency=2, timeout_s=30.0, backoff_s=0.2,
                       backoff_max_s=1.0, max_retries=8)  # fmt: skip
            assert eng.check(tok)["down_at_start"] == [dead]

            def kill_and_restart():
                time.sleep(delay_s * 1.5)  # mid-run: two requests are in flight on it
                os.killpg(procs[0].pid, signal.SIGKILL)
                procs[0].wait()
                procs.append(standin_process(d, port, delay_s))

            t = threading.Thread(target=kill_and_restart)
            t.start()
            got = list(eng.generate(reqs(ps)))
            t.join()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert sorted(r.id for r in got) == sorted(p["id"] for p in ps)  # each once
    assert all(isinstance(r, Result) and r.retries == 0 for r in got) and eng.retries == 0
    assert {r.id: r.output_ids for r in got} == {k: r.output_ids for k, r in ref.items()}
    stats = {r["url"]: r for r in eng.server_stats()}
    print({u: (r["answered"], r["failures"], r["seconds_out_of_rotation"]) for u, r in stats.items()})
    assert (
        stats[dead]["answered"] == 0
        and not stats[dead]["in_rotation"]
        and stats[dead]["seconds_out_of_rotation"] > 0
    )
    assert stats[dead]["failures"] == {"refused": 1}  # taken out at the start; its probes are not requests
    assert stats[flaky]["failures"].get("reset", 0) >= 1  # the SIGKILL reset its in-flight requests
    assert stats[live]["answered"] + stats[flaky]["answered"] == len(ps)


@pytest.mark.parametrize("stream", [True, False])
def test_a_server_that_accepts_but_never_answers_leaves_the_rotation(world, prompts, standin, stream):
    """A socket that only listens: the server is out of rotation after its first failure, and the other server
    answers everything. Streamed, no token from it on any stream for stall_s is a stall, the server's fault
    (uncharged); not streamed, the requests time out at their deadline (charged: it is all the engine knows)."""
    s = Sampling(max_new_tokens=4)
    standin.faults = Faults()
    with socket.socket() as hole, ServerThread(standin) as good:
        hole.bind(("127.0.0.1", 0))
        hole.listen(64)  # connections complete in the backlog; nothing is ever read or answered
        black = f"http://127.0.0.1:{hole.getsockname()[1]}"
        eng = http(SGLangEngine, [black, good], s, concurrency=2, timeout_s=1.0, backoff_s=5.0,
                   backoff_max_s=5.0, stream=stream, stall_s=1.0, min_tokens_per_s=100.0)  # fmt: skip
        got = list(eng.generate(reqs(prompts[:8])))
    assert len(got) == 8 and all(isinstance(r, Result) and r.server == good for r in got)
    st = {r["url"]: r for r in eng.server_stats()}
    kind = "stall" if stream else "timeout"
    assert not st[black]["in_rotation"] and st[black]["failures"] == {kind: 2}  # its 2 slots, once each
    assert eng.retries == (0 if stream else 2) and st[good]["answered"] == 8


def test_starts_with_a_server_down_and_refuses_only_when_all_are(world, standin):
    _, tok, _ = world
    standin.faults = Faults()
    s1, d1 = dead_url()
    s2, d2 = dead_url()
    with s1, s2, ServerThread(standin) as good:
        info = http(SGLangEngine, [d1, good], Sampling()).check(tok)
        assert info["down_at_start"] == [d1] and len(info["servers"]) == 2
        with pytest.raises(EngineError) as e:
            http(SGLangEngine, [d1, d2], Sampling()).check(tok)
    assert d1 in str(e.value) and d2 in str(e.value)


def test_no_server_in_rotation_for_all_down_s_stops_the_run(world, prompts, standin):
    """Every server gone mid-run: generate() raises after all_down_s instead of waiting forever (03 stops with
    what it wrote; a restart resumes)."""
    sock, dead = dead_url()
    with sock:
        eng = http(SGLangEngine, [dead], Sampling(max_new_tokens=4), all_down_s=0.5, backoff_s=0.1)
        with pytest.raises(EngineError, match="no server in rotation"):
            list(eng.generate(reqs(prompts[:2])))


# ---------------------------------------------------------------- whose fault (issue 42, item 7)


@pytest.mark.parametrize("act", ["400", "abort"])
def test_a_node_that_rejects_everything_does_not_drain_the_queue(world, prompts, standin, act):
    """A misconfigured node answers every request at once with a 4xx or an abort: each rejected request is
    tried on the other server (a rejection fails a request only when a second one confirms it), the node leaves
    the rotation after IN_A_ROW of them, and nothing goes to the errors (the old engine failed every request
    the node took, at the speed of its replies)."""
    d, _, model = world
    s = Sampling(max_new_tokens=6)
    ps = prompts[:10]
    bad = StandIn(str(d), faults=Faults(plans={prompt_key(p["prompt_ids"]): [act] * 10 for p in ps}))
    standin.faults = Faults()
    with ServerThread(bad) as b, ServerThread(standin) as good:
        eng = http(SGLangEngine, [b, good], s, concurrency=2, backoff_s=0.5, backoff_max_s=1.0)
        got = list(eng.generate(reqs(ps)))
    assert len(got) == 10 and all(isinstance(r, Result) and r.server == good and r.retries == 0 for r in got)
    assert {r.id: r.output_ids for r in got} == {
        k: r.output_ids for k, r in embedded_ref(model, ps, s).items()
    }
    st = {r["url"]: r for r in eng.server_stats()}
    reason = {"400": "http_400", "abort": "finish_abort"}[act]
    assert (
        st[b]["answered"] == 0
        and set(st[b]["failures"]) == {reason}
        and st[b]["failures"][reason] >= IN_A_ROW
    )
    assert st[b]["seconds_out_of_rotation"] > 0 and eng.retries == 0


def test_a_single_router_url_keeps_its_rotation_through_429_and_5xx(world, prompts, standin):
    """Behind one router URL, a 429 is back-pressure and a lone 5xx one worker's fault: the requests are
    retried uncharged and the only URL stays in rotation (the old engine took it out and charged each)."""
    _, _, model = world
    s = Sampling(max_new_tokens=6)
    ps = prompts[:6]
    plans = {prompt_key(p["prompt_ids"]): [a] for p, a in zip(ps, ["429", "503", "500"], strict=False)}
    standin.faults = Faults(plans=plans)
    standin.counts.clear()
    with ServerThread(standin) as url:
        eng = http(SGLangEngine, url, s)
        got = list(eng.generate(reqs(ps)))
    assert all(isinstance(r, Result) and r.retries == 0 for r in got) and eng.retries == 0
    assert {r.id: r.output_ids for r in got} == {
        k: r.output_ids for k, r in embedded_ref(model, ps, s).items()
    }
    (st,) = eng.server_stats()
    assert st["in_rotation"] and st["seconds_out_of_rotation"] == 0
    assert st["failures"] == {"http_429": 1, "http_5xx": 2}


@web.middleware
async def cut_first_replies(request, handler):
    """Each prompt's first /generate reply cut to two thirds, framed as complete (Content-Length of the cut)."""
    resp = await handler(request)
    if request.path != "/generate" or resp.status != 200:
        return resp
    key, seen = prompt_key((await request.json())["input_ids"]), request.app[STATE].cut
    if key in seen:
        return resp
    seen.add(key)
    return web.Response(
        status=200, body=resp.body[: len(resp.body) * 2 // 3], content_type="application/json"
    )


def test_a_reply_cut_short_is_retried_not_failed(world, prompts, monkeypatch):
    """A well-framed body that stops midway is the transport's fault: retried, uncharged (it was a permanent
    "malformed" failure)."""
    import tests.support.sglang_standin as standin_module

    d, _, model = world
    real = standin_module.make_app

    def make_app(state):
        app = real(state)
        app.middlewares.append(cut_first_replies)
        return app

    monkeypatch.setattr(standin_module, "make_app", make_app)
    st = StandIn(str(d))
    st.cut = set()
    s = Sampling(max_new_tokens=6)
    with ServerThread(st) as url:
        eng = http(SGLangEngine, url, s, stream=False)  # one JSON body (streamed cuts: test_streaming.py)
        got = list(eng.generate(reqs(prompts[:4])))
    assert all(isinstance(r, Result) and r.retries == 0 for r in got) and len(got) == 4
    ref = embedded_ref(model, prompts[:4], s)
    assert {r.id: r.output_ids for r in got} == {k: r.output_ids for k, r in ref.items()}
    assert eng.server_stats()[0]["failures"] == {"truncated": 4}


def test_cut_short_tells_a_truncated_body_from_garbage():
    """Every proper prefix of a valid reply is cut short (the reference: the prefixes, by construction); a
    complete document and garbage are not."""
    reply = {"text": 'héllo "quoted"\n\x1b 東京 \\ end', "output_ids": [1, 22, 333], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 2}, "e2e_latency": -1.5e-3, "ok": True, "none": None,
        "input_token_logprobs": [[None, 1, None], [-0.25, 22, None]]}}  # fmt: skip
    for ascii_only in (True, False):
        text = json.dumps(reply, ensure_ascii=ascii_only)
        assert not cut_short(text)
        cut = [i for i in range(len(text)) if not cut_short(text[:i])]
        assert cut == [], (ascii_only, [text[:i][-20:] for i in cut[:5]])
    for garbage in ("{not json", "<html><body>502 Bad Gateway</body></html>", "Internal Server Error",
                    '{"a": 1} trailing', '{"a": [1, }, "b": 2', '{"a": 1 xyz', "[1, 2]]"):  # fmt: skip
        assert not cut_short(garbage), garbage


def test_too_many_failures_stop_the_run_early(world, prompts, standin):
    """Every request rejected twice: the run stops once the failures are clearly past max_error_fraction, long
    before the queue is drained into errors (the old engine failed all 20)."""
    ps = prompts[:20]
    standin.faults = Faults(plans={prompt_key(p["prompt_ids"]): ["400", "400"] for p in ps})
    standin.counts.clear()
    got = []
    with ServerThread(standin) as url:
        eng = http(SGLangEngine, url, Sampling(max_new_tokens=4), concurrency=2, max_error_fraction=0.01)
        with pytest.raises(EngineError, match=r"10 of the 10 .* clearly past max_error_fraction 0.01"):
            got.extend(eng.generate(reqs(ps)))
    assert 10 <= len(got) <= 12 and all(isinstance(r, Failure) and r.reason == "http_400" for r in got)
    assert sum(standin.counts.get(prompt_key(p["prompt_ids"]), 0) == 0 for p in ps) >= 5  # never sent


def test_error_budget_is_the_wilson_bound():
    """ErrorBudget's lower bound is the Wilson score interval's (scipy's, at the same z), and it trips only with
    min_failures failures and that bound past the fraction."""
    from scipy.stats import binomtest, norm

    level = 1 - 2 * norm.sf(5.0)
    for k, n in [(10, 10), (10, 200), (20, 1000), (3, 7), (50, 5000)]:
        b = ErrorBudget(0.01, ok=n - k, failed=k)
        ref = binomtest(k, n).proportion_ci(confidence_level=level, method="wilson").low
        assert abs(b.lower_bound() - ref) < 1e-9, (k, n)
        assert b.exceeded() == (k >= 10 and ref > 0.01)
    assert ErrorBudget(0.01, ok=0, failed=10).exceeded() and not ErrorBudget(0.01, ok=0, failed=9).exceeded()
    assert not ErrorBudget(0.01, ok=990, failed=10).exceeded()  # at the bound: never
