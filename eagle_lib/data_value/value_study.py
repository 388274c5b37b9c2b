"""07_data_value's studies (`eagle_lib.value` is the stage: params and entry point): drafters trained with 05's
recipe on subsets (learning curve, leave-one-dataset-out, regenerated vs original responses) and decoded on the
held-out prompts; cached by what they were trained on.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd

from eagle_lib import forked, models, params, progress, store
from eagle_lib.data import subsets
from eagle_lib.data_value import curve as curves
from eagle_lib.data_value import value_tables as tables
from eagle_lib.drafter import retrain
from eagle_lib.drafter import trainer as loop
from eagle_lib.engines import machine
from eagle_lib.serving import heldout_tau

STAGE = "07_data_value"
_TRAINING_SHARED = {
    "target",
    "tokenizer",
    "trust_remote_code",
    "revision",
    "tokenizer_revision",
    "seed",
    "heldout_percent",
}  # what the key holds


class Study:
    """Trains (or reuses) drafters on subsets and decodes the held-out prompts with each."""

    def __init__(self, cfg: params.StageConfig):
        self.cfg, self.out = cfg, cfg.out("value")
        p05, shared05, world05 = retrain.load_recipe(cfg.run_dir)
        self.recipe = p05.model_dump()  # 05's params as 05 wrote them (the cache key and the report hold it)
        if shared05.heldout_percent != cfg.shared.heldout_percent or shared05.seed != cfg.shared.seed:
            raise params.ParamsError(
                f"{STAGE}: heldout_percent/seed ({cfg.shared.heldout_percent}, {cfg.shared.seed}) differ from "
                f"the ones 05 trained with ({shared05.heldout_percent}, {shared05.seed}) in {cfg.run_dir}/drafter"
            )
        self.trainer = retrain.Trainer(p05, cfg.shared, world05)
        self.train_seqs, held, self.seq_tally = self.trainer.sequences(cfg.run_dir, max_eval=0)
        self.names = subsets.dataset_of(cfg.run_dir)
        self.groups = subsets.by_dataset(self.train_seqs, self.names, cfg.shared.seed)
        self.total = subsets.tokens(self.train_seqs)
        self.steps05 = self.trainer.full_steps(self.train_seqs)
        self.arm_processes = arm_processes(cfg.stage, self.trainer)
        self.side_by_side: dict[str, tuple[str, float]] = {}  # key -> (the arm that trained it, its seconds)
        self.decoder = self._decoder(cfg, held)
        self.arms: dict[str, dict] = {}
        self.noise = curves.NO_NOISE  # training noise, once the curve's seed replicates measured it
        self.sums_file = self.out / "sums.json"
        self.cached_sums = store.read_json(self.sums_file) if self.sums_file.exists() else {}
        self.progress = progress.Progress("arm", planned_arms(cfg.stage, self.groups), every_s=0)
        # arms the progress lines have counted (when trained side by side, or when trained and decoded)
        self.counted: set[str] = set()

    def _decoder(self, cfg: params.StageConfig, held: list) -> heldout_tau.Decoder:
        """Offline decoding of 06's held-out prompts, or the teacher-forced chain tau of held-out sequences."""
        p = cfg.stage
        if p.tau_source == "ttt":
            by_ds: dict[str, list] = {}
            for s in held:
                by_ds.setdefault(self.names[s.id], []).append(s)
            kept = [(s, d) for d, v in sorted(by_ds.items()) for s in v[: p.max_prompts_per_dataset]]
            n = sum(len(v) for v in by_ds.values())
            self.prompt_tally = {
                "read": n,
                "kept": len(kept),
                "dropped": {"over_cap": n - len(kept)},
                "rejected": 0,
            }
            return heldout_tau.TeacherForced(
                self.trainer, [s for s, _ in kept], [d for _, d in kept], p.num_steps
            )
        prompts, self.prompt_tally = heldout_tau.heldout_prompts(
            cfg.run_dir, cfg.shared.heldout_percent, p.max_prompts_per_dataset, p.max_prompt_tokens
        )
        target = getattr(self.trainer.source, "model", None) or models.load_target(cfg.shared)
        eos = models.stop_ids(models.load_tokenizer(cfg.shared), target)
        return heldout_tau.Decoder(target, prompts, p.eval_max_new_tokens, p.num_steps, eos)

    def schedule(self, seqs: list) -> tuple[int, int]:
        """(steps, warmup) for an arm: proportional to its tokens or 05's, times step_scale."""
        p, r = self.cfg.stage, self.recipe
        share = subsets.tokens(seqs) / self.total if p.steps == "proportional" else 1.0
        steps = max(1, round(self.steps05 * share * p.step_scale))
        return steps, min(steps, round(r["warmup_steps"] * steps / self.steps05))

    def key(self, seqs: list, steps: int, warmup: int, seed: int | None = None) -> str:
        ids = sorted(s.id + ":" + store.stable_hash(s.input_ids) for s in seqs)
        shared = self.cfg.shared.model_dump(include=_TRAINING_SHARED)
        what = {"recipe": self.recipe, "shared": shared, "ids": ids, "s": (steps, warmup)}
        if seed is not None:  # a seed replicate (05's own seed keeps the keys of earlier runs)
            what["seed"] = seed
        if self.arm_processes > 1:  # one thread an arm: other bits than the training step's threads give
            what["threads"] = 1
        return store.stable_hash(what)

    def _train(self, seqs: list, steps: int, warmup: int, key: str, seed: int | None):
        """Trains and saves one arm's drafter under drafters/<key>/ (one thread when arms train side by side, in
        this process too, so that an arm's bits do not depend on which others the cache held); its training log."""
        from eagle_lib.drafter.model import save_drafter

        ddir = self.out / "drafters" / key
        threads = 1 if self.arm_processes > 1 else None
        drafter, log = self.trainer.train(seqs, steps, warmup, ddir, key, seed, threads=threads)
        save_drafter(drafter, ddir, {"training": {"steps": steps, "warmup": warmup, "log": log}})
        return drafter, log

    def train_side_by_side(self, arms: list[tuple[str, list, int | None]]) -> None:
        """Trains the drafters of `arms` ((name, sequences, seed) each, as `arm` takes them) that no earlier run
        cached, `arm_processes` at a time, each in a forked process on one thread, the longest first; `arm` then
        finds them trained. Nothing when one process is allowed (`arm` trains each on the step's threads)."""
        if self.arm_processes <= 1:
            return
        todo: dict[str, tuple] = {}
        for name, seqs, seed in arms:
            steps, warmup = self.schedule(seqs)
            key = self.key(seqs, steps, warmup, seed)
            if key not in todo and not (self.out / "drafters" / key / "model.safetensors").exists():
                todo[key] = (name, seqs, steps, warmup, seed)
        keys = sorted(todo, key=lambda k: -todo[k][2])  # longest first: the last ones to end are short

        def one(i: int) -> float:
            _, seqs, steps, warmup, seed = todo[keys[i]]
            t0 = time.time()
            self._train(seqs, steps, warmup, keys[i], seed)
            return time.time() - t0

        def ended(i: int, seconds: float) -> None:
            name, _, steps, _, _ = todo[keys[i]]
            self.side_by_side[keys[i]] = (name, seconds)
            self.counted.add(name)  # the stage's arm count (and its ETA) moves as arms end training
            self.progress.update(
                len(self.counted), f"{name}: trained side by side, {steps} steps in {seconds:.0f} s"
            )

        forked.forked_map(one, len(keys), self.arm_processes, "07's arms", done=ended)

    def arm(
        self,
        name: str,
        study: str,
        seqs: list,
        reuse_dir: Path | None = None,
        decoder=None,
        seed: int | None = None,
    ) -> dict:
        """Train (or load) the drafter of one arm and decode the held-out prompts (or `decoder`'s) with it;
        `seed` (default 05's) trains a seed replicate: the same recipe and data, another initialisation and
        batch order."""
        decoder = decoder or self.decoder
        from eagle_lib.drafter.model import load_drafter

        steps, warmup = self.schedule(seqs)
        key, t0 = self.key(seqs, steps, warmup, seed), time.time()
        ddir = self.out / "drafters" / key
        if reuse_dir is not None:
            drafter, how = load_drafter(reuse_dir, device=self.trainer.device), "05's final drafter"
        elif (ddir / "model.safetensors").exists():
            drafter = load_drafter(ddir, device=self.trainer.device)
            how = self.obtained(key, name)
        else:
            drafter, how = self._train(seqs, steps, warmup, key, seed)[0], "trained"
        eval_key = store.stable_hash(
            {"d": key if reuse_dir is None else reused_id(reuse_dir), "e": self._eval_id(decoder)}
        )
        # decode on the threads a training step holds alone (threads_alone): a cached or reused drafter's decode
        # then forks as many one-thread decodes as a trained one's (heldout_tau.Decoder.decode)
        loop.alone_threads(self.trainer.p, self.trainer.source)
        sums = decoder.add(name, drafter, self.cached_sums.get(eval_key))
        self.cached_sums[eval_key] = sums
        info = {
            "arm": name, "study": study, "sequences": len(seqs), "tokens": subsets.tokens(seqs),
            "label_tokens": sum(sum(s.loss_mask) for s in seqs), "steps": steps, "drafter": how, "key": key,
            "seed": self.cfg.shared.seed if seed is None else seed, "seconds": time.time() - t0,
            "train_seconds": self.side_by_side[key][1] if how == "trained side by side" else None,
        }  # fmt: skip
        self.arms[name] = info
        tau = decoder.sums.tau(name)
        note = f"{name}: {how}, {steps} steps on {info['tokens']} tokens, tau {tau:.3f} ({info['seconds']:.0f} s)"
        if name in self.counted:  # counted when its training ended: its tau on a line of its own
            self.progress.emit(f"arm {note}")
        else:
            self.counted.add(name)
            self.progress.update(len(self.counted), note)
        return info

    def obtained(self, key: str, name: str) -> str:
        """How arm `name` got the cached drafter `key`: trained side by side under this name, or cached (an earlier
        run's, or another arm's of the same data: the leave-out reference is the curve's arm)."""
        return "trained side by side" if self.side_by_side.get(key, ("",))[0] == name else "cached"

    def _eval_id(self, d) -> dict:
        src = self.cfg.stage.tau_source
        return {
            "prompts": [(q.dataset, q.id) for q in d.prompts],
            "n": d.max_new_tokens,
            "k": d.k,
            "src": src,
        }

    def save_sums(self) -> None:
        store.write_json(self.sums_file, self.cached_sums)


