"""Multi-process training: torchrun environment, DDP / FSDP wrapping, full (portable) state dicts.

Under ``torchrun --nproc_per_node N`` each process trains on its share of every optimizer step's
micro-batches (see `eagle_lib.drafter.batches.BatchStream`); gradients are averaged across processes, so the run
matches a single process with ``grad_accum * N`` micro-batches. gloo on CPU, nccl on GPU. Checkpoints hold
full, unsharded state dicts keyed by parameter name, so a run resumes under any world size.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys

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
# being the vllm hidden source's wait for a producer's unit (`hidden_states.engine_hidden.PRODUCER_WAIT_S`, which
# is derived from this); NCCL's default (10 min) would abort a job whose producer is merely slow.
PROCESS_GROUP_TIMEOUT_S = 2 * 3600.0


def init(device: torch.device) -> torch.device:
    """Join the process group when under torchrun (timeout `PROCESS_GROUP_TIMEOUT_S`); returns this process's
    device."""
    if not launched():
        return device
    _, _, local = world()
    if device.type == "cuda":
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


def launch(nproc: int, argv: list[str]) -> None:
    """Run ``python -m torch.distributed.run --nproc_per_node nproc <argv>`` and fail loudly if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv]
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"distributed training failed (exit {proc.returncode}): {' '.join(cmd)}")


def shutdown() -> None:
    """Leave the process group together: a rank tearing gloo down while another still talks to it can abort
    (std::terminate in gloo's threads, seen on a loaded 2-core CI box)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
