"""What `make run` shows on its console, on the two fake stages (tests/fixtures): the runner's lines and each
stage's progress lines, and no warning (ipykernel's "running over TCP without encryption", nbformat's
MissingIDFieldWarning, ...); the kernel's IPC sockets and the console files are gone afterwards."""

import glob
import shutil
import tempfile
import warnings

from eagle_lib.pipeline import REPO_ROOT, run_pipeline
from tests.fixtures.fake_stage import REGISTRY


def test_console_has_progress_and_no_warning(tmp_path, capfd, caplog):
    root = tmp_path / "repo"
    for d in ("eagle_lib", "tests/fixtures"):
        shutil.copytree(REPO_ROOT / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests/__init__.py").touch()
    p = root / "p.yaml"
    p.write_text("run_name: t\nstages:\n  01_fake: {n: 4}\n  02_fake: {n: 4}\n")
    sockets = f"{tempfile.gettempdir()}/eagle-k-*"
    before, log = set(glob.glob(sockets)), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a `python -m` run shows
        run_pipeline(p, registry=REGISTRY, root=root, log=log.append)
    out, err = capfd.readouterr()  # the kernels write to this process's stdout/stderr file descriptors
    console = "\n".join(log) + out + err
    assert "without encryption" not in console
    assert "warning" not in console.lower(), console
    shown = [f"{w.category.__name__}: {w.message}" for w in caught
             if not issubclass(w.category, DeprecationWarning | PendingDeprecationWarning)]  # fmt: skip
    assert not shown, shown
    logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelname in {"WARNING", "ERROR"}]
    assert not logged, logged  # e.g. papermill's "Passed unknown parameter" (logging's last resort: stderr)
    for stage in REGISTRY:
        lines = [x for x in log if x.startswith(f"[{stage}] line ")]
        assert [x.split(",")[0] for x in lines] == [f"[{stage}] line 1/4", f"[{stage}] line 4/4"], log
        assert "ETA" in lines[0]
    assert set(glob.glob(sockets)) == before  # the kernels' socket directories went with them
    assert not list((root / "outputs/t/.stages").glob("*.console"))
