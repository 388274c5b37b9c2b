"""Stage 07's pieces: the retrainer reproduces 05, subsets are nested and never held out, held-out tau sums."""

import shutil

import pytest
import torch

from eagle_lib import acceptance, store, train
from eagle_lib.data import batches, subsets
from eagle_lib.drafter import retrain, ttt
from eagle_lib.drafter.model import load_drafter
from eagle_lib.serving import heldout_tau
from tests.support import eagle_tiny


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained by stage 05 itself (6 steps), and the retrainer on its recipe."""
    root = tmp_path_factory.mktemp("v")
    run = eagle_tiny.make_run(root)
    cfg = eagle_tiny.stage_config(run, root / "target")
    train.run(cfg)
    return run, cfg, retrain.Trainer(*retrain.load_recipe(run))


def test_a_recipe_this_code_does_not_know_is_refused(trained, tmp_path):
    """05's meta from a newer 05 (an unknown setting) is refused, naming the file and the key: 07 would
    otherwise train another recipe than 05's."""
    run = trained[0]
    (tmp_path / "drafter").mkdir()
    meta = store.read_json(run / "drafter/meta.json")
    store.write_json(tmp_path / "drafter/meta.json", meta | {"params": meta["params"] | {"new_knob": 1}})
    with pytest.raises(retrain.RecipeError, match=r"(?s)drafter/meta.json.*new_knob"):
        retrain.load_recipe(tmp_path)


def test_retrain_reproduces_stage_05_weights(trained, tmp_path):
    run, cfg, tr = trained
    seqs, _, _ = tr.sequences(run)
    steps = tr.full_steps(seqs)
    assert steps == store.read_json(run / "drafter/summary.json")["steps"]
    drafter, log = tr.train(seqs, steps, cfg.stage.warmup_steps, tmp_path, "arm")
    ref = load_drafter(run / "drafter" / "final")
    for key, v in ref.state_dict().items():
        torch.testing.assert_close(drafter.state_dict()[key], v, rtol=1e-5, atol=1e-6)
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    five = [r["loss"] for r in store.read_jsonl(run / "drafter" / "train_log.jsonl")]
    assert [r["loss"] for r in log] == pytest.approx(five, rel=1e-4)  # 05's own log of the same steps
    assert not (tmp_path / "checkpoints").exists()  # the arm's checkpoints go once it is trained


def test_a_seed_replicate_is_another_training_run_of_the_same_recipe(trained, tmp_path):
    """07's training-noise arms: another seed gives other weights (init and batch order), the same seed the same
    weights again, and the default seed is 05's (reproduced above)."""
    run, cfg, tr = trained
    seqs, _, _ = tr.sequences(run)
    steps, warm = tr.full_steps(seqs), cfg.stage.warmup_steps
    a, _ = tr.train(seqs, steps, warm, tmp_path / "a", "a", seed=cfg.shared.seed + 10_000)
    b, _ = tr.train(seqs, steps, warm, tmp_path / "b", "b", seed=cfg.shared.seed + 10_000)
    ref = load_drafter(run / "drafter" / "final").state_dict()
    trainable = [k for k, v in a.named_parameters() if v.requires_grad]
    assert trainable
    for k in trainable:
        torch.testing.assert_close(a.state_dict()[k], b.state_dict()[k], rtol=0, atol=0)
    assert any(not torch.allclose(a.state_dict()[k], ref[k], rtol=1e-3, atol=1e-4) for k in trainable)


def test_retrain_reproduces_stage_05_weights_with_muon(tmp_path):
    """optimizer muon (two optimizers in 05) is honoured by the retrainer: the same weights."""
    run = eagle_tiny.make_run(tmp_path)
    cfg = eagle_tiny.stage_config(run, tmp_path / "target", optimizer="muon")
    train.run(cfg)
    tr = retrain.Trainer(*retrain.load_recipe(run))
    seqs, _, _ = tr.sequences(run)
    drafter, _ = tr.train(seqs, tr.full_steps(seqs), cfg.stage.warmup_steps, tmp_path / "arm", "arm")
    for key, v in load_drafter(run / "drafter" / "final").state_dict().items():
        torch.testing.assert_close(drafter.state_dict()[key], v, rtol=1e-5, atol=1e-6)


