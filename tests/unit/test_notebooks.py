"""Conventions every stage notebook and params file must keep (CONVENTIONS.md 1-3, 7-9)."""

import json

import papermill as pm
import pytest

from eagle_lib.params import STAGES, SharedParams, load_params
from eagle_lib.pipeline import REPO_ROOT

PARAM_FILES = sorted((REPO_ROOT / "params").glob("*.yaml"))
NOTEBOOKS = [s for s in STAGES.values() if (REPO_ROOT / s.notebook).exists()]


def test_expected_params_files_exist():
    assert {p.name for p in PARAM_FILES} >= {"toy.yaml", "ci.yaml", "kimi_k25.yaml"}


@pytest.mark.parametrize("path", PARAM_FILES, ids=lambda p: p.name)
def test_every_params_file_validates(path):
    load_params(path)


@pytest.mark.parametrize("spec", NOTEBOOKS, ids=lambda s: s.name)
def test_params_cell_declares_every_key(spec):
    declared = set(pm.inspect_notebook(str(REPO_ROOT / spec.notebook)))
    model_keys = {"run_dir"} | set(SharedParams.model_fields) | set(spec.params_model().model_fields)
    assert declared == model_keys, f"{spec.notebook}: params cell and Params model differ"
    for path in PARAM_FILES:
        run = load_params(path)
        assert set(run.notebook_parameters(spec.name)) <= declared


@pytest.mark.parametrize("spec", NOTEBOOKS, ids=lambda s: s.name)
def test_notebook_shape(spec):
    nb = json.loads((REPO_ROOT / spec.notebook).read_text())
    cells = nb["cells"]
    assert cells[0]["cell_type"] == "markdown"
    text = "".join(cells[0]["source"]).lower()
    assert "python -m eagle_lib.pipeline" in text and "cpu" in text and "gpu" in text
    assert "parameters" in cells[2].get("metadata", {}).get("tags", [])
    assert f'validate_namespace("{spec.name}"' in "".join(cells[3]["source"])
    assert "report.record(" in "".join(cells[-1]["source"])
    for c in cells:
        src = "".join(c["source"])
        if c["cell_type"] == "code":
            assert not c.get("outputs") and c.get("execution_count") is None, "commit notebooks cleared"
            assert "\ndef " not in "\n" + src and "\nclass " not in "\n" + src, "logic belongs in eagle_lib"


@pytest.mark.parametrize("spec", NOTEBOOKS, ids=lambda s: s.name)
def test_parameter_defaults_match_params_model(spec):
    """Defaults in the notebook's params cell run the toy pipeline: they equal the Params model defaults."""
    declared = pm.inspect_notebook(str(REPO_ROOT / spec.notebook))
    defaults = {**SharedParams().model_dump(), **spec.params_model()().model_dump(mode="json")}
    for key, value in defaults.items():
        assert json.loads(json.dumps(eval(declared[key]["default"]))) == json.loads(json.dumps(value)), key


@pytest.mark.parametrize("spec", NOTEBOOKS, ids=lambda s: s.name)
def test_every_cell_has_a_unique_id(spec):
    """nbformat 4.5 cells carry ids; without them every run printed nbformat's MissingIDFieldWarning."""
    import warnings

    import nbformat

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # MissingIDFieldWarning, or any other validation warning, fails
        nb = nbformat.read(REPO_ROOT / spec.notebook, as_version=4)
        nbformat.validate(nb)
    ids = [c.get("id") for c in nb.cells]
    assert all(ids) and len(set(ids)) == len(ids), f"{spec.notebook}: cells without ids or with repeated ids"
