"""Stage 06_eval_acceptance: the drafter's acceptance length as it will be served — greedy and sampled, per dataset,
per context length, offline and online.

Offline (:mod:`eagle_lib.decoding.specdec`): every prompt is decoded by the target with each method (``none`` =
plain decoding, ``ngram`` = prompt lookup, ``eagle3`` = our drafter), k drafts per step verified by one target
forward, at each temperature in ``temperatures`` (0 = greedy; > 0 = the target's sampling with top_p / top_k,
verified by the speculative accept/reject rule, :mod:`eagle_lib.decoding.sampling`). At T=0 every method's
output must equal ``none``'s token for token (``lossless``); at T>0 the output distribution is the target's
(proved by tests/unit/test_specdec.py). Prompts: the run's held-out A/B records plus ``eval_sets`` (MT-Bench,
GSM8K, HumanEval, MATH500, SPEED-Bench by hub id or file, :mod:`eagle_lib.data.evalsets`), rendered with the
target's chat template.

Reported per method x temperature x dataset (:mod:`eagle_lib.serving.tables`): tau (drafts that end up in the
output + 1 per target step), per-position acceptance, accepted-length histograms, tau by context-length bucket
(prompt + generated, ``context_buckets``), seconds per token and the speedup implied by the measured
drafter/target cost ratio, tau / (1 + ratio * k).

Online (:mod:`eagle_lib.serving.online`): the same prompts at the same temperatures against a server with the
drafter loaded, compared with the offline numbers and diagnosed; the server's own account of its speculative
settings is checked too (:mod:`eagle_lib.serving.live`). Preflight checks the exported drafter first.

Writes ``eval/``: tau.csv, positions.csv, accepted_hist.csv, context.csv, generations.jsonl, online.csv, online_context.csv,
online.json, preflight.json, live_preflight.json, plots, meta.json.
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pandas as pd
from pydantic import model_validator

from eagle_lib import forked, params, progress, store
from eagle_lib.data import evalsets
from eagle_lib.data.evalsets import Prompt
from eagle_lib.engines import machine

if TYPE_CHECKING:
    from eagle_lib.decoding.sampling import Sampler

Method = Literal["none", "ngram", "eagle3", "oracle"]  # oracle: the target's own argmax drafts, T > 0 only
# tqdm.auto (imported by transformers while the target loads) warns on stderr in a kernel without ipywidgets:
# noise in the executed report
warnings.filterwarnings("ignore", message="IProgress not found")


class Params(params.Strict):
    """06_eval_acceptance parameters."""

    max_prompts_per_dataset: int = 8  # held-out prompts decoded per dataset
    max_prompt_tokens: int = 768  # longer prompts are skipped (counted as dropped 'too_long')
    a_prompt: Literal["last_turn", "first_turn"] = "last_turn"  # A records: prompt before this assistant turn
    eval_max_new_tokens: int = 64  # tokens generated per held-out prompt while measuring tau
    stop_token_ids: list[int] = []  # empty: the target's (generation config, as 03); others: decode past them
    num_steps: int = 3  # drafts per step (SGLang --speculative-num-steps, vLLM num_speculative_tokens)
    topk: int = 1  # draft tree width in the launch commands; offline decoding is a chain (topk 1)
    num_draft_tokens: int = 4  # SGLang --speculative-num-draft-tokens (num_steps + 1 for topk 1)
    methods: list[Method] = ["none", "ngram", "eagle3"]  # offline methods; 'none' is the lossless reference
    temperatures: list[float] = []  # 0 = greedy; empty: shared.serve_temperatures (empty too: [0.0, 1.0])
    sampled_methods: list[Method] = ["none", "ngram", "eagle3"]  # decoded at T > 0 (none: speed baseline)
    sampled_max_prompts: int = 0  # prompts per dataset decoded at T > 0 (the first ones); 0 = all
    # offline decodes side by side, in forked processes on 06's threads each (eagle_lib/forked.py; the same
    # generations bit for bit): 1 = in this process; 0 = as many as the cores allow (within EAGLE_MAX_THREADS)
    decode_processes: int = 1
    top_p: float = 0.0  # the target's sampling at T > 0; 0: shared.serve_top_p; 1.0 = off
    top_k: int = 0  # the target's top-k at T > 0; 0 = off
    draft_sampling: Literal["greedy", "probabilistic"] = (
        "greedy"  # eagle3 drafts at T > 0: argmax (SGLang; vLLM's default) | probabilistic (vLLM's opt-in
        # draft_sample_method: drawn from softmax(draft logits / T), no top-p; sampling.draft_sampler)
    )
    context_buckets: list[int] = [
        1024,
        4096,
        16384,
    ]  # tau by prompt + generated length: <1k, 1-4k, 4-16k, >=16k
    eval_sets: list[
        evalsets.EvalSet
    ] = []  # standard prompt sets: {name, path, schema, config, split, max_prompts}
    reference_text: str = ""  # published reference points for this target (text with sources) shown beside
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
    online_temperatures: list[float] = []  # temperatures measured online; empty = the same as temperatures
    online_concurrency: int = 4  # parallel requests
    online_speed: bool = (
        False  # vllm (local): serve the same requests without the drafter too, tokens/s of both
    )
    online_timeout_s: float = 600.0  # per request
    online_tolerance: float = 0.2  # |online - offline| tau allowed before the report flags a disagreement
    online_api_key_env: str = (
        ""  # NAME of the variable holding the server's --api-key (sent as a Bearer token)
    )
    llamacpp: bool = False  # also serve the drafter in llama.cpp beside the GGUF target (make llamacpp-env)

    @model_validator(mode="after")
    def _consistent(self):
        if min(self.num_steps, self.topk, self.eval_max_new_tokens, self.max_prompts_per_dataset) < 1:
            raise ValueError("num_steps, topk, eval_max_new_tokens and max_prompts_per_dataset must be >= 1")
        if self.decode_processes < 0:
            raise ValueError(
                f"decode_processes must be >= 0 (0: as the cores allow; got {self.decode_processes})"
            )
        if self.offline and "none" not in self.methods:
            raise ValueError("methods must include 'none', the lossless greedy reference")
        if not self.offline and self.online_engine == "none":
            raise ValueError("offline: false needs an online_engine, or there is nothing to measure")
        if self.online_engine == "sglang" and not self.online_url:
            raise ValueError("online_engine 'sglang' needs online_url (a running server)")
        temps = self.temperatures + self.online_temperatures
        if min(temps, default=0) < 0 or len(set(self.temperatures)) < len(self.temperatures):
            raise ValueError(f"temperatures must be distinct and >= 0 (got {self.temperatures})")
        if not 0 <= self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"need 0 < top_p <= 1 (0: serve_top_p) and top_k >= 0 (got {self.top_p}, {self.top_k})"
            )
        if (
            self.context_buckets != sorted(set(self.context_buckets))
            or min(self.context_buckets, default=1) < 1
        ):
            raise ValueError(
                f"context_buckets must be increasing positive lengths (got {self.context_buckets})"
            )
        return self

    def served(self, shared: params.SharedParams) -> Params:
        """These params with the serving settings they leave to the shared ones filled in: empty temperatures
        take ``serve_temperatures`` (empty too: [0.0, 1.0]), top_p 0 takes ``serve_top_p``."""
        temps = self.temperatures or list(shared.serve_temperatures) or [0.0, 1.0]
        return self.model_copy(update={"temperatures": temps, "top_p": self.top_p or shared.serve_top_p})

    @property
    def online_temps(self) -> list[float]:
        return self.online_temperatures or self.temperatures


@dataclass
class Eval:
    """What the notebook shows: tables, preflight reports, online comparison, the answer and headline numbers."""

    tau: pd.DataFrame
    positions: pd.DataFrame
    hist: pd.DataFrame
    context: pd.DataFrame = field(default_factory=pd.DataFrame)
    preflight: list[dict] = field(default_factory=list)
    online: pd.DataFrame | None = None
    live: list[dict] = field(default_factory=list)  # checks of the running server's own settings
    headline: dict = field(default_factory=dict)
    answer: str = ""
    reference_text: str = ""
    out_dir: Path = Path(".")
    starts: pd.DataFrame = field(default_factory=pd.DataFrame)  # first drafts by how their cycle started


# --- held-out prompts ---------------------------------------------------------------------------------
def heldout_prompts(run_dir: Path, percent: float, p: Params) -> tuple[dict[str, list[Prompt]], dict]:
    """Held-out prompts per dataset, capped (`evalsets.heldout_prompts`, which 07 decodes too); and the tally."""
    return evalsets.heldout_prompts(
        run_dir, percent, p.max_prompts_per_dataset, p.max_prompt_tokens, p.a_prompt
    )


def eval_set_prompts(p: Params, tokenizer) -> tuple[dict[str, list[Prompt]], dict, list[dict]]:
    """The eval sets' first-turn prompts per set name (rendered with the target's chat template), each set's
    tally, and the rows with later turns (``turns: all``) for `later_turn_prompts`."""
    out, tallies, multi = {}, {}, []
    for es in p.eval_sets:
        rows, tallies[es.name] = evalsets.read(es, tokenizer, p.max_prompt_tokens)
        out[es.name] = [Prompt(r["id"], es.name, r["prompt_ids"]) for r in rows]
        multi += [r for r in rows if r.get("later_turns")]
        tallies[es.name]["rows"] = rows  # for the contamination check (popped before meta.json)
    return out, tallies, multi


def later_turn_prompts(multi: list[dict], tokenizer, target, p: Params, eos: list[int]):
    """Prompts of the later turns (`evalsets.followups`), each after the target's greedy answers to the turns
    before it (eval_max_new_tokens long, as 06 decodes); and their tally."""
    from eagle_lib.decoding import specdec

    runner = specdec.TargetRunner(target)

    def answer(ids: list[int]) -> list[int]:
        return specdec.speculative_generate(
            runner, specdec.NoProposer(), ids, p.eval_max_new_tokens, p.num_steps, eos
        ).output_ids

    return evalsets.followups(multi, tokenizer, answer, p.max_prompt_tokens)


# --- offline decoding ---------------------------------------------------------------------------------
def proposer_for(method: str, p: Params, drafter, sampler: Sampler | None = None, target=None):
    from eagle_lib.decoding import specdec

    if method == "oracle":  # at T > 0: the ceiling of greedy drafting (engines draft the argmax)
        return specdec.OracleProposer(target)
    if method == "none":
        return specdec.NoProposer()
    if method == "ngram":
        return specdec.NgramProposer(p.ngram_max, p.ngram_min)
    from eagle_lib.decoding.sampling import draft_sampler

    seed, temp = (sampler.seed, sampler.temperature) if sampler is not None else (0, 0.0)
    return specdec.EagleProposer(drafter, draft_sampler(p.draft_sampling, temp, seed))


def sampler_for(p: Params, temperature: float, seed: int, pr: Prompt, salt: str = "") -> Sampler:
    """The target's sampling for one prompt, seeded by (seed, temperature, dataset, id): reruns repeat it."""
    from eagle_lib.decoding.sampling import Sampler

    key = int(store.stable_hash([seed, temperature, pr.dataset, pr.id, salt], 8), 16)
    return Sampler(temperature, p.top_p if temperature else 1.0, p.top_k if temperature else 0, key)


