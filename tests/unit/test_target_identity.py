"""03's target identity (issue 42, item 1): the identity of the records is the model's, not which servers are up
or the paths they report; every live server is checked to serve that model by its answer to a fixed probe
(`eagle_lib.engines.fingerprint`), against the other live servers and against the fingerprint the first run
recorded.

Servers: the SGLang stand-in (greedy ids only: it returns no log-probs, so it is fingerprinted by its greedy
continuation), and the stand-in with the scoring a real server adds (`scoring`): teacher-forced log-probs of
the prompt in SGLang's ``meta_info.input_token_logprobs`` and vLLM's ``choices[0].prompt_logprobs`` formats,
computed here with the model itself (the reference), in float32 or bfloat16 (other numerics, same model).
"""

from __future__ import annotations

import json
import shutil
import socket

import pytest
import torch
from aiohttp import web

from eagle_lib import infer, store
from eagle_lib.engines import fingerprint
from eagle_lib.engines.base import EngineError, Request, Result, Sampling
from eagle_lib.engines.http_apis import OpenAIEngine, SGLangEngine
from tests.support import sglang_standin
from tests.support.sglang_standin import Faults, ServerThread, StandIn
from tests.support.tiny import build_world, make_prompts

torch.set_num_threads(1)
STOP = 164


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """(target dir, another checkpoint of it: same tokenizer and config, other weights, the tokenizer)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("worlds")
    d, other = build_world(root / "target"), build_world(root / "other", seed=1)
    return d, other, AutoTokenizer.from_pretrained(d)


def load(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def teacher_forced(model, ids: list[int]) -> list[float | None]:
    """log p(ids[i] | ids[:i]) from the model's own logits (None for the first token): the reference."""
    logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [None] + [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def standin(model_dir, reports=None, scorer=None, **faults) -> StandIn:
    """A stand-in serving `model_dir`, reporting the path `reports` (another checkpoint at the same path) and,
    with a `scorer` model, returning prompt log-probs as real servers do."""
    st = StandIn(str(model_dir), faults=Faults(**faults))
    st.model_dir = str(reports or model_dir)
    st.scorer = scorer
    return st


@web.middleware
async def score_prompts(request: web.Request, handler):
    """SGLang `return_logprob` + `logprob_start_len: 0`, vLLM `prompt_logprobs`: the prompt's log-probs added to
    the stand-in's reply, in each API's reply format."""
    resp = await handler(request)
    body = await request.json() if request.method == "POST" else {}
    scorer = request.app[sglang_standin.STATE].scorer
    if resp.status != 200 or not (body.get("return_logprob") or body.get("prompt_logprobs") is not None):
        return resp
    data = json.loads(resp.body)
    ids = body.get("input_ids") or body.get("prompt")
    lps = teacher_forced(scorer, ids)
    if request.path == "/generate":
        data["meta_info"]["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
    else:
        data["choices"][0]["prompt_logprobs"] = [None] + [
            {str(t): {"logprob": lp, "rank": 1, "decoded_token": None}}
            for lp, t in zip(lps[1:], ids[1:], strict=True)
        ]
    return web.json_response(data)


@pytest.fixture
def scoring(monkeypatch):
    """Stand-ins with a `scorer` get the scoring middleware."""
    real = sglang_standin.make_app

    def make_app(state):
        app = real(state)
        if getattr(state, "scorer", None) is not None:
            app.middlewares.append(score_prompts)
        return app

    monkeypatch.setattr(sglang_standin, "make_app", make_app)


def http(cls, urls, **kw):
    kw = {
        "vocab_size": 264,
        "concurrency": 2,
        "timeout_s": 20.0,
        "backoff_s": 0.05,
        "backoff_max_s": 0.1,
    } | kw
    return cls(urls, Sampling(max_new_tokens=8), **kw)


def dead_url() -> tuple[socket.socket, str, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    return sock, f"http://127.0.0.1:{port}", port


# ---------------------------------------------------------------- the fingerprint and its tolerance


def test_tolerance_separates_numerics_from_another_checkpoint(worlds):
    """The test targets' share of the measurement in fingerprint's docstring: the same model in bfloat16 is
    well inside TOLERANCE, another checkpoint (other seed, same config and tokenizer) far outside."""
    d, other, tok = worlds
    ids = fingerprint.probe_ids(tok)

    def fp(model):
        return fingerprint.Fingerprint(tuple(ids), tuple(teacher_forced(model, ids)), ())

    ref = fp(load(d))
    same = fingerprint.distance(ref, fp(load(d, torch.bfloat16)))
    another = fingerprint.distance(ref, fp(load(other)))
    print(f"tiny target: bf16 {same:.4f}, another checkpoint {another:.3f} nats/token")
    assert same < fingerprint.TOLERANCE / 4 and another > 10 * fingerprint.TOLERANCE
    assert not fingerprint.difference(ref, fp(load(d, torch.bfloat16)))
    assert "log-probs differ by" in fingerprint.difference(ref, fp(load(other)))


@pytest.mark.parametrize("cls", [SGLangEngine, OpenAIEngine])
def test_live_servers_are_compared_by_their_log_probs(worlds, scoring, cls):
    """Two servers of the target (float32 and bfloat16 numerics) agree; their log-probs, read from each API's
    reply, are the model's own. A third serving another checkpoint at the same path is refused by name."""
    d, other, tok = worlds
    ids = fingerprint.probe_ids(tok)
    ref = teacher_forced(load(d), ids)
    a, b = standin(d, scorer=load(d)), standin(d, scorer=load(d, torch.bfloat16))
    c = standin(other, reports=d, scorer=load(other))
    with ServerThread(a) as ua, ServerThread(b) as ub, ServerThread(c) as uc:
        eng = http(cls, [ua, ub])
        info = eng.check(tok)
        with pytest.raises(EngineError) as e:
            http(cls, [ua, ub, uc]).check(tok)
    assert [s["fingerprint"] for s in info["servers"]] == ["logprobs", "logprobs"]
    got = eng.fingerprints[ua].logprobs
    assert got[0] is None and max(abs(x - y) for x, y in zip(got[1:], ref[1:], strict=True)) < 1e-5
    odd = [line.split(": serves another model than")[0].strip() for line in str(e.value).splitlines()[1:]]
    assert odd == [uc] and "log-probs differ by" in str(e.value)


# ---------------------------------------------------------------- 03 restarts (the "done when")


def make_run(tmp_path, tok, n: int):
    run = tmp_path / "run"
    store.append_jsonl(
        run / "data/B/a/prompts.jsonl", [p | {"source": "tiny"} for p in make_prompts(tok, n, seed=2)]
    )
    return run


def config(run, d, urls: list[str], **stage):
    from eagle_lib import params

    stage = {"stop_token_ids": [STOP], "write_every": 2, "progress": False, "engine": "sglang",
             "server_urls": urls, "concurrency": 1, "timeout_s": 20.0, "backoff_s": 0.05} | stage  # fmt: skip
    shared = params.SharedParams(target=str(d), num_workers=1, max_new_tokens=8)
    return params.StageConfig("03_infer", run, shared, infer.Params(**stage))


def reference(d, prompts) -> dict[str, list[int]]:
    from eagle_lib.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(load(d), Sampling(max_new_tokens=8, stop_token_ids=(STOP,)), batch_size=1)
    return {r.id: r.output_ids for r in eng.generate([Request(p["id"], p["prompt_ids"]) for p in prompts])}


def test_restart_with_a_server_down_and_another_path_resumes_every_record(worlds, tmp_path):
    """Run 1 on three servers answers half the prompts; run 2 has one server down and one serving the same
    checkpoint from another path: it resumes every committed record and answers the rest (the old identity,
    the served paths plus '?' for the one down, made every record stale)."""
    d, _, tok = worlds
    run = make_run(tmp_path, tok, 8)
    elsewhere = shutil.copytree(d, tmp_path / "node2" / "target")  # the same files, another path
    with ServerThread(st := standin(d)) as a, ServerThread(st) as b, ServerThread(st) as c:
        first = infer.run(config(run, d, [a, b, c], limit=4))
        sock, down, _ = dead_url()
        with sock, ServerThread(standin(elsewhere)) as b2:
            meta = infer.run(config(run, d, [a, b2, down]))
    m = meta["datasets"]["a"]
    assert (m["resumed"], m["generated"], m["kept"], m["set_aside"]) == (4, 4, 8, 0)
    assert meta["probe"]["down_at_start"] == [down] and first["target"] == meta["target"]
    recs = store.read_jsonl(run / "infer/a/responses.jsonl")
    assert all(r["target"] == first["target"] for r in recs) and len(recs) == 8
    assert {r["id"]: r["output_ids"] for r in recs} == reference(
        d, store.read_jsonl(run / "data/B/a/prompts.jsonl")
    )
    assert len(list((run / "infer").glob("target_fingerprint-*.json"))) == 1


def test_a_server_swapped_for_another_model_is_refused(worlds, tmp_path):
    """Another checkpoint with the same tokenizer, at the same path (the old identity saw nothing): refused by
    URL when the other live servers disagree with it, and by the first run's recorded fingerprint when every
    server was swapped. Nothing is written."""
    d, other, tok = worlds
    run = make_run(tmp_path, tok, 4)
    with (
        ServerThread(st := standin(d)) as a,
        ServerThread(st) as b,
        ServerThread(swap := standin(other, d)) as s,
    ):
        infer.run(config(run, d, [a, b], limit=2))
        before = (run / "infer/a/responses.jsonl").read_bytes()
        with pytest.raises(
            infer.InferError, match=rf"{s}: serves another model than http.*greedy continuation"
        ):
            infer.run(config(run, d, [a, s, b]))
        with ServerThread(swap) as s2, pytest.raises(infer.InferError) as e:
            infer.run(config(run, d, [s, s2]))
    assert f"{s}: the probe's greedy continuation" in str(e.value) and s2 in str(e.value)
    assert "target_fingerprint-" in str(e.value)
    assert (run / "infer/a/responses.jsonl").read_bytes() == before


def test_a_server_back_mid_run_with_another_model_stays_out(worlds):
    """A server down at the start comes back mid-run serving another checkpoint: its probe fails against the
    run's fingerprint, so it never gets work (the old probe passed it: same tokenizer)."""
    d, other, tok = worlds
    prompts = make_prompts(tok, 6, seed=3)
    sock, url, port = dead_url()
    with ServerThread(standin(d, delay_s=0.4)) as good:
        eng = http(SGLangEngine, [good, url], concurrency=1)
        assert eng.check(tok)["down_at_start"] == [url]
        sock.close()
        with ServerThread(standin(other, reports=d), port=port):
            got = list(eng.generate([Request(p["id"], p["prompt_ids"]) for p in prompts]))
    stats = {r["url"]: r for r in eng.server_stats()}
    assert all(isinstance(r, Result) and r.server == good for r in got) and len(got) == 6
    assert (
        stats[url]["answered"] == 0
        and "serves another model than this run's target" in stats[url]["last_error"]
    )


def test_records_of_an_older_03_name_what_to_do(worlds, tmp_path):
    """A record whose target is the old served-path identity: the stale error says what that was and what to do."""
    d, _, tok = worlds
    run = make_run(tmp_path, tok, 2)
    with ServerThread(standin(d)) as a:
        infer.run(config(run, d, [a]))
        recs = store.read_jsonl(run / "infer/a/responses.jsonl")
        old = [r | {"target": {"engine": "sglang", "model": [str(d), "?"]}} for r in recs]
        (run / "infer/a/responses.jsonl").unlink()
        store.append_jsonl(run / "infer/a/responses.jsonl", old)
        with pytest.raises(
            infer.InferError, match=r"older 03 named a served target by the model paths .* finish"
        ):
            infer.run(config(run, d, [a]))
