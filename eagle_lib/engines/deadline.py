"""How long stage 03 waits for one HTTP answer (`eagle_lib.engines.http`): "slow but alive" is told from "dead" by
the tokens a streamed answer delivers, not by one fixed time limit.

- The stall deadline (`stall_s`): a server that has requests in flight and delivers no new token on any of them
  for `stall_s` seconds is suspect (hung, or its process gone with the connection still open): its requests go
  back to the queue and it leaves the rotation at once (`ServerHealth.streams` / `last_token`). One slow or
  queued request on a server that is still producing tokens for its others is not a stall (SGLang and vLLM queue
  and preempt requests under load); the total deadline bounds it.
- The total deadline of one attempt: ``max(timeout_s, stall_s + max_new_tokens / rate)``, re-read while the
  attempt runs. `rate` is the slow end of the run's own per-request rates (answer tokens / seconds from sending
  to the last token, queueing and prefill included: the `QUANTILE` of the last `WINDOW` answers of at least
  `min_tokens` tokens, divided by `SLACK`) once `MIN_SAMPLES` answers are measured, and `prior_rate`
  (03's ``min_tokens_per_s``) before. `timeout_s` is its floor: the deadline is never shorter.

At the seeds' 4.5-10 tokens/s per request, a 16,384-token answer needs 27-61 min; measured at 4.5 tokens/s its
deadline is 16,384 / 2.25 + stall_s ~ 2 h, where the old fixed 3,600 s killed it and restarted it from zero.
A non-streamed answer (``stream: false``) has only the total deadline.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

QUANTILE = 0.1  # the slow end of the measured per-request rates ...
SLACK = 2.0  # ... divided by this: an answer may be twice as slow as the run's 10% slowest and still finish
WINDOW = 512  # the last answers measured (the rate follows the servers' load)
MIN_SAMPLES = 8  # answers measured before the measured rate replaces the prior


@dataclass
class Deadlines:
    """The stall and total deadlines of one engine (module docstring); `observe` every answer."""

    max_new_tokens: int
    stall_s: float = 300.0
    floor_s: float = 1800.0  # 03's timeout_s: the total deadline is never shorter
    prior_rate: float = 1.0  # 03's min_tokens_per_s: tokens/s per request assumed before any is measured
    rates: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def __post_init__(self):
        if self.stall_s <= 0 or self.prior_rate <= 0 or self.max_new_tokens < 1:
            raise ValueError(
                f"deadlines need stall_s > 0, min_tokens_per_s > 0 and max_new_tokens >= 1 (got {self.stall_s}, "
                f"{self.prior_rate}, {self.max_new_tokens})"
            )

    @property
    def min_tokens(self) -> int:
        """Answers shorter than this are not measured (their time is mostly the wait for the first token)."""
        return max(1, min(64, self.max_new_tokens // 4))

    def observe(self, n_tokens: int, seconds: float) -> None:
        """One answer: `n_tokens` in `seconds` from sending the request to its last token."""
        if n_tokens >= self.min_tokens and seconds > 0:
            self.rates.append(n_tokens / seconds)

    def rate(self) -> float:
        """Tokens/s per request the total deadline assumes (the measured slow end, or the prior)."""
        if len(self.rates) < MIN_SAMPLES:
            return self.prior_rate
        xs = sorted(self.rates)
        return xs[int(QUANTILE * (len(xs) - 1))] / SLACK

    def total_s(self) -> float:
        """The longest one attempt may take now."""
        return max(self.floor_s, self.stall_s + self.max_new_tokens / self.rate())

    def record(self) -> dict:
        """For 03's meta: the deadlines in force at the end and what they were derived from."""
        return {"stall_s": self.stall_s, "total_s": round(self.total_s(), 1), "floor_s": self.floor_s,
                "rate_tokens_per_s": round(self.rate(), 3), "answers_measured": len(self.rates),
                "measured": len(self.rates) >= MIN_SAMPLES}  # fmt: skip
