"""Stage 04: are the responses truncated or too short, and how many tokens do we have?

Reads A records (`data/A/<ds>/records.jsonl`) and B responses (`infer/<ds>/responses.jsonl` and its shards,
possibly still being written by 03: read only, a torn last line skipped) and writes `analysis/`: per-dataset
length tables, measured token totals, a bootstrap projection of the final totals of datasets still being
generated, verdicts and plots (the last two in `lengths_plots`).

Definitions. B: prompt = prompt_ids, completion = output_ids (all trainable), at limit = finish_reason "length".
A: completion = trainable (loss-masked) tokens, prompt = the rest, at limit = truncated by 01. Reasoning tokens =
completion tokens up to and including the end-of-thinking token (B: its first occurrence; A: the last one in each
assistant turn, a run of mask ones), answer = the rest. A repeated id counts once (the first, as 03 does).

Speed: a line is never fully materialised. Its int lists are located by byte search (an int list holds no
brackets or quotes, and a key's quotes cannot occur unescaped inside a JSON string), counted by their commas and
searched for the end-of-thinking id as bytes; only the rest of the line (scalars, text) is parsed as JSON.
Memory: a few compact ints per sample, plus the ids seen (for duplicates).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from array import array
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from eagle_lib.params import Strict
from eagle_lib.store import RecordError, check_tally, read_json, write_json

try:  # orjson parses the scalar rest of a line ~3x faster; the stdlib gives the same result
    from orjson import loads as _loads
except ImportError:
    from json import loads as _loads

QUANTILES = (10, 50, 90, 99)


class Params(Strict):
    """Stage 04 parameters: the end-of-thinking token, the planned sample counts and the verdict thresholds."""

    end_of_thinking_token: str = "</think>"  # token that ends reasoning, resolved with the target tokenizer
    end_of_thinking_id: int = -1  # its id, if known (skips loading the tokenizer); -1: resolve the token
    max_new_tokens: int = 0  # 03's generation limit, checked against the responses' own; 0: take theirs
    infer_limit: int = 0  # 03's `limit` (first N prompts per dataset) while it runs; 0: all prompts
    datasets: list[str] = []  # analyse only these dataset names (A and B); empty: every dataset found
    short_tokens: int = 32  # completions shorter than this count as short (bimodality summary)
    max_short_share: float = 0.25  # warn when more samples than this are short
    max_limit_share: float = 0.05  # warn when more samples than this ended at the limit (truncated)
    min_reasoning_tokens: int = 3  # a sample reasons if a turn thinks this many tokens (<think></think> is 2)
    reasoning_min_share: float = 0.5  # reasoning dataset: this share of its uncut samples reasons
    p99_limit_fraction: float = 0.98  # warn when a reasoning dataset's p99 reaches this fraction of the limit
    min_median_ratio: float = 0.1  # warn when a median is below this fraction of the median of peers' medians
    min_samples_to_project: int = 30  # fewer completed samples than this: no projection, flagged
    bootstrap_reps: int = 2000  # bootstrap replicates of the projection interval
    interval: float = 0.95  # coverage of the projection interval
    block_bytes: int = 16777216  # bytes read per block while streaming a record file


# ---------------------------------------------------------------- byte-level record scanning

_ARRAYS = {"prompt": "q", "completion": "q", "reasoning": "q", "think_span": "q", "status": "b"}
_STATUS = {"stop": 0, "length": 1}  # anything else: 2


@dataclass
class Lengths:
    """Per-sample lengths of one dataset as compact arrays (never token lists), plus reading counters."""

    kind: str  # "A" | "B"
    name: str
    cols: dict[str, array] = field(default_factory=lambda: {k: array(t) for k, t in _ARRAYS.items()})
    limits: Counter = field(default_factory=Counter)  # max_new_tokens found in the records -> count
    read: int = 0  # non-empty lines
    torn: int = 0  # torn writes skipped
    duplicates: int = 0  # lines whose id came earlier
    bytes_read: int = 0

    def add(self, prompt: int, completion: int, reasoning: int, think_span: int, status: int) -> None:
        c = self.cols
        c["prompt"].append(prompt)
        c["completion"].append(completion)
        c["reasoning"].append(reasoning)  # 0: no end-of-thinking token
        c["think_span"].append(think_span)  # the longest turn's reasoning (A: an empty <think></think> is 2)
        c["status"].append(status)  # 0 stop, 1 at the limit, 2 other

    def arrays(self) -> dict[str, np.ndarray]:
        """Zero-copy numpy views of the per-sample columns, plus total = prompt + completion."""
        a = {k: np.frombuffer(v, dtype=v.typecode) for k, v in self.cols.items()}
        return a | {"total": a["prompt"] + a["completion"]}


def _array_span(line: bytes, key: bytes) -> tuple[int, int] | None:
    """(start, end) of the contents of the int list under `key`, or None if the key is absent."""
    k = line.find(key)
    if k < 0:
        return None
    s, what = line.find(b"[", k + len(key)), key[1:-2].decode()
    if s < 0 or line[k + len(key) : s].strip():
        raise ValueError(f"{what} is not a list")
    e = line.find(b"]", s)
    if e < 0:
        raise ValueError(f"{what} list is not closed")
    return s + 1, e


def _count(line: bytes, span: tuple[int, int]) -> int:
    s, e = span
    n = line.count(b",", s, e)
    return n + 1 if n or line[s:e].strip() else 0


def _id_positions(line: bytes, span: tuple[int, int], tok: bytes, first: bool) -> list[int]:
    """Indices of the list at `span` whose element is the id spelled `tok` (its digits)."""
    s, e = span
    out = []
    i = line.find(tok, s, e)
    while i >= 0:
        j = i + len(tok)
        if (i == s or line[i - 1] in b", \t") and (j == e or line[j] in b", \t\r"):
            out.append(line.count(b",", s, i))
            if first:
                break
        i = line.find(tok, j, e)
    return out


def _rest(line: bytes, spans: list[tuple[int, int]]) -> dict:
    """Parse the line with its int lists emptied: the scalars and strings only."""
    pieces, at = [], 0
    for s, e in sorted(spans):
        pieces.append(line[at:s])
        at = e
    pieces.append(line[at:])
    rec = _loads(b"".join(pieces))
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    return rec


def _check(rec: dict, key: str, measured: int) -> None:
    if key in rec and rec[key] != measured:
        raise ValueError(f"{key}={rec[key]} but the list holds {measured} ids")


def scan_response(line: bytes, tok: bytes | None) -> tuple:
    """(id, max_new_tokens, prompt, completion, reasoning, think_span, status) of one B response line."""
    o_span = _array_span(line, b'"output_ids":')
    if o_span is None:
        raise ValueError("no output_ids")
    p_span = _array_span(line, b'"prompt_ids":')
    rec = _rest(line, [o_span] + ([p_span] if p_span else []))
    n_out = _count(line, o_span)
    _check(rec, "n_output_tokens", n_out)
    if p_span is not None:
        n_prompt = _count(line, p_span)
        _check(rec, "n_prompt_tokens", n_prompt)
    elif isinstance(rec.get("n_prompt_tokens"), int):
        n_prompt = rec["n_prompt_tokens"]
    else:
        raise ValueError("neither prompt_ids nor n_prompt_tokens")
    pos = _id_positions(line, o_span, tok, first=True) if tok else []
    limit = (rec.get("sampling") or {}).get("max_new_tokens")
    status = _STATUS.get(rec.get("finish_reason"), 2)
    reasoning = pos[0] + 1 if pos else 0
    return rec.get("id"), limit, n_prompt, n_out, reasoning, reasoning, status


def _mask(line: bytes, span: tuple[int, int]) -> np.ndarray:
    """The loss mask as uint8 (n,): a compact `0,1,...` list is read straight from the bytes."""
    s, e = span
    raw = np.frombuffer(line, np.uint8, count=e - s, offset=s)
    if raw.size % 2 == 1 and (raw.size == 1 or (raw[1::2] == 44).all()):  # 44 = ','
        v = raw[::2] - 48  # '0' -> 0, '1' -> 1; anything else wraps above 1
        if (v <= 1).all():
            return v
    v = np.asarray(_loads(line[s - 1 : e + 1]), dtype=np.int64)
    if v.size and not ((v == 0) | (v == 1)).all():
        raise ValueError("loss_mask holds values other than 0 and 1")
    return v.astype(np.uint8)


def _turn_reasoning(mask: np.ndarray, think_pos: list[int]) -> tuple[int, int]:
    """(sum, max) over assistant turns (runs of mask ones) of the tokens up to the turn's last end-of-thinking."""
    pos = [p for p in think_pos if mask[p]]
    if not pos:
        return 0, 0
    starts = np.flatnonzero(np.diff(mask.astype(np.int8), prepend=0) == 1)  # first index of each turn
    last: dict[int, int] = {}
    for turn, p in zip(np.searchsorted(starts, pos, side="right") - 1, pos, strict=True):
        last[int(turn)] = p  # positions ascend: the last one per turn wins
    spans = [p - int(starts[t]) + 1 for t, p in last.items()]
    return sum(spans), max(spans)


