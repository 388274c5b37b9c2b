"""Session fixture: run the whole pipeline once on params/ci.yaml; stage tests read its outputs."""

import fcntl
from pathlib import Path

import pytest

from eagle_lib.pipeline import REPO_ROOT, run_pipeline

CI_PARAMS = REPO_ROOT / "params" / "ci.yaml"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/pipeline" in str(item.fspath):
            item.add_marker(pytest.mark.pipeline)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ci_run() -> Path:
    """outputs/ci after every stage ran (unchanged complete stages are reused, as `make run` would). Under
    pytest-xdist both workers may ask: the first runs it holding an exclusive lock, the second then waits and finds
    every stage complete (tests/conftest.py)."""
    lock = REPO_ROOT / "outputs" / ".ci_run.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released by the kernel if this worker dies
        try:
            manifest = run_pipeline(CI_PARAMS)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    return Path(manifest["run_dir"])
