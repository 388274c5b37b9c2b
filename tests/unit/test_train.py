"""Stage 05 training: TTT vs the inference drafter, label shift, packing, metrics, resume, NaN guard."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from eagle_lib import params, store, train
from eagle_lib.data import batches
from eagle_lib.drafter import served, trainer, ttt
from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter, load_drafter
from tests.support import eagle_tiny

torch.set_num_threads(1)
V, H, HT = 40, 32, 24


def drafter(seed=0, n=V, **options) -> Eagle3Drafter:
    torch.manual_seed(seed)
    c = Eagle3Config(
        hidden_size=H,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        draft_vocab_size=n,
        target_hidden_size=HT,
        aux_layers=[1, 3, 4],
        **options,
    )
    m = Eagle3Drafter(c).double()
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
    if n < V:
        kept = torch.arange(0, V, V // n)[:n]
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[kept] = True
        m.set_vocab_map(kept - torch.arange(n), t2d)
    return m


def inputs(t, seed=0, b=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * HT, generator=g, dtype=torch.float64)
    logits = torch.randn(b, t, V, generator=g, dtype=torch.float64) * 3
    pos = torch.arange(t).expand(b, t)
    return ids, pos, torch.zeros(b, t, dtype=torch.long), aux, logits


def inference_chain(m, ids, aux, t, steps, drafted=False):
    """Logits of draft steps 0..steps-1 after the prefix ending at t, run as an engine runs the drafter;
    ``drafted``: step j reads the previous step's greedy draft (as decoding does), else the data's token."""
    cache = m.new_cache()
    out, lg = m(ids[:, 1 : t + 2], m.project(aux[:, : t + 1]), torch.arange(t + 1)[None], cache)
    h, res = out[:, -1:], [lg[0, -1]]
    for j in range(1, steps):
        tok = m.draft_to_target(res[-1].argmax())[None, None] if drafted else ids[:, t + 1 + j : t + 2 + j]
        h, lg = m(tok, h, torch.tensor([[t + j]]), cache)
        res.append(lg[0, -1])
    return res


def soft_ce(draft_logits, target_logits, m):
    p = F.softmax(target_logits[m.draft_ids()], -1)
    return -(p * F.log_softmax(draft_logits, -1)).sum()


CASES = {  # (drafter options, ttt_input, target_temperature)
    "original": ({}, "label", 1.0),
    "norm_before_residual": ({"norm_before_residual": True}, "label", 1.0),
    "norm_before_fc": ({"norm_before_fc": True}, "label", 1.0),
    "norm_output": ({"norm_output": True}, "label", 1.0),
    "drafted": ({}, "drafted", 1.0),
    "sharpened_target": ({}, "label", 0.5),
    "drafted_norm_all": (
        {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
        "drafted",
        1.0,
    ),
}


@torch.no_grad()
@pytest.mark.parametrize("case", sorted(CASES))
def test_ttt_loss_equals_inference_chain_reference(case):
    """Every TTT row/step has the logits the served drafter would have, and the loss is their soft CE; with
    the norm options and with the self-fed unroll (drafted: the chain feeds its own greedy drafts)."""
    options, feed, temp = CASES[case]
    m, t_len, k = drafter(n=20, **options), 11, 3
    if options.get("norm_before_fc"):
        m.input_norm.weight.normal_()  # away from 1 so a missing norm shows
    ids, pos, doc, aux, tl = inputs(t_len)
    mask = torch.ones(1, t_len, dtype=torch.bool)
    loss, stats = ttt.TTT(m, k, 0.7, feed=feed, target_temperature=temp)(ids, pos, doc, mask, aux, tl)
    expected = 0.0
    for i in range(k):
        ces = []
        for t in range(t_len - 2 - i):
            lg = inference_chain(m, ids, aux, t, i + 1, drafted=feed == "drafted")[i]
            if m.t2d[tl[0, t + 1 + i].argmax()]:  # loss only where the target argmax is in the draft vocab
                ces.append(soft_ce(lg, tl[0, t + 1 + i] / temp, m))
        assert stats[i, ttt.N_LABELS] == t_len - 2 - i and stats[i, ttt.N_LOSS] == len(ces)
        expected += 0.7**i * (sum(ces) / max(1, len(ces)))
    assert loss.item() == pytest.approx(float(expected), rel=1e-9)


@torch.no_grad()
def test_confidence_bins_count_first_draft_hits_by_the_targets_top1_probability():
    """Per bin of the target's own top-1 probability at the predicted position: labels and first-draft hits,
    against the served drafter's first draft at every prefix (`inference_chain`) binned by a plain loop."""
    m, t_len = drafter(n=20), 30
    ids, pos, doc, aux, tl = inputs(t_len, seed=3)
    tl[0, ::3] *= 4  # some sure positions beside the hesitant ones
    mask = torch.ones(1, t_len, dtype=torch.bool)
    mask[0, :4] = False  # a prompt: no label there
    model = ttt.TTT(m, 2, 1.0)
    model.confidence = torch.zeros(2, len(ttt.CONFIDENCE_EDGES) + 1, dtype=torch.float64)
    model(ids, pos, doc, mask, aux, tl)
    edges = [0.0, *ttt.CONFIDENCE_EDGES, 1.01]
    want = torch.zeros_like(model.confidence)
    for t in range(t_len - 2):
        if not mask[0, t + 2]:
            continue
        p1 = float(F.softmax(tl[0, t + 1], -1).max())
        b = next(j for j in range(len(edges) - 1) if edges[j] <= p1 < edges[j + 1])
        draft = m.draft_to_target(inference_chain(m, ids, aux, t, 1)[0].argmax())
        want[0, b] += 1
        want[1, b] += float(draft == tl[0, t + 1].argmax())
    assert torch.equal(model.confidence, want)
    assert want[0].sum() == t_len - 4 and (want[0] > 0).sum() >= 3  # labels at t + 2 >= 4, in several bins
    rows = ttt.confidence_table(want)
    assert [r["labels"] for r in rows] == want[0].tolist()
    assert sum(r["miss_share"] for r in rows if r["labels"]) == pytest.approx(1.0)


