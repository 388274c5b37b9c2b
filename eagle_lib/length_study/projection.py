"""Stage 04's projection of runs in progress: final token totals, truncation and short shares, with intervals.

With 03's ledger (`engines.ledger`) a B dataset in progress is estimated by `analysis.censored`: in-flight
responses are right-censored, the prompts not started are projected from the Kaplan-Meier distribution. The
table also keeps the old finished-only projection beside it ("naive_*"), which shows how much the in-flight
responses move the estimate. Without a ledger (a run made before 03 kept one) the finished-only projection is
all there is, and the table says so (method "finished only"): mid-run, it under-states long datasets.
A datasets and finished B datasets are measured, not projected.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from eagle_lib.length_study import censored
from eagle_lib.length_study.scan import Lengths
from eagle_lib.store import iter_lines, read_json

if TYPE_CHECKING:
    from eagle_lib.length_study.settings import Params


def bootstrap_remaining(
    values: np.ndarray, remaining: int, reps: int, rng: np.random.Generator
) -> np.ndarray:
    """(reps,) draws of the token total of `remaining` future samples, predicted from the measured `values`.

    Each replicate resamples the measured values (a multinomial over their distinct values, so the cost does
    not grow with n), then draws the sum of `remaining` new samples from that resample (normal, by the CLT):
    mean and spread both vary. Right for prompts and finished datasets' kin; for completions mid-run it assumes
    the finished responses are a random sample, which they are not (short ones finish first).
    """
    if remaining <= 0:
        return np.zeros(reps)
    u, c = np.unique(values, return_counts=True)
    u, n = u.astype(np.float64), values.size
    chunk = max(1, 4_000_000 // u.size)  # bound the (chunk, distinct) count matrix
    out = []
    for lo in range(0, reps, chunk):
        counts = rng.multinomial(n, c / n, size=min(chunk, reps - lo))  # (r, distinct)
        mean = counts @ u / n
        var = np.maximum(counts @ (u * u) / n - mean * mean, 0.0)
        draws = remaining * mean + np.sqrt(remaining * var) * rng.standard_normal(mean.size)
        out.append(np.maximum(draws, 0.0))  # the normal tail must not remove tokens already counted
    return np.concatenate(out)


def b_plan(run_dir: Path, name: str, infer_limit: int = 0) -> tuple[int | None, bool]:
    """(planned samples of a B dataset, None if unknown; True if 03 has finished it).

    Finished: 03's infer/<ds>/meta.json names what it selected ("read"). Otherwise the prompts 02 kept (its
    meta.json "kept", else the lines of prompts.jsonl), capped at 03's limit.
    """
    src, done = run_dir / "data" / "B" / name, run_dir / "infer" / name / "meta.json"
    meta = read_json(done) if done.exists() else {}
    if meta.get("finished") and isinstance(meta.get("read"), int):
        return meta["read"], True
    planned = read_json(src / "meta.json").get("kept") if (src / "meta.json").exists() else None
    if not isinstance(planned, int) and (src / "prompts.jsonl").exists():
        planned = sum(1 for _, line, _ in iter_lines(src / "prompts.jsonl", 1 << 24) if line.strip())
    if not isinstance(planned, int):
        return None, False
    return (min(planned, infer_limit) if infer_limit > 0 else planned), False


def run_state(ls: Lengths, limit: int, planned: int | None, as_of: float = 0.0) -> censored.RunState:
    """A B dataset's ledger view; as_of 0: the last moment its files record (a start or a finish)."""
    a, t, f = ls.arrays(), ls.timing, ls.in_flight
    start, end = np.frombuffer(t["start"], "d"), np.frombuffer(t["end"], "d")
    in_start = np.frombuffer(f["start"], "d")
    if not as_of:
        seen = [x[np.isfinite(x)] for x in (start, end, in_start)]
        as_of = max((float(x.max()) for x in seen if x.size), default=0.0)
    return censored.RunState(a["completion"], a["status"], start, end, np.frombuffer(t["server"], "h"),
                             in_start, np.frombuffer(f["server"], "h"), limit, planned, as_of,
                             np.frombuffer(f["n"], "q"), np.frombuffer(f["n_t"], "d"))  # fmt: skip


def _kw(p: Params, reps: int, seed: int) -> dict:
    return dict(reps=reps, interval=p.interval, short=p.short_tokens, quantile=p.censor_rate_quantile,
                typical=p.typical_rate_quantile, seed=seed)  # fmt: skip


