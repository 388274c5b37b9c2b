"""Stage 05 report pieces for the notebook: curves, vocab coverage, acc table, exports, headline numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from eagle_lib import models, store


def _drafter_dir(cfg) -> Path:
    return cfg.out("drafter")


def curves(cfg):
    """Figure: weighted loss, per-step loss and acc_k over optimizer steps (from train_log.jsonl)."""
    import matplotlib.pyplot as plt

    log = store.read_jsonl(_drafter_dir(cfg) / "train_log.jsonl")
    steps = [r["step"] for r in log]
    k = len(log[0]["acc_k"]) if log else 0
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [r["loss"] for r in log])
    axes[0].set(title="TTT loss (decay-weighted)", xlabel="step")
    for i in range(k):
        axes[1].plot(steps, [r["loss_k"][i] for r in log], label=f"step {i}")
        axes[2].plot(steps, [r["acc_k"][i] for r in log], label=f"acc_{i}")
    axes[1].set(title="loss per TTT step", xlabel="step")
    axes[2].set(title="acc per TTT step (train micro-batches)", xlabel="step", ylim=(0, 1))
    axes[2].legend(fontsize="small", ncol=2)
    fig.tight_layout()
    plt.close(fig)
    return fig


def vocab_coverage(cfg, summary: dict):
    """Figure: share of label tokens covered by the top-n draft vocab, n up to V, with the chosen N marked."""
    import matplotlib.pyplot as plt
    from safetensors.torch import load_file

    path = _drafter_dir(cfg) / "vocab" / f"vocab-{summary['vocab']['key']}.safetensors"
    counts = load_file(str(path))["counts"].numpy()
    cum = np.cumsum(np.sort(counts)[::-1]) / max(1, counts.sum())
    n = cfg.stage.draft_vocab_size
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(1, len(cum) + 1), cum)
    ax.axvline(n, color="k", ls="--")
    ax.set(
        xscale="log",
        xlabel="draft vocab size n",
        ylabel="label-token coverage",
        title=f"coverage at N={n}: {summary['vocab']['coverage']:.4f} (V={len(counts)})",
    )
    fig.tight_layout()
    plt.close(fig)
    return fig


def acc_table(summary: dict) -> pd.DataFrame:
    """Per TTT step: final-step train acc, held-out acc / cond_acc / loss."""
    held = summary.get("heldout") or {}
    k = len(summary["final_train_acc_k"])
    return pd.DataFrame(
        {
            "ttt_step": range(k),
            "train_acc": summary["final_train_acc_k"],
            "heldout_acc": held.get("acc", [np.nan] * k),
            "heldout_cond_acc": held.get("cond_acc", [np.nan] * k),
            "heldout_loss": held.get("loss", [np.nan] * k),
        }
    ).set_index("ttt_step")


def export(cfg) -> pd.DataFrame:
    """Write drafter/export/{sglang,speculators} from final/ with eagle_lib.serving.export; table of the paths."""
    from transformers import AutoConfig

    from eagle_lib.drafter.model import load_drafter
    from eagle_lib.serving import export as exporter

    p = cfg.stage
    model = load_drafter(_drafter_dir(cfg) / "final")
    verifier = models.resolve(cfg.shared.target)
    arch = AutoConfig.from_pretrained(verifier, trust_remote_code=cfg.shared.trust_remote_code).architectures
    paths = exporter.export_all(
        model,
        _drafter_dir(cfg) / "export",
        verifier,
        list(arch or []),
        p.num_speculative_tokens,
        p.export_dtype,
    )
    return pd.DataFrame(
        [
            {"format": k, "path": str(v), "files": sorted(f.name for f in Path(v).iterdir())}
            for k, v in paths.items()
        ]
    )


def headline(summary: dict) -> dict:
    """The numbers report.record keeps."""
    if "stopped_at_step" in summary:
        raise RuntimeError(
            f"training stopped at step {summary['stopped_at_step']} of {summary['total_steps']} "
            "(stop_after_steps); run the stage again to resume"
        )
    held = summary.get("heldout") or {}
    return {
        "steps": summary["steps"],
        "ttt_steps": summary["ttt_steps"],
        "train_sequences": summary["train_sequences"],
        "heldout_sequences": summary["heldout_sequences"],
        "train_tokens": summary["train_tokens"],
        "tokens_per_s": summary["tokens_per_s"],
        "final_train_loss": summary["final_train_loss"],
        "heldout_acc_0": (held.get("acc") or [None])[0],
        "heldout_acc_k": held.get("acc"),
        "heldout_cond_acc_k": held.get("cond_acc"),
        "heldout_sim_tau": held.get("sim_tau"),
        "heldout_chain_tau": held.get("chain_tau"),
        "baseline_acc_majority_token": summary["vocab"]["majority_share"],
        "vocab_coverage": summary["vocab"]["coverage"],
    }
