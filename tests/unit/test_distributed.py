"""torchrun with 2 CPU processes (gloo) matches one process with the same global batch.

Stated tolerance: per-step losses within rel 1e-5, final weights within abs 1e-5 (float32 sums in a
different order: gradient all-reduce vs accumulation).
"""

import shutil
from pathlib import Path

import pytest
import torch

from eagle_lib import store, train
from eagle_lib.drafter import retrain
from eagle_lib.drafter.model import load_drafter
from tests.support import eagle_tiny


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return root, eagle_tiny.make_run(root)


def fresh(world, dest: Path) -> Path:
    shutil.copytree(world[1] / "data", dest / "data")
    shutil.copytree(world[1] / "infer", dest / "infer")
    return dest


def compare(world, tmp_path, mode):
    root = world[0]
    one, two = fresh(world, tmp_path / "one"), fresh(world, tmp_path / "two")
    train.run(eagle_tiny.stage_config(one, root / "target", grad_accum=2, max_steps=4))
    summary = train.run(
        eagle_tiny.stage_config(
            two, root / "target", grad_accum=1, max_steps=4, nproc_per_node=2, distributed=mode
        )
    )
    assert summary["world_size"] == 2
    a = store.read_jsonl(one / "drafter/train_log.jsonl")
    b = store.read_jsonl(two / "drafter/train_log.jsonl")
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]  # same global batches
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    wa, wb = load_drafter(one / "drafter/final"), load_drafter(two / "drafter/final")
    for key, v in wa.state_dict().items():
        torch.testing.assert_close(v, wb.state_dict()[key], rtol=0, atol=1e-5)
    start = load_drafter(next((one / "drafter/checkpoints").glob("*/step_0000004")))
    assert not torch.equal(start.fc.weight, eagle_tiny_init_fc(world, tmp_path))


def eagle_tiny_init_fc(world, tmp_path):
    """fc at initialisation (to check that training moved the weights at all)."""
    cfg = eagle_tiny.stage_config(fresh(world, tmp_path / "init"), world[0] / "target")
    _, drafter, *_ = train.build(cfg, torch.device("cpu"))
    return drafter.fc.weight.detach()


def test_ddp_two_processes_match_one(world, tmp_path):
    compare(world, tmp_path, "ddp")


@pytest.mark.slow
def test_fsdp_two_processes_match_one(world, tmp_path):
    compare(world, tmp_path, "fsdp")


def test_07_trains_05s_two_rank_recipe_as_one_process(world, tmp_path):
    """05 on 2 ranks x grad_accum 2 with its steps from the epoch count; 07's retrainer on that run's recipe
    takes 05's step count and 4 micro-batches per step in 05's order, and ends on 05's weights (the old
    retrainer ignored the world size: 1/2 the batch and another step count)."""
    two = fresh(world, tmp_path / "two")
    cfg = eagle_tiny.stage_config(
        two, world[0] / "target", grad_accum=2, max_steps=0, epochs=3, nproc_per_node=2
    )
    summary = train.run(cfg)
    tr = retrain.Trainer(*retrain.load_recipe(two))
    seqs = tr.sequences(two)[0]
    assert (tr.world, tr.p.grad_accum) == (2, 4)
    assert tr.full_steps(seqs) == summary["steps"] > 1
    drafter, log = tr.train(seqs, summary["steps"], cfg.stage.warmup_steps, tmp_path / "arm", "a")
    five = store.read_jsonl(two / "drafter/train_log.jsonl")
    assert [r["tokens"] for r in log] == [r["tokens"] for r in five]  # the same global batches
    ref = load_drafter(two / "drafter/final")
    for key, v in ref.state_dict().items():
        torch.testing.assert_close(drafter.state_dict()[key], v, rtol=0, atol=1e-5)


def test_process_group_outlives_the_longest_wait_for_a_producer(monkeypatch):
    """Ranks may wait up to PRODUCER_WAIT_S for a producer's unit between two collectives: the process group
    must be created with a longer timeout than that (NCCL's default is 10 minutes)."""
    import datetime

    import torch.distributed as dist

    from eagle_lib.drafter import distributed
    from eagle_lib.hidden_states import engine_hidden

    got = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: got.update(backend=backend, **kw))
    distributed.init(torch.device("cpu"))
    assert got["backend"] == "gloo" and isinstance(got["timeout"], datetime.timedelta)
    assert got["timeout"].total_seconds() > engine_hidden.PRODUCER_WAIT_S >= 3600
