"""Dataset adapters: every public schema -> one normalized conversation.

A normalized conversation is ``{id, source, messages, tools, group}``: OpenAI-style ``messages`` (roles system /
user / assistant / tool; assistant messages may carry ``reasoning_content`` and ``tool_calls`` whose
``function.arguments`` is a JSON string; tool messages carry ``tool_call_id``), ``tools`` a list of
``{"type": "function", "function": {...}}`` and ``group`` a key shared by rows of the same task (SWE instance
id) or None. The pre-tokenized schema yields ``{id, source, input_ids, loss_mask, group}`` instead.

A source (:class:`Source`) is a hub id or a local folder laid out like a hub dataset repository (both read
through ``datasets.load_dataset`` with config / split / streaming / data_files), a local json / jsonl / parquet
file, or ``toy://data/<name>``. :func:`iter_rows` yields each raw row with its location
(file and line or row) or the reason it could not be parsed; :func:`adapt` applies the source's adapter and
raises :class:`Malformed` (the row is rejected) or :class:`Skip` (the row is dropped for a counted reason).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from eagle_lib import params
from eagle_lib.data import readers
from eagle_lib.data.readers import Malformed  # noqa: F401  (formats.Malformed: adapters raise it)

Adapter = Literal["glaive", "mot", "openthoughts", "swe_agent", "opencodeinstruct", "sharegpt", "ultrachat",
                  "openai", "pretokenized"]  # fmt: skip


class Source(params.Strict):
    """One dataset: where it lives and which adapter reads it."""

    name: str  # dataset name: output directory data/<A|B>/<name>/ and the `source` field of records
    path: str  # local .jsonl/.json/.parquet file, toy://data/<name>, a hub dataset id or a hub-layout folder
    adapter: Adapter  # the schema: glaive, mot, openthoughts, swe_agent, sharegpt, openai, ... (see ADAPTERS)
    config: str = ""  # hub dataset config (e.g. "all" for Mixture-of-Thoughts); empty: default
    split: str = "train"  # hub dataset split
    data_files: str = (
        ""  # hub dataset: the one file to read when the repo holds several (empty: the builder's)
    )
    streaming: bool = False  # stream a hub dataset instead of downloading it whole
    max_read: int = 0  # stop after reading this many rows (0: all)
    skip: int = (
        0  # rows to pass over before reading (disjoint slices of one file: A takes 0-999, B skips 1000)
    )
    drop_system: bool = False  # drop system messages (e.g. OpenThoughts' format-forcing system prompt)
    target_only: bool = False  # swe_agent: keep only trajectories whose `target` is true (resolved runs)


class Skip(Exception):
    """A well-formed row that is dropped for a counted reason (e.g. an empty ShareGPT conversation)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------- reading sources (eagle_lib.data.readers)

is_hub_id, iter_rows, resolve_path = readers.is_hub_id, readers.iter_rows, readers.resolve_path


# ---------------------------------------------------------------- helpers shared by adapters


