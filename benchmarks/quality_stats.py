"""The arithmetic of benchmarks/bench_quality.py's real-model table (no torch, no eagle_lib): means and spreads
over seeds, ratios with their per-seed range, and "steps ours needs to reach a peer's final tau" interpolated
on ours' measured curve with an interval over seeds.

Steps to quality: ours' tau is measured at a few points of one training (e.g. 0, 1/8, 1/4, 1/2 and all of the
budget). The steps ours needs to reach a goal tau are found by linear interpolation between the two measured
points around the curve's first crossing of the goal; a goal at or below the first point needs that point's
steps; a goal the curve never reaches is ``None`` (more than the budget). The point estimate takes ours'
seed-mean curve against the peer's seed-mean final tau; the interval is the range over every (ours seed,
peer seed) pair, each ours seed's own curve against each peer seed's final tau (``None`` anywhere makes the
upper end "beyond the budget").
"""

from __future__ import annotations

import math
import statistics


def mean_spread(xs: list[float]) -> dict:
    """{'mean', 'sd' (sample, 0 for one value), 'min', 'max', 'n'} of the per-seed values."""
    if not xs:
        raise ValueError("mean_spread: no values")
    return {
        "mean": statistics.fmean(xs),
        "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def ratio(num: list[float], den: list[float]) -> dict:
    """Ratio of the seed means, and the range of the per-seed ratios (seed i over seed i)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio: {len(num)} and {len(den)} per-seed values")
    per_seed = [a / b for a, b in zip(num, den, strict=True)]
    return {
        "ratio": statistics.fmean(num) / statistics.fmean(den),
        "min": min(per_seed),
        "max": max(per_seed),
    }


def steps_to_reach(steps: list[int], taus: list[float], goal: float) -> float | None:
    """Steps at which the curve (steps ascending, tau measured there) first reaches `goal`, interpolated
    linearly between the measured points around the crossing; None when it never does."""
    if len(steps) != len(taus) or not steps:
        raise ValueError(f"steps_to_reach: {len(steps)} steps, {len(taus)} taus")
    if any(b <= a for a, b in zip(steps[:-1], steps[1:], strict=True)):
        raise ValueError(f"steps_to_reach: steps must ascend, got {steps}")
    if taus[0] >= goal:
        return float(steps[0])
    for i in range(len(steps) - 1):
        (s0, t0), (s1, t1) = (steps[i], taus[i]), (steps[i + 1], taus[i + 1])
        if t0 < goal <= t1:
            return s0 + (goal - t0) / (t1 - t0) * (s1 - s0)
    return None


def steps_interval(steps: list[int], ours_curves: list[list[float]], peer_finals: list[float]) -> dict:
    """Steps ours needs to reach a peer's final tau: the point (ours' mean curve vs the peer's mean final) and
    the range over every (ours seed curve, peer seed final) pair; ``hi`` is None when some pair is not reached
    within the budget. Also the fraction of the peer's steps (its final is at steps[-1])."""
    if not ours_curves or not peer_finals:
        raise ValueError("steps_interval: needs at least one ours curve and one peer final tau")
    mean_curve = [statistics.fmean(c[i] for c in ours_curves) for i in range(len(steps))]
    point = steps_to_reach(steps, mean_curve, statistics.fmean(peer_finals))
    pairs = [steps_to_reach(steps, c, f) for c in ours_curves for f in peer_finals]
    reached = [x for x in pairs if x is not None]
    lo = min(reached) if reached else None
    hi = None if len(reached) < len(pairs) else max(reached)
    budget = steps[-1]
    return {
        "point": point,
        "lo": lo,
        "hi": hi,
        "pairs": len(pairs),
        "not_reached": len(pairs) - len(reached),
        "fraction": None if point is None else point / budget,
        "fraction_lo": None if lo is None else lo / budget,
        "fraction_hi": None if hi is None else hi / budget,
    }


def fmt_steps(x: float | None, budget: int) -> str:
    """A step count for the table: one decimal, or '> budget' when not reached."""
    return f"> {budget}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"
