"""Export: engine key names and configs, and both formats reload into a drafter with identical logits."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle_lib.drafter import export
from tests.support import models as tiny

torch.set_num_threads(1)
V, N = tiny.EXPORT_VOCAB, tiny.EXPORT_DRAFT_VOCAB

SGLANG_KEYS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
}


def make_drafter(n_draft=N, seed=0):
    return tiny.export_drafter(n_draft, seed)


def logits_of(d, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(V, (1, 7), generator=g)
    feats = torch.randn(1, 7, 3 * d.config.target_hidden_size, generator=g)
    with torch.no_grad():
        h, logits = d(ids, d.project(feats), torch.arange(7)[None])
    return h, logits


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_roundtrip_gives_identical_logits(tmp_path, fmt):
    d = make_drafter()
    path = export.export_all(d, tmp_path, "some/target", ["LlamaForCausalLM"])[fmt]
    back = export.load_export(path, embed=d.embed_tokens.weight)
    assert back.config == d.config
    for a, b in zip(logits_of(d), logits_of(back), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.t2d, d.t2d)


def test_sglang_keys_and_config(tmp_path):
    d = make_drafter()
    path = export.export_sglang(d, tmp_path / "s")
    tensors = load_file(str(path / "model.safetensors"))
    assert set(tensors) == SGLANG_KEYS  # no embed_tokens: engines share the target's
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["lm_head.weight"].shape == (N, 64)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == V and cfg["draft_vocab_size"] == N and cfg["tie_word_embeddings"] is False
    # SGLang: decoder-layer outputs [1, L//2-1, L-4]; vLLM top level: HF hidden_states indices (+1)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]


def test_speculators_keys_and_config(tmp_path):
    d = make_drafter()
    path = export.export_speculators(d, tmp_path / "v", "org/target", ["LlamaForCausalLM"], 3)
    tensors = load_file(str(path / "model.safetensors"))
    assert set(tensors) == {k.replace("midlayer.", "layers.0.") for k in SGLANG_KEYS}
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["model_type"] == "speculators"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False
    assert cfg["transformer_layer_config"]["head_dim"] == 32
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]


def test_full_vocab_drops_vocab_map(tmp_path):
    """vLLM refuses d2t when the draft vocab is the full vocab; reload restores the identity map."""
    d = make_drafter(n_draft=V)
    for _fmt, path in export.export_all(d, tmp_path, "t", ["LlamaForCausalLM"]).items():
        assert not {"d2t", "t2d"} & set(load_file(str(path / "model.safetensors")))
        back = export.load_export(path, embed=d.embed_tokens.weight)
        assert bool(back.t2d.all()) and not bool(back.d2t.any())
        assert torch.equal(logits_of(d)[1], logits_of(back)[1])


def test_bf16_export_is_cast(tmp_path):
    d = make_drafter()
    path = export.export_sglang(d, tmp_path / "b", dtype="bfloat16")
    t = load_file(str(path / "model.safetensors"))
    assert t["fc.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_unreadable_export_names_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(export.ExportError, match="config.json"):
        export.load_export(tmp_path)
    with pytest.raises(export.ExportError, match="missing"):
        export.read_config(tmp_path / "nowhere")
