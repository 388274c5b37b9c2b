"""Stage 05's measured acceptance: prompts, tau against a from-scratch drafting reference, checkpoint choice."""

import pytest
import torch
from safetensors.torch import load_file

from eagle_lib import store, train
from eagle_lib.data import batches
from eagle_lib.drafter import checkpoints, measure
from eagle_lib.drafter.model import load_drafter
from tests.support import eagle_tiny

torch.set_num_threads(1)


def seq(ids, first_label):
    return batches.Sequence("s", list(ids), [0] * first_label + [1] * (len(ids) - first_label))


def test_prompts_are_the_tokens_before_the_first_label_evenly_spread():
    seqs = [seq(range(10 * i, 10 * i + 8), 3 + i % 3) for i in range(10)] + [seq([1, 2, 3], 1)]
    got = measure.prompts_of(seqs, 4, 4)
    # 10 usable (the last has a 1-token prompt); indices 0, 2, 5, 7 of them; prompts cut to their last 4 tokens
    assert got == [[0, 1, 2], [21, 22, 23, 24], [51, 52, 53, 54], [70, 71, 72, 73]]
    assert len(measure.prompts_of(seqs, 0, 100)) == 10


def test_due_and_best():
    assert [s for s in range(1, 12) if measure.due(s, 4, 11)] == [4, 8, 11]
    assert not measure.due(3, 0, 3)
    rows = [
        {"step": 1},
        {"step": 2, "measured_tau": 1.5},
        {"step": 3, "measured_tau": 2.0},
        {"step": 4, "measured_tau": 2.0},
    ]
    assert measure.best(rows)["step"] == 3 and measure.best([{"step": 1}]) is None


@torch.no_grad()
def reference_accepted(target, drafter, prompt, max_new, k):
    """Greedy EAGLE drafting recomputed from scratch (no KV caches) at every verify step."""
    aux = drafter.config.aux_layers

    def run(ids):
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[a + 1] for a in aux], -1)[0]  # (n, 3H)
        return out.logits[0].argmax(-1).tolist(), feats

    greedy, _ = run(prompt)
    seqn, emitted, accepted = list(prompt) + [greedy[-1]], 1, []
    while emitted < max_new:
        _, feats = run(seqn)
        n = len(seqn)
        # rows 0..n-2: token x_{t+1} with the target feature f_t; drafts chain from the last row
        out, logits = drafter(
            torch.tensor([seqn[1:]]), drafter.project(feats[None, : n - 1]), torch.arange(n - 1)[None]
        )
        h, drafts = out[:, -1:], [int(drafter.draft_to_target(logits[0, -1].argmax()))]
        ids, pos = seqn[1:], list(range(n - 1))
        hid = drafter.project(feats[None, : n - 1])
        for j in range(1, k):  # full recompute: previous rows plus the draft rows so far
            ids, pos = ids + [drafts[-1]], pos + [n - 2 + j]
            hid = torch.cat([hid, h], 1)
            out, logits = drafter(torch.tensor([ids]), hid, torch.tensor([pos]))
            h = out[:, -1:]
            drafts.append(int(drafter.draft_to_target(logits[0, -1].argmax())))
        g, _ = run(seqn + drafts)
        g = g[n - 1 :]
        a = 0
        while a < k and drafts[a] == g[a]:
            a += 1
        seqn += drafts[:a] + [g[a]]
        emitted += a + 1
        accepted.append(a)
    return accepted


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("m")
    return root, eagle_tiny.make_run(root)


def test_meter_tau_equals_the_from_scratch_reference(world):
    from transformers import AutoModelForCausalLM

    root, run = world
    target = AutoModelForCausalLM.from_pretrained(root / "target").eval()
    cfg = eagle_tiny.stage_config(run, root / "target")
    _, drafter, _, held, _, _ = train.build(cfg, torch.device("cpu"))
    with torch.no_grad():  # a drafter that agrees with the target now and then: mixed accept lengths
        drafter.lm_head.weight.mul_(3.0)
    prompts = measure.prompts_of(held, 3, 64)
    m = measure.Meter(target, drafter.config.aux_layers, prompts, 12, 3)(drafter)
    ref = [a for p in prompts for a in reference_accepted(target, drafter, p, 12, 3)]
    assert m["verify_steps"] == len(ref) and m["prompts"] == 3
    assert m["tau"] == pytest.approx(1 + sum(ref) / len(ref))
    assert m["acc"][0] == pytest.approx(sum(a >= 1 for a in ref) / len(ref))