def projection(lengths: list[Lengths], run_dir: Path, p: Params, seed: int, limits: dict[str, int]):
    """(table, corpus, estimates): per dataset and token kind, measured / projected / interval; corpus totals.

    `estimates`: B dataset -> censored.estimate of its completions (in progress with a ledger only), for the
    verdicts. A dataset without a ledger and with too few completed samples is not projected but flagged.
    """
    rng, tail = np.random.default_rng(seed), (1 - p.interval) / 2 * 100
    rows, corpus_reps, unprojected, estimates = [], {}, [], {}
    for ls in lengths:
        a = ls.arrays()
        n = a["completion"].size
        planned, finished = b_plan(run_dir, ls.name, p.infer_limit) if ls.kind == "B" else (n, True)
        in_flight = len(ls.in_flight["start"]) if not finished else 0
        remaining = 0 if finished or planned is None else max(planned - n, 0, in_flight)
        live = ls.kind == "B" and ls.ledger and remaining > 0
        too_few = remaining > 0 and not live and n < max(1, p.min_samples_to_project)
        unprojected += [f"{ls.kind}/{ls.name}"] if too_few else []
        status = "complete" if finished or (planned is not None and remaining == 0) else "in progress"
        status = "planned unknown" if planned is None and not finished else status
        method = "censored" if live else "finished only" if remaining else "measured"
        head = dict(status=status, method=method, completed=n, in_flight=in_flight, planned=planned)
        head |= dict(remaining=remaining, too_few_to_project=too_few)
        est = None
        if live:
            state = run_state(ls, limits.get(ls.name, 0), planned, p.as_of)
            est = estimates[ls.name] = censored.estimate(state, **_kw(p, p.bootstrap_reps, seed))
        comp_draws = None
        for kind, x in (("prompt", a["prompt"]), ("completion", a["completion"])):
            measured = int(x.sum())
            naive = measured + (0 if too_few else bootstrap_remaining(x, remaining, p.bootstrap_reps, rng))
            naive_pt = np.nan if too_few else measured + remaining * (x.mean() if n else 0.0)
            lo_d, hi_d = (naive, naive) if est is None or kind == "prompt" else est["draws"]
            corpus_reps[kind] = [
                a + b for a, b in zip(corpus_reps.get(kind, (0, 0)), (lo_d, hi_d), strict=True)
            ]
            if kind == "completion":
                comp_draws = (lo_d, hi_d)
            else:
                prompt_draws = (lo_d, hi_d)
            point = est["tokens"][0] if est is not None and kind == "completion" else naive_pt
            lo, hi = (
                (np.nan, np.nan) if too_few else (np.percentile(lo_d, tail), np.percentile(hi_d, 100 - tail))
            )
            rows.append(dict(kind=ls.kind, dataset=ls.name, tokens=kind) | head | dict(measured=measured,
                        projected=point, lo=lo, hi=hi, naive_projected=naive_pt,
                        naive_lo=np.nan if too_few else np.percentile(naive, tail),
                        naive_hi=np.nan if too_few else np.percentile(naive, 100 - tail)))  # fmt: skip
        pc = rows[-2], rows[-1]
        total = {k: pc[0][k] + pc[1][k] for k in ("measured", "projected", "naive_projected")}
        lo_t, hi_t = (prompt_draws[0] + comp_draws[0]), (prompt_draws[1] + comp_draws[1])
        total |= dict(lo=np.nan if too_few else np.percentile(lo_t, tail))
        total |= dict(hi=np.nan if too_few else np.percentile(hi_t, 100 - tail))
        total |= {k: pc[0][k] + pc[1][k] for k in ("naive_lo", "naive_hi")}  # bounds of the sum: conservative
        rows.append(dict(kind=ls.kind, dataset=ls.name, tokens="total") | head | total)
        corpus_reps["total"] = [
            a + b for a, b in zip(corpus_reps.get("total", (0, 0)), (lo_t, hi_t), strict=True)
        ]
    table = pd.DataFrame(rows)
    corpus: dict = {"unprojected": unprojected, "interval": p.interval}
    for kind, (lo_r, hi_r) in corpus_reps.items():
        sub = table[table.tokens == kind]
        projected = float(sub.projected.fillna(sub.measured).sum())
        lo, hi = float(np.percentile(lo_r, tail)), float(np.percentile(hi_r, 100 - tail))
        corpus[kind] = dict(measured=int(sub.measured.sum()), projected=projected, lo=lo, hi=hi)
    return table, corpus, estimates


def timeline(lengths: list[Lengths], p: Params, seed: int, limits: dict[str, int], planned: dict[str, int],
             points: int = 8) -> pd.DataFrame:  # fmt: skip
    """The estimate and its interval against time, per B dataset in progress with a ledger: as a reader would
    have computed it at `points` moments from the first start to now (from the same files: finish and start
    times are recorded). Shows the estimate settle; the finished-only projection beside it."""
    rows = []
    for ls in lengths:
        if ls.kind != "B" or not ls.ledger or ls.name not in planned:
            continue
        state = run_state(ls, limits.get(ls.name, 0), planned[ls.name], p.as_of)
        starts = np.concatenate([state.start, state.in_start])
        starts = starts[np.isfinite(starts)]
        if not starts.size:
            continue
        t0 = float(starts.min())
        for t in np.linspace(t0, state.as_of, points + 1)[1:]:
            snap = state.at(float(t))
            est = censored.estimate(snap, **_kw(p, min(p.bootstrap_reps, 300), seed))
            old = censored.naive(snap, reps=300, interval=p.interval, seed=seed)
            rows.append({"dataset": ls.name, "time": float(t), "hours": (float(t) - t0) / 3600,
                         "finished": est["finished"], "in_flight": est["in_flight"],
                         **{f"tokens_{k}": v for k, v in zip(("est", "lo", "hi"), est["tokens"], strict=True)},
                         **{f"limit_{k}": v for k, v in zip(("est", "lo", "hi"), est["share_at_limit"], strict=True)},
                         "naive_tokens": old["tokens"][0], "naive_limit": old["share_at_limit"][0]})  # fmt: skip
    return pd.DataFrame(rows)
