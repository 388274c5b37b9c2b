"""How many CPU threads a process of ours may take on a machine that other jobs share: the cores this process may
use, and a cap set from outside (``$EAGLE_MAX_THREADS``). Stdlib only, below every package (the toy worlds, the
engines, the stages all ask it); `eagle_lib.engines.machine.cpu_threads` is the stages' rule built on it."""

from __future__ import annotations

import os


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


MAX_THREADS_ENV = "EAGLE_MAX_THREADS"


def thread_cap() -> int:
    """The most CPU threads any one process of ours takes (torch in a stage, the toy worlds' training, a vLLM
    server or producer, llama.cpp): ``$EAGLE_MAX_THREADS`` when set to a positive integer; 0 (no cap) unset.
    For a machine shared by several jobs that each think they are alone: the suite's two pytest workers set it
    to 1 on 2 cores (tests/conftest.py), since a job that takes every core collapses beside another CPU-bound one
    (`eagle_lib.engines.machine.cpu_threads`, benchmarks/bench_threads.py)."""
    raw = os.environ.get(MAX_THREADS_ENV, "").strip()
    if raw:
        try:
            cap = int(raw)
        except ValueError:
            raise ValueError(f"${MAX_THREADS_ENV}={raw!r}: give a positive integer (or unset it)") from None
        if cap < 1:
            raise ValueError(f"${MAX_THREADS_ENV}={raw!r}: give a positive integer (or unset it)")
        return cap
    return 0


def capped(threads: int) -> int:
    """`threads` (a count asked for explicitly: a params value, a recipe's) within `thread_cap`, at least one."""
    cap = thread_cap()
    return max(1, min(threads, cap) if cap else threads)
