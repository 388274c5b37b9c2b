"""A tiny target world for engine/infer tests: a byte-level tokenizer and a random Llama, saved like a real model.

Independent of the toy world (eagle_lib.toy), so engine tests run before and without it. head_dim is 32
because vLLM's CPU backend rejects smaller heads.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "[PAD]"]
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{{ m['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def build_tokenizer(out_dir: Path, specials: list[str] | None = None):
    """Byte-level BPE without merges (every byte is a token) plus Kimi-like special tokens; returns the HF tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials or SPECIALS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="[PAD]", chat_template=TEMPLATE
    )
    hf.save_pretrained(out_dir)
    return hf


def build_world(out_dir: str | Path, seed: int = 0, layers: int = 2, vocab_pad: int = 8) -> Path:
    """Write tokenizer + random LlamaForCausalLM (fp32 safetensors) into one dir; returns it. Idempotent."""
    from transformers import GenerationConfig

    from tests.support import models

    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    n = len(tok)
    vocab_size = (
        (n + vocab_pad - 1) // vocab_pad * vocab_pad
    )  # model vocab padded past the tokenizer's, like Kimi
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # larger logits than the default init: fewer near-ties, sharper greedy paths
    model = models.llama(seed, lm_head_scale=8.0, vocab_size=vocab_size, num_hidden_layers=layers,
                         eos_token_id=eos, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)  # fmt: skip
    model.generation_config = GenerationConfig(eos_token_id=[eos], pad_token_id=tok.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tiny_world.json").write_text(json.dumps({"seed": seed, "layers": layers, "eos": eos}))
    return out


def make_prompts(tokenizer, n: int, seed: int = 0, min_words: int = 1, max_words: int = 40) -> list[dict]:
    """Stage-02-shaped prompt records {id, source, messages, prompt_ids, n_prompt_tokens} of varied length."""
    import random

    rng = random.Random(seed)
    words = "the a cat dog runs fast slow blue green why how what code test tool call think answer".split()
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words)))
        messages = [{"role": "user", "content": f"{i}: {text}"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        out.append(
            {
                "id": f"s{i:05d}",
                "source": "tiny",
                "messages": messages,
                "prompt_ids": ids,
                "n_prompt_tokens": len(ids),
            }
        )
    return out
