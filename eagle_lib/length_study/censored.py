"""Mid-run estimates without survivor bias: in-flight responses are right-censored, not missing.

03 appends responses as they finish, so mid-run the finished set over-represents short answers. With 03's
ledger of started requests (`engines.ledger`) and its seeded random order, the started set is a random sample of
the dataset, and each started request is either finished (its length T is known) or still in flight (T is at
least what it has produced so far). This module estimates, per dataset, the length distribution (Kaplan-Meier),
its mean, the share cut at the limit, the share of short responses and the final token total, with bootstrap
intervals, and projects the prompts not yet started from that distribution.

Censoring. A request started at s has produced at least C = r_low x (as_of - s) tokens by `as_of`, where r_low
is a low quantile of its server's measured per-request rate (finished: tokens / latency). The same C is applied
to the finished requests too (one that finished with T > C is counted as censored at C): the censoring then
depends on start times only, never on T, which is what Kaplan-Meier needs to be unbiased.

Tail. When the longest observations are censored, Kaplan-Meier leaves mass S_end beyond them undistributed. The
estimates are then bounds: "low" puts S_end just above the largest censored value (not at the limit), "high" at
the limit. The interval runs from the low bound's lower percentile to the high bound's upper one, so it covers
the final value when either bound is right; a verdict whose threshold lies inside it is "undetermined yet".

Point estimate of the shares. Between those bounds the data alone do not decide (the tail beyond the longest
observation is undistributed), so the point estimate of the share cut at the limit and of the short share comes
from a model: a lognormal of (length + 1) fitted by maximum likelihood to the finished lengths (exact) and the
in-flight ones (longer than what they have typically produced; at the limit: at least the limit), with
scipy's optimizer (`lognormal_fit`). Reasoning lengths are close to lognormal; the model only places the point inside the
nonparametric interval (it is clipped to it), it never narrows the interval.

Written here, not taken from lifelines / scipy: `kaplan_meier` does all bootstrap replicates at once from (R, G)
weights (lifelines fits one sample a call), and the predictive draws are no statistic scipy.stats.bootstrap
resamples (tests check the KM against lifelines and a product-limit loop).

Bootstrap. Units are resampled by multinomial counts over distinct (value, kind) groups, so a replicate costs
O(distinct lengths), not O(samples). Each replicate is a predictive draw of the final quantity: the measured
part is fixed, in-flight requests add their conditional mean E[T | T > C_i] and the unstarted ones m x mean,
with the normal spread of their sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

EVENT, LIMIT, CENSORED = 0, 1, 2  # group kinds: finished below the limit, finished at the limit, censored


@dataclass
class RunState:
    """One dataset of a run as of `as_of`: finished requests (n,) and in-flight ones (k,); times in unix seconds."""

    completion: np.ndarray  # (n,) output tokens of each finished request
    status: np.ndarray  # (n,) 0 stop, 1 at the limit, 2 other
    start: np.ndarray  # (n,) start time (nan: unknown)
    end: np.ndarray  # (n,) finish time (nan: unknown)
    server: np.ndarray  # (n,) server code
    in_start: np.ndarray  # (k,) start times of the requests in flight
    in_server: np.ndarray  # (k,) their server codes
    limit: int  # max_new_tokens
    planned: int | None  # prompts this dataset will have answered in all (None: unknown)
    as_of: float  # the moment the state describes
    in_count: np.ndarray | None = (
        None  # (k,) tokens an in-flight request had produced at in_count_t (engine's count)
    )
    in_count_t: np.ndarray | None = None  # (k,) when (nan: no count)

    @property
    def not_started(self) -> int:
        return max((self.planned or 0) - self.completion.size - self.in_start.size, 0)

    def at(self, t: float) -> RunState:
        """The state as a reader would have seen it at time t (<= as_of): finished by t, started by t."""
        done = self.end <= t
        was_running = (self.start <= t) & ~done
        keep_in = self.in_start <= t
        count, count_t = self.counts()
        count_t = np.where(count_t <= t, count_t, np.nan)[keep_in]  # a count taken after t was not known at t
        extra = int(was_running.sum())  # requests finished after t: no count recorded while they ran
        return replace(self, completion=self.completion[done], status=self.status[done], start=self.start[done],
                       end=self.end[done], server=self.server[done],
                       in_start=np.concatenate([self.in_start[keep_in], self.start[was_running]]),
                       in_server=np.concatenate([self.in_server[keep_in], self.server[was_running]]), as_of=t,
                       in_count=np.concatenate([np.where(np.isfinite(count_t), count[keep_in], 0), np.zeros(extra)]),
                       in_count_t=np.concatenate([count_t, np.full(extra, np.nan)]))  # fmt: skip

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(k,) streamed token counts of the in-flight requests and their times (0, nan where none)."""
        k = self.in_start.size
        if self.in_count is None or self.in_count_t is None:
            return np.zeros(k), np.full(k, np.nan)
        return self.in_count.astype(np.float64), self.in_count_t.astype(np.float64)


