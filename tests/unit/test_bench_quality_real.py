"""benchmarks/quality_stats.py (bench_quality.py's real-model table): steps to quality interpolated on ours'
measured curve with its interval over seeds, means, spreads and ratios, against hand-computed references; and
quality_jobs.GreedyReplay (T=0 tau without the target's verify) step for step against the real decoder."""

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

from eagle_lib.decoding import specdec
from tests.support import models as tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import quality_jobs as qj  # noqa: E402
import quality_real  # noqa: E402
import quality_stats as qs  # noqa: E402

STEPS = [0, 10, 20, 40, 80]
CURVE = [1.0, 1.5, 2.0, 2.2, 2.4]


@pytest.mark.parametrize(
    ("goal", "want"),
    [
        (1.75, 15.0),  # between (10, 1.5) and (20, 2.0): 10 + 0.25 / 0.5 * 10
        (2.3, 60.0),  # between (40, 2.2) and (80, 2.4): 40 + 0.1 / 0.2 * 40
        (2.0, 20.0),  # exactly a measured point: that point's steps
        (0.9, 0.0),  # at or below the first point: its steps
        (2.5, None),  # never reached within the budget
    ],
)
def test_steps_to_reach_interpolates_linearly_between_the_points_around_the_crossing(goal, want):
    got = qs.steps_to_reach(STEPS, CURVE, goal)
    assert got == pytest.approx(want) if want is not None else got is None


def test_steps_to_reach_takes_the_first_crossing_of_a_curve_that_dips():
    assert qs.steps_to_reach([0, 1, 2, 3], [1.0, 2.0, 1.8, 2.5], 1.9) == pytest.approx(0.9)


def test_steps_to_reach_refuses_unordered_or_mismatched_input():
    with pytest.raises(ValueError):
        qs.steps_to_reach([0, 20, 10], [1.0, 2.0, 3.0], 1.5)
    with pytest.raises(ValueError):
        qs.steps_to_reach([0, 10], [1.0], 1.5)


def test_steps_interval_point_on_the_mean_curve_and_range_over_every_seed_pair():
    steps = [0, 10, 20]
    curves = [[1.0, 2.0, 3.0], [1.0, 1.5, 2.0]]
    # mean curve [1.0, 1.75, 2.5] vs mean final 2.0: 10 + 0.25 / 0.75 * 10
    # pairs: (c0, 1.5) -> 5, (c0, 2.5) -> 15, (c1, 1.5) -> 10, (c1, 2.5) -> never
    got = qs.steps_interval(steps, curves, [1.5, 2.5])
    assert got["point"] == pytest.approx(10 + 10 / 3)
    assert got["lo"] == pytest.approx(5.0)
    assert got["hi"] is None and got["not_reached"] == 1 and got["pairs"] == 4
    assert got["fraction"] == pytest.approx((10 + 10 / 3) / 20)
    assert got["fraction_hi"] is None


def test_steps_interval_closed_when_every_pair_is_reached():
    got = qs.steps_interval([0, 10, 20], [[1.0, 2.0, 3.0], [1.0, 1.5, 2.0]], [1.5])
    assert got["point"] == pytest.approx(0.5 / 0.75 * 10)  # mean curve 1.0 -> 1.75 over 0..10
    assert (got["lo"], got["hi"]) == (pytest.approx(5.0), pytest.approx(10.0))
    assert (got["fraction_lo"], got["fraction_hi"]) == (pytest.approx(0.25), pytest.approx(0.5))


def test_mean_spread_and_ratio_by_hand():
    s = qs.mean_spread([2.0, 2.2, 2.4])
    assert (s["mean"], s["sd"], s["min"], s["max"], s["n"]) == (
        pytest.approx(2.2), pytest.approx(0.2), 2.0, 2.4, 3,
    )  # fmt: skip
    assert qs.mean_spread([3.0])["sd"] == 0.0
    r = qs.ratio([2.0, 3.0], [1.0, 2.0])
    assert r["ratio"] == pytest.approx(2.5 / 1.5)  # ratio of the means, not the mean of the ratios
    assert (r["min"], r["max"]) == (pytest.approx(1.5), pytest.approx(2.0))