def test_training_logs_measured_tau_and_final_can_take_the_best(world, tmp_path):
    import shutil

    root, run = world
    for d in ("data", "infer"):
        shutil.copytree(run / d, tmp_path / d)
    cfg = eagle_tiny.stage_config(
        tmp_path,
        root / "target",
        measure_every=2,
        measure_prompts=3,
        measure_new_tokens=8,
        final_checkpoint="best_measured",
    )
    summary = train.run(cfg)
    log = store.read_jsonl(tmp_path / "drafter" / "train_log.jsonl")
    assert [r["step"] for r in log if "measured_tau" in r] == [2, 4, 6]
    assert all(
        1.0 <= r["measured_tau"] <= 4.0 and len(r["measured_acc"]) == 3 for r in log if "measured_tau" in r
    )
    assert [r["elapsed_s"] for r in log] == sorted(r["elapsed_s"] for r in log)
    m = summary["measured"]
    top = max((r for r in log if "measured_tau" in r), key=lambda r: (r["measured_tau"], -r["step"]))
    assert (
        m["best_step"] == top["step"] == m["final_weights_step"] and m["final_tau"] == log[-1]["measured_tau"]
    )
    best = checkpoints.directory(tmp_path / "drafter", train.fingerprint(cfg)) / checkpoints.BEST
    final = load_file(str(tmp_path / "drafter" / "final" / "model.safetensors"))
    for k, v in load_file(str(best / "model.safetensors")).items():
        torch.testing.assert_close(final[k], v)
    assert set(summary["exports"]) == {"sglang", "speculators"}
    assert load_drafter(tmp_path / "drafter" / "final").config.draft_vocab_size == 64
    ck = checkpoints.complete(tmp_path / "drafter", train.fingerprint(cfg))
    assert ck and not list(ck[-1].glob("*.pt"))  # nothing to unpickle


def test_optimizer_state_round_trips_through_safetensors_and_json():
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95))
    p.grad = torch.randn(3, 2)
    opt.step()
    sd = opt.state_dict()
    named = {"state": {"w.a": sd["state"][0]}, "param_groups": [dict(sd["param_groups"][0], params=["w.a"])]}
    tensors, meta = checkpoints.split_optimizer(named)
    import json

    back = checkpoints.join_optimizer(tensors, json.loads(json.dumps(meta)))
    assert set(back["state"]["w.a"]) == set(named["state"]["w.a"])
    for k, v in named["state"]["w.a"].items():
        torch.testing.assert_close(back["state"]["w.a"][k], v)
    assert back["param_groups"][0]["betas"] == [0.9, 0.95] and back["param_groups"][0]["params"] == ["w.a"]


def test_report_answer_and_gap_table_state_the_numbers():
    from eagle_lib.drafter import figures

    summary = {
        "steps": 80,
        "cpu_s": 246.0,
        "heldout": {"acc": [0.66, 0.5], "cond_acc": [0.66, 0.7]},
        "vocab": {"majority_share": 0.05, "coverage": 0.98},
        "measured": {
            "final_tau": 3.1,
            "final_acc": [0.9, 0.72, 0.54],
            "drafts": 3,
            "elapsed_s": 294.0,
            "best_tau": 3.2,
            "best_step": 60,
            "final_weights_step": 80,
        },
    }
    text = figures.answer_text(summary)
    assert (
        text.startswith("Held-out acc_0 0.66")
        and "measured tau 3.10 at 3 drafts after 80 steps (4.9 min wall, 4.1 CPU-min;" in text
    )
    gap = figures.gap_table(summary)
    assert gap["measured_cond_acc"].round(3).tolist() == [0.9, 0.8, 0.75]
    assert (
        gap["teacher_forced_cond_acc"].tolist()[:2] == [0.66, 0.7]
        and gap["teacher_forced_cond_acc"].isna().iloc[2]
    )
    skipped = dict(summary, measured={"skipped": "measure_every is 0"})
    assert "not measured during training (measure_every is 0" in figures.answer_text(skipped)


