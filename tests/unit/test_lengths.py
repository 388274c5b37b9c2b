"""Stage 04 (eagle_lib.lengths, lengths_scan, lengths_report): the byte-level scanner against json.loads, the
statistics against numpy on the same data, the projection interval against known answers, the verdicts, torn
and corrupt files."""

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_lib import lengths, params, store
from eagle_lib.length_study import projection
from eagle_lib.length_study import scan as lengths_scan
from eagle_lib.length_study.scan import Lengths
from eagle_lib.lengths import Params

THINK = 163607
TOK = str(THINK).encode()


def response(i, out, prompt=(1, 2, 3), finish="stop", limit=64, **extra):
    prompt, out = [int(v) for v in prompt], [int(v) for v in out]
    return {"id": f"r{i}", "source": "t", "prompt_ids": prompt, "output_ids": out, "text": "x",
            "finish_reason": finish, "n_prompt_tokens": len(prompt), "n_output_tokens": len(out),
            "sampling": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": limit, "seed": 0}, "engine": "hf",
            "latency_s": 0.1} | extra  # fmt: skip


def a_record(i, ids, mask, truncated=False):
    return {"id": f"a{i}", "source": "a", "input_ids": list(ids), "loss_mask": list(mask), "n_tokens": len(ids),
            "n_trainable": sum(mask), "truncated": truncated}  # fmt: skip


def ref_response(rec):
    """Plain-Python reference for one B record: (prompt, completion, reasoning, reasoning span, status)."""
    out = rec["output_ids"]
    r = out.index(THINK) + 1 if THINK in out else 0
    status = {"stop": 0, "length": 1}.get(rec["finish_reason"], 2)
    return len(rec["prompt_ids"]), len(out), r, r, status


def ref_record(rec):
    """Reference for one A record: reasoning = per assistant turn, up to its last masked end-of-thinking."""
    ids, mask = rec["input_ids"], rec["loss_mask"]
    spans, i = [0], 0
    while i < len(mask):
        if not mask[i]:
            i += 1
            continue
        j = i
        while j < len(mask) and mask[j]:
            j += 1
        thinks = [k for k in range(i, j) if ids[k] == THINK]
        spans.append(thinks[-1] - i + 1 if thinks else 0)
        i = j
    return len(ids) - sum(mask), sum(mask), sum(spans), max(spans), int(rec["truncated"])


def dumps(rec, style):
    """The same record spelled several ways a writer may choose."""
    if style == "compact":
        return json.dumps(rec, separators=(",", ":")).encode()
    if style == "spaced":
        return json.dumps(rec).encode()
    keys = list(rec)
    random.Random(len(keys)).shuffle(keys)
    return json.dumps({k: rec[k] for k in keys}, ensure_ascii=False, separators=(", ", ": ")).encode()


ids = st.lists(
    st.sampled_from([THINK, 1636070, 16360, 7, 0, 163606, 3607]) | st.integers(0, 200_000), max_size=40
)
tricky_text = st.sampled_from(['"output_ids":[163607]', "]]", '\\"prompt_ids\\": [1', "163607", "é ✓", ""])
_FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(out=ids, prompt=ids, text=tricky_text, finish=st.sampled_from(["stop", "length", "abort"]),
       style=st.sampled_from(["compact", "spaced", "shuffled"]))  # fmt: skip
def test_scan_response_matches_json_reference(out, prompt, text, finish, style):
    rec = response(0, out, prompt, finish, text=text)
    sid, limit, *row = lengths_scan.scan_response(dumps(rec, style), TOK)
    assert (sid, limit) == ("r0", 64)
    assert tuple(row) == ref_response(rec)


@_FAST
@given(data=st.lists(st.tuples(ids.filter(bool), st.booleans()), min_size=1, max_size=6),
       style=st.sampled_from(["compact", "spaced", "shuffled"]), truncated=st.booleans())  # fmt: skip