def test_fmt_steps_names_a_goal_beyond_the_budget():
    assert qs.fmt_steps(None, 80) == "> 80"
    assert qs.fmt_steps(12.345, 80) == "12.3"


# --- the T=0 replay (benchmarks/quality_jobs.GreedyReplay) against the real decoder ------------------------
V = 128


@pytest.fixture(scope="module")
def tiny_target():
    return tiny.llama(0, torch.float64, vocab_size=V, num_hidden_layers=6, tie_word_embeddings=False)


class _Corrupted:
    """The target's greedy drafts (from its recorded path) with one wrong token at a random position."""

    name, needs_features, q = "corrupted", True, None

    def __init__(self, path: list[int], seed: int):
        self.path, self.rng, self.n, self.feats = path, random.Random(seed), 0, []

    def start(self, seq, feats):
        self.n = len(seq)
        self.feats.append(feats.clone())

    def propose(self, k):
        d = list(self.path[self.n : self.n + k])
        j = self.rng.randrange(k + 1)
        if j < len(d):
            d[j] = (d[j] + 1) % V
        return d

    def advance(self, new, feats):
        self.n += len(new)
        self.feats.append(feats.clone())


def _record(target, prompt, n, k, aux):
    rec = qj.Recorder()
    g = specdec.speculative_generate(specdec.TargetRunner(target, aux), rec, prompt, n + k + 2, k, [])
    return prompt + g.output_ids, torch.cat(rec.feats)


@pytest.mark.parametrize("eos_at", [None, 9])
def test_greedy_replay_decodes_step_for_step_as_the_target(tiny_target, eos_at):
    """Every step's accepted count, the output and the features handed to the proposer equal the real
    decoder's (the target's own KV-cache verify), partial acceptance every step, with and without a stop."""
    aux, k, n = [1, 2, 3], 3, 24
    for prompt in ([5, 17, 9, 33, 2, 71, 9, 33], list(range(40, 60))):
        seq, feats = _record(tiny_target, prompt, n, k, aux)
        eos = [seq[len(prompt) + eos_at]] if eos_at is not None else []
        runs = []
        for runner in (specdec.TargetRunner(tiny_target, aux), qj.GreedyReplay(seq, feats, V)):
            prop = _Corrupted(seq, seed=3)
            g = specdec.speculative_generate(runner, prop, prompt, n, k, eos)
            runs.append((g, prop.feats))
        (real, real_f), (rep, rep_f) = runs
        assert rep.output_ids == real.output_ids and rep.accepted == real.accepted
        assert rep.matched == real.matched and sum(real.accepted) > 0
        assert len(rep_f) == len(real_f)
        assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(rep_f, real_f, strict=True))


def test_greedy_replay_refuses_a_block_off_the_recorded_path(tiny_target):
    seq, feats = _record(tiny_target, [5, 17, 9, 33], 8, 3, [1, 2, 3])
    rep = qj.GreedyReplay(seq, feats, V)
    rep.prefill(seq[:4])
    with pytest.raises(ValueError, match="off the recorded path"):
        rep.verify([(seq[4] + 1) % V, 1, 2])


def test_marks_are_the_budget_fractions():
    assert quality_real.marks(160) == [20, 40, 80, 160]
    assert quality_real.marks(2) == [1, 2]


def test_ours_set_overrides_05s_recipe_and_refuses_what_05_refuses():
    from eagle_lib.drafter.recipe import Params
    from eagle_lib.params import ParamsError, SharedParams

    p, sh = Params(learning_rate=0.002, max_steps=160), SharedParams(serve_temperatures=[0.0, 1.0])
    got, got_sh = quality_real.ours_recipe(p, sh, ["learning_rate=0.005", "target_temperature=1.0"])
    assert (got.learning_rate, got.target_temperature, got.max_steps) == (0.005, 1.0, 160) and got_sh is sh
    assert quality_real.ours_recipe(p, sh, []) == (p, sh)
    _, got_sh = quality_real.ours_recipe(p, sh, ["shared.serve_temperatures=[0.0]"])
    assert got_sh.serve_temperatures == [0.0] and sh.serve_temperatures == [0.0, 1.0]
    with pytest.raises(Exception, match="learnin_rate"):  # 05's own validation names the unknown key
        quality_real.ours_recipe(p, sh, ["learnin_rate=0.005"])
    with pytest.raises(Exception, match="serve_temperatures"):  # and the shared params' their own rule
        quality_real.ours_recipe(p, sh, ["shared.serve_temperatures=[1.0, 1.0]"])
    with pytest.raises(ParamsError, match="one key of 05_train_eagle3"):
        quality_real.ours_recipe(p, sh, ["shared.seed=1"])


