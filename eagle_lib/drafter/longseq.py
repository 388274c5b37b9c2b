"""Long sequences in one TTT unroll: memory linear in length (attention, target log-probs, head and loss).

Attention (``attention: chunked``): the TTT pattern is block-sparse. At step ``i`` a query row ``t`` sees the
step-0 keys ``s <= t`` of its own document and the keys of steps ``1..i`` at row ``t`` only (the diagonal).
`ttt_attention_chunked` runs it blockwise with an online softmax (the flash-attention recurrence, in plain
torch so it runs on every device): query blocks of ``block`` rows visit only the key blocks their documents
can reach (documents are contiguous, so a key block whose document-id range misses the query block's is
skipped); the diagonal keys join the same softmax as ``i`` extra scores per row. Forward keeps only the
output and the row log-sum-exp; backward recomputes each block's scores from them. Peak memory is
O(T * D + block^2) per head instead of today's (T, T) mask, (T, T) scores and, for sdpa, a (T, (i+1)T) mask.

Head and loss (``loss_chunk: R``): each step's label rows go through the drafter's lm_head and the loss R rows
at a time under activation checkpointing (no (n, N_draft) logits kept for backward), and the target's
log-probs over the draft vocab are computed for those R rows only, from the target's logits at them (a
(B, T, V) tensor, or a `eagle_lib.hidden_states.hidden.HeadTarget`: the last hidden state and the target's
final norm + lm_head, so no (T, V) tensor exists at all; the dump, vLLM and kept sources return one when
``loss_chunk`` is set).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from eagle_lib.hidden_states.hidden import HeadTarget

BLOCK = 256  # rows per query / key block of the chunked attention


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def block_pairs(doc_ids: torch.Tensor, block: int) -> list[list[int]]:
    """For each query block, the key blocks (<= it) whose document-id range meets its own (any batch row)."""
    t = doc_ids.shape[1]
    nb = (t + block - 1) // block
    pad = nb * block - t
    d = (
        torch.cat([doc_ids, doc_ids[:, -1:].expand(-1, pad)], 1) if pad else doc_ids
    )  # the tail repeats the last
    d = d.view(d.shape[0], nb, block)
    lo, hi = d.amin(-1).amin(0).tolist(), d.amax(-1).amax(0).tolist()  # per block over the batch
    return [[kb for kb in range(qb + 1) if lo[kb] <= hi[qb] and lo[qb] <= hi[kb]] for qb in range(nb)]


def _mask(doc_ids, qs: slice, ks: slice, diagonal: bool) -> torch.Tensor:
    """(B, 1, Cq, Ck): same document, and key <= query inside the diagonal block."""
    m = doc_ids[:, qs, None] == doc_ids[:, None, ks]
    if diagonal:
        m = m & torch.ones(m.shape[1:], dtype=torch.bool, device=m.device).tril()
    return m[:, None]


class _ChunkedTTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, doc_ids, block):
        # q, k0, v0 (B, h, T, D); kd, vd (B, h, T, i, D) (i may be 0); doc_ids (B, T)
        b, h, t, dim = q.shape
        scale = dim**-0.5
        pairs = block_pairs(doc_ids, block)
        dv = v0.shape[-1]  # the value width (MLA: v_head_dim, not the query/key width)
        out = torch.empty(b, h, t, dv, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        lse = torch.empty(b, h, t, dtype=out.dtype, device=q.device)
        for qb, kbs in enumerate(pairs):
            qs = slice(qb * block, min(t, (qb + 1) * block))
            qq = _fp32(q[:, :, qs]) * scale
            m = torch.full(qq.shape[:-1], float("-inf"), dtype=qq.dtype, device=q.device)
            den = torch.zeros_like(m)
            acc = qq.new_zeros(*qq.shape[:-1], dv)
            for kb in kbs:
                ks = slice(kb * block, min(t, (kb + 1) * block))
                s = qq @ _fp32(k0[:, :, ks]).transpose(-1, -2)
                s.masked_fill_(~_mask(doc_ids, qs, ks, kb == qb), float("-inf"))
                m, den, acc = _online(m, den, acc, s, lambda p, ks=ks: p @ _fp32(v0[:, :, ks]))
            if kd.shape[3]:
                s = (qq[..., None, :] * _fp32(kd[:, :, qs])).sum(-1)  # (B, h, C, i)
                m, den, acc = _online(
                    m, den, acc, s, lambda p, qs=qs: (p[..., None] * _fp32(vd[:, :, qs])).sum(-2)
                )
            out[:, :, qs] = acc / den[..., None]
            lse[:, :, qs] = m + den.log()
        ctx.save_for_backward(q, k0, v0, kd, vd, doc_ids, out, lse)
        ctx.block, ctx.pairs = block, pairs
        return out.to(v0.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, kd, vd, doc_ids, out, lse = ctx.saved_tensors
        block, pairs = ctx.block, ctx.pairs
        t, dim = q.shape[2], q.shape[3]
        scale = dim**-0.5
        do = _fp32(dout)
        dl = (do * out).sum(-1)  # (B, h, T)
        dq, dk0 = (torch.zeros(q.shape, dtype=out.dtype, device=q.device) for _ in range(2))
        dv0 = torch.zeros(v0.shape, dtype=out.dtype, device=q.device)
        dkd = torch.zeros(kd.shape, dtype=out.dtype, device=q.device)
        dvd = torch.zeros(vd.shape, dtype=out.dtype, device=q.device)
        for qb, kbs in enumerate(pairs):
            qs = slice(qb * block, min(t, (qb + 1) * block))
            qq = _fp32(q[:, :, qs]) * scale
            dob, lb, db = do[:, :, qs], lse[:, :, qs, None], dl[:, :, qs, None]
            for kb in kbs:
                ks = slice(kb * block, min(t, (kb + 1) * block))
                kk, vv = _fp32(k0[:, :, ks]), _fp32(v0[:, :, ks])
                s = qq @ kk.transpose(-1, -2)
                s.masked_fill_(~_mask(doc_ids, qs, ks, kb == qb), float("-inf"))
                p = (s - lb).exp()  # masked scores -> 0
                dv0[:, :, ks] += p.transpose(-1, -2) @ dob
                ds = p * (dob @ vv.transpose(-1, -2) - db)
                dq[:, :, qs] += ds @ kk
                dk0[:, :, ks] += ds.transpose(-1, -2) @ qq
            if kd.shape[3]:
                kk, vv = _fp32(kd[:, :, qs]), _fp32(vd[:, :, qs])  # (B, h, C, i, D)
                p = ((qq[..., None, :] * kk).sum(-1) - lb).exp()  # (B, h, C, i)
                dvd[:, :, qs] = p[..., None] * dob[..., None, :]
                ds = p * ((dob[..., None, :] * vv).sum(-1) - db)
                dq[:, :, qs] += (ds[..., None] * kk).sum(-2)
                dkd[:, :, qs] = ds[..., None] * qq[..., None, :]
        dq *= scale
        return (
            dq.to(q.dtype),
            dk0.to(k0.dtype),
            dv0.to(v0.dtype),
            dkd.to(kd.dtype),
            dvd.to(vd.dtype),
            None,
            None,
        )


def _online(m, den, acc, s, pv):
    """One online-softmax update with new scores s (..., n) and their value product pv(p) (..., D)."""
    m_new = torch.maximum(m, s.amax(-1))
    safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with nothing seen yet
    alpha = (m - safe).exp()
    p = (s - safe[..., None]).exp()
    return m_new, den * alpha + p.sum(-1), acc * alpha[..., None] + pv(p)


def ttt_attention_chunked(q, k0, v0, doc_ids, ks: list, vs: list, block: int | None = None) -> torch.Tensor:
    """`eagle_lib.drafter.ttt.ttt_attention`'s result (q (B,h,T,D) over step-0 keys of the same document up to
    each row, plus the diagonal keys ks/vs of later steps), blockwise; takes ``doc_ids`` (B, T), not a mask."""
    b, h, t, dim = q.shape
    if ks:
        kd, vd = torch.stack(ks, 3), torch.stack(vs, 3)
    else:
        kd, vd = q.new_zeros(b, h, t, 0, dim), v0.new_zeros(b, h, t, 0, v0.shape[-1])
    return _ChunkedTTTAttention.apply(q, k0, v0, kd, vd, doc_ids, block or BLOCK)


def target_rows(target, bi: torch.Tensor, ti: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
    """(n, V) target logits at rows (bi, ti) of a (B, T, V) tensor or a `HeadTarget`; with `cols`, (n, len(cols))
    of those vocabulary ids only (a `HeadTarget` then multiplies by those lm_head rows alone: V / N less work)."""
    if isinstance(target, HeadTarget):
        return target.rows(bi, ti, cols)
    return target[bi, ti] if cols is None else target[bi, ti][:, cols]


@torch.no_grad()
def target_argmax(target, chunk: int) -> torch.Tensor:
    """(B, T) the target's argmax over its whole vocab, ``chunk`` rows at a time."""
    if isinstance(target, HeadTarget) and target.argmax is not None:
        return target.argmax  # the source's (07's kept source computes each sequence's once)
    b, t = target.shape[:2]
    bi, ti = (x.reshape(-1) for x in torch.meshgrid(torch.arange(b), torch.arange(t), indexing="ij"))
    dev = target.last.device if isinstance(target, HeadTarget) else target.device
    bi, ti = bi.to(dev), ti.to(dev)
    out = [
        target_rows(target, bi[i : i + chunk], ti[i : i + chunk]).argmax(-1) for i in range(0, b * t, chunk)
    ]
    return torch.cat(out).view(b, t) if out else torch.zeros(b, t, dtype=torch.long, device=dev)


