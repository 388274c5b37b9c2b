"""Sequence parallel TTT (`eagle_lib.drafter.seqpar`): 2 processes over gloo, each with half of every row,
against one process with the whole rows: the loss, every stat and every gradient (fp64)."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, os, torch, torch.distributed as dist
from eagle_lib.drafter import seqpar, ttt
from eagle_lib import distributed
from tests.unit.test_longseq import packed
from tests.unit.test_train import drafter
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
k, feed, attention, chunk = int(os.environ["K"]), os.environ["FEED"], os.environ["ATTN"], int(os.environ["CHUNK"])
m = drafter(seed=3, n=20)
args = packed(46, 2, seed=k)
shard = seqpar.groups(world, rank, world)
loss, stats = ttt.TTT(m, k, 0.8, attention, feed, 0.7, loss_chunk=chunk, shard=shard)(*args)
params = [p for p in m.parameters() if p.requires_grad]
grads = torch.autograd.grad(loss, params)
flat = torch.cat([g.reshape(-1) for g in grads]) / world  # the average over ranks DDP would take
dist.all_reduce(flat)
tot = stats.clone()
dist.all_reduce(tot)
part = loss.detach().clone() / world
dist.all_reduce(part)
ref_loss, ref_stats = ttt.TTT(m, k, 0.8, "eager", feed, 0.7)(*args)
ref = torch.cat([g.reshape(-1) for g in torch.autograd.grad(ref_loss, params)])
if rank == 0:
    print(json.dumps({"loss": [float(part), float(ref_loss)], "stats": ((tot - ref_stats).abs() / ref_stats.abs().clamp(min=1)).max().item(),
                      "grad": (flat - ref).abs().max().item(), "grad_scale": ref.abs().max().item(),
                      "local_labels": float(stats[0, ttt.N_LABELS]), "labels": float(ref_stats[0, ttt.N_LABELS])}),
          flush=True)
distributed.shutdown()
"""


@pytest.mark.parametrize(
    "k,feed,attention,chunk",
    # `make test`: drafted feed with chunked attention, and eager attention; k=1 is the `full` tier's
    [
        pytest.param(1, "label", "chunked", 0, marks=pytest.mark.full),
        (3, "drafted", "chunked", 5),
        (7, "label", "eager", 4),
    ],
)
@pytest.mark.slow
def test_two_ranks_each_half_a_row_equal_one_process(k, feed, attention, chunk):
    from eagle_lib.engines.vllm_server import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "K": str(k), "FEED": feed, "ATTN": attention, "CHUNK": str(chunk)}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert got["loss"][0] == pytest.approx(got["loss"][1], rel=1e-12)
    assert got["stats"] < 1e-6  # stats are float32 sums (counts exact, loss sums to float32 rounding)
    assert got["grad"] < 1e-10 * max(1.0, got["grad_scale"])
    assert 0 < got["local_labels"] < got["labels"]  # each rank trained a part, not the whole row


@pytest.mark.slow
def test_05_on_a_two_rank_sequence_parallel_group_matches_one_process(tmp_path):
    """05 itself: nproc_per_node 2 with sequence_parallel 2 (one data rank; each process half of every row)
    ends on one process's weights with the same batches and losses (float32 sums: abs 1e-5, rel 1e-5)."""
    import shutil

    import torch

    from eagle_lib import store, train
    from eagle_lib.drafter.model import load_drafter
    from tests.support import eagle_tiny

    run = eagle_tiny.make_run(tmp_path)
    dirs = {}
    for name in ("one", "two"):
        dirs[name] = tmp_path / name
        for part in ("data", "infer"):
            shutil.copytree(run / part, dirs[name] / part)
    kw = dict(grad_accum=2, max_steps=3, attention="chunked", loss_chunk=8)
    train.run(eagle_tiny.stage_config(dirs["one"], tmp_path / "target", **kw))
    summary = train.run(eagle_tiny.stage_config(dirs["two"], tmp_path / "target", nproc_per_node=2,
                                                 sequence_parallel=2, **kw))  # fmt: skip
    assert summary["world_size"] == 1 and summary["sequence_parallel"] == 2  # one data rank, a group of two
    a, b = (store.read_jsonl(dirs[n] / "drafter/train_log.jsonl") for n in ("one", "two"))
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    assert [r["acc_k"] for r in a] == [r["acc_k"] for r in b]
    wa, wb = (load_drafter(dirs[n] / "drafter/final") for n in ("one", "two"))
    for key, v in wa.state_dict().items():
        torch.testing.assert_close(v, wb.state_dict()[key], rtol=0, atol=1e-5)
