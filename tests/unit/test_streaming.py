"""03's HTTP engines stream their answers (issue 42 item 6): a slow but steady answer outlives the old fixed
deadline, a server that hangs mid-stream is dropped after the stall deadline (not the total one), and the
streamed result equals the non-streamed one. Times are scaled down with the engine's parameters."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from eagle_lib.engines import deadline, http, http_apis
from eagle_lib.engines.base import Failure, Request, Result, Sampling
from eagle_lib.engines.deadline import Deadlines
from eagle_lib.engines.embedded import EmbeddedEngine
from eagle_lib.engines.http_apis import OpenAIEngine, SGLangEngine
from tests.support.sglang_standin import Faults, ServerThread, StandIn, prompt_key
from tests.support.tiny import build_world, make_prompts

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = build_world(tmp_path_factory.mktemp("tiny") / "w")
    tok = AutoTokenizer.from_pretrained(d)
    return d, tok, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(world):
    return make_prompts(world[1], 8, seed=3, max_words=20)


def reqs(ps) -> list[Request]:
    return [Request(p["id"], p["prompt_ids"]) for p in ps]


def reference(model, ps, s: Sampling) -> dict:
    """The target itself, in process (tested against transformers' generate in test_engines)."""
    return {
        r.id: (r.output_ids, r.finish_reason)
        for r in EmbeddedEngine(model, s, batch_size=1).generate(reqs(ps))
    }


def stop_id(model, ps) -> int:
    """A token the model emits early for several prompts: a stop id that ends some answers with "stop"."""
    firsts = []
    for p in ps:
        x = torch.tensor([p["prompt_ids"]])
        g = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=3, pad_token_id=0
        )
        firsts += g[0, x.shape[1] :].tolist()
    return max(set(firsts), key=firsts.count)


def engine(cls, urls, s, **kw):
    kw = {"vocab_size": 264, "concurrency": 2, "backoff_s": 0.01, "backoff_max_s": 0.05} | kw
    return cls(urls if isinstance(urls, list) else [urls], s, **kw)


@pytest.mark.parametrize(("cls", "incremental", "trim"), [(SGLangEngine, False, False), (SGLangEngine, True, False),
                                                          (SGLangEngine, False, True), (OpenAIEngine, False, False)])  # fmt: skip
def test_streamed_answers_equal_the_unstreamed_ones(world, prompts, monkeypatch, cls, incremental, trim):
    """SGLang's cumulative and incremental streams, a stream whose last event trimmed the stop token, and vLLM's
    per-token stream all merge to the non-streamed reply's ids and finish reason, and both equal the target's."""
    d, _, model = world
    monkeypatch.setattr(http_apis, "STREAM_EVERY", 3)  # several events per answer
    s = Sampling(max_new_tokens=12, stop_token_ids=(stop_id(model, prompts),))
    ref = reference(model, prompts, s)
    assert {f for _, f in ref.values()} == {"stop", "length"}
    got = {}
    with ServerThread(StandIn(str(d), faults=Faults(incremental=incremental, trim_stop=trim))) as url:
        for stream in (True, False):
            eng = engine(cls, url, s, stream=stream)
            got[stream] = {r.id: (r.output_ids, r.finish_reason) for r in eng.generate(reqs(prompts))}
    assert got[True] == got[False] == ref


def test_a_slow_steady_stream_outlives_the_old_fixed_deadline(world, prompts, monkeypatch):
    """Each answer streams for ~1.6 s, over 3x `timeout_s` (the old engine's fixed limit: every request timed
    out, was charged and restarted from zero): all are answered, uncharged, and the deadline learnt the rate."""
    d, _, model = world
    monkeypatch.setattr(http_apis, "STREAM_EVERY", 2)
    s = Sampling(max_new_tokens=16)  # no stop id: every answer is 16 tokens
    st = StandIn(str(d), faults=Faults(token_delay_s=0.1))
    with ServerThread(st) as url:
        # before any answer is measured it assumes 2 tokens/s: a deadline of 0.6 + 16 / 2 s
        eng = engine(SGLangEngine, url, s, concurrency=4, timeout_s=0.5, stall_s=0.6, min_tokens_per_s=2.0)
        t0 = time.monotonic()
        got = list(eng.generate(reqs(prompts)))
        took = time.monotonic() - t0
    assert all(isinstance(r, Result) and r.retries == 0 for r in got) and eng.retries == 0, eng.server_stats()
    assert {r.id: (r.output_ids, r.finish_reason) for r in got} == reference(model, prompts, s)
    assert min(r.latency_s for r in got) > 3 * 0.5 and took > 3.0  # the old limit was 0.5 s
    assert eng.server_stats()[0]["failures"] == {}
    # the measured rate: 16 tokens in >= 1.6 s, so the deadline is now at least 0.6 + 16 / (10 / SLACK)
    assert eng.deadlines.rate() <= 10.0 / deadline.SLACK and eng.deadlines.total_s() >= 0.6 + 16 / 5.0


