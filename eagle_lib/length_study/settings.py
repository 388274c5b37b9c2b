"""Stage 04's params model, here so that its wing (projection, verdicts) may import it; `eagle_lib.lengths` (the
stage) takes it from here."""

from __future__ import annotations

from eagle_lib.params import Strict


class Params(Strict):
    """Stage 04 parameters: the end-of-thinking token, the planned sample counts and the verdict thresholds."""

    end_of_thinking_token: str = "</think>"  # token that ends reasoning, resolved with the target tokenizer
    end_of_thinking_id: int = -1  # its id, if known (skips loading the tokenizer); -1: resolve the token
    infer_limit: int = 0  # 03's `limit` (first N prompts per dataset) while it runs; 0: all prompts
    datasets: list[str] = []  # analyse only these dataset names (A and B); empty: every dataset found
    short_tokens: int = 32  # completions shorter than this count as short (bimodality summary)
    max_short_share: float = 0.25  # warn when more samples than this are short
    max_limit_share: float = 0.05  # warn when more samples than this ended at the limit (truncated)
    min_reasoning_tokens: int = (
        3  # a turn reasons with this many tokens to </think> (empty: 1 on Kimi, else 2)
    )
    reasoning_min_share: float = 0.5  # reasoning dataset: this share of its uncut samples reasons
    p99_limit_fraction: float = 0.98  # warn when a reasoning dataset's p99 reaches this fraction of the limit
    min_median_ratio: float = 0.1  # warn when a median is below this fraction of the median of peers' medians
    min_samples_to_project: int = 30  # fewer completed samples than this: no projection, flagged
    bootstrap_reps: int = 2000  # bootstrap replicates of the projection interval
    as_of: float = 0.0  # unix time the mid-run estimate describes; 0: the last start or finish in 03's files
    censor_rate_quantile: float = 0.1  # in-flight lower bound: this quantile of a server's tokens/s x elapsed
    typical_rate_quantile: float = 0.5  # ...and what it has typically produced (the in-flight prediction)
    timeline_points: int = 8  # moments at which the estimate is recomputed for the "against time" plot
    interval: float = 0.95  # coverage of the projection interval
    block_bytes: int = 16777216  # bytes read per block while streaming a record file
