"""The suite under pytest-xdist (`make test` runs two workers, `--dist loadfile`).

- A file's tests run in one worker, so its module fixtures (a trained drafter, a vLLM server) are built once. The
  toy pipeline's session run (`ci_run`, tests/pipeline/conftest.py) is shared by several files: the first worker to
  ask runs it under a file lock, the other waits and then finds every stage complete (the runner reuses them).
  (`--dist loadgroup` would group across files, but xdist 3.8 writes its group into `item._nodeid`, which pytest 9
  no longer reads.)
- The long files go first (the real-model slice, then the toy pipeline's files, then the server tests), so the two
  workers start on the two longest and the short ones fill in behind them (`--no-loadscope-reorder` keeps this
  order; xdist's own sorts by test count).
- Under xdist each server a test starts takes one core unpinned (`OMP_NUM_THREADS=1`,
  `VLLM_CPU_OMP_THREADS_BIND=nobind`, set before any server starts): two workers share two cores, and a server
  pinned to both, or spinning on both, would stall the other worker's process (docs/MACHINES.md).

Both ways, OpenMP waits passively in the test processes (`OMP_WAIT_POLICY=PASSIVE` unless set; the toy world's
2 training threads and 05's `threads_alone` assume it, as the pipeline's kernels do). Without xdist nothing else
here changes anything.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP, after this conftest
FIRST = ("tests/pipeline/test_real_run.py", "ci_run", "tests/server/")  # started first, in this order


def _xdist(config) -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or (
        config.pluginmanager.hasplugin("xdist") and (config.getoption("numprocesses", None) or 0) != 0
    )


def pytest_configure(config):
    if _xdist(config):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def order_keys(items) -> dict[int, int]:
    """Each test's rank in FIRST: its file, or `ci_run` for every file where a test uses the toy pipeline's run."""
    file = {id(i): i.nodeid.split("::")[0] for i in items}
    shared = {file[id(i)] for i in items if "ci_run" in getattr(i, "fixturenames", ())}
    group = {k: "ci_run" if f in shared else f for k, f in file.items()}
    return {
        k: next((r for r, key in enumerate(FIRST) if g.startswith(key)), len(FIRST)) for k, g in group.items()
    }


def pytest_collection_modifyitems(config, items):
    if _xdist(config):
        rank = order_keys(items)
        items.sort(key=lambda item: rank[id(item)])  # stable: file order within a rank
