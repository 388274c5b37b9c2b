"""Stage 06's plots, each saved as PNG beside the tables and returned for the notebook to show once."""

from __future__ import annotations

import pandas as pd

from eagle_lib import report

STYLES = {0.0: "-"}  # greedy solid; sampled temperatures dashed


def _save(fig, ev, name: str):
    return report.save_figure(fig, ev.out_dir / name)


def plot_positions(ev):
    """Per-position acceptance of eagle3 (unconditional, conditional) pooled over datasets, one line per
    temperature (solid T=0, dashed sampled), the n-gram baseline in grey."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    pos = (
        ev.positions
        if len(ev.positions)
        else pd.DataFrame(columns=["method", "temperature", "dataset", "position"])
    )
    pos = pos[pos.dataset == "all"]
    titles = {"acc": "P(draft i accepted)", "cond_acc": "P(draft i accepted | drafts < i accepted)"}
    for ax, (col, title) in zip(axes, titles.items(), strict=True):
        for (m, t), g in pos[pos.method.isin(["eagle3", "ngram"])].groupby(["method", "temperature"]):
            color = "k" if m == "eagle3" else "grey"
            ax.plot(g.position, g[col], marker="o", color=color, ls=STYLES.get(t, "--"), label=f"{m} T={t:g}")
        ax.set(title=title, xlabel="draft position", ylim=(0, 1), xticks=sorted(pos.position.unique()))
    axes[0].set_ylabel("acceptance (all datasets pooled)")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    return _save(fig, ev, "positions.png")


def plot_datasets(ev):
    """tau per dataset for each method x temperature as grouped bars, the server's tau as more bars."""
    import matplotlib.pyplot as plt

    t = pd.DataFrame()
    if len(ev.tau):
        tau = ev.tau.assign(
            col=[f"{m} T={x:g}" for m, x in zip(ev.tau.method, ev.tau.temperature, strict=True)]
        )
        t = tau[tau.method != "none"].pivot(index="dataset", columns="col", values="tau")
    if ev.online is not None and len(t):
        for temp, g in ev.online.groupby("temperature"):
            t[f"eagle3 {g.engine.iloc[0]} T={temp:g}"] = g.set_index("dataset").online_tau
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(t) + 2), 4))
    if len(t):
        t.loc[sorted(t.index, key=lambda d: (d == "all", d))].plot.bar(ax=ax, rot=30)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set(ylabel="tau (accepted + 1 per target step)", xlabel="")
    ax.axhline(1.0, color="grey", lw=0.8)
    return _save(fig, ev, "tau_by_dataset.png")


def plot_context(ev):
    """eagle3's tau by context-length bucket (prompt + generated), one line per temperature, with the number
    of verify steps behind each point."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    c = ev.context[ev.context.method == "eagle3"] if len(ev.context) else pd.DataFrame()
    for t, g in c.groupby("temperature") if len(c) else []:
        g = g[g.steps > 0]
        ax.plot(g.bucket, g.tau, marker="o", color="k", ls=STYLES.get(t, "--"), label=f"eagle3 T={t:g}")
        for b, tau, n in zip(g.bucket, g.tau, g.steps, strict=True):
            ax.annotate(f"{n}", (b, tau), textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
    ax.set(
        xlabel="context length (prompt + generated tokens)",
        ylabel="tau",
        title="tau by context (steps noted)",
    )
    ax.axhline(1.0, color="grey", lw=0.8)
    if len(c):
        ax.legend(fontsize=8)
    return _save(fig, ev, "tau_by_context.png")