def _work(root, lr: float, vmap: bytes = b"map", t1_prompts: int = 2):
    import json

    root.mkdir()
    (root / "vocab_map.safetensors").write_bytes(vmap)
    (root / "eval.json").write_text(json.dumps({"work": str(root), "plan": {"run_dir": "r", "lr": lr},
                                                "sampled_prompts": t1_prompts}))  # fmt: skip
    (root / "refs.pt").write_bytes(b"refs")
    for side in quality_real.SIDES:
        spec = {"out": str(root / side / "seed0"), "vocab_map": str(root / "vocab_map.safetensors"),
                "lr": 0.002 if side != "ours" else lr}  # fmt: skip
        (root / f"train_{side}_0.json").write_text(json.dumps(spec))
        (root / side / "seed0" / "step_8").mkdir(parents=True)
        (root / side / "seed0" / "step_8" / "tau.json").write_text(side)
        (root / f"eval_{side}_0.done").write_text("")
    return root


def test_reuse_copies_only_peer_jobs_whose_spec_map_and_eval_settings_are_the_same(tmp_path):
    src = _work(tmp_path / "base", lr=0.002)
    new = tmp_path / "variant"
    _work(new, lr=0.005)
    for side in quality_real.SIDES:  # the variant's jobs not run yet
        shutil.rmtree(new / side)
        (new / f"eval_{side}_0.done").unlink()
    (new / "refs.pt").unlink()
    got = quality_real.reuse(new, src, [0])
    assert got == ["refs.pt", "speculators seed 0", "SpecForge seed 0"]  # never ours: its recipe differs
    assert (new / "SpecForge/seed0/step_8/tau.json").read_text() == "SpecForge"
    assert not (new / "ours").exists() and not (new / "eval_ours_0.done").exists()
    # another draft vocab map, or other eval settings: nothing is copied
    for kw in ({"vmap": b"other"}, {"t1_prompts": 3}):
        other = tmp_path / f"other{len(kw)}{next(iter(kw))}"
        _work(other, lr=0.005, **kw)
        for side in quality_real.SIDES:
            shutil.rmtree(other / side)
            (other / f"eval_{side}_0.done").unlink()
        (other / "refs.pt").unlink()
        assert quality_real.reuse(other, src, [0]) == ([] if "vmap" not in kw else ["refs.pt"])


def test_reuse_copies_ours_too_where_the_plans_differ_in_their_seeds_alone(tmp_path):
    """A work dir planned for seeds 0-2 takes ours' seed 0 from one planned for seed 0 (the same recipe, run
    and budget); one whose plan differs elsewhere (another --ours-set) takes the peers' only."""
    src = _work(tmp_path / "base", lr=0.002)
    plan = {"steps": 96, "ours_set": [], "run_dir": "r", "bench_params": {"learning_rate": 0.002}}
    (src / "plan.json").write_text(json.dumps(plan | {"seeds": [0], "vocab_map": str(src / "x")}))
    for name, ours_set, want in (("more", [], "ours seed 0"), ("other", ["loss_decay=0.5"], None)):
        new = _work(tmp_path / name, lr=0.002)
        for side in quality_real.SIDES:
            shutil.rmtree(new / side)
            (new / f"eval_{side}_0.done").unlink()
        (new / "plan.json").write_text(json.dumps(plan | {"seeds": [0, 1, 2], "ours_set": ours_set,
                                                          "vocab_map": str(new / "x")}))  # fmt: skip
        got = quality_real.reuse(new, src, [0, 1, 2])
        assert ("ours seed 0" in got) == (want is not None) and "speculators seed 0" in got
        assert (new / "ours/seed0/step_8/tau.json").exists() == (want is not None)


