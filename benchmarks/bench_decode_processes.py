"""07's held-out decode of one drafter in one process against forked one-thread processes, side by side in one run.

07 decodes every arm's held-out prompts one by one on one torch thread (the fastest count for the toy's small
matmuls) between training steps that hold two; `heldout_tau.Decoder` now forks as many one-thread decodes as the
training step held (`machine.decoding_processes`). This takes a finished run (05's final drafter and 06's
held-out prompts, as 07 picks them), decodes them with torch holding 1 thread (one process) and 2 threads (two
processes), alternating, `--rounds` times each, and prints the seconds of each, their ratio and whether the sums
and generations are the same.

    .venv/bin/python benchmarks/bench_decode_processes.py [--run-dir outputs/toy] [--per-dataset 6]
        [--new-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_lib import models  # noqa: E402
from eagle_lib.drafter import retrain  # noqa: E402
from eagle_lib.drafter.model import load_drafter  # noqa: E402
from eagle_lib.engines import machine  # noqa: E402
from eagle_lib.serving import heldout_tau  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default="outputs/toy")
    ap.add_argument(
        "--per-dataset", type=int, default=6, help="07's max_prompts_per_dataset (params/toy.yaml)"
    )
    ap.add_argument("--new-tokens", type=int, default=32, help="07's eval_max_new_tokens (params/toy.yaml)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    run = Path(a.run_dir)
    _, shared, _ = retrain.load_recipe(run)
    target = models.load_target(shared)
    drafter = load_drafter(run / "drafter" / "final")
    prompts, _ = heldout_tau.heldout_prompts(run, shared.heldout_percent, a.per_dataset, 768)
    eos = models.stop_ids(models.load_tokenizer(shared), target)
    model, flags = machine.cpu_model_and_flags(Path("/proc/cpuinfo").read_text())
    isa = " ".join(f for f, v in flags.items() if v) or "none of " + " ".join(flags)
    print(f"{model} ({isa}); {machine.usable_cores()} usable cores; torch {torch.__version__}")
    print(f"{run}: {len(prompts)} held-out prompts x {a.new_tokens} tokens, k=3, greedy")
    secs, outs = {1: [], 2: []}, {}
    for _ in range(a.rounds):
        for owned in (1, 2):  # torch's threads as the stage holds them: 1 -> one process, 2 -> two
            torch.set_num_threads(owned)
            dec = heldout_tau.Decoder(target, prompts, a.new_tokens, 3, eos)
            t0 = time.perf_counter()
            num, den = dec.decode(drafter)
            secs[owned].append(time.perf_counter() - t0)
            outs.setdefault(owned, (num.tolist(), den.tolist(), [g.output_ids for g in dec.generations]))
    for owned, label in ((1, "one process (1 thread held)"), (2, "two processes (2 threads held)")):
        s = secs[owned]
        print(f"{label:34s} {statistics.median(s):7.2f} s  (rounds: {', '.join(f'{x:.2f}' for x in s)})")
    print(f"one / two processes: {statistics.median(secs[1]) / statistics.median(secs[2]):.2f}x; "
          f"the same sums and generations: {outs[1] == outs[2]}; tau {sum(outs[1][0]) / sum(outs[1][1]):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
