"""Where the real-model drafters' T=0 acceptance differs: teacher-forced acceptance per draft position and per
target confidence, for every side and seed bench_quality.py's real mode (quality_real.py) trained.

Prompts: the bench's own T=0 ones (refs.pt: 06's MT-Bench, HumanEval and held-out prompts; the first
``--per-set`` of each dataset), each with the target's greedy continuation (the bench's recorded greedy path,
cut to ``--new-tokens`` and after the stop token; decoded afresh where the record is shorter). The target reads
prompt + continuation once (`LayerCapture`: the aux features the drafters were trained on, and its logits).
Per drafter, at each continuation row r (token x[r+1], features f_r) it drafts k tokens as decoding does (draft
1 from the target's features, then from its own hidden state and previous draft, attending to the target rows
<= r and its own chain: `ttt.ttt_attention`); draft i is right when it equals the greedy token x[r+1+i].
Printed: per position the unconditional acceptance (drafts 1..i right) and the conditional one; position 1 by
the target's confidence at the drafted token (top softmax probability at T=1) and by eval group; ours - peer
at position 1 as a sum over buckets of share x (acc ours - acc peer); beside them the decoded acceptance
(tau.json: the bench's decode, of its own new tokens), which counts cycles (they start where the last one was
rejected) rather than positions.
Checks (an error when one fails): the real decoder's first verify step of each prompt
(`specdec.speculative_generate`, the target's KV cache) drafts the chain's k tokens at the prompt's last row
and accepts as many; 05's TTT unroll (`ttt.TTT`, drafted inputs) counts as this chain does at every position.

    .venv/bin/python benchmarks/quality_diag.py --work-dir /tmp/bq_real [--step 96] [--seeds 0 1 2] \\
        [--per-set 10] [--new-tokens 48]

Writes <work-dir>/diag.json; caches the target's pass in <work-dir>/diag_target_<new tokens>.pt.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from eagle_lib.decoding import specdec

SIDES = ("ours", "speculators", "SpecForge")
EDGES = (0.3, 0.6, 0.9)  # target confidence buckets [0, .3), [.3, .6), [.6, .9), [.9, 1]
BUCKETS = ("[0,0.3)", "[0.3,0.6)", "[0.6,0.9)", "[0.9,1.0]")


# --- arithmetic -------------------------------------------------------------------------------------------
def bucket_of(p: float) -> int:
    """Index of the confidence bucket holding probability p (1.0 falls in the last)."""
    return sum(p >= e for e in EDGES)


def position_acceptance(hit: list[list[bool]], has: list[list[bool]]) -> tuple[list, list]:
    """(unconditional, conditional) acceptance of positions 1..k over rows: draft i counts as accepted when
    drafts 1..i are all right; unconditional over the rows with a label at i, conditional over those whose
    drafts 1..i-1 were right. NaN where nothing is counted."""
    k = len(hit[0]) if hit else 0
    unc, cond = [], []
    for i in range(k):
        num = sum(all(h[: i + 1]) and s[i] for h, s in zip(hit, has, strict=True))
        den_u = sum(s[i] for s in has)
        den_c = sum(all(h[:i]) and s[i] for h, s in zip(hit, has, strict=True))
        unc.append(num / den_u if den_u else float("nan"))
        cond.append(num / den_c if den_c else float("nan"))
    return unc, cond


def by_bucket(conf: list[float], hit1: list[bool]) -> list[dict]:
    """Per confidence bucket: the share of rows, the rows and the acceptance of draft 1 there."""
    n = len(conf)
    out = []
    for b in range(len(BUCKETS)):
        hits = [h for c, h in zip(conf, hit1, strict=True) if bucket_of(c) == b]
        out.append({"share": len(hits) / n if n else 0.0, "n": len(hits),
                    "acc": sum(hits) / len(hits) if hits else float("nan")})  # fmt: skip
    return out


def contributions(shares: list[float], acc_a: list[float], acc_b: list[float]) -> list[float]:
    """Each bucket's part of the position-1 gap a - b (same rows, so the parts add up to it)."""
    return [0.0 if s == 0 else s * (a - b) for s, a, b in zip(shares, acc_a, acc_b, strict=True)]


