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

Time, from the params' own counts (`counts`): per dataset the prompts (B: ``max_prompts``, else the size the
``budget`` section gives) or records (A: ``max_read``, else that size), times the mean answered turns on each_turn
sets, times the mean prompt and answer tokens (the answer capped at ``max_new_tokens``; ``budget.output_tokens``
0: the cap itself); a run directory's 02/03 meta replaces the prompts, turns and answer lengths it measured.
Rates (tokens/s): a run's measured ones (03's meta, 05's summary) where the run directory has them, else the
params' ``budget`` section, else `DEFAULT_RATES`; each printed with its source. Each stage's wall time is on the
GPUs that stage uses (`layout`): 03 the serving nodes; 05 the trainer ranks (``nnodes x nproc_per_node``) and,
pipelined beside them, the producers (one group of ``num_producers`` per ``ranks_per_producer`` ranks; the slower
side sets the time); 06 one server of ``serve_tp`` GPUs; 07 one trainer process and its producers, over the arms'
share of 05's work (an upper bound). With ``cluster`` stated, a layout that does not fit it is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SEEDS_SCALE = {
    "samples": 88_000,
    "tokens": 228_000_000,
}  # the seeds' regeneration (README): 05's report sizes its own time at this scale

# Throughput assumed for the GPU path (tokens/s) where neither the params' budget section nor a run gives one;
# not measured on any GPU by this project.
DEFAULT_RATES = {
    # 03: one TP-8 serving node's output tokens/s at concurrency 64: the seeds' 24-55 h for ~228M tokens on 4
    # nodes imply 290-660 (their middle)
    "decode_per_server": 450.0,
    "prefill_per_producer": 20_000.0,  # 05/07: one TP-8 vLLM producer's prefill tokens/s (hidden states out)
    "train_per_rank": 12_000.0,  # 05/07: one trainer GPU's tokens/s through the TTT unroll
}
FP32, ADAM_STATES = 4, 2


@dataclass
class Budget:
    """Bytes per trainer rank, hidden-state bytes, the run's counts, layout and time; `rows` renders them."""

    memory: dict[str, int] = field(default_factory=dict)  # per rank
    hidden: dict[str, float] = field(default_factory=dict)
    time: dict[str, dict] = field(default_factory=dict)  # stage -> {hours, gpus, gpu_hours, how}
    params: dict[str, int] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    rate_sources: dict[str, str] = field(default_factory=dict)
    counts: list[dict] = field(default_factory=list)  # per dataset (`counts`)
    layout: dict[str, dict] = field(default_factory=dict)  # stage -> {gpus, nodes, text} (`layout`)
    misfits: list[str] = field(default_factory=list)  # why the layout does not fit the cluster
    cluster: str = "unstated"

    @property
    def tokens(self) -> dict[str, float]:
        return {k: sum(c[k] for c in self.counts) for k in ("sequences", "generated", "trained")}

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
        for c in self.counts:
            out.append((f"count {c['stage']} {c['name']}", f"{c['sequences']:,.0f} sequences = {c['how']}; "
                        f"{c['generated'] / 1e6:,.1f}M generated, {c['trained'] / 1e6:,.1f}M tokens"))  # fmt: skip
        t = self.tokens
        out.append(("count, all datasets", f"{t['sequences']:,.0f} sequences, {t['generated'] / 1e6:,.1f}M tokens "
                    f"generated by 03, {t['trained'] / 1e6:,.1f}M tokens in all"))  # fmt: skip
        out.append(("cluster", self.cluster))
        out += [(f"layout {k}", f"{v['gpus']} GPUs: {v['text']}") for k, v in self.layout.items()]
        out += [("LAYOUT DOES NOT FIT", m) for m in self.misfits]
        for stage, x in self.time.items():
            out.append((f"{stage} wall time", f"{x['hours']:,.1f} h on {x['gpus']} GPUs = {x['gpu_hours']:,.0f} GPU-hours ({x['how']})"))  # fmt: skip
        out += [
            (f"rate {k} (tokens/s)", f"{v:,.0f} ({self.rate_sources.get(k, 'assumed')})")
            for k, v in self.rates.items()
        ]
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
    d.lm_head.weight.requires_grad_(not p05.freeze_lm_head)
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
    world = ranks(p05)
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
    embed = counts["frozen"] - (vd * h if p05.freeze_lm_head else 0)
    head_dtype = str(
        getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    )
    head_bytes = {"bfloat16": 2, "float16": 2}.get(head_dtype.removeprefix("torch."), FP32)
    mem = {
        "trainable (fp32 master + grads + AdamW)": counts["trainable"] * FP32 * (2 + ADAM_STATES) // shard,
        "frozen embedding (bf16 under bf16 precision, else fp32)": embed * (2 if bf16 else FP32) // shard,
        "target final norm + lm_head (checkpoint dtype, whole)": (v * h + h) * head_bytes,
        "activations, one micro-batch (formula)": activation_bytes(
            t, v, vd, h, i, cfg.num_attention_heads, k, p05.attention, p05.loss_chunk, recompute=p05.checkpoint_steps
        ),
    }  # fmt: skip
    # a frozen draft lm_head: fp32 weights, no grads or optimizer state (frozen_in_bf16 casts only the embedding)
    if p05.freeze_lm_head:
        mem["frozen draft lm_head (fp32 weights only)"] = vd * h * FP32 // shard
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
    per_rank = p05.max_buffer_gb * 2**30 / ranks(p05)
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