def low_rates(s: RunState, quantile: float) -> dict[int, float]:
    """Server code -> a low quantile of its finished requests' tokens/s (all servers pooled: key -1)."""
    dt = s.end - s.start
    ok = np.isfinite(dt) & (dt > 0) & (s.completion > 0)
    rate, srv = s.completion[ok] / dt[ok], s.server[ok]
    out = {-1: float(np.quantile(rate, quantile)) if rate.size else 0.0}
    for code in np.unique(srv):
        r = rate[srv == code]
        out[int(code)] = float(np.quantile(r, quantile)) if r.size >= 20 else out[-1]
    return out


def censor_points(s: RunState, quantile: float) -> tuple[np.ndarray, np.ndarray]:
    """(finished (n,), in-flight (k,)) tokens each request has produced by as_of: floor(rate quantile x elapsed)."""
    rates = low_rates(s, quantile)
    r = lambda codes: np.array([rates.get(int(c), rates[-1]) for c in codes], dtype=np.float64)  # noqa: E731
    fin = np.floor(r(s.server) * np.maximum(s.as_of - s.start, 0.0))
    fin = np.where(np.isfinite(fin), fin, np.inf)  # unknown start: never censored
    inf = np.floor(r(s.in_server) * np.maximum(s.as_of - s.in_start, 0.0))
    inf = np.maximum(inf, counted(s, r(s.in_server)))
    return fin, np.minimum(inf, max(s.limit - 1, 0))  # still running: below the limit


def counted(s: RunState, rate: np.ndarray) -> np.ndarray:
    """(k,) lower bounds from the engine's streamed counts: n at t, plus rate x (as_of - t); 0 without a count."""
    n, t = s.counts()
    return np.where(
        np.isfinite(t), np.floor(n + rate * np.maximum(s.as_of - np.nan_to_num(t, nan=s.as_of), 0)), 0
    )


def count_rate(s: RunState) -> float | None:
    """One request's decode tokens/s from the engine's streamed counts: the median over the in-flight requests
    with a count of n / (t - start); None when the engine gives no counts (the HTTP engines)."""
    n, t = s.counts()
    ok = np.isfinite(t) & (t > s.in_start) & (n > 0)
    return float(np.median(n[ok] / (t[ok] - s.in_start[ok]))) if ok.any() else None


