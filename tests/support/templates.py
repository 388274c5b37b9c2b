"""The chat-template matrix for the mask tests: one template per real family, written for this project, plus
adversarial ones; a byte-level BPE shared by all of them; a slow (no offsets) tokenizer stand-in; the reference.

Every template carries ``{% generation %}`` markers around what the model generated in each assistant turn. The
tokenizers get the template WITH THE MARKERS REMOVED (:func:`strip_markers`), so the code under test never sees
them; :func:`reference_mask` renders the marked template through transformers' own jinja renderer, which
reports the character ranges of the generation blocks: an "exact" mask that shares no code or method with
eagle_lib.data.chat. Token rule (the project's, from chat.py's docstring): a token is trained iff all its
characters lie inside one generation block.
"""

from __future__ import annotations

import json
import re
from functools import cache

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from eagle_lib.toy import tokenizer as toy_tok

G, EG = "{% generation %}", "{% endgeneration %}"


def strip_markers(template: str) -> str:
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


# tool calls as JSON, the way several families write them (arguments is already a JSON string)
_CALLS_JSON = (
    "{%- for tc in m.tool_calls or [] -%}"
    "{{ '<tool_call>{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + tc.function.arguments + '}</tool_call>' }}"
    "{%- endfor -%}"
)  # fmt: skip
_TOOLS_DECL = "{%- if tools -%}{{ '<|im_start|>system\\n# Tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif -%}"
_LAST_ASST = (
    "{%- set ns = namespace(last=-1, last_user=-1) -%}{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}"
    "{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
)
_CHATML_OTHER = (
    "{%- elif m.role == 'tool' -%}{{ '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}{%- endfor -%}"
)  # fmt: skip


def _chatml(body: str, prelude: str = "", gen: str = "<|im_start|>assistant\\n", header: bool = True) -> str:
    """A ChatML-family template whose assistant branch is ``body`` (after the header)."""
    return (
        _LAST_ASST + prelude + _TOOLS_DECL + "{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
        + ("{{ '<|im_start|>assistant\\n' }}" if header else "") + body + _CHATML_OTHER
        + "{%- if add_generation_prompt -%}{{ '" + gen + "' }}{%- endif -%}"
    )  # fmt: skip


CHATML = _chatml(
    G + "{%- if loop.index0 == ns.last and m.reasoning_content -%}{{ '<think>\\n' + m.reasoning_content + "
    "'\\n</think>\\n\\n' }}{%- endif -%}{{ m.content }}"
    + _CALLS_JSON
    + "{{ '<|im_end|>' }}"
    + EG
    + "{{ '\\n' }}"
)

# Qwen3-style: reasoning only for turns after the last user message; enable_thinking=false puts an empty think
# block into the generation prompt (the model did not write it: outside the generation block)
QWEN3 = _chatml(
    "{%- set after = loop.index0 > ns.last_user -%}"
    "{%- set nothink = enable_thinking is defined and not enable_thinking and not m.reasoning_content -%}"
    "{%- if after and nothink -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}" + G +
    "{%- if after and not nothink -%}{{ '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}"
    "{%- endif -%}{{ m.content }}" + _CALLS_JSON + "{{ '<|im_end|>' }}" + EG + "{{ '\\n' }}",
    gen="<|im_start|>assistant\\n' + ('<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and not "
    "enable_thinking else '') + '",
)  # fmt: skip

LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{%- if tools -%}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nTools: ' + (tools | tojson) + '<|eot_id|>' }}"
    "{%- endif -%}{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\\n\\n' }}"
    "{%- if m.role == 'assistant' -%}" + G + "{{ m.content }}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{{ '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' + tc.function.arguments + '}' }}{%- endfor -%}"
    "{{ '<|eot_id|>' }}" + EG + "{%- else -%}{{ m.content + '<|eot_id|>' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)  # fmt: skip

# Mistral-style: no assistant header at all, the system prompt inside the first [INST]
MISTRAL = (
    "{{ '<s>' }}{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- set ns = namespace(first=true) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- if ns.first and tools -%}{{ '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif -%}"
    "{{ '[INST] ' + (sys + '\\n\\n' if ns.first and sys else '') + m.content + ' [/INST]' }}"
    "{%- set ns.first = false -%}"
    "{%- elif m.role == 'assistant' -%}" + G + "{{ m.content }}"
    "{%- if m.tool_calls -%}{{ '[TOOL_CALLS][' }}{%- for tc in m.tool_calls -%}"
    "{{ '{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + tc.function.arguments + '}' }}"
    "{%- endfor -%}{{ ']' }}{%- endif -%}{{ '</s>' }}" + EG +
    "{%- elif m.role == 'tool' -%}{{ '[TOOL_RESULTS] ' + m.content + ' [/TOOL_RESULTS]' }}"
    "{%- endif -%}{%- endfor -%}"
)  # fmt: skip

