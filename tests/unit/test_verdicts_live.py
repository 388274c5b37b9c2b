"""04's mid-run truncation verdict from a censoring-aware interval: warn only when the whole interval is over the
threshold; undetermined otherwise, and said to be likely when the estimate itself is over it."""

import pytest

from eagle_lib.analysis.verdicts import COLUMNS, _live_checks
from eagle_lib.lengths import Params


def truncation(share: tuple[float, float, float]) -> dict | None:
    est = {"share_at_limit": share, "share_short": (0.0, 0.0, 0.0), "in_flight": 7, "not_started": 30,
           "finished": 12}  # fmt: skip
    p = Params(max_limit_share=0.05)
    rows = [dict(zip(COLUMNS, r, strict=True)) for r in _live_checks("mot", est, p)]
    return next((r for r in rows if r["check"] == "truncation"), None)


@pytest.mark.parametrize(
    "share, level, opening, advice",
    [
        ((0.24, 0.10, 0.55), "warn", "24.0% of the final", ": raise max_new_tokens"),
        (
            (0.24, 0.0, 0.55),
            "undetermined",
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
