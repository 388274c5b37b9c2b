"""bench_quality.py on a real model's run (``--params params/smollm2.yaml --run-dir <run>``): ours, speculators'
Eagle3DraftModel and SpecForge's EAGLE-3 trained side by side at equal budget on the run's stage-05 data, tau by
our offline decoder on MT-Bench, HumanEval and held-out prompts at T=0 and T=1, over several seeds, and the steps
ours needs to reach each peer's final tau.

Equal budget, as bench_quality.py's docstring lays out, with what differs on a real run:

* Data: the run's 05 training split (`batches.load_sequences`, 05's max_seq_len), limited to the sequences 05
  (or 07) kept the target's hidden states of (``keep_hidden_states``; the count is printed), in the micro-batches
  of our `BatchStream` for each seed (``rows_per_batch`` packed rows of ``pack_len`` tokens a step: speculators
  reads them as one row, SpecForge as one padded row per sequence).
* Hidden states: the SAME ones for every side, read from the run's kept store (vLLM's prefill of the run's
  target), never recomputed: ours through 07's reader (`kept_source.KeptSource`, which starts no producer when
  every sequence is kept), the peers through `stored_features` (pre-norm last layer for speculators'
  verifier_last_hidden_states; the final norm applied for SpecForge's hidden_state, as its capture stores it).
* Steps, batch, draft vocab (counted on these sequences, one map for all), draft layer (the target's layer
  shape, 05's draft_intermediate_size), init (frozen target embedding, lm_head from the target's rows of the
  draft vocab, each side's own seeded random layer), k (05's preset: 3, the drafts served), peak learning rate
  and schedule (05's: linear warmup, cosine to lr * min_lr_ratio; warmup scaled with the steps).
* Each side's own: ours 05's whole recipe (Muon, lk_hybrid served-temperature terms, ...); speculators 0.9's
  defaults (kl_div, decay 1.0, Muon on the matrices + AdamW elsewhere with its weight decays, grad clip 1.0);
  SpecForge 0.2.0's (its TTT soft cross-entropy, decay 0.8, AdamW with weight decay 0, grad clip 0.5).
  Changed, and why: the peers' peak lr and schedule are ours (their defaults, 1e-3 linear and 1e-4 cosine, are
  set for long runs on large targets; at a few hundred steps 1e-4 barely moves a drafter, which would flatter
  ours); SpecForge's TTT length is 3, not its 7 (the chain served, and equal compute a step); the peers'
  EAGLE-3.1 norms stay off (the original layer on every side: the same draft-layer shape).

Tau: the prompts and settings of stage 06 (params' 06_eval_acceptance: eval_sets with MT-Bench's later turns
asked after the target's own answers, held-out prompts, num_steps drafts, top_p, draft_sampling), at T=0 for
every checkpoint and at T=1 for the final ones. T=0 decodes every drafter against one recorded greedy path per
prompt (`GreedyReplay`: the target's greedy output and its aux features, recorded once by the real decoder with
the target's KV cache): at T=0 the output is the target's greedy output whatever the drafts, so the verify of a
step only ever needs the greedy path up to its first rejection; the report states on how many prompts the replay
matched the real decoder (`specdec.TargetRunner`) for one drafter. T=1 runs the real decoder
(`heldout_tau.Decoder`) with the same sampling seeds for every side.

    .venv/bin/python benchmarks/bench_quality.py --params params/smollm2.yaml --run-dir outputs/smollm2 \\
        --seeds 0 1 2 [--steps 160] [--work-dir DIR]

Variants: ``--ours-set KEY=VALUE`` changes our side's 05 recipe (or its served temperatures) and records it in
the plan; the peers' peak lr is ``--peer-lr`` (default: ours', so an ``--ours-set learning_rate=...`` moves
the peers' too unless --peer-lr names theirs). ``--sides`` trains and evaluates only some sides,
``--reuse DIR`` copies from another work dir the peer jobs and eval paths this one would compute identically
(same training spec, vocab map and eval settings), so a variant of ours costs only ours' jobs.

The work runs as jobs (target greedy paths, one training per side and seed, evaluation shards), at most one per
core (``taskset``, one thread each); a job whose result is in --work-dir is not run again (a rerun resumes, and
``--seeds`` may then name a subset of the planned seeds). ``quality_real.py report <work dir>`` prints the table of
the seeds complete so far.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
SIDES = ("ours", "speculators", "SpecForge")
FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1)
GROUPS = ("mt_bench", "humaneval", "heldout")


def marks(steps: int) -> list[int]:
    """Steps at which every side's drafter is kept (1/8, 1/4, 1/2 and all of the budget)."""
    return sorted({max(1, round(steps * f)) for f in FRACTIONS})


