"""Drafter quality at equal budget: our stage-05 drafter vs speculators 0.9's Eagle3DraftModel and SpecForge
0.2.0's EAGLE-3 draft model (benchmarks/specforge_side.py: SpecForge's own TTT forward and loss, in its own venv
made by scripts/install_specforge.sh), all three by decoding, at T=0 and at each sampled ``--temperatures``.
SpecForge trains on the same spec as speculators (micro-batches, hidden states, schedule, AdamW, vocab map, init);
its loss is its own (soft cross-entropy per TTT step averaged over every padded position, decay as given).

Both train on the same toy run's training sequences (``--run-dir``, stages 01-03 done), in the same micro-batches
(our `BatchStream`: ``--rows`` packed rows of ``--pack-len`` tokens per step, which speculators reads as one row), with the same hidden states (the toy
target's aux-layer outputs, computed on each side from the same target weights), the same number of steps and the
same learning-rate schedule (linear warmup then cosine to ``lr * min_lr_ratio``, grad clip) and AdamW settings
(speculators trains with AdamW; our side takes params/toy.yaml's ``optimizer``, Muon for the toy, unless
``--our-optimizer adamw`` makes it optimizer for optimizer),
the same draft vocab map (ours, from the label-token counts) and the same initialisation from the target
(embedding frozen, lm_head from the target's rows of the draft vocab). Each keeps its own TTT loss: ours (soft
cross-entropy, preset ``--ours-preset``) and speculators' (its default kl_div, ``ttt_step_loss_decay`` 1.0) at
matched ``k``. speculators runs with norm_before_residual / norm_before_fc / norm_output off: its trainer turns them
on by default for eagle3, but our drafter, our exports and the offline decoder implement the original EAGLE-3
layer, and the comparison decodes both with the same code.

Both drafters are then measured by greedy speculative decoding (`eagle_lib.decoding.specdec`, as stage 06) on the
same held-out prompts, speculators' and SpecForge's models loaded through our reader of their own save formats
(`eagle_lib.drafter.export.load_export`, which must read back the aux layers each was trained on). At T > 0 every
side is decoded by speculative sampling (`heldout_tau.Decoder`, --top-p, drafts drawn as --draft-sampling says,
--reps seeds a prompt). Prints tau per side and the ratios ours / speculators and ours / SpecForge.

    .venv/bin/python benchmarks/bench_quality.py [--run-dir outputs/toy] [--steps 80] [--k 3] [--lr 5e-3] [--vllm]

With ``--vllm`` both exports are also served by a local vLLM CPU server (`make vllm-env`), one after the other,
each as the EAGLE-3 drafter of the toy target (our speculators-format export, and speculators' own
`save_pretrained` output), and tau is read from vLLM's spec-decoding counters on the same held-out prompts (vLLM
counts drafts uncut at the token budget, so its tau is compared between the two servers, not with the offline one).

On a real model's run, ``--params params/smollm2.yaml --run-dir <run> --seeds 0 1 2``: benchmarks/quality_real.py
(its docstring has the rules): the run's 05 recipe and kept hidden states for all three sides, each side's own
optimizer and loss, tau on MT-Bench, HumanEval and held-out prompts at T=0 and T=1, means over seeds and the
steps ours needs to reach each peer's final tau. ``--vllm`` serves the toy's exports only.

speculators runs in its own venv (`make bench-env`), as in bench_train.py. Wall time is measured on each side
and includes the target's forward; on a shared CPU it varies with the load, the step counts do not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Stage 05's schedule (`eagle_lib.drafter.recipe.lr_factor`; this side imports nothing of ours): linear warmup,
    cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


# --- speculators side (runs in .venv-speculators; imports nothing from eagle_lib) -----------------------------
def _target_features(target, aux_layers: list[int], ids):
    """(aux (T, 3H) = outputs of decoder layers aux_layers, last (T, H) = last decoder layer output, pre-norm)."""
    import torch

    layers = target.model.layers
    got = {}
    hooks = [
        layers[i].register_forward_hook(
            lambda _m, _i, out, i=i: got.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in {*aux_layers, len(layers) - 1}
    ]
    with torch.no_grad():
        target(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return torch.cat([got[i][0] for i in aux_layers], -1), got[len(layers) - 1][0]


def _speculators_batch(target, aux_layers, data, m: int, feats=None):
    """Micro-batch m as speculators trains on it: each sequence shifted by its `shift_batch`, all in one row.
    Hidden states from the target, or (real-model mode) `feats(key, n)`: the run's kept ones (stored_features)."""
    import torch
    from speculators.models.eagle3.data import shift_batch

    parts = []
    for ids, mask, *key in data["steps"][m]:
        aux, last = feats(key[0], len(ids)) if feats else _target_features(target, aux_layers, ids)
        n = len(ids)
        parts.append(
            shift_batch(
                {
                    "input_ids": torch.tensor(ids),
                    "hidden_states": aux,
                    "verifier_last_hidden_states": last,
                    "loss_mask": torch.tensor(mask, dtype=torch.bool),
                    "lengths": torch.tensor([n]),
                    "position_ids": torch.arange(n),
                }
            )
        )
    cat = {
        k: torch.cat([p[k] for p in parts])[None]
        for k in ("input_ids", "hidden_states", "loss_mask", "position_ids")
    }
    cat["verifier_last_hidden_states"] = torch.cat([p["verifier_last_hidden_states"] for p in parts])[None]
    cat["document_ids"] = torch.cat([torch.full((len(p["input_ids"]),), d) for d, p in enumerate(parts)])[
        None
    ]
    return cat


