"""Stage 04, what the notebook shows besides the tables: the verdicts and the figures.

Verdicts: one row per failed check, naming the measured value, the params threshold and what to do.
Figures: length ECDFs with the generation limit marked, truncation rates, token contributions. Each saves one
PNG and returns the (closed) figure, which a notebook displays inline. Curves are drawn from at most `POINTS`
quantiles per dataset, so a figure costs the same for 1,000 or 10,000,000 samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from eagle_lib import report

if TYPE_CHECKING:
    from eagle_lib.length_study.scan import Lengths
    from eagle_lib.length_study.settings import Params

POINTS = 512  # quantiles drawn per ECDF curve

# ---------------------------------------------------------------- verdicts


COLUMNS = ["level", "kind", "dataset", "check", "value", "threshold", "message"]


def _live_checks(name: str, est: dict, p: Params) -> list[tuple]:
    """Truncation and short-response verdicts of a dataset in progress, from its censoring-aware interval.

    warn: the whole interval is over the threshold, or the point estimate (the lognormal fit, see
    `censored.estimate`) is over it while the interval is not yet: "undetermined yet, likely over the threshold"
    (acting now is cheaper than after the run); undetermined yet: the threshold lies inside the interval and the
    estimate is under it; nothing: the interval is below it.
    """
    out, moving = (
        [],
        f"{est['in_flight']} in flight, {est['not_started']} not started, {est['finished']} finished",
    )
    for check, key, thr, what, fix in (
        ("truncation", "share_at_limit", p.max_limit_share, "will end at the limit", "raise max_new_tokens"),
        (
            "many_short",
            "share_short",
            p.max_short_share,
            f"have under {p.short_tokens} completion tokens",
            "",
        ),
    ):
        point, lo, hi = est[key]
        if not np.isfinite(point) or hi <= thr:
            continue
        level = "warn" if lo > thr or point > thr else "undetermined"
        verdict, advice = "", f": {fix}" if fix else ""
        if lo <= thr < point:  # the estimate is over it, the interval not yet
            verdict, advice = (
                "undetermined yet, likely over the threshold: ",
                f": if it holds, {fix}" if fix else "",
            )
        elif level == "undetermined" and check == "truncation" and est.get("outlived", (0.0,))[0] > thr:
            share, p90 = est["outlived"]  # more of the run than the threshold is still running past the bulk
            level, verdict, advice = (
                "warn",
                (
                    f"undetermined yet, a long tail is forming ({share:.0%} of the started requests are still running "
                    f"past {p90:.0f} tokens, longer than 90% of the finished ones): "
                ),
                f": if the tail reaches the limit, {fix}",
            )
        elif level == "undetermined":
            verdict, advice = "undetermined yet: ", ""
        model = est.get("point_model", "")
        source = " by the lognormal fit" if model.startswith("lognormal") else ""
        out.append((level, "B", name, check, point,
                    thr, f"{verdict}{point:.1%} of the final samples {what}{source} (95% interval {lo:.1%}-{hi:.1%}; "
                    f"threshold {thr:.0%}; {moving}){advice}"))  # fmt: skip
    return out


def _dataset_checks(row, peers: float, p: Params) -> list[tuple[str, float, float, bool, str]]:
    """(check, value, threshold, failed, message) for one row of the length table; peers = others' median."""
    n, lim, med, p99, at = row["n"], row["limit"], row["median"], row["p99"], row["share_at_limit"]
    fix = (
        "raise max_new_tokens" if row["kind"] == "B" else "raise 01's max_seq_len or accept cut conversations"
    )
    p99_at, low_median, short = p.p99_limit_fraction * lim, p.min_median_ratio * peers, row["share_short"]
    return [
        ("truncation", at, p.max_limit_share, at > p.max_limit_share,
         f"{row['n_at_limit']} of {n} samples ({at:.1%}) ended at the limit{f' {lim}' if lim else ''}, "
         f"{row['n_at_limit_unclosed']} of them with no end-of-thinking token (threshold "
         f"{p.max_limit_share:.0%}): {fix}"),
        ("reasoning_p99_at_limit", p99, p99_at,
         bool(row["kind"] == "B" and lim and row["reasoning_dataset"] and p99 >= p99_at),
         f"reasoning dataset ({row['share_reasoning']:.0%} of samples think): p99 completion {p99:.0f} "
         f"reaches {p.p99_limit_fraction:.0%} of max_new_tokens {lim}: long reasoning is cut, raise max_new_tokens"),
        ("median_far_below_peers", med, low_median, bool(np.isfinite(peers) and med < low_median),
         f"median completion {med:.0f} tokens is below {p.min_median_ratio:.0%} of the median of the other "
         f"datasets' medians ({peers:.0f})"),
        ("many_short", short, p.max_short_share, short > p.max_short_share,
         f"{short:.1%} of samples have under {p.short_tokens} completion tokens (threshold "
         f"{p.max_short_share:.0%}); the longest 10% hold {row['top_decile_token_share']:.0%} of the tokens"),
        ("empty_completions", row["n_empty"], 0, row["n_empty"] > 0,
         f"{row['n_empty']} of {n} samples have no completion tokens"),
        ("other_finish_reason", row["share_other"], 0, row["share_other"] > 0,
         f"{row['share_other']:.1%} of samples finished neither by stop nor by length"),
    ]  # fmt: skip