def reused_id(drafter_dir: Path) -> dict:
    """What a reused drafter's cached decode is keyed by: its directory and a digest of its weights. The directory
    alone (05's final/) stays the same when 05 retrains with another recipe, and its old tau was then reused."""
    import hashlib

    from eagle_lib.drafter.model import WEIGHTS_FILE

    digest = hashlib.sha256()
    with (Path(drafter_dir) / WEIGHTS_FILE).open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return {"dir": str(drafter_dir), "weights": digest.hexdigest()}


def arm_processes(p, trainer: retrain.Trainer) -> int:
    """How many of 07's arms train at once, each in a forked one-thread process (`Study.train_side_by_side`):
    `p.arm_processes`, or with 0 one per thread the training step holds alone (threads_alone, else 05's
    num_threads rule), within the cores and `EAGLE_MAX_THREADS` (`machine.decoding_processes`). One (each arm on
    the step's threads, as before) for a drafter on a GPU and for a source whose producers serve one training at
    a time (vllm)."""
    if p.arm_processes == 1 or getattr(trainer.source, "producing", None) is not None:
        return 1
    if trainer.device.type != "cpu":
        return 1
    if p.arm_processes > 1:
        return machine.capped(p.arm_processes)
    tp = trainer.p
    owned = machine.capped(tp.threads_alone) if tp.threads_alone > 0 else machine.cpu_threads(tp.num_threads)
    return machine.decoding_processes(owned, 1, trainer.device)