def test_subsets_nested_stratified_and_never_heldout(trained):
    run, cfg, tr = trained
    seqs, held, _ = tr.sequences(run, max_eval=0)
    names = subsets.dataset_of(run)
    assert set(names.values()) == {"tiny", "tinyb"}
    groups = subsets.by_dataset(seqs, names, seed=0)
    prev: set[str] = set()
    for f in (0.125, 0.25, 0.5, 1.0):
        sub = subsets.fraction_subset(groups, f)
        ids = {s.id for s in sub}
        assert prev <= ids, f"fraction {f} does not contain the smaller subset"
        assert not any(store.is_heldout(i, cfg.shared.heldout_percent) for i in ids)
        assert not ids & {s.id for s in held}
        for d, v in groups.items():  # every dataset cut at (at least) the same token share
            mine = [s for s in sub if names[s.id] == d]
            assert subsets.tokens(mine) >= f * subsets.tokens(v) > subsets.tokens(mine[:-1])
        prev = ids
    assert prev == {s.id for s in seqs}
    budget = subsets.tokens(groups["tinyb"]) // 2
    out = subsets.leave_out(groups, {"tiny"}, budget)
    assert {names[s.id] for s in out} == {"tinyb"} and subsets.tokens(out) >= budget
    with pytest.raises(ValueError, match="fewer than the budget"):
        subsets.leave_out(groups, {"tiny"}, subsets.tokens(groups["tinyb"]) + 1)
    a, b = subsets.equalize(groups["tiny"], groups["tinyb"][:3], seed=0)
    assert abs(subsets.tokens(a) - subsets.tokens(b)) <= max(len(s.input_ids) for s in groups["tiny"])


def test_heldout_prompts_are_those_06_decodes(trained, tmp_path):
    run = trained[0]
    shutil.copytree(run / "data", tmp_path / "data")
    for percent in (10.0, 40.0):
        mine, tally = heldout_tau.heldout_prompts(tmp_path, percent, per_dataset=4, max_prompt_tokens=768)
        ref, ref_tally = acceptance.heldout_prompts(
            tmp_path, percent, acceptance.Params(max_prompts_per_dataset=4)
        )
        assert [(p.dataset, p.id, p.prompt_ids) for p in mine] == [
            (p.dataset, p.id, p.prompt_ids) for ps in ref.values() for p in ps
        ]
        assert tally["kept"] == ref_tally["kept"] and tally["read"] == ref_tally["read"]


def test_decoder_sums_pool_to_the_generation_tau(trained):
    from eagle_lib import models
    from eagle_lib.decoding import specdec

    run, _, tr = trained
    drafter = load_drafter(run / "drafter" / "final")
    prompts, _ = heldout_tau.heldout_prompts(run, 40.0, 3, 768)
    target = tr.source.model
    dec = heldout_tau.Decoder(target, prompts, 12, 3, [])
    dec.add("d", drafter)
    runner = specdec.TargetRunner(target, drafter.config.aux_layers)
    steps = []
    for p in prompts:  # the reference: one generation per prompt, pooled as 06 pools (mean of accepted + 1)
        g = specdec.speculative_generate(runner, specdec.EagleProposer(drafter), p.prompt_ids, 12, 3, [])
        steps += g.accepted
    assert dec.sums.tau("d") == pytest.approx(sum(a + 1 for a in steps) / len(steps))
    assert models.pick_device("cpu").type == "cpu"


def test_teacher_forced_sums_equal_ttt_chain_tau(trained):
    run, _, tr = trained
    _, held, _ = tr.sequences(run, max_eval=0)
    drafter = load_drafter(run / "drafter" / "final")
    tf = heldout_tau.TeacherForced(tr, held, ["x"] * len(held), 2)
    tf.add("d", drafter)
    total = None
    model = ttt.TTT(drafter, 2, tr.decay, "eager").eval()
    with torch.no_grad():  # the reference: ttt.summarize over all held-out sequences packed together
        rows = batches.pack([len(s.input_ids) for s in held], 10_000)
        batch = batches.make_batch(held, rows, batches.PAD_TO)
        _, total = model(
            batch.input_ids, batch.position_ids, batch.doc_ids, batch.loss_mask, *tr.source(batch)
        )
    assert tf.sums.tau("d") == pytest.approx(ttt.summarize(total)["chain_tau"], rel=1e-5)


