"""eagle_lib.engines.machine: the line `make test` starts with (CPU model, ISA flags, vLLM's ops build)."""

import json
import subprocess

import pytest

from eagle_lib import threads
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

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    monkeypatch.delenv(threads.MAX_THREADS_ENV, raising=False)  # `make test` sets it (tests/conftest.py)
    assert machine.cpu_threads(requested, processes) == want


def test_the_thread_cap_bounds_every_count_we_ask_for(monkeypatch):
    """A machine shared by jobs that each think they are alone (the suite's two workers on 2 cores): a count a
    params file asks for (05's threads_alone: 2), the half-the-cores rule and a vLLM process's OpenMP threads all
    stay within $EAGLE_MAX_THREADS."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: set(range(8)))
    monkeypatch.delenv(threads.MAX_THREADS_ENV, raising=False)
    assert (machine.cpu_threads(2), machine.cpu_threads(), machine.cpu_threads(0, 2)) == (2, 4, 2)
    assert "OMP_NUM_THREADS" not in vllm_server.cpu_env(cpu_fixes=False)
    monkeypatch.setenv(threads.MAX_THREADS_ENV, "1")
    assert (machine.cpu_threads(2), machine.cpu_threads(), machine.capped(16)) == (1, 1, 1)
    assert vllm_server.cpu_env(cpu_fixes=False)["OMP_NUM_THREADS"] == "1"
    assert vllm_server.cpu_env(threads=4, cpu_fixes=False)["OMP_NUM_THREADS"] == "1"
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(threads.MAX_THREADS_ENV, bad)
        with pytest.raises(ValueError, match="EAGLE_MAX_THREADS"):
            machine.cpu_threads(2)


def test_a_training_step_alone_takes_its_threads_within_the_cap(monkeypatch):
    """05/07's `threads_alone` (2 on a 2-core host) beside another worker's job: torch gets the cap's 1 thread."""
    import types

    import torch

    from eagle_lib.drafter import trainer

    before = torch.get_num_threads()
    p = types.SimpleNamespace(threads_alone=2, num_threads=1)
    try:
        monkeypatch.setenv(threads.MAX_THREADS_ENV, "1")
        trainer.alone_threads(p, object())  # a source without producers: alone throughout
        assert torch.get_num_threads() == 1
        monkeypatch.delenv(threads.MAX_THREADS_ENV)
        trainer.alone_threads(p, object())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_server_with_unbound_openmp_runs_its_worker_in_the_engine_core():
    """vLLM's CPU platform forces its multiprocess executor unless VLLM_ENABLE_V1_MULTIPROCESSING is "0"; we set it
    where OpenMP is left unbound (nobind), keep a value the caller set, and leave vLLM's own binding alone."""
    assert (
        vllm_server.one_process({"VLLM_CPU_OMP_THREADS_BIND": "nobind"})[vllm_server.SINGLE_PROCESS_ENV]
        == "0"
    )
    kept = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", vllm_server.SINGLE_PROCESS_ENV: "1"}
    assert vllm_server.one_process(dict(kept)) == kept
    for bound in ({}, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}):
        assert vllm_server.SINGLE_PROCESS_ENV not in vllm_server.one_process(dict(bound))