def test_scan_record_matches_turn_reference(data, style, truncated):
    seq, mask = [], []
    for piece, trained in data:  # alternating spans: prompt-like (0) or assistant turns (1)
        seq += piece
        mask += [int(trained)] * len(piece)
    rec = a_record(0, seq, mask, truncated)
    sid, limit, *row = lengths_scan.scan_record(dumps(rec, style), TOK)
    assert sid == "a0" and limit is None
    assert tuple(row) == ref_record(rec)


def test_scan_rejects_inconsistent_records(tmp_path):
    bad = [
        (response(0, [1, 2]) | {"n_output_tokens": 3}, "n_output_tokens=3 but the list holds 2"),
        ({"id": "x", "finish_reason": "stop"}, "no output_ids"),
        (response(0, [1]) | {"output_ids": None}, "output_ids is not a list"),
        (response(0, [1]) | {"id": ["x"]}, "id is a list, not a string"),
    ]
    for i, (rec, why) in enumerate(bad):
        f = tmp_path / f"b{i}" / "responses.jsonl"
        store.append_jsonl(f, [response(9, [1]), rec, response(8, [2])])
        with pytest.raises(store.RecordError, match=f"{f}: line 2: {why}"):
            lengths_scan.scan_dataset("B", "b", [f], THINK)
    a = tmp_path / "a.jsonl"
    store.append_jsonl(a, [a_record(0, [1, 2, 3], [0, 1, 1]) | {"loss_mask": [0, 1]}])
    with pytest.raises(store.RecordError, match="line 1: loss_mask has 2 entries, input_ids 3"):
        lengths_scan.scan_dataset("A", "a", [a], THINK)


def test_torn_lines_are_skipped_like_store_and_corruption_is_named(tmp_path):
    f = tmp_path / "responses.jsonl"
    recs = [response(i, [i] * (i + 1)) for i in range(5)]
    store.append_jsonl(f, recs[:2])
    with open(f, "ab") as h:  # a crash mid-write, later terminated by the next append
        h.write(json.dumps(recs[2]).encode()[:25])
    store.append_jsonl(f, recs[3:])
    with open(f, "ab") as h:  # a write in progress: cut right after a nested object closed
        h.write(json.dumps(response(7, [1, 2]))[:-10].encode() + b"}")
    ls = lengths_scan.scan_dataset("B", "b", [f], THINK)
    assert (
        list(ls.arrays()["completion"]) == [len(r["output_ids"]) for r in store.iter_jsonl(f)] == [1, 2, 4, 5]
    )
    assert (ls.read, ls.torn) == (5, 1)  # the first fragment was truncated by the next append (store)
    assert ls.torn_at == [f"{f}:5"]  # named, file:line
    g = tmp_path / "corrupt.jsonl"
    g.write_bytes(
        json.dumps(recs[0]).encode() + b'\n{"id": "z", "output_ids": [1], oops}\n' + f.read_bytes()[:50]
    )
    with pytest.raises(store.RecordError, match=rf"{g}: line 2: "):
        lengths_scan.scan_dataset("B", "b", [g], THINK)


def test_empty_line_inside_a_file_is_an_error(tmp_path):
    f = tmp_path / "responses.jsonl"
    f.write_bytes(
        json.dumps(response(0, [1])).encode() + b"\n\n" + json.dumps(response(1, [1])).encode() + b"\n"
    )
    with pytest.raises(store.RecordError, match="line 2: empty line"):
        lengths_scan.scan_dataset("B", "b", [f], THINK)


def test_growing_file_is_read_up_to_its_size_when_opened(tmp_path):
    f = tmp_path / "responses.jsonl"
    store.append_jsonl(f, [response(i, [1, 2]) for i in range(3)])
    lines = store.iter_lines(f, block=64)
    first = next(lines)
    store.append_jsonl(f, [response(i, [1]) for i in range(3, 9)])  # 03 appends while we read
    assert 1 + sum(1 for _ in lines) == 3 and first[0] == 1