@torch.no_grad()
def test_drafted_unroll_equals_label_unroll_when_the_draft_is_the_label():
    """Self-fed = teacher-forced exactly when the draft equals the data's next token: k=2 with labels at 2
    and 3 only (step 0 trains rows 0 and 1, step 1 row 0); x_2 is set to row 0's own greedy draft, then
    changed, which must change step 1's loss only."""
    m, t_len, k = drafter(seed=3, n=20), 8, 2
    ids, pos, doc, aux, tl = inputs(t_len, seed=4)
    tl[..., m.draft_ids()[7]] += 20.0  # the target's argmax in the draft vocab: every label has a loss
    mask = torch.zeros(1, t_len, dtype=torch.bool)
    mask[0, 2:4] = True
    draft0 = inference_chain(m, ids, aux, 0, 1)[0].argmax()  # reads x_1 and f_0 only
    ids[0, 2] = m.draft_to_target(draft0)
    a = ttt.TTT(m, k, 0.7, feed="label")(ids, pos, doc, mask, aux, tl)
    b = ttt.TTT(m, k, 0.7, feed="drafted")(ids, pos, doc, mask, aux, tl)
    torch.testing.assert_close(a, b)
    assert a[1][1, ttt.N_LABELS] == 1  # step 1 did train a row
    ids[0, 2] = (ids[0, 2] + 1) % V  # now the data's token is not the draft
    a = ttt.TTT(m, k, 0.7, feed="label")(ids, pos, doc, mask, aux, tl)
    b = ttt.TTT(m, k, 0.7, feed="drafted")(ids, pos, doc, mask, aux, tl)
    assert a[1][0, ttt.LOSS_SUM] == b[1][0, ttt.LOSS_SUM]
    assert a[1][1, ttt.LOSS_SUM] != b[1][1, ttt.LOSS_SUM]
    with pytest.raises(ValueError, match="ttt_input"):
        ttt.TTT(m, k, 0.7, feed="sampled")


