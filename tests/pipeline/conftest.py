"""Session fixture: run the whole pipeline once on params/ci.yaml; stage tests read its outputs."""

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
    """outputs/ci after every stage ran (unchanged complete stages are reused, as `make run` would)."""
    manifest = run_pipeline(CI_PARAMS)
    return Path(manifest["run_dir"])
