"""The saturating tau(tokens) fit, its bootstrap and the verdict, on synthetic points with a known answer."""

import math

import numpy as np
import pytest

from eagle_lib.data_value import curve

X = np.array([1 / 8, 1 / 4, 1 / 2, 1.0])


def law(x, a=3.2, b=1.1, c=0.6):
    return a - b * np.power(x, -c)


def prompt_sums(taus, n_prompts=40, steps=30, noise=0.0, seed=0):
    """Per-prompt (num, den) (D, P) whose pooled tau per row is taus (plus per-prompt noise)."""
    rng = np.random.default_rng(seed)
    den = np.full((len(taus), n_prompts), float(steps))
    per = np.asarray(taus)[:, None] + noise * rng.standard_normal((len(taus), n_prompts))
    return per * den, den


def test_fit_recovers_known_parameters_and_projection():
    f = curve.fit_saturating(X, law(X), cap=4.0)
    assert f.a == pytest.approx(3.2, abs=0.03) and f.b == pytest.approx(1.1, abs=0.03)
    assert f.c == pytest.approx(0.6, rel=0.03)
    for m in (2.0, 4.0, 10.0):  # projections against the formula itself
        assert f.predict([m])[0] == pytest.approx(law(m), abs=0.01)
    # tokens for a target: the formula's inverse, ((a - tau) / b) ** (-1 / c)
    assert f.tokens_for(2.9) == pytest.approx(((3.2 - 2.9) / 1.1) ** (-1 / 0.6), rel=0.05)
    assert f.tokens_for(3.3) == math.inf  # beyond the fitted ceiling


def test_fit_respects_the_chain_limit_and_flat_data():
    steep = 1.5 + 0.8 * np.log2(X * 64)  # keeps rising: an unbounded fit would pass cap
    f = curve.fit_saturating(X, steep, cap=4.0)
    assert f.a <= 4.0 + 1e-12 and f.predict([1000.0])[0] <= 4.0
    flat = curve.fit_saturating(X, np.full(4, 2.0), cap=4.0)
    assert flat.b == pytest.approx(0.0, abs=1e-9) and flat.predict([10.0])[0] == pytest.approx(2.0)
    falling = curve.fit_saturating(X, [2.4, 2.3, 2.2, 2.1], cap=4.0)  # b >= 0: no decreasing curve
    assert falling.b == 0.0 and falling.a == pytest.approx(2.25)
    with pytest.raises(ValueError, match="tokens must be > 0"):
        curve.fit_saturating([0.0, 1.0], [1.0, 2.0], cap=4.0)


def test_bootstrap_interval_covers_the_truth_and_verdicts():
    num, den = prompt_sums(law(X), noise=0.3)
    c = curve.learning_curve(X, num, den, 4.0, [2.0, 4.0, 10.0], reps=200, seed=1)
    for m in (2.0, 4.0):
        p = c.projection(m)
        assert p["lo"] <= law(m) <= p["hi"] and p["lo"] < p["tau"] < p["hi"]
    v = curve.verdict(c, min_gain=0.05)
    assert v["kind"] == "data-limited" and f"{c.fit.predict([2.0])[0]:.2f}" in v["text"]
    true_gain = law(2.0) - law(1.0)
    assert v["gain_2x"]["lo"] <= true_gain <= v["gain_2x"]["hi"]
    flat = curve.learning_curve(X, *prompt_sums([2.0] * 4, noise=0.02), 4.0, [2.0], reps=100, seed=1)
    assert curve.verdict(flat, 0.05)["kind"] == "saturated"


def test_bootstrap_draws_stay_within_strata_and_pair_drafters():
    strata = ["a"] * 3 + ["b"] * 5
    d = curve.bootstrap_draws(8, 50, 0, strata)
    assert d.shape == (50, 8) and (d[:, :3] < 3).all() and (d[:, 3:] >= 3).all()
    num, den = prompt_sums([2.0, 2.0], n_prompts=8, noise=0.2)
    same = curve.diff_interval(np.vstack([num[0], num[0]]), np.vstack([den[0], den[0]]), 0, 1, d)
    assert same["diff"] == 0.0 and same["lo"] == same["hi"] == 0.0 and not same["measurable"]
    shifted = curve.diff_interval(np.vstack([num[0] + 30, num[0]]), den, 0, 1, d)  # +1 tau on every prompt
    assert shifted["diff"] == pytest.approx(1.0) and shifted["measurable"]
    few = curve.diff_interval(num[:, :3] + [[30], [0]], den[:, :3], 0, 1, d[:, :3])
    assert math.isnan(few["lo"]) and not few["measurable"]  # 3 prompts: no interval


