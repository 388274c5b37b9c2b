"""Stage 05: train an EAGLE-3 drafter on A records + B responses with the target's hidden states.

Writes ``run_dir/drafter/``: ``vocab/`` (cached draft-vocab maps), ``checkpoints/<fingerprint>/step_NNNNNNN/``
(drafter and optimizer safetensors + ``trainer.json`` with scheduler and log history; ``COMPLETE`` last),
``train_log.jsonl`` (one line per optimizer step; every ``measure_every`` steps also the acceptance measured by
decoding held-out prompts, `eagle_lib.drafter.measure`), ``final/`` (`eagle_lib.drafter.model.load_drafter` reads it;
``summary.json`` beside the weights), ``export/{sglang,speculators}/`` (`eagle_lib.serving.export`), ``summary.json``
and ``meta.json``.

A rerun with ``resume: true`` continues from the newest complete checkpoint of the same settings; the data
order is a pure function of (seed, step), so the resumed loss curve equals an uninterrupted one.
``nproc_per_node > 1`` relaunches this module under torchrun (DDP or FSDP, `eagle_lib.drafter.distributed`).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Literal

import torch

from eagle_lib import models, params, store
from eagle_lib.drafter import batches, checkpoints, distributed, measure, ttt, vocab
from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter, init_from_target, save_state

STAGE = "05_train_eagle3"
# tqdm.auto (imported by transformers / huggingface_hub while the target loads) warns on stderr in a kernel without
# ipywidgets: noise in the executed 05 report
warnings.filterwarnings("ignore", message="IProgress not found")
# settings that do not change the trained weights (may differ on resume)
_NOT_IN_FINGERPRINT = {
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "log_every",
    "stop_after_steps",
    "max_eval_samples",
    "nproc_per_node",
    "num_threads",
    "distributed",
    "export_dtype",
    "attention",
    "num_speculative_tokens",
    "measure_every",
    "measure_prompts",
    "measure_new_tokens",
    "measure_drafts",
    "final_checkpoint",
    "tensor_parallel_size",
    "num_producers",
    "max_buffer_gb",
    "keep_hidden_states",
    "start_producers",
}


class Params(params.Strict):
    """Stage 05 parameters (defaults train the toy drafter in a few CPU minutes)."""

    hidden_source: Literal["online", "offline", "vllm"] = (
        "online"  # online: run the HF target | offline: engine dumps in hidden_dump_dir | vllm: engine prefill
    )
    hidden_dump_dir: str = (
        ""  # dir of hs_{i}.safetensors (token_ids [T], hidden_states [T, 4, H]); offline only
    )
    # vllm (eagle_lib.drafter.engine_hidden): producers stream units into hidden_dump_dir or drafter/hidden_buffer
    tensor_parallel_size: int = 1  # vLLM tensor parallel size of each producer
    num_producers: int = 1  # vLLM producers (data parallel), each with its share of max_buffer_gb
    max_buffer_gb: float = 2.0  # bound on unconsumed hidden states (+ in-flight writes) in the buffer
    keep_hidden_states: bool = False  # keep consumed units (a rerun of the same plan reuses them)
    hidden_dtype: Literal["float32", "bfloat16"] = "float32"  # storage dtype of the buffered hidden states
    start_producers: bool = True  # false: producers are started by hand (a cluster) on the buffer dir
    aux_layers: list[int] = []  # target decoder layers (0-based) feeding fc; empty means [1, L//2-1, L-4]
    draft_vocab_size: int = 512  # N: lm_head over the N most frequent label tokens
    ttt_preset: Literal["eagle", "specforge", "speculators", "modelopt", "custom"] = (
        "eagle"  # eagle, specforge (k 7, decay 0.8) | speculators (3, 1.0) | modelopt (3, 0.9) | custom
    )
    ttt_steps: int = 0  # TTT unroll length k; 0 takes the preset's
    loss_decay: float = 0.0  # weight of step i is decay**i; 0 takes the preset's
    epochs: int = 1  # passes over the training rows (ignored when max_steps > 0)
    max_steps: int = 80  # optimizer steps; 0 means epochs x steps per epoch
    learning_rate: float = 5e-3  # AdamW peak learning rate (toy; 1e-4 suits large targets)
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 10  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay
    adam_betas: list[float] = [0.9, 0.95]  # AdamW betas
    grad_clip: float = 0.5  # max global grad norm
    grad_accum: int = 1  # micro-batches per optimizer step (per process)
    rows_per_batch: int = 2  # packed rows per micro-batch
    pack_len: int = 1024  # tokens per packed row
    max_seq_len: int = 1024  # longer sequences are truncated (at most pack_len)
    max_train_samples: int = 0  # cap on training sequences; 0 means all
    max_eval_samples: int = 64  # held-out sequences for the final acc table; 0 means all
    init_lm_head_from_target: bool = True  # start lm_head from the target's rows of the draft vocab
    attention: Literal["auto", "eager", "sdpa"] = (
        "auto"  # TTT attention: eager (T x T scores per step; CPU) | sdpa (fused kernel; GPU) | auto
    )
    precision: Literal["auto", "fp32", "bf16"] = (
        "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    )
    nproc_per_node: int = 1  # >1: relaunch under torchrun with this many processes
    distributed: Literal["ddp", "fsdp"] = (
        "ddp"  # ddp | fsdp (shards drafter, grads and optimizer state; large drafters)
    )
    checkpoint_every: int = 50  # optimizer steps between checkpoints (and at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept
    resume: bool = (
        True  # continue from the newest complete checkpoint of the same settings; false: start over
    )
    stop_after_steps: int = 0  # stop this invocation after so many steps (time-boxed jobs); 0 runs to the end
    log_every: int = 10  # print a progress line every so many steps
    max_bad_steps: int = 5  # consecutive non-finite steps (skipped) before training aborts
    num_threads: int = 0  # torch CPU threads; 0 keeps torch's default
    export_dtype: Literal["float32", "bfloat16", "float16"] = (
        "float32"  # float32 | bfloat16 | float16 for the SGLang / speculators exports
    )
    num_speculative_tokens: int = 3  # written into the speculators export's proposal config
    measure_every: int = 20  # steps between measured-acceptance runs (decoding held-out prompts); 0: never
    measure_prompts: int = 8  # held-out prompts decoded per measurement
    measure_new_tokens: int = 32  # tokens generated per prompt per measurement
    measure_drafts: int = 3  # drafts per verify step when measuring (06's num_steps)
    final_checkpoint: Literal["last", "best_measured"] = (
        "last"  # weights in final/: last (the last step's) or best_measured (highest measured tau)
    )


def fingerprint(cfg: params.StageConfig) -> str:
    p = {k: v for k, v in cfg.stage.model_dump().items() if k not in _NOT_IN_FINGERPRINT}
    return store.stable_hash({"stage": p, "shared": cfg.shared.model_dump(exclude={"num_workers", "device"})})


def run(cfg: params.StageConfig) -> dict:
    """Train (or resume) and return the summary; relaunches itself under torchrun when asked."""
    _quiet()
    p = cfg.stage
    if p.nproc_per_node > 1 and not distributed.launched():
        out = cfg.out("drafter")
        out.mkdir(parents=True, exist_ok=True)
        spec = out / "launch.json"
        store.write_json(
            spec, {"run_dir": str(cfg.run_dir), "shared": cfg.shared.model_dump(), "stage": p.model_dump()}
        )
        (out / "summary.json").unlink(missing_ok=True)
        distributed.launch(p.nproc_per_node, ["-m", "eagle_lib.train", str(spec)])
        done = out / "summary.json"
        return store.read_json(done if done.exists() else out / "stopped.json")
    return train(cfg)


# --- setup -------------------------------------------------------------------------------------------
def _quiet() -> None:
    """No model-loading progress bars or advisories: in a notebook they land in stderr cells (report noise)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _source(cfg, device, hf_config):
    """(hidden source, embedding (V, H), target lm_head or None, keep(ids) filter or None)."""
    p = cfg.stage
    if p.hidden_source == "online":
        target = models.load_target(cfg.shared, device=str(device))
        aux = p.aux_layers or Eagle3Config.from_target_config(hf_config, 1).aux_layers
        from eagle_lib.drafter.hidden import OnlineHidden

        emb = target.get_input_embeddings().weight
        return OnlineHidden(target, aux), emb, target.get_output_embeddings().weight, None
    if p.hidden_source == "offline":
        from eagle_lib.drafter import hidden

        if not p.hidden_dump_dir:
            raise params.ParamsError(f"{STAGE}: hidden_source offline needs hidden_dump_dir")
        tgt = models.resolve(cfg.shared.target)
        head = hidden.load_target_head(tgt, hf_config)
        text = hf_config.get_text_config()
        src = hidden.OfflineHidden(p.hidden_dump_dir, head, text.hidden_size, device)
        return src, hidden.load_target_embedding(tgt), head.lm_head, src.has
    if p.hidden_source == "vllm":
        from eagle_lib.drafter import engine_hidden

        return engine_hidden.make_source(cfg, device, hf_config, fingerprint(cfg))
    raise params.ParamsError(f"{STAGE}: hidden_source {p.hidden_source!r}: choose online or offline")


