"""Small GGUF files written by the tests themselves (the `gguf` package's writer), in llama.cpp's layout.

`write_llama(hf_model, tokenizer, path)` turns a (random, tiny) HF Llama and a byte-level BPE tokenizer into a
float32 GGUF as llama.cpp's convert_hf_to_gguf.py lays one out: tensor names ``token_embd``, ``blk.N.attn_q`` ...,
the q and k projections permuted into GGML's rotary layout (rows of each head interleaved by halves), the
tokenizer as ``gpt2`` tokens + merges. A converter that reads it back must give the HF model's own logits: that
is the reference, built from the format's definition, not from the converter under test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF (rotate_half) rows -> GGML rows: per head, interleave the two halves (llama.cpp's `permute`)."""
    out_dim = w.shape[0]
    return w.reshape(n_head, 2, out_dim // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama(model, tokenizer, path: Path, *, architecture: str = "llama", chat_template: str | None = None,
                eos_token: str = "<|im_end|>") -> Path:  # fmt: skip
    """Write `model` (a LlamaForCausalLM) and `tokenizer` (byte-level BPE) as a float32 GGUF at `path`."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny test llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                         else float(cfg.rope_theta))  # fmt: skip
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [
        f"[PAD{i}]" for i in range(cfg.vocab_size - len(tokens))
    ]  # rows the model has beyond the vocab
    special = set(tokenizer.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special or t.startswith("[PAD") else gguf.TokenType.NORMAL
                       for t in tokens])  # fmt: skip
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(vocab[eos_token])
    w.add_eos_token_id(vocab[eos_token])
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], nh))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], nkv))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_llama(seed: int = 0, vocab_size: int = 272, tie: bool = True):
    """A random LlamaForCausalLM small enough to write and convert in a second (head_dim 32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=tie, rms_norm_eps=1e-5)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a dropped norm weight would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model
