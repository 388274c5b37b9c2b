"""One core's fp32 matrix-multiply speed, side by side in one process: torch (its BLAS, MKL in the CPU wheel) and
numpy (its BLAS, OpenBLAS in the PyPI wheel), 1024x1024 by default, one thread each. Tells a slow host (a slow core)
from a slow code path of ours: docs/MACHINES.md, "CPUs".

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gemm.py [--n 1024]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def gflops(mm, n: int, reps: int) -> float:
    for _ in range(3):
        mm()
    t = time.perf_counter()
    for _ in range(reps):
        mm()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    ta, tb = torch.randn(a.n, a.n), torch.randn(a.n, a.n)
    na, nb = ta.numpy().copy(), tb.numpy().copy()
    t = gflops(lambda: ta @ tb, a.n, a.reps)
    n = gflops(lambda: na @ nb, a.n, a.reps)
    print(
        f"torch {torch.__version__}: {t:.1f} GFLOP/s; numpy {np.__version__}: {n:.1f} GFLOP/s; ratio {t / n:.2f}"
    )


if __name__ == "__main__":
    main()
