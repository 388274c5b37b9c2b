"""Stage 06 on the ci run: lossless, tau per dataset, preflight passes, a local vLLM server agrees."""

import json

import pandas as pd
import pytest
import torch

from eagle_lib import report, store

CI_TOLERANCE = 0.15  # params/ci.yaml online_tolerance


@pytest.fixture(scope="module")
def ev(ci_run):
    nb = ci_run / "reports" / "06_eval_acceptance.ipynb"
    return {"run": ci_run, "m": report.read_notebook_metrics(nb), "dir": ci_run / "eval"}


def test_lossless_and_tau_per_dataset(ev):
    m = ev["m"]
    assert m["lossless"] is True and m["tau_none"] == 1.0 and m["preflight_ok"] is True
    assert m["tau_eagle3"] >= 1.0 and m["tau_ngram"] >= 1.0
    assert len(m["tau_eagle3_by_dataset"]) >= 2 and all(t >= 1.0 for t in m["tau_eagle3_by_dataset"].values())
    assert len(m["acc_eagle3"]) == 3 and m["acc_eagle3"] == sorted(m["acc_eagle3"], reverse=True)


def test_tau_table_matches_raw_steps(ev):
    """tau.csv re-derived from generations.jsonl: mean(accepted + 1) over every target step."""
    tau = pd.read_csv(ev["dir"] / "tau.csv")
    gens = store.read_jsonl(ev["dir"] / "generations.jsonl")
    for (method, ds), row in tau.set_index(["method", "dataset"]).iterrows():
        steps = [
            a for g in gens if g["method"] == method and ds in ("all", g["dataset"]) for a in g["accepted"]
        ]
        assert row.tau == pytest.approx(sum(a + 1 for a in steps) / len(steps))
    meta = store.read_json(ev["dir"] / "meta.json")
    store.check_tally(meta)
    assert meta["kept"] == len({(g["dataset"], g["id"]) for g in gens})


def test_outputs_equal_hf_greedy(ev):
    """Independent reference: transformers' own greedy generate on the toy target, first eagle3 prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_lib import acceptance, models
    from eagle_lib.params import SharedParams

    torch.set_num_threads(2)
    path = models.resolve(SharedParams().target)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = acceptance.eos_ids(AutoTokenizer.from_pretrained(path), target)
    gens = store.read_jsonl(ev["dir"] / "generations.jsonl")
    prompts = _prompts(ev["run"])
    for g in [g for g in gens if g["method"] == "eagle3"][:3]:
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
    assert abs(m["online_tau"] - m["tau_eagle3"]) <= CI_TOLERANCE
    assert m["online_greedy_equal"] == 1.0