def test_repeated_ids_count_once_across_shard_files(tmp_path):
    main, shard = tmp_path / "responses.jsonl", tmp_path / "shards" / "0-of-2" / "responses.jsonl"
    store.append_jsonl(main, [response(0, [1] * 5), response(1, [1] * 6)])
    store.append_jsonl(shard, [response(1, [1] * 99), response(2, [1] * 7)])
    ls = lengths_scan.scan_dataset("B", "b", [main, shard], THINK)
    assert list(ls.arrays()["completion"]) == [5, 6, 7] and ls.duplicates == 1


def _numpy_row(recs, ref, short):
    """Independent expectations for one dataset, from the generated records and numpy."""
    p, c, r, span, s = (np.array(v) for v in zip(*(ref(x) for x in recs), strict=True))
    k = -(-len(c) // 10)
    return {
        "n": len(c), "min": c.min(), "p10": np.percentile(c, 10), "median": np.median(c), "mean": c.mean(),
        "p90": np.percentile(c, 90), "p99": np.percentile(c, 99), "max": c.max(), "share_at_limit": (s == 1).mean(),
        "share_stop": (s == 0).mean(), "reasoning_tokens": r.sum(), "answer_tokens": c.sum() - r.sum(),
        "share_short": (c < short).mean(), "top_decile_token_share": np.sort(c)[::-1][:k].sum() / c.sum(),
        "share_think_closed": (r > 0).mean(), "share_reasoning": (span >= 3).mean(),
        "reasoning_dataset": (span[s != 1] >= 3).mean() >= 0.5, "prompt_median": np.median(p),
        "prompt_p99": np.percentile(p, 99), "prompt_tokens": p.sum(), "completion_tokens": c.sum(),
    }  # fmt: skip


def make_run(root: Path, seed=0, n_b=300, planned=None, finished=False):
    """A run dir: A records (multi-turn masks), a reasoning B set with truncation, a short tool-call B set."""
    rng = np.random.default_rng(seed)
    a_recs, think_recs, tool_recs = [], [], []
    for i in range(120):
        turns = [(int(rng.integers(3, 30)), 0), (int(rng.integers(1, 60)), 1), (int(rng.integers(2, 9)), 0),
                 (int(rng.integers(1, 40)), 1)]  # fmt: skip
        ids_, mask = [], []
        for n, m in turns:
            piece = rng.integers(0, 4000, n).tolist()
            if m and rng.random() < 0.7:
                piece[int(rng.integers(0, n))] = THINK
            ids_, mask = ids_ + piece, mask + [m] * n
        a_recs.append(a_record(i, ids_, mask, truncated=bool(rng.random() < 0.01)))
    for i in range(n_b):
        n = int(min(256, rng.lognormal(5, 0.8)))
        out = rng.integers(0, 4000, n).tolist()
        if n > 4 and rng.random() < 0.9:
            out[int(rng.integers(0, n - 1))] = THINK
        think_recs.append(
            response(
                i, out, rng.integers(0, 9, int(rng.integers(5, 80))), "length" if n == 256 else "stop", 256
            )
        )
        n = int(rng.integers(0, 12))
        tool_recs.append(response(i, rng.integers(0, 4000, n), rng.integers(0, 9, 20), "stop", 256))
    store.append_jsonl(root / "data" / "A" / "native" / "records.jsonl", a_recs)
    for name, recs in (("think", think_recs), ("tools", tool_recs)):
        store.append_jsonl(root / "infer" / name / "responses.jsonl", recs)
        plan = planned or len(recs)
        store.write_json(
            root / "data" / "B" / name / "meta.json",
            {"read": plan, "kept": plan, "dropped": {}, "rejected": 0},
        )
        if finished:
            store.write_json(
                root / "infer" / name / "meta.json", {"read": len(recs), "kept": len(recs), "finished": 1.0}
            )
    return {"native": a_recs, "think": think_recs, "tools": tool_recs}


def cfg_for(root, **kw):
    return params.StageConfig(
        "04_length_analysis", root, params.SharedParams(), Params(end_of_thinking_id=THINK, **kw)
    )


def _sha(root):
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(root.rglob("*.json*"))}