def typical_produced(s: RunState, quantile: float) -> np.ndarray:
    """(k,) what each in-flight request has typically produced.

    With the engine's streamed counts (the embedded engine records one per request every few seconds): its
    latest count plus `count_rate` x the seconds since (no count yet: that rate x elapsed). Otherwise
    (elapsed - overhead) / seconds per token:

    Per server, latency = overhead + tokens x seconds-per-token is fitted by least squares over its finished
    requests (queueing and prefill are the overhead, so long requests are not judged by short ones' rates);
    with fewer than 10 of them, or a fit that is not increasing, the `quantile` rate x elapsed. Never below the
    sure lower bound, never at the limit (it would have finished).
    """
    cr = count_rate(s)
    if cr is not None:  # counted: finished requests' rates (short ones finish fast) would overstate it
        rate = np.full(s.in_start.size, cr)
        fresh = np.floor(cr * np.maximum(s.as_of - s.in_start, 0.0))  # started since the last count
        out = np.where(np.isfinite(s.counts()[1]), counted(s, rate), fresh)
        return np.minimum(out, max(s.limit - 1, 0))
    low = censor_points(s, quantile)[1]
    dt, out = s.end - s.start, low.copy()
    ok = np.isfinite(dt) & (dt > 0)
    for code in np.unique(s.in_server):
        mine, srv = s.in_server == code, ok & (s.server == code)
        if srv.sum() < 10:
            srv = ok
        x, y = s.completion[srv].astype(np.float64), dt[srv]
        if srv.sum() < 10 or np.ptp(x) == 0:
            continue
        slope, overhead = np.polyfit(x, y, 1)
        if slope > 0:
            out[mine] = np.floor(np.maximum(s.as_of - s.in_start[mine] - max(overhead, 0.0), 0.0) / slope)
    return np.minimum(np.maximum(out, low), max(s.limit - 1, 0))


