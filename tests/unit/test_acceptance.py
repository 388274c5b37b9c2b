"""Stage 06: held-out prompt selection and the whole stage on a tiny run directory."""

import json
import random
from pathlib import Path

import pytest
import torch

from eagle_lib import acceptance, params, store
from eagle_lib.data import evalsets
from eagle_lib.serving import tables as tbl
from eagle_lib.serving import verdict

torch.set_num_threads(1)


# --- held-out prompts -------------------------------------------------------------------------------------
def test_a_prompt_ids():
    rec = {"input_ids": list(range(10)), "loss_mask": [0, 0, 1, 1, 0, 0, 0, 1, 1, 0]}
    assert evalsets.a_prompt_ids(rec, "first_turn") == [0, 1]
    assert evalsets.a_prompt_ids(rec, "last_turn") == [0, 1, 2, 3, 4, 5, 6]
    assert evalsets.a_prompt_ids({"input_ids": [1, 2], "loss_mask": [0, 0]}, "last_turn") is None


def write_run(run_dir, n=400, vocab=200, seed=0):
    rng = random.Random(seed)
    a, b = [], []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(4, 40))]
        mask = [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)
        a.append({"id": f"a{i}", "source": "s", "input_ids": ids, "loss_mask": mask})
        b.append({"id": f"b{i}", "source": "s", "messages": [], "prompt_ids": ids[: rng.randrange(2, 30)]})
    store.append_jsonl(run_dir / "data" / "A" / "chat" / "records.jsonl", a)
    store.append_jsonl(run_dir / "data" / "B" / "tools" / "prompts.jsonl", b)
    return a, b


def test_heldout_prompts_select_only_heldout(tmp_path):
    a, b = write_run(tmp_path)
    p = acceptance.Params(max_prompts_per_dataset=5, max_prompt_tokens=20)
    got, tally = acceptance.heldout_prompts(tmp_path, 10.0, p)
    exp_b = [r for r in b if store.is_heldout(r["id"], 10.0) and len(r["prompt_ids"]) <= 20][:5]
    assert [x.id for x in got["tools"]] == [r["id"] for r in exp_b]
    assert [x.prompt_ids for x in got["tools"]] == [r["prompt_ids"] for r in exp_b]
    for x in got["chat"]:
        rec = next(r for r in a if r["id"] == x.id)
        assert store.is_heldout(x.id, 10.0) and x.prompt_ids == rec["input_ids"][: rec["loss_mask"].index(1)]
    assert tally["read"] == 800 and tally["kept"] == 10
    store.check_tally(tally)


def test_malformed_record_names_file_and_record(tmp_path):
    write_run(tmp_path, n=5)
    store.append_jsonl(tmp_path / "data" / "B" / "tools" / "prompts.jsonl", [{"id": "b_bad", "messages": []}])
    with pytest.raises(store.RecordError, match=r"tools/prompts.jsonl: record 6 \(id 'b_bad'\)"):
        acceptance.heldout_prompts(tmp_path, 100.0, acceptance.Params())


