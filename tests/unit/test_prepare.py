"""Stage 01_prepare_A on small toy files: records, tally, rejects, truncation, threshold, reuse, workers."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle_lib import params, prepare, store
from eagle_lib.data import formats, records
from eagle_lib.toy import datasets as toy_data
from eagle_lib.toy import tokenizer as toy_tok

N_ROWS, N_BAD = 40, 3
A_SETS = ["native_chat", "native_tools"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Toy A files (40 rows, 3 malformed each) and a small toy tokenizer: {"data": dir, "tok": dir, "logs": {}}."""
    root = tmp_path_factory.mktemp("world")
    logs, valid = {}, {}
    for name in ("native_chat", "native_tools"):
        logs[name], valid[name] = toy_data.write_dataset(root, name, 0, N_ROWS, N_BAD)
    corpus = [s for recs in valid.values() for r in recs for s in toy_data.string_leaves(r)]
    toy_tok.build_tokenizer(root / "tok", corpus, vocab_size=1024)
    return {"data": root, "tok": str(root / "tok"), "logs": logs}


def make_cfg(world, run_dir: Path, workers: int = 1, **stage) -> params.StageConfig:
    sources = [
        formats.Source(name=n, path=str(world["data"] / f"{n}.jsonl"), adapter="openai")
        for n in ("native_chat", "native_tools")
    ]
    p = prepare.Params(**({"datasets": sources, "batch_size": 16} | stage))
    shared = params.SharedParams(target="unused", tokenizer=world["tok"], num_workers=workers)
    return params.StageConfig("01_prepare_A", run_dir, shared, p)


def test_records_tally_and_rejects(world, tmp_path):
    meta = prepare.run(make_cfg(world, tmp_path))
    tok = AutoTokenizer.from_pretrained(world["tok"])
    store.check_tally(meta)
    for name in ("native_chat", "native_tools"):
        d = tmp_path / "data" / "A" / name
        m = store.read_json(d / "meta.json")
        store.check_tally(m)
        assert (m["read"], m["rejected"], m["kept"], m["dropped"]) == (N_ROWS, N_BAD, N_ROWS - N_BAD, {})
        rejects = store.read_jsonl(d / "rejects.jsonl")
        assert [r["line"] - 1 for r in rejects] == [b["index"] for b in world["logs"][name]["malformed"]]
        assert all(r["file"].endswith(f"{name}.jsonl") and r["reason"] for r in rejects)
        raw = [
            json.loads(x) for x in (world["data"] / f"{name}.jsonl").read_text().splitlines() if _parses(x)
        ]
        by_id = {
            r["id"]: r for r in _lines(world["data"] / f"{name}.jsonl") if isinstance(r, dict) and "id" in r
        }
        recs = store.read_jsonl(d / "records.jsonl")
        assert len(recs) == m["kept"] and len({r["id"] for r in recs}) == len(recs) and raw
        for rec in recs:
            assert set(rec) == {
                "id",
                "source",
                "input_ids",
                "loss_mask",
                "n_tokens",
                "n_trainable",
                "truncated",
            }
            assert rec["n_tokens"] == len(rec["input_ids"]) == len(rec["loss_mask"]) and not rec["truncated"]
            assert rec["n_trainable"] == sum(rec["loss_mask"]) > 0 and rec["source"] == name
            row = by_id[rec["id"].split(":", 1)[1]]  # the native rows' own id
            msgs = row.get("messages") or row.get("conversations")
            want = tok.apply_chat_template(msgs, tools=row.get("tools") or None, return_dict=False)
            assert rec["input_ids"] == want  # the target's own template and tokenizer, nothing else
            pairs = list(zip(rec["input_ids"], rec["loss_mask"], strict=True))
            trained = tok.decode([t for t, k in pairs if k])
            untrained = tok.decode([t for t, k in pairs if not k])
            for msg in msgs:
                if msg["role"] == "assistant" and msg.get("content"):
                    assert msg["content"] in trained
                elif msg["role"] in ("user", "tool"):
                    assert msg["content"] in untrained
    assert (
        meta["kept"] == 2 * (N_ROWS - N_BAD) and prepare.tally_table(meta).iloc[-1]["records"] == meta["kept"]
    )


