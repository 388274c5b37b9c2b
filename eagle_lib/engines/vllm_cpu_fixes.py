"""A fix for vLLM's CPU backend, loaded into vLLM's own processes as a general plugin.

vLLM 0.32's CPU stand-in for the Triton ``expand_kernel`` (``vllm.utils.cpu_triton_utils._expand_kernel_impl``)
casts its output buffer to int64, so for the float32 temperature / top_p and int32 top_k it fills a temporary and
leaves the caller's ``new_empty`` buffer unwritten (vllm-project/vllm#55005, open; fix proposed in #55006). Every
non-greedy speculative step then rejects drafts against logits divided by uninitialised memory: measured here on
the tiny target at T=1, vLLM accepted 0 second or third drafts in ~200 steps where the offline decoder accepts
4% / 1.5%, and top_k > 0 crashed the engine (HTTP 500). Greedy decoding never calls it. GPUs run the Triton kernel.

`register` (the entry point in ``vllm_plugins/*.dist-info``; `eagle_lib.engines.vllm_server.start_vllm` puts that
directory and the repository on the server's PYTHONPATH) replaces the stand-in only on the CPU platform and only
when a probe shows it is broken, so a vLLM with the fix is left alone. vLLM loads general plugins just before it
registers its CPU kernel overrides (``worker_base``), and the override reads the module attribute set here.

Runs in the vLLM venv: imports torch and vllm only, and never an ISA-specific build of vLLM's ops itself
(tests/unit/test_vllm_cpu_fixes.py forces an AVX2-only CPU and checks).
"""

from __future__ import annotations

import logging

PLUGIN_DIR_NAME = "vllm_plugins"  # next to this file: the dist-info that names `register` as an entry point
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
log = logging.getLogger(__name__)


def expand_at_dtype(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (the kernel's name)
    """output (num_tokens,) <- input_val (batch,) repeated per request (cu_num_tokens (batch,) cumulative counts),
    values equal to replace_from replaced by replace_to; written in output's own dtype."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))  # (batch,) tokens per request
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    out = torch.repeat_interleave(vals, counts)  # (sum counts,)
    output[: out.numel()].copy_(out.to(output.dtype))


def shim_is_broken(expand) -> bool:
    """True when `expand` leaves a float32 output unwritten or truncates it (the vLLM 0.32 CPU stand-in does)."""
    import torch

    out = torch.full((3,), -7.0)
    try:  # replace_from / replace_to are ints, as the rejection sampler passes them (GREEDY_TEMPERATURE -> 1)
        expand(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), -1, 1)
    except (RuntimeError, TypeError):
        return True
    return out.tolist() != [0.5, 2.0, 2.0]


def register() -> None:
    """vLLM general-plugin entry point: install `expand_at_dtype` on the CPU platform when the stand-in is broken."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    # The C++ ops the stand-in calls, in the build vLLM picks for this CPU (_C needs AVX-512 BF16, _C_AVX512
    # AVX-512, _C_AVX2 AVX2; importing vllm._C itself dies with SIGILL on an AVX2-only CPU). A no-op when
    # vLLM already loaded them; on failure it logs and the probe below finds the stand-in broken.
    current_platform.import_kernels()
    try:
        from vllm.utils import cpu_triton_utils as cpu
    except ImportError:
        return
    if not shim_is_broken(cpu._expand_kernel_impl):
        return
    cpu._expand_kernel_impl = expand_at_dtype
    from vllm.triton_utils import dispatcher

    if KERNEL in dispatcher._registry:  # loaded after the CPU overrides: replace the registered one too
        dispatcher.register_kernels({KERNEL: expand_at_dtype})
    log.warning("eagle_lib: replaced vLLM's CPU expand_kernel stand-in (vllm-project/vllm#55005)")
