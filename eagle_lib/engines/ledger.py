"""03's ledger of started requests: `infer/<ds>/started.jsonl` (or a shard's), beside the finished responses.

One line per request start: {"id", "t" (unix seconds), "server"}. A request started again (an HTTP retry, a
restart after a crash) gets another line; readers keep the LATEST start of an id, which under-states how long
it has been running and so keeps "it has produced at least elapsed x rate tokens" a true lower bound.
Engines that know how far a request has got (the embedded engine) add progress lines {"id", "t", "n"}: it had
produced n tokens at t (readers keep the latest, and only if it is not older than the latest start).

Durable and cheap: starts are buffered and appended in batches (store.append_jsonl, fsync) by a background
thread every `seconds`, and before every append of responses (`flush`), so a reader mid-run sees every finished
response's start in the ledger except for at most `seconds` of the newest starts, which it reads as not yet
started (projected from the dataset's distribution, never as finished). A torn last line is skipped.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from eagle_lib import store

try:  # orjson parses a ledger line ~3x faster; the stdlib gives the same result
    from orjson import loads as _loads
except ImportError:
    from json import loads as _loads

NAME = "started.jsonl"


class Ledger:
    """Thread-safe buffer of request starts, flushed to `path` every `seconds` and on `flush()`."""

    def __init__(self, path: Path, seconds: float = 5.0):
        self.path, self.seconds = Path(path), seconds
        self.buf: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="infer-ledger", daemon=True)

    def start(self) -> Ledger:
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop the flusher and write what is buffered."""
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.flush()

    def started(self, sample_id: str, server: str = "") -> None:
        """Record that a request was handed to a server now (called from the engine, any thread)."""
        with self.lock:
            self.buf.append({"id": sample_id, "t": round(time.time(), 3), "server": server})

    def progress(self, counts: list[tuple[str, int]]) -> None:
        """Record how many tokens each request in flight has produced by now (called from the engine)."""
        t = round(time.time(), 3)
        with self.lock:
            self.buf.extend({"id": sid, "t": t, "n": int(n)} for sid, n in counts)

    def flush(self) -> None:
        with self.lock:
            buf, self.buf = self.buf, []
        store.append_jsonl(self.path, buf)

    def _loop(self) -> None:
        while not self.stop.wait(self.seconds):
            self.flush()


def ledger_files(ds_dir: Path) -> list[Path]:
    """A dataset's ledgers: the unsharded run's, then every shard's."""
    files = [ds_dir / NAME, *sorted(ds_dir.glob(f"shards/*/{NAME}"))]
    return [f for f in files if f.exists()]


def read_starts(files: list[Path], block: int = 1 << 24) -> tuple[dict[str, tuple], set[str]]:
    """(id -> (latest start time, server, progress time, tokens by then), ids started more than once) over the
    ledger files (progress: nan, 0 when none was recorded after that start); a torn last line is skipped.

    Streams the bytes (as the 04 scanner does), so a ledger of millions of starts costs a second, not a
    record object per line.
    """

    out: dict[str, tuple] = {}
    restarted: set[str] = set()  # ids started more than once (an HTTP retry, or 03 interrupted and resumed)
    nan = float("nan")
    for f in files:
        for lineno, line, ended in store.iter_lines(f, block):
            text = line.strip()
            if not text:
                continue
            try:
                rec = _loads(text)
                sid, t = rec["id"], float(rec["t"])
            except (ValueError, KeyError, TypeError) as e:
                if not ended or not text.endswith(b"}"):
                    continue  # a torn write (the last line, or a fragment later terminated)
                raise store.RecordError(f"{f}: line {lineno}: not a ledger record ({e})") from None
            old = out.get(sid)
            if "n" in rec:  # progress of the latest start (a progress line never precedes its start)
                if old is not None and t >= old[0]:
                    out[sid] = (old[0], old[1], t, int(rec["n"]))
            elif old is None or t >= old[0]:
                out[sid] = (t, str(rec.get("server", "")), nan, 0)
                if old is not None:
                    restarted.add(sid)
    return out, restarted
