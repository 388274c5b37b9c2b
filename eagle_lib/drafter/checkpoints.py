"""Training checkpoints: ``checkpoints/<fingerprint>/step_NNNNNNN/`` = drafter ``model.safetensors`` +
``optimizer.safetensors`` + ``trainer.json`` + ``COMPLETE``.

Each settings fingerprint (`eagle_lib.train.fingerprint`) has its own directory: a run with changed settings
starts fresh beside the old checkpoints (nothing is deleted), and going back to earlier settings resumes them.
The optimizer state is full (unsharded, name-keyed): its tensors go to ``optimizer.safetensors`` under
``<param name>/<field>`` keys, everything else (param groups, non-tensor state, the scheduler state, the step,
the settings fingerprint and the log history) to ``trainer.json``, so a resumed run continues the same curve
under any world size and nothing in a run directory is unpickled. ``COMPLETE`` is written last: a checkpoint
without it (a crash while saving, or one written in the older ``trainer.pt`` layout) is ignored.
``best_measured/`` beside the steps holds the drafter with the highest measured tau so far
(``final_checkpoint: best_measured``). `export_final` writes the serving exports of ``final/``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle_lib import distributed, store
from eagle_lib.drafter.model import WEIGHTS_FILE, load_drafter, save_state

OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_FILE = "trainer.json"
BEST = "best_measured"


def state_digest(state: dict) -> str:
    """sha256 of a state dict's tensors (names, dtypes, shapes and bytes, in name order): two runs with the same
    digest ended on the same bits (the safetensors files also carry a summary with times, so their bytes differ)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def drafter_state(model_state: dict) -> dict:
    """TTT-wrapper keys (drafter.*) -> drafter state-dict keys."""
    return {k.removeprefix("drafter."): v for k, v in model_state.items()}


def split_optimizer(optim_state: dict) -> tuple[dict, dict]:
    """(tensors keyed ``name/field``, JSON rest) of a name-keyed optimizer state dict."""
    import torch

    tensors, rest = {}, {}
    for name, fields in optim_state["state"].items():
        for f, v in fields.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{name}/{f}"] = v.detach().contiguous().cpu()
            else:
                rest.setdefault(str(name), {})[f] = v
    return tensors, {"param_groups": optim_state["param_groups"], "scalars": rest}


def join_optimizer(tensors: dict, meta: dict) -> dict:
    """Inverse of `split_optimizer` (param names contain dots, never ``/``)."""
    state: dict = {}
    for key, v in tensors.items():
        name, f = key.rsplit("/", 1)
        state.setdefault(name, {})[f] = v
    for name, fields in meta["scalars"].items():
        state.setdefault(name, {}).update(fields)
    return {"state": state, "param_groups": meta["param_groups"]}


def save(out: Path, model, opts: list, scheds: list, step: int, fp: str, history: list, config, keep: int,
         world: int = 1):  # fmt: skip
    """Write checkpoint ``step`` (a collective under FSDP: call on every rank) and prune old ones. ``opts``:
    the optimizers (one state, keyed by parameter name); ``scheds``: their schedules, which step together."""
    from safetensors.torch import save_file

    model_state, optim_state = distributed.full_state(model, opts)
    if not distributed.is_main():
        return
    ck = directory(out, fp) / f"step_{step:07d}"
    if ck.exists():
        shutil.rmtree(ck)
    save_state(drafter_state(model_state), config, ck, {"step": step, "fingerprint": fp})
    tensors, meta = split_optimizer(optim_state)
    save_file(tensors, str(ck / OPTIMIZER_FILE))
    trainer = {"optimizer": meta, "scheduler": scheds[0].state_dict(), "step": step, "fingerprint": fp,
               "world_size": world}  # fmt: skip
    store.write_json(ck / TRAINER_FILE, {**trainer, "history": history})
    (ck / "COMPLETE").write_text(str(step))
    done = complete(out, fp)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old)


def directory(out: Path, fp: str) -> Path:
    """Where the checkpoints of one settings fingerprint live."""
    return out / "checkpoints" / fp


def complete(out: Path, fp: str) -> list[Path]:
    """Complete checkpoints of these settings, oldest first."""
    return sorted(
        c
        for c in directory(out, fp).glob("step_*")
        if (c / "COMPLETE").exists() and (c / TRAINER_FILE).exists()
    )


class ResumeError(ValueError):
    """A checkpoint that this run cannot continue exactly (message names the checkpoint and why)."""


def resume(out: Path, model, opts: list, scheds: list, fp: str, world: int = 1) -> tuple[int, list]:
    """Load the newest complete checkpoint into model/opts/scheds; returns (step, history), (0, []) if none.
    Refuses a checkpoint written by another number of processes: a step takes world x grad_accum micro-batches,
    so the data order and the step count would change silently (start over, or resume with its world size)."""
    from safetensors.torch import load_file

    done = complete(out, fp)
    if not done:
        return 0, []
    ck = done[-1]
    state = json.loads((ck / TRAINER_FILE).read_text())
    if state["fingerprint"] != fp:
        raise ValueError(f"{ck / TRAINER_FILE}: fingerprint {state['fingerprint']} in the directory of {fp}")
    if state.get("world_size", world) != world:  # checkpoints older than the key: their world is not known
        raise ResumeError(
            f"{ck / TRAINER_FILE}: written by {state['world_size']} processes, resumed by {world}: each step "
            f"would take other micro-batches (resume with nproc_per_node {state['world_size']}, or resume: false)"
        )
    weights = {f"drafter.{k}": v for k, v in load_file(str(ck / WEIGHTS_FILE)).items()}
    optim = join_optimizer(load_file(str(ck / OPTIMIZER_FILE)), state["optimizer"])
    distributed.load_full_state(model, opts, weights, optim)
    for s in scheds:
        s.load_state_dict(state["scheduler"])
    return state["step"], state["history"]


def save_best(out: Path, fp: str, state: dict, config, step: int, tau: float) -> Path:
    """Replace ``best_measured/`` with this drafter state (measured tau ``tau`` after ``step``)."""
    best = directory(out, fp) / BEST
    (best / "COMPLETE").unlink(missing_ok=True)
    save_state(state, config, best, {"step": step, "measured_tau": tau, "fingerprint": fp})
    (best / "COMPLETE").write_text(str(step))
    return best


def load_best(out: Path, fp: str, drafter) -> int | None:
    """Load ``best_measured/`` into ``drafter``; returns its step (None when there is none)."""
    best = directory(out, fp) / BEST
    if not (best / "COMPLETE").exists():
        return None
    saved = load_drafter(best, device=next(drafter.parameters()).device)
    drafter.load_state_dict(saved.state_dict())
    return int((best / "COMPLETE").read_text())


def export_final(cfg, out: Path) -> dict[str, str]:
    """drafter/export/{sglang,speculators} from final/ (`eagle_lib.drafter.export`); format -> path."""
    from eagle_lib import models
    from eagle_lib.drafter import export

    p, verifier = cfg.stage, models.resolve(cfg.shared.target)
    arch = models.load_config(cfg.shared.target, **models.hub_kwargs(cfg.shared)).architectures
    paths = export.export_all(
        load_drafter(out / "final"),
        out / "export",
        verifier,
        list(arch or []),
        p.num_speculative_tokens,
        p.export_dtype,
    )
    return {fmt: str(path) for fmt, path in paths.items()}
