"""One producer serving several trainer ranks (``ranks_per_producer``): one engine fills two ranks' buffers, each
with its own plan, cursor and buffer share, and each rank reads exactly what transformers computes for its own
batches (`tests.support.hf_producer.HFEngine` answers ``prefill``, an independent capture). The producer is
started from the command line its group's COMMAND names, as a user would on the producer node."""

import shlex
import threading

import pytest
import torch

from eagle_lib.hidden_states import engine_hidden, hidden, producer_procs, vllm_producer
from eagle_lib.hidden_states import hidden_buffer as hb
from tests.support import eagle_tiny
from tests.support.hf_producer import HFEngine, assert_matches_online
from tests.unit.test_engine_hidden import AUX, producer_cfg, world

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return eagle_tiny.load_target(tmp_path_factory.mktemp("tiny"))


class CountingEngine(HFEngine):
    """HFEngine that records how many sequences each prefill call carried."""

    calls: list[int] = []

    def prefill(self, seqs):
        CountingEngine.calls.append(len(seqs))
        return super().prefill(seqs)


def test_one_producer_fills_two_ranks_buffers_from_one_engine(target, tmp_path, monkeypatch):
    path, model = target
    ids = engine_hidden.layer_ids(AUX, eagle_tiny.LAYERS)
    from transformers import AutoModelForCausalLM

    own = AutoModelForCausalLM.from_pretrained(path).eval()
    engines = []

    def make(cfg, scratch):
        engines.append(cfg)
        return CountingEngine(own, ids, scratch)

    monkeypatch.setattr(vllm_producer, "make_engine", make)
    CountingEngine.calls = []
    head = hidden.load_target_head(str(path), model.config)
    ranks = []
    for r, seed in enumerate((0, 1)):  # two ranks, different sequences (as two ranks' micro-batches)
        seqs, batches, units, tokens = world(8, seed=seed)
        src = engine_hidden.VllmHidden(
            tmp_path / f"rank{r}", units, tokens, 0, ids, AUX, head, 64, torch.device("cpu"),
            producer_cfg=producer_cfg(path, ids, 10**8), start_producers=False, write_command=False,
        )  # fmt: skip
        ranks.append((src, batches, units))
    group = [(str(src.buf), src.plan_session) for src, _, _ in ranks]
    (line,) = producer_procs.external_producers(ranks[0][0].buf, 1, log=lambda _: None, group=group)
    argv = shlex.split(line)
    assert argv.count("--buffer") == 2 and argv.count("--session") == 2
    assert not (ranks[1][0].buf / producer_procs.COMMAND_FILE).exists()  # the group's first rank names it
    errors = []

    def run():
        try:
            vllm_producer.main(argv[3:])
        except BaseException as e:  # surfaced below
            errors.append(repr(e))

    thread = threading.Thread(target=run)
    thread.start()
    try:
        for src, batches, _ in ranks:  # each rank reads its own units, equal to transformers' own
            assert_matches_online(src, model, AUX, batches)
    finally:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(engines) == 1  # one engine served both ranks
    for src, _, units in ranks:
        stats = hb.read_json(src.buf / "producer_0.json")
        assert stats["state"] == "done" and stats["units"] == len(units) and stats["busy_s"] > 0
        assert stats["tokens"] == sum(src.lengths[k] for u in units for k in u)
    assert sum(CountingEngine.calls) == sum(len(u) for _, _, us in ranks for u in us)  # every sequence once
    assert max(CountingEngine.calls) > max(len(u) for u in ranks[0][2]) * 4  # a call spans both ranks' units


def test_buffers_of_different_engines_are_refused(target, tmp_path):
    path, _ = target
    ids = engine_hidden.layer_ids(AUX, eagle_tiny.LAYERS)
    lanes = []
    for r, tp in enumerate((1, 2)):
        buf = tmp_path / f"rank{r}"
        buf.mkdir()
        hb.write_json(
            buf / "producer_config.json", {**producer_cfg(path, ids, 10**8), "tensor_parallel_size": tp}
        )
        hb.write_json(buf / "plan.json", {"units": []})
        (buf / "sequences.jsonl").write_text("")
        lanes.append(vllm_producer.Producer(buf, 0, 1))
    with pytest.raises(SystemExit, match=r"tensor_parallel_size"):
        vllm_producer.engine_config(lanes)
