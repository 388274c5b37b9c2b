"""Stage 02_extract_B: prompt cut, prompt_ids, length filter, dedup (text and SWE instance), seeded cap, tally."""

import json
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle_lib import extract, params, store
from eagle_lib.toy import datasets as toy_data
from eagle_lib.toy import tokenizer as toy_tok

SIZES = {"glaive": 40, "sharegpt": 40, "swe_agent": 8, "ultrachat": 40}
EXT = {"glaive": "jsonl", "sharegpt": "jsonl", "swe_agent": "jsonl", "ultrachat": "parquet"}
N_BAD = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bworld")
    logs, valid = {}, {}
    for name, n in SIZES.items():
        logs[name], valid[name] = toy_data.write_dataset(root, name, 0, n, N_BAD)
    corpus = [s for recs in valid.values() for r in recs for s in toy_data.string_leaves(r)]
    toy_tok.build_tokenizer(root / "tok", corpus, vocab_size=1024)
    return {"data": root, "tok": str(root / "tok"), "logs": logs, "valid": valid}


def source(world, name, **kw):
    return extract.BSource(name=name, path=str(world["data"] / f"{name}.{EXT[name]}"), adapter=name, **kw)


def make_cfg(world, run_dir: Path, sources, workers=1, seed=0, max_new_tokens=64, **stage):
    p = extract.Params(**({"datasets": sources, "batch_size": 8, "max_reject_fraction": 0.5} | stage))
    shared = params.SharedParams(
        target="unused", tokenizer=world["tok"], num_workers=workers, seed=seed, max_new_tokens=max_new_tokens
    )
    return params.StageConfig("02_extract_B", run_dir, shared, p)


U, A, T = ({"role": r, "content": r[0]} for r in ("user", "assistant", "tool"))


@pytest.mark.parametrize(
    "msgs, turn, want",
    [
        ([U, A, U, A], "first", [U]),
        ([U, A, U, A], "last", [U, A, U]),
        ([U, A, T, A, U], "first", [U]),
        ([U, A, U], "last", [U, A, U]),  # ends on a user turn: regenerate its missing answer
        ([U, A, T, A], "last", [U, A, T]),
        ([U], "first", [U]),
        ([U, A, A], "last", [U]),  # consecutive assistant messages answer the same turn
    ],
)
def test_prompt_messages(msgs, turn, want):
    assert extract.prompt_messages(msgs, turn) == want


def test_prompt_key_normalizes_case_and_spacing_only():
    a = [{"role": "user", "content": "Hello   World\n"}]
    assert extract.prompt_key(a, []) == extract.prompt_key([{"role": "user", "content": "hello world"}], [])
    assert extract.prompt_key(a, []) != extract.prompt_key([{"role": "user", "content": "hello word"}], [])
    assert extract.prompt_key(a, []) != extract.prompt_key([{"role": "system", "content": "hello world"}], [])


def test_prompts_tally_and_prompt_ids(world, tmp_path):
    names = list(SIZES)
    meta = extract.run(make_cfg(world, tmp_path, [source(world, n) for n in names]))
    tok = AutoTokenizer.from_pretrained(world["tok"])
    store.check_tally(meta)
    for name in names:
        d = tmp_path / "data" / "B" / name
        m = store.read_json(d / "meta.json")
        store.check_tally(m)
        assert m["rejected"] == N_BAD and m["read"] == world["logs"][name]["n_records"]
        assert [r.get("line", r.get("row", 0) + 1) - 1 for r in store.read_jsonl(d / "rejects.jsonl")] == [
            b["index"] for b in world["logs"][name]["malformed"]
        ]
        prompts = store.read_jsonl(d / "prompts.jsonl")
        assert len(prompts) == m["kept"] > 0 and len({p["id"] for p in prompts}) == len(prompts)
        for p in prompts:
            assert set(p) == {"id", "source", "messages", "tools", "prompt_ids", "n_prompt_tokens"}
            want = tok.apply_chat_template(
                p["messages"], tools=p["tools"] or None, add_generation_prompt=True, return_dict=False
            )
            assert p["prompt_ids"] == want and p["n_prompt_tokens"] == len(want)
            assert p["n_prompt_tokens"] + 64 <= 2048 and p["messages"][-1]["role"] in ("user", "tool")
    assert meta["datasets"]["sharegpt"]["dropped"].get("empty", 0) == world["logs"]["sharegpt"]["quirks"].get(
        "empty", 0
    )


def test_swe_agent_one_prompt_per_instance(world, tmp_path):
    extract.run(make_cfg(world, tmp_path, [source(world, "swe_agent")]))
    prompts = store.read_jsonl(tmp_path / "data" / "B" / "swe_agent" / "prompts.jsonl")
    instances = [p["id"].split(":", 1)[1] for p in prompts]  # SWE-agent rows are named by their issue
    valid_instances = {r["instance_id"] for r in world["valid"]["swe_agent"]}
    assert sorted(instances) == sorted(valid_instances)  # each instance once, none lost
    m = store.read_json(tmp_path / "data" / "B" / "swe_agent" / "meta.json")
    assert m["dropped"]["duplicate"] == len(world["valid"]["swe_agent"]) - len(valid_instances)


