"""The printed table of bench_quality.py's real-model mode, from the job results under its work dir: each
side's tau (mean, sd, range over seeds) per prompt group at T=0 and T=1, the ratios ours / speculators and
ours / SpecForge, per-position acceptance, the tau curve over the budget and the steps ours needs to reach each
peer's final tau (`quality_stats`). The last line is the same as one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

import quality_stats as qs

SIDES = ("ours", "speculators", "SpecForge")
MAIN = "MT-Bench+HumanEval"
RECIPES = {"speculators": "kl_div, Muon+AdamW, clip 1.0", "SpecForge": "its soft CE, AdamW, clip 0.5"}


def _tau(per_prompt: dict, groups: dict[str, str], want) -> float:
    rows = [v for pid, v in per_prompt.items() if want(groups[pid])]
    return sum(r["num"] for r in rows) / max(1, sum(r["den"] for r in rows))


def _taus(per_prompt: dict, groups: dict[str, str]) -> dict[str, float]:
    """tau per group, over MT-Bench + HumanEval (every eval set) and over all prompts."""
    out = {g: _tau(per_prompt, groups, lambda x, g=g: x == g) for g in dict.fromkeys(groups.values())}
    out[MAIN] = _tau(per_prompt, groups, lambda x: x != "heldout")
    out["all"] = _tau(per_prompt, groups, lambda x: True)
    return out


def _acc(per_prompt: dict, k: int) -> list[float]:
    """Unconditional acceptance of draft positions 1..k (T=0) over every verify step."""
    acc = [a for v in per_prompt.values() for a in v["accepted"]]
    return [sum(a >= i for a in acc) / max(1, len(acc)) for i in range(1, k + 1)]


def collect(work: Path, plan: dict) -> dict:
    """{side: {seed: {step: {"t0": taus, "acc": [...], "t1": taus?}}}} and the groups of each prompt, over the
    seeds ours finished; a peer is in it only where it finished every one of them (a ``--sides ours`` variant's
    work dir reports ours alone)."""
    import torch

    refs = torch.load(work / "refs.pt", weights_only=False)
    g0 = {p["id"]: p["group"] for p in refs["t0"]}
    g1 = {p["id"]: p["group"] for p in refs["t1"]}
    res: dict = {}

    def finished(side: str, s: int) -> bool:
        return (work / side / f"seed{s}" / f"step_{plan['steps']}" / "tau.json").exists()

    done = [s for s in plan["seeds"] if finished("ours", s)]
    sides = [side for side in SIDES if done and all(finished(side, s) for s in done)]
    for side in sides:
        for seed in done:
            for m in ([0] if side == "ours" else []) + plan["marks"]:
                r = json.loads((work / side / f"seed{seed}" / f"step_{m}" / "tau.json").read_text())
                row = {"t0": _taus(r["t0"], g0), "acc": _acc(r["t0"], refs["k"])}
                if "t1" in r:
                    row["t1"] = _taus(r["t1"], g1)
                res.setdefault(side, {}).setdefault(seed, {})[m] = row
    return {
        "res": res,
        "refs": refs,
        "groups": list(dict.fromkeys(g0.values())),
        "seeds": done,
        "sides": sides,
    }


def _cell(xs: list[float]) -> str:
    s = qs.mean_spread(xs)
    return f"{s['mean']:.3f} ± {s['sd']:.3f} [{s['min']:.2f}-{s['max']:.2f}]"


def report(work: Path, plan: dict, total_s: float | None) -> str:
    c = collect(work, plan)
    res, refs, seeds, final, sides = c["res"], c["refs"], c["seeds"], plan["steps"], c["sides"]
    if not seeds:
        return f"{work}: no seed has our side's tau yet"
    cols = [*c["groups"], MAIN, "all"]
    lines = []
    train = {side: [json.loads((work / side / f"seed{s}" / "result.json").read_text()) for s in seeds]
             for side in sides}  # fmt: skip
    n0 = {g: sum(p["group"] == g for p in refs["t0"]) for g in c["groups"]}
    n1 = {g: sum(p["group"] == g for p in refs["t1"]) for g in c["groups"]}
    lines += [
        f"Real run {plan['run_dir']}: {plan['steps']} steps x {plan['tokens_per_step']} tokens a step, seeds {seeds} (planned {plan['seeds']}); "
        f"sides {', '.join(sides)}; {plan['sequences']} of 05's {plan['train_sequences']} training sequences have kept hidden states "
        f"({plan['kept_tokens']} tokens)",
        f"  k={plan['k']} drafts trained and served; peak lr ours {plan['lr']}, peers {plan.get('peer_lr', plan['lr'])}, "
        f"warmup {plan['warmup']}; ours: 05's recipe ({plan['optimizer']})"
        + (f" with {' '.join(plan['ours_set'])}" if plan.get("ours_set") else "")
        + "".join(f"; {side}: {RECIPES[side]}" for side in sides[1:]),
        f"  tau = tokens per target verify step ({refs['k']} drafts). T=0: {sum(n0.values())} prompts {n0} x "
        f"{refs['new_tokens']} new tokens, greedy. T=1: top_p {refs['top_p']}, {refs['draft_sampling']} drafts, "
        f"{sum(n1.values())} prompts {n1} x {refs['new_tokens']} tokens x {_reps(work)} sampling seeds",
    ]
    hid = train["ours"][0].get("hidden", {})
    lines.append(f"  hidden states: every side read the run's kept store ({plan['store']}); ours produced "
                 f"{hid.get('produced_tokens')} tokens (no producer), read {hid.get('kept_tokens')} kept")  # fmt: skip
    if (work / "check.json").exists():
        ck = json.loads((work / "check.json").read_text())
        lines.append(f"  T=0 replay check: {ck['same']}/{ck['prompts']} prompts decode step for step as the real "
                     f"decoder (tau {ck['tau']['replay']:.3f} vs {ck['tau']['real']:.3f}; {ck['task']['side']} "
                     f"seed {ck['task']['seed']})")  # fmt: skip
    out = {"plan": {k: plan[k] for k in ("steps", "seeds", "marks", "sequences", "kept_tokens")}, "tau": {}}
    for temp in ("t0", "t1"):
        lines.append(f"\n{'T=0' if temp == 't0' else 'T=1'}: tau mean ± sd [min-max] over {len(seeds)} seeds")
        lines.append(f"  {'side':16s} " + " | ".join(f"{g:^27s}" for g in cols))
        for side in sides:
            vals = {g: [res[side][s][final][temp][g] for s in seeds] for g in cols}
            out["tau"].setdefault(side, {})[temp] = {g: qs.mean_spread(v) for g, v in vals.items()}
            lines.append(f"  {side:16s} " + " | ".join(f"{_cell(vals[g]):^27s}" for g in cols))
        for peer in sides[1:]:
            r = {g: qs.ratio([res["ours"][s][final][temp][g] for s in seeds],
                             [res[peer][s][final][temp][g] for s in seeds]) for g in cols}  # fmt: skip
            out.setdefault("ratio", {}).setdefault(peer, {})[temp] = r
            lines.append(f"  ours/{peer:11s} " + " | ".join(
                f"{x['ratio']:.3f} (seeds {x['min']:.2f}-{x['max']:.2f})".center(27) for x in r.values()))  # fmt: skip
    lines += _served(work, seeds, sides, out)
    lines.append("\nT=0 acceptance by draft position (unconditional, all prompts, final step, seed mean)")
    for side in sides:
        acc = [sum(res[side][s][final]["acc"][i] for s in seeds) / len(seeds) for i in range(refs["k"])]
        lines.append(f"  {side:12s} {[round(x, 3) for x in acc]}")
    lines += _steps(res, plan, seeds, sides, out)
    lines.append("\nTraining seconds (steps only, one core each; seed mean): " + ", ".join(
        f"{side} {sum(t['train_s'] for t in train[side]) / len(seeds):.0f}" for side in sides))  # fmt: skip
    if total_s is not None:  # None: the table alone (`quality_real.py report`), no invocation to time
        lines.append(
            f"Wall: {total_s / 60:.1f} min for this invocation (jobs found done in the work dir are not rerun)"
        )
    lines.append(json.dumps(out))
    text = "\n".join(lines)
    return text


def _reps(work: Path) -> int:
    return json.loads((work / "eval.json").read_text())["reps"]


def _steps(res, plan, seeds, sides, out) -> list[str]:
    """The T=0 tau curve (MT-Bench + HumanEval) of each side and steps ours needs to reach each peer's final."""
    marks, final = plan["marks"], plan["steps"]
    lines = [f"\nSteps to quality (T=0, {MAIN} tau at each kept step, seed mean)"]
    steps_ours = [0, *marks]
    for side in sides:
        at = steps_ours if side == "ours" else marks
        mean = [sum(res[side][s][m]["t0"][MAIN] for s in seeds) / len(seeds) for m in at]
        lines.append(f"  {side:12s} " + "  ".join(f"{m}: {t:.3f}" for m, t in zip(at, mean, strict=True)))
    curves = [[res["ours"][s][m]["t0"][MAIN] for m in steps_ours] for s in seeds]
    for peer in sides[1:]:
        finals = [res[peer][s][final]["t0"][MAIN] for s in seeds]
        x = qs.steps_interval(steps_ours, curves, finals)
        out.setdefault("steps_to_peer_final", {})[peer] = x
        frac = "" if x["fraction"] is None else f" = {x['fraction']:.2f} of its {final} steps"
        lines.append(
            f"  steps ours needs to reach the {peer} drafter's final tau {sum(finals) / len(finals):.3f}: "
            f"{qs.fmt_steps(x['point'], final)}{frac} (interval over {x['pairs']} seed pairs: "
            f"{qs.fmt_steps(x['lo'], final)} to {qs.fmt_steps(x['hi'], final)})"
        )
    return lines