def test_a_server_that_hangs_mid_stream_is_dropped_at_the_stall_deadline(world, prompts):
    """One server sends its first token, then nothing: after stall_s (1 s) without a token on any of its streams
    it is out of rotation and its requests go to the other server, uncharged (the server's fault), long before
    the total deadline (60 s: the old engine waited the whole timeout, an hour on the Kimi params)."""
    d, _, model = world
    s = Sampling(max_new_tokens=8)
    hung = StandIn(str(d), faults=Faults(random_rate=1.0, random_actions=["hang"], timeout_sleep_s=120.0))
    with ServerThread(hung) as bad, ServerThread(StandIn(str(d))) as good:
        eng = engine(
            SGLangEngine, [bad, good], s, timeout_s=60.0, stall_s=1.0, backoff_s=30.0, backoff_max_s=30.0
        )
        t0 = time.monotonic()
        got = list(eng.generate(reqs(prompts)))
        took = time.monotonic() - t0
    assert all(isinstance(r, Result) and r.server == good and r.retries == 0 for r in got) and len(got) == 8
    assert {r.id: (r.output_ids, r.finish_reason) for r in got} == reference(model, prompts, s)
    st = {x["url"]: x for x in eng.server_stats()}
    assert st[bad]["failures"] == {"stall": 2} and not st[bad]["in_rotation"]  # its 2 streams, once each
    assert 1.0 <= took < 30.0 and eng.deadlines.total_s() >= 60.0


def test_a_stream_cut_midway_is_retried_uncharged(world, prompts):
    """The connection closed after the first event (a proxy or a dying worker): the transport's fault, retried."""
    d, _, model = world
    s = Sampling(max_new_tokens=8)
    plans = {prompt_key(p["prompt_ids"]): ["cut"] for p in prompts[:4]}
    st = StandIn(str(d), faults=Faults(plans=plans))
    with ServerThread(st) as url:
        eng = engine(OpenAIEngine, url, s)
        got = list(eng.generate(reqs(prompts[:4])))
    assert all(isinstance(r, Result) and r.retries == 0 for r in got)
    assert {r.id: (r.output_ids, r.finish_reason) for r in got} == reference(model, prompts[:4], s)
    assert sum(eng.server_stats()[0]["failures"].values()) == 4


def test_a_stream_far_slower_than_the_run_misses_its_deadline(world, prompts):
    """Alive (a token every 0.1 s, so never a stall) but far slower than the run's measured rate: past its total
    deadline it is charged (its own), and at max_retries it is an error, not a wait without end."""
    d, _, _ = world
    s = Sampling(max_new_tokens=16)
    with ServerThread(StandIn(str(d), faults=Faults(token_delay_s=0.1))) as url:
        eng = engine(OpenAIEngine, url, s, timeout_s=0.2, stall_s=0.5, max_retries=1)
        eng.deadlines.rates.extend([400.0] * deadline.MIN_SAMPLES)  # earlier answers came at 400 tokens/s
        assert eng.deadlines.total_s() == pytest.approx(0.5 + 16 / 200)
        (r,) = eng.generate(reqs(prompts[:1]))
    assert (
        isinstance(r, Failure) and r.reason == "retries_exhausted" and "past the total deadline" in r.detail
    )
    assert eng.server_stats()[0]["failures"] == {"deadline": 2} and eng.retries == 1


def test_streams_in_flight_report_their_progress(world, prompts, monkeypatch):
    """03's ledger gets each stream's token count while it runs (04 reads it as a lower bound)."""
    d, _, _ = world
    monkeypatch.setattr(http, "PROGRESS_S", 0.2)
    s = Sampling(max_new_tokens=16)
    seen: list[tuple[str, int]] = []
    with ServerThread(StandIn(str(d), faults=Faults(token_delay_s=0.1))) as url:
        eng = engine(OpenAIEngine, url, s)
        eng.on_progress = seen.extend
        final = {r.id: len(r.output_ids) for r in eng.generate(reqs(prompts[:2]))}
    assert {i for i, _ in seen} == set(final) and all(0 < n <= final[i] for i, n in seen)
    for i in final:  # non-decreasing per request, and it got somewhere before the end
        ns = [n for j, n in seen if j == i]
        assert ns == sorted(ns) and len(set(ns)) > 1


def test_the_total_deadline_follows_the_measured_rates():
    """max(floor, stall + max_new / (10th percentile of the measured rates / SLACK)); the prior before."""
    dl = Deadlines(max_new_tokens=1000, stall_s=30.0, floor_s=100.0, prior_rate=2.0)
    assert dl.total_s() == 30.0 + 1000 / 2.0  # no answer measured yet
    rng = np.random.default_rng(0)
    rates = rng.uniform(5.0, 50.0, size=40)
    for r in rates:
        dl.observe(int(10 * r), 10.0)  # answers of 50-500 tokens in 10 s
    dl.observe(3, 0.001)  # too short to measure (below min_tokens)
    tokens = np.floor(10 * rates)
    assert dl.min_tokens == 64 and (tokens < 64).any()  # answers under 64 tokens are not measured either
    slow = np.percentile(tokens[tokens >= 64] / 10.0, 10, method="lower")
    assert dl.rate() == pytest.approx(slow / deadline.SLACK)
    assert dl.total_s() == pytest.approx(max(100.0, 30.0 + 1000 / (slow / deadline.SLACK)))
    fast = Deadlines(max_new_tokens=10, stall_s=1.0, floor_s=100.0, rates=[1e4] * 20)
    assert fast.total_s() == 100.0  # the floor