def planned_arms(p, groups: dict) -> int:
    """How many arms the studies `p` turns on will run on datasets `groups` (the progress lines' total): the
    curve's fractions and their seed replicates, the leave-out reference and its leave-outs, and a pair each for
    regen and multiturn when a dataset they compare has training data."""
    n = sum(len(seed_names(f, p)) for f in sorted(set(p.fractions)))
    n += (1 + len(p.lodo_units or groups)) if p.lodo else 0
    n += 2 if p.regen and any(d in groups for d in p.original_datasets) else 0
    return n + (2 if p.multiturn and any(d in groups for d in p.multiturn_datasets) else 0)


SEED_STRIDE = 10_000  # replicate r trains with seed + SEED_STRIDE * r: far from 05's per-epoch shuffle seeds


def noise_fractions(p) -> list[float]:
    """The curve fractions trained with `noise_seeds` more seeds: `p.noise_fractions`, default the two smallest."""
    fr = sorted(set(p.fractions))
    return sorted(set(p.noise_fractions)) if p.noise_fractions is not None else fr[:2]


def seed_names(f: float, p) -> list[str]:
    """Arm names of fraction f's drafters: 05's seed first, then its seed replicates."""
    reps = p.noise_seeds if f in noise_fractions(p) else 0
    return [f"{f:g}"] + [f"{f:g}@seed+{r}" for r in range(1, reps + 1)]