def verdicts(completion: pd.DataFrame, proj: pd.DataFrame, lengths: list[Lengths], p: Params,
             think_id: int | None, max_new_tokens: int = 0, estimates: dict | None = None) -> pd.DataFrame:  # fmt: skip
    """The warnings table: each row names the check, the measured value, its threshold and a message.

    For a B dataset in progress with 03's ledger (`estimates`), truncation and short responses are judged on
    the censoring-aware interval of the final dataset, not on the finished responses.
    """
    out, estimates = [], estimates or {}
    comp = proj[proj.tokens == "completion"] if "tokens" in proj else proj
    unfinished = set(comp.dataset[comp.status != "complete"]) if len(comp) else set()
    medians = completion.set_index(["kind", "dataset"])["median"].dropna()
    for ls, (_, row) in zip(lengths, completion.iterrows(), strict=True):
        others = medians.drop((row["kind"], row["dataset"]), errors="ignore")
        peers = float(np.median(others)) if len(others) and row["n"] else np.nan
        live = estimates.get(ls.name) if ls.kind == "B" else None
        skip = {"truncation", "many_short"} if live else set()
        out += [("warn", ls.kind, ls.name, *c[:3], c[4]) for c in _dataset_checks(row, peers, p) if c[3]
                and c[0] not in skip]  # fmt: skip
        out += _live_checks(ls.name, live, p) if live else []
        if live and ls.restarted:
            out.append(("warn", "B", ls.name, "restarted_in_flight", ls.restarted, 0, f"{ls.restarted} request(s) in "
                        "flight were started again (03 interrupted and resumed, or retried): the time of their earlier "
                        "attempt is not counted, so until they finish the estimate leans short (the interval too)"))  # fmt: skip
        if ls.kind == "B" and not ls.ledger and ls.name in unfinished:
            out.append(("warn", "B", ls.name, "no_ledger", row["n"], 0, "03 kept no ledger of started requests "
                        "(a run made before it did): mid-run estimates count finished responses only and may be "
                        "biased towards short ones"))  # fmt: skip
        seen = sorted(ls.limits)
        if ls.kind == "B" and max_new_tokens and seen and seen != [max_new_tokens]:
            out.append(("warn", ls.kind, ls.name, "limit_mismatch", seen[-1], max_new_tokens,
                        f"responses were generated with max_new_tokens {seen}, params say {max_new_tokens}"))  # fmt: skip
        if ls.torn or ls.duplicates:
            out.append(("info", ls.kind, ls.name, "skipped_lines", ls.torn + ls.duplicates, 0,
                        f"skipped {ls.torn} torn line(s) (a write in progress or an interrupted one"
                        + (f": {', '.join(ls.torn_at)}" if ls.torn_at else "")
                        + f") and {ls.duplicates} repeated id(s) (the first record of an id counts)"))  # fmt: skip
    for _, r in proj[proj.tokens == "completion"].iterrows():
        if r["too_few_to_project"]:
            out.append(("warn", r["kind"], r["dataset"], "too_few_to_project", r["completed"],
                        p.min_samples_to_project, f"only {r['completed']} of {r['planned']} samples completed "
                        f"(< {p.min_samples_to_project}): not projected, the corpus projection is a lower bound"))  # fmt: skip
        if r["status"] == "planned unknown":
            out.append(("info", r["kind"], r["dataset"], "planned_unknown", r["completed"], 0,
                        "no data/B/<dataset>/meta.json nor prompts.jsonl: measured totals only, nothing projected"))  # fmt: skip
    if think_id is None:
        out.append(
            ("info", "", "", "no_end_of_thinking", 0, 0, "no end-of-thinking token: reasoning not split")
        )
    return pd.DataFrame(out, columns=COLUMNS)


# ---------------------------------------------------------------- figures


def _palette(n: int) -> list:
    return sns.color_palette("tab10" if n <= 10 else "husl", n)


def _save(fig, path: Path):
    return report.save_figure(fig, path)


def _ecdf(ax, x: np.ndarray, label: str, color) -> None:
    q = np.linspace(0, 1, min(POINTS, x.size))
    ax.step(np.quantile(x, q), q, where="post", label=label, color=color)


