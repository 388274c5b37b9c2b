"""Is a drafter trained on whole long sequences as good late in a long context as early? (issue 23)

Runs params/toy_long.yaml (01-06) on the toy world: 03 answers to a 1,536-token budget, 05 trains every sequence
whole (up to 2,048 tokens, chunked attention and loss), 06 decodes 1,536 tokens past each held-out prompt. Then
the same 05 with ``max_seq_len: 512`` (every label past token 512 cut, as 05 cut Kimi's traces past 4,096 before
issue 23), evaluated by the same 06 on the same prompts. Per arm it prints the label tally of 05's meta (trained,
held out, cut) and eagle3's tau per context bucket (the prompt + generated length each verify step read at),
with a 95% bootstrap interval over prompts, and the longest-minus-shortest bucket difference with its interval:
the check is that the whole arm's difference is not below zero by more than that noise.

    .venv/bin/python benchmarks/bench_long_quality.py [--cut-at 512] [--reps 2000]

Outputs: outputs/toy_long (whole) and outputs/toy_long_cut (05 and 06 of the cut arm; data and 03 copied).
Training noise (a second 05 seed) is not part of the interval: state it from a rerun if a claim needs it.
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


def run_arms(cut_at: int) -> dict[str, Path]:
    from eagle_lib.pipeline import run_pipeline

    whole = Path(run_pipeline(PARAMS, stages="01,02,03,04,05,06")["run_dir"])
    raw = yaml.safe_load(PARAMS.read_text())
    raw["run_name"] = "toy_long_cut"
    raw["stages"]["05_train_eagle3"]["max_seq_len"] = cut_at
    cut = whole.parent / "toy_long_cut"
    for part in ("data", "infer"):  # the same records and answers: only 05's cut differs
        shutil.rmtree(cut / part, ignore_errors=True)
        shutil.copytree(whole / part, cut / part)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=ROOT / "params", delete=False) as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    try:
        run_pipeline(f.name, stages="05,06")
    finally:
        Path(f.name).unlink()
    return {"whole": whole, f"cut at {cut_at}": cut}


def per_prompt_steps(run_dir: Path, edges: list[int]) -> list[list[list[int]]]:
    """eagle3 at T=0: per prompt, per bucket, the accepted drafts of each verify step."""
    from eagle_lib import store
    from eagle_lib.serving.tables import bucket_of

    out = []
    for g in store.read_jsonl(run_dir / "eval" / "generations.jsonl"):
        if g["method"] != "eagle3" or g["temperature"] != 0:
            continue
        per = [[] for _ in range(len(edges) + 1)]
        for a, c in zip(g["accepted"], g["ctx"], strict=True):
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
    ap.add_argument("--no-run", action="store_true", help="only summarise the existing outputs")
    a = ap.parse_args()
    edges = yaml.safe_load(PARAMS.read_text())["stages"]["06_eval_acceptance"]["context_buckets"]
    if a.no_run:
        arms = {"whole": ROOT / "outputs/toy_long", f"cut at {a.cut_at}": ROOT / "outputs/toy_long_cut"}
    else:
        arms = run_arms(a.cut_at)
    results = {}
    for name, d in arms.items():
        res = results[name] = summarise(per_prompt_steps(d, edges), edges, a.reps) | {"labels": labels(d)}
        lab = res["labels"]
        print(f"\n## {name}: labels trained {lab['train']:,}, held out {lab['heldout']:,}, cut {lab['cut']:,}, "
              f"dropped {lab['dropped']:,}; cut by sequence length {lab['cut_by_length']}")  # fmt: skip
        print(f"eagle3 tau at T=0, 3 drafts, {res['prompts']} held-out prompts x 1,536 tokens")
        print("| context | verify steps | tau | 95% interval |\n|---|---|---|---|")
        for lab_, b in res["buckets"].items():
            print(f"| {lab_} | {b['steps']} | {b['tau']:.2f} | [{b['lo']:.2f}, {b['hi']:.2f}] |")
        lo, hi = res["long_minus_short_ci"]
        print(f"longest - shortest bucket: {res['long_minus_short']:+.2f} [{lo:+.2f}, {hi:+.2f}]")
    names = list(results)
    w, c = results[names[0]], results[names[1]]
    last = list(w["buckets"])[-1]
    print(f"\nwhole / cut in the longest bucket ({last}): "
          f"{w['buckets'][last]['tau']:.2f} / {c['buckets'][last]['tau']:.2f} = "
          f"{w['buckets'][last]['tau'] / c['buckets'][last]['tau']:.2f}x")  # fmt: skip
    ok = w["long_minus_short_ci"][1] >= 0
    print(
        f"check (whole arm: longest bucket no worse than the shortest beyond the noise): {'pass' if ok else 'FAIL'}"
    )
    out = ROOT / "outputs" / "toy_long" / "bench_long_quality.json"
    out.write_text(json.dumps(results, indent=1, default=float))
    print(f"written: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
