"""Stage 06's tables from the per-prompt generation records: tau per method x temperature x dataset, per-position
acceptance, accepted-length histograms, tau by context length, speedups and the report's answer sentence.

A generation record is one prompt decoded by one method at one temperature: ``{method, temperature, dataset,
id, accepted, matched, drafted, ctx, output_ids, total_s, draft_s, draft_calls, target_s, target_calls,
lossless}`` (see :class:`eagle_lib.decoding.specdec.Generation`; ``lossless`` is None for sampled runs, whose
correctness is a property of the distribution, tested in tests/unit/test_specdec.py).
"""

from __future__ import annotations

import math

import pandas as pd

from eagle_lib.decoding.specdec import CYCLE_STARTS, acceptance_stats, first_draft_by_cycle_start

KEYS = ["method", "temperature", "dataset"]


def _temp(r: dict) -> float:
    return float(r.get("temperature", 0.0))


def _groups(gens: list[dict]):
    """(method, temperature, dataset) -> records, plus each method and temperature pooled as dataset 'all'."""
    by: dict[tuple[str, float, str], list[dict]] = {}
    for r in gens:
        by.setdefault((r["method"], _temp(r), r["dataset"]), []).append(r)
        by.setdefault((r["method"], _temp(r), "all"), []).append(r)
    return sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] == "all", kv[0][2]))


def _lossless(g: list[dict]):
    """All greedy outputs equal the reference; None when the group was sampled."""
    flags = [r.get("lossless") for r in g]
    return None if any(f is None for f in flags) else all(flags)


