"""What 07's tau is, and how it relates to 06's, where the run has both (issue 42, item 10).

With ``tau_source: ttt`` (targets too large to decode here: the Kimi params) 07 measures no decoding: each
drafter's chain of k argmax drafts is scored teacher-forced, position by position, along held-out sequences of
the run's own text, and that text was sampled by 03 (Kimi: T=1.0, top_p 0.95). Such a tau is not 06's served tau
(the server decodes and verifies, at its own temperature) and not on the scale of ``target_tau``, so 07's report
names it (`kind`) and calibrates it against 06 wherever 06 measured the same run (`calibrate`): per 06 source
(served by an engine: ``eval/online.csv``; decoded offline: ``eval/tau.csv``) and temperature, 05's drafter's
tau in 06 beside its tau in 07 on the datasets both measured, their ratio of gains over 1 and what
``target_tau`` on 06's scale is on 07's. It is a linear map from one drafter: a rough guide, not an interval.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from eagle_lib import store

FULL_ARM = "1"  # 07's full-data curve point (05's own drafter when reused): the arm 06 measured too


def sampling_of(run_dir: str | Path) -> list[dict]:
    """The distinct sampling settings 03 generated the run's B answers with (``infer/<dataset>/meta.json``)."""
    out: list[dict] = []
    for f in sorted(Path(run_dir).glob("infer/*/meta.json")):
        s = (store.read_json(f) or {}).get("sampling") or {}
        s = {k: s[k] for k in ("temperature", "top_p") if k in s}
        if s and s not in out:
            out.append(s)
    return out


def kind(p, sampling: list[dict]) -> str:
    """07's tau as what it is, for its report: how it was measured and what it is comparable with."""
    if p.tau_source != "ttt":
        return (f"offline speculative decoding (greedy, {p.num_steps} drafts a step) of held-out prompts, as 06 "
                "decodes offline: on 06's offline scale")  # fmt: skip
    text = ", ".join(f"T={s.get('temperature', '?'):g}" + (f", top_p {s['top_p']:g}" if "top_p" in s else "")
                     for s in sampling) or "sampling unknown"  # fmt: skip
    return (
        f"teacher-forced argmax-chain tau (tau_source: ttt): each drafter's chain of {p.num_steps} argmax drafts "
        f"scored position by position along held-out sequences of the run's own text (03's answers sampled at "
        f"{text}), no decoding; not comparable with 06's served tau nor with target_tau, which 06's scale "
        "measures (see the calibration against 06)"
    )


def read_06(run_dir: str | Path) -> tuple[pd.DataFrame, dict]:
    """06's eagle3 tau of this run per source, temperature and dataset (``source``: '<engine> served' from
    eval/online.csv, 'offline decode' from eval/tau.csv), and 06's meta ({} when 06 has not run)."""
    ev = Path(run_dir) / "eval"
    frames = []
    if (ev / "online.csv").exists() and (ev / "online.csv").stat().st_size:
        on = pd.read_csv(ev / "online.csv")
        frames.append(pd.DataFrame({"source": on["engine"].astype(str) + " served", "temperature": on["temperature"],
                                    "dataset": on["dataset"], "tau_06": on["online_tau"]}))  # fmt: skip
    if (ev / "tau.csv").exists() and (ev / "tau.csv").stat().st_size > 1:
        off = pd.read_csv(ev / "tau.csv")
        if len(off):
            off = off[off["method"] == "eagle3"]
            frames.append(pd.DataFrame({"source": "offline decode", "temperature": off["temperature"],
                                        "dataset": off["dataset"], "tau_06": off["tau"]}))  # fmt: skip
    meta = store.read_json(ev / "meta.json") if (ev / "meta.json").exists() else {}
    cols = ["source", "temperature", "dataset", "tau_06"]
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)), meta


def _excess_ratio(t06: float, t07: float) -> float:
    """(tau_06 - 1) / (tau_07 - 1): how much more of the chain 06 accepts than 07 scores (nan: 07 at 1)."""
    return (t06 - 1) / (t07 - 1) if t07 > 1 and np.isfinite(t06) else float("nan")