def decode_offline(
    target, drafter, prompts: dict[str, list[Prompt]], p: Params, eos_ids: list[int], out: Path, seed: int = 0
):
    """Every method on every prompt at every temperature; appends records to out (JSONL) and returns them. The
    prompts (each with all its methods) are decoded by `offline_processes(p)` forked processes, in the order and
    with the bits one process gives (each run is seeded by its prompt alone)."""
    from eagle_lib.decoding import specdec

    methods = ["none"] + [m for m in p.methods if m != "none"]
    runners = {
        False: specdec.TargetRunner(target),
        True: specdec.TargetRunner(target, drafter.config.aux_layers) if drafter is not None else None,
    }
    jobs = []  # (temperature, methods, dataset, prompt), in the order one process decodes them
    for temp in sorted(p.temperatures):
        # the oracle accepts everything at T = 0 (nothing to learn, k target passes a step): sampled only
        todo = (
            [m for m in methods if m != "oracle"]
            if temp == 0
            else [m for m in methods if m in p.sampled_methods]
        )
        cap = p.sampled_max_prompts if temp > 0 and p.sampled_max_prompts else None
        jobs += [(temp, todo, ds, pr) for ds, ps in prompts.items() for pr in ps[:cap]]

    def one(i: int) -> list[dict]:
        temp, todo, ds, pr = jobs[i]
        recs, ref = [], None
        for m in todo:
            prop = proposer_for(m, p, drafter, sampler_for(p, temp, seed, pr, "draft"), target)
            g = specdec.speculative_generate(
                runners[prop.needs_features], prop, pr.prompt_ids, p.eval_max_new_tokens,
                p.num_steps, eos_ids, sampler_for(p, temp, seed, pr),
            )  # fmt: skip
            ref = g.output_ids if m == "none" else ref
            recs.append({
                "method": m,
                "temperature": temp,
                "dataset": ds,
                "id": pr.id,
                "n_prompt": len(pr.prompt_ids),
                "lossless": g.output_ids == ref if temp == 0 else None,
                **vars(g),
            })  # fmt: skip
        return recs

    bar = progress.Progress("offline decoding", len(jobs), "prompts")  # a line at most every 15 s, time left
    done, procs = bar.counter(lambda i: f"T={jobs[i][0]:g}"), offline_processes(p, runners[False].device)
    gens = []
    for recs in forked.forked_map(one, len(jobs), procs, "06's offline decoding", done=done):
        store.append_jsonl(out, recs, fsync=False)
        gens += recs
    return gens