# --- the whole stage --------------------------------------------------------------------------------------
def test_run_on_tiny_run_dir(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter, init_from_target, save_drafter
    from tests.support.tiny import build_world

    world = build_world(tmp_path / "world", layers=8)
    target = AutoModelForCausalLM.from_pretrained(world)
    d = Eagle3Drafter(Eagle3Config.from_target_config(AutoConfig.from_pretrained(world), 64))
    init_from_target(d, target.get_input_embeddings().weight)
    d.set_vocab_map(
        torch.arange(64) * 3 - torch.arange(64),
        torch.isin(torch.arange(d.config.vocab_size), torch.arange(64) * 3),
    )
    run_dir = tmp_path / "run"
    save_drafter(d, run_dir / "drafter" / "final")
    rng = random.Random(0)  # byte-token prompts: the tiny target answers chat prompts with EOS at once
    recs = [
        {"id": f"p{i}", "prompt_ids": [rng.randrange(256) for _ in range(rng.randrange(5, 30))]}
        for i in range(300)
    ]
    recs = [r for r in recs if store.is_heldout(r["id"], 5.0)][:4]
    store.append_jsonl(run_dir / "data" / "B" / "tiny" / "prompts.jsonl", recs)
    shared = params.SharedParams(target=str(world), device="cpu")
    p = acceptance.Params(
        max_prompts_per_dataset=3,
        eval_max_new_tokens=12,
        methods=["none", "ngram", "eagle3"],
        context_buckets=[20],
    )
    ev = acceptance.run(params.StageConfig("06_eval_acceptance", run_dir, shared, p))
    h = ev.headline
    assert h["lossless"] and h["tau_none"] == 1.0 and h["preflight_ok"] and h["prompts"] == 3
    assert set(ev.tau.method) == {"none", "ngram", "eagle3"} and "tiny" in set(ev.tau.dataset)
    assert set(ev.tau.temperature) == {0.0, 1.0} and h["temperatures"] == [0.0, 1.0]
    assert ev.answer.startswith("eagle3 tau ") and "at T=0 and" in ev.answer and "on 3/3 prompts" in ev.answer
    assert (
        set(ev.context.bucket) == {"<20", ">=20"}
        and ev.context.steps.sum() == ev.tau[ev.tau.dataset == "all"].steps.sum()
    )
    for f in [
        "tau.csv",
        "positions.csv",
        "accepted_hist.csv",
        "context.csv",
        "preflight.json",
        "meta.json",
        "generations.jsonl",
    ]:
        assert (run_dir / "eval" / f).exists(), f
    meta = store.read_json(run_dir / "eval" / "meta.json")
    assert meta["kept"] == 3 and meta["dropped"] == {"over_cap": 1}
    assert (run_dir / "eval" / "export" / "speculators" / "config.json").exists()
    gens = store.read_jsonl(run_dir / "eval" / "generations.jsonl")
    assert len(gens) == 18  # 3 prompts x 3 methods x 2 T
    # what the bits depend on; a rerun of one record repeats every token (T=1 too)
    rec = meta["reproducibility"]
    assert rec["seed"] == shared.seed and rec["threads"] == torch.get_num_threads() and rec["device"] == "cpu"
    assert any("thread" in n for n in rec["same_bits"])
    acceptance.run(params.StageConfig("06_eval_acceptance", run_dir, shared, p))
    timeless = [{k: v for k, v in g.items() if not k.endswith("_s")} for g in gens]
    again = [{k: v for k, v in g.items() if not k.endswith("_s")} for g in store.read_jsonl(run_dir / "eval" / "generations.jsonl")]  # fmt: skip
    assert again == timeless and any(g["temperature"] == 1.0 and g["output_ids"] for g in again)
    # decode_processes: 2 decodes in two forked one-thread processes: the same records in the same order, T=1 too
    import os

    from tests.support.threads import training_threads_on_two_cores

    monkeypatch.delenv("EAGLE_MAX_THREADS", raising=False)  # the suite caps its workers at one thread
    with training_threads_on_two_cores(monkeypatch, 1) as seen:
        p_forked = p.model_copy(update={"decode_processes": 2})
        assert acceptance.offline_processes(p_forked) == 2
        acceptance.run(params.StageConfig("06_eval_acceptance", run_dir, shared, p_forked))
        pids = {pid for pid, _ in seen()}
    forked = [{k: v for k, v in g.items() if not k.endswith("_s")} for g in store.read_jsonl(run_dir / "eval" / "generations.jsonl")]  # fmt: skip
    assert forked == timeless and pids and os.getpid() not in pids
    # stop_token_ids replaces the target's stop ids: the first token the target wrote now ends that answer
    first = next(g for g in gens if g["method"] == "none" and g["temperature"] == 0)
    assert len(first["output_ids"]) == 12 and meta["stop_ids"] != first["output_ids"][:1]
    p2 = p.model_copy(
        update={"methods": ["none"], "temperatures": [0.0], "stop_token_ids": first["output_ids"][:1]}
    )
    acceptance.run(params.StageConfig("06_eval_acceptance", run_dir, shared, p2))
    gens2 = {g["id"]: g for g in store.read_jsonl(run_dir / "eval" / "generations.jsonl")}
    assert store.read_json(run_dir / "eval" / "meta.json")["stop_ids"] == first["output_ids"][:1]
    assert gens2[first["id"]]["output_ids"] == first["output_ids"][:1] and len(gens2) == 3


def test_compare_online_flags_a_collapsed_server():
    """Offline tau 2.5 on both datasets; the server accepts nothing on one: that row and 'all' are flagged;
    whole outputs are compared (a shared prefix is not enough, a trimmed stop token is)."""
    gens = [
        {
            "method": m,
            "temperature": 0.0,
            "dataset": ds,
            "id": f"{ds}0",
            "accepted": acc,
            "output_ids": [1, 2, 3, 9],
            "total_s": 1.0,
            "lossless": True,
        }
        for ds in ("x", "y", "z")
        for m, acc in (("none", [0, 0]), ("eagle3", [2, 1]))
    ]
    tau, _, _ = tbl.tables(gens, 3, cost_ratio=0.1)
    raw = {
        0.0: {
            "x": {
                "tau": 2.5,
                "drafts": 2,
                "accepted": 3,
                "outputs": {"x0": [1, 2, 3]},
            },  # stop token 9 trimmed
            "y": {
                "tau": 1.0,
                "drafts": 8,
                "accepted": 0,
                "outputs": {"y0": [1, 2, 3]},
            },  # a prefix, other stop
            "z": {"tau": 2.5, "drafts": 2, "accepted": 3, "outputs": {"z0": [1, 2, 3, 9, 4]}},
        }
    }
    on = verdict.compare(raw, tau, gens, "vllm", 0.2, eos_ids=[9]).set_index("dataset")
    assert on.loc["x", "verdict"] == "agree" and on.loc["y", "verdict"] == "collapsed"
    assert any("EAGLE3" in c for c in on.loc["y", "causes"])
    assert on.loc["all", "online_tau"] == pytest.approx(1 + 6 / 12) and on.loc["all", "verdict"] == "lower"
    assert on.loc["x", "greedy_equal"] == 1.0 and on.loc["z", "greedy_equal"] == 0.0
    on = verdict.compare(raw, tau, gens, "vllm", 0.2, eos_ids=[5]).set_index("dataset")  # 9 is not a stop id
    assert on.loc["x", "greedy_equal"] == 0.0


# --- eval sets --------------------------------------------------------------------------------------------
EVAL_DIR = Path(__file__).resolve().parents[1] / "data" / "evalsets"
FIRST_MESSAGE = {  # what each schema's adapter must send, read from the files independently
    "mt_bench": lambda r: r["turns"][0],
    "speed_bench": lambda r: r["turns"][0],
    "gsm8k": lambda r: r["question"],
    "humaneval": lambda r: r["prompt"],
    "math500": lambda r: r["problem"],
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.support.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("bench", sorted(FIRST_MESSAGE))
def test_eval_sets_render_the_first_user_turn(tokenizer, bench):
    rows = [json.loads(x) for x in (EVAL_DIR / f"{bench}.jsonl").read_text().splitlines()]
    es = evalsets.EvalSet(name=bench, path=str(EVAL_DIR / f"{bench}.jsonl"), benchmark=bench, max_prompts=3)
    got, tally = evalsets.read(es, tokenizer, max_prompt_tokens=4096)
    assert len(got) == min(3, len(rows)) and tally == {
        "read": len(got),
        "kept": len(got),
        "dropped": {},
        "rejected": 0,
    }
    for g, r in zip(got, rows, strict=False):
        msgs = [{"role": "user", "content": FIRST_MESSAGE[bench](r)}]
        ref = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert g["prompt_ids"] == tokenizer.encode(ref, add_special_tokens=False) and g["dataset"] == bench
    if bench == "mt_bench":
        assert [g["id"] for g in got] == ["81", "101", "111"] and got[0]["category"] == "writing"


def test_eval_set_relative_path_and_errors(tokenizer, monkeypatch, tmp_path):
    monkeypatch.chdir(
        tmp_path
    )  # as JupyterLab runs a notebook from notebooks/: the repo root is the fallback
    es = evalsets.EvalSet(
        name="mt", path="tests/data/evalsets/mt_bench.jsonl", benchmark="mt_bench", max_prompts=1
    )
    assert len(evalsets.read(es, tokenizer, 4096)[0]) == 1
    bad = es.model_copy(update={"path": str(EVAL_DIR / "mt_bench_bad.jsonl"), "max_prompts": 5})
    with pytest.raises(
        evalsets.EvalSetError, match=r"mt_bench_bad.jsonl: line 2: field 'turns' must be a non-empty"
    ):
        evalsets.read(bad, tokenizer, 4096)
    short = es.model_copy(update={"max_prompts": 4})
    got, tally = evalsets.read(short, tokenizer, max_prompt_tokens=120)
    assert tally["read"] == 4 and tally["kept"] + tally["dropped"]["too_long"] == 4
    assert all(len(g["prompt_ids"]) <= 120 for g in got)


def test_later_turns_follow_the_targets_own_answers(tokenizer):
    """MT-Bench turn 2 is asked after turn 1 and the target's answer to it (its text after the end of thinking,
    the stop token dropped); the reference renders the whole conversation written out by hand."""
    rows = [json.loads(x) for x in (EVAL_DIR / "mt_bench.jsonl").read_text().splitlines()][:2]
    es = evalsets.EvalSet(name="mt", path=str(EVAL_DIR / "mt_bench.jsonl"), benchmark="mt_bench",
                          max_prompts=2, turns="all")  # fmt: skip
    got, _ = evalsets.read(es, tokenizer, 4096)
    assert [g["later_turns"] for g in got] == [r["turns"][1:] for r in rows]
    answers = {}  # prompt ids -> the "target's" output: some thinking, its end, an answer, the stop token

    def answer(ids):
        text = f"<think>scratch {len(answers)}</think>Answer number {len(answers)}."
        answers[tuple(ids)] = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return answers[tuple(ids)]

    later, tally = evalsets.followups(got, tokenizer, answer, 4096)
    assert list(later) == ["mt_turn2"] and tally == {"kept": 2, "dropped": {}}
    for i, (pr, r) in enumerate(zip(later["mt_turn2"], rows, strict=True)):
        msgs = [{"role": "user", "content": r["turns"][0]},
                {"role": "assistant", "content": f"Answer number {i}."},
                {"role": "user", "content": r["turns"][1]}]  # fmt: skip
        ref = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert pr.prompt_ids == tokenizer.encode(ref, add_special_tokens=False)
        assert (pr.id, pr.dataset) == (f"{r['question_id']}#t2", "mt_turn2")
    first = evalsets.read(es.model_copy(update={"turns": "first"}), tokenizer, 4096)[0]
    assert "later_turns" not in first[0] and evalsets.followups(first, tokenizer, answer, 4096)[0] == {}
    short, tally = evalsets.followups(got, tokenizer, answer, len(got[0]["prompt_ids"]) + 5)
    assert short == {} and tally["dropped"] == {"too_long": 2}