def scan_record(line: bytes, tok: bytes | None) -> tuple:
    """(id, None, prompt, completion, reasoning, think_span, status) of one A record; completion = trainable."""
    i_span = _array_span(line, b'"input_ids":')
    m_span = _array_span(line, b'"loss_mask":')
    if i_span is None or m_span is None:
        raise ValueError("no input_ids" if i_span is None else "no loss_mask")
    rec = _rest(line, [i_span, m_span])
    n = _count(line, i_span)
    mask = _mask(line, m_span)
    if mask.size != n:
        raise ValueError(f"loss_mask has {mask.size} entries, input_ids {n}")
    trainable = int(mask.sum(dtype=np.int64))
    _check(rec, "n_tokens", n)
    _check(rec, "n_trainable", trainable)
    reasoning, span = _turn_reasoning(mask, _id_positions(line, i_span, tok, first=False) if tok else [])
    return rec.get("id"), None, n - trainable, trainable, reasoning, span, int(bool(rec.get("truncated")))


def iter_lines(path: Path, block: int) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, line, ended by a newline) up to the file's size when opened: a growing file is not chased."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        carry, lineno, left = b"", 0, size
        while left > 0:
            buf = f.read(min(block, left))
            if not buf:
                break
            left -= len(buf)
            lines = (carry + buf).split(b"\n")
            carry = lines.pop()
            for line in lines:
                lineno += 1
                yield lineno, line, True
        if carry:
            yield lineno + 1, carry, False