def worker_speculators(spec_path: str) -> dict:
    import torch
    from safetensors.torch import load_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(spec["seed"])
    vmap = load_file(spec["vocab_map"])
    feats = None
    if spec.get("features"):  # real-model mode: the run's kept hidden states, the same for every side
        from stored_features import StoredFeatures

        feats, target = StoredFeatures(spec["features"]), None
    else:
        target = AutoModelForCausalLM.from_pretrained(spec["target"]).eval()
    layer = AutoConfig.from_pretrained(spec["target"])
    layer.num_hidden_layers = 1
    layer.intermediate_size = (
        spec.get("intermediate_size") or layer.intermediate_size
    )  # ours: draft_intermediate_size
    layer._attn_implementation = spec["attention"]
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=int(vmap["d2t"].numel()),
        norm_before_residual=False,
        norm_before_fc=False,
        norm_output=False,
        # the config key is in vLLM's numbering (our ids + 1: `models.layer_ids`), which every reader of the
        # saved model (vLLM, our load_export) applies; features are computed here from spec["aux_layers"]
        eagle_aux_hidden_state_layer_ids=spec["config_aux_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=spec["k"])],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=spec["target"], architectures=list(layer.architectures or [])
            ),
        ),
    )
    model = Eagle3DraftModel(cfg)
    model.load_vocab_mappings(vmap["t2d"], vmap["d2t"])
    model.load_verifier_weights()  # embed_tokens (frozen), lm_head rows of the draft vocab, verifier head / norm
    for name in ("embed_tokens", "verifier_lm_head", "verifier_norm"):
        getattr(model, name).requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opts = _speculators_optimizers(model, trainable, spec)
    total, save_at = len(spec["steps"]), set(spec.get("save_at", []))
    scheds = [
        torch.optim.lr_scheduler.LambdaLR(
            o, lambda s: lr_factor(s, spec["warmup"], total, spec["min_lr_ratio"])
        )
        for o in opts
    ]
    loss_cfg = resolve_loss_config("kl_div", "eager")
    data, train_s, losses = {"steps": spec["steps"]}, 0.0, []
    for m in range(total):
        t0 = time.perf_counter()
        b = _speculators_batch(target, spec["aux_layers"], data, m, feats)
        _, loss, _ = model(
            b["hidden_states"],
            b["input_ids"],
            b["document_ids"],
            loss_mask=b["loss_mask"],
            position_ids=b["position_ids"],
            verifier_last_hidden_states=b["verifier_last_hidden_states"],
            ttt_steps=spec["k"],
            ttt_step_loss_decay=spec["decay"],
            loss_config=loss_cfg,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, spec["grad_clip"])
        for o, s in zip(opts, scheds, strict=True):
            o.step()
            o.zero_grad(set_to_none=True)
            s.step()
        train_s += time.perf_counter() - t0
        losses.append(float(loss.detach()))
        print(
            f"step {m + 1}/{total} loss {losses[-1]:.4f} {time.perf_counter() - t0:.2f} s",
            file=sys.stderr,
            flush=True,
        )
        if m + 1 in save_at:  # the steps-to-quality points (real-model mode)
            model.save_pretrained(str(Path(spec["out"]) / f"step_{m + 1}"))
    out = {"train_s": train_s, "final_loss": losses[-1], "out": spec["out"], "losses": losses}
    if save_at:
        (Path(spec["out"]) / "result.json").write_text(json.dumps(out))
    else:
        model.save_pretrained(spec["out"])
    return out


