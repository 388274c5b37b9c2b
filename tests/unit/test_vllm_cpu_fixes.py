"""The vLLM CPU fix plugin (eagle_lib.engines.vllm_cpu_fixes), checked without vLLM: the replacement expand against
a per-element loop, the probe against a stand-in with vLLM 0.32's defect, and the plugin's discoverability.
The server-side effect (T=1 acceptance at every draft position) is tests/server/test_vllm_spec.py."""

import importlib.metadata as md
from pathlib import Path

import pytest
import torch

from eagle_lib.engines import vllm_cpu_fixes, vllm_server


def loop_expand(values: list, counts: list[int], replace_from, replace_to) -> list:
    out = []
    for v, n in zip(values, counts, strict=True):
        out += [replace_to if v == replace_from else v] * n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_writes_the_callers_buffer_in_its_dtype(dtype):
    values, counts = [0.7, -1, 3, 0.25], [3, 1, 0, 2]
    x = torch.tensor(values).to(dtype)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = torch.full((sum(counts),), 99).to(dtype)
    vllm_cpu_fixes.expand_at_dtype(out, x, cu, -1, 1)
    assert out.dtype == dtype
    assert out.tolist() == pytest.approx(loop_expand(x.tolist(), counts, -1, 1))


def int64_only_standin(output, input_val, cu_num_tokens, replace_from, replace_to):
    """The defect of vLLM 0.32's CPU stand-in: it fills an int64 copy of `output` (and of a float input)."""
    o, i = output.to(torch.int64), input_val.to(torch.int64)
    vllm_cpu_fixes.expand_at_dtype(o, i, cu_num_tokens, replace_from, replace_to)
    if output.dtype == torch.int64:
        output.copy_(o)


def test_probe_tells_the_broken_standin_from_the_fix():
    assert vllm_cpu_fixes.shim_is_broken(int64_only_standin)
    assert not vllm_cpu_fixes.shim_is_broken(vllm_cpu_fixes.expand_at_dtype)


def test_plugin_is_an_entry_point_on_the_servers_path():
    env = vllm_server.cpu_env()
    paths = env["PYTHONPATH"].split(":")
    plugin_dir = Path(vllm_cpu_fixes.__file__).parent / vllm_cpu_fixes.PLUGIN_DIR_NAME
    assert str(plugin_dir) in paths and str(vllm_server.REPO_ROOT) in paths
    eps = [e for d in md.distributions(path=[str(plugin_dir)]) for e in d.entry_points]
    assert [(e.group, e.value) for e in eps] == [
        ("vllm.general_plugins", "eagle_lib.engines.vllm_cpu_fixes:register")
    ]
    assert eps[0].load() is vllm_cpu_fixes.register
    assert "PYTHONPATH" not in vllm_server.cpu_env(cpu_fixes=False)


# The plugin on a CPU without AVX-512, forced: vLLM's own capability checks report no AVX-512 (as on an AVX2-only
# AMD EPYC), and a meta-path finder records every import of vLLM's op builds and refuses `vllm._C` (the AVX-512
# BF16 build: on an AVX2-only CPU importing it is SIGILL, so it must never be asked for). Then `register` runs as
# vLLM's plugin loader runs it. Fails on code that imports vllm._C itself, on any CPU.
FORCED_AVX2 = r"""
import json, sys
import torch
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
asked = []
class Recorder:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("vllm._C"):
            asked.append(name)
            if name == "vllm._C":
                raise ImportError("refused by the test: the AVX-512 BF16 build on a forced AVX2-only CPU")
        return None
sys.meta_path.insert(0, Recorder())
from eagle_lib.engines import vllm_cpu_fixes
from vllm.utils import cpu_triton_utils as cpu
vllm_cpu_fixes.register()
print(json.dumps({"asked": asked, "installed": cpu._expand_kernel_impl is vllm_cpu_fixes.expand_at_dtype}))
"""


@pytest.mark.slow
def test_plugin_registers_on_a_forced_avx2_cpu_without_touching_vllm_C():
    import json
    import subprocess

    py = vllm_server.vllm_python()
    if not py.exists():
        pytest.fail(f"no vLLM interpreter at {py}: run scripts/install_vllm_cpu.sh")
    env = {**vllm_server.cpu_env(), "VLLM_LOGGING_LEVEL": "ERROR"}
    out = subprocess.run([str(py), "-c", FORCED_AVX2], env=env, capture_output=True, text=True, timeout=300,
                         cwd=vllm_server.REPO_ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "vllm._C" not in got["asked"], got  # the plugin asked for the AVX-512 BF16 build itself
    assert "vllm._C_AVX2" in got["asked"], got  # the ops came through vLLM's own choice for this CPU
    assert got["installed"] is True  # and the fix was installed (vLLM 0.32's stand-in is broken)


def _imports_vllm_C(path: Path) -> list[str]:
    """The places in a Python file that import one of vLLM's C++ op builds (vllm._C, _C_AVX2, _C_AVX512)."""
    import ast

    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__"
        ):  # fmt: skip
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        hits += [f"{path}:{node.lineno} {n}" for n in names if n == "vllm._C" or n.startswith("vllm._C")]
    return hits


def test_no_module_of_ours_imports_a_vllm_ops_build():
    root = vllm_server.REPO_ROOT
    files = [p for d in ("eagle_lib", "tests", "benchmarks", "scripts") for p in (root / d).rglob("*.py")]
    assert len(files) > 100
    assert [h for p in files for h in _imports_vllm_C(p)] == []


def test_the_import_guard_sees_each_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import vllm._C\nfrom vllm import _C_AVX2\nimport importlib\nimportlib.import_module('vllm._C')\n"
    )
    assert [h.split()[-1] for h in _imports_vllm_C(f)] == ["vllm._C", "vllm._C_AVX2", "vllm._C"]
