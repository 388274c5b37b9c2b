"""Stage 06_eval_acceptance: the drafter's acceptance length, measured losslessly per dataset, offline and online.

Offline (:mod:`eagle_lib.serving.specdec`): every held-out prompt is decoded greedily by the target with each method
(``none`` = plain greedy, ``ngram`` = prompt lookup, ``eagle3`` = our drafter), k drafts per step verified by
one target forward; every method's output must equal ``none``'s token for token (``lossless``).
Per method and dataset: tau = mean(accepted + 1) per target step, per-position acceptance (unconditional
P(a >= i) and conditional P(a >= i | a >= i-1)), the distribution of accepted lengths, measured seconds per
token, the drafter/target forward-cost ratio and the speedup it implies, tau / (1 + ratio * k).

Online: the same prompts against a server with the drafter loaded — vLLM (``/metrics`` counters: tau = 1 +
accepted / drafts) or SGLang (``meta_info``: completion_tokens / spec_verify_ct, which also counts the
prefill token, so it is set beside the offline tokens per step) — compared with the offline number and
diagnosed (:func:`eagle_lib.serving.preflight.diagnose`). Preflight checks the exported drafter before that.

Writes ``eval/``: tau.csv, positions.csv, accepted_hist.csv, generations.jsonl, online.json, preflight.json,
plots, meta.json.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pandas as pd
from pydantic import model_validator

from eagle_lib import models, params, store
from eagle_lib.serving import export, preflight, specdec
from eagle_lib.serving.specdec import Prompt, cost_ratio, tables

Method = Literal["none", "ngram", "eagle3"]


class Params(params.Strict):
    """06_eval_acceptance parameters."""

    max_prompts_per_dataset: int = 8  # held-out prompts decoded per dataset
    max_prompt_tokens: int = 768  # longer prompts are skipped (counted as dropped 'too_long')
    a_prompt: Literal["last_turn", "first_turn"] = "last_turn"  # A records: prompt before this assistant turn
    eval_max_new_tokens: int = 64  # tokens generated per held-out prompt while measuring tau
    num_steps: int = 3  # drafts per step (SGLang --speculative-num-steps, vLLM num_speculative_tokens)
    topk: int = 1  # draft tree width in the launch commands; offline decoding is a chain (topk 1)
    num_draft_tokens: int = 4  # SGLang --speculative-num-draft-tokens (num_steps + 1 for topk 1)
    methods: list[Method] = ["none", "ngram", "eagle3"]  # offline methods; 'none' is the lossless reference
    ngram_max: int = 3  # longest suffix the n-gram (prompt lookup) proposer matches
    ngram_min: int = 1  # shortest suffix it falls back to
    offline: bool = True  # decode with the target here (False: a target too large to run here; online only)
    drafter_dir: str = ""  # drafter to evaluate; empty = <run_dir>/drafter/final
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # when 06 exports the drafter itself
    step_cost_ratio: float = 0.0  # drafter/target forward cost for the speedup estimate; 0 = measured offline
    serve_tp: int = 1  # tensor parallel size in the printed launch commands
    sglang_cmd: str = ""  # the intended SGLang launch command to preflight; empty = the generated one
    online_engine: Literal["none", "vllm", "sglang"] = "none"  # measure tau on a server too
    online_url: str = ""  # running server's base URL; empty with vllm = start a local vLLM CPU server
    online_model: str = ""  # served model name (OpenAI API); empty = the first of /v1/models
    online_format: Literal["sglang", "speculators"] = "speculators"  # export a local vLLM server loads
    online_max_prompts: int = 8  # prompts per dataset sent online (the first of the offline ones)
    online_concurrency: int = 4  # parallel requests
    online_timeout_s: float = 600.0  # per request
    online_tolerance: float = 0.2  # |online - offline| tau allowed before the report flags a disagreement

    @model_validator(mode="after")
    def _consistent(self):
        if min(self.num_steps, self.topk, self.eval_max_new_tokens, self.max_prompts_per_dataset) < 1:
            raise ValueError("num_steps, topk, eval_max_new_tokens and max_prompts_per_dataset must be >= 1")
        if self.offline and "none" not in self.methods:
            raise ValueError("methods must include 'none', the lossless greedy reference")
        if not self.offline and self.online_engine == "none":
            raise ValueError("offline: false needs an online_engine, or there is nothing to measure")
        if self.online_engine == "sglang" and not self.online_url:
            raise ValueError("online_engine 'sglang' needs online_url (a running server)")
        return self


@dataclass
class Eval:
    """What the notebook shows: tables, preflight reports, online comparison and the headline numbers."""

    tau: pd.DataFrame
    positions: pd.DataFrame
    hist: pd.DataFrame
    preflight: list[dict] = field(default_factory=list)
    online: pd.DataFrame | None = None
    headline: dict = field(default_factory=dict)
    out_dir: Path = Path(".")


# --- held-out prompts ---------------------------------------------------------------------------------
def a_prompt_ids(rec: dict, mode: str) -> list[int] | None:
    """Prompt of an A record: tokens before the first / the last run of loss-masked tokens (None if none)."""
    mask = rec["loss_mask"]
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    start = (starts[0] if mode == "first_turn" else starts[-1]) if starts else 0
    return list(rec["input_ids"][:start]) if start else None


def heldout_prompts(run_dir: Path, percent: float, p: Params) -> tuple[dict[str, list[Prompt]], dict]:
    """Held-out prompts per dataset (A records and B prompts whose id is held out), capped; and the tally."""
    files = sorted((run_dir / "data" / "A").glob("*/records.jsonl")) + sorted(
        (run_dir / "data" / "B").glob("*/prompts.jsonl")
    )
    names = [f.parent.name for f in files]
    out, tally = {}, {"read": 0, "kept": 0, "dropped": Counter(), "rejected": 0}
    for f in files:
        kind, ds = f.parent.parent.name, f.parent.name
        label = ds if names.count(ds) == 1 else f"{kind}/{ds}"
        for n, rec in enumerate(store.iter_jsonl(f), 1):
            tally["read"] += 1
            try:
                why = _keep(rec, kind, percent, p, out.setdefault(label, []))
            except (KeyError, TypeError, IndexError) as e:
                raise store.RecordError(f"{f}: record {n} (id {rec.get('id')!r}): malformed, {e!r}") from None
            if why:
                tally["dropped"][why] += 1
            else:
                out[label].append(Prompt(str(rec["id"]), label, _prompt_of(rec, kind, p)))
                tally["kept"] += 1
    tally["dropped"] = dict(tally["dropped"])
    return {k: v for k, v in out.items() if v}, tally


def _prompt_of(rec: dict, kind: str, p: Params) -> list[int] | None:
    return a_prompt_ids(rec, p.a_prompt) if kind == "A" else list(rec["prompt_ids"])


def _keep(rec: dict, kind: str, percent: float, p: Params, kept: list) -> str | None:
    """None to keep the record, else the reason it is dropped."""
    if not store.is_heldout(rec["id"], percent):
        return "not_heldout"
    ids = _prompt_of(rec, kind, p)
    if not ids:
        return "no_prompt"
    if len(ids) > p.max_prompt_tokens:
        return "too_long"
    return "over_cap" if len(kept) >= p.max_prompts_per_dataset else None


# --- offline decoding ---------------------------------------------------------------------------------
def proposer_for(method: str, p: Params, drafter):
    if method == "none":
        return specdec.NoProposer()
    if method == "ngram":
        return specdec.NgramProposer(p.ngram_max, p.ngram_min)
    return specdec.EagleProposer(drafter)


def decode_offline(
    target, drafter, prompts: dict[str, list[Prompt]], p: Params, eos_ids: list[int], out: Path
):
    """Every method on every prompt; appends records to out (JSONL) and returns them."""
    gens = []
    methods = ["none"] + [m for m in p.methods if m != "none"]
    runners = {
        False: specdec.TargetRunner(target),
        True: specdec.TargetRunner(target, drafter.config.aux_layers),
    }
    for ds, ps in prompts.items():
        for pr in ps:
            ref = None
            for m in methods:
                prop = proposer_for(m, p, drafter)
                g = specdec.speculative_generate(
                    runners[prop.needs_features], prop, pr.prompt_ids, p.eval_max_new_tokens, p.num_steps, eos_ids
                )
                ref = g.output_ids if m == "none" else ref
                rec = {
                    "method": m,
                    "dataset": ds,
                    "id": pr.id,
                    "n_prompt": len(pr.prompt_ids),
                    "lossless": g.output_ids == ref,
                    **vars(g),
                }
                store.append_jsonl(out, [rec], fsync=False)
                gens.append(rec)
    return gens


def eos_ids(tokenizer, target) -> list[int]:
    """Stop ids: the tokenizer's EOS plus the target's generation_config EOS (int or list)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gc = getattr(target, "generation_config", None)
    extra = getattr(gc, "eos_token_id", None) if gc is not None else None
    ids |= set(extra if isinstance(extra, list) else [] if extra is None else [extra])
    return sorted(ids)