@torch.no_grad()
def test_first_assistant_token_is_a_trained_label():
    """mask[a] = 1 only: step 0 trains row a-2 (token x[a-1]) against the target at a-1; step 1 row a-3."""
    m, t_len, a = drafter(), 10, 6
    ids, pos, doc, aux, tl = inputs(t_len, seed=3)
    mask = torch.zeros(1, t_len, dtype=torch.bool)
    mask[0, a] = True
    loss, stats = ttt.TTT(m, 2, 0.5)(ids, pos, doc, mask, aux, tl)
    assert stats[:, ttt.N_LABELS].tolist() == [1, 1]
    step0 = soft_ce(inference_chain(m, ids, aux, a - 2, 1)[0], tl[0, a - 1], m)
    step1 = soft_ce(inference_chain(m, ids, aux, a - 3, 2)[1], tl[0, a - 1], m)
    assert loss.item() == pytest.approx((step0 + 0.5 * step1).item(), rel=1e-9)
    mask[0, a] = False
    mask[0, a - 1] = True  # shifting the mask by one moves the trained rows with it
    _, stats = ttt.TTT(m, 1, 1.0)(ids, pos, doc, mask, aux, tl)
    assert stats[0, ttt.N_LABELS] == 1


def test_b_response_mask_marks_output_tokens(tmp_path):
    store.append_jsonl(
        tmp_path / "infer/x/responses.jsonl",
        [{"id": "r1", "prompt_ids": [1, 2, 3], "output_ids": [4, 5], "finish_reason": "stop"}],
    )
    store.append_jsonl(
        tmp_path / "data/A/y/records.jsonl",
        [
            {"id": "q1", "input_ids": [7, 8, 9], "loss_mask": [0, 0, 1]},
            {"id": "q2", "input_ids": [7, 8], "loss_mask": [0, 1]},
        ],
    )
    tr, held, tally = batches.load_sequences(tmp_path, 0.0, 100)
    by_id = {s.id: s for s in tr}
    assert by_id["r1"].input_ids == [1, 2, 3, 4, 5] and by_id["r1"].loss_mask == [0, 0, 0, 1, 1]
    assert tally.dropped == {"no_trainable_labels": 1} and tally.read == 3 and not held
    store.append_jsonl(
        tmp_path / "data/A/y/records.jsonl", [{"id": "bad", "input_ids": [1, 2], "loss_mask": [1]}]
    )
    with pytest.raises(ValueError, match="records.jsonl: record 'bad'.*2 token ids but 1"):
        batches.load_sequences(tmp_path, 0.0, 100)


def test_packed_rows_equal_separate_rows():
    m = drafter(seed=4, n=20)
    lens = [7, 5, 6]
    parts = [inputs(n, seed=10 + i) for i, n in enumerate(lens)]
    seqs = [
        batches.Sequence(str(i), p[0][0].tolist(), [0, 1] * (n // 2) + [1] * (n % 2))
        for i, (p, n) in enumerate(zip(parts, lens, strict=True))
    ]
    packed = batches.make_batch(seqs, [[0, 1, 2]])
    aux = torch.cat([p[3] for p in parts], 1)
    tl = torch.cat([p[4] for p in parts], 1)
    model = ttt.TTT(m, 3, 0.8)
    _, s_packed = model(packed.input_ids, packed.position_ids, packed.doc_ids, packed.loss_mask, aux, tl)
    s_sep = sum(
        model(p[0], p[1], p[2], torch.tensor([seqs[i].loss_mask], dtype=torch.bool), p[3], p[4])[1]
        for i, p in enumerate(parts)
    )
    torch.testing.assert_close(s_packed, s_sep)
    rows = batches.pack([5, 9, 3, 7, 2, 8], 10)
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum([5, 9, 3, 7, 2, 8][i] for i in r) <= 10 for r in rows)


def test_summarize_metrics():
    stats = torch.zeros(3, ttt.N_STATS)
    stats[:, ttt.N_LABELS] = torch.tensor([10.0, 10, 10])
    stats[:, ttt.N_CORRECT] = torch.tensor([8.0, 5, 4])
    stats[:, ttt.COND_NUM] = torch.tensor([8.0, 4, 2])
    stats[:, ttt.COND_DEN] = torch.tensor([10.0, 8, 4])
    m = ttt.summarize(stats)
    assert m["acc"] == [0.8, 0.5, 0.4] and m["cond_acc"] == [0.8, 0.5, 0.5]
    assert m["sim_tau"] == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.4)
    assert m["chain_tau"] == pytest.approx(1 + (8 + 4 + 2) / 10)


