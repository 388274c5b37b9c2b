"""The mini-Kimi world's tokenizer (`eagle_lib.toy.mini_kimi` builds the world): Kimi-K2.5's vocabulary layout
(163,840 ids, the special tokens at Kimi's ids from 163,584), a byte-level BPE trained on the toy corpus for the
reachable regular ids, written as the tiktoken-based remote-code tokenizer Kimi ships (``kimi_remote/``), and the
toy's Kimi-like chat template made to think as Kimi-K2.5's does (``MINI_KIMI_TEMPLATE``).
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

from eagle_lib.toy.tokenizer import KIMI_LIKE_TEMPLATE, N_SPECIAL_SLOTS, SPECIAL_OFFSETS

# The chat template: the toy's Kimi-like one with Kimi-K2.5's two rules about thinking, as its
# chat_template.jinja has them (the toy's model writes <think> itself; the toy keeps the reasoning of the last
# assistant message, whatever follows it):
# - the generation prompt opens the think block (<think>; <think></think> with thinking: false): answers start
#   inside the reasoning;
# - an assistant message keeps its reasoning only after the last assistant message without tool calls (in the
#   current tool-use chain), none with thinking: false: a prompt whose last answer is followed by a user turn
#   shows no reasoning. Kimi's drops a final answer's own reasoning too; here the final message keeps it (the
#   target is trained on renders that end with the answer it writes, as the toy's).
_TEMPLATE_EDITS = [
    (
        "{%- set ns = namespace(last_asst=-1, call_idx=0) -%}"
        "{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}{%- set ns.last_asst = loop.index0 -%}"
        "{%- endif -%}{%- endfor -%}",
        "{%- set ns = namespace(last_answer=-1, call_idx=0) -%}{%- for m in messages -%}"
        "{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}{%- set ns.last_answer = loop.index0 -%}"
        "{%- endif -%}{%- endfor -%}",
    ),
    (
        "{%- if loop.index0 == ns.last_asst and m.get('reasoning_content') -%}",
        "{%- if (loop.index0 > ns.last_answer or loop.last) and m.get('reasoning_content')"
        " and not (thinking is defined and thinking is false) -%}",
    ),
    (
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}",
        "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
        "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
        "{%- endif -%}",
    ),
]


def kimi_template(toy_template: str = KIMI_LIKE_TEMPLATE) -> str:
    """The mini-Kimi chat template: the toy's with Kimi-K2.5's thinking rules (``_TEMPLATE_EDITS``)."""
    for old, new in _TEMPLATE_EDITS:
        if toy_template.count(old) != 1:
            raise RuntimeError(f"the toy's Kimi-like template no longer holds {old!r} once")
        toy_template = toy_template.replace(old, new)
    return toy_template


MINI_KIMI_TEMPLATE = kimi_template()
REMOTE_DIR = Path(__file__).parent / "kimi_remote"
VOCAB_SIZE = 163840
FIRST_SPECIAL = VOCAB_SIZE - N_SPECIAL_SLOTS  # 163584, as Kimi-K2.5
# Kimi-K2.5's media tokens (vLLM's Kimi-K2.5 class resolves <|media_pad|> through the tokenizer) and [PAD]
OFFSETS = SPECIAL_OFFSETS | {"<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20,
                             "<|media_pad|>": 21, "[PAD]": N_SPECIAL_SLOTS - 1}  # fmt: skip


def special_names() -> dict[str, int]:
    """Every special-slot token -> its id (Kimi's named ones, ``<|reserved_token_N|>`` elsewhere)."""
    by_off = {off: name for name, off in OFFSETS.items()}
    return {by_off.get(o, f"<|reserved_token_{o}|>"): FIRST_SPECIAL + o for o in range(N_SPECIAL_SLOTS)}


# ---------------------------------------------------------------- tokenizer


def train_ranks(corpus: list[str], n_tokens: int) -> list[bytes]:
    """A byte-level BPE of ``n_tokens`` tokens trained on ``corpus`` (split like the tokenizer's PAT_STR),
    as token bytes in rank order: the 256 bytes first, then merges in the order they were learned."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from eagle_lib.toy.kimi_remote.tokenization_kimi import PAT_STR, byte_to_char

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=n_tokens,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    c2b = {c: b for b, c in byte_to_char().items()}
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    singles = [bytes([b]) for b in range(256)]
    merged = [bytes(c2b[c] for c in s) for s, _ in vocab if len(s) > 1]
    return singles + [m for m in merged if len(m) > 1]


def write_tokenizer(out: Path, ranks: list[bytes], max_len: int) -> None:
    """tiktoken.model (padded to 163,584 regular ids), tokenization_kimi.py, tokenizer_config.json."""
    n_regular = FIRST_SPECIAL
    if len(ranks) > n_regular:
        raise ValueError(f"{len(ranks)} BPE tokens do not fit below the first special id {FIRST_SPECIAL}")
    lines = [base64.b64encode(t) + b" " + str(i).encode() for i, t in enumerate(ranks)]
    for i in range(len(ranks), n_regular):  # unreachable: 0xFF never occurs in UTF-8 text
        lines.append(base64.b64encode(b"\xff\xff" + i.to_bytes(3, "big")) + b" " + str(i).encode())
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    shutil.copy(REMOTE_DIR / "tokenization_kimi.py", out / "tokenization_kimi.py")
    added = {
        str(i): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }  # fmt: skip
        for name, i in special_names().items()
    }
    cfg = {
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",  # as Kimi's tokenizer_config; generation stops on <|im_end|> (generation_config)
        "pad_token": "[PAD]",
        "chat_template": MINI_KIMI_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=True)
