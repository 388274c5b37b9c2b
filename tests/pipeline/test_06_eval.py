"""Stage 06 on the ci run: lossless, tau per dataset at T=0 and T=1, an MT-Bench-schema eval set, context
buckets, preflight passes, a local vLLM server agrees (and its live preflight too)."""

import json

import pandas as pd
import pytest
import torch

from eagle_lib import report, store

CI_TOLERANCE = 0.15  # params/ci.yaml online_tolerance
# eagle3 minus n-gram tau on ci, measured at seeds 0 / 1 / 2 (an AVX2 host): 0.72 / 0.58 / 0.74 at T=0 (eagle3
# 1.81 / 1.67 / 1.83, n-gram 1.09 each) and 0.66 / 0.53 / 0.79 at T=1: the margins sit about one seed spread
# (0.17) below the lowest seed, so a drafter that stops learning fails while seed noise does not
QUALITY_MARGIN = 0.4


@pytest.fixture(scope="module")
def ev(ci_run):
    nb = ci_run / "reports" / "06_eval_acceptance.ipynb"
    return {"run": ci_run, "m": report.read_notebook_metrics(nb), "dir": ci_run / "eval"}


def test_lossless_and_tau_per_dataset(ev):
    m = ev["m"]
    assert m["lossless"] is True and m["tau_none"] == 1.0 and m["preflight_ok"] is True
    # a quality level: the trained drafter beats n-gram drafting by a margin (see QUALITY_MARGIN)
    assert m["tau_eagle3"] >= m["tau_ngram"] + QUALITY_MARGIN, (m["tau_eagle3"], m["tau_ngram"])
    assert m["eagle3_T=1"]["tau"]["all"] >= m["tau_ngram"] + QUALITY_MARGIN / 2
    assert len(m["tau_eagle3_by_dataset"]) >= 2 and len(m["acc_eagle3"]) == 3
    assert m["temperatures"] == [0.0, 1.0]
    assert "mt_bench" in m["tau_eagle3_by_dataset"] and "mt_bench" in m["eagle3_T=1"]["tau"]
    assert "mt_bench_turn2" in m["tau_eagle3_by_dataset"]  # turns: all: asked after the target's own answer


def test_report_opens_with_the_answer(ev):
    """The first output after the parameters is the generated answer sentence with the numbers."""
    nb = json.loads((ev["run"] / "reports" / "06_eval_acceptance.ipynb").read_text())
    outs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    first = next(o for o in outs if o.get("output_type") in ("execute_result", "display_data"))
    text = "".join(first["data"].get("text/markdown") or first["data"]["text/plain"])
    assert text.startswith("**eagle3 tau ") and "at T=0 and" in text and "at T=1" in text
    assert not any(o.get("name") == "stderr" for o in outs), "a cell shows stderr"


def test_context_buckets_account_for_every_step(ev):
    ctx = pd.read_csv(ev["dir"] / "context.csv")
    tau = pd.read_csv(ev["dir"] / "tau.csv")
    for (m, t), g in ctx.groupby(["method", "temperature"]):
        pooled = tau[(tau.method == m) & (tau.temperature == t) & (tau.dataset == "all")].iloc[0]
        assert g.steps.sum() == pooled.steps and list(g.bucket) == ["<128", "128-256", ">=256"]


def test_tau_table_matches_raw_steps(ev):
    """tau.csv re-derived from generations.jsonl: mean(accepted + 1) over every target step; accepted drafts
    never run past the output (each step's accepted drafts fit in the tokens the output holds)."""
    tau = pd.read_csv(ev["dir"] / "tau.csv")
    gens = store.read_jsonl(ev["dir"] / "generations.jsonl")
    for (method, temp, ds), row in tau.set_index(["method", "temperature", "dataset"]).iterrows():
        sel = [
            g
            for g in gens
            if g["method"] == method and g["temperature"] == temp and ds in ("all", g["dataset"])
        ]
        steps = [a for g in sel for a in g["accepted"]]
        assert row.tau == pytest.approx(sum(a + 1 for a in steps) / len(steps))
    for g in [g for g in gens if g["accepted"]]:
        assert 1 + sum(a + 1 for a in g["accepted"][:-1]) + g["accepted"][-1] <= len(g["output_ids"])
    meta = store.read_json(ev["dir"] / "meta.json")
    store.check_tally(meta)
    held = {(g["dataset"], g["id"]) for g in gens if not g["dataset"].startswith("mt_bench")}
    assert meta["kept"] == len(held) and meta["eval_sets"]["mt_bench"]["kept"] == 2
    assert meta["eval_sets"]["later_turns"] == {"kept": 2, "dropped": {}}


def test_outputs_equal_hf_greedy(ev):
    """Independent reference: transformers' own greedy generate on the toy target, first eagle3 prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_lib import models
    from eagle_lib.params import SharedParams

    torch.set_num_threads(2)
    path = models.resolve(SharedParams().target)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = models.stop_ids(AutoTokenizer.from_pretrained(path), target)
    gens = store.read_jsonl(ev["dir"] / "generations.jsonl")
    prompts = _prompts(ev["run"])
    for g in [
        g
        for g in gens
        if g["method"] == "eagle3" and g["temperature"] == 0 and not g["dataset"].startswith("mt_bench")
    ][:3]:
        ids = prompts[(g["dataset"], g["id"])]
        out = target.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=eos)
        ref = out[0, len(ids) :].tolist()
        assert g["output_ids"] == ref[: len(ref) if ref[-1] in eos else 32]


def _prompts(run_dir):
    """(dataset, id) -> prompt ids as 06 chose them (B prompts verbatim; A: before the last assistant turn)."""
    out = {}
    for f in (run_dir / "data" / "B").glob("*/prompts.jsonl"):
        out.update({(f.parent.name, str(r["id"])): r["prompt_ids"] for r in store.iter_jsonl(f)})
    for f in (run_dir / "data" / "A").glob("*/records.jsonl"):
        for r in store.iter_jsonl(f):
            m = r["loss_mask"]
            starts = [i for i, x in enumerate(m) if x and (i == 0 or not m[i - 1])]
            if starts:
                out[(f.parent.name, str(r["id"]))] = r["input_ids"][: starts[-1]]
    return out


def test_exports_and_preflight(ev):
    pf = json.loads((ev["dir"] / "preflight.json").read_text())
    assert {r["format"] for r in pf} == {"sglang", "speculators"} and all(r["ok"] for r in pf)
    sg = next(r for r in pf if r["format"] == "sglang")
    assert "--speculative-algorithm EAGLE3" in sg["commands"]["sglang"]


@pytest.mark.server
def test_local_vllm_agrees_with_offline(ev):
    m = ev["m"]
    assert m["online_verdict"]["verdict"] == "agree", m["online_verdict"]["message"]
    # vLLM counts drafts accepted past the stop token too: compare with the offline count made the same way
    assert abs(m["online_tau"] - m["tau_uncut_eagle3"]) <= CI_TOLERANCE
    assert m["online_greedy_equal"] == 1.0 and m["live_preflight_ok"] is True
