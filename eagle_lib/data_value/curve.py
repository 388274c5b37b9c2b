"""Learning curves of tau: a saturating fit, a bootstrap over held-out prompts, projections and a verdict.

Model: ``tau(x) = a - b * x**(-c)`` with x the training tokens relative to a reference count (the run's full
training set, so x = 1 is "all the data"), ``1 <= a <= cap`` (cap = k + 1, the chain limit: every draft
accepted), ``b >= 0`` and ``c`` in (0, C_MAX]. For a fixed c the model is linear in (a, b); the fit scans c on
a log grid and solves each (a, b) by least squares with the bounds enforced (an active bound is refitted
with that parameter fixed), keeping the c of least squared error. No optimizer state, no start values:
the same points always give the same fit.

Uncertainty: tau of a drafter is a ratio of sums over held-out prompts (sum of accepted + 1 over sum of steps),
so one bootstrap draw resamples the prompts (the same draw for every drafter: the points move together, as
they share the held-out set), recomputes every tau and refits. Percentile intervals of the projections
follow; they cover evaluation noise (which prompts were held out).

Training noise (another seed trains another drafter of another tau on the same data): where some curve points
were trained with several seeds (`SeedNoise`), their pooled spread gives s (nu degrees of freedom), assumed the
same at every point (a variance model, stated in the verdict). Each bootstrap draw then also draws a variance
from the posterior of sigma^2 given s (nu s^2 / chi^2_nu: scaled inverse chi-square, flat prior on log sigma,
so few replicates give wide, t-like tails rather than a confident plug-in) and adds independent normal offsets
of that variance (over the seeds averaged) to every point's tau before refitting, and twice that variance to a
paired difference of two drafters (`diff_interval`). Replicated points enter the fit as their seeds' mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

C_GRID = np.geomspace(0.02, 3.0, 240)
C_MAX = float(C_GRID[-1])


@dataclass(frozen=True)
class Fit:
    """tau(x) = a - b * x**-c (x relative tokens); sse = sum of squared residuals."""

    a: float
    b: float
    c: float
    sse: float

    def predict(self, x) -> np.ndarray:
        return self.a - self.b * np.power(np.asarray(x, dtype=float), -self.c)

    def tokens_for(self, tau: float) -> float:
        """Relative tokens where the curve reaches tau (inf when tau >= a, the fitted ceiling)."""
        if tau >= self.a:
            return math.inf
        if self.b <= 0:  # a flat curve already at a > tau
            return 0.0
        return (self.b / (self.a - tau)) ** (1 / self.c)


def _fit_fixed_c(z: np.ndarray, y: np.ndarray, lo: float, cap: float) -> tuple[float, float, float]:
    """(a, b, sse) of y ~ a - b z with lo <= a <= cap and b >= 0 (z = x**-c)."""
    zc, yc = z - z.mean(), y - y.mean()
    den = float(zc @ zc)
    b = max(0.0, -float(zc @ yc) / den) if den > 0 else 0.0
    a = float(y.mean() + b * z.mean())
    for bound in (cap, lo):  # an active bound on a: fix a there, refit b >= 0 alone
        if (bound == cap and a > cap) or (bound == lo and a < lo):
            a = bound
            b = max(0.0, float(z @ (a - y)) / float(z @ z)) if float(z @ z) > 0 else 0.0
    r = y - (a - b * z)
    return a, b, float(r @ r)


def fit_saturating(x, y, cap: float, floor: float = 1.0) -> Fit:
    """Least-squares fit of tau = a - b x^-c to points (x relative tokens > 0, y tau); floor <= a <= cap."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or len(x) < 2:
        raise ValueError(f"fit_saturating: need >= 2 paired points (got x {x.shape}, y {y.shape})")
    if (x <= 0).any() or not np.isfinite(y).all():
        raise ValueError("fit_saturating: tokens must be > 0 and tau finite")
    best = None
    for c in C_GRID:
        a, b, sse = _fit_fixed_c(np.power(x, -c), y, floor, cap)
        if best is None or sse < best.sse - 1e-15:
            best = Fit(a, b, float(c), sse)
    return best


