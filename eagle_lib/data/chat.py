"""Render conversations with the target's own chat template: token ids + assistant loss mask in one pass.

The conversation is rendered ONCE with the tokenizer's template and tokenized ONCE; assistant turns are located
as character spans of that single rendered text and mapped to tokens, so the cost is one render + one
tokenization whatever the number of turns, and no token is split by concatenating separately tokenized pieces.

Which characters are trained (one rule for every template): for each assistant turn, everything the template
writes from the end of the generation prompt (``render(history, add_generation_prompt)``, when the full text holds
all of it before this turn; else the end of the assistant header the template writes for history turns) through
the first end-of-turn special token after the turn's content and tool calls (and end tokens right after it); a turn the template closes with no special token (e.g. a closing token written only
after the final message) ends with its last content or tool-call character. Headers, separators after the
end-of-turn token, system / user / tool turns are 0.

How spans are found (:attr:`Encoded.method`):
- ``scan``: one pass over the text: each assistant header (learned once by :func:`.chat_spans.probe_template`)
  opens a turn, the next end-of-turn closes it; accepted only when a walk over ALL messages in order finds each
  non-assistant message's content between the spans and each assistant message's content and tool calls inside
  its own span.
- ``fallback`` (:func:`.chat_spans.verified_spans`): every message is located by re-rendering with that message
  replaced by a sentinel (the characters that change), the turn start by rendering the history with the
  generation prompt; each span must lie between the neighbouring messages' text and hold its own message's
  content and tool calls verbatim, or :class:`ChatError` is raised (the record is rejected, never kept with a
  guessed mask). Empty assistant messages are rejected (templates disagree on rendering them).

Boundary tokens: a token is trained only when ALL its characters lie inside one trained span; a token that
straddles a span boundary (a BPE merge of a header's trailing space with the first content characters) is
excluded (mask 0). Fast tokenizers take token character ranges from their offsets. Tokenizers without offsets
(slow / tiktoken ones such as Kimi-K2.5's) tokenize the text cut at span boundaries: when the pieces concatenate
to the whole text's tokenization no token crosses a boundary (the fast path's mask); otherwise the ranges come
from decoding the whole text's ids token by token (tokens spelling one character share its range, as fast
offsets do) and the same rule applies, so both kinds take the same decision; a tokenizer whose decode does not
reproduce the text then rejects the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from eagle_lib.data import chat_spans
from eagle_lib.data.chat_spans import ChatError, Probe, call_pieces, content_of  # noqa: F401  (chat.ChatError)

Turns = Literal["all", "last", "each"]


@dataclass
class Encoded:
    """One tokenized conversation (or, for ``turns: each``, one assistant turn with its history)."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 = assistant token to predict (a label position), same length as input_ids
    text: str  # the rendered conversation
    method: str  # "scan" (one-pass spans) or "fallback" (verified spans from sentinel re-renders)
    turns: list[int] | None = None  # turns: each: which assistant turns (0-based) this sequence trains


