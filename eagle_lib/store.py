"""Durable record files shared by every stage: JSONL append/read, meta.json, held-out split.

Records are JSON lines. Writers append whole batches and fsync, so a crash leaves at most one torn last
line; readers skip a torn last line (never a torn line in the middle, which is real corruption).
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

    If the file ends in a torn line (a crash mid-write), it is terminated first so the new batch starts on
    its own line and the torn fragment stays a single skipped line.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False, separators=(",", ":")) for r in records]
    if not lines:
        return 0
    payload = "\n".join(lines) + "\n"
    with open(path, "ab+") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                payload = "\n" + payload
        f.write(payload.encode("utf-8"))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return len(lines)


def iter_jsonl(path: str | Path, tolerate_torn_tail: bool = True) -> Iterator[dict]:
    """Yield the records of a JSONL file.

    A last line without its newline that does not parse is a torn write and is skipped (when tolerated);
    any other line that does not parse raises RecordError naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb") as f:
        prev = None  # (lineno, raw) of the line before, so we know which line is last
        for lineno, raw in enumerate(f, 1):
            if prev is not None:
                rec = _parse_line(path, *prev, last=False, tolerate=tolerate_torn_tail)
                if rec is not None:
                    yield rec
            prev = (lineno, raw)
        if prev is not None:
            rec = _parse_line(path, *prev, last=True, tolerate=tolerate_torn_tail)
            if rec is not None:
                yield rec


def _parse_line(path: Path, lineno: int, raw: bytes, last: bool, tolerate: bool) -> dict | None:
    text = raw.strip()
    if not text:
        if last:
            return None
        raise RecordError(f"{path}: line {lineno}: empty line inside a record file")
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        torn = not raw.endswith(b"\n")
        if (last and torn and tolerate) or (torn is False and _is_torn_fragment(raw) and tolerate):
            return None
        raise RecordError(f"{path}: line {lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise RecordError(f"{path}: line {lineno}: expected a JSON object, got {type(rec).__name__}")
    return rec


def _is_torn_fragment(raw: bytes) -> bool:
    """A torn fragment later terminated by append_jsonl: it starts a JSON object but never closes it."""
    text = raw.strip()
    return text.startswith(b"{") and not text.endswith(b"}")


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


def is_heldout(sample_id: str, percent: float) -> bool:
    """Deterministic held-out split by id hash: the same id is held out in every stage and run."""
    h = int.from_bytes(hashlib.sha256(str(sample_id).encode()).digest()[:8], "big")
    return (h % 10_000) < percent * 100