def test_draft_intermediate_size_sets_the_mlp_width_and_is_exported(world, tmp_path):
    """05's `draft_intermediate_size` (a peer option: SpecForge / speculators take the draft layer's config):
    the drafter's MLP has that width, both exports carry it, and each export reloads to the same logits."""
    from eagle_lib.drafter import export

    root, run = world
    cfg = eagle_tiny.stage_config(run, root / "target", draft_intermediate_size=40)
    _, drafter, *_ = train.build(cfg, torch.device("cpu"))
    assert drafter.config.intermediate_size == 40
    assert tuple(drafter.midlayer.mlp.gate_proj.weight.shape) == (40, drafter.config.hidden_size)
    made = export.export_all(drafter, tmp_path / "export", str(root / "target"), ["LlamaForCausalLM"], 3)
    ids = torch.tensor([[3, 5, 7, 9]])
    aux = torch.randn(1, 4, 3 * drafter.config.hidden_size)
    pos = torch.arange(4)[None]
    with torch.no_grad():
        want = drafter(ids, drafter.project(aux), pos, drafter.new_cache())[1]
        for fmt, d in made.items():
            back = export.load_export(d, drafter.embed_tokens.weight, drafter.config.aux_layers)
            assert back.config.intermediate_size == 40, fmt
            torch.testing.assert_close(back(ids, back.project(aux), pos, back.new_cache())[1], want)
    default = train.build(eagle_tiny.stage_config(run, root / "target"), torch.device("cpu"))[1]
    from transformers import AutoConfig

    assert default.config.intermediate_size == AutoConfig.from_pretrained(root / "target").intermediate_size


def test_meter_decodes_on_the_machine_rule_threads_and_restores_the_training_threads(world, monkeypatch):
    """05's meter runs between training steps that may hold threads_alone (2): it decodes on cpu_threads' count."""
    from transformers import AutoModelForCausalLM

    from tests.support.threads import training_threads_on_two_cores

    root, run = world
    target = AutoModelForCausalLM.from_pretrained(root / "target").eval()
    cfg = eagle_tiny.stage_config(run, root / "target")
    _, drafter, _, held, _, _ = train.build(cfg, torch.device("cpu"))
    with training_threads_on_two_cores(monkeypatch) as seen:
        measure.Meter(target, drafter.config.aux_layers, measure.prompts_of(held, 2, 64), 6, 3)(drafter)
        assert seen() and {threads for _, threads in seen()} == {1}
        assert torch.get_num_threads() == 2


def test_meter_in_two_decode_processes_measures_what_one_process_does(world, monkeypatch):
    """05's meter between steps that hold threads_alone (2 on 2 cores) decodes its prompts in two forked one-thread
    processes; the tau and per-position acceptance are the one-process meter's exactly."""
    import os

    from transformers import AutoModelForCausalLM

    from tests.support.threads import training_threads_on_two_cores

    monkeypatch.delenv("EAGLE_MAX_THREADS", raising=False)
    root, run = world
    target = AutoModelForCausalLM.from_pretrained(root / "target").eval()
    cfg = eagle_tiny.stage_config(run, root / "target")
    _, drafter, _, held, _, _ = train.build(cfg, torch.device("cpu"))
    meter = measure.Meter(target, drafter.config.aux_layers, measure.prompts_of(held, 3, 64), 6, 3)
    got = {}
    for threads in (1, 2):
        with training_threads_on_two_cores(monkeypatch, threads) as seen:
            got[threads] = {k: v for k, v in meter(drafter).items() if k != "seconds"}
            got[threads, "pids"] = {pid for pid, _ in seen()}
    assert got[1, "pids"] == {os.getpid()} and os.getpid() not in got[2, "pids"]
    assert got[2] == got[1] and got[1]["verify_steps"] > 0