def test_speculators_muon_runs_its_newton_schulz_in_float32_on_cpu_with_torchs_update():
    import bench_quality
    from torch.optim import _muon

    torch_ns = _muon._zeropower_via_newtonschulz
    try:
        bench_quality.muon_float32_on_cpu()
        bench_quality.muon_float32_on_cpu()  # idempotent: wraps torch's once
        patched = _muon._zeropower_via_newtonschulz
        assert patched is not torch_ns and getattr(patched, "float32_on_cpu", False)
        g = torch.Generator().manual_seed(0)
        for shape in ((48, 80), (80, 48)):
            grad = torch.randn(*shape, generator=g)
            ours, theirs = (
                patched(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7),
                torch_ns(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7),
            )
            assert ours.dtype == torch.float32 and ours.shape == grad.shape
            # torch's bfloat16 result up to bfloat16's rounding
            assert (ours - theirs.float()).norm() / theirs.float().norm() < 0.02
            # and what the iteration is for: singular values pulled from G's spread into roughly (0.5, 1.5)
            sv, sv_g = torch.linalg.svdvals(ours), torch.linalg.svdvals(grad)
            assert sv_g.max() / sv_g.min() > 5 and 0.3 < sv.min() and sv.max() < 1.3
    finally:
        _muon._zeropower_via_newtonschulz = torch_ns


def _fake_work(work: Path) -> dict:
    """A work dir with one seed done on every side: 2 prompts (mt_bench, heldout) at T=0 and T=1, marks [2, 4]."""
    plan = {"seeds": [0], "steps": 4, "marks": [2, 4], "run_dir": "outputs/x", "tokens_per_step": 64, "sequences": 3,
            "train_sequences": 5, "kept_tokens": 99, "k": 3, "lr": 0.01, "warmup": 1, "optimizer": "muon",
            "store": "outputs/x/kept"}  # fmt: skip
    t0 = [{"id": "a", "group": "mt_bench"}, {"id": "b", "group": "heldout"}]
    refs = {"t0": t0, "t1": t0, "k": 3, "new_tokens": 4, "top_p": 0.95,
            "draft_sampling": "probabilistic"}  # fmt: skip
    torch.save(refs, work / "refs.pt")
    (work / "eval.json").write_text(json.dumps({"reps": 1}))
    for i, side in enumerate(("ours", "speculators", "SpecForge")):
        seed = work / side / "seed0"
        for m in [0, 2, 4] if side == "ours" else [2, 4]:
            # mt_bench: steps accepting [1, 0] -> tau (2 + 1) / 2 = 1.5 at step 4 (ours); lower earlier and for peers
            acc = [1, 0] if (side == "ours" and m == 4) else [0, 0]
            num = sum(a + 1 for a in acc)
            rows = {
                "a": {"num": num, "den": 2, "accepted": acc},
                "b": {"num": 2, "den": 2, "accepted": [0, 0]},
            }
            (seed / f"step_{m}").mkdir(parents=True)
            (seed / f"step_{m}" / "tau.json").write_text(json.dumps({"t0": rows, "t1": rows}))
        (seed / "result.json").write_text(json.dumps({"train_s": 10.0 * (i + 1)}))
    return plan


def test_report_states_the_wall_time_only_for_an_invocation_that_ran(tmp_path):
    """`quality_real.py report DIR` prints the table alone (it printed "Wall: nan min"); the bench's own run states
    its wall time; the table's tau is the pooled (sum num / sum den) one, computed here by hand."""
    import quality_report

    plan = _fake_work(tmp_path)
    alone = quality_report.report(tmp_path, plan, None)
    assert "nan" not in alone and "Wall" not in alone
    ran = quality_report.report(tmp_path, plan, 90.0)
    assert "Wall: 1.5 min for this invocation" in ran
    out = json.loads(alone.splitlines()[-1])
    assert out["tau"]["ours"]["t0"]["MT-Bench+HumanEval"]["mean"] == pytest.approx(3 / 2)  # (2 + 1) / 2 steps
    assert out["tau"]["ours"]["t0"]["all"]["mean"] == pytest.approx((3 + 2) / 4)
    assert out["tau"]["speculators"]["t0"]["MT-Bench+HumanEval"]["mean"] == pytest.approx(1.0)


