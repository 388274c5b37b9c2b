"""Multi-turn regeneration (02 ``turn: each_turn``, 03, 05): the source conversation cut into the turns the target
answers, the target's answers parsed back into messages, the continue/stop rule, and 05's training sequences.

A conversation's *answer points* are the places where the source has an assistant message right after a
non-assistant one (and its end, when it ends on a user or tool message). 02 keeps the first prompt (exactly
``turn: first``'s) and, for each later answer point k, a *follow-up*: the source's tool calls of the answer before
it (``calls``) and the non-assistant messages between the two (``messages``: user turns, tool results).

The target answers turn 0, then each follow-up in order, its own earlier answers fed back as history (rendered by
the target's chat template). After answer k the conversation continues with follow-up k+1 only when
- answer k ended on a stop token (an answer cut at max_new_tokens is not a history the target would see), and
- the target's tool calls of answer k equal the source's (function names and arguments after JSON normalisation,
  in order); tool results are taken from the source only then, with the target's call ids;
else it stops there, with the reason counted (``length``, ``tool_call_mismatch``, ``too_long``, ``unparsable``).

Answers are parsed in Kimi-K2.5's format (the toy's too): ``<think>reasoning</think>content`` then an optional
``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS
<|tool_call_end|>...<|tool_calls_section_end|>``. Kimi-K2.5's generation prompt ends with ``<think>`` (the
template opens the think block), so its answers start inside the reasoning: ``reasoning</think>content``; the
toy's prompt stops before ``<think>`` and the model writes it. Which of the two a turn is comes from its prompt
(:func:`opens_think`). Either way the reasoning goes to ``reasoning_content``, never into the replayed content.
An answer whose think block never closes has no content to replay: cut at max_new_tokens the conversation stops
(``length``); ended by a stop token inside its reasoning it stops as ``unparsable``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

SEP = "#"  # a turn record's id: f"{conversation}{SEP}{turn}"
_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^<]*?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>",
    re.S,
)
_SECTION = "<|tool_calls_section_begin|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def turn_id(conversation: str, turn: int) -> str:
    return f"{conversation}{SEP}{turn}"


def answer_points(messages: list[dict]) -> list[int]:
    """Indices where the target answers: assistant messages after a non-assistant one, plus the end when the
    conversation ends on a user or tool message."""
    pts = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k > 0 and messages[k - 1]["role"] != "assistant"]  # fmt: skip
    if messages and messages[-1]["role"] in ("user", "tool"):
        pts.append(len(messages))
    return pts


def split_turns(messages: list[dict]) -> tuple[list[dict], list[dict]] | None:
    """(first prompt, follow-ups) of a source conversation; None when it has no answer point."""
    pts = answer_points(messages)
    if not pts:
        return None
    follow = []
    for a, b in zip(pts, pts[1:], strict=False):
        calls = [tc for m in messages[a:b] if m["role"] == "assistant" for tc in m.get("tool_calls") or []]
        between = [m for m in messages[a:b] if m["role"] != "assistant"]
        follow.append({"calls": calls, "messages": between})
    return messages[: pts[0]], follow


def norm_call(tc: dict) -> tuple[str, str]:
    """(name, canonical JSON of the arguments); arguments that are not JSON compare as stripped text."""
    fn = tc.get("function", tc)
    args = fn.get("arguments", "")
    try:
        val = json.loads(args) if isinstance(args, str) else args
        canon = json.dumps(val, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except json.JSONDecodeError:
        canon = " ".join(str(args).split())
    return str(fn.get("name", "")), canon


def calls_match(target_calls: list[dict], source_calls: list[dict]) -> bool:
    """Same functions with the same arguments, in the same order."""
    return [norm_call(t) for t in target_calls] == [norm_call(s) for s in source_calls]


def opens_think(prompt_tail: str) -> bool:
    """Whether a prompt (its decoded end suffices) leaves a think block open: the answer starts inside it."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


