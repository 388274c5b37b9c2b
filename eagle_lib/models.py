"""Load the target tokenizer/model through the same code for the toy world and a real model.

`toy://...` URIs resolve to the cached toy world (built on first use); anything else is an HF model dir or
hub id, loaded with AutoTokenizer / AutoModelForCausalLM exactly as a real target would be.
"""

from __future__ import annotations

import os

import torch


def resolve(uri: str) -> str:
    """Map toy:// URIs to local paths (building the toy world if needed); other strings pass through."""
    if uri.startswith("toy://"):
        from eagle_lib import toy

        return toy.resolve(uri)
    return uri


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def num_workers(n: int) -> int:
    """0 means all cores this process may use."""
    if n > 0:
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_tokenizer(shared):
    """The target tokenizer (shared.tokenizer or the target's own), with its chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        resolve(shared.tokenizer_path), trust_remote_code=shared.trust_remote_code
    )


def load_target(shared, dtype: torch.dtype | None = None, device: str | None = None):
    """The target model in eval mode on the chosen device (fp32 on CPU, bf16 on GPU unless told)."""
    from transformers import AutoModelForCausalLM

    dev = pick_device(device or shared.device)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        resolve(shared.target), dtype=dtype, trust_remote_code=shared.trust_remote_code
    )
    return model.to(dev).eval()
