"""Stage 05's recipe, the one home of what 05 and 07 both train with: the params model (`Params`), the settings
fingerprint, the learning-rate schedule, the drafter's config and initialisation, and 05's recipe as one process
(`single_process`: how 07 trains "05's recipe on a subset" on any world size). The optimizer-step count and the
micro-batches of a step are the data order's (`eagle_lib.data.batches.total_steps`, `micro_batches`).

Importing this module does not import torch (validating params must stay light): the functions that need it
import it themselves.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import model_validator

from eagle_lib import params, store

# settings that do not change the trained weights (may differ on resume)
NOT_IN_FINGERPRINT = {
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "log_every",
    "stop_after_steps",
    "max_eval_samples",
    "nproc_per_node",
    "sequence_parallel",
    "num_threads",
    "distributed",
    "export_dtype",
    "attention",
    "loss_chunk",
    "checkpoint_steps",
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
    "nnodes",
    "rdzv_endpoint",
    "ranks_per_producer",
}


class Params(params.Strict):
    """Stage 05 parameters (defaults train the toy drafter in a few CPU minutes)."""

    hidden_source: Literal["online", "offline", "vllm"] = (
        "online"  # online: run the HF target | offline: engine dumps in hidden_dump_dir | vllm: engine prefill
    )
    hidden_dump_dir: str = (
        ""  # dir of hs_{i}.safetensors (token_ids [T], hidden_states [T, 4, H]); offline only
    )
    # vllm (eagle_lib.hidden_states.engine_hidden): producers stream units into hidden_dump_dir or drafter/hidden_buffer
    tensor_parallel_size: int = 1  # vLLM tensor parallel size of each producer
    num_producers: int = 1  # vLLM producers (data parallel), each with its share of max_buffer_gb
    max_buffer_gb: float = (
        2.0  # bound on unconsumed hidden states (+ in-flight writes): all ranks' buffers together
    )
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
    loss_positions: Literal["assistant", "all"] = (
        "assistant"  # label rows: the loss mask's (assistant tokens) | all (prompt tokens too: the target's logits)
    )
    loss: Literal["soft_ce", "forward_kl", "reverse_kl", "jsd", "tv", "nla", "lk_hybrid"] = (
        "soft_ce"  # per-position loss, target p vs draft q (eagle_lib.drafter.served.per_position_loss)
    )
    # shared.serve_temperatures > 0: each adds a term, the target's served distribution (T, serve_top_p) vs
    # softmax(draft logits / T), the draft vLLM samples with draft_sample_method probabilistic (drafter/served.py)
    sampled_loss: Literal["soft_ce", "forward_kl", "jsd", "tv", "nla", "lk_hybrid"] = (
        "tv"  # 1 - TV = the acceptance rate of a draft drawn from q
    )
    serve_weights: list[float] = []  # one weight per shared.serve_temperatures entry; empty = equal
    greedy_draft_temperature: float = (
        1.0  # the T=0 term's q = softmax(draft logits / this); = target_temperature: both sharpened alike
    )
    # normalisation options of later EAGLE-3 trainers (speculators' names): ours only, not servable (no exports)
    norm_before_residual: bool = False  # residual = hidden_norm(hidden) instead of the raw hidden
    norm_before_fc: bool = False  # an RMSNorm (extra weight input_norm) on the 3H_t features before fc
    norm_output: bool = False  # feed norm(out) back to the next draft step instead of the pre-norm out
    fc_norm: bool = (
        False  # an RMSNorm per aux feature before fc; with norm_output: EAGLE-3.1 (served by both)
    )
    draft_attention: Literal["gqa", "mla"] = (
        "gqa"  # the draft layer's attention: gqa (Llama) | mla (an MLA target's own shapes: Eagle3DeepseekV2)
    )
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
    freeze_lm_head: bool = (
        False  # keep lm_head at those rows (speculators' way): train fc, the layer and norms
    )
    lm_head_lr_scale: float = 1.0  # the lm_head's AdamW lr as a fraction of learning_rate (> 0)
    # a target decoder layer (0-based) whose weights start the draft layer, with the target's final norm before the
    # lm_head (drafter/model.init_layer_from_target); -1: a random layer (the peers' init)
    init_layer_from_target: int = -1
    init_layer_halves: Literal["hidden", "both"] = (
        "hidden"  # which half of q/k/v's 2H input takes the target's matrix: hidden | both (embedding too)
    )
    init_fc: Literal["random", "last_aux"] = (
        "random"  # fc's start: random | last_aux (passes the last aux layer's feature through: [0, 0, I])
    )
    attention: Literal["auto", "eager", "sdpa", "chunked"] = (
        "auto"  # TTT attention: eager (T x T scores per step; CPU) | sdpa (fused kernel; GPU) | chunked
        # (blockwise, memory linear in length: long sequences; drafter/longseq.py) | auto (sdpa on GPU, else eager)
    )
    loss_chunk: int = 0  # > 0: lm_head, loss and target log-probs this many label rows at a time (no (T, V))
    checkpoint_steps: bool = (
        False  # recompute each TTT step's decoder layer in backward (~4 H kept a token a step)
    )
    precision: Literal["auto", "fp32", "bf16"] = (
        "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    )
    nproc_per_node: int = 1  # >1: relaunch under torchrun with this many processes (a node's GPUs at most)
    nnodes: int = (
        1  # trainer nodes: >1 joins torchrun's c10d rendezvous at rdzv_endpoint (one command a node)
    )
    rdzv_endpoint: str = ""  # host:port of the rendezvous (a trainer node's address) when nnodes > 1
    ranks_per_producer: int = (
        1  # vllm: trainer ranks one producer serves (consecutive ranks share its engine)
    )
    sequence_parallel: int = 1  # ranks of a group that split every row's tokens (Ulysses; drafter/seqpar.py)
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
    num_threads: int = (
        0  # torch CPU threads; 0: the machine rule (engines.machine.cpu_threads: half the cores)
    )
    # torch CPU threads once no hidden-state producer of the stage runs (vllm: the producer holds a core until it
    # has made every unit); 0: num_threads throughout. Only where nothing else shares the machine
    threads_alone: int = 0
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

    @model_validator(mode="after")
    def _sequence_parallel(self):
        sp = self.sequence_parallel
        if sp < 1 or 16 % sp or self.nproc_per_node % sp:
            raise ValueError(f"sequence_parallel {sp} must divide 16 (rows are padded to multiples of 16) and "
                             f"nproc_per_node ({self.nproc_per_node})")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _layout(self):
        if self.nnodes < 1 or self.ranks_per_producer < 1 or self.nproc_per_node < 1:
            raise ValueError("nnodes, nproc_per_node and ranks_per_producer must be >= 1")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"nnodes {self.nnodes} needs rdzv_endpoint (host:port of a trainer node) for torchrun"
            )
        if self.ranks_per_producer > 1 and self.hidden_source == "vllm" and self.start_producers:
            raise ValueError(
                f"ranks_per_producer {self.ranks_per_producer} needs start_producers: false (a producer "
                "serving several ranks runs on its own node, from its group's first rank's COMMAND)"
            )
        return self

    @model_validator(mode="after")
    def _frozen_head(self):
        if self.lm_head_lr_scale <= 0:
            raise ValueError(f"lm_head_lr_scale {self.lm_head_lr_scale}: must be > 0 (freeze_lm_head: true "
                             "keeps the lm_head fixed)")  # fmt: skip
        if self.freeze_lm_head and not self.init_lm_head_from_target:
            raise ValueError("freeze_lm_head keeps the target's lm_head rows: it needs init_lm_head_from_target "
                             "(a frozen random lm_head would never learn the vocabulary)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _layer_init(self):
        if self.init_layer_from_target < -1:
            raise ValueError(f"init_layer_from_target {self.init_layer_from_target}: a target decoder layer "
                             "(0-based) or -1 (a random draft layer)")  # fmt: skip
        if self.init_layer_from_target >= 0 and self.draft_attention != "gqa":
            raise ValueError("init_layer_from_target needs draft_attention gqa (an MLA draft layer has no "
                             "target layer of its shapes to start from)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _epochs_or_steps(self):
        # the Kimi params said epochs: 2 while the default max_steps (80) silently decided: found on the mini run
        if "epochs" in self.model_fields_set and self.max_steps and "max_steps" not in self.model_fields_set:
            raise ValueError(f"epochs: {self.epochs} is ignored while max_steps is {self.max_steps} (its default): "
                             "set max_steps: 0 to train by epochs, or set max_steps explicitly")  # fmt: skip
        return self


def objective(p: Params, shared: params.SharedParams) -> list:
    """The training objective's terms (`eagle_lib.drafter.served`) for these params."""
    from eagle_lib.drafter import served

    try:
        return served.terms(shared.serve_temperatures, shared.serve_top_p, p.serve_weights, p.target_temperature,
                            p.loss, p.sampled_loss, p.greedy_draft_temperature)  # fmt: skip
    except ValueError as e:
        raise params.ParamsError(f"05_train_eagle3: {e}") from None