def length_ecdf(report, path: Path):
    """Completion and prompt length ECDFs per dataset (log x); dashed lines mark each B dataset's limit."""
    shown = [ls for ls in report.lengths if len(ls.cols["completion"])]
    with sns.axes_style("whitegrid"):
        fig, (ax_c, ax_p) = plt.subplots(1, 2, figsize=(13, 4.8))
        for ls, color in zip(shown, _palette(len(shown)), strict=True):
            a = ls.arrays()
            label = f"{ls.kind}/{ls.name} (n={a['completion'].size:,})"
            _ecdf(ax_c, a["completion"], label, color)
            _ecdf(ax_p, a["prompt"], label, color)
            limit = report.completion.set_index(["kind", "dataset"]).loc[(ls.kind, ls.name), "limit"]
            if ls.kind == "B" and limit:
                ax_c.axvline(limit, color=color, ls="--", lw=1)
        for ax, what in (
            (ax_c, "completion tokens (A: trainable)"),
            (ax_p, "prompt tokens (A: not trainable)"),
        ):
            ax.set_xscale("symlog", linthresh=1)  # symlog: empty completions stay visible at 0
            ax.set_xlim(left=0)
            ax.set(xlabel=what, ylabel="share of samples <= x", ylim=(0, 1.01))
        ax_c.set_title("completion length (dashed: max_new_tokens)")
        ax_p.set_title("prompt length")
        ax_c.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def truncation_bars(report, path: Path, threshold: float):
    """Share of samples that ended at the limit, per dataset, against the warning threshold."""
    c = report.completion
    labels = [f"{k}/{d}" for k, d in zip(c.kind, c.dataset, strict=True)]
    with sns.axes_style("whitegrid"):
        fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(c) + 2), 4))
        shares = c.share_at_limit.fillna(0).to_numpy()
        colors = ["tab:red" if s > threshold else "tab:blue" for s in shares]
        ax.bar(labels, shares * 100, color=colors)
        ax.axhline(threshold * 100, color="k", ls="--", lw=1, label=f"threshold {threshold:.0%}")
        for i, (k, n) in enumerate(zip(c.n_at_limit, c.n, strict=True)):
            ax.annotate(f"{k}/{n}", (i, shares[i] * 100), ha="center", va="bottom", fontsize=8)
        ax.set(ylabel="% ended at the limit", title="truncation (B: finish_reason=length, A: cut by 01)")
        ax.tick_params(axis="x", rotation=45)
        ax.legend()
    return _save(fig, path)


def token_bars(report, path: Path):
    """Stacked tokens per dataset: prompt, reasoning, answer (measured) and the projected remainder."""
    c, proj = report.completion, report.projection
    labels = [f"{k}/{d}" for k, d in zip(c.kind, c.dataset, strict=True)]
    tok = report.tokens.set_index(["kind", "dataset"]).loc[list(zip(c.kind, c.dataset, strict=True))]
    total = proj[proj.tokens == "total"].set_index(["kind", "dataset"]).loc[tok.index]
    parts = {
        "prompt": tok.prompt_tokens.to_numpy(),
        "reasoning": c.reasoning_tokens.to_numpy(),
        "answer": c.answer_tokens.to_numpy(),
        "projected remainder": (total.projected.fillna(total.measured) - total.measured).to_numpy(),
    }
    top = max(1.0, float(sum(parts.values()).max()))
    scale, unit = next(
        (s, u) for s, u in ((1e9, "billion "), (1e6, "million "), (1e3, "thousand "), (1, "")) if top >= s
    )
    colors = [*_palette(3), "lightgrey"]
    with sns.axes_style("whitegrid"):
        fig, ax = plt.subplots(figsize=(9, max(3, 0.45 * len(c) + 1.5)))
        left = np.zeros(len(c))
        for (name, v), color in zip(parts.items(), colors, strict=True):
            hatch = "//" if name == "projected remainder" else None
            ax.barh(labels, v / scale, left=left / scale, label=name, color=color, hatch=hatch)
            left += v
        ax.invert_yaxis()
        ax.set(xlabel=f"{unit}tokens", title="token contribution per dataset (completion = trainable)")
        ax.legend(fontsize=8)
    return _save(fig, path)


