"""Speculative decoding: lossless against HF greedy generate, exact accounting, drafter cache == recompute."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle_lib.drafter import Eagle3Config, Eagle3Drafter, init_from_target
from eagle_lib.specdec import (
    EagleProposer,
    NgramProposer,
    NoProposer,
    OracleProposer,
    TargetRunner,
    speculative_generate,
)

torch.set_num_threads(1)
V = 128


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=96)
    d = Eagle3Drafter(cfg)
    kept = torch.tensor(sorted(random.Random(0).sample(range(V), 96)))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    d.set_vocab_map(kept - torch.arange(96), t2d)
    init_from_target(d, target.get_input_embeddings().weight)
    return d.to(torch.float64).eval()


def hf_greedy(model, prompt, n, eos=None):
    """The reference: transformers' own greedy generate."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


PROMPTS = [[5, 17, 9, 33, 2, 71, 9, 33], [100, 3, 3, 3, 64], list(range(40, 60)) + list(range(40, 50))]


class Corrupted(OracleProposer):
    """The oracle's drafts with one wrong token at a random position: partial acceptance every step."""

    name = "corrupted"

    def __init__(self, model, seed=0):
        super().__init__(model)
        self.rng = random.Random(seed)

    def propose(self, k):
        d = super().propose(k)
        j = self.rng.randrange(k + 1)
        if j < k:
            d[j] = (d[j] + 1) % V
        return d


@pytest.mark.parametrize("kind", ["none", "ngram", "oracle", "corrupted", "eagle"])
def test_output_equals_target_greedy(target, drafter, kind):
    runner = TargetRunner(target, drafter.config.aux_layers if kind == "eagle" else None)
    for prompt in PROMPTS:
        proposer = {
            "none": NoProposer(),
            "ngram": NgramProposer(),
            "oracle": OracleProposer(target),
            "corrupted": Corrupted(target),
            "eagle": EagleProposer(drafter),
        }[kind]
        gen = speculative_generate(runner, proposer, prompt, max_new_tokens=20, k=3)
        assert gen.output_ids == hf_greedy(target, prompt, 20)
        assert all(0 <= a <= d <= 3 for a, d in zip(gen.accepted, gen.drafted, strict=True))
        # every step emits a + 1 tokens; the prefill emitted the first one
        assert 1 + sum(a + 1 for a in gen.accepted) >= 20 > sum(a + 1 for a in gen.accepted[:-1])


def test_stops_at_eos_like_generate(target):
    prompt = PROMPTS[0]
    ref = hf_greedy(target, prompt, 20)
    eos = ref[7]
    gen = speculative_generate(
        TargetRunner(target), Corrupted(target, seed=3), prompt, 20, k=3, eos_ids=[eos]
    )
    assert gen.output_ids == hf_greedy(target, prompt, 20, eos=eos)
    assert gen.output_ids[-1] == eos and eos not in gen.output_ids[:-1]


def test_oracle_accepts_everything(target):
    gen = speculative_generate(
        TargetRunner(target), OracleProposer(target), PROMPTS[1], max_new_tokens=25, k=4
    )
    assert gen.accepted == [4] * len(gen.accepted) and gen.drafted == [4] * len(gen.drafted)
    assert len(gen.accepted) == 5  # 1 token from prefill + 5 steps x 5 tokens >= 25


def test_no_proposer_is_one_token_per_step(target):
    gen = speculative_generate(TargetRunner(target), NoProposer(), PROMPTS[0], max_new_tokens=10, k=3)
    assert gen.accepted == [0] * 9 and gen.drafted == [0] * 9


def ngram_reference(seq, k, n_max, n_min):
    """Obviously-correct prompt lookup: all matches of the longest matching suffix, take the latest."""
    for n in range(n_max, n_min - 1, -1):
        if n > len(seq) - 1:
            continue
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == seq[len(seq) - n :]]
        if starts:
            i = max(starts)
            return seq[i + n : i + n + k]
    return []


def test_ngram_matches_reference():
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        p = NgramProposer(n_max=3, n_min=1)
        p.start(seq, None)
        assert p.propose(3) == ngram_reference(seq, 3, 3, 1)


def drafter_reference_drafts(drafter, ids, feats, k):
    """Chain drafts by recomputing the drafter over every row, no cache (rows: target rows then own rows)."""
    d = drafter
    hidden = d.project(feats[None])  # (1, T, H)
    tokens = list(ids)
    out = []
    for _j in range(k):
        pos = torch.arange(len(tokens))[None]
        h, logits = d(torch.tensor([tokens]), hidden, pos)
        tok = int(d.draft_to_target(logits[0, -1].argmax()))
        out.append(tok)
        tokens.append(tok)
        hidden = torch.cat([hidden, h[:, -1:]], dim=1)
    return out


def test_eagle_proposer_cache_equals_recompute(drafter):
    """start / propose / advance with crops give the drafts a cache-free recompute gives."""
    torch.manual_seed(2)
    width = 3 * drafter.config.target_hidden_size
    seq = [3, 9, 27, 81, 50, 22]
    feats = torch.randn(len(seq) - 1, width, dtype=torch.float64)
    p = EagleProposer(drafter)
    p.start(seq, feats)
    for a in [0, 2, 1, 3, 0]:
        drafts = p.propose(3)
        assert drafts == drafter_reference_drafts(drafter, seq[1:], feats, 3)
        new = drafts[:a] + [int(torch.randint(V, ()))]
        new_feats = torch.randn(len(new), width, dtype=torch.float64)
        p.advance(new, new_feats)
        seq, feats = seq + new, torch.cat([feats, new_feats])