def _field(row: dict, key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in row or row[key] is None:
        raise Malformed(f"missing field '{key}'")
    val = row[key]
    if not isinstance(val, kind):
        want = kind.__name__ if isinstance(kind, type) else "|".join(k.__name__ for k in kind)
        raise Malformed(f"field '{key}' must be {want}, got {type(val).__name__}")
    return val


def _text(val: Any, what: str) -> str:
    if not isinstance(val, str):
        raise Malformed(f"{what} must be a string, got {type(val).__name__}")
    return val


_REASONING = [
    re.compile(r"^\s*<think>(.*?)</think>(.*)$", re.S),
    re.compile(r"^\s*<\|begin_of_thought\|>(.*?)<\|end_of_thought\|>(.*)$", re.S),
]
_SOLUTION = re.compile(r"^\s*<\|begin_of_solution\|>(.*?)<\|end_of_solution\|>\s*$", re.S)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of an assistant text with <think>..</think> or OpenThoughts thought/solution markers."""
    for pat in _REASONING:
        m = pat.match(text)
        if m:
            answer = m.group(2)
            sol = _SOLUTION.match(answer)
            return m.group(1).strip(), (sol.group(1) if sol else answer).strip()
    return None, text.strip()


def assistant(text: str, **extra: Any) -> dict:
    """An assistant message with its reasoning split out of the text (when marked)."""
    reasoning, answer = split_reasoning(text)
    msg = {"role": "assistant", "content": answer}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    msg.update(extra)
    return msg


def _conv(rid: str, messages: list[dict], tools: list | None = None, group: str | None = None) -> dict:
    return {"id": rid, "source": "", "messages": messages, "tools": tools or [], "group": group}


def _from_role_value(turns: Any, roles: dict[str, str], what: str) -> list[dict]:
    """ShareGPT-style [{from, value}] -> messages, mapping `from` through ``roles``."""
    if not isinstance(turns, list):
        raise Malformed(f"field '{what}' must be list, got {type(turns).__name__}")
    out = []
    for k, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise Malformed(f"{what}[{k}] must be an object with 'from' and 'value'")
        role = roles.get(t["from"])
        if role is None:
            raise Malformed(f"{what}[{k}]: unknown role '{t['from']}'")
        value = _text(t["value"], f"{what}[{k}].value")
        out.append(assistant(value) if role == "assistant" else {"role": role, "content": value.strip()})
    return out


# ---------------------------------------------------------------- glaive-function-calling-v2

_GLAIVE_TURN = re.compile(r"(?:^|\n)[ \t]*(USER|ASSISTANT|FUNCTION RESPONSE):[ \t]?")
_GLAIVE_CALL = re.compile(
    r'^\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"arguments"\s*:\s*(?P<args>.*)\}$', re.S
)


def _glaive_tools(system: str) -> tuple[str, list[dict]]:
    """(system prompt, tools) from glaive's `system`: a sentence, then pretty-printed JSON functions."""
    system = re.sub(r"^\s*SYSTEM:\s*", "", system)
    cut = system.find(" -\n")
    if cut < 0 or "{" not in system[cut:]:
        return system.strip(), []
    prompt, rest = system[:cut].strip(), system[cut + 3 :]
    dec, tools, pos = json.JSONDecoder(), [], 0
    while pos < len(rest):
        while pos < len(rest) and rest[pos].isspace():
            pos += 1
        if pos >= len(rest):
            break
        try:
            fn, pos = dec.raw_decode(rest, pos)
        except json.JSONDecodeError as e:
            raise Malformed(f"system: function definition is not valid JSON ({e.msg})") from None
        if not isinstance(fn, dict) or "name" not in fn:
            raise Malformed("system: function definition without a name")
        tools.append({"type": "function", "function": fn})
    return prompt, tools


def _glaive_call(text: str, idx: int) -> dict:
    """`{"name": "f", "arguments": '{...}'}` (arguments single-quoted) -> an OpenAI tool call with Kimi's id."""
    m = _GLAIVE_CALL.match(text.strip())
    if not m:
        raise Malformed(f"unparseable <functioncall>: {text.strip()[:80]!r}")
    args = m.group("args").strip()
    if args.startswith("'") and args.endswith("'"):
        args = args[1:-1].replace("\\'", "'")
    try:
        json.loads(args)
    except json.JSONDecodeError:
        raise Malformed(f"<functioncall> arguments are not valid JSON: {args[:80]!r}") from None
    name = m.group("name")
    return {
        "id": f"functions.{name}:{idx}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def adapt_glaive(row: dict, src: Source, rid: str) -> dict:
    """glaive row {system, chat}: functions -> tools, <functioncall> -> tool_calls, FUNCTION RESPONSE -> tool."""
    prompt, tools = _glaive_tools(_field(row, "system", str))
    parts = _GLAIVE_TURN.split(_field(row, "chat", str))
    if len(parts) < 3:
        raise Malformed("chat has no USER/ASSISTANT/FUNCTION RESPONSE turns")
    messages = [{"role": "system", "content": prompt}] if prompt else []
    pending: list[dict] = []
    n_calls = 0
    for marker, body in zip(parts[1::2], parts[2::2], strict=True):
        body = body.replace("<|endoftext|>", "").strip()
        if marker == "USER":
            messages.append({"role": "user", "content": body})
        elif marker == "ASSISTANT":
            pre, sep, call = body.partition("<functioncall>")
            extra = {}
            if sep:
                extra["tool_calls"] = [_glaive_call(call, n_calls)]
                pending.append(extra["tool_calls"][0])
                n_calls += 1
            messages.append(assistant(pre, **extra))
        elif pending:  # FUNCTION RESPONSE answering the oldest open call
            call = pending.pop(0)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": body})
        # a FUNCTION RESPONSE with no call before it (chats that start with one) has no call to answer: dropped
    return _conv(rid, messages, tools)


# ---------------------------------------------------------------- the other schemas


def adapt_mot(row: dict, src: Source, rid: str) -> dict:
    """open-r1/Mixture-of-Thoughts row {messages, num_tokens, source}; <think> -> reasoning_content."""
    return _conv(rid, _openai_messages(_field(row, "messages", list), "messages"))


def adapt_openthoughts(row: dict, src: Source, rid: str) -> dict:
    """OpenThoughts-114k {system, conversations[user|assistant]} and OpenThoughts3 {conversations[human|gpt]}."""
    roles = {
        "user": "user",
        "human": "user",
        "assistant": "assistant",
        "gpt": "assistant",
        "system": "system",
    }
    messages = _from_role_value(_field(row, "conversations", list), roles, "conversations")
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise Malformed(f"field 'system' must be str, got {type(system).__name__}")
    if system:
        messages.insert(0, {"role": "system", "content": system.strip()})
    return _conv(rid, messages)


def adapt_swe_agent(row: dict, src: Source, rid: str) -> dict:
    """nebius/SWE-agent-trajectories row: trajectory[system|ai|user] -> messages; group = instance_id."""
    instance = _field(row, "instance_id", str)
    if src.target_only and row.get("target") is not True:
        raise Skip("not_target")
    roles = {"system": "system", "ai": "assistant", "user": "user"}
    messages = []
    for k, t in enumerate(_field(row, "trajectory", list)):
        if not isinstance(t, dict) or t.get("role") not in roles:
            raise Malformed(f"trajectory[{k}]: expected an object with role system|ai|user")
        text = _text(t.get("text"), f"trajectory[{k}].text")
        role = roles[t["role"]]
        messages.append(assistant(text) if role == "assistant" else {"role": role, "content": text.strip()})
    return _conv(rid, messages, group=instance)


def adapt_opencodeinstruct(row: dict, src: Source, rid: str) -> dict:
    """nvidia/OpenCodeInstruct row {id, input, output, ...}: one user/assistant exchange."""
    user, output = _field(row, "input", str), _field(row, "output", str)
    return _conv(rid, [{"role": "user", "content": user.strip()}, assistant(output)])


def adapt_sharegpt(row: dict, src: Source, rid: str) -> dict:
    """ShareGPT row {id, conversations[from, value]}: every `from` value; leading assistant turns dropped."""
    roles = {"human": "user", "user": "user", "system": "system"}
    roles.update({k: "assistant" for k in ("gpt", "chatgpt", "bing", "bard", "assistant", "model")})
    messages = _from_role_value(_field(row, "conversations", list), roles, "conversations")
    if not messages:
        raise Skip("empty")
    return _conv(rid, messages)


def adapt_ultrachat(row: dict, src: Source, rid: str) -> dict:
    """HuggingFaceH4/ultrachat_200k row {prompt, prompt_id, messages[user|assistant]}."""
    return _conv(rid, _openai_messages(_field(row, "messages", list), "messages"))


def adapt_openai(row: dict, src: Source, rid: str) -> dict:
    """OpenAI-style {id?, messages|conversations, tools?}: tool_calls, tool_call_id, reasoning_content kept."""
    key = "messages" if "messages" in row or "conversations" not in row else "conversations"
    if row.get(key) is None:
        raise Malformed("missing field 'messages' (or 'conversations')")
    messages = _openai_messages(_field(row, key, list), key)
    tools = row.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Malformed("field 'tools' must be a list of objects")
    tools = [t if "function" in t else {"type": "function", "function": t} for t in tools]
    return _conv(rid, messages, tools)


def _content(val: Any, what: str) -> str:
    """Message content as a string: None -> "", a list of text parts -> their concatenation."""
    if val is None:
        return ""
    if isinstance(val, list):
        parts = [p if isinstance(p, str) else p.get("text") if isinstance(p, dict) else None for p in val]
        if any(not isinstance(p, str) for p in parts):
            raise Malformed(f"{what}: content parts must be text")
        return "".join(parts)
    return _text(val, what)


def _tool_call(tc: Any, what: str) -> dict:
    fn = tc.get("function", tc) if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise Malformed(f"{what}: tool call without a function name")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if tc.get("id"):
        out["id"] = str(tc["id"])
    return out


def _openai_messages(raw: list, what: str) -> list[dict]:
    """Validate OpenAI-style messages; assistant reasoning comes from reasoning_content|reasoning or <think>."""
    out = []
    for k, m in enumerate(raw):
        w = f"{what}[{k}]"
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "user",
            "assistant",
            "tool",
            "developer",
        ):
            raise Malformed(f"{w}: expected an object with role system|user|assistant|tool")
        role = "system" if m["role"] == "developer" else m["role"]
        content = _content(m.get("content"), w)
        if role != "assistant":
            msg = {"role": role, "content": content if role == "tool" else content.strip()}
            if role == "tool" and m.get("tool_call_id") is not None:
                msg["tool_call_id"] = str(m["tool_call_id"])
            out.append(msg)
            continue
        extra: dict[str, Any] = {}
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise Malformed(f"{w}: tool_calls must be a list")
            extra["tool_calls"] = [
                _tool_call(tc, f"{w}.tool_calls[{j}]") for j, tc in enumerate(m["tool_calls"])
            ]
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None:
            msg = {
                "role": "assistant",
                "content": content.strip(),
                "reasoning_content": _text(reasoning, w).strip(),
            }
            msg.update(extra)
        else:
            msg = assistant(content, **extra)
        out.append(msg)
    return out


def adapt_pretokenized(row: dict, src: Source, rid: str) -> dict:
    """Pre-tokenized {input_ids, loss_mask}: checked (same length, ints, mask in {0,1}) and passed through."""
    ids, mask = _field(row, "input_ids", list), _field(row, "loss_mask", list)
    if len(ids) != len(mask):
        raise Malformed(f"input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
    if not all(type(t) is int and t >= 0 for t in ids):
        raise Malformed("input_ids must be non-negative integers")
    if not all(v in (0, 1) and type(v) is int for v in mask):
        raise Malformed("loss_mask values must be 0 or 1")
    return {"id": rid, "source": "", "input_ids": ids, "loss_mask": mask, "group": None}


ADAPTERS: dict[str, Callable[[dict, Source, str], dict]] = {
    "glaive": adapt_glaive,
    "mot": adapt_mot,
    "openthoughts": adapt_openthoughts,
    "swe_agent": adapt_swe_agent,
    "opencodeinstruct": adapt_opencodeinstruct,
    "sharegpt": adapt_sharegpt,
    "ultrachat": adapt_ultrachat,
    "openai": adapt_openai,
    "pretokenized": adapt_pretokenized,
}


# the field of each schema that names a row itself (ShareGPT's conversation id, the SWE issue, ...)
SOURCE_ID_FIELDS = {"sharegpt": "id", "swe_agent": "instance_id", "opencodeinstruct": "id",
                    "ultrachat": "prompt_id", "openai": "id"}  # fmt: skip


def record_id(src: Source, where: dict, row: Any = None) -> str:
    """Stable id of a row: ``dataset:<the row's own id>`` where its schema has one (a re-download or another
    streaming order keeps it, and with it the held-out split and 03's resume), else ``dataset:<line | row>``.
    Rows sharing a source id (SWE-agent runs of one issue) are told apart by the stages (`DatasetOutput`)."""
    field = SOURCE_ID_FIELDS.get(src.adapter)
    val = row.get(field) if field and isinstance(row, dict) else None
    if isinstance(val, (str, int)) and not isinstance(val, bool) and str(val).strip():
        return f"{src.name}:{str(val).strip()}"
    return f"{src.name}:{where.get('line', where.get('row'))}"


def adapt(row: dict, src: Source, where: dict) -> dict:
    """Normalize one raw row with the source's adapter (raises Malformed or Skip)."""
    conv = ADAPTERS[src.adapter](row, src, record_id(src, where, row))
    conv["source"] = src.name
    if "messages" not in conv:
        return conv
    msgs = conv["messages"]
    if src.drop_system:
        msgs = [m for m in msgs if m["role"] != "system"]
    while msgs and msgs[0]["role"] == "system" and not msgs[0]["content"]:
        msgs = msgs[1:]
    first_user = next((k for k, m in enumerate(msgs) if m["role"] == "user"), None)
    if first_user is None:
        raise Skip("empty" if not msgs else "no_user_turn")
    # turns before the first user message other than system ones (a greeting, an orphan tool result) are dropped
    conv["messages"] = [m for k, m in enumerate(msgs) if k >= first_user or m["role"] == "system"]
    return conv