def chunked_head_loss(drafter, out_rows, target, bi, ti, objective, chunk: int, full_vocab: bool = False):
    """Sum of per-position losses over label rows and the drafter's argmax (draft ids), ``chunk`` rows at a time.

    out_rows (n, H) the drafter's pre-norm outputs at the label rows; (bi, ti) the target rows they read; the
    target's logits at them (the draft vocab's columns, or the whole vocab with ``full_vocab``: a nucleus needs
    it) are made per chunk and ``objective(target rows, draft logits) -> (n,)`` gives the loss. Returns
    ((n,) loss per row, (n,) draft argmax); each chunk's head + loss run under checkpoint, so backward keeps
    (n, H), not (n, N_draft).
    """
    ids = drafter.draft_ids()
    losses, arg = [], []
    for i in range(0, out_rows.shape[0], chunk):
        with torch.no_grad():
            tl = _fp32(target_rows(target, bi[i : i + chunk], ti[i : i + chunk], None if full_vocab else ids))

        def f(x, tl=tl):
            z = _fp32(drafter.head(x))
            return objective(tl, z), z.detach().argmax(-1)

        x = out_rows[i : i + chunk]
        ce, a = checkpoint(f, x, use_reentrant=False) if x.requires_grad else f(x)
        losses.append(ce)
        arg.append(a)
    if not losses:
        z = out_rows.new_zeros(0)
        return z, z.long()
    return torch.cat(losses), torch.cat(arg)
