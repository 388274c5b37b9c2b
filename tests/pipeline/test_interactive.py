"""Interactive use, as JupyterLab runs a notebook: working directory notebooks/, defaults from the parameters
cell, and a relative run_dir that must resolve against the repository root (never the cwd)."""

import json

import nbformat
import papermill as pm
import pytest
from nbclient import NotebookClient

from eagle_lib.console import report_env
from eagle_lib.params import STAGES
from eagle_lib.pipeline import REPO_ROOT

NOTEBOOKS = [s for s in STAGES.values() if (REPO_ROOT / s.notebook).exists()]


@pytest.mark.parametrize("spec", NOTEBOOKS, ids=lambda s: s.name)
def test_notebook_opened_from_notebooks_dir_resolves_its_run(spec, ci_run, tmp_path):
    """Imports, parameters (run_dir edited to the ci run, as a researcher would) and the validation cell run
    from notebooks/; the validated run_dir is the repository's outputs/ci and its upstream outputs are found."""
    nb = nbformat.read(REPO_ROOT / spec.notebook, as_version=4)
    head = nb.cells[:4]
    params_src = head[2].source
    assert 'run_dir = "outputs/toy"' in params_src, "default run_dir: the last toy run"
    head[2].source = params_src.replace('run_dir = "outputs/toy"', 'run_dir = "outputs/ci"')
    deps = [o for d in spec.deps for o in STAGES[d].outputs]
    head.append(
        nbformat.v4.new_code_cell(
            "import json, pathlib\n"
            f"assert cfg.run_dir == pathlib.Path({str(REPO_ROOT)!r}) / 'outputs/ci', cfg.run_dir\n"
            f"missing = [d for d in {deps!r} if not (cfg.run_dir / d / 'meta.json').exists()]\n"
            "assert not missing, missing\n"
        )
    )
    nb.cells = head
    with report_env():
        NotebookClient(
            nb,
            timeout=300,
            kernel_name="python3",
            resources={"metadata": {"path": str(REPO_ROOT / "notebooks")}},
        ).execute()


def test_04_runs_whole_from_notebooks_dir(ci_run, tmp_path):
    """A read-only stage end to end from notebooks/ with a relative run_dir: same headline as the pipeline's."""
    out = tmp_path / "04.ipynb"
    before = json.loads((ci_run / "metrics" / "04_length_analysis.json").read_text())
    with report_env():
        pm.execute_notebook(
            str(REPO_ROOT / "notebooks/04_length_analysis.ipynb"),
            str(out),
            parameters={
                "run_dir": "outputs/ci",
                "infer_limit": 12,
                "bootstrap_reps": 500,
                "max_new_tokens": 64,
            },
            cwd=str(REPO_ROOT / "notebooks"),
            progress_bar=False,
            kernel_name="python3",
        )
    after = json.loads((ci_run / "metrics" / "04_length_analysis.json").read_text())
    assert {k: v for k, v in after.items() if "second" not in k} == {
        k: v for k, v in before.items() if "second" not in k
    }