def _speculators_optimizers(model, trainable, spec: dict) -> list:
    """AdamW with the spec's betas / weight decay (the toy comparison), or with ``optimizer: muon``
    speculators' own default pair (`speculators.train.optimizers.build_optimizers` with its CLI's
    `OptimizerArgs` defaults: Muon on the 2-D hidden matrices, AdamW elsewhere, its momentum and weight decays)
    at the spec's lr."""
    import torch

    if spec.get("optimizer", "adamw") == "adamw":
        return [torch.optim.AdamW(trainable, lr=spec["lr"], betas=tuple(spec["betas"]),
                                  weight_decay=spec["weight_decay"])]  # fmt: skip
    from speculators.train.config.schema import OptimizerArgs
    from speculators.train.optimizers import build_optimizers

    # its CLI's defaults (muon_lr None: --lr's), at the spec's lr
    cfg = OptimizerArgs().model_copy(update={"optimizer": "muon", "lr": spec["lr"], "muon_lr": spec["lr"]})
    muon_float32_on_cpu()
    return build_optimizers(model, cfg)


def muon_float32_on_cpu() -> None:
    """torch.optim.Muon (speculators' Muon) with its Newton-Schulz iterations in float32 for CPU tensors, as our
    side runs them (eagle_lib.drafter.optim; this side imports nothing of ours): torch's bfloat16 iterations are
    emulated on a CPU without avx512_bf16 (37 s a speculators step on the AVX2 EPYC instead of 8), and the
    update differs only by bfloat16's rounding. The same quintic iteration on the wide side of G/||G||_F; on
    CUDA torch's own. Patched where torch's single-tensor Muon looks the function up."""
    import torch
    from torch.optim import _muon

    if getattr(_muon._zeropower_via_newtonschulz, "float32_on_cpu", False):
        return
    torch_ns = _muon._zeropower_via_newtonschulz

    def ns(grad, ns_coefficients, ns_steps, eps):
        if grad.device.type != "cpu":
            return torch_ns(grad, ns_coefficients, ns_steps, eps)
        a, b, c = ns_coefficients
        tall = grad.size(0) > grad.size(1)
        x = grad.float().T if tall else grad.float()
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x

    ns.float32_on_cpu = True
    _muon._zeropower_via_newtonschulz = ns


# --- our side and the comparison (runs in .venv) ---------------------------------------------------------------
def worker_spec(aux_layers: list[int]) -> dict:
    """The layer part of a worker's spec: ``aux_layers`` (0-based decoder-layer outputs: the features it trains
    on) and ``config_aux_ids``, the same layers as its saved config must name them (vLLM's numbering, which
    speculators' ``eagle_aux_hidden_state_layer_ids`` is read in). Until this was split, the worker wrote our
    0-based ids there, so its drafter was decoded (offline and by vLLM) on the layers below the trained ones."""
    from eagle_lib import models

    return {"aux_layers": list(aux_layers), "config_aux_ids": models.layer_ids(aux_layers, "vllm")}


def _stage_config(run_dir: Path, work: Path, a, preset: str):
    import yaml

    from eagle_lib import params, train

    raw = yaml.safe_load((ROOT / "params" / "toy.yaml").read_text())
    stage = dict(raw["stages"]["05_train_eagle3"])
    stage.update(
        ttt_preset=preset,
        ttt_steps=a.k if preset == "custom" else 0,
        loss_decay=a.decay if preset == "custom" else 0.0,
        max_steps=a.steps,
        learning_rate=a.lr,
        warmup_steps=a.warmup,
        min_lr_ratio=a.min_lr_ratio,
        rows_per_batch=a.rows,
        pack_len=a.pack_len,
        max_seq_len=min(a.pack_len, stage.get("max_seq_len", 1024)),
        measure_every=0,
        resume=False,
        checkpoint_every=10**6,
        num_threads=1,
    )
    if a.our_optimizer:
        stage["optimizer"] = a.our_optimizer
    for d in ("data", "infer"):
        if not (work / d).exists():
            (work / d).symlink_to((run_dir / d).resolve())
    return params.StageConfig(
        "05_train_eagle3", work, params.SharedParams(**raw["shared"]), train.Params(**stage)
    )


