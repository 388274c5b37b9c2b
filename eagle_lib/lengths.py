"""Stage 04: are the responses truncated or too short, and how many tokens do we have?

Reads A records and B responses (with `analysis.scan`, which streams them into compact per-sample arrays) and
writes `analysis/`: per-dataset length tables, measured token totals, a projection of the final totals of
datasets still being generated (`analysis.projection`: with 03's ledger, in-flight responses are right-censored,
`analysis.censored`), its estimate against time, verdicts and plots (`analysis.verdicts`).

Definitions. B: prompt = prompt_ids, completion = output_ids (all trainable), at limit = finish_reason "length".
A: completion = trainable (loss-masked) tokens, prompt = the rest, at limit = truncated by 01. Reasoning tokens =
completion tokens up to and including the end-of-thinking token (B: its first occurrence; A: the last one in each
assistant turn, a run of mask ones), answer = the rest. A repeated id counts once (the first, as 03 does).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from eagle_lib import store
from eagle_lib.length_study.projection import projection, timeline
from eagle_lib.length_study.scan import Lengths, find_sources, scan_all
from eagle_lib.length_study.settings import (
    Params,  # this stage's params model (params.STAGES reads lengths.Params)
)
from eagle_lib.store import write_json

QUANTILES = (10, 50, 90, 99)
VIEWS = {  # the answering columns of the wide tables shown in the notebook
    "completion": ["kind", "dataset", "n", "limit", "median", "p99", "max", "share_at_limit", "n_at_limit",
                   "share_short", "reasoning_dataset", "share_reasoning"],
    "projection": ["kind", "dataset", "status", "method", "completed", "in_flight", "planned", "measured",
                   "projected", "lo", "hi", "naive_projected", "shift"],
    "tokens": ["kind", "dataset", "samples", "prompt_tokens", "trainable_tokens", "trainable_share"],
}  # fmt: skip


# ---------------------------------------------------------------- statistics


def _pct(x: np.ndarray, prefix: str) -> dict:
    names = [f"{prefix}{k}" for k in ("min", "p10", "median", "mean", "p90", "p99", "max")]
    if not x.size:
        return dict.fromkeys(names, np.nan)
    q = np.percentile(x, QUANTILES)
    return dict(
        zip(names, (int(x.min()), q[0], q[1], float(x.mean()), q[2], q[3], int(x.max())), strict=True)
    )


def top_decile_share(x: np.ndarray) -> float:
    """Share of all tokens held by the longest 10% of samples (ceil(n/10) samples)."""
    if not x.size or not x.sum():
        return np.nan
    k = -(-x.size // 10)
    top = np.partition(x, x.size - k)[x.size - k :]
    return float(top.sum(dtype=np.int64) / x.sum(dtype=np.int64))


def _limit(ls: Lengths, max_new_tokens: int) -> int:
    """The generation limit of a B dataset: the records' own (most common), else shared max_new_tokens."""
    if ls.limits:
        return int(ls.limits.most_common(1)[0][0])
    return max_new_tokens if ls.kind == "B" else 0


def _reasoning(a: dict[str, np.ndarray], p: Params) -> bool:
    """A reasoning dataset: at least `reasoning_min_share` of its uncut samples think (not just `<think></think>`)."""
    uncut = a["think_span"][a["status"] != 1]
    return bool(uncut.size and (uncut >= p.min_reasoning_tokens).mean() >= p.reasoning_min_share)


def dataset_row(ls: Lengths, p: Params, max_new_tokens: int = 0) -> dict:
    """One row of the length table: counts, completion/prompt distributions, limit and reasoning shares."""
    a = ls.arrays()
    c, r, n = a["completion"], a["reasoning"], a["completion"].size
    share = (lambda m: float(m.mean())) if n else (lambda m: np.nan)
    row = {"kind": ls.kind, "dataset": ls.name, "n": n, "limit": _limit(ls, max_new_tokens)} | _pct(c, "")
    row |= {
        "share_at_limit": share(a["status"] == 1),
        "share_stop": share(a["status"] == 0),
        "share_other": share(a["status"] == 2),
        "n_at_limit": int((a["status"] == 1).sum()),
        "n_at_limit_unclosed": int(((a["status"] == 1) & (r == 0)).sum()),
        "n_empty": int((c == 0).sum()),
        "share_think_closed": share(r > 0),
        "share_reasoning": share(a["think_span"] >= p.min_reasoning_tokens),
        "reasoning_dataset": _reasoning(a, p),
        "reasoning_tokens": int(r.sum()),
        "answer_tokens": int(c.sum() - r.sum()),
        "reasoning_median": float(np.median(r)) if n else np.nan,
        "answer_median": float(np.median(c - r)) if n else np.nan,
        "share_short": share(c < p.short_tokens),
        "top_decile_token_share": top_decile_share(c),
    }
    return row | _pct(a["prompt"], "prompt_")


