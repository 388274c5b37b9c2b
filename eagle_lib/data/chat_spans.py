"""Where the assistant turns are in a rendered conversation: the template probe, the one-pass scan, the verified
fallback. Character spans only; :mod:`eagle_lib.data.chat` turns them into token masks (its docstring has the rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ChatError(ValueError):
    """A conversation the template or tokenizer cannot render into an exact mask (message says why)."""


@dataclass(frozen=True)
class Probe:
    """What opens and closes an assistant turn in this template's renders."""

    header: str  # e.g. "<|im_start|>assistant\n"; "" for templates with no assistant header (Mistral [INST])
    ends: tuple[str, ...]  # end-of-turn strings: after the final turn, after a history turn (harmony differs)
    drops_history_reasoning: bool = False  # reasoning of turns before a later user turn is not rendered
    history_header: str = ""  # what precedes a history turn's content, when it is less than the prompt


def content_of(msg: dict) -> str:
    c = msg.get("content")
    return c if isinstance(c, str) else ""


def call_pieces(msg: dict) -> list[str]:
    """Tool-call names and argument strings, in order: each must be rendered inside the turn."""
    out = []
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function", tc)
        out += [s for s in (fn.get("name", ""), fn.get("arguments", "")) if isinstance(s, str) and s]
    return out


Span = tuple[int, int]


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def without_reasoning(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]


def special_strings(tok: Any) -> list[str]:
    """The tokenizer's special / added token strings, longest first."""
    names = set(getattr(tok, "all_special_tokens", []) or [])
    for added in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        names.add(str(getattr(added, "content", added)))
    return sorted((n for n in names if n), key=len, reverse=True)


def _first_special(text: str, specials: list[str]) -> tuple[int, str] | None:
    hits = [(j, -len(s), s) for s in specials if (j := text.find(s)) >= 0]
    return (min(hits)[0], min(hits)[2]) if hits else None


def snap(text: str, k: int, specials: list[str]) -> int:
    """``k`` moved back to the start of a special token it would cut (a common prefix may end inside one)."""
    for s in specials:
        j = text.find(s, max(0, k - len(s) + 1), k + len(s))
        if 0 <= j < k < j + len(s):
            return j
    return k


def first_end(text: str, ends: tuple[str, ...], lo: int, hi: int) -> int:
    """End of the earliest end-of-turn string inside text[lo:hi] and of the end strings right after it
    (``</tool_call><|im_end|>`` when both close turns), or -1."""
    hits = [(j, j + len(s)) for s in ends if (j := text.find(s, lo, hi)) >= 0]
    if not hits:
        return -1
    best = min(hits)[1]
    while nxt := [best + len(s) for s in ends if text.startswith(s, best) and best + len(s) <= hi]:
        best = max(nxt)
    return best


# ---------------------------------------------------------------- probe


