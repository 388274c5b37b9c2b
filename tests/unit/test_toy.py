"""Tests of the toy world: tokenizer layout, chat template, raw dataset schemas, determinism, cache, resolve.

Everything here builds data-only worlds (``train.steps == 0``) into a temporary ``$EAGLE_CACHE``; only the
``slow`` test builds (or reuses) the real world with the trained target.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from eagle_lib import toy
from eagle_lib.toy import __main__ as cli
from eagle_lib.toy import datasets, world
from eagle_lib.toy.tokenizer import KIMI_LIKE_TEMPLATE, SPECIAL_OFFSETS, build_tokenizer

V = 4096
KIMI_OFFSETS = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
                "<|im_system|>": 10, "<|tool_calls_section_begin|>": 11, "<|tool_calls_section_end|>": 12,
                "<|tool_call_begin|>": 13, "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15,
                "<|im_middle|>": 17, "<think>": 22, "</think>": 23}  # fmt: skip
SMALL_SIZES = {name: 40 for name in datasets.DATASET_NAMES} | {"swe_agent": 6}


def small_recipe(**train) -> dict:
    """The real recipe shrunk to a data + tokenizer world (no target training): builds in about a second."""
    r = copy.deepcopy(toy.RECIPE)
    r["dataset_sizes"] = dict(SMALL_SIZES)
    r["train_mix"] = {"chat": 40, "tool": 40, "reasoning": 20, "code": 10, "swe": 2}
    r["train"]["steps"] = 0
    r["train"].update(train)
    return r


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [s for name in ("native_chat", "native_tools") for r, _ in datasets.make_rows(name, 0, 60)
             for s in datasets.string_leaves(r)]  # fmt: skip
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, texts, V)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def small_world(tmp_path_factory):
    """A data-only world in its own cache; $EAGLE_CACHE is restored at once (tests that need it set it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE_CACHE", str(tmp_path_factory.mktemp("cache")))
        root = toy.build(small_recipe(), log=lambda *a: None)
    return root, json.loads((root / "build_log.json").read_text())


# ---------------------------------------------------------------- tokenizer


def test_special_ids_at_kimi_offsets(tok):
    assert len(tok) == V
    assert SPECIAL_OFFSETS == KIMI_OFFSETS
    for name, off in KIMI_OFFSETS.items():
        assert tok.convert_tokens_to_ids(name) == V - 256 + off, name
    assert tok.convert_tokens_to_ids("<|reserved_token_5|>") == V - 256 + 5
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "[BOS]"
    assert tok.pad_token_id == V - 1 and tok.pad_token.startswith("<|reserved_token_")


def test_regular_vocab_below_specials_and_specials_never_merge(tok):
    ids = tok("hello<|im_end|>world<think>x</think>", add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids and tok.convert_tokens_to_ids("</think>") in ids
    assert tok.decode(ids) == "hello<|im_end|>world<think>x</think>"
    plain = tok("The answer is 42. " * 20, add_special_tokens=False)["input_ids"]
    assert max(plain) < V - 256


# ---------------------------------------------------------------- chat template


def render(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_template_is_the_saved_one(tok):
    assert tok.chat_template == KIMI_LIKE_TEMPLATE


def test_template_simple_turn(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}]  # fmt: skip
    assert render(tok, msgs) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Greet back.</think>Hello!<|im_end|>"
    )


def test_template_no_default_system_and_generation_prompt(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]
    assert render(tok, msgs, add_generation_prompt=True) == (
        "<|im_user|>user<|im_middle|>AB<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


def test_template_drops_thinking_of_earlier_turns(tok):
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]  # fmt: skip
    out = render(tok, msgs)
    assert out == (
        "<|im_user|>user<|im_middle|>Q1<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>A1<|im_end|>"
        "<|im_user|>user<|im_middle|>Q2<|im_end|><|im_assistant|>assistant<|im_middle|><think>R2</think>A2<|im_end|>"
    )
    assert "R1" not in out


def test_template_tools_calls_and_results(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two calls.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "5 C"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "20 C"},
        {"role": "assistant", "content": "Oslo 5 C, Rome 20 C.", "reasoning_content": "Done."},
    ]  # fmt: skip
    assert render(tok, msgs, tools=tools) == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
        '"parameters":{"type":"object"}}}]<|im_end|>'
        "<|im_user|>user<|im_middle|>Weather in Oslo and Rome?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n5 C<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n20 C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Done.</think>Oslo 5 C, Rome 20 C.<|im_end|>"
    )