def tables(
    lengths: list[Lengths], p: Params, max_new_tokens: int = 0
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(completion length table, prompt length table, measured token table with corpus shares)."""
    rows = pd.DataFrame([dataset_row(ls, p, max_new_tokens) for ls in lengths])
    prompt_cols = [c for c in rows.columns if c.startswith("prompt_")]
    prompt = rows[["kind", "dataset", "n"] + prompt_cols].rename(columns=lambda c: c.removeprefix("prompt_"))
    completion = rows.drop(columns=prompt_cols)
    sums = [{k: int(v.sum()) for k, v in ls.arrays().items()} for ls in lengths]
    tok = pd.DataFrame({"kind": [ls.kind for ls in lengths], "dataset": [ls.name for ls in lengths]})
    tok["samples"] = completion["n"]
    tok["prompt_tokens"] = [s["prompt"] for s in sums]
    tok["completion_tokens"] = [s["completion"] for s in sums]
    tok["trainable_tokens"] = tok["completion_tokens"]  # by definition, for A and B alike
    tok["total_tokens"] = tok["prompt_tokens"] + tok["completion_tokens"]
    for col in ("trainable_tokens", "total_tokens"):
        total = tok[col].sum()
        tok[col.replace("_tokens", "_share")] = tok[col] / total if total else np.nan
    return completion, prompt, tok


# ---------------------------------------------------------------- the stage


@dataclass
class LengthReport:
    """Everything the notebook shows: tables, verdicts, corpus totals, per-dataset lengths and figures."""

    params: Params
    completion: pd.DataFrame
    prompt: pd.DataFrame
    tokens: pd.DataFrame
    projection: pd.DataFrame
    verdicts: pd.DataFrame
    corpus: dict
    lengths: list[Lengths]
    think_id: int | None
    estimates: dict = field(default_factory=dict)  # B dataset in progress -> censored.estimate
    timeline: pd.DataFrame = field(default_factory=pd.DataFrame)
    figures: dict = field(default_factory=dict)

    @property
    def answer_text(self) -> str:
        """The report's first line: a sentence with the numbers (tokens, truncation, what to do)."""
        from eagle_lib.length_study.verdicts import answer

        return answer(self)

    def answer(self):
        """answer_text as Markdown (bold), for the notebook."""
        from IPython.display import Markdown

        return Markdown(f"**{self.answer_text}**")

    def view(self, name: str) -> pd.DataFrame:
        """The columns of a wide table that answer its question (the full table is analysis/<name>.csv)."""
        cols = VIEWS.get(name)
        table = getattr(self, name)
        if name == "projection":
            table = table[table.tokens == "completion"].assign(shift=table.projected - table.naive_projected)
        return table[[c for c in cols if c in table]] if cols else table

    @property
    def headline(self) -> dict:
        """The numbers the notebook records."""
        c, tok, proj = self.completion, self.tokens, self.corpus["completion"]
        per = lambda col: {f"{k}/{d}": v for k, d, v in zip(c.kind, c.dataset, c[col], strict=True)}  # noqa: E731
        return {
            "datasets": len(c),
            "samples": int(c.n.sum()),
            **{f"{k}_tokens": int(tok[f"{k}_tokens"].sum()) for k in ("prompt", "completion", "trainable")},
            # with unprojected datasets the projection is a lower bound: no point, no upper end
            "projected_is_lower_bound": bool(self.corpus["unprojected"]),
            "projected_trainable_tokens": None if self.corpus["unprojected"] else proj["projected"],
            "projected_trainable_lo": proj["lo"],
            "projected_trainable_hi": None if self.corpus["unprojected"] else proj["hi"],
            "unprojected_datasets": self.corpus["unprojected"],
            "max_share_at_limit": float(c.share_at_limit.max()),
            "warnings": int((self.verdicts.level == "warn").sum()),
            "undetermined": int((self.verdicts.level == "undetermined").sum()),
            "in_flight": int(self.projection.in_flight[self.projection.tokens == "completion"].sum()),
            "share_at_limit": per("share_at_limit"),
            "median_completion": per("median"),
        }


def resolve_think_id(p: Params, shared, load_tokenizer=None) -> int | None:
    """The end-of-thinking id: the params' id, else the token looked up in the target tokenizer; None = no split."""
    if p.end_of_thinking_id >= 0:
        return p.end_of_thinking_id
    if not p.end_of_thinking_token:
        return None
    if load_tokenizer is None:
        from eagle_lib.models import load_tokenizer
    with warnings.catch_warnings():  # tqdm's "IProgress not found" (a notebook without ipywidgets) is noise
        warnings.filterwarnings("ignore", message="IProgress not found")
        tok, token = load_tokenizer(shared), p.end_of_thinking_token
    i = tok.convert_tokens_to_ids(token)
    if not isinstance(i, int) or i == tok.unk_token_id or tok.convert_ids_to_tokens(i) != token:
        raise ValueError(f"end_of_thinking_token {token!r} is not one token of the tokenizer "
                         f"{shared.tokenizer_path!r}: set end_of_thinking_id, or a token the tokenizer has")  # fmt: skip
    return i


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    store.write_atomic(path, lambda tmp: df.to_csv(tmp, index=False))


def run(cfg) -> LengthReport:
    """Stage 04: scan, tabulate, project, judge, plot; writes analysis/ (meta.json last). Inputs are read only."""
    from eagle_lib.length_study.verdicts import make_figures, verdicts

    t0 = time.time()
    p, run_dir = cfg.stage, Path(cfg.run_dir)
    out = run_dir / "analysis"
    think_id = resolve_think_id(p, cfg.shared)
    sources = find_sources(run_dir, p.datasets)
    lengths = scan_all(sources, think_id, p.block_bytes, cfg.shared.num_workers)
    completion, prompt, tokens = tables(lengths, p, cfg.shared.max_new_tokens)
    limits = dict(
        zip(completion.dataset[completion.kind == "B"], completion.limit[completion.kind == "B"], strict=True)
    )
    proj, corpus, estimates = projection(lengths, run_dir, p, cfg.shared.seed, limits)
    found = verdicts(completion, proj, lengths, p, think_id, cfg.shared.max_new_tokens, estimates)
    result = LengthReport(p, completion, prompt, tokens, proj, found, corpus, lengths, think_id, estimates)
    live = proj[(proj.tokens == "completion") & (proj.method == "censored")]
    planned = dict(zip(live.dataset, live.planned, strict=True))
    result.timeline = timeline(lengths, p, cfg.shared.seed, limits, planned, p.timeline_points)
    out.mkdir(parents=True, exist_ok=True)
    result.figures = make_figures(result, out / "plots")
    for name in ("completion", "prompt", "tokens", "projection", "verdicts", "timeline"):
        _write_csv(getattr(result, name), out / f"{name}.csv")
    write_json(out / "verdicts.json", json.loads(found.to_json(orient="records", double_precision=15)))
    write_json(out / "summary.json", {"end_of_thinking_id": think_id, "corpus": corpus, **result.headline})
    read, torn, dups = (sum(getattr(ls, k) for ls in lengths) for k in ("read", "torn", "duplicates"))
    dropped = {k: v for k, v in (("torn_line", torn), ("duplicate_id", dups)) if v}
    inputs = {f"{k}/{n}": {"files": [str(f) for f in fs], "bytes_read": ls.bytes_read}
              for (k, n, fs, _), ls in zip(sources, lengths, strict=True)}  # fmt: skip
    meta = dict(read=read, kept=read - torn - dups, dropped=dropped, rejected=0, inputs=inputs)
    meta |= dict(params=p.model_dump(mode="json"), shared=cfg.shared.model_dump(mode="json"), end_of_thinking_id=think_id)  # fmt: skip
    store.write_meta(out, meta, t0, tally=True)
    return result
