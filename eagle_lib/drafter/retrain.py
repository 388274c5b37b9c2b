"""Train fresh drafters with a finished run's stage-05 recipe on chosen sequences (stage 07's data studies).

The recipe is 05's own params model (`recipe.Params`), read from ``run_dir/drafter/meta.json`` with the world
size 05 ran on, and trained by 05's loop (`trainer.fit`): the same hidden source, draft-vocab size, TTT preset,
optimizer, schedule (`recipe.schedules`), step count (`batches.total_steps`), clipping, packing, data order and
initialisation (`recipe.new_drafter`). One process stands in for 05's ranks (`recipe.single_process`: grad_accum
x world micro-batches per step, in 05's order), so an arm is "05's recipe on a subset" at any world size, and 05's
full training set for 05's steps reproduces 05's weights (tests check it, on 1 and 2 ranks), which is why 07 may
reuse 05's drafter as the full-data point. The draft vocab is counted on the given sequences (05 counts it on
its training data, so a subset gets its own). An arm checkpoints into its own directory and resumes there.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pydantic

from eagle_lib import models, params, store
from eagle_lib.data import batches
from eagle_lib.drafter import checkpoints, optim, recipe, trainer, ttt, vocab
from eagle_lib.engines import machine


class RecipeError(ValueError):
    """The run's 05 recipe cannot be reproduced (message names the file and the key)."""


def load_recipe(run_dir: str | Path) -> tuple[recipe.Params, params.SharedParams, int]:
    """(05's params, shared params, the world size 05 trained on) from run_dir/drafter/meta.json."""
    path = Path(run_dir) / "drafter" / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no stage-05 meta.json (run 05_train_eagle3 first)")
    meta = store.read_json(path)
    if not isinstance(meta.get("params"), dict) or "shared" not in meta:
        raise RecipeError(f"{path}: needs 'params' and 'shared' (written by stage 05)")
    try:
        p, shared = recipe.Params(**meta["params"]), params.SharedParams(**meta["shared"])
    except pydantic.ValidationError as e:
        raise RecipeError(f"{path}: 05's recipe is not one this code trains: {e}") from None
    world = meta.get("world_size")
    if world is None:  # a 05 meta older than the key: its summary has always recorded it
        summary = Path(run_dir) / "drafter" / "summary.json"
        world = store.read_json(summary).get("world_size") if summary.exists() else None
    if not isinstance(world, int) or world < 1:
        raise RecipeError(f"{path}: no world_size (05's process count), neither there nor in summary.json")
    return p, shared, world


