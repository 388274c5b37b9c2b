"""Typed, validated parameters: one YAML file per run, one notebook per stage.

A params file has three top-level keys::

    run_name: toy                 # outputs go to outputs/<run_name>/
    shared:  {...}                # SharedParams: passed to every notebook
    stages:                       # one section per stage notebook, validated by that stage's Params model
      01_prepare_A: {...}

Every notebook's parameters cell declares `run_dir`, every SharedParams field and its stage's fields as typed
literals whose defaults run the toy pipeline. The runner validates the whole file before any stage runs; the
cell after the parameters cell validates again (papermill only warns on unknown parameters).
Secrets never live here: a params field may only name the environment variable that holds one.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class ParamsError(ValueError):
    """Invalid parameters: the message names the file (or notebook) and the key."""


class Strict(BaseModel):
    """Base for every params model: unknown keys and wrong types are errors (no silent coercion)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SharedParams(Strict):
    """Parameters every stage sees."""

    target: str = (
        "toy://target"  # HF model dir or hub id of the target (toy://target: the embedded toy model)
    )
    tokenizer: str = ""  # tokenizer dir or hub id (empty: the target's own)
    trust_remote_code: bool = False  # needed for Kimi-K2.5's tokenizer and model code
    revision: str = ""  # hub commit (40 hex) of the target; with trust_remote_code a hub target must have one
    tokenizer_revision: str = ""  # hub commit of a separate `tokenizer` repo (empty: `revision`)
    allow_unpinned_remote_code: bool = (
        False  # run a hub repo's code from its moving branch head (not advised)
    )
    seed: int = 0  # global seed for sampling, splits and training
    num_workers: int = 0  # worker processes for CPU-bound stages (0: all cores)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    heldout_percent: float = 5.0  # share of sample ids (by hash) held out of training for evaluation
    max_new_tokens: int = (
        512  # the target's generation budget: 03 generates up to it, 02 and 04 check against it
    )
    # how the drafter will be served: 05 trains one loss term per temperature (drafter/served.py), 06 measures
    # at them (its own temperatures / top_p override); empty = greedy verification only
    serve_temperatures: list[float] = []
    serve_top_p: float = 1.0  # the target's nucleus at T > 0 (Kimi-K2.5 thinking mode: 0.95); 1.0 = none

    @model_validator(mode="after")
    def _serving(self):
        t = self.serve_temperatures
        if any(x < 0 for x in t) or len(set(t)) != len(t) or not 0 < self.serve_top_p <= 1:
            raise ValueError(
                f"serve_temperatures must be distinct and >= 0, 0 < serve_top_p <= 1 (got {t}, {self.serve_top_p})"
            )
        return self

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.target


@dataclass(frozen=True)
class StageSpec:
    """What the runner knows about a stage: its notebook, params model, outputs and upstream stages."""

    name: str
    module: str  # module whose `Params` class validates the stage section ("prepare" = eagle_lib.prepare)
    outputs: tuple[str, ...]  # directories under run_dir the stage writes (each gets a meta.json)
    deps: tuple[str, ...] = ()
    notebook_dir: str = "notebooks"

    @property
    def notebook(self) -> str:
        return f"{self.notebook_dir}/{self.name}.ipynb"

    def params_model(self) -> type[Strict]:
        mod = self.module if "." in self.module else f"eagle_lib.{self.module}"
        try:
            return importlib.import_module(mod).Params
        except (ImportError, AttributeError) as e:
            raise ParamsError(f"stage {self.name}: cannot load its params model from {mod} ({e})") from None


STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in [
        StageSpec("01_prepare_A", "prepare", ("data/A",)),
        StageSpec("02_extract_B", "extract", ("data/B",)),
        StageSpec("03_infer", "infer", ("infer",), ("02_extract_B",)),
        StageSpec("04_length_analysis", "lengths", ("analysis",), ("01_prepare_A", "03_infer")),
        StageSpec("05_train_eagle3", "train", ("drafter",), ("01_prepare_A", "03_infer")),
        StageSpec(
            "06_eval_acceptance", "acceptance", ("eval",), ("01_prepare_A", "02_extract_B", "05_train_eagle3")
        ),
        StageSpec(
            "07_data_value",
            "value",
            ("value",),
            ("01_prepare_A", "02_extract_B", "03_infer", "05_train_eagle3"),
        ),
    ]
}


