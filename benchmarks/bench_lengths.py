"""Stage 04 at scale: 1,000,000 synthetic B responses, streamed, beside a plain pandas read_json baseline.

    .venv/bin/python benchmarks/bench_lengths.py [--records 1000000] [--baseline-records 100000]

Writes a run directory of synthetic responses (several datasets, real record layout: prompt_ids, output_ids
with Kimi-sized ids and the end-of-thinking id, text, finish_reason, sampling) and a data/B meta.json planning
25% more samples than were generated (so the projection runs), plus 03's ledger of started requests (every
response's start and 2% more still in flight), so the censoring-aware projection runs too (--no-ledger: as a run
made before 03 kept one). Then, each in a fresh process:
- eagle_lib.lengths.run on everything (tables, projection, verdicts, plots): wall time and peak RSS;
- pandas.read_json(lines=True, chunksize) on the first --baseline-records lines of one dataset, computing the
  same statistics; its time is also scaled to the full record count (printed as such);
- eagle_lib.lengths on that same prefix, and a check that both give the same numbers.
Target (issue 5): <= 60 s and <= 2 GB RSS for 1,000,000 records.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

THINK_ID = 163607
LIMIT = 4096
DATASETS = {"reasoning": (6.2, 1.0), "chat": (5.3, 0.9), "code": (5.8, 0.8), "tools": (3.5, 1.0)}  # lognormal


def _pool(rng: np.random.Generator, mu: float, sigma: float, size: int = 400) -> list[bytes]:
    """Distinct response bodies of one dataset (all but the id); the files repeat them with unique ids."""
    bodies = []
    for _ in range(size):
        n = int(min(LIMIT, max(1, rng.lognormal(mu, sigma))))
        out = rng.integers(0, 163_584, n)
        if mu > 6 and n > 2:
            out[int(rng.integers(0, n))] = THINK_ID
        n_prompt = int(rng.lognormal(4.5, 0.8)) + 1
        rec = {
            "source": "bench",
            "prompt_ids": rng.integers(0, 163_584, n_prompt).tolist(),
            "output_ids": out.tolist(),
            "text": "tok " * n,
            "finish_reason": "length" if n == LIMIT else "stop",
            "n_prompt_tokens": n_prompt,
            "n_output_tokens": n,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": LIMIT, "seed": 0},
            "engine": "sglang",
            "latency_s": 1.0,
        }
        bodies.append(json.dumps(rec, separators=(",", ":")).encode()[1:] + b"\n")
    return bodies


def write_ledger(path: Path, name: str, n: int) -> None:
    """03's started.jsonl: one start per response (1 ms apart), then 2% more requests still in flight."""
    with open(path, "wb") as f:
        for lo in range(0, n, 50_000):
            f.write(b"".join(b'{"id":"%s-%d","t":%.3f,"server":"s%d"}\n' % (name.encode(), i, 1.7e9 + i / 1000, i % 4)
                             for i in range(lo, min(n, lo + 50_000))))  # fmt: skip
        f.write(b"".join(b'{"id":"%s-run%d","t":%.3f,"server":"s%d"}\n' % (name.encode(), k, 1.7e9 + n / 1000, k % 4)
                         for k in range(n // 50)))  # fmt: skip


def write_run(run_dir: Path, records: int, seed: int = 0, ledger: bool = True) -> int:
    """Synthetic responses split over DATASETS (and their ledgers); returns the bytes of responses written."""
    rng = np.random.default_rng(seed)
    total = 0
    for i, (name, (mu, sigma)) in enumerate(DATASETS.items()):
        n = records // len(DATASETS) + (i < records % len(DATASETS))
        pool = _pool(rng, mu, sigma)
        path = run_dir / "infer" / name / "responses.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for lo in range(0, n, 50_000):
                picks = rng.integers(0, len(pool), min(50_000, n - lo))
                buf = b"".join(
                    b'{"id":"%s-%d",' % (name.encode(), lo + k) + pool[j] for k, j in enumerate(picks)
                )
                total += f.write(buf)
        if ledger:
            write_ledger(path.parent / "started.jsonl", name, n)
        meta = run_dir / "data" / "B" / name / "meta.json"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"read": n * 5 // 4, "kept": n * 5 // 4, "dropped": {}, "rejected": 0}))
    return total


PEAK = """
def peak_mb():  # VmHWM: this process's own peak (ru_maxrss would include the parent's at fork)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""

OURS = (
    PEAK
    + """
import json, resource, sys, time
from pathlib import Path
t0 = time.time()
from eagle_lib import lengths, params
workers = int(sys.argv[2])
cfg = params.StageConfig("04_length_analysis", Path(sys.argv[1]),
                         params.SharedParams(num_workers=workers, max_new_tokens=LIMIT),
                         lengths.Params(end_of_thinking_id=THINK_ID))
r = lengths.run(cfg)
c = r.completion.set_index("dataset")
ru, ch = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": time.time() - t0, "rss_mb": peak_mb(), "worker_rss_mb": ch.ru_maxrss / 1024,
                  "cpu_s": ru.ru_utime + ru.ru_stime + ch.ru_utime + ch.ru_stime,
                  "samples": int(c.n.sum()), "stats": c[["n", "median", "mean", "p99", "share_at_limit",
                  "reasoning_tokens"]].to_dict(orient="index")}))
