"""Stage 05 report pieces for the notebook: answer, curves, measured tau, vocab coverage, acc table, exports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from eagle_lib import store


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


def gap_table(summary: dict) -> pd.DataFrame:
    """Train/decode gap per draft position: teacher-forced held-out acceptance vs measured by drafting."""
    m, held = summary.get("measured") or {}, summary.get("heldout") or {}
    acc = m.get("final_acc") or []
    rows = []
    for i, a in enumerate(acc):
        prev = acc[i - 1] if i else 1.0
        tf = held.get("cond_acc") or []
        rows.append(
            {
                "draft_position": i + 1,
                "teacher_forced_cond_acc": tf[i] if i < len(tf) else np.nan,
                "measured_cond_acc": a / prev if prev else np.nan,
                "measured_acc": a,
            }
        )
    return pd.DataFrame(rows).set_index("draft_position") if rows else pd.DataFrame()


def confidence_table(summary: dict) -> pd.DataFrame:
    """The first draft's held-out labels and misses per bin of the target's own top-1 probability there."""
    rows = (summary.get("heldout") or {}).get("by_target_confidence") or []
    shown = [{k: v for k, v in r.items() if k != "p_top1_below"} for r in rows]
    return pd.DataFrame(shown).set_index("target_p_top1") if rows else pd.DataFrame()


def hesitant_miss_share(summary: dict, below: float = 0.5) -> float | None:
    """Share of the first draft's held-out misses where the target's top-1 probability is under ``below``."""
    rows = (summary.get("heldout") or {}).get("by_target_confidence") or []
    return sum(r["miss_share"] for r in rows if r["p_top1_below"] <= below and r["labels"]) if rows else None


def export_table(summary: dict) -> pd.DataFrame:
    """The exports `eagle_lib.train.run` wrote (drafter/export/{sglang,speculators}): format, path, files."""
    return pd.DataFrame(
        [
            {"format": k, "path": v, "files": sorted(f.name for f in Path(v).iterdir())}
            for k, v in summary.get("exports", {}).items()
        ]
    )


def measured_curve(cfg):
    """Figure: measured tau (held-out prompts decoded during training) against steps and wall minutes."""
    import matplotlib.pyplot as plt

    log = [r for r in store.read_jsonl(_drafter_dir(cfg) / "train_log.jsonl") if "measured_tau" in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    if not log:
        for ax in axes:
            ax.text(0.5, 0.5, "no measurement (measure_every: 0 or no target in process)", ha="center")
        plt.close(fig)
        return fig
    k = len(log[0]["measured_acc"])
    tau = [r["measured_tau"] for r in log]
    axes[0].plot([r["step"] for r in log], tau, marker="o")
    axes[0].set(title=f"measured tau ({k} drafts, held-out prompts)", xlabel="optimizer step", ylabel="tau")
    axes[1].plot([r["elapsed_s"] / 60 for r in log], tau, marker="o")
    axes[1].set(title="measured tau against training time", xlabel="wall minutes (steps + measurements)")
    for ax in axes:
        ax.axhline(k + 1, color="k", ls=":", lw=1)
        ax.set_ylim(1, k + 1.1)
    fig.tight_layout()
    plt.close(fig)
    return fig


def answer(summary: dict):
    """The report's answer, displayed as Markdown (bold), from `answer_text`."""
    from IPython.display import Markdown

    return Markdown(f"**{answer_text(summary)}**")


def _cpu(summary: dict) -> str:
    """ ", 4.1 CPU-min" when the summary has this process's CPU time (the load-independent cost on CPU)."""
    return f", {summary['cpu_s'] / 60:.1f} CPU-min" if summary.get("cpu_s") else ""