def timeline_figure(report, path: Path):
    """Per dataset in progress: projected trainable tokens and truncation share against time, with intervals."""
    tl = report.timeline
    with sns.axes_style("whitegrid"):
        fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(13, 4.5))
        if tl.empty:
            for ax in (ax_t, ax_l):
                ax.text(
                    0.5, 0.5, "no B dataset in progress with a ledger", ha="center", transform=ax.transAxes
                )
        names = list(dict.fromkeys(tl.dataset)) if not tl.empty else []
        for name, color in zip(names, _palette(max(len(names), 1)), strict=False):
            d = tl[tl.dataset == name]
            for ax, key, naive in ((ax_t, "tokens", "naive_tokens"), (ax_l, "limit", "naive_limit")):
                ax.plot(d.hours, d[f"{key}_est"], color=color, label=name)
                ax.fill_between(d.hours, d[f"{key}_lo"], d[f"{key}_hi"], color=color, alpha=0.2)
                ax.plot(d.hours, d[naive], color=color, ls=":", lw=1)
        ax_t.set(xlabel="hours since the dataset's first start", ylabel="projected final trainable tokens",
                 title="final tokens (band: 95% interval; dotted: finished-only estimate)")  # fmt: skip
        ax_l.axhline(report.params.max_limit_share, color="k", ls="--", lw=1)
        ax_l.set(xlabel="hours since the dataset's first start", ylabel="share ended at the limit",
                 title="truncation share of the final dataset (dashed: threshold)")  # fmt: skip
        if names:
            ax_t.legend(fontsize=8)
    return _save(fig, path)


def make_figures(report, out: Path) -> dict:
    """All figures of the stage, saved under `out` as PNG; returns name -> figure."""
    threshold = report.params.max_limit_share
    return {
        "lengths": length_ecdf(report, out / "lengths_ecdf.png"),
        "truncation": truncation_bars(report, out / "truncation.png", threshold),
        "tokens": token_bars(report, out / "tokens.png"),
        "timeline": timeline_figure(report, out / "timeline.png"),
    }


# ---------------------------------------------------------------- the answer, first


def answer(report) -> str:
    """The notebook's first line: tokens (measured, or projected with its interval mid-run) and what to fix."""
    c, v, corpus = report.completion, report.verdicts, report.corpus["completion"]
    measured = int(report.tokens.trainable_tokens.sum())
    proj = report.projection[report.projection.tokens == "completion"]
    running = proj[proj.status != "complete"]
    unprojected = report.corpus.get("unprojected") or []
    if running.empty and not unprojected:
        head = f"{measured:,} trainable tokens measured"
    elif unprojected:  # never an interval narrower than what is known: these datasets are not in it
        head = (f"run in progress ({len(running)} dataset(s)): {measured:,} trainable tokens measured; the final "
                f"total is at least {corpus['lo']:,.0f}, a lower bound only: {len(unprojected)} dataset(s) have too "
                f"few finished samples to project ({', '.join(unprojected)}), "
                f"{int(running.in_flight.sum()):,} responses in flight")  # fmt: skip
    else:
        head = (f"run in progress ({len(running)} dataset(s)): {measured:,} trainable tokens measured, "
                f"{corpus['projected']:,.0f} projected (95% interval {corpus['lo']:,.0f}-{corpus['hi']:,.0f}), "
                f"{int(running.in_flight.sum()):,} responses in flight")  # fmt: skip
    trunc = v[(v.check == "truncation") & (v.level == "warn")]
    open_ = [d in report.estimates and report.estimates[d]["share_at_limit"][1] <= report.params.max_limit_share
             for d in trunc.dataset]  # warned while the interval still reaches under the threshold  # fmt: skip
    trunc, likely = trunc[[not o for o in open_]], trunc[open_]
    undecided = v[(v.check == "truncation") & (v.level == "undetermined")]
    thr = f"{report.params.max_limit_share:.0%}"
    parts = [head]
    if len(trunc):
        names = ", ".join(f"{k}/{d}" for k, d in zip(trunc.kind, trunc.dataset, strict=True))
        fix = (
            "raise max_new_tokens"
            if set(trunc.kind) == {"B"}
            else "raise max_new_tokens (B) / 01's max_seq_len (A)"
        )
        parts.append(f"{len(trunc)} dataset(s) cut at the limit in > {thr} of samples ({names}): {fix}")

    def listed(rows) -> str:
        est = {d: report.estimates[d]["share_at_limit"] for d in rows.dataset}
        return ", ".join(f"B/{d} (estimate {pt:.0%}, {lo:.0%}-{hi:.0%})" for d, (pt, lo, hi) in est.items())

    if len(likely):
        parts.append(f"truncation undetermined yet but likely over {thr} or with a long tail forming, for "
                     f"{listed(likely)}: consider raising max_new_tokens now (cheaper than after the run)")  # fmt: skip
    if len(undecided):
        parts.append(f"truncation undetermined yet for {listed(undecided)}")
    if not len(trunc) and not len(likely) and not len(undecided):
        parts.append(f"no dataset cut at the limit in > {thr} of samples")
    others = v[(v.level == "warn") & (v.check != "truncation")]
    if len(others):
        parts.append(f"{len(others)} other warning(s): {', '.join(sorted(set(others.check)))}")
    return "; ".join(parts) + f" ({len(c)} datasets)."
