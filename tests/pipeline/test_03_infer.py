"""Stage 03 end to end on params/ci.yaml: every selected B prompt answered once, greedy ids equal model.generate."""

from __future__ import annotations

from collections import Counter

import torch

from eagle_lib import params, report, store
from eagle_lib.pipeline import REPO_ROOT


def test_every_selected_prompt_is_answered_exactly_once(ci_run):
    run = params.load_params(REPO_ROOT / "params/ci.yaml")
    stage, limit = run.stage("03_infer"), run.shared.max_new_tokens
    meta = store.read_json(ci_run / "infer" / "meta.json")
    store.check_tally(meta)
    assert meta["status"] == "ok" and meta["rejected"] == 0
    names = sorted(p.parent.name for p in (ci_run / "data" / "B").glob("*/prompts.jsonl"))
    assert sorted(meta["datasets"]) == names and names
    for name in names:
        prompts = store.read_jsonl(ci_run / "data/B" / name / "prompts.jsonl")[: stage.limit or None]
        recs = store.read_jsonl(ci_run / "infer" / name / "responses.jsonl")
        assert Counter(r["id"] for r in recs) == Counter(p["id"] for p in prompts), name
        by_id = {p["id"]: p for p in prompts}
        for r in recs:
            assert r["prompt_ids"] == by_id[r["id"]]["prompt_ids"]
            assert r["finish_reason"] in ("stop", "length") and 0 < r["n_output_tokens"] <= limit
            assert (
                r["finish_reason"] == "length"
                or r["output_ids"][-1] in meta["datasets"][name]["stop_token_ids"]
            )
        m = store.read_json(ci_run / "infer" / name / "meta.json")
        assert (m["read"], m["kept"]) == (len(prompts), len(recs))


def test_greedy_ids_equal_model_generate_on_the_toy_target(ci_run):
    from eagle_lib import models

    shared = params.load_params(REPO_ROOT / "params/ci.yaml").shared
    model = models.load_target(shared, device="cpu")
    recs = [r for f in sorted((ci_run / "infer").glob("*/responses.jsonl")) for r in store.read_jsonl(f)[:2]]
    metas = store.read_json(ci_run / "infer/meta.json")["datasets"]
    stops = next(iter(metas.values()))["stop_token_ids"]  # resolved once per run: the target's eos ids
    assert recs and all(m["stop_token_ids"] == stops for m in metas.values())
    for r in recs[:8]:
        ids = torch.tensor([r["prompt_ids"]])  # explicit mask: generate would treat pad-id tokens as padding
        g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=stops,
                           max_new_tokens=r["sampling"]["max_new_tokens"], pad_token_id=0)  # fmt: skip
        assert g[0, len(r["prompt_ids"]) :].tolist() == r["output_ids"], r["id"]


def test_notebook_reports_the_tally_and_speed(ci_run):
    m = report.read_notebook_metrics(ci_run / "reports" / "03_infer.ipynb")
    assert m["prompts"] == m["responses"] + m["errors"] and m["errors"] == 0
    assert m["output_tokens"] > 0 and 0 <= m["length_share"] <= 1 and m["engine"] == "embedded"