def offline_processes(p: Params, device="cpu") -> int:
    """Forked processes of 06's offline decoding: `p.decode_processes` (0: as many as the cores allow), each on
    the torch threads this process holds (`machine.decoding_processes`: within the cores and EAGLE_MAX_THREADS; one
    for a target on a GPU)."""
    import torch

    threads = torch.get_num_threads()
    most = machine.decoding_processes(machine.usable_cores(), threads, device)
    return most if p.decode_processes == 0 else min(p.decode_processes, most)


def ensure_exports(cfg: params.StageConfig, drafter_dir: Path, tcfg: dict, load) -> dict[str, Path]:
    """Stage 05's exports when complete, else export the drafter (load()) into eval/export/ (every format it
    has: `export.formats_for`)."""
    from eagle_lib import models
    from eagle_lib.drafter import export
    from eagle_lib.drafter.model import CONFIG_FILE, Eagle3Config

    saved = drafter_dir / CONFIG_FILE
    fmts = export.FORMATS
    if saved.exists():
        fmts = export.formats_for(Eagle3Config.from_dict(json.loads(saved.read_text())["config"]))
    made = {f: cfg.out("drafter", "export", f) for f in fmts}
    if all((d / export.CONFIG).exists() and (d / export.WEIGHTS).exists() for d in made.values()):
        return made
    arch = list(tcfg.get("architectures") or ["LlamaForCausalLM"])
    verifier = models.resolve(cfg.shared.target)
    return export.export_all(
        load(), cfg.out("eval", "export"), verifier, arch, cfg.stage.num_steps, cfg.stage.export_dtype
    )