def test_run_statistics_match_numpy_on_the_same_data(tmp_path):
    recs = make_run(tmp_path, finished=True)
    before = _sha(tmp_path)
    res = lengths.run(cfg_for(tmp_path))
    after = _sha(tmp_path)
    assert {k: after[k] for k in before} == before  # inputs are read only
    comp = res.completion.set_index("dataset")
    prm = res.prompt.set_index("dataset").add_prefix("prompt_")
    tok = res.tokens.set_index("dataset")
    for name, ref in (("native", ref_record), ("think", ref_response), ("tools", ref_response)):
        want = _numpy_row(recs[name], ref, short=32)
        got = comp.loc[name].to_dict() | prm.loc[name].to_dict() | tok.loc[name].to_dict()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12), (name, key)
    trainable = {n: _numpy_row(r, ref_record if n == "native" else ref_response, 32)["completion_tokens"]
                 for n, r in recs.items()}  # fmt: skip
    assert tok.trainable_share.to_dict() == pytest.approx(
        {n: v / sum(trainable.values()) for n, v in trainable.items()}
    )
    assert res.headline["trainable_tokens"] == sum(trainable.values())
    # finished datasets: nothing projected, interval collapses on the measured total
    assert (res.projection.remaining == 0).all() and (res.projection.lo == res.projection.measured).all()


