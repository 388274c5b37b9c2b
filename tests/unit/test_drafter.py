"""Eagle3Drafter: checkpoint keys, the layer math against a naive reference, KV cache, save/load."""

import math

import pytest
import torch

from eagle_lib import models
from eagle_lib.drafter.model import (
    DraftCache,
    Eagle3Config,
    Eagle3Drafter,
    load_drafter,
    save_drafter,
)

torch.set_num_threads(1)

SGLANG_KEYS = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def small_config(**kw) -> Eagle3Config:
    base = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=40,
        draft_vocab_size=16,
        target_hidden_size=24,
        aux_layers=[1, 3, 4],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    base.update(kw)
    return Eagle3Config(**base)


def randomized(cfg: Eagle3Config, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    m = Eagle3Drafter(cfg).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)  # norms away from 1 so a wrong norm shows
    kept = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    m.set_vocab_map(kept - torch.arange(cfg.draft_vocab_size), t2d)
    return m


def test_state_dict_keys_and_shapes_are_the_sglang_checkpoint_layout():
    c = small_config()
    sd = Eagle3Drafter(c).state_dict()
    assert set(sd) == SGLANG_KEYS | {"embed_tokens.weight"}
    h, ht, n, v = c.hidden_size, c.target_hidden_size, c.draft_vocab_size, c.vocab_size
    assert sd["fc.weight"].shape == (h, 3 * ht)
    assert sd["lm_head.weight"].shape == (n, h)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (c.num_attention_heads * c.head_dim, 2 * h)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (c.num_key_value_heads * c.head_dim, 2 * h)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (h, c.num_attention_heads * c.head_dim)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (n,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (v,)
    assert not Eagle3Drafter(c).embed_tokens.weight.requires_grad


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope_complex(x, pos, theta):
    """Rotary embedding via complex numbers on the (i, i + D/2) pairs (HF Llama's pairing)."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    freqs = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = z * torch.polar(torch.ones_like(freqs), freqs)
    return torch.cat([z.real, z.imag], -1)


def naive_forward(m: Eagle3Drafter, ids, feats_hidden, positions):
    """Per-position loops, one sequence: the EAGLE-3 layer as written in the reference."""
    c, L = m.config, m.midlayer
    sd = {k: v for k, v in m.state_dict().items()}
    t = ids.shape[0]
    emb = sd["embed_tokens.weight"][ids]
    x = torch.cat(
        [
            _rms(emb, sd["midlayer.input_layernorm.weight"], c.rms_norm_eps),
            _rms(feats_hidden, sd["midlayer.hidden_norm.weight"], c.rms_norm_eps),
        ],
        -1,
    )
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(t, c.num_attention_heads, c.head_dim)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(t, c.num_key_value_heads, c.head_dim)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(t, c.num_key_value_heads, c.head_dim)
    group = c.num_attention_heads // c.num_key_value_heads
    out = torch.zeros(t, c.num_attention_heads, c.head_dim, dtype=x.dtype)
    for i in range(t):
        for h in range(c.num_attention_heads):
            qi = _rope_complex(q[i, h], float(positions[i]), c.rope_theta)
            scores = torch.stack(
                [
                    qi @ _rope_complex(k[j, h // group], float(positions[j]), c.rope_theta)
                    for j in range(i + 1)
                ]
            ) / math.sqrt(c.head_dim)
            w = torch.softmax(scores, 0)
            out[i, h] = sum(w[j] * v[j, h // group] for j in range(i + 1))
    resid = (
        _rms(feats_hidden, sd["midlayer.hidden_norm.weight"], c.rms_norm_eps)
        if c.norm_before_residual
        else feats_hidden
    )
    hmid = resid + out.reshape(t, -1) @ sd["midlayer.self_attn.o_proj.weight"].T
    y = _rms(hmid, sd["midlayer.post_attention_layernorm.weight"], c.rms_norm_eps)
    g = y @ sd["midlayer.mlp.gate_proj.weight"].T
    mlp = ((g * torch.sigmoid(g)) * (y @ sd["midlayer.mlp.up_proj.weight"].T)) @ sd[
        "midlayer.mlp.down_proj.weight"
    ].T
    out_h = hmid + mlp
    normed = _rms(out_h, sd["norm.weight"], c.rms_norm_eps)
    logits = normed @ sd["lm_head.weight"].T
    assert L is m.midlayer
    return (normed if c.norm_output else out_h), logits


def test_forward_matches_naive_reference():
    m = randomized(small_config())
    ids = torch.randint(0, 40, (1, 7))
    feats = torch.randn(1, 7, 72, dtype=torch.float64)
    pos = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    hidden = m.project(feats)
    assert torch.allclose(hidden, feats @ m.fc.weight.T)
    out, logits = m(ids, hidden, pos)
    ref_h, ref_l = naive_forward(m, ids[0], hidden[0], pos[0])
    torch.testing.assert_close(out[0], ref_h, rtol=1e-6, atol=1e-6)  # rope angles are fp32, as in HF
    torch.testing.assert_close(logits[0], ref_l, rtol=1e-6, atol=1e-6)


NORM_OPTIONS = ["norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"]
EXTRA_WEIGHTS = {
    "norm_before_fc": {"input_norm.weight": 72},
    "fc_norm": {f"fc_norm.{i}.weight": 24 for i in range(3)},
}


@pytest.mark.parametrize("option", NORM_OPTIONS)
def test_norm_option_matches_naive_reference_and_changes_only_its_part(option):
    """Each later-EAGLE normalisation option against the hand-written layer; off = the original layer. The
    exports write the option's flag and weights (both engines run it), but for norm_before_residual, which
    SGLang 0.5.23's layer lacks: refused."""
    base, opt = randomized(small_config()), randomized(small_config(**{option: True}))
    extra = EXTRA_WEIGHTS.get(option, {})
    assert set(opt.state_dict()) - set(base.state_dict()) == set(extra)
    with torch.no_grad():
        for name, width in extra.items():
            opt.get_parameter(name).copy_(torch.randn(width, dtype=torch.float64))
    opt.load_state_dict(base.state_dict(), strict=False)  # same weights: only the option differs
    ids = torch.randint(0, 40, (1, 6))
    feats = torch.randn(1, 6, 72, dtype=torch.float64)
    pos = torch.arange(2, 8)[None]
    if extra:
        eps = opt.config.rms_norm_eps
        if option == "norm_before_fc":  # one RMSNorm over the 3 H_t features
            ref_in = _rms(feats, opt.input_norm.weight, eps)
        else:  # one RMSNorm per aux feature, each H_t wide (vLLM's fc_norm)
            ref_in = torch.cat(
                [_rms(x, w, eps) for x, w in zip(feats.split(24, -1), opt.fc_norm.parameters(), strict=True)],
                -1,
            )
        torch.testing.assert_close(
            opt.project(feats), ref_in @ opt.fc.weight.T, rtol=1e-5, atol=1e-5
        )  # fp32 norm
        assert not torch.allclose(opt.project(feats), base.project(feats))
    hidden = base.project(feats)  # the layer itself on the same input hidden
    out, logits = opt(ids, hidden, pos)
    ref_h, ref_l = naive_forward(opt, ids[0], hidden[0], pos[0])
    torch.testing.assert_close(out[0], ref_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits[0], ref_l, rtol=1e-6, atol=1e-6)
    b_out, b_logits = base(ids, hidden, pos)
    if extra:  # the layer is untouched: only project differs
        torch.testing.assert_close((out, logits), (b_out, b_logits))
    elif option == "norm_output":  # same logits, the fed-back hidden is post-norm
        torch.testing.assert_close(logits, b_logits)
        assert not torch.allclose(out, b_out)
    else:
        assert not torch.allclose(logits, b_logits)
    from eagle_lib.drafter import export

    export.sglang_config(base.config)  # the original layer exports
    for make in (export.sglang_config, lambda c: export.speculators_config(c, "t", [])):
        if option == "norm_before_residual":
            with pytest.raises(ValueError, match=option):  # SGLang would serve another layer
                make(opt.config)
        else:  # the flag is written out, the others false
            assert {n: make(opt.config)[n] for n in NORM_OPTIONS} == {n: n == option for n in NORM_OPTIONS}


def test_cache_append_and_crop_match_full_forward():
    m = randomized(small_config(), seed=1)
    ids = torch.randint(0, 40, (2, 9))
    hid = torch.randn(2, 9, 32, dtype=torch.float64)
    pos = torch.arange(9).expand(2, 9)
    _, full = m(ids, hid, pos)
    cache = m.new_cache()
    _, a = m(ids[:, :4], hid[:, :4], pos[:, :4], cache)
    _, b = m(ids[:, 4:5], hid[:, 4:5], pos[:, 4:5], cache)
    _, c = m(ids[:, 5:], hid[:, 5:], pos[:, 5:], cache)
    assert len(cache) == 9
    torch.testing.assert_close(torch.cat([a, b, c], 1), full)
    cache.crop(3)  # e.g. rejected drafts: recompute rows 3.. from other inputs
    assert len(cache) == 3
    _, again = m(ids[:, 3:], hid[:, 3:], pos[:, 3:], cache)
    torch.testing.assert_close(again, full[:, 3:])
    with pytest.raises(ValueError, match="crop"):
        cache.crop(10)
    assert len(DraftCache()) == 0


def test_draft_to_target_uses_d2t_offsets():
    m = randomized(small_config(), seed=2)
    kept = torch.nonzero(m.t2d).flatten()
    ids = torch.arange(16).view(4, 4)
    assert torch.equal(m.draft_to_target(ids), kept[ids])
    assert torch.equal(m.draft_ids(), kept)


def test_default_aux_layers_and_from_target_config():
    from transformers import DeepseekV3Config, LlamaConfig

    assert models.default_aux_layers(8) == [1, 3, 4]
    assert models.default_aux_layers(61) == [1, 29, 57]  # Kimi-K2.5
    assert models.default_aux_layers(7) == [1, 2, 3]
    with pytest.raises(ValueError, match="not be distinct"):
        models.default_aux_layers(6)  # would be [1, 2, 2]
    kimi = DeepseekV3Config(
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=64,
        num_key_value_heads=64,
        vocab_size=163840,
        intermediate_size=18432,
    )
    c = Eagle3Config.from_target_config(kimi, 32000)
    assert (c.hidden_size, c.target_hidden_size, c.vocab_size, c.draft_vocab_size) == (
        7168,
        7168,
        163840,
        32000,
    )
    assert c.aux_layers == [1, 29, 57]
    assert c.head_dim * c.num_attention_heads == 7168  # MLA target: a plain Llama head split of H
    llama = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=12,
        num_attention_heads=2,
        head_dim=32,
        num_key_value_heads=1,
        vocab_size=100,
        intermediate_size=96,
    )
    c2 = Eagle3Config.from_target_config(llama, 50, aux_layers=[0, 5, 9])
    assert (c2.head_dim, c2.num_key_value_heads, c2.aux_layers) == (32, 1, [0, 5, 9])
    with pytest.raises(ValueError, match="3 aux layers"):
        Eagle3Drafter(small_config(aux_layers=[1, 2]))


def test_project_rejects_final_layer_only_features():
    m = Eagle3Drafter(small_config())
    with pytest.raises(ValueError, match="EAGLE3"):
        m.project(torch.randn(1, 3, 24))


def test_save_load_roundtrip(tmp_path):
    m = randomized(small_config(), seed=3).float()
    save_drafter(m, tmp_path / "d", extra={"note": 1})
    back = load_drafter(tmp_path / "d")
    for k, v in m.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert back.config == m.config
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_drafter(tmp_path)
