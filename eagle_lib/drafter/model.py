"""The EAGLE-3 drafter: fc (3H_t -> H), one Llama decoder layer over concat(embedding, feature), norm, lm_head
(``attention: mla``: the layer's attention is DeepSeek-V2's latent attention instead, `eagle_lib.drafter.mla`).

State-dict keys are exactly the EAGLE / SGLang checkpoint keys (``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, buffers ``d2t`` / ``t2d``) plus ``embed_tokens.weight``, the target's frozen embedding,
which exporters omit (engines share the target's).

Token / feature alignment (the same in training, SGLang and vLLM)
------------------------------------------------------------------
Let the target read tokens ``x_0 .. x_n`` and let ``f_t`` (3H_t wide) be the concatenated outputs of its aux
decoder layers at position ``t`` (the state after reading ``x_t``). The drafter row for position ``t`` takes

* ``hidden[t] = project(f_t)`` (fc),
* ``input_ids[t] = x_{t+1}`` (the token the target produced / read next),
* ``position_ids[t] = t`` (the feature's position, not the token's),

and its logits at ``t`` predict ``x_{t+2}``. So a prefill over target positions ``0..n-1`` uses
``input_ids = x_1..x_n`` (the last one being the token the target just sampled), and the first draft token
is the argmax at position ``n-1``. Each further draft step ``j`` feeds one row: the previous draft token,
``hidden = out_hidden`` of the previous row (pre-norm, never re-projected by fc) and position ``n-1+j``.
This is how vLLM's eagle proposer and SGLang's EAGLE3 worker run it (input ids shifted left by one against
the target's positions, pre-norm output hidden recycled).

The decoder layer: ``residual = hidden``; attention over
``concat(input_layernorm(embed(ids)), hidden_norm(hidden))`` (width 2H); ``h = residual + attn``;
``out = h + mlp(post_attention_layernorm(h))``; ``logits = lm_head(norm(out))`` over the draft vocab, whose
ids map to the target's by ``target_id = draft_id + d2t[draft_id]``. Config options (off by default, named as
in speculators / vLLM): ``norm_before_residual`` (residual = hidden_norm(hidden)), ``norm_before_fc`` (an
``input_norm`` RMSNorm on the 3H_t features before fc: one extra weight), ``fc_norm`` (an RMSNorm per aux
feature, ``fc_norm.{0,1,2}.weight``, after ``input_norm`` when both are on: vLLM's order) and ``norm_output`` (the
hidden fed back to the next draft step is ``norm(out)``, the tensor the logits read too). EAGLE-3.1 as SGLang
and vLLM serve it (SGLang's kimi_k25_eagle3 calls it so) is ``fc_norm`` + ``norm_output``.

Incremental decoding: ``DraftCache`` holds the layer's keys/values in position order. ``forward`` with a
cache appends the new rows (each new row attends to every cached row and causally to the new ones) and
``cache.crop(n)`` drops everything from row ``n`` on, e.g. after the target rejects draft tokens: crop to
the rows computed from target features, then feed the accepted tokens' target features as new rows.
All rows of a batch share one cache length (decode in lockstep; no padding mask).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from eagle_lib import models
from eagle_lib.drafter.mla import MLAAttention, mla_qkv
from eagle_lib.drafter.norms import RMSNorm

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "drafter_config.json"


@dataclass
class Eagle3Config:
    """Shapes of the drafter; ``vocab_size`` is the target's, ``draft_vocab_size`` the lm_head's."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # normalisation options of later EAGLE-3 trainers (speculators / vLLM config keys), all off = the original layer
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden), not the raw hidden
    norm_before_fc: bool = False  # RMSNorm ``input_norm`` (3H_t) on the concatenated features before fc
    norm_output: bool = False  # the hidden fed back to the next draft step is norm(out), not the pre-norm out
    fc_norm: bool = False  # an RMSNorm per aux feature (H_t each) before fc (EAGLE-3.1, with norm_output)
    # the layer's attention: "gqa" (Llama: q/k/v/o_proj) or "mla" (DeepSeek-V2 latent attention, `drafter.mla`:
    # vLLM's Eagle3DeepseekV2ForCausalLM, SGLang's kimi_k25_eagle3) with the MLA shapes below (0: unused)
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"drafter attention {self.attention!r}: choose one of {list(ATTENTIONS)}")
        if self.attention == "mla" and self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("an MLA draft layer has one key/value head per query head (num_key_value_heads)")

    @classmethod
    def from_target_config(
        cls, hf_config, draft_vocab_size: int, aux_layers: list[int] | None = None, attention: str = "gqa"
    ):
        """A drafter as wide as the target; aux layers default to [1, L//2-1, L-4] (0-based decoder layers).
        ``attention="mla"`` takes the target's MLA shapes (heads, q/kv ranks, head widths): the draft layer's
        latent cache then has the target's layout (Kimi's published MLA drafts do the same)."""
        cfg = models.text_config(hf_config)
        n_layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
        heads = cfg.num_attention_heads
        mla = hasattr(cfg, "kv_lora_rank") or hasattr(cfg, "qk_rope_head_dim")
        if attention == "mla" and not mla:
            raise ValueError(
                f"draft_attention mla needs an MLA target (kv_lora_rank / qk_rope_head_dim in its config); "
                f"{getattr(cfg, 'model_type', '?')} has none: use draft_attention gqa"
            )
        shapes = {}
        if attention == "mla":
            shapes = {n: int(getattr(cfg, n, 0) or 0) for n in MLA_SHAPES}
            shapes["attention"] = "mla"
        head_dim = hidden // heads if mla else (getattr(cfg, "head_dim", None) or hidden // heads)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(
            hidden_size=hidden,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=heads
            if attention == "mla"
            else getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hidden,
            aux_layers=list(aux_layers) if aux_layers is not None else models.default_aux_layers(n_layers),
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
            rope_theta=float(theta or getattr(cfg, "rope_theta", None) or 10000.0),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
            **shapes,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"Eagle3Config: unknown keys {sorted(unknown)}")
        return cls(**d)