DEEPSEEK_V3 = (
    "{{ '<｜begin▁of▁sentence｜>' }}{%- for m in messages if m.role == 'system' -%}{{ m.content }}{%- endfor -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' -%}{{ '<｜Assistant｜>' }}" + G + "{{ m.content }}"
    "{%- if m.tool_calls -%}{{ '<｜tool▁calls▁begin｜>' }}{%- for tc in m.tool_calls -%}"
    "{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tc.function.name + '\\n```json\\n' + tc.function.arguments"
    " + '\\n```<｜tool▁call▁end｜>' }}{%- endfor -%}{{ '<｜tool▁calls▁end｜>' }}{%- endif -%}"
    "{{ '<｜end▁of▁sentence｜>' }}" + EG +
    "{%- elif m.role == 'tool' -%}{{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + m.content + "
    "'<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)  # fmt: skip

# harmony-like: reasoning in an analysis channel (kept after the last user only), the answer in the final
# channel; the final message ends with <|return|>, history turns with <|end|>, tool-call turns with <|call|>
HARMONY = (
    _LAST_ASST + "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{ '<|start|>assistant' }}" + G +
    "{%- if m.reasoning_content and loop.index0 > ns.last_user -%}"
    "{{ '<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|><|start|>assistant' }}{%- endif -%}"
    "{%- if m.content -%}{{ '<|channel|>final<|message|>' + m.content }}{%- endif -%}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{{ '<|channel|>commentary to=functions.' + tc.function.name + '<|message|>' + tc.function.arguments }}"
    "{%- endfor -%}{{ '<|call|>' if m.tool_calls else '<|return|>' if loop.last else '<|end|>' }}" + EG +
    "{%- else -%}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}"
)  # fmt: skip

# Gemma-style: `model` role, <end_of_turn>, the system prompt folded into the first user turn, no tools
GEMMA = (
    "{{ '<bos>' }}{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- for m in messages if m.role != 'system' -%}"
    "{%- if m.role == 'tool' -%}{{ raise_exception('tool messages are not supported') }}{%- endif -%}"
    "{%- if m.role == 'assistant' -%}{{ '<start_of_turn>model\\n' }}" + G +
    "{{ m.content }}{%- if m.tool_calls -%}{{ raise_exception('tool calls are not supported') }}{%- endif -%}"
    "{{ '<end_of_turn>' }}" + EG + "{{ '\\n' }}"
    "{%- else -%}{{ '<start_of_turn>user\\n' + (sys + '\\n\\n' if loop.first and sys else '') + m.content + "
    "'<end_of_turn>\\n' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)  # fmt: skip

# Phi-3-style: the end-of-text token only when no generation prompt follows (refused before)
PHI3 = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{ '<|assistant|>\\n' }}" + G + "{{ m.content }}"
    "{{ '<|end|>' }}" + EG + "{{ '\\n' }}{%- else -%}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- else -%}"
    "{{ '<|endoftext|>' }}{%- endif -%}"
)  # fmt: skip