def test_presets():
    assert ttt.resolve_preset("eagle", 0, 0.0) == (7, 0.8)
    assert ttt.resolve_preset("speculators", 0, 0.0) == (3, 1.0)
    assert ttt.resolve_preset("modelopt", 0, 0.0) == (3, 0.9)
    assert ttt.resolve_preset("eagle", 4, 0.5) == (4, 0.5)
    with pytest.raises(ValueError, match="ttt_preset"):
        ttt.resolve_preset("nope", 0, 0.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("w")
    return root, eagle_tiny.make_run(root)


def copy_run(world, dest: Path) -> Path:
    import shutil

    root, run = world
    shutil.copytree(run / "data", dest / "data")
    shutil.copytree(run / "infer", dest / "infer")
    return dest


def test_resume_continues_the_same_run(world, tmp_path):
    root, _ = world
    full_dir, cut_dir = copy_run(world, tmp_path / "full"), copy_run(world, tmp_path / "cut")
    full = train.run(eagle_tiny.stage_config(full_dir, root / "target"))
    part = train.run(eagle_tiny.stage_config(cut_dir, root / "target", stop_after_steps=3))
    assert part == {"stopped_at_step": 3, "total_steps": 6}
    ck = sorted((cut_dir / "drafter/checkpoints").glob("*/step_*"))
    assert [c.name for c in ck] == ["step_0000002"]  # step 3 was not checkpointed: resume from 2
    assert {"model.safetensors", "optimizer.safetensors", "trainer.json", "COMPLETE"} <= {
        p.name for p in ck[0].iterdir()
    }
    resumed = train.run(eagle_tiny.stage_config(cut_dir, root / "target"))
    a = store.read_jsonl(full_dir / "drafter/train_log.jsonl")
    b = store.read_jsonl(cut_dir / "drafter/train_log.jsonl")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
    assert resumed["heldout"]["acc"] == pytest.approx(full["heldout"]["acc"])
    wa, wb = load_drafter(full_dir / "drafter/final"), load_drafter(cut_dir / "drafter/final")
    for key, v in wa.state_dict().items():
        torch.testing.assert_close(v, wb.state_dict()[key], rtol=1e-5, atol=1e-6)
    assert a[-1]["loss"] < a[0]["loss"]
    summary = json.loads((full_dir / "drafter/final/summary.json").read_text())
    assert summary["vocab"]["coverage"] > 0.5 and len(summary["heldout"]["acc"]) == 2
    other = train.run(eagle_tiny.stage_config(cut_dir, root / "target", learning_rate=1e-2))
    assert other["steps"] == 6 and len(list((cut_dir / "drafter/checkpoints").iterdir())) == 2
    assert [r["step"] for r in store.read_jsonl(cut_dir / "drafter/train_log.jsonl")] == list(range(1, 7))
    assert (ck[0].parent / "step_0000006" / "COMPLETE").exists()  # other settings start fresh, beside


def test_muon_resume_continues_the_same_run(world, tmp_path):
    """optimizer muon: two optimizers (AdamW + Muon) checkpoint into one name-keyed state and resume exactly."""
    root, _ = world
    full_dir, cut_dir = copy_run(world, tmp_path / "full"), copy_run(world, tmp_path / "cut")
    full = train.run(eagle_tiny.stage_config(full_dir, root / "target", optimizer="muon"))
    train.run(eagle_tiny.stage_config(cut_dir, root / "target", optimizer="muon", stop_after_steps=3))
    ck = sorted((cut_dir / "drafter/checkpoints").glob("*/step_*"))[0]
    keys = set(load_file(str(ck / "optimizer.safetensors")))
    assert "drafter.midlayer.mlp.down_proj.weight/momentum_buffer" in keys  # Muon's state
    assert "drafter.lm_head.weight/exp_avg_sq" in keys  # AdamW's
    assert len(json.loads((ck / "trainer.json").read_text())["optimizer"]["param_groups"]) == 2
    resumed = train.run(eagle_tiny.stage_config(cut_dir, root / "target", optimizer="muon"))
    a = store.read_jsonl(full_dir / "drafter/train_log.jsonl")
    b = store.read_jsonl(cut_dir / "drafter/train_log.jsonl")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
    assert resumed["heldout"]["acc"] == pytest.approx(full["heldout"]["acc"])
    adam = train.run(eagle_tiny.stage_config(copy_run(world, tmp_path / "adam"), root / "target"))
    assert adam["final_train_loss"] != pytest.approx(full["final_train_loss"], rel=1e-3)  # another optimizer


def test_nan_guard_skips_then_aborts(world, tmp_path, monkeypatch):
    root, _ = world
    run = copy_run(world, tmp_path / "nan")
    real = trainer._micro_step
    calls = {"n": 0}

    def poisoned(model, source, batch, *a):
        calls["n"] += 1
        nan_source = (lambda b: tuple(x * math.nan for x in source(b))) if calls["n"] in (2,) else source
        return real(model, nan_source, batch, *a)

    monkeypatch.setattr(trainer, "_micro_step", poisoned)
    train.run(eagle_tiny.stage_config(run, root / "target", max_steps=3, checkpoint_every=100))
    log = store.read_jsonl(run / "drafter/train_log.jsonl")
    assert [r["skipped"] for r in log] == [False, True, False]
    calls["n"] = 0
    monkeypatch.setattr(
        trainer,
        "_micro_step",
        lambda m, s, b, *a: real(m, lambda x: tuple(y * math.nan for y in s(x)), b, *a),
    )
    with pytest.raises(FloatingPointError, match="consecutive"):
        train.run(eagle_tiny.stage_config(run, root / "target", max_steps=5, max_bad_steps=1, resume=False))


def test_sdpa_attention_equals_eager():
    m = drafter(seed=5, n=20)
    ids, pos, doc, aux, tl = inputs(13, seed=6, b=2)
    doc[:, 7:] = 1
    pos = torch.where(doc == 1, pos - 7, pos)
    mask = torch.rand(2, 13, generator=torch.Generator().manual_seed(1)) < 0.7
    loss_e, st_e = ttt.TTT(m, 4, 0.8, "eager")(ids, pos, doc, mask, aux, tl)
    loss_s, st_s = ttt.TTT(m, 4, 0.8, "sdpa")(ids, pos, doc, mask, aux, tl)
    torch.testing.assert_close(loss_s, loss_e)
    torch.testing.assert_close(st_s, st_e)


def test_padding_rows_changes_nothing():
    m = drafter(seed=7, n=20)
    seqs = [batches.Sequence("a", list(range(3, 12)), [0, 0, 0, 1, 1, 1, 1, 1, 1])]
    tight, padded = batches.make_batch(seqs, [[0]]), batches.make_batch(seqs, [[0]], pad_to=16)
    assert padded.input_ids.shape == (1, 16) and padded.n_tokens == tight.n_tokens == 9
    g = torch.Generator().manual_seed(2)
    aux, tl = torch.randn(1, 16, 3 * HT, generator=g, dtype=torch.float64), torch.randn(1, 16, V, generator=g)
    model = ttt.TTT(m, 3, 0.8)
    a = model(
        tight.input_ids, tight.position_ids, tight.doc_ids, tight.loss_mask, aux[:, :9], tl[:, :9].double()
    )
    b = model(padded.input_ids, padded.position_ids, padded.doc_ids, padded.loss_mask, aux, tl.double())
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


def test_hesitant_miss_share_reads_the_bins_under_one_half():
    from eagle_lib.drafter import figures

    counts = torch.tensor([[200.0, 30, 20, 40, 190, 500], [128, 22, 16, 32, 178, 490]])
    summary = {"heldout": {"by_target_confidence": ttt.confidence_table(counts)}}
    misses = [72, 8, 4, 8, 12, 10]  # labels - hits per bin
    assert figures.hesitant_miss_share(summary) == pytest.approx((72 + 8) / sum(misses))
    assert figures.hesitant_miss_share({"heldout": {}}) is None


def test_resume_under_another_world_size_is_refused(world, tmp_path):
    """A checkpoint written by one process, resumed by two: each step would take other micro-batches (the
    order and the step count change silently), so the resume is refused, naming the checkpoint."""
    from eagle_lib.drafter import checkpoints

    root, _ = world
    cut = copy_run(world, tmp_path / "cut")
    train.run(eagle_tiny.stage_config(cut, root / "target", stop_after_steps=3))
    fp = next((cut / "drafter/checkpoints").iterdir()).name
    with pytest.raises(
        checkpoints.ResumeError, match=r"step_0000002/trainer.json: written by 1 processes, resumed by 2"
    ):
        checkpoints.resume(cut / "drafter", None, [], [], fp, world=2)
    assert checkpoints.resume.__defaults__[-1] == 1  # the single process is the default world


def test_torn_lines_are_counted_named_and_fail_above_the_threshold(tmp_path):
    """A torn line inside a responses file (a fragment an older writer terminated) used to vanish: 05 trained
    on fewer records than 03 wrote and said nothing. It is counted as read and dropped, named file:line, and
    past MAX_TORN_SHARE of the lines the stage fails."""
    path = tmp_path / "infer/x/responses.jsonl"
    recs = [{"id": f"r{i}", "prompt_ids": [1, 2, 3], "output_ids": [4, 5, 6], "finish_reason": "stop"}
            for i in range(150)]  # fmt: skip
    store.append_jsonl(path, recs[:60])
    with open(path, "ab") as f:
        f.write(b'{"id": "r_torn", "prompt_ids": [1, 2\n')  # line 61: a fragment, later terminated
    store.append_jsonl(path, recs[60:])
    tr, _, tally = batches.load_sequences(tmp_path, 0.0, 100)
    assert len(tr) == 150 and tally.read == 151 and tally.dropped == {"torn_line": 1}
    assert tally.torn_lines == [f"{path}:61"]
    store.check_tally({"read": tally.read, "kept": tally.kept, "dropped": tally.dropped, "rejected": 0})
    with open(path, "ab") as f:
        f.write(b'{"id": "r_torn2", "output_ids": [4\n')
    store.append_jsonl(path, recs[:1])
    with pytest.raises(ValueError, match=rf"2 of 153 record lines are torn writes .*{path}:61, {path}:152"):
        batches.load_sequences(tmp_path, 0.0, 100)


# p = [0.5, 0.5] (target), q = [0.25, 0.75] (draft); alpha = sum min(p, q) = 0.75. Each value by hand:
# soft CE  -(0.5 ln 0.25 + 0.5 ln 0.75)                         = 0.836988
# KL(p||q) 0.5 ln 2 + 0.5 ln(2/3)                                = 0.143841
# KL(q||p) 0.25 ln 0.5 + 0.75 ln 1.5                             = 0.130812
# JSD      m = [0.375, 0.625]: 0.5 (0.032269) + 0.5 (0.035375)   = 0.033822
# TV       1 - 0.75                                              = 0.25
# NLA      -ln 0.75                                              = 0.287682
# LK       lam = e^-2.25 = 0.105399: lam 0.143841 + (1 - lam) 0.25 = 0.238811
LOSS_BY_HAND = {"soft_ce": 0.836988, "forward_kl": 0.143841, "reverse_kl": 0.130812, "jsd": 0.033822,
                "tv": 0.25, "nla": 0.287682, "lk_hybrid": 0.238811}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(LOSS_BY_HAND))
