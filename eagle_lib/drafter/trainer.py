"""The training loop of 05 and 07 (`fit`) and stage 05's run around it (`eagle_lib.train` is the stage: entry points): the hidden
source, a drafter initialised from the target, TTT steps with gradient accumulation, DDP/FSDP, NaN guard,
checkpoints and resume, measured acceptance while training, the held-out table, final weights and exports.
"""

from __future__ import annotations

import math
import shutil
import time
import warnings

import torch

from eagle_lib import distributed, models, params, progress, store
from eagle_lib.data import batches
from eagle_lib.drafter import checkpoints, measure, optim, recipe, seqpar, ttt, vocab
from eagle_lib.drafter.model import Eagle3Config, save_state
from eagle_lib.engines import machine

# tqdm.auto (imported by transformers / huggingface_hub while the target loads) warns on stderr in a kernel without
# ipywidgets: noise in the executed 05 report
warnings.filterwarnings("ignore", message="IProgress not found")
NORM_OPTIONS = ("norm_before_residual", "norm_before_fc", "norm_output")  # Eagle3Config flags, not exported


# --- setup -------------------------------------------------------------------------------------------
def _quiet() -> None:
    """No model-loading progress bars or advisories: in a notebook they land in stderr cells (report noise)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _source(cfg, device, hf_config, fp: str):
    """(hidden source, embedding (V, H), target lm_head or None, keep(ids) filter or None)."""
    p = cfg.stage
    if p.hidden_source == "online":
        target = models.load_target(cfg.shared, device=str(device))
        aux = p.aux_layers or Eagle3Config.from_target_config(hf_config, 1).aux_layers
        from eagle_lib.hidden_states.hidden import OnlineHidden

        emb = target.get_input_embeddings().weight
        return OnlineHidden(target, aux), emb, target.get_output_embeddings().weight, None
    if p.hidden_source == "offline":
        from eagle_lib.hidden_states import hidden

        if not p.hidden_dump_dir:
            raise params.ParamsError(f"{cfg.name}: hidden_source offline needs hidden_dump_dir")
        tgt = models.resolve(cfg.shared.target)
        rev = models.hub_kwargs(cfg.shared)["revision"]
        head = hidden.load_target_head(tgt, hf_config, rev)
        text = models.text_config(hf_config)
        src = hidden.OfflineHidden(p.hidden_dump_dir, head, text.hidden_size, device)
        return src, hidden.load_target_embedding(tgt, rev), head.lm_head, src.has
    if p.hidden_source == "vllm":
        from eagle_lib.hidden_states import engine_hidden

        # the plan starts where `checkpoints.resume` will: the newest complete checkpoint of these settings
        done = checkpoints.complete(cfg.out("drafter"), fp) if p.resume else []
        start_step = int(done[-1].name.removeprefix("step_")) if done else 0
        return engine_hidden.make_source(cfg, device, hf_config, start_step)
    raise params.ParamsError(f"{cfg.name}: hidden_source {p.hidden_source!r}: choose online, offline or vllm")


# --- loop ----------------------------------------------------------------------------------------------
def _to(batch: batches.Batch, device):
    return [x.to(device) for x in (batch.input_ids, batch.position_ids, batch.doc_ids, batch.loss_mask)]


def _micro_step(model, source, batch, device, autocast: bool, accum: int, sync: bool):
    aux, tlogits = source(batch)
    ids, pos, doc, mask = _to(batch, device)
    with distributed.no_sync(model, not sync), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
        loss, stats = model(ids, pos, doc, mask, aux, tlogits)
        (loss / accum).backward()
    return stats.detach()


def alone_threads(p, source) -> None:
    """torch's threads for the next step: p.threads_alone (within `eagle_lib.threads.thread_cap`) while none of the
    source's producers runs (a source without producers: always), else p.num_threads's count (05's rule), since a
    CPU-bound job beside a torch job that takes every core collapses it (benchmarks/bench_threads.py)."""
    if p.threads_alone <= 0:
        return
    producing = getattr(source, "producing", None)
    want = (
        machine.cpu_threads(p.num_threads, distributed.world()[1])
        if producing is not None and producing()
        else machine.capped(p.threads_alone)
    )
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)


def fit(name, p, model, opts, scheds, source, stream, device, k, decay, total, fp, config, out,
        meter=None, log_every: int | None = None) -> list[dict]:  # fmt: skip
    """The training loop of 05 and 07: optimizer steps `start`..`total` of recipe `p` (resumed from the newest
    complete checkpoint of fingerprint `fp` under `out` when p.resume), each over `batches.micro_batches` of
    `stream`; NaN guard; train_log.jsonl and checkpoints under `out`; `meter(row, history)` after each step
    (05's measured acceptance). Returns the per-step history (resumed rows included)."""
    rank, world = distributed.data_world(p.sequence_parallel)  # one sequence-parallel group: one data rank
    sp = max(1, p.sequence_parallel)
    start, history = checkpoints.resume(out, model, opts, scheds, fp, world) if p.resume else (0, [])
    log = out / "train_log.jsonl"
    if distributed.is_main():  # the log restarts from the resumed checkpoint's history
        out.mkdir(parents=True, exist_ok=True)
        tmp = log.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        store.append_jsonl(tmp, history)
        tmp.touch()
        tmp.replace(log)
    autocast = use_autocast(p, device)
    if autocast and device.type == "cpu" and not machine.native_bf16() and distributed.is_main():
        print("warning: precision bf16 on a CPU without avx512_bf16/AMX: torch emulates bf16 matmuls, ~36x "
              "slower than fp32 here (eagle_lib.engines.machine.native_bf16); precision: fp32 trains the same "
              "recipe in full precision", flush=True)  # fmt: skip
    params_ = [q for q in model.parameters() if q.requires_grad]
    every = p.log_every if log_every is None else log_every
    bad, stop = 0, (start + p.stop_after_steps if p.stop_after_steps else total)
    prog = progress.Progress("step", total, every_s=0, start=start)  # printed every `every` steps
    for step in range(start, min(total, stop)):
        alone_threads(p, source)
        t0 = time.perf_counter()
        stats, tokens = torch.zeros(k, ttt.N_STATS, device=device), 0
        for a, m in enumerate(batches.micro_batches(step, rank, world, p.grad_accum)):
            batch = stream.micro_batch(m)
            stats += _micro_step(model, source, batch, device, autocast, p.grad_accum, a == p.grad_accum - 1)
            tokens += batch.n_tokens
        gnorm = float(torch.nn.utils.clip_grad_norm_(params_, p.grad_clip))
        bad = bad + 1 if not math.isfinite(gnorm) else 0
        if bad > p.max_bad_steps:
            raise FloatingPointError(
                f"{name}: {bad} consecutive steps with non-finite gradients (last {step})"
            )
        if bad == 0:
            optim.step(opts)
        optim.zero_grad(opts)
        lr = scheds[0].get_last_lr()[0]
        with warnings.catch_warnings():  # a skipped step still advances the schedule (it is per step)
            warnings.simplefilter("ignore", UserWarning)
            for s in scheds:
                s.step()
        stats = distributed.all_reduce_sum(stats)
        tokens = (
            int(distributed.all_reduce_sum(torch.tensor(tokens, device=device))) // sp
        )  # a group shares rows
        row = ttt.log_row(step + 1, lr, stats, gnorm, tokens, time.perf_counter() - t0, decay)
        row["skipped"] = bad > 0
        row["threads"] = torch.get_num_threads()
        row["elapsed_s"] = (history[-1]["elapsed_s"] if history else 0.0) + row["seconds"]
        if meter is not None:
            meter(row, history)
        history.append(row)
        if distributed.is_main():
            store.append_jsonl(log, [row], fsync=False)
            if every and ((step + 1) % every == 0 or step == 0):
                tau = f" measured tau {row['measured_tau']:.2f}" if "measured_tau" in row else ""
                prog.update(step + 1, f"loss {row['loss']:.4f} acc_0 {row['acc_k'][0]:.3f} "
                                      f"tok/s {tokens / row['seconds']:.0f}{tau}")  # fmt: skip
        if (step + 1) % p.checkpoint_every == 0 or step + 1 == total:
            checkpoints.save(
                out, model, opts, scheds, step + 1, fp, history, config, p.keep_checkpoints, world
            )
    return history


def _measure(cfg, model, meter, fp, config, total):
    """05's per-step hook: decode the held-out prompts with the current weights (main rank) when due; keep
    the best weights."""
    p = cfg.stage

    def hook(row: dict, history: list) -> None:
        if meter is None or not measure.due(row["step"], p.measure_every, total):
            return
        if distributed.is_main():
            drafter = distributed.unwrap(model).drafter
            m = meter(drafter)
            row.update(measured_tau=m["tau"], measured_acc=m["acc"], measure_seconds=m["seconds"])
            row["elapsed_s"] += m["seconds"]
            top = measure.best(history)
            if p.final_checkpoint == "best_measured" and (top is None or m["tau"] > top["measured_tau"]):
                state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
                checkpoints.save_best(cfg.out("drafter"), fp, state, config, row["step"], m["tau"])
        distributed.barrier()

    return hook


def use_autocast(p, device) -> bool:
    return p.precision == "bf16" or (p.precision == "auto" and device.type == "cuda")


# --- the stage -----------------------------------------------------------------------------------------
def build(cfg: params.StageConfig, device, fp: str = ""):
    """Sequences, hidden source and a drafter initialised from the target (shared by train and tests)."""
    p = cfg.stage
    if p.max_seq_len > p.pack_len:
        raise params.ParamsError(f"{cfg.name}: max_seq_len {p.max_seq_len} > pack_len {p.pack_len}")
    hf_config = models.load_config(cfg.shared.target, **models.hub_kwargs(cfg.shared))
    source, embed, lm_head, keep = _source(cfg, device, hf_config, fp)
    train_seqs, held, tally = batches.load_sequences(
        cfg.run_dir, cfg.shared.heldout_percent, p.max_seq_len, p.max_train_samples, p.max_eval_samples, keep
    )
    config = recipe.drafter_config(hf_config, p)
    d2t, t2d, vinfo = vocab.for_stage(cfg, train_seqs, config.vocab_size)
    layer = recipe.target_layer(p, cfg.shared, hf_config)
    drafter = recipe.new_drafter(config, d2t, t2d, p, cfg.shared.seed, embed, lm_head, layer)
    recipe.frozen_in_bf16(drafter, use_autocast(p, device))
    return source, drafter.to(device), train_seqs, held, tally, vinfo


def train(cfg: params.StageConfig, fp: str) -> dict:
    """The stage body (one process of a torchrun job, or the only one); ``fp``: the settings fingerprint."""
    _quiet()
    p, out, t_start, cpu_start = cfg.stage, cfg.out("drafter"), time.time(), time.process_time()
    machine.set_cpu_threads(p.num_threads, distributed.world()[1])  # on GPU: the data loading's threads
    device = distributed.init(models.pick_device(cfg.shared.device))
    k, decay = ttt.resolve_preset(p.ttt_preset, p.ttt_steps, p.loss_decay)
    if p.optimizer == "muon" and distributed.world()[1] > 1 and p.distributed == "fsdp":
        raise params.ParamsError(
            f"{cfg.name}: optimizer muon needs whole matrices; FSDP shards them (use ddp)"
        )
    source, drafter, train_seqs, held, tally, vinfo = build(cfg, device, fp)
    try:  # the source (vllm: the buffer's trainer lock, its producers) is closed however this ends
        stream = batches.BatchStream(train_seqs, p.pack_len, p.rows_per_batch, cfg.shared.seed)
        world = distributed.data_world(p.sequence_parallel)[1]
        total = batches.total_steps(p, stream.per_epoch, world)
        attn = p.attention if p.attention != "auto" else ("sdpa" if device.type == "cuda" else "eager")
        if p.loss_chunk and hasattr(source, "lazy_logits"):
            source.lazy_logits = True  # last hidden + head: logits made chunk by chunk, never (B, T, V)
        shard = seqpar.groups(distributed.world()[1], distributed.world()[0], p.sequence_parallel)
        unroll = ttt.TTT(drafter, k, decay, attn, p.ttt_input, p.target_temperature, p.loss, p.loss_chunk,
                         p.checkpoint_steps, shard, recipe.objective(p, cfg.shared), p.loss_positions)  # fmt: skip
        model = distributed.wrap(unroll, p.distributed, device, use_autocast(p, device))
        opts = optim.for_recipe(model.named_parameters(), p)
        scheds = recipe.schedules(opts, p, total)
        if not p.resume and distributed.is_main() and checkpoints.directory(out, fp).exists():
            shutil.rmtree(
                checkpoints.directory(out, fp)
            )  # asked to start over: only these settings' checkpoints
        distributed.barrier()
        meter, why_not = measure.meter_for(cfg, source, held)
        hook = _measure(cfg, model, meter, fp, drafter.config, total)
        history = fit(cfg.name, p, model, opts, scheds, source, stream, device, k, decay, total, fp, drafter.config,
                      out, hook)  # fmt: skip
        if len(history) < total:  # stop_after_steps: the next run resumes
            stopped = {"stopped_at_step": len(history), "total_steps": total}
            if distributed.is_main():
                store.write_json(out / "stopped.json", stopped)
            distributed.shutdown()
            return stopped
        chosen = checkpoints.load_best(out, fp, drafter) if p.final_checkpoint == "best_measured" else None
        heldout = ttt.evaluate(
            model, source, held, p.pack_len, p.rows_per_batch, device, use_autocast(p, device)
        )
        summary = ttt.run_summary(history, heldout, vinfo, tally, k, decay, total, world)
        if hasattr(source, "summary"):  # vllm: bytes/token, peak buffer, producer vs trainer throughput
            summary["hidden"] = source.summary()
        summary["measured"] = measure.summary(history, chosen, why_not, p)
        summary["cpu_s"] = time.process_time() - cpu_start  # this process's CPU time: load-independent on CPU
        summary["sequence_parallel"] = unroll.shard.size  # ranks that split each row (the TTT module's group)
        _finish(cfg, model, drafter.config, summary, tally, t_start, fp, device)
        distributed.shutdown()
        return summary

    finally:
        if hasattr(source, "close"):
            source.close()


def reproducibility(cfg, device, world: int, model_state: dict) -> dict:
    """05's meta: what the final weights are a function of, their digest (compare two runs by it), and what can
    make a rerun of the same record end on other bits."""
    p = cfg.stage
    caveats = [machine.SAME_BITS + " (tested on CPU: two 05 runs of one record end on one digest)"]
    if torch.device(device).type == "cuda":
        caveats.append(machine.ON_CUDA)
    if p.hidden_source == "vllm":
        caveats.append(
            "hidden_source vllm: the producers' hidden states depend on how vLLM batched each request (its "
            "kernels' reduction order), so reruns agree to rounding, not bit for bit"
        )
    return {
        **machine.run_record(cfg.shared.seed, str(device), world),
        "weights_sha256": checkpoints.state_digest(checkpoints.drafter_state(model_state)),
        "same_bits": caveats,
    }


def _finish(cfg, model, config, summary, tally, t_start, fp: str, device) -> None:
    model_state = distributed.full_model_state(model)
    if not distributed.is_main():
        return
    out = cfg.out("drafter")
    save_state(checkpoints.drafter_state(model_state), config, out / "final", {"training": summary})
    norms = [n for n in NORM_OPTIONS if getattr(config, n)]
    if norms:  # the exports describe the original EAGLE-3 layer: an engine would run a different drafter
        summary["exports"] = {"skipped": f"{', '.join(norms)}: ours only, the exports cannot carry it"}
    else:
        summary["exports"] = checkpoints.export_final(cfg, out)
    store.write_json(out / "final" / "summary.json", summary)
    store.write_json(out / "summary.json", summary)
    (out / "stopped.json").unlink(missing_ok=True)
    dropped = dict(tally.dropped, heldout_for_eval=tally.heldout)
    meta = {
        "read": tally.read,
        "kept": tally.kept,
        "dropped": dropped,
        "rejected": 0,
        "truncated": tally.truncated,
        "label_tokens": batches.label_table(tally),  # trained / held out / cut / dropped per dataset x length
        "torn_lines": tally.torn_lines,  # file:line of each skipped torn write (counted in dropped.torn_line)
        "params": cfg.stage.model_dump(),
        "shared": cfg.shared.model_dump(),
        "inputs": batches.data_fingerprint(cfg.run_dir),
        "fingerprint": fp,
        "world_size": summary["world_size"],  # 07 trains 05's recipe as one process of world x grad_accum
        "reproducibility": reproducibility(cfg, device, summary["world_size"], model_state),
    }
    store.write_meta(out, meta, t_start, tally=True)
