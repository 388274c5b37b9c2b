"""The drafter's optimizers (stage 05 and 07's retrainer build them here, so both train alike).

``adamw``: one AdamW over every trainable weight. ``muon``: torch's Muon (momentum, the update orthogonalised by
Newton-Schulz iterations, its RMS matched to AdamW's with ``adjust_lr_fn="match_rms_adamw"``, so the same
``learning_rate`` and schedule apply) on the hidden matrices, fc and the draft layer's attention and MLP; AdamW on
the rest (lm_head, norms), as Muon's authors split it. Muon needs whole matrices: FSDP's shards are not (05 refuses
the pair).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

KINDS = ("adamw", "muon")
_NOT_MUON = ("lm_head", "embed_tokens")  # 2-D, but a vocabulary map: AdamW


def muon_param(name: str, q: torch.Tensor) -> bool:
    """Whether ``muon`` puts this weight under Muon: a 2-D hidden matrix (not lm_head, not an embedding)."""
    return q.ndim == 2 and not any(part in name for part in _NOT_MUON)


def build(
    named: Iterable[tuple[str, torch.Tensor]], kind: str, lr: float, betas, weight_decay: float
) -> list[torch.optim.Optimizer]:
    """The optimizers over the trainable ``named`` parameters (AdamW first; with ``muon``, Muon second)."""
    named = [(n, q) for n, q in named if q.requires_grad]
    if kind not in KINDS:
        raise ValueError(f"optimizer {kind!r}: choose one of {list(KINDS)}")
    adam = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    if kind == "adamw":
        return [torch.optim.AdamW([q for _, q in named], **adam)]
    hidden = [q for n, q in named if muon_param(n, q)]
    rest = [q for n, q in named if not muon_param(n, q)]
    if not hidden:
        raise ValueError("optimizer muon: no 2-D hidden weight to put under Muon")
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    return ([torch.optim.AdamW(rest, **adam)] if rest else []) + [muon]


def step(opts: list[torch.optim.Optimizer]) -> None:
    for o in opts:
        o.step()


def zero_grad(opts: list[torch.optim.Optimizer]) -> None:
    for o in opts:
        o.zero_grad(set_to_none=True)
