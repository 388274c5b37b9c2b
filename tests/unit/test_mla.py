"""The MLA draft layer (`eagle_lib.drafter.mla`, ``draft_attention: mla``): its attention against transformers'
own DeepSeek-V3 latent attention (an independent implementation: de-interleaved rope, expanded latent cache),
TTT against the served chain, the attention paths against each other, and its export, reload and preflight."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from eagle_lib.drafter import export, ttt
from eagle_lib.drafter.mla import mla_qkv
from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter
from eagle_lib.serving import preflight

torch.set_num_threads(1)
V, H, HT = 40, 32, 24
MLA = dict(attention="mla", num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=20,
           qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)  # fmt: skip


def mla_drafter(seed=0, n=20, **kw) -> Eagle3Drafter:
    torch.manual_seed(seed)
    c = Eagle3Config(hidden_size=H, intermediate_size=48, head_dim=8, vocab_size=V, draft_vocab_size=n,
                     target_hidden_size=HT, aux_layers=[1, 3, 4], rope_theta=500.0, **{**MLA, **kw})  # fmt: skip
    m = Eagle3Drafter(c).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)  # norms away from 1: a skipped norm shows
    kept = torch.arange(0, V, V // n)[:n]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    m.set_vocab_map(kept - torch.arange(n), t2d)
    return m


@torch.no_grad()
def test_mla_attention_equals_transformers_deepseek_v3_attention():
    """Our q/k/v + causal attention + o_proj over the 2H-wide input = transformers' DeepseekV3Attention built with
    hidden_size 2H and the same weights (its o_proj's first H rows ours, the rest zero)."""
    m = mla_drafter()
    c, att = m.config, m.midlayer.self_attn
    hf_cfg = DeepseekV3Config(
        hidden_size=2 * H, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=20,
        qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, rope_interleave=True, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, attention_bias=False,
    )  # fmt: skip
    hf_cfg._attn_implementation = "eager"
    ref = DeepseekV3Attention(hf_cfg, layer_idx=0).double()
    for name, module in att.named_children():  # our module names must be transformers' (getattr fails else)
        if name != "o_proj":
            getattr(ref, name).load_state_dict(module.state_dict())
    ref.o_proj.weight.zero_()
    ref.o_proj.weight[:H] = att.o_proj.weight
    t = 9
    x = torch.randn(2, t, 2 * H, dtype=torch.float64)
    pos = torch.tensor([list(range(t)), list(range(5, 5 + t))])
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, pos)
    causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None].expand(2, 1, t, t)
    want = ref(x, (cos.double(), sin.double()), causal)[0][..., :H]
    q, k, v = mla_qkv(att, c, x, pos)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = att.o_proj(o.transpose(1, 2).reshape(2, t, -1))
    # fp32 rotary angles on both sides (each its own formula): measured max abs diff ~1e-7 on outputs ~1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.abs().max() > 0.1  # a real signal, not two zeros


def inference_chain(m, ids, aux, t, steps):
    cache = m.new_cache()
    out, lg = m(ids[:, 1 : t + 2], m.project(aux[:, : t + 1]), torch.arange(t + 1)[None], cache)
    h, res = out[:, -1:], [lg[0, -1]]
    for j in range(1, steps):
        h, lg = m(ids[:, t + 1 + j : t + 2 + j], h, torch.tensor([[t + j]]), cache)
        res.append(lg[0, -1])
    return res


@torch.no_grad()
@pytest.mark.parametrize("attention", ["eager", "sdpa", "chunked"])
def test_mla_ttt_loss_equals_the_served_chain(attention):
    """Each TTT row/step of an MLA drafter has the logits the incremental (cached) drafter computes, on every
    attention path (values narrower than queries: v_head 10, q/k 14)."""
    m, t_len, k = mla_drafter(), 11, 3
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (1, t_len), generator=g)
    aux = torch.randn(1, t_len, 3 * HT, generator=g, dtype=torch.float64)
    tl = torch.randn(1, t_len, V, generator=g, dtype=torch.float64) * 3
    pos, doc = torch.arange(t_len)[None], torch.zeros(1, t_len, dtype=torch.long)
    mask = torch.ones(1, t_len, dtype=torch.bool)
    loss, stats = ttt.TTT(m, k, 0.7, attention)(ids, pos, doc, mask, aux, tl)
    expected = 0.0
    for i in range(k):
        ces = []
        for t in range(t_len - 2 - i):
            lg = inference_chain(m, ids, aux, t, i + 1)[i]
            if m.t2d[tl[0, t + 1 + i].argmax()]:
                p = F.softmax(tl[0, t + 1 + i][m.draft_ids()], -1)
                ces.append(-(p * F.log_softmax(lg, -1)).sum())
        expected += 0.7**i * (sum(ces) / max(1, len(ces)))
    assert loss.item() == pytest.approx(float(expected), rel=1e-9)


def test_mla_chunked_attention_gradients_equal_eager():
    """The blockwise attention's hand-written backward with values narrower than keys (MLA)."""
    m = mla_drafter(seed=3)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 13), generator=g)
    aux = torch.randn(2, 13, 3 * HT, generator=g, dtype=torch.float64)
    tl = torch.randn(2, 13, V, generator=g, dtype=torch.float64) * 3
    doc = torch.zeros(2, 13, dtype=torch.long)
    doc[:, 7:] = 1
    pos = torch.where(doc == 1, torch.arange(13) - 7, torch.arange(13))
    mask = torch.ones(2, 13, dtype=torch.bool)
    grads = {}
    for att in ("eager", "chunked"):
        m.zero_grad()
        ttt.TTT(m, 3, 0.8, att)(ids, pos, doc, mask, aux, tl)[0].backward()
        grads[att] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads["chunked"].keys()
    for n in grads["eager"]:
        torch.testing.assert_close(grads["chunked"][n], grads["eager"][n], rtol=1e-8, atol=1e-10)


