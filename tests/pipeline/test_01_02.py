"""Stages 01_prepare_A and 02_extract_B in the ci run: every toy dataset loads in its real schema, exactly the
injected malformed rows are rejected (at their lines), nothing else is lost, and the reports show the tally."""

import json

import pytest

from eagle_lib import models, params, toy
from eagle_lib.pipeline import REPO_ROOT
from eagle_lib.report import read_notebook_metrics
from eagle_lib.store import check_tally, read_json, read_jsonl

A_SETS = ["native_chat", "native_tools"]
B_SETS = [
    "glaive",
    "mot",
    "openthoughts_114k",
    "openthoughts3",
    "swe_agent",
    "opencodeinstruct",
    "sharegpt",
    "ultrachat",
]
B_REASONS = {"duplicate", "over_cap", "too_long", "empty", "no_user_turn", "not_target", "no_prompt"}


@pytest.fixture(scope="module")
def toy_log():
    return json.loads((toy.world_dir() / "build_log.json").read_text())["datasets"]


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer(params.SharedParams())


def _rejected_positions(path):
    return [r["line"] - 1 if "line" in r else r["row"] for r in read_jsonl(path)]


@pytest.mark.parametrize("kind, names", [("A", A_SETS), ("B", B_SETS)])
def test_every_toy_dataset_tallied_and_only_malformed_rows_rejected(ci_run, toy_log, kind, names):
    meta = read_json(ci_run / "data" / kind / "meta.json")
    check_tally(meta)
    assert set(meta["datasets"]) == set(names)
    for name in names:
        m, log = meta["datasets"][name], toy_log[name]
        check_tally(m, name)
        assert m["read"] == log["n_records"] and m["kept"] > 0
        assert m["rejected"] == log["n_malformed"], name
        assert _rejected_positions(ci_run / "data" / kind / name / "rejects.jsonl") == [
            b["index"] for b in log["malformed"]
        ]
        if kind == "A":
            assert set(m["dropped"]) <= {"truncated_away"}, (name, m["dropped"])  # nothing else is lost
        else:
            assert set(m["dropped"]) <= B_REASONS, (name, m["dropped"])
            assert m["dropped"].get("empty", 0) == log["quirks"].get("empty", 0)
            assert m["dropped"].get("no_user_turn", 0) <= log["quirks"].get(
                "starts_with_function_response", 0
            )


def test_records_render_the_target_template_with_assistant_masks(ci_run, tok):
    """Structure check on the real toy tokenizer: every trained run starts with <think>, ends with <|im_end|>."""
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("<|im_end|>")
    header_end = tok.convert_tokens_to_ids("<|im_middle|>")
    for name in A_SETS:
        for rec in read_jsonl(ci_run / "data" / "A" / name / "records.jsonl")[:50]:
            ids, mask = rec["input_ids"], rec["loss_mask"]
            runs, start = [], None
            for i, m in enumerate(mask + [0]):
                if m and start is None:
                    start = i
                elif not m and start is not None:
                    runs.append((start, i))
                    start = None
            assert runs and sum(b - a for a, b in runs) == rec["n_trainable"]
            for a, b in runs:
                assert ids[a] == think and ids[a - 1] == header_end, rec["id"]
                assert ids[b - 1] == end or (rec["truncated"] and b == len(ids)), rec["id"]


def test_prompt_ids_are_the_template_with_generation_prompt(ci_run, tok):
    run = params.load_params(REPO_ROOT / "params" / "ci.yaml")
    p = run.stage("02_extract_B")
    caps = {d.name: d.max_prompts for d in p.datasets}
    for name in B_SETS:
        prompts = read_jsonl(ci_run / "data" / "B" / name / "prompts.jsonl")
        assert 0 < len(prompts) <= caps[name] and len({x["id"] for x in prompts}) == len(prompts)
        for x in prompts:
            want = tok.apply_chat_template(
                x["messages"], tools=x["tools"] or None, add_generation_prompt=True, return_dict=False
            )
            assert x["prompt_ids"] == want and x["n_prompt_tokens"] == len(want)
            assert x["n_prompt_tokens"] + run.shared.max_new_tokens <= p.max_seq_len


@pytest.mark.parametrize("stage, kind", [("01_prepare_A", "A"), ("02_extract_B", "B")])
def test_reports_show_the_final_tally(ci_run, stage, kind):
    nb_path = ci_run / "reports" / f"{stage}.ipynb"
    metrics = read_notebook_metrics(nb_path)
    meta = read_json(ci_run / "data" / kind / "meta.json")
    assert (metrics["read"], metrics["kept"], metrics["rejected"]) == (
        meta["read"],
        meta["kept"],
        meta["rejected"],
    )
    assert metrics["read"] == metrics["kept"] + metrics["dropped"] + metrics["rejected"]
    nb = json.loads(nb_path.read_text())
    tally = [c for c in nb["cells"] if "tally_table" in "".join(c["source"])][0]
    text = "".join("".join(o.get("data", {}).get("text/plain", "")) for o in tally["outputs"])
    assert "TOTAL" in text and all(n in text for n in meta["datasets"])
    answer = [c for c in nb["cells"] if ".answer(meta)" in "".join(c["source"])][0]
    shown = "".join("".join(o.get("data", {}).get("text/markdown", "")) for o in answer["outputs"])
    lead = (
        f"**{meta['kept']:,} of {meta['read']:,} A records kept**"
        if kind == "A"
        else (f"**{meta['kept']:,} prompts kept from {meta['read']:,} B rows**")
    )
    assert shown.startswith(lead)  # the report opens with its answer, numbers generated from the meta
    stderr = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("name") == "stderr"]
    assert not stderr, f"{stage}: stderr in the report: {stderr[0]['text'][:200]}"


def test_01_report_shows_how_every_record_was_masked(ci_run):
    meta = read_json(ci_run / "data" / "A" / "meta.json")
    for name, m in meta["datasets"].items():
        assert sum(m["masked_by"].values()) == m["kept"], name  # scan + verified fallback + pretokenized
    nb = json.loads((ci_run / "reports" / "01_prepare_A.ipynb").read_text())
    cell = [c for c in nb["cells"] if "masking_table" in "".join(c["source"])][0]
    text = "".join("".join(o.get("data", {}).get("text/plain", "")) for o in cell["outputs"])
    assert "verified_fallback" in text and all(n in text for n in meta["datasets"])
