"""The mini-Kimi world (``toy://kimi``): a small target shaped like Kimi-K2.5, built and cached like the toy world.

What is Kimi-like, and why (each is a place where the toy world cannot show a defect of the real path):
- the target is a DeepseekV3 language model (MLA attention with Kimi's own ``kv_lora_rank`` 512 and
  ``qk_rope_head_dim`` 64, the only sizes vLLM's CPU MLA backend takes; MoE with a shared expert, sigmoid
  ``noaux_tc`` routing, a dense first layer; no MTP layer) inside Kimi-K2.5's multimodal wrapper: config
  ``model_type: kimi_k25`` with a ``text_config``, weights named ``language_model.model.layers.N...`` and
  ``language_model.lm_head.weight`` in sharded safetensors with an index, the wrapper's classes as remote code
  (``auto_map``). Text-only: ``vision_config`` describes a tower the checkpoint does not hold (serve it with
  ``--limit-mm-per-prompt '{"vision_chunk": 0}'``);
- Kimi's vocabulary: 163,840 ids, the special tokens at Kimi's ids from 163,584 (``[BOS]`` 163584, ``[EOS]``
  163585, ``<|im_end|>`` 163586, ``</think>`` 163607, ``[PAD]`` 163839); tokenizer ``eos_token`` ``[EOS]`` while
  generation_config stops on ``<|im_end|>``, as Kimi's do;
- the tokenizer is a tiktoken-based slow tokenizer loaded as remote code (``tokenization_kimi.py``), with the
  toy's Kimi-like chat template (tool calls in Kimi's markup) made to think as Kimi-K2.5's does
  (``MINI_KIMI_TEMPLATE``): the generation prompt opens the think block, so answers start inside the reasoning,
  and a history keeps no reasoning up to its last answer without tool calls.
Only ``bpe_tokens`` regular ids are reachable (a BPE trained on the toy corpus); the others up to 163,583 are
byte strings no UTF-8 text produces (they hold 0xFF), as the toy pads its vocabulary.

Training (minutes on 2 cores) uses a compact head: the reachable ids, the 256 special slots and one "junk" class
standing for the N unreachable ids, whose logit gets + log N. Expanding the junk row into all N rows of the full
163,840-row lm_head then gives the full model exactly the compact model's distribution (checked at build time),
at 1/40 of the head's training cost. The conversations are the toy world's (same generators and seed).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle_lib.threads import capped
from eagle_lib.toy import datasets, kimi_data, target, world
from eagle_lib.toy.kimi_tokenizer import (
    FIRST_SPECIAL,
    MINI_KIMI_TEMPLATE,
    OFFSETS,
    REMOTE_DIR,
    VOCAB_SIZE,
    load_tokenizer,
    special_names,
    train_ranks,
    write_tokenizer,
)
from eagle_lib.toy.tokenizer import N_SPECIAL_SLOTS

MINI_KIMI_VERSION = 1
RECIPE: dict = {
    "seed": 0,
    "bpe_tokens": 3840,
    "native_swe": 12,  # SWE sessions in data/native_swe.jsonl  # reachable regular ids (the toy tokenizer's 4096 - 256)
    "train_mix": {"chat": 1200, "tool": 1200, "reasoning": 400, "code": 300, "swe": 30},
    "text_config": {
        "hidden_size": 128,
        "intermediate_size": 384,  # the dense first layer
        "moe_intermediate_size": 128,
        "num_hidden_layers": 8,  # default aux layers [1, L//2-1, L-4] = [1, 3, 4]
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 64,
        "kv_lora_rank": 512,  # Kimi's: vLLM's CPU MLA backend takes no other
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,  # Kimi's: idem
        "v_head_dim": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",  # with sigmoid scoring, as Kimi: vLLM routes like transformers only so
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 8192,
        "rope_theta": 50000.0,
        "rms_norm_eps": 1e-5,
    },
    "train": world.RECIPE["train"] | {"steps": 240},  # the toy target's training, fewer steps
    "eval": {
        "prompts_per_domain": {"tool": 16, "chat": 16, "reasoning": 8, "code": 8},
        "batch_size": 8,
        "max_new_tokens": {"tool": 128, "chat": 192, "reasoning": 384, "code": 192},
    },
}
# the unused vision tower the config names (vLLM's Kimi-K2.5 class reads its sizes; the checkpoint has none)
VISION_CONFIG = {"patch_size": 14, "num_attention_heads": 2, "num_hidden_layers": 1, "hidden_size": 32,
                 "intermediate_size": 64, "merge_kernel_size": [2, 2]}  # fmt: skip
# its image preprocessing (vLLM builds the processor even when no image is allowed per prompt)
MEDIA_PROC_CFG = {"patch_size": 14, "merge_kernel_size": [2, 2], "temporal_merge_kernel_size": 4,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "in_patch_limit": 1024,
                  "patch_limit_on_one_side": 64, "fixed_output_tokens": None, "in_patch_limit_each_frame": 1024,
                  "in_patch_limit_video": 4096}  # fmt: skip


# ---------------------------------------------------------------- target


class Compact:
    """The id map between the full vocabulary and the training head: reachable ids, specials, one junk class."""

    def __init__(self, n_reachable: int):
        self.n_reach = n_reachable
        self.junk = n_reachable + N_SPECIAL_SLOTS
        self.size = self.junk + 1
        self.n_junk = FIRST_SPECIAL - n_reachable
        self.log_n_junk = math.log(self.n_junk)

    def to_compact(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(ids, self.junk)
        out[ids < self.n_reach] = ids[ids < self.n_reach]
        spec = ids >= FIRST_SPECIAL
        out[spec] = ids[spec] - FIRST_SPECIAL + self.n_reach
        return torch.where(ids < 0, ids, out)  # -100 labels stay

    def full_rows(self) -> torch.Tensor:
        """For each full id, the compact row that it takes (index into the compact table)."""
        return self.to_compact(torch.arange(VOCAB_SIZE))

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """The compact logits with the junk class standing for its N ids."""
        bonus = torch.zeros(self.size, dtype=logits.dtype)
        bonus[self.junk] = self.log_n_junk
        return logits + bonus


def text_config(shape: dict, vocab_size: int):
    from transformers import DeepseekV3Config

    full = vocab_size == VOCAB_SIZE  # the compact training head has no room for Kimi's ids
    return DeepseekV3Config(
        vocab_size=vocab_size,
        bos_token_id=FIRST_SPECIAL if full else None,
        eos_token_id=FIRST_SPECIAL + 1 if full else None,
        pad_token_id=VOCAB_SIZE - 1 if full else None,
        tie_word_embeddings=False,
        rope_scaling=None,
        **shape,
    )


def compact_loss(cmp: Compact) -> Callable:
    """The next-token loss on the junk-adjusted compact logits (for `target.train`)."""

    def loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = cmp.adjusted(model(input_ids=ids).logits)  # (B, T, Vc)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    return loss


@torch.no_grad()
def expand(compact_model, cmp: Compact, shape: dict):
    """The full-vocabulary DeepseekV3 model with the compact model's weights (junk row -> every unreachable id)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    full = DeepseekV3ForCausalLM(text_config(shape, VOCAB_SIZE)).eval()
    state = compact_model.state_dict()
    rows = cmp.full_rows()
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][rows].clone()
    state["lm_head.weight"] = state["lm_head.weight"][rows].clone()
    full.load_state_dict(state)
    return full


