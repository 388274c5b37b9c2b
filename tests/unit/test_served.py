"""The served-temperature objective (`eagle_lib.drafter.served`): hand-computed target distributions under the
nucleus, the terms a served recipe makes, the loss it trains against the acceptance rate the real accept/reject
rule measures, and the unroll's chunked head equal to its eager one with a nucleus term."""

import math

import pytest
import torch

from eagle_lib import params
from eagle_lib.decoding.sampling import Sampler, draft_sampler
from eagle_lib.drafter import recipe, served, ttt
from tests.unit.test_longseq import packed
from tests.unit.test_train import drafter

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)  # softmax: .6439 .2369 .0871 .0321
COLS = torch.tensor([0, 2, 3])  # the draft vocab: token 1 is outside it


def _term(top_p, t=1.0, loss="tv"):
    return served.Term(t, t, t, top_p, loss, 1.0)


def test_the_nucleus_is_taken_over_the_whole_vocab_before_the_draft_vocab_restriction():
    # top_p 0.9: tokens 0, 1, 2 (the mass before token 2 is .8808 < .9); in the draft vocab 0 and 2 remain
    e2 = math.exp(2.0)
    got = served.target_logprobs(LOGITS, COLS, _term(0.9)).exp()[0].tolist()
    assert got == pytest.approx([e2 / (e2 + 1), 1 / (e2 + 1), 0.0], abs=1e-12)
    # top_p 0.7: tokens 0 and 1 (.6439 before token 1 < .7), only token 0 is in the draft vocab
    assert served.target_logprobs(LOGITS, COLS, _term(0.7)).exp()[0].tolist() == pytest.approx([1, 0, 0])
    # no nucleus at T = 2: softmax(logits / 2) over the draft columns
    x = [1.0, 0.0, -0.5]
    ref = [math.exp(v) / sum(math.exp(u) for u in x) for v in x]
    got2 = served.target_logprobs(LOGITS[:, COLS], None, _term(1.0, t=2.0)).exp()[0].tolist()
    assert got2 == pytest.approx(ref, abs=1e-12)


def test_the_draft_vocabs_share_of_the_served_distribution_equals_its_hand_value():
    """The ceiling of a probabilistic draft's acceptance rate at T: the mass of the target's served distribution on
    the draft ids (token 1 is outside the draft vocab)."""
    e, e2, em1 = math.e, math.exp(2.0), math.exp(-1.0)
    # top_p 0.9 keeps tokens 0, 1, 2 (.6439 + .2369 + .0871); of those, 0 and 2 are draft ids
    got = served.vocab_mass(LOGITS, COLS, _term(0.9))
    assert got.tolist() == pytest.approx([(e2 + 1) / (e2 + e + 1)], abs=1e-12)  # 0.7553
    assert served.vocab_mass(LOGITS, COLS, _term(1.0)).tolist() == pytest.approx(
        [(e2 + 1 + em1) / (e2 + e + 1 + em1)], abs=1e-12
    )
    # T = 2, no nucleus: softmax(logits / 2) = exp(1, .5, 0, -.5) / Z
    z = [math.exp(v) for v in (1.0, 0.5, 0.0, -0.5)]
    assert served.vocab_mass(LOGITS, COLS, _term(1.0, t=2.0)).tolist() == pytest.approx(
        [(z[0] + z[2] + z[3]) / sum(z)], abs=1e-12
    )


