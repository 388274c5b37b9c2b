"""A vLLM CPU server's start, with its engine core and worker in two processes (vLLM 0.32's CPU default) against one
(`eagle_lib.engines.vllm_server.one_process`: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` under nobind), alternating, on
the toy target (built if missing), one OpenMP thread unbound as in the suite. Each start is timed from the command to
the first answered completion; the completions of both settings must be the same text (greedy), or it exits 1.

    .venv/bin/python benchmarks/bench_vllm_start.py [--rounds 2] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_lib import models  # noqa: E402
from eagle_lib.engines import client, vllm_server  # noqa: E402

SETTINGS = {"two processes (vLLM's default)": "1", "one process (ours)": "0"}


def start_once(model: str, multiprocessing: str, log_dir: Path) -> tuple[float, str]:
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           vllm_server.SINGLE_PROCESS_ENV: multiprocessing}  # fmt: skip
    t = time.perf_counter()
    with vllm_server.start_vllm(model, max_model_len=512, env=env, log_dir=log_dir) as srv:
        body = {"model": srv.model, "prompt": "hello", "max_tokens": 16, "temperature": 0.0}
        text = client.post_json(srv.base_url + "/v1/completions", body, timeout=120)["choices"][0]["text"]
        return time.perf_counter() - t, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="toy://target")
    ap.add_argument("--log-dir", default="/tmp/bench_vllm_start")
    a = ap.parse_args()
    model = models.resolve(a.model)
    secs: dict[str, list[float]] = {k: [] for k in SETTINGS}
    texts: dict[str, set[str]] = {k: set() for k in SETTINGS}
    for r in range(a.rounds):
        for name, mp in SETTINGS.items():
            s, text = start_once(model, mp, Path(a.log_dir))
            secs[name].append(s)
            texts[name].add(text)
            print(f"round {r}: {name}: {s:.1f} s to the first completion", flush=True)
    for name, xs in secs.items():
        print(f"{name}: median {statistics.median(xs):.1f} s ({', '.join(f'{x:.1f}' for x in xs)})")
    base, ours = (statistics.median(xs) for xs in secs.values())
    print(f"ratio (two processes / one): {base / ours:.2f}x")
    same = len(set.union(*texts.values())) == 1
    print("completions: " + ("the same text on both" if same else f"DIFFER: {texts}"))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
