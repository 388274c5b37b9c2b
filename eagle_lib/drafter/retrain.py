"""Train fresh drafters with a finished run's stage-05 recipe on chosen sequences (stage 07's data studies).

The recipe is read from ``run_dir/drafter/meta.json`` (05's params and shared params, written by 05), so 07
trains exactly what 05 would on the same sequences: the same hidden source, draft-vocab size, TTT preset,
optimizer (`eagle_lib.drafter.optim`), warmup + cosine schedule, gradient clipping, accumulation, packing and data order
(`batches.BatchStream` with the shared seed), initialisation (``torch.manual_seed(seed)`` then the target's
embedding and lm_head rows). A single process, no checkpoints: 07 caches the final weights itself. The draft
vocab is counted on the given sequences (05 counts it on its training data, so a subset gets its own).
Training on 05's full training set for 05's steps reproduces 05's weights (tests check it), which is why 07
may reuse 05's drafter as the full-data point.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

from eagle_lib import models, params, store
from eagle_lib.drafter import batches, optim, ttt, vocab
from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter, init_from_target

# 05 settings that change the trained weights and that this trainer reproduces; a recipe holding a key in
# neither set (a newer 05) is trained anyway, and the key is named (`unknown_keys`, 07 reports it)
HONOURED = {
    "hidden_source", "hidden_dump_dir", "aux_layers", "draft_vocab_size", "ttt_preset", "ttt_steps", "loss_decay",
    "epochs", "max_steps", "learning_rate", "min_lr_ratio", "warmup_steps", "weight_decay", "adam_betas",
    "grad_clip", "grad_accum", "rows_per_batch", "pack_len", "max_seq_len", "max_train_samples",
    "init_lm_head_from_target", "precision", "max_bad_steps", "max_eval_samples", "attention", "hidden_dtype",
    "ttt_input", "target_temperature", "norm_before_residual", "norm_before_fc", "norm_output",
    "draft_intermediate_size", "optimizer",
}  # fmt: skip
# the recipe settings newer than some runs' 05 meta: a recipe without them trained with these values
DEFAULTS = {"ttt_input": "label", "target_temperature": 1.0, "norm_before_residual": False, "norm_before_fc": False,
            "norm_output": False, "draft_intermediate_size": 0, "optimizer": "adamw"}  # fmt: skip
# 05 settings without effect on a single-process run's weights
IGNORED = {
    "checkpoint_every", "keep_checkpoints", "resume", "log_every", "stop_after_steps", "nproc_per_node",
    "num_threads", "distributed", "export_dtype", "num_speculative_tokens", "measure_every", "measure_prompts",
    "measure_new_tokens", "measure_drafts",
    "final_checkpoint",  # which step final/ holds: 07 reuses 05's drafter only when it is the last one
    # the vllm hidden source's settings (07 reads 05's kept hidden states, producing only missing ones)
    "tensor_parallel_size", "num_producers", "max_buffer_gb", "keep_hidden_states", "start_producers",
}  # fmt: skip


class RecipeError(ValueError):
    """The run's 05 recipe cannot be reproduced (message names the file and the key)."""


def unknown_keys(recipe: dict) -> list[str]:
    """05 settings this trainer does not know (it may then train differently from 05)."""
    return sorted(set(recipe) - HONOURED - IGNORED)


def load_recipe(run_dir: str | Path) -> tuple[dict, params.SharedParams]:
    """(05 params dict, shared params) from run_dir/drafter/meta.json."""
    path = Path(run_dir) / "drafter" / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no stage-05 meta.json (run 05_train_eagle3 first)")
    meta = store.read_json(path)
    p = meta.get("params")
    if not isinstance(p, dict) or "shared" not in meta:
        raise RecipeError(f"{path}: needs 'params' and 'shared' (written by stage 05)")
    if unknown_keys(p):
        warnings.warn(
            f"{path}: 05 setting(s) {unknown_keys(p)} are not reproduced by eagle_lib.drafter.retrain",
            stacklevel=2,
        )
    return p, params.SharedParams(**meta["shared"])


