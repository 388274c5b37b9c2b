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