def scan_file(path: Path, out: Lengths, think_id: int | None, seen: set, block: int = 1 << 24) -> Lengths:
    """Stream one record file into `out` (ids in `seen` are skipped as duplicates).

    Skips a torn last line and a torn fragment later terminated (as store.iter_jsonl does); any other bad line
    raises RecordError naming the file, the line and the reason.
    """
    tok = str(think_id).encode() if think_id is not None and think_id >= 0 else None
    scan = scan_record if out.kind == "A" else scan_response
    for lineno, line, ended in iter_lines(path, block):
        out.bytes_read += len(line) + ended
        text = line.strip()
        if not text:
            if ended:
                raise RecordError(f"{path}: line {lineno}: empty line inside a record file")
            continue
        out.read += 1
        if not text.endswith(b"}") and (not ended or text.startswith(b"{")):
            out.torn += 1  # a torn write: the last line, or a fragment later terminated by append_jsonl
            continue
        try:
            sid, limit, *row = scan(text, tok)
        except ValueError as e:  # orjson.JSONDecodeError is a ValueError too
            if not ended:
                out.torn += 1
                continue
            raise RecordError(f"{path}: line {lineno}: {e}") from None
        if not isinstance(sid, str | int | None):
            raise RecordError(f"{path}: line {lineno}: id is a {type(sid).__name__}, not a string")
        if sid is not None:
            if sid in seen:
                out.duplicates += 1
                continue
            seen.add(sid)
        if limit is not None:
            out.limits[limit] += 1
        out.add(*row)
    return out