# LLaVA-style: plain-text role names, the generation prompt "ASSISTANT:" and history "ASSISTANT: text</s>"
LLAVA = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{ 'ASSISTANT:' }}" + G + "{{ ' ' + m.content + "
    "'</s>' }}" + EG + "{%- elif m.role == 'system' -%}{{ m.content + '\\n' }}{%- else -%}"
    "{{ 'USER: ' + m.content + ' ' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)  # fmt: skip

# ---- adversarial

SKIP_EMPTY = _chatml(
    "{%- if m.content or m.tool_calls -%}{{ '<|im_start|>assistant\\n' }}"
    + G
    + "{{ m.content }}"
    + _CALLS_JSON
    + "{{ '<|im_end|>' }}"
    + EG
    + "{{ '\\n' }}{%- endif -%}",
    header=False,
)
# the closing special token only after the final message: history turns end with their text
FINAL_CLOSE = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}" + G +
    "{{ m.content }}" + _CALLS_JSON + "{{ '<|im_end|>' if loop.last else '' }}" + EG + "{{ '\\n' }}"
    + _CHATML_OTHER + "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)  # fmt: skip
# assistant content rendered transformed (upper-cased): a later user message quoting it holds the original
TRANSFORM = _chatml(G + "{{ m.content | upper }}" + _CALLS_JSON + "{{ '<|im_end|>' }}" + EG + "{{ '\\n' }}")
# a system prompt that depends on later messages (their count and the final message)
SYS_LATER = _chatml(
    G + "{{ m.content }}" + _CALLS_JSON + "{{ '<|im_end|>' }}" + EG + "{{ '\\n' }}",
    prelude="{{ '<|im_start|>system\\n' + (messages | length | string) + ' messages; last: ' + "
    "(messages[-1].content or '') + '<|im_end|>\\n' }}",
)
# a header ending in a space that byte-level BPE merges with the first content word (" Hello")
BPE_MERGE = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{ '### Assistant: ' }}" + G + "{{ m.content }}"
    + _CALLS_JSON + "{{ '<|end|>' }}" + EG + "{{ '\\n' }}{%- else -%}{{ '### ' + m.role + ': ' + m.content + "
    "'<|end|>\\n' }}{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{ '### Assistant: ' }}{%- endif -%}"
)  # fmt: skip


def kimi_marked() -> str:
    """The toy world's Kimi-like template with generation markers: its shared trailing <|im_end|> moved into
    each branch (tests check that the marker-free copy renders exactly like the toy template)."""

    def once(t: str, old: str, new: str) -> str:
        assert t.count(old) == 1, old
        return t.replace(old, new)

    t = toy_tok.KIMI_LIKE_TEMPLATE
    t = once(t, "assistant<|im_middle|><think>", "assistant<|im_middle|>" + G + "<think>")
    t = once(
        t,
        "{%- endif -%}<|im_end|>",
        "{%- endif -%}{%- if m['role'] != 'assistant' -%}<|im_end|>{%- endif -%}",
    )
    t = once(t, "{%- elif m['role'] == 'tool' -%}", "<|im_end|>" + EG + "{%- elif m['role'] == 'tool' -%}")
    return t


SPECIALS = {
    "chatml": ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "mistral": ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"],
    "deepseek_v3": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>"],
    "harmony": ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"],
    "gemma": ["<bos>", "<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<|end|>", "<|endoftext|>"],
    "llava": ["</s>"],
    "bpe_merge": ["<|end|>"],
    "kimi": list(toy_tok.SPECIAL_OFFSETS),
}  # fmt: skip

# name -> (marked template, specials family, template kwargs)
MATRIX: dict[str, tuple[str, str, dict]] = {
    "chatml": (CHATML, "chatml", {}),
    "qwen3": (QWEN3, "chatml", {}),
    "qwen3_no_thinking": (QWEN3, "chatml", {"enable_thinking": False}),
    "llama3": (LLAMA3, "llama3", {}),
    "mistral": (MISTRAL, "mistral", {}),
    "deepseek_v3": (DEEPSEEK_V3, "deepseek_v3", {}),
    "harmony": (HARMONY, "harmony", {}),
    "gemma": (GEMMA, "gemma", {}),
    "phi3": (PHI3, "phi3", {}),
    "llava": (LLAVA, "llava", {}),
    "kimi": (kimi_marked(), "kimi", {}),
    "skip_empty": (SKIP_EMPTY, "chatml", {}),
    "final_close": (FINAL_CLOSE, "chatml", {}),
    "transform_quote": (TRANSFORM, "chatml", {}),
    "system_later": (SYS_LATER, "chatml", {}),
    "bpe_merge": (BPE_MERGE, "bpe_merge", {}),
}

CORPUS_ALPHABET = "abcdefghij klmnop qrstuvwxyz ABC XYZ 0123456789 .,;:!?'\"-_(){}[]<>/|\\\n\téü中文🙂"


@cache
def _base_bpe() -> str:
    """One byte-level BPE (as JSON) for all templates; trained on role words and random text."""
    import random

    rng = random.Random(0)
    words = ["assistant", "user", "system", "Assistant", "### Assistant: Hello", "USER: hi ASSISTANT: yes",
             "get_weather", "add", "arguments", "name", "Hello world", "You said", "analysis", "final"]  # fmt: skip
    corpus = words * 20 + ["".join(rng.choice(CORPUS_ALPHABET) for _ in range(200)) for _ in range(60)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok.to_str()


@cache
def tokenizer(name: str) -> PreTrainedTokenizerFast:
    """The fast tokenizer of matrix entry ``name`` (its template without generation markers)."""
    marked, family, _ = MATRIX[name]
    tok = Tokenizer.from_str(_base_bpe())
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS[family]])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=strip_markers(marked))


