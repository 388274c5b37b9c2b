"""Toy target: a small LlamaForCausalLM trained on native-style conversations rendered with the chat template.

Training decisions:
- each conversation is cut after a random thinking assistant turn (``cut_at_random_turn``), so tool calls and
  middle turns also appear as the final turn, the one that keeps its reasoning;
- loss on ALL tokens of packed blocks (prompts are learnable in this grammar and the extra signal helps a
  few-minute model), except the ``</think>`` of history turns' empty ``<think></think>`` (see ``pack``);
  conversations are concatenated and cut into fixed blocks, so a block may start mid-conversation.
The model only has to behave like a chat model: answer in its own style, in the right structure, and stop with
<|im_end|>. ``evaluate`` measures that on held-out prompts from the native A files (greedy generation) and the
teacher-forced next-token accuracy on assistant tokens.
"""

from __future__ import annotations

import math
import random
import re
import statistics
import time
from collections.abc import Callable

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eagle_lib.toy.tokenizer import save_tokenizer

ASSISTANT_OPEN = "<|im_assistant|>assistant<|im_middle|>"
ASSISTANT_SPAN = re.compile(re.escape(ASSISTANT_OPEN) + r".*?<\|im_end\|>", re.S)


def render(
    tok: PreTrainedTokenizerFast, messages: list[dict], tools: list | None, gen_prompt: bool = False
) -> str:
    """Render a conversation with the tokenizer's chat template (text, not ids)."""
    return tok.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=gen_prompt
    )