def tables(
    gens: list[dict], k: int, cost_ratio: float | None
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(tau per method x temperature x dataset incl. 'all', per-position long table, accepted-length histogram).

    tau counts the drafts that end up in the output; tau_uncut counts every draft the verify accepted (also
    past the stop token / max_new_tokens), the way vLLM's /metrics counters do."""
    rows = []
    for (method, temp, ds), g in _groups(gens):
        st = acceptance_stats([a for r in g for a in r["accepted"]], k)
        raw = [a for r in g for a in r.get("matched", r["accepted"])]
        tokens = sum(len(r["output_ids"]) for r in g)
        secs = sum(r["total_s"] for r in g)
        rows.append(
            dict(
                method=method,
                temperature=temp,
                dataset=ds,
                prompts=len(g),
                tokens=tokens,
                tokens_per_step=tokens / max(st["steps"], 1),
                s_per_token=secs / max(tokens, 1),
                lossless=_lossless(g),
                tau_uncut=(sum(raw) + len(raw)) / len(raw) if raw else math.nan,
                **st,
            )
        )
    tau = pd.DataFrame(rows)
    base = tau[tau.method == "none"].set_index(["temperature", "dataset"])["s_per_token"]
    tau["measured_speedup"] = [
        base.get((t, d), math.nan) / s
        for t, d, s in zip(tau.temperature, tau.dataset, tau.s_per_token, strict=True)
    ]
    ratio = {
        "eagle3": cost_ratio if cost_ratio is not None else math.nan,
        "ngram": 0.0,
        "none": 0.0,
        "oracle": math.nan,
    }  # the oracle is a ceiling of acceptance, not a proposer one can run cheaply
    tau["est_speedup"] = [
        t / (1 + ratio.get(m, 0.0) * (k if m == "eagle3" else 0))
        for m, t in zip(tau.method, tau.tau, strict=True)
    ]
    pos = [
        {**{c: r[c] for c in KEYS}, "position": i, "acc": r[f"acc_{i}"], "cond_acc": r[f"cond_acc_{i}"]}
        for r in rows
        for i in range(1, k + 1)
    ]
    hist = tau[KEYS + [f"a={j}" for j in range(k + 1)]]
    return tau, pd.DataFrame(pos), hist


def cost_ratio(gens: list[dict]) -> float | None:
    """Measured seconds per drafter forward / seconds per target verify forward (eagle3 runs)."""
    g = [r for r in gens if r["method"] == "eagle3"]
    d_calls, t_calls = sum(r["draft_calls"] for r in g), sum(r["target_calls"] for r in g)
    if not d_calls or not t_calls:
        return None
    return (sum(r["draft_s"] for r in g) / d_calls) / (sum(r["target_s"] for r in g) / t_calls)


# --- first drafts by how their cycle started ----------------------------------------------------------------
def cycle_start_table(gens: list[dict]) -> pd.DataFrame:
    """Where acceptance is lost: per method x temperature (all datasets), the cycles by how they started
    (`specdec.CYCLE_STARTS`: a prompt's first, after a cycle that accepted every draft, after a rejection), their
    share of the cycles, and the share whose first draft was accepted. Positions where the drafter is weak come in
    stretches (at T > 0 on the toy: where the target hesitates between many tokens), and a cycle there yields one
    token, so such stretches fill most of the cycles that start after a rejection: a low share there says how much
    of the run is spent in them (`benchmarks/diag_served.py` splits the acceptance by the target's confidence).
    Methods that never drafted (none) have no rows."""
    rows = []
    by: dict[tuple[str, float], list[dict]] = {}
    for r in gens:
        by.setdefault((r["method"], _temp(r)), []).append(r)
    for (method, temp), g in sorted(by.items()):
        counts = first_draft_by_cycle_start((r["matched"], r["drafted"]) for r in g)
        total = sum(n for _, n in counts.values())
        if not total:
            continue
        for how in CYCLE_STARTS:
            a, n = counts[how]
            rows.append(
                dict(
                    method=method,
                    temperature=temp,
                    cycle_start=how,
                    cycles=n,
                    share_of_cycles=n / total,
                    first_draft_accepted=a / n if n else math.nan,
                )
            )
    return pd.DataFrame(rows)


# --- tau by context length ----------------------------------------------------------------------------------
def bucket_labels(edges: list[int]) -> list[str]:
    """Labels of the buckets [0, e1), [e1, e2), ..., [e_n, inf): '<1k', '1k-4k', ..., '>=16k'."""

    def short(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)

    if not edges:
        return ["all"]
    mids = [f"{short(a)}-{short(b)}" for a, b in zip(edges, edges[1:], strict=False)]
    return [f"<{short(edges[0])}", *mids, f">={short(edges[-1])}"]


def bucket_of(n: int, edges: list[int]) -> int:
    return sum(n >= e for e in edges)


def context_table(gens: list[dict], edges: list[int], k: int) -> pd.DataFrame:
    """tau per method x temperature x context bucket (the prompt + generated length each verify step read at);
    every bucket appears, empty ones with 0 steps."""
    labels = bucket_labels(edges)
    steps: dict[tuple[str, float], list[list[int]]] = {}
    for r in gens:
        per = steps.setdefault((r["method"], _temp(r)), [[] for _ in labels])
        for a, c in zip(r["accepted"], r.get("ctx") or [], strict=False):
            per[bucket_of(c, edges)].append(a)
    rows = []
    for (m, t), per in sorted(steps.items()):
        for i, acc in enumerate(per):
            st = acceptance_stats(acc, k)
            rows.append(dict(method=m, temperature=t, bucket=labels[i], steps=st["steps"], tau=st["tau"]))
    return pd.DataFrame(rows, columns=["method", "temperature", "bucket", "steps", "tau"])


# --- what a reader needs first ------------------------------------------------------------------------------
def headline_table(tau: pd.DataFrame) -> pd.DataFrame:
    """tau with one row per method x temperature and one column per dataset ('all' last)."""
    if not len(tau):
        return pd.DataFrame()
    t = tau.pivot_table(index=["method", "temperature"], columns="dataset", values="tau")
    cols = sorted(c for c in t.columns if c != "all") + ["all"]
    return t[cols]


def lossless_count(gens: list[dict]) -> tuple[int, int]:
    """(greedy prompts whose every method's output equals the plain greedy one, greedy prompts)."""
    ok: dict[tuple[str, str], bool] = {}
    for r in gens:
        if _temp(r) == 0:
            key = (r["dataset"], r["id"])
            ok[key] = ok.get(key, True) and bool(r.get("lossless"))
    return sum(ok.values()), len(ok)


def answer(
    tau: pd.DataFrame,
    k: int,
    lossless: tuple[int, int] = (0, 0),
    online: pd.DataFrame | None = None,
    method: str = "eagle3",
    starts: pd.DataFrame | None = None,
) -> str:
    """The report's first sentence: the drafter's tau at each temperature, losslessness, estimated speedup,
    the n-gram baseline, where sampled acceptance is lost (`cycle_start_table`) and the online verdict, with the
    numbers."""
    allr = tau[(tau.method == method) & (tau.dataset == "all")] if len(tau) else tau
    parts = []
    if len(allr):
        taus = " and ".join(f"{r.tau:.2f} at T={r.temperature:g}" for r in allr.itertuples())
        parts.append(f"{method} tau {taus} ({k} drafts per step)")
        if lossless[1]:
            parts.append(f"greedy output identical to the target's on {lossless[0]}/{lossless[1]} prompts")
        e0 = allr.iloc[0]
        if e0.est_speedup == e0.est_speedup:
            parts.append(f"est. speedup {e0.est_speedup:.2f}x at T={e0.temperature:g}")
        ng = tau[(tau.method == "ngram") & (tau.dataset == "all")]
        if len(ng):
            parts.append(f"n-gram lookup tau {ng.tau.iloc[0]:.2f}")
        for t, c in ceiling(tau, method).items():
            parts.append(f"at T={t:g} the target's own argmax drafts reach tau {c['oracle']:.2f} (the ceiling of "
                         f"greedy drafting, as engines draft): {method} has {c['share']:.0%} of the gain")  # fmt: skip
        for t, by in cycle_starts(starts, method).items():
            if t == "T=0":  # the split explains sampled serving (at T=0 a rejection's token is the argmax)
                continue
            rej = by[CYCLE_STARTS[2]]
            parts.append(
                f"at {t} its first draft is accepted "
                + ", ".join(f"{v['first_draft_accepted']:.2f} {how}" for how, v in by.items() if v["cycles"])
                + f" ({rej['share_of_cycles']:.0%} of its cycles start after a rejection)"
            )
    if online is not None and len(online):
        for r in online[online.dataset == "all"].itertuples():
            parts.append(f"{r.engine} online tau {r.online_tau:.2f} at T={r.temperature:g} ({r.verdict})")
    return "; ".join(parts) + "." if parts else "no acceptance measured."


def ceiling(tau: pd.DataFrame, method: str = "eagle3") -> dict[float, dict]:
    """Per sampled temperature with an 'oracle' row: its tau (the target's argmax drafts, accepted with the
    target's own probability of its top token: what greedy drafting can reach, up to the small gain of a
    drafter that looks ahead), the method's tau and its share of the oracle's gain over 1."""
    allr = tau[tau.dataset == "all"] if len(tau) else tau
    out = {}
    for t in sorted({float(x) for x in allr.temperature} if len(allr) else []):
        at = allr[allr.temperature == t].set_index("method")
        if t > 0 and "oracle" in at.index and method in at.index:
            o, m = float(at.loc["oracle", "tau"]), float(at.loc[method, "tau"])
            out[t] = {"oracle": o, method: m, "share": (m - 1) / (o - 1) if o > 1 else float("nan")}
    return out


def cycle_starts(starts: pd.DataFrame | None, method: str = "eagle3") -> dict:
    """{"T=t": {cycle start: {"cycles", "share_of_cycles", "first_draft_accepted"}}} of one method."""
    if starts is None or not len(starts):
        return {}
    sel = starts[starts.method == method]
    return {
        f"T={t:g}": {
            r.cycle_start: {
                "cycles": int(r.cycles),
                "share_of_cycles": float(r.share_of_cycles),
                "first_draft_accepted": float(r.first_draft_accepted),
            }
            for r in g.itertuples()
        }
        for t, g in sel.groupby("temperature")
    }


def headline(
    tau: pd.DataFrame,
    ctx: pd.DataFrame,
    pf: list[dict],
    on: pd.DataFrame | None,
    k: int,
    temps: list[float],
    starts: pd.DataFrame | None = None,
) -> dict:
    """The numbers report.record keeps: taus per temperature, per-position acceptance, speedups, checks, and
    eagle3's first-draft acceptance by how its cycle started (`cycle_start_table`)."""
    h: dict = {"preflight_ok": all(r["ok"] for r in pf), "temperatures": sorted(temps)}
    t0 = min(temps)
    if len(tau):
        allr = tau[tau.dataset == "all"]
        greedy = tau[tau.temperature == 0]
        h["lossless"] = bool(greedy.lossless.all()) if len(greedy) else None
        h["prompts"] = int(allr.prompts.iloc[0])
        first = allr[allr.temperature == t0].set_index("method")  # the flat keys: the lowest temperature
        for m in first.index:
            h[f"tau_{m}"] = float(first.loc[m, "tau"])
        h["tau_at"] = {
            f"{m}@T={t:g}": float(v) for m, t, v in zip(allr.method, allr.temperature, allr.tau, strict=True)
        }
        if "eagle3" in first.index:
            e = first.loc["eagle3"]
            h["acc_eagle3"] = [float(e[f"acc_{i}"]) for i in range(1, k + 1)]
            h["cond_acc_eagle3"] = [float(e[f"cond_acc_{i}"]) for i in range(1, k + 1)]
            h["est_speedup_eagle3"] = float(e.est_speedup)
            h["measured_speedup_eagle3"] = float(e.measured_speedup)
            h["tau_uncut_eagle3"] = float(e.tau_uncut)
            per = tau[(tau.method == "eagle3") & (tau.dataset != "all") & (tau.temperature == t0)]
            h["tau_eagle3_by_dataset"] = dict(zip(per.dataset, per.tau.astype(float), strict=True))
            for t in sorted(temps):
                sel = tau[(tau.method == "eagle3") & (tau.temperature == t)].set_index("dataset")
                h[f"eagle3_T={t:g}"] = {
                    "tau": sel.tau.astype(float).to_dict(),
                    "tau_uncut": sel.tau_uncut.astype(float).to_dict(),
                    "acc": [float(sel.loc["all", f"acc_{i}"]) for i in range(1, k + 1)],
                }
        h["ceiling"] = {f"T={t:g}": c for t, c in ceiling(tau).items()}
        h["eagle3_first_draft_by_cycle_start"] = cycle_starts(starts)
        c = ctx[(ctx.method == "eagle3") & (ctx.steps > 0)]
        h["tau_eagle3_by_context"] = {
            f"T={t:g}": dict(zip(g.bucket, g.tau.astype(float), strict=True))
            for t, g in c.groupby("temperature")
        }
    if on is not None:
        allr = on[on.dataset == "all"]
        h["online"] = {
            f"T={r.temperature:g}": {"tau": r.online_tau, "offline": r.offline, "verdict": r.verdict}
            for r in allr.itertuples()
        }
        r0 = allr.iloc[0]
        h["online_tau"] = float(r0.online_tau)
        per = on[(on.dataset != "all") & (on.temperature == r0.temperature)]
        h["online_tau_by_dataset"] = dict(zip(per.dataset, per.online_tau.astype(float), strict=True))
        h["online_verdicts"] = dict(zip(per.dataset, per.verdict, strict=True))
        h["online_greedy_equal"] = float(r0.greedy_equal)
        h["online_verdict"] = {key: r0[key] for key in ("verdict", "message", "causes")}
    return h


# --- what the notebook shows ----------------------------------------------------------------------------
def baseline_table(ev) -> pd.DataFrame:
    """All datasets pooled, one row per method x temperature: tau, speedups, seconds per token."""
    cols = ["method", "temperature", "tau", "tau_uncut", "tokens_per_step", "measured_speedup", "est_speedup",
            "s_per_token", "steps", "tokens"]  # fmt: skip
    if not len(ev.tau):
        return pd.DataFrame()
    return ev.tau[ev.tau.dataset == "all"][cols].set_index(["method", "temperature"]).round(4)


def positions_table(ev) -> pd.DataFrame:
    """eagle3's per-position acceptance (unconditional and conditional), pooled, one row per temperature."""
    if not len(ev.positions):
        return pd.DataFrame()
    pos = ev.positions[(ev.positions.method == "eagle3") & (ev.positions.dataset == "all")]
    return pos.pivot(index="temperature", columns="position", values=["acc", "cond_acc"]).round(3)


def cycle_start_summary(ev) -> pd.DataFrame:
    """First-draft acceptance (and the cycles behind it) per method x temperature (rows) and how the cycle
    started (columns)."""
    c = ev.starts
    if not len(c):
        return pd.DataFrame()
    order = [h for h in CYCLE_STARTS if h in set(c.cycle_start)]
    acc = c.pivot(index=["method", "temperature"], columns="cycle_start", values="first_draft_accepted")[
        order
    ]
    n = c.pivot(index=["method", "temperature"], columns="cycle_start", values="cycles")[order]
    return pd.concat({"first_draft_accepted": acc.round(3), "cycles": n}, axis=1)


def context_summary(ev) -> pd.DataFrame:
    """tau per context bucket (columns) for each method x temperature (rows), with the steps behind it."""
    c = ev.context
    if not len(c):
        return pd.DataFrame()
    order = list(dict.fromkeys(c.bucket))
    tau = c.pivot(index=["method", "temperature"], columns="bucket", values="tau")[order].round(3)
    steps = c.pivot(index=["method", "temperature"], columns="bucket", values="steps")[order]
    return pd.concat({"tau": tau, "steps": steps}, axis=1)


def preflight_table(ev) -> pd.DataFrame:
    """The preflight checks that failed or warned (all checks are in preflight.json); one row saying all passed
    when none did."""
    rows = [{"format": r["format"], **c} for r in ev.preflight for c in r["checks"] if not c["ok"]]
    n = sum(len(r["checks"]) for r in ev.preflight)
    cols = ["format", "name", "severity", "message"]
    return pd.DataFrame(rows)[cols] if rows else pd.DataFrame([{"checks": n, "result": "all passed"}])


def served_speed(raw: dict[float, dict[str, dict]], plain: dict[float, dict[str, dict]]) -> list[dict]:
    """Wall-clock tokens/s of the same requests served with the drafter (`raw`) and without it (`plain`), per
    temperature and dataset and pooled ('all'): completion tokens / seconds the requests took, at 06's
    online_concurrency, on one server at a time."""
    rows = []
    for temp, per in sorted(raw.items()):
        base = plain.get(temp, {})
        for ds in [*per, "all"]:
            with_, without = (
                ([per[ds]], [base.get(ds)]) if ds != "all" else (list(per.values()), list(base.values()))
            )
            if not without or any(o is None or not o.get("seconds") for o in with_ + without):
                continue
            tps = sum(o["completion_tokens"] for o in with_) / sum(o["seconds"] for o in with_)
            tps0 = sum(o["completion_tokens"] for o in without) / sum(o["seconds"] for o in without)
            rows.append(dict(temperature=temp, dataset=ds, tokens_per_s=tps, tokens_per_s_no_draft=tps0,
                             speedup=tps / tps0))  # fmt: skip
    return rows


def served_speed_table(ev) -> pd.DataFrame:
    """Wall-clock tokens/s of the same requests served with and without the drafter (06 `online_speed`)."""
    f = ev.out_dir / "served_speed.csv"
    if not f.exists() or f.stat().st_size < 2:
        return pd.DataFrame(
            [{"served speed": "not measured (online_speed: false, or a server 06 did not start)"}]
        )
    return pd.read_csv(f).round(3)


def online_table(ev) -> pd.DataFrame:
    """The server's tau beside the offline one per temperature and dataset (causes are in online.csv)."""
    if ev.online is None:
        return pd.DataFrame([{"online": "not measured (online_engine: none)"}])
    cols = ["temperature", "dataset", "engine", "online_tau", "offline", "greedy_equal", "verdict"]
    return ev.online[cols].round(3)


def launch_text(ev) -> str:
    """The launch commands preflight printed, per export format."""
    return "\n\n".join(
        f"[{r['format']}] {name}:\n{cmd}" for r in ev.preflight for name, cmd in r["commands"].items()
    )


def hist_table(ev) -> pd.DataFrame:
    """Steps accepting a = 0..k drafts, all datasets pooled (per dataset in accepted_hist.csv)."""
    return ev.hist[ev.hist.dataset == "all"].drop(columns="dataset") if len(ev.hist) else pd.DataFrame()


def live_table(ev) -> pd.DataFrame:
    """The running server's own settings, checked (empty when nothing was served)."""
    if not ev.live:
        return pd.DataFrame([{"live preflight": "no server (online_engine: none)"}])
    return pd.DataFrame(ev.live)[["name", "ok", "severity", "message"]]


def answer_markdown(ev):
    """The answer sentence in bold, and the published reference points when params name them."""
    from IPython.display import Markdown

    ref = f"\n\n**Published reference points** (other drafters/settings; not comparable 1:1): {ev.reference_text}"
    return Markdown(f"**{ev.answer}**" + (ref if ev.reference_text else ""))
