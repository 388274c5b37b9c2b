"""Stage 03 orchestration: contract records, exactly-once across crashes and SIGKILLs, shards, faults, stale data."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from eagle_lib import infer, infer_tables, params, store
from eagle_lib.engines.base import Request, Sampling
from eagle_lib.engines.embedded import EmbeddedEngine
from eagle_lib.engines.http_apis import SGLangEngine
from eagle_lib.pipeline import REPO_ROOT
from tests.support import slow_append
from tests.support.sglang_standin import Faults, ServerThread, StandIn, prompt_key
from tests.support.tiny import build_world, make_prompts

torch.set_num_threads(1)
STOP = 164  # a byte token the tiny random model emits often: some answers stop, some hit the length limit


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoTokenizer

    d = build_world(tmp_path_factory.mktemp("tiny") / "w")
    return d, AutoTokenizer.from_pretrained(d)


def make_run(tmp_path: Path, tok, sizes: dict[str, int], source: str = "tiny") -> Path:
    run = tmp_path / "run"
    for name, n in sizes.items():
        prompts = [p | {"source": source} for p in make_prompts(tok, n, seed=n)]
        store.append_jsonl(run / "data" / "B" / name / "prompts.jsonl", prompts)
    return run


def config(run: Path, world_dir: Path, max_new_tokens: int = 12, **stage) -> params.StageConfig:
    stage = {"stop_token_ids": [STOP], "write_every": 3, "progress": False} | stage
    shared = params.SharedParams(target=str(world_dir), num_workers=1, max_new_tokens=max_new_tokens)
    return params.StageConfig("03_infer", run, shared, infer.Params(**stage))


def records(run: Path, name: str) -> list[dict]:
    return store.read_jsonl(run / "infer" / name / "responses.jsonl")


def reference(
    world_dir: Path, prompts: list[dict], max_new: int = 12, stop: int = STOP
) -> dict[str, list[int]]:
    """Independent reference: the embedded engine one prompt at a time (itself checked against model.generate)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world_dir, dtype=torch.float32).eval()
    eng = EmbeddedEngine(model, Sampling(max_new_tokens=max_new, stop_token_ids=(stop,)), batch_size=1)
    return {r.id: r.output_ids for r in eng.generate([Request(p["id"], p["prompt_ids"]) for p in prompts])}


def test_records_follow_the_contract(world, tmp_path):
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 14, "b": 5})
    meta = infer.run(config(run, d))
    prompts = store.read_jsonl(run / "data/B/a/prompts.jsonl")
    recs = records(run, "a")
    assert sorted(r["id"] for r in recs) == sorted(p["id"] for p in prompts)
    ref = reference(d, prompts)
    for r in recs:
        assert set(r) >= {"id", "source", "prompt_ids", "output_ids", "text", "finish_reason", "n_prompt_tokens",
                          "n_output_tokens", "sampling", "engine", "latency_s"}  # fmt: skip
        assert r["output_ids"] == ref[r["id"]]
        assert r["text"] == tok.decode(r["output_ids"], skip_special_tokens=False)
        assert r["n_output_tokens"] == len(r["output_ids"]) and r["n_prompt_tokens"] == len(r["prompt_ids"])
        assert r["finish_reason"] == ("stop" if r["output_ids"][-1] == STOP else "length")
        assert r["sampling"] == {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 12, "seed": 0}
        assert r["engine"] == "embedded"
    m = store.read_json(run / "infer/a/meta.json")
    store.check_tally(m)
    assert (m["read"], m["kept"], m["rejected"]) == (14, 14, 0)
    assert m["finish_reason"] == dict(Counter(r["finish_reason"] for r in recs))
    assert m["output_tokens"] == sum(r["n_output_tokens"] for r in recs)
    assert (meta["read"], meta["kept"]) == (19, 19) and store.read_json(run / "infer/meta.json")[
        "status"
    ] == "ok"
    assert set(infer_tables.summary_table(meta)["dataset"]) == {"a", "b", "TOTAL"}