def reproducibility(p: Params, seed: int, target) -> dict:
    """06's meta: what its tau is a function of, and what can make a rerun of the same record differ."""
    notes = [
        machine.SAME_BITS
        + " (offline: T > 0 samples are seeded per (seed, temperature, dataset, prompt id); "
        "tested: a rerun writes the same generations)",
        "another thread count or CPU can flip a near-tie of the target's logits, and the answer diverges from there",
    ]
    device = str(target.device) if target is not None else "none (offline: false)"
    if device.startswith("cuda"):
        notes.append(machine.ON_CUDA)
    if p.online_engine != "none":
        notes.append(
            f"online ({p.online_engine}): the server's batching and its sampler are outside this run; online tau "
            f"repeats only to online_tolerance ({p.online_tolerance})"
        )
    return {**machine.run_record(seed, device), "same_bits": notes}


def _models(cfg: params.StageConfig, drafter_dir: Path):
    """(target or None, drafter or None, target text config dict): loaded only when decoding offline."""
    from eagle_lib import models
    from eagle_lib.drafter.model import load_drafter
    from eagle_lib.serving import preflight

    if not cfg.stage.offline:
        return None, None, preflight.target_text_config(cfg.shared.target, **models.hub_kwargs(cfg.shared))
    target = models.load_target(cfg.shared)
    drafter = load_drafter(drafter_dir, device=target.device)
    return target, drafter, preflight.text_config_dict(target.config)


def preflight_all(exports: dict[str, Path], cfg: params.StageConfig, tcfg: dict) -> list[dict]:
    """Preflight every export against the target and the intended commands."""
    from eagle_lib.serving import commands, preflight

    p, sh = cfg.stage, cfg.shared
    launch = commands.launch_kwargs(p, sh, tcfg)
    trained = _trained_config(Path(p.drafter_dir) if p.drafter_dir else cfg.out("drafter", "final"))
    aux, norms = (trained["aux_layers"], trained) if trained else (None, None)
    args = (sh.target, p.sglang_cmd, None, sh.trust_remote_code, tcfg, aux, norms)
    return [preflight.preflight(d, *args, **launch).to_dict() for d in exports.values()]


def _trained_config(drafter_dir: Path) -> dict | None:
    """The trained drafter's own config (drafter_config.json: aux layers, norm flags), if there is one."""
    from eagle_lib.drafter.model import CONFIG_FILE

    f = drafter_dir / CONFIG_FILE
    return json.loads(f.read_text())["config"] if f.exists() else None


