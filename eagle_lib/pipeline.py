"""The one entry point: run the numbered stage notebooks in order with papermill.

    python -m eagle_lib.pipeline run PARAMS [--stages 01-06] [--run-name NAME] [--seed N] [--set KEY=VALUE] [--force]

Per run (outputs/<run>/): reports/NN_*.ipynb + .html (the executed notebooks are the report), manifest.json
(params, git commit, package versions, start/end/duration of each stage) and .stages/<stage>.json markers.
A stage is skipped when its marker holds the same fingerprint (its params, its notebook and the eagle_lib modules
it imports, its local input files and its upstream stages' fingerprints) and every output directory still has its meta.json.
The run stops at the first failing stage, naming the failed cell and the executed notebook to open.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from eagle_lib.console import ConsoleTail, ipc_kernel_manager, report_env
from eagle_lib.params import STAGES, ParamsError, RunParams, StageSpec, load_params
from eagle_lib.progress import CONSOLE_ENV
from eagle_lib.store import read_json, stable_hash, write_json

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "datasets",
    "papermill",
    "safetensors",
    "numpy",
    "pydantic",
)


class StageFailed(RuntimeError):
    """A stage notebook raised: the message names the stage, the cell and the executed notebook."""


def select_stages(spec: str | None, registry: dict[str, StageSpec]) -> list[str]:
    """'01-06', '03', '01,03', '03-', '03_infer,05_train_eagle3' -> stage names in order (by their two-digit
    prefix; a whole stage name stands for its prefix). Anything else is a ParamsError naming the part."""
    names = list(registry)
    if not spec:
        return names

    def number(end: str, part: str) -> int:
        if end in names:
            return int(end[:2])
        if end.isdigit():
            return int(end)
        raise ParamsError(
            f"--stages {spec!r}: {part!r} is not a stage number, range or name (e.g. 01-06, 03, 03-, "
            f"{names[0]}; known: {', '.join(names)})"
        )

    chosen: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = (part, "", "") if part in names else part.partition("-")
        lo_n = number(lo, part) if lo else 0
        hi_n = (number(hi, part) if hi else 99) if sep else lo_n
        chosen += [n for n in names if lo_n <= int(n[:2]) <= hi_n and n not in chosen]
    if not chosen:
        raise ParamsError(f"--stages {spec!r} selects no stage (known: {', '.join(names)})")
    return sorted(chosen, key=names.index)


def _imported_modules(source: str, package: str = "eagle_lib") -> set[str]:
    """`package.x` modules a piece of source imports (import a.b / from a import b / from a.b import c)."""
    found: set[str] = set()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _module_file(name: str, root: Path) -> Path | None:
    base = root.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def code_fingerprint(notebook: Path, root: Path = REPO_ROOT) -> str:
    """Hash of the notebook and of every eagle_lib module it imports, transitively.

    A change in a module a stage uses re-runs that stage; a change elsewhere in the library does not.
    """
    nb = json.loads(notebook.read_text())
    todo = set()
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            todo |= _imported_modules("".join(cell.get("source", "")))
    files: dict[str, str] = {}
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name, root)
        if path is None:
            continue  # an attribute imported from a module, not a module itself
        src = path.read_text()
        files[str(path.relative_to(root))] = src
        todo |= _imported_modules(src)
        parts = name.split(".")
        todo |= {".".join(parts[:i]) for i in range(1, len(parts))}  # parent packages run too
    return stable_hash([notebook.read_text(), sorted(files.items())])


def _local_inputs(obj: Any, found: dict[str, list[int]]) -> dict[str, list[int]]:
    """Size and mtime of every existing local file or directory a parameter names (data sources)."""
    if isinstance(obj, dict):
        for v in obj.values():
            _local_inputs(v, found)
    elif isinstance(obj, list):
        for v in obj:
            _local_inputs(v, found)
    elif isinstance(obj, str) and obj and len(obj) < 4096 and "://" not in obj:
        p = Path(obj)
        if p.is_file():
            st = p.stat()
            found[obj] = [st.st_size, st.st_mtime_ns]
    return found


@dataclass
class Runner:
    """Runs the selected stages of one params file; `registry` may be swapped for tests."""

    run: RunParams
    run_dir: Path
    force: bool = False
    registry: dict[str, StageSpec] = field(default_factory=lambda: dict(STAGES))
    root: Path = REPO_ROOT
    log: Any = print

    def __post_init__(self):
        self.reports = self.run_dir / "reports"
        self.markers = self.run_dir / ".stages"
        self.manifest_path = self.run_dir / "manifest.json"

    def fingerprint(self, name: str, params: dict) -> str:
        spec = self.registry[name]
        upstream = {}
        for dep in spec.deps:
            marker = self._marker(dep)
            upstream[dep] = marker.get("fingerprint") if marker else None
        code = code_fingerprint(self.root / spec.notebook, self.root)
        return stable_hash([params, code, _local_inputs(params, {}), upstream])

    def _marker(self, name: str) -> dict | None:
        path = self.markers / f"{name}.json"
        return read_json(path) if path.exists() else None

    def is_complete(self, name: str, fp: str) -> bool:
        marker = self._marker(name)
        if not marker or marker.get("status") != "complete" or marker.get("fingerprint") != fp:
            return False
        outputs = self.registry[name].outputs
        return all((self.run_dir / o / "meta.json").exists() for o in outputs)

    def available(self, names: list[str]) -> list[str]:
        """Stages whose notebook exists (the pipeline runs every stage that exists)."""
        return [n for n in names if (self.root / self.registry[n].notebook).exists()]

    def execute(self, names: list[str]) -> dict:
        """Run stages in order; returns the manifest. Raises StageFailed at the first failure."""
        manifest = self._new_manifest()
        for name in names:
            entry = self._run_stage(name)
            manifest["stages"][name] = entry
            manifest["finished"] = _now()
            write_json(self.manifest_path, manifest)
            if entry["status"] == "failed":
                raise StageFailed(entry["error"])
        return manifest

    def _run_stage(self, name: str) -> dict:
        spec = self.registry[name]
        params = self.run.notebook_parameters(name, str(self.run_dir), self.registry)
        fp = self.fingerprint(name, params)
        out_nb = self.reports / f"{name}.ipynb"
        entry: dict[str, Any] = {"fingerprint": fp, "report": str(out_nb), "params": params}
        if not self.force and self.is_complete(name, fp):
            self.log(f"[{name}] skipped: outputs complete, inputs and params unchanged")
            return {**self._marker(name), "status": "skipped"}
        (self.markers / f"{name}.json").unlink(missing_ok=True)
        self.log(f"[{name}] running {spec.notebook} -> {out_nb}")
        t0, entry["started"] = time.time(), _now()
        with ConsoleTail(self.markers / f"{name}.console", lambda line: self.log(f"[{name}] {line}")) as tail:
            error = self._papermill(spec, out_nb, params, {CONSOLE_ENV: str(tail.path)})  # progress lines
        entry.update(finished=_now(), seconds=round(time.time() - t0, 2))
        if error:
            entry.update(status="failed", error=f"stage {name} failed: {error}\n  open the report: {out_nb}")
            self.log(entry["error"])
            return entry
        entry["html"] = self._html(out_nb)
        entry["status"] = "complete"
        write_json(self.markers / f"{name}.json", entry)
        self.log(f"[{name}] done in {entry['seconds']:.1f}s")
        return entry

    def _papermill(self, spec: StageSpec, out_nb: Path, params: dict, env: dict | None = None) -> str | None:
        import papermill as pm

        self.reports.mkdir(parents=True, exist_ok=True)
        try:
            with report_env(env):
                pm.execute_notebook(
                    str(self.root / spec.notebook),
                    str(out_nb),
                    parameters=params,
                    cwd=str(self.root),
                    progress_bar=False,
                    log_output=False,
                    kernel_name="python3",
                    kernel_manager_class=ipc_kernel_manager(),
                )
        except pm.PapermillExecutionError as e:
            return f"cell {e.cell_index} (execution count {e.exec_count}) raised {e.ename}: {e.evalue}"
        return None

    def _html(self, nb_path: Path) -> str:
        import nbformat
        from nbconvert import HTMLExporter

        body, _ = HTMLExporter().from_notebook_node(nbformat.read(nb_path, as_version=4))
        html = nb_path.with_suffix(".html")
        html.write_text(body)
        return str(html)

    def _new_manifest(self) -> dict:
        old = read_json(self.manifest_path) if self.manifest_path.exists() else {}
        return {
            "run_dir": str(self.run_dir),
            "params_file": self.run.source_file,
            "params": self.run.model_dump(exclude={"source_file"}),
            "git": _git_state(self.root),
            "python": platform.python_version(),
            "packages": _versions(),
            "started": _now(),
            "stages": old.get("stages", {}),
        }


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _versions() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES + ("eagle-lib",):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _git_state(root: Path) -> dict:
    def git(*args):
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def unpinned_remote_code(shared) -> str:
    """Why the target's or tokenizer's hub code would run unpinned ('' when it would not)."""
    from eagle_lib import models

    try:
        models.hub_kwargs(shared)
        models.hub_kwargs(shared, tokenizer=True)
    except models.RemoteCodeError as e:
        return str(e)
    return ""


def prepare_target(target: str, log=print) -> None:
    """A GGUF target is converted here, once, before any stage (not inside the first report, nor by several
    stage processes at once); a GGUF that cannot become a target stops the run before any stage."""
    from eagle_lib.targets import gguf_target

    if not gguf_target.is_gguf(target):
        return
    try:
        path = gguf_target.resolve(target, log=log)
    except (gguf_target.GGUFTargetError, FileNotFoundError) as e:
        raise ParamsError(f"shared.target: {e}") from None
    log(f"target {target} -> {path}")


def run_pipeline(
    params_path: str | Path,
    stages: str | None = None,
    run_name: str | None = None,
    force: bool = False,
    registry: dict[str, StageSpec] | None = None,
    root: Path = REPO_ROOT,
    log=print,
    seed: int | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Validate the params file, then run the selected stages that have a notebook; returns the manifest.
    `seed` replaces shared.seed (the held-out split, 02's sample, 05's init and order) and, unless `run_name`
    is given, names the run ``<run_name>_s<seed>``. `overrides` (``KEY=VALUE``) replace values of the params file
    (the manifest's params are the values used)."""
    registry = registry or dict(STAGES)
    run = load_params(params_path, registry, overrides)
    if problem := unpinned_remote_code(run.shared):  # before any stage runs the hub's code
        raise ParamsError(f"{params_path}: {problem}")
    if seed is not None:
        run = run.model_copy(update={"shared": run.shared.model_copy(update={"seed": seed}),
                                     "run_name": run_name or f"{run.run_name}_s{seed}"})  # fmt: skip
    if run_name:
        run = run.model_copy(update={"run_name": run_name})
    if run.shared.target.startswith("toy://"):  # build an embedded world here, not inside the first report
        from eagle_lib.toy import uris

        uris.resolve(run.shared.target)
    prepare_target(run.shared.target, log)
    run_dir = root / run.run_dir
    runner = Runner(run, run_dir, force=force, registry=registry, root=root, log=log)
    names = runner.available(select_stages(stages, registry))
    missing = sorted(set(select_stages(stages, registry)) - set(names))
    if missing:
        log(f"not yet available (no notebook): {', '.join(missing)}")
    return runner.execute(names)