class CrashAfter:
    """Wraps an engine; raises after `n` results, like a process dying mid-run."""

    def __init__(self, engine, n: int):
        self.engine, self.n = engine, n
        self.name, self.sampling, self.model = engine.name, engine.sampling, engine.model

    @property
    def on_start(self):
        return self.engine.on_start

    @on_start.setter
    def on_start(self, hook):
        self.engine.on_start = hook  # the wrapped engine records the starts in the ledger

    def check(self, tok):
        return self.engine.check(tok)

    def generate(self, requests):
        for k, item in enumerate(self.engine.generate(requests)):
            if k == self.n:
                raise RuntimeError("simulated crash")
            yield item


def test_restart_after_a_crash_generates_only_the_rest(world, tmp_path, monkeypatch):
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 20})
    real = infer.make_engine
    monkeypatch.setattr(infer, "make_engine", lambda cfg, t, *urls: CrashAfter(real(cfg, t, *urls), 7))
    with pytest.raises(RuntimeError, match="simulated crash"):
        infer.run(config(run, d, batch_size=4))
    first = (run / "infer/a/responses.jsonl").read_bytes()
    assert len(records(run, "a")) == 7  # the results before the crash were committed
    with open(run / "infer/a/responses.jsonl", "ab") as f:
        f.write(b'{"id": "s00001", "prompt_ids": [1, 2')  # and a torn last line, as from a crash mid-write
    monkeypatch.setattr(infer, "make_engine", real)
    meta = infer.run(config(run, d, batch_size=4))
    assert (run / "infer/a/responses.jsonl").read_bytes().startswith(first)  # nothing rewritten
    recs = records(run, "a")
    assert Counter(r["id"] for r in recs) == Counter(
        p["id"] for p in store.read_jsonl(run / "data/B/a/prompts.jsonl")
    )
    assert meta["datasets"]["a"]["resumed"] == 7 and meta["datasets"]["a"]["generated"] == 13
    assert {r["id"]: r["output_ids"] for r in recs} == reference(
        d, store.read_jsonl(run / "data/B/a/prompts.jsonl")
    )


NON_ASCII = "données·日本語·🙂"  # every record carries it (source): a torn tail can be cut inside a character


def kill_mid_write(cmd: list[str], out: Path, env: dict) -> None:
    """SIGKILL the slow-append CLI at its first torn tail (a handshake: no clock decides where)."""
    slow_append.kill_mid_write(cmd, out, env, cwd=REPO_ROOT)
    data = out.read_bytes()
    with pytest.raises(UnicodeDecodeError):
        data[data.rfind(b"\n") + 1 :].decode()  # the torn tail ends inside a multi-byte character


def params_file(tmp_path: Path, world_dir: Path, max_new_tokens: int, **stage) -> Path:
    f = tmp_path / "kill.yaml"
    shared = {"target": str(world_dir), "num_workers": 1, "max_new_tokens": max_new_tokens}
    f.write_text(yaml.safe_dump({"run_name": "kill", "shared": shared, "stages": {"03_infer": stage}}))
    return f


@pytest.mark.slow
def test_sigkill_mid_write_then_finish(world, tmp_path):
    """The CLI is SIGKILLed three times in the middle of writing a non-ASCII record, then finishes: one record
    per prompt, none lost, none duplicated, outputs belong to their ids."""
    d, tok = world
    n, eos = 60, tok.convert_tokens_to_ids("<|im_end|>")  # rarely emitted: long answers, work to interrupt
    run = make_run(tmp_path, tok, {"a": n}, source=NON_ASCII)
    stage = {"stop_token_ids": [eos], "batch_size": 4, "write_every": 2, "progress": False}
    pfile = params_file(tmp_path, d, 24, **stage)
    out = run / "infer/a/responses.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    slow = [sys.executable, "-m", "tests.support.slow_append", str(pfile), "--run-dir", str(run)]
    for _ in range(3):
        kill_mid_write(slow, out, env)
    partial = len(records(run, "a"))
    assert 0 < partial < n
    cmd = [sys.executable, "-m", "eagle_lib.infer", str(pfile), "--run-dir", str(run)]
    subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True, timeout=300, capture_output=True)
    recs = records(run, "a")
    prompts = store.read_jsonl(run / "data/B/a/prompts.jsonl")
    assert Counter(r["id"] for r in recs) == Counter(p["id"] for p in prompts)  # none lost, none duplicated
    assert all(r["source"] == NON_ASCII for r in recs)
    meta = store.read_json(run / "infer/a/meta.json")
    assert (meta["kept"], meta["resumed"], meta["duplicates_ignored"]) == (n, partial, 0)
    sample = random.Random(1).sample(prompts, 20)  # outputs belong to their ids (a sample, for speed)
    by_id = {r["id"]: r["output_ids"] for r in recs}
    assert {p["id"]: by_id[p["id"]] for p in sample} == reference(d, sample, max_new=24, stop=eos)