class ClusterParams(Strict):
    """The cluster a run gets (`validate --budget` refuses a layout that does not fit it; 0: unstated)."""

    nodes: int = 0  # nodes of the cluster
    gpus_per_node: int = 0  # GPUs on each node (torchrun's nproc_per_node and a producer's TP must fit in it)


class BudgetParams(Strict):
    """What `validate --budget` (`eagle_lib.drafter.budget`) assumes where neither the params' limits nor a run's
    measurements say: dataset sizes, mean lengths, throughput rates. Printed as assumptions beside the estimate."""

    dataset_sizes: dict[
        str, int
    ] = {}  # dataset name -> prompts (B) / records (A) it holds (where no cap bounds it)
    prompt_tokens: int = 0  # mean prompt (history) tokens of one trained sequence; 0: none counted
    output_tokens: int = 0  # mean generated tokens of one answer; 0: max_new_tokens (the upper bound)
    turns: float = 1.0  # mean answered turns of a conversation (each_turn B sets, turns: each A sets)
    decode_tokens_per_s: float = 0.0  # one serving node's output tokens/s (03, 06); 0: the budget's default
    prefill_tokens_per_s: float = (
        0.0  # one vLLM producer's prefill tokens/s (05, 07); 0: the budget's default
    )
    train_tokens_per_s: float = (
        0.0  # one trainer GPU's tokens/s through the TTT unroll; 0: the budget's default
    )

    @model_validator(mode="after")
    def _positive(self):
        bad = {k: v for k, v in self.dataset_sizes.items() if v < 0}
        if bad or self.turns < 1 or min(self.prompt_tokens, self.output_tokens) < 0:
            raise ValueError(
                f"budget: sizes and token counts must be >= 0 and turns >= 1 (got {bad or self.turns})"
            )
        return self


class RunParams(Strict):
    """A whole params file."""

    run_name: str
    shared: SharedParams = SharedParams()
    cluster: ClusterParams = (
        ClusterParams()
    )  # nodes x GPUs the run gets (validate --budget checks the layout)
    budget: BudgetParams = BudgetParams()  # validate --budget's assumed sizes and rates
    stages: dict[str, dict[str, Any]] = {}
    source_file: str = ""

    @property
    def run_dir(self) -> str:
        return f"outputs/{self.run_name}"

    def stage(self, name: str, registry: dict[str, StageSpec] | None = None) -> Strict:
        """The validated params model of one stage (defaults where the file is silent)."""
        spec = (registry or STAGES)[name]
        return _validate(spec.params_model(), self.stages.get(name, {}), self.source_file, f"stages.{name}")

    def notebook_parameters(
        self, name: str, run_dir: str | None = None, registry: dict[str, StageSpec] | None = None
    ) -> dict[str, Any]:
        """The flat dict papermill injects into the stage's notebook."""
        out: dict[str, Any] = {"run_dir": run_dir or self.run_dir}
        out.update(self.shared.model_dump())
        out.update(self.stage(name, registry).model_dump(mode="json"))
        return out


def _fmt_errors(err: ValidationError, where: str, prefix: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(e["loc"]))
        got = "" if e["type"] == "missing" else f" (got {e.get('input')!r:.80})"
        reason = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{where}: {key}: {reason}{got}")
    return "\n".join(lines)