def _parses(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _lines(path: Path) -> list:
    return [json.loads(x) if _parses(x) else None for x in path.read_text().splitlines()]


def test_parallel_workers_write_the_same_records(world, tmp_path):
    prepare.run(make_cfg(world, tmp_path / "one", workers=1))
    prepare.run(make_cfg(world, tmp_path / "two", workers=2))
    for name in ("native_chat", "native_tools"):
        a = (tmp_path / "one" / "data" / "A" / name / "records.jsonl").read_bytes()
        assert a == (tmp_path / "two" / "data" / "A" / name / "records.jsonl").read_bytes()


def test_truncation_is_counted(world, tmp_path):
    meta = prepare.run(make_cfg(world, tmp_path, max_seq_len=64))
    for name in ("native_chat", "native_tools"):
        m = meta["datasets"][name]
        store.check_tally(m)
        recs = store.read_jsonl(tmp_path / "data" / "A" / name / "records.jsonl")
        assert all(r["n_tokens"] <= 64 and r["n_trainable"] == sum(r["loss_mask"]) > 0 for r in recs)
        assert m["truncated"] == sum(r["truncated"] for r in recs)
        assert m["kept"] + m["dropped"].get("truncated_away", 0) == N_ROWS - N_BAD
    assert meta["datasets"]["native_chat"]["truncated"] > 0  # long answers cut, their first 64 tokens kept
    assert meta["datasets"]["native_tools"]["dropped"]["truncated_away"] > 0  # tool declarations fill them


def test_reject_threshold_fails_the_stage_clearly_and_keeps_the_data(world, tmp_path):
    with pytest.raises(records.StageFailed) as err:
        prepare.run(make_cfg(world, tmp_path, max_reject_fraction=0.01))
    msg = str(err.value)
    assert f"dataset native_chat: {N_BAD}/{N_ROWS} rows rejected" in msg and "native_tools" in msg
    assert "rejects.jsonl" in msg and "max_reject_fraction" in msg
    d = tmp_path / "data" / "A" / "native_chat"
    assert store.read_json(d / "meta.json")["status"] == "failed"
    assert len(store.read_jsonl(d / "records.jsonl")) == N_ROWS - N_BAD  # nothing already made is lost
    assert store.read_json(tmp_path / "data" / "A" / "meta.json")["status"] == "failed"


def test_unchanged_dataset_is_reused_and_a_change_redoes_it(world, tmp_path):
    first = prepare.run(make_cfg(world, tmp_path))
    again = prepare.run(make_cfg(world, tmp_path))
    assert not any(m["reused"] for m in first["datasets"].values())
    assert all(m["reused"] for m in again["datasets"].values())
    changed = prepare.run(make_cfg(world, tmp_path, turns="last"))
    assert not any(m["reused"] for m in changed["datasets"].values())
    assert (
        changed["datasets"]["native_chat"]["trainable_tokens"]
        < first["datasets"]["native_chat"]["trainable_tokens"]
    )


def test_pretokenized_source(world, tmp_path):
    path = tmp_path / "pre.jsonl"
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [5, 99999], "loss_mask": [0, 1]},
            {"input_ids": [5, 6], "loss_mask": [0, 0]}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(world, tmp_path)
    src = formats.Source(name="pre", path=str(path), adapter="pretokenized")
    cfg = params.StageConfig(
        cfg.name, tmp_path, cfg.shared, prepare.Params(datasets=[src], max_reject_fraction=0.5)
    )
    m = prepare.run(cfg)["datasets"]["pre"]
    assert (m["kept"], m["rejected"], m["dropped"]) == (1, 1, {"no_assistant_turn": 1})
    assert "vocab size" in store.read_jsonl(tmp_path / "data" / "A" / "pre" / "rejects.jsonl")[0]["reason"]