def make_model(shape: dict, tok: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama with ``shape`` (hidden_size, layers, heads, ...) and the tokenizer's vocab."""
    cfg = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,  # like Kimi: the drafter shares the embedding, not the lm_head
        **shape,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def cut_at_random_turn(convs: list[dict], seed: int) -> list[dict]:
    """Cut each conversation after a random assistant turn that carries reasoning (its last one, if none do).

    The template keeps reasoning only on the LAST assistant turn, so a tool call, say, would otherwise only
    ever be seen as history (``<think></think>`` + call); cutting makes every kind of turn appear as the final,
    thinking turn, which is the turn the model writes at generation time.
    """
    rng = random.Random(f"{seed}:cut")
    out = []
    for c in convs:
        asst = [i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"]
        thinking = [i for i in asst if c["messages"][i].get("reasoning_content")] or asst[-1:]
        end = thinking[rng.randrange(len(thinking))] + 1
        out.append(c | {"messages": c["messages"][:end]})
    return out


def pack(tok: PreTrainedTokenizerFast, convs: list[dict], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Render, tokenize and concatenate ``convs``, cut into blocks: (input_ids, labels), each (n_blocks, block).

    Labels equal the ids except at the ``</think>`` of an empty ``<think></think>`` (-100): history turns
    render without reasoning, and learning "close the think at once" there would teach the model never to
    think in the turn it is asked to write.
    """
    think, end_think = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    ids: list[int] = []
    for c in convs:
        ids += tok(render(tok, c["messages"], c["tools"]), add_special_tokens=False)["input_ids"]
    n = len(ids) // block
    x = torch.tensor(ids[: n * block], dtype=torch.long)  # (n * block,)
    labels = x.clone()
    labels[1:][(x[:-1] == think) & (x[1:] == end_think)] = -100
    return x.view(n, block), labels.view(n, block)


def _lr(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(
    model,
    blocks: tuple[torch.Tensor, torch.Tensor],
    cfg: dict,
    seed: int,
    log: Callable = print,
    loss_fn: Callable | None = None,
) -> dict:
    """Train ``cfg['steps']`` AdamW steps on random batches of ``blocks`` = (ids, labels), each (n, T); the loss is
    the model's own (``labels=``) unless ``loss_fn(model, ids, labels)`` is given (the mini-Kimi compact head).

    Returns the training time and loss statistics.
    """
    ids, labels = blocks
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"], betas=(0.9, 0.95)
    )
    model.train()
    losses, t0 = [], time.time()
    for step in range(cfg["steps"]):
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg["steps"], cfg["lr"], cfg["warmup_steps"])
        pick = torch.randint(len(ids), (cfg["batch_size"],), generator=gen)
        if loss_fn is None:
            loss = model(input_ids=ids[pick], labels=labels[pick]).loss  # ids[pick]: (B, T)
        else:
            loss = loss_fn(model, ids[pick], labels[pick])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 25 == 0 or step == cfg["steps"] - 1:
            log(f"  step {step:4d}  loss {loss.item():.3f}  {time.time() - t0:6.1f}s")
    model.eval()
    tail = losses[-10:] or [float("nan")]
    return {
        "train_seconds": round(time.time() - t0, 1),
        "final_loss": round(sum(tail) / len(tail), 4),
        "first_loss": round(losses[0], 4) if losses else None,
    }


def eval_prompt(conv: dict) -> tuple[list[dict], dict]:
    """Split a conversation into (prompt messages, reference assistant message).

    Tool conversations are cut before their first tool call (the model must emit the call and stop);
    others before their last assistant message (multi-turn context, then the final answer).
    """
    msgs = conv["messages"]
    asst = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    calls = [i for i in asst if msgs[i].get("tool_calls")]
    cut = calls[0] if conv["domain"] == "tool" and calls else asst[-1]
    # history as a client sends it back: without reasoning_content (the template would keep it on the last one)
    prompt = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs[:cut]]
    return prompt, msgs[cut]


@torch.no_grad()
def _generate(model, tok, prompts: list[str], max_new: int, batch_size: int) -> list[list[int]]:
    """Greedy continuations (token ids, stopped after <|im_end|> or at ``max_new``) of each prompt."""
    side, tok.padding_side = tok.padding_side, "left"  # left padding: every row continues at the end
    outs = []
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(
            **enc,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
            outs.append(row[:cut])
    tok.padding_side = side
    return outs


@torch.no_grad()
def assistant_accuracy(model, tok, convs: list[dict]) -> tuple[int, int]:
    """(correct, total) greedy next-token predictions on assistant tokens (incl. <|im_end|>), teacher forced."""
    correct = total = 0
    for c in convs:
        text = render(tok, c["messages"], c["tools"])
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
        ids, offs = enc["input_ids"], enc["offset_mapping"]
        spans = [(m.start() + len(ASSISTANT_OPEN), m.end()) for m in ASSISTANT_SPAN.finditer(text)]
        # label position j (token j) is predicted from logits at j-1
        is_asst = [any(a <= s < b for a, b in spans) for s, _ in offs]
        logits = model(input_ids=torch.tensor([ids[:4096]])).logits[0]  # (T, V)
        pred = logits.argmax(-1).tolist()
        for j in range(1, min(len(ids), 4096)):
            if is_asst[j]:
                total += 1
                correct += int(pred[j - 1] == ids[j])
    return correct, total


def evaluate(model, tok, convs_by_domain: dict[str, list[dict]], cfg: dict, log: Callable = print) -> dict:
    """im_end rate, response lengths (greedy) and assistant next-token accuracy per domain, plus overall."""
    res: dict = {
        "im_end_rate_by_domain": {},
        "response_len_by_domain": {},
        "next_token_acc_by_domain": {},
        "eval_prompts_by_domain": {},
        "reference_len_by_domain": {},
    }
    ends = correct = total = n_all = 0
    for domain, convs in convs_by_domain.items():
        if not convs:
            log(f"  eval {domain}: no held-out prompts, skipped")
            continue
        pairs = [eval_prompt(c) for c in convs]
        prompts = [
            render(tok, p, c["tools"], gen_prompt=True) for (p, _), c in zip(pairs, convs, strict=True)
        ]
        outs = _generate(model, tok, prompts, cfg["max_new_tokens"][domain], cfg["batch_size"])
        ended = [bool(o) and o[-1] == tok.eos_token_id for o in outs]
        lens = [len(o) for o in outs]
        refs = [
            len(tok(render(tok, p + [a], c["tools"])[len(q) :], add_special_tokens=False)["input_ids"])
            for (p, a), c, q in zip(pairs, convs, prompts, strict=True)
        ]
        c_ok, c_tot = assistant_accuracy(model, tok, convs)
        res["im_end_rate_by_domain"][domain] = round(sum(ended) / len(ended), 4)
        res["response_len_by_domain"][domain] = _len_stats(lens)
        res["reference_len_by_domain"][domain] = _len_stats(refs)
        res["next_token_acc_by_domain"][domain] = round(c_ok / max(1, c_tot), 4)
        res["eval_prompts_by_domain"][domain] = len(convs)
        ends, correct, total, n_all = ends + sum(ended), correct + c_ok, total + c_tot, n_all + len(ended)
        log(
            f"  eval {domain:9s} im_end {sum(ended)}/{len(ended)}  len {res['response_len_by_domain'][domain]}"
            f"  acc {res['next_token_acc_by_domain'][domain]}"
        )
    res["im_end_rate"] = round(ends / max(1, n_all), 4)
    res["next_token_acc"] = round(correct / max(1, total), 4)
    return res


def _len_stats(xs: list[int]) -> dict:
    return {
        "mean": round(statistics.mean(xs), 1),
        "median": statistics.median(xs),
        "max": max(xs),
        "n": len(xs),
    }


def save(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out_dir, max_new_tokens: int = 1024) -> None:
    """save_pretrained model (safetensors) + tokenizer + generation_config (stops on <|im_end|>)."""
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    save_tokenizer(tok, out_dir)