ATTENTIONS = ("gqa", "mla")
MLA_SHAPES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        d_in = 2 * c.hidden_size
        self.q_proj = nn.Linear(d_in, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = MLAAttention(c) if c.attention == "mla" else Attention(c)
        self.mlp = MLP(c)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DraftCache:
    """Keys/values of the drafter's layer, (B, n_kv, S, D) each, rows in position order."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new rows (B, n_kv, T, D); returns all rows."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        """Keep rows [0, n) (drop rejected / feature-less rows)."""
        if n < 0 or n > len(self):
            raise ValueError(f"DraftCache.crop({n}): cache holds {len(self)} rows")
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter; see the module docstring for inputs and alignment."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        if len(c.aux_layers) != 3:
            raise ValueError(f"EAGLE-3 needs 3 aux layers, got {c.aux_layers}")
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if c.norm_before_fc:  # only then: the default state dict stays the SGLang checkpoint layout
            self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(3))
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DecoderLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True  # identity map until set_vocab_map
        self.register_buffer("t2d", t2d)

    # --- vocab -------------------------------------------------------------------------------------
    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft->target map (see eagle_lib.drafter.vocab)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab map shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} do not fit the drafter")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft id, (N,)."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids (any shape) to target ids."""
        return ids + self.d2t[ids]

    # --- pieces shared by inference (forward) and training (eagle_lib.drafter.ttt) -------------------------
    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc: (B, T, 3H_t) concatenated aux-layer features -> (B, T, H)."""
        if aux_hidden.shape[-1] != self.fc.in_features:
            from eagle_lib.hidden_states.hidden import width_error

            raise ValueError(
                width_error(aux_hidden.shape[-1], self.config.target_hidden_size, "Eagle3Drafter")
            )
        if self.config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.config.fc_norm:
            parts = aux_hidden.chunk(3, dim=-1)
            aux_hidden = torch.cat([n(x) for n, x in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, 1, T, D) for rotary embedding at the given positions."""
        c = self.config
        dims = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=position_ids.device) / c.head_dim
        inv_freq = 1.0 / c.rope_theta**dims  # fp32 even when the weights are bf16
        ang = position_ids[..., None].float() * inv_freq  # (B, T, D/2)
        emb = torch.cat([ang, ang], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def qkv(self, input_ids, hidden, position_ids):
        """q (B, nh, T, D), k/v (B, nkv, T, D) with rope applied, and the residual (B, T, H)."""
        layer, c = self.midlayer, self.config
        b, t = input_ids.shape
        emb = layer.input_layernorm(self.embed_tokens(input_ids).to(hidden.dtype))
        normed = layer.hidden_norm(hidden)
        x = torch.cat([emb, normed], dim=-1)  # (B, T, 2H)
        att = layer.self_attn
        if c.attention == "mla":
            q, k, v = mla_qkv(att, c, x, position_ids)
            return q, k, v, normed if c.norm_before_residual else hidden
        q = att.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = att.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = att.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rope(position_ids, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v, normed if c.norm_before_residual else hidden

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn (B, nh, T, D) -> pre-norm output hidden (B, T, H)."""
        b, _, t, _ = attn.shape
        layer = self.midlayer
        h = residual + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def head(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) pre-norm hidden -> (B, T, N_draft) logits."""
        return self.lm_head(self.norm(out_hidden))

    def feedback(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """The hidden (B, T, H) fed to the next draft step: pre-norm out, or norm(out) under norm_output."""
        return self.norm(out_hidden) if self.config.norm_output else out_hidden

    # --- inference ---------------------------------------------------------------------------------
    def forward(self, input_ids, hidden, position_ids, cache: DraftCache | None = None):
        """One pass over new rows: returns (out_hidden (B, T, H), logits (B, T, N_draft)).

        ``hidden`` is ``project(features)`` for rows with target features, else the previous out_hidden;
        out_hidden is the pre-norm output (``feedback``: post-norm under ``norm_output``).
        """
        q, k, v, residual = self.qkv(input_ids, hidden, position_ids)
        past = len(cache) if cache is not None else 0
        if cache is not None:
            k, v = cache.append(k, v)
        t, s = q.shape[2], k.shape[2]
        if past == 0:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=past)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out = self.finish(attn, residual)
        return self.feedback(out), self.head(out)

    def new_cache(self) -> DraftCache:
        return DraftCache()

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]


def init_from_target(model: Eagle3Drafter, embed: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
    """Copy the target's embedding (frozen) and, when widths match, its lm_head rows of the draft vocab."""
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        if lm_head is not None and lm_head.shape[1] == model.config.hidden_size:
            model.lm_head.weight.copy_(lm_head[model.draft_ids().to(lm_head.device)])


# the target decoder layer's tensors that `init_layer_from_target` reads (Llama names under model.layers.{i}.)
LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)  # fmt: skip


def init_layer_from_target(model: Eagle3Drafter, layer: dict[str, torch.Tensor], final_norm: torch.Tensor,
                           halves: str = "hidden") -> None:  # fmt: skip
    """Start the draft layer from a target decoder layer (``layer``: LAYER_TENSORS by name) and the drafter's
    norm from the target's final norm, so norm + lm_head (the target's rows) start as the target's head.

    The draft layer's q/k/v read ``concat(embedding, hidden)`` (2H): ``halves`` says which half takes the
    target's matrix: ``hidden`` (the embedding half keeps its random init) or ``both`` (the same matrix on
    both halves: q = W (e + h)). o_proj, the MLP and the layer norms (hidden_norm and input_layernorm both
    from the target's input_layernorm) are copied. Shapes must match: a GQA layer as wide as the target."""
    c = model.config
    if c.attention != "gqa":
        raise ValueError(f"init_layer_from_target: the draft layer's attention is {c.attention!r}; only a "
                         "gqa layer takes a target layer's weights")  # fmt: skip
    if halves not in ("hidden", "both"):
        raise ValueError(f"init_layer_from_target halves {halves!r}: choose hidden or both")
    mid, h = model.midlayer, c.hidden_size
    pairs = [(mid.self_attn.o_proj.weight, "self_attn.o_proj.weight"),
             (mid.mlp.gate_proj.weight, "mlp.gate_proj.weight"), (mid.mlp.up_proj.weight, "mlp.up_proj.weight"),
             (mid.mlp.down_proj.weight, "mlp.down_proj.weight"),
             (mid.post_attention_layernorm.weight, "post_attention_layernorm.weight"),
             (mid.input_layernorm.weight, "input_layernorm.weight"), (mid.hidden_norm.weight, "input_layernorm.weight")]  # fmt: skip
    for name in ("q_proj", "k_proj", "v_proj"):
        pairs.append((getattr(mid.self_attn, name).weight[:, h:], f"self_attn.{name}.weight"))
        if halves == "both":
            pairs.append((getattr(mid.self_attn, name).weight[:, :h], f"self_attn.{name}.weight"))
    with torch.no_grad():
        for dst, key in pairs:
            src = layer[key]
            if src.shape != dst.shape:
                raise ValueError(f"init_layer_from_target: the target's {key} is {tuple(src.shape)}, the draft "
                                 f"layer's {tuple(dst.shape)} (a drafter of another width or MLP size)")  # fmt: skip
            dst.copy_(src.to(dst.dtype))
        if final_norm.shape != model.norm.weight.shape:
            raise ValueError(f"init_layer_from_target: the target's final norm is {tuple(final_norm.shape)}, "
                             f"the drafter's {tuple(model.norm.weight.shape)}")  # fmt: skip
        model.norm.weight.copy_(final_norm.to(model.norm.weight.dtype))


def save_drafter(model: Eagle3Drafter, out_dir: str | Path, extra: dict | None = None) -> Path:
    """Write model.safetensors (full state_dict) + drafter_config.json (config + extra fields)."""
    return save_state(model.state_dict(), model.config, out_dir, extra)


def save_state(state: dict, config: Eagle3Config, out_dir: str | Path, extra: dict | None = None) -> Path:
    """save_drafter from a state dict (e.g. gathered from FSDP); each file is replaced atomically."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(state, str(out / f".{WEIGHTS_FILE}.tmp"))
    (out / f".{WEIGHTS_FILE}.tmp").replace(out / WEIGHTS_FILE)
    meta = {"config": config.to_dict(), **(extra or {})}
    (out / f".{CONFIG_FILE}.tmp").write_text(json.dumps(meta, indent=2))
    (out / f".{CONFIG_FILE}.tmp").replace(out / CONFIG_FILE)
    return out


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Load a drafter written by save_drafter (a final/ or checkpoint directory)."""
    from safetensors.torch import load_file

    path = Path(path)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path}: no {name} (not a drafter directory written by save_drafter)")
    cfg = Eagle3Config.from_dict(json.loads((path / CONFIG_FILE).read_text())["config"])
    model = Eagle3Drafter(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(path / WEIGHTS_FILE)), strict=False)
    if missing or unexpected:
        raise ValueError(f"{path / WEIGHTS_FILE}: missing keys {missing}, unexpected keys {unexpected}")
    model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