def compare_online(
    online: dict[str, dict], tau: pd.DataFrame, gens: list[dict], engine: str, tol: float
) -> pd.DataFrame:
    """Online tau beside the offline eagle3 tau per dataset and pooled ('all'), the greedy-output check and
    the diagnosis. vLLM's tau is set beside the offline tau; SGLang's (tokens / verify steps) beside the
    offline tokens per step."""
    col = "tau" if engine == "vllm" else "tokens_per_step"
    off = tau[tau.method == "eagle3"].set_index("dataset")[col] if len(tau) else pd.Series(dtype=float)
    ref = {(r["dataset"], r["id"]): r["output_ids"] for r in gens if r["method"] == "none"}
    same = {
        ds: [_prefix_equal(ids, ref[(ds, i)]) for i, ids in o["outputs"].items() if (ds, i) in ref]
        for ds, o in online.items()
    }
    same["all"] = [x for v in same.values() for x in v]
    taus = {ds: o["tau"] for ds, o in online.items()} | {"all": _overall_online(online, engine)}
    rows = []
    for ds, t in taus.items():
        off_tau = float(off[ds]) if ds in off.index else None
        diag = preflight.diagnose(off_tau, t, tol)
        eq = sum(same[ds]) / len(same[ds]) if same[ds] else float("nan")
        rows.append(
            {
                "dataset": ds,
                "engine": engine,
                "online_tau": t,
                "offline": off_tau,
                "greedy_equal": eq,
                "verdict": diag["verdict"],
                "message": diag["message"],
                "causes": diag["causes"],
            }
        )
    return pd.DataFrame(rows)