# --- setup (main process) -------------------------------------------------------------------------------
def _bench_params(p05, a):
    """05's recipe at the benchmark's budget, one process, no resume / measuring / producers' thread rule."""
    steps = a.steps or p05.max_steps
    warmup = a.warmup if a.warmup is not None else max(1, round(p05.warmup_steps * steps / p05.max_steps))
    return p05.model_copy(
        update=dict(max_steps=steps, warmup_steps=warmup, resume=False, checkpoint_every=10**6, log_every=0,
                    measure_every=0, num_threads=1, threads_alone=0, stop_after_steps=0)
    )  # fmt: skip


def ours_recipe(p05, shared, sets: list[str]):
    """(05's recipe, shared params) with ``--ours-set KEY=VALUE`` overrides, validated as the pipeline validates
    them: 05's keys, or ``shared.serve_temperatures`` / ``shared.serve_top_p`` (the served-temperature terms of
    ours' objective); values read as YAML. A variant of our side only (the peers' lr is --peer-lr's)."""
    from eagle_lib.params import ParamsError, parse_override

    update, shared_update = {}, {}
    for text in sets:
        parts, value = parse_override(text)
        if len(parts) == 2 and parts[0] == "shared" and parts[1] in ("serve_temperatures", "serve_top_p"):
            shared_update[parts[1]] = value
        elif len(parts) == 1:
            update[parts[0]] = value
        else:
            raise ParamsError(f"--ours-set {text!r}: name one key of 05_train_eagle3 (e.g. learning_rate=0.005) "
                              f"or shared.serve_temperatures / shared.serve_top_p")  # fmt: skip
    p05 = type(p05)(**(p05.model_dump() | update)) if update else p05
    shared = type(shared)(**(shared.model_dump() | shared_update)) if shared_update else shared
    return p05, shared


def reuse(work: Path, src: Path, seeds: list[int]) -> list[str]:
    """Copy from another work dir (``--reuse``) what this one would compute identically: a peer's training and
    evaluation of a seed when its training spec is the same (bar its output path) and so are the evaluation
    settings (bar the plan's ours-only fields); ours' too when the two plans differ only in their seeds; and the
    eval prompts' greedy paths (refs.pt) when the prompt settings are the same. Returns what was copied."""

    def spec(d: Path, name: str) -> dict | None:  # paths inside the work dir written as <work>
        f = d / name
        if not f.exists():
            return None
        return {k: v for k, v in json.loads(f.read_text().replace(str(d), "<work>")).items() if k != "out"}

    def settings(d: Path) -> dict | None:
        f = d / "eval.json"
        if not f.exists():
            return None
        cfg = json.loads(f.read_text())
        return {k: v for k, v in cfg.items() if k not in ("work", "plan")} | {
            "run_dir": cfg["plan"]["run_dir"]
        }

    def plan_but_seeds(d: Path) -> dict | None:
        f = d / "plan.json"
        return None if not f.exists() else {k: v for k, v in json.loads(f.read_text().replace(str(d), "<work>")).items() if k != "seeds"}  # fmt: skip

    got = []
    # ours too where the two plans differ in their seeds alone (the same recipe, run and budget: a work dir
    # planned for more seeds than the one it copies from)
    sides = (
        SIDES
        if plan_but_seeds(src) is not None and plan_but_seeds(src) == plan_but_seeds(work)
        else SIDES[1:]
    )
    vmap = "vocab_map.safetensors"
    same_map = (src / vmap).exists() and (src / vmap).read_bytes() == (work / vmap).read_bytes()
    same_eval = settings(src) is not None and settings(src) == settings(work)
    if same_eval and (src / "refs.pt").exists() and not (work / "refs.pt").exists():
        shutil.copy2(src / "refs.pt", work / "refs.pt")
        got.append("refs.pt")
    for seed in seeds:
        for side in sides:
            name, done = f"train_{side}_{seed}.json", src / f"eval_{side}_{seed}.done"
            theirs = spec(src, name)
            if not (
                same_map and same_eval and done.exists() and theirs is not None and theirs == spec(work, name)
            ):
                continue
            if (work / side / f"seed{seed}").exists():
                continue
            shutil.copytree(src / side / f"seed{seed}", work / side / f"seed{seed}")
            shutil.copy2(done, work / done.name)
            got.append(f"{side} seed {seed}")
    return got