def test_heldout_evaluation_reports_the_served_vocab_mass_of_the_first_drafts_labels():
    """`ttt.evaluate`'s accumulator over the unroll's first-draft label rows equals the mass computed row by row
    from the target's logits in plain Python (nucleus by sorting each row's probabilities)."""
    m = drafter(seed=3, n=20)
    ids, pos, doc, mask, aux, tl = packed(45, 2, seed=1)
    terms = served.terms([0.0, 1.0], 0.9, [], 0.5, "soft_ce", "tv")
    model = ttt.TTT(m, 3, 0.8, "eager", terms=terms)
    model.confidence = torch.zeros(2, len(ttt.CONFIDENCE_EDGES) + 1, dtype=torch.float64)
    model.served_mass = torch.zeros(1, 2, dtype=torch.float64)
    with torch.no_grad():
        model(ids, pos, doc, mask, aux, tl)
    draft = set(m.draft_ids().tolist())
    masses = []
    b, t = ids.shape
    for r in range(b):
        for j in range(
            t - 2
        ):  # row j reads the target at j + 1 and is trained on token j + 2 of its document
            if not (mask[r, j + 2] and doc[r, j + 2] == doc[r, j] and doc[r, j] >= 0):
                continue
            row = [math.exp(v) for v in tl[r, j + 1].double().tolist()]
            probs = [v / sum(row) for v in row]
            kept, before = set(), 0.0
            for v in sorted(range(len(probs)), key=lambda v: -probs[v]):
                if before >= 0.9:
                    break
                kept.add(v)
                before += probs[v]
            masses.append(sum(probs[v] for v in kept & draft) / sum(probs[v] for v in kept))
    assert len(masses) > 20 and min(masses) < max(
        masses
    )  # the draft vocab (20 of 64) cuts some rows, not all
    n = model.served_mass[0, 1].item()
    assert n == len(masses)
    assert model.served_mass[0, 0].item() / n == pytest.approx(sum(masses) / len(masses), abs=1e-9)


def test_a_nucleus_wholly_outside_the_draft_vocab_falls_back_to_the_untruncated_row():
    logits = torch.tensor([[0.0, 5.0, 0.0]], dtype=torch.float64)  # token 1 holds > 0.95 of the mass
    got = served.target_logprobs(logits, torch.tensor([0, 2]), _term(0.5))
    assert torch.isfinite(got).all() and got.exp()[0].tolist() == pytest.approx([0.5, 0.5])


def test_tv_and_kl_against_a_truncated_target_equal_their_hand_computed_values():
    e2 = math.exp(2.0)
    p = [e2 / (e2 + 1), 1 / (e2 + 1), 0.0]
    q = [0.5, 0.25, 0.25]
    z = torch.tensor([q], dtype=torch.float64).log()
    tv = served.objective(LOGITS, COLS, z, [_term(0.9)])
    assert float(tv) == pytest.approx(1 - (0.5 + p[1] + 0.0), abs=1e-12)
    kl = served.objective(LOGITS, COLS, z, [_term(0.9, loss="forward_kl")])
    assert float(kl) == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0))
    # T = 2 divides the draft logits too: q = softmax(log q / 2) = sqrt(q) normalised; p = softmax(l / 2)
    sq = [math.sqrt(v) for v in q]
    q2 = [v / sum(sq) for v in sq]
    x = [1.0, 0.0, -0.5]
    p2 = [math.exp(v) / sum(math.exp(u) for u in x) for v in x]
    got = served.objective(LOGITS[:, COLS], None, z, [_term(1.0, t=2.0)])
    assert float(got) == pytest.approx(1 - sum(min(a, b) for a, b in zip(p2, q2, strict=True)), abs=1e-12)


def test_one_minus_the_sampled_term_is_the_acceptance_rate_the_accept_reject_rule_measures():
    """The reference is the sampler itself: drafts drawn as vLLM draws them (softmax(z / T), no nucleus)
    judged by `Sampler.verify` against the target at (T, top_p); 40,000 trials, within 4 standard errors."""
    g = torch.Generator().manual_seed(0)
    v, t, top_p = 12, 0.8, 0.9
    target = torch.randn(1, v, generator=g, dtype=torch.float64) * 2
    z = torch.randn(1, v, generator=g, dtype=torch.float64) * 2
    predicted = 1 - float(served.objective(target, torch.arange(v), z, [_term(top_p, t=t)]))
    judge = Sampler(t, top_p, 0, seed=1)
    drafts = draft_sampler("probabilistic", t, seed=2)
    q = torch.softmax(z[0] / t, -1)
    n = 40_000
    accepted = sum(judge.verify([drafts.draw(q)], torch.cat([target, target]), q[None])[0] for _ in range(n))
    se = math.sqrt(predicted * (1 - predicted) / n)
    assert abs(accepted / n - predicted) < 4 * se
    # greedy drafts are accepted with p(argmax q) alone, below the sampled draft's rate here
    p = Sampler(t, top_p).probs(target[0])
    assert float(p[int(z.argmax())]) < predicted


