"""06's eval sets and live check as the Kimi params run them (issue 42, item 8): SPEED-Bench's stub rows refused and
counted, its coding set = the qualitative config's coding category, and the live preflight against SGLang
comparing the export SGLang serves. References are read from the files and commands independently of 06."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from eagle_lib import params, store
from eagle_lib.data import evalsets
from eagle_lib.serving import commands, live

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "params" / "kimi_k25.yaml"
STUB = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH\n\n{article}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.support.tiny import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _row(qid: str, category: str, text: str) -> dict:
    """One row in SPEED-Bench's published schema."""
    return {"question_id": qid, "category": category, "sub_category": "x", "turns": [text], "source": "s",
            "src_id": qid, "difficulty": "easy", "multiturn": False}  # fmt: skip


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _kimi_eval_set(name: str) -> evalsets.EvalSet:
    p = params.load_params(KIMI).stage("06_eval_acceptance")
    return next(es for es in p.eval_sets if es.name == name)


def test_speed_bench_stub_rows_are_refused_and_counted(tokenizer, tmp_path, capsys):
    rows = [_row("q1", "summarization", STUB), _row("q2", "qa", "Why is the sky blue?"),
            _row("q3", "qa", "  " + STUB), _row("q4", "math", "What is 2 + 3?")]  # fmt: skip
    path = _write(tmp_path / "throughput.jsonl", rows)
    es = evalsets.EvalSet(name="speed", path=str(path), benchmark="speed_bench", max_prompts=10)
    got, tally = evalsets.read(es, tokenizer, 4096)
    real = [r for r in rows if "FULL BENCHMARK DATA" not in r["turns"][0]]  # the reference: by eye
    assert [g["id"] for g in got] == [r["question_id"] for r in real] == ["q2", "q4"]
    assert [g["message"] for g in got] == [r["turns"][0] for r in real]
    assert tally == {"read": 4, "kept": 2, "dropped": {"stub": 2}, "rejected": 0}
    store.check_tally(tally)  # read = kept + dropped + rejected: nothing skipped silently
    assert "refused 2 SPEED-Bench stub row(s)" in capsys.readouterr().out


def test_a_set_of_stubs_only_stops_with_the_file_and_how_to_rebuild(tokenizer, tmp_path):
    path = _write(tmp_path / "t16k.jsonl", [_row(f"q{i}", "mixed", STUB) for i in range(3)])
    es = evalsets.EvalSet(name="speed_16k", path=str(path), benchmark="speed_bench", max_prompts=2)
    with pytest.raises(evalsets.EvalSetError, match=r"speed_16k.*t16k\.jsonl.*3 of them are SPEED-Bench stubs.*"
                       r"prepare_data\.py"):  # fmt: skip
        evalsets.read(es, tokenizer, 4096)


def test_kimi_speed_coding_is_the_coding_category_not_the_first_rows(tokenizer, tmp_path):
    """The qualitative config holds 11 categories of 80 rows; InferenceX's "SPEED-Bench coding" is the coding
    ones. A file in that layout whose first rows are another category: the Kimi set keeps only coding rows."""
    rows = [_row(f"w{i}", "writing", f"Write poem {i}.") for i in range(3)]
    rows += [_row(f"c{i}", "coding", f"Write a function f{i}.") for i in range(3)]
    rows += [_row("s1", "coding", STUB), _row("m1", "math", "Solve x + 1 = 2.")]
    es = _kimi_eval_set("speed_coding").model_copy(update={"path": str(_write(tmp_path / "q.jsonl", rows))})
    assert es.config == "qualitative" and es.max_prompts == 80
    got, tally = evalsets.read(es, tokenizer, 4096)
    coding = [r["question_id"] for r in rows if r["category"] == "coding" and "FULL" not in r["turns"][0]]
    assert [g["id"] for g in got] == coding == ["c0", "c1", "c2"]
    assert {g["category"] for g in got} == {"coding"}
    assert tally["dropped"] == {"other_category": 4, "stub": 1} and tally["read"] == len(rows)


def test_kimi_live_check_compares_the_export_sglang_serves(tmp_path, monkeypatch):
    """SGLang serves the sglang export (the command preflight prints; it cannot load the speculators one): a
    correctly started server must pass 06's live check with the Kimi params, not FAIL on the draft path."""
    p = params.load_params(KIMI).stage("06_eval_acceptance")
    assert p.online_engine == "sglang"
    exports = {f: tmp_path / "export" / f for f in ("sglang", "speculators")}
    for d in exports.values():
        d.mkdir(parents=True)
    cmd = commands.launch_commands("moonshotai/Kimi-K2.5", str(exports["sglang"]), "sglang", p.num_steps, p.topk,
                                   p.num_draft_tokens, p.serve_tp)["sglang"]  # fmt: skip
    argv = shlex.split(cmd)
    served = argv[argv.index("--speculative-draft-model-path") + 1]
    server = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": served,
              "speculative_num_steps": p.num_steps, "speculative_eagle_topk": p.topk,
              "speculative_num_draft_tokens": p.num_draft_tokens}  # fmt: skip
    monkeypatch.setattr(live, "sglang_server_args", lambda url, timeout=30.0, headers=None: server)
    monkeypatch.setenv(p.online_api_key_env, "k")
    checks = live.live_checks(p, p.online_url, exports[p.online_format], {0.0: {"all": {"tau": 2.6}}})
    failed = [c for c in checks if not c["ok"]]
    assert failed == [], failed
