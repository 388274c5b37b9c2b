"""A run's memory and time budget from its params and the target's config (`pipeline validate`, 05's report).

Per trainer rank: the drafter's trainable parameters with fp32 master weights, gradients and AdamW's two moments
(16 bytes a parameter, sharded over the ranks under FSDP, which gathers them in bf16 for bf16 precision), its
frozen embedding (bf16 under bf16 precision: only looked up; sharded too), the target's final norm + lm_head that turn the last hidden state into
logits (the checkpoint's dtype, whole on every rank), and one micro-batch's
activations (the target logits over the full vocab, the draft logits, log-softmax and their gradients over the
draft vocab and the decoder layer's saved tensors for each of the k TTT steps, the attention masks or scores).
The activation term is a formula, not a measurement: `benchmarks/bench_long.py`-style peaks are the check.

Hidden states: bytes a token (captured layers x hidden x storage itemsize, + one fp32 scale per layer for
float8), the buffer bound per rank (``max_buffer_gb`` is the run's, split across ranks), and what dumping every
training token would take instead.

Time at a given scale (default: the seeds' regeneration, 88K samples, ~228M tokens), from throughput RATES that
are assumed, not measured here (no GPU): each is printed with the estimate, and `measured_rates` replaces the
trainer and producer rates with those a finished 05 recorded (its summary's ``hidden`` block). 03: the generated
tokens (bounded above by all the tokens) over the serving nodes' decode rate; 05: epochs x tokens through the
trainers and, pipelined beside them, the producers (the slower side sets the time); 07: the arms' share of 05's
work (an upper bound: every arm at 05's tokens-per-step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEEDS_SCALE = {
    "samples": 88_000,
    "tokens": 228_000_000,
}  # the seeds' regeneration (README, issue of the real path)

# Throughput assumed for the GPU path (tokens/s); not measured on any GPU by this project. Replace with measured
# ones (`measured_rates`) once a real 05 ran.
ASSUMED_RATES = {
    "decode_per_server": 2_500.0,  # 03: one TP-8 serving node's output tokens/s at concurrency 64
    "prefill_per_producer": 20_000.0,  # 05/07: one TP-8 vLLM producer's prefill tokens/s (hidden states out)
    "train_per_rank": 12_000.0,  # 05/07: one trainer GPU's tokens/s through the TTT unroll
}
FP32, ADAM_STATES = 4, 2


@dataclass
class Budget:
    """Bytes per trainer rank, hidden-state bytes, time estimates; `rows` renders them."""

    memory: dict[str, int] = field(default_factory=dict)  # per rank
    hidden: dict[str, float] = field(default_factory=dict)
    time: dict[str, dict] = field(default_factory=dict)
    params: dict[str, int] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    rate_source: str = "assumed"
    scale: dict[str, int] = field(default_factory=dict)

    def rows(self) -> list[tuple[str, str]]:
        gb = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
        out = [
            (
                "drafter parameters",
                f"{self.params['trainable']:,} trainable + {self.params['frozen']:,} frozen",
            )
        ]
        out += [(f"per rank: {k}", gb(v)) for k, v in self.memory.items()]
        h = self.hidden
        out += [
            ("hidden states per token", f"{h['bytes_per_token']:,.0f} B ({h['layers']} layers x {h['hidden']} x {h['dtype']})"),
            ("buffer per rank (max_buffer_gb / ranks)", f"{gb(h['buffer_per_rank'])}: ~{h['tokens_ahead_per_rank']:,.0f} tokens ahead"),
            ("dumping every training token instead", f"{h['dump_bytes'] / 2**40:,.2f} TiB"),
        ]  # fmt: skip
        for stage, t in self.time.items():
            out.append((f"{stage} at {self.scale['tokens'] / 1e6:,.0f}M tokens",
                        f"{t['hours']:,.1f} h on {t['gpus']} GPUs = {t['gpu_hours']:,.0f} GPU-hours ({t['how']})"))  # fmt: skip
        out.append(
            (
                f"rates ({self.rate_source}, tokens/s)",
                ", ".join(f"{k} {v:,.0f}" for k, v in self.rates.items()),
            )
        )
        return out

    def text(self) -> str:
        w = max(len(k) for k, _ in self.rows())
        return "\n".join(f"  {k:<{w}}  {v}" for k, v in self.rows())


def drafter_params(hf_config, p05) -> dict[str, int]:
    """Trainable and frozen parameter counts of 05's drafter for this target (built on the meta device)."""
    import torch

    from eagle_lib.drafter import recipe
    from eagle_lib.drafter.model import Eagle3Drafter

    with torch.device("meta"):
        d = Eagle3Drafter(recipe.drafter_config(hf_config, p05))
    trainable = sum(t.numel() for t in d.parameters() if t.requires_grad)
    frozen = sum(t.numel() for t in d.parameters() if not t.requires_grad)
    return {"trainable": trainable, "frozen": frozen}


