"""06 against llama.cpp (params ``llamacpp: true``): the drafter served by llama-server beside the GGUF target, on
06's own online prompts, after 06's offline decoding.

What it measures, per online temperature and dataset (and pooled, ``all``):

* ``greedy_equal`` (T=0): the share of prompts whose output with the draft equals llama.cpp's target alone
  (the same binary and GGUF without ``-md``) token for token; ``greedy_equal_or_tie`` also counts outputs that
  leave it first at a near tie (the target's top two tokens < NEAR_TIE nats apart: llama.cpp's batched verify
  rounds otherwise than its one-token decode; measured: the target drafting for itself diverges at the same
  places), each divergence listed with its gap; ``equal_to_offline``: the target alone against 06's own greedy
  decoding (transformers, float32 dequantized weights; a quantized GGUF computes otherwise);
* ``llamacpp_tau`` = 1 + accepted / verify steps from llama-server's /metrics counters, beside ``offline_tau`` =
  06's eagle3 tau_uncut on the same prompts (drafts accepted past the stop count, as a server counts them), with
  ``noise`` = 2 standard errors of their difference (per-step variances of accepted + 1, both sides);
* ``tokens_per_s`` / ``tokens_per_s_no_draft``: generated tokens / the generation phase's seconds from each
  response's own ``timings`` (batch 1, prompt processing excluded), and their ratio. Both servers run at once
  (``--poll 0``: idle threads sleep) and each prompt goes to the target alone and then to the draft, so a change
  in the machine's load hits both sides alike.

The prompts are rebuilt exactly as 06 built them (held-out records, eval sets, later turns after the target's
greedy answers, taken from 06's ``generations.jsonl``) and checked against it (every prompt's length), so the
comparison is prompt for prompt. Files: ``eval/llamacpp/`` (the draft GGUF, converter and server logs),
``eval/llamacpp.csv``, ``eval/llamacpp.json``.

    python -m eagle_lib.serving.llamacpp_eval params/smollm2.yaml [--run-dir outputs/smollm2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from eagle_lib import store
from eagle_lib.data import evalsets
from eagle_lib.data.evalsets import Prompt
from eagle_lib.engines import machine
from eagle_lib.serving import llamacpp
from eagle_lib.serving import llamacpp_server as ls
from eagle_lib.serving.verdict import same_output

STAGE = "06_eval_acceptance"
CAUSES = {
    "numerics": "target arithmetic: llama.cpp runs the GGUF's quantized weights (Q4_1 x Q8 activations) where 06 "
    "decodes their float32 dequantization; near-ties flip, the texts part (equal_to_offline < 1) and the aux "
    "features the drafter reads differ slightly",
    "vocab": "draft vocabulary: llama.cpp scatters the draft lm_head onto the target vocab through d2t written as "
    "absolute ids (the preflight checks them); a wrong map would put drafts on the wrong tokens (tau ~ 1)",
    "aux": "aux layers: llama.cpp reads the input of target layer id (= HF hidden_states[id]); the preflight "
    "checks target_layers equal the drafter's (off by one would give tau ~ 1)",
    "rule": "acceptance rule at T > 0: llama.cpp's EAGLE-3 drafter always drafts the argmax and accepts a draft "
    "when the target's own sample equals it, where 06 drew drafts from the drafter (draft_sampling: probabilistic)",
}


# --- 06's prompts, rebuilt ---------------------------------------------------------------------------------
def eval_prompts(cfg, p, tokenizer, gens: list[dict]) -> dict[str, list[Prompt]]:
    """06's prompts per dataset (held-out, eval sets, later turns), checked against its generations."""
    prompts, _ = evalsets.heldout_prompts(
        cfg.run_dir, cfg.shared.heldout_percent, p.max_prompts_per_dataset, p.max_prompt_tokens, p.a_prompt
    )
    multi = []
    for es in p.eval_sets:
        rows, _ = evalsets.read(es, tokenizer, p.max_prompt_tokens)
        prompts[es.name] = [Prompt(r["id"], es.name, r["prompt_ids"]) for r in rows]
        multi += [r for r in rows if r.get("later_turns")]
    greedy = {(g["dataset"], g["id"]): g for g in gens if g["method"] == "none" and g["temperature"] == 0}
    by_ids = {tuple(pr.prompt_ids): greedy.get((ds, pr.id)) for ds, ps in prompts.items() for pr in ps}

    def answer(
        ids: list[int],
    ) -> list[int]:  # the target's greedy answer to an earlier turn, as 06 decoded it
        g = by_ids.get(tuple(ids))
        if g is None:
            raise llamacpp.LlamaCppError(f"{cfg.out('eval', 'generations.jsonl')}: no greedy 'none' decoding of "
                                         "an earlier turn's prompt (06 with methods including none at T=0)")  # fmt: skip
        return g["output_ids"]

    if multi:
        later, _ = evalsets.followups(multi, tokenizer, answer, p.max_prompt_tokens)
        prompts |= later
    for ds, ps in prompts.items():
        for pr in ps:
            g = greedy.get((ds, pr.id))
            if g is None or g["n_prompt"] != len(pr.prompt_ids):
                got = "none" if g is None else f"{g['n_prompt']} tokens"
                raise llamacpp.LlamaCppError(
                    f"{cfg.out('eval', 'generations.jsonl')}: prompt {ds}/{pr.id} rebuilt with {len(pr.prompt_ids)} "
                    f"tokens, 06 decoded {got}: the run's data or params changed since 06 ran"
                )
    return prompts


