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
    # torch iterates in bfloat16 (measured: 1.2% relative Frobenius error against this float64 reference)
    assert float((got - want).norm() / want.norm()) < 0.03
    assert float(got.pow(2).mean().sqrt()) == pytest.approx(0.2 * 1e-2, rel=0.35)  # AdamW-like RMS