@torch.no_grad()
def check_expansion(compact_model, full, cmp: Compact, ids: torch.Tensor) -> float:
    """Max |log p_full - log p_compact| over the full vocabulary on one block (the build asserts ~0)."""
    lp_c = torch.log_softmax(cmp.adjusted(compact_model(input_ids=cmp.to_compact(ids)).logits.double()), -1)
    lp_f = torch.log_softmax(full(input_ids=ids).logits.double(), -1)  # float64: 163,840-way sums
    want = lp_c[..., cmp.full_rows()] - torch.where(cmp.full_rows() == cmp.junk, cmp.log_n_junk, 0.0)
    return float((lp_f - want).abs().max())


@torch.no_grad()
def evaluate(full, tok, convs_by_domain: dict[str, list[dict]], cfg: dict, stop: int, n_reach: int,
             log: Callable) -> dict:  # fmt: skip
    """Greedy answers to held-out prompts: share that stop with <|im_end|>, lengths, and how many contain an
    unreachable id (must be 0)."""
    res: dict = {"im_end_rate_by_domain": {}, "response_len_by_domain": {}}
    ends = n_all = junk = 0
    for domain, convs in convs_by_domain.items():
        prompts = [tok.apply_chat_template(target.eval_prompt(c)[0], tools=c["tools"] or None,
                                           add_generation_prompt=True, return_dict=False) for c in convs]  # fmt: skip
        outs = []
        for i in range(0, len(prompts), cfg["batch_size"]):
            chunk = prompts[i : i + cfg["batch_size"]]
            width = max(map(len, chunk))
            x = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])
            att = (x != tok.pad_token_id).long()
            gen = full.generate(input_ids=x, attention_mask=att, max_new_tokens=cfg["max_new_tokens"][domain],
                                do_sample=False, eos_token_id=stop, pad_token_id=tok.pad_token_id)  # fmt: skip
            for row in gen[:, width:].tolist():
                outs.append(row[: row.index(stop) + 1] if stop in row else row)
        ended = [bool(o) and o[-1] == stop for o in outs]
        junk += sum(any(n_reach <= t < FIRST_SPECIAL for t in o) for o in outs)
        res["im_end_rate_by_domain"][domain] = round(sum(ended) / len(ended), 4)
        lens = [len(o) for o in outs]
        res["response_len_by_domain"][domain] = {"mean": round(statistics.mean(lens), 1), "max": max(lens)}
        ends, n_all = ends + sum(ended), n_all + len(ended)
        log(
            f"  eval {domain:9s} im_end {sum(ended)}/{len(ended)}  len {res['response_len_by_domain'][domain]}"
        )
    res["im_end_rate"] = round(ends / max(1, n_all), 4)
    res["answers_with_unreachable_ids"] = junk
    return res