def _schedule(p: Params, total: int):
    def lr_lambda(step: int) -> float:
        if step < p.warmup_steps:
            return (step + 1) / p.warmup_steps
        frac = min(1.0, (step - p.warmup_steps) / max(1, total - p.warmup_steps))
        return p.min_lr_ratio + (1 - p.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return lr_lambda


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


def _loop(cfg, model, opt, sched, source, stream, device, k, decay, total, fp, config, meter):
    p, out = cfg.stage, cfg.out("drafter")
    rank, world, _ = distributed.world()
    group = world * p.grad_accum
    start, history = checkpoints.resume(out, model, opt, sched, fp) if p.resume else (0, [])
    log = out / "train_log.jsonl"
    if distributed.is_main():  # the log restarts from the resumed checkpoint's history
        tmp = log.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        store.append_jsonl(tmp, history)
        tmp.touch()
        tmp.replace(log)
    autocast = _autocast(p, device)
    params_ = [q for q in model.parameters() if q.requires_grad]
    bad, stop = 0, (start + p.stop_after_steps if p.stop_after_steps else total)
    for step in range(start, min(total, stop)):
        t0 = time.perf_counter()
        stats, tokens = torch.zeros(k, ttt.N_STATS, device=device), 0
        for a in range(p.grad_accum):
            batch = stream.micro_batch(step * group + rank * p.grad_accum + a)
            stats += _micro_step(model, source, batch, device, autocast, p.grad_accum, a == p.grad_accum - 1)
            tokens += batch.n_tokens
        gnorm = float(torch.nn.utils.clip_grad_norm_(params_, p.grad_clip))
        bad = bad + 1 if not math.isfinite(gnorm) else 0
        if bad > p.max_bad_steps:
            raise FloatingPointError(
                f"{STAGE}: {bad} consecutive steps with non-finite gradients (last {step})"
            )
        if bad == 0:
            opt.step()
        opt.zero_grad(set_to_none=True)
        lr = sched.get_last_lr()[0]
        with warnings.catch_warnings():  # a skipped step still advances the schedule (it is per step)
            warnings.simplefilter("ignore", UserWarning)
            sched.step()
        stats = distributed.all_reduce_sum(stats)
        tokens = int(distributed.all_reduce_sum(torch.tensor(tokens, device=device)))
        row = ttt.log_row(step + 1, lr, stats, gnorm, tokens, time.perf_counter() - t0, decay)
        row["skipped"] = bad > 0
        _measure(cfg, model, meter, row, history, fp, config, total)
        history.append(row)
        if distributed.is_main():
            store.append_jsonl(log, [row], fsync=False)
            if (step + 1) % p.log_every == 0 or step == 0:
                tau = f" measured tau {row['measured_tau']:.2f}" if "measured_tau" in row else ""
                print(
                    f"step {step + 1}/{total} loss {row['loss']:.4f} acc_0 {row['acc_k'][0]:.3f} "
                    f"tok/s {tokens / row['seconds']:.0f}{tau}",
                    flush=True,
                )
        if (step + 1) % p.checkpoint_every == 0 or step + 1 == total:
            checkpoints.save(out, model, opt, sched, step + 1, fp, history, config, p.keep_checkpoints)
    return history


def _measure(cfg, model, meter, row, history, fp, config, total) -> None:
    """Decode the held-out prompts with the current weights (main rank) when due; keep the best weights."""
    p = cfg.stage
    prev = history[-1]["elapsed_s"] if history else 0.0
    row["elapsed_s"] = prev + row["seconds"]
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


def _autocast(p: Params, device) -> bool:
    if p.precision not in ("auto", "fp32", "bf16"):
        raise params.ParamsError(f"{STAGE}: precision {p.precision!r}: choose auto, fp32 or bf16")
    return p.precision == "bf16" or (p.precision == "auto" and device.type == "cuda")


# --- the stage -----------------------------------------------------------------------------------------
def build(cfg: params.StageConfig, device):
    """Sequences, hidden source and a drafter initialised from the target (shared by train and tests)."""
    from transformers import AutoConfig

    p = cfg.stage
    if p.max_seq_len > p.pack_len:
        raise params.ParamsError(f"{STAGE}: max_seq_len {p.max_seq_len} > pack_len {p.pack_len}")
    hf_config = AutoConfig.from_pretrained(
        models.resolve(cfg.shared.target), trust_remote_code=cfg.shared.trust_remote_code
    )
    source, embed, lm_head, keep = _source(cfg, device, hf_config)
    train_seqs, held, tally = batches.load_sequences(
        cfg.run_dir, cfg.shared.heldout_percent, p.max_seq_len, p.max_train_samples, p.max_eval_samples, keep
    )
    config = Eagle3Config.from_target_config(hf_config, p.draft_vocab_size, p.aux_layers or None)
    d2t, t2d, vinfo = vocab.for_stage(cfg, train_seqs, config.vocab_size)
    torch.manual_seed(cfg.shared.seed)
    drafter = Eagle3Drafter(config)
    drafter.set_vocab_map(d2t, t2d)
    init_from_target(
        drafter,
        embed.detach().float().cpu(),
        lm_head.detach().float().cpu() if p.init_lm_head_from_target else None,
    )
    return source, drafter.to(device), train_seqs, held, tally, vinfo


def train(cfg: params.StageConfig) -> dict:
    """The stage body (one process of a torchrun job, or the only one)."""
    p, out, t_start, cpu_start = cfg.stage, cfg.out("drafter"), time.time(), time.process_time()
    if p.num_threads:
        torch.set_num_threads(p.num_threads)
    device = distributed.init(models.pick_device(cfg.shared.device))
    k, decay = ttt.resolve_preset(p.ttt_preset, p.ttt_steps, p.loss_decay)
    source, drafter, train_seqs, held, tally, vinfo = build(cfg, device)
    stream = batches.BatchStream(train_seqs, p.pack_len, p.rows_per_batch, cfg.shared.seed)
    world = distributed.world()[1]
    total = p.max_steps or max(1, p.epochs * stream.per_epoch // (world * p.grad_accum))
    attn = p.attention if p.attention != "auto" else ("sdpa" if device.type == "cuda" else "eager")
    model = distributed.wrap(ttt.TTT(drafter, k, decay, attn), p.distributed, device)
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(
        trainable, lr=p.learning_rate, betas=tuple(p.adam_betas), weight_decay=p.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(p, total))
    fp = fingerprint(cfg)
    if not p.resume and distributed.is_main() and checkpoints.directory(out, fp).exists():
        shutil.rmtree(checkpoints.directory(out, fp))  # asked to start over: only these settings' checkpoints
    distributed.barrier()
    meter, why_not = measure.meter_for(cfg, source, held)
    history = _loop(
        cfg, model, opt, sched, source, stream, device, k, decay, total, fp, drafter.config, meter
    )
    if len(history) < total:  # stop_after_steps: the next run resumes
        stopped = {"stopped_at_step": len(history), "total_steps": total}
        if distributed.is_main():
            store.write_json(out / "stopped.json", stopped)
        distributed.shutdown()
        return stopped
    chosen = checkpoints.load_best(out, fp, drafter) if p.final_checkpoint == "best_measured" else None
    heldout = ttt.evaluate(model, source, held, p.pack_len, p.rows_per_batch, device, _autocast(p, device))
    summary = ttt.run_summary(history, heldout, vinfo, tally, k, decay, total, world)
    if hasattr(source, "summary"):  # vllm: bytes/token, peak buffer, producer vs trainer throughput
        summary["hidden"] = source.summary()
    summary["measured"] = measure.summary(history, chosen, why_not, p)
    summary["cpu_s"] = time.process_time() - cpu_start  # this process's CPU time: load-independent on CPU
    _finish(cfg, model, drafter.config, summary, tally, t_start)
    distributed.shutdown()
    return summary


def _finish(cfg, model, config, summary, tally, t_start) -> None:
    model_state = distributed.full_model_state(model)
    if not distributed.is_main():
        return
    out = cfg.out("drafter")
    save_state(checkpoints.drafter_state(model_state), config, out / "final", {"training": summary})
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
        "params": cfg.stage.model_dump(),
        "shared": cfg.shared.model_dump(),
        "inputs": batches.data_fingerprint(cfg.run_dir),
        "fingerprint": fingerprint(cfg),
    }
    store.write_meta(out, meta, t_start, tally=True)


def main(argv: list[str]) -> None:
    """torchrun entry: ``python -m eagle_lib.train <drafter/launch.json>``."""
    spec = json.loads(Path(argv[0]).read_text())
    cfg = params.StageConfig(
        STAGE, Path(spec["run_dir"]), params.SharedParams(**spec["shared"]), Params(**spec["stage"])
    )
    train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