def test_each_loss_option_equals_its_hand_computed_value(kind):
    p, q = torch.tensor([[0.5, 0.5]], dtype=torch.float64), torch.tensor([[0.25, 0.75]], dtype=torch.float64)
    got = served.per_position_loss(p.log(), q.log(), kind)
    assert float(got) == pytest.approx(LOSS_BY_HAND[kind], abs=1e-6)
    assert set(LOSS_BY_HAND) == set(served.LOSSES)  # every option has its hand value


def test_losses_vanish_where_the_draft_is_the_target_and_lk_leaves_lambda_undifferentiated():
    """At q = p every divergence is 0 (CE is the entropy) and the gradient of the LK loss is
    lam dKL + (1 - lam) dTV with lam held fixed (speculators' adaptive blend)."""
    logp = torch.tensor([[0.1, -0.4, 0.3]], dtype=torch.float64).log_softmax(-1)
    for kind in ("forward_kl", "reverse_kl", "jsd", "tv"):
        assert float(served.per_position_loss(logp, logp, kind)) == pytest.approx(0.0, abs=1e-12)
    z = torch.tensor([[0.7, -0.2, 0.1]], dtype=torch.float64, requires_grad=True)
    served.per_position_loss(logp, z.log_softmax(-1), "lk_hybrid").sum().backward()
    g_lk = z.grad.clone()
    alpha = torch.minimum(logp.exp(), z.detach().softmax(-1)).sum()
    lam = float(torch.exp(-3 * alpha))
    z.grad = None
    (lam * served.per_position_loss(logp, z.log_softmax(-1), "forward_kl")
     + (1 - lam) * served.per_position_loss(logp, z.log_softmax(-1), "tv")).sum().backward()  # fmt: skip
    torch.testing.assert_close(g_lk, z.grad)
    with pytest.raises(ValueError, match="choose one of"):
        ttt.TTT(torch.nn.Linear(1, 1), 1, 1.0, loss="hinge")