def test_a_reused_drafters_cached_decode_is_keyed_by_its_weights(tmp_path):
    """07 reuses 05's final/ as the full-data point; after 05 retrains there, the cached tau must not be reused."""
    from eagle_lib.data_value import value_study

    d = tmp_path / "final"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights of one recipe")
    first = value_study.reused_id(d)
    assert value_study.reused_id(d) == first  # a rerun on the same weights keeps its cached decode
    (d / "model.safetensors").write_bytes(b"weights of another recipe")
    assert value_study.reused_id(d) != first and value_study.reused_id(d)["dir"] == first["dir"]


def test_a_replicate_trains_on_another_draw_of_its_training_set(trained):
    """07's retraining-noise arms: with ``noise_resample`` a replicate at fraction f trains on the same fraction of
    a bootstrap of each dataset's training sequences (a rerun of the pipeline trains on another split, which a
    seed alone never varies); without it, on the very sequences of the base arm."""
    import collections
    import types

    from eagle_lib import value
    from eagle_lib.data_value import value_study

    run, cfg, tr = trained
    seqs, _, _ = tr.sequences(run, max_eval=0)
    names = subsets.dataset_of(run)
    groups = subsets.by_dataset(seqs, names, seed=0)

    boot = subsets.resampled(groups, 10_000)
    assert {d: len(v) for d, v in boot.items()} == {d: len(v) for d, v in groups.items()}
    for d, v in boot.items():
        assert {s.id for s in v} <= {s.id for s in groups[d]}  # drawn from its own dataset only
    assert [s.id for s in subsets.resampled(groups, 10_000)["tiny"]] == [s.id for s in boot["tiny"]]
    draws = [collections.Counter(s.id for s in subsets.resampled(groups, r)["tiny"]) for r in range(20)]
    assert any(max(c.values()) > 1 for c in draws)  # with replacement
    assert len({tuple(sorted(c.items())) for c in draws}) > 1

    def arms_of(resample: bool) -> dict:
        got = {}
        study = types.SimpleNamespace(
            recipe={"final_checkpoint": "last"},
            cfg=types.SimpleNamespace(
                shared=types.SimpleNamespace(seed=0), out=lambda *a: run / "drafter" / "final"
            ),
            groups=groups,
            train_side_by_side=lambda arms: None,  # (its own test below)
            arm=lambda name, study, sub, reuse=None, seed=None: got.__setitem__(
                name, (sorted(s.id for s in sub), seed)
            ),
        )
        p = value.Params(fractions=[0.5, 1.0], noise_seeds=1, noise_fractions=[0.5], noise_resample=resample)
        with pytest.raises(AttributeError, match="decoder"):  # every arm trained; decoding is not this test's
            value_study.curve(study, p)
        return got

    plain, resampled = arms_of(False), arms_of(True)
    assert plain["0.5@seed+1"][0] == plain["0.5"][0]
    assert resampled["0.5"] == plain["0.5"] and resampled["0.5@seed+1"][1] == plain["0.5@seed+1"][1] == 10_000
    assert resampled["0.5@seed+1"][0] != resampled["0.5"][0]