@pytest.mark.slow
def test_sigkill_during_the_merge_of_shards(world, tmp_path):
    """Two shards done; the merging run is SIGKILLed mid-write; the next run merges the rest exactly once."""
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 40}, source=NON_ASCII)
    for shard in ("0/2", "1/2"):
        infer.run(config(run, d), shard=shard)
    pfile = params_file(tmp_path, d, 12, stop_token_ids=[STOP], write_every=3, progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    main = run / "infer/a/responses.jsonl"
    kill_mid_write(
        [sys.executable, "-m", "tests.support.slow_append", str(pfile), "--run-dir", str(run)], main, env
    )
    partial = len(records(run, "a"))
    assert 0 < partial < 40
    meta = infer.run(config(run, d))["datasets"]["a"]
    assert (meta["merged_from_shards"], meta["generated"], meta["kept"]) == (40 - partial, 0, 40)
    prompts = store.read_jsonl(run / "data/B/a/prompts.jsonl")
    assert Counter(r["id"] for r in records(run, "a")) == Counter(p["id"] for p in prompts)


def test_ledger_of_starts_and_a_seeded_random_order(world, tmp_path, monkeypatch):
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 24})
    monkeypatch.setattr(EmbeddedEngine, "progress_s", 0.0)  # a streamed count at every decoding step
    meta = infer.run(config(run, d, batch_size=4))
    cut = meta["finish_reason"].get("length", 0)
    assert infer_tables.answer_text(meta).startswith(
        "**24 of 24 prompts answered** (0 errors) in 1 datasets: "
    )
    assert ("1 dataset(s) cut at max_new_tokens in > 5%" in infer_tables.answer_text(meta)) == (
        cut > 0.05 * 24
    )
    lines, recs = store.read_jsonl(run / "infer/a/started.jsonl"), records(run, "a")
    starts, counts = [s for s in lines if "n" not in s], [s for s in lines if "n" in s]
    done = {r["id"]: r for r in recs}
    assert counts and all(c["n"] < done[c["id"]]["n_output_tokens"] and c["t"] <= done[c["id"]]["finished_at"]
                          for c in counts)  # fmt: skip
    assert Counter(s["id"] for s in starts) == Counter(r["id"] for r in recs)  # every request started once
    by_id = {s["id"]: s for s in starts}
    assert all(
        by_id[r["id"]]["t"] <= r["finished_at"] and by_id[r["id"]]["server"] == "embedded" for r in recs
    )
    prompts = store.read_jsonl(run / "data/B/a/prompts.jsonl")
    shuffled = [p["id"] for p in prompts]
    random.Random("0:a").shuffle(shuffled)  # the documented order: seed 0, dataset "a"
    started = [s["id"] for s in starts]  # in the order the engine admitted them
    windows = lambda ids: [set(ids[i : i + 4]) for i in range(0, len(ids), 4)]  # noqa: E731
    assert windows(started) == windows(shuffled) and started != [p["id"] for p in prompts]