def fingerprint(stage: Params, shared: params.SharedParams) -> str:
    """The hash of every setting that changes the trained weights (checkpoint directories are keyed by it)."""
    p = {k: v for k, v in stage.model_dump().items() if k not in NOT_IN_FINGERPRINT}
    return store.stable_hash({"stage": p, "shared": shared.model_dump(exclude={"num_workers", "device"})})


def single_process(p: Params, world: int) -> Params:
    """05's recipe (run on `world` processes) as one process: the same micro-batches per optimizer step in the
    same order, hence the same steps, schedule and (summed-then-averaged) gradients."""
    return p.model_copy(
        update={"grad_accum": p.grad_accum * world, "nproc_per_node": 1, "sequence_parallel": 1}
    )


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1 over `warmup` steps, then cosine down to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def schedules(opts: list, p: Params, total: int, warmup: int | None = None) -> list:
    """One LambdaLR per optimizer, stepping together: warmup (p.warmup_steps unless given) then cosine."""
    import torch

    w = p.warmup_steps if warmup is None else warmup
    return [
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, total, w, p.min_lr_ratio)) for o in opts
    ]


def drafter_config(hf_config, p: Params):
    """The drafter's `Eagle3Config` for this target and recipe (draft vocab, aux layers, norms, MLP width)."""
    from eagle_lib.drafter.model import Eagle3Config

    config = Eagle3Config.from_target_config(
        hf_config, p.draft_vocab_size, p.aux_layers or None, attention=p.draft_attention
    )
    config.norm_before_residual, config.norm_before_fc = p.norm_before_residual, p.norm_before_fc
    config.norm_output, config.fc_norm = p.norm_output, p.fc_norm
    config.intermediate_size = p.draft_intermediate_size or config.intermediate_size
    return config