def match_store(tr, run_dir: Path) -> str:
    """Point our reader at the run's kept store of this target's content. The store's identity names the target
    by its resolved path, i.e. by the $EAGLE_CACHE the run converted the GGUF under: a store whose identity
    differs only there (same config and weight fingerprints, layers, dtypes) holds the same hidden states."""
    src = tr.source
    root = Path(src.recipe["hidden_dump_dir"] or Path(run_dir) / "drafter" / "hidden_buffer")
    same = {k: v for k, v in src.ident.items() if k != "target"}
    for f in sorted(root.glob("kept/*/identity.json")):
        other = json.loads(f.read_text())
        if {k: v for k, v in other.items() if k != "target"} == same:
            src.ident = other
            return other["target"]
    return src.ident["target"]


def kept_sequences(tr, run_dir: Path):
    """(05's training sequences whose hidden states the run kept, all of them, the store)."""
    from eagle_lib.data import batches

    match_store(tr, run_dir)
    tr.source.use_root(run_dir, prepare=False)  # the store only: no producer for what is missing
    store = tr.source.kept
    p = tr.p
    train, _, _ = batches.load_sequences(
        run_dir, tr.shared.heldout_percent, p.max_seq_len, p.max_train_samples, 1
    )
    return [s for s in train if batches.seq_key(s.input_ids) in store], train, store


def step_sequences(seqs, p, seed: int, steps: int) -> list[list[list]]:
    """Every optimizer step's sequences as [ids, loss_mask, key], in our `BatchStream` order for `seed`."""
    from eagle_lib.data import batches

    stream = batches.BatchStream(seqs, p.pack_len, p.rows_per_batch, seed)
    out = []
    for s in range(steps):
        step = []
        for m in batches.micro_batches(s, 0, 1, p.grad_accum):
            b = stream.micro_batch(m)
            step += [[b.input_ids[r, st : st + n].tolist(), b.loss_mask[r, st : st + n].int().tolist(), key]
                     for r, segs in enumerate(b.segments) for key, st, n in segs]  # fmt: skip
        out.append(step)
    return out


def features_spec(store, tr, keys: set[str]) -> dict:
    """The peers' `stored_features` spec for these sequence keys."""
    index = {k: [store.index[k]["file"], store.index[k]["offset"], store.index[k]["n"]] for k in keys}
    return {"files": str(store.dir / "files"), "index": index, "aux_cols": tr.source.aux_cols,
            "last_col": tr.source.last_col}  # fmt: skip


def setup(a, work: Path) -> dict:
    """Recipe, sequences, vocab map and every job's spec (written under `work`); returns the plan."""
    import torch
    from bench_quality import worker_spec
    from safetensors.torch import save_file

    from eagle_lib import models
    from eagle_lib.drafter import retrain, vocab

    run_dir = Path(a.run_dir)
    p05, shared, world = retrain.load_recipe(run_dir)
    p05, shared = ours_recipe(p05, shared, a.ours_set)
    p = _bench_params(p05, a)
    tr = retrain.Trainer(p, shared, world, torch.device("cpu"))
    seqs, train, store = kept_sequences(tr, run_dir)
    if not seqs:
        sys.exit(f"{run_dir}: none of 05's {len(train)} training sequences has kept hidden states "
                 f"({store.dir}); run 05 with keep_hidden_states: true")  # fmt: skip
    counts = vocab.count_label_tokens(((s.input_ids, s.loss_mask) for s in seqs), tr.config.vocab_size)
    d2t, t2d = vocab.build_vocab_map(counts, tr.p.draft_vocab_size)
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(work / "vocab_map.safetensors"))
    steps = tr.p.max_steps
    plan = {
        "run_dir": str(run_dir), "params": a.params, "steps": steps, "warmup": tr.p.warmup_steps,
        "marks": marks(steps), "seeds": list(a.seeds), "k": tr.k, "decay": tr.decay, "lr": tr.p.learning_rate,
        "optimizer": tr.p.optimizer, "tokens_per_step": tr.p.pack_len * tr.p.rows_per_batch * tr.p.grad_accum,
        "sequences": len(seqs), "train_sequences": len(train), "store": str(store.dir),
        "kept_tokens": sum(len(s.input_ids) for s in seqs), "aux_layers": tr.config.aux_layers,
        "world": world, "bench_params": tr.p.model_dump(), "shared": shared.model_dump(),
        "ours_set": list(a.ours_set), "peer_lr": a.peer_lr or tr.p.learning_rate,
        "store_target": tr.source.ident["target"],
    }  # fmt: skip
    target = models.resolve(shared.target)
    for seed in a.seeds:
        st = step_sequences(seqs, tr.p, seed, steps)
        keys = {key for step in st for _, _, key in step}
        base = worker_spec(tr.config.aux_layers) | {
            "target": target, "intermediate_size": tr.config.intermediate_size, "k": tr.k,
            "lr": a.peer_lr or tr.p.learning_rate, "warmup": tr.p.warmup_steps, "min_lr_ratio": tr.p.min_lr_ratio,
            "seed": seed, "vocab_map": str(work / "vocab_map.safetensors"), "steps": st, "save_at": plan["marks"],
            "features": features_spec(store, tr, keys), "attention": a.attention,
        }  # fmt: skip
        specs = {
            "ours": {"plan": str(work / "plan.json"), "seed": seed, "keys": [[k for *_, k in s] for s in st]},
            # speculators 0.9's defaults (train/config/schema.py): kl_div, decay 1.0, Muon + AdamW, clip 1.0
            "speculators": base | {"decay": 1.0, "optimizer": "muon", "grad_clip": 1.0},
            # SpecForge 0.2.0's (config/schema.py, Eagle3TrainStrategy): decay 0.8, AdamW wd 0, clip 0.5
            "SpecForge": base | {"decay": a.sf_decay, "betas": [0.9, 0.999], "weight_decay": 0.0,
                                 "grad_clip": 0.5},
        }  # fmt: skip
        for side, spec in specs.items():
            spec["out"] = str(work / side / f"seed{seed}")
            (work / f"train_{side}_{seed}.json").write_text(json.dumps(spec))
    (work / "plan.json").write_text(json.dumps(plan))
    return plan


