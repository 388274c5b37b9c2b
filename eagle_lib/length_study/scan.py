"""Stage 04's reader: streams A records and B responses into compact per-sample length arrays.

Reads A records (`data/A/<ds>/records.jsonl`) and B responses (`infer/<ds>/responses.jsonl` and its shards,
possibly still being written by 03: read only, a torn last line skipped). `eagle_lib.lengths` tabulates,
projects and judges what this returns.

Speed: a line is never fully materialised. Its int lists are located by byte search (an int list holds no
brackets or quotes, and a key's quotes cannot occur unescaped inside a JSON string), counted by their commas and
searched for the end-of-thinking id as bytes; only the rest of the line (scalars, text) is parsed as JSON.
Memory: a few compact ints per sample, plus the ids seen (for duplicates).

Mid-run (issue 16): with 03's ledger of started requests (`engines.ledger`), each B response also gets its start
and finish time and server, and the ledger's ids that have no response yet are the requests in flight, whose
length `analysis.censored` treats as right-censored. A run without a ledger is read as before (`ledger` False).
"""

from __future__ import annotations

import multiprocessing
import os
from array import array
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eagle_lib.store import RecordError, iter_lines

_NAN = float("nan")

try:  # orjson parses the scalar rest of a line ~3x faster; the stdlib gives the same result
    from orjson import loads as _loads
except ImportError:
    from json import loads as _loads

# ---------------------------------------------------------------- byte-level record scanning

_ARRAYS = {"prompt": "q", "completion": "q", "reasoning": "q", "think_span": "q", "status": "b"}
_STATUS = {"stop": 0, "length": 1}  # anything else: 2
TORN_NAMED = 20  # torn lines named (file:line) per dataset; all are counted


@dataclass
class Lengths:
    """Per-sample lengths of one dataset as compact arrays (never token lists), plus reading counters."""

    kind: str  # "A" | "B"
    name: str
    cols: dict[str, array] = field(default_factory=lambda: {k: array(t) for k, t in _ARRAYS.items()})
    limits: Counter = field(default_factory=Counter)  # max_new_tokens found in the records -> count
    read: int = 0  # non-empty lines
    torn: int = 0  # torn writes skipped
    torn_at: list[str] = field(default_factory=list)  # file:line of the first TORN_NAMED of them
    duplicates: int = 0  # lines whose id came earlier
    bytes_read: int = 0
    ledger: bool = False  # 03 kept a ledger of started requests for this dataset
    restarted: int = (
        0  # requests in flight that were started more than once (their earlier attempt not counted)
    )
    timing: dict[str, array] = field(
        default_factory=lambda: {"start": array("d"), "end": array("d"), "server": array("h")}
    )
    in_flight: dict[str, array] = field(
        default_factory=lambda: {
            "start": array("d"),
            "server": array("h"),
            "n": array("q"),
            "n_t": array("d"),
        }
    )  # start, server, and the latest streamed count of tokens produced (n at time n_t; nan: none)
    servers: dict[str, int] = field(default_factory=dict)  # server name -> code in timing / in_flight

    def add_torn(self, path, lineno: int) -> None:
        self.torn += 1
        if len(self.torn_at) < TORN_NAMED:
            self.torn_at.append(f"{path}:{lineno}")

    def server_code(self, name) -> int:
        return self.servers.setdefault(str(name or ""), len(self.servers))

    def add_timing(self, start: float, end: float, server) -> None:
        t = self.timing
        t["start"].append(start)
        t["end"].append(end)
        t["server"].append(self.server_code(server))

    def add(self, prompt: int, completion: int, reasoning: int, think_span: int, status: int) -> None:
        c = self.cols
        c["prompt"].append(prompt)
        c["completion"].append(completion)
        c["reasoning"].append(reasoning)  # 0: no end-of-thinking token
        # the longest turn's reasoning (an empty block: 2 tokens; 1 where the prompt opens <think>, as Kimi's does)
        c["think_span"].append(think_span)
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
    return _scan_response(line, tok)[0]


def _scan_response(line: bytes, tok: bytes | None) -> tuple[tuple, dict]:
    """scan_response's row and the line's scalar fields (server, latency_s, finished_at for the timing)."""
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
    return (rec.get("id"), limit, n_prompt, n_out, reasoning, reasoning, status), rec


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


def _timing(out: Lengths, rec: dict, started: tuple | None) -> None:
    """Start (ledger, else finished_at - latency), finish (finished_at, else start + latency) and server."""
    lat, fin = rec.get("latency_s"), rec.get("finished_at")
    lat = float(lat) if isinstance(lat, int | float) else _NAN
    fin = float(fin) if isinstance(fin, int | float) else _NAN
    start = started[0] if started else fin - lat
    out.add_timing(start, fin if fin == fin else start + lat, rec.get("server") or (started or ("", ""))[1])