def test_run_writes_tables_verdicts_plots_and_a_tallied_meta(tmp_path):
    make_run(tmp_path, planned=1000)
    with open(tmp_path / "infer" / "think" / "responses.jsonl", "ab") as h:
        h.write(b'{"id": "r-torn", "output_ids": [1, 2')  # 03 is still writing
    res = lengths.run(cfg_for(tmp_path))
    out = tmp_path / "analysis"
    meta = store.read_json(out / "meta.json")
    store.check_tally(meta)
    assert meta["dropped"] == {"torn_line": 1} and meta["kept"] == 720
    skipped = res.verdicts[res.verdicts.check == "skipped_lines"].message.tolist()
    assert len(skipped) == 1 and "think/responses.jsonl:" in skipped[0]  # the 04 report names the line
    for name in ("completion", "prompt", "tokens", "projection", "verdicts"):
        pd.testing.assert_frame_equal(pd.read_csv(out / f"{name}.csv"), getattr(res, name).reset_index(drop=True),
                                      check_dtype=False)  # fmt: skip
    written = pd.DataFrame(store.read_json(out / "verdicts.json"))
    pd.testing.assert_frame_equal(written, res.verdicts, check_dtype=False)
    assert store.read_json(out / "summary.json")["samples"] == 720
    for png in ("lengths_ecdf", "truncation", "tokens"):
        assert (out / "plots" / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    checks = set(zip(res.verdicts.dataset, res.verdicts.check, strict=True))
    assert ("think", "truncation") in checks and ("think", "reasoning_p99_at_limit") in checks
    assert ("tools", "median_far_below_peers") in checks and ("tools", "many_short") in checks
    assert ("think", "skipped_lines") in checks and ("native", "truncation") not in checks
    think = res.projection.query("dataset == 'think' and tokens == 'completion'").iloc[0]
    assert think.status == "in progress" and think.remaining == 700 and think.lo < think.projected < think.hi


def _check_row(**over):
    row = {"kind": "B", "dataset": "d", "n": 1000, "limit": 1000, "median": 400.0, "p99": 700.0,
           "share_at_limit": 0.01, "n_at_limit": 10, "n_at_limit_unclosed": 3, "share_reasoning": 0.9,
           "reasoning_dataset": True, "share_short": 0.0, "top_decile_token_share": 0.2, "n_empty": 0,
           "share_other": 0.0}  # fmt: skip
    return row | over


@pytest.mark.parametrize(
    "over, peers, check, numbers",
    [
        ({}, 500.0, None, []),
        ({"share_at_limit": 0.08, "n_at_limit": 80}, 500.0, "truncation", ["80 of 1000", "8.0%", "1000"]),
        ({"p99": 990.0}, 500.0, "reasoning_p99_at_limit", ["990", "1000"]),
        ({"p99": 990.0, "reasoning_dataset": False}, 500.0, None, []),
        ({"median": 40.0}, 500.0, "median_far_below_peers", ["40", "500"]),
        ({"share_short": 0.4, "top_decile_token_share": 0.61}, 500.0, "many_short", ["40.0%", "61%"]),
        ({"n_empty": 3}, 500.0, "empty_completions", ["3 of 1000"]),
        ({"share_other": 0.002}, 500.0, "other_finish_reason", ["0.2%"]),
    ],
)
def test_each_check_fires_on_its_threshold_and_names_its_numbers(over, peers, check, numbers):
    from eagle_lib.length_study.verdicts import _dataset_checks

    failed = [c for c in _dataset_checks(pd.Series(_check_row(**over)), peers, Params()) if c[3]]
    assert [c[0] for c in failed] == ([check] if check else [])
    for n in numbers:
        assert n in failed[0][4]


def test_limit_mismatch_and_no_think_token_are_reported():
    from eagle_lib.length_study.verdicts import verdicts

    ls = Lengths("B", "d")
    ls.add(3, 100, 0, 0, 0)
    ls.limits[512] += 1
    p = Params()
    comp, _, _ = lengths.tables([ls], p, max_new_tokens=1024)
    proj = pd.DataFrame(
        columns=["kind", "dataset", "tokens", "too_few_to_project", "status", "completed", "planned"]
    )
    v = verdicts(comp, proj, [ls], p, None, max_new_tokens=1024)
    assert set(v.check) == {"limit_mismatch", "no_end_of_thinking"}
    assert "[512]" in v.set_index("check").loc["limit_mismatch", "message"]


def test_top_decile_share_against_a_sort():
    rng = np.random.default_rng(3)
    for n in (1, 9, 10, 11, 1000):
        x = rng.integers(0, 5000, n)
        k = int(np.ceil(n / 10))
        assert lengths.top_decile_share(x) == pytest.approx(np.sort(x)[-k:].sum() / x.sum())


# ---------------------------------------------------------------- projection


def test_projection_of_constant_lengths_is_exact():
    x = np.full(50, 37)
    draws = projection.bootstrap_remaining(x, 950, 500, np.random.default_rng(0))
    assert np.allclose(draws, 950 * 37)


def test_projection_interval_width_matches_the_analytic_predictive_sd():
    """sd of the final total = sqrt(R^2 s^2 / n + R s^2) (mean uncertainty + the R future draws)."""
    rng = np.random.default_rng(1)
    x = rng.integers(1, 2000, 400)
    r = 1600
    draws = projection.bootstrap_remaining(x, r, 20_000, rng)
    s2 = x.var()
    assert draws.mean() == pytest.approx(r * x.mean(), rel=2e-3)
    assert draws.std() == pytest.approx(np.sqrt(r * r * s2 / x.size + r * s2), rel=0.03)


def test_projection_interval_covers_the_final_total_95_percent_of_the_time(tmp_path):
    """Known answer: a population is generated in full; the projection sees only a prefix of it."""
    rng = np.random.default_rng(2)
    hits, trials = 0, 300
    for _ in range(trials):
        full = np.minimum(rng.lognormal(5, 1.0, 500).astype(int), 4096)
        done = full[:100]
        draws = done.sum() + projection.bootstrap_remaining(done, 400, 400, rng)
        lo, hi = np.percentile(draws, [2.5, 97.5])
        hits += lo <= full.sum() <= hi
    assert 0.9 <= hits / trials <= 0.99


def test_planned_counts_come_from_02_capped_by_03_and_finished_runs_are_final(tmp_path):
    ds = tmp_path / "data" / "B"
    store.append_jsonl(ds / "a" / "prompts.jsonl", [{"id": i} for i in range(7)])
    store.write_json(ds / "b" / "meta.json", {"kept": 40})
    store.write_json(ds / "c" / "meta.json", {"kept": 40})
    store.write_json(tmp_path / "infer" / "c" / "meta.json", {"read": 12, "kept": 11, "finished": 5.0})
    assert projection.b_plan(tmp_path, "a") == (7, False)
    assert projection.b_plan(tmp_path, "b") == (40, False)
    assert projection.b_plan(tmp_path, "b", infer_limit=25) == (25, False)
    assert projection.b_plan(tmp_path, "c") == (12, True)
    assert projection.b_plan(tmp_path, "missing") == (None, False)


def test_too_few_samples_are_flagged_not_projected(tmp_path):
    make_run(tmp_path, n_b=10, planned=500)
    res = lengths.run(cfg_for(tmp_path, min_samples_to_project=30))
    proj = res.projection.set_index(["dataset", "tokens"])
    assert proj.loc[("think", "completion"), "too_few_to_project"]
    assert np.isnan(proj.loc[("think", "completion"), "projected"])
    assert set(res.corpus["unprojected"]) == {"B/think", "B/tools"}
    measured = res.projection.query("tokens == 'completion'").measured.sum()
    assert res.corpus["completion"]["projected"] == measured  # a lower bound: only what was measured
    assert "too_few_to_project" in set(res.verdicts.check)
    # the headline says so in words and states no point and no upper end (it used to print a zero-width interval)
    h = res.headline
    assert (
        h["projected_is_lower_bound"]
        and h["projected_trainable_tokens"] is None
        and h["projected_trainable_hi"] is None
    )
    from eagle_lib.length_study import verdicts

    text = verdicts.answer(res)
    assert "at least" in text and "lower bound" in text and "95% interval" not in text and "B/think" in text


# ---------------------------------------------------------------- parameters and sources


class FakeTokenizer:
    unk_token_id = 0
    vocab = {"<unk>": 0, "</think>": 4071, "<think>": 4070}

    def convert_tokens_to_ids(self, t):
        return self.vocab.get(t, 0)

    def convert_ids_to_tokens(self, i):
        return {v: k for k, v in self.vocab.items()}[i]


def test_end_of_thinking_id_resolution():
    shared = params.SharedParams()
    assert lengths.resolve_think_id(Params(), shared, lambda s: FakeTokenizer()) == 4071
    assert lengths.resolve_think_id(Params(end_of_thinking_id=163607), shared, None) == 163607  # no tokenizer
    assert lengths.resolve_think_id(Params(end_of_thinking_token=""), shared, None) is None
    with pytest.raises(ValueError, match="'</reasoning>' is not one token of the tokenizer 'toy://target'"):
        lengths.resolve_think_id(
            Params(end_of_thinking_token="</reasoning>"), shared, lambda s: FakeTokenizer()
        )


def test_no_inputs_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="run stages 01-03 first"):
        lengths.run(cfg_for(tmp_path))


