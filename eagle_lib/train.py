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
import sys
from pathlib import Path
from typing import Literal

from eagle_lib import params, store

STAGE = "05_train_eagle3"
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
    keep_hidden_states: bool = (
        False  # keep consumed hidden states per sequence (later runs and 07 reuse them)
    )
    hidden_dtype: Literal["float32", "bfloat16", "float8_e4m3fn"] = (
        "float32"  # storage dtype of the buffered hidden states (float8: one scale per token and layer)
    )
    start_producers: bool = True  # false: producers are started by hand (a cluster) on the buffer dir
    aux_layers: list[int] = []  # target decoder layers (0-based) feeding fc; empty means [1, L//2-1, L-4]
    draft_vocab_size: int = 512  # N: lm_head over the N most frequent label tokens
    ttt_preset: Literal["eagle", "specforge", "speculators", "modelopt", "custom"] = (
        "eagle"  # eagle, specforge (k 7, decay 0.8) | speculators (3, 1.0) | modelopt (3, 0.9) | custom
    )
    ttt_steps: int = 0  # TTT unroll length k; 0 takes the preset's
    loss_decay: float = 0.0  # weight of step i is decay**i; 0 takes the preset's
    ttt_input: Literal["label", "drafted"] = (
        "label"  # input token of unroll steps >= 1: the data's next token | the drafter's own previous draft
    )
    target_temperature: float = (
        1.0  # soft target = softmax(target logits / this); < 1 sharpens towards argmax
    )
    # normalisation options of later EAGLE-3 trainers (speculators' names): ours only, not servable (no exports)
    norm_before_residual: bool = False  # residual = hidden_norm(hidden) instead of the raw hidden
    norm_before_fc: bool = False  # an RMSNorm (extra weight input_norm) on the 3H_t features before fc
    norm_output: bool = False  # feed norm(out) back to the next draft step instead of the pre-norm out
    draft_intermediate_size: int = 0  # the drafter's MLP width; 0 takes the target's (served: a config value)
    epochs: int = 1  # passes over the training rows (ignored when max_steps > 0)
    max_steps: int = 80  # optimizer steps; 0 means epochs x steps per epoch
    learning_rate: float = 5e-3  # AdamW peak learning rate (toy; 1e-4 suits large targets)
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 10  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay
    adam_betas: list[float] = [0.9, 0.95]  # AdamW betas
    optimizer: Literal["adamw", "muon"] = (
        "adamw"  # adamw | muon: torch's Muon on fc and the draft layer's matrices (AdamW-matched lr), AdamW on the rest
    )
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
    """Train (or resume), write drafter/ (final weights, exports, summary, meta) and return the summary;
    relaunches itself under torchrun when asked. The loop is `eagle_lib.drafter.trainer`, imported here so
    that validating params never imports torch."""
    from eagle_lib.drafter import distributed, trainer

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
    return trainer.train(cfg, fingerprint(cfg))


def build(cfg: params.StageConfig, device):
    """Sequences, hidden source and a drafter initialised from the target (`trainer.build`; used by tests)."""
    from eagle_lib.drafter import trainer

    return trainer.build(cfg, device, fingerprint(cfg))


def main(argv: list[str]) -> None:
    """torchrun entry: ``python -m eagle_lib.train <drafter/launch.json>``."""
    spec = json.loads(Path(argv[0]).read_text())
    cfg = params.StageConfig(
        STAGE, Path(spec["run_dir"]), params.SharedParams(**spec["shared"]), Params(**spec["stage"])
    )
    from eagle_lib.drafter import trainer

    trainer.train(cfg, fingerprint(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