def test_template_tool_call_index_counts_over_conversation(tok):
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "1"},
            {"role": "assistant", "content": "", "tool_calls": [call]}]  # fmt: skip
    out = render(tok, msgs)
    assert (
        "functions.f:0<|tool_call_argument_begin|>" in out
        and "functions.f:1<|tool_call_argument_begin|>" in out
    )


# ---------------------------------------------------------------- raw datasets


def read_file(root: Path, entry: dict) -> tuple[list[dict], int]:
    """Valid records of a raw file and how many records could not be used at all (by schema)."""
    field = datasets.SCHEMAS[Path(entry["file"]).stem][2]
    path = root / entry["file"]
    if entry["format"] == "parquet":
        rows = pq.read_table(path).to_pylist()
    else:
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append(None)
    ok = [r for r in rows if isinstance(r, dict) and isinstance(r.get(field), str | list)]
    assert len(rows) == entry["n_records"]
    return ok, len(rows) - len(ok)


FIELDS = {
    "glaive": {"system", "chat"},
    "mot": {"messages", "num_tokens", "source"},
    "openthoughts_114k": {"system", "conversations"},
    "openthoughts3": {"difficulty", "source", "domain", "conversations"},
    "swe_agent": {"instance_id", "model_name", "target", "trajectory", "exit_status", "generated_patch",
                  "eval_logs"},
    "opencodeinstruct": {"id", "input", "output", "domain", "generation_algorithm", "llm_judgement", "unit_tests",
                         "tests_execution_status", "average_test_score"},
    "sharegpt": {"id", "conversations"},
    "ultrachat": {"prompt", "prompt_id", "messages"},
    "native_chat": {"id", "domain", "conversations"},
    "native_tools": {"id", "messages", "tools"},
}  # fmt: skip


@pytest.mark.parametrize("name", datasets.DATASET_NAMES)
def test_dataset_schema_and_malformed_count(small_world, name):
    root, blog = small_world
    entry = blog["datasets"][name]
    assert (root / entry["file"]).is_file()
    ok, bad = read_file(root, entry)
    assert bad == entry["n_malformed"] > 0
    assert all(set(r) == FIELDS[name] for r in ok), name
    if name == "opencodeinstruct":
        assert all(isinstance(v, str) for r in ok for v in r.values())


def test_at_least_two_parquet_files(small_world):
    assert sum(e["format"] == "parquet" for e in small_world[1]["datasets"].values()) >= 2


def test_dataset_quirks(small_world):
    root, blog = small_world
    glaive, _ = read_file(root, blog["datasets"]["glaive"])
    assert any(r["chat"].startswith("FUNCTION RESPONSE:") for r in glaive)
    assert any("<functioncall> {" in r["chat"] and "'{" in r["chat"] for r in glaive)
    assert all(r["system"].startswith("SYSTEM: You are a helpful assistant") for r in glaive)
    share, _ = read_file(root, blog["datasets"]["sharegpt"])
    assert any(not r["conversations"] for r in share)
    assert any(r["conversations"] and r["conversations"][0]["from"] == "gpt" for r in share)
    swe, _ = read_file(root, blog["datasets"]["swe_agent"])
    assert max(Counter(r["instance_id"] for r in swe).values()) > 1
    assert all(isinstance(r["target"], bool) for r in swe)
    assert {t["role"] for r in swe for t in r["trajectory"]} == {"system", "user", "ai"}


def test_native_tools_are_openai_style_with_kimi_ids(small_world):
    root, blog = small_world
    rows, _ = read_file(root, blog["datasets"]["native_tools"])
    calls = [c for r in rows for m in r["messages"] for c in m.get("tool_calls") or []]
    assert calls and all(c["id"].startswith(f"functions.{c['function']['name']}:") for c in calls)
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)


