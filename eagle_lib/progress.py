"""Progress lines with the elapsed time and an estimated time left, for the stages that run longer than ~30 s
(05's steps, 07's arms, 03's prompts).

A `Progress` prints its lines on stdout: the cell's output when a notebook runs interactively, and the executed
report's. Papermill keeps a kernel's output off the terminal, so when the pipeline names a console file in the
environment (`CONSOLE_ENV`) each line is also appended there; the runner tails that file and prints the lines on
its own console, prefixed with the stage's name. Lines are rate-limited (`every_s`), never one per step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

CONSOLE_ENV = "EAGLE_PROGRESS_FILE"  # set by eagle_lib.pipeline for the kernel of each stage


def eta_seconds(elapsed: float, done: float, total: float) -> float | None:
    """Seconds left at the rate seen so far: `elapsed` seconds for `done` of `total` units (None before any
    unit is done)."""
    if done <= 0:
        return None
    return elapsed / done * max(total - done, 0)


def duration(seconds: float | None) -> str:
    """42s, 3m05s, 1h02m ('?' when unknown)."""
    if seconds is None:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def to_console(line: str) -> None:
    """Append `line` to the pipeline's console file, when the pipeline named one (else nothing)."""
    path = os.environ.get(CONSOLE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:  # one short append a line: whole across processes
            f.write(line.rstrip("\n") + "\n")


class Progress:
    """`what done/total unit, note, elapsed 1m02s, ETA 3m10s` lines; `update` prints one when the first unit is
    done, when the last is, and otherwise at most every `every_s` seconds. `start` units were done before this
    run (a resumed training): the rate counts only the units done since."""

    def __init__(self, what: str, total: int, unit: str = "", every_s: float = 15.0, start: int = 0,
                 clock: Callable[[], float] = time.monotonic, echo: bool = True):  # fmt: skip
        self.what, self.total, self.unit, self.every_s, self.start = what, total, unit, every_s, start
        self.clock, self.echo = clock, echo
        self.t0, self.last = clock(), None

    def line(self, done: int, note: str = "") -> str:
        elapsed = self.clock() - self.t0
        total = max(self.total, done)
        eta = eta_seconds(elapsed, done - self.start, total - self.start)
        unit = f" {self.unit}" if self.unit else ""
        note = f", {note}" if note else ""
        return f"{self.what} {done}/{total}{unit}{note}, elapsed {duration(elapsed)}, ETA {duration(eta)}"

    def due(self, done: int) -> bool:
        return self.last is None or done >= self.total or self.clock() - self.last >= self.every_s

    def update(self, done: int, note: str = "", force: bool = False) -> str | None:
        """Print the line for `done` units when due (or `force`); returns it, or None when not printed."""
        if not (force or self.due(done)):
            return None
        text = self.line(done, note)
        self.emit(text)
        return text

    def counter(self, note: Callable[[int], str] = lambda i: "") -> Callable[[int, object], None]:
        """A `forked.forked_map` ``done`` callback: each call is one more unit done, its line noted by note(item)."""
        done = [self.start]

        def one_more(i: int, _result: object) -> None:
            done[0] += 1
            self.update(done[0], note(i))

        return one_more

    def emit(self, text: str) -> None:
        """Print `text` (stdout) and hand it to the pipeline's console."""
        self.last = self.clock()
        if self.echo:
            print(text, flush=True)
        to_console(text)


class Bar:
    """tqdm's `update` / `set_postfix_str` / `close` over a `Progress` (03's prompt loop); `enabled=False`
    prints nothing."""

    def __init__(self, progress: Progress, enabled: bool = True):
        self.progress, self.enabled, self.n, self.note = progress, enabled, 0, ""

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled:
            self.progress.update(self.n, self.note)

    def set_postfix_str(self, s: str, refresh: bool = False) -> None:
        self.note = s

    def close(self) -> None:
        """The final count, unless its line was the last one printed."""
        if self.enabled and self.n and self.n < self.progress.total:
            self.progress.update(self.n, self.note + " (stopped)" if self.note else "stopped", force=True)
