"""Long sequences (`eagle_lib.drafter.longseq`): the chunked TTT attention and the chunked head + loss equal
today's eager path (full (T, T) masks and scores, whole-row logits) in loss and every gradient, fp64/fp32."""

import pytest
import torch

from eagle_lib.drafter import longseq, ttt
from eagle_lib.hidden_states.hidden import HeadTarget, TargetHead
from tests.unit.test_train import HT, V, drafter, inputs

torch.set_num_threads(1)


def packed(t: int, b: int, seed: int, cuts=(5, 17, 30)):
    """Several documents per row, positions restarting at each, padding (doc -1) at the end of row 1."""
    ids, pos, doc, aux, tl = inputs(t, seed=seed, b=b)
    for c in cuts:
        if c < t:
            doc[:, c:] += 1
    start = torch.zeros_like(doc)
    for r in range(b):
        for j in range(1, t):
            start[r, j] = start[r, j - 1] if doc[r, j] == doc[r, j - 1] else j
    pos = torch.arange(t).expand(b, t) - start
    if b > 1:
        doc[1, t - 4 :] = -1
    mask = torch.rand(b, t, generator=torch.Generator().manual_seed(seed)) < 0.8
    mask &= doc >= 0
    return ids, pos, doc, mask, aux, tl


@pytest.mark.parametrize("block", [4, 7, 64])
@pytest.mark.parametrize("i", [0, 1, 3])
def test_chunked_attention_equals_full_mask_attention_and_its_gradients(block, i):
    """Random q/k/v over a packed, padded batch: the blockwise kernel vs the (T, T) masked softmax."""
    g = torch.Generator().manual_seed(block * 10 + i)
    b, h, t, d = 2, 3, 37, 8
    _, _, doc, _, _, _ = packed(t, b, seed=i)
    q, k0, v0 = (
        torch.randn(b, h, t, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    ks = [torch.randn(b, h, t, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(i)]
    vs = [torch.randn(b, h, t, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(i)]
    same = doc[:, :, None] == doc[:, None, :]
    mask0 = (same & torch.ones_like(same).tril())[:, None]
    w = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    leaves = [q, k0, v0, *ks, *vs]
    ref = ttt.ttt_attention(q, k0, v0, mask0, ks, vs)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    got = longseq.ttt_attention_chunked(q, k0, v0, doc, ks, vs, block=block)
    g_got = torch.autograd.grad((got * w).sum(), leaves)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for a, r in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)


def test_block_pairs_skip_exactly_the_blocks_no_document_reaches():
    doc = torch.tensor([[0] * 8 + [1] * 8 + [2] * 8])  # three documents of two blocks each (block 4)
    pairs = longseq.block_pairs(doc, 4)
    assert pairs == [[0], [0, 1], [2], [2, 3], [4], [4, 5]]
    doc2 = torch.tensor([[0] * 20 + [-1] * 4])  # padding: its own "document" at the end
    assert longseq.block_pairs(doc2, 4)[5] == [5]


def _grads(model, *args):
    loss, stats = model(*args)
    return loss, stats, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("feed,recompute", [("label", False), ("drafted", False), ("label", True)])
def test_chunked_ttt_equals_eager_loss_stats_and_gradients(k, feed, recompute):
    """The whole unroll on packed multi-document rows: chunked attention + chunked head/loss (3 rows a
    chunk, block 8), with and without recomputing each step's layer, against eager; loss, every stat and
    every trainable gradient."""
    m = drafter(seed=3, n=20)
    args = packed(45, 2, seed=k)
    ref = _grads(ttt.TTT(m, k, 0.8, "eager", feed, 0.7), *args)
    model = ttt.TTT(m, k, 0.8, "chunked", feed, 0.7, loss_chunk=3, checkpoint_steps=recompute)
    import eagle_lib.drafter.longseq as ls

    old, ls.BLOCK = ls.BLOCK, 8
    try:
        got = _grads(model, *args)
    finally:
        ls.BLOCK = old
    torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], ref[1])
    for a, r in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("loss", ["soft_ce", "jsd", "lk_hybrid"])
def test_head_target_equals_its_materialised_logits(loss):
    """A HeadTarget (last hidden + final norm + lm_head, logits made per chunk) gives the loss, stats and
    gradients of the (B, T, V) logits the same head produces in one go."""
    m = drafter(seed=4, n=20)
    ids, pos, doc, mask, aux, _ = packed(30, 2, seed=2)
    g = torch.Generator().manual_seed(9)
    head = TargetHead(torch.rand(HT, generator=g, dtype=torch.float64) + 0.5,
                      torch.randn(V, HT, generator=g, dtype=torch.float64), 1e-6)  # fmt: skip
    last = torch.randn(2, 30, HT, generator=g, dtype=torch.float64)
    full = head(last)
    ref = _grads(ttt.TTT(m, 3, 0.8, "eager", loss=loss), ids, pos, doc, mask, aux, full)
    got = _grads(ttt.TTT(m, 3, 0.8, "chunked", loss=loss, loss_chunk=4), ids, pos, doc, mask, aux,
                 HeadTarget(last, head))  # fmt: skip
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    for a, r in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, r)


def test_head_target_without_loss_chunk_is_refused():
    m = drafter(seed=4, n=20)
    ids, pos, doc, mask, aux, _ = packed(10, 1, seed=2)
    head = TargetHead(torch.ones(HT, dtype=torch.float64), torch.randn(V, HT, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="loss_chunk"):
        ttt.TTT(m, 2, 0.8)(ids, pos, doc, mask, aux, HeadTarget(torch.randn(1, 10, HT).double(), head))


def test_chunked_backward_keeps_no_t_by_t_tensor():
    """What autograd saves for the chunked attention at T = 512 (block 64): no tensor with T*T elements."""
    t, saved = 512, []
    q, k0, v0 = (torch.randn(1, 2, t, 8, requires_grad=True) for _ in range(3))
    doc = torch.zeros(1, t, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        longseq.ttt_attention_chunked(q, k0, v0, doc, [k0 * 1.0], [v0 * 1.0], block=64).sum()
    assert saved and max(saved) < t * t
    saved.clear()
    same = doc[:, :, None] == doc[:, None, :]
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        ttt.ttt_attention(q, k0, v0, (same & torch.ones_like(same).tril())[:, None], [k0 * 1.0], [v0 * 1.0])
    assert max(saved) >= t * t  # the reference eager path does keep (T, T) scores: the probe sees them


def test_recomputed_steps_keep_less_for_backward():
    """checkpoint_steps: what autograd keeps for one unroll shrinks (the layer's internals are recomputed)."""
    m = drafter(seed=3, n=20)
    args = packed(64, 1, seed=1)

    def kept(**kw):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            ttt.TTT(m, 3, 0.8, "chunked", loss_chunk=16, **kw)(*args)
        return sum(sizes)

    assert kept(checkpoint_steps=True) < 0.6 * kept(checkpoint_steps=False)