def _prefix_equal(a: list[int], b: list[int]) -> bool:
    """Equal on the common length (a server may stop on other stop ids or trim the stop token)."""
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def _online(
    p: Params, shared, exports: dict[str, Path], prompts: dict[str, list[Prompt]], out: Path, max_pos: int
):
    """Raw online results per dataset: a given server, or a local vLLM CPU server on the exported drafter."""
    conc = (p.online_concurrency, p.online_timeout_s)
    vargs = (p.num_steps, *conc)
    if p.online_engine == "sglang":
        return specdec.online_sglang(p.online_url.rstrip("/"), prompts, p.eval_max_new_tokens, *conc)
    if p.online_url:
        return specdec.online_vllm(
            p.online_url.rstrip("/"), p.online_model, prompts, p.eval_max_new_tokens, *vargs
        )
    from eagle_lib.engines.vllm_server import start_vllm

    spec = {"method": "eagle3", "model": str(exports[p.online_format]), "num_speculative_tokens": p.num_steps}
    max_len = min(max_pos, p.max_prompt_tokens + p.eval_max_new_tokens + 2 * p.num_steps + 8)
    with start_vllm(
        models.resolve(shared.target),
        extra_args=["--speculative-config", json.dumps(spec)],
        tokenizer=models.resolve(shared.tokenizer_path),
        max_model_len=max_len,
        log_dir=out / "vllm",
    ) as srv:
        return specdec.online_vllm(srv.base_url, srv.model, prompts, p.eval_max_new_tokens, *vargs)