def test_a_served_recipe_makes_one_term_per_temperature_and_refuses_infinite_losses():
    ts = served.terms([0.0, 1.0], 0.95, [], 0.1, "soft_ce", "tv")
    assert ts == [
        served.Term(0.0, 0.1, 1.0, 1.0, "soft_ce", 0.5),
        served.Term(1.0, 1.0, 1.0, 0.95, "tv", 0.5),
    ]
    assert served.terms([], 1.0, [], 0.25, "jsd", "tv") == [served.Term(0.0, 0.25, 1.0, 1.0, "jsd", 1.0)]
    with pytest.raises(ValueError, match="infinite where the target's nucleus"):
        served.terms([1.0], 0.95, [], 0.1, "soft_ce", "reverse_kl")
    assert served.terms([1.0], 1.0, [], 0.1, "soft_ce", "reverse_kl")[0].loss == "reverse_kl"
    with pytest.raises(ValueError, match="one weight per serve temperature"):
        served.terms([0.0, 1.0], 1.0, [1.0], 0.1, "soft_ce", "tv")
    with pytest.raises(params.ParamsError, match="05_train_eagle3"):
        recipe.objective(
            recipe.Params(serve_weights=[1.0, 2.0]), params.SharedParams(serve_temperatures=[1.0])
        )
    with pytest.raises(ValueError, match="serve_temperatures must be distinct"):
        params.SharedParams(serve_temperatures=[1.0, 1.0])


@pytest.mark.parametrize("loss", ["tv", "forward_kl", "jsd", "lk_hybrid"])
def test_losses_stay_finite_with_zeros_in_the_target_and_their_gradients_too(loss):
    logp = served.target_logprobs(LOGITS, COLS, _term(0.9))
    z = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    out = served.per_position_loss(logp, z.log_softmax(-1), loss)
    (g,) = torch.autograd.grad(out.sum(), z)
    assert torch.isfinite(out).all() and torch.isfinite(g).all()


def test_a_nucleus_term_unrolled_with_the_chunked_head_equals_the_eager_unroll():
    """Loss, stats, every gradient and the held-out acceptance accumulators: the chunked head makes the target rows
    over the whole vocab per chunk."""
    m = drafter(seed=3, n=20)
    args = packed(45, 2, seed=1)
    terms = served.terms([0.0, 1.0], 0.9, [0.3, 0.7], 0.5, "soft_ce", "tv")

    def run(model):
        model.served_alpha = torch.zeros(1, 3, 2, dtype=torch.float64)  # the held-out acceptance accumulators
        model.served_alpha_bins = torch.zeros(1, len(ttt.CONFIDENCE_EDGES) + 1, dtype=torch.float64)
        loss, stats = model(*args)
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        return loss, stats, grads, model.served_alpha, model.served_alpha_bins

    ref = run(ttt.TTT(m, 3, 0.8, "eager", terms=terms))
    got = run(ttt.TTT(m, 3, 0.8, "chunked", loss_chunk=4, terms=terms))
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    torch.testing.assert_close(got[3], ref[3])
    torch.testing.assert_close(got[4], ref[4])
    for a, b in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(a, b)
    # and the nucleus changes the loss (the term is not the plain one)
    plain = run(
        ttt.TTT(m, 3, 0.8, "eager", terms=served.terms([0.0, 1.0], 1.0, [0.3, 0.7], 0.5, "soft_ce", "tv"))
    )
    assert abs(float(plain[0].detach()) - float(ref[0].detach())) > 1e-4


