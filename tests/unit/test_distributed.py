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


@pytest.mark.slow
def test_ddp_two_processes_match_one(world, tmp_path):
    compare(world, tmp_path, "ddp")


@pytest.mark.slow
def test_fsdp_two_processes_match_one(world, tmp_path):
    compare(world, tmp_path, "fsdp")


@pytest.mark.slow
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

    from eagle_lib import distributed
    from eagle_lib.hidden_states import producer_procs

    got = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: got.update(backend=backend, **kw))
    distributed.init(torch.device("cpu"))
    assert got["backend"] == "gloo" and isinstance(got["timeout"], datetime.timedelta)
    assert got["timeout"].total_seconds() > producer_procs.PRODUCER_WAIT_S >= 3600


FSDP_BF16 = """
import json, os, torch, torch.distributed as dist
from eagle_lib import distributed
from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter
dist.init_process_group("gloo")
torch.manual_seed(0)
c = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                 vocab_size=50, draft_vocab_size=20, target_hidden_size=32, aux_layers=[0, 1, 2])
m = distributed.wrap(Eagle3Drafter(c), "fsdp", torch.device("cpu"), bf16=os.environ["BF16"] == "1")
seen = []
m.fc.register_forward_pre_hook(lambda mod, args: seen.append(str(mod.weight.dtype)))
out = m.fc(torch.randn(3, 96))
out.float().sum().backward()
if dist.get_rank() == 0:
    w = m.fc.weight
    print(json.dumps({"in_forward": seen[0], "master": str(w.dtype), "grad": str(w.grad.dtype),
                      "local_rows": w.to_local().shape[0], "rows": w.shape[0]}), flush=True)
distributed.shutdown()  # barrier first: one rank tearing gloo down while the other still talks aborts (CI)
"""


@pytest.mark.slow
# the fp32 case's dtypes: the `full` tier (fp32 FSDP against one process: test_fsdp_two_processes_match_one)
@pytest.mark.parametrize("bf16", [True, pytest.param(False, marks=pytest.mark.full)])
def test_fsdp_bf16_gathers_bf16_and_keeps_fp32_master_shards(bf16):
    """05's bf16 precision under FSDP: the gathered weights a module computes with are bf16 (half the
    all-gather), the shards the optimizer steps stay fp32 and so do their gradients (reduced in fp32); without
    bf16, everything fp32 (the old wrap gathered fp32 in both cases)."""
    import json
    import os
    import subprocess
    import sys

    from eagle_lib.engines.vllm_server import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "BF16": "1" if bf16 else "0", "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", FSDP_BF16], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert got["in_forward"] == ("torch.bfloat16" if bf16 else "torch.float32")
    assert got["master"] == got["grad"] == "torch.float32"
    assert got["local_rows"] * 2 == got["rows"]  # sharded over the 2 ranks


def test_torchrun_line_joins_a_rendezvous_on_several_nodes(tmp_path, monkeypatch):
    """nnodes > 1: every trainer node runs the same torchrun line with a c10d rendezvous (the old launch could
    only run `--standalone`, one node); the line is written for the other nodes before the launch."""
    import subprocess

    from eagle_lib import distributed

    one = distributed.torchrun_command(8, ["-m", "eagle_lib.train", "x.json"])
    assert one[3:] == ["--standalone", "--nproc_per_node=8", "-m", "eagle_lib.train", "x.json"]
    two = distributed.torchrun_command(8, ["-m", "eagle_lib.train", "x.json"], 2, "node0:29500", "run1")
    assert "--standalone" not in two
    assert two[3:] == ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=run1",
                       "--nproc_per_node=8", "-m", "eagle_lib.train", "x.json"]  # fmt: skip
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        distributed.torchrun_command(8, [], 2, "")
    ran = []
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, check: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0)
    )
    distributed.launch(
        8, ["-m", "eagle_lib.train", "x.json"], 2, "node0:29500", "run1", tmp_path / "TORCHRUN"
    )
    assert ran == [two] and (tmp_path / "TORCHRUN").read_text() == " ".join(two) + "\n"


def test_a_rank_past_the_nodes_gpus_is_refused_before_set_device(monkeypatch):
    """nproc_per_node 16 on an 8-GPU node: local rank 8 has no GPU; the old init called set_device(8)."""
    import torch.distributed as dist

    from eagle_lib import distributed

    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) called"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("joined the group"))
    with pytest.raises(RuntimeError, match="local rank 8 has no GPU: this node has 8; nproc_per_node"):
        distributed.init(torch.device("cuda"))


def test_ranks_are_grouped_by_the_producer_that_serves_them():
    from eagle_lib import distributed

    # the Kimi layout: 8 ranks, 3 a producer (the last producer serves 2)
    assert distributed.producer_groups(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [distributed.producer_group(r, 3) for r in range(8)] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert distributed.producer_groups(4, 1) == [[0], [1], [2], [3]]  # one producer a rank (the default)
    for world, k in [(8, 3), (16, 4), (5, 2), (3, 8)]:  # every rank in exactly the group producer_group names
        groups = distributed.producer_groups(world, k)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(r in groups[distributed.producer_group(r, k)] for r in range(world))