def _served_tau(groups: dict, want) -> float:
    rows = [v for g, v in groups.items() if want(g)]
    drafts = sum(r["drafts"] for r in rows)
    return 1 + sum(r["accepted"] for r in rows) / drafts if drafts else float("nan")


def _served(work: Path, seeds: list, sides: list, out: dict) -> list[str]:
    """``--vllm``: each side's final drafter served by vLLM (`quality_jobs.job_serve`), tau over MT-Bench +
    HumanEval and over all prompts (vLLM's /metrics counts), the greedy outputs equal to the target's, and ours /
    each peer; the sides and seeds served so far."""
    got = {side: [work / side / f"seed{s}" / "served.json" for s in seeds] for side in sides}
    served = [side for side in sides if all(f.exists() for f in got[side])]
    if not served:
        return []
    lines = [
        f"\nServed by vLLM 0.32 CPU (final drafters; {MAIN} | all prompts), mean ± sd [min-max] over {len(seeds)} seeds"
    ]
    taus: dict = {}
    for side in served:
        rows = [json.loads(f.read_text()) for f in got[side]]
        cells = []
        for temp in ("t0", "t1"):
            for name, want in ((MAIN, lambda g: g != "heldout"), ("all", lambda g: True)):
                vals = [_served_tau(r[temp], want) for r in rows]
                taus.setdefault(side, {}).setdefault(temp, {})[name] = vals
                cells.append(_cell(vals))
        same, n = sum(r["same"] for r in rows), sum(r["n"] for r in rows)
        out.setdefault("served", {})[side] = {
            t: {k: qs.mean_spread(v) for k, v in d.items()} for t, d in taus[side].items()
        }
        out["served"][side]["same"] = [same, n]
        lines.append(
            f"  {side:12s} T=0 {cells[0]} | {cells[1]}   T=1 {cells[2]} | {cells[3]}   greedy = target's {same}/{n}"
        )
    for peer in [x for x in served if x != "ours" and "ours" in served]:
        r = {t: qs.ratio(taus["ours"][t][MAIN], taus[peer][t][MAIN]) for t in ("t0", "t1")}
        out["served"].setdefault("ratio", {})[peer] = r
        lines.append(
            f"  ours/{peer:11s} {MAIN}: T=0 {r['t0']['ratio']:.3f} (seeds {r['t0']['min']:.2f}-{r['t0']['max']:.2f}), "
            f"T=1 {r['t1']['ratio']:.3f} (seeds {r['t1']['min']:.2f}-{r['t1']['max']:.2f})"
        )
    return lines