def full_steps(recipe: dict, n_rows: int) -> int:
    """Optimizer steps 05 ran: max_steps, else epochs x micro-batches per epoch / grad_accum."""
    if recipe["max_steps"]:
        return recipe["max_steps"]
    per_epoch = -(-n_rows // recipe["rows_per_batch"])
    return max(1, recipe["epochs"] * per_epoch // recipe["grad_accum"])


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_ratio at `total` (05's schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


class Trainer:
    """Holds the target-side pieces (hidden source, embedding, lm_head) once; trains many drafters."""

    def __init__(self, recipe: dict, shared: params.SharedParams, device: torch.device | None = None):
        self.p, self.shared = recipe, shared
        if recipe.get("num_threads"):  # as 05: one thread each keeps busy shared cores from oversubscribing
            torch.set_num_threads(recipe["num_threads"])
        self.device = device or models.pick_device(shared.device)
        tgt = models.resolve(shared.target)
        self.hf_config = models.load_config(shared.target, shared.trust_remote_code)
        self.config = Eagle3Config.from_target_config(
            self.hf_config, recipe["draft_vocab_size"], recipe["aux_layers"] or None
        )
        for flag in ("norm_before_residual", "norm_before_fc", "norm_output"):  # as 05 (drafter.trainer)
            setattr(self.config, flag, bool(recipe.get(flag, DEFAULTS[flag])))
        width = recipe.get("draft_intermediate_size", DEFAULTS["draft_intermediate_size"])
        self.config.intermediate_size = width or self.config.intermediate_size
        self.k, self.decay = ttt.resolve_preset(
            recipe["ttt_preset"], recipe["ttt_steps"], recipe["loss_decay"]
        )
        self.source, self.embed, self.lm_head, self.keep = self._source(tgt)
        if recipe["precision"] not in ("auto", "fp32", "bf16"):
            raise RecipeError(f"precision {recipe['precision']!r}: choose auto, fp32 or bf16")
        cuda = self.device.type == "cuda"
        self.autocast = recipe["precision"] == "bf16" or (recipe["precision"] == "auto" and cuda)
        self.attention = (
            recipe["attention"] if recipe["attention"] != "auto" else ("sdpa" if cuda else "eager")
        )

    def _source(self, tgt: str):
        """(hidden source, embedding (V, H), lm_head (V, H) or None, keep(ids) filter or None)."""
        from eagle_lib.drafter import hidden

        p = self.p
        if p["hidden_source"] == "online":
            target = models.load_target(self.shared, device=str(self.device))
            src = hidden.OnlineHidden(target, self.config.aux_layers)
            return src, target.get_input_embeddings().weight, target.get_output_embeddings().weight, None
        if p["hidden_source"] == "offline":
            head = hidden.load_target_head(tgt, self.hf_config)
            size = models.text_config(self.hf_config).hidden_size
            src = hidden.OfflineHidden(p["hidden_dump_dir"], head, size, self.device)
            return src, hidden.load_target_embedding(tgt), head.lm_head, src.has
        if p["hidden_source"] == "vllm":  # 05's kept hidden states; the missing ones from a vLLM producer
            from eagle_lib.drafter.hidden_store import KeptSource

            src = KeptSource(p, self.shared, self.hf_config, self.device)
            return src, src.embed, src.head.lm_head, None
        raise RecipeError(
            f"hidden_source {p['hidden_source']!r}: 07 retrains from online, offline or vllm hidden states"
        )

    def sequences(self, run_dir: str | Path, max_eval: int | None = None):
        """05's (train, held-out, tally) split of run_dir's A records and B responses (held-out capped at
        05's max_eval_samples unless `max_eval` is given; 0: all)."""
        p = self.p
        cap = p["max_eval_samples"] if max_eval is None else max_eval
        if hasattr(self.source, "use_root"):  # vllm: the kept hidden states live in this run's 05 output
            self.source.use_root(run_dir)
        return batches.load_sequences(
            run_dir, self.shared.heldout_percent, p["max_seq_len"], p["max_train_samples"], cap, self.keep
        )

    def new_drafter(self, seqs: list[batches.Sequence]) -> Eagle3Drafter:
        """05's initialisation, with the draft vocab counted on `seqs`."""
        counts = vocab.count_label_tokens(((s.input_ids, s.loss_mask) for s in seqs), self.config.vocab_size)
        d2t, t2d = vocab.build_vocab_map(counts, self.p["draft_vocab_size"])
        torch.manual_seed(self.shared.seed)
        drafter = Eagle3Drafter(self.config)
        drafter.set_vocab_map(d2t, t2d)
        head = self.lm_head.detach().float().cpu() if self.p["init_lm_head_from_target"] else None
        init_from_target(drafter, self.embed.detach().float().cpu(), head)
        return drafter.to(self.device)

    def train(
        self, seqs: list[batches.Sequence], steps: int, warmup: int
    ) -> tuple[Eagle3Drafter, list[dict]]:
        """A fresh drafter trained on `seqs` for `steps` optimizer steps; (drafter in eval mode, per-step log)."""
        p, dev = self.p, self.device
        drafter = self.new_drafter(seqs)
        if hasattr(self.source, "prepare"):  # vllm: produce what 05 did not keep, in one producer session
            self.source.prepare(seqs)
        stream = batches.BatchStream(seqs, p["pack_len"], p["rows_per_batch"], self.shared.seed)
        model = ttt.TTT(drafter, self.k, self.decay, self.attention, p.get("ttt_input", DEFAULTS["ttt_input"]),
                        p.get("target_temperature", DEFAULTS["target_temperature"]))  # fmt: skip
        trainable = [q for q in model.parameters() if q.requires_grad]
        kind = p.get("optimizer", DEFAULTS["optimizer"])
        opts = optim.build(
            model.named_parameters(), kind, p["learning_rate"], p["adam_betas"], p["weight_decay"]
        )
        scheds = [
            torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, steps, warmup, p["min_lr_ratio"]))
            for o in opts
        ]
        log, bad = [], 0
        for step in range(steps):
            loss_sum, tokens = 0.0, 0
            for a in range(p["grad_accum"]):
                batch = stream.micro_batch(step * p["grad_accum"] + a)
                aux, tlogits = self.source(batch)
                x = [t.to(dev) for t in (batch.input_ids, batch.position_ids, batch.doc_ids, batch.loss_mask)]
                with torch.autocast(dev.type, torch.bfloat16, enabled=self.autocast):
                    loss, _ = model(*x, aux, tlogits)
                    (loss / p["grad_accum"]).backward()
                loss_sum, tokens = loss_sum + float(loss.detach()), tokens + batch.n_tokens
            gnorm = float(torch.nn.utils.clip_grad_norm_(trainable, p["grad_clip"]))
            bad = bad + 1 if not math.isfinite(gnorm) else 0
            if bad > p["max_bad_steps"]:
                raise FloatingPointError(f"retrain: {bad} consecutive steps with non-finite gradients")
            if bad == 0:
                optim.step(opts)
            optim.zero_grad(opts)
            with warnings.catch_warnings():  # a skipped step still advances the schedule (as in 05)
                warnings.simplefilter("ignore", UserWarning)
                for s in scheds:
                    s.step()
            log.append(
                {"step": step + 1, "loss": loss_sum / p["grad_accum"], "tokens": tokens, "skipped": bad > 0}
            )
        return drafter.eval(), log