def test_text_duplicates_are_dropped(world, tmp_path):
    path = tmp_path / "dups.jsonl"
    rows = [{"messages": [{"role": "user", "content": c}, {"role": "assistant", "content": "x"}]}
            for c in ("Hi there", "hi   THERE", "Something else", "Hi there\n")]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = extract.BSource(name="dups", path=str(path), adapter="openai")
    m = extract.run(make_cfg(world, tmp_path, [src]))["datasets"]["dups"]
    assert (m["kept"], m["dropped"]) == (2, {"duplicate": 2})
    assert (
        extract.run(make_cfg(world, tmp_path / "nodedup", [src], dedup=False))["datasets"]["dups"]["kept"]
        == 4
    )


def test_length_filter(world, tmp_path):
    meta = extract.run(
        make_cfg(world, tmp_path, [source(world, "glaive")], max_seq_len=200, max_new_tokens=100)
    )
    m = meta["datasets"]["glaive"]
    prompts = store.read_jsonl(tmp_path / "data" / "B" / "glaive" / "prompts.jsonl")
    assert m["dropped"]["too_long"] > 0 and all(p["n_prompt_tokens"] + 100 <= 200 for p in prompts)


def test_rows_sharing_a_source_id_keep_the_first_and_count_the_rest(world, tmp_path):
    """Without dedup, SWE-agent runs of one issue share its id: one prompt per id, the others dropped as
    duplicate_id (03's resume and the held-out split key on ids)."""
    extract.run(make_cfg(world, tmp_path, [source(world, "swe_agent")], dedup=False))
    prompts = store.read_jsonl(tmp_path / "data" / "B" / "swe_agent" / "prompts.jsonl")
    m = store.read_json(tmp_path / "data" / "B" / "swe_agent" / "meta.json")
    runs = len(world["valid"]["swe_agent"])
    assert (
        len({p["id"] for p in prompts})
        == len(prompts)
        == len({r["instance_id"] for r in world["valid"]["swe_agent"]})
    )
    assert m["dropped"]["duplicate_id"] == runs - len(prompts) > 0


def test_cap_is_a_seeded_sample_independent_of_workers(world, tmp_path):
    def run(sub, workers, seed, batch):
        src = source(world, "ultrachat", max_prompts=10)
        extract.run(make_cfg(world, tmp_path / sub, [src], workers=workers, seed=seed, batch_size=batch))
        d = tmp_path / sub / "data" / "B" / "ultrachat"
        return [p["id"] for p in store.read_jsonl(d / "prompts.jsonl")], store.read_json(d / "meta.json")

    a, meta = run("a", 1, 0, 8)
    b, _ = run("b", 2, 0, 3)
    c, _ = run("c", 1, 1, 8)
    assert len(a) == 10 and a == b and a != c
    assert meta["dropped"]["over_cap"] == meta["read"] - meta["rejected"] - 10 - sum(
        v for k, v in meta["dropped"].items() if k != "over_cap"
    )
    lines = (world["data"] / "ultrachat.parquet").exists()
    order = [r["prompt_id"] for r in world["valid"]["ultrachat"]]  # ultrachat rows are named by prompt_id
    rows = sorted(order.index(i.split(":", 1)[1]) for i in a)
    assert lines and rows[-1] > 20  # sampled across the file, not its first rows
    assert Counter(i.split(":")[0] for i in a) == {"ultrachat": 10}


def test_pretokenized_b_source_is_rejected(world, tmp_path):
    path = tmp_path / "pre.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [0, 1]}) + "\n")
    src = extract.BSource(name="pre", path=str(path), adapter="pretokenized")
    with pytest.raises(extract.records.StageFailed, match="1/1 rows rejected"):
        extract.run(make_cfg(world, tmp_path, [src]))
    rej = store.read_jsonl(tmp_path / "data" / "B" / "pre" / "rejects.jsonl")
    assert "no messages to regenerate" in rej[0]["reason"]


def test_hub_layout_dataset_streamed_with_workers_gives_the_prompts_of_its_jsonl(
    world, tmp_path, monkeypatch
):
    """02 through datasets.load_dataset (streaming) on a local hub-layout repo, 2 workers: the prompts of the
    jsonl file the repo was made from."""
    import datasets

    from tests.support import hub_repo

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name in ("native_chat", "native_tools"):
        toy_data.write_dataset(tmp_path, name, 0, 30, 0)
    repo = hub_repo.build(tmp_path / "repo", tmp_path / "native_chat.jsonl", tmp_path / "native_tools.jsonl")
    hub = extract.BSource(name="tools", path=str(repo), adapter="openai", config="tools", streaming=True)
    local = extract.BSource(name="tools", path=str(tmp_path / "native_tools.jsonl"), adapter="openai")
    for run, src in (("hub", hub), ("local", local)):
        extract.run(make_cfg(world, tmp_path / run, [src], workers=2, dedup=False))
    got, want = (store.read_jsonl(tmp_path / r / "data/B/tools/prompts.jsonl") for r in ("hub", "local"))
    assert len(got) == len(want) == 30
    assert [(r["prompt_ids"], r["messages"], r["tools"]) for r in got] == [
        (r["prompt_ids"], r["messages"], r["tools"]) for r in want
    ]