def test_resume_sets_aside_records_of_another_target_or_other_stop_ids(world, tmp_path):
    d, tok = world
    other = build_world(tmp_path / "other", seed=1)  # the same tokenizer, another model
    run = make_run(tmp_path, tok, {"a": 4})
    infer.run(config(run, d))
    before = (run / "infer/a/responses.jsonl").read_bytes()
    with pytest.raises(infer.InferError, match=r"is stale: it was made by .*this run's target is"):
        infer.run(config(run, other))
    assert (run / "infer/a/responses.jsonl").read_bytes() == before
    meta = infer.run(config(run, other, on_stale="set_aside"))["datasets"]["a"]
    assert (meta["set_aside"], meta["generated"], meta["kept"]) == (4, 4, 4)
    assert (run / "infer/a/stale.jsonl").read_bytes() == before
    assert all(r["target"]["model"] == str(other) for r in records(run, "a"))
    with pytest.raises(infer.InferError, match=r"made with stop ids \[164\], this run stops at \[164, 165\]"):
        infer.run(config(run, other, stop_token_ids=[STOP, 165]))
    meta = infer.run(config(run, other, stop_token_ids=[STOP, 165], on_stale="set_aside"))["datasets"]["a"]
    assert (meta["set_aside"], meta["generated"]) == (4, 4)
    assert len(store.read_jsonl(run / "infer/a/stale.jsonl")) == 8


def test_shards_then_merge_exactly_once(world, tmp_path):
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 16})
    m0 = infer.run(config(run, d), shard="0/2")
    m1 = infer.run(config(run, d), shard="1/2")
    assert m0["read"] + m1["read"] == 16 and min(m0["read"], m1["read"]) > 0
    assert not (run / "infer/a/responses.jsonl").exists() and not (run / "infer/meta.json").exists()
    meta = infer.run(config(run, d))
    a = meta["datasets"]["a"]
    assert (a["merged_from_shards"], a["generated"], a["kept"]) == (16, 0, 16)
    recs = records(run, "a")
    assert Counter(r["id"] for r in recs) == Counter(
        p["id"] for p in store.read_jsonl(run / "data/B/a/prompts.jsonl")
    )
    infer.run(config(run, d))  # idempotent: merging again appends nothing
    assert len(records(run, "a")) == 16


def test_stale_records_stop_the_run_and_are_kept(world, tmp_path):
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 4})
    infer.run(config(run, d))
    before = (run / "infer/a/responses.jsonl").read_bytes()
    with pytest.raises(
        infer.InferError, match=r"responses.jsonl: record 's000\d\d' is stale: it was sampled with"
    ):
        infer.run(config(run, d, max_new_tokens=13))
    assert (run / "infer/a/responses.jsonl").read_bytes() == before
    meta = infer.run(config(run, d, max_new_tokens=13, on_stale="set_aside"))
    assert (meta["kept"], meta["generated"]) == (4, 4)
    assert (run / "infer/a/stale.jsonl").read_bytes() == before  # moved aside, not lost
    assert all(r["sampling"]["max_new_tokens"] == 13 for r in records(run, "a"))


def test_bad_prompt_records_are_named(world, tmp_path):
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 3})
    store.append_jsonl(run / "data/B/a/prompts.jsonl", [{"id": "bad", "prompt_ids": ["x"]}])
    with pytest.raises(infer.InferError, match=r"prompts.jsonl: record 4 \(id 'bad'\): prompt_ids must be"):
        infer.run(config(run, d))
    with pytest.raises(infer.InferError, match="no prompts.jsonl for"):
        infer.run(config(run, d, datasets=["missing"]))


def test_faults_summary_and_retry_of_errors(world, tmp_path):
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 10})
    prompts = store.read_jsonl(run / "data/B/a/prompts.jsonl")
    plans = {
        prompt_key(p["prompt_ids"]): a
        for p, a in zip(prompts, [["400", "400"], ["malformed"] * 2, ["500", "429"]] * 2, strict=False)
    }
    standin = StandIn(str(d), faults=Faults(plans=plans))
    with ServerThread(standin) as url:
        http = {
            "engine": "sglang",
            "server_urls": [url],
            "concurrency": 2,
            "backoff_s": 0.01,
            "timeout_s": 20.0,
        }
        with pytest.raises(infer.InferError, match=r"4/10 prompts failed"):
            infer.run(config(run, d, **http))
        meta = store.read_json(run / "infer/meta.json")
        assert meta["status"] == "failed" and (meta["read"], meta["kept"], meta["rejected"]) == (10, 6, 4)
        assert meta["datasets"]["a"]["errors_by_reason"] == {"http_400": 2, "malformed": 2}
        errs = store.read_jsonl(run / "infer/a/errors.jsonl")
        assert sorted(e["reason"] for e in errs) == ["http_400", "http_400", "malformed", "malformed"]
        assert all(e["detail"] and e["server"] == url for e in errs)
        standin.counts.clear()
        standin.faults = Faults()
        meta = infer.run(config(run, d, **http))  # the errors are retried, the answered ids are not
    assert (meta["kept"], meta["rejected"], meta["datasets"]["a"]["generated"]) == (10, 0, 4)
    assert {r["id"]: r["output_ids"] for r in records(run, "a")} == reference(d, prompts)
    assert all(r["engine"] == "sglang" and r["server"] == url for r in records(run, "a"))