def save_target(out: Path, full, shape: dict, max_new: int) -> None:
    """The wrapper checkpoint: config with auto_map, sharded safetensors with an index, generation_config."""
    from transformers import GenerationConfig

    from eagle_lib.toy.kimi_remote.configuration_kimi_k25 import KimiK25Config
    from eagle_lib.toy.kimi_remote.modeling_kimi_k25 import KimiK25ForConditionalGeneration

    tc = text_config(shape, VOCAB_SIZE).to_dict()
    tc["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg = KimiK25Config(text_config=tc, vision_config=VISION_CONFIG, architectures=["KimiK25ForConditionalGeneration"],
                        bos_token_id=FIRST_SPECIAL, eos_token_id=FIRST_SPECIAL + 1, pad_token_id=VOCAB_SIZE - 1,
                        tie_word_embeddings=False, image_token_id=163605)  # fmt: skip
    KimiK25Config.register_for_auto_class()
    KimiK25ForConditionalGeneration.register_for_auto_class("AutoModelForCausalLM")
    torch.manual_seed(0)
    wrapper = KimiK25ForConditionalGeneration(cfg)
    wrapper.language_model.load_state_dict(full.state_dict())
    wrapper.generation_config = GenerationConfig(
        bos_token_id=FIRST_SPECIAL, eos_token_id=FIRST_SPECIAL + OFFSETS["<|im_end|>"],
        pad_token_id=VOCAB_SIZE - 1, max_new_tokens=max_new, do_sample=False)  # fmt: skip
    wrapper.save_pretrained(str(out), max_shard_size="100MB")
    (out / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n"
    )


# ---------------------------------------------------------------- the world


def kimi_key(recipe: dict | None = None) -> str:
    """Hash of everything the world depends on: the recipe, the version, the toy data it trains on, the
    remote-code files and the chat template it ships."""
    toy = {k: world.RECIPE[k] for k in ("seed", "dataset_sizes", "malformed_per_dataset")}
    code = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(REMOTE_DIR.glob("*.py"))}
    template = hashlib.sha256(MINI_KIMI_TEMPLATE.encode()).hexdigest()
    blob = json.dumps({"version": MINI_KIMI_VERSION, "recipe": recipe or RECIPE, "toy": toy, "code": code,
                       "chat_template": template}, sort_keys=True)  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def world_dir(recipe: dict | None = None) -> Path:
    return world.cache_root() / f"kimi-{kimi_key(recipe)}"