# --- serving ------------------------------------------------------------------------------------------------
# nats between the target's token and the one the verify batch chose. Measured on SmolLM2 Q4_1 (2 threads): 0.004,
# 0.010 and 0.070, each reproduced with the target drafting for itself (--spec-type draft-simple), so not the drafter
NEAR_TIE = 0.1


def request_seed(seed: int, temperature: float, pr: Prompt) -> int:
    return int(store.stable_hash([seed, temperature, pr.dataset, pr.id], 8), 16) % (2**31)


def _pool(ps: list[Prompt], res: list[dict]) -> dict:
    keys = ("predicted_n", "predicted_ms", "seconds", "draft_n", "draft_n_accepted")
    return {k: sum(r[k] for r in res) for k in keys} | {
        "outputs": {pr.id: r["tokens"] for pr, r in zip(ps, res, strict=True)},
        "stop_types": [r["stop_type"] for r in res],
    }


def divergence(plain_url: str, pr: Prompt, spec: list[int], plain: list[int], max_new: int) -> dict:
    """Where the output with the draft leaves the target's own, and how close the target's two candidates were
    there (its logprobs, from the target-alone server): a near tie is the verify batch's arithmetic, not the
    drafter (greedy verification keeps the target's argmax whatever is drafted)."""
    k = next(
        (i for i, (a, b) in enumerate(zip(spec, plain, strict=False)) if a != b), min(len(spec), len(plain))
    )
    _, probs = ls.top_logprobs(plain_url, pr.prompt_ids, max_new)
    top = probs[k] if k < len(probs) else {}
    want, got = (plain[k] if k < len(plain) else None), (spec[k] if k < len(spec) else None)
    gap = top[want] - top[got] if want in top and got in top else None
    return {"id": pr.id, "position": k, "target_token": want, "draft_run_token": got, "logprob_gap": gap,
            "near_tie": gap is not None and gap < NEAR_TIE}  # fmt: skip