""".replace("THINK_ID", str(THINK_ID)).replace("LIMIT", str(LIMIT))
)

BASELINE = (
    PEAK
    + """
import json, resource, sys, time
t0 = time.time()
import numpy as np, pandas as pd
lens, at_limit, reasoning = [], 0, 0
for df in pd.read_json(sys.argv[1], lines=True, chunksize=20000):
    lens.append(df.output_ids.str.len().to_numpy())
    at_limit += int((df.finish_reason == "length").sum())
    reasoning += sum(o.index(THINK_ID) + 1 for o in df.output_ids if THINK_ID in o)
x = np.concatenate(lens)
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": time.time() - t0, "rss_mb": peak_mb(), "cpu_s": ru.ru_utime + ru.ru_stime,
                  "samples": int(x.size), "stats": {"n": int(x.size), "median": float(np.median(x)),
                  "mean": float(x.mean()), "p99": float(np.percentile(x, 99)), "share_at_limit": at_limit / x.size,
                  "reasoning_tokens": reasoning}}))
""".replace("THINK_ID", str(THINK_ID))
)


def _child(code: str, *args) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ours(label: str, r: dict, size: int, workers: int) -> None:
    rss = f"peak RSS {r['rss_mb']:.0f} MB"
    if workers > 1:  # each worker's peak counts the parent's pages at fork: an upper bound
        rss += f" + {workers} workers <= {r['worker_rss_mb']:.0f} MB each"
    print(
        f"eagle_lib.lengths.run, {label} {r['samples']:,} records, {workers} process(es): {r['seconds']:.1f} s, "
        f"{rss}, {size / 1e6 / r['seconds']:.0f} MB/s, CPU {r['cpu_s']:.1f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--baseline-records", type=int, default=100_000)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed after)")
    ap.add_argument("--no-ledger", action="store_true", help="no 03 ledger: the finished-only projection")
    ap.add_argument("--workers", default="1,2", help="process counts to time, e.g. 1")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_lengths_"))
    try:
        t0 = time.time()
        size = write_run(work / "run", args.records, ledger=not args.no_ledger)
        print(
            f"wrote {args.records:,} responses in {len(DATASETS)} datasets, {size / 1e9:.2f} GB, in "
            f"{time.time() - t0:.0f} s. Target: <= 60 s, <= 2048 MB. Load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} CPUs (wall time grows with other users' load; CPU time does not)"
        )
        for workers in map(int, args.workers.split(",")):
            _ours("all", _child(OURS, work / "run", workers), size, workers)
        src = work / "run" / "infer" / "reasoning" / "responses.jsonl"
        prefix = work / "prefix" / "infer" / "reasoning" / "responses.jsonl"
        prefix.parent.mkdir(parents=True)
        with open(src, "rb") as f_in, open(prefix, "wb") as f_out:
            for _, line in zip(range(args.baseline_records), f_in, strict=False):
                f_out.write(line)
        base, mine = _child(BASELINE, prefix), _child(OURS, prefix.parents[2], 1)
        scale = args.records / base["samples"]
        print(
            f"baseline pandas.read_json(lines, chunksize), {base['samples']:,} records: {base['seconds']:.1f} s, "
            f"CPU {base['cpu_s']:.1f} s, peak RSS {base['rss_mb']:.0f} MB; scaled to {args.records:,}: "
            f"{base['seconds'] * scale:.0f} s, CPU {base['cpu_s'] * scale:.0f} s"
        )
        _ours("same", mine, prefix.stat().st_size, 1)
        print(
            f"  -> pandas took {base['seconds'] / mine['seconds']:.1f}x our wall time and {base['cpu_s'] / mine['cpu_s']:.1f}x "
            "our CPU time on the same records (both from interpreter start, imports included)"
        )
        ref, got = base["stats"], mine["stats"]["reasoning"]
        same = all(np.isclose(ref[k], got[k]) for k in ref)
        print(f"same statistics as the pandas baseline: {same}  ({ref} vs {got})")
        if not same:
            sys.exit(1)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
