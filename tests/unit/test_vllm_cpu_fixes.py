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