TARGET = {"hidden_size": HT, "vocab_size": V, "num_hidden_layers": 8, "kv_lora_rank": 20, "qk_rope_head_dim": 6,
          "architectures": ["DeepseekV3ForCausalLM"]}  # fmt: skip


def test_mla_export_is_the_deepseek_eagle3_layout_and_reloads_to_the_same_drafter(tmp_path):
    m = mla_drafter()
    paths = export.export_all(m, tmp_path, "verifier", ["DeepseekV3ForCausalLM"])
    assert set(paths) == {"sglang"}  # vLLM's speculators loader has no MLA layer
    fmt, cfg = export.read_config(paths["sglang"])
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert {n: cfg[n] for n in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                "v_head_dim")} == {"q_lora_rank": 12, "kv_lora_rank": 20, "qk_nope_head_dim": 8,
                                                   "qk_rope_head_dim": 6, "v_head_dim": 10}  # fmt: skip
    back = export.load_export(paths["sglang"], m.embed_tokens.weight, dtype=torch.float64)
    assert back.config.attention == "mla"
    ids, h = torch.randint(0, V, (1, 6)), torch.randn(1, 6, H, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            back(ids, h, torch.arange(6)[None])[1], m(ids, h, torch.arange(6)[None])[1]
        )
    with pytest.raises(ValueError, match="no speculators export"):
        export.speculators_config(m.config, "verifier", [])


def test_preflight_passes_the_mla_export_on_an_mla_target_and_fails_it_elsewhere(tmp_path):
    m = mla_drafter()
    d = export.export_sglang(m, tmp_path / "sglang")
    rep = preflight.preflight(d, "verifier", target_config=TARGET, trained_aux=[1, 3, 4],
                              trained_norms=export.norm_flags(m.config))  # fmt: skip
    failed = [c for c in rep.checks if not c.ok and c.severity == "error"]
    assert not failed, failed
    dense = {k: v for k, v in TARGET.items() if k not in ("kv_lora_rank", "qk_rope_head_dim")}
    rep = preflight.preflight(d, "verifier", target_config=dense)
    assert [c.name for c in rep.checks if not c.ok] == ["MLA target"]


def test_recipe_draft_attention_takes_the_mla_targets_shapes_and_refuses_a_dense_target():
    from transformers import LlamaConfig

    from eagle_lib import train
    from eagle_lib.drafter import recipe

    target = DeepseekV3Config(hidden_size=64, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1,
                              q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4,
                              v_head_dim=12, intermediate_size=96, vocab_size=300)  # fmt: skip
    c = recipe.drafter_config(target, train.Params(draft_attention="mla", draft_vocab_size=64))
    assert (c.attention, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        "mla", 16, 32, 8, 4, 12)  # fmt: skip
    assert c.num_key_value_heads == c.num_attention_heads == 2  # latent keys/values: one per query head
    assert recipe.drafter_config(target, train.Params(draft_vocab_size=64)).attention == "gqa"
    dense = LlamaConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, intermediate_size=96)
    with pytest.raises(ValueError, match="needs an MLA target"):
        recipe.drafter_config(dense, train.Params(draft_attention="mla", draft_vocab_size=64))


def test_kimi_shaped_draft_layers_count_their_attention_weights_and_cache_as_the_formulas_say():
    """The README's Kimi-shape figures: the attention weights of each draft layer counted on the module (meta
    device) equal the closed-form count, and the cache per token is the latent + rope (MLA) or 2 x kv heads x
    head_dim (Llama-style)."""
    from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter

    h, heads, ql, kl, nope, rope, v = 7168, 64, 1536, 512, 128, 64, 128  # Kimi-K2.5's text config
    kimi = DeepseekV3Config(hidden_size=h, num_hidden_layers=61, num_attention_heads=heads, num_key_value_heads=heads,
                            q_lora_rank=ql, kv_lora_rank=kl, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                            v_head_dim=v, intermediate_size=18432, vocab_size=163840)  # fmt: skip
    counts, cache = {}, {}
    for att in ("gqa", "mla"):
        c = Eagle3Config.from_target_config(kimi, 32000, attention=att)
        with torch.device("meta"):
            d = Eagle3Drafter(c)
        cache[att] = (
            c.kv_lora_rank + c.qk_rope_head_dim if att == "mla" else 2 * c.num_key_value_heads * c.head_dim
        )
        counts[att] = sum(p.numel() for n, p in d.named_parameters() if ".self_attn." in n)
    hd = h // heads  # 112: the Llama-style layer's head width on an MLA target
    assert counts["gqa"] == 3 * 2 * h * heads * hd + heads * hd * h  # q, k, v over 2H; o_proj
    mla = 2 * h * ql + ql + ql * heads * (nope + rope) + 2 * h * (kl + rope) + kl + kl * heads * (nope + v)
    assert counts["mla"] == mla + heads * v * h
    assert (round(counts["mla"] / 1e6, 1), round(counts["gqa"] / 1e6, 1)) == (116.3, 359.7)
    assert cache == {"mla": 576, "gqa": 14336}  # cached values a token, from the built configs
