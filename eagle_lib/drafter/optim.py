"""The drafter's optimizers (stage 05 and 07's retrainer build them here, so both train alike).

``adamw``: one AdamW over every trainable weight. ``muon``: torch's Muon (momentum, the update orthogonalised by
Newton-Schulz iterations, its RMS matched to AdamW's with ``adjust_lr_fn="match_rms_adamw"``, so the same
``learning_rate`` and schedule apply) on the hidden matrices, fc and the draft layer's attention and MLP; AdamW on
the rest (lm_head, norms), as Muon's authors split it. Muon needs whole matrices: FSDP's shards are not (05 refuses
the pair).

`Muon` is torch's, except for the precision of the Newton-Schulz iterations: torch runs them in bfloat16, which a
GPU (or a CPU with AMX) multiplies natively but an AVX2 or AVX-512 CPU without avx512_bf16 emulates. There the
bfloat16 iterations were 87% of a real-model step (py-spy, the SmolLM2 drafter's 8 Muon matrices on an AVX2
EPYC: ~30 s of a 34 s step of 512 tokens; `benchmarks/bench_muon.py` measures it side by side). On a CPU they run in float32:
the same update up to bfloat16's rounding (~1% of its norm), at a fraction of the cost; on CUDA in bfloat16, as
torch and the peers do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

KINDS = ("adamw", "muon")
# device type -> the Newton-Schulz iterations' dtype; float32 elsewhere (the module docstring)
NS_DTYPE = {"cuda": torch.bfloat16}
_NOT_MUON = ("lm_head", "embed_tokens")  # 2-D, but a vocabulary map: AdamW


def muon_param(name: str, q: torch.Tensor) -> bool:
    """Whether ``muon`` puts this weight under Muon: a 2-D hidden matrix (not lm_head, not an embedding)."""
    return q.ndim == 2 and not any(part in name for part in _NOT_MUON)


def build(
    named: Iterable[tuple[str, torch.Tensor]],
    kind: str,
    lr: float,
    betas,
    weight_decay: float,
    head_lr_scale: float = 1.0,
) -> list[torch.optim.Optimizer]:
    """The optimizers over the trainable ``named`` parameters (AdamW first; with ``muon``, Muon second). The
    lm_head, an AdamW weight under either kind, takes ``lr * head_lr_scale`` (its own param group)."""
    named = [(n, q) for n, q in named if q.requires_grad]
    if kind not in KINDS:
        raise ValueError(f"optimizer {kind!r}: choose one of {list(KINDS)}")
    if head_lr_scale <= 0:
        raise ValueError(f"head_lr_scale {head_lr_scale}: must be > 0 (freeze_lm_head keeps it fixed)")
    adam = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    hidden = [q for n, q in named if kind == "muon" and muon_param(n, q)]
    adamw = [(n, q) for n, q in named if not (kind == "muon" and muon_param(n, q))]
    if head_lr_scale == 1.0:  # one group, as a checkpoint's optimizer state written before the scale has it
        groups = [{"params": [q for _, q in adamw]}] if adamw else []
    else:
        head = [q for n, q in adamw if "lm_head" in n]
        rest = [q for n, q in adamw if "lm_head" not in n]
        groups = [g for g in ({"params": rest}, {"params": head, "lr": lr * head_lr_scale}) if g["params"]]
    if kind == "adamw":
        return [torch.optim.AdamW(groups, **adam)]
    if not hidden:
        raise ValueError("optimizer muon: no 2-D hidden weight to put under Muon")
    muon = Muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    return ([torch.optim.AdamW(groups, **adam)] if groups else []) + [muon]


def for_recipe(named: Iterable[tuple[str, torch.Tensor]], p) -> list[torch.optim.Optimizer]:
    """`build` with a stage-05 recipe's (`recipe.Params`) optimizer settings."""
    return build(named, p.optimizer, p.learning_rate, p.adam_betas, p.weight_decay, p.lm_head_lr_scale)


def newton_schulz(g: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Muon's quintic iteration X <- aX + (bA + cA^2)X with A = X X^T, from X = G/||G||_F, on the wide side of G,
    in `dtype` (torch's own is bfloat16)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon (same arguments, state and update: Nesterov momentum, Newton-Schulz, the adjusted lr,
    decoupled weight decay) with the Newton-Schulz iterations in `NS_DTYPE` of the parameter's device."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = float(group["lr"]), group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                dtype = NS_DTYPE.get(p.device.type, torch.float32)
                update = newton_schulz(
                    update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype
                )
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def adjusted_lr(lr: float, rule: str | None, shape) -> float:
    """torch's Muon learning-rate rules: "match_rms_adamw" scales by 0.2 sqrt(max(A, B)) (the update's RMS then
    matches AdamW's), "original" (or None) by sqrt(max(1, A/B))."""
    a, b = shape[:2]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    if rule in (None, "original"):
        return lr * math.sqrt(max(1, a / b))
    return lr


def step(opts: list[torch.optim.Optimizer]) -> None:
    for o in opts:
        o.step()


def zero_grad(opts: list[torch.optim.Optimizer]) -> None:
    for o in opts:
        o.zero_grad(set_to_none=True)