def test_stage_stops_early_when_failures_are_clearly_too_many(world, tmp_path):
    """A server that rejects every request: 03 stops once the failures are clearly past max_error_fraction,
    leaving most prompts pending rather than in errors.jsonl (the old 03 failed all 40, then the stage); fixed,
    a restart answers every prompt."""
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 40})
    prompts = store.read_jsonl(run / "data/B/a/prompts.jsonl")
    standin = StandIn(
        str(d), faults=Faults(plans={prompt_key(p["prompt_ids"]): ["400"] * 2 for p in prompts})
    )
    with ServerThread(standin) as url:
        http = {
            "engine": "sglang",
            "server_urls": [url],
            "concurrency": 2,
            "timeout_s": 20.0,
            "backoff_s": 0.05,
        }
        # the stop is 03's clear error (it was the engine's bare EngineError, with no meta written), naming the
        # dataset and its counts; infer/meta.json says it stopped early and what each dataset got
        with pytest.raises(
            infer.InferError,
            match=r"(?s)stopped early in a \(a: 0 answered, 1\d failed, \d+ not "
            r"finished of 40 pending\).*clearly past max_error_fraction 0.01.*restart resumes",
        ):
            infer.run(config(run, d, **http))
        errors = store.read_jsonl(run / "infer/a/errors.jsonl")
        assert 10 <= len(errors) <= 12
        meta = store.read_json(run / "infer/meta.json")
        assert meta["status"] == "stopped_early" and "max_error_fraction" in meta["reason"]
        assert meta["datasets"]["a"] == {"pending": 40, "answered": 0, "failed": len(errors),
                                         "not_finished": 40 - len(errors)}  # fmt: skip
        standin.faults = Faults()
        meta = infer.run(config(run, d, **http))
    assert (meta["kept"], meta["rejected"]) == (40, 0)
    assert {r["id"]: r["output_ids"] for r in records(run, "a")} == reference(d, prompts)


def test_embedded_engine_stops_before_decoding_when_failures_are_clearly_too_many(world, tmp_path):
    """The embedded engine's only per-request failures (too long, empty) are known before decoding: with most
    prompts too long for the context it writes them and stops at once (the old engine decoded every other
    prompt, then failed the stage); the stop is recorded as the HTTP engines' is."""
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 30})
    prompts = store.read_jsonl(run / "data/B/a/prompts.jsonl")
    short = sorted(len(p["prompt_ids"]) for p in prompts)[5]  # the 5 shortest fit
    too_long = sum(len(p["prompt_ids"]) >= short for p in prompts)
    with pytest.raises(infer.InferError, match=rf"stopped early in a \(a: 0 answered, {too_long} failed, "
                       rf"{30 - too_long} not finished of 30 pending\).*stopped before decoding"):  # fmt: skip
        infer.run(config(run, d, max_model_len=short))
    assert not (run / "infer/a/responses.jsonl").exists() or records(run, "a") == []
    errors = store.read_jsonl(run / "infer/a/errors.jsonl")
    assert len(errors) == too_long and {e["reason"] for e in errors} == {"prompt_too_long"}
    assert store.read_json(run / "infer/meta.json")["status"] == "stopped_early"


def test_stage_fails_fast_when_the_server_is_down(world, tmp_path, monkeypatch):
    """Its only server down: refused at the probe with the URL's error (with others up it would start)."""
    d, tok = world
    run = make_run(tmp_path, tok, {"a": 2})
    waits = []  # fast = no retry and no backoff wait (counted, not timed)
    monkeypatch.setattr(SGLangEngine, "_delay", lambda self, *a: waits.append(a) or 0.0)
    with pytest.raises(infer.InferError, match="(?s)health probe failed.*down or not answering"):
        infer.run(config(run, d, engine="sglang", server_urls=["http://127.0.0.1:9"]))
    assert waits == [] and not (run / "infer/a").exists()


