"""Measured acceptance during training: greedy speculative decoding of a few held-out prompts.

Every ``measure_every`` optimizer steps stage 05 decodes the same few held-out prompts with the current drafter
weights, exactly as stage 06 does (`eagle_lib.decoding.specdec`: the target verifies every draft, the output is
the target's own greedy output), and logs the acceptance length ``tau`` beside the loss. Unlike the
teacher-forced TTT accuracies, this is what the drafter achieves when it feeds its own drafts and hidden states
back, so it predicts 06 and can choose the final checkpoint (``final_checkpoint: best_measured``).

Cost is bounded by ``prompts x max_new_tokens`` target verify forwards (at most, fewer when drafts are
accepted) and ``k`` drafter passes per verify. The prompts are the held-out sequences' prefixes before their
first label token (an A record's first assistant turn, a B record's prompt), spread evenly over the held-out
list (which is in file order, so over datasets), each cut to its last ``max_prompt_tokens`` tokens.
"""

from __future__ import annotations

import time

import torch

from eagle_lib import distributed, forked, models
from eagle_lib.decoding import specdec
from eagle_lib.engines import machine


def prompts_of(seqs, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """Up to ``n`` prompts (token ids before the first label), evenly spaced over ``seqs``."""
    found = []
    for s in seqs:
        first = next((i for i, m in enumerate(s.loss_mask) if m), len(s.loss_mask))
        if first >= 2:  # the drafter's prefill needs at least one (feature, next token) row
            found.append(list(s.input_ids[:first][-max_prompt_tokens:]))
    if n <= 0 or len(found) <= n:
        return found
    return [found[i * len(found) // n] for i in range(n)]


class Meter:
    """Measures tau of a drafter on fixed prompts; ``k`` drafts per verify step (06's ``num_steps``)."""

    def __init__(
        self,
        target,
        aux_layers: list[int],
        prompts: list[list[int]],
        max_new_tokens: int,
        k: int,
        eos_ids: list[int] | None = None,
    ):
        if not prompts:
            raise ValueError("measured acceptance needs at least one held-out prompt with a label")
        if k < 1 or max_new_tokens < 2:
            raise ValueError(
                f"measured acceptance needs k >= 1 and max_new_tokens >= 2 (got {k}, {max_new_tokens})"
            )
        self.target, self.aux_layers, self.prompts = target, list(aux_layers), prompts
        self.max_new_tokens, self.k, self.eos_ids = max_new_tokens, k, eos_ids

    def __call__(self, drafter) -> dict:
        """{'tau', 'acc' (per draft position, unconditional), 'verify_steps', 'prompts', 'seconds'}."""
        t0 = time.perf_counter()
        was_training = drafter.training
        drafter.eval()
        runner = specdec.TargetRunner(self.target, self.aux_layers)
        owned = torch.get_num_threads()  # the training step's: threads_alone once no producer runs

        def one(i: int) -> list[int]:
            ids = self.prompts[i]
            return specdec.speculative_generate(
                runner, specdec.EagleProposer(drafter), ids, self.max_new_tokens, self.k, self.eos_ids
            ).accepted

        # one thread a decode (not the training step's threads_alone), the rest of `owned` in more processes
        with torch.no_grad(), machine.decoding_threads() as want:
            procs = machine.decoding_processes(owned, want, runner.device)
            runs = forked.forked_map(one, len(self.prompts), procs, "05's measured tau")
        accepted = [a for run in runs for a in run]
        runner.cache = None  # free the target's KV cache between measurements
        drafter.train(was_training)
        st = specdec.acceptance_stats(accepted, self.k)
        return {
            "tau": st["tau"],
            "acc": [st[f"acc_{i}"] for i in range(1, self.k + 1)],
            "verify_steps": st["steps"],
            "prompts": len(self.prompts),
            "seconds": time.perf_counter() - t0,
        }


def due(step: int, every: int, total: int) -> bool:
    """Measure after optimizer step ``step`` (1-based): every ``every`` steps and at the last one."""
    return every > 0 and (step % every == 0 or step == total)


def best(history: list[dict]) -> dict | None:
    """The log row with the highest measured tau (the earliest among ties), or None."""
    rows = [r for r in history if r.get("measured_tau") is not None]
    return max(rows, key=lambda r: (r["measured_tau"], -r["step"])) if rows else None


def meter_for(cfg, source, held) -> tuple[Meter | None, str]:
    """Stage 05's meter, or None and why not (it needs the HF target in this process, unsharded weights)."""
    p = cfg.stage
    if p.measure_every <= 0:
        return None, "measure_every is 0"
    if not hasattr(source, "model"):
        return None, f"hidden_source {p.hidden_source} has no target in this process (06 measures tau)"
    if distributed.launched() and p.distributed == "fsdp":
        return None, "the drafter is sharded under fsdp (06 measures tau)"
    prompts = prompts_of(held, p.measure_prompts, p.max_seq_len)
    if not prompts:
        return None, "no held-out sequence with a prompt before its first label"
    eos = models.stop_ids(models.load_tokenizer(cfg.shared), source.model)
    return Meter(source.model, source.aux_layers, prompts, p.measure_new_tokens, p.measure_drafts, eos), ""


def summary(history: list[dict], chosen: int | None, why_not: str, p) -> dict:
    """summary.json's ``measured``: the last and the best measurement and which step final/ holds."""
    rows = [r for r in history if "measured_tau" in r]
    if not rows:
        return {"skipped": why_not or "no measurement in this run's log"}
    top = best(history)
    return {
        "drafts": p.measure_drafts,
        "prompts": p.measure_prompts,
        "new_tokens": p.measure_new_tokens,
        "final_tau": rows[-1]["measured_tau"],
        "final_acc": rows[-1]["measured_acc"],
        "best_tau": top["measured_tau"],
        "best_step": top["step"],
        "final_weights_step": chosen if chosen is not None else history[-1]["step"],
        "elapsed_s": history[-1]["elapsed_s"],
    }
