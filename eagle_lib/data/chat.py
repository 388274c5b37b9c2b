"""Render conversations with the target's own chat template: token ids + assistant loss mask in one pass.

The conversation is rendered ONCE with the tokenizer's template and tokenized ONCE; assistant turns are located
as character spans of that single rendered text and mapped to tokens through the fast tokenizer's offsets, so
the cost is one render + one tokenization whatever the number of turns (a per-turn prefix re-encode is
O(turns x length)), and no token is ever split by concatenating separately tokenized pieces.

Which characters are trained: for every assistant turn, everything the model writes after the assistant header
(the generation prompt) up to and including the end-of-turn token: reasoning where the template keeps it, the
content, tool-call markup and arguments, the end-of-turn token. Headers, separators after the end-of-turn
token, system / user / tool turns are 0. A token is 1 when its characters overlap a trained span.

The header and end-of-turn strings are learned once per template by rendering tiny probe conversations
(:func:`probe_template`); spans are then found by scanning the full render and checked against the messages.
When the check fails (a template whose history header differs from its generation prompt, a user who pastes
chat markup), spans come from rendering the conversation prefix by prefix instead (correct, slower).
Tokenizers without offsets (slow / tiktoken ones such as Kimi-K2.5's) tokenize the text cut at span
boundaries and, by default, verify that the pieces concatenate to the tokenization of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Turns = Literal["all", "last"]


class ChatError(ValueError):
    """A conversation the template or tokenizer cannot render into an exact mask (message says why)."""


@dataclass(frozen=True)
class Probe:
    """What opens and closes an assistant turn in this template's renders."""

    header: str  # e.g. "<|im_assistant|>assistant<|im_middle|>" (Kimi) or "<|im_start|>assistant\n" (ChatML)
    end: str  # e.g. "<|im_end|>": the end-of-turn token text, the last trained characters of a turn


@dataclass
class Encoded:
    """One tokenized conversation."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 = assistant token to predict (a label position), same length as input_ids
    text: str  # the rendered conversation
    method: str  # "scan" (one-pass spans) or "prefix" (prefix-by-prefix fallback)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _without_reasoning(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]


def shift_labels(input_ids: list[int], loss_mask: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(inputs, labels, label_mask) for next-token training.

    Position t reads inputs[:t+1] and predicts labels[t] = input_ids[t+1]; it is trained when label_mask[t] =
    loss_mask[t+1]. The mask moves WITH the labels: pairing labels with loss_mask[:-1] would skip the first
    assistant token of every turn (a known peer bug).
    """
    return input_ids[:-1], input_ids[1:], loss_mask[1:]