def _overall_online(raw: dict[str, dict], engine: str) -> float:
    if engine == "vllm":
        drafts = sum(o["drafts"] for o in raw.values())
        return 1 + sum(o["accepted"] for o in raw.values()) / drafts if drafts else float("nan")
    verify = sum(o["spec_verify_ct"] for o in raw.values())
    return sum(o["completion_tokens"] for o in raw.values()) / verify if verify else float("nan")


def ensure_exports(cfg: params.StageConfig, drafter_dir: Path, tcfg: dict, load) -> dict[str, Path]:
    """Stage 05's exports when complete, else export the drafter (load()) into eval/export/ (both formats)."""
    made = {f: cfg.out("drafter", "export", f) for f in export.FORMATS}
    if all((d / export.CONFIG).exists() and (d / export.WEIGHTS).exists() for d in made.values()):
        return made
    arch = list(tcfg.get("architectures") or ["LlamaForCausalLM"])
    verifier = models.resolve(cfg.shared.target)
    return export.export_all(
        load(), cfg.out("eval", "export"), verifier, arch, cfg.stage.num_steps, cfg.stage.export_dtype
    )


def headline(tau: pd.DataFrame, pf: list[dict], online: pd.DataFrame | None, p: Params) -> dict:
    """The numbers report.record keeps: taus, per-position acceptance, speedups, losslessness, checks."""
    h: dict = {"preflight_ok": all(r["ok"] for r in pf)}
    k = p.num_steps
    if len(tau):
        allr = tau[tau.dataset == "all"].set_index("method")
        h["lossless"] = bool(tau.lossless.all())
        h["prompts"] = int(allr.prompts.iloc[0])
        for m in allr.index:
            h[f"tau_{m}"] = float(allr.loc[m, "tau"])
        if "eagle3" in allr.index:
            e = allr.loc["eagle3"]
            h["acc_eagle3"] = [float(e[f"acc_{i}"]) for i in range(1, k + 1)]
            h["cond_acc_eagle3"] = [float(e[f"cond_acc_{i}"]) for i in range(1, k + 1)]
            h["est_speedup_eagle3"] = float(e.est_speedup)
            h["measured_speedup_eagle3"] = float(e.measured_speedup)
            per = tau[(tau.method == "eagle3") & (tau.dataset != "all")]
            h["tau_eagle3_by_dataset"] = dict(zip(per.dataset, per.tau.astype(float), strict=True))
    if online is not None:
        allr = online.set_index("dataset").loc["all"]
        per = online[online.dataset != "all"]
        h["online_tau"] = float(allr.online_tau)
        h["online_tau_by_dataset"] = dict(zip(per.dataset, per.online_tau.astype(float), strict=True))
        h["online_verdicts"] = dict(zip(per.dataset, per.verdict, strict=True))
        h["online_greedy_equal"] = float(allr.greedy_equal)
        h["online_verdict"] = {key: allr[key] for key in ("verdict", "message", "causes")}
    return h