def budget_text(run: RunParams, target_config: str = "", run_dir: str = "") -> str:
    """The run's memory and time budget (`eagle_lib.drafter.budget`), or why it cannot be computed here; a
    run directory's measured counts and rates (`run_dir`, else the params' own outputs/<run_name> where it
    exists) replace the assumed ones."""
    from eagle_lib import models
    from eagle_lib.drafter import budget
    from eagle_lib.params import resolve_run_dir

    target = run.shared.target
    try:
        if target_config:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(target_config, trust_remote_code=run.shared.trust_remote_code)
        elif target.startswith("toy://"):
            from eagle_lib.toy import uris

            if not uris.built(target):
                return f"budget: {target} is not built yet (python -m eagle_lib.toy build): no config to size"
            cfg = models.load_config(models.resolve(target), **models.hub_kwargs(run.shared))
        else:
            cfg = models.load_config(target, **models.hub_kwargs(run.shared))
    except (OSError, ValueError) as e:
        return f"budget: the target's config is not readable here ({type(e).__name__}: {str(e)[:200]}); pass --target-config"
    measured = Path(run_dir) if run_dir else resolve_run_dir(run.run_dir)
    b = budget.estimate(run, cfg, run_dir=measured if measured.is_dir() else None)
    seen = (
        f"measured where {measured} has them" if measured.is_dir() else f"no run at {measured}: all assumed"
    )
    return f"budget (eagle_lib.drafter.budget; counts and rates from the params, {seen}):\n" + b.text()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle_lib.pipeline", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the stage notebooks of a params file")
    r.add_argument("params", help="params/<name>.yaml")
    r.add_argument("--stages", default=None, help="e.g. 01-06, 03, 01,03, 04- (default: all)")
    r.add_argument("--run-name", default=None, help="override run_name (outputs/<run-name>/)")
    r.add_argument(
        "--seed", type=int, default=None, help="override shared.seed (run name <run_name>_s<seed>)"
    )
    r.add_argument("--force", action="store_true", help="re-run stages even if complete and unchanged")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="replace a value of the params file, e.g. 05_train_eagle3.threads_alone=0 (repeatable)")  # fmt: skip
    v = sub.add_parser("validate", help="validate params files and exit")
    v.add_argument("params", nargs="+")
    v.add_argument("--budget", action="store_true", help="also print the run's memory and time budget")
    v.add_argument(
        "--target-config", default="", help="the target's config.json for the budget (else loaded)"
    )
    v.add_argument("--run-dir", default="", help="a run whose measured counts and rates the budget takes "
                   "(default: the params' outputs/<run_name>, where it exists)")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        if args.cmd == "validate":
            for p in args.params:
                run = load_params(p)
                problem = unpinned_remote_code(run.shared)
                print(f"{p}: ok" + (f" (warning: a run would refuse: {problem})" if problem else ""))
                if args.budget:  # loads torch (the drafter's shapes): only when asked
                    from eagle_lib.drafter import budget

                    misfits = budget.layout(run)[1]
                    if misfits:
                        c = run.cluster
                        raise ParamsError(f"{p}: the layout does not fit cluster {c.nodes} nodes x "
                                          f"{c.gpus_per_node} GPUs: " + "; ".join(misfits))  # fmt: skip
                    print(budget_text(run, args.target_config, args.run_dir))
            return 0
        manifest = run_pipeline(
            args.params, args.stages, args.run_name, args.force, seed=args.seed, overrides=args.overrides
        )
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StageFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"reports: {Path(manifest['run_dir']) / 'reports'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
