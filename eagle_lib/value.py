"""Stage 07_data_value: will more data raise tau, and which data should be generated next?

Every study trains fresh drafters with the run's 05 recipe (`eagle_lib.drafter.retrain`, read from
``drafter/meta.json``) on subsets of 05's own training sequences (held-out ids never enter) and measures each
drafter's tau on ONE fixed set of held-out prompts by offline speculative decoding, as 06 does
(`eagle_lib.serving.heldout_tau`). Intervals are percentile bootstraps over those prompts, resampled within
each eval dataset and paired across drafters (they share the prompts); they cover which prompts were held out
and, with ``noise_seeds`` > 0, training noise: the curve's smallest ``noise_fractions`` (cheap) are trained again
with other seeds, each on another draw of its training set (``noise_resample``: a bootstrap of each dataset's
sequences, cut at the same fraction, since a rerun of the pipeline trains on another split too), their pooled
spread is the retraining noise of tau (assumed the same at every fraction), and every
interval of the stage (projections, verdict, leave-one-out values, regenerated vs original, multi-turn) draws it
(`eagle_lib.data_value.curve`: posterior of the variance given the replicates, so few seeds give wide intervals).

1. Learning curve: nested stratified subsets (`eagle_lib.data.subsets`) of ``fractions`` of 05's training
   tokens; steps proportional to the tokens (``steps: proportional``, 05's epochs: each token is seen as often
   as in 05, the way a larger regeneration would be trained) or 05's step count for all (``fixed``). The
   fraction-1 point is 05's own drafter when it equals what the recipe gives (``reuse_05_drafter``). A
   saturating fit tau = a - b x^-c (`eagle_lib.data_value.curve`) gives projections, tokens for ``target_tau``
   and the verdict.
2. Which data: leave-one-out at an equal token budget (``lodo_fraction`` of 05's tokens): each unit (a dataset,
   or a domain group from ``lodo_units``) removed, the rest scaled up to the budget, against all datasets at the
   same budget. Value of a unit for an eval set = tau(with) - tau(without).
3. Regenerated vs original: the same training prompts of ``original_datasets`` with the target's regenerated
   responses vs the datasets' own, cut to equal tokens.
4. Multi-turn vs single-turn regeneration (`eagle_lib.data_value.value_multiturn`): every turn of the multi-turn
   B conversations answered by the target vs their first turn only, at equal tokens, on held-out first- and
   later-turn prompts (07 regenerates a bounded number each_turn when 03 did not).

Every tau of the stage is of one kind, named in the headline (``tau_kind``): with ``tau_source: ttt`` a
teacher-forced argmax-chain tau on the run's sampled text, not 06's served tau nor on ``target_tau``'s scale;
where 06 measured the run, `eagle_lib.data_value.tau_scale` calibrates it against 06 (calibration.csv,
``tau_calibration``, ``tokens_for_target_on_06_scale``).

Writes ``value/``: curve.csv, projections.csv, lodo.csv, regen.csv, multiturn.csv (+ multiturn/<dataset>/ turn
records), calibration.csv, sums.json (per drafter and prompt),
drafters/<key>/ (cached weights: a rerun with the same inputs reuses them), the plots and meta.json.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

from pydantic import model_validator

from eagle_lib import params, store

if TYPE_CHECKING:
    from eagle_lib.data_value.value_tables import Result

STAGE = "07_data_value"
_ORIGINALS = ["sharegpt", "ultrachat", "openthoughts_114k", "openthoughts3", "mot", "opencodeinstruct"]


class Params(params.Strict):
    """07_data_value parameters (defaults: the toy study, about 10 CPU minutes)."""

    fractions: list[float] = [0.125, 0.25, 0.5, 1.0]  # nested subsets, shares of the 05 training tokens
    steps: Literal["proportional", "fixed"] = (
        "proportional"  # steps ~ tokens (the 05 epochs) | the 05 step count
    )
    step_scale: float = (
        1.0  # multiplies the steps of every arm (< 1: a cheaper study; 1.0 reuses the 05 drafter)
    )
    arm_processes: int = 0  # arms trained at once, each in a forked process on one thread; 0: one per thread
    # the training step holds alone (threads_alone: 2 on a 2-core host, 1 under EAGLE_MAX_THREADS=1); 1: one at a
    # time on the step's threads (the bits of runs before side-by-side training)
    reuse_05_drafter: bool = (
        True  # fraction 1.0 uses the final 05 drafter when the recipe would give the same one
    )
    tau_source: Literal["decode", "ttt"] = (
        "decode"  # decode: offline speculative decoding as in 06 | ttt: teacher-forced chain tau
    )
    max_prompts_per_dataset: int = 8  # held-out prompts decoded per eval dataset (selected as in 06)
    max_prompt_tokens: int = 768  # longer held-out prompts are skipped
    eval_max_new_tokens: int = 64  # tokens generated per held-out prompt
    num_steps: int = 3  # drafts per target verify step (num_steps of 06); the chain limit is num_steps + 1
    bootstrap_reps: int = 400  # bootstrap draws over held-out prompts
    noise_seeds: int = (
        1  # more seeds trained at each noise fraction: their spread is the training noise (0: none)
    )
    noise_fractions: list[float] | None = None  # curve fractions given those seeds; None: the two smallest
    noise_resample: bool = True  # a replicate also trains on a bootstrap of the fraction's training set
    multipliers: list[float] = [2.0, 4.0, 10.0]  # projected tau at these multiples of the 05 training tokens
    target_tau: float = 2.5  # report the training tokens needed for this tau
    min_gain: float = 0.05  # doubling the data must add more tau than this to count as data-limited
    lodo: bool = True  # run the leave-one-out study
    lodo_fraction: float = 0.5  # equal token budget of every leave-out arm, share of the 05 training tokens
    lodo_units: dict[
        str, list[str]
    ] = {}  # unit -> datasets left out together (domain groups); {}: one per dataset
    short_datasets: list[str] = ["glaive"]  # short-response datasets (tool calls): reported on their own line
    regen: bool = True  # run the regenerated-vs-original study
    original_datasets: list[str] = _ORIGINALS  # B datasets with their own responses
    regen_fraction: float = 1.0  # share of those datasets (training tokens) the two arms are drawn from
    multiturn: bool = True  # run the multi-turn vs single-turn regeneration study
    multiturn_datasets: list[str] = ["sharegpt", "ultrachat", "glaive"]  # multi-turn B datasets compared
    multiturn_conversations: int = (
        24  # training conversations per dataset 07 regenerates each_turn (03 did not)
    )
    multiturn_heldout: int = (
        16  # held-out source conversations per dataset regenerated each_turn for eval (0: all)
    )
    multiturn_base_fraction: float = 0.125  # share of the other datasets' tokens both arms also train on

    @model_validator(mode="after")
    def _consistent(self):
        if not self.fractions or any(not 0 < f <= 1 for f in self.fractions) or len(set(self.fractions)) < 2:
            raise ValueError("fractions: at least two distinct shares in (0, 1]")
        if (
            not (0 < self.lodo_fraction <= 1 and 0 < self.regen_fraction <= 1)
            or self.step_scale <= 0
            or not (0 <= self.multiturn_base_fraction <= 1)
        ):
            raise ValueError(
                "lodo_fraction and regen_fraction must be in (0, 1], multiturn_base_fraction in [0, 1], step_scale > 0"
            )
        if self.arm_processes < 0:
            raise ValueError(f"arm_processes must be >= 0 (0: as the cores allow), got {self.arm_processes}")
        if self.noise_seeds < 0 or (
            self.noise_fractions is not None and not set(self.noise_fractions) <= set(self.fractions)
        ):
            raise ValueError(
                f"noise_seeds must be >= 0 and noise_fractions ({self.noise_fractions}) a subset of fractions "
                f"({self.fractions})"
            )
        if (
            min(self.num_steps, self.eval_max_new_tokens, self.max_prompts_per_dataset, self.bootstrap_reps)
            < 1
        ):
            raise ValueError(
                "num_steps, eval_max_new_tokens, max_prompts_per_dataset, bootstrap_reps must be >= 1"
            )
        return self


def run(cfg: params.StageConfig) -> Result:
    """The whole stage: the studies the params ask for, their tables and plots, value/meta.json."""
    import pandas as pd

    from eagle_lib.data_value import tau_scale
    from eagle_lib.data_value import value_multiturn as mturn
    from eagle_lib.data_value import value_study as study
    from eagle_lib.data_value import value_tables as tables

    p, started = cfg.stage, time.time()
    st = study.Study(cfg)
    curve_df, c = study.curve(st, p)
    st.save_sums()
    lodo = study.lodo(st, p) if p.lodo else pd.DataFrame()
    st.save_sums()
    regen, regen_tally = study.regen(st, p) if p.regen else (pd.DataFrame(), {})
    st.save_sums()
    mt, mt_tally = mturn.study(st, p) if p.multiturn else (pd.DataFrame(), {"skipped": "multiturn: false"})
    st.save_sums()
    src = st.trainer.source
    if hasattr(src, "close"):  # vllm: the producers stop; their accounting stays in the summary
        src.close()
    res = tables.result(st, curve_df, c, lodo, regen, p)
    res.multiturn = mt
    res.headline |= mturn.headline(mt, mt_tally)
    res.calibration, scale = tau_scale.headline(cfg.run_dir, st, p, c)  # what this tau is; 06 beside it
    res.headline |= scale
    res.headline["tokens_for_target"]["scale"] = "07's tau (tau_kind); on 06's: tokens_for_target_on_06_scale"
    for name, df in (("curve", curve_df), ("projections", res.projections), ("lodo", lodo), ("regen", regen),
                     ("multiturn", mt), ("calibration", res.calibration)):  # fmt: skip
        df.to_csv(st.out / f"{name}.csv", index=False)
    meta = {
        **st.prompt_tally,
        "params": p.model_dump(),
        "shared": cfg.shared.model_dump(mode="json"),  # the target's revision (pinned hub code) among them
        "recipe": st.recipe,
        "train_sequences": st.seq_tally.kept,
        "train_tokens": st.total,
        "steps_05": st.steps05,
        "arms": list(st.arms.values()),
        "original_responses": regen_tally,
        "multiturn": mt_tally,
        "hidden": src.summary() if hasattr(src, "summary") else None,  # vllm: mode, bound, producers' peak
        "headline": res.headline,
    }
    meta = store.write_meta(st.out, meta, started, tally=True)
    res.headline["seconds"] = meta["seconds"]
    return res