def _steps_of(cfg, a) -> list[list[tuple[list[int], list[int]]]]:
    """The (ids, loss_mask) sequences of every micro-batch our run consumes, in order (our `BatchStream`)."""
    from eagle_lib.data import batches

    p = cfg.stage
    seqs, _, _ = batches.load_sequences(
        cfg.run_dir, cfg.shared.heldout_percent, p.max_seq_len, p.max_train_samples
    )
    stream = batches.BatchStream(seqs, p.pack_len, p.rows_per_batch, cfg.shared.seed)
    out = []
    for m in range(a.steps):
        b = stream.micro_batch(m)
        out.append(
            [
                (b.input_ids[r, s : s + n].tolist(), b.loss_mask[r, s : s + n].int().tolist())
                for r, segs in enumerate(b.segments)
                for _key, s, n in segs
            ]
        )
    return out


def _tau(drafter, target, tokenizer, held, a) -> dict:
    """Measured tau of one drafter: greedy speculative decoding of the held-out prompts (`drafter.measure`)."""
    from eagle_lib import models
    from eagle_lib.drafter import measure

    prompts = measure.prompts_of(held, a.prompts, 1024)
    eos = models.stop_ids(tokenizer, target)
    return measure.Meter(target, drafter.config.aux_layers, prompts, a.new_tokens, a.drafts, eos)(drafter)


def _sampled_tau(drafter, decoder, a, temperature: float) -> float:
    """Offline tau at a sampled temperature (`heldout_tau.Decoder.decode`: the target's T / --top-p
    distribution, drafts drawn as --draft-sampling says, --reps sampling seeds a prompt, sums pooled)."""
    num, den = decoder.decode(drafter, temperature, a.top_p, a.draft_sampling, a.reps)
    return float(num.sum() / den.sum())


def _served_tau(cfg, export_dir: Path, prompts: list, a, log_dir: Path) -> dict:
    """vLLM's tau for one export: a local CPU server with it as the toy target's EAGLE-3 drafter, greedy, and
    at each sampled --temperatures (T, --top-p, --draft-sampling as vLLM's draft_sample_method; --reps request
    seeds): {"tau", ..., "sampled": {T: tau}}."""
    from eagle_lib import models
    from eagle_lib.engines.vllm_server import start_vllm
    from eagle_lib.serving import commands, online

    spec = commands.vllm_spec(str(export_dir), a.drafts, a.draft_sampling)
    max_len = max(len(p.prompt_ids) for p in prompts) + a.new_tokens + 2 * a.drafts + 8
    with start_vllm(
        models.resolve(cfg.shared.target),
        extra_args=["--speculative-config", json.dumps(spec)],
        tokenizer=models.resolve(cfg.shared.tokenizer_path),
        max_model_len=max_len,
        log_dir=log_dir,
    ) as srv:
        res = online.online_vllm(srv.base_url, srv.model, {"heldout": prompts}, a.new_tokens, a.drafts)[
            "heldout"
        ]
        res["sampled"] = {}
        for t in (t for t in a.temperatures if t > 0):
            s = online.Sampling(temperature=t, top_p=a.top_p, top_k=0)
            runs = [online.online_vllm(srv.base_url, srv.model, {"heldout": prompts}, a.new_tokens, a.drafts, 2,
                                       sampling=s, seed=seed)["heldout"] for seed in range(1, a.reps + 1)]  # fmt: skip
            res["sampled"][t] = 1 + sum(r["accepted"] for r in runs) / sum(r["drafts"] for r in runs)
        return res