class SlowTokenizer:
    """A tokenizer without offsets (the kind of Kimi-K2.5's tiktoken one): is_fast False, no backend; encodes
    and decodes with the same vocabulary as the fast one it wraps."""

    is_fast = False

    def __init__(self, fast: PreTrainedTokenizerFast):
        self._fast, self._model = fast, fast.backend_tokenizer
        self.chat_template, self.name_or_path = fast.chat_template, "slow-stand-in"
        self.all_special_tokens, self.added_tokens_decoder = (
            fast.all_special_tokens,
            fast.added_tokens_decoder,
        )

    def apply_chat_template(self, *args, **kwargs):
        return self._fast.apply_chat_template(*args, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._model.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: object) -> str:
        return self._model.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return len(self._fast)


def reference_render(name: str, messages: list[dict], tools: list | None = None) -> tuple[str, list]:
    """(text, generation spans) of the marked template, rendered by transformers' jinja renderer."""
    marked, _, kwargs = MATRIX[name]
    texts, spans = render_jinja_template(
        conversations=[messages], tools=tools or None, chat_template=marked, return_assistant_tokens_mask=True,
        **kwargs,
    )  # fmt: skip
    return texts[0], [(a, b) for a, b in spans[0] if b > a]


def reference_mask(
    name: str, messages: list[dict], tools: list | None = None, only_last: bool = False, tok=None
):
    """(ids, mask, text) by the reference: tokens whose characters all lie inside one generation block."""
    text, spans = reference_render(name, messages, tools)
    if only_last:
        spans = spans[-1:]
    enc = (tok or tokenizer(name)).backend_tokenizer.encode(text, add_special_tokens=False)
    mask = [int(s < e and any(a <= s and e <= b for a, b in spans)) for s, e in enc.offsets]
    return enc.ids, mask, text


def reference_tokens(name: str, text: str, spans: list, tok=None) -> tuple[list[int], list[int]]:
    """(ids, mask) of ``text``: tokens whose characters all lie inside one of ``spans``."""
    enc = (tok or tokenizer(name)).backend_tokenizer.encode(text, add_special_tokens=False)
    return enc.ids, [int(s < e and any(a <= s and e <= b for a, b in spans)) for s, e in enc.offsets]


def reference_each(name: str, messages: list[dict], tools: list | None = None, tok=None) -> list[tuple]:
    """The ``turns: each`` sequences by the reference, as (ids, mask, turns): a turn whose place in the full
    (marked) render is preceded by exactly the prompt the target was given and reads as the final message's
    generation block is trained in the full sequence; any other turn in prompt + its own generation block."""
    tok = tok or tokenizer(name)
    kwargs = MATRIX[name][2]
    full, spans = reference_render(name, messages, tools)
    asst = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(spans) == len(asst), "one generation block per assistant message"
    merged, own = [], []
    for k, i in enumerate(asst):
        prompt = tok.apply_chat_template(messages[:i], tools=tools or None, add_generation_prompt=True,
                                         tokenize=False, **kwargs)  # fmt: skip
        text, own_spans = reference_render(name, messages[: i + 1], tools)
        turn = text[own_spans[-1][0] : own_spans[-1][1]]
        a, b = spans[k]
        if full[:a] == prompt and full[a:b] == turn:
            merged.append(k)
        else:
            own.append(
                (*reference_tokens(name, prompt + turn, [(len(prompt), len(prompt) + len(turn))], tok), [k])
            )
    head = [(*reference_tokens(name, full, [spans[k] for k in merged], tok), merged)] if merged else []
    return head + own


def tool_call(name: str, args: dict, k: int) -> dict:
    return {"id": f"functions.{name}:{k}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}  # fmt: skip


# what a user may paste: every template's special tokens and plain-text role headers
MARKUP = sorted(
    {s for v in SPECIALS.values() for s in v}
    | {"<|im_start|>assistant\n", "ASSISTANT:", "### Assistant: ", "<start_of_turn>model\n", "[/INST]"}
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]