def parse_answer(text: str, stop_strings: list[str], think_open: bool = False) -> dict | None:
    """An assistant message {role, content, reasoning_content?, tool_calls?} from a generated answer's text;
    ``think_open``: its prompt opened the think block (`opens_think`), so the text starts inside the reasoning.
    None when the think block never closes (an answer cut inside its reasoning has no content to replay)."""
    for s in stop_strings:
        if s and text.endswith(s):
            text = text[: -len(s)]
            break
    msg: dict = {"role": "assistant"}
    if not think_open and text.startswith(THINK_OPEN):
        text, think_open = text[len(THINK_OPEN) :], True
    if think_open:
        reasoning, closed, text = text.partition(THINK_CLOSE)
        if not closed:
            return None
        if reasoning:
            msg["reasoning_content"] = reasoning
    content, _, section = text.partition(_SECTION)
    msg["content"] = content
    calls = []
    for m in _CALL.finditer(section):
        ident = m.group("id").strip()
        name = ident.removeprefix("functions.").rsplit(":", 1)[0]
        calls.append(
            {"id": ident, "type": "function", "function": {"name": name, "arguments": m.group("args")}}
        )
    if calls:
        msg["tool_calls"] = calls
    return msg


def next_turn(answer: dict | None, finish_reason: str, follow: dict | None) -> tuple[list[dict] | None, str]:
    """(messages to append after the answer, "") to continue, or (None, reason) to stop; reason "complete" when
    the source has no further turn, "unparsable" when `parse_answer` found no answer to replay (None)."""
    if follow is None:
        return None, "complete"
    if finish_reason != "stop":
        return None, "length"
    if answer is None:
        return None, "unparsable"
    mine = answer.get("tool_calls") or []
    if not calls_match(mine, follow["calls"]):
        return None, "tool_call_mismatch"
    ids = iter(tc["id"] for tc in mine)
    out = []
    for m in follow["messages"]:
        if m["role"] == "tool":  # the source's result, answering the target's own (equal) call
            m = m | {"tool_call_id": next(ids, m.get("tool_call_id", ""))}
        out.append(m)
    return out, ""


@dataclass
class Merged:
    """One training sequence of a conversation: its turns' answers are the loss spans (mask 1)."""

    id: str
    conversation: str
    turns: list[int]
    input_ids: list[int]
    loss_mask: list[int]


def conversation_sequences(turn_records: list[dict]) -> list[Merged]:
    """05's sequences of one conversation's turn records: as few as possible, none repeating a prefix needlessly.

    Turn k+1 joins the sequence of turn k when its prompt_ids start with that whole sequence (the history the
    target saw is the text it was trained on); otherwise (e.g. the template dropped an earlier turn's reasoning
    from the history, or the answer re-tokenized differently) it starts a new sequence holding its own prompt.
    Mask: 1 on every turn's output_ids, 0 elsewhere.
    """
    out: list[Merged] = []
    for rec in sorted(turn_records, key=lambda r: r["turn"]):
        p, o = list(rec["prompt_ids"]), list(rec["output_ids"])
        cur = out[-1] if out else None
        if cur is not None and p[: len(cur.input_ids)] == cur.input_ids:
            cur.loss_mask += [0] * (len(p) - len(cur.input_ids)) + [1] * len(o)
            cur.input_ids = p + o
            cur.turns.append(rec["turn"])
            continue
        conv = str(rec["conversation"])
        out.append(
            Merged(turn_id(conv, rec["turn"]), conv, [rec["turn"]], p + o, [0] * len(p) + [1] * len(o))
        )
    return out


def training_records(turn_records: list[dict]):
    """(record, input_ids, loss_mask) of every conversation's merged sequences, in first-seen order; the record
    is {id, conversation, turns, source}: its split key (`store.split_key`) is the conversation."""
    by_conv: dict[str, list[dict]] = {}
    for rec in turn_records:
        by_conv.setdefault(str(rec["conversation"]), []).append(rec)
    for recs in by_conv.values():
        for m in conversation_sequences(recs):
            rec = {
                "id": m.id,
                "conversation": m.conversation,
                "turns": m.turns,
                "source": recs[0].get("source"),
            }
            yield rec, m.input_ids, m.loss_mask