def _lossless(target, prompts: list, served: dict, new_tokens: int) -> dict[str, int]:
    """Prompts whose served output equals the target's own greedy decoding (up to the shorter: a stop token
    kept or not), the reference decoded once for every server."""
    import torch

    same = {side: 0 for side in served}
    for pr in prompts:
        with torch.no_grad():
            ref = target.generate(torch.tensor([pr.prompt_ids]), max_new_tokens=new_tokens, do_sample=False)
        ref_ids = ref[0, len(pr.prompt_ids) :].tolist()
        for side, res in served.items():
            got = res["outputs"][pr.id]
            same[side] += got[: len(ref_ids)] == ref_ids[: len(got)]
    return same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default=str(ROOT / "outputs" / "toy"))
    ap.add_argument(
        "--params",
        default="",
        help="a real recipe (params/smollm2.yaml): the real-model mode (benchmarks/quality_real.py)",
    )
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (toy 80; real: 05's max_steps)")
    ap.add_argument("--k", type=int, default=3, help="TTT steps of both sides (matched k)")
    ap.add_argument("--decay", type=float, default=1.0, help="per-step loss decay of both sides")
    ap.add_argument("--ours-preset", default="custom", help="custom: --k / --decay; or a stage-05 preset")
    ap.add_argument("--lr", type=float, default=1e-2, help="peak LR of both sides (the toy recipe's)")
    ap.add_argument("--warmup", type=int, default=None, help="toy 10; real: 05's, scaled with --steps")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--pack-len", type=int, default=1024)
    ap.add_argument(
        "--rows", type=int, default=2, help="packed rows per step (speculators: one row of them all)"
    )
    ap.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="held-out prompts decoded per side (toy 24; real: a cap per dataset, 0: 06's)",
    )
    ap.add_argument("--new-tokens", type=int, default=None, help="toy 64; real: 06's eval_max_new_tokens")
    ap.add_argument(
        "--drafts", type=int, default=3, help="drafts per verify step when decoding (06's num_steps)"
    )
    ap.add_argument("--attention", default="sdpa", help="speculators' attention implementation")
    ap.add_argument("--spec-python", default=str(ROOT / ".venv-speculators/bin/python"))
    ap.add_argument("--sf-python", default=str(ROOT / ".venv-specforge/bin/python"),
                    help="SpecForge 0.2.0's venv (make specforge-env): the third side, benchmarks/specforge_side.py")  # fmt: skip
    ap.add_argument(
        "--keep", action="store_true", help="keep the work directory (both drafters, the batches)"
    )
    ap.add_argument("--vllm", action="store_true", help="also serve both exports with vLLM and read its tau")
    ap.add_argument(
        "--our-optimizer",
        default="",
        choices=["", "adamw", "muon"],
        help="our side's optimizer: empty takes params/toy.yaml's; adamw compares optimizer for optimizer",
    )
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="0: greedy; T > 0: speculative sampling at T (offline, and served with --vllm)",
    )
    ap.add_argument("--top-p", type=float, default=0.95, help="the target's nucleus at T > 0 (toy.yaml's)")
    ap.add_argument(
        "--draft-sampling",
        default="probabilistic",
        choices=["greedy", "probabilistic"],
        help="drafts at T > 0, both sides: probabilistic = vLLM's draft_sample_method (q = softmax(z / T))",
    )
    ap.add_argument("--reps", type=int, default=None, help="sampling seeds a prompt at T > 0 (toy 3, real 1)")
    # the real-model mode (--params): benchmarks/quality_real.py
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="real: training seeds (init + data order)"
    )
    ap.add_argument("--sampled-prompts", type=int, default=0, help="real: T=1 prompts a dataset (0: 06's)")
    ap.add_argument("--peer-lr", type=float, default=0.0, help="real: the peers' peak lr (0: ours, 05's)")
    ap.add_argument("--sf-decay", type=float, default=0.8, help="real: SpecForge's TTT decay (its default)")
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                    help="real: a variant of ours' 05 recipe (e.g. learning_rate=0.005); the peers' lr is --peer-lr (0: ours')")  # fmt: skip
    ap.add_argument("--sides", nargs="+", default=["ours", "speculators", "SpecForge"],
                    choices=["ours", "speculators", "SpecForge"],
                    help="real: train and evaluate only these (the table waits for the others: --reuse, a rerun)")  # fmt: skip
    ap.add_argument(
        "--reuse", default="", help="real: another work dir whose identical peer jobs are copied, not rerun"
    )
    ap.add_argument(
        "--work-dir", default="", help="real: where jobs write (a rerun resumes); default a new one"
    )
    ap.add_argument("--jobs", type=int, default=0, help="real: jobs at once, one per core (0: every core)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(worker_speculators(a.worker)))
        return
    if a.params:
        import quality_real

        a.reps = 1 if a.reps is None else a.reps
        quality_real.main(a)
        return
    for name, toy in (("steps", 80), ("warmup", 10), ("prompts", 24), ("new_tokens", 64), ("reps", 3)):
        if getattr(a, name) is None:
            setattr(a, name, toy)
    if not Path(a.spec_python).exists():
        sys.exit(f"{a.spec_python} missing: run `make bench-env` first")
    if not Path(a.sf_python).exists():
        sys.exit(f"{a.sf_python} missing: run `make specforge-env` first")
    run_dir = Path(a.run_dir)
    if not list(run_dir.glob("infer/*/responses.jsonl")):
        sys.exit(f"{run_dir}: no infer/*/responses.jsonl; run stages 01-03 first")
    sys.path.insert(0, str(ROOT))
    import torch
    from safetensors.torch import save_file

    from eagle_lib import models, train
    from eagle_lib.data import batches
    from eagle_lib.drafter import export, measure
    from eagle_lib.drafter.model import load_drafter

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_quality_"))
    cfg = _stage_config(run_dir, work, a, a.ours_preset)
    steps = _steps_of(cfg, a)
    t0 = time.perf_counter()
    ours = train.run(cfg)
    ours_s = time.perf_counter() - t0
    drafter = load_drafter(work / "drafter" / "final")
    vmap = work / "vocab_map.safetensors"
    save_file({"d2t": drafter.d2t.contiguous(), "t2d": drafter.t2d.contiguous()}, str(vmap))
    spec = worker_spec(drafter.config.aux_layers) | {
        "target": str(models.resolve("toy://target")),
        "intermediate_size": drafter.config.intermediate_size,  # the same draft layer on both sides
        "k": a.k,
        "decay": a.decay,
        "lr": a.lr,
        "betas": cfg.stage.adam_betas,
        "weight_decay": cfg.stage.weight_decay,
        "warmup": a.warmup,
        "min_lr_ratio": a.min_lr_ratio,
        "grad_clip": cfg.stage.grad_clip,
        "seed": cfg.shared.seed,
        "vocab_map": str(vmap),
        "steps": steps,
        "out": str(work / "speculators"),
        "attention": a.attention,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [a.spec_python, __file__, "--worker", str(work / "spec.json")],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        sys.exit(f"speculators worker failed:\n{proc.stderr[-3000:]}")
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    (work / "sf_spec.json").write_text(json.dumps({**spec, "out": str(work / "specforge")}))
    proc = subprocess.run(
        [a.sf_python, str(ROOT / "benchmarks" / "specforge_side.py"), str(work / "sf_spec.json")],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"SpecForge worker failed:\n{proc.stderr[-3000:]}")
    sf = json.loads(proc.stdout.strip().splitlines()[-1])
    target = models.load_target(cfg.shared, device="cpu")
    tokenizer = models.load_tokenizer(cfg.shared)
    _, held, _ = batches.load_sequences(run_dir, cfg.shared.heldout_percent, cfg.stage.max_seq_len, 0, 0)
    embed = target.get_input_embeddings().weight.detach()
    their_drafter = export.load_export(work / "speculators", embed, drafter.config.aux_layers)
    sf_drafter = export.load_export(work / "specforge", embed, drafter.config.aux_layers)
    for name, d in (
        ("speculators", their_drafter),
        ("SpecForge", sf_drafter),
    ):  # the layers their configs name
        if d.config.aux_layers != drafter.config.aux_layers:
            sys.exit(
                f"{name}: saved config names aux layers {d.config.aux_layers}, trained on {drafter.config.aux_layers}"
            )
    t_ours, t_theirs, t_sf = (
        _tau(drafter, target, tokenizer, held, a),
        _tau(their_drafter, target, tokenizer, held, a),
        _tau(sf_drafter, target, tokenizer, held, a),
    )
    ratio, ratio_sf = t_ours["tau"] / t_theirs["tau"], t_ours["tau"] / t_sf["tau"]
    from eagle_lib.data.evalsets import Prompt
    from eagle_lib.serving import heldout_tau

    ids = measure.prompts_of(held, a.prompts, 1024)
    prompts = [Prompt(f"p{i}", "heldout", x) for i, x in enumerate(ids)]
    decoder = heldout_tau.Decoder(target, prompts, a.new_tokens, a.drafts, models.stop_ids(tokenizer, target))
    sampled = {
        t: {
            "ours": _sampled_tau(drafter, decoder, a, t),
            "speculators": _sampled_tau(their_drafter, decoder, a, t),
            "SpecForge": _sampled_tau(sf_drafter, decoder, a, t),
        }
        for t in a.temperatures
        if t > 0
    }
    served = {}
    if a.vllm:
        exports = {"ours": work / "drafter" / "export" / "speculators", "speculators": work / "speculators"}
        for side, d in exports.items():
            served[side] = _served_tau(cfg, d, prompts, a, work / f"vllm-{side}")
        for side, same in _lossless(target, prompts, served, a.new_tokens).items():
            served[side] |= {"same": same, "n": len(prompts)}
    if not a.keep:
        shutil.rmtree(work)
    print(
        f"{a.steps} steps, k={a.k}, lr {a.lr}, {a.rows} x {a.pack_len}-token rows; tau at {a.drafts} drafts on "
        f"{t_ours['prompts']} held-out prompts x {a.new_tokens} tokens (greedy, offline decoder)"
    )
    print(
        f"  ours ({a.ours_preset}, {cfg.stage.optimizer})  tau {t_ours['tau']:.3f}  "
        f"acc {[round(x, 3) for x in t_ours['acc']]}  "
        f"train {ours_s:.0f} s (whole stage)"
    )
    print(
        f"  speculators 0.9  tau {t_theirs['tau']:.3f}  acc {[round(x, 3) for x in t_theirs['acc']]}  "
        f"train {theirs['train_s']:.0f} s (steps only)"
    )
    print(
        f"  SpecForge 0.2.0  tau {t_sf['tau']:.3f}  acc {[round(x, 3) for x in t_sf['acc']]}  "
        f"train {sf['train_s']:.0f} s (steps only)"
    )
    print(f"  T=0: tau ours / speculators = {ratio:.3f}   ours / SpecForge = {ratio_sf:.3f}")
    for t, r in sampled.items():
        print(f"  T={t:g} (top_p {a.top_p}, {a.draft_sampling} drafts, {a.reps} seeds a prompt): ours {r['ours']:.3f}  "
              f"speculators {r['speculators']:.3f}  SpecForge {r['SpecForge']:.3f}  ours / speculators = "
              f"{r['ours'] / r['speculators']:.3f}   ours / SpecForge = {r['ours'] / r['SpecForge']:.3f}")  # fmt: skip
    for side, r in served.items():
        print(f"  vLLM serving {side:12s} tau {r['tau']:.3f}  acc {[round(x, 3) for x in r['acc']]}  "
              f"({r['drafts']:.0f} verify steps; output = offline greedy on {r['same']}/{r['n']} prompts)")  # fmt: skip
    if len(served) == 2:
        print(f"  vLLM tau ours / speculators = {served['ours']['tau'] / served['speculators']['tau']:.3f}")
        for t in served["ours"]["sampled"]:
            o, s_ = served["ours"]["sampled"][t], served["speculators"]["sampled"][t]
            print(f"  vLLM T={t:g}: ours {o:.3f}  speculators {s_:.3f}  ours / speculators = {o / s_:.3f}")
    print(
        json.dumps(
            {
                "steps": a.steps,
                "k": a.k,
                "ours_optimizer": cfg.stage.optimizer,
                "ours_tau": t_ours["tau"],
                "speculators_tau": t_theirs["tau"],
                "ratio": ratio,
                "specforge_tau": t_sf["tau"],
                "ratio_specforge": ratio_sf,
                "specforge_train_s": sf["train_s"],
                "ours_s": ours_s,
                "speculators_train_s": theirs["train_s"],
                "heldout_acc_0": ours["heldout"]["acc"][0],
                "vllm_tau": {side: r["tau"] for side, r in served.items()},
                "sampled_tau": {str(t): r for t, r in sampled.items()},
                "vllm_sampled_tau": {side: r["sampled"] for side, r in served.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
