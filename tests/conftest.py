"""The suite under pytest-xdist (`make test` runs two workers, `--dist loadgroup`).

- Every test is put in one xdist group, so what its tests share is built once: a module's own tests stay together
  (module fixtures: a trained drafter, a vLLM server), and every test of the toy pipeline's session run (`ci_run`,
  tests/pipeline/conftest.py) is one group whichever file it is in.
- The long groups go first (the real-model slice, then the toy pipeline, then the server tests), so the two
  workers start on the two longest and the short ones fill in behind them (`--no-loadscope-reorder` keeps this
  order; xdist's own reorders by test count).
- Under xdist each server a test starts takes one core unpinned (`OMP_NUM_THREADS=1`,
  `VLLM_CPU_OMP_THREADS_BIND=nobind`, set before any server starts): two workers share two cores, and a server
  pinned to both, or spinning on both, would stall the other worker's process (docs/MACHINES.md).

Both ways, OpenMP waits passively in the test processes (`OMP_WAIT_POLICY=PASSIVE` unless set; the toy world's
2 training threads and 05's `threads_alone` assume it, as the pipeline's kernels do). Without xdist nothing else
here changes anything.
"""

from __future__ import annotations

import os

import pytest

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


def groups_of(items) -> dict[int, str]:
    """Each test's xdist group: `ci_run` for every test in a file where any test uses the toy pipeline's session
    run (outputs/ci), else its file."""
    file = {id(i): i.nodeid.split("::")[0] for i in items}
    shared = {file[id(i)] for i in items if "ci_run" in getattr(i, "fixturenames", ())}
    return {k: "ci_run" if f in shared else f for k, f in file.items()}


def _rank(group: str) -> int:
    return next((i for i, key in enumerate(FIRST) if group.startswith(key)), len(FIRST))


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook appends the group to each node id
def pytest_collection_modifyitems(config, items):
    if not _xdist(config):
        return
    groups = groups_of(items)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    items.sort(key=lambda item: _rank(groups[id(item)]))  # stable: file order within a rank
