"""Durable record files shared by every stage: JSONL append/read, meta.json, held-out split.

Records are JSON lines. Writers append whole batches and fsync, so a crash leaves at most one torn last
line; the next append truncates it before writing, and readers skip it (the same rules as 04's byte scanner,
:mod:`eagle_lib.length_study.scan`); a bad line in the middle is real corruption and an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


class RecordError(ValueError):
    """A record file is corrupt: names the file, the line and the reason."""


def append_jsonl(path: str | Path, records: Iterable[dict], fsync: bool = True) -> int:
    """Append records as JSON lines in one write; returns how many were written.

    A file that does not end in a newline was cut by a crash mid-write: a tail that parses as a whole record
    (only its newline was lost) is kept and terminated; any other torn tail is truncated away first, so a torn
    fragment never ends up in the middle of the file (where it would be corruption, not a torn tail).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in records]
    if not lines:
        return 0
    payload = ("\n".join(lines) + "\n").encode("utf-8")
    with open(path, "ab+") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            start = _tail_start(f, size)
            if start < size:
                f.seek(start)
                if _is_record(f.read()):
                    payload = b"\n" + payload
                else:
                    f.truncate(start)
        f.write(payload)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return len(lines)


def _tail_start(f: Any, size: int, block: int = 1 << 16) -> int:
    """Offset just after the last newline of an open binary file of ``size`` bytes (0: no newline)."""
    end = size
    while end > 0:
        start = max(0, end - block)
        f.seek(start)
        k = f.read(end - start).rfind(b"\n")
        if k >= 0:
            return start + k + 1
        end = start
    return 0


def _is_record(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError (a cut inside a multi-byte character)
        return False


def iter_jsonl(
    path: str | Path, tolerate_torn_tail: bool = True, torn: list[str] | None = None
) -> Iterator[dict]:
    """Yield the records of a JSONL file, with the same torn-write rules as 04's byte scanner.

    Skipped as torn writes (when tolerated): a last line without its newline that does not parse (cut anywhere,
    inside a multi-byte UTF-8 character or right after an inner ``}`` or ``]``), and a line that opens an object
    but does not close it (a fragment an older writer terminated). A last line that parses is a record. Any other
    line that does not parse, an empty line inside the file and a non-object raise RecordError (file, line).
    Each skipped torn line is appended to `torn` as ``file:line`` when a list is given (readers that train or
    count on the records pass one: a skipped line is data lost, and must be counted).
    """
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            rec = _parse_line(path, lineno, raw, tolerate_torn_tail)
            if rec is not None:
                yield rec
            elif torn is not None and raw.strip():
                torn.append(f"{path}:{lineno}")


def _parse_line(path: Path, lineno: int, raw: bytes, tolerate: bool) -> dict | None:
    ended = raw.endswith(b"\n")
    text = raw.strip()
    if not text:
        if ended:
            raise RecordError(f"{path}: line {lineno}: empty line inside a record file")
        return None
    if not text.endswith(b"}") and (not ended or text.startswith(b"{")):
        if tolerate:
            return None  # a torn write: the tail, or a fragment an older writer terminated
        raise RecordError(f"{path}: line {lineno}: torn write (a record cut short)")
    try:
        rec = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a cut inside a character
        if not ended and tolerate:
            return None
        raise RecordError(f"{path}: line {lineno}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(rec, dict):
        raise RecordError(f"{path}: line {lineno}: expected a JSON object, got {type(rec).__name__}")
    return rec


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a JSONL file (torn tail tolerated)."""
    return list(iter_jsonl(path))


def write_atomic(path: str | Path, write: Any) -> Path:
    """The one write-then-rename: ``write(tmp_path)`` fills a temp file beside ``path`` (fsynced), which then
    replaces ``path``; readers see the old file or the new one, never half of one. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, obj: Any) -> None:
    """Write JSON atomically (:func:`write_atomic`), so readers never see half a file."""
    text = json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n"
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def now_iso(ts: float | None = None) -> str:
    """ISO-8601 UTC time (seconds) of ``ts`` (epoch seconds; default now): the one time format of meta files."""
    return datetime.fromtimestamp(time.time() if ts is None else ts, UTC).isoformat(timespec="seconds")


def write_meta(directory: str | Path, meta: dict, started: float, tally: bool = False) -> dict:
    """Write ``directory/meta.json``: ``meta`` plus ``started`` / ``finished`` (ISO-8601) and ``seconds``;
    with ``tally`` the counting invariant is checked first. Returns what was written."""
    end = time.time()
    out = meta | {"started": now_iso(started), "finished": now_iso(end), "seconds": round(end - started, 3)}
    path = Path(directory) / "meta.json"
    if tally:
        check_tally(out, str(path))
    write_json(path, out)
    return out


def read_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


def check_tally(meta: dict, where: str = "meta.json") -> None:
    """Enforce the counting invariant of every stage: read = kept + dropped + rejected."""
    dropped = sum(meta.get("dropped", {}).values())
    if meta["read"] != meta["kept"] + dropped + meta["rejected"]:
        raise AssertionError(
            f"{where}: read={meta['read']} != kept={meta['kept']} + dropped={dropped} "
            f"+ rejected={meta['rejected']}"
        )


def stable_hash(obj: Any, n: int = 16) -> str:
    """Short sha256 of a JSON-serialisable object (sorted keys): cache keys and fingerprints."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


def split_key(rec: dict) -> str:
    """What the held-out split hashes: the conversation of a ``turns: each`` sequence (all of one conversation's
    sequences land on the same side), else the record id."""
    return str(rec.get("conversation") or rec["id"])


def is_heldout(sample_id: str, percent: float) -> bool:
    """Deterministic held-out split by id hash: the same id is held out in every stage and run."""
    h = int.from_bytes(hashlib.sha256(str(sample_id).encode()).digest()[:8], "big")
    return (h % 10_000) < percent * 100


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