def calibrate(tau07: dict[str, float], six: pd.DataFrame, target_tau: float) -> tuple[pd.DataFrame, dict]:
    """Per 06 source x temperature: 05's drafter's tau in 06 and in 07 (`tau07`: dataset -> tau) on the datasets
    both measured, and their mean over those datasets ('common'); `ratio` = (06 - 1) / (07 - 1). Returns the table
    and, per '<source> T=<t>', {datasets, tau_06, tau_07, ratio, target_tau_on_07_scale}."""
    rows, summary = [], {}
    for (src, temp), g in six.groupby(["source", "temperature"], sort=True):
        g = g[g["dataset"].isin(tau07) & (g["dataset"] != "all")].drop_duplicates("dataset")
        if not len(g):
            continue
        for r in g.itertuples():
            t7 = tau07[r.dataset]
            rows.append({"source": src, "temperature": temp, "dataset": r.dataset, "tau_06": r.tau_06,
                         "tau_07": t7, "diff": r.tau_06 - t7, "ratio": _excess_ratio(r.tau_06, t7)})  # fmt: skip
        m6, m7 = float(g["tau_06"].mean()), float(np.mean([tau07[d] for d in g["dataset"]]))
        ratio = _excess_ratio(m6, m7)
        rows.append({"source": src, "temperature": temp, "dataset": "common", "tau_06": m6, "tau_07": m7,
                     "diff": m6 - m7, "ratio": ratio})  # fmt: skip
        on07 = 1 + (target_tau - 1) / ratio if ratio > 0 else float("nan")
        summary[f"{src} T={temp:g}"] = {"datasets": sorted(g["dataset"]), "tau_06": m6, "tau_07": m7,
                                        "ratio": ratio, "target_tau_on_07_scale": on07}  # fmt: skip
    cols = ["source", "temperature", "dataset", "tau_06", "tau_07", "diff", "ratio"]
    return pd.DataFrame(rows, columns=cols), summary


def same_drafter(run_dir: str | Path, meta06: dict, arm: dict | None) -> bool:
    """Whether 06 measured the drafter 07's full point is: 05's final drafter, reused by 07."""
    final = (Path(run_dir) / "drafter" / "final").resolve()
    d06 = meta06.get("drafter_dir")
    return bool(arm and arm.get("drafter") == "05's final drafter" and d06 and Path(d06).resolve() == final)


def headline(run_dir, st, p, curve) -> tuple[pd.DataFrame, dict]:
    """(calibration table, headline entries): 07's tau kind, the calibration against 06 (or why there is none)
    and, where calibrated, the tokens for target_tau read on 07's scale (`curve.tokens_for`)."""
    h = {"tau_kind": kind(p, sampling_of(run_dir)), "tau_source": p.tau_source}
    six, meta06 = read_06(run_dir)
    names = st.decoder.sums.names
    if FULL_ARM not in names or not len(six):
        why = "no 06 measurement of this run" if not len(six) else "07 has no full-data point (fraction 1.0)"
        h["tau_calibration"] = {"text": f"07's tau not calibrated against 06: {why}"}
        return pd.DataFrame(), h
    tau07 = {d: st.decoder.sums.tau(FULL_ARM, d) for d in sorted(set(st.decoder.sums.datasets))}
    table, by = calibrate(tau07, six, p.target_tau)
    same = same_drafter(run_dir, meta06, st.arms.get(FULL_ARM))
    who = (
        "05's drafter"
        if same
        else "07's full-data drafter (06 measured 05's: same recipe and data, other weights)"
    )
    parts = [f"{k}: {v['tau_06']:.2f} in 06 vs {v['tau_07']:.2f} in 07 on {', '.join(v['datasets'])} (ratio of "
             f"gains over 1 {v['ratio']:.2f}: target_tau {p.target_tau:g} there ~ {v['target_tau_on_07_scale']:.2f} "
             "on 07's scale)" for k, v in by.items()]  # fmt: skip
    text = (f"07's tau vs 06's for {who}: " + "; ".join(parts) + ". A linear map from one drafter: a rough guide"
            if by else "07's tau not calibrated against 06: no dataset measured by both")  # fmt: skip
    h["tau_calibration"] = {"text": text, "by": by, "same_drafter": same}
    h["tokens_for_target_on_06_scale"] = {}
    for k, v in by.items():  # target_tau as 06 measures it, read on the fitted curve of 07's tau
        t = v["target_tau_on_07_scale"]
        reach = curve.tokens_for(t) if np.isfinite(t) else {"x": float("nan"), "p_reach": float("nan")}
        h["tokens_for_target_on_06_scale"][k] = {"target_tau_on_07_scale": t, "tokens": reach["x"] * st.total,
                                                 "p_reach": reach["p_reach"]}  # fmt: skip
    return table, h
