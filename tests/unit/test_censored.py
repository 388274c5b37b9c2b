"""04 mid-run without survivor bias (issue 16): Kaplan-Meier against a hand-written product-limit loop, the
censoring bounds, and the calibration test: snapshots of a simulated long run (the motivating mixture) at
10-80%, whose final totals and truncation shares must fall inside 04's 95% intervals in >= 90% of snapshots from
20% on, with intervals that narrow, while the finished-only estimator 04 used before fails the same test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eagle_lib.length_study import censored
from eagle_lib.length_study.censored import CENSORED, EVENT, LIMIT, RunState
from tests.support.sim_run import MIXTURE, simulate


def product_limit(times: list[float], died: list[bool]) -> dict[float, float]:
    """Textbook KM, one observation at a time: S(t) after each distinct event time (ties: deaths first)."""
    s, out = 1.0, {}
    for t in sorted(set(x for x, d in zip(times, died, strict=True) if d)):
        at_risk = sum(1 for x in times if x >= t)
        deaths = sum(1 for x, d in zip(times, died, strict=True) if d and x == t)
        s *= 1 - deaths / at_risk
        out[t] = s
    return out


def test_kaplan_meier_equals_the_product_limit_loop():
    rng = np.random.default_rng(0)
    times = rng.integers(1, 40, 200).astype(float)
    died = rng.random(200) < 0.6
    kinds = np.where(died, EVENT, CENSORED)
    key, counts = np.unique(times * 4 + kinds, return_counts=True)
    km = censored.kaplan_meier(key // 4, key % 4, counts[None, :].astype(float), 64)
    surv = 1 - np.cumsum(km.mass[0])
    ref = product_limit(list(times), list(died))
    for t, s in ref.items():
        assert surv[np.searchsorted(km.values, t)] == pytest.approx(s)
    assert km.tail[0] == pytest.approx(
        min(ref.values())
    )  # the mass beyond the last event is left undistributed


def test_without_censoring_the_estimate_is_the_empirical_distribution():
    x = np.array([5, 5, 7, 9, 12, 16])  # 16: at the limit
    vals, counts = np.unique(x, return_counts=True)
    k = censored.kaplan_meier(
        vals.astype(float), np.array([EVENT] * 4 + [LIMIT]), counts[None, :].astype(float), 16
    )
    assert (k.mass[0] * k.values).sum() == pytest.approx(x.mean()) and k.tail[0] == pytest.approx(0)
    assert list(k.mass[0]) == pytest.approx([2 / 6, 1 / 6, 1 / 6, 1 / 6, 1 / 6])
    assert k.limit_mass[0].sum() == pytest.approx(1 / 6)


def _state(completion, status, start, end, in_start, limit=100, planned=None, as_of=100.0) -> RunState:
    n, k = len(completion), len(in_start)
    return RunState(np.array(completion), np.array(status, np.int8), np.array(start, float), np.array(end, float),
                    np.zeros(n, np.int64), np.array(in_start, float), np.zeros(k, np.int64), limit,
                    planned if planned is not None else n + k, as_of)  # fmt: skip


def test_censor_points_are_a_low_rate_times_elapsed_and_stay_below_the_limit():
    # 30 finished at 1..30 tokens/s; the 10% quantile is the reference rate
    rates = np.arange(1, 31, dtype=float)
    s = _state(
        [min(10 * r, 300) for r in rates],
        [0] * 30,
        [0.0] * 30,
        [10.0] * 30,
        [90.0, 0.0],
        limit=300,
        as_of=100.0,
    )
    fin, inf = censored.censor_points(s, 0.1)
    r_low = np.quantile(rates, 0.1)
    assert inf[0] == np.floor(r_low * 10) and inf[1] == 299  # 10 s at r_low; capped below the limit
    assert np.all(fin == np.floor(r_low * 100))
    values, kinds, counts = censored.groups(s, fin, inf)
    assert counts.sum() == 32 and set(kinds) <= {EVENT, LIMIT, CENSORED}


def test_run_state_at_an_earlier_moment():
    s = _state([3, 50, 7], [0, 1, 0], [0, 0, 5], [2, 40, 9], [30.0], as_of=50.0)
    early = s.at(8.0)
    assert list(early.completion) == [3] and sorted(early.in_start) == [0.0, 5.0]  # 50 and 7 still running
    assert early.not_started == 1 and early.as_of == 8.0


def test_a_complete_dataset_is_measured_exactly():
    s = _state([3, 50, 7], [0, 1, 0], [0, 0, 5], [2, 40, 9], [])
    e = censored.estimate(s, reps=50)
    assert e["tokens"] == (60.0, 60.0, 60.0) and e["share_at_limit"] == pytest.approx((1 / 3,) * 3)


def test_nothing_finished_yet_is_undetermined_up_to_the_limit():
    s = _state([], [], [], [], [0.0, 1.0], limit=100, planned=10, as_of=5.0)
    e = censored.estimate(s, reps=50)
    assert e["share_at_limit"][1] == 0.0 and e["share_at_limit"][2] == pytest.approx(1.0)
    assert e["tokens"][2] == pytest.approx(1000.0, rel=0.05)  # every prompt could still reach the limit


# ---------------------------------------------------------------- calibration (the point of issue 16)

FRACTIONS = (0.1, 0.2, 0.4, 0.6, 0.8)
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def calibration():
    """(method, dataset, seed, fraction, quantity) -> (covered, relative width) over the simulated runs."""
    out = {}
    for seed in SEEDS:
        for name in MIXTURE:
            run = simulate(name, seed)
            truth = run.truth
            for f in FRACTIONS:
                snap = run.snapshot(f)
                for method, est in (("censored", censored.estimate(snap, reps=200, seed=seed)),
                                    ("finished only", censored.naive(snap, reps=200, seed=seed))):  # fmt: skip
                    for q in ("tokens", "share_at_limit"):
                        point, lo, hi = est[q]
                        out[method, name, seed, f, q] = (
                            lo <= truth[q] <= hi,
                            (hi - lo) / max(truth[q], 1e-3),
                            point - truth[q],
                        )
    return out


def coverage(cal: dict, method: str, q: str, names=tuple(MIXTURE), fractions=FRACTIONS[1:]) -> float:
    hits = [
        v[0]
        for (m, d, _, f, qq), v in cal.items()
        if m == method and qq == q and f in fractions and d in names
    ]
    return float(np.mean(hits))


def test_the_simulated_run_has_the_motivating_shape():
    run = {name: simulate(name, 0) for name in MIXTURE}
    assert sum(r.final.completion.size for r in run.values()) >= 20_000
    assert (
        run["tool_calls"].truth["share_at_limit"] == 0 and np.median(run["tool_calls"].final.completion) < 100
    )
    assert 0.15 < run["reasoning"].truth["share_at_limit"] < 0.3 < run["swe"].truth["share_at_limit"]
    snap = run["reasoning"].snapshot(0.1)
    finished_mean = snap.completion.mean()
    assert finished_mean < 0.9 * run["reasoning"].final.completion.mean()  # survivor bias is real here
    assert snap.in_start.size == 4 * 64  # several servers' worth of requests in flight


@pytest.mark.parametrize("q", ["tokens", "share_at_limit"])
def test_censored_intervals_cover_the_final_values(calibration, q):
    assert coverage(calibration, "censored", q) >= 0.9


@pytest.mark.parametrize("q", ["tokens", "share_at_limit"])
def test_the_finished_only_estimator_fails_the_same_test(calibration, q):
    cut = ("reasoning", "swe")  # where answers are cut (tool calls never are: 0% is trivially inside)
    side_by_side = {
        m: (coverage(calibration, m, q), coverage(calibration, m, q, cut))
        for m in ("censored", "finished only")
    }
    print(f"coverage of {q} from 20% on (all datasets, reasoning+swe): {side_by_side}")
    assert side_by_side["finished only"][0] < 0.9 and side_by_side["finished only"][1] < 0.75
    assert side_by_side["censored"][1] >= 0.9


def test_intervals_narrow_as_the_run_proceeds(calibration):
    for name in ("reasoning", "swe"):
        for q in ("tokens", "share_at_limit"):
            widths = [
                np.median([calibration["censored", name, s, f, q][1] for s in SEEDS]) for f in FRACTIONS
            ]
            assert all(a > b for a, b in zip(widths, widths[1:], strict=False)), (name, q, widths)


def test_the_share_point_estimate_is_near_the_final_share(calibration):
    """The lognormal point (the verdicts' "likely") against the simulated truth, from 20% on: the simulation is
    lognormal, so this checks the fit and the conditioning on what each in-flight request has produced."""
    errs = [abs(v[2]) for (m, _, _, f, q), v in calibration.items()
            if m == "censored" and q == "share_at_limit" and f >= 0.2]  # fmt: skip
    print(
        f"share point estimate, |estimate - final| from 20% on: median {np.median(errs):.4f}, max {max(errs):.4f}"
    )
    assert np.median(errs) <= 0.01 and max(errs) <= 0.05, sorted(errs)[-5:]


def _loglik(mu: float, sd: float, events, cens) -> float:
    """The censored lognormal log-likelihood of log(T + 1), written with the standard library only."""
    ll = 0.0
    for x in events:
        z = (math.log1p(x) - mu) / sd
        ll += -0.5 * z * z - math.log(sd)
    for c in cens:
        ll += math.log(max(0.5 * math.erfc((math.log1p(c) - mu) / sd / math.sqrt(2)), 1e-300))
    return ll


def test_lognormal_fit_maximises_the_censored_likelihood():
    rng = np.random.default_rng(5)
    t = np.rint(rng.lognormal(5.0, 0.9, 300))
    c = np.rint(rng.uniform(20, 600, 300))  # censoring independent of T
    events, cens = t[t <= c], c[t > c]
    mu, sd = censored.lognormal_fit(events, np.ones(events.size), cens, np.ones(cens.size))
    grid = [(m, s) for m in np.arange(4.0, 6.0, 0.01) for s in np.arange(0.5, 1.5, 0.01)]
    best = max(grid, key=lambda g: _loglik(g[0], g[1], events, cens))
    assert abs(mu - best[0]) <= 0.011 and abs(sd - best[1]) <= 0.011, (mu, sd, best)
    assert _loglik(mu, sd, events, cens) >= _loglik(*best, events, cens) - 1e-6
    only = censored.lognormal_fit(events, np.ones(events.size), np.empty(0), np.empty(0))
    y = np.log1p(events)
    assert only == pytest.approx((y.mean(), y.std()))  # uncensored: the sample mean and sd of log(T + 1)
    assert censored.lognormal_fit(np.empty(0), np.empty(0), cens, np.ones(cens.size)) is None


def test_norm_sf_matches_erfc():
    z = np.linspace(-8, 8, 161)
    ref = np.array([0.5 * math.erfc(x / math.sqrt(2)) for x in z])
    assert np.all(np.abs(censored.norm_sf(z) - ref) <= 2e-7 * ref + 1e-300)


def test_streamed_counts_give_the_in_flight_progress():
    # finished requests were fast (short ones finish first): their rates would say the in-flight ones are done
    s = _state([10] * 20, [0] * 20, [0.0] * 20, [0.5] * 20, [60.0, 90.0, 99.0], limit=512, as_of=100.0)
    s.in_count, s.in_count_t = np.array([200, 50, 0]), np.array([98.0, 98.0, np.nan])
    rate = np.median([200 / 38.0, 50 / 8.0])  # n / (t - start) of the counted ones
    expect = np.floor([200 + 2 * rate, 50 + 2 * rate, 1 * rate])
    assert np.array_equal(censored.typical_produced(s, 0.5), expect)
    assert censored.count_rate(s) == pytest.approx(rate)


def test_short_answers_never_look_like_a_forming_tail():
    """The simulated tool-call answers (never cut) at every snapshot: under 5% of the started requests are still
    running past 90% of the finished lengths, so the "long tail is forming" warning stays quiet; the reasoning set
    at 40% warns outright (its interval is over the threshold)."""
    run = simulate("tool_calls", 0)
    shares = [censored.estimate(run.snapshot(f), reps=50, seed=0)["outlived"][0] for f in FRACTIONS]
    assert max(shares) < 0.05, shares
    mid = censored.estimate(simulate("reasoning", 0).snapshot(0.4), reps=50, seed=0)
    assert mid["share_at_limit"][1] > 0.05


def test_kaplan_meier_equals_lifelines_with_weights():
    """Reference: lifelines' KaplanMeierFitter on the same weighted groups (one replicate)."""
    from lifelines import KaplanMeierFitter

    rng = np.random.default_rng(3)
    times = rng.integers(1, 60, 300).astype(float)
    kinds = np.where(rng.random(300) < 0.55, EVENT, CENSORED)
    key, first = np.unique(times * 4 + kinds, return_index=True)
    w = rng.integers(1, 6, key.size).astype(float)  # group counts, as a bootstrap replicate draws them
    km = censored.kaplan_meier(key // 4, key % 4, w[None, :], 64)
    ref = KaplanMeierFitter().fit(key // 4, event_observed=(key % 4) != CENSORED, weights=w)
    surv = 1 - np.cumsum(km.mass[0])  # S just after each distinct value
    want = ref.survival_function_at_times(km.values).to_numpy()
    np.testing.assert_allclose(surv, want, rtol=0, atol=1e-12)


def test_lognormal_fit_equals_lifelines():
    """Reference: lifelines' LogNormalFitter (right-censored, weighted) on T + 1."""
    import warnings

    from lifelines import LogNormalFitter

    rng = np.random.default_rng(11)
    t = np.rint(rng.lognormal(5.5, 0.8, 400))
    c = np.rint(rng.uniform(50, 900, 400))
    events, cens = t[t <= c], c[t > c]
    ew, cw = rng.integers(1, 4, events.size).astype(float), rng.integers(1, 4, cens.size).astype(float)
    mu, sd = censored.lognormal_fit(events, ew, cens, cw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = LogNormalFitter().fit(
            np.concatenate([events, cens]) + 1,
            np.concatenate([np.ones(events.size, bool), np.zeros(cens.size, bool)]),
            weights=np.concatenate([ew, cw]),
        )
    assert (mu, sd) == pytest.approx((ref.mu_, ref.sigma_), abs=1e-4)