def _models(cfg: params.StageConfig, drafter_dir: Path):
    """(target or None, drafter or None, target text config dict): loaded only when decoding offline."""
    from eagle_lib.drafter.model import load_drafter

    if not cfg.stage.offline:
        return None, None, preflight.target_text_config(cfg.shared.target, cfg.shared.trust_remote_code)
    target = models.load_target(cfg.shared)
    drafter = load_drafter(drafter_dir, device=target.device)
    return target, drafter, preflight.text_config_dict(target.config)


def preflight_all(exports: dict[str, Path], cfg: params.StageConfig, tcfg: dict) -> list[dict]:
    """Preflight every export against the target and the intended commands."""
    p, sh = cfg.stage, cfg.shared
    launch = {
        "num_steps": p.num_steps,
        "topk": p.topk,
        "num_draft_tokens": p.num_draft_tokens,
        "tp": p.serve_tp,
    }
    trained = _trained_aux(Path(p.drafter_dir) if p.drafter_dir else cfg.out("drafter", "final"))
    args = (sh.target, p.sglang_cmd, None, sh.trust_remote_code, tcfg, trained)
    return [preflight.preflight(d, *args, **launch).to_dict() for d in exports.values()]


def _trained_aux(drafter_dir: Path) -> list[int] | None:
    """The aux layers in the trained drafter's own config (drafter_config.json), if there is one."""
    from eagle_lib.drafter.model import CONFIG_FILE

    f = drafter_dir / CONFIG_FILE
    return json.loads(f.read_text())["config"]["aux_layers"] if f.exists() else None


def run(cfg: params.StageConfig) -> Eval:
    """The whole stage: held-out prompts, exports + preflight, offline decoding, online check, files."""
    from eagle_lib.drafter.model import load_drafter

    p, shared, started, out = cfg.stage, cfg.shared, time.time(), cfg.out("eval")
    out.mkdir(parents=True, exist_ok=True)
    prompts, tally = heldout_prompts(cfg.run_dir, shared.heldout_percent, p)
    if not prompts:
        raise ValueError(
            f"{cfg.run_dir / 'data'}: no held-out prompts (heldout_percent={shared.heldout_percent}); "
            f"dropped: {tally['dropped']}"
        )
    drafter_dir = Path(p.drafter_dir) if p.drafter_dir else cfg.out("drafter", "final")
    target, drafter, tcfg = _models(cfg, drafter_dir)
    exports = ensure_exports(cfg, drafter_dir, tcfg, lambda: drafter or load_drafter(drafter_dir))
    pf = preflight_all(exports, cfg, tcfg)
    store.write_json(out / "preflight.json", pf)
    gens: list[dict] = []
    if p.offline:
        (out / "generations.jsonl").unlink(missing_ok=True)
        eos = eos_ids(models.load_tokenizer(shared), target)
        gens = decode_offline(target, drafter, prompts, p, eos, out / "generations.jsonl")
    ratio = p.step_cost_ratio or cost_ratio(gens)
    tau, pos, hist = tables(gens, p.num_steps, ratio) if gens else (pd.DataFrame(),) * 3
    for name, df in (("tau", tau), ("positions", pos), ("accepted_hist", hist)):
        df.to_csv(out / f"{name}.csv", index=False)
    online = None
    if p.online_engine != "none":
        sub = {ds: ps[: p.online_max_prompts] for ds, ps in prompts.items()}
        raw = _online(p, shared, exports, sub, out, int(tcfg.get("max_position_embeddings", 4096)))
        online = compare_online(raw, tau, gens, p.online_engine, p.online_tolerance)
        store.write_json(out / "online.json", {"engine": p.online_engine, "datasets": raw})
    h = {**headline(tau, pf, online, p), "cost_ratio": ratio}
    done = time.time()
    meta = {
        **tally,
        "params": p.model_dump(),
        "drafter_dir": str(drafter_dir),
        "headline": h,
        "exports": {k: str(v) for k, v in exports.items()},
        "started": started,
        "finished": done,
        "seconds": done - started,
    }
    store.check_tally(meta, str(out / "meta.json"))
    store.write_json(out / "meta.json", meta)
    return Eval(tau, pos, hist, pf, online, h, out)


