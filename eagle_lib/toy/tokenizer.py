"""Toy tokenizer: byte-level BPE trained locally, with Kimi-K2.5's special-token layout and chat template.

Layout (mirrors Kimi-K2.5, whose vocab is 163840 with 256 special slots from 163584 = V - 256):
ids 0 .. V-257 are regular BPE tokens; ids V-256 .. V-1 are special tokens at Kimi's offsets
(``SPECIAL_OFFSETS``), every other slot is ``<|reserved_token_N|>`` with N = offset.

Chat template decisions (documented here because the loss-mask code depends on them):
- no default system prompt is inserted: a conversation renders exactly the messages it has;
- only the LAST assistant message keeps its ``reasoning_content``; every other assistant message renders an
  empty ``<think></think>`` (as Kimi-K2.5 does for history turns);
- a tool call renders with the id ``functions.NAME:IDX``, IDX counting tool calls over the whole conversation
  from 0 (Kimi's convention); a tool result renders ``## Return of <tool_call_id>`` with the id it carries;
- ``add_generation_prompt`` appends ``<|im_assistant|>assistant<|im_middle|>``; the model then writes ``<think>``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

N_SPECIAL_SLOTS = 256

# Kimi-K2.5 special tokens: offset from the first special id (163584 in Kimi).
SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<think>": 22,
    "</think>": 23,
}
PAD_OFFSET = N_SPECIAL_SLOTS - 1  # Kimi's [PAD] is the last id, V - 1
BOS_TOKEN = "[BOS]"
EOS_TOKEN = "<|im_end|>"  # Kimi's generation config stops on <|im_end|>, not [EOS]

KIMI_LIKE_TEMPLATE = (
    "{%- macro render_content(msg) -%}"
    "{%- set c = msg.get('content') -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is not none -%}"
    "{%- for part in c -%}{%- if part is string -%}{{ part }}{%- else -%}{{ part.get('text', '') }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(last_asst=-1, call_idx=0) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{%- set ns.last_asst = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ render_content(m) }}"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|><think>"
    "{%- if loop.index0 == ns.last_asst and m.get('reasoning_content') -%}{{ m['reasoning_content'] }}"
    "{%- endif -%}</think>{{ render_content(m) }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for tc in m['tool_calls'] -%}"
    "{%- set fn = tc['function'] if tc.get('function') else tc -%}"
    "<|tool_call_begin|>functions.{{ fn['name'] }}:{{ ns.call_idx }}<|tool_call_argument_begin|>"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}"
    "{%- endif -%}<|tool_call_end|>"
    "{%- set ns.call_idx = ns.call_idx + 1 -%}"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.get('tool_call_id', '') }}\n"
    "{{ render_content(m) }}"
    "{%- else -%}<|im_system|>{{ m['role'] }}<|im_middle|>{{ render_content(m) }}"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def special_tokens(vocab_size: int) -> dict[str, int]:
    """Map every special-slot token string to its id for a vocab of ``vocab_size`` (all 256 slots)."""
    first = vocab_size - N_SPECIAL_SLOTS
    by_offset = {off: name for name, off in SPECIAL_OFFSETS.items()}
    names = [by_offset.get(off, f"<|reserved_token_{off}|>") for off in range(N_SPECIAL_SLOTS)]
    return {name: first + off for off, name in enumerate(names)}


def _train_bpe(corpus_texts: list[str], n_regular: int) -> Tokenizer:
    """Train a byte-level BPE with at most ``n_regular`` tokens (no specials yet)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_regular,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(corpus_texts, trainer=trainer)
    return tok


def _pad_regular_vocab(tok: Tokenizer, n_regular: int) -> Tokenizer:
    """Fill the regular range up to ``n_regular`` ids with unreachable entries (no merge produces them).

    A small corpus can run out of merges before the target size; padding keeps the specials at V - 256.
    """
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    i = 0
    while len(vocab) < n_regular:
        vocab.setdefault(f"<|unused_bpe_{i}|>", len(vocab))
        i += 1
    return Tokenizer.from_str(json.dumps(data))


def build_tokenizer(
    out_dir: str | Path, corpus_texts: list[str], vocab_size: int = 4096
) -> PreTrainedTokenizerFast:
    """Train the toy tokenizer on ``corpus_texts`` and save it as an HF fast tokenizer in ``out_dir``.

    The result has exactly ``vocab_size`` ids, Kimi-K2.5's special layout and ``KIMI_LIKE_TEMPLATE``;
    ``AutoTokenizer.from_pretrained(out_dir)`` loads it without remote code. Deterministic for a given corpus.
    """
    if vocab_size <= N_SPECIAL_SLOTS + 256:
        raise ValueError(f"vocab_size must exceed {N_SPECIAL_SLOTS + 256} (256 bytes + 256 special slots)")
    n_regular = vocab_size - N_SPECIAL_SLOTS
    tok = _pad_regular_vocab(_train_bpe(corpus_texts, n_regular), n_regular)
    specials = special_tokens(vocab_size)
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    for name, idx in specials.items():  # the layout is the contract: fail loudly if tokenizers shifted it
        if tok.token_to_id(name) != idx:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {idx}")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=f"<|reserved_token_{PAD_OFFSET}|>",
        model_max_length=8192,
        chat_template=KIMI_LIKE_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    save_tokenizer(hf, out_dir)
    return hf


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """save_pretrained, then name the class ``PreTrainedTokenizerFast`` in tokenizer_config.json.

    transformers 5 writes its internal ``TokenizersBackend``, which transformers 4.x (still used by some
    serving stacks) cannot resolve; both versions load ``PreTrainedTokenizerFast`` from tokenizer.json.
    """
    tok.save_pretrained(str(out_dir))
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
