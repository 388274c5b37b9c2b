"""The drafter's optimizers: which weights Muon takes, and one Muon step against its formula."""

import math

import pytest
import torch

from eagle_lib.drafter import optim
from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter


def tiny_drafter():
    torch.manual_seed(0)
    c = Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=8, vocab_size=50, draft_vocab_size=20, target_hidden_size=12, aux_layers=[1, 2, 3])  # fmt: skip
    return Eagle3Drafter(c)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    d = tiny_drafter()
    named = [(n, q) for n, q in d.named_parameters() if q.requires_grad]
    adam, muon = optim.build(d.named_parameters(), "muon", 1e-2, [0.9, 0.95], 0.0)
    in_muon = {id(q) for g in muon.param_groups for q in g["params"]}
    want = {n for n, q in named if q.ndim == 2 and "lm_head" not in n and "embed" not in n}
    assert {n for n, q in named if id(q) in in_muon} == want
    assert {"fc.weight", "midlayer.mlp.down_proj.weight", "midlayer.self_attn.q_proj.weight"} <= want
    assert sum(len(g["params"]) for g in adam.param_groups) + len(in_muon) == len(named)
    (only,) = optim.build(d.named_parameters(), "adamw", 1e-2, [0.9, 0.95], 0.0)
    assert isinstance(only, torch.optim.AdamW) and len(only.param_groups[0]["params"]) == len(named)
    with pytest.raises(ValueError, match="optimizer"):
        optim.build(d.named_parameters(), "sgd", 1e-2, [0.9, 0.95], 0.0)


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration of Muon (Jordan et al.): X <- aX + (bA + cA^2)X, A = X X^T, from X = G/||G||_F."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = g / (g.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


def test_one_muon_step_is_the_orthogonalised_nesterov_gradient_at_adamw_rms():
    """First step from zero momentum: nesterov makes the update (1 + mu) g, orthogonalised, scaled by
    lr * 0.2 * sqrt(max(A, B)) (AdamW-matched RMS), no weight decay (05's default 0)."""
    w = torch.nn.Parameter(torch.randn(24, 16, dtype=torch.float64))
    start = w.detach().clone()
    (muon,) = optim.build([("fc.weight", w)], "muon", 1e-2, [0.9, 0.95], 0.0)
    g = torch.randn(24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w.grad = g.clone()
    muon.step()
    want = 1e-2 * 0.2 * math.sqrt(24) * newton_schulz((1 + 0.95) * g)
    got = start - w.detach()
    # on a CPU the iterations run in float32 (torch's own Muon, in bfloat16, was 1.2% off this float64 reference)
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert float(got.pow(2).mean().sqrt()) == pytest.approx(0.2 * 1e-2, rel=0.35)  # AdamW-like RMS


def test_with_bfloat16_iterations_it_is_torchs_muon_bit_for_bit(monkeypatch):
    """Reference: torch.optim.Muon itself, over three steps with momentum and weight decay (its iterations are
    bfloat16): ours differs from it only in the dtype `NS_DTYPE` picks, and on CUDA picks torch's."""
    monkeypatch.setitem(optim.NS_DTYPE, "cpu", torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen) for s in ((24, 16), (16, 40))]
    grads = [[torch.randn(w.shape, generator=gen) for w in start] for _ in range(3)]
    ws = []
    for make in (optim.Muon, torch.optim.Muon):
        w = [torch.nn.Parameter(x.clone()) for x in start]
        opt = make(w, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        for g in grads:
            for q, gq in zip(w, g, strict=True):
                q.grad = gq.clone()
            opt.step()
        ws.append(w)
    for ours, theirs in zip(*ws, strict=True):
        assert torch.equal(ours.detach(), theirs.detach())
    assert optim.NS_DTYPE["cuda"] == torch.bfloat16


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_the_lm_head_takes_its_scaled_lr_and_the_rest_the_peak(kind):
    """AdamW's first step moves each weight by lr (m / sqrt(v) = sign(g) from zero state, bias-corrected):
    the lm_head's by lr * 0.1, a norm weight's by lr; Muon's matrices are unchanged by the scale."""
    moved = {}
    for scale in (1.0, 0.1):
        d = tiny_drafter()
        start = {n: q.detach().clone() for n, q in d.named_parameters()}
        opts = optim.build(d.named_parameters(), kind, 1e-2, [0.9, 0.95], 0.0, head_lr_scale=scale)
        for n, q in d.named_parameters():
            if q.requires_grad:
                q.grad = torch.randn_like(q, generator=torch.Generator().manual_seed(len(n)))
        optim.step(opts)
        moved[scale] = {n: (q.detach() - start[n]).abs() for n, q in d.named_parameters()}
    for scale, m in moved.items():
        assert torch.allclose(
            m["lm_head.weight"], torch.full_like(m["lm_head.weight"], 1e-2 * scale), rtol=1e-3
        )
        assert torch.allclose(m["norm.weight"], torch.full_like(m["norm.weight"], 1e-2), rtol=1e-3)
    assert torch.equal(moved[1.0]["fc.weight"], moved[0.1]["fc.weight"])
    with pytest.raises(ValueError, match="head_lr_scale"):
        optim.build(tiny_drafter().named_parameters(), kind, 1e-2, [0.9, 0.95], 0.0, head_lr_scale=0.0)