def test_b_dataset_not_started_yet_is_listed_with_its_plan(tmp_path):
    store.write_json(tmp_path / "data" / "B" / "late" / "meta.json", {"kept": 80})
    store.append_jsonl(
        tmp_path / "infer" / "early" / "responses.jsonl", [response(i, [1] * 9) for i in range(40)]
    )
    sources = lengths_scan.find_sources(tmp_path, [])
    assert [(k, n, len(f)) for k, n, f, _ in sources] == [("B", "early", 1), ("B", "late", 0)]
    assert lengths_scan.find_sources(tmp_path, ["late"])[0][1] == "late"


def test_worker_processes_give_the_same_lengths(tmp_path, monkeypatch):
    make_run(tmp_path, n_b=40)
    sources = lengths_scan.find_sources(tmp_path, [])
    serial = lengths_scan.scan_all(sources, THINK, 1 << 20, workers=1)
    monkeypatch.setattr(lengths_scan, "PARALLEL_BYTES", 0)
    parallel = lengths_scan.scan_all(sources, THINK, 1 << 20, workers=2)
    for a, b in zip(serial, parallel, strict=True):
        assert (a.kind, a.name, a.read, a.limits) == (b.kind, b.name, b.read, b.limits)
        for key, col in a.arrays().items():
            np.testing.assert_array_equal(col, b.arrays()[key])


