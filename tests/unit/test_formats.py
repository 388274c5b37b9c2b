"""eagle_lib.data.formats: each public schema -> the normalized conversation, with the schemas' real quirks.

Records here are written by hand in the published schemas (field names as on the hub), so the adapters are
checked against the schemas, not against the toy generator; the toy files are checked separately for counts.
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_lib.data import formats
from eagle_lib.toy import datasets as toy_data


def src(adapter, **kw):
    return formats.Source(name="ds", path="-", adapter=adapter, **kw)


def adapt(adapter, row, **kw):
    return formats.adapt(row, src(adapter, **kw), {"line": 7})


GLAIVE_SYSTEM = (
    "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
    '{\n    "name": "get_exchange_rate",\n    "description": "Get the rate",\n    "parameters": {\n'
    '        "type": "object",\n        "properties": {"base": {"type": "string"}}\n    }\n}\n\n'
    '{\n    "name": "convert",\n    "parameters": {}\n}'
)
GLAIVE_CHAT = (
    "USER: What is the rate from USD to EUR?\n\n\n"
    'ASSISTANT: <functioncall> {"name": "get_exchange_rate", "arguments": \'{"base": "USD", "note": "it\'s"}\'} '
    "<|endoftext|>\n\n\n"
    'FUNCTION RESPONSE: {"rate": 0.9}\n\n\n'
    "ASSISTANT: The rate is 0.9. <|endoftext|>\n\n\n"
    "USER: Thanks!"
)


def test_glaive_functions_calls_and_responses():
    conv = adapt("glaive", {"system": GLAIVE_SYSTEM, "chat": GLAIVE_CHAT})
    assert [t["function"]["name"] for t in conv["tools"]] == ["get_exchange_rate", "convert"]
    roles = [m["role"] for m in conv["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]  # ends on a user turn: kept
    assert conv["messages"][0]["content"].startswith("You are a helpful assistant with access")
    call = conv["messages"][2]["tool_calls"][0]
    assert call["function"]["name"] == "get_exchange_rate"
    assert json.loads(call["function"]["arguments"]) == {"base": "USD", "note": "it's"}
    assert conv["messages"][2]["content"] == ""
    assert conv["messages"][3] == {"role": "tool", "tool_call_id": call["id"], "content": '{"rate": 0.9}'}
    assert conv["messages"][4]["content"] == "The rate is 0.9."  # <|endoftext|> stripped
    assert conv["id"] == "ds:7" and conv["source"] == "ds"


def test_glaive_without_functions_and_starting_with_function_response():
    conv = adapt(
        "glaive",
        {
            "system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
            "chat": 'FUNCTION RESPONSE: {"x": 1}\n\n\nUSER: Hi\n\n\nASSISTANT: Hello! <|endoftext|>',
        },
    )
    assert conv["tools"] == []
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant"]  # orphan response dropped


def test_glaive_only_function_response_has_no_user_turn():
    row = {"system": GLAIVE_SYSTEM, "chat": 'FUNCTION RESPONSE: {"x": 1}\n\n\nASSISTANT: Done. <|endoftext|>'}
    with pytest.raises(formats.Skip, match="no_user_turn"):
        adapt("glaive", row)


@pytest.mark.parametrize(
    "chat, reason",
    [
        ("USER: hi\n\n\nASSISTANT: <functioncall> not json at all", "unparseable <functioncall>"),
        ('USER: hi\n\n\nASSISTANT: <functioncall> {"name": "f", "arguments": \'{bad\'}', "not valid JSON"),
        ("no markers here", "no USER/ASSISTANT"),
    ],
)
def test_glaive_malformed(chat, reason):
    with pytest.raises(formats.Malformed, match=reason):
        adapt("glaive", {"system": GLAIVE_SYSTEM, "chat": chat})


def test_mixture_of_thoughts_reasoning_split():
    row = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n**4**"},
        ],
        "num_tokens": 12,
        "source": "open-r1/OpenR1-Math-220k",
    }
    conv = adapt("mot", row)
    assert conv["messages"][1] == {"role": "assistant", "content": "**4**", "reasoning_content": "add them"}


def test_openthoughts_114k_thought_solution_and_system():
    value = (
        "<|begin_of_thought|>\n\nthink hard\n\n<|end_of_thought|>\n\n"
        "<|begin_of_solution|>\n\nanswer 5\n\n<|end_of_solution|>"
    )
    row = {
        "system": "Your role...",
        "conversations": [{"from": "user", "value": "Q"}, {"from": "assistant", "value": value}],
    }
    conv = adapt("openthoughts", row)
    assert conv["messages"][0] == {"role": "system", "content": "Your role..."}
    assert conv["messages"][2] == {
        "role": "assistant",
        "content": "answer 5",
        "reasoning_content": "think hard",
    }
    assert [m["role"] for m in adapt("openthoughts", row, drop_system=True)["messages"]] == [
        "user",
        "assistant",
    ]


def test_openthoughts3_human_gpt():
    row = {"difficulty": 3, "source": "s", "domain": "math",
           "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "<think>r</think>\n\nA"}]}  # fmt: skip
    msgs = adapt("openthoughts", row)["messages"]
    assert msgs == [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning_content": "r"},
    ]


def swe_row(target=True, instance="org__repo-1"):
    traj = [
        {
            "role": "system",
            "text": "SETTING: you are an agent",
            "system_prompt": "x",
            "mask": True,
            "cutoff_date": "",
        },
        {"role": "user", "text": "ISSUE: fix it", "system_prompt": "", "mask": True, "cutoff_date": ""},
        {
            "role": "ai",
            "text": "DISCUSSION\nlook\n\n```\nls\n```",
            "system_prompt": "",
            "mask": False,
            "cutoff_date": "",
        },
        {"role": "user", "text": "a.py", "system_prompt": "", "mask": True, "cutoff_date": ""},
    ]
    return {"instance_id": instance, "model_name": "m", "target": target, "trajectory": traj, "exit_status": "submitted",
            "generated_patch": "", "eval_logs": ""}  # fmt: skip


def test_swe_agent_roles_group_and_target_filter():
    conv = adapt("swe_agent", swe_row())
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant", "user"]
    assert conv["messages"][2]["content"].startswith("DISCUSSION") and conv["group"] == "org__repo-1"
    with pytest.raises(formats.Skip, match="not_target"):
        adapt("swe_agent", swe_row(target=False), target_only=True)
    assert adapt("swe_agent", swe_row(target=False))["messages"]  # no filter by default


def test_opencodeinstruct():
    row = {k: "" for k in ("id", "domain", "generation_algorithm", "llm_judgement", "unit_tests",
                           "tests_execution_status", "average_test_score")}  # fmt: skip
    conv = adapt("opencodeinstruct", row | {"input": "Write f.", "output": "```python\ndef f(): pass\n```"})
    assert conv["messages"] == [{"role": "user", "content": "Write f."},
                                {"role": "assistant", "content": "```python\ndef f(): pass\n```"}]  # fmt: skip


@pytest.mark.parametrize("who", ["gpt", "chatgpt", "bing", "bard"])
def test_sharegpt_every_assistant_name(who):
    row = {"id": "a_0", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                           {"from": who, "value": "A"}]}  # fmt: skip
    assert [m["role"] for m in adapt("sharegpt", row)["messages"]] == ["system", "user", "assistant"]


def test_sharegpt_quirks():
    with pytest.raises(formats.Skip, match="empty"):
        adapt("sharegpt", {"id": "x", "conversations": []})
    row = {"id": "x", "conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Q"},
                                         {"from": "gpt", "value": "A"}]}  # fmt: skip
    assert [m["role"] for m in adapt("sharegpt", row)["messages"]] == [
        "user",
        "assistant",
    ]  # leading gpt dropped
    with pytest.raises(formats.Malformed, match="unknown role 'robot'"):
        adapt("sharegpt", {"id": "x", "conversations": [{"from": "robot", "value": "Q"}]})


def test_ultrachat():
    row = {"prompt": "Q", "prompt_id": "h", "messages": [{"role": "user", "content": "Q"},
                                                         {"role": "assistant", "content": "A"}]}  # fmt: skip
    assert adapt("ultrachat", row)["messages"][1] == {"role": "assistant", "content": "A"}


def test_openai_messages_tools_reasoning():
    row = {
        "id": "n1",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "Oslo?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "call it",
             "tool_calls": [{"id": "c0", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "3C"},
            {"role": "assistant", "content": "<think>sum up</think>It is 3C."},
        ],
        "tools": [{"name": "get_weather", "parameters": {}}],
    }  # fmt: skip
    conv = adapt("openai", row)
    m = conv["messages"]
    assert m[0] == {"role": "system", "content": "be brief"} and m[1]["content"] == "Weather Oslo?"
    assert m[2]["reasoning_content"] == "call it" and m[2]["content"] == ""
    assert json.loads(m[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert m[3] == {"role": "tool", "content": "3C", "tool_call_id": "c0"}
    assert m[4] == {"role": "assistant", "content": "It is 3C.", "reasoning_content": "sum up"}
    assert conv["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert adapt("openai", {"conversations": row["messages"]})["messages"] == m


@pytest.mark.parametrize(
    "row, reason",
    [
        ({}, "missing field 'messages'"),
        ({"messages": 5}, "must be list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": 3}]}, "must be a string"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "without a function name"),
    ],
)
def test_openai_malformed(row, reason):
    with pytest.raises(formats.Malformed, match=reason):
        adapt("openai", row)


def test_pretokenized():
    rec = adapt("pretokenized", {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})
    assert rec["input_ids"] == [1, 2, 3] and rec["loss_mask"] == [0, 1, 1]
    for bad, reason in [({"input_ids": [1, 2], "loss_mask": [1]}, "differ in length"),
                        ({"input_ids": [1, -2], "loss_mask": [1, 1]}, "non-negative"),
                        ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "0 or 1")]:  # fmt: skip
        with pytest.raises(formats.Malformed, match=reason):
            adapt("pretokenized", bad)


def test_split_reasoning_without_markers_is_all_answer():
    assert formats.split_reasoning("  plain answer ") == (None, "plain answer")


# ---------------------------------------------------------------- reading files


def test_iter_rows_jsonl_with_broken_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": \n\n[1, 2]\n{"a": 3}\n{"a": "\xff"}\n')
    got = list(formats.iter_rows(formats.Source(name="d", path=str(path), adapter="openai")))
    assert [(w["line"], r, e is not None) for w, r, e in got] == [
        (1, {"a": 1}, False), (2, None, True), (4, None, True), (5, {"a": 3}, False), (6, None, True)]  # fmt: skip
    assert "invalid JSON" in got[1][2] and "expected a JSON object" in got[2][2] and "UTF-8" in got[4][2]
    assert got[0][0]["file"] == str(path)


def test_iter_rows_json_array_parquet_and_max_read(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps([{"a": i} for i in range(5)]))
    pq.write_table(pa.Table.from_pylist([{"a": i} for i in range(5)]), tmp_path / "d.parquet")
    for name in ("d.json", "d.parquet"):
        got = list(
            formats.iter_rows(
                formats.Source(name="d", path=str(tmp_path / name), adapter="openai", max_read=3)
            )
        )
        assert [(w["row"], r) for w, r, _ in got] == [(0, {"a": 0}), (1, {"a": 1}), (2, {"a": 2})]


def test_a_json_array_cut_off_inside_a_record_gives_every_whole_record_and_counts_the_rest(tmp_path):
    """ShareGPT V3's file in its wheel ends inside a record: the records before it are read, the rest is one
    unreadable row naming its byte offset (counted by 01/02 like any rejected row), never a failed stage."""
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "é" * i}]} for i in range(4)]
    whole = json.dumps(rows, indent=2, ensure_ascii=False)
    cut = whole[: whole.index('"c3"') + 6]  # inside the fourth record
    (tmp_path / "cut.json").write_text(cut, encoding="utf-8")
    got = list(
        formats.iter_rows(formats.Source(name="d", path=str(tmp_path / "cut.json"), adapter="sharegpt"))
    )
    assert [r["id"] for _, r, e in got if e is None] == ["c0", "c1", "c2"]
    ((where, row, err),) = [g for g in got if g[2] is not None]
    assert where["row"] == 3 and row is None
    rest = len(cut[cut.rindex("{", 0, cut.index('"c3"')) :].encode("utf-8"))
    assert "the file is cut off" in err and f"{rest:,} bytes from record 3 on" in err
    # broken JSON inside a closed array is named as such, not as a cut
    broken = whole.replace('"c1"', "c1")
    (tmp_path / "broken.json").write_text(broken, encoding="utf-8")
    got = list(
        formats.iter_rows(formats.Source(name="d", path=str(tmp_path / "broken.json"), adapter="sharegpt"))
    )
    assert [r["id"] for _, r, e in got if e is None] == ["c0"] and "invalid JSON" in got[-1][2]
    # a whole array reads every record and nothing else
    (tmp_path / "whole.json").write_text(whole, encoding="utf-8")
    got = list(
        formats.iter_rows(formats.Source(name="d", path=str(tmp_path / "whole.json"), adapter="sharegpt"))
    )
    assert [r["id"] for _, r, e in got] == ["c0", "c1", "c2", "c3"] and all(e is None for *_, e in got)


def test_gzipped_jsonl_and_disjoint_slices_with_skip(tmp_path):
    import gzip

    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"a": i}) + "\n" for i in range(10))
    path = str(tmp_path / "d.jsonl.gz")
    assert not formats.is_hub_id(path)

    def read(**kw):
        return [
            r["a"]
            for _, r, _ in formats.iter_rows(formats.Source(name="d", path=path, adapter="openai", **kw))
        ]

    assert read() == list(range(10))
    first, second = read(max_read=4), read(skip=4, max_read=3)
    assert first == [0, 1, 2, 3] and second == [4, 5, 6] and read(skip=8) == [8, 9]


def test_missing_local_file_and_hub_ids(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such.jsonl"):
        list(
            formats.iter_rows(
                formats.Source(name="d", path=str(tmp_path / "no_such.jsonl"), adapter="openai")
            )
        )
    assert formats.is_hub_id("open-thoughts/OpenThoughts3-1.2M")
    assert not formats.is_hub_id("data/x.jsonl") and not formats.is_hub_id("toy://data/glaive")


TOY_ADAPTERS = {"glaive": "glaive", "mot": "mot", "openthoughts_114k": "openthoughts", "openthoughts3": "openthoughts",
                "swe_agent": "swe_agent", "opencodeinstruct": "opencodeinstruct", "sharegpt": "sharegpt",
                "ultrachat": "ultrachat", "native_chat": "openai", "native_tools": "openai"}  # fmt: skip


@pytest.mark.parametrize("name", toy_data.DATASET_NAMES)
def test_every_toy_dataset_loads_and_only_malformed_rows_fail(name, tmp_path):
    """Toy files in every real schema: exactly the injected malformed rows are rejected, at their lines/rows."""
    entry, _ = toy_data.write_dataset(tmp_path, name, 0, 6 if name == "swe_agent" else 60, 3)
    s = formats.Source(
        name=name, path=str(tmp_path / entry["file"].split("/")[-1]), adapter=TOY_ADAPTERS[name]
    )
    bad, ok, skipped = [], 0, []
    for where, row, err in formats.iter_rows(s):
        pos = where["line"] - 1 if "line" in where else where["row"]  # 0-based index in the file
        try:
            if err is not None:
                raise formats.Malformed(err)
            conv = formats.adapt(row, s, where)
            assert conv["messages"] and any(m["role"] == "user" for m in conv["messages"])
            ok += 1
        except formats.Malformed:
            bad.append(pos)
        except formats.Skip as e:
            skipped.append(e.reason)
    assert bad == [m["index"] for m in entry["malformed"]]
    assert ok + len(skipped) == entry["n_valid"]
    assert skipped.count("empty") == entry["quirks"].get("empty", 0)
    assert len(skipped) <= entry["quirks"].get("empty", 0) + entry["quirks"].get(
        "starts_with_function_response", 0
    )


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory):
    """Toy chat + tool rows (valid ones: a parquet schema holds no malformed rows) and the hub-layout folder."""
    from tests.support import hub_repo

    root = tmp_path_factory.mktemp("hub")
    for name in ("native_chat", "native_tools"):
        toy_data.write_dataset(root, name, 0, 30, 0)
    return root, hub_repo.build(root / "repo", root / "native_chat.jsonl", root / "native_tools.jsonl")


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _adapted(src: formats.Source) -> list[dict]:
    return [formats.adapt(r, src, w) for w, r, e in formats.iter_rows(src) if e is None]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("config, jsonl", [("chat", "native_chat.jsonl"), ("tools", "native_tools.jsonl")])
def test_hub_layout_folder_reads_like_its_jsonl(hub_repo, datasets_cache, config, jsonl, streaming):
    """The hub path (datasets.load_dataset with config, split, streaming) on a local repo folder: the same
    conversations as the jsonl file it was made from, with the same ids: the rows' own ``id`` (not a row number
    from 0 there and a line number from 1 here)."""
    root, repo = hub_repo
    hub = formats.Source(name="x", path=str(repo), adapter="openai", config=config, streaming=streaming)
    local = formats.Source(name="x", path=str(root / jsonl), adapter="openai")
    got, want = _adapted(hub), _adapted(local)
    assert len(got) == len(want) == 30
    for g, w in zip(got, want, strict=True):
        assert g["id"] == w["id"] and g["id"].startswith("x:native_")
        assert (g["messages"], g["tools"]) == (w["messages"], w["tools"])
    first = next(formats.iter_rows(hub))[0]
    assert first == {"file": f"{repo}[{config}:train]", "row": 0}


def test_hub_layout_max_read_data_files_and_bad_config(hub_repo, datasets_cache):
    root, repo = hub_repo
    capped = formats.Source(
        name="x", path=str(repo), adapter="openai", config="chat", max_read=7, streaming=True
    )
    assert len(list(formats.iter_rows(capped))) == 7
    one = formats.Source(
        name="x", path=str(repo), adapter="openai", data_files="chat/train-00001-of-00002.parquet"
    )
    assert len(list(formats.iter_rows(one))) == 15  # the second shard only
    raw = formats.Source(name="x", path=str(repo), adapter="openai", data_files="raw/native_tools.jsonl")
    local = formats.Source(name="x", path=str(root / "native_tools.jsonl"), adapter="openai")
    assert [c["messages"] for c in _adapted(raw)] == [c["messages"] for c in _adapted(local)]
    with pytest.raises(ValueError, match="nope"):
        list(formats.iter_rows(formats.Source(name="x", path=str(repo), adapter="openai", config="nope")))


@pytest.mark.parametrize("name, field", [("sharegpt", "id"), ("ultrachat", "prompt_id"),
                                         ("opencodeinstruct", "id"), ("swe_agent", "instance_id"),
                                         ("native_chat", "id")])  # fmt: skip
def test_ids_are_the_sources_own_and_survive_another_row_order(name, field, tmp_path):
    """A re-download or a streaming order that differs keeps every record's id (and so the held-out split and
    03's resume): ids come from the schema's own id field, not from the line or row number."""
    rows = [r for r, _ in toy_data.make_rows(name, 0, 4 if name == "swe_agent" else 12)]
    for order, fname in ((rows, "a.jsonl"), (rows[::-1], "b.jsonl")):
        (tmp_path / fname).write_text("".join(json.dumps(r) + "\n" for r in order))
    ids = {}
    for fname in ("a.jsonl", "b.jsonl"):
        src = formats.Source(name=name, path=str(tmp_path / fname), adapter=TOY_ADAPTERS[name])
        ids[fname] = {}
        for where, row, _ in formats.iter_rows(src):
            ids[fname].setdefault(formats.record_id(src, where, row), row)
    if name == "swe_agent":  # several runs of one issue share its id (02 keeps one prompt per issue)
        assert set(ids["a.jsonl"]) == set(ids["b.jsonl"])
    else:
        assert ids["a.jsonl"] == ids["b.jsonl"]  # same id -> same row, whatever the order
    assert set(ids["a.jsonl"]) == {f"{name}:{r[field]}" for r in rows}


def test_rows_without_an_id_field_keep_their_position_id():
    src = formats.Source(name="g", path="x.jsonl", adapter="glaive")
    assert formats.record_id(src, {"line": 7}, {"system": "", "chat": "USER: hi"}) == "g:7"
    shared = formats.Source(name="s", path="x.jsonl", adapter="sharegpt")
    assert formats.record_id(shared, {"line": 3}, {"id": "", "conversations": []}) == "s:3"  # empty: position
    assert formats.record_id(shared, {"line": 3}, None) == "s:3"  # an unreadable row


def test_two_local_hub_folders_of_one_name_never_share_a_cache(tmp_path, datasets_cache):
    """`datasets` caches a local folder with a README card under its name and the card's (relative) data files: a
    second folder of that name (or the same folder rebuilt with other rows) read the first one's cached rows back
    (found running the mini-Kimi world)."""
    from eagle_lib.toy import kimi_data

    names = [name for name, _ in kimi_data.HUB_LAYOUT.values()]
    for sub, n in (("a", 4), ("b", 6)):
        kimi_data.write_hub_repos(
            tmp_path / sub, {name: [{"k": f"{sub}{i}"} for i in range(n)] for name in names}
        )
    for sub, n in (("a", 4), ("b", 6)):
        src = formats.Source(name="u", path=str(tmp_path / sub / "HuggingFaceH4/ultrachat_200k"),
                             adapter="ultrachat", split="train_sft")  # fmt: skip
        assert [row["k"] for _, row, _ in formats.iter_rows(src)] == [f"{sub}{i}" for i in range(0, n, 2)]