def build(recipe: dict | None = None, force: bool = False, log: Callable = print) -> Path:
    """Build (or return the cached) mini-Kimi world dir: target/ (checkpoint, remote code, tokenizer),
    build_log.json (+ .txt), recipe.json."""
    recipe = recipe or RECIPE

    def write(tmp: Path) -> None:
        blog = build_into(tmp, recipe, log) | {"key": kimi_key(recipe)}
        (tmp / "recipe.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
        (tmp / "build_log.txt").write_text(summary(blog) + "\n")
        (tmp / "build_log.json").write_text(json.dumps(blog, indent=2) + "\n")  # last: marks it complete

    return world.build_cached(world_dir(recipe), write, force, log)


def build_into(out: Path, recipe: dict, log: Callable) -> dict:
    """Write the mini-Kimi world into ``out`` (``target/``: checkpoint + tokenizer); returns its build log."""
    t0, seed = time.time(), recipe["seed"]
    toy = world.RECIPE
    blog: dict = {"mini_kimi_version": MINI_KIMI_VERSION, "timings": {}}
    scratch = out / ".data"
    _, valid = datasets.write_all(scratch, seed, toy["dataset_sizes"], toy["malformed_per_dataset"])
    shutil.rmtree(scratch)
    blog["hub_repos"] = kimi_data.write_hub_repos(out / "hub", valid)
    blog["native_swe"] = kimi_data.write_native_swe(
        out / "data" / "native_swe.jsonl", seed, recipe["native_swe"]
    )
    train_convs = datasets.native_conversations(seed, recipe["train_mix"], "train")
    corpus = [s for recs in valid.values() for r in recs for s in datasets.string_leaves(r)]
    corpus += [s for c in train_convs for s in datasets.string_leaves(c)]
    ranks = train_ranks(corpus, recipe["bpe_tokens"])
    tdir = out / "target"
    write_tokenizer(tdir, ranks, recipe["text_config"]["max_position_embeddings"])
    tok = load_tokenizer(tdir)
    if len(tok) != VOCAB_SIZE or tok.convert_tokens_to_ids("</think>") != FIRST_SPECIAL + 23:
        raise RuntimeError(
            f"mini-Kimi tokenizer: {len(tok)} ids, </think> {tok.convert_tokens_to_ids('</think>')}"
        )
    blog["tokenizer"] = {"vocab_size": len(tok), "reachable_regular_ids": len(ranks),
                         "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                         "pad_token_id": tok.pad_token_id, "special_ids": {k: v for k, v in special_names().items()
                                                                           if not k.startswith("<|reserved")}}  # fmt: skip
    blog["timings"]["tokenizer_s"] = round(time.time() - t0, 1)

    tr, threads = recipe["train"], torch.get_num_threads()
    torch.set_num_threads(capped(tr["threads"]))
    try:
        from transformers import DeepseekV3ForCausalLM

        cmp = Compact(len(ranks))
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(text_config(recipe["text_config"], cmp.size))
        cut = target.cut_at_random_turn(train_convs, seed)
        ids, labels = target.pack(tok, cut, tr["block_size"])
        blog["timings"]["pack_s"] = round(time.time() - t0 - blog["timings"]["tokenizer_s"], 1)
        log(f"training mini-Kimi target: {ids.numel()} tokens in {len(ids)} blocks, {tr['steps']} steps")
        blocks = (cmp.to_compact(ids), cmp.to_compact(labels))
        blog |= target.train(model, blocks, tr, seed, log, loss_fn=compact_loss(cmp))
        full = expand(model, cmp, recipe["text_config"])
        blog["expansion_max_abs_logprob_diff"] = check_expansion(model, full, cmp, ids[:1, :128])
        if blog["expansion_max_abs_logprob_diff"] > 1e-3:
            raise RuntimeError(
                f"mini-Kimi expansion changed the distribution: {blog['expansion_max_abs_logprob_diff']}"
            )
        evals, _ = world.eval_conversations(valid, train_convs, recipe["eval"]["prompts_per_domain"])
        stop = FIRST_SPECIAL + OFFSETS["<|im_end|>"]
        t_eval = time.time()
        blog |= evaluate(full, tok, evals, recipe["eval"], stop, len(ranks), log)
        blog["eval_seconds"] = round(time.time() - t_eval, 1)
        save_target(tdir, full, recipe["text_config"], max(recipe["eval"]["max_new_tokens"].values()))
    finally:
        torch.set_num_threads(threads)
    blog["model"] = recipe["text_config"] | {"n_params": sum(p.numel() for p in full.parameters()),
                                             "architecture": "KimiK25ForConditionalGeneration(DeepseekV3)"}  # fmt: skip
    blog["train_tokens_available"] = ids.numel()
    blog["timings"]["total_s"] = round(time.time() - t0, 1)
    return blog


def summary(blog: dict) -> str:
    return (
        f"mini-Kimi world {blog.get('key', '')} (version {blog['mini_kimi_version']}), timings {blog['timings']}\n"
        f"  tokenizer: {blog['tokenizer']['vocab_size']} ids ({blog['tokenizer']['reachable_regular_ids']} "
        f"reachable regular), eos {blog['tokenizer']['eos_token_id']}\n"
        f"  target: {blog['model']['n_params'] / 1e6:.1f}M params, trained {blog['train_seconds']}s, final loss "
        f"{blog['final_loss']}, expansion diff {blog['expansion_max_abs_logprob_diff']:.2e}\n"
        f"  im_end rate {blog['im_end_rate']} by domain {blog['im_end_rate_by_domain']}"
    )