def memory_per_rank(hf_config, p05) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes per trainer rank by part, parameter counts)."""
    from eagle_lib import models
    from eagle_lib.drafter import recipe, ttt

    text = models.text_config(hf_config)
    counts = drafter_params(hf_config, p05)
    cfg = recipe.drafter_config(hf_config, p05)
    world = max(1, p05.nproc_per_node)
    shard = world if p05.distributed == "fsdp" else 1
    bf16 = p05.precision != "fp32"  # a GPU run: auto is bf16 there (trainer.use_autocast)
    k, _ = ttt.resolve_preset(p05.ttt_preset, p05.ttt_steps, p05.loss_decay)
    t, v, vd, h, i = (
        p05.rows_per_batch * p05.pack_len,
        text.vocab_size,
        cfg.draft_vocab_size,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    head_dtype = str(
        getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    )
    head_bytes = {"bfloat16": 2, "float16": 2}.get(head_dtype.removeprefix("torch."), FP32)
    mem = {
        "trainable (fp32 master + grads + AdamW)": counts["trainable"] * FP32 * (2 + ADAM_STATES) // shard,
        "frozen embedding (bf16 under bf16 precision, else fp32)": counts["frozen"] * (2 if bf16 else FP32) // shard,
        "target final norm + lm_head (checkpoint dtype, whole)": (v * h + h) * head_bytes,
        "activations, one micro-batch (formula)": activation_bytes(
            t, v, vd, h, i, cfg.num_attention_heads, k, p05.attention, p05.loss_chunk, recompute=p05.checkpoint_steps
        ),
    }  # fmt: skip
    mem["total"] = sum(mem.values())
    return mem, counts


def activation_bytes(t: int, v: int, vd: int, h: int, i: int, heads: int, k: int, attention: str,
                     loss_chunk: int = 0, block: int = 256, recompute: bool = False) -> int:  # fmt: skip
    """Formula bytes (fp32) of one TTT unroll over t tokens: the decoder layer's saved tensors per step
    (~12 H + 3 I a token), the target's logits over the vocab V and log-probs over the draft vocab, the draft
    logits / log-softmax / gradient (3 x draft vocab a label row and step), and attention: eager keeps a (T, T)
    mask and two (heads, T, T) score tensors a step, sdpa a (T, (j+1) T) bool mask at step j, chunked
    (`longseq`) the output and log-sum-exp rows plus a few (heads, block, block) transients. With
    ``loss_chunk`` the target and head terms are one chunk's (logits made per chunk from the last hidden),
    plus the (T, H) rows each step's checkpointed head keeps. ``recompute`` (``checkpoint_steps``): a step
    keeps its layer's input, output, keys and values (~4 H a token) and one step's internals exist at a time
    in backward. ``auto`` counts as eager (the CPU choice)."""
    per_token = 12 * h + 3 * i
    layer = (k * t * 4 * h + t * per_token) * FP32 if recompute else k * t * per_token * FP32
    if loss_chunk:
        target = t * h * FP32 + loss_chunk * (v + vd) * FP32
        head = k * t * h * FP32 + loss_chunk * 3 * vd * FP32
    else:
        target = t * (v + vd) * FP32
        head = k * t * 3 * vd * FP32
    if attention == "sdpa":
        attn = t * t + sum(t * (j + 1) * t for j in range(k))
    elif attention == "chunked":
        attn = k * t * (h + heads) * FP32 + 4 * heads * block * block * FP32
    else:
        attn = t * t + k * heads * t * t * FP32 * 2
    return layer + target + head + attn


def hidden_bytes(hf_config, p05, tokens: int) -> dict:
    from eagle_lib import models
    from eagle_lib.drafter.model import Eagle3Config
    from eagle_lib.hidden_states import engine_hidden
    from eagle_lib.hidden_states import hidden_buffer as hb

    text = models.text_config(hf_config)
    aux = list(p05.aux_layers or Eagle3Config.from_target_config(hf_config, 1).aux_layers)
    n_ids = len(engine_hidden.layer_ids(aux, text.num_hidden_layers))
    per_token = n_ids * text.hidden_size * hb.ITEMSIZE[p05.hidden_dtype] + (
        FP32 * n_ids if p05.hidden_dtype == "float8_e4m3fn" else 0
    )
    per_rank = p05.max_buffer_gb * 2**30 / max(1, p05.nproc_per_node)
    return {"layers": n_ids, "hidden": text.hidden_size, "dtype": p05.hidden_dtype, "bytes_per_token": per_token,
            "buffer_per_rank": per_rank, "tokens_ahead_per_rank": per_rank / per_token,
            "dump_bytes": tokens * per_token}  # fmt: skip


def arms_share(p07, n_datasets: int) -> float:
    """07's training work as a multiple of 05's (an upper bound: regen and multi-turn arms counted at full
    size)."""
    curve = sum(f for f in p07.fractions if f < 1 or not p07.reuse_05_drafter) * p07.step_scale
    noisy = p07.noise_fractions if p07.noise_fractions is not None else sorted(set(p07.fractions))[:2]
    curve += p07.noise_seeds * sum(set(noisy)) * p07.step_scale  # the seed replicates (training noise)
    units = len(p07.lodo_units) or n_datasets
    lodo = (units + 1) * p07.lodo_fraction if p07.lodo else 0.0
    regen = 2 * p07.regen_fraction if p07.regen else 0.0
    multi = 2 * 1.0 if p07.multiturn else 0.0
    return curve + lodo + regen + multi


def estimate(
    run, hf_config, scale: dict | None = None, rates: dict | None = None, rate_source: str = "assumed"
) -> Budget:
    """The whole budget of a params file (`params.RunParams`) for a target config."""
    scale = dict(scale or SEEDS_SCALE)
    r = dict(ASSUMED_RATES) | dict(rates or {})
    p03, p05, p07 = (run.stage(n) for n in ("03_infer", "05_train_eagle3", "07_data_value"))
    mem, counts = memory_per_rank(hf_config, p05)
    b = Budget(memory=mem, params=counts, rates=r, rate_source=rate_source, scale=scale)
    b.hidden = hidden_bytes(hf_config, p05, scale["tokens"])
    world, tp = max(1, p05.nproc_per_node), max(1, p05.tensor_parallel_size)
    servers = max(1, len(p03.server_urls))
    hours = scale["tokens"] / (r["decode_per_server"] * servers) / 3600
    b.time["03"] = {"hours": hours, "gpus": servers * tp, "gpu_hours": hours * servers * tp,
                    "how": f"{servers} servers x TP {tp}, every token counted as generated"}  # fmt: skip
    passes = (
        p05.epochs * scale["tokens"]
        if not p05.max_steps
        else p05.max_steps * p05.grad_accum * world * p05.rows_per_batch * p05.pack_len
    )
    train_h = passes / (r["train_per_rank"] * world) / 3600
    prod_h = (
        passes / (r["prefill_per_producer"] * p05.num_producers * world) / 3600
        if p05.hidden_source == "vllm"
        else 0.0
    )
    gpus = world + (world * p05.num_producers * tp if p05.hidden_source == "vllm" else 0)
    slower = "producers" if prod_h > train_h else "trainers"
    b.time["05"] = {"hours": max(train_h, prod_h), "gpus": gpus, "gpu_hours": max(train_h, prod_h) * gpus,
                    "how": f"{passes / 1e6:,.0f}M token passes; {slower} set the pace (trainers {train_h:,.1f} h, producers {prod_h:,.1f} h)"}  # fmt: skip
    n_ds = len(run.stage("01_prepare_A").datasets) + len(run.stage("02_extract_B").datasets)
    share = arms_share(p07, n_ds)
    h7 = share * b.time["05"]["hours"]
    b.time["07"] = {"hours": h7, "gpus": gpus, "gpu_hours": h7 * gpus,
                    "how": f"{share:.2f} x 05's work in its arms (upper bound), streamed through the producers again"}  # fmt: skip
    return b


def measured_rates(summary: dict) -> dict[str, float]:
    """The trainer and producer tokens/s a finished 05 recorded (summary.json ``hidden``), where it has them."""
    h = (summary or {}).get("hidden") or {}
    out = {}
    if h.get("trainer_tokens_per_s"):
        out["train_per_rank"] = float(h["trainer_tokens_per_s"])
    if h.get("producer_tokens_per_s"):
        out["prefill_per_producer"] = float(h["producer_tokens_per_s"])
    return out


def stage05_rows(
    hf_config, p05, summary: dict | None = None, scale: dict | None = None
) -> list[tuple[str, str]]:
    """05's part of the budget for its report: memory per rank, hidden-state bytes, and 05's time at `scale`
    with the rates this run measured beside the assumed GPU ones (a CPU run's rates say nothing of a GPU's)."""
    scale = dict(scale or SEEDS_SCALE)
    mem, counts = memory_per_rank(hf_config, p05)
    b = Budget(memory=mem, params=counts, scale=scale, rates=dict(ASSUMED_RATES))
    b.hidden = hidden_bytes(hf_config, p05, scale["tokens"])
    rows = [r for r in b.rows() if not r[0].startswith("rates")]
    world = max(1, p05.nproc_per_node)
    passes = p05.epochs * scale["tokens"]
    for label, rates in (
        ("assumed GPU rates", ASSUMED_RATES),
        ("this run's measured rates", measured_rates(summary or {})),
    ):
        if "train_per_rank" not in rates:
            rows.append(
                (f"05 at {scale['tokens'] / 1e6:,.0f}M tokens, {label}", "not measured (no vllm source)")
            )
            continue
        train_h = passes / (rates["train_per_rank"] * world) / 3600
        prod = rates.get("prefill_per_producer")
        prod_h = (
            passes / (prod * p05.num_producers * world) / 3600
            if prod and p05.hidden_source == "vllm"
            else 0.0
        )
        rows.append((f"05 at {scale['tokens'] / 1e6:,.0f}M tokens, {label}",
                     f"{max(train_h, prod_h):,.1f} h (trainers {train_h:,.1f} h at {rates['train_per_rank']:,.0f} tok/s/rank, "
                     f"producers {prod_h:,.1f} h" + (f" at {prod:,.0f} tok/s each)" if prod else ")")))  # fmt: skip
    return rows
