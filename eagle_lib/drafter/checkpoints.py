"""Training checkpoints: ``checkpoints/<fingerprint>/step_NNNNNNN/`` = drafter safetensors + ``trainer.pt``
+ ``COMPLETE``.

Each settings fingerprint (`eagle_lib.train.fingerprint`) has its own directory: a run with changed settings
starts fresh beside the old checkpoints (nothing is deleted), and going back to earlier settings resumes them.
``trainer.pt`` holds the full (unsharded, name-keyed) optimizer state, the scheduler state, the step, the
settings fingerprint and the log history, so a resumed run continues the same curve under any world size.
``COMPLETE`` is written last: a checkpoint without it (a crash while saving) is ignored.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from eagle_lib.drafter import distributed
from eagle_lib.drafter.model import save_state


def drafter_state(model_state: dict) -> dict:
    """TTT-wrapper keys (drafter.*) -> drafter state-dict keys."""
    return {k.removeprefix("drafter."): v for k, v in model_state.items()}


def save(out: Path, model, opt, sched, step: int, fp: str, history: list, config, keep: int):
    """Write checkpoint ``step`` (a collective under FSDP: call on every rank) and prune old ones."""
    model_state, optim_state = distributed.full_state(model, opt)
    if not distributed.is_main():
        return
    ck = directory(out, fp) / f"step_{step:07d}"
    if ck.exists():
        shutil.rmtree(ck)
    save_state(drafter_state(model_state), config, ck, {"step": step, "fingerprint": fp})
    torch.save(
        {
            "optimizer": optim_state,
            "scheduler": sched.state_dict(),
            "step": step,
            "fingerprint": fp,
            "history": history,
        },
        ck / "trainer.pt",
    )
    (ck / "COMPLETE").write_text(str(step))
    done = complete(out, fp)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old)


def directory(out: Path, fp: str) -> Path:
    """Where the checkpoints of one settings fingerprint live."""
    return out / "checkpoints" / fp


def complete(out: Path, fp: str) -> list[Path]:
    """Complete checkpoints of these settings, oldest first."""
    return sorted(c for c in directory(out, fp).glob("step_*") if (c / "COMPLETE").exists())


def resume(out: Path, model, opt, sched, fp: str) -> tuple[int, list]:
    """Load the newest complete checkpoint into model/opt/sched; returns (step, history), (0, []) if none."""
    from safetensors.torch import load_file

    done = complete(out, fp)
    if not done:
        return 0, []
    ck = done[-1]
    state = torch.load(ck / "trainer.pt", weights_only=False)
    if state["fingerprint"] != fp:
        raise ValueError(f"{ck / 'trainer.pt'}: fingerprint {state['fingerprint']} in the directory of {fp}")
    weights = {f"drafter.{k}": v for k, v in load_file(str(ck / "model.safetensors")).items()}
    distributed.load_full_state(model, opt, weights, state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return state["step"], state["history"]
