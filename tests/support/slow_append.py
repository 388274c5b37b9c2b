"""`python -m eagle_lib.infer`, with every append to a responses.jsonl written in two parts and a stop between.

    python -m tests.support.slow_append PARAMS --run-dir RUN [--shard i/n]

The last record of each batch is written up to the middle of its first multi-byte UTF-8 character (records are
written non-ASCII) and flushed to disk: the torn tail a crash mid-write leaves, cut inside a character. Then the
child stops there. Started by `kill_mid_write` (which passes it two pipe ends in ``HANDSHAKE_ENV``), it sends the
record it is writing and waits for "go": the parent SIGKILLs it at that recorded point or lets it finish the
line, so no clock and no machine load decides where the kill lands. Run by hand (no handshake), it pauses `PAUSE_S` instead.
Used by the kill tests of tests/unit/test_infer.py and tests/unit/test_multiturn.py.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from eagle_lib import infer, store

PAUSE_S = 0.4
HANDSHAKE_ENV = "SLOW_APPEND_FDS"  # "<fd to read 'go' from>,<fd to write 'torn' to>"
GO = b"go\n"
_append = store.append_jsonl


def _cut(line: bytes) -> int:
    """A position inside the line's first multi-byte character (else its middle)."""
    i = next((k for k, b in enumerate(line) if b >= 0xC0), None)
    return i + 1 if i is not None else len(line) // 2


def _stop_mid_write(line: bytes) -> None:
    """Send the parent the record whose line is torn now and wait for its 'go' (or its SIGKILL); without a
    parent, pause."""
    fds = os.environ.get(HANDSHAKE_ENV)
    if not fds:
        time.sleep(PAUSE_S)
        return
    r, w = (int(x) for x in fds.split(","))
    with open(w, "wb", closefd=False) as pipe:
        pipe.write(line.lstrip(b"\n") + b"\n")
    got = b""
    while not got.endswith(b"\n"):
        chunk = os.read(r, 16)
        if not chunk:  # the parent went away: finish the line as an uninterrupted run would
            return
        got += chunk


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
        _stop_mid_write(line)  # a kill here leaves a torn tail cut inside a character
        f.write(line[k:] + b"\n")
        f.flush()
        os.fsync(f.fileno())
    return n + 1


def kill_mid_write(
    cmd: list[str], out: Path, env: dict, ready: Callable[[bytes, dict], bool] = lambda data, rec: True,
    cwd: Path | None = None, timeout_s: float = 600,
) -> dict:  # fmt: skip
    """Run the slow-append CLI `cmd` and SIGKILL it at the first torn tail of `out` for which `ready(bytes of
    out, the record being written)` holds; asserts it died there, the file ending inside that record, and
    returns the record. Each torn tail is a handshake: the child waits until the parent has decided, so the
    outcome does not depend on timing."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    env = {**env, HANDSHAKE_ENV: f"{to_child_r},{from_child_w}"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, pass_fds=(to_child_r, from_child_w),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    os.close(to_child_r)
    os.close(from_child_w)
    deadline, killed, torn = time.monotonic() + timeout_s, None, 0
    try:
        with open(from_child_r, "rb", buffering=0) as notices:
            while killed is None and time.monotonic() < deadline:
                if not select.select([notices], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    break
                line = _read_line(notices)
                if not line:  # EOF: the child exited
                    break
                torn += 1
                rec = json.loads(line)
                if ready(out.read_bytes(), rec):
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = rec
                else:
                    os.write(to_child_w, GO)
    finally:
        os.close(to_child_w)
        if proc.poll() is None and killed is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert killed is not None, (
        f"the child exited (code {proc.returncode}) after {torn} torn tails, none for which `ready` held; "
        f"{out} ends {out.read_bytes()[-300:] if out.exists() else 'absent'!r}"
    )
    assert proc.returncode == -signal.SIGKILL and not out.read_bytes().endswith(b"\n"), "not killed mid-write"
    return killed


def _read_line(f) -> bytes:
    """One newline-terminated line from an unbuffered pipe (b"" at EOF)."""
    got = b""
    while not got.endswith(b"\n"):
        chunk = f.read(1)
        if not chunk:
            return b""
        got += chunk
    return got


if __name__ == "__main__":
    store.append_jsonl = slow_append
    raise SystemExit(infer.main(sys.argv[1:]))