def curve(st: Study, p) -> tuple[pd.DataFrame, curves.Curve]:
    fr = sorted(set(p.fractions))
    reuse = st.recipe.get("final_checkpoint", "last") == "last" and p.step_scale == 1.0 and p.reuse_05_drafter
    seed, plan = st.cfg.shared.seed, []  # (name, sequences, seed, 05's drafter to reuse)
    for f in fr:
        final = st.cfg.out("drafter", "final")
        plan.append(
            (f"{f:g}", subsets.fraction_subset(st.groups, f), None, final if f == 1.0 and reuse else None)
        )
        # retraining noise: other seeds, each on another draw of the training set (noise_resample)
        for r, name in enumerate(seed_names(f, p)[1:], start=1):
            rseed = seed + SEED_STRIDE * r
            draw = subsets.resampled(st.groups, rseed) if p.noise_resample else st.groups
            plan.append((name, subsets.fraction_subset(draw, f), rseed, None))
    st.train_side_by_side([(name, seqs, s) for name, seqs, s, reused in plan if reused is None])
    for name, seqs, s, reused in plan:
        st.arm(name, "curve", seqs, reused, seed=s)
    arms = {f: seed_names(f, p) for f in fr}
    names = [n for ns in arms.values() for n in ns]
    ends = np.cumsum([len(ns) for ns in arms.values()])
    groups = [
        list(range(e - len(ns), e)) for e, ns in zip(ends, arms.values(), strict=True)
    ]  # point -> its rows
    num, den = st.decoder.sums.rows(names)
    x = np.array([st.arms[f"{f:g}"]["tokens"] for f in fr]) / st.total
    draws = st.decoder.sums.datasets
    c = curves.learning_curve(
        x, num, den, p.num_steps + 1, p.multipliers, p.bootstrap_reps, seed, draws, groups, p.noise_resample
    )
    st.noise = c.noise  # the paired differences of the other studies carry the same training noise
    return tables.curve_table(st, arms), c


def lodo(st: Study, p) -> pd.DataFrame:
    units = p.lodo_units or {d: [d] for d in st.groups}
    missing = sorted({d for ds in units.values() for d in ds} - set(st.groups))
    if missing:
        raise params.ParamsError(f"{STAGE}: lodo_units name datasets with no training data: {missing}")
    budget = round(p.lodo_fraction * st.total)
    ref = f"lodo:all@{p.lodo_fraction:g}"
    plan = [(ref, subsets.fraction_subset(st.groups, p.lodo_fraction), None)]
    plan += [(f"lodo:-{u}", subsets.leave_out(st.groups, set(ds), budget), None) for u, ds in units.items()]
    st.train_side_by_side(plan)
    for name, seqs, _ in plan:
        st.arm(name, "lodo", seqs)
    return tables.value_table(st, ref, {u: f"lodo:-{u}" for u in units}, units, p)


def regen(st: Study, p) -> tuple[pd.DataFrame, dict]:
    tok = models.load_tokenizer(st.cfg.shared)
    regen, orig, tally = [], [], {}
    for ds in [d for d in p.original_datasets if d in st.groups]:
        seqs = {s.id: s for s in subsets.first_turns(subsets.prefix(st.groups[ds], p.regen_fraction))}
        o, tally[ds] = subsets.original_sequences(
            st.cfg.run_dir, ds, set(seqs), tok, st.recipe["max_seq_len"]
        )
        if st.trainer.keep is not None:  # offline dumps: an original response needs its own dump too
            tally[ds]["no_hidden_dump"] = sum(not st.trainer.keep(s.input_ids) for s in o)
            o = [s for s in o if st.trainer.keep(s.input_ids)]
        regen += [seqs[s.id] for s in o]
        orig += o
    if not orig:
        return pd.DataFrame(), tally
    regen, orig = subsets.equalize(regen, orig, st.cfg.shared.seed)
    st.train_side_by_side([("regenerated", regen, None), ("original", orig, None)])
    st.arm("regenerated", "regen", regen)
    st.arm("original", "regen", orig)
    return tables.pair_table(st, "regenerated", "original", p), tally
