"""Is a drafter trained on whole long sequences as good late in a long context as early? (issue 23)

Runs params/toy_long.yaml (01-06) on the toy world: 03 answers to a 1,536-token budget, 05 trains every sequence
whole (up to 2,048 tokens, chunked attention and loss), 06 decodes 1,536 tokens past each held-out prompt. Then
the same 05 with ``max_seq_len: 512`` (every label past token 512 cut, as 05 cut Kimi's traces past 4,096 before
issue 23), evaluated by the same 06 on the same prompts. Per arm it prints the label tally of 05's meta (trained,
held out, cut) and eagle3's tau per context bucket (the prompt + generated length each verify step read at),
with a 95% bootstrap interval over prompts, and the longest-minus-shortest bucket difference with its interval:
the check is that the whole arm's difference is not below zero by more than that noise.

    .venv/bin/python benchmarks/bench_long_quality.py [--cut-at 512] [--reps 2000] [--seed 0]

Outputs: outputs/toy_long (whole) and outputs/toy_long_cut (05 and 06 of the cut arm; data and 03 copied);
with --seed S, outputs/toy_long_sS[_cut]. Training noise is not part of the interval: a rerun with another
--seed (another held-out split, 03 order, 05 init and batch order) shows it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PARAMS = ROOT / "params" / "toy_long.yaml"


def run_name(seed: int) -> str:
    return "toy_long" if seed == 0 else f"toy_long_s{seed}"


def _run(raw: dict, stages: str) -> Path:
    from eagle_lib.pipeline import run_pipeline

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=ROOT / "params", delete=False) as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    try:
        return Path(run_pipeline(f.name, stages=stages)["run_dir"])
    finally:
        Path(f.name).unlink()


def run_arms(cut_at: int, seed: int) -> dict[str, Path]:
    """Both arms under `seed` (shared.seed: held-out split, 03's sampling order, 05's init and batches)."""
    raw = yaml.safe_load(PARAMS.read_text())
    raw["run_name"], raw["shared"]["seed"] = run_name(seed), seed
    whole = _run(raw, "01,02,03,04,05,06")
    raw["run_name"] = run_name(seed) + "_cut"
    raw["stages"]["05_train_eagle3"]["max_seq_len"] = cut_at
    cut = whole.parent / raw["run_name"]
    for part in ("data", "infer"):  # the same records and answers: only 05's cut differs
        shutil.rmtree(cut / part, ignore_errors=True)
        shutil.copytree(whole / part, cut / part)
    _run(raw, "05,06")
    return {"whole": whole, f"cut at {cut_at}": cut}


REPEAT_N = 5  # a step's next token is a "repeat" when it completes a 5-gram already in the context


def repeats(ids: list[int], n: int = REPEAT_N) -> list[bool]:
    """Per position of `ids`: whether the token completes an n-gram that occurred earlier in `ids`."""
    seen, out = set(), []
    for i in range(len(ids)):
        g = tuple(ids[i - n + 1 : i + 1]) if i >= n - 1 else None
        out.append(g is not None and g in seen)
        if g is not None:
            seen.add(g)
    return out


def per_prompt_steps(run_dir: Path, edges: list[int], stratum: str = "all") -> list[list[list[int]]]:
    """eagle3 at T=0: per prompt, per bucket, the accepted drafts of each verify step; `stratum` "novel" or
    "repeat" keeps the steps whose next token (the first one drafted) does not / does complete a REPEAT_N-gram
    already in the prompt + generated text (long continuations of a small target loop, and a repeat is easy to
    draft: comparing novel steps across buckets compares like with like)."""
    from eagle_lib import store
    from eagle_lib.serving.tables import bucket_of

    out = []
    for g in store.read_jsonl(run_dir / "eval" / "generations.jsonl"):
        if g["method"] != "eagle3" or g["temperature"] != 0:
            continue
        rep = repeats(
            g["output_ids"]
        )  # output_ids: the prompt's generated continuation, from position n_prompt
        per = [[] for _ in range(len(edges) + 1)]
        for a, c in zip(g["accepted"], g["ctx"], strict=True):
            pos = c - g["n_prompt"]
            is_rep = 0 <= pos < len(rep) and rep[pos]
            if stratum == "all" or (stratum == "repeat") == is_rep:
                per[bucket_of(c, edges)].append(a)
        out.append(per)
    return out


def tau_of(prompts: list[list[list[int]]], idx, b: int) -> float:
    acc = [a for i in idx for a in prompts[i][b]]
    return 1.0 + float(np.mean(acc)) if acc else float("nan")  # tokens per verify step: accepted + the bonus


def summarise(prompts, edges: list[int], reps: int, seed: int = 0) -> dict:
    from eagle_lib.serving.tables import bucket_labels

    rng, n, nb = np.random.default_rng(seed), len(prompts), len(edges) + 1
    point = [tau_of(prompts, range(n), b) for b in range(nb)]
    boot = np.array([[tau_of(prompts, idx, b) for b in range(nb)] for idx in rng.integers(0, n, (reps, n))])
    lo, hi = np.nanpercentile(boot, [2.5, 97.5], axis=0)
    diff = boot[:, -1] - boot[:, 0]
    steps = [sum(len(p[b]) for p in prompts) for b in range(nb)]
    return {
        "prompts": n,
        "buckets": {
            lab: {"steps": s, "tau": t, "lo": a, "hi": z}
            for lab, s, t, a, z in zip(bucket_labels(edges), steps, point, lo, hi, strict=True)
        },
        "long_minus_short": point[-1] - point[0],
        "long_minus_short_ci": [float(np.nanpercentile(diff, 2.5)), float(np.nanpercentile(diff, 97.5))],
    }


def labels(run_dir: Path) -> dict:
    from eagle_lib import store

    rows = store.read_json(run_dir / "drafter" / "meta.json")["label_tokens"]
    tot = {k: sum(r[k] for r in rows if r["length"] == "all") for k in ("train", "heldout", "cut", "dropped")}
    by_len: dict[str, int] = {}
    for r in rows:
        if r["length"] != "all":
            by_len[r["length"]] = by_len.get(r["length"], 0) + r["cut"]
    return tot | {"cut_by_length": {k: v for k, v in sorted(by_len.items()) if v}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cut-at", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0, help="shared.seed of both arms (outputs/toy_long_s<seed>)")
    ap.add_argument("--no-run", action="store_true", help="only summarise the existing outputs")
    a = ap.parse_args()
    edges = yaml.safe_load(PARAMS.read_text())["stages"]["06_eval_acceptance"]["context_buckets"]
    if a.no_run:
        out = ROOT / "outputs" / run_name(a.seed)
        arms = {"whole": out, f"cut at {a.cut_at}": out.with_name(out.name + "_cut")}
    else:
        arms = run_arms(a.cut_at, a.seed)
    results: dict = {}
    for stratum in ("all", "novel", "repeat"):
        res_s = results[stratum] = {}
        for name, d in arms.items():
            res = res_s[name] = summarise(per_prompt_steps(d, edges, stratum), edges, a.reps) | {
                "labels": labels(d)
            }
            lab = res["labels"]
            if stratum == "all":
                print(f"\n## {name}: labels trained {lab['train']:,}, held out {lab['heldout']:,}, cut {lab['cut']:,}, "
                      f"dropped {lab['dropped']:,}; cut by sequence length {lab['cut_by_length']}")  # fmt: skip
            else:
                print(f"\n## {name}, {stratum} steps only (the next token does {'not ' if stratum == 'novel' else ''}"
                      f"complete a {REPEAT_N}-gram already in the context)")  # fmt: skip
            print(f"eagle3 tau at T=0, 3 drafts, {res['prompts']} held-out prompts x 1,536 tokens")
            print("| context | verify steps | tau | 95% interval |\n|---|---|---|---|")
            for lab_, b in res["buckets"].items():
                print(f"| {lab_} | {b['steps']} | {b['tau']:.2f} | [{b['lo']:.2f}, {b['hi']:.2f}] |")
            lo, hi = res["long_minus_short_ci"]
            print(f"longest - shortest bucket: {res['long_minus_short']:+.2f} [{lo:+.2f}, {hi:+.2f}]")
    names = list(arms)
    verdict = {}
    for stratum in ("all", "novel"):
        w, c = results[stratum][names[0]], results[stratum][names[1]]
        last = list(w["buckets"])[-1]
        print(f"\n{stratum} steps: whole / cut in the longest bucket ({last}): "
              f"{w['buckets'][last]['tau']:.2f} / {c['buckets'][last]['tau']:.2f} = "
              f"{w['buckets'][last]['tau'] / c['buckets'][last]['tau']:.2f}x")  # fmt: skip
        verdict[stratum] = w["long_minus_short_ci"][1] >= 0
        print(
            f"check on {stratum} steps (whole arm: longest bucket no worse than the shortest beyond the noise): "
            f"{'pass' if verdict[stratum] else 'FAIL'}"
        )
    results["check"] = verdict
    out = ROOT / "outputs" / run_name(a.seed) / "bench_long_quality.json"
    out.write_text(json.dumps(results, indent=1, default=float))
    print(f"written: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
