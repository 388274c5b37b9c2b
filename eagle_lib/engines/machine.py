"""The machine a run lands on, in one line each: the CPU model, the x86 ISA flags vLLM's CPU build depends on,
and the build of vLLM's C++ ops that vLLM picks for this CPU. `make test` prints it first, so a red CI names
its machine (vLLM's AVX-512 build dies with SIGILL on an AVX2-only CPU).

    python -m eagle_lib.engines.machine
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

from eagle_lib.threads import capped, usable_cores

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # as /proc/cpuinfo spells them

# vLLM 0.32's rule (vllm/platforms/cpu.py, CpuPlatform.import_kernels) asked of the torch in vLLM's own venv.
_OPS_BUILD = """
import torch
from vllm.platforms import current_platform
if not current_platform.is_cpu():
    print(type(current_platform).__name__ + " (not the CPU platform)")
elif not torch.cpu._is_avx512_supported():
    print("vllm._C_AVX2")
else:
    print("vllm._C" if torch.cpu._is_avx512_bf16_supported() else "vllm._C_AVX512")
"""


def cpu_threads(requested: int = 0, processes: int = 1) -> int:
    """Torch CPU threads of one stage process: `requested` when > 0, else half the cores this process may use
    shared by its `processes` (torchrun ranks), at least one; either within `thread_cap`. The one rule for every
    CPU stage (03's embedded engine, 05, 06, 07): a torch job that takes every core collapses when anything else
    runs (measured by benchmarks/bench_threads.py on 2 cores: beside a CPU-bound job, 2 threads kept 1-11% of
    their idle speed, 1 thread 81%); half leaves the other half to whatever shares the machine."""
    if requested > 0:
        return capped(requested)
    return capped(usable_cores() // (2 * max(1, processes)))


def set_cpu_threads(requested: int = 0, processes: int = 1) -> int:
    """`cpu_threads` applied to torch in this process; returns the count."""
    import torch

    n = cpu_threads(requested, processes)
    torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def decoding_threads(requested: int = 0):
    """torch's threads set by `cpu_threads(requested)` (half the cores) while step-by-step decoding runs, then put
    back. Decoding is many small matmuls: the thread count a training step inside 05 or 07 takes alone (its
    `threads_alone`, 2 on a 2-core host) decodes slower than one thread (benchmarks/bench_threads.py, the toy
    target on an idle 2-core EPYC: 1,583 tokens/s with 1 thread, 655 with 2 passive, 190 with 2 spinning)."""
    import torch

    before, want = torch.get_num_threads(), cpu_threads(requested)
    if want != before:
        torch.set_num_threads(want)
    try:
        yield want
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def decoding_processes(owned: int, per_process: int, device="cpu") -> int:
    """How many forked processes decode side by side (`eagle_lib.forked.forked_map`) in a stage that holds `owned`
    torch threads while each decode takes `per_process` (`decoding_threads`): owned // per_process, at least one,
    within the cores this process may use and `thread_cap`. 07's arms and 05's measured tau decode between training
    steps that hold `threads_alone` (2 on a 2-core host), so two one-thread decodes run there at once, each as fast as
    one alone; a stage on `cpu_threads`' half of the machine (06, a run beside another) keeps one process. Always
    one for models on a GPU (`device`): CUDA cannot run in a child forked after it started."""
    import torch

    if torch.device(device).type != "cpu":
        return 1
    return max(1, min(owned, usable_cores(), capped(owned)) // max(1, per_process))


def cpu_model_and_flags(cpuinfo: str) -> tuple[str, dict[str, bool]]:
    """The first processor's model name and which of ISA_FLAGS it has, from /proc/cpuinfo text."""
    model, flags = "unknown", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, {f: f in flags for f in ISA_FLAGS}


def native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 natively (avx512_bf16 or AMX); without it, torch emulates bf16 matmuls,
    measured ~36x slower than fp32 on an AVX2-only EPYC (1024x384 @ 384x1024: 673 ms vs 18.6 ms, 1 thread)."""
    try:
        _, flags = cpu_model_and_flags(Path(cpuinfo_path).read_text())
    except OSError:
        return True  # not Linux: no claim
    return flags["avx512_bf16"] or flags["amx_bf16"]


def vllm_ops_build(python: Path) -> str:
    """Which build of vLLM's ops vLLM loads on this CPU, asked in a subprocess of the vLLM venv's `python`."""
    if not python.exists():
        return f"no vLLM interpreter at {python}"
    try:
        out = subprocess.run([str(python), "-c", _OPS_BUILD], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "unknown (vLLM did not answer in 120 s)"
    lines = out.stdout.strip().splitlines()
    return lines[-1] if out.returncode == 0 and lines else f"unknown (exit {out.returncode})"


# What can still move a run's numbers when everything run_record stores matches (each stage adds its own).
SAME_BITS = (
    "a rerun repeats the same bits when everything recorded here matches: the seed, torch's thread counts (oneDNN "
    "and MKL split reductions by thread), the CPU model and ISA (they pick the kernels), the torch build, the "
    "device, the world size and the same inputs"
)
ON_CUDA = (
    "CUDA: torch.use_deterministic_algorithms is off (atomic adds in backward kernels), so reruns on a GPU agree "
    "to rounding, not bit for bit, and the difference grows over steps"
)


def run_record(seed: int, device: str, world_size: int = 1, cpuinfo_path: str = "/proc/cpuinfo") -> dict:
    """What this process's numbers are a function of beside its inputs and params: the seed, torch's threads,
    the CPU and its ISA flags, the library builds, the device and the world size (for a stage's meta.json)."""
    import numpy
    import torch

    try:
        model, flags = cpu_model_and_flags(Path(cpuinfo_path).read_text())
    except OSError:
        model, flags = "unknown", {}
    return {
        "seed": seed,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu": model,
        "isa": sorted(f for f, v in flags.items() if v),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "device": str(device),
        "world_size": world_size,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def describe(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    from eagle_lib.engines.vllm_server import vllm_python

    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:
        text = ""
    model, flags = cpu_model_and_flags(text)
    isa = " ".join(f"{f}={'yes' if v else 'no'}" for f, v in flags.items())
    return f"machine: {model}; {isa}; vLLM ops build: {vllm_ops_build(vllm_python())}"


if __name__ == "__main__":
    print(describe())
