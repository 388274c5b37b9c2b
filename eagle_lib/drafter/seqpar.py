"""Sequence parallel TTT (Ulysses): one packed row's tokens split across the ranks of a group.

Every rank of a group of P holds the whole micro-batch's small per-token inputs (ids, positions, documents,
loss mask; the target's aux features and logits or last hidden) but computes only its slice of T / P rows:
fc, the decoder layer's projections and MLP, the lm_head and the loss. Attention needs every row of a
document, so around it the queries, keys and values go from (B, heads, T / P, D) to (B, heads / P, T, D) by
one all-to-all (each rank then attends over the whole sequence for its share of the heads, with the same
chunked or eager kernel as one process) and the output comes back by the inverse all-to-all; their backward is
the same exchange of gradients. The loss of a step is normalised by the group's label count, so the ranks'
losses add up to one process's loss: `TTT` returns the local part times P, which the data-parallel gradient
average over all ranks (DDP / FSDP) turns into the group's sum.

`Shard()` with no group is the identity: one process, the whole row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (P chunks): chunk j goes to rank j; backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class Shard:
    """This rank's part of a sequence-parallel group (`group`, `size` ranks, index `rank` in it)."""

    def __init__(self, group=None, size: int = 1, rank: int = 0):
        if size > 1 and group is None and not dist.is_initialized():
            raise ValueError("sequence parallel needs an initialised process group")
        self.group, self.size, self.rank = group, size, rank

    def bounds(self, t: int) -> tuple[int, int]:
        if t % self.size:
            raise ValueError(f"sequence parallel over {self.size} ranks needs T divisible by it (T = {t})")
        n = t // self.size
        return self.rank * n, (self.rank + 1) * n

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """x[:, this rank's rows] along dim 1."""
        if self.size == 1:
            return x
        a, b = self.bounds(x.shape[1])
        return x[:, a:b]

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, T/P, D) local rows of every head -> (B, h/P, T, D) every row of this rank's heads."""
        if self.size == 1:
            return x
        b, h, tl, d = x.shape
        if h % self.size:
            raise ValueError(f"sequence parallel over {self.size} ranks needs heads divisible by it ({h})")
        y = _AllToAll.apply(x.view(b, self.size, h // self.size, tl, d).transpose(0, 1), self.group)
        return y.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * tl, d)

    def to_rows(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_heads`: (B, h/P, T, D) -> (B, h, T/P, D)."""
        if self.size == 1:
            return y
        b, hp, t, d = y.shape
        x = _AllToAll.apply(y.view(b, hp, self.size, t // self.size, d).permute(2, 0, 1, 3, 4), self.group)
        return x.transpose(0, 1).reshape(b, hp * self.size, t // self.size, d)

    @torch.no_grad()
    def total(self, x: torch.Tensor) -> torch.Tensor:
        """The group's sum of a count (no gradient)."""
        if self.size == 1:
            return x
        x = x.clone()
        dist.all_reduce(x, group=self.group)
        return x


def groups(world: int, rank: int, size: int) -> Shard:
    """Consecutive ranks form groups of `size` (every rank must call this: new_group is collective)."""
    if size <= 1:
        return Shard()
    if world % size:
        raise ValueError(f"sequence_parallel {size} must divide the world size {world}")
    mine = None
    for start in range(0, world, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = g
    return Shard(mine, size, rank % size)
