"""Training checkpoints: ``checkpoints/step_NNNNNNN/`` = drafter safetensors + ``trainer.pt`` + ``COMPLETE``.

``trainer.pt`` holds the full (unsharded, name-keyed) optimizer state, the scheduler state, the step, the
settings fingerprint and the log history, so a resumed run continues the same curve under any world size.
``COMPLETE`` is written last: a checkpoint without it (a crash while saving) is ignored.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from eagle_lib import distributed, params
from eagle_lib.drafter import save_state


def drafter_state(model_state: dict) -> dict:
    """TTT-wrapper keys (drafter.*) -> drafter state-dict keys."""
    return {k.removeprefix("drafter."): v for k, v in model_state.items()}


def save(out: Path, model, opt, sched, step: int, fp: str, history: list, config, keep: int):
    """Write checkpoint ``step`` (a collective under FSDP: call on every rank) and prune old ones."""
    model_state, optim_state = distributed.full_state(model, opt)
    if not distributed.is_main():
        return
    ck = out / "checkpoints" / f"step_{step:07d}"
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
    done = sorted(c for c in (out / "checkpoints").glob("step_*") if (c / "COMPLETE").exists())
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old)


def latest(out: Path) -> Path | None:
    done = sorted(c for c in (out / "checkpoints").glob("step_*") if (c / "COMPLETE").exists())
    return done[-1] if done else None


def resume(out: Path, model, opt, sched, fp: str) -> tuple[int, list]:
    """Load the newest complete checkpoint into model/opt/sched; returns (step, history), (0, []) if none."""
    from safetensors.torch import load_file

    ck = latest(out)
    if ck is None:
        return 0, []
    state = torch.load(ck / "trainer.pt", weights_only=False)
    if state["fingerprint"] != fp:
        raise params.ParamsError(
            f"{ck}: checkpoint made with other settings (fingerprint {state['fingerprint']} != {fp}); "
            "set resume: false to start over (old checkpoints are then replaced) or restore the settings"
        )
    weights = {f"drafter.{k}": v for k, v in load_file(str(ck / "model.safetensors")).items()}
    distributed.load_full_state(model, opt, weights, state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return state["step"], state["history"]