def test_threads_rise_to_threads_alone_once_the_producers_stop(trained, tmp_path, monkeypatch):
    """threads_alone: the steps taken while the source's producer runs keep 05's thread count, the steps after
    it use threads_alone (the producer's core is free then); without it the count never changes."""
    monkeypatch.delenv(
        "EAGLE_MAX_THREADS", raising=False
    )  # `make test`'s cap (tests/conftest.py) would hold 1
    run, cfg, tr = trained
    seqs, _, _ = tr.sequences(run)
    inner, calls = tr.source, []

    class Producing:  # the source's producer runs for the first two steps
        def __call__(self, batch):
            return inner(batch)

        def producing(self):
            calls.append(1)
            return len(calls) <= 2

    torch.set_num_threads(1)
    p = tr.p
    try:
        tr.source = Producing()
        tr.p = p.model_copy(update={"num_threads": 1, "threads_alone": 2})
        _, log = tr.train(seqs, 4, 1, tmp_path / "a", "a")
        assert [r["threads"] for r in log] == [1, 1, 2, 2]
        torch.set_num_threads(1)
        tr.p = p.model_copy(update={"num_threads": 1, "threads_alone": 0})
        _, log = tr.train(seqs, 3, 1, tmp_path / "b", "b")
        assert [r["threads"] for r in log] == [1, 1, 1]
    finally:
        tr.source, tr.p = inner, p
        torch.set_num_threads(1)


def test_decoder_decodes_on_the_machine_rule_threads_not_the_training_threads(trained, monkeypatch):
    """07 trains each arm on threads_alone (2 on a 2-core host) and then decodes its tau: decoding must run on
    cpu_threads' count (one of two cores, the faster one for decoding) and leave the training threads as found."""
    from tests.support.threads import training_threads_on_two_cores

    run, _, tr = trained
    drafter = load_drafter(run / "drafter" / "final")
    prompts, _ = heldout_tau.heldout_prompts(run, 40.0, 2, 768)
    with training_threads_on_two_cores(monkeypatch) as seen:
        heldout_tau.Decoder(tr.source.model, prompts, 8, 3, []).add("d", drafter)
        assert seen() and {threads for _, threads in seen()} == {1}
        assert torch.get_num_threads() == 2


def test_two_decode_processes_give_the_one_process_sums_bit_for_bit(trained, monkeypatch):
    """On a 2-core host 07 decodes each arm's prompts in two forked one-thread processes (`machine.decoding_processes`
    of the training step's threads_alone): every prompt's generation, greedy and sampled, must be the one a single
    process makes. The reference is the decode in this process (torch on one thread owns one process)."""
    import os

    from tests.support.threads import training_threads_on_two_cores

    monkeypatch.delenv("EAGLE_MAX_THREADS", raising=False)  # the suite caps its workers at one thread
    run, _, tr = trained
    drafter = load_drafter(run / "drafter" / "final")
    prompts, _ = heldout_tau.heldout_prompts(run, 40.0, 3, 768)
    assert len(prompts) >= 3

    def runs(training_threads, **how):
        dec = heldout_tau.Decoder(tr.source.model, prompts, 10, 3, [])
        with training_threads_on_two_cores(monkeypatch, training_threads) as seen:
            num, den = dec.decode(drafter, **how)
            calls = seen()
        gens = [(g.output_ids, g.accepted, g.drafted) for g in dec.generations]
        return (num.tolist(), den.tolist(), gens), calls

    for how in ({}, {"temperature": 1.0, "top_p": 0.95, "draft": "probabilistic", "reps": 2, "seed": 3}):
        one, calls1 = runs(1, **how)
        two, calls2 = runs(2, **how)
        assert {pid for pid, _ in calls1} == {os.getpid()}  # the reference ran here
        assert calls2 and os.getpid() not in {pid for pid, _ in calls2}  # ... and this one in forked children
        assert {t for _, t in calls1 + calls2} == {1}
        assert two == one, how
        assert len(calls2) == len(prompts) * how.get("reps", 1)


