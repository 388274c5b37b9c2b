"""benchmarks/quality_diag.py (teacher-forced acceptance per draft position and target confidence of the real
bench's drafters): its bucket, position and contribution arithmetic against hand-computed values, and its
teacher-forced chain against the real decoder (the first verify step of each prompt, and the proposer's drafts
at every row) and 05's TTT counts, on a tiny random Llama with a drafter fitted to its answers."""

import sys
from pathlib import Path

import pytest
import torch

from eagle_lib.decoding import specdec
from tests.support import eagle_tiny
from tests.support import models as tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import quality_diag as qd  # noqa: E402

K, V, AUX = 3, 128, [1, 2, 3]


@pytest.mark.parametrize(
    ("p", "b"), [(0.0, 0), (0.2999, 0), (0.3, 1), (0.6, 2), (0.8999, 2), (0.9, 3), (1.0, 3)]
)
def test_bucket_edges(p, b):
    assert qd.bucket_of(p) == b


def test_buckets_and_contributions_by_hand():
    conf = [0.1, 0.2, 0.5, 0.7, 0.95, 1.0, 0.3, 0.9]
    ours = [True, False, False, True, True, True, False, False]
    peer = [False, False, True, True, False, False, False, True]
    got = qd.by_bucket(conf, ours)
    # buckets: {0.1, 0.2} {0.5, 0.3} {0.7} {0.95, 1.0, 0.9}
    assert [b["n"] for b in got] == [2, 2, 1, 3]
    assert [b["share"] for b in got] == pytest.approx([0.25, 0.25, 0.125, 0.375])
    assert [b["acc"] for b in got] == pytest.approx([0.5, 0.0, 1.0, 2 / 3])
    peer_acc = [b["acc"] for b in qd.by_bucket(conf, peer)]
    assert peer_acc == pytest.approx([0.0, 0.5, 1.0, 1 / 3])
    parts = qd.contributions([0.25, 0.25, 0.125, 0.375], [0.5, 0.0, 1.0, 2 / 3], peer_acc)
    assert parts == pytest.approx([0.125, -0.125, 0.0, 0.125])
    # the parts add up to the overall gap: 4/8 - 3/8
    assert sum(parts) == pytest.approx(sum(ours) / 8 - sum(peer) / 8)


def test_empty_bucket_has_no_acceptance_and_no_part():
    got = qd.by_bucket([0.95, 0.99], [True, False])
    assert [b["n"] for b in got] == [0, 0, 0, 2] and got[0]["acc"] != got[0]["acc"]  # NaN
    assert qd.contributions([0.0, 1.0], [float("nan"), 0.5], [float("nan"), 0.25]) == [0.0, 0.25]


def test_position_acceptance_by_hand():
    T, F = True, False
    hit = [[T, T, F], [T, F, T], [F, T, T], [T, T, F], [T, F, F]]
    has = [[T, T, T], [T, T, T], [T, T, T], [T, T, F], [T, F, F]]
    unc, cond = qd.position_acceptance(hit, has)
    # 1: rows 1, 2, 4, 5 of 5; 2: drafts 1-2 right in rows 1 and 4, of the 4 rows with a second label, given
    # draft 1 right: of rows 1, 2, 4; 3: none (row 2's third draft is right after a wrong second), of rows 1-3
    assert unc == pytest.approx([0.8, 0.5, 0.0])
    assert cond == pytest.approx([0.8, 2 / 3, 0.0])


def test_rows_cover_the_continuation_and_align_each_draft_with_its_label():
    seq = {"ids": [10, 11, 12, 13, 14, 15], "n": 3, "conf": torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])}
    drafts = torch.zeros(5, K, dtype=torch.long)
    drafts[2] = torch.tensor([14, 99, 7])  # row 2 (token 13) drafts 14, 15, -
    drafts[3] = torch.tensor([15, 0, 0])  # row 3 (token 14) drafts 15, -, -
    r = qd.rows_of(seq, drafts, K)
    assert r["conf"] == pytest.approx([0.4, 0.5])  # the target's confidence where 14 and 15 are drawn
    assert r["has"] == [[True, True, False], [True, False, False]]
    assert r["hit"] == [[True, False, False], [True, False, False]]


def test_select_prompts_keeps_the_first_of_each_dataset():
    ps = [{"dataset": d, "i": i} for i, d in enumerate("aabacb")]
    assert [p["i"] for p in qd.select_prompts(ps, 1)] == [0, 2, 4]
    assert len(qd.select_prompts(ps, 0)) == 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A float64 tiny target, 8 prompts with its greedy continuations and features, a drafter (draft vocab 96)
    fitted to them so that drafts are accepted at every position."""
    torch.set_num_threads(1)
    target = tiny.llama(0, torch.float64, lm_head_scale=8.0, vocab_size=V, num_hidden_layers=4,
                        tie_word_embeddings=False)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    prompts = [{"id": f"p{i}", "dataset": "d", "group": "g", "prompt_ids": torch.randint(0, V, (5 + 2 * i,),
                generator=g).tolist()} for i in range(8)]  # fmt: skip
    seqs = qd.target_material(
        tmp_path_factory.mktemp("diag"), target, prompts, {"paths": {}, "eos": []}, 16, AUX
    )
    d = tiny.drafter(target.config, 96, seed=1, aux_layers=AUX).double()
    data = []
    for s in seqs:
        x = torch.tensor(s["ids"])
        y = torch.full((len(x) - 1,), -100)
        y[:-1] = torch.where(d.t2d[x[2:]], d.t2d.long().cumsum(0)[x[2:]] - 1, -100)  # draft-vocab index
        data.append((x[1:], s["feats"][:-1], y, s["n"] - 2))
    eagle_tiny.memorize(d, data, 120, lr=1e-2)
    return target, d, seqs


def test_greedy_continuation_is_the_targets_greedy_generate(world):
    target, _, seqs = world
    for s in seqs[:3]:
        out = target.generate(torch.tensor([s["prompt_ids"]]), max_new_tokens=16, do_sample=False,
                              attention_mask=torch.ones(1, s["n"], dtype=torch.long), pad_token_id=0)  # fmt: skip
        assert s["ids"] == out[0].tolist()


def test_chain_is_the_decoders_at_every_row_first_steps_and_ttt_agree(world):
    target, d, seqs = world
    drafts = [qd.chain(d, s["ids"], s["feats"], K) for s in seqs]
    for s, dr in zip(seqs[:3], drafts[:3], strict=True):  # the decoding proposer after every prefix
        for r in range(s["n"] - 1, len(s["ids"]) - 1):
            p = specdec.EagleProposer(d)
            p.start(s["ids"][: r + 2], s["feats"][: r + 1])
            assert p.propose(K) == dr[r].tolist()
    runner = qd.MemoRunner(target, AUX)
    assert qd.first_step_check(d, runner, seqs, drafts, K, []) == []
    assert qd.first_step_check(d, runner, seqs, drafts, K, []) == []  # again, from the kept prefills
    rows = [qd.rows_of(s, dr, K) for s, dr in zip(seqs, drafts, strict=True)]
    assert [qd.ttt_check(d, s, r, K) for s, r in zip(seqs, rows, strict=True)] == [None] * len(seqs)
    # not vacuous: drafts are accepted at every position, and first drafts at the wrong row are caught
    unc, _ = qd.position_acceptance([h for r in rows for h in r["hit"]], [h for r in rows for h in r["has"]])
    assert min(unc) > 0.05
    shifted = [torch.roll(dr, 1, 0) for dr in drafts]
    assert len(qd.first_step_check(d, runner, seqs, shifted, K, [])) >= 4