def ranks(p05) -> int:
    """05's trainer ranks: nnodes x nproc_per_node."""
    return max(1, p05.nnodes) * max(1, p05.nproc_per_node)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def counts(run, run_dir: Path | None = None) -> list[dict]:
    """Per dataset (01's A, 02's B): sequences, tokens 03 generates and tokens 05 trains, from the params' caps
    and the ``budget`` section's sizes and means; a run's 02 meta (kept prompts) and 03 meta (turns, mean answer)
    replace them where `run_dir` has them. ``how`` says which of each it took."""
    bp, shared = run.budget, run.shared
    out_tok = min(bp.output_tokens or shared.max_new_tokens, shared.max_new_tokens)
    p01, p02 = run.stage("01_prepare_A"), run.stage("02_extract_B")
    rows = []
    for stage, ds, cap, multi in [("01", d, d.max_read, p01.turns == "each") for d in p01.datasets] + [
        ("02", d, d.max_prompts, d.turn == "each_turn") for d in p02.datasets
    ]:
        word = "records" if stage == "01" else "prompts"
        size = bp.dataset_sizes.get(ds.name, 0)
        n, how = (min(cap, size), f"{word} max(cap {cap:,}, size {size:,})") if cap and size else (
            (cap, f"{word} cap {cap:,}") if cap else (size, f"{word} budget.dataset_sizes {size:,}"))  # fmt: skip
        turns, out = (bp.turns if multi else 1.0), out_tok
        kind = "B" if stage == "02" else "A"
        m02 = _read(run_dir / "data" / kind / ds.name / "meta.json") if run_dir else {}
        if m02.get("kept") is not None:
            n, how = m02["kept"], f"{word} {m02['kept']:,} (measured: the run's meta)"
        m03 = _read(run_dir / "infer" / ds.name / "meta.json") if run_dir and stage == "02" else {}
        if m03.get("kept") and m03.get("generated"):
            turns, out = m03["generated"] / m03["kept"], m03.get("mean_output_tokens") or out
            how += f" x {turns:,.2f} turns (measured), {out:,.0f} answer tokens (measured)"
        else:
            how += (f" x {turns:g} turns (assumed)" if multi else "") + f" x ({bp.prompt_tokens:,} prompt + {out:,} answer tokens, assumed)"  # fmt: skip
        if not n:
            how = f"NOT COUNTED: no cap and no size (give budget.dataset_sizes.{ds.name})"
        seqs = n * turns
        rows.append({"stage": stage, "name": ds.name, "sequences": seqs, "how": how,
                     "generated": seqs * out if stage == "02" else 0.0, "trained": seqs * (bp.prompt_tokens + out)})  # fmt: skip
    return rows