def probe_template(enc: Any) -> Probe:
    """Learn the assistant header, the end-of-turn strings and whether history reasoning is dropped.

    header = what the generation prompt adds after the user turn AND the template writes before an assistant's
    content (the toy's Kimi-like template renders ``<think></think>`` there, which belongs to the turn; Kimi-K2.5's
    generation prompt ends with ``<think>``, which the model never writes: it is the header's); "" when there is
    none (Mistral ``[INST]``). An end = the text after an assistant's content through its first special token, learned after a
    final turn, a history turn and a tool-call turn; a special token that opens user turns is not an end (a
    template that closes only the final message).
    """
    u, u2 = {"role": "user", "content": "Hi there"}, {"role": "user", "content": "And then"}
    r2, thought = "Second reply 9", "Probe thought 5"
    base, gen = enc.render([u]), enc.render([u], add_generation_prompt=True)
    for r1 in ("Probe reply 7", "42 + 42"):  # the second survives templates that transform letters
        full = enc.render([u, {"role": "assistant", "content": r1}])
        if r1 in full:
            break
    else:
        raise ChatError("chat template: it renders no assistant content verbatim (cannot train it exactly)")
    if "Hi there" not in base:
        raise ChatError("chat template: it does not render a user message verbatim")
    k0 = snap(gen, common_prefix_len(base, gen), enc.specials)
    k1 = snap(gen, common_prefix_len(gen, full), enc.specials)
    header = gen[k0:k1] if k0 <= k1 <= full.rindex(r1) else ""
    if not header:  # the text before the turn changed with it (a system prompt citing later messages)
        before = full[: full.rindex(r1)]
        z = common_prefix_len(gen[k0:][::-1], before[::-1])
        header = gen[len(gen) - z :] if z else ""
    two = enc.render([u, {"role": "assistant", "content": r1}, u2, {"role": "assistant", "content": r2}])
    k2 = snap(gen, common_prefix_len(gen, two), enc.specials)
    history_header = gen[k0:k2] if k0 < k2 else header
    user_open = {s for s in enc.specials if s in base[: base.index("Hi there")]}

    def closing(text: str, piece: str, nxt: str, openers: set[str]) -> str:
        """The last special token after ``piece`` before the next message's opening markup ("" if none)."""
        j = text.index(piece) + len(piece)
        after = text[j : text.index(nxt, j)]
        cut = min((k for s in openers if (k := after.find(s)) >= 0), default=len(after))
        hits = [(after.rfind(s, 0, cut), s) for s in enc.specials if after.rfind(s, 0, cut) >= 0]
        return max(hits, key=lambda h: (h[0] + len(h[1]), len(h[1])))[1] if hits else ""

    after_last = full[full.index(r1) + len(r1) :]
    hit = _first_special(after_last, enc.specials)
    ends = [hit[1] if hit else ""]  # the final turn: the first special token after its content
    ends.append(closing(two, r1, "And then", user_open))
    call = {"type": "function", "function": {"name": "probe_fn", "arguments": '{"x": 71}'}}
    try:  # a tool-call turn may close with its own token (harmony-like <|call|>)
        asked = [u, {"role": "assistant", "content": "", "tool_calls": [call]}]
        calls = enc.render(asked + [{"role": "tool", "content": "Probe result 3"}])
        if '{"x": 71}' in calls and "Probe result 3" in calls:
            at = common_prefix_len(enc.render(asked), calls)
            tool_open = {s for s in enc.specials if s in calls[at : calls.index("Probe result 3")]}
            ends.append(closing(calls, '{"x": 71}', "Probe result 3", user_open | tool_open))
    except ChatError:
        pass
    last = enc.render([u, {"role": "assistant", "content": r1, "reasoning_content": thought}])
    hist = enc.render(
        [u, {"role": "assistant", "content": r1, "reasoning_content": thought}, u2,
         {"role": "assistant", "content": r2}]
    )  # fmt: skip
    drops = thought in last and thought not in hist
    return Probe(header, tuple(dict.fromkeys(e for e in ends if e)), drops, history_header)


# ---------------------------------------------------------------- scan (fast path)


def scan_spans(enc: Any, text: str, messages: list[dict]) -> list[Span] | None:
    """One pass: every header opens a turn, the next end-of-turn closes it; None unless the walk agrees."""
    header, ends = enc.probe.header, enc.probe.ends
    if not header or not ends:
        return None
    n_asst = sum(m["role"] == "assistant" for m in messages)
    starts, pos = [], text.find(header)
    while pos >= 0:
        starts.append(pos + len(header))
        pos = text.find(header, pos + len(header))
    if len(starts) != n_asst:
        return None
    spans = []
    for k, b in enumerate(starts):
        limit = starts[k + 1] - len(header) if k + 1 < len(starts) else len(text)
        e = first_end(text, ends, b, limit)
        if e < 0:
            return None
        spans.append((b, e))
    return spans if _walk_agrees(text, messages, spans, len(header)) else None


def _walk_agrees(text: str, messages: list[dict], spans: list[Span], header_len: int) -> bool:
    """Every message's text, in order: non-assistant content between spans, assistant content and tool calls
    inside their own span (a span that swallowed another message, or missed its own, fails)."""
    pos, k = 0, 0
    for m in messages:
        if m["role"] == "assistant":
            b, e = spans[k]
            k += 1
            if b < pos:
                return False
            p = b
            for piece in [content_of(m)] + call_pieces(m):
                if piece:
                    j = text.find(piece, p, e)
                    if j < 0:
                        return False
                    p = j + len(piece)
            pos = e
        elif c := content_of(m):
            nxt = spans[k][0] - header_len if k < len(spans) else len(text)
            j = text.find(c, pos, nxt)
            if j < 0:
                return False
            pos = j + len(c)
    return True


# ---------------------------------------------------------------- verified fallback