class Trainer:
    """Holds the target-side pieces (hidden source, embedding, lm_head) once; trains many drafters."""

    def __init__(self, p05: recipe.Params, shared: params.SharedParams, world: int = 1, device=None):
        self.p05, self.world, self.shared = p05, world, shared
        self.p = recipe.single_process(p05, world)
        machine.set_cpu_threads(self.p.num_threads)  # as 05 (07 trains in one process)
        self.device = device or models.pick_device(shared.device)
        self.hf_config = models.load_config(shared.target, **models.hub_kwargs(shared))
        self.config = recipe.drafter_config(self.hf_config, self.p)
        self.k, self.decay = ttt.resolve_preset(self.p.ttt_preset, self.p.ttt_steps, self.p.loss_decay)
        self.source, self.embed, self.lm_head, self.keep = self._source(models.resolve(shared.target))
        self.layer = recipe.target_layer(self.p, shared, self.hf_config)
        cuda = self.device.type == "cuda"
        self.autocast = trainer.use_autocast(self.p, self.device)
        self.attention = self.p.attention if self.p.attention != "auto" else ("sdpa" if cuda else "eager")
        self.loss_chunk = self.p.loss_chunk
        if self.loss_chunk and hasattr(self.source, "lazy_logits"):
            self.source.lazy_logits = True  # as 05: logits chunk by chunk from the last hidden

    def _source(self, tgt: str):
        """(hidden source, embedding (V, H), lm_head (V, H) or None, keep(ids) filter or None)."""
        from eagle_lib.hidden_states import hidden

        p = self.p
        if p.hidden_source == "online":
            target = models.load_target(self.shared, device=str(self.device))
            src = hidden.OnlineHidden(target, self.config.aux_layers)
            return src, target.get_input_embeddings().weight, target.get_output_embeddings().weight, None
        if p.hidden_source == "offline":
            rev = models.hub_kwargs(self.shared)["revision"]
            head = hidden.load_target_head(tgt, self.hf_config, rev)
            size = models.text_config(self.hf_config).hidden_size
            src = hidden.OfflineHidden(p.hidden_dump_dir, head, size, self.device)
            return src, hidden.load_target_embedding(tgt, rev), head.lm_head, src.has
        if p.hidden_source == "vllm":  # 05's kept hidden states; the missing ones from a vLLM producer
            from eagle_lib.hidden_states.kept_source import KeptSource

            src = KeptSource(p.model_dump(), self.shared, self.hf_config, self.device)
            return src, src.embed, src.head.lm_head, None
        raise RecipeError(
            f"hidden_source {p.hidden_source!r}: 07 retrains from online, offline or vllm states"
        )

    def sequences(self, run_dir: str | Path, max_eval: int | None = None):
        """05's (train, held-out, tally) split of run_dir's A records and B responses (held-out capped at
        05's max_eval_samples unless `max_eval` is given; 0: all)."""
        p = self.p
        cap = p.max_eval_samples if max_eval is None else max_eval
        if hasattr(self.source, "use_root"):  # vllm: the kept hidden states live in this run's 05 output
            self.source.use_root(run_dir)
        return batches.load_sequences(
            run_dir, self.shared.heldout_percent, p.max_seq_len, p.max_train_samples, cap, self.keep
        )

    def full_steps(self, seqs: list[batches.Sequence]) -> int:
        """The optimizer steps 05's recipe takes on `seqs` (05's own formula, at 05's world size)."""
        per_epoch = batches.BatchStream(
            seqs, self.p.pack_len, self.p.rows_per_batch, self.shared.seed
        ).per_epoch
        return batches.total_steps(self.p05, per_epoch, self.world)

    def new_drafter(self, seqs: list[batches.Sequence], seed: int | None = None):
        """05's initialisation (seeded by `seed`, default 05's), with the draft vocab counted on `seqs`."""
        counts = vocab.count_label_tokens(((s.input_ids, s.loss_mask) for s in seqs), self.config.vocab_size)
        d2t, t2d = vocab.build_vocab_map(counts, self.p.draft_vocab_size)
        seed = self.shared.seed if seed is None else seed
        drafter = recipe.new_drafter(
            self.config, d2t, t2d, self.p, seed, self.embed, self.lm_head, self.layer
        )
        recipe.frozen_in_bf16(drafter, self.autocast)
        return drafter.to(self.device)

    def train(
        self,
        seqs: list[batches.Sequence],
        steps: int,
        warmup: int,
        work_dir: Path,
        key: str,
        seed: int | None = None,
        threads: int | None = None,
    ):
        """A fresh drafter trained on `seqs` for `steps` optimizer steps by 05's loop, checkpointing (and
        resuming) under `work_dir` keyed by `key`; (drafter in eval mode, per-step log). `seed` (default 05's)
        seeds the initialisation and the batch order: another seed is another training run of the same recipe on
        the same data. `threads` (default the recipe's num_threads / threads_alone) sets torch's threads for every
        step. The checkpoints are removed once the drafter is trained."""
        import torch

        update = {"stop_after_steps": 0}
        if threads is not None:
            update |= {"num_threads": threads, "threads_alone": threads}
            torch.set_num_threads(threads)
        p = self.p.model_copy(update=update)
        seed = self.shared.seed if seed is None else seed
        drafter = self.new_drafter(seqs, seed)
        if hasattr(self.source, "prepare"):  # vllm: produce what 05 did not keep, in one producer session
            self.source.prepare(seqs)
        stream = batches.BatchStream(seqs, p.pack_len, p.rows_per_batch, seed)
        if hasattr(self.source, "expect"):  # vllm, stream mode: the arm's micro-batches in the order fit asks
            self.source.expect(
                stream.micro_batch(m)
                for s in range(steps)
                for m in batches.micro_batches(s, 0, 1, p.grad_accum)
            )
        model = ttt.TTT(
            drafter, self.k, self.decay, self.attention, p.ttt_input, p.target_temperature, p.loss, p.loss_chunk,
            p.checkpoint_steps, terms=recipe.objective(p, self.shared), positions=p.loss_positions,
        )  # fmt: skip
        opts = optim.for_recipe(model.named_parameters(), p)
        scheds = recipe.schedules(opts, p, steps, warmup)
        log = trainer.fit("07_data_value", p, model, opts, scheds, self.source, stream, self.device, self.k,
                          self.decay, steps, key, drafter.config, Path(work_dir), log_every=0)  # fmt: skip
        ck = checkpoints.directory(Path(work_dir), key)
        shutil.rmtree(ck, ignore_errors=True)
        with contextlib.suppress(OSError):  # checkpoints/ itself, once no other arm's are in it
            ck.parent.rmdir()
        return drafter.eval(), log
