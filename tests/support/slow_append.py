"""`python -m eagle_lib.infer`, with every append to a responses.jsonl written in two parts and a pause between.

    python -m tests.support.slow_append PARAMS --run-dir RUN [--shard i/n]

The last record of each batch is written up to the middle of its first multi-byte UTF-8 character (records are
written non-ASCII), flushed to disk, and completed `PAUSE_S` later: a SIGKILL during the pause leaves exactly
the torn tail a crash mid-write leaves, cut inside a character. Used by tests/unit/test_infer.py's kill tests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from eagle_lib import infer, store

PAUSE_S = 0.4
_append = store.append_jsonl


def _cut(line: bytes) -> int:
    """A position inside the line's first multi-byte character (else its middle)."""
    i = next((k for k, b in enumerate(line) if b >= 0xC0), None)
    return i + 1 if i is not None else len(line) // 2


def slow_append(path, records, fsync: bool = True) -> int:
    records = list(records)
    if not records or not str(path).endswith("responses.jsonl"):
        return _append(path, records, fsync)
    n = _append(path, records[:-1], fsync)
    line = json.dumps(records[-1], ensure_ascii=False, separators=(",", ":")).encode()
    k = _cut(line)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as f:
        size = f.seek(0, os.SEEK_END)
        start = store._tail_start(f, size) if size else 0  # store's rule for a torn tail (n == 0 only)
        if start < size:
            f.seek(start)
            if store._is_record(f.read()):
                line = b"\n" + line
                k += 1
            else:
                f.truncate(start)
        f.write(line[:k])
        f.flush()
        os.fsync(f.fileno())
        time.sleep(PAUSE_S)  # a kill here leaves a torn tail cut inside a character
        f.write(line[k:] + b"\n")
        f.flush()
        os.fsync(f.fileno())
    return n + 1


if __name__ == "__main__":
    store.append_jsonl = slow_append
    raise SystemExit(infer.main(sys.argv[1:]))
