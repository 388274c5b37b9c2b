"""One TTT unroll on long sequences: today's path vs the long-sequence path, peak memory and step time, on CPU.

Today: ``attention: eager`` ((T, T) mask, (T, T) scores kept per step) with the target's (T, V) logits and
whole-row draft logits. New: ``attention: chunked`` + ``loss_chunk`` (`eagle_lib.drafter.longseq`): blockwise
attention recomputed in backward, head + loss per chunk of rows, target logits made per chunk from the last
hidden state (`HeadTarget`). The toy drafter's shape (hidden 128, 4 heads of 32, 2 KV heads, MLP 384, vocab
4096, draft vocab 1024), one sequence per row (one document: the whole causal triangle), k TTT steps. Each
(T, path) runs in its own subprocess; its peak RSS above the process's RSS after building the inputs is the
unroll's peak. Today's path is not run where its formula projects more than --max-gb (printed instead).
Then the formula (`eagle_lib.drafter.budget.activation_bytes`) at Kimi size: hidden 7168, 64 heads,
MLP 18432, vocab 163840, draft vocab 32000, k = 7.

    .venv/bin/python benchmarks/bench_long.py [--lengths 1024 4096 16384 32768] [--steps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TOY = dict(h=128, heads=4, kv=2, hd=32, i=384, v=4096, n=1024)
KIMI = dict(h=7168, heads=64, i=18432, v=163840, n=32000, k=7)
LOSS_CHUNK = 1024


def rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(t: int, k: int, path: str) -> dict:
    import torch

    from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter
    from eagle_lib.drafter.ttt import TTT
    from eagle_lib.hidden_states.hidden import HeadTarget, TargetHead

    s = TOY
    g = torch.Generator().manual_seed(0)
    cfg = Eagle3Config(hidden_size=s["h"], intermediate_size=s["i"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv"], head_dim=s["hd"], vocab_size=s["v"], draft_vocab_size=s["n"],
                       target_hidden_size=s["h"], aux_layers=[1, 3, 4])  # fmt: skip
    d = Eagle3Drafter(cfg)
    kept = torch.randperm(s["v"], generator=g)[: s["n"]].sort().values
    t2d = torch.zeros(s["v"], dtype=torch.bool)
    t2d[kept] = True
    d.set_vocab_map(kept - torch.arange(s["n"]), t2d)
    head = TargetHead(torch.ones(s["h"]), torch.randn(s["v"], s["h"], generator=g) * 0.3, 1e-6)
    aux = torch.randn(1, t, 3 * s["h"], generator=g)
    last = torch.randn(1, t, s["h"], generator=g)
    ids = torch.randint(0, s["v"], (1, t), generator=g)
    pos, doc = torch.arange(t)[None], torch.zeros(1, t, dtype=torch.long)
    mask = torch.ones(1, t, dtype=torch.bool)
    if path == "today":
        model = TTT(d, k, 0.8, "eager")
    else:
        model = TTT(d, k, 0.8, "chunked", loss_chunk=LOSS_CHUNK, checkpoint_steps=path == "new+recompute")
    base = rss()
    t0 = time.perf_counter()
    with torch.no_grad():
        target = head(last) if path == "today" else HeadTarget(last, head)
    loss, _ = model(ids, pos, doc, mask, aux, target)
    loss.backward()
    return {"seconds": time.perf_counter() - t0, "peak_bytes": rss() - base, "loss": float(loss)}


def projected(t: int, k: int, path: str, size: dict) -> int:
    from eagle_lib.drafter import budget

    chunked = path != "today"
    return budget.activation_bytes(t, size["v"], size["n"], size["h"], size["i"], size["heads"], k,
                                   "chunked" if chunked else "eager", LOSS_CHUNK if chunked else 0,
                                   recompute=path == "new+recompute")  # fmt: skip


def spawn(t: int, k: int, path: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--worker", path, "--lengths", str(t), "--steps", str(k)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["killed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def gib(x: float) -> str:
    return f"{x / 2**30:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-gb", type=float, default=12.0, help="skip today's path above this projection")
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        print(json.dumps(worker(a.lengths[0], a.steps, a.worker)))
        return
    print(
        f"toy drafter {TOY}, k={a.steps}, one document per row, {a.threads} threads; peak = RSS above inputs;"
        f" proj = the formula; new = chunked attention + loss_chunk {LOSS_CHUNK}; +rc = with checkpoint_steps"
    )
    paths = ("today", "new", "new+recompute")
    print(f"{'T':>6} | " + " | ".join(f"{x[:9]:>9} GiB       s  proj GiB" for x in ("today", "new", "new+rc"))
          + " | mem today/new")  # fmt: skip
    peaks = {x: {} for x in paths}
    for t in a.lengths:
        cells = []
        for path in paths:
            proj = projected(t, a.steps, path, TOY)
            res = spawn(t, a.steps, path, a.threads) if path != "today" or proj <= a.max_gb * 2**30 else {}
            peaks[path][t] = res.get("peak_bytes")
            got = (
                f"{gib(res['peak_bytes'])}  {res['seconds']:6.1f}"
                if "peak_bytes" in res
                else f"{'not run':>8}  {'':>6}"
            )
            cells.append(f"{'':>5}{got}  {gib(proj)}")
        today, new = peaks["today"][t], peaks["new"][t]
        ratio = f"{today / new:13.1f}" if today and new else ""
        print(f"{t:>6} | " + " | ".join(cells) + f" | {ratio}")
    for path in paths[1:]:
        lo, hi = peaks[path].get(4096), peaks[path].get(32768)
        if lo and hi:
            print(f"{path}: peak 32K / 4K = {hi / lo:.2f} (linear: 8; the goal: <= 9)")
    print(f"\nformula per row at Kimi size {KIMI} (GiB; activations of one unroll, fp32):")
    print(f"{'T':>6} | {'today (eager)':>13} | {'new (chunked)':>13} | {'new+recompute':>13}")
    for t in a.lengths:
        print(f"{t:>6} | " + " | ".join(f"{gib(projected(t, KIMI['k'], x, KIMI)):>13}" for x in paths))


if __name__ == "__main__":
    main()
