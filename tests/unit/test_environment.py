"""environment.yml (conda) and pyproject.toml must list the same dependencies."""

import tomllib

import yaml

from eagle_lib.pipeline import REPO_ROOT


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    wanted = sorted(project["dependencies"] + project["optional-dependencies"]["dev"])
    env = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert sorted(x for x in pip if x != "-e .") == wanted
    assert "-e ." in pip
    assert any(str(d).startswith("python=3.11") for d in env["dependencies"])


def test_torch_pinned_to_cpu_build_release():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]
