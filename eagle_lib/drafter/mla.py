"""The MLA draft layer's attention (``draft_attention: mla``): DeepSeek-V2 multi-head latent attention over the
EAGLE-3 layer's 2H-wide input, as vLLM 0.32 (``Eagle3DeepseekV2ForCausalLM``, deepseek_eagle3.py) and SGLang
0.5.23 (kimi_k25_eagle3.py) serve it for MLA targets (Kimi-K2.x, DeepSeek-V3).

With x = concat(input_layernorm(embed), hidden_norm(hidden)) (B, T, 2H):

* ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` viewed (heads, qk_nope + qk_rope); both engines require the
  low-rank query (``q_lora_rank``: SGLang's class refuses a draft without it);
* ``c, k_pe = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope])``; ``k_nope, v = split(kv_b_proj(
  kv_a_layernorm(c)), [qk_nope, v_head])`` per head; the one ``k_pe`` head is shared by every head;
* rotary on the ``qk_rope`` part of q and k only, pairs of adjacent channels (vLLM's ``is_neox_style=False``;
  transformers' ``rope_interleave`` computes the same scores in another channel order);
* scores scaled by (qk_nope + qk_rope) ** -0.5 (q's width: every attention path here scales by it), values
  ``v_head`` wide, ``o_proj`` (H, heads * v_head).

The engines run the absorbed form (keys and values kept as the latent c and k_pe); it computes the same
attention. Only plain rope (``rope_type: default``) is trained and exported: the drafter is trained from
scratch, so it need not share the target's YaRN scaling.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle_lib.drafter.norms import RMSNorm


class MLAAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d_in, heads = 2 * c.hidden_size, c.num_attention_heads
        if not c.q_lora_rank or not c.kv_lora_rank or not c.qk_rope_head_dim or not c.v_head_dim:
            raise ValueError(
                "draft_attention mla needs q_lora_rank, kv_lora_rank, qk_rope_head_dim and v_head_dim > 0 "
                f"(got {c.q_lora_rank}, {c.kv_lora_rank}, {c.qk_rope_head_dim}, {c.v_head_dim}): an MLA target's "
                "config gives them; SGLang's MLA draft class requires the low-rank query"
            )
        if c.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {c.qk_rope_head_dim} must be even (rotary pairs)")
        self.q_a_proj = nn.Linear(d_in, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(
            c.q_lora_rank, heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), bias=False
        )
        self.kv_a_proj_with_mqa = nn.Linear(d_in, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * c.v_head_dim, c.hidden_size, bias=False)


def rope_interleaved(
    position_ids: torch.Tensor, dim: int, theta: float, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, 1, T, dim/2) of the rotary part: frequency theta ** (-2i / dim) for channel pair i."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim)
    ang = position_ids[..., None].float() * inv_freq
    return ang.cos()[:, None].to(dtype), ang.sin()[:, None].to(dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x (..., dim) by the angles of cos/sin (..., dim/2)."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def mla_qkv(att: MLAAttention, c, x: torch.Tensor, position_ids: torch.Tensor):
    """q, k (B, heads, T, qk_nope + qk_rope) and v (B, heads, T, v_head) of the 2H-wide input x (B, T, 2H)."""
    b, t, _ = x.shape
    heads, nope, rope = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
    q = att.q_b_proj(att.q_a_layernorm(att.q_a_proj(x))).view(b, t, heads, nope + rope).transpose(1, 2)
    latent, k_pe = att.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rope], dim=-1)
    kv = att.kv_b_proj(att.kv_a_layernorm(latent)).view(b, t, heads, nope + c.v_head_dim).transpose(1, 2)
    k_nope, v = kv.split([nope, c.v_head_dim], dim=-1)
    cos, sin = rope_interleaved(position_ids, rope, c.rope_theta, q.dtype)
    q_pe = rotate_pairs(q[..., nope:], cos, sin)
    k_pe = rotate_pairs(k_pe[:, None], cos, sin).expand(b, heads, t, rope)
    return torch.cat([q[..., :nope], q_pe], -1), torch.cat([k_nope, k_pe], -1), v