def test_every_label_token_is_trained_held_out_cut_or_dropped(tmp_path):
    """05's label-token table: per dataset and sequence length, the labels past max_seq_len are counted as cut,
    a sequence left with no label as dropped, and the counts add up to the labels of the input, recounted here
    from the files themselves."""
    from eagle_lib import store
    from eagle_lib.data import batches

    run = tmp_path / "run"
    recs = [  # lengths 6, 1500, 5000: the last two are cut at 1200; one has all its labels past the cut
        {"id": "a:0", "input_ids": list(range(6)), "loss_mask": [0, 0, 1, 1, 1, 1]},
        {"id": "a:1", "input_ids": list(range(1500)), "loss_mask": [0] * 1000 + [1] * 500},
        {"id": "a:2", "input_ids": list(range(5000)), "loss_mask": [0] * 1300 + [1] * 3700},
    ]
    store.append_jsonl(run / "data" / "A" / "a" / "records.jsonl", recs)
    train, held, tally = batches.load_sequences(run, 0.0, 1200)
    rows = {(r["dataset"], r["length"]): r for r in batches.label_table(tally)}
    assert rows[("A/a", "<1k")] == {"dataset": "A/a", "length": "<1k", "train": 4, "heldout": 0, "cut": 0, "dropped": 0,
                                   "trained_share": 1.0}  # fmt: skip
    assert (rows[("A/a", "1k-4k")]["train"], rows[("A/a", "1k-4k")]["cut"]) == (200, 300)
    assert (rows[("A/a", "4k-16k")]["train"], rows[("A/a", "4k-16k")]["cut"]) == (
        0,
        3700,
    )  # dropped: no label left
    total = rows[("A/a", "all")]
    assert sum(total[k] for k in batches.LABEL_FATES) == sum(sum(r["loss_mask"][2:]) for r in recs)
    assert total["trained_share"] == round(204 / 4204, 4) and tally.dropped == {"no_trainable_labels": 1}


