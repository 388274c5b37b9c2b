"""Stage-05 recipe variants side by side, each measured by decoding the held-out prompts (06's tau).

Every variant is params/toy.yaml's 05 section (``--params``: another params file's, e.g. the mini-Kimi world's for
the kimi_* variants) plus a few overrides, trained by stage 05 itself (`train.run`) on a cached run's stages 01-03 (``--run-dir``, read only: its data/ and infer/ are symlinked into a fresh work
directory per variant). Each trained drafter is then decoded greedily on 06's held-out prompts (``--per-dataset``
per dataset, ``--new-tokens`` tokens, ``--drafts`` drafts per verify step; `eagle_lib.serving.heldout_tau`, as 06
and 07 decode), and one line per variant prints its tau, the held-out teacher-forced accuracy per position, the
tau measured while training, the wall time of its 05 and the drafter/target step-cost ratio of its decode (a wider
draft MLP costs more per draft). ``--seeds`` trains every variant once per shared seed (initialisation and data
order) and ends on a table per variant: tau per seed, their mean and sample standard deviation, and the mean's
difference to the first variant (seed by seed, so the recipes are compared on the same seeds). Results are
appended as JSON lines to ``--out``.

    nice -n 5 .venv/bin/python benchmarks/bench_recipe.py --steps 200 --variants baseline norm_before_residual
    nice -n 5 .venv/bin/python benchmarks/bench_recipe.py --steps 200 --variants baseline muon --seeds 0 1 2
    .venv/bin/python benchmarks/bench_recipe.py --params params/mini_kimi.yaml --run-dir outputs/mini_kimi \
        --variants kimi_gqa kimi_mla --seeds 0 1 2

Two processes on different variants can share a machine; wall times then include the other's load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# params/toy.yaml's 05 before Muon and the five settings beside it became the toy default: the recipe every
# variant below was measured against ("baseline" in the README's earlier rows)
PREVIOUS = {"optimizer": "adamw", "aux_layers": [], "draft_intermediate_size": 0, "grad_clip": 0.5,
            "adam_betas": [0.9, 0.95], "target_temperature": 0.25}  # fmt: skip
# the best AdamW settings measured one by one, which the combo_* variants share
COMBO = {
    "aux_layers": [1, 3, 6],
    "draft_intermediate_size": 1536,
    "grad_clip": 2.0,
    "adam_betas": [0.9, 0.999],
}
# name -> 05 overrides on top of PREVIOUS (on top of params/toy.yaml, which sets the rest)
ON_PREVIOUS = {
    "previous_default": {},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_output": {"norm_output": True},
    "norm_all": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
    "drafted_input": {"ttt_input": "drafted"},
    "target_t_1.0": {"target_temperature": 1.0},  # the recipe before issue 15's first change
    "target_t_0.5": {"target_temperature": 0.5},
    "target_t_0.25": {"target_temperature": 0.25},
    "target_t_0.1": {"target_temperature": 0.1},
    "norm_fc_out": {"norm_before_fc": True, "norm_output": True},
    "t0.25_minlr0.3": {"target_temperature": 0.25, "min_lr_ratio": 0.3},
    "decay_0.8": {"ttt_preset": "custom", "ttt_steps": 3, "loss_decay": 0.8},
    "decay_0.6": {"ttt_preset": "custom", "ttt_steps": 3, "loss_decay": 0.6},
    "k4": {"ttt_preset": "custom", "ttt_steps": 4, "loss_decay": 1.0},
    "lr_2e-2": {"learning_rate": 0.02},
    "lr_5e-3": {"learning_rate": 0.005},
    "min_lr_0": {"min_lr_ratio": 0.0},
    "min_lr_0.3": {"min_lr_ratio": 0.3},
    "warmup_30": {"warmup_steps": 30},
    "betas_999": {"adam_betas": [0.9, 0.999]},
    "clip_5": {"grad_clip": 5.0},
    "wd_0.01": {"weight_decay": 0.01},
    "aux_136": {"aux_layers": [1, 3, 6]},  # the high feature from layer L-2 instead of EAGLE-3's L-4
    "aux_146": {"aux_layers": [1, 4, 6]},
    "aux_137": {"aux_layers": [1, 3, 7]},  # the high feature from the last layer (L-1, before the final norm)
    "combo_137": {
        **COMBO,
        "aux_layers": [1, 3, 7],
    },
    "mlp_768": {"draft_intermediate_size": 768},  # 2x the toy target's 384
    "mlp_1536": {"draft_intermediate_size": 1536},
    "combo_aux_mlp_clip_betas": {
        **COMBO,
    },  # the small gains measured one by one, together
    "aux_clip_betas": {"aux_layers": [1, 3, 6], "grad_clip": 2.0, "adam_betas": [0.9, 0.999]},
    "aux_mlp768_clip_betas": {
        "aux_layers": [1, 3, 6],
        "draft_intermediate_size": 768,
        "grad_clip": 2.0,
        "adam_betas": [0.9, 0.999],
    },
    "aux_mlp1536": {"aux_layers": [1, 3, 6], "draft_intermediate_size": 1536},
    "combo_lr_1.5e-2": {
        **COMBO,
        "learning_rate": 0.015,
    },
    "combo_warmup_30": {
        **COMBO,
        "warmup_steps": 30,
    },
    "combo_k4": {
        **COMBO,
        "ttt_preset": "custom",
        "ttt_steps": 4,
        "loss_decay": 1.0,
    },
    "combo_t0.1": {
        **COMBO,
        "target_temperature": 0.1,
    },
    "combo_t0.1_mlp3072": {
        **COMBO,
        "draft_intermediate_size": 3072,
        "target_temperature": 0.1,
    },
    "lr_1.5e-2_clip_2": {"learning_rate": 0.015, "grad_clip": 2.0},
    "rows_4_half_steps": {"rows_per_batch": 4, "_steps_factor": 0.5},
    "muon": {"optimizer": "muon"},  # Muon on fc and the draft layer's matrices, AdamW on lm_head and norms
    "combo_muon": {
        **COMBO,
        "optimizer": "muon",
    },
    "combo_t0.1_muon": {
        **COMBO,
        "target_temperature": 0.1,
        "optimizer": "muon",
    },
    # keys starting with _ are the benchmark's, not 05's: _ema_decay trains as 05 does and swaps an exponential
    # moving average of the weights (updated after every optimizer step) into final/ (a measured prototype: 05
    # has no such param, since it did not raise tau)
    "combo_ema_0.99": {
        **COMBO,
        "_ema_decay": 0.99,
    },
}
# served-temperature recipes on top of params/toy.yaml (keys "shared.X" override its shared section): 05 trains
# a term per served temperature (eagle_lib/drafter/served.py); decode with --temperatures 0 1 to see both
SERVE_01 = {"shared.serve_temperatures": [0.0, 1.0], "shared.serve_top_p": 0.95}
ON_TOY = {
    # toy.yaml before the served recipe: the greedy term alone (what 05 trained before serve_temperatures)
    "greedy_only": {"shared.serve_temperatures": []},
    "serve_01_tv": SERVE_01,
    "serve_01_fkl": {**SERVE_01, "sampled_loss": "forward_kl"},
    "serve_01_lk": {**SERVE_01, "sampled_loss": "lk_hybrid"},
    "serve_01_tv_w3": {**SERVE_01, "serve_weights": [0.25, 0.75]},
    "serve_01_nla": {**SERVE_01, "sampled_loss": "nla"},
    "serve_01_nla_w3": {**SERVE_01, "sampled_loss": "nla", "serve_weights": [0.25, 0.75]},
    "serve_1_tv": {**SERVE_01, "shared.serve_temperatures": [1.0]},
    "serve_1_fkl": {**SERVE_01, "shared.serve_temperatures": [1.0], "sampled_loss": "forward_kl"},
    "serve_01_fkl_w3": {**SERVE_01, "sampled_loss": "forward_kl", "serve_weights": [0.25, 0.75]},
    # the greedy term sharpens the draft as it sharpens the target: softmax(z / 0.1) vs softmax(l / 0.1), whose
    # optimum (z = l) is the sampled term's too, where softmax(z) vs a sharpened target pulls q away from p_1
    "serve_01_fkl_gd": {**SERVE_01, "sampled_loss": "forward_kl", "greedy_draft_temperature": 0.1},
    "serve_01_fkl_gd_w3": {
        **SERVE_01,
        "sampled_loss": "forward_kl",
        "greedy_draft_temperature": 0.1,
        "serve_weights": [0.25, 0.75],
    },
}
# the MLA draft layer against the Llama-style one on the mini-Kimi world (``--params params/mini_kimi.yaml
# --run-dir outputs/mini_kimi``): its 05 section is the Kimi run's (vLLM producers, FSDP on 2 ranks, bf16, lr 1e-4,
# 2 epochs: a plumbing check that never leaves tau 1), so both arms train here on one CPU process from the HF
# target's own hidden states, in fp32, with the toy's optimizer settings, at the same steps and data
MINI_KIMI_CPU = {"hidden_source": "online", "nproc_per_node": 1, "precision": "fp32", "attention": "eager",
                 "checkpoint_steps": False, "loss_chunk": 0, "ttt_preset": "speculators", "learning_rate": 0.01,
                 "optimizer": "muon", "grad_clip": 2.0, "adam_betas": [0.9, 0.999], "warmup_steps": 10,
                 "target_temperature": 0.1, "max_eval_samples": 8}  # fmt: skip
ON_MINI_KIMI = {
    "kimi_gqa": {**MINI_KIMI_CPU, "draft_attention": "gqa"},  # the Llama-style layer (head_dim 64, 2 heads)
    "kimi_mla": {
        **MINI_KIMI_CPU,
        "draft_attention": "mla",
    },  # the target's latent attention (Eagle3DeepseekV2)
}
# "baseline" is params/toy.yaml itself (since the served recipe: serve_01_lk; before it greedy_only, and before
# that combo_t0.1_muon)
VARIANTS = {
    "baseline": {},
    **ON_TOY,
    **ON_MINI_KIMI,
    **{name: {**PREVIOUS, **over} for name, over in ON_PREVIOUS.items()},
}


@contextlib.contextmanager
def ema_weights(decay: float):
    """While active, 05's loop keeps an EMA of the trainable weights and leaves it in the model at the end
    (so the held-out table, final/ and the exports are the EMA's); measurements during training see the raw
    weights. decay 0: nothing changes."""
    import torch

    from eagle_lib.drafter import trainer

    if not decay:
        yield
        return
    loop = trainer.fit

    def with_ema(name, p, model, opts, *args, **kw):
        params = [q for q in model.parameters() if q.requires_grad]
        ema = [q.detach().clone() for q in params]
        last = opts[-1]  # the average is taken once every optimizer of the step has stepped
        step = last.step

        def step_and_average(*a, **k):
            out = step(*a, **k)
            with torch.no_grad():
                torch._foreach_lerp_(ema, [q.detach() for q in params], 1 - decay)
            return out

        last.step = step_and_average
        history = loop(name, p, model, opts, *args, **kw)
        with torch.no_grad():
            for q, e in zip(params, ema, strict=True):
                q.copy_(e)
        return history

    trainer.fit = with_ema
    try:
        yield
    finally:
        trainer.fit = loop


def parse_variant(spec: str) -> tuple[str, dict]:
    """A VARIANTS name, or ``name=key:value,key:value`` (values parsed as JSON, else strings)."""
    if "=" not in spec:
        if spec not in VARIANTS:
            sys.exit(f"unknown variant {spec!r}: choose from {sorted(VARIANTS)} or name=key:value,...")
        return spec, dict(VARIANTS[spec])
    name, body = spec.split("=", 1)
    over = {}
    for part in body.split(","):
        key, val = part.split(":", 1)
        try:
            over[key] = json.loads(val)
        except json.JSONDecodeError:
            over[key] = val
    return name, over


def stage_config(
    run_dir: Path,
    work: Path,
    steps: int,
    over: dict,
    measure_every: int,
    seed: int | None = None,
    params_file: Path = ROOT / "params" / "toy.yaml",
):
    import yaml

    from eagle_lib import params, train

    raw = yaml.safe_load(Path(params_file).read_text())
    stage = dict(raw["stages"]["05_train_eagle3"])
    factor = over.pop("_steps_factor", 1.0)
    over.pop("_ema_decay", None)
    stage.update(max_steps=max(1, round(steps * factor)), measure_every=measure_every, resume=False)
    shared_over = {k.split(".", 1)[1]: over.pop(k) for k in [k for k in over if k.startswith("shared.")]}
    stage.update(checkpoint_every=10**6, num_threads=1, **over)
    work.mkdir(parents=True, exist_ok=True)
    for d in ("data", "infer"):
        if not (work / d).exists():
            (work / d).symlink_to((run_dir / d).resolve())
    return params.StageConfig(
        "05_train_eagle3",
        work,
        params.SharedParams(**dict(raw["shared"], **shared_over, **({} if seed is None else {"seed": seed}))),
        train.Params(**stage),
    )


def seed_table(rows: list[dict], key: str = "tau") -> str:
    """Markdown table of the rows' tau (``key``: "tau" at T=0, or a `sampled_key`) per variant across seeds: per
    seed, mean, sample sd (n - 1; blank for one seed), and the mean paired difference to the first variant over
    the seeds both ran."""
    import math

    by: dict[str, dict[int, float]] = {}
    for r in rows:
        if key in r:
            by.setdefault(r["variant"], {})[r["seed"]] = r[key]
    first = next(iter(by), None)
    lines = ["| variant | tau per seed | mean | sd | minus the first variant |", "|---|---|---|---|---|"]
    for name, taus in by.items():
        v = list(taus.values())
        mean = sum(v) / len(v)
        sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None
        shared = [s for s in taus if s in by[first]]
        diff = sum(taus[s] - by[first][s] for s in shared) / len(shared) if shared and name != first else None
        per = ", ".join(f"{s}: {t:.3f}" for s, t in sorted(taus.items()))
        lines.append(
            f"| {name} | {per} | {mean:.3f} | {'' if sd is None else f'{sd:.3f}'} | "
            f"{'' if diff is None else f'{diff:+.3f} ({len(shared)} seeds)'} |"
        )
    return "\n".join(lines)


def sampled_key(temperature: float, mode: str) -> str:
    """The row key of tau at a sampled temperature with `mode` drafts (heldout_tau.Decoder.decode)."""
    return f"tau_T{temperature:g}_{mode}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default=str(ROOT / "outputs" / "toy"))
    ap.add_argument(
        "--params", default=str(ROOT / "params" / "toy.yaml"),
        help="the params file whose shared and 05 sections the variants override (its run's --run-dir)",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", nargs="+", default=["baseline"])
    ap.add_argument("--per-dataset", type=int, default=8, help="held-out prompts per dataset (06's default)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per prompt (06's toy value)")
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--measure-every", type=int, default=50, help="measured tau while training; 0: never")
    ap.add_argument("--out", default="/tmp/bench_recipe/results.jsonl")
    ap.add_argument("--keep", action="store_true", help="keep each variant's work directory")
    ap.add_argument(
        "--seeds", "--seed", type=int, nargs="+", default=[None],
        help="shared seeds (init, data order), each variant trained once per seed; default toy.yaml's",
    )  # fmt: skip
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0],
        help="also decode at these T > 0 (top_p --top-p), once per --draft-sampling mode",
    )
    ap.add_argument("--top-p", type=float, default=0.95, help="the target's nucleus at T > 0 (toy.yaml's)")
    ap.add_argument(
        "--draft-sampling",
        nargs="+",
        default=["greedy", "probabilistic"],
        help="EAGLE drafts at T > 0: greedy (argmax) | probabilistic (vLLM's draft_sample_method)",
    )
    ap.add_argument(
        "--reps", type=int, default=3, help="sampling seeds per prompt at T > 0 (their sums pool)"
    )
    a = ap.parse_args()
    run_dir = Path(a.run_dir)
    if not list(run_dir.glob("infer/*/responses.jsonl")):
        sys.exit(f"{run_dir}: no infer/*/responses.jsonl; run stages 01-03 first")
    sys.path.insert(0, str(ROOT))
    import torch
    import yaml

    from eagle_lib import models, params, train
    from eagle_lib.drafter.model import load_drafter
    from eagle_lib.serving import heldout_tau

    torch.set_num_threads(1)
    specs = [parse_variant(v) for v in a.variants]
    shared = params.SharedParams(**yaml.safe_load(Path(a.params).read_text())["shared"])
    target = models.load_target(shared, device="cpu")
    eos = models.stop_ids(models.load_tokenizer(shared), target)
    prompts, _ = heldout_tau.heldout_prompts(run_dir, shared.heldout_percent, a.per_dataset, 768)
    decoder = heldout_tau.Decoder(target, prompts, a.new_tokens, a.drafts, eos)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"{len(prompts)} held-out prompts x {a.new_tokens} tokens, {a.drafts} drafts, {a.steps} steps",
        flush=True,
    )
    rows = []
    # seed-major: every variant of a seed before the next seed, so an interrupted run leaves paired comparisons
    for seed, (name, over) in ((s, v) for s in a.seeds for v in specs):
        work = Path(tempfile.mkdtemp(prefix=f"recipe_{name}_", dir=out.parent))
        cfg = stage_config(run_dir, work, a.steps, dict(over), a.measure_every, seed, Path(a.params))
        t0 = time.perf_counter()
        with ema_weights(over.get("_ema_decay", 0.0)):
            summary = train.run(cfg)
        train_s = time.perf_counter() - t0
        drafter = load_drafter(work / "drafter" / "final")
        t1 = time.perf_counter()
        num, den = decoder.decode(drafter)
        tau = float(num.sum() / den.sum())
        sampled = {}
        for temp in (t for t in a.temperatures if t > 0):
            for mode in a.draft_sampling:
                n_, d_ = decoder.decode(drafter, temp, a.top_p, mode, a.reps)
                sampled[sampled_key(temp, mode)] = float(n_.sum() / d_.sum())
        log = [json.loads(x) for x in (work / "drafter" / "train_log.jsonl").read_text().splitlines()]
        curve = [(r["step"], round(r["measured_tau"], 3)) for r in log if "measured_tau" in r]
        row = {
            "variant": name,
            "overrides": over,
            "steps": cfg.stage.max_steps,
            "seed": cfg.shared.seed,
            "tau": tau,
            **sampled,
            "heldout_acc": summary["heldout"]["acc"],
            "measured_curve": curve,
            "train_s": train_s,
            "decode_s": time.perf_counter() - t1,
            "draft_cost_ratio": decoder.cost_ratio,  # s per drafter forward / s per target verify (CPU)
            "prompts": len(prompts),
        }
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        rows.append(row)
        acc = [round(x, 3) for x in row["heldout_acc"]]
        print(
            f"{name:24s} seed {row['seed']}  steps {row['steps']:4d}  tau {tau:.3f}  "
            + "".join(f"{k} {v:.3f}  " for k, v in sampled.items())
            + f"heldout acc {acc}  measured {curve}  "
            f"05 {train_s:.0f} s  draft/target step cost {decoder.cost_ratio:.2f}",
            flush=True,
        )
        if not a.keep:
            shutil.rmtree(work)
    print(f"\ntau at T=0 per seed ({len(prompts)} held-out prompts x {a.new_tokens} tokens, {a.steps} steps)")
    print(seed_table(rows))
    for key in dict.fromkeys(k for r in rows for k in r if k.startswith("tau_T")):
        print(f"\n{key} per seed (top_p {a.top_p}, {a.reps} sampling seeds a prompt)")
        print(seed_table(rows, key))


if __name__ == "__main__":
    main()