def ratio_tau(num: np.ndarray, den: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
    """tau per drafter from per-prompt sums: num/den (D, P) -> (D,), over prompts idx (default all)."""
    if idx is not None:
        num, den = num[:, idx], den[:, idx]
    return num.sum(1) / np.maximum(den.sum(1), 1)


def bootstrap_draws(n_prompts: int, reps: int, seed: int, strata: list | None = None) -> np.ndarray:
    """(reps, n_prompts) resampled prompt indices; within each stratum (dataset) when strata is given."""
    rng = np.random.default_rng(seed)
    if strata is None:
        return rng.integers(0, n_prompts, size=(reps, n_prompts))
    groups = [np.flatnonzero(np.asarray(strata) == s) for s in dict.fromkeys(strata)]
    return np.concatenate([g[rng.integers(0, len(g), size=(reps, len(g)))] for g in groups], axis=1)


@dataclass(frozen=True)
class SeedNoise:
    """Training noise of tau from seed replicates: pooled sd, its degrees of freedom, the seeds per point."""

    sd: float  # pooled within-point standard deviation of tau across seeds (0 when nothing was replicated)
    dof: int  # sum over points of (seeds - 1)
    seeds: tuple[int, ...]  # (D,) seeds each point's tau averages
    resampled: bool = False  # the replicates also trained on another draw of the training set

    @classmethod
    def from_replicates(cls, taus: list, resampled: bool = False) -> SeedNoise:
        """`taus[i]`: the tau of each seed trained at point i (one value: not replicated)."""
        taus = [np.asarray(t, dtype=float) for t in taus]
        if any(len(t) < 1 for t in taus):
            raise ValueError("SeedNoise: every point needs at least one tau")
        dof = sum(len(t) - 1 for t in taus)
        ss = sum(float(((t - t.mean()) ** 2).sum()) for t in taus)
        return cls(
            math.sqrt(ss / dof) if dof else 0.0, dof, tuple(len(t) for t in taus), resampled and dof > 0
        )

    def variances(self, reps: int, seed: int) -> np.ndarray:
        """(reps,) draws of sigma^2 from its posterior given s: nu s^2 / chi^2_nu (zeros when nu = 0)."""
        if self.dof == 0:
            return np.zeros(reps)
        rng = np.random.default_rng([seed, 7919])  # a stream of its own: the prompt draws stay as they were
        return self.dof * self.sd**2 / rng.chisquare(self.dof, size=reps)

    def offsets(self, reps: int, seed: int) -> np.ndarray:
        """(reps, D) training-noise offsets of the points' tau, one posterior variance per draw."""
        var = self.variances(reps, seed)
        rng = np.random.default_rng([seed, 104729])
        z = rng.standard_normal((reps, len(self.seeds)))
        return z * np.sqrt(var[:, None] / np.asarray(self.seeds, dtype=float))

    def text(self) -> str:
        if self.dof == 0:
            return "training noise not measured (no seed replicates): intervals cover held-out prompt sampling only"
        if self.resampled:
            return (
                f"intervals include retraining noise: sd {self.sd:.3f} tau ({self.dof} degrees of freedom from "
                "replicates trained with another seed on a bootstrap of their training set), assumed the same at "
                "every fraction"
            )
        return (
            f"intervals include training noise: seed sd {self.sd:.3f} tau ({self.dof} degrees of freedom from "
            "seed replicates), assumed the same at every fraction"
        )


NO_NOISE = SeedNoise(0.0, 0, ())


def quantiles(values, qs) -> np.ndarray:
    """Linear-interpolation quantiles that allow +-inf among the values: a quantile that puts any weight on an
    infinite neighbour is that infinity (numpy's interpolation turns inf - inf into NaN there)."""
    v = np.sort(np.asarray(values, dtype=float))
    if v.size == 0 or np.isnan(v).any():
        raise ValueError(f"quantiles: need non-empty values without NaN (got {v.size} values)")
    out = []
    for q in np.atleast_1d(qs):
        pos = float(q) * (v.size - 1)
        i, j = math.floor(pos), math.ceil(pos)
        t = pos - i
        a, b = v[i], v[j]
        if t == 0 or a == b:
            out.append(a)
        elif not math.isfinite(a) or not math.isfinite(b):
            out.append(b if t > 0 and not math.isfinite(b) else a)
        else:
            out.append(a + (b - a) * t)
    return np.array(out)


@dataclass
class Curve:
    """The fitted curve, its bootstrap fits and the projections asked for."""

    x: np.ndarray  # (D,) relative tokens of the points
    tau: np.ndarray  # (D,) measured tau (a replicated point: its seeds' mean)
    fit: Fit
    boot: list[Fit]
    cap: float
    multipliers: list[float]
    noise: SeedNoise = NO_NOISE

    def band(self, xs, q: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """Pointwise (lo, hi) of the bootstrap curves at xs."""
        preds = np.stack([f.predict(xs) for f in self.boot]) if self.boot else self.fit.predict(xs)[None]
        return tuple(np.quantile(preds, [(1 - q) / 2, (1 + q) / 2], axis=0))

    def projection(self, m: float, q: float = 0.95) -> dict:
        """tau at m x the reference tokens: point estimate and bootstrap interval."""
        lo, hi = self.band([m], q)
        return {
            "multiplier": m,
            "tau": float(self.fit.predict([m])[0]),
            "lo": float(lo[0]),
            "hi": float(hi[0]),
        }

    def gain(self, m: float, q: float = 0.95) -> dict:
        """tau(m) - tau(1) from the fit, with its bootstrap interval (each draw's own difference)."""
        d = [float(f.predict([m])[0] - f.predict([1.0])[0]) for f in self.boot] or [0.0]
        lo, hi = np.quantile(d, [(1 - q) / 2, (1 + q) / 2])
        return {"gain": float(self.fit.predict([m])[0] - self.fit.predict([1.0])[0]), "lo": lo, "hi": hi}

    def tokens_for(self, tau: float, q: float = 0.95) -> dict:
        """Relative tokens to reach tau: fit and bootstrap interval (inf: beyond the fitted ceiling)."""
        t = [f.tokens_for(tau) for f in self.boot] or [self.fit.tokens_for(tau)]
        lo, hi = quantiles(t, [(1 - q) / 2, (1 + q) / 2])  # draws beyond their ceiling are inf
        reach = float(np.mean(np.isfinite(t)))
        return {
            "target_tau": tau,
            "x": self.fit.tokens_for(tau),
            "lo": float(lo),
            "hi": float(hi),
            "p_reach": reach,
        }


def point_tau(
    num: np.ndarray, den: np.ndarray, groups: list[list[int]], idx: np.ndarray | None = None
) -> np.ndarray:
    """(D,) tau per point: the mean over its seeds' drafters (rows of num/den) of each one's ratio tau."""
    t = ratio_tau(num, den, idx)
    return np.array([t[g].mean() for g in groups])


def learning_curve(
    x,
    num: np.ndarray,
    den: np.ndarray,
    cap: float,
    multipliers: list[float],
    reps: int,
    seed: int,
    strata=None,
    groups: list[list[int]] | None = None,
    resampled: bool = False,
) -> Curve:
    """Fit the curve to the points' tau and bootstrap it over the prompts (and, with seed replicates, over
    training noise). num/den: (A drafters x P prompts); `groups[i]`: the rows of point i's drafters (its seeds;
    default: one drafter per point); `resampled`: the replicates trained on another draw of the training set."""
    x = np.asarray(x, dtype=float)
    groups = groups or [[i] for i in range(len(num))]
    if len(groups) != len(x):
        raise ValueError(f"learning_curve: {len(x)} points but {len(groups)} groups of drafters")
    tau = point_tau(num, den, groups)
    each = ratio_tau(num, den)
    noise = SeedNoise.from_replicates([each[g] for g in groups], resampled)
    fit = fit_saturating(x, tau, cap)
    off = noise.offsets(reps, seed)
    boot = [
        fit_saturating(x, point_tau(num, den, groups, idx) + off[r], cap)
        for r, idx in enumerate(bootstrap_draws(num.shape[1], reps, seed, strata))
    ]
    return Curve(x, tau, fit, boot, cap, list(multipliers), noise)


MIN_PROMPTS = 5  # a bootstrap over fewer prompts is no interval: such a difference is never "measurable"


def diff_interval(
    num: np.ndarray,
    den: np.ndarray,
    i: int,
    j: int,
    draws: np.ndarray,
    q: float = 0.95,
    noise: SeedNoise = NO_NOISE,
    seed: int = 0,
) -> dict:
    """tau_i - tau_j (paired: the same resampled prompts for both) with its percentile interval
    (NaN, not measurable, below MIN_PROMPTS prompts); with `noise`, each draw adds the training noise of two
    independently trained drafters (normal, twice a posterior variance draw)."""
    var = noise.variances(len(draws), seed)
    z = np.random.default_rng([seed, 15485863]).standard_normal(len(draws))
    d = [
        float(t[i] - t[j] + z[r] * math.sqrt(2 * var[r]))
        for r, t in enumerate(ratio_tau(num, den, idx) for idx in draws)
    ]
    few = num.shape[1] < MIN_PROMPTS or not d
    lo, hi = (math.nan, math.nan) if few else np.quantile(d, [(1 - q) / 2, (1 + q) / 2])
    full = ratio_tau(num, den)
    return {
        "diff": float(full[i] - full[j]),
        "lo": float(lo),
        "hi": float(hi),
        "measurable": bool(lo > 0 or hi < 0),
    }


def verdict(curve: Curve, min_gain: float, q: float = 0.95) -> dict:
    """Data-limited / saturated / undetermined, from the projected gain of doubling the data."""
    now = curve.projection(1.0, q)
    two = curve.projection(2.0, q)
    g = curve.gain(2.0, q)
    span = f"{now['tau']:.2f} to {two['tau']:.2f} [{two['lo']:.2f}, {two['hi']:.2f}]"
    if g["lo"] > min_gain:
        kind = "data-limited"
        text = f"data-limited: doubling the data is projected to raise tau from {span} (gain {g['gain']:+.2f}, " \
               f"interval [{g['lo']:+.2f}, {g['hi']:+.2f}] excludes gains below {min_gain})"  # fmt: skip
    elif g["hi"] < min_gain:
        kind = "saturated"
        text = f"saturated: doubling the data is projected to move tau only from {span} (gain {g['gain']:+.2f}, " \
               f"interval [{g['lo']:+.2f}, {g['hi']:+.2f}] below {min_gain}): capacity or recipe is the limit, " \
               f"fitted ceiling {curve.fit.a:.2f} of the chain limit {curve.cap:.0f}"  # fmt: skip
    else:
        kind = "undetermined"
        text = f"undetermined: doubling the data is projected to move tau from {span} (gain {g['gain']:+.2f}, " \
               f"interval [{g['lo']:+.2f}, {g['hi']:+.2f}] straddles {min_gain}); more held-out prompts, " \
               "another subset point or more seeds would decide"  # fmt: skip
    text += f" ({curve.noise.text()})"
    top = int(np.argmax(curve.x))  # the fit must also pass the full-data point, or its shape is wrong
    miss = float(curve.tau[top] - curve.fit.predict([curve.x[top]])[0])
    if abs(miss) > max(0.05, (now["hi"] - now["lo"]) / 2):
        text += (
            f". Caution: the fit misses the largest subset by {miss:+.2f} tau (measured {curve.tau[top]:.2f}); "
            + (
                "tau is still steepening there, so the projection is conservative (small subsets may be "
                "under-trained at the 05 epochs: steps: fixed separates data from compute)"
                if miss > 0
                else "tau flattens faster than the fitted form, so the projection is optimistic"
            )
        )
    return {"kind": kind, "text": text, "gain_2x": g, "tau_now": now, "tau_2x": two, "fit_miss": miss}
