"""The vllm hidden source without vLLM: producer accounting + regrouping and the trainer-side consumer.

The real `vllm_producer.Producer` runs in a thread with an engine that answers ``prefill`` from
transformers (`tests.support.hf_producer.HFEngine`: an independent capture), and the
consumer (`engine_hidden.VllmHidden`) must return what `hidden.OnlineHidden` computes, while the producer
never holds more than the buffer bound. tests/server/test_vllm_hidden.py runs the same with real vLLM.
"""

import os
import threading
from pathlib import Path

import pytest
import torch

from eagle_lib import store
from eagle_lib.data.batches import PAD_TO, Sequence, make_batch, seq_key
from eagle_lib.hidden_states import engine_hidden, hidden, producer_procs, vllm_producer
from eagle_lib.hidden_states import hidden_buffer as hb
from tests.support import eagle_tiny, hf_producer
from tests.support.hf_producer import HFEngine

torch.set_num_threads(1)
AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return eagle_tiny.load_target(tmp_path_factory.mktemp("tiny"))


def world(n_seqs=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [
        Sequence(f"s{i}", torch.randint(0, eagle_tiny.VOCAB, (int(t),), generator=g).tolist(), [1] * int(t))
        for i, t in enumerate(torch.randint(5, 20, (n_seqs,), generator=g))
    ]
    rows = [[i, i + 1] for i in range(0, n_seqs, 2)]  # 2 sequences per row, 1 row per unit
    batches = [make_batch(seqs, [r], PAD_TO) for r in rows]
    units = [[k for row in b.segments for k, _, _ in row] for b in batches]
    return seqs, batches, units, {seq_key(s.input_ids): s.input_ids for s in seqs}


def producer_cfg(target_dir, ids, max_bytes):
    return {
        "target": str(target_dir), "layer_ids": ids, "num_layers": eagle_tiny.LAYERS, "hidden_size": 64,
        "model_dtype": "float32", "storage_dtype": "float32", "tensor_parallel_size": 1, "max_model_len": 64,
        "trust_remote_code": False, "connector": "cpu", "units_per_call": 4, "max_buffer_bytes": max_bytes,
    }  # fmt: skip


def test_layer_ids_map_decoder_layers_to_hf_indices():
    assert engine_hidden.layer_ids([1, 3, 4], 8) == [2, 4, 5, 8]
    assert engine_hidden.layer_ids([4, 1, 3], 8) == [2, 4, 5, 8]  # vLLM sorts its aux ids
    with pytest.raises(ValueError, match="outside"):
        engine_hidden.layer_ids([1, 3, 8], 8)


def test_streamed_units_equal_online_and_respect_the_bound(target, tmp_path, monkeypatch):
    path, model = target
    seqs, batches, units, tokens = world()
    ids = engine_hidden.layer_ids(AUX, eagle_tiny.LAYERS)
    per_unit = [
        hb.shard_bytes(sum(len(tokens[k]) for k in u), len(u), len(ids), 64, "float32")
        + hb.scratch_bytes([len(tokens[k]) for k in u], len(ids), 64, "float32")
        for u in units
    ]
    bound = max(per_unit) + min(per_unit)  # room for one unit in flight and little else: the producer blocks
    from transformers import AutoModelForCausalLM

    own = AutoModelForCausalLM.from_pretrained(
        path
    ).eval()  # the producer thread's copy (hooks are per model)
    monkeypatch.setattr(vllm_producer, "make_engine", lambda cfg, scratch: HFEngine(own, ids, scratch))
    head = hidden.load_target_head(str(path), model.config)
    src = engine_hidden.VllmHidden(
        tmp_path / "buf", units, tokens, 0, ids, AUX, head, 64, torch.device("cpu"),
        producer_cfg=producer_cfg(path, ids, bound), start_producers=False,
    )  # fmt: skip
    # start_producers: false names the buffer and the command for the serving nodes; start it as a user would
    (cmd,) = (tmp_path / "buf" / producer_procs.COMMAND_FILE).read_text().splitlines()
    argv = cmd.split()
    assert argv[:3] == [".venv-vllm/bin/python", "-m", "eagle_lib.hidden_states.vllm_producer"]
    a = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert a == {
        "--buffer": str(tmp_path / "buf"),
        "--index": "0",
        "--count": "1",
        "--session": src.plan_session,
    }
    prod = vllm_producer.Producer(
        Path(a["--buffer"]), int(a["--index"]), int(a["--count"]), session=a["--session"]
    )
    errors = []
    thread = threading.Thread(target=lambda: _run(prod, errors))
    thread.start()
    try:  # a slow trainer: the producer fills the buffer to its bound and waits
        hf_producer.assert_matches_online(src, model, AUX, batches, delay_s=0.3)
    finally:
        thread.join(timeout=30)
    assert not errors, errors
    stats = hb.read_json(tmp_path / "buf" / "producer_0.json")
    assert stats["state"] == "done" and stats["units"] == len(units)
    assert 0 < stats["peak_buffer_bytes"] <= bound
    assert src.summary()["observed_peak_buffer_bytes"] <= bound
    assert stats["blocked_s"] > 0  # the bound was reached and held
    assert not list((tmp_path / "buf").glob("unit_*"))  # consumed units are deleted
    assert [r["unit"] for r in store.read_jsonl(tmp_path / "buf" / "served.jsonl")] == list(range(len(units)))


def _run(prod, errors):
    try:
        prod.run()
    except BaseException as e:  # surfaced by the test thread
        errors.append(repr(e))


def test_a_replanned_buffer_drops_the_old_request_and_refuses_producers_of_the_old_plan(target, tmp_path):
    """start_producers: false, a run directory used before (the second `make test` hung an hour): the earlier
    run's COMMAND and its producers' states go before planning, so a watcher never acts on the old request and
    a stale "done" is not read as this run's; a producer started from an older plan's command refuses the new
    plan without touching the stats; a restarted trainer on the same plan keeps the plan's session (producers
    serving it go on); while one trainer reads the buffer, a second is refused (a surviving rank of a killed
    run consumed and deleted a unit the new run was reading)."""
    path, model = target
    _, _, units, tokens = world(4)
    ids = engine_hidden.layer_ids(AUX, eagle_tiny.LAYERS)
    head = hidden.load_target_head(str(path), model.config)
    buf = tmp_path / "buf"

    def source(us):
        return engine_hidden.VllmHidden(
            buf, us, tokens, 0, ids, AUX, head, 64, torch.device("cpu"),
            producer_cfg=producer_cfg(path, ids, 10**6), start_producers=False,
        )  # fmt: skip

    def command():
        (line,) = (buf / producer_procs.COMMAND_FILE).read_text().splitlines()
        return line.split()[3:]

    first = source(units)
    old = command()
    with pytest.raises(RuntimeError, match=rf"another trainer \(pid {os.getpid()}\)"):
        source(units)  # a second consumer (another 05, a killed run's surviving rank) would take its units
    hb.write_json(buf / "producer_0.json", {"state": "done", "pid": 1})  # the earlier producer's last word
    first.close()
    again = source(units)  # the same plan: the same session and command
    assert not (buf / "producer_0.json").exists() and command() == old
    again.close()
    other = source(units[:1])  # another plan: another session
    new = command()
    assert new != old and new[new.index("--session") + 1] == other.plan_session
    with pytest.raises(vllm_producer.StalePlan, match="re-planned"):
        vllm_producer.main(old)
    assert not (buf / "producer_0.json").exists()
    vllm_producer.Producer(buf, 0, 1, session=other.plan_session)  # the new command's producer is accepted
    other.close()


def test_out_of_plan_call_and_oversized_unit_fail_clearly(target, tmp_path):
    path, model = target
    seqs, batches, units, tokens = world(4)
    ids = engine_hidden.layer_ids(AUX, eagle_tiny.LAYERS)
    head = hidden.load_target_head(str(path), model.config)
    src = engine_hidden.VllmHidden(
        tmp_path / "buf", units, tokens, 0, ids, AUX, head, 64, torch.device("cpu"),
        producer_cfg=producer_cfg(path, ids, 1000), start_producers=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="not planned unit 0"):
        src(batches[1])
    with pytest.raises(SystemExit, match="raise max_buffer_gb"):
        vllm_producer.Producer(tmp_path / "buf", 0, 1).run()
    src.close()


@pytest.mark.slow
def test_a_failed_external_producer_stops_the_waiting_rank_at_once(tmp_path, monkeypatch):
    """start_producers: false. A producer that dies (here: no producer_config.json in its buffer, as any
    startup error) records ``failed`` with its error; the rank waiting on a unit raises with that error
    within seconds, not after PRODUCER_WAIT_S (the mini-Kimi run hung an hour on an AMX host before)."""
    import time

    buf = tmp_path / "rank0"
    buf.mkdir()
    with pytest.raises(FileNotFoundError):
        vllm_producer.main(["--buffer", str(buf), "--index", "0"])
    state = hb.read_json(buf / "producer_0.json")
    assert state["state"] == "failed" and "producer_config.json" in state["error"]
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="every external producer .* failed") as err:
        producer_procs.wait_for(buf / "unit_000000.safetensors", [], buf)
    assert time.perf_counter() - t0 < 5 and "producer_config.json" in str(err.value)
    # one producer still starting (another index): keep waiting, the timeout still applies
    hb.write_json(buf / "producer_1.json", {"state": "starting", "pid": 1})
    monkeypatch.setattr(producer_procs, "PRODUCER_WAIT_S", 1.5)
    with pytest.raises(TimeoutError):
        producer_procs.wait_for(buf / "unit_000000.safetensors", [], buf)
