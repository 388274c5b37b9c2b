"""Held-out tau of many drafters on one fixed prompt set, kept per prompt (for bootstrap intervals).

Prompts are chosen as stage 06 chooses them: every A record and B prompt whose id is held out
(`store.is_heldout(id, heldout_percent)`); an A record's prompt is the tokens before its last assistant turn
(06's default ``a_prompt: last_turn``), a B prompt its ``prompt_ids``; longer than ``max_prompt_tokens`` is
skipped, at most ``per_dataset`` per dataset (in file order). Each drafter decodes every prompt greedily with
`eagle_lib.decoding.specdec.speculative_generate` (k drafts per target verify step, lossless by construction)
and the per-prompt sums are kept: ``num`` = sum over steps of (accepted + 1), ``den`` = the number of steps,
so tau of any set of prompts is sum(num) / sum(den), exactly 06's pooled tau.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from eagle_lib import forked, store
from eagle_lib.data import evalsets
from eagle_lib.decoding import specdec
from eagle_lib.decoding.sampling import Sampler, draft_sampler
from eagle_lib.decoding.specdec import Prompt
from eagle_lib.engines import machine
from eagle_lib.serving import tables


def heldout_prompts(run_dir: str | Path, percent: float, per_dataset: int, max_prompt_tokens: int):
    """(prompts, tally): 06's held-out prompts (`evalsets.heldout_prompts`, A prompts before the last turn),
    flattened in dataset order."""
    by_ds, tally = evalsets.heldout_prompts(run_dir, percent, per_dataset, max_prompt_tokens)
    return [q for qs in by_ds.values() for q in qs], tally


@dataclass
class Sums:
    """Per-drafter, per-prompt decoding sums: num/den (D, P); tau of drafter d = num[d].sum() / den[d].sum()."""

    names: list[str]
    datasets: list[str]  # (P,) dataset of each prompt
    num: np.ndarray
    den: np.ndarray
    seconds: dict[str, float] = field(default_factory=dict)

    def rows(self, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        idx = [self.names.index(n) for n in names]
        return self.num[idx], self.den[idx]

    def tau(self, name: str, dataset: str | None = None) -> float:
        i = self.names.index(name)
        cols = [j for j, d in enumerate(self.datasets) if dataset in (None, d)]
        return float(self.num[i, cols].sum() / max(1, self.den[i, cols].sum()))


class Decoder:
    """The target and a fixed prompt set; `add(name, drafter)` decodes every prompt and stores the sums."""

    def __init__(self, target, prompts: list[Prompt], max_new_tokens: int, k: int, eos_ids: list[int]):
        if not prompts:
            raise ValueError("held-out tau needs at least one held-out prompt")
        self.target, self.prompts = target, prompts
        self.max_new_tokens, self.k, self.eos_ids = max_new_tokens, k, eos_ids
        self.sums = Sums(
            [], [p.dataset for p in prompts], np.zeros((0, len(prompts))), np.zeros((0, len(prompts)))
        )
        self.cost_ratio = float("nan")  # the last decode's seconds per drafter forward / per target verify
        self.generations: list[
            specdec.Generation
        ] = []  # the last decode's runs (prompt-major within each rep)

    @torch.no_grad()
    def decode(
        self,
        drafter,
        temperature: float = 0.0,
        top_p: float = 1.0,
        draft: str = "greedy",
        reps: int = 1,
        seed: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(num, den) per prompt (P,) for one drafter: greedy (temperature 0), or sampled at `temperature` /
        `top_p` with drafts drawn as `draft` says (`draft_sampler`), each prompt decoded `reps` times with other
        sampling seeds (the sums add up)."""
        runner = specdec.TargetRunner(self.target, drafter.config.aux_layers)
        num, den = np.zeros(len(self.prompts)), np.zeros(len(self.prompts))
        gens, self.generations = [], []
        owned = torch.get_num_threads()  # what the stage holds (07: the training step's threads_alone)
        # one thread decodes faster; the rest of `owned` decodes in more processes
        with machine.decoding_threads() as want:
            procs = machine.decoding_processes(owned, want, runner.device)
            self._decode(runner, drafter, (temperature, top_p, draft, reps, seed), num, den, gens, procs)
        runner.cache = None  # free the target's KV cache
        ratio = tables.cost_ratio(gens)
        self.cost_ratio = float("nan") if ratio is None else ratio
        return num, den

    def _decode(self, runner, drafter, how: tuple, num, den, gens: list, processes: int = 1) -> None:
        """decode()'s loop: adds each prompt's sums into num / den in place; the prompts are decoded by
        `processes` forked processes (`forked.forked_map`: each prompt's run is the one this process would make,
        bit for bit, its sampling seeded by the prompt alone)."""
        temperature, top_p, draft, reps, seed = how
        jobs = [(r, j) for r in range(reps if temperature > 0 else 1) for j in range(len(self.prompts))]

        def one(i: int) -> specdec.Generation:
            r, j = jobs[i]
            pr = self.prompts[j]
            key = int(store.stable_hash([seed, r, temperature, pr.dataset, pr.id], 8), 16)
            return specdec.speculative_generate(
                runner,
                specdec.EagleProposer(drafter, draft_sampler(draft, temperature, key + 1)),
                pr.prompt_ids,
                self.max_new_tokens,
                self.k,
                self.eos_ids,
                Sampler(temperature, top_p if temperature else 1.0, 0, key),
            )

        runs = forked.forked_map(one, len(jobs), processes, "held-out decoding")
        for (_, j), g in zip(jobs, runs, strict=True):
            num[j] += sum(a + 1 for a in g.accepted)
            den[j] += len(g.accepted)
            gens.append({"method": "eagle3", **vars(g)})
            self.generations.append(g)

    def add(self, name: str, drafter, cached: tuple[list, list] | None = None) -> tuple[list, list]:
        """Decode (or take `cached` per-prompt sums) and append as row `name`; returns the sums as lists."""
        t0 = time.perf_counter()
        num, den = (np.asarray(cached[0]), np.asarray(cached[1])) if cached else self.decode(drafter)
        s = self.sums
        s.names.append(name)
        s.num, s.den = np.vstack([s.num, num[None]]), np.vstack([s.den, den[None]])
        s.seconds[name] = time.perf_counter() - t0
        return num.tolist(), den.tolist()