def test_verdict_flags_a_fit_that_misses_the_full_data_point():
    steepening = [1.08, 1.26, 1.55, 2.21]  # convex in log tokens: no a - b x^-c passes all four points
    c = curve.learning_curve(X, *prompt_sums(steepening, noise=0.05), 4.0, [2.0], reps=100, seed=1)
    v = curve.verdict(c, 0.05)
    assert v["fit_miss"] > 0.05 and "Caution: the fit misses the largest subset" in v["text"]
    clean = curve.verdict(curve.learning_curve(X, *prompt_sums(law(X), noise=0.05), 4.0, [2.0], 100, 1), 0.05)
    assert "Caution" not in clean["text"] and abs(clean["fit_miss"]) < 0.05


@pytest.mark.parametrize("seed", range(6))
def test_fit_is_as_good_as_scipys_bounded_least_squares(seed):
    """Reference: scipy's least_squares from several starts (tests/support/curve_ref): the grid fit reaches the
    same residual (within the grid's resolution in c) and the same fitted and projected values."""
    from tests.support.curve_ref import refit

    rng = np.random.default_rng(seed)
    t1, c = rng.uniform(2.5, 3.8), rng.uniform(0.2, 1.5)  # tau at all the data, and the curvature
    t8 = rng.uniform(1.3, t1 - 0.2)  # tau at 1/8 of it
    b = (t1 - t8) / (8**c - 1)
    y = law(X, a=t1 + b, b=b, c=c)
    y = np.minimum(y + 0.03 * rng.standard_normal(X.size), 3.99)
    f = curve.fit_saturating(X, y, cap=4.0)
    a, b, c, sse = refit(X, y, cap=4.0)
    noise_sse = X.size * 0.03**2  # what the noise alone leaves
    assert f.sse <= sse + 0.05 * noise_sse  # the grid in c costs under 5% of the noise's residual
    ref = a - b * np.power(X, -c)
    np.testing.assert_allclose(f.predict(X), ref, atol=0.01)  # a third of the noise


# ---------------------------------------------------------------- training noise (seed replicates)


def test_seed_noise_pools_the_replicates_by_hand():
    n = curve.SeedNoise.from_replicates([[1.0, 1.2], [2.0], [2.5, 2.9], [3.1]])
    # within-point squares: (0.1^2 * 2) + (0.2^2 * 2) = 0.02 + 0.08 over (2-1) + (2-1) degrees of freedom
    assert n.dof == 2 and n.sd == pytest.approx(math.sqrt(0.10 / 2)) and n.seeds == (2, 1, 2, 1)
    none = curve.SeedNoise.from_replicates([[1.0], [2.0]])
    assert none.dof == 0 and none.sd == 0.0 and not none.offsets(5, 0).any()
    assert "not measured" in none.text() and "2 degrees of freedom" in n.text()


def test_seed_noise_variance_draws_follow_the_scaled_inverse_chi_square():
    n = curve.SeedNoise.from_replicates([[1.0, 1.2], [2.5, 2.9]])  # s^2 = 0.05, nu = 2
    var = n.variances(40_000, seed=3)
    # nu s^2 / chi^2_nu: its median is nu s^2 / median(chi^2_2), and chi^2_2's median is 2 ln 2
    assert np.median(var) == pytest.approx(2 * 0.05 / (2 * math.log(2)), rel=0.03)
    # P(sigma^2 > s^2) = P(chi^2_2 < 2) = 1 - exp(-1)
    assert np.mean(var > 0.05) == pytest.approx(1 - math.exp(-1), abs=0.01)
    off = n.offsets(40_000, seed=3)  # each point averages 2 seeds: offsets of variance sigma^2 / 2
    assert off.shape == (40_000, 2)
    ref = np.sqrt(var / 2) * np.random.default_rng([3, 104729]).standard_normal((40_000, 2))[:, 0]
    np.testing.assert_allclose(off[:, 0], ref)


