from pathlib import Path

import pytest

from eagle_lib.params import ParamsError, SharedParams, load_params, secret_from_env, validate_namespace
from tests.fixtures.fake_stage import REGISTRY


def write(tmp_path, text):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    return p


def test_valid_file_and_notebook_parameters(tmp_path):
    p = write(tmp_path, "run_name: r\nshared: {seed: 3}\nstages:\n  01_fake: {n: 5}\n")
    run = load_params(p, REGISTRY)
    assert run.run_dir == "outputs/r"
    nbp = run.notebook_parameters("01_fake", registry=REGISTRY)
    assert nbp["run_dir"] == "outputs/r" and nbp["seed"] == 3 and nbp["n"] == 5 and nbp["fail"] is False
    assert set(nbp) == {"run_dir", *SharedParams.model_fields, "n", "fail"}


@pytest.mark.parametrize(
    "text, key",
    [
        ("run_name: r\nshared: {sede: 3}\n", "shared.sede: unknown key"),
        ("run_name: r\nshared: {seed: '3'}\n", "shared.seed"),
        ("run_name: r\nstages:\n  01_fake: {n: x}\n", "stages.01_fake.n"),
        ("run_name: r\nstages:\n  01_fake: {m: 1}\n", "stages.01_fake.m: unknown key"),
        ("run_name: r\nstages:\n  09_nope: {}\n", "stages.09_nope: unknown stage"),
        ("shared: {}\n", "run_name"),
        ("run_name: r\nextra: 1\n", "extra: unknown key"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, key):
    p = write(tmp_path, text)
    with pytest.raises(ParamsError) as e:
        load_params(p, REGISTRY)
    assert str(p) in str(e.value) and key in str(e.value)


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(write(tmp_path, "run_name: [unclosed\n"), REGISTRY)
    with pytest.raises(ParamsError, match="no such params file"):
        load_params(tmp_path / "nope.yaml", REGISTRY)


def _namespace(**over):
    ns = {"run_dir": "outputs/x", **SharedParams().model_dump(), "n": 3, "fail": False}
    ns.update(over)
    return ns


def test_validate_namespace_accepts_declared_and_rejects_unknown_or_mistyped():
    before = {"params", "report"}
    cfg = validate_namespace("01_fake", _namespace(n=7), before, REGISTRY)
    root = Path(__file__).resolve().parents[2]  # relative run dirs are under the repository root, not the cwd
    assert cfg.stage.n == 7 and cfg.run_dir == root / "outputs/x" and cfg.out("a") == root / "outputs/x/a"
    assert validate_namespace("01_fake", _namespace(run_dir="/abs/run"), before, REGISTRY).run_dir == Path(
        "/abs/run"
    )
    with pytest.raises(ParamsError, match="unknown parameter.*bogus"):
        validate_namespace("01_fake", _namespace(bogus=1), before, REGISTRY)
    with pytest.raises(ParamsError, match=r"n: Input should be a valid integer"):
        validate_namespace("01_fake", _namespace(n="7"), before, REGISTRY)
    # names bound before the parameters cell (imports) are not parameters
    assert validate_namespace("01_fake", _namespace(params=1), before | {"params"}, REGISTRY)


def test_secrets_come_from_env(monkeypatch):
    monkeypatch.setenv("MY_KEY", "s3cret")
    assert secret_from_env("MY_KEY", "server") == "s3cret"
    assert secret_from_env("", "server") is None
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(ParamsError, match="MY_KEY"):
        secret_from_env("MY_KEY", "server")


def test_set_overrides_replace_values_and_bad_ones_are_named(tmp_path):
    """`pipeline run --set KEY=VALUE`: a stage key, a shared key and a top-level key are replaced (values read as
    YAML); an unknown key, a wrong type and a malformed override are errors naming what is wrong."""
    f = tmp_path / "p.yaml"
    f.write_text("run_name: a\nshared: {seed: 0}\nstages:\n  05_train_eagle3: {max_steps: 10}\n")
    run = load_params(f, overrides=["05_train_eagle3.max_steps=80", "shared.seed=3", "run_name=b",
                                    "05_train_eagle3.adam_betas=[0.8, 0.9]"])  # fmt: skip
    p05 = run.stage("05_train_eagle3")
    assert (p05.max_steps, run.shared.seed, run.run_name) == (80, 3, "b")
    assert list(p05.adam_betas) == [0.8, 0.9]
    assert load_params(f).stage("05_train_eagle3").max_steps == 10  # the file is untouched
    with pytest.raises(ParamsError, match=r"05_train_eagle3\.max_stepz.*unknown key"):
        load_params(f, overrides=["05_train_eagle3.max_stepz=1"])
    with pytest.raises(ParamsError, match=r"shared\.seed"):
        load_params(f, overrides=["shared.seed=many"])
    with pytest.raises(ParamsError, match="KEY=VALUE"):
        load_params(f, overrides=["05_train_eagle3.max_steps"])