def test_response_lengths_differ_by_domain():
    """Tool calls short, chat medium, reasoning long, SWE sessions long and many-turn (as in the seeds)."""
    convs = datasets.native_conversations(1, {"tool": 60, "chat": 60, "reasoning": 60, "swe": 10}, "t")

    def last_len(c):
        m = [m for m in c["messages"] if m["role"] == "assistant"][-1]
        return len((m.get("reasoning_content") or "") + m["content"])

    mean = {
        d: sum(last_len(c) for c in convs if c["domain"] == d) / 60 for d in ("tool", "chat", "reasoning")
    }
    assert mean["tool"] < mean["chat"] < mean["reasoning"]
    assert max(len(c["messages"]) for c in convs if c["domain"] == "swe") > 30


# ---------------------------------------------------------------- build, cache, determinism


def test_build_is_deterministic(tmp_path, monkeypatch):
    trees = []
    for sub in ("a", "b"):
        monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / sub))
        root = toy.build(small_recipe(), log=lambda *a: None)
        files = sorted(
            p for p in root.rglob("*") if p.is_file() and p.name not in ("build_log.json", "build_log.txt")
        )
        trees.append({str(p.relative_to(root)): p.read_bytes() for p in files})
    assert trees[0].keys() == trees[1].keys() and "tokenizer/tokenizer.json" in trees[0]
    assert trees[0] == trees[1]


def test_cache_hit_is_instant_and_layout(small_world, monkeypatch):
    root, blog = small_world
    monkeypatch.setenv("EAGLE_CACHE", str(root.parent))
    t = time.perf_counter()
    assert toy.build(small_recipe(), log=lambda *a: None) == root
    assert time.perf_counter() - t < 0.5
    assert root.name == f"toy-{toy.toy_key(small_recipe())}" and root.parent == toy.cache_root()
    assert json.loads((root / "recipe.json").read_text()) == small_recipe()
    assert not [p for p in root.parent.glob(".toy-*") if p.is_dir()], "temp build dirs left behind"
    assert {"tokenizer", "data", "build_log.json", "build_log.txt", "recipe.json"} <= {
        p.name for p in root.iterdir()
    }


def test_key_depends_on_recipe_and_version(monkeypatch):
    assert toy.toy_key(small_recipe()) != toy.toy_key(small_recipe(lr=1e-4))
    k = toy.toy_key(small_recipe())
    monkeypatch.setattr(world, "TOY_VERSION", world.TOY_VERSION + 1)
    assert toy.toy_key(small_recipe()) != k


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    assert toy.cache_root() == tmp_path
    monkeypatch.delenv("EAGLE_CACHE")
    assert toy.cache_root() == Path.home() / ".cache" / "eagle_lib"


def test_crashed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))

    def boom(*a, **k):
        raise RuntimeError("crash mid-build")

    monkeypatch.setattr(world, "build_tokenizer", boom)
    with pytest.raises(RuntimeError):
        toy.build(small_recipe(), log=lambda *a: None)
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []  # only the (free) lock file remains