def _sentinel(old: str, tag: str) -> str:
    mark = next(c for c in "ΞΨΦ" if not old.startswith(c) and not old.endswith(c))
    return f"{mark}{tag} sentinel{mark}"


def _perturbed(m: dict, k: int) -> dict:
    """Message k with its own text replaced by sentinels (what it contributes to the render changes)."""
    m2 = dict(m)
    c = content_of(m)
    if m["role"] != "assistant" or c:
        m2["content"] = _sentinel(c, f"c{k}")
    if m["role"] == "assistant":
        if m.get("reasoning_content"):
            m2["reasoning_content"] = _sentinel(m["reasoning_content"], f"r{k}")
        if not c and m.get("tool_calls"):
            m2["tool_calls"] = [
                {**tc, "function": {**tc["function"], "name": f"sentinel_fn_{k}_{j}"}}
                for j, tc in enumerate(m["tool_calls"])
            ]
    return m2


def _region(enc: Any, messages: list[dict], tools: list | None, text: str, k: int) -> Span:
    """The characters of ``text`` that change when message k's own text is replaced: where it is rendered."""
    alt = enc.render(messages[:k] + [_perturbed(messages[k], k)] + messages[k + 1 :], tools)
    if alt == text:
        raise ChatError(f"message {k} ({messages[k]['role']}): the template does not render it")
    a = common_prefix_len(text, alt)
    room = min(len(text), len(alt)) - a
    z = common_prefix_len(text[: a - 1 : -1] if a else text[::-1], alt[: a - 1 : -1] if a else alt[::-1])
    return a, len(text) - min(z, room)


def _turn_start(enc: Any, hist: list[dict], tools: list | None, text: str) -> int:
    """End of the generation prompt before this turn (-1: none fits).

    The history (as given, or without reasoning) must be rendered whole at the start of the text; the turn then
    starts after the generation prompt when the text holds all of it, else after the assistant header the
    template writes for history turns (Qwen3-style ``enable_thinking=false`` prompts add an empty think block
    that history turns do not have).
    """
    best, hh = -1, enc.probe.history_header
    for h in (hist, without_reasoning(hist)):
        gen = enc.render(h, tools, add_generation_prompt=True)
        at = snap(gen, common_prefix_len(enc.render(h, tools), gen), enc.specials)  # the prompt begins
        if common_prefix_len(gen, text) < at:
            continue
        if text.startswith(gen[at:], at):
            best = max(best, len(gen))
        elif hh and gen.startswith(hh, at) and text.startswith(hh, at):
            best = max(best, at + len(hh))
    return best


def verified_spans(enc: Any, messages: list[dict], tools: list | None, text: str) -> list[Span]:
    """Spans checked against every message's located text, or ChatError naming the message and the reason."""
    regions = [_region(enc, messages, tools, text, k) for k in range(len(messages))]
    for k in range(1, len(regions)):
        if regions[k][0] < regions[k - 1][1]:
            raise ChatError(
                f"message {k}: the template mixes its text with message {k - 1}'s (e.g. a system prompt or "
                "history that depends on later messages)"
            )
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        lo = regions[i - 1][1] if i else 0
        hi = regions[i + 1][0] if i + 1 < len(messages) else len(text)
        s, e = regions[i]
        b = _turn_start(enc, messages[:i], tools, text)
        if not lo <= b <= s and (hh := enc.probe.history_header) and (j := text.rfind(hh, lo, s)) >= 0:
            b = j + len(
                hh
            )  # the history renders differently later (Qwen3 think blocks): the header is the turn's
        if not lo <= b <= s:
            raise ChatError(
                f"message {i}: the history before it renders differently in the full conversation"
            )
        pos = b
        if c := content_of(m):
            j = text.find(c, s, e)
            if j < 0:
                raise ChatError(f"message {i}: the template does not render the assistant content verbatim")
            pos = j + len(c)
        pos = max(pos, e)
        at = b  # calls render in order: each is searched after the previous one (two identical calls are two)
        for piece in call_pieces(m):
            j = text.find(piece, at, hi)
            if j < 0:
                raise ChatError(f"message {i}: a tool call is not rendered verbatim inside its turn")
            at = j + len(piece)
            pos = max(pos, at)
        end = first_end(text, enc.probe.ends, pos, hi)
        spans.append((b, end if end >= 0 else pos))
    return spans