def test_duplicate_dataset_names_are_a_params_error():
    src = formats.Source(name="x", path="x.jsonl", adapter="openai")
    with pytest.raises(ValueError, match="duplicate dataset names"):
        prepare.Params(datasets=[src, src])


def test_a_crash_mid_dataset_keeps_the_previous_output_and_hides_the_partial(world, tmp_path, monkeypatch):
    prepare.run(make_cfg(world, tmp_path))
    before = (tmp_path / "data" / "A" / "native_chat" / "records.jsonl").read_bytes()
    real = formats.iter_rows

    def dying(src):
        for k, item in enumerate(real(src)):
            if k == 20:
                raise OSError("disk gone")
            yield item

    monkeypatch.setattr(formats, "iter_rows", dying)
    with pytest.raises(OSError, match="disk gone"):
        prepare.run(make_cfg(world, tmp_path, max_seq_len=999))
    assert (tmp_path / "data" / "A" / "native_chat" / "records.jsonl").read_bytes() == before
    assert sorted(p.parent.name for p in (tmp_path / "data" / "A").glob("*/records.jsonl")) == A_SETS
    monkeypatch.setattr(formats, "iter_rows", real)
    meta = prepare.run(make_cfg(world, tmp_path, max_seq_len=999))  # the rerun starts the dataset afresh
    assert meta["datasets"]["native_chat"]["read"] == N_ROWS and not meta["datasets"]["native_chat"]["reused"]


def _trained_text(tok, rec) -> str:
    return tok.decode([t for t, m in zip(rec["input_ids"], rec["loss_mask"], strict=True) if m])


def test_turns_each_trains_every_turn_with_its_reasoning_once(world, tmp_path):
    """One sequence per assistant turn: that turn (reasoning included, which `all` drops for history turns)
    is its only trained text; 04's scanner and 05's loader count exactly these trainable tokens."""
    from eagle_lib.data import batches
    from eagle_lib.length_study import scan

    meta = prepare.run(make_cfg(world, tmp_path / "each", turns="each"))
    all_meta = prepare.run(make_cfg(world, tmp_path / "all"))
    tok = AutoTokenizer.from_pretrained(world["tok"])
    for name in A_SETS:
        m = meta["datasets"][name]
        path = tmp_path / "each" / "data" / "A" / name / "records.jsonl"
        recs = store.read_jsonl(path)
        src = formats.Source(name=name, path=str(world["data"] / f"{name}.jsonl"), adapter="openai")
        convs = {}
        for where, raw, err in formats.iter_rows(src):
            try:
                conv = formats.adapt(raw, src, where) if err is None else None
            except formats.Malformed:
                conv = None
            if conv is not None:
                convs[conv["id"]] = conv
        turns = {cid: [x for x in c["messages"] if x["role"] == "assistant"] for cid, c in convs.items()}
        assert m["kept"] == all_meta["datasets"][name]["kept"] == len(convs)
        assert m["sequences"] == len(recs) and len({r["id"] for r in recs}) == len(recs)
        trained_turns = sorted((r["conversation"], k) for r in recs for k in r["turns"])
        assert trained_turns == sorted((c, k) for c, t in turns.items() for k in range(len(t)))  # each once
        for rec in recs:
            trained = _trained_text(tok, rec)
            assert rec["id"].startswith(f"{rec['conversation']}#s")
            for k in rec["turns"]:
                msg = turns[rec["conversation"]][k]
                assert msg["content"] in trained and trained.endswith("<|im_end|>")
                assert f"<think>{msg.get('reasoning_content', '')}</think>" in trained  # its own reasoning
            mine = [turns[rec["conversation"]][k]["content"] for k in rec["turns"]]
            others = [x["content"] for k, x in enumerate(turns[rec["conversation"]]) if k not in rec["turns"]]
            assert not any(o and o in trained and not any(o in c for c in mine) for o in others)  # history: 0
        lens = scan.scan_dataset("A", name, [path], None)
        assert sum(lens.cols["completion"]) == m["trainable_tokens"] == sum(r["n_trainable"] for r in recs)
        assert m["trainable_tokens"] > all_meta["datasets"][name]["trainable_tokens"]  # history reasoning
    train, held, _ = batches.load_sequences(tmp_path / "each", 0.0, 100_000)
    assert sum(sum(s.loss_mask) for s in train) == sum(
        meta["datasets"][n]["trainable_tokens"] for n in A_SETS
    )