def serve_pair(spec_url: str, plain_url: str, prompts: dict[str, list[Prompt]], max_new: int, temperature: float,
               top_p: float, top_k: int, seed: int, timeout_s: float = 600.0) -> tuple[dict, dict]:  # fmt: skip
    """Per dataset, every prompt once on the target alone and then with the draft (batch 1, alternating, so a
    change in the machine's load hits both alike): outputs, the responses' own timings and draft counts; with the
    draft also the /metrics counter deltas (verify steps, accepted, per position) and, at T=0, every divergence
    from the target alone (:func:`divergence`)."""
    spec_out, plain_out = {}, {}
    for ds, ps in prompts.items():
        before = ls.counters(spec_url)
        res, base = [], []
        for pr in ps:
            args = (max_new, temperature, top_p, top_k, request_seed(seed, temperature, pr), timeout_s)
            base.append(ls.complete(plain_url, pr.prompt_ids, *args))
            res.append(ls.complete(spec_url, pr.prompt_ids, *args))
        o = _pool(ps, res)
        after = ls.settled(spec_url, before, o["predicted_n"])
        o |= {k: after[k] - before.get(k, 0.0) for k in after if k != "predicted"}
        if temperature == 0:
            o["divergence"] = [divergence(plain_url, pr, r["tokens"], b["tokens"], max_new)
                               for pr, r, b in zip(ps, res, base, strict=True) if r["tokens"] != b["tokens"]]  # fmt: skip
        spec_out[ds], plain_out[ds] = o, _pool(ps, base)
    return spec_out, plain_out


# --- the comparison -------------------------------------------------------------------------------------------
def _offline(gens: list[dict], temperature: float, keys: set) -> list[int]:
    """Per-step accepted + 1 (uncut: drafts matched past the stop too) of 06's eagle3 runs on these prompts."""
    return [a + 1 for g in gens if g["method"] == "eagle3" and g["temperature"] == temperature
            and (g["dataset"], g["id"]) in keys for a in g["matched"]]  # fmt: skip