def run(cfg: params.StageConfig) -> Eval:
    """The whole stage: prompts, exports + preflight, offline decoding, online check, files."""
    from eagle_lib import models
    from eagle_lib.drafter.model import load_drafter
    from eagle_lib.serving import local, online, verdict
    from eagle_lib.serving import tables as tbl

    cfg = dataclasses.replace(cfg, stage=cfg.stage.served(cfg.shared))  # what 05 trained for, unless set here
    p, shared, started, out = cfg.stage, cfg.shared, time.time(), cfg.out("eval")
    machine.set_cpu_threads(shared.num_workers)  # offline decoding on CPU: the machine rule
    out.mkdir(parents=True, exist_ok=True)
    prompts, tally = heldout_prompts(cfg.run_dir, shared.heldout_percent, p)
    tok = models.load_tokenizer(shared)
    extra, set_tally, multi = eval_set_prompts(p, tok)
    evalsets.refuse_contaminated(cfg.run_dir, set_tally, tok)
    if not prompts and not extra:
        raise ValueError(
            f"{cfg.run_dir / 'data'}: no held-out prompts (heldout_percent={shared.heldout_percent}) and no "
            f"eval_sets; dropped: {tally['dropped']}"
        )
    prompts |= extra
    drafter_dir = Path(p.drafter_dir) if p.drafter_dir else cfg.out("drafter", "final")
    target, drafter, tcfg = _models(cfg, drafter_dir)
    exports = ensure_exports(cfg, drafter_dir, tcfg, lambda: drafter or load_drafter(drafter_dir))
    pf = preflight_all(exports, cfg, tcfg)
    store.write_json(out / "preflight.json", pf)
    gens: list[dict] = []
    eos = list(p.stop_token_ids) or models.stop_ids(tok, target, shared)
    if multi and p.offline:  # later turns need the target's own answers: decoded here
        later, set_tally["later_turns"] = later_turn_prompts(multi, tok, target, p, eos)
        prompts |= later
    elif multi:
        set_tally["later_turns"] = {
            "kept": 0,
            "skipped": "offline: false (no target here to answer earlier turns)",
        }
    if p.offline:
        (out / "generations.jsonl").unlink(missing_ok=True)
        gens = decode_offline(target, drafter, prompts, p, eos, out / "generations.jsonl", shared.seed)
    ratio = p.step_cost_ratio or tbl.cost_ratio(gens)
    tau, pos, hist = tbl.tables(gens, p.num_steps, ratio) if gens else (pd.DataFrame(),) * 3
    ctx = tbl.context_table(gens, p.context_buckets, p.num_steps)
    starts = tbl.cycle_start_table(gens)
    for name, df in (("tau", tau), ("positions", pos), ("accepted_hist", hist), ("context", ctx),
                     ("cycle_start", starts)):  # fmt: skip
        df.to_csv(out / f"{name}.csv", index=False)
    on, live, speed = None, [], []
    if p.online_engine != "none":
        sub = {ds: ps[: p.online_max_prompts] for ds, ps in prompts.items()}
        raw, live, speed = local.serve_and_measure(
            p, shared, exports, sub, out, int(tcfg.get("max_position_embeddings", 4096)), eos
        )
        on = verdict.compare(raw, tau, gens, p.online_engine, p.online_tolerance, eos)
        on.to_csv(out / "online.csv", index=False)
        online.context_table(raw, p.online_engine).to_csv(out / "online_context.csv", index=False)
        pd.DataFrame(speed).to_csv(out / "served_speed.csv", index=False)
        store.write_json(
            out / "online.json", {"engine": p.online_engine, "by_temperature": raw, "speed": speed}
        )
        store.write_json(out / "live_preflight.json", live)
    h = {
        **tbl.headline(tau, ctx, pf, on, p.num_steps, p.temperatures, starts),
        "cost_ratio": ratio,
        "live_preflight_ok": all(c["ok"] for c in live),
    }
    if on is not None and speed:
        h["served_tokens_per_s"] = {
            f"T={r['temperature']:g}": {
                k: round(r[k], 3) for k in ("tokens_per_s", "tokens_per_s_no_draft", "speedup")
            }
            for r in speed
            if r["dataset"] == "all"
        }
    h["answer"] = tbl.answer(tau, p.num_steps, tbl.lossless_count(gens), on, starts=starts)
    meta = {**tally, "eval_sets": set_tally, "params": p.model_dump(), "drafter_dir": str(drafter_dir),
            "shared": shared.model_dump(mode="json"), "stop_ids": eos, "headline": h, "exports": {k: str(v) for k, v in exports.items()},
            "reproducibility": reproducibility(p, shared.seed, target)}  # fmt: skip
    store.write_meta(out, meta, started, tally=True)
    return Eval(tau, pos, hist, ctx, pf, on, live, h, h["answer"], p.reference_text, out, starts)
