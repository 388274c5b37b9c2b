"""eagle_lib.drafter.recipe: the one schedule and step layout that 05 and 07 train with (the step count and the
micro-batches of a step: eagle_lib.data.batches)."""

import pytest
import torch

from eagle_lib.data import batches
from eagle_lib.drafter import recipe


@pytest.mark.parametrize(("total", "warmup", "ratio"), [(10, 2, 0.1), (40, 5, 0.0), (7, 7, 0.3)])
def test_schedule_equals_torchs_linear_warmup_then_cosine(total, warmup, ratio):
    """Reference: torch's own LinearLR (warmup) followed by CosineAnnealingLR (eta_min = ratio x lr)."""
    lr = 0.5
    ours = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    ref = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    (mine,) = recipe.schedules([ours], recipe.Params(min_lr_ratio=ratio, warmup_steps=warmup), total)
    parts = [torch.optim.lr_scheduler.LinearLR(ref, 1 / warmup, 1.0, total_iters=max(1, warmup - 1))]
    if total > warmup:
        parts.append(torch.optim.lr_scheduler.CosineAnnealingLR(ref, total - warmup, eta_min=ratio * lr))
    theirs = (
        torch.optim.lr_scheduler.SequentialLR(ref, parts, milestones=[warmup]) if len(parts) > 1 else parts[0]
    )
    got, want = [], []
    for _ in range(total):
        got.append(mine.get_last_lr()[0])
        want.append(theirs.get_last_lr()[0])
        ours.step(), ref.step(), mine.step(), theirs.step()
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize(("world", "accum"), [(1, 1), (2, 2), (8, 4)])
def test_ranks_of_a_step_take_what_one_process_takes(world, accum):
    """The world x accum micro-batches of a step, over all ranks, are those of one process with accum x world:
    disjoint, consecutive, and every step's follow the previous step's."""
    one = recipe.single_process(recipe.Params(grad_accum=accum), world)
    assert one.grad_accum == world * accum and one.nproc_per_node == 1
    seen = []
    for step in range(3):
        ranks = [list(batches.micro_batches(step, r, world, accum)) for r in range(world)]
        assert sum(ranks, []) == list(batches.micro_batches(step, 0, 1, one.grad_accum))
        seen += sum(ranks, [])
    assert seen == list(range(3 * world * accum))


def test_the_step_count_is_the_same_for_any_split_of_the_global_batch():
    p = recipe.Params(max_steps=0, epochs=2, grad_accum=4)
    assert (
        batches.total_steps(p, 100, 8)
        == 2 * 100 // 32
        == batches.total_steps(recipe.single_process(p, 8), 100, 1)
    )
    assert batches.total_steps(p.model_copy(update={"max_steps": 5}), 100, 8) == 5