def test_bf16_precision_holds_the_frozen_embedding_in_bf16_and_trains(world, tmp_path):
    """precision bf16: the frozen target embedding is bf16 (looked up only: no fp32 copy), every trainable
    weight stays fp32 (the master copy), and 05 trains, checkpoints and resumes to the same weights; fp32
    precision keeps it fp32. (The embedding was fp32 under bf16 before.)"""
    root, _ = world
    device = torch.device("cpu")
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        cfg = eagle_tiny.stage_config(
            copy_run(world, tmp_path / precision), root / "target", precision=precision
        )
        _, d, *_ = trainer.build(cfg, device)
        assert d.embed_tokens.weight.dtype == dtype and not d.embed_tokens.weight.requires_grad
        assert all(q.dtype == torch.float32 for q in d.parameters() if q.requires_grad)
    full, cut = copy_run(world, tmp_path / "full"), copy_run(world, tmp_path / "cut")
    ref = train.run(eagle_tiny.stage_config(full, root / "target", precision="bf16"))
    train.run(eagle_tiny.stage_config(cut, root / "target", precision="bf16", stop_after_steps=3))
    again = train.run(eagle_tiny.stage_config(cut, root / "target", precision="bf16"))
    assert all(map(math.isfinite, ref["heldout"]["acc"])) and again["heldout"]["acc"] == pytest.approx(
        ref["heldout"]["acc"]
    )
    wa, wb = load_drafter(full / "drafter/final"), load_drafter(cut / "drafter/final")
    for key, v in wa.state_dict().items():
        torch.testing.assert_close(v, wb.state_dict()[key], rtol=1e-5, atol=1e-6)