def scan_dataset(
    kind: str, name: str, files: list[Path], think_id: int | None, block: int = 1 << 24
) -> Lengths:
    """A dataset's lengths over its record files in order (B: responses.jsonl, then 03's shard files)."""
    out, seen = Lengths(kind, name), set()
    for f in files:
        scan_file(f, out, think_id, seen, block)
    return out


PARALLEL_BYTES = 1 << 26  # below 64 MB of input, starting worker processes costs more than it saves


def scan_all(
    sources: list[tuple[str, str, list[Path]]], think_id: int | None, block: int, workers: int
) -> list:
    """scan_dataset over every source; big inputs get one dataset per worker process (0: every core we have)."""
    jobs = [(kind, name, files, think_id, block) for kind, name, files in sources]
    workers = min(workers or len(os.sched_getaffinity(0)), len(jobs))
    if workers <= 1 or sum(f.stat().st_size for *_, files in sources for f in files) < PARALLEL_BYTES:
        return [scan_dataset(*job) for job in jobs]
    # spawn, not fork: the caller may be a Jupyter kernel with threads running
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(scan_dataset, *zip(*jobs, strict=True)))


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


def _limit(ls: Lengths, p: Params) -> int:
    """The generation limit of a B dataset: the records' own (most common), else the params'."""
    if ls.limits:
        return int(ls.limits.most_common(1)[0][0])
    return p.max_new_tokens if ls.kind == "B" else 0


def _reasoning(a: dict[str, np.ndarray], p: Params) -> bool:
    """A reasoning dataset: at least `reasoning_min_share` of its uncut samples think (not just `<think></think>`)."""
    uncut = a["think_span"][a["status"] != 1]
    return bool(uncut.size and (uncut >= p.min_reasoning_tokens).mean() >= p.reasoning_min_share)


def dataset_row(ls: Lengths, p: Params) -> dict:
    """One row of the length table: counts, completion/prompt distributions, limit and reasoning shares."""
    a = ls.arrays()
    c, r, n = a["completion"], a["reasoning"], a["completion"].size
    share = (lambda m: float(m.mean())) if n else (lambda m: np.nan)
    row = {"kind": ls.kind, "dataset": ls.name, "n": n, "limit": _limit(ls, p)} | _pct(c, "")
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


