"""Raw toy datasets in the REAL public schemas (see the project's dataset-schemas reference).

Each dataset is generated from the grammars with its own ``random.Random(f"{seed}:{name}")`` stream, so the
files are byte-identical for a given seed and sizes. Every file holds a few deliberately malformed records
(broken JSON line, missing field, wrong type; nulls in parquet) and the schema's real quirks (glaive chats that
start with FUNCTION RESPONSE, ShareGPT conversations that start with gpt or are empty, ...); both are counted in
the returned log so later stages can be checked against them.

Native A sets (the target's own OpenAI-style format): ``native_chat`` uses the ``conversations`` key,
``native_tools`` the ``messages`` key plus ``tools`` (both spellings occur in SpecForge-style files).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_lib.toy import grammar as g
from eagle_lib.toy import swe, toolcalls

GLAIVE_TOOLS = (
    "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
)
GLAIVE_NO_TOOLS = "SYSTEM: You are a helpful assistant, with no access to external functions."
OT_SYSTEM = (
    "Your role as an assistant is to think through each question in a long, careful process before "
    "giving a final precise solution. Put your thinking in the Thought section and the answer in the "
    "Solution section."
)
MOT_SOURCES = {"reasoning": "open-r1/OpenR1-Math-220k", "code": "open-r1/codeforces-cots", "chat": "science"}


def _think_answer(conv: dict) -> tuple[str, str, str]:
    """(user, reasoning, answer) of a single-exchange conversation; builds a reasoning when it has none."""
    user, asst = conv["messages"][-2]["content"], conv["messages"][-1]
    reasoning = (
        asst.get("reasoning_content") or f"Let me think about this request.\n{user}\nI will answer it."
    )
    return user, reasoning, asst["content"]


def _reasoning_mix(rng: random.Random, weights: dict[str, float]) -> dict:
    """A foreign-style single exchange drawn from math reasoning, code or science-like chat."""
    kind = rng.choices(list(weights), list(weights.values()))[0]
    if kind == "reasoning":
        return g.gen_reasoning(rng, "foreign")
    if kind == "code":
        return g.gen_code(rng, "foreign")
    return g.gen_chat(rng, "foreign", max_turns=1)


def _approx_tokens(*texts: str) -> int:
    return sum(len(t.split()) for t in texts) * 4 // 3


# ---------------------------------------------------------------- one record per schema


def rec_glaive(rng: random.Random, i: int) -> tuple[dict, list[str]]:
    """glaive-function-calling-v2 row {system, chat}; returns the row and its quirks."""
    conv = (
        toolcalls.gen_tool(rng, "foreign") if rng.random() < 0.85 else g.gen_chat(rng, "foreign", max_turns=2)
    )
    tools = conv["tools"]
    if tools:
        system = GLAIVE_TOOLS + "\n\n".join(json.dumps(t["function"], indent=4) for t in tools)
    else:
        system = GLAIVE_NO_TOOLS
    turns = []
    for m in conv["messages"]:
        if m["role"] == "user":
            turns.append(f"USER: {m['content']}")
        elif m["role"] == "tool":
            turns.append(f"FUNCTION RESPONSE: {m['content']}")
        elif m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            turns.append(
                f'ASSISTANT: <functioncall> {{"name": "{fn["name"]}", "arguments": \'{fn["arguments"]}\'}} '
                "<|endoftext|>"
            )
        elif m["role"] == "assistant":
            turns.append(f"ASSISTANT: {m['content']} <|endoftext|>")
    quirks, responses = [], [k for k, t in enumerate(turns) if t.startswith("FUNCTION RESPONSE:")]
    if i % 10 == 3 and responses:  # quirks at fixed indices: every file of 10+ rows has them
        turns, quirks = turns[responses[0] :], ["starts_with_function_response"]
    elif i % 10 == 7:
        turns, quirks = turns + [f"USER: Thanks! What about {g._pick(rng, g.CITIES)}?"], ["ends_on_user"]
    return {"system": system, "chat": "\n\n\n".join(turns)}, quirks


def rec_mot(rng: random.Random, i: int) -> tuple[dict, list[str]]:
    """open-r1/Mixture-of-Thoughts row {messages, num_tokens, source}; assistant = <think>..</think> answer."""
    conv = _reasoning_mix(rng, {"reasoning": 0.6, "code": 0.25, "chat": 0.15})
    user, reasoning, answer = _think_answer(conv)
    content = f"<think>\n{reasoning}\n</think>\n\n{answer}"
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": content}]
    return {
        "messages": messages,
        "num_tokens": _approx_tokens(user, content),
        "source": MOT_SOURCES[conv["domain"]],
    }, []


def rec_ot114k(rng: random.Random, i: int) -> tuple[dict, list[str]]:
    """OpenThoughts-114k row {system, conversations[from user|assistant]} with thought/solution tags."""
    user, reasoning, answer = _think_answer(_reasoning_mix(rng, {"reasoning": 0.7, "code": 0.3}))
    value = (
        f"<|begin_of_thought|>\n\n{reasoning}\n\n<|end_of_thought|>\n\n"
        f"<|begin_of_solution|>\n\n{answer}\n\n<|end_of_solution|>"
    )
    conversations = [{"from": "user", "value": user}, {"from": "assistant", "value": value}]
    return {"system": OT_SYSTEM, "conversations": conversations}, []


def rec_ot3(rng: random.Random, i: int) -> tuple[dict, list[str]]:
    """OpenThoughts3 row {difficulty, source, domain, conversations[from human|gpt]}."""
    conv = _reasoning_mix(rng, {"reasoning": 0.6, "code": 0.3, "chat": 0.1})
    user, reasoning, answer = _think_answer(conv)
    domain = {"reasoning": "math", "code": "code", "chat": "science"}[conv["domain"]]
    conversations = [
        {"from": "human", "value": user},
        {"from": "gpt", "value": f"<think>\n{reasoning}\n</think>\n\n{answer}"},
    ]
    return {
        "difficulty": rng.randint(1, 10),
        "source": f"ot3-{domain}",
        "domain": domain,
        "conversations": conversations,
    }, []


def rec_opencodeinstruct(rng: random.Random, i: int) -> tuple[dict, list[str]]:
    """nvidia/OpenCodeInstruct row: ten string fields, output = code with a docstring."""
    user, fname, code, tin, tout = g.code_parts(rng)
    head, body = code.split("\n", 1)
    output = f'```python\n{head}\n    """\n    Function {fname}.\n    """\n{body}\n```'
    judge = {
        "requirement_conformance": {"score": 5, "justification": "The function meets the request."},
        "logical_correctness": {"score": rng.randint(4, 5), "justification": "The logic is correct."},
    }
    tests = [f"assert {fname}({tin}) == {tout}"] * rng.randint(1, 3)
    return {
        "id": hashlib.sha256(f"oci{i}{user}".encode()).hexdigest()[:32],
        "input": user,
        "output": output,
        "domain": g._pick(rng, ["generic", "algorithmic"]),
        "generation_algorithm": g._pick(rng, ["self-instruct", "evol-instruct"]),
        "llm_judgement": json.dumps(judge),
        "unit_tests": json.dumps(tests),
        "tests_execution_status": json.dumps(["pass"] * len(tests)),
        "average_test_score": "1.0",
    }, []


def rec_sharegpt(rng: random.Random, i: int) -> tuple[dict, list[str]]:
    """ShareGPT row {id, conversations[from, value]} with all `from` values and the known quirks."""
    conv = g.gen_chat(rng, "foreign", max_turns=3) if rng.random() < 0.8 else g.gen_code(rng, "foreign")
    asst_name = {1: "chatgpt", 2: "bing", 3: "bard"}.get(i % 20, "gpt")
    role = {"system": "system", "user": "human", "assistant": asst_name}
    convs = [{"from": role[m["role"]], "value": m["content"]} for m in conv["messages"]]
    quirks = []
    if i % 20 == 4:
        convs, quirks = [], ["empty"]
    elif i % 10 == 9:
        convs, quirks = (
            [{"from": "gpt", "value": "Hello! How can I help you today?"}] + convs,
            ["starts_with_gpt"],
        )
    quirks += [f"from_{asst_name}"] if convs and asst_name != "gpt" else []
    return {"id": f"{rng.getrandbits(32):08x}_{i}", "conversations": convs}, quirks


def rec_ultrachat(rng: random.Random, i: int) -> tuple[dict, list[str]]:
    """ultrachat_200k row {prompt, prompt_id, messages[role user|assistant]}."""
    conv = g.gen_chat(rng, "foreign", max_turns=3)
    msgs = [{"role": m["role"], "content": m["content"]} for m in conv["messages"] if m["role"] != "system"]
    prompt = msgs[0]["content"]
    return {
        "prompt": prompt,
        "prompt_id": hashlib.sha256(f"{prompt}{i}".encode()).hexdigest(),
        "messages": msgs,
    }, []


def rec_native_chat(rng: random.Random, i: int) -> tuple[dict, list[str]]:
    """Native A chat row {id, domain, conversations[OpenAI messages with reasoning_content]}: chat/reasoning/code."""
    conv = rng.choices([g.gen_chat, g.gen_reasoning, g.gen_code], [0.6, 0.25, 0.15])[0](rng, "native")
    return {"id": f"native_chat-{i}", "domain": conv["domain"], "conversations": conv["messages"]}, [
        conv["domain"]
    ]


def rec_native_tools(rng: random.Random, i: int) -> tuple[dict, list[str]]:
    """Native A tool-use row {id, messages, tools} with tool_calls, tool results and reasoning_content."""
    conv = toolcalls.gen_tool(rng, "native")
    return {"id": f"native_tools-{i}", "messages": conv["messages"], "tools": conv["tools"]}, []


def swe_rows(rng: random.Random, n_instances: int) -> list[tuple[dict, list[str]]]:
    """nebius/SWE-agent-trajectories rows: 1..4 runs per instance_id, long trajectories."""
    rows = []
    for k in range(n_instances):
        inst = swe.gen_instance(rng, k)
        for _ in range(rng.choice([1, 2, 3, 4])):
            run = swe.gen_run(rng, inst)
            traj = [
                {
                    "role": r,
                    "text": t,
                    "system_prompt": swe.SWE_SYSTEM if r == "system" else "",
                    "mask": r != "ai",
                    "cutoff_date": "2024-07-01",
                }
                for r, t in run["turns"]
            ]
            row = {
                "instance_id": inst["instance_id"],
                "model_name": run["model_name"],
                "target": run["target"],
                "trajectory": traj,
                "exit_status": run["exit_status"],
                "generated_patch": run["generated_patch"],
                "eval_logs": "PASSED" if run["target"] else "FAILED",
            }
            rows.append((row, [f"messages_{len(traj)}"]))
    return rows


# name -> (record maker, file format, main field that malformed records break)
SCHEMAS = {
    "glaive": (rec_glaive, "jsonl", "chat"),
    "mot": (rec_mot, "jsonl", "messages"),
    "openthoughts_114k": (rec_ot114k, "jsonl", "conversations"),
    "openthoughts3": (rec_ot3, "parquet", "conversations"),
    "swe_agent": (None, "jsonl", "trajectory"),
    "opencodeinstruct": (rec_opencodeinstruct, "parquet", "output"),
    "sharegpt": (rec_sharegpt, "jsonl", "conversations"),
    "ultrachat": (rec_ultrachat, "parquet", "messages"),
    "native_chat": (rec_native_chat, "jsonl", "conversations"),
    "native_tools": (rec_native_tools, "jsonl", "messages"),
}
DATASET_NAMES = list(SCHEMAS)
MALFORMED_KINDS = {"jsonl": ["broken_json", "missing_field", "wrong_type"], "parquet": ["null_field"]}


def make_rows(name: str, seed: int, size: int) -> list[tuple[dict, list[str]]]:
    """All (record, quirks) of dataset ``name``, before malformed records are injected."""
    rng = random.Random(f"{seed}:{name}")
    if name == "swe_agent":
        return swe_rows(rng, size)
    maker = SCHEMAS[name][0]
    return [maker(rng, i) for i in range(size)]


def _break(record: dict, kind: str, field: str) -> dict | str:
    """A malformed version of ``record``: a str for broken JSON lines, else a dict."""
    if kind == "broken_json":
        text = json.dumps(record, ensure_ascii=False)
        return text[: len(text) // 2]
    bad = dict(record)
    if kind == "missing_field":
        del bad[field]
    elif kind == "wrong_type":
        bad[field] = 12345
    else:  # null_field (parquet cannot hold mixed types)
        bad[field] = None
    return bad


def write_dataset(
    data_dir: Path, name: str, seed: int, size: int, n_malformed: int
) -> tuple[dict, list[dict]]:
    """Write ``data/<name>.<fmt>``; returns (log entry, the valid records) for corpus and evaluation use."""
    _, fmt, field = SCHEMAS[name]
    rows = make_rows(name, seed, size)
    rng = random.Random(f"{seed}:{name}:malformed")
    # malformed rows never at the very end: a torn last line reads as a crash artefact, not a bad record
    bad_idx = sorted(rng.sample(range(1, len(rows) - 1), n_malformed))
    kinds = MALFORMED_KINDS[fmt]
    out: list[dict | str] = [r for r, _ in rows]
    malformed = []
    for j, idx in enumerate(bad_idx):
        kind = kinds[j % len(kinds)]
        out[idx] = _break(out[idx], kind, field)
        malformed.append({"index": idx, "kind": kind})
    path = data_dir / f"{name}.{fmt}"
    if fmt == "jsonl":
        lines = [o if isinstance(o, str) else json.dumps(o, ensure_ascii=False) for o in out]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:
        pq.write_table(pa.Table.from_pylist(out), path, compression="zstd")
    quirks = Counter(q for i, (_, qs) in enumerate(rows) if i not in bad_idx for q in qs)
    entry = {
        "file": f"data/{path.name}",
        "format": fmt,
        "n_records": len(out),
        "n_malformed": len(malformed),
        "n_valid": len(out) - len(malformed),
        "malformed": malformed,
        "quirks": dict(sorted(quirks.items())),
    }
    valid = [r for i, (r, _) in enumerate(rows) if i not in bad_idx]
    return entry, valid


def write_all(data_dir: Path, seed: int, sizes: dict[str, int], n_malformed: int) -> tuple[dict, dict]:
    """Write every dataset; returns ({name: log entry}, {name: valid records})."""
    data_dir.mkdir(parents=True, exist_ok=True)
    logs, valid = {}, {}
    for name in DATASET_NAMES:
        logs[name], valid[name] = write_dataset(data_dir, name, seed, sizes[name], n_malformed)
    return logs, valid


def native_conversations(seed: int, mix: dict[str, int], stream: str) -> list[dict]:
    """Native-style canonical conversations (the target's own style), ``mix[domain]`` of each domain."""
    rng = random.Random(f"{seed}:native:{stream}")
    makers = {
        "chat": g.gen_chat,
        "tool": toolcalls.gen_tool,
        "reasoning": g.gen_reasoning,
        "code": g.gen_code,
    }
    convs = []
    for domain, n in mix.items():
        if domain == "swe":
            for k in range(n):
                convs.append(swe.to_messages(swe.gen_run(rng, swe.gen_instance(rng, k))))
        else:
            convs += [makers[domain](rng, "native") for _ in range(n)]
    random.Random(f"{seed}:shuffle:{stream}").shuffle(convs)
    return convs


def string_leaves(obj: object) -> list[str]:
    """Every string inside a nested record (tokenizer training corpus)."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in string_leaves(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in string_leaves(v)]
    return []