def spread(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def no_nan(x):
    """x with every NaN as None (strict JSON)."""
    if isinstance(x, dict):
        return {k: no_nan(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [no_nan(v) for v in x]
    return None if isinstance(x, float) and x != x else x


def select_prompts(prompts: list[dict], per_set: int) -> list[dict]:
    """The first per_set prompts of each dataset, in the bench's order (0: all)."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        seen[p["dataset"]] = seen.get(p["dataset"], 0) + 1
        if not per_set or seen[p["dataset"]] <= per_set:
            out.append(p)
    return out


# --- the target's pass ------------------------------------------------------------------------------------
@torch.no_grad()
def target_pass(target, aux_layers: list[int], ids: list[int]):
    """One forward over ids: aux features (L, 3H), the greedy token after each position (L,) and the top
    softmax probability at T=1 there (L,)."""
    from eagle_lib.hidden_states.hidden import LayerCapture

    cap = LayerCapture(target, aux_layers)
    with cap:
        logits = target(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    feats = cap.take()[0]  # (L, 3H) in the target's dtype
    return feats, logits.argmax(-1), logits.softmax(-1).max(-1).values


def greedy_continuation(
    target, prompt: list[int], new_tokens: int, eos: list[int], recorded=None
) -> list[int]:
    """The target's greedy output (at most new_tokens, up to and with the first stop token): the recorded
    greedy path's when it reaches that far, else decoded here (`specdec`, the target alone)."""
    if recorded is not None and recorded[: len(prompt)] == prompt:
        out = recorded[len(prompt) :]
        stop = next((i for i, t in enumerate(out[:new_tokens]) if t in eos), None)
        if stop is not None or len(out) >= new_tokens:
            return out[: new_tokens if stop is None else stop + 1]
    runner = specdec.TargetRunner(target)
    return specdec.speculative_generate(runner, specdec.NoProposer(), prompt, new_tokens, 0, eos).output_ids


def target_material(work: Path, target, prompts: list[dict], refs: dict, new_tokens: int, aux: list[int]):
    """Per prompt: ids (prompt + continuation), n (prompt length), features, greedy tokens and confidence of
    the target's pass (cached under work, keyed by the prompts, new_tokens and the aux layers)."""
    cache = work / f"diag_target_{new_tokens}.pt"
    key = {"prompts": [[p["id"], p["prompt_ids"]] for p in prompts], "aux": list(aux), "new": new_tokens}
    if cache.exists():
        got = torch.load(cache, weights_only=False)
        if got["key"] == key:
            return got["seqs"]
    seqs, worst, flips = [], 0.0, 0
    for p in prompts:
        rec = refs["paths"].get(p["id"])
        cont = greedy_continuation(target, p["prompt_ids"], new_tokens, refs["eos"], rec and rec["seq"])
        ids = p["prompt_ids"] + cont
        feats, arg, conf = target_pass(target, aux, ids)
        n = len(p["prompt_ids"])
        flips += int((arg[n - 1 : -1] != torch.tensor(cont)).sum())
        if rec is not None:  # the bench's features (KV-cache decode) against this pass
            m = min(len(feats), len(rec["feats"]))
            worst = max(worst, float((feats[:m].float() - rec["feats"][:m].float()).abs().max()))
        seqs.append({**p, "ids": ids, "n": n, "feats": feats, "argmax": arg, "conf": conf})
    recorded = sum(p["id"] in refs["paths"] for p in prompts)
    print(f"  target pass: {len(seqs)} prompts, {sum(len(s['ids']) - s['n'] for s in seqs)} continuation "
          f"tokens; full-forward argmax differs from the decoded token at {flips}"
          + (f"; features vs the bench's recorded ones ({recorded} prompts): max |diff| {worst:.2e}"
             if recorded else ""), flush=True)  # fmt: skip
    torch.save({"key": key, "seqs": seqs}, cache)
    return seqs


# --- teacher-forced drafts --------------------------------------------------------------------------------
@torch.no_grad()
def chain(drafter, ids: list[int], feats: torch.Tensor, k: int) -> torch.Tensor:
    """(L-1, k) target ids: at row r (token ids[r+1], features feats[r]) the k drafts decoding makes after the
    prefix ids[: r+2], each fed the previous draft and the drafter's own hidden state."""
    from eagle_lib.drafter.ttt import ttt_attention

    d, c = drafter, drafter.config
    rep = c.num_attention_heads // c.num_key_value_heads
    t = len(ids) - 1
    pos = torch.arange(t)[None]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]  # (1, 1, T, T)
    hidden = d.project(feats[None, :t].to(d.fc.weight.dtype))  # (1, T, H)
    tokens = torch.tensor([ids[1:]])
    k0 = v0 = None
    ks, vs, drafts = [], [], []
    for i in range(k):
        q, kk, vv, res = d.qkv(tokens, hidden, pos + i)
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        if i == 0:
            k0, v0 = kk, vv
        else:
            ks.append(kk)
            vs.append(vv)
        out = d.finish(ttt_attention(q, k0, v0, mask, ks, vs), res)  # (1, T, H) pre-norm
        tokens = d.draft_to_target(d.head(out).argmax(-1))  # (1, T)
        drafts.append(tokens[0])
        hidden = d.feedback(out)
    return torch.stack(drafts, dim=1)


def rows_of(seq: dict, drafts: torch.Tensor, k: int) -> dict:
    """The continuation's rows r = n-1 .. L-3 (draft 1 predicts x[r+2], a continuation token): confidence at
    draft 1's label, and per position whether its label is in the continuation and the draft is right."""
    ids, n = seq["ids"], seq["n"]
    last = len(ids) - 1
    conf, hit, has = [], [], []
    for r in range(n - 1, last - 1):
        conf.append(float(seq["conf"][r + 1]))
        has.append([r + 2 + i <= last for i in range(k)])
        hit.append([r + 2 + i <= last and int(drafts[r, i]) == ids[r + 2 + i] for i in range(k)])
    return {"conf": conf, "hit": hit, "has": has}


# --- checks -----------------------------------------------------------------------------------------------
def first_step_check(drafter, runner, seqs: list[dict], drafts: list[torch.Tensor], k: int, eos) -> list[str]:
    """The real decoder's first verify step of each prompt against the teacher-forced chain at the prompt's
    last row: the same k drafts, as many accepted. Returns the mismatches."""
    bad = []
    for s, dr in zip(seqs, drafts, strict=True):
        n, cont = s["n"], s["ids"][s["n"] + 1 :]
        if s["ids"][n] in eos:  # the target stops at once: no verify step
            continue
        prop = FirstDrafts(drafter)
        g = specdec.speculative_generate(runner, prop, s["prompt_ids"], 2, k, eos)
        want = [int(x) for x in dr[n - 1]]
        lim = min(k, len(cont))  # drafts past the stop token are not compared with the continuation
        tf_acc = next((i for i in range(lim) if want[i] != cont[i]), lim)
        dec_acc = min(g.matched[0], lim) if g.matched else None
        if g.output_ids[0] != s["ids"][n] or prop.first != want or dec_acc != tf_acc:
            bad.append(f"{s['id']}: decoder drafts {prop.first} accepted {dec_acc}, first token "
                       f"{g.output_ids[0]}; teacher-forced {want} accepted {tf_acc}, first token {s['ids'][n]}")  # fmt: skip
    return bad


def ttt_check(drafter, seq: dict, rows: dict, k: int) -> str | None:
    """05's TTT unroll (drafted inputs) over the sequence, the continuation as its labels: its chained counts
    per position must be this chain's."""
    from eagle_lib.drafter import ttt

    ids, n = seq["ids"], seq["n"]
    length, vocab = len(ids), drafter.config.vocab_size
    logits = torch.zeros(1, length, vocab)  # one-hot: the target's greedy token after each position
    logits[0, torch.arange(length - 1), torch.tensor(ids[1:])] = 1.0
    mask = torch.zeros(1, length, dtype=torch.bool)
    mask[0, n + 1 :] = True  # labels: the continuation past its first token (never drafted)
    model = ttt.TTT(drafter, k, 1.0, "eager", "drafted")
    with torch.no_grad():
        _, st = model(torch.tensor([ids]), torch.arange(length)[None], torch.zeros(1, length, dtype=torch.long),
                      mask, seq["feats"][None], logits)  # fmt: skip
    got = [[int(st[i, ttt.COND_NUM]), int(st[i, ttt.COND_DEN])] for i in range(k)]
    hit, has = rows["hit"], rows["has"]
    want = [[sum(all(h[: i + 1]) and s[i] for h, s in zip(hit, has, strict=True)),
             sum(all(h[:i]) and s[i] for h, s in zip(hit, has, strict=True))] for i in range(k)]  # fmt: skip
    return None if got == want else f"{seq['id']}: TTT counts {got}, chain {want}"


class FirstDrafts(specdec.EagleProposer):
    """EagleProposer keeping its first proposal."""

    first: list[int] | None = None

    def propose(self, k: int) -> list[int]:
        out = super().propose(k)
        if self.first is None:
            self.first = list(out)
        return out


class MemoRunner(specdec.TargetRunner):
    """The real decoder's `TargetRunner`, its prefill kept per prompt (the same logits, features and KV cache
    for every drafter; each decode verifies on its own copy of the cache)."""

    def __init__(self, model, aux_layers: list[int]):
        super().__init__(model, aux_layers)
        self.memo: dict = {}

    def prefill(self, prompt_ids: list[int]):
        key = tuple(prompt_ids)
        if key not in self.memo:
            logits, feats = super().prefill(prompt_ids)
            self.memo[key] = (logits, feats, copy.deepcopy(self.cache))
        logits, feats, cache = self.memo[key]
        self.cache = copy.deepcopy(cache)
        return logits, feats


# --- per drafter, per side ----------------------------------------------------------------------------------
def load_side(side: str, path: Path, embed: torch.Tensor, aux: list[int]):
    """A kept drafter as quality_jobs' evaluation loads it: ours' own files, the peers' exports."""
    from eagle_lib.drafter import export
    from eagle_lib.drafter.model import load_drafter

    if side == "ours":
        return load_drafter(path).float().eval()
    d = export.load_export(path, embed, aux)
    if d.config.aux_layers != aux:
        raise ValueError(f"{path}: saved config names aux layers {d.config.aux_layers}, trained on {aux}")
    return d.float().eval()


def summarize(rows: list[dict], groups: list[str], in_vocab: list[bool], decoded: list[float]) -> dict:
    """One drafter's numbers from its rows (one dict per prompt, `rows_of`), each prompt's group."""
    flat = {key: [x for r in rows for x in r[key]] for key in ("conf", "hit", "has")}
    grp = [g for r, g in zip(rows, groups, strict=True) for _ in r["conf"]]
    unc, cond = position_acceptance(flat["hit"], flat["has"])
    buckets = by_bucket(flat["conf"], [h[0] for h in flat["hit"]])
    for b, bk in enumerate(buckets):
        inb = [v for c, v in zip(flat["conf"], in_vocab, strict=True) if bucket_of(c) == b]
        bk["in_draft_vocab"] = sum(inb) / len(inb) if inb else float("nan")
    by_group = {}
    for g in dict.fromkeys(groups):
        sel = [i for i, x in enumerate(grp) if x == g]
        u, _ = position_acceptance([flat["hit"][i] for i in sel], [flat["has"][i] for i in sel])
        by_group[g] = {"share": len(sel) / len(grp), "n": len(sel), "acc": u}
    return {"rows": len(grp), "acc": unc, "cond": cond, "buckets": buckets, "groups": by_group,
            "decoded_acc": decoded}  # fmt: skip


def decoded_acc(tau_json: Path, ids: list[str], k: int) -> list[float]:
    """The bench's decoded T=0 acceptance of positions 1..k (tau.json's accepted counts) on these prompts."""
    t0 = json.loads(tau_json.read_text())["t0"]
    acc = [a for i in ids for a in t0[i]["accepted"]]
    return [sum(a >= j for a in acc) / max(1, len(acc)) for j in range(1, k + 1)]


def run_drafter(side, path, seqs, k, embed, aux, runner, eos, tau_json) -> tuple[dict, list[str]]:
    d = load_side(side, path, embed, aux)
    rows, drafts, bad = [], [], []
    for s in seqs:
        dr = chain(d, s["ids"], s["feats"], k)
        r = rows_of(s, dr, k)
        rows.append(r)
        drafts.append(dr)
        err = ttt_check(d, s, r, k)
        bad += [err] if err else []
    bad += first_step_check(d, runner, seqs, drafts, k, eos)
    t2d = d.t2d.bool()
    in_vocab = [bool(t2d[s["ids"][r + 2]]) for s in seqs for r in range(s["n"] - 1, len(s["ids"]) - 2)]
    dec = decoded_acc(tau_json, [s["id"] for s in seqs], k) if tau_json.exists() else []
    return summarize(rows, [s["group"] for s in seqs], in_vocab, dec), bad


# --- report -----------------------------------------------------------------------------------------------
def _cell(xs: list[float]) -> str:
    s = spread(xs)
    return f"{s['mean']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def seed_mean(res: dict, side: str, get) -> float:
    return statistics.fmean(get(r) for r in res[side].values())


def report(res: dict, seqs: list[dict], step: int, k: int) -> tuple[list[str], dict]:
    """The printed tables and the JSON's summary (seed means, spreads, contributions)."""
    sides = [s for s in SIDES if res.get(s)]
    any_r = next(iter(res[sides[0]].values()))
    per_ds = dict(Counter(s["dataset"] for s in seqs))
    w = 25
    lines = [f"Teacher-forced T=0 acceptance at step {step}: {len(seqs)} prompts {per_ds}, "
             f"{any_r['rows']} continuation rows, k={k}; cells: seed mean [min-max]",
             "", f"  {'side':12s} {'seeds':6s} | " + " | ".join(f"{h:^{w}s}" for h in
             [*(f'acc {i + 1} (all before right)' for i in range(k)), *(f'cond {i + 1}' for i in range(1, k)),
              *(f'decoded acc {i + 1}' for i in range(k))])]  # fmt: skip
    summary = {"sides": {}, "contributions": {}}
    for side in sides:
        rs = list(res[side].values())
        cols = [[r["acc"][i] for r in rs] for i in range(k)] + [
            [r["cond"][i] for r in rs] for i in range(1, k)
        ]
        cols += [[r["decoded_acc"][i] for r in rs] for i in range(k)] if all(r["decoded_acc"] for r in rs) else []  # fmt: skip
        seeds = ",".join(str(x) for x in res[side])
        lines.append(f"  {side:12s} {seeds:6s} | " + " | ".join(f"{_cell(c):^{w}s}" for c in cols))
        summary["sides"][side] = {"acc": [spread(c) for c in cols[:k]], "cond": [spread(c) for c in cols[k:2 * k - 1]],
                                  "decoded_acc": [spread(c) for c in cols[2 * k - 1:]]}  # fmt: skip
    shares = [b["share"] for b in any_r["buckets"]]
    lines += ["", "Position 1 by the target's confidence at the drafted token (top probability, T=1):",
              f"  {'bucket':10s} {'share':>6s} {'in vocab':>8s} | " + " | ".join(f"{s:^{w}s}" for s in sides)]  # fmt: skip
    for b, name in enumerate(BUCKETS):
        accs = [_cell([r["buckets"][b]["acc"] for r in res[s].values()]) for s in sides]
        lines.append(f"  {name:10s} {shares[b]:6.3f} {any_r['buckets'][b]['in_draft_vocab']:8.3f} | "
                     + " | ".join(f"{x:^{w}s}" for x in accs))  # fmt: skip
    lines += ["", "Position 1 by eval group (unconditional acceptance of draft 1):",
              f"  {'group':10s} {'share':>6s} | " + " | ".join(f"{s:^{w}s}" for s in sides)]  # fmt: skip
    for g, gv in any_r["groups"].items():
        accs = [_cell([r["groups"][g]["acc"][0] for r in res[s].values()]) for s in sides]
        lines.append(f"  {g:10s} {gv['share']:6.3f} | " + " | ".join(f"{x:^{w}s}" for x in accs))
    if "ours" in sides:
        lines.append("\nWhere ours gains or loses vs each peer at position 1 (seed means; a bucket's part of the "
                     "gap = share x (acc ours - acc peer)):")  # fmt: skip
        mean_b = {s: [seed_mean(res, s, lambda r, b=b: r["buckets"][b]["acc"]) for b in range(len(BUCKETS))]
                  for s in sides}  # fmt: skip
        for peer in sides[1:]:
            parts = contributions(shares, mean_b["ours"], mean_b[peer])
            gap = seed_mean(res, "ours", lambda r: r["acc"][0]) - seed_mean(res, peer, lambda r: r["acc"][0])
            summary["contributions"][peer] = {"gap": gap, "parts": dict(zip(BUCKETS, parts, strict=True))}
            lines.append(f"  vs {peer}: gap {gap:+.4f} (acc 1 {gap + seed_mean(res, peer, lambda r: r['acc'][0]):.3f}"
                         f" vs {seed_mean(res, peer, lambda r: r['acc'][0]):.3f})")  # fmt: skip
            for b, name in enumerate(BUCKETS):
                verb = "gains" if parts[b] > 0 else "loses" if parts[b] < 0 else "even"
                lines.append(f"    {name:10s} share {shares[b]:.3f}: ours {mean_b['ours'][b]:.3f} vs "
                             f"{mean_b[peer][b]:.3f} -> {parts[b]:+.4f} of the gap ({verb})")  # fmt: skip
    return lines, summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", required=True, help="bench_quality.py's real-mode work dir")
    ap.add_argument("--step", type=int, default=0, help="kept step to diagnose (default: the plan's last)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds, those found at the step")
    ap.add_argument(
        "--per-set", type=int, default=0, help="first N T=0 prompts per dataset (0: all the bench's)"
    )
    ap.add_argument("--new-tokens", type=int, default=0, help="continuation length (0: the bench's)")
    a = ap.parse_args(argv)
    from eagle_lib import models
    from eagle_lib.params import SharedParams

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    work = Path(a.work_dir)
    for f in ("plan.json", "refs.pt"):
        if not (work / f).exists():
            sys.exit(f"{work / f} missing: run bench_quality.py's real mode (its refs job) first")
    plan = json.loads((work / "plan.json").read_text())
    refs = torch.load(work / "refs.pt", weights_only=False)
    step, k, aux = a.step or plan["steps"], refs["k"], plan["aux_layers"]
    prompts = select_prompts(refs["t0"], a.per_set)
    found = {side: [s for s in a.seeds if (work / side / f"seed{s}" / f"step_{step}" / "model.safetensors").exists()]
             for side in SIDES}  # fmt: skip
    if not any(found.values()):
        sys.exit(f"{work}: no drafter at step {step} for seeds {a.seeds}")
    print(f"{work}: step {step}, drafters {found}", flush=True)
    target = models.load_target(SharedParams(**plan["shared"]), device="cpu")
    seqs = target_material(work, target, prompts, refs, a.new_tokens or refs["new_tokens"], aux)
    runner, embed = MemoRunner(target, aux), target.get_input_embeddings().weight.detach().float()
    res, bad, checked = {}, [], 0
    for side in SIDES:
        for seed in found[side]:
            t1 = time.perf_counter()
            path = work / side / f"seed{seed}" / f"step_{step}"
            res.setdefault(side, {})[seed], errs = run_drafter(side, path, seqs, k, embed, aux, runner,
                                                               refs["eos"], path / "tau.json")  # fmt: skip
            bad += [f"{side} seed {seed}: {e}" for e in errs]
            checked += 1
            print(
                f"  {side} seed {seed}: {time.perf_counter() - t1:.0f} s, {len(errs)} check failures",
                flush=True,
            )
    lines, summary = report(res, seqs, step, k)
    n_first = sum(s["ids"][s["n"]] not in refs["eos"] for s in seqs)
    lines.append(f"\nChecks: {checked} drafters x {n_first} prompts, first verify step of the real decoder vs the "
                 f"teacher-forced chain at the prompt's last row, and 05's TTT counts over every row: "
                 f"{len(bad)} mismatches. Wall {time.perf_counter() - t0:.0f} s")  # fmt: skip
    print("\n".join(lines), flush=True)
    out = {"step": step, "k": k, "prompts": [s["id"] for s in seqs], "buckets": list(BUCKETS),
           "per_seed": res, "summary": summary, "check_failures": bad,
           "seconds": time.perf_counter() - t0}  # fmt: skip
    (work / "diag.json").write_text(json.dumps(no_nan(out), indent=1))
    if bad:
        sys.exit("consistency check failed:\n" + "\n".join(bad[:20]))


if __name__ == "__main__":
    main()