def groups(s: RunState, c_fin: np.ndarray, c_in: np.ndarray, bins: int = 2048):
    """(value, kind, count) per group, sorted by value (events before censored at a tie).

    Values are grouped in bins of limit / `bins` tokens, so a bootstrap replicate costs O(bins): an event group
    sits at its members' mean length, a censored group at its bin's floor (still a lower bound).
    """
    step = max(1, s.limit // bins)
    cut = s.completion > c_fin
    kind = np.concatenate(
        [np.where(cut, CENSORED, np.where(s.status == 1, LIMIT, EVENT)), np.full(c_in.size, CENSORED)]
    )
    value = np.concatenate([np.where(cut, c_fin, s.completion), c_in]).astype(np.int64)
    key, inverse, counts = np.unique((value // step) * 4 + kind, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=value.astype(np.float64), minlength=key.size)
    kinds = key % 4
    values = np.where(kinds == CENSORED, (key // 4) * step, sums / counts)
    order = np.lexsort((kinds, values))
    return values[order], kinds[order], counts[order].astype(np.float64)


@dataclass
class KM:
    """Kaplan-Meier masses per replicate: values (V,), masses (R, V), limit masses (R, V), tail mass (R,)."""

    values: np.ndarray
    mass: np.ndarray
    limit_mass: np.ndarray
    tail: np.ndarray
    last: float  # where the low bound puts the tail: the largest value seen
    limit: float  # where the high bound puts it


def kaplan_meier(values, kinds, w: np.ndarray, limit: int) -> KM:
    """KM over groups with weights w (R, G) (counts or bootstrap counts); ties: events first, censored at risk."""
    v, first = np.unique(values, return_index=True)
    ev = np.add.reduceat(w * (kinds != CENSORED), first, axis=1)  # (R, V)
    lim = np.add.reduceat(w * (kinds == LIMIT), first, axis=1)
    at_risk = np.cumsum(np.add.reduceat(w, first, axis=1)[:, ::-1], axis=1)[:, ::-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        h = np.where(at_risk > 0, ev / at_risk, 0.0)
        lim_h = np.where(at_risk > 0, lim / at_risk, 0.0)
    after = np.cumprod(1.0 - h, axis=1)
    before = np.concatenate([np.ones((w.shape[0], 1)), after[:, :-1]], axis=1)
    return KM(v.astype(np.float64), before * h, before * lim_h, after[:, -1], float(v[-1]), float(limit))


def _above(x: np.ndarray) -> np.ndarray:
    """(R, V+1): column j holds the sum of x's columns j.. (the last column: nothing above)."""
    return np.concatenate([np.cumsum(x[:, ::-1], axis=1)[:, ::-1], np.zeros((x.shape[0], 1))], axis=1)


def _tails(km: KM, c: np.ndarray) -> dict:
    """Per replicate and in-flight bound c (k,): tail mass, first and second moments above c, limit mass above c."""
    idx = np.searchsorted(km.values, c, side="right")  # first value > c
    return {
        "m0": _above(km.mass)[:, idx], "m1": _above(km.mass * km.values)[:, idx],
        "m2": _above(km.mass * km.values**2)[:, idx], "lim": _above(km.limit_mass)[:, idx],
    }  # fmt: skip


def _predict(km: KM, c_in: np.ndarray, n_in: np.ndarray, m: int, base: dict, where: str, short: int) -> dict:
    """(mean, sd) of the final token total and at-limit count, and the distribution's mean, limit and short
    shares, per replicate (R,), with the undistributed tail placed `where` ("low": at the largest value seen,
    "high": at the limit)."""
    at = np.maximum(km.last, c_in[None, :]) if where == "low" else np.full((1, c_in.size), km.limit)
    t_all = km.tail[:, None]
    loc = km.last if where == "low" else km.limit
    mean = (km.mass * km.values).sum(1) + km.tail * loc  # (R,)
    second = (km.mass * km.values**2).sum(1) + km.tail * loc**2
    p_lim = km.limit_mass.sum(1) + (km.tail if where == "high" else 0.0)
    p_short = km.mass[:, km.values < short].sum(1) + (km.tail if where == "high" and loc < short else 0.0)
    tl = _tails(km, c_in)
    s0 = tl["m0"] + t_all  # P(T > c_i) per replicate (R, k)
    with np.errstate(invalid="ignore", divide="ignore"):
        c_mean = np.where(s0 > 0, (tl["m1"] + t_all * at) / s0, at)
        c_var = np.where(s0 > 0, (tl["m2"] + t_all * at**2) / s0 - c_mean**2, 0.0)
        c_lim = np.where(s0 > 0, (tl["lim"] + (t_all if where == "high" else 0.0)) / s0, 0.0)
    var = np.maximum(second - mean**2, 0.0)
    tok_mu = base["tokens"] + c_mean @ n_in + m * mean  # n_in (k,): in-flight requests per distinct bound
    tok_sd = np.sqrt(np.maximum(c_var, 0) @ n_in + m * var)
    lim_mu = base["at_limit"] + c_lim @ n_in + m * p_lim
    lim_sd = np.sqrt((c_lim * (1 - c_lim)) @ n_in + m * p_lim * (1 - p_lim))
    return {"tokens": (tok_mu, tok_sd), "at_limit": (lim_mu, lim_sd), "mean": mean, "p_limit": p_lim,
            "p_short": p_short}  # fmt: skip


def norm_sf(z: np.ndarray) -> np.ndarray:
    """P(Z > z) of a standard normal (scipy's ndtr, exact in the far tails)."""
    from scipy.special import ndtr

    return ndtr(-np.asarray(z, dtype=np.float64))


def lognormal_fit(
    events: np.ndarray, ew: np.ndarray, cens: np.ndarray, cw: np.ndarray
) -> tuple[float, float] | None:
    """Maximum-likelihood (mu, sigma) of log(T + 1) from exact lengths `events` (weights `ew`) and right-censored
    ones T > `cens` (weights `cw`): scipy's optimizer on the weighted censored normal log-likelihood (log pdf
    of the exact ones, log sf of the censored ones; closed form without censoring). sigma has a floor of 0.05
    (identical lengths would give 0). None without any exact length (no scale)."""
    from scipy.optimize import minimize
    from scipy.special import log_ndtr

    if ew.sum() <= 0:
        return None
    y, c = np.log1p(events.astype(np.float64)), np.log1p(cens.astype(np.float64))
    mu0 = float(np.average(y, weights=ew))
    sd0 = max(float(np.sqrt(np.average((y - mu0) ** 2, weights=ew))), 0.05)
    if cw.sum() <= 0:
        return mu0, sd0

    def nll(theta: np.ndarray) -> tuple[float, np.ndarray]:
        mu, log_sd = theta
        sd = math.exp(log_sd)
        z, zc = (y - mu) / sd, (c - mu) / sd
        lsf = log_ndtr(-zc)
        lam = np.exp(-0.5 * zc * zc - 0.5 * math.log(2 * math.pi) - lsf)  # pdf / sf at the censoring points
        f = float((ew * (0.5 * z * z + log_sd)).sum() - (cw * lsf).sum())
        d_mu = float(-(ew * z).sum() / sd - (cw * lam).sum() / sd)
        d_lsd = float((ew * (1 - z * z)).sum() - (cw * lam * zc).sum())
        return f, np.array([d_mu, d_lsd])

    res = minimize(nll, np.array([mu0, math.log(sd0)]), jac=True, method="L-BFGS-B",
                   bounds=[(None, None), (math.log(0.05), None)], options={"ftol": 1e-15, "gtol": 1e-10})  # fmt: skip
    return float(res.x[0]), float(math.exp(res.x[1]))


def model_shares(s: RunState, c_in: np.ndarray, short: int) -> dict | None:
    """Point estimates of the final share at the limit and the short share under `lognormal_fit`: measured for
    the finished, P(. | T > c_i) for the in-flight (c_in: what each has typically produced), the unconditional
    probability for those not started. None when nothing has finished below the limit yet."""
    below = s.status != 1
    ev, ev_w = np.unique(s.completion[below], return_counts=True)
    n_lim = int((~below).sum())
    cv, cv_w = np.unique(np.concatenate([c_in, np.full(n_lim, s.limit)]), return_counts=True)
    fit = lognormal_fit(ev, ev_w.astype(np.float64), cv, cv_w.astype(np.float64))
    if fit is None:
        return None
    mu, sd = fit
    z = lambda x: (np.log1p(np.asarray(x, dtype=np.float64)) - mu) / sd  # noqa: E731
    sf_lim = float(norm_sf(z(s.limit - 0.5)))  # P(T >= limit): lengths are integers
    sf_short = float(norm_sf(z(short - 0.5)))  # P(T >= short)
    sf_c = np.maximum(norm_sf(z(c_in + 0.5)), 1e-300)  # P(T > c_i)
    p_lim_in = np.minimum(sf_lim / sf_c, 1.0)
    p_short_in = np.where(c_in < short - 1, np.clip((sf_c - sf_short) / sf_c, 0.0, 1.0), 0.0)
    m, planned = s.not_started, s.completion.size + c_in.size + s.not_started
    return {
        "share_at_limit": (n_lim + p_lim_in.sum() + m * sf_lim) / planned,
        "share_short": (float((s.completion < short).sum()) + p_short_in.sum() + m * (1 - sf_short)) / planned,
        "mu": mu, "sigma": sd,
    }  # fmt: skip


def _interval(lo: np.ndarray, hi: np.ndarray, tail: float) -> tuple[float, float, float]:
    """(point, lo, hi): the midpoint of the bounds' medians and the outer percentiles."""
    point = float(np.median((lo + hi) / 2))
    return point, float(np.percentile(lo, tail)), float(np.percentile(hi, 100 - tail))


def estimate(s: RunState, reps: int = 400, interval: float = 0.95, short: int = 32, quantile: float = 0.1,
             typical: float = 0.5, seed: int = 0) -> dict:  # fmt: skip
    """Censoring-aware estimates of one dataset's final totals; {quantity: (point, lo, hi)} plus counts."""
    rng, tail = np.random.default_rng(seed), (1 - interval) / 2 * 100
    n, k, m = s.completion.size, s.in_start.size, s.not_started
    base = {"tokens": float(s.completion.sum()), "at_limit": float((s.status == 1).sum())}
    planned = n + k + m
    out = {"finished": n, "in_flight": k, "not_started": m, "planned": planned}
    if n + k == 0:
        nan = dict.fromkeys(("tokens", "share_at_limit", "share_short", "mean"), (np.nan,) * 3)
        return out | nan | {"draws": (np.zeros(reps), np.zeros(reps))}
    if k == 0 and m == 0:  # complete: measured, no interval needed
        exact = (
            base["tokens"],
            base["at_limit"] / n,
            float((s.completion < short).mean()),
            base["tokens"] / n,
        )
        names = ("tokens", "share_at_limit", "share_short", "mean")
        return out | {q: (v, v, v) for q, v in zip(names, exact, strict=True)} | {
            "draws": (np.full(reps, base["tokens"]),) * 2}  # fmt: skip
    c_fin, c_in = censor_points(s, quantile)
    values, kinds, counts = groups(s, c_fin, c_in)
    c_typ = typical_produced(s, typical)  # what an in-flight request has typically produced
    produced = c_typ.copy()
    step = max(1, s.limit // 2048)  # in-flight bounds on the groups' grid (floored: still lower bounds)
    c_typ, n_typ = np.unique(c_typ // step * step, return_counts=True)  # (R, distinct) arrays, not (R, k)
    w = rng.multinomial(n + k, counts / counts.sum(), size=reps).astype(np.float64)  # (R, G)
    km = kaplan_meier(values, kinds, w, s.limit)
    draws = {}
    for where in ("low", "high"):
        p = _predict(km, c_typ, n_typ.astype(np.float64), m, base, where, short)
        z = rng.standard_normal((2, reps))
        draws[where] = {
            "tokens": np.maximum(p["tokens"][0] + p["tokens"][1] * z[0], base["tokens"]),
            "at_limit": np.clip(p["at_limit"][0] + p["at_limit"][1] * z[1], base["at_limit"], planned) / planned,
            "mean": p["mean"], "p_short": p["p_short"],
        }  # fmt: skip
    lo, hi = draws["low"], draws["high"]
    res = out | {
        "tokens": _interval(lo["tokens"], hi["tokens"], tail),
        "share_at_limit": _interval(lo["at_limit"], hi["at_limit"], tail),
        "share_short": _interval(np.minimum(lo["p_short"], hi["p_short"]), np.maximum(lo["p_short"], hi["p_short"]), tail),
        "mean": _interval(lo["mean"], hi["mean"], tail),
        "draws": (lo["tokens"], hi["tokens"]),  # (R,) each: the corpus interval sums them over datasets
        "point_model": "bounds' midpoint",
    }  # fmt: skip
    # a tail not yet seen: the started requests still running past what 90% of the finished ones produced
    p90 = float(np.quantile(s.completion, 0.9)) if n >= 10 else float("nan")
    res["outlived"] = (float((produced > p90).sum()) / (n + k) if np.isfinite(p90) else 0.0, p90)
    model = model_shares(s, produced, short)
    if model is not None:  # the shares' point from the lognormal, inside the nonparametric interval
        for q in ("share_at_limit", "share_short"):
            _, q_lo, q_hi = res[q]
            res[q] = (float(np.clip(model[q], q_lo, q_hi)), q_lo, q_hi)
        res["point_model"] = (
            f"lognormal fit (mu {model['mu']:.2f}, sigma {model['sigma']:.2f} of log(tokens + 1))"
        )
    return res


def naive(s: RunState, reps: int = 400, interval: float = 0.95, seed: int = 0) -> dict:
    """The estimator 04 used before (finished responses only, as if they were a random sample), for comparison."""
    rng, tail = np.random.default_rng(seed), (1 - interval) / 2 * 100
    x, n = s.completion.astype(np.float64), s.completion.size
    remaining = (s.planned or n) - n
    if n == 0:
        return {"tokens": (np.nan,) * 3, "share_at_limit": (np.nan,) * 3}
    idx = rng.integers(0, n, size=(reps, n)) if n * reps <= 4_000_000 else None
    if idx is None:
        means = rng.normal(x.mean(), x.std() / np.sqrt(n), reps)
        share = (s.status == 1).mean()
        shares = rng.normal(share, np.sqrt(share * (1 - share) / n), reps)
    else:
        means, shares = x[idx].mean(1), (s.status[idx] == 1).mean(1)
    tok = x.sum() + remaining * means + np.sqrt(remaining) * x.std() * rng.standard_normal(reps)
    point = (x.sum() + remaining * x.mean(), float((s.status == 1).mean()))
    return {
        "tokens": (point[0], *np.percentile(tok, [tail, 100 - tail])),
        "share_at_limit": (point[1], *np.percentile(shares, [tail, 100 - tail])),
    }
