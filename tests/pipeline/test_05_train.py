"""Stage 05 end to end on params/ci.yaml: a trained drafter that beats chance, its maps, logs and exports."""

import json

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from eagle_lib import report, store
from eagle_lib.drafter.model import load_drafter
from eagle_lib.drafter.vocab import check_vocab_map
from eagle_lib.models import resolve

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


def test_drafter_trained_and_beats_chance(ci_run):
    d = ci_run / "drafter"
    meta = store.read_json(d / "meta.json")
    store.check_tally(meta, str(d / "meta.json"))
    assert meta["kept"] > 0 and meta["dropped"]["heldout_for_eval"] > 0
    summary = store.read_json(d / "summary.json")
    metrics = report.read_notebook_metrics(ci_run / "reports" / "05_train_eagle3.ipynb")
    assert metrics["heldout_acc_0"] == summary["heldout"]["acc"][0]
    # well above chance: at least twice the rate of always guessing the most frequent label token
    assert metrics["heldout_acc_0"] > max(0.15, 2 * metrics["baseline_acc_majority_token"])
    log = store.read_jsonl(d / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, summary["steps"] + 1))
    first, last = log[0]["loss"], sum(r["loss"] for r in log[-5:]) / 5
    assert last < first


def test_final_drafter_loads_with_a_checked_vocab_map(ci_run):
    model = load_drafter(ci_run / "drafter" / "final")
    c = model.config
    n_layers = AutoConfig.from_pretrained(resolve("toy://target")).num_hidden_layers
    assert c.aux_layers == [1, n_layers // 2 - 1, n_layers - 4]  # EAGLE-3's default low/mid/high layers
    check_vocab_map(model.d2t, model.t2d)
    assert int(model.t2d.sum()) == c.draft_vocab_size
    assert not model.embed_tokens.weight.requires_grad
    ids = torch.tensor([[5, 6, 7]])
    out, logits = model(
        ids, model.project(torch.zeros(1, 3, 3 * c.target_hidden_size)), torch.arange(3)[None]
    )
    assert out.shape == (1, 3, c.hidden_size) and logits.shape == (1, 3, c.draft_vocab_size)


def test_exports_in_both_formats(ci_run):
    exp = ci_run / "drafter" / "export"
    sg = json.loads((exp / "sglang" / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert set(load_file(str(exp / "sglang" / "model.safetensors"))) == SGLANG_KEYS
    sp = json.loads((exp / "speculators" / "config.json").read_text())
    assert sp["speculators_model_type"] == "eagle3"
    assert any(k.startswith("layers.0.") for k in load_file(str(exp / "speculators" / "model.safetensors")))


def test_measured_tau_is_skipped_with_its_reason_under_vllm(ci_run):
    """ci trains from vLLM's hidden states: no target in the trainer's process, so no measured tau (it would
    load the whole target there; 06 measures tau), and summary and report say why. Logging measured tau while
    training is tests/unit/test_measure.py (online source); the toy run shows it in its 05 report."""
    d = ci_run / "drafter"
    assert store.read_json(d / "meta.json")["params"]["hidden_source"] == "vllm"
    assert not [r for r in store.read_jsonl(d / "train_log.jsonl") if "measured_tau" in r]
    summary = store.read_json(d / "summary.json")
    assert "has no target in this process" in summary["measured"]["skipped"]
    metrics = report.read_notebook_metrics(ci_run / "reports" / "05_train_eagle3.ipynb")
    assert metrics["measured_tau"] is None
    nb = json.loads((ci_run / "reports" / "05_train_eagle3.ipynb").read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("name") == "stderr"], "05 report has stderr output"
    first = next(
        o
        for c in nb["cells"][4:]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") in ("execute_result", "display_data")
    )
    assert "".join(first["data"]["text/markdown"]).startswith("**Held-out acc_0 ")