def _validate(model: type[Strict], data: Any, where: str, prefix: str = "") -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ParamsError(_fmt_errors(err, where, prefix)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``KEY=VALUE`` of ``pipeline run --set``: (the dotted key's parts, the value read as YAML)."""
    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ParamsError(
            f"--set {text!r}: expected KEY=VALUE, e.g. 05_train_eagle3.max_steps=80 or shared.seed=1"
        )
    try:
        return parts, yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ParamsError(f"--set {text!r}: the value is not valid YAML: {e}") from None


def _apply_overrides(raw: dict, overrides: list[str], path: Path, registry) -> None:
    """Each ``KEY=VALUE`` into the raw params: ``<stage>.<key>`` (under stages:), ``shared.<key>`` or a top-level
    key; validation then names any key or value the params do not take."""
    for text in overrides:
        parts, value = parse_override(text)
        node = raw["stages"].setdefault(parts[0], {}) if parts[0] in registry else raw
        keys = parts[1:] if parts[0] in registry else parts
        if not keys:
            raise ParamsError(f"--set {text!r}: name a key inside stage {parts[0]} (e.g. {parts[0]}.seed=1)")
        for k in keys[:-1]:
            if not isinstance(node.get(k, {}), dict):
                raise ParamsError(f"{path}: --set {text!r}: {k} is not a mapping")
            node = node.setdefault(k, {})
        node[keys[-1]] = value


def load_params(
    path: str | Path, registry: dict[str, StageSpec] | None = None, overrides: list[str] | None = None
) -> RunParams:
    """Load and fully validate a params file (every stage section), before anything runs; `overrides`
    (``KEY=VALUE``, `pipeline run --set`) replace values of the file first."""
    registry = registry or STAGES
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: no such params file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping")
    raw = dict(raw, source_file=str(path))
    stages = raw.get("stages") or {}
    if not isinstance(stages, dict):
        raise ParamsError(f"{path}: stages: must be a mapping of stage name -> section")
    for name, section in stages.items():
        if name not in registry:
            raise ParamsError(f"{path}: stages.{name}: unknown stage (known: {', '.join(registry)})")
        if not isinstance(section, dict):
            raise ParamsError(f"{path}: stages.{name}: must be a mapping")
    raw["stages"] = stages
    _apply_overrides(raw, list(overrides or []), path, registry)
    run = _validate(RunParams, raw, str(path) + (f" (with --set {' '.join(overrides)})" if overrides else ""))
    for name in stages:
        run.stage(name, registry)
    return run


@dataclass(frozen=True)
class StageConfig:
    """What a notebook's validation cell returns: the run directory and the typed params."""

    name: str
    run_dir: Path
    shared: SharedParams
    stage: Any

    def out(self, *parts: str) -> Path:
        return self.run_dir.joinpath(*parts)


_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


def validate_namespace(
    stage: str, namespace: dict[str, Any], before: set[str], registry: dict[str, StageSpec] | None = None
) -> StageConfig:
    """Validate a notebook's parameters: every name bound after `before` was taken must be a known key.

    Called in the cell after the parameters cell (and papermill's injected cell): an unknown or wrongly
    typed parameter raises ParamsError naming the key and the notebook.
    """
    spec = (registry or STAGES)[stage]
    names = {
        k
        for k in namespace
        if k not in before
        and not k.startswith("_")
        and k not in _IPYTHON_NAMES
        and not hasattr(namespace[k], "__file__")  # modules imported after `before`
    }
    shared_keys = set(SharedParams.model_fields)
    model = spec.params_model()
    known = {"run_dir"} | shared_keys | set(model.model_fields)
    where = f"{spec.notebook} parameters"
    unknown = sorted(names - known)
    if unknown:
        raise ParamsError(f"{where}: unknown parameter(s): {', '.join(unknown)}")
    run_dir = namespace.get("run_dir")
    if not isinstance(run_dir, str):
        raise ParamsError(f"{where}: run_dir: must be a string (got {run_dir!r})")
    shared = _validate(SharedParams, {k: namespace[k] for k in shared_keys if k in names}, where)
    params = _validate(model, {k: namespace[k] for k in model.model_fields if k in names}, where)
    return StageConfig(stage, resolve_run_dir(run_dir), shared, params)


REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_run_dir(run_dir: str) -> Path:
    """A relative run_dir is under the repository root (or $EAGLE_REPO_ROOT), never the working directory:
    a notebook opened from notebooks/ in JupyterLab finds outputs/toy as the pipeline does."""
    path = Path(run_dir).expanduser()
    if path.is_absolute():
        return path
    return Path(os.environ.get("EAGLE_REPO_ROOT") or REPO_ROOT) / path


def secret_from_env(var: str, purpose: str) -> str | None:
    """Read a secret (API key) named by a params field from the environment; None if the name is empty."""
    if not var:
        return None
    val = os.environ.get(var)
    if val is None:
        raise ParamsError(f"environment variable {var} (for {purpose}) is not set")
    return val
