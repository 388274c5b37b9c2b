"""The runner itself, on two tiny fake stage notebooks (tests/fixtures) so it does not wait for the stages."""

import json
import shutil
from pathlib import Path

import pytest

from eagle_lib.params import ParamsError
from eagle_lib.pipeline import REPO_ROOT, StageFailed, main, run_pipeline, select_stages
from eagle_lib.report import read_notebook_metrics
from tests.fixtures.fake_stage import REGISTRY

pytestmark = pytest.mark.slow  # starts Jupyter kernels


@pytest.fixture
def repo(tmp_path):
    """A copy of the parts of the repo the runner reads, so runs never touch the real outputs/."""
    root = tmp_path / "repo"
    for d in ("eagle_lib", "tests/fixtures"):
        shutil.copytree(REPO_ROOT / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests/__init__.py").touch()
    return root


def params(root, n=3, fail=False):
    p = root / "p.yaml"
    p.write_text(f"run_name: t\nstages:\n  01_fake: {{n: {n}}}\n  02_fake: {{fail: {str(fail).lower()}}}\n")
    return p


def runs(root, stage):
    return int((root / "outputs/t" / f"{stage}.runs").read_text())


def go(root, p, **kw):
    return run_pipeline(p, registry=REGISTRY, root=root, log=lambda *_: None, **kw)


def test_runs_reports_manifest_and_skips_unchanged(repo):
    p = params(repo)
    m = go(repo, p)
    run = repo / "outputs/t"
    for s in REGISTRY:
        assert (run / "reports" / f"{s}.ipynb").exists() and (run / "reports" / f"{s}.html").exists()
        assert m["stages"][s]["status"] == "complete" and m["stages"][s]["seconds"] > 0
    assert read_notebook_metrics(run / "reports/01_fake.ipynb") == {"n": 3}
    man = json.loads((run / "manifest.json").read_text())
    assert {"git", "packages", "params", "stages", "python"} <= set(man)
    assert man["packages"]["torch"].startswith("2.")
    # unchanged -> skipped; --force -> re-run
    m2 = go(repo, p)
    assert [m2["stages"][s]["status"] for s in REGISTRY] == ["skipped", "skipped"]
    assert runs(repo, "01_fake") == 1
    go(repo, p, force=True)
    assert runs(repo, "01_fake") == 2


def test_changed_params_rerun_stage_and_its_dependents(repo):
    go(repo, params(repo, n=3))
    go(repo, params(repo, n=4))  # 01 changed; 02 depends on 01 -> both re-run
    assert runs(repo, "01_fake") == 2 and runs(repo, "02_fake") == 2
    assert (repo / "outputs/t/01_fake/lines.txt").read_text().count("\n") == 4


def test_missing_outputs_rerun(repo):
    p = params(repo)
    go(repo, p)
    (repo / "outputs/t/02_fake/meta.json").unlink()
    go(repo, p)
    assert runs(repo, "01_fake") == 1 and runs(repo, "02_fake") == 2


def test_failure_stops_and_names_the_cell(repo):
    with pytest.raises(StageFailed) as e:
        go(repo, params(repo, fail=True))
    msg = str(e.value)
    assert "02_fake failed" in msg and "RuntimeError: asked to fail" in msg and "cell 5" in msg
    assert "reports/02_fake.ipynb" in msg
    man = json.loads((repo / "outputs/t/manifest.json").read_text())
    assert man["stages"]["02_fake"]["status"] == "failed"
    assert not (repo / "outputs/t/.stages/02_fake.json").exists()


def test_bad_params_fail_before_any_stage(repo):
    p = repo / "bad.yaml"
    p.write_text("run_name: t\nstages:\n  01_fake: {n: 1}\n  02_fake: {nn: 2}\n")
    with pytest.raises(ParamsError, match="stages.02_fake.nn: unknown key"):
        go(repo, p)
    assert not (repo / "outputs/t/reports").exists()


def test_stage_selection():
    names = list(REGISTRY)
    assert select_stages("01-02", REGISTRY) == names
    assert select_stages("02", REGISTRY) == ["02_fake"]
    assert select_stages("02-", REGISTRY) == ["02_fake"]
    assert select_stages(None, REGISTRY) == names
    with pytest.raises(ParamsError):
        select_stages("05", REGISTRY)


def test_stage_selection_by_name_and_a_clear_error_for_anything_else():
    # `make real STAGES=01_prepare_A,...` raised a bare ValueError (int('01_prepare_A')) before any stage ran
    assert select_stages("02_fake", REGISTRY) == ["02_fake"]
    assert select_stages("01_fake, 02_fake", REGISTRY) == list(REGISTRY)
    assert select_stages("01_fake-02_fake", REGISTRY) == list(REGISTRY)
    for bad in ("prepare", "01_nope", "1-x"):
        with pytest.raises(
            ParamsError, match=f"--stages '{bad}': '{bad}' is not a stage number, range or name"
        ):
            select_stages(bad, REGISTRY)


def test_cli_validate_reports_errors(tmp_path, capsys):
    bad = tmp_path / "x.yaml"
    bad.write_text("run_name: x\nshared: {seed: nope}\n")
    assert main(["validate", str(bad)]) == 2
    assert "shared.seed" in capsys.readouterr().err
    assert Path(REPO_ROOT / "params").is_dir()


def test_code_change_reruns_only_stages_that_import_it(repo):
    p = params(repo)
    go(repo, p)
    unused = repo / "eagle_lib/models.py"  # not imported by the fake stages' notebooks
    unused.write_text(unused.read_text() + "\n# unrelated edit\n")
    go(repo, p)
    assert runs(repo, "01_fake") == 1
    used = repo / "eagle_lib/store.py"  # imported through eagle_lib.report
    used.write_text(used.read_text() + "\n# edit\n")
    go(repo, p)
    assert runs(repo, "01_fake") == 2 and runs(repo, "02_fake") == 2


def test_a_toy_target_is_built_by_the_runner_before_any_report(repo, monkeypatch):
    """A fresh machine: the toy world must be built (its progress on stderr) by the runner, not inside 01's
    notebook, whose report then carried the build log as stderr (tests/pipeline/test_01_02.py caught it)."""
    from eagle_lib.toy import uris

    calls = []
    monkeypatch.setattr(uris, "resolve", lambda uri: calls.append(uri) or uri)
    p = repo / "p.yaml"
    p.write_text("run_name: t\nshared: {target: toy://target}\nstages:\n  01_fake: {n: 1}\n")
    go(repo, p, stages="1")
    assert calls == ["toy://target"]


def test_a_seed_override_names_the_run_and_reaches_every_stage(repo):
    """`pipeline run --seed N` (`make real SEED=N`): shared.seed = N in every stage, outputs/<run_name>_sN."""
    m = go(repo, params(repo), seed=2)
    assert Path(m["run_dir"]).name == "t_s2" and (repo / "outputs/t_s2/01_fake/lines.txt").exists()
    for s in REGISTRY:
        nb = json.loads((repo / "outputs/t_s2/reports" / f"{s}.ipynb").read_text())
        injected = next(c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", []))
        assert "seed = 2\n" in "".join(injected["source"])
    assert not (repo / "outputs/t").exists()


def test_a_set_override_reaches_the_stage_and_the_manifest(repo):
    """`pipeline run --set 01_fake.n=5` (`make real SET=...`): the stage runs with 5, the manifest records 5,
    and the params file keeps its 3."""
    p = params(repo)
    m = go(repo, p, overrides=["01_fake.n=5"])
    assert read_notebook_metrics(repo / "outputs/t/reports/01_fake.ipynb") == {"n": 5}
    assert m["params"]["stages"]["01_fake"]["n"] == 5
    assert "n: 3" in p.read_text()