class ChatEncoder:
    """Renders and tokenizes conversations for one tokenizer + template (probe computed once)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict | None = None, verify_pieces: bool = True):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.verify_pieces = verify_pieces
        self.backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
        self.probe = probe_template(self)

    def render(
        self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False
    ) -> str:
        """The template's text for ``messages`` (no tokenization)."""
        try:
            return self.tok.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
                **self.kwargs,
            )  # fmt: skip
        # jinja raises whatever the template author chose (TemplateError, TypeError, ...)
        except Exception as e:
            raise ChatError(f"chat template failed: {type(e).__name__}: {e}") from None

    def tokenize(self, text: str) -> list[int]:
        """Token ids of already-rendered text (no special tokens added: the template wrote them)."""
        if self.backend is not None:
            return self.backend.encode(text, add_special_tokens=False).ids
        return self.tok.encode(text, add_special_tokens=False)

    def encode_prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """Token ids of ``messages`` + the generation prompt: what an engine continues from."""
        return self.tokenize(self.render(messages, tools, add_generation_prompt=True))

    def encode(self, messages: list[dict], tools: list | None = None, turns: Turns = "all") -> Encoded:
        """Token ids and loss mask of a whole conversation (assistant turns: all, or the last only)."""
        return self.encode_text(self.render(messages, tools), messages, tools, turns)

    def encode_text(
        self, text: str, messages: list[dict], tools: list | None = None, turns: Turns = "all"
    ) -> Encoded:
        """Token ids and loss mask of ``text``, the render of ``messages`` (one tokenization, spans by scan)."""
        asst = [m for m in messages if m["role"] == "assistant"]
        spans, method = self._scan_spans(text, asst), "scan"
        if spans is None:
            spans, method = self._prefix_spans(messages, tools, text), "prefix"
        if turns == "last":
            spans = spans[-1:]
        ids, mask = self._tokenize_masked(text, spans)
        return Encoded(ids, mask, text, method)

    # ------------------------------------------------------------ spans (character ranges of trained text)

    def _scan_spans(self, text: str, asst: list[dict]) -> list[tuple[int, int]] | None:
        """One pass: every header opens a turn, the next end-of-turn closes it; None if the check fails."""
        header, end = self.probe.header, self.probe.end
        starts, pos = [], text.find(header)
        while pos >= 0:
            starts.append(pos + len(header))
            pos = text.find(header, pos + len(header))
        if len(starts) != len(asst):
            return None
        spans = []
        for k, (b, msg) in enumerate(zip(starts, asst, strict=True)):
            limit = starts[k + 1] - len(header) if k + 1 < len(starts) else len(text)
            e = text.find(end, b, limit)
            if e < 0 or not _holds(text, b, e, msg):
                return None
            spans.append((b, e + len(end)))
        return spans

    def _prefix_spans(self, messages: list[dict], tools: list | None, text: str) -> list[tuple[int, int]]:
        """Slow path: turn i starts where render(messages[:i], generation prompt) stops matching the full text.

        The history before turn i is rendered both as given and without reasoning (templates that drop the
        thinking of earlier turns render it that way inside the full conversation); the one that matches wins.
        """
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            b = -1
            for hist in (messages[:i], _without_reasoning(messages[:i])):
                base = self.render(hist, tools)
                if text.startswith(base):
                    gen = self.render(hist, tools, add_generation_prompt=True)
                    b = max(b, len(base) + _common_prefix_len(gen[len(base) :], text[len(base) :]))
            if b < 0:
                raise ChatError(
                    f"message {i}: the template renders the history before it unlike the full text"
                )
            anchor = _after_message(text, b, m)
            e = text.find(self.probe.end, anchor)
            if e < 0:
                raise ChatError(f"message {i}: no end-of-turn {self.probe.end!r} after the assistant turn")
            spans.append((b, e + len(self.probe.end)))
        return spans

    # ------------------------------------------------------------ tokens

    def _tokenize_masked(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        if self.backend is None:
            return self._tokenize_pieces(text, spans)
        enc = self.backend.encode(text, add_special_tokens=False)
        ids = enc.ids
        mask = [0] * len(ids)
        for a, b in spans:
            t0 = next((t for c in range(a, b) if (t := enc.char_to_token(c)) is not None), None)
            if t0 is None:  # the span's characters map to no token (e.g. removed by a normalizer)
                continue
            t1 = next(t for c in range(b - 1, a - 1, -1) if (t := enc.char_to_token(c)) is not None)
            mask[t0 : t1 + 1] = [1] * (t1 + 1 - t0)
        return ids, mask

    def _tokenize_pieces(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Tokenizers without offsets: tokenize the text cut at span boundaries, check against the whole."""
        ids: list[int] = []
        mask: list[int] = []
        pos = 0
        for a, b in spans + [(len(text), len(text))]:
            for piece, bit in ((text[pos:a], 0), (text[a:b], 1)):
                if piece:
                    part = self.tok.encode(piece, add_special_tokens=False)
                    ids += part
                    mask += [bit] * len(part)
            pos = b
        if self.verify_pieces and ids != self.tok.encode(text, add_special_tokens=False):
            raise ChatError("a token crosses a mask boundary (pieces do not concatenate to the whole text)")
        return ids, mask


def _holds(text: str, b: int, e: int, msg: dict) -> bool:
    """Does text[b:e] hold the message's content and tool-call names (a cheap check that the span is right)?"""
    content = (msg.get("content") or "").strip() if isinstance(msg.get("content"), str) else ""
    if content and text.find(content, b, e) < 0:
        return False
    for tc in msg.get("tool_calls") or []:
        name = tc.get("function", tc).get("name", "")
        if name and text.find(name, b, e) < 0:
            return False
    return True


def _after_message(text: str, b: int, msg: dict) -> int:
    """Position after the message's content and tool-call names in ``text`` (searching from ``b``)."""
    pos = b
    content = msg.get("content") if isinstance(msg.get("content"), str) else ""
    for needle in [content.strip()] + [
        tc.get("function", tc).get("name", "") for tc in msg.get("tool_calls") or []
    ]:
        k = text.find(needle, pos) if needle else -1
        if k >= 0:
            pos = k + len(needle)
    return pos


def _special_strings(tok: Any) -> list[str]:
    names = set(getattr(tok, "all_special_tokens", []) or [])
    for added in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        names.add(str(getattr(added, "content", added)))
    return sorted((n for n in names if n), key=len, reverse=True)


def probe_template(enc: ChatEncoder) -> Probe:
    """Learn the assistant header and end-of-turn text from renders of tiny probe conversations.

    header = the longest common prefix of the generation prompt and of what precedes an assistant's content
    in history (Kimi renders ``<think></think>`` there, which belongs to the turn, not the header); end = the
    text after an assistant's content up to and including its last special token (ChatML's trailing newline
    is a separator, not generated).
    """
    user, reply = {"role": "user", "content": "Hi there"}, "Probe reply 7"
    base = enc.render([user])
    gen = enc.render([user], add_generation_prompt=True)
    full = enc.render([user, {"role": "assistant", "content": reply}])
    if not (gen.startswith(base) and full.startswith(base)) or reply not in full[len(base) :]:
        raise ChatError("chat template: cannot locate the assistant turn in probe renders")
    k = full.index(reply, len(base))
    hist_header, after = full[len(base) : k], full[k + len(reply) :]
    header = gen[len(base) : len(base) + _common_prefix_len(gen[len(base) :], hist_header)]
    cut = max((after.rfind(s) + len(s) for s in _special_strings(enc.tok) if s in after), default=-1)
    end = after[:cut] if cut > 0 else after.rstrip()
    if not header or not end:
        raise ChatError(f"chat template: no assistant header ({header!r}) or end-of-turn ({end!r}) found")
    return Probe(header, end)
