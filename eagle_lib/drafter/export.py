"""Export a trained drafter for serving engines, and reload an export into our drafter.

Two formats, safetensors only, each a directory with ``config.json`` + ``model.safetensors``:

* ``sglang`` — the EAGLE / SGLang format (``--speculative-algorithm EAGLE3``; vLLM loads it too):
  architectures ``["LlamaForCausalLMEagle3"]``, keys ``fc.weight``, ``midlayer.*``, ``norm.weight``,
  ``lm_head.weight``, ``d2t``, ``t2d``.
* MLA drafters (``attention: mla``) have the EAGLE / SGLang layout only, under the architecture both engines
  name ``Eagle3DeepseekV2ForCausalLM`` (vLLM 0.32 deepseek_eagle3, SGLang 0.5.23 kimi_k25_eagle3) with a
  ``deepseek_v2`` layer config: vLLM's speculators loader knows llama / qwen3 layers only, so there is no
  speculators export of them (vLLM serves the sglang directory).
* ``speculators`` — the vLLM speculators format (``speculators_model_type: eagle3``): the same tensors with
  ``midlayer.`` renamed ``layers.0.``, the decoder layer described by ``transformer_layer_config`` and every
  normalisation flag written out (vLLM defaults a missing ``norm_before_residual`` to True, which is not
  this drafter).

The target's token embedding is never exported: both engines share the target's. When the draft vocab is
the full target vocab, ``d2t`` / ``t2d`` are left out too: vLLM 0.32 then has no ``draft_id_to_target_id``
parameter and refuses a checkpoint that carries one (speculators 0.9 omits them as well).

Aux layer ids: one number, two conventions (the one home of the conversions: `eagle_lib.models.layer_ids`). SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids``
names decoder-layer *outputs* (0-based; SGLang captures at the input of layer id+1), which is our
``Eagle3Config.aux_layers``. vLLM's ``eagle_aux_hidden_state_layer_ids`` (top level, read before
``eagle_config``) names HF ``hidden_states`` indices = our ids + 1. The sglang export writes both keys, each
in its engine's convention, so one directory is right in both engines; the speculators export writes the
vLLM one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle_lib import models
from eagle_lib.drafter.model import MLA_SHAPES, Eagle3Config, Eagle3Drafter

SGLANG_ARCH = "LlamaForCausalLMEagle3"
MLA_ARCH = (
    "Eagle3DeepseekV2ForCausalLM"  # vLLM 0.32 and SGLang 0.5.23: EAGLE-3 with DeepSeek-V2 latent attention
)
SPECULATORS_ARCH = "Eagle3DraftModel"  # speculators 0.9.0; vLLM maps any eagle3 speculator to its own class
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
FORMATS = ("sglang", "speculators")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """An export directory that cannot be read back: names the file and the reason."""


# the drafter's normalisation options, each a config key both engines read at the top level of config.json (vLLM
# 0.32 llama_eagle3 / speculators algos.update_eagle3; SGLang 0.5.23 llama_eagle3, which has no
# norm_before_residual). The weights they add: input_norm.weight (norm_before_fc), fc_norm.{0,1,2}.weight (fc_norm).
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def norm_flags(c: Eagle3Config) -> dict[str, bool]:
    """Every normalisation flag of the drafter, written out (a missing one means another default per engine)."""
    return {n: bool(getattr(c, n)) for n in NORM_FLAGS}


def formats_for(c: Eagle3Config) -> tuple[str, ...]:
    """The export formats this drafter has: both, or the sglang layout only for an MLA layer."""
    return ("sglang",) if c.attention == "mla" else FORMATS


def _mla_layer_config(c: Eagle3Config) -> dict:
    """The one MLA decoder layer as an HF DeepseekV2Config dict (dense MLP; plain rope, trained so)."""
    return {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        **{n: getattr(c, n) for n in MLA_SHAPES},
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rope_scaling": None,
        "rope_interleave": True,  # adjacent-pair rotation, as trained (SGLang reads it; vLLM's MLA always does so)
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def _layer_config(c: Eagle3Config) -> dict:
    """The one Llama decoder layer, as an HF LlamaConfig dict (vocab_size = the target's); the MLA layer's
    DeepseekV2Config dict for an MLA drafter."""
    if c.norm_before_residual:  # SGLang would run it without (silently wrong), and both formats must serve
        raise ValueError(
            "cannot export a drafter trained with norm_before_residual: SGLang 0.5.23's EAGLE-3 layer has no such "
            "option (it would serve the drafter without it); train with norm_before_fc / fc_norm / norm_output"
        )
    if c.attention == "mla":
        return _mla_layer_config(c)
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def sglang_config(c: Eagle3Config, dtype: str = "float32") -> dict:
    """config.json of the EAGLE / SGLang format."""
    return {
        "architectures": [MLA_ARCH if c.attention == "mla" else SGLANG_ARCH],
        **_layer_config(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "torch_dtype": dtype,
        **norm_flags(c),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
            "use_aux_hidden_state": True,
        },
        "eagle_aux_hidden_state_layer_ids": models.layer_ids(c.aux_layers, "vllm"),
    }


def speculators_config(
    c: Eagle3Config,
    verifier: str,
    verifier_architectures: list[str],
    num_speculative_tokens: int = 3,
    dtype: str = "float32",
) -> dict:
    """config.json of the speculators / vLLM format (verifier = the target's hub id or directory)."""
    if c.attention == "mla":
        raise ValueError(
            "an MLA drafter has no speculators export (vLLM 0.32's speculators loader builds llama / qwen3 layers "
            "only); vLLM serves its sglang export as Eagle3DeepseekV2ForCausalLM: set online_format: sglang"
        )
    return {
        "architectures": [SPECULATORS_ARCH],
        "model_type": "speculators",
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": num_speculative_tokens,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": {**_layer_config(c), "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": models.layer_ids(c.aux_layers, "vllm"),
        **norm_flags(c),
        "torch_dtype": dtype,
    }


def export_tensors(model: Eagle3Drafter, fmt: str, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The state dict as written: no embedding, float weights cast to dtype, keys renamed for the format;
    no vocab map when the draft vocab is the full vocab."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (known: {', '.join(FORMATS)})")
    c = model.config
    full_vocab = c.draft_vocab_size == c.vocab_size
    if full_vocab and bool(model.d2t.any()):
        raise ValueError("a full-size draft vocab must map draft id i to target id i (d2t all zero)")
    out = {}
    for key, t in model.state_dict().items():
        # vLLM refuses d2t when the draft vocab is the full vocab (speculators omits it too)
        if key.startswith("embed_tokens.") or (full_vocab and key in ("d2t", "t2d")):
            continue
        t = t.detach().cpu()
        if t.is_floating_point():
            t = t.to(_DTYPES[dtype])
        if fmt == "speculators" and key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer.") :]
        out[key] = t.contiguous()
    return out


def _write(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write weights then config through temp names, so a crash never leaves a config without weights."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / WEIGHTS)
    tmp = out_dir / f".{CONFIG}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(out_dir / CONFIG)
    return out_dir


def export_sglang(model: Eagle3Drafter, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the EAGLE / SGLang format to out_dir; returns it."""
    return _write(Path(out_dir), sglang_config(model.config, dtype), export_tensors(model, "sglang", dtype))


def export_speculators(
    model: Eagle3Drafter,
    out_dir: str | Path,
    verifier: str,
    verifier_architectures: list[str],
    num_speculative_tokens: int = 3,
    dtype: str = "float32",
) -> Path:
    """Write the speculators / vLLM format to out_dir; returns it."""
    cfg = speculators_config(model.config, verifier, verifier_architectures, num_speculative_tokens, dtype)
    return _write(Path(out_dir), cfg, export_tensors(model, "speculators", dtype))


def export_all(
    model: Eagle3Drafter,
    out_root: str | Path,
    verifier: str,
    verifier_architectures: list[str],
    num_speculative_tokens: int = 3,
    dtype: str = "float32",
) -> dict[str, Path]:
    """Every format of the drafter (`formats_for`) under out_root/<format>."""
    root = Path(out_root)
    out = {"sglang": export_sglang(model, root / "sglang", dtype)}
    if "speculators" in formats_for(model.config):
        out["speculators"] = export_speculators(
            model, root / "speculators", verifier, verifier_architectures, num_speculative_tokens, dtype
        )
    return out


def read_config(path: str | Path) -> tuple[str, dict]:
    """(format, config dict) of an export directory; ExportError if it is neither format."""
    f = Path(path) / CONFIG
    if not f.exists():
        raise ExportError(f"{f}: missing (not an export directory)")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{f}: not valid JSON ({e.msg})") from None
    if cfg.get("speculators_model_type") is not None or "speculators_config" in cfg:
        return "speculators", cfg
    if "architectures" in cfg:
        return "sglang", cfg
    raise ExportError(f"{f}: neither an EAGLE/SGLang config (architectures) nor a speculators config")


def aux_layers_of(fmt: str, cfg: dict) -> list[int] | None:
    """Aux layers in our convention (decoder-layer outputs, 0-based), or None if the config has none."""
    if fmt == "sglang":
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids:
            return list(ids)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return models.aux_layers_from(ids, "vllm") if ids else None


def drafter_config(fmt: str, cfg: dict, aux_layers: list[int] | None = None) -> Eagle3Config:
    """Our Eagle3Config from an export config (aux_layers: fallback when the config names none)."""
    layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    mla = MLA_ARCH in (cfg.get("architectures") or [])
    if mla and not all(layer.get(n) for n in MLA_SHAPES):
        raise ExportError(f"{MLA_ARCH} config lacks an MLA shape ({', '.join(MLA_SHAPES)}: each > 0)")
    shapes = {"attention": "mla", **{n: int(layer[n]) for n in MLA_SHAPES}} if mla else {}
    rope = layer.get("rope_parameters") or {}
    aux = aux_layers_of(fmt, cfg) or aux_layers
    if not aux:
        raise ExportError(f"{fmt} config names no aux layers; pass aux_layers")
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=heads if mla else layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or hidden // heads,
        vocab_size=layer["vocab_size"],
        draft_vocab_size=cfg.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size") or hidden,
        aux_layers=list(aux),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(layer.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=layer.get("max_position_embeddings", 4096),
        # as the engines read them: vLLM's speculators loader defaults a missing norm_before_residual to True
        **{n: bool(cfg.get(n, fmt == "speculators" and n == "norm_before_residual")) for n in NORM_FLAGS},
        **shapes,
    )


def read_tensors(path: str | Path, fmt: str) -> dict[str, torch.Tensor]:
    """The export's tensors under our drafter's keys (layers.0. -> midlayer.)."""
    from safetensors.torch import load_file

    f = Path(path) / WEIGHTS
    if not f.exists():
        raise ExportError(f"{f}: missing")
    out = {}
    for key, t in load_file(str(f)).items():
        if fmt == "speculators" and key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0.") :]
        out[key] = t
    return out


def load_export(
    path: str | Path,
    embed: torch.Tensor | None = None,
    aux_layers: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Eagle3Drafter:
    """Rebuild our drafter from an export (either format); embed = the target's embedding (V, H).

    Without embed the embedding stays as initialised, so token-dependent outputs are meaningless.
    """
    fmt, cfg = read_config(path)
    model = Eagle3Drafter(drafter_config(fmt, cfg, aux_layers))
    state = read_tensors(path, fmt)
    if embed is not None:
        state["embed_tokens.weight"] = embed
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "embed_tokens.weight" and k not in ("d2t", "t2d")]
    if missing or unexpected:
        raise ExportError(f"{Path(path) / WEIGHTS}: missing keys {missing}, unexpected keys {unexpected}")
    if "d2t" not in state:  # speculators omits the map when the draft vocab is the full vocab
        if model.config.draft_vocab_size != model.config.vocab_size:
            raise ExportError(
                f"{Path(path) / WEIGHTS}: no d2t although the draft vocab is smaller than the target's"
            )
        model.t2d.fill_(True)
    return model.to(dtype).eval()
