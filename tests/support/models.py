"""The one factory for the tiny random models the tests build (Llama targets and EAGLE-3 drafters).

Defaults: hidden 64, 2 heads of head_dim 32 (vLLM's CPU backend rejects smaller heads), 1 KV head, 512 positions.
"""

from __future__ import annotations

import dataclasses
import random

import torch


def llama_config(**overrides):
    """A tiny LlamaConfig; any field can be overridden (vocab_size, num_hidden_layers, ...)."""
    from transformers import LlamaConfig

    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
    )
    return LlamaConfig(**(base | overrides))


def llama(seed: int = 0, dtype: torch.dtype = torch.float32, lm_head_scale: float = 1.0, **overrides):
    """A random LlamaForCausalLM in eval mode; ``lm_head_scale`` > 1 sharpens its next-token distribution."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(**overrides))
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    return model.to(dtype).eval()


def vocab_map(vocab: int, n_draft: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random draft vocab of ``n_draft`` target ids: (d2t offsets (n_draft,), t2d bool mask (vocab,))."""
    kept = torch.tensor(sorted(random.Random(seed).sample(range(vocab), n_draft)))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(n_draft), t2d


def drafter(
    target_config,
    n_draft: int,
    seed: int = 0,
    aux_layers: list[int] | None = None,
    noisy_norms=False,
    norms: tuple[str, ...] = (),
):
    """A random Eagle3Drafter for ``target_config`` with a random draft vocab (full vocab when n_draft == vocab)
    and the normalisation options ``norms`` on (e.g. ("fc_norm", "norm_output"): EAGLE-3.1)."""
    from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter

    torch.manual_seed(seed)
    kw = {} if aux_layers is None else {"aux_layers": aux_layers}
    config = Eagle3Config.from_target_config(target_config, draft_vocab_size=n_draft, **kw)
    d = Eagle3Drafter(dataclasses.replace(config, **dict.fromkeys(norms, True)))
    if noisy_norms:
        with torch.no_grad():
            for p in d.parameters():  # norms away from 1 so a swapped norm would show
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    if n_draft < target_config.vocab_size:
        d.set_vocab_map(*vocab_map(target_config.vocab_size, n_draft, seed))
    return d.eval()


EXPORT_VOCAB, EXPORT_DRAFT_VOCAB = 160, 96  # the export / preflight tests' target vocab and draft vocab


def export_drafter(n_draft: int = EXPORT_DRAFT_VOCAB, seed: int = 0):
    """The export / preflight tests' drafter: a 10-layer target (aux ids default to [1, 4, 7]), noisy norms."""
    cfg = llama_config(vocab_size=EXPORT_VOCAB, intermediate_size=96, num_hidden_layers=10, rope_theta=5e4)
    return drafter(cfg, n_draft, seed, noisy_norms=True)
