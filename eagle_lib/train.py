"""Stage 05: train an EAGLE-3 drafter on A records + B responses with the target's hidden states.

Writes ``run_dir/drafter/``: ``vocab/`` (cached draft-vocab maps), ``checkpoints/<fingerprint>/step_NNNNNNN/``
(drafter and optimizer safetensors + ``trainer.json`` with scheduler and log history; ``COMPLETE`` last),
``train_log.jsonl`` (one line per optimizer step; every ``measure_every`` steps also the acceptance measured by
decoding held-out prompts, `eagle_lib.drafter.measure`), ``final/`` (`eagle_lib.drafter.model.load_drafter` reads it;
``summary.json`` beside the weights), ``export/{sglang,speculators}/`` (`eagle_lib.drafter.export`), ``summary.json``
and ``meta.json``.

A rerun with ``resume: true`` continues from the newest complete checkpoint of the same settings; the data
order is a pure function of (seed, step), so the resumed loss curve equals an uninterrupted one.
``nproc_per_node > 1`` relaunches this module under torchrun (DDP or FSDP, `eagle_lib.distributed`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle_lib import params, store
from eagle_lib.drafter import recipe
from eagle_lib.drafter.recipe import Params  # noqa: F401  (this stage's params model: params.STAGES reads it)

STAGE = "05_train_eagle3"


def fingerprint(cfg: params.StageConfig) -> str:
    return recipe.fingerprint(cfg.stage, cfg.shared)


def run(cfg: params.StageConfig) -> dict:
    """Train (or resume), write drafter/ (final weights, exports, summary, meta) and return the summary;
    relaunches itself under torchrun when asked. The loop is `eagle_lib.drafter.trainer`, imported here so
    that validating params never imports torch."""
    from eagle_lib import distributed
    from eagle_lib.drafter import trainer

    p = cfg.stage
    if (p.nproc_per_node > 1 or p.nnodes > 1) and not distributed.launched():
        out = cfg.out("drafter")
        out.mkdir(parents=True, exist_ok=True)
        spec = out / "launch.json"
        store.write_json(
            spec, {"run_dir": str(cfg.run_dir), "shared": cfg.shared.model_dump(), "stage": p.model_dump()}
        )
        (out / "summary.json").unlink(missing_ok=True)
        distributed.launch(p.nproc_per_node, ["-m", "eagle_lib.train", str(spec)], p.nnodes, p.rdzv_endpoint,
                           f"eagle3-{fingerprint(cfg)[:12]}", out / "TORCHRUN")  # fmt: skip
        done = out / "summary.json"
        return store.read_json(done if done.exists() else out / "stopped.json")
    return trainer.train(cfg, fingerprint(cfg))


def build(cfg: params.StageConfig, device):
    """Sequences, hidden source and a drafter initialised from the target (`trainer.build`; used by tests)."""
    from eagle_lib.drafter import trainer

    return trainer.build(cfg, device, fingerprint(cfg))


def main(argv: list[str]) -> None:
    """torchrun entry: ``python -m eagle_lib.train <drafter/launch.json>``."""
    spec = json.loads(Path(argv[0]).read_text())
    cfg = params.StageConfig(
        STAGE, Path(spec["run_dir"]), params.SharedParams(**spec["shared"]), Params(**spec["stage"])
    )
    from eagle_lib.drafter import trainer

    trainer.train(cfg, fingerprint(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
