"""Stage 07's plots: tau vs training tokens with the fit and projection band, the dataset-value heatmap and the
regenerated-vs-original bars. Each is saved as PNG under value/ and returned (closed) for the notebook to show."""

from __future__ import annotations

import numpy as np

from eagle_lib import report


def _save(fig, res, name: str):
    return report.save_figure(fig, res.out_dir / name)


def tau_axis(res) -> str:
    """The y label of 07's tau: what it is (`tau_scale.kind`), short."""
    if res.headline.get("tau_source") == "ttt":
        return "tau: teacher-forced argmax chain on sampled text\n(not 06's served tau)"
    return "tau (held-out, offline decoding)"


def plot_curve(res):
    """Measured tau per subset (log x: training tokens; faint lines: per eval set), the fit, its 95% bootstrap
    band out to the largest multiplier, the projections with intervals and the chain limit."""
    import matplotlib.pyplot as plt

    c, total = res.fit, res.total_tokens
    xs = np.geomspace(min(c.x.min(), 1.0) * 0.8, max(c.multipliers + [1.0]) * 1.1, 200)
    lo, hi = c.band(xs)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.fill_between(xs * total, lo, hi, color="tab:blue", alpha=0.2, label="95% bootstrap band")
    ax.plot(
        xs * total,
        c.fit.predict(xs),
        color="tab:blue",
        label=f"fit {c.fit.a:.2f} - {c.fit.b:.2f} x^-{c.fit.c:.2f}",
    )
    for col in [k for k in res.curve.columns if k.startswith("tau_") and k != "tau_all"]:
        ax.plot(
            res.curve.tokens, res.curve[col], lw=0.8, alpha=0.45, marker="."
        )  # one faint line per eval set
    ax.plot(c.x * total, c.tau, "ko", label="measured, all eval sets (faint: per eval set)")
    for r in res.projections[res.projections.row == "projection"].itertuples():
        if r.multiplier > 1:
            ax.errorbar(
                r.tokens, r.tau, yerr=[[r.tau - r.lo], [r.hi - r.tau]], fmt="s", color="tab:orange", capsize=3
            )
            ax.annotate(
                f"{r.multiplier:g}x: {r.tau:.2f}",
                (r.tokens, r.tau),
                textcoords="offset points",
                xytext=(4, -12),
                fontsize=8,
            )
    ax.axhline(c.cap, color="grey", ls="--", lw=0.8, label=f"chain limit {c.cap:g}")
    ax.axvline(total, color="grey", ls=":", lw=0.8)
    ax.set(xscale="log", xlabel="training tokens (05's data = dotted line)", ylabel=tau_axis(res))
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, res, "curve.png")


def plot_heatmap(res):
    """Value of each left-out unit (rows) for each eval set (columns): tau(with) - tau(without); cells whose
    interval includes zero are greyed and marked '~'."""
    import matplotlib.pyplot as plt

    if not len(res.lodo):
        return None
    v = res.lodo.pivot(index="unit", columns="eval", values="value")
    m = res.lodo.pivot(index="unit", columns="eval", values="measurable").astype(bool)
    order = list(res.ranked.unit)
    v, m = v.loc[order], m.loc[order]
    lim = float(np.nanmax(np.abs(v.values))) or 1.0
    fig, ax = plt.subplots(figsize=(1.0 * v.shape[1] + 3, 0.5 * v.shape[0] + 1.8))
    im = ax.imshow(np.where(m.values, v.values, np.nan), cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    ax.imshow(np.where(m.values, np.nan, 0.0), cmap="Greys", vmin=-1, vmax=4, aspect="auto")
    for i in range(v.shape[0]):
        for j in range(v.shape[1]):
            ax.text(
                j,
                i,
                f"{v.values[i, j]:+.2f}" + ("" if m.values[i, j] else "~"),
                ha="center",
                va="center",
                fontsize=7,
            )
    ax.set_xticks(range(v.shape[1]), v.columns, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(v.shape[0]), v.index, fontsize=8)
    ax.set(
        xlabel="eval dataset",
        ylabel="left-out unit",
        title="tau(with) - tau(without), equal tokens (~: not measurable)",
    )
    fig.colorbar(im, ax=ax, shrink=0.8)
    return _save(fig, res, "value_heatmap.png")


def plot_regen(res):
    """tau per eval set when trained on the regenerated vs the original responses (equal tokens), with the
    paired interval of the difference as error bars on the regenerated bar."""
    import matplotlib.pyplot as plt

    r = res.regen
    if not len(r):
        return None
    x = np.arange(len(r))
    fig, ax = plt.subplots(figsize=(0.8 * len(r) + 3, 4))
    ax.bar(x - 0.2, r.tau_original, 0.4, label="original responses", color="tab:grey")
    err = [r["diff"] - r.lo, r.hi - r["diff"]]
    ax.bar(
        x + 0.2,
        r.tau_regenerated,
        0.4,
        yerr=err,
        capsize=3,
        label="regenerated (interval of the difference)",
        color="tab:green",
    )
    ax.set_xticks(x, r["eval"], rotation=30, ha="right")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel=tau_axis(res), title="regenerated vs original responses, equal tokens")
    ax.legend(fontsize=8)
    return _save(fig, res, "regen_vs_original.png")


def plot_multiturn(res):
    """tau per eval set (first-turn prompts <dataset>, later-turn prompts <dataset>:later, pooled "later",
    "all") of the single-turn vs the multi-turn regeneration drafter at equal tokens; error bars: the paired
    interval of the difference, on the multi-turn bar."""
    import matplotlib.pyplot as plt

    r = res.multiturn
    if not len(r) or "tau_multi_turn" not in r:
        return None
    r = r[r["tau_multi_turn"].notna()]
    x = np.arange(len(r))
    fig, ax = plt.subplots(figsize=(0.8 * len(r) + 3, 4))
    ax.bar(x - 0.2, r.tau_single_turn, 0.4, label="first turn only (single-turn)", color="tab:grey")
    err = np.nan_to_num(np.array([r["diff"] - r.lo, r.hi - r["diff"]], dtype=float))
    ax.bar(x + 0.2, r.tau_multi_turn, 0.4, yerr=err, capsize=3, color="tab:purple",
           label="every turn (each_turn; interval of the difference)")  # fmt: skip
    ax.set_xticks(x, r["eval"], rotation=30, ha="right")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel=tau_axis(res), title="multi-turn vs single-turn regeneration, equal tokens")
    ax.legend(fontsize=8)
    return _save(fig, res, "multiturn_vs_single.png")
