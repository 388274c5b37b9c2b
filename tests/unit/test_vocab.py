"""Draft vocab map: top-N by label frequency, the d2t/t2d convention, checks and the keyed cache."""

import random
from collections import Counter

import numpy as np
import pytest
import torch

from eagle_lib import models
from eagle_lib.drafter import vocab


def random_data(seed=0, n=40, v=50):
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        t = rnd.randint(1, 30)
        ids = [min(v - 1, int(rnd.expovariate(0.15))) for _ in range(t)]
        mask = [rnd.random() < 0.6 for _ in range(t)]
        out.append((ids, [int(m) for m in mask]))
    return out


def slow_top_n(data, n, v):
    """Counter over label positions, sorted by (-count, id); the draft vocab in target-id order."""
    c = Counter(tok for ids, mask in data for tok, m in zip(ids, mask, strict=True) if m)
    ranked = sorted(range(v), key=lambda i: (-c.get(i, 0), i))
    return sorted(ranked[:n]), c


@pytest.mark.parametrize("seed,n", [(0, 10), (1, 25), (2, 50), (3, 1)])
def test_map_matches_slow_reference(seed, n):
    v = 50
    data = random_data(seed, v=v)
    counts = vocab.count_label_tokens(data, v)
    kept, c = slow_top_n(data, n, v)
    assert [int(counts[i]) for i in range(v)] == [c.get(i, 0) for i in range(v)]
    d2t, t2d = vocab.build_vocab_map(counts, n)
    assert [i + int(d2t[i]) for i in range(n)] == kept  # target_id = draft_id + d2t[draft_id]
    assert [i for i in range(v) if t2d[i]] == kept
    total = sum(c.values())
    assert vocab.coverage(counts, t2d) == pytest.approx(sum(c[i] for i in kept) / total)


def test_only_label_positions_count():
    counts = vocab.count_label_tokens([([5, 6, 7, 5], [0, 1, 0, 1]), ([7, 7], [0, 0])], 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]


def test_bad_maps_are_rejected():
    d2t, t2d = vocab.build_vocab_map(np.array([5, 0, 3, 9, 1, 2]), 3)
    vocab.check_vocab_map(d2t, t2d)
    with pytest.raises(vocab.VocabMapError, match="strictly increasing"):
        vocab.check_vocab_map(torch.tensor([3, 0, 0]), t2d)
    with pytest.raises(vocab.VocabMapError, match="t2d.sum"):
        bad = t2d.clone()
        bad[1] = True
        vocab.check_vocab_map(d2t, bad)
    with pytest.raises(vocab.VocabMapError, match="outside"):
        vocab.check_vocab_map(torch.tensor([0, 0, 5]), t2d)
    with pytest.raises(vocab.VocabMapError, match="draft vocab size"):
        vocab.build_vocab_map(np.array([1, 2]), 3)
    with pytest.raises(vocab.VocabMapError, match="outside the target vocab"):
        vocab.count_label_tokens([([3, 12], [1, 1])], 10)


def test_cache_is_keyed_and_reused(tmp_path):
    data = random_data(4)
    calls = []

    def seqs():
        calls.append(1)
        return iter(data)

    key = vocab.cache_key("tok", "data", 12)
    d1, t1, c1, cached1 = vocab.load_or_build(tmp_path, key, 12, 50, seqs)
    d2, t2, c2, cached2 = vocab.load_or_build(tmp_path, key, 12, 50, seqs)
    assert (cached1, cached2, len(calls)) == (False, True, 1)
    assert torch.equal(d1, d2) and torch.equal(t1, t2) and np.array_equal(c1, c2)
    assert (
        len(
            {
                vocab.cache_key("tok", "data", 12),
                vocab.cache_key("tok2", "data", 12),
                vocab.cache_key("tok", "data2", 12),
                vocab.cache_key("tok", "data", 13),
            }
        )
        == 4
    )


def test_tokenizer_fingerprint_changes_with_the_table():
    class Tok:
        def __init__(self, v):
            self.v, self.all_special_tokens = v, ["<s>"]

        def get_vocab(self):
            return self.v

    assert models.tokenizer_fingerprint(Tok({"a": 0, "b": 1})) != models.tokenizer_fingerprint(
        Tok({"a": 1, "b": 0})
    )