# --- jobs -----------------------------------------------------------------------------------------------
def run_jobs(jobs: list[dict], cores: list[int], work: Path) -> None:
    """Run jobs ({name, argv, done, after}) at most one per core (taskset, one thread), each once the files in
    its `after` exist, the first ready one first; a job whose `done` file exists is skipped; a failure stops the
    benchmark with its log's tail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    todo = [j for j in jobs if not Path(j["done"]).exists()]
    free, running = list(cores), {}
    try:
        while todo or running:
            while free and (ready := [j for j in todo if all(Path(d).exists() for d in j.get("after", []))]):
                j, core = ready[0], free.pop(0)
                todo.remove(j)
                log = open(work / f"{j['name']}.log", "w")  # noqa: SIM115  (closed when the job ends)
                argv = (["taskset", "-c", str(core)] if len(cores) > 1 else []) + j["argv"]
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
                running[proc.pid] = (proc, j, core, log, time.perf_counter())
                print(f"  [{time.strftime('%H:%M:%S')}] start {j['name']} on core {core}", flush=True)
            time.sleep(1.0)
            for pid, (proc, j, core, log, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[pid]
                free.append(core)
                took = time.perf_counter() - t0
                if proc.returncode != 0 or not Path(j["done"]).exists():
                    tail = (work / f"{j['name']}.log").read_text(errors="replace")[-3000:]
                    sys.exit(f"job {j['name']} failed (rc {proc.returncode}, {took:.0f} s):\n{tail}")
                print(f"  [{time.strftime('%H:%M:%S')}] done  {j['name']} in {took:.0f} s", flush=True)
    finally:  # stopped (a failure, Ctrl-C, SIGTERM): no job outlives the benchmark
        for proc, *_ in running.values():
            proc.terminate()


def train_jobs(a, work: Path, plan: dict) -> list[dict]:
    py = {"ours": sys.executable, "speculators": a.spec_python, "SpecForge": a.sf_python}
    script = {"ours": [str(HERE / "quality_real.py"), "ours"], "speculators": [str(HERE / "bench_quality.py"), "--worker"],
              "SpecForge": [str(HERE / "specforge_side.py")]}  # fmt: skip
    jobs = []
    for seed in plan["seeds"]:
        for side in SIDES:
            spec = work / f"train_{side}_{seed}.json"
            out = Path(json.loads(spec.read_text())["out"])
            jobs.append({"name": f"train_{side}_{seed}", "argv": [py[side], *script[side], str(spec)],
                         "done": str(out / "result.json"), "side": side, "seed": seed})  # fmt: skip
    return jobs


def eval_jobs(plan: dict, work: Path) -> list[dict]:
    """One job per (side, seed), once its training is done: T=0 at every kept step (ours also at step 0), T=1
    at the final one; the first also checks the T=0 replay against the real decoder."""
    jobs = []
    for side in SIDES:
        for seed in plan["seeds"]:
            out = work / side / f"seed{seed}"
            tasks = [{"side": side, "seed": seed, "step": m, "dir": str(out / f"step_{m}"),
                      "sampled": m == plan["steps"]} for m in ([0] if side == "ours" else []) + plan["marks"]]  # fmt: skip
            spec = work / f"eval_{side}_{seed}.json"
            spec.write_text(json.dumps({"tasks": tasks, "check": not jobs}))
            jobs.append({"name": f"eval_{side}_{seed}", "done": str(spec.with_suffix(".done")), "seed": seed, "side": side,
                         "after": [str(out / "result.json"), str(work / "refs.pt")],
                         "argv": [sys.executable, str(HERE / "quality_real.py"), "eval", str(spec)]})  # fmt: skip
    return jobs


def serve_jobs(plan: dict, work: Path, sides) -> list[dict]:
    """``--vllm``: one job per (side, seed) once its evaluation is done: its final drafter served by a vLLM CPU
    server beside the target (`quality_jobs.job_serve`)."""
    jobs = []
    for side in sides:
        for seed in plan["seeds"]:
            out = work / side / f"seed{seed}"
            spec = work / f"serve_{side}_{seed}.json"
            spec.write_text(json.dumps({"side": side, "seed": seed, "step": plan["steps"],
                                        "dir": str(out / f"step_{plan['steps']}")}))  # fmt: skip
            jobs.append({"name": f"serve_{side}_{seed}", "done": str(out / "served.json"), "seed": seed, "side": side,
                         "after": [str(work / f"eval_{side}_{seed}.done")],
                         "argv": [sys.executable, str(HERE / "quality_real.py"), "serve", str(spec)]})  # fmt: skip
    return jobs


def main(a) -> None:
    """The real-model benchmark: setup, jobs, table (bench_quality.py --params ...)."""
    for side, py, make in (
        ("speculators", a.spec_python, "bench-env"),
        ("SpecForge", a.sf_python, "specforge-env"),
    ):
        if side in a.sides and not Path(py).exists():  # a peer's venv runs only its own training jobs
            sys.exit(f"{py} missing: run `make {make}` first")
    work = Path(a.work_dir or f"/tmp/bench_quality_real_{os.getpid()}").absolute()
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    if a.vllm:
        from eagle_lib.engines.vllm_server import vllm_python

        if not vllm_python().exists():
            sys.exit(f"{vllm_python()} missing: run `make vllm-env` first (--vllm serves the drafters)")
    t0 = time.perf_counter()
    plan = json.loads((work / "plan.json").read_text()) if (work / "plan.json").exists() else setup(a, work)
    if (not set(a.seeds) <= set(plan["seeds"]) or plan["steps"] != (a.steps or plan["steps"])
            or plan.get("ours_set", []) != list(a.ours_set)
            or (a.peer_lr and a.peer_lr != plan.get("peer_lr", plan["lr"]))):  # fmt: skip
        sys.exit(f"{work}: planned for seeds {plan['seeds']}, {plan['steps']} steps, ours-set "
                 f"{plan.get('ours_set', [])}, peer lr {plan.get('peer_lr', plan['lr'])}; use another --work-dir")  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))[: a.jobs] if a.jobs else sorted(os.sched_getaffinity(0))
    refs = {"name": "refs", "argv": [sys.executable, str(HERE / "quality_real.py"), "refs", str(work / "eval.json")],
            "done": str(work / "refs.pt")}  # fmt: skip
    (work / "eval.json").write_text(json.dumps(_eval_settings(a, plan, work)))
    if a.reuse:
        print(f"reused from {a.reuse}: {', '.join(reuse(work, Path(a.reuse), list(a.seeds))) or 'nothing'}")
    print(
        f"work dir {work}: seeds {list(a.seeds)} (plan: {plan['seeds']}) x sides {' '.join(a.sides)} x {plan['steps']} "
        f"steps, cores {cores}"
    )
    trains, evals = train_jobs(a, work, plan), eval_jobs(plan, work)
    evals += serve_jobs(plan, work, a.sides) if a.vllm else []
    # seed by seed (trainings, then their evaluations once trained): a run stopped early has whole seeds;
    # --seeds may name a subset of the plan's (the others resume later in the same --work-dir)
    order = [j for seed in a.seeds for j in trains + evals if j["seed"] == seed and j["side"] in a.sides]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM)"))
    run_jobs([refs, *order], cores, work)
    from quality_report import report

    text = report(work, plan, time.perf_counter() - t0)
    print(text)


def _eval_settings(a, plan: dict, work: Path) -> dict:
    return {"work": str(work), "plan": plan, "prompts": a.prompts or 0, "sampled_prompts": a.sampled_prompts,
            "new_tokens": a.new_tokens or 0, "reps": a.reps, "temperature": 1.0, "top_p": a.top_p,
            "draft_sampling": a.draft_sampling}  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    import quality_jobs

    quality_jobs.main(sys.argv[1:])