def _var(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def compare(raw: dict, plain: dict, gens: list[dict], eos: list[int], num_steps: int) -> pd.DataFrame:
    """One row per temperature x dataset (and ``all``): llama.cpp's tau beside the offline one, the output checks,
    tokens/s with and without the draft (see the module doc)."""
    ref = {
        (g["dataset"], g["id"]): g["output_ids"]
        for g in gens
        if g["method"] == "none" and g["temperature"] == 0
    }
    rows = []
    for temp, per in sorted(raw.items()):
        for ds in [*per, "all"]:
            sets = list(per) if ds == "all" else [ds]
            s = {k: sum(per[d].get(k, 0.0) for d in sets) for k in
                 ("drafts", "accepted", "draft_tokens", "predicted_n", "predicted_ms", "draft_n", "draft_n_accepted")}  # fmt: skip
            b = {k: sum(plain[temp][d][k] for d in sets) for k in ("predicted_n", "predicted_ms")}
            keys = {(d, i) for d in sets for i in per[d]["outputs"]}
            off = _offline(gens, temp, keys)
            tau = 1 + s["accepted"] / s["drafts"] if s["drafts"] else float("nan")
            off_tau = sum(off) / len(off) if off else float("nan")
            # the llama.cpp side's per-step spread is not reported per step: the offline one stands in for it
            noise = 2 * math.sqrt(_var(off) / max(len(off), 1) + _var(off) / max(s["drafts"], 1))
            row = dict(temperature=temp, dataset=ds, prompts=len(keys), llamacpp_tau=tau, offline_tau=off_tau,
                       diff=tau - off_tau, noise=noise, verify_steps=s["drafts"], accepted=s["accepted"],
                       draft_tokens=s["draft_tokens"],
                       acc=[sum(per[d].get(f"pos_{i}", 0.0) for d in sets) / s["drafts"] if s["drafts"] else math.nan
                            for i in range(num_steps)],
                       tokens_per_s=1000 * s["predicted_n"] / s["predicted_ms"] if s["predicted_ms"] else math.nan,
                       tokens_per_s_no_draft=1000 * b["predicted_n"] / b["predicted_ms"] if b["predicted_ms"] else math.nan)  # fmt: skip
            row["speedup"] = row["tokens_per_s"] / row["tokens_per_s_no_draft"]
            if temp == 0:
                pairs = [
                    (per[d]["outputs"][i], plain[temp][d]["outputs"][i], ref.get((d, i))) for d, i in keys
                ]
                row["greedy_equal"] = sum(a == b for a, b, _ in pairs) / len(pairs)
                ties = sum(x["near_tie"] for d in sets for x in per[d].get("divergence", []))
                row["greedy_equal_or_tie"] = row["greedy_equal"] + ties / len(pairs)
                row["equal_to_offline"] = sum(
                    r is not None and same_output(b, r, set(eos)) for _, b, r in pairs
                ) / len(pairs)
            rows.append(row)
    return pd.DataFrame(rows)


def verdict(row: dict, tolerance: float) -> dict:
    """agree | lower | higher, and the causes that can explain a gap beyond noise (and tolerance)."""
    gap = row["diff"]
    if gap != gap:
        return {"verdict": "no_tau", "causes": []}
    if abs(gap) <= max(row["noise"], tolerance):
        return {"verdict": "agree", "causes": []}
    causes = [CAUSES["numerics"]] if row.get("equal_to_offline", 1.0) < 1 or row["temperature"] == 0 else []
    causes += [CAUSES["rule"]] if row["temperature"] > 0 else []
    return {"verdict": "lower" if gap < 0 else "higher", "causes": causes + [CAUSES["aux"], CAUSES["vocab"]]}


# --- what 06 runs ---------------------------------------------------------------------------------------------
def run(cfg, headline: dict | None = None, threads: int = 0) -> pd.DataFrame:
    """06's llama.cpp measurement (after ``acceptance.run``): convert + preflight the drafter, serve 06's online
    prompts with and without it, write eval/llamacpp.{csv,json}; adds ``llamacpp`` to `headline`. `threads`: each
    server's compute threads (0: shared.num_workers, else every core; on a machine other jobs share, 1 keeps the
    timings from collapsing: 2 threads on 2 busy cores wait on each other by whole time slices)."""
    from eagle_lib import models

    p = cfg.stage.served(cfg.shared)
    if not getattr(p, "llamacpp", False):
        return pd.DataFrame([{"llama.cpp": "not measured (llamacpp: false)"}])
    why = llamacpp.wait_for_build()  # `make test` builds it behind the first tests
    if why:
        raise llamacpp.LlamaCppError(f"06 llamacpp: true, but {why}")
    out = cfg.out("eval")
    meta = json.loads((out / "meta.json").read_text())
    if "speculators" not in meta.get("exports", {}):
        raise llamacpp.LlamaCppError(
            f"{out / 'meta.json'}: no speculators export, the format llama.cpp converts"
        )
    trained = Path(meta["drafter_dir"]) / "drafter_config.json"
    aux = json.loads(trained.read_text())["config"]["aux_layers"] if trained.is_file() else None
    work = out / "llamacpp"
    draft, target, checks = llamacpp.make_draft(meta["exports"]["speculators"], cfg.shared.target, work, aux)
    gens = list(store.iter_jsonl(out / "generations.jsonl")) if (out / "generations.jsonl").is_file() else []
    if not gens:
        raise llamacpp.LlamaCppError(f"{out}: no offline generations (llamacpp needs offline: true)")
    tok = models.load_tokenizer(cfg.shared)
    prompts = {ds: ps[: p.online_max_prompts] for ds, ps in eval_prompts(cfg, p, tok, gens).items()}
    threads = machine.capped(threads or cfg.shared.num_workers or machine.usable_cores())
    ctx = max(1024, p.max_prompt_tokens + p.eval_max_new_tokens + 2 * p.num_steps + 16)
    temps = p.online_temps
    raw, plain = {}, {}
    kw = dict(
        num_steps=p.num_steps, threads=threads, ctx_size=ctx, log_dir=work, poll=0
    )  # two servers: no spinning
    with ls.start_server(target, None, **kw) as alone, ls.start_server(target, draft, **kw) as spec:
        first = next(iter(prompts.values()))[0]
        for srv in (alone, spec):  # the first request builds the graphs: not measured
            ls.complete(srv.base_url, first.prompt_ids, 4)
        for t in temps:
            raw[t], plain[t] = serve_pair(spec.base_url, alone.base_url, prompts, p.eval_max_new_tokens, t,
                                          p.top_p if t else 1.0, p.top_k if t else 0, cfg.shared.seed,
                                          p.online_timeout_s)  # fmt: skip
    table = compare(raw, plain, gens, meta["stop_ids"], p.num_steps)
    table = pd.concat(
        [table, pd.DataFrame([verdict(r, p.online_tolerance) for r in table.to_dict("records")])], axis=1
    )
    table.to_csv(out / "llamacpp.csv", index=False)
    cmd = ls.server_command(target, draft, num_steps=p.num_steps, threads=threads, ctx_size=ctx, poll=0)
    store.write_json(out / "llamacpp.json", {
        "command": " ".join(cmd), "command_no_draft": " ".join(ls.server_command(target, threads=threads, ctx_size=ctx, poll=0)),
        "draft": str(draft), "target": str(target), "threads": threads, "build_profile": llamacpp.build_profile(),
        "preflight": [c.__dict__ for c in checks], "with_draft": raw, "no_draft": plain,
        "table": table.to_dict("records")})  # fmt: skip
    if headline is not None:
        headline["llamacpp"] = summary(table, " ".join(cmd))
    return table


def summary(table: pd.DataFrame, command: str) -> dict:
    """The headline entry: per temperature the pooled tau (llama.cpp and offline), output checks, tokens/s."""
    out: dict = {"command": command, "build_profile": llamacpp.build_profile()}
    if (
        out["build_profile"] == "test"
    ):  # tokens/s of a -O0 build (scripts/install_llamacpp.sh): not for reporting
        out["note"] = (
            "tokens/s from make test's build (-O0 outside ggml); `make llamacpp-env` builds the release"
        )
    for r in table[table.dataset == "all"].to_dict("records"):
        keys = ["llamacpp_tau", "offline_tau", "noise", "tokens_per_s", "tokens_per_s_no_draft", "speedup",
                "greedy_equal", "greedy_equal_or_tie", "equal_to_offline", "verdict"]  # fmt: skip
        out[f"T={r['temperature']:g}"] = {k: (round(r[k], 4) if isinstance(r[k], float) else r[k])
                                          for k in keys if k in r and r[k] == r[k]}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    from eagle_lib import params

    ap = argparse.ArgumentParser(
        prog="python -m eagle_lib.serving.llamacpp_eval", description=__doc__.split("\n")[0]
    )
    ap.add_argument("params_file")
    ap.add_argument("--run-dir", default="", help="the run 06 ran in (default: outputs/<run_name>)")
    ap.add_argument("--threads", type=int, default=0, help="compute threads per server (default: every core)")
    a = ap.parse_args(argv)
    run_params = params.load_params(a.params_file)
    stage = run_params.stage(STAGE).model_copy(update={"llamacpp": True})
    cfg = params.StageConfig(
        STAGE, params.resolve_run_dir(a.run_dir or run_params.run_dir), run_params.shared, stage
    )
    h: dict = {}
    table = run(cfg, h, a.threads)
    cols = ["temperature", "dataset", "prompts", "llamacpp_tau", "offline_tau", "noise", "greedy_equal",
            "greedy_equal_or_tie", "equal_to_offline", "tokens_per_s", "tokens_per_s_no_draft", "speedup", "verdict"]  # fmt: skip
    print(table[[c for c in cols if c in table]].round(3).to_string(index=False))
    print(json.dumps(h, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
