"""Stage 07's tables, verdicts and headline numbers from the drafters' per-prompt decoding sums.

Every difference is paired (both drafters decoded the same held-out prompts) and carries a percentile bootstrap
interval over those prompts; a difference whose interval includes zero is reported as "no measurable
difference", never ranked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from eagle_lib.data_value import curve as curves


@dataclass
class Result:
    """What the notebook shows."""

    curve: pd.DataFrame  # one row per subset: tokens, steps, tau overall and per eval dataset
    fit: curves.Curve
    projections: pd.DataFrame
    verdict: dict
    lodo: pd.DataFrame = field(default_factory=pd.DataFrame)  # unit x eval dataset values with intervals
    ranked: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per unit, by value on all eval sets
    regen: pd.DataFrame = field(default_factory=pd.DataFrame)  # per eval dataset: regenerated vs original
    headline: dict = field(default_factory=dict)
    total_tokens: int = 0
    out_dir: Path = Path(".")
    multiturn: pd.DataFrame = field(default_factory=pd.DataFrame)  # per eval set: multi- vs single-turn regen
    calibration: pd.DataFrame = field(default_factory=pd.DataFrame)  # 07's tau beside 06's (`tau_scale`)


def _eval_sets(st) -> list[str]:
    return sorted(set(st.decoder.sums.datasets)) + ["all"]


def curve_table(st, arms: dict[float, list[str]]) -> pd.DataFrame:
    """Subsets (rows): share, tokens, steps, how the drafter was obtained, the seeds trained, tau overall and per
    eval dataset (a replicated subset: the mean over its seeds, as the fit takes it; `seed_taus` each seed's).
    `arms`: fraction -> its drafters' arm names, 05's seed first."""
    rows = []
    for f, names in arms.items():
        a = st.arms[names[0]]
        row = {
            "fraction": float(f),
            **{k: a[k] for k in ("sequences", "tokens", "label_tokens", "steps", "drafter")},
            "seeds": len(names),
            "seed_taus": " ".join(f"{st.decoder.sums.tau(n):.9f}" for n in names),
        }
        row |= {
            f"tau_{e}": float(np.mean([st.decoder.sums.tau(n, None if e == "all" else e) for n in names]))
            for e in _eval_sets(st)
        }
        rows.append(row)
    return pd.DataFrame(rows)


def _paired(st, i: str, j: str, dataset: str, reps: int, seed: int, sums=None) -> dict:
    """tau_i - tau_j on one eval dataset ('all': every prompt, resampled within datasets)."""
    s = sums or st.decoder.sums
    cols = [k for k, d in enumerate(s.datasets) if dataset in ("all", d)]
    num, den = s.rows([i, j])
    num, den = num[:, cols], den[:, cols]
    strata = [s.datasets[k] for k in cols] if dataset == "all" else None
    draws = curves.bootstrap_draws(len(cols), reps, seed, strata)
    return curves.diff_interval(num, den, 0, 1, draws, noise=getattr(st, "noise", curves.NO_NOISE), seed=seed)


def value_table(st, ref: str, arms: dict[str, str], units: dict[str, list[str]], p) -> pd.DataFrame:
    """Leave-one-out: value of each unit for each eval set = tau(all at budget) - tau(without the unit)."""
    rows = []
    for u, arm in arms.items():
        for e in _eval_sets(st):
            d = _paired(st, ref, arm, e, p.bootstrap_reps, st.cfg.shared.seed)
            rows.append({
                "unit": u, "left_out": ",".join(units[u]), "eval": e, "value": d["diff"], "lo": d["lo"], "hi": d["hi"],
                "measurable": d["measurable"], "short_response": any(x in p.short_datasets for x in units[u]),
            })  # fmt: skip
    return pd.DataFrame(rows)


def ranked(lodo: pd.DataFrame) -> pd.DataFrame:
    """One row per unit, by value on all eval sets; the eval sets it measurably helps / hurts; a sentence."""
    out = []
    for u, g in lodo.groupby("unit", sort=False):
        allr = g[g["eval"] == "all"].iloc[0]
        per = g[g["eval"] != "all"]
        helps = list(per[per.measurable & (per.value > 0)]["eval"])
        hurts = list(per[per.measurable & (per.value < 0)]["eval"])
        iv = f"{allr.value:+.3f} [{allr.lo:+.3f}, {allr.hi:+.3f}]"
        if not allr.measurable:
            text = f"{u}: no measurable difference on all eval sets ({iv})"
        elif allr.value > 0:
            text = f"{u}: more of it is projected to raise tau on all eval sets ({iv})"
        else:
            text = f"{u}: removing it raised tau on all eval sets ({iv}): more of it is not projected to help"
        text += f"; adding more of {u} is projected to help eval sets {', '.join(helps)}" if helps else ""
        text += f"; removing it measurably helps {', '.join(hurts)}" if hurts else ""
        if not helps and not hurts:
            text += "; no single eval set shows a measurable difference"
        overall = iv if allr.measurable else f"no measurable difference ({iv})"
        out.append({"unit": u, "value_all": allr.value, "lo": allr.lo, "hi": allr.hi, "overall": overall,
                    "helps": helps, "hurts": hurts, "short_response": bool(allr.short_response), "text": text})  # fmt: skip
    df = pd.DataFrame(out)
    return df.sort_values("value_all", ascending=False, ignore_index=True) if len(df) else df


def recommendation(rank: pd.DataFrame) -> str:
    """Which data to generate next: the units with a measurable positive value on all eval sets, best first."""
    good = rank[(rank.lo > 0) & rank.value_all.notna()]
    rest = [u for u in rank.unit if u not in set(good.unit)]
    if not len(good):
        return f"no unit measurably raises tau on all eval sets at this budget ({', '.join(rest)})"
    first = ", ".join(f"{r.unit} ({r.value_all:+.3f} [{r.lo:+.3f}, {r.hi:+.3f}])" for r in good.itertuples())
    return f"generate more of {first} first" + (
        f"; no measurable gain from {', '.join(rest)}" if rest else ""
    )


def pair_table(st, a: str, b: str, p, sums=None) -> pd.DataFrame:
    """Per eval set: tau of arm a and b and a - b with its paired interval (on `sums`: another prompt set)."""
    s, rows = sums or st.decoder.sums, []
    for e in sorted(set(s.datasets)) + ["all"]:
        d = _paired(st, a, b, e, p.bootstrap_reps, st.cfg.shared.seed, s)
        ds = None if e == "all" else e
        rows.append({"eval": e, f"tau_{a}": s.tau(a, ds), f"tau_{b}": s.tau(b, ds), "diff": d["diff"],
                     "lo": d["lo"], "hi": d["hi"], "measurable": d["measurable"]})  # fmt: skip
    return pd.DataFrame(rows)


def projections(c: curves.Curve, total: int, target_tau: float) -> pd.DataFrame:
    """Measured point (1x) and the projections at the multipliers: tokens, tau and its interval."""
    rows = [{"multiplier": m, "tokens": m * total, **c.projection(m)} for m in [1.0] + c.multipliers]
    t = c.tokens_for(target_tau)
    rows.append({"multiplier": t["x"], "tokens": t["x"] * total, "multiplier_lo": t["lo"], "multiplier_hi": t["hi"],
                 "tau": target_tau, "lo": np.nan, "hi": np.nan, "p_reach": t["p_reach"], "row": "tokens for target"})  # fmt: skip
    df = pd.DataFrame(rows)
    df["row"] = df["row"].fillna("projection") if "row" in df else "projection"
    return df


def regen_text(regen: pd.DataFrame) -> str:
    if not len(regen):
        return "regenerated vs original: not run (no B dataset with its own responses)"
    r = regen[regen["eval"] == "all"].iloc[0]
    iv = f"{r['diff']:+.3f} [{r.lo:+.3f}, {r.hi:+.3f}]"
    if not r.measurable:
        return f"regenerated vs original responses at equal tokens: no measurable difference in tau ({iv})"
    word = "pays" if r["diff"] > 0 else "costs"
    return f"regeneration {word}: tau {r.tau_regenerated:.2f} vs {r.tau_original:.2f} with the original responses ({iv})"


def result(st, curve_df, c: curves.Curve, lodo: pd.DataFrame, regen: pd.DataFrame, p) -> Result:
    """Projections, verdict, rankings and the headline numbers report.record keeps."""
    proj = projections(c, st.total, p.target_tau)
    v = curves.verdict(c, p.min_gain)
    rank = ranked(lodo) if len(lodo) else pd.DataFrame()
    t = c.tokens_for(p.target_tau)
    h = {
        "train_tokens_05": st.total,
        "steps_05": st.steps05,
        "tau_by_fraction": {f"{r.fraction:g}": r.tau_all for r in curve_df.itertuples()},
        "fit": {"a": c.fit.a, "b": c.fit.b, "c": c.fit.c, "cap": c.cap},
        "projected": {f"{m:g}x": c.projection(m) for m in c.multipliers},
        "tokens_for_target": {
            "target_tau": p.target_tau,
            "tokens": t["x"] * st.total,
            "lo": t["lo"] * st.total,
            "hi": t["hi"] * st.total,
            "p_reach": t["p_reach"],
        },  # fmt: skip
        "steps_rule": p.steps,  # proportional: every subset at the 05 epochs (tokens and compute grow together)
        "verdict": v["text"],
        "verdict_kind": v["kind"],
        "training_noise": {"seed_sd": c.noise.sd, "dof": c.noise.dof, "text": c.noise.text()},
        "gain_2x": v["gain_2x"],
        "heldout_prompts": len(st.decoder.prompts),
        "arms": {n: {k: a[k] for k in ("tokens", "steps", "drafter")} for n, a in st.arms.items()},
        "recipe_world_size": st.trainer.world,  # 05 ran on so many processes; 07 trains them as one
    }
    if len(rank):
        h["lodo_value_all"] = {
            r.unit: {"value": r.value_all, "lo": r.lo, "hi": r.hi} for r in rank.itertuples()
        }
        h["lodo_ranking"] = [r.text for r in rank.itertuples()]
        h["next_data"] = recommendation(rank)
        h["short_response"] = [
            f"{r.unit} (short responses): {r.overall}; {r.text}"
            for r in rank.itertuples()
            if r.short_response
        ]
    if len(regen):
        r = regen[regen["eval"] == "all"].iloc[0]
        h["regen_minus_original"] = {
            "diff": r["diff"],
            "lo": r.lo,
            "hi": r.hi,
            "measurable": bool(r.measurable),
        }
        h["regen_text"] = regen_text(regen)
    return Result(curve_df, c, proj, v, lodo, rank, regen, h, st.total, st.out)
