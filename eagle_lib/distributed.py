"""Multi-process training: torchrun environment, DDP / FSDP wrapping, full (portable) state dicts.

Under ``torchrun --nproc_per_node N`` each process trains on its share of every optimizer step's
micro-batches (see `eagle_lib.data.batches.BatchStream`); gradients are averaged across processes, so the run
matches a single process with ``grad_accum * N`` micro-batches. gloo on CPU, nccl on GPU. Checkpoints hold
full, unsharded state dicts keyed by parameter name, so a run resumes under any world size.

Top-level because two wings share it: the trainer (`eagle_lib.drafter`) and the vllm hidden source, whose plan
follows the trainer's data-parallel rank and whose producers serve groups of ranks (`eagle_lib.hidden_states`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment; (0, 1, 0) otherwise."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", 1)) > 1


# Collectives wait at most this long: longer than any wait of one rank between two collectives, the longest
# being the vllm hidden source's wait for a producer's unit (`hidden_states.producer_procs.PRODUCER_WAIT_S`, which
# is derived from this); NCCL's default (10 min) would abort a job whose producer is merely slow.
PROCESS_GROUP_TIMEOUT_S = 2 * 3600.0


def init(device: torch.device) -> torch.device:
    """Join the process group when under torchrun (timeout `PROCESS_GROUP_TIMEOUT_S`); returns this process's
    device."""
    if not launched():
        return device
    _, _, local = world()
    if device.type == "cuda":
        check_local_rank(local, torch.cuda.device_count())
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    return device


def data_world(sequence_parallel: int = 1) -> tuple[int, int]:
    """(data-parallel rank, data-parallel world size): the ranks of one sequence-parallel group (consecutive
    ranks, `eagle_lib.drafter.seqpar`) read the same micro-batches, each computing its part of every row."""
    rank, size, _ = world()
    sp = max(1, sequence_parallel)
    if size % sp:
        raise ValueError(f"sequence_parallel {sp} must divide the number of processes ({size})")
    return rank // sp, size // sp


def is_main() -> bool:
    return world()[0] == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
    return x


def wrap(module: nn.Module, mode: str, device: torch.device, bf16: bool = False) -> nn.Module:
    """DDP or FSDP (fully_shard) when launched with several processes; the module itself otherwise. FSDP with
    `bf16` (05's bf16 precision): parameters gathered and computed in bf16, gradients reduced in fp32 into the
    fp32 shards, which stay the only full-precision (master) copy."""
    if not launched():
        return module
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kw = {"mp_policy": mp} if mp else {}
        # the TTT loop calls the drafter's leaf modules directly, so each leaf owning parameters is one
        # FSDP unit (gathered by its own forward hook)
        for sub in list(module.modules()):
            if sub is not module and any(True for _ in sub.parameters(recurse=False)):
                fully_shard(sub, **kw)
        return fully_shard(module, **kw)
    raise ValueError(f"distributed mode {mode!r}: choose ddp or fsdp")


def no_sync(model: nn.Module, skip: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step (DDP / FSDP)."""
    if skip and hasattr(model, "no_sync"):
        return model.no_sync()
    if skip and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(True)
    return contextlib.nullcontext()


def full_state(model: nn.Module, optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state), unsharded, on CPU, keyed by parameter name (any world size);
    ``optimizer``: one or a list (their states merged by parameter name)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=opts)


def full_model_state(model: nn.Module) -> dict:
    """The model's unsharded state dict on CPU (a collective under FSDP: call on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model: nn.Module, optimizer, model_state: dict, optim_state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=opts)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def check_local_rank(local: int, gpus: int) -> None:
    """Refuse a process whose local rank has no GPU on this node (``nproc_per_node`` above the node's GPUs):
    ``set_device`` would fail with CUDA's "invalid device ordinal", or two ranks would share one GPU."""
    if local >= gpus:
        raise RuntimeError(f"local rank {local} has no GPU: this node has {gpus}; nproc_per_node must be at most "
                           "the GPUs of one node (more ranks: nnodes > 1 with rdzv_endpoint)")  # fmt: skip


def torchrun_command(nproc: int, argv: list[str], nnodes: int = 1, rdzv_endpoint: str = "",
                     rdzv_id: str = "eagle3") -> list[str]:  # fmt: skip
    """torchrun's command line: one node alone (``--standalone``), or one of `nnodes` nodes joining the c10d
    rendezvous at `rdzv_endpoint` (the same line runs on every trainer node; torchrun assigns the node ranks)."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and not rdzv_endpoint:
        cmd.append("--standalone")
    else:
        if not rdzv_endpoint:
            raise ValueError(f"nnodes {nnodes}: a multi-node launch needs rdzv_endpoint (host:port)")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]  # fmt: skip
    return [*cmd, f"--nproc_per_node={nproc}", *argv]


def launch(nproc: int, argv: list[str], nnodes: int = 1, rdzv_endpoint: str = "", rdzv_id: str = "eagle3",
           command_file=None) -> None:  # fmt: skip
    """Run torchrun (`torchrun_command`) here and fail loudly if it fails. With ``nnodes > 1`` the same line
    must run on the other trainer nodes (from the repository, on the shared run directory): it is printed and
    written to `command_file` first."""
    cmd = torchrun_command(nproc, argv, nnodes, rdzv_endpoint, rdzv_id)
    if nnodes > 1:
        line = " ".join(cmd)
        if command_file is not None:
            Path(command_file).write_text(line + "\n")
        print(
            f"training on {nnodes} nodes: run on each of the other {nnodes - 1} trainer nodes:\n  {line}",
            flush=True,
        )
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"distributed training failed (exit {proc.returncode}): {' '.join(cmd)}")


def producer_groups(world_size: int, ranks_per_producer: int) -> list[list[int]]:
    """Trainer ranks by the producers that serve them: group g = ranks g*k .. g*k+k-1 (k = ranks_per_producer;
    the last group may be smaller). Each of a group's ``num_producers`` producers serves every rank of it."""
    k = max(1, ranks_per_producer)
    return [list(range(g, min(g + k, world_size))) for g in range(0, world_size, k)]


def producer_group(rank: int, ranks_per_producer: int) -> int:
    """The producer group (`producer_groups`) serving trainer rank `rank`."""
    return rank // max(1, ranks_per_producer)


def shutdown() -> None:
    """Leave the process group together: a rank tearing gloo down while another still talks to it can abort
    (std::terminate in gloo's threads, seen on a loaded 2-core CI box)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
