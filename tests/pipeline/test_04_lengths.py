"""Stage 04 end to end on params/ci.yaml: the analysis of the CI run's real A records and B responses, checked
against statistics recomputed here from the record files (store.iter_jsonl + numpy) and the toy tokenizer."""

import numpy as np
import pandas as pd
import pytest

from eagle_lib import models, params, report, store
from eagle_lib.pipeline import REPO_ROOT

STAGE = "04_length_analysis"


@pytest.fixture(scope="module")
def analysis(ci_run):
    return ci_run / "analysis"


def _think_id():
    tok = models.load_tokenizer(params.SharedParams(target="toy://target"))
    return tok.convert_tokens_to_ids("</think>")


def _expected(ci_run):
    """dataset -> (completion lengths, prompt lengths, at-limit flags, reasoning tokens), first record per id."""
    think, out = _think_id(), {}
    for f in sorted((ci_run / "data" / "A").glob("*/records.jsonl")):
        recs = {r["id"]: r for r in reversed(list(store.iter_jsonl(f)))}.values()
        rows = []
        for r in recs:
            ids, mask = np.array(r["input_ids"]), np.array(r["loss_mask"])
            turn_starts = np.flatnonzero(np.diff(mask, prepend=0) == 1)
            reasoning = 0
            for s in turn_starts:
                e = s + np.argmin(np.append(mask[s:], 0))  # end of the run of ones
                hits = np.flatnonzero(ids[s:e] == think)
                reasoning += hits[-1] + 1 if hits.size else 0
            rows.append((mask.sum(), len(ids) - mask.sum(), r["truncated"], reasoning))
        out[("A", f.parent.name)] = rows
    for f in sorted((ci_run / "infer").glob("*/responses.jsonl")):
        recs = {r["id"]: r for r in reversed(list(store.iter_jsonl(f)))}.values()
        out[("B", f.parent.name)] = [
            (len(r["output_ids"]), len(r["prompt_ids"]), r["finish_reason"] == "length",
             r["output_ids"].index(think) + 1 if think in r["output_ids"] else 0)
            for r in recs
        ]  # fmt: skip
    return out


def test_tables_match_statistics_recomputed_from_the_records(ci_run, analysis):
    comp = pd.read_csv(analysis / "completion.csv").set_index(["kind", "dataset"])
    prompt = pd.read_csv(analysis / "prompt.csv").set_index(["kind", "dataset"])
    expected = _expected(ci_run)
    assert set(comp.index) == set(expected) and len(expected) >= 2
    for key, rows in expected.items():
        c, p, at_limit, reasoning = (np.array(v) for v in zip(*rows, strict=True))
        got = comp.loc[key]
        assert got.n == len(c)
        for name, q in (("p10", 10), ("median", 50), ("p90", 90), ("p99", 99)):
            assert got[name] == pytest.approx(np.percentile(c, q)), (key, name)
            assert prompt.loc[key, name] == pytest.approx(np.percentile(p, q)), (key, name)
        assert (got["min"], got["max"], got["mean"]) == (c.min(), c.max(), pytest.approx(c.mean()))
        assert got.share_at_limit == pytest.approx(at_limit.mean())
        assert got.reasoning_tokens == reasoning.sum() and got.answer_tokens == c.sum() - reasoning.sum()


def test_meta_summary_and_notebook_numbers_agree(ci_run, analysis):
    meta = store.read_json(analysis / "meta.json")
    store.check_tally(meta, "analysis/meta.json")
    assert meta["end_of_thinking_id"] == _think_id()
    summary = store.read_json(analysis / "summary.json")
    metrics = report.read_notebook_metrics(ci_run / "reports" / f"{STAGE}.ipynb")
    tokens = pd.read_csv(analysis / "tokens.csv")
    assert metrics["samples"] == summary["samples"] == meta["kept"] == tokens.samples.sum()
    assert metrics["trainable_tokens"] == summary["trainable_tokens"] == tokens.trainable_tokens.sum()
    assert tokens.trainable_share.sum() == pytest.approx(1.0)


def test_finished_run_is_not_projected_and_outputs_exist(analysis):
    proj = pd.read_csv(analysis / "projection.csv")
    b = proj[proj.kind == "B"]
    assert (b.status == "complete").all() and (b.remaining == 0).all()
    assert np.allclose(proj.projected, proj.measured) and np.allclose(proj.lo, proj.hi)
    verdicts = store.read_json(analysis / "verdicts.json")
    assert all(v["message"] and v["level"] in ("warn", "info") for v in verdicts)
    for png in ("lengths_ecdf", "truncation", "tokens"):
        assert (analysis / "plots" / f"{png}.png").stat().st_size > 10_000


@pytest.mark.parametrize("ledger", ["every dataset", "one dataset without"])
def test_03_killed_at_40_percent_then_04_covers_the_final_total(ci_run, tmp_path, ledger):
    """Issue 24's snapshot check on the CI run's real 03 files, cut at one moment (40% of all responses written)
    as a SIGKILL would leave them: every dataset has started (03 interleaves them), and 04's headline never
    claims more than it knows. With every ledger, 04 projects each dataset from its censored estimate and the
    interval holds the finished run's total; when one dataset has no ledger (an old run's files) and too few
    completed samples, the headline is an explicit lower bound, at or below the final total, never a point."""
    from eagle_lib import lengths
    from tests.support.snapshot import cut_run_at

    final = store.read_json(ci_run / "metrics" / f"{STAGE}.json")["projected_trainable_tokens"]
    cut_run_at(ci_run, tmp_path, 0.4)
    names = sorted(p.parent.name for p in (ci_run / "infer").glob("*/responses.jsonl"))
    for name in names:
        done = sum(1 for _ in store.iter_jsonl(ci_run / "infer" / name / "responses.jsonl"))
        snap = list(store.iter_jsonl(tmp_path / "infer" / name / "responses.jsonl"))
        assert snap and len(snap) < done, name  # every dataset begun, none finished
    if ledger != "every dataset":
        (tmp_path / "infer" / names[0] / "started.jsonl").unlink()
    run = params.load_params(REPO_ROOT / "params" / "ci.yaml")
    cfg = params.StageConfig(
        STAGE, tmp_path, run.shared.model_copy(update={"num_workers": 1}), run.stage(STAGE)
    )
    res = lengths.run(cfg)
    h = res.headline
    assert h["trainable_tokens"] < final
    lo, hi = h["projected_trainable_lo"], h["projected_trainable_hi"]
    print(f"{ledger}: measured {h['trainable_tokens']}, interval [{lo:.0f}, {hi}], final {final:.0f}")
    if ledger == "every dataset":
        assert not h["projected_is_lower_bound"] and lo <= final <= hi and lo < hi
    else:
        assert h["projected_is_lower_bound"] and h["unprojected_datasets"] == [f"B/{names[0]}"]
        assert h["projected_trainable_tokens"] is None and hi is None and lo <= final
        assert "lower bound" in res.answer_text and "95% interval" not in res.answer_text