def test_empty_history_thinking_does_not_make_a_reasoning_sample():
    """Kimi-like history turns render <think></think> (2 tokens): summed over turns they are not reasoning."""
    start = 163606
    ids = [9, 9, start, THINK, 5, 5, 9, 9, start, THINK, 6, 9, start, THINK, 7]
    mask = [0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1]
    ls = Lengths("A", "a")
    ls.add(*lengths_scan.scan_record(dumps(a_record(0, ids, mask), "compact"), TOK)[2:])
    row = lengths.dataset_row(ls, Params())
    assert (row["reasoning_tokens"], row["share_think_closed"], row["share_reasoning"]) == (6, 1.0, 0.0)


# ---------------------------------------------------------------- mid-run, from the files (issue 16)


def test_mid_run_files_with_a_ledger_give_censored_estimates_that_cover_the_final(tmp_path):
    """A simulated run's files cut at 40% (responses + ledger, no 03 meta): 04 reads the in-flight requests from
    the ledger, its interval holds the final total where the finished-only one does not, truncation warns."""
    from tests.support.sim_run import simulate, write_files

    run = simulate("reasoning", seed=3, scale=0.03, concurrency=8)  # 240 prompts, 32 in flight at a time
    snap = run.snapshot(0.4)
    write_files(tmp_path, "reasoning", snap)
    store.write_json(
        tmp_path / "data/B/reasoning/meta.json", {"read": 240, "kept": 240, "dropped": {}, "rejected": 0}
    )
    restart = {
        "id": "reasoning-run0",
        "t": snap.as_of - 1.0,
        "server": "s0",
    }  # one in-flight request started again
    store.append_jsonl(tmp_path / "infer/reasoning/started.jsonl", [restart])
    shared = params.SharedParams(max_new_tokens=snap.limit, num_workers=1)
    p = Params(end_of_thinking_token="", bootstrap_reps=400, timeline_points=4)
    res = lengths.run(params.StageConfig("04_length_analysis", tmp_path, shared, p))
    row = res.projection.set_index(["dataset", "tokens"]).loc[("reasoning", "completion")]
    final = run.truth["tokens"]
    assert (row.method, row.in_flight, row.completed) == (
        "censored",
        snap.in_start.size,
        snap.completion.size,
    )
    assert row.lo <= final <= row.hi and not row.naive_lo <= final <= row.naive_hi
    trunc = res.verdicts.set_index("check").loc["truncation"]
    assert trunc.level == "warn" and "raise max_new_tokens" in trunc.message and "in flight" in trunc.message
    lo, hi = res.estimates["reasoning"]["share_at_limit"][1:]
    assert lo <= run.truth["share_at_limit"] <= hi
    assert res.verdicts.set_index("check").loc["restarted_in_flight", "value"] == 1
    tl = res.timeline
    assert len(tl) == 4 and tl.tokens_est.iloc[-1] == pytest.approx(row.projected, rel=0.02)
    assert (
        "run in progress" in res.answer_text
        and f"{int(snap.in_start.size)} responses in flight" in res.answer_text
    )
    assert (tmp_path / "analysis/timeline.csv").exists() and (
        tmp_path / "analysis/plots/timeline.png"
    ).exists()


def test_an_old_run_without_a_ledger_is_read_as_before_with_a_warning(tmp_path):
    make_run(tmp_path, n_b=60, planned=120)
    res = lengths.run(params.StageConfig("04_length_analysis", tmp_path, params.SharedParams(num_workers=1),
                                         Params(end_of_thinking_id=THINK, bootstrap_reps=200)))  # fmt: skip
    proj = res.projection[res.projection.tokens == "completion"]
    assert set(proj.method[proj.kind == "B"]) == {"finished only"}
    assert "no_ledger" in set(res.verdicts.check) and res.timeline.empty