# --- what the notebook shows ----------------------------------------------------------------------------
def tau_summary(ev: Eval) -> pd.DataFrame:
    """tau per dataset (rows) and method (columns), with the number of prompts and losslessness."""
    if not len(ev.tau):
        return pd.DataFrame()
    t = ev.tau.pivot(index="dataset", columns="method", values="tau")
    t.insert(0, "prompts", ev.tau.groupby("dataset").prompts.max())
    t["lossless"] = ev.tau.groupby("dataset").lossless.all()
    return t.loc[sorted(t.index, key=lambda d: (d == "all", d))]


def baseline_table(ev: Eval) -> pd.DataFrame:
    """All datasets pooled, one row per method: tau, measured and estimated speedup, seconds per token."""
    cols = [
        "method",
        "tau",
        "tokens_per_step",
        "measured_speedup",
        "est_speedup",
        "s_per_token",
        "steps",
        "tokens",
    ]
    return ev.tau[ev.tau.dataset == "all"][cols].set_index("method") if len(ev.tau) else pd.DataFrame()


def preflight_table(ev: Eval) -> pd.DataFrame:
    """One row per preflight check of every export (format, check, ok, severity, message)."""
    return pd.DataFrame([{"format": r["format"], **c} for r in ev.preflight for c in r["checks"]])


def launch_text(ev: Eval) -> str:
    """The launch commands preflight printed, per export format."""
    return "\n\n".join(
        f"[{r['format']}] {name}:\n{cmd}" for r in ev.preflight for name, cmd in r["commands"].items()
    )


def plot_positions(ev: Eval):
    """Per-position acceptance of eagle3 (unconditional, conditional), one line per dataset, all pooled in black
    and the n-gram baseline dashed; saved as PNG."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    pos = ev.positions if len(ev.positions) else pd.DataFrame(columns=["method", "dataset", "position"])
    titles = {"acc": "P(draft i accepted)", "cond_acc": "P(draft i accepted | drafts < i accepted)"}
    for ax, (col, title) in zip(axes, titles.items(), strict=True):
        for (m, ds), g in pos[pos.method.isin(["eagle3", "ngram"])].groupby(["method", "dataset"]):
            if m == "ngram" and ds != "all":
                continue
            style = {"lw": 3, "color": "k"} if ds == "all" and m == "eagle3" else {"lw": 1}
            style = {"ls": "--", "color": "grey"} if m == "ngram" else style
            ax.plot(
                g.position, g[col], marker="o", label=f"{ds}" if m == "eagle3" else "ngram (all)", **style
            )
        ax.set(title=title, xlabel="draft position", ylim=(0, 1), xticks=sorted(pos.position.unique()))
    axes[0].set_ylabel("acceptance")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(ev.out_dir / "positions.png", dpi=110)
    plt.close(fig)  # shown once, as the cell's value
    return fig


def plot_datasets(ev: Eval):
    """tau per dataset and method as grouped bars, the server's tau as one more bar when measured; saved as PNG."""
    import matplotlib.pyplot as plt

    t = tau_summary(ev).drop(columns=["prompts", "lossless"], errors="ignore")
    t = t[[m for m in ("none", "ngram", "eagle3") if m in t.columns]]
    if ev.online is not None and len(t):
        t[f"eagle3 online ({ev.online.engine.iloc[0]})"] = ev.online.set_index("dataset").online_tau
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(t) + 2), 4))
    if len(t):
        t.plot.bar(ax=ax, rot=30)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set(ylabel="tau (accepted + 1 per target step)", xlabel="")
    ax.axhline(1.0, color="grey", lw=0.8)
    fig.tight_layout()
    fig.savefig(ev.out_dir / "tau_by_dataset.png", dpi=110)
    plt.close(fig)  # shown once, as the cell's value
    return fig