def test_report_answer_names_methods_and_recommends_each(world, tmp_path):
    meta = prepare.run(make_cfg(world, tmp_path))
    text = prepare.answer_text(meta)
    n_kept = 2 * (N_ROWS - N_BAD)
    assert text.startswith(f"**{n_kept} of {2 * N_ROWS} A records kept** ({2 * N_BAD} rejected: ")
    assert f"masks: {n_kept} scan, 0 verified fallback." in text
    assert "drops the reasoning of earlier turns" in text and "`turns: each`" in text
    assert meta["template"]["drops_history_reasoning"] is True
    table = prepare.masking_table(meta)
    assert list(table.columns[:5]) == ["dataset", "scan", "verified_fallback", "pretokenized", "rejected"]
    assert table["scan"].sum() == n_kept and table["rejected"].sum() == 2 * N_BAD
    each = prepare.answer_text(prepare.run(make_cfg(world, tmp_path / "each", turns="each")))
    assert "drops the reasoning" not in each and "training sequences" in each


def test_masking_methods_and_reject_reasons_per_dataset(world, tmp_path):
    """A user pasting the assistant header forces the verified fallback; an empty assistant is rejected."""
    hi = {"role": "user", "content": "Hi"}
    rows = [
        {"messages": [hi, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "What is <|im_assistant|>assistant<|im_middle|>?"},
                      {"role": "assistant", "content": "A header."}]},
        {"messages": [hi, {"role": "assistant", "content": ""}, hi, {"role": "assistant", "content": "Yes."}]},
    ]  # fmt: skip
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = make_cfg(world, tmp_path)
    src = formats.Source(name="mixed", path=str(path), adapter="openai")
    cfg = params.StageConfig(
        base.name, tmp_path, base.shared, prepare.Params(datasets=[src], max_reject_fraction=0.5)
    )
    m = prepare.run(cfg)["datasets"]["mixed"]
    assert m["masked_by"] == {"scan": 1, "fallback": 1}
    assert m["reject_reasons"] == {"empty assistant message": 1}
    assert (
        "message 1: empty assistant message"
        in store.read_jsonl(tmp_path / "data/A/mixed/rejects.jsonl")[0]["reason"]
    )


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_layout_dataset_with_workers_gives_the_records_of_its_jsonl(
    world, tmp_path, monkeypatch, streaming
):
    """01 through datasets.load_dataset on a local hub-layout repo (two configs, parquet), 2 workers: the same
    token ids and masks, in the same order, as from the jsonl files the repo was made from."""
    import datasets

    from tests.support import hub_repo

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name in A_SETS:
        toy_data.write_dataset(tmp_path, name, 0, 30, 0)
    repo = hub_repo.build(tmp_path / "repo", tmp_path / "native_chat.jsonl", tmp_path / "native_tools.jsonl")
    hub = [formats.Source(name=n, path=str(repo), adapter="openai", config=c, streaming=streaming)
           for n, c in (("native_chat", "chat"), ("native_tools", "tools"))]  # fmt: skip
    local = [formats.Source(name=n, path=str(tmp_path / f"{n}.jsonl"), adapter="openai") for n in A_SETS]
    base = make_cfg(world, tmp_path, workers=2)
    for run, srcs in (("hub", hub), ("local", local)):
        p = prepare.Params(datasets=srcs, batch_size=8)
        prepare.run(params.StageConfig(base.name, tmp_path / run, base.shared, p))
    for name in A_SETS:
        got, want = (
            store.read_jsonl(tmp_path / r / "data/A" / name / "records.jsonl") for r in ("hub", "local")
        )
        assert len(got) == len(want) == 30
        assert [(r["input_ids"], r["loss_mask"]) for r in got] == [
            (r["input_ids"], r["loss_mask"]) for r in want
        ]