def test_stage_runs_with_one_server_down_and_reports_each_server(world, tmp_path):
    """One of two URLs down at the start: 03 completes on the other, and meta.json says which was down, what
    each answered and how long the dead one was out of rotation."""
    import socket

    d, tok = world
    run = make_run(tmp_path, tok, {"a": 4})
    with socket.socket() as sock, ServerThread(StandIn(str(d))) as url:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
        meta = infer.run(
            config(run, d, engine="sglang", server_urls=[dead, url], backoff_s=0.05, timeout_s=20.0)
        )
    assert (meta["kept"], meta["rejected"]) == (4, 0) and meta["probe"]["down_at_start"] == [dead]
    st = {r["url"]: r for r in meta["servers"]}
    assert (
        st[dead]["answered"] == 0 and st[dead]["seconds_out_of_rotation"] > 0 and not st[dead]["in_rotation"]
    )
    assert st[url]["answered"] == 4 and st[url]["failures"] == {}
    assert infer_tables.servers_table(meta).shape[0] == 2


def test_datasets_are_interleaved_so_any_snapshot_samples_all_of_them(world, tmp_path):
    """03 takes the pending prompts of every dataset in one seeded random order (it ran them one dataset after
    another, so a run killed at 40% had not started most datasets and 04 saw a zero-width interval): the first
    40% of the requests started reach every dataset, in about its share; files and counts stay per dataset."""
    d, tok = world
    run = tmp_path / "run"
    sizes = {"a": 12, "b": 6, "c": 6}
    for name, n in sizes.items():  # ids as 02 writes them: <dataset>:<row id>
        ps = [p | {"id": f"{name}:{p['id']}", "source": "tiny"} for p in make_prompts(tok, n, seed=n)]
        store.append_jsonl(run / "data" / "B" / name / "prompts.jsonl", ps)
    with ServerThread(StandIn(str(d))) as url:
        meta = infer.run(config(run, d, engine="sglang", server_urls=[url], concurrency=1, timeout_s=20.0))
    starts = sorted((r["t"], n) for n in sizes for r in store.read_jsonl(run / "infer" / n / "started.jsonl"))
    first = Counter(n for _, n in starts[: int(0.4 * len(starts))])
    assert set(first) == set(sizes), first  # every dataset started within the first 40%
    assert all(meta["datasets"][n]["kept"] == k for n, k in sizes.items())
    assert all(r["id"].startswith(f"{n}:") for n in sizes for r in records(run, n))  # each in its own file


def test_api_key_is_read_from_the_named_variable(world, tmp_path, monkeypatch):
    d, tok = world
    monkeypatch.delenv("EAGLE_TEST_KEY", raising=False)
    run = make_run(tmp_path, tok, {"a": 1})
    with pytest.raises(params.ParamsError, match="EAGLE_TEST_KEY"):
        infer.run(
            config(run, d, engine="openai", server_urls=["http://127.0.0.1:9"], api_key_env="EAGLE_TEST_KEY")
        )


def test_shard_argument():
    assert infer.parse_shard("1/4") == (1, 4) and infer.parse_shard("") is None
    for bad in ("4/4", "x", "1/0"):
        with pytest.raises(infer.InferError):
            infer.parse_shard(bad)
    owners = Counter(infer.shard_of(f"id{i}", 3) for i in range(3000))
    assert set(owners) == {0, 1, 2} and min(owners.values()) > 850


def test_params_files_block_validates():
    for f in ("toy", "ci", "kimi_k25"):
        run = params.load_params(REPO_ROOT / "params" / f"{f}.yaml")
        assert isinstance(run.stage("03_infer"), infer.Params)
    kimi = params.load_params(REPO_ROOT / "params/kimi_k25.yaml").stage("03_infer")
    assert kimi.engine == "sglang" and len(kimi.server_urls) > 1 and kimi.api_key_env
    assert json.dumps(kimi.model_dump()).count("sk-") == 0  # secrets only by variable name