def tables(lengths: list[Lengths], p: Params) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(completion length table, prompt length table, measured token table with corpus shares)."""
    rows = pd.DataFrame([dataset_row(ls, p) for ls in lengths])
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


# ---------------------------------------------------------------- projection of runs in progress


def bootstrap_remaining(
    values: np.ndarray, remaining: int, reps: int, rng: np.random.Generator
) -> np.ndarray:
    """(reps,) draws of the token total of `remaining` future samples, predicted from the measured `values`.

    Each replicate resamples the measured values (a multinomial over their distinct values, so the cost does
    not grow with n), then draws the sum of `remaining` new samples from that resample (normal, by the CLT):
    mean and spread both vary, so the interval covers the final total, not only remaining x mean.
    """
    if remaining <= 0:
        return np.zeros(reps)
    u, c = np.unique(values, return_counts=True)
    u, n = u.astype(np.float64), values.size
    chunk = max(1, 4_000_000 // u.size)  # bound the (chunk, distinct) count matrix
    out = []
    for lo in range(0, reps, chunk):
        counts = rng.multinomial(n, c / n, size=min(chunk, reps - lo))  # (r, distinct)
        mean = counts @ u / n
        var = np.maximum(counts @ (u * u) / n - mean * mean, 0.0)
        draws = remaining * mean + np.sqrt(remaining * var) * rng.standard_normal(mean.size)
        out.append(np.maximum(draws, 0.0))  # the normal tail must not remove tokens already counted
    return np.concatenate(out)


def b_plan(run_dir: Path, name: str, infer_limit: int = 0) -> tuple[int | None, bool]:
    """(planned samples of a B dataset, None if unknown; True if 03 has finished it).

    Finished: 03's infer/<ds>/meta.json names what it selected ("read"). Otherwise the prompts 02 kept (its
    meta.json "kept", else the lines of prompts.jsonl), capped at 03's limit.
    """
    src, done = run_dir / "data" / "B" / name, run_dir / "infer" / name / "meta.json"
    meta = read_json(done) if done.exists() else {}
    if meta.get("finished") and isinstance(meta.get("read"), int):
        return meta["read"], True
    planned = read_json(src / "meta.json").get("kept") if (src / "meta.json").exists() else None
    if not isinstance(planned, int) and (src / "prompts.jsonl").exists():
        planned = sum(1 for _, line, _ in iter_lines(src / "prompts.jsonl", 1 << 24) if line.strip())
    if not isinstance(planned, int):
        return None, False
    return (min(planned, infer_limit) if infer_limit > 0 else planned), False


def projection(lengths: list[Lengths], run_dir: Path, p: Params, seed: int) -> tuple[pd.DataFrame, dict]:
    """Per dataset and token kind: measured, remaining samples, projected final total and its interval.

    Returns the table and the corpus totals (the datasets' replicates summed). A dataset with too few completed
    samples is not projected but flagged; the corpus then counts only its measured tokens and lists it.
    """
    rng, tail = np.random.default_rng(seed), (1 - p.interval) / 2 * 100
    rows, corpus_reps, unprojected = [], {}, []
    for ls in lengths:
        a = ls.arrays()
        n = a["completion"].size
        planned, finished = b_plan(run_dir, ls.name, p.infer_limit) if ls.kind == "B" else (n, True)
        remaining = 0 if finished or planned is None else max(planned - n, 0)
        too_few = remaining > 0 and n < max(1, p.min_samples_to_project)
        unprojected += [f"{ls.kind}/{ls.name}"] if too_few else []
        status = "complete" if finished or (planned is not None and remaining == 0) else "in progress"
        status = "planned unknown" if planned is None and not finished else status
        head = dict(status=status, completed=n, planned=planned)
        head |= dict(remaining=remaining, too_few_to_project=too_few)
        for kind, x in (("prompt", a["prompt"]), ("completion", a["completion"]), ("total", a["total"])):
            measured = int(x.sum())
            reps = measured + (0 if too_few else bootstrap_remaining(x, remaining, p.bootstrap_reps, rng))
            corpus_reps[kind] = corpus_reps.get(kind, 0) + reps
            lo, hi = (np.nan, np.nan) if too_few else np.percentile(reps, [tail, 100 - tail])
            projected = np.nan if too_few else measured + remaining * (x.mean() if n else 0.0)
            rows.append(dict(kind=ls.kind, dataset=ls.name, tokens=kind) | head
                        | dict(measured=measured, projected=projected, lo=lo, hi=hi))  # fmt: skip
    table = pd.DataFrame(rows)
    corpus: dict = {"unprojected": unprojected, "interval": p.interval}
    for kind, reps in corpus_reps.items():
        sub = table[table.tokens == kind]
        lo, hi = np.percentile(reps, [tail, 100 - tail])
        projected = float(sub.projected.fillna(sub.measured).sum())
        corpus[kind] = dict(measured=int(sub.measured.sum()), projected=projected, lo=float(lo), hi=float(hi))
    return table, corpus


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
    figures: dict = field(default_factory=dict)

    @property
    def headline(self) -> dict:
        """The numbers the notebook records."""
        c, tok, proj = self.completion, self.tokens, self.corpus["completion"]
        per = lambda col: {f"{k}/{d}": v for k, d, v in zip(c.kind, c.dataset, c[col], strict=True)}  # noqa: E731
        return {
            "datasets": len(c),
            "samples": int(c.n.sum()),
            **{f"{k}_tokens": int(tok[f"{k}_tokens"].sum()) for k in ("prompt", "completion", "trainable")},
            "projected_trainable_tokens": proj["projected"],
            "projected_trainable_lo": proj["lo"],
            "projected_trainable_hi": proj["hi"],
            "unprojected_datasets": self.corpus["unprojected"],
            "max_share_at_limit": float(c.share_at_limit.max()),
            "warnings": int((self.verdicts.level == "warn").sum()),
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
    tok, token = load_tokenizer(shared), p.end_of_thinking_token
    i = tok.convert_tokens_to_ids(token)
    if not isinstance(i, int) or i == tok.unk_token_id or tok.convert_ids_to_tokens(i) != token:
        raise ValueError(f"end_of_thinking_token {token!r} is not one token of the tokenizer "
                         f"{shared.tokenizer_path!r}: set end_of_thinking_id, or a token the tokenizer has")  # fmt: skip
    return i


def find_sources(run_dir: Path, only: list[str]) -> list[tuple[str, str, list[Path]]]:
    """(kind, dataset, record files) of every A dataset and every planned or generated B dataset.

    B files: infer/<ds>/responses.jsonl, then the shard files of a sharded 03 run not yet merged into it.
    """
    names = {"A": {f.parent.name for f in (run_dir / "data" / "A").glob("*/records.jsonl")}, "B": set()}
    names["B"] |= {d.name for d in (run_dir / "infer").glob("*/") if d.is_dir()}
    names["B"] |= {d.parent.name for d in (run_dir / "data" / "B").glob("*/meta.json")}
    names["B"] |= {d.parent.name for d in (run_dir / "data" / "B").glob("*/prompts.jsonl")}
    out = []
    for kind in ("A", "B"):
        for name in sorted(n for n in names[kind] if not only or n in only):
            if kind == "A":
                files = [run_dir / "data" / "A" / name / "records.jsonl"]
            else:
                ds = run_dir / "infer" / name
                files = [ds / "responses.jsonl", *sorted(ds.glob("shards/*/responses.jsonl"))]
            out.append((kind, name, [f for f in files if f.exists()]))
    if not out:
        named = f" named {only}" if only else ""
        raise FileNotFoundError(f"{run_dir}: no A records (data/A/*/records.jsonl) nor B datasets (infer/*, "
                                f"data/B/*){named}: run stages 01-03 first")  # fmt: skip
    return out


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def run(cfg) -> LengthReport:
    """Stage 04: scan, tabulate, project, judge, plot; writes analysis/ (meta.json last). Inputs are read only."""
    from eagle_lib.lengths_plots import make_figures, verdicts

    t0, started = time.time(), _now()
    p, run_dir = cfg.stage, Path(cfg.run_dir)
    out = run_dir / "analysis"
    think_id = resolve_think_id(p, cfg.shared)
    sources = find_sources(run_dir, p.datasets)
    lengths = scan_all(sources, think_id, p.block_bytes, cfg.shared.num_workers)
    completion, prompt, tokens = tables(lengths, p)
    proj, corpus = projection(lengths, run_dir, p, cfg.shared.seed)
    found = verdicts(completion, proj, lengths, p, think_id)
    result = LengthReport(p, completion, prompt, tokens, proj, found, corpus, lengths, think_id)
    out.mkdir(parents=True, exist_ok=True)
    result.figures = make_figures(result, out / "plots")
    for name in ("completion", "prompt", "tokens", "projection", "verdicts"):
        _write_csv(getattr(result, name), out / f"{name}.csv")
    write_json(out / "verdicts.json", json.loads(found.to_json(orient="records", double_precision=15)))
    write_json(out / "summary.json", {"end_of_thinking_id": think_id, "corpus": corpus, **result.headline})
    read, torn, dups = (sum(getattr(ls, k) for ls in lengths) for k in ("read", "torn", "duplicates"))
    dropped = {k: v for k, v in (("torn_line", torn), ("duplicate_id", dups)) if v}
    inputs = {f"{k}/{n}": {"files": [str(f) for f in fs], "bytes_read": ls.bytes_read}
              for (k, n, fs), ls in zip(sources, lengths, strict=True)}  # fmt: skip
    meta = dict(read=read, kept=read - torn - dups, dropped=dropped, rejected=0, inputs=inputs)
    meta |= dict(params=p.model_dump(mode="json"), shared=cfg.shared.model_dump(mode="json"), end_of_thinking_id=think_id)  # fmt: skip
    meta |= dict(started=started, finished=_now(), seconds=round(time.time() - t0, 2))
    check_tally(meta, str(out / "meta.json"))
    write_json(out / "meta.json", meta)
    return result