def rates(run, run_dir: Path | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """(rates, where each came from): a run's measured ones (03's meta: generated tokens over the generating
    seconds and servers; 05's summary: the trainer's and producers' tokens/s), else the params' budget
    section, else `DEFAULT_RATES`."""
    bp = run.budget
    given = {"decode_per_server": bp.decode_tokens_per_s, "prefill_per_producer": bp.prefill_tokens_per_s,
             "train_per_rank": bp.train_tokens_per_s}  # fmt: skip
    r, src = {}, {}
    for k, v in DEFAULT_RATES.items():
        r[k], src[k] = (
            (given[k], "params: budget section") if given[k] else (v, "assumed: budget.DEFAULT_RATES")
        )
    if run_dir is None:
        return r, src
    m03 = _read(run_dir / "infer" / "meta.json")
    servers = len(run.stage("03_infer").server_urls) or 1
    if m03.get("generate_seconds") and m03.get("generated_tokens"):
        r["decode_per_server"] = m03["generated_tokens"] / m03["generate_seconds"] / servers
        src["decode_per_server"] = f"measured: {run_dir}/infer/meta.json over {servers} servers"
    summary = _read(run_dir / "drafter" / "summary.json")
    for k, v in measured_rates(summary).items():
        r[k], src[k] = v, f"measured: {run_dir}/drafter/summary.json"
    return r, src


def _pack(nodes: list[int], gpus: int, n: int, tp: int) -> tuple[list[int], int]:
    """Place `n` producers of `tp` GPUs on `nodes` (GPUs used a node, trainer nodes first), adding nodes of
    `gpus` GPUs as needed: (GPUs used per node, producers placed on added nodes)."""
    nodes = list(nodes)
    for _ in range(n):
        free = next((i for i, used in enumerate(nodes) if gpus - used >= tp), None)
        if free is None:
            nodes.append(0)
            free = len(nodes) - 1
        nodes[free] += tp
    return nodes, n


def layout(run) -> tuple[dict[str, dict], list[str]]:
    """Per GPU stage: the GPUs it uses and where ({gpus, nodes, text}); and, with ``cluster`` stated, why a
    stage does not fit it. A node holds trainer ranks (``nproc_per_node`` a node) and producers of
    ``tensor_parallel_size`` GPUs, never across nodes."""
    from eagle_lib import distributed

    c, p03, p05 = run.cluster, run.stage("03_infer"), run.stage("05_train_eagle3")
    p06 = run.stage("06_eval_acceptance")
    gpn = c.gpus_per_node or max(p05.nproc_per_node, p05.tensor_parallel_size, 1)
    tp, world = max(1, p05.tensor_parallel_size), ranks(p05)
    vllm = p05.hidden_source == "vllm"
    groups = distributed.producer_groups(world, p05.ranks_per_producer)
    n_prod = len(groups) * p05.num_producers if vllm else 0
    used, _ = _pack([p05.nproc_per_node] * p05.nnodes, gpn, n_prod, tp)
    serving = ", ".join(f"{'-'.join(map(str, (g[0], g[-1]))) if len(g) > 1 else g[0]}" for g in groups)
    out = {
        "03": {"gpus": len(p03.server_urls) * gpn, "nodes": len(p03.server_urls),
               "text": f"{len(p03.server_urls)} serving nodes x {gpn} GPUs (one server a node)"},
        "05": {"gpus": world + n_prod * tp, "nodes": len(used),
               "text": f"{world} trainer ranks ({p05.nnodes} node(s) x {p05.nproc_per_node})"
               + (f" + {n_prod} producers x TP {tp} ({p05.num_producers} a group of {p05.ranks_per_producer} "
                  f"ranks; groups serve ranks {serving})" if vllm else "")
               + f"; GPUs used by node {used}"},
    }  # fmt: skip
    p07_prod = p05.num_producers if vllm else 0  # 07 trains 05's recipe in one process, beside its producers
    used7, _ = _pack([1], gpn, p07_prod, tp)
    out["06"] = {"gpus": p06.serve_tp, "nodes": 1, "text": f"one server x TP {p06.serve_tp}"}
    out["07"] = {"gpus": 1 + p07_prod * tp, "nodes": len(used7),
                 "text": "1 trainer process" + (f" + {p07_prod} producers x TP {tp}" if p07_prod else "")}  # fmt: skip
    bad = []
    if c.nodes and c.gpus_per_node:
        g = c.gpus_per_node
        if p05.nproc_per_node > g:
            bad.append(f"05: nproc_per_node {p05.nproc_per_node} > {g} GPUs a node (ranks past the node's GPUs "
                       "have no device: use nnodes)")  # fmt: skip
        for name, t in (("05 tensor_parallel_size", tp if vllm else 1), ("06 serve_tp", p06.serve_tp)):
            if t > g:
                bad.append(f"{name} {t} > {g} GPUs a node")
        for k, v in out.items():
            if v["nodes"] > c.nodes:
                bad.append(f"{k} needs {v['nodes']} nodes ({v['gpus']} GPUs: {v['text']}), the cluster has "
                           f"{c.nodes} x {g}")  # fmt: skip
    return out, bad


def estimate(run, hf_config, rates_override: dict | None = None, run_dir: Path | None = None) -> Budget:
    """The whole budget of a params file (`params.RunParams`) for a target config; `run_dir`: a run whose
    measured counts and rates replace the assumed ones; `rates_override`: rates that replace all others."""
    p03, p05, p07 = (run.stage(n) for n in ("03_infer", "05_train_eagle3", "07_data_value"))
    p06 = run.stage("06_eval_acceptance")
    mem, n_params = memory_per_rank(hf_config, p05)
    r, src = rates(run, run_dir)
    for k, v in (rates_override or {}).items():
        r[k], src[k] = v, "given"
    b = Budget(memory=mem, params=n_params, rates=r, rate_sources=src, counts=counts(run, run_dir))
    b.layout, b.misfits = layout(run)
    c = run.cluster
    b.cluster = f"{c.nodes} nodes x {c.gpus_per_node} GPUs" if c.nodes else "unstated (no layout check)"
    tok = b.tokens
    b.hidden = hidden_bytes(hf_config, p05, tok["trained"])
    world, vllm = ranks(p05), p05.hidden_source == "vllm"
    servers = max(1, len(p03.server_urls))
    h3 = tok["generated"] / (r["decode_per_server"] * servers) / 3600
    b.time["03"] = _t(
        h3, b.layout["03"]["gpus"], f"{tok['generated'] / 1e6:,.1f}M tokens generated by {servers} servers"
    )
    train_tok = tok["trained"] * (1 - run.shared.heldout_percent / 100)
    passes = (p05.epochs * train_tok if not p05.max_steps
              else p05.max_steps * p05.grad_accum * world * p05.rows_per_batch * p05.pack_len)  # fmt: skip
    n_prod = b.layout["05"]["gpus"] - world
    n_prod //= max(1, p05.tensor_parallel_size)
    train_h = passes / (r["train_per_rank"] * world) / 3600
    prod_h = passes / (r["prefill_per_producer"] * n_prod) / 3600 if vllm and n_prod else 0.0
    slower = "producers" if prod_h > train_h else "trainers"
    b.time["05"] = _t(max(train_h, prod_h), b.layout["05"]["gpus"], f"{passes / 1e6:,.0f}M token passes; {slower} "
                      f"set the pace (trainers {train_h:,.1f} h, producers {prod_h:,.1f} h)")  # fmt: skip
    n_eval = sum(e.max_prompts for e in p06.eval_sets) + p06.online_max_prompts * len(b.counts)
    t6 = n_eval * p06.eval_max_new_tokens * max(1, len(p06.temperatures))
    b.time["06"] = _t(t6 / r["decode_per_server"] / 3600, p06.serve_tp,
                      f"{n_eval:,} prompts x {p06.eval_max_new_tokens} tokens x {max(1, len(p06.temperatures))} "
                      "temperatures at one node's decode rate (drafts not counted: an upper bound)")  # fmt: skip
    share = arms_share(p07, len(b.counts))
    p07_prod = (b.layout["07"]["gpus"] - 1) // max(1, p05.tensor_parallel_size)
    rate7 = (
        min(r["train_per_rank"], r["prefill_per_producer"] * p07_prod) if p07_prod else r["train_per_rank"]
    )
    b.time["07"] = _t(share * passes / rate7 / 3600, b.layout["07"]["gpus"],
                      f"{share:.2f} x 05's token passes in its arms (upper bound), one trainer process at "
                      f"{rate7:,.0f} tokens/s")  # fmt: skip
    return b


def _t(hours: float, gpus: int, how: str) -> dict:
    return {"hours": hours, "gpus": gpus, "gpu_hours": hours * gpus, "how": how}


def measured_rates(summary: dict) -> dict[str, float]:
    """The trainer and producer tokens/s a finished 05 recorded (summary.json ``hidden``; without it, the
    summary's tokens/s over its world size), where it has them."""
    h = (summary or {}).get("hidden") or {}
    out = {}
    if h.get("trainer_tokens_per_s"):
        out["train_per_rank"] = float(h["trainer_tokens_per_s"])
    elif (summary or {}).get("tokens_per_s"):
        out["train_per_rank"] = float(summary["tokens_per_s"]) / max(1, int(summary.get("world_size") or 1))
    if h.get("producer_tokens_per_s"):
        out["prefill_per_producer"] = float(h["producer_tokens_per_s"])
    return out


def stage05_rows(
    hf_config, p05, summary: dict | None = None, scale: dict | None = None
) -> list[tuple[str, str]]:
    """05's part of the budget for its report: memory per rank, hidden-state bytes, and 05's time at `scale`
    (default the seeds') with the rates this run measured beside the default GPU ones (a CPU run's rates say
    nothing of a GPU's)."""
    scale = dict(scale or SEEDS_SCALE)
    mem, n_params = memory_per_rank(hf_config, p05)
    b = Budget(memory=mem, params=n_params, counts=[{"stage": "", "name": "", "sequences": 0, "generated": 0,
                                                     "trained": scale["tokens"], "how": ""}])  # fmt: skip
    b.hidden = hidden_bytes(hf_config, p05, scale["tokens"])
    rows = [r for r in b.rows() if r[0].startswith(("drafter", "per rank", "hidden", "buffer", "dumping"))]
    world = ranks(p05)
    n_prod = -(-world // p05.ranks_per_producer) * p05.num_producers
    passes = p05.epochs * scale["tokens"]
    for label, rr in (
        ("default GPU rates", DEFAULT_RATES),
        ("this run's measured rates", measured_rates(summary or {})),
    ):
        key = f"05 at {scale['tokens'] / 1e6:,.0f}M tokens, {label}"
        if "train_per_rank" not in rr:
            rows.append((key, "not measured"))
            continue
        train_h = passes / (rr["train_per_rank"] * world) / 3600
        prod = rr.get("prefill_per_producer")
        prod_h = passes / (prod * n_prod) / 3600 if prod and p05.hidden_source == "vllm" else 0.0
        rows.append((key, f"{max(train_h, prod_h):,.1f} h (trainers {train_h:,.1f} h at {rr['train_per_rank']:,.0f} "
                     f"tok/s/rank, producers {prod_h:,.1f} h" + (f" at {prod:,.0f} tok/s each)" if prod else ")")))  # fmt: skip
    return rows