def test_heldout_evaluation_reports_the_acceptance_of_a_probabilistic_draft_as_an_engine_would_draw_it():
    """The unroll's accumulators of sum_v min(p_v, q_v) per step (and per bin of the target's top-1 at step 0)
    against a reference from the drafter run as an engine runs it (`inference_chain`: the data's tokens fed to each
    step) and the decoder's own warp of the target (`sampling.warp`: T, top_p over the whole vocab), the draft
    sampled from softmax(logits / T) over the draft ids, summed in plain Python."""
    from eagle_lib.decoding.sampling import warp
    from tests.unit.test_train import inference_chain, inputs

    m = drafter(seed=3, n=20)
    t_len, k, temp, top_p = 24, 3, 1.0, 0.9
    ids, pos, doc, aux, tl = inputs(t_len, seed=4)
    mask = torch.rand(1, t_len, generator=torch.Generator().manual_seed(5)) < 0.8
    terms = served.terms([0.0, temp], top_p, [], 0.5, "soft_ce", "tv")
    model = ttt.TTT(m, k, 0.8, "eager", terms=terms)
    n_bins = len(ttt.CONFIDENCE_EDGES) + 1
    model.served_alpha = torch.zeros(1, k, 2, dtype=torch.float64)
    model.served_alpha_bins = torch.zeros(1, n_bins, dtype=torch.float64)
    with torch.no_grad():
        model(ids, pos, doc, mask, aux, tl)
    cols = m.draft_ids()
    want = [[0.0, 0] for _ in range(k)]
    bins = [0.0] * n_bins
    with torch.no_grad():
        for t in range(t_len - 2):
            steps = min(k, t_len - 2 - t)
            chain = inference_chain(m, ids, aux, t, steps)
            for i in range(steps):
                if not mask[0, t + 2 + i]:
                    continue
                p = warp(tl[0, t + 1 + i], temp, 0, top_p)[cols].tolist()
                q = torch.softmax(chain[i].double() / temp, -1).tolist()
                a = sum(min(x, y) for x, y in zip(p, q, strict=True))
                want[i][0] += a
                want[i][1] += 1
                if i == 0:
                    top1 = float(torch.softmax(tl[0, t + 1], -1).max())
                    bins[sum(top1 >= e for e in ttt.CONFIDENCE_EDGES)] += a
    assert [int(n) for n in model.served_alpha[0, :, 1].tolist()] == [n for _, n in want]
    assert model.served_alpha[0, :, 0].tolist() == pytest.approx([a for a, _ in want], abs=1e-9)
    assert model.served_alpha_bins[0].tolist() == pytest.approx(bins, abs=1e-9)
    assert (
        0.05 < want[0][0] / want[0][1] < 0.95
    )  # neither 0 nor 1: the draft is neither disjoint nor the target


def test_05s_answer_and_headline_state_the_served_acceptance_and_where_the_target_hesitates():
    """From a hand-made summary: the per-position acceptance at T=1 and the first bin under 0.3 (its alpha and
    share), into the answer and the headline."""
    from eagle_lib.drafter import figures

    counts = torch.tensor([[10.0, 0, 0, 0, 0, 30.0], [5.0, 0, 0, 0, 0, 29.0]], dtype=torch.float64)
    rows = ttt.confidence_table(counts, {"T=1": [5.2, 0, 0, 0, 0, 28.5]})
    assert rows[0]["alpha_T=1"] == pytest.approx(0.52) and rows[5]["alpha_T=1"] == pytest.approx(0.95)
    assert math.isnan(rows[1]["alpha_T=1"])  # an empty bin
    summary = {
        "steps": 200, "ttt_steps": 3, "train_sequences": 1, "heldout_sequences": 1, "train_tokens": 1,
        "tokens_per_s": 1.0, "final_train_loss": 1.0,
        "heldout": {"acc": [0.9], "by_target_confidence": rows, "served_acceptance": {"T=1": [0.84, 0.85, 0.8]}},
        "vocab": {"majority_share": 0.05, "coverage": 0.98},
    }  # fmt: skip
    text = figures.answer_text(summary)
    assert (
        "At T=1 a probabilistic draft is accepted 0.84 / 0.85 / 0.80 at draft positions 1..3, teacher-forced, "
        in text
    )
    assert "0.52 where the target's top-1 is under 0.3 (25% of the labels)" in text
    assert figures.headline(summary)["heldout_served_acceptance"] == {"T=1": [0.84, 0.85, 0.8]}


def test_the_nucleus_from_top_k_tiers_equals_a_full_sort_on_peaked_and_flat_rows():
    """served.nucleus cuts most rows from a top-k and sorts only the rest; the set must be the full sort's."""
    from eagle_lib.drafter import served

    torch.manual_seed(3)
    V = 5000
    rows = torch.cat(
        [torch.randn(40, V) * s for s in (12.0, 4.0, 1.0, 0.05)]
    )  # nucleus of ~1 to ~4,700 tokens
    p = rows.double().softmax(-1)
    for top_p in (0.5, 0.9, 0.95, 0.999):
        sp, order = p.sort(-1, descending=True)
        want = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, (sp.cumsum(-1) - sp) < top_p)
        got = served.nucleus(p, top_p, k=16)
        assert torch.equal(got, want), top_p
        sizes = got.sum(-1)
        assert sizes.min() < 16 < 16 * 16 < sizes.max()  # every tier was used
