"""The real model's 06 numbers over seeds: mean and spread of each run's tau (offline and served), baselines and
served tokens/s, one row per method and temperature, one column per eval set. Reads each run's eval/tau.csv,
eval/online.csv and eval/served_speed.csv (stage 06's own files), nothing else.

    make real; make real SEED=1 STAGES=01-06; make real SEED=2 STAGES=01-06
    .venv/bin/python benchmarks/real_seeds.py outputs/smollm2 outputs/smollm2_s1 outputs/smollm2_s2

A cell reads "mean (min-max)" over the runs that have it, and "[n]" when fewer runs than given have it. Each
seed is a whole run (02's sample of B, 03's sampled answers, the held-out split, 05's init and batch order, 06's
sampling), so the spread is the recipe's, not only the training's.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path

SETS = ["sharegpt_orig", "sharegpt", "mt_bench", "mt_bench_turn2", "humaneval", "all"]


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def collect(runs: list[Path]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """(row label, eval set) -> values over the runs: tau per method/temperature offline, served tau, and the
    served tokens/s with and without the drafter."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        for r in _rows(run / "eval" / "tau.csv"):
            label = f"{r['method']} T={float(r['temperature']):g}, offline"
            out[label][r["dataset"]].append(float(r["tau"]))
        for r in _rows(run / "eval" / "online.csv"):
            if r.get("online_tau"):
                label = f"eagle3 T={float(r['temperature']):g}, served by {r['engine']}"
                out[label][r["dataset"]].append(float(r["online_tau"]))
            if r.get("greedy_equal"):
                out[f"greedy output equal, served {r['engine']}"][r["dataset"]].append(
                    float(r["greedy_equal"])
                )
        for r in _rows(run / "eval" / "served_speed.csv"):
            t = f"T={float(r['temperature']):g}"
            out[f"served tokens/s {t}, with the drafter"][r["dataset"]].append(float(r["tokens_per_s"]))
            out[f"served tokens/s {t}, without"][r["dataset"]].append(float(r["tokens_per_s_no_draft"]))
            out[f"served speedup {t}"][r["dataset"]].append(float(r["speedup"]))
    return out


def cell(values: list[float], n_runs: int) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    text = f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ({min(values):.2f}-{max(values):.2f})"
    return text + (f" [{len(values)}]" if len(values) < n_runs else "")


def table(runs: list[Path], speed: bool = True) -> str:
    data = collect(runs)
    if not speed:
        data = {k: v for k, v in data.items() if not k.startswith("served tokens/s") and "speedup" not in k}
    head = "| | " + " | ".join(SETS) + " |\n|---|" + "---|" * len(SETS)
    lines = [head]
    for label in sorted(data, key=lambda s: (not s.startswith("eagle3"), s)):
        lines.append(
            f"| {label} | " + " | ".join(cell(data[label].get(s, []), len(runs)) for s in SETS) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "runs", nargs="+", type=Path, help="run directories (outputs/smollm2, outputs/smollm2_s1, ...)"
    )
    ap.add_argument(
        "--no-speed",
        action="store_true",
        help="leave out served tokens/s (runs made side by side, or beside other work, slow each other)",
    )
    a = ap.parse_args()
    missing = [str(r) for r in a.runs if not (r / "eval" / "tau.csv").exists()]
    if missing:
        raise SystemExit(f"no stage-06 eval/tau.csv in: {', '.join(missing)} (run 06 there first)")
    print(f"{len(a.runs)} runs: {', '.join(str(r) for r in a.runs)}; mean (min-max)")
    print(table(a.runs, speed=not a.no_speed))


if __name__ == "__main__":
    main()