def target_layer(p: Params, shared: params.SharedParams, hf_config) -> dict | None:
    """The target tensors that init_layer_from_target starts the drafter from (None when it is -1): the
    layer's (`model.LAYER_TENSORS`) and ``final_norm``, read alone from the target's safetensors (at the
    pinned revision)."""
    from eagle_lib import models
    from eagle_lib.drafter.model import LAYER_TENSORS
    from eagle_lib.hidden_states.hidden import load_target_tensors

    i = p.init_layer_from_target
    if i < 0:
        return None
    n = models.text_config(hf_config).num_hidden_layers
    if i >= n:
        raise params.ParamsError(f"05_train_eagle3: init_layer_from_target {i}: the target has {n} decoder "
                                 f"layers (0-{n - 1})")  # fmt: skip
    names = {key: [f"model.layers.{i}.{key}", f"layers.{i}.{key}"] for key in LAYER_TENSORS}
    target, revision = models.resolve(shared.target), models.hub_kwargs(shared)["revision"]
    return load_target_tensors(target, {**names, "final_norm": ["model.norm.weight"]}, revision)


def new_drafter(config, d2t, t2d, p: Params, seed: int, embed, lm_head, layer: dict | None = None):
    """A drafter initialised as 05 does: ``torch.manual_seed(seed)``, the vocab map, then the target's
    embedding and (with init_lm_head_from_target) its lm_head rows of the draft vocab, frozen under
    freeze_lm_head; with init_layer_from_target, the draft layer and the final norm from ``layer``
    (`target_layer`)."""
    import torch

    from eagle_lib.drafter.model import Eagle3Drafter, init_from_target, init_layer_from_target

    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config)
    drafter.set_vocab_map(d2t, t2d)
    head = lm_head.detach().float().cpu() if p.init_lm_head_from_target else None
    init_from_target(drafter, embed.detach().float().cpu(), head)
    if p.init_layer_from_target >= 0:
        if layer is None:
            raise ValueError("init_layer_from_target: no target layer given (recipe.target_layer)")
        weights = {k: v.detach().float().cpu() for k, v in layer.items()}
        init_layer_from_target(drafter, weights, weights.pop("final_norm"), p.init_layer_halves)
    if p.init_fc == "last_aux":
        if config.hidden_size != config.target_hidden_size:
            raise ValueError(f"init_fc last_aux passes a target feature ({config.target_hidden_size} wide) "
                             f"through fc: the drafter is {config.hidden_size} wide")  # fmt: skip
        with torch.no_grad():
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, 2 * config.target_hidden_size :].copy_(torch.eye(config.hidden_size))
    if p.freeze_lm_head:
        if head is None or head.shape[1] != config.hidden_size:
            width = "no target lm_head" if head is None else f"the target lm_head's width {head.shape[1]}"
            raise ValueError(f"freeze_lm_head: {width} cannot start the drafter's lm_head (hidden "
                             f"{config.hidden_size}); set freeze_lm_head: false")  # fmt: skip
        drafter.lm_head.weight.requires_grad_(False)
    return drafter


def frozen_in_bf16(drafter, bf16: bool) -> None:
    """Under bf16 precision the frozen target embedding is held in bf16: it is only looked up, never trained,
    so it needs no fp32 master copy (a bf16 checkpoint's values, as Kimi's, lose nothing)."""
    import torch

    if bf16:
        drafter.embed_tokens.to(torch.bfloat16)