def test_a_work_dir_of_ours_alone_reports_ours_and_a_peer_short_of_a_seed_is_left_out(tmp_path):
    """A ``--sides ours`` variant's work dir printed "no seed has every side's tau yet": it reports ours alone; a
    peer that has not finished every seed ours finished drops out of the table and the ratios."""
    import shutil

    import quality_report

    plan = _fake_work(tmp_path)
    shutil.rmtree(tmp_path / "SpecForge")
    text = quality_report.report(tmp_path, plan, None)
    out = json.loads(text.splitlines()[-1])
    assert set(out["tau"]) == {"ours", "speculators"} and set(out["ratio"]) == {"speculators"}
    assert out["ratio"]["speculators"]["t0"]["MT-Bench+HumanEval"]["ratio"] == pytest.approx(1.5)  # 1.5 / 1.0
    assert "SpecForge" not in text
    shutil.rmtree(tmp_path / "speculators")
    out = json.loads(quality_report.report(tmp_path, plan, None).splitlines()[-1])
    assert set(out["tau"]) == {"ours"} and "ratio" not in out and "steps_to_peer_final" not in out
    assert out["tau"]["ours"]["t1"]["all"]["mean"] == pytest.approx((3 + 2) / 4)
    shutil.rmtree(tmp_path / "ours")
    assert "no seed has our side's tau yet" in quality_report.report(tmp_path, plan, None)


def test_a_run_of_ours_alone_needs_no_peer_venv(tmp_path):
    """`--sides ours` stopped on a missing SpecForge venv that only SpecForge's training jobs run in; a side that
    is asked for still needs its own."""
    from types import SimpleNamespace

    import quality_real

    (tmp_path / "plan.json").write_text(json.dumps({"seeds": [0], "steps": 4, "lr": 0.01, "ours_set": []}))
    a = SimpleNamespace(vllm=False, spec_python=str(tmp_path / "none"), sf_python=str(tmp_path / "none"),
                        sides=["ours"], work_dir=str(tmp_path), seeds=[1], steps=4, ours_set=[], peer_lr=0.0)  # fmt: skip
    with pytest.raises(
        SystemExit, match="planned for seeds"
    ):  # past the venv check, stopped by the plan's seeds
        quality_real.main(a)
    a.sides = ["ours", "SpecForge"]
    with pytest.raises(SystemExit, match="make specforge-env"):
        quality_real.main(a)


def test_the_served_table_pools_vllms_counts_and_takes_the_ratio_of_the_seed_means(tmp_path):
    """``--vllm``: each side's served.json (vLLM's accepted / drafts per prompt group); tau over MT-Bench +
    HumanEval pools the eval sets' counts (1 + accepted / drafts), by hand here; a side served for only some
    seeds is left out of the served table."""
    import quality_report

    plan = _fake_work(tmp_path)

    def served(side: str, mt: tuple, held: tuple, same: int) -> None:
        groups = {"mt_bench": {"accepted": mt[0], "drafts": mt[1], "tau": 0.0},
                  "heldout": {"accepted": held[0], "drafts": held[1], "tau": 0.0}}  # fmt: skip
        row = {"t0": groups, "t1": groups, "same": same, "n": 2}
        (tmp_path / side / "seed0" / "served.json").write_text(json.dumps(row))

    served("ours", (3, 6), (1, 4), 2)  # MT-Bench + HumanEval 1 + 3/6 = 1.5; all 1 + 4/10 = 1.4
    served("speculators", (2, 8), (0, 2), 1)  # 1.25; all 1.2
    text = quality_report.report(tmp_path, plan, None)
    out = json.loads(text.splitlines()[-1])["served"]
    assert out["ours"]["t0"]["MT-Bench+HumanEval"]["mean"] == pytest.approx(1.5)
    assert out["ours"]["t1"]["all"]["mean"] == pytest.approx(1.4)
    assert out["speculators"]["t0"]["all"]["mean"] == pytest.approx(1.2)
    assert out["ratio"]["speculators"]["t0"]["ratio"] == pytest.approx(1.5 / 1.25)
    assert out["ours"]["same"] == [2, 2] and out["speculators"]["same"] == [1, 2]
    assert "SpecForge" not in out and "greedy = target's 2/2" in text