def test_05_meta_records_what_its_bits_depend_on_and_a_digest_two_runs_of_one_record_share(world, tmp_path):
    """05's meta.json says what makes a run bit-reproducible (seed, threads, CPU and ISA, builds, device, world
    size) and digests its final weights: two runs of one record end on the same bits (compared tensor by
    tensor, not by the digest) and one digest; another seed ends elsewhere, and its digest says so."""
    root, _ = world
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        cfg = eagle_tiny.stage_config(copy_run(world, tmp_path / name), root / "target")
        cfg = params.StageConfig(
            cfg.name, cfg.run_dir, cfg.shared.model_copy(update={"seed": seed}), cfg.stage
        )
        train.run(cfg)
        meta = store.read_json(cfg.run_dir / "drafter/meta.json")
        runs[name] = (meta["reproducibility"], load_drafter(cfg.run_dir / "drafter/final").state_dict())
    rec, wa = runs["a"]
    assert rec["seed"] == 0 and rec["threads"] == 1 and rec["device"] == "cpu" and rec["world_size"] == 1
    assert rec["torch"] == torch.__version__ and rec["cpu"] and isinstance(rec["isa"], list)
    assert any("thread" in c for c in rec["same_bits"])
    wb = runs["b"][1]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert runs["b"][0]["weights_sha256"] == rec["weights_sha256"]
    wc = runs["c"][1]
    assert runs["c"][0]["seed"] == 1 and not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert runs["c"][0]["weights_sha256"] != rec["weights_sha256"]


def test_loss_positions_all_trains_every_token_of_a_document_and_is_measured_on_assistant_tokens():
    """Label rows at TTT step i, counted by formula: a 12-token document followed by 4 padding tokens (doc -1),
    assistant tokens 7..11. "assistant": the label x[t+2+i] must be one of the 5, so 5 rows at every step;
    "all": every t with t+2+i inside the document, 12 - 2 - i rows, padding never. The held-out metrics
    (`ttt.evaluate`) count assistant rows whatever the model trained on, and leave its setting as it was."""
    t = 16
    ids, pos, doc, aux, logits = inputs(t)
    doc[:, 12:] = -1
    mask = torch.zeros(1, t, dtype=torch.bool)
    mask[:, 7:12] = True
    counts = {}
    for positions in ("assistant", "all"):
        model = ttt.TTT(drafter(), 3, 1.0, positions=positions)
        _, stats = model(ids, pos, doc, mask, aux, logits)
        counts[positions] = stats[:, 3].tolist()
    assert counts == {"assistant": [5.0, 5.0, 5.0], "all": [10.0, 9.0, 8.0]}
    with pytest.raises(ValueError, match="loss_positions 'prompt'"):
        ttt.TTT(drafter(), 3, 1.0, positions="prompt")

    class Source:  # the batch's aux features and target logits, as a hidden source returns them
        def __call__(self, batch):
            n = batch.input_ids.shape[1]
            return aux[:, :n].expand(batch.input_ids.shape[0], -1, -1), logits[:, :n]

    seq = batches.Sequence("s", ids[0, :12].tolist(), mask[0, :12].int().tolist())
    model = ttt.TTT(drafter(), 3, 1.0, positions="all")
    held = ttt.evaluate(model, Source(), [seq], 16, 1, torch.device("cpu"), False)
    assert model.positions == "all" and held["n_labels"] == 5