class ChatEncoder:
    """Renders and tokenizes conversations for one tokenizer + template (probe computed once)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict | None = None, verify_pieces: bool = True):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.verify_pieces = verify_pieces
        self.backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
        self.specials = chat_spans.special_strings(tokenizer)
        self.probe = chat_spans.probe_template(self)

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
        if turns == "each":
            raise ValueError("turns='each' yields several sequences: use encode_each")
        return self.encode_text(self.render(messages, tools), messages, tools, turns)

    def encode_each(self, messages: list[dict], tools: list | None = None) -> list[Encoded]:
        """Every assistant turn trained once, in a sequence that shows it as the target saw it when it wrote it.

        A turn whose place in the full render is exactly that (the text before it is the prompt the target was
        given, ``render(history, add_generation_prompt)``, and the turn reads as the template renders it when it
        is the final message) is trained in one sequence of the whole conversation. Every other turn (its
        reasoning dropped by the template because later turns follow, or an earlier turn's reasoning that the
        target saw dropped from the history) gets its own sequence: that prompt followed by the turn as the final
        message renders it, reasoning included; its history is masked 0. A conversation without reasoning is
        one sequence, as with ``all``.
        """
        full = self.render(messages, tools)
        spans, method = self.spans_of(full, messages, tools)
        merged: list[int] = []
        out: list[Encoded] = []
        for k, i in enumerate(i for i, m in enumerate(messages) if m["role"] == "assistant"):
            b, e = spans[k]
            prompt = self.render(messages[:i], tools, add_generation_prompt=True)
            own = self.render(messages[: i + 1], tools)
            own_spans, own_method = self.spans_of(own, messages[: i + 1], tools)
            turn = own[own_spans[-1][0] : own_spans[-1][1]]
            if full[:b] == prompt and full[b:e] == turn:
                merged.append(k)
                continue
            text = prompt + turn
            ids, mask = self._tokenize_masked(text, [(len(prompt), len(text))])
            out.append(Encoded(ids, mask, text, own_method, [k]))
        if merged:
            ids, mask = self._tokenize_masked(full, [spans[k] for k in merged])
            out.insert(0, Encoded(ids, mask, full, method, merged))
        return out

    def spans_of(self, text: str, messages: list[dict], tools: list | None = None) -> tuple[list, str]:
        """(character spans of the assistant turns in ``text``, "scan" | "fallback"); ChatError if unverifiable."""
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and not (
                content_of(m).strip() or m.get("reasoning_content") or m.get("tool_calls")
            ):
                raise ChatError(f"message {i}: empty assistant message (templates disagree on rendering it)")
        spans = chat_spans.scan_spans(self, text, messages)
        if spans is not None:
            return spans, "scan"
        return chat_spans.verified_spans(self, messages, tools, text), "fallback"

    def encode_text(
        self, text: str, messages: list[dict], tools: list | None = None, turns: Turns = "all"
    ) -> Encoded:
        """Token ids and loss mask of ``text``, the render of ``messages`` (one tokenization)."""
        spans, method = self.spans_of(text, messages, tools)
        if turns == "last":
            spans = spans[-1:]
        ids, mask = self._tokenize_masked(text, spans)
        return Encoded(ids, mask, text, method)

    # ------------------------------------------------------------ tokens

    def _tokenize_masked(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        if self.backend is None:
            return self._tokenize_slow(text, spans)
        enc = self.backend.encode(text, add_special_tokens=False)
        ids = enc.ids
        mask = [0] * len(ids)
        for a, b in spans:
            t0 = next((t for c in range(a, b) if (t := enc.char_to_token(c)) is not None), None)
            if t0 is None:  # the span's characters map to no token (e.g. removed by a normalizer)
                continue
            t1 = next(t for c in range(b - 1, a - 1, -1) if (t := enc.char_to_token(c)) is not None)
            t0 += enc.token_to_chars(t0)[0] < a  # straddles the span start: holds header text, excluded
            t1 -= enc.token_to_chars(t1)[1] > b  # straddles the span end: excluded
            if t0 <= t1:
                mask[t0 : t1 + 1] = [1] * (t1 + 1 - t0)
        return ids, mask

    def _tokenize_slow(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Tokenizers without offsets: the text cut at span boundaries, tokenized piece by piece; when the pieces
        concatenate to the whole text's tokenization, no token crosses a boundary and the mask is the fast path's.
        Otherwise character ranges come from decoding the ids and the fast path's rule excludes the crossing
        tokens (rejected when decoding is not exact)."""
        ids, mask = self._tokenize_pieces(text, spans)
        if not self.verify_pieces:
            return ids, mask
        whole = self.tok.encode(text, add_special_tokens=False)
        if ids == whole:
            return ids, mask
        offsets = decoded_offsets(self.tok, whole, text)
        if offsets is None:
            raise ChatError(
                "a token crosses a mask boundary and decoding gives no character ranges to exclude it"
            )
        mask, k = [0] * len(whole), 0
        for t, (s, e) in enumerate(offsets):
            while k < len(spans) and spans[k][1] <= s:
                k += 1
            if k < len(spans) and spans[k][0] <= s and e <= spans[k][1] and s < e:
                mask[t] = 1
        return whole, mask

    def _tokenize_pieces(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """The text cut at span boundaries, each piece tokenized alone (pieces inside spans masked 1)."""
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
        return ids, mask


def decoded_offsets(tok: Any, ids: list[int], text: str) -> list[tuple[int, int]] | None:
    """Character range of every token, by decoding the ids one by one; None if decoding is not exact.

    Tokens that together spell one character (byte-level pieces of a multi-byte character) share its range.
    """
    out: list[tuple[int, int]] = []
    pos, group = 0, 0
    for k in range(len(ids)):
        group += 1
        piece = tok.decode(
            ids[k - group + 1 : k + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if not text.startswith(piece, pos):
            if "\ufffd" in piece and group < 4:  # an incomplete character: wait for its other bytes
                continue
            return None
        out += [(pos, pos + len(piece))] * group
        pos, group = pos + len(piece), 0
    return out if pos == len(text) and group == 0 else None
