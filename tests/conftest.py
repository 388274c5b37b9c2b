"""The suite under pytest-xdist (`make test` runs two workers, `--dist loadfile`).

- A file's tests run in one worker, so its module fixtures (a trained drafter, a vLLM server) are built once. The
  toy pipeline's session run (`ci_run`, tests/pipeline/conftest.py) is shared by several files: the first worker to
  ask runs it under a file lock, the other waits and then finds every stage complete (the runner reuses them).
  (`--dist loadgroup` would group across files, but xdist 3.8 writes its group into `item._nodeid`, which pytest 9
  no longer reads.)
- The long files go first (RANKS below: the real-model slice, the toy pipeline's first file, the server tests),
  so the workers start on the longest and the short ones fill in behind them (`--no-loadscope-reorder` keeps
  this order; xdist's own sorts by test count). Three workers measured slower than two: llama.cpp's build, which
  `make test` runs at nice 19 behind the tests, then gets almost no CPU and the tests that need it wait longer.
- Under xdist each server a test starts takes one core unpinned (`OMP_NUM_THREADS=1`,
  `VLLM_CPU_OMP_THREADS_BIND=nobind`, set before any server starts): the workers share two cores, and a server
  pinned to both, or spinning on both, would stall the other workers' processes (docs/MACHINES.md). So does
  every other process of ours (`EAGLE_MAX_THREADS`, eagle_lib/threads.py: the cores over the workers, 1 on 2
  cores), whose own counts (05's threads_alone: 2, the toy world's 2 training threads) assume an idle machine.

Both ways, OpenMP waits passively in the test processes (`OMP_WAIT_POLICY=PASSIVE` unless set; the toy world's
2 training threads and 05's `threads_alone` assume it, as the pipeline's kernels do). Without xdist nothing else
here changes anything.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP, after this conftest
# the order the files start in: the real-model slice, the first file on the toy pipeline's run (it builds the toy
# world, or waits for `make test`'s background build of it, and the run), the server tests (llama.cpp's last: it waits for the build `make test` runs behind the tests),
# the other files on the toy pipeline's run (by then it is done: a worker taking one early would wait on its lock),
# the rest
RANKS = ("real", "ci_first", "server", "llamacpp", "ci_rest")
LLAMACPP = "tests/server/test_llamacpp.py"
REAL = "tests/pipeline/test_real_run.py"


def _xdist(config) -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or (
        config.pluginmanager.hasplugin("xdist") and (config.getoption("numprocesses", None) or 0) != 0
    )


def pytest_configure(config):
    if _xdist(config):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # every process of ours within its share of the cores (engines.machine.thread_cap): the stages' own
        # thread counts (05's threads_alone: 2, the toy world's 2 training threads) assume an idle machine
        n = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or config.getoption("numprocesses", None) or 1
        workers = int(n) if str(n).isdigit() else 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ.setdefault("EAGLE_MAX_THREADS", str(max(1, cores // max(1, workers))))


def order_keys(items) -> dict[int, int]:
    """Each test's place in RANKS (tests/conftest.py's docstring): by its file, where a file in which any test uses
    the toy pipeline's run (`ci_run`) is a ci file."""
    file = {id(i): i.nodeid.split("::")[0] for i in items}
    ci = [file[id(i)] for i in items if "ci_run" in getattr(i, "fixturenames", ())]

    def rank(f: str) -> str:
        if f == REAL:
            return "real"
        if ci and f == ci[0]:
            return "ci_first"
        if f == LLAMACPP:
            return "llamacpp"
        if f.startswith("tests/server/"):
            return "server"
        return "ci_rest" if f in ci else ""

    return {k: RANKS.index(r) if (r := rank(f)) else len(RANKS) for k, f in file.items()}


def pytest_collection_modifyitems(config, items):
    if _xdist(config):
        rank = order_keys(items)
        items.sort(key=lambda item: rank[id(item)])  # stable: file order within a rank