def test_the_kimi_params_train_by_their_epochs_not_the_default_step_count():
    """params/kimi_k25.yaml said epochs: 2 while max_steps kept its default (80): a real run would have trained
    80 steps whatever the data (found running params/mini_kimi.yaml). The params now say max_steps: 0, and a file
    that sets epochs without max_steps is refused."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    for name in ("kimi_k25.yaml", "mini_kimi.yaml"):
        cfg = yaml.safe_load((root / "params" / name).read_text())["stages"]["05_train_eagle3"]
        p = recipe.Params(**{k: v for k, v in cfg.items() if k in recipe.Params.model_fields})
        per_epoch, world = 10_000, cfg["nproc_per_node"]
        assert batches.total_steps(p, per_epoch, world) == 2 * per_epoch // (world * cfg["grad_accum"])
    with pytest.raises(ValueError, match="max_steps: 0"):
        recipe.Params(epochs=2)
    assert batches.total_steps(recipe.Params(epochs=2, max_steps=0), 100, 1) == 200
    assert recipe.Params(epochs=3, max_steps=5).max_steps == 5  # both set: the steps, as asked


def _tiny_drafter(freeze: bool):
    from eagle_lib.drafter.model import Eagle3Config

    c = Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=8, vocab_size=50, draft_vocab_size=20, target_hidden_size=16, aux_layers=[1, 2, 3])  # fmt: skip
    g = torch.Generator().manual_seed(3)
    embed, head = torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g)
    d2t = torch.arange(0, 40, 2)[:20] - torch.arange(20)  # draft id i -> target id 2i
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[torch.arange(0, 40, 2)] = True
    p = recipe.Params(freeze_lm_head=freeze)
    return recipe.new_drafter(c, d2t, t2d, p, 0, embed, head), head


@pytest.mark.parametrize("freeze", [True, False])
def test_a_frozen_lm_head_stays_the_targets_rows_while_the_layer_trains(freeze):
    from eagle_lib.drafter import optim

    d, head = _tiny_drafter(freeze)
    rows = head[torch.arange(0, 40, 2)]  # the target's rows of the draft vocab, by the map written above
    assert torch.equal(d.lm_head.weight.detach(), rows)
    fc0 = d.fc.weight.detach().clone()
    opts = optim.build(d.named_parameters(), "muon", 1e-2, [0.9, 0.95], 0.0)
    for _ in range(3):
        ids = torch.randint(0, 50, (1, 6))
        out, logits = d(ids, d.project(torch.randn(1, 6, 48)), torch.arange(6)[None])
        torch.nn.functional.cross_entropy(logits[0], torch.randint(0, 20, (6,))).backward()
        optim.step(opts)
        optim.zero_grad(opts)
    assert not torch.equal(d.fc.weight.detach(), fc0)
    assert torch.equal(d.lm_head.weight.detach(), rows) == freeze
    assert d.lm_head.weight.requires_grad is not freeze


def test_a_frozen_lm_head_needs_the_targets_rows():
    with pytest.raises(ValueError, match="init_lm_head_from_target"):
        recipe.Params(freeze_lm_head=True, init_lm_head_from_target=False)


def test_the_lm_head_lr_scale_is_a_positive_fraction():
    with pytest.raises(ValueError, match="lm_head_lr_scale"):
        recipe.Params(lm_head_lr_scale=0.0)
    assert recipe.Params(lm_head_lr_scale=0.1).lm_head_lr_scale == 0.1


def _shared(path):
    from eagle_lib.params import SharedParams

    return SharedParams(target=str(path))


def _saved_llama(tmp_path, layers: int = 4):
    """A tiny random Llama target saved as safetensors (the layer init reads the tensors from the files)."""
    from tests.support.models import llama

    target = llama(seed=3, num_hidden_layers=layers, num_key_value_heads=2)
    target.save_pretrained(tmp_path)
    return target


def test_a_draft_layer_started_from_a_target_layer_computes_that_layer(tmp_path):
    """Reference: the HF target's own decoder layer. With init_fc last_aux, fc passes the last aux feature (the
    output of layer 1) through; with the layer started from target layer 2 and the embedding half of q/k/v zeroed
    here, the draft layer's output is the target's hidden state after layer 2, and norm + lm_head (the target's
    final norm and rows) give the target's logits of that state."""
    from eagle_lib import models

    target = _saved_llama(tmp_path)
    p = recipe.Params(
        init_layer_from_target=2, init_fc="last_aux", draft_vocab_size=128, aux_layers=[0, 0, 1]
    )
    config = recipe.drafter_config(target.config, p)
    layer = recipe.target_layer(p, _shared(tmp_path), target.config)
    v = config.vocab_size
    d = recipe.new_drafter(config, torch.zeros(v, dtype=torch.long), torch.ones(v, dtype=torch.bool), p, 0,
                           target.get_input_embeddings().weight, target.lm_head.weight, layer)  # fmt: skip
    h = config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(d.midlayer.self_attn, name).weight[:, :h] = 0.0
    ids = torch.randint(0, v, (1, 9))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states  # [embeddings, after layer 0, ...]
        feats = torch.cat([states[1], states[1], states[2]], dim=-1)
        out, logits = d(ids, d.project(feats), torch.arange(9)[None])
        want = states[3]  # after layer 2 (not the last: HF's last state is normed)
        want_logits = target.lm_head(target.model.norm(want))
    assert torch.allclose(out, want, atol=1e-5)
    assert torch.allclose(logits, want_logits, atol=1e-4)
    assert models.text_config(target.config).num_hidden_layers == 4


def test_both_halves_take_the_target_matrix_and_the_embedding_half_is_random_otherwise(tmp_path):
    target = _saved_llama(tmp_path)
    got = {}
    for halves in ("hidden", "both"):
        p = recipe.Params(
            init_layer_from_target=3, init_layer_halves=halves, draft_vocab_size=128, aux_layers=[0, 1, 2]
        )
        config = recipe.drafter_config(target.config, p)
        layer = recipe.target_layer(p, _shared(tmp_path), target.config)
        v = config.vocab_size
        got[halves] = recipe.new_drafter(config, torch.zeros(v, dtype=torch.long), torch.ones(v, dtype=torch.bool),
                                         p, 0, target.get_input_embeddings().weight, target.lm_head.weight, layer)  # fmt: skip
    h, want = 64, target.model.layers[3].self_attn.k_proj.weight
    assert torch.equal(got["hidden"].midlayer.self_attn.k_proj.weight[:, h:].detach(), want.detach())
    assert torch.equal(got["both"].midlayer.self_attn.k_proj.weight[:, :h].detach(), want.detach())
    assert not torch.equal(got["hidden"].midlayer.self_attn.k_proj.weight[:, :h].detach(), want.detach())
    assert torch.equal(got["hidden"].norm.weight.detach(), target.model.norm.weight.detach())


def test_the_layer_init_names_a_layer_the_target_has(tmp_path):
    from eagle_lib import params

    target = _saved_llama(tmp_path, layers=2)
    with pytest.raises(params.ParamsError, match="init_layer_from_target 2: the target has 2 decoder layers"):
        recipe.target_layer(recipe.Params(init_layer_from_target=2), _shared(tmp_path), target.config)
    with pytest.raises(ValueError, match="init_layer_from_target -2"):
        recipe.Params(init_layer_from_target=-2)
    with pytest.raises(ValueError, match="draft_attention gqa"):
        recipe.Params(init_layer_from_target=0, draft_attention="mla")
    assert recipe.target_layer(recipe.Params(), _shared(tmp_path), target.config) is None