def scan_file(path: Path, out: Lengths, think_id: int | None, seen: set, block: int = 1 << 24,
              starts: dict | None = None) -> Lengths:  # fmt: skip
    """Stream one record file into `out` (ids in `seen` are skipped as duplicates).

    Skips a torn last line and a torn fragment later terminated (as store.iter_jsonl does); any other bad line
    raises RecordError naming the file, the line and the reason. `starts` (B, from 03's ledger): id -> (start,
    server); each response takes its id's entry out, so what is left afterwards is in flight.
    """
    tok = str(think_id).encode() if think_id is not None and think_id >= 0 else None
    scan = scan_record if out.kind == "A" else _scan_response
    for lineno, line, ended in iter_lines(path, block):
        out.bytes_read += len(line) + ended
        text = line.strip()
        if not text:
            if ended:
                raise RecordError(f"{path}: line {lineno}: empty line inside a record file")
            continue
        out.read += 1
        if not text.endswith(b"}") and (not ended or text.startswith(b"{")):
            out.add_torn(
                path, lineno
            )  # a torn write: the last line, or a fragment later terminated by append_jsonl
            continue
        try:
            got = scan(text, tok)
            rec = None if out.kind == "A" else got[1]
            sid, limit, *row = got if out.kind == "A" else got[0]
        except ValueError as e:  # orjson.JSONDecodeError is a ValueError too
            if not ended:
                out.add_torn(path, lineno)
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
        if rec is not None:
            _timing(out, rec, starts.pop(sid, None) if starts is not None else None)
    return out


def scan_dataset(kind: str, name: str, files: list[Path], think_id: int | None, block: int = 1 << 24,
                 ledgers: list[Path] | None = None) -> Lengths:  # fmt: skip
    """A dataset's lengths over its record files in order (B: responses.jsonl, then 03's shard files).

    With 03's ledgers (B), the started requests without a response are recorded in `in_flight`.
    """
    from eagle_lib.engines.ledger import read_starts

    out, seen = Lengths(kind, name), set()
    starts, restarted = read_starts(ledgers, block) if ledgers else (None, set())
    out.ledger = starts is not None
    for f in files:
        scan_file(f, out, think_id, seen, block, starts)
    for sid, (t, server, n_t, n) in (starts or {}).items():
        if sid not in seen:
            out.restarted += sid in restarted
            f = out.in_flight
            f["start"].append(t)
            f["server"].append(out.server_code(server))
            f["n"].append(n)
            f["n_t"].append(n_t)
    return out


PARALLEL_BYTES = 1 << 26  # below 64 MB of input, starting worker processes costs more than it saves


def scan_all(
    sources: list[tuple[str, str, list[Path]]], think_id: int | None, block: int, workers: int
) -> list:
    """scan_dataset over every source; big inputs get one dataset per worker process (0: every core we have)."""
    jobs = [(kind, name, files, think_id, block, ledgers) for kind, name, files, ledgers in sources]
    workers = min(workers or len(os.sched_getaffinity(0)), len(jobs))
    if workers <= 1 or sum(f.stat().st_size for _, _, files, _ in sources for f in files) < PARALLEL_BYTES:
        return [scan_dataset(*job) for job in jobs]
    # spawn, not fork: the caller may be a Jupyter kernel with threads running
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(scan_dataset, *zip(*jobs, strict=True)))


def find_sources(run_dir: Path, only: list[str]) -> list[tuple[str, str, list[Path], list[Path]]]:
    """(kind, dataset, record files, ledger files) of every A dataset and every planned or generated B dataset.

    B files: infer/<ds>/responses.jsonl, then the shard files of a sharded 03 run not yet merged into it; its
    ledgers: infer/<ds>/started.jsonl and the shards' (none for A, nor for a run made before 03 kept one).
    """
    from eagle_lib.engines.ledger import ledger_files

    names = {"A": {f.parent.name for f in (run_dir / "data" / "A").glob("*/records.jsonl")}, "B": set()}
    names["B"] |= {d.name for d in (run_dir / "infer").glob("*/") if d.is_dir()}
    names["B"] |= {d.parent.name for d in (run_dir / "data" / "B").glob("*/meta.json")}
    names["B"] |= {d.parent.name for d in (run_dir / "data" / "B").glob("*/prompts.jsonl")}
    out = []
    for kind in ("A", "B"):
        for name in sorted(n for n in names[kind] if not only or n in only):
            ledgers: list[Path] = []
            if kind == "A":
                files = [run_dir / "data" / "A" / name / "records.jsonl"]
            else:
                ds = run_dir / "infer" / name
                files = [ds / "responses.jsonl", *sorted(ds.glob("shards/*/responses.jsonl"))]
                ledgers = ledger_files(ds)
            out.append((kind, name, [f for f in files if f.exists()], ledgers))
    if not out:
        named = f" named {only}" if only else ""
        raise FileNotFoundError(f"{run_dir}: no A records (data/A/*/records.jsonl) nor B datasets (infer/*, "
                                f"data/B/*){named}: run stages 01-03 first")  # fmt: skip
    return out