def _study(rng, truth, sigma_train, replicated, prompt_sd=0.35, eps_sd=0.15, n_prompts=34, steps=20):
    """Per-prompt sums of the curve's drafters: every drafter's tau is truth + its training noise; prompts differ
    by an effect shared by every drafter (paired) plus a small per-drafter part. Returns num, den, groups."""
    counts = [2 if i in replicated else 1 for i in range(len(truth))]
    u = prompt_sd * rng.standard_normal(n_prompts)
    rows = []
    for i, k in enumerate(counts):
        for _ in range(k):
            e = sigma_train * rng.standard_normal()
            rows.append(truth[i] + e + u + eps_sd * rng.standard_normal(n_prompts))
    per = np.array(rows)
    den = np.full(per.shape, float(steps))
    groups, at = [], 0
    for k in counts:
        groups.append(list(range(at, at + k)))
        at += k
    return per * den, den, groups


@pytest.mark.slow
@pytest.mark.full
def test_training_noise_makes_the_gain_interval_cover_where_prompts_alone_do_not():
    """Synthetic curves with a known law and known seed noise (sd 0.08 tau per drafter, as the toy's measured seed
    spread): the 95% interval of the doubling gain covers the true gain in most studies when two points carry a
    second seed (the stage's default), and far less often from the prompt bootstrap alone (the old intervals)."""
    rng = np.random.default_rng(0)
    truth = law(X, a=3.8, b=0.6, c=0.5)
    true_gain = float(law(2.0, 3.8, 0.6, 0.5) - law(1.0, 3.8, 0.6, 0.5))
    trials, reps, covered_new, covered_old, widths = 60, 100, 0, 0, []
    for t in range(trials):
        num, den, groups = _study(rng, truth, 0.08, replicated={0, 1})
        new = curve.learning_curve(X, num, den, 4.0, [2.0], reps, seed=t, groups=groups).gain(2.0)
        first = [g[0] for g in groups]  # the same study without its replicates: prompts only, as before
        old = curve.learning_curve(X, num[first], den[first], 4.0, [2.0], reps, seed=t).gain(2.0)
        covered_new += new["lo"] <= true_gain <= new["hi"]
        covered_old += old["lo"] <= true_gain <= old["hi"]
        widths.append((new["hi"] - new["lo"], old["hi"] - old["lo"]))
    assert covered_new / trials >= 0.85, (covered_new, covered_old, np.median(widths, axis=0))
    assert covered_old / trials <= 0.75, (covered_new, covered_old, np.median(widths, axis=0))


def test_paired_difference_interval_widens_by_the_training_noise_of_two_drafters():
    num, den = prompt_sums([2.0, 2.0], n_prompts=40, noise=0.0)  # identical drafters: no prompt noise at all
    draws = curve.bootstrap_draws(40, 4000, seed=1)
    flat = curve.diff_interval(num, den, 0, 1, draws)
    assert flat["lo"] == flat["hi"] == 0.0
    n = curve.SeedNoise(
        0.1, 1000, (1, 1)
    )  # nearly known sigma: the difference is normal with sd 0.1 * sqrt(2)
    d = curve.diff_interval(num, den, 0, 1, draws, noise=n, seed=1)
    half = 1.96 * 0.1 * math.sqrt(2)
    assert d["lo"] == pytest.approx(-half, rel=0.06) and d["hi"] == pytest.approx(half, rel=0.06)
    assert not d["measurable"]


def test_tokens_for_target_interval_is_infinite_not_nan_when_draws_pass_their_ceiling():
    """Bootstrap fits whose ceiling lies below the target give inf tokens; the interval's upper end there is inf
    (numpy's interpolation made it NaN, with a RuntimeWarning in the 07 report), and finite draws interpolate
    as numpy does."""
    import warnings

    below = [curve.Fit(3.0, 1.0, 0.5, 0.0)] * 3  # ceiling 3.0 < target 3.1: inf tokens
    above = [curve.Fit(3.2 + 0.01 * k, 1.0, 0.5, 0.0) for k in range(37)]
    c = curve.Curve(X, law(X), above[0], above + below, 4.0, [2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = c.tokens_for(3.1)
    assert t["hi"] == math.inf and math.isfinite(t["lo"])
    assert t["p_reach"] == pytest.approx(37 / 40)
    finite = sorted(f.tokens_for(3.1) for f in above)
    assert t["lo"] == pytest.approx(float(np.quantile(finite + [math.inf] * 3, 0.025)))
    rng = np.random.default_rng(3)
    v = rng.standard_normal(51)
    assert curve.quantiles(v, [0.025, 0.5, 0.9]) == pytest.approx(np.quantile(v, [0.025, 0.5, 0.9]))
    assert list(curve.quantiles([1.0, 2.0, math.inf, math.inf], [0.0, 0.975])) == [1.0, math.inf]