def test_force_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    root = toy.build(small_recipe(), log=lambda *a: None)
    (root / "marker").write_text("x")
    assert toy.build(small_recipe(), force=True, log=lambda *a: None) == root
    assert not (root / "marker").exists() and (root / "build_log.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [root.name]


def test_concurrent_builds_build_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    calls, real = [], world._build_into

    def counting(*a, **k):
        calls.append(1)
        time.sleep(0.3)  # hold the lock long enough for the other thread to queue behind it
        return real(*a, **k)

    monkeypatch.setattr(world, "_build_into", counting)
    with ThreadPoolExecutor(2) as pool:
        roots = list(pool.map(lambda _: toy.build(small_recipe(), log=lambda *a: None), range(2)))
    assert roots[0] == roots[1] and len(calls) == 1


# ---------------------------------------------------------------- resolve / CLI


def test_resolve(small_world, monkeypatch):
    root, _ = small_world
    monkeypatch.setenv("EAGLE_CACHE", str(root.parent))
    monkeypatch.setattr(world, "RECIPE", small_recipe())
    assert toy.resolve("/some/model") == "/some/model"
    assert toy.resolve("org/model") == "org/model"
    assert toy.resolve("toy://tokenizer") == str(root / "tokenizer")
    assert toy.resolve("toy://data/ultrachat") == str(root / "data" / "ultrachat.parquet")
    assert Path(toy.resolve("toy://data/glaive")).is_file()
    with pytest.raises(ValueError, match="toy://data/sharegpt"):
        toy.resolve("toy://data/nope")
    with pytest.raises(ValueError, match="toy://target"):
        toy.resolve("toy://model")
    with pytest.raises(ValueError, match="without a target"):
        toy.resolve("toy://target")


def test_long_variant_changes_only_the_target_context_and_resolves_to_its_own_world(small_world, monkeypatch):
    from eagle_lib.toy import uris

    def flat(r: dict) -> dict:
        return {
            f"{k}.{j}": w for k, v in r.items() for j, w in (v.items() if isinstance(v, dict) else [("", v)])
        }

    toy_r, long_r = flat(world.RECIPE), flat(world.LONG_RECIPE)
    assert {k for k in toy_r if toy_r[k] != long_r[k]} == {"train.block_size", "train.batch_size"}
    assert long_r["train.block_size"] >= 4 * toy_r["train.block_size"]  # positions past 2K are in training
    # the same tokens per step, so the long target is trained on as much text as the toy target
    assert (
        long_r["train.block_size"] * long_r["train.batch_size"]
        == toy_r["train.block_size"] * toy_r["train.batch_size"]
    )
    root, _ = small_world
    monkeypatch.setenv("EAGLE_CACHE", str(root.parent))
    monkeypatch.setattr(world, "RECIPE", small_recipe())
    monkeypatch.setattr(world, "LONG_RECIPE", small_recipe(block_size=64))
    assert not uris.built("toy://long") and uris.built("toy://tokenizer")
    tok_dir = Path(uris.resolve("toy://long/tokenizer"))  # builds the (data-only) long world
    assert tok_dir.parent == world.world_dir(small_recipe(block_size=64)) != root
    assert (
        uris.built("toy://long")
        and tok_dir.joinpath("tokenizer.json").read_bytes()
        == (root / "tokenizer" / "tokenizer.json").read_bytes()
    )  # the same tokenizer: only the target differs
    with pytest.raises(ValueError, match="long-context toy world .* has no nope"):
        uris.resolve("toy://long/nope")


def test_cli_resolve(capsys):
    assert cli.main(["resolve", "plain/name"]) == 0
    assert capsys.readouterr().out.strip() == "plain/name"
    assert cli.main(["resolve", "toy://bogus"]) == 2


# ---------------------------------------------------------------- the real world (cached in $EAGLE_CACHE)


@pytest.mark.slow
def test_real_world_target_behaves_like_a_chat_model():
    from transformers import AutoModelForCausalLM, GenerationConfig

    root = toy.build()
    blog = json.loads((root / "build_log.json").read_text())
    assert blog["im_end_rate"] >= 0.9
    assert blog["im_end_rate_by_domain"]["tool"] >= 0.9 and blog["im_end_rate_by_domain"]["chat"] >= 0.9
    lens = {d: s["mean"] for d, s in blog["response_len_by_domain"].items()}
    assert lens["tool"] < lens["chat"] < lens["reasoning"]
    assert (
        blog["train_seconds"] > 0 and 0 < blog["next_token_acc"] <= 1
    )  # time: see build_log, load-dependent
    tgt = toy.resolve("toy://target")
    model = AutoModelForCausalLM.from_pretrained(tgt)
    tok = AutoTokenizer.from_pretrained(tgt)
    cfg = model.config
    assert cfg.num_hidden_layers >= 8 and cfg.head_dim in (32, 64) and cfg.vocab_size == len(tok) == V
    assert cfg.max_position_embeddings >= 4096
    assert GenerationConfig.from_pretrained(tgt).eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