class TeacherForced(Decoder):
    """Held-out tau without decoding, for targets too large to run here: the TTT chain tau of each held-out
    sequence (features from the training hidden source, e.g. engine dumps). Per sequence
    ``num = n + sum_{i < k} n_i`` and ``den = n``, with n its label positions and n_i those where drafts 0..i
    are all right (teacher-forced): tau = 1 + sum_i P(drafts 0..i right), the chain of k drafts."""

    def __init__(self, trainer, seqs: list, datasets: list[str], k: int):
        if not seqs:
            raise ValueError("teacher-forced held-out tau needs at least one held-out sequence")
        self.trainer, self.seqs, self.k = trainer, seqs, k
        self.prompts = [Prompt(s.id, d, s.input_ids) for s, d in zip(seqs, datasets, strict=True)]
        self.max_new_tokens = 0
        self.sums = Sums([], list(datasets), np.zeros((0, len(seqs))), np.zeros((0, len(seqs))))

    @torch.no_grad()
    def decode(self, drafter) -> tuple[np.ndarray, np.ndarray]:
        from eagle_lib.data import batches
        from eagle_lib.drafter import ttt

        tr = self.trainer
        model = ttt.TTT(drafter, max(self.k, 1), tr.decay, tr.attention, loss_chunk=tr.loss_chunk).eval()
        num, den = np.zeros(len(self.seqs)), np.zeros(len(self.seqs))
        for j in range(len(self.seqs)):
            batch = batches.make_batch(self.seqs, [[j]], batches.PAD_TO)
            aux, tlogits = tr.source(batch)
            x = [
                t.to(tr.device) for t in (batch.input_ids, batch.position_ids, batch.doc_ids, batch.loss_mask)
            ]
            with torch.autocast(tr.device.type, torch.bfloat16, enabled=tr.autocast):
                _, stats = model(*x, aux, tlogits)  # (k, N_STATS) sums
            n = float(stats[0, ttt.N_LABELS])
            num[j], den[j] = n + float(stats[: self.k, ttt.COND_NUM].sum()), n
        return num, den