def answer_text(summary: dict) -> str:
    """The report's first sentence: held-out acc_0, measured tau and the budget it took."""
    if "stopped_at_step" in summary:
        return (
            f"Training stopped at step {summary['stopped_at_step']} of {summary['total_steps']} "
            "(stop_after_steps): run the stage again to resume."
        )
    held = summary.get("heldout") or {}
    acc0 = (held.get("acc") or [float("nan")])[0]
    m = summary.get("measured") or {}
    if "final_tau" in m:
        minutes = m["elapsed_s"] / 60
        tau = (
            f"measured tau {m['final_tau']:.2f} at {m['drafts']} drafts after {summary['steps']} steps "
            f"({minutes:.1f} min wall{_cpu(summary)}; best {m['best_tau']:.2f} at step {m['best_step']}, "
            f"final weights from step {m['final_weights_step']})"
        )
    else:
        tau = f"tau not measured during training ({m.get('skipped', 'measure_every: 0')}; 06 measures it)"
    hes = hesitant_miss_share(summary)
    why = (
        f" {hes:.0%} of the first draft's held-out misses are where the target itself puts under 0.5 on its "
        "top token (the draft must match its near-tie order there)."
        if hes is not None and hes == hes
        else ""
    )
    mass = held.get("served_vocab_mass") or {}
    served = "".join(
        f" At {t} the draft vocab holds {v:.3f} of the target's sampling distribution on held-out labels: no "
        "probabilistic draft is accepted more often than that."
        for t, v in mass.items()
    )
    for t, per in (held.get("served_acceptance") or {}).items():
        low = [r for r in held.get("by_target_confidence") or [] if r["labels"] and r["p_top1_below"] <= 0.3]
        where = (
            f", {low[0][f'alpha_{t}']:.2f} where the target's top-1 is under 0.3 ({low[0]['share']:.0%} of the labels)"
            if low and f"alpha_{t}" in low[0]
            else ""
        )
        served += (
            f" At {t} a probabilistic draft is accepted " + " / ".join(f"{a:.2f}" for a in per)
            + f" at draft positions 1..{len(per)}, teacher-forced{where}; decoding accepts less, since weak "
            "positions come in stretches that fill the cycles (06 measures it)."
        )  # fmt: skip
    return (
        f"Held-out acc_0 {acc0:.2f} (teacher-forced; majority-token baseline "
        f"{summary['vocab']['majority_share']:.2f}), {tau}, draft vocab coverage "
        f"{summary['vocab']['coverage']:.3f} of the label tokens.{why}{served}"
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
        # per served T > 0: the draft vocab's share of the target's sampling distribution on held-out labels, the
        # ceiling of a probabilistic draft's acceptance rate
        "heldout_served_vocab_mass": held.get("served_vocab_mass") or None,
        # per served T > 0: the teacher-forced acceptance of a probabilistic draft (sum min(p, q)) per draft position
        "heldout_served_acceptance": held.get("served_acceptance") or None,
        "measured_tau": (summary.get("measured") or {}).get("final_tau"),
        "measured_best_tau": (summary.get("measured") or {}).get("best_tau"),
        "measured_elapsed_s": (summary.get("measured") or {}).get("elapsed_s"),
        "heldout_miss_share_target_p_below_0.5": hesitant_miss_share(summary),
    }


def budget_table(cfg, summary: dict):
    """Memory per rank, hidden-state bytes and 05's time at the seeds' scale (`eagle_lib.drafter.budget`)."""
    import pandas as pd

    from eagle_lib import models
    from eagle_lib.drafter import budget

    hf = models.load_config(cfg.shared.target, **models.hub_kwargs(cfg.shared))
    return pd.DataFrame(budget.stage05_rows(hf, cfg.stage, summary), columns=["what", "estimate"])


def label_tokens_table(cfg):
    """Label tokens per dataset x sequence length: trained, held out, cut past max_seq_len, dropped (05's meta)."""
    import pandas as pd

    rows = store.read_json(cfg.out("drafter", "meta.json")).get("label_tokens") or []
    return (
        pd.DataFrame(rows)
        if rows
        else pd.DataFrame([{"label_tokens": "not recorded (a 05 older than the table)"}])
    )
