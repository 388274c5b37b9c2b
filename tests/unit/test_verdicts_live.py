"""04's mid-run truncation verdict from a censoring-aware interval: warn when the whole interval is over the
threshold, or when the point estimate is over it ("undetermined yet, likely over the threshold": acting before
the run ends is the point of a mid-run report); undetermined when only the interval's top is over it."""

import pytest

from eagle_lib.length_study.verdicts import COLUMNS, _live_checks
from eagle_lib.lengths import Params


def truncation(
    share: tuple[float, float, float], model: str = "bounds' midpoint", outlived=(0.0, 40.0)
) -> dict | None:
    est = {"share_at_limit": share, "share_short": (0.0, 0.0, 0.0), "in_flight": 7, "not_started": 30,
           "finished": 12, "point_model": model, "outlived": outlived}  # fmt: skip
    p = Params(max_limit_share=0.05)
    rows = [dict(zip(COLUMNS, r, strict=True)) for r in _live_checks("mot", est, p)]
    return next((r for r in rows if r["check"] == "truncation"), None)


@pytest.mark.parametrize(
    "share, level, opening, advice",
    [
        ((0.24, 0.10, 0.55), "warn", "24.0% of the final", ": raise max_new_tokens"),
        (
            (0.24, 0.0, 0.55),
            "warn",
            "undetermined yet, likely over the threshold: 24.0%",
            ": if it holds, raise max_new_tokens",
        ),  # fmt: skip
        ((0.02, 0.0, 0.40), "undetermined", "undetermined yet: 2.0%", ""),
    ],
)
def test_levels_and_wording(share, level, opening, advice):
    row = truncation(share)
    assert row["level"] == level and row["message"].startswith(opening)
    assert (
        row["message"].endswith(")" + advice) and "7 in flight, 30 not started, 12 finished" in row["message"]
    )


def test_an_interval_under_the_threshold_says_nothing():
    assert truncation((0.01, 0.0, 0.04)) is None


def test_a_model_estimate_is_named_as_such():
    row = truncation((0.24, 0.0, 0.55), "lognormal fit (mu 4.1, sigma 1.2 of log(tokens + 1))")
    assert (
        row["level"] == "warn"
        and "end at the limit by the lognormal fit (95% interval 0.0%-55.0%" in row["message"]
    )
    assert "by the lognormal" not in truncation((0.24, 0.1, 0.55))["message"]


def test_a_long_tail_forming_warns_while_undetermined():
    """More of the started requests than the threshold still running past 90% of the finished lengths: the
    interval's top could be reached, and the report says why it warns (a count, not a model)."""
    row = truncation((0.02, 0.0, 0.40), outlived=(0.27, 78.0))
    assert row["level"] == "warn"
    assert row["message"].startswith("undetermined yet, a long tail is forming (27% of the started requests are "
                                     "still running past 78 tokens, longer than 90% of the finished ones): 2.0%")  # fmt: skip
    assert row["message"].endswith(": if the tail reaches the limit, raise max_new_tokens")
    assert truncation((0.02, 0.0, 0.40), outlived=(0.04, 78.0))["level"] == "undetermined"
    assert truncation((0.01, 0.0, 0.04), outlived=(0.5, 78.0)) is None  # the interval is under the threshold