def test_arm_processes_one_per_thread_the_step_holds_alone_and_one_where_it_cannot_fork(monkeypatch):
    """07's side-by-side arms: as many one-thread processes as threads_alone holds (else 05's num_threads rule),
    within the cores and EAGLE_MAX_THREADS; one for a drafter on a GPU, for producers that serve one training at
    a time (vllm) and where the params ask for one."""
    from types import SimpleNamespace

    from eagle_lib import value
    from eagle_lib.data_value import value_study
    from eagle_lib.engines import machine

    monkeypatch.delenv("EAGLE_MAX_THREADS", raising=False)
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)

    def procs(threads_alone=2, num_threads=0, device="cpu", source=None, **p):
        tr = SimpleNamespace(p=SimpleNamespace(threads_alone=threads_alone, num_threads=num_threads),
                             device=torch.device(device), source=source or object())  # fmt: skip
        return value_study.arm_processes(value.Params(**p), tr)

    assert procs() == 2  # the toy's 05 recipe on a 2-core host
    assert procs(threads_alone=0) == 1  # 05's rule: half the cores
    assert procs(threads_alone=0, num_threads=2) == 2
    assert procs(arm_processes=1) == 1
    assert procs(device="cuda") == 1
    assert procs(source=SimpleNamespace(producing=lambda: False)) == 1
    monkeypatch.setattr(machine, "usable_cores", lambda: 4)
    assert procs(threads_alone=4) == 4 and procs(arm_processes=3) == 3
    monkeypatch.setenv("EAGLE_MAX_THREADS", "1")  # the suite's workers
    assert procs(threads_alone=4) == 1 and procs(arm_processes=3) == 1
    with pytest.raises(ValueError, match="arm_processes"):
        value.Params(arm_processes=-1)


def test_arms_trained_side_by_side_are_the_one_thread_drafters_of_this_process(
    trained, tmp_path, monkeypatch
):
    """On a 2-core host 07 trains its arms two at a time, each in a forked process on one thread, while this
    process holds two: every drafter must be, bit for bit, the one Trainer.train makes here on one thread (the
    reference), each arm must have trained in a child on one thread, and a second call must find them all cached."""
    import os

    from eagle_lib import params, value
    from eagle_lib.data_value import value_study
    from eagle_lib.engines import machine

    monkeypatch.delenv("EAGLE_MAX_THREADS", raising=False)
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    run, cfg, _ = trained
    shutil.copytree(run, tmp_path / "run")  # 07 writes value/ into the run
    cfg07 = params.StageConfig("07_data_value", tmp_path / "run", cfg.shared, value.Params(arm_processes=2))
    st = value_study.Study(cfg07)
    assert st.arm_processes == 2
    half = subsets.fraction_subset(st.groups, 0.5)
    arms = [("0.5", half, None), ("0.5@seed+1", subsets.fraction_subset(subsets.resampled(st.groups, 7), 0.5), 7),
            ("1", subsets.fraction_subset(st.groups, 1.0), None), ("0.5 again", half, None)]  # fmt: skip
    calls, real = tmp_path / "calls.txt", st.trainer.train

    def spy(*a, **k):
        out = real(*a, **k)
        with calls.open("a") as f:
            f.write(f"{os.getpid()} {sorted({r['threads'] for r in out[1]})}\n")
        return out

    monkeypatch.setattr(st.trainer, "train", spy)
    shown: list[str] = []
    monkeypatch.setattr(st.progress, "emit", shown.append)
    torch.set_num_threads(2)
    try:
        st.train_side_by_side(arms)
    finally:
        torch.set_num_threads(1)
    lines = calls.read_text().splitlines()
    assert len(lines) == 3  # "0.5 again" is "0.5": trained once
    assert all(line.split(" ", 1)[1] == "[1]" for line in lines)
    assert str(os.getpid()) not in {line.split()[0] for line in lines}
    assert len(st.side_by_side) == 3
    # the stage's progress counts each arm as its training ends: arm 1/N, 2/N, 3/N
    assert [ln.split(",")[0] for ln in shown] == [f"arm {i}/{st.progress.total}" for i in (1, 2, 3)]
    for name, seqs, seed in arms[:3]:
        steps, warm = st.schedule(seqs)
        key = st.key(seqs, steps, warm, seed)
        got = load_drafter(st.out / "drafters" / key).state_dict()
        ref, _ = real(seqs, steps, warm, tmp_path / "ref" / name, "ref", seed, threads=1)
        assert torch.get_num_threads() == 1
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"{name}: {k}")
    st.train_side_by_side(arms)
    assert len(calls.read_text().splitlines()) == 3  # all cached
    key = st.key(half, *st.schedule(half))
    assert st.obtained(key, "0.5") == "trained side by side"
    assert st.obtained(key, "0.5 again") == "cached"  # the same data under another name: not trained again
