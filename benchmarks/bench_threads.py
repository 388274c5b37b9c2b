"""Torch CPU threads under load: a toy-shaped decode and a toy-shaped TTT step, idle and beside a CPU-bound job.

Each workload runs in its own subprocess with N torch threads, first on an idle machine, then while a burner
process (the same kind of work, with every core's threads: another stage or a test run) shares the cores. It
prints tokens/s per case and the loaded/idle ratio; the project's rule (`eagle_lib.engines.machine.cpu_threads`)
is the thread count whose loaded speed holds up best. `--wait-policy` also varies OpenMP's wait policy of the measured
process (`OMP_WAIT_POLICY`; the burner keeps the default): with `active` (libgomp's default spin) a 2-thread torch job
beside another CPU-bound job collapses, with `passive` its idle threads sleep instead of spinning. Workloads: greedy decoding of a random Llama with the toy
target's shape (hidden 128, 8 layers, vocab 4096; batch 8, 48 new tokens, KV cache) as 03's embedded engine and
06's verifier run it, one TTT forward + backward of the toy drafter (T = 1024, k = 3) as 05/07 run it, and one
training step of the toy world's target (`world`: its shape and batch, AdamW) as `make toy` runs it.

    .venv/bin/python benchmarks/bench_threads.py [--threads 1 2] [--repeat 3] [--wait-policy default passive]
        [--work decode ttt world]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def decode(seconds: float) -> tuple[int, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=4096)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 4096, (8, 64))
    tokens, t0 = 0, time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() - t0 < seconds:
            out = model(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(48):
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                tokens += ids.shape[0]
    return tokens, time.perf_counter() - t0


def ttt_step(seconds: float) -> tuple[int, float]:
    import torch

    from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter
    from eagle_lib.drafter.ttt import TTT

    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, vocab_size=4096, draft_vocab_size=1024, target_hidden_size=128,
                       aux_layers=[1, 3, 4])  # fmt: skip
    d = Eagle3Drafter(cfg)
    kept = torch.arange(0, 4096, 4)
    t2d = torch.zeros(4096, dtype=torch.bool)
    t2d[kept] = True
    d.set_vocab_map(kept - torch.arange(1024), t2d)
    model, t = TTT(d, 3, 1.0), 1024
    ids, aux, logits = torch.randint(0, 4096, (2, t)), torch.randn(2, t, 384), torch.randn(2, t, 4096)
    pos, doc = torch.arange(t).expand(2, t), (torch.arange(t) // 256).expand(2, t)
    mask = torch.ones(2, t, dtype=torch.bool)
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        loss, _ = model(ids, pos, doc, mask, aux, logits)
        loss.backward()
        d.zero_grad(set_to_none=True)
        tokens += 2 * t
    return tokens, time.perf_counter() - t0


def world_step(seconds: float) -> tuple[int, float]:
    """The toy world's target training step (`eagle_lib.toy.target.train`'s body): its model shape and batch
    (RECIPE: 4 blocks of 512 tokens), AdamW, grad clip; random token ids (speed depends on shapes only)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_lib.toy.world import RECIPE

    torch.manual_seed(0)
    tr = RECIPE["train"]
    model = LlamaForCausalLM(LlamaConfig(vocab_size=RECIPE["vocab_size"], tie_word_embeddings=False,
                                         **RECIPE["model"]))  # fmt: skip
    opt = torch.optim.AdamW(
        model.parameters(), lr=tr["lr"], weight_decay=tr["weight_decay"], betas=(0.9, 0.95)
    )
    ids = torch.randint(0, RECIPE["vocab_size"], (tr["batch_size"], tr["block_size"]))
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += ids.numel()
    return tokens, time.perf_counter() - t0


WORK = {"decode": decode, "ttt": ttt_step, "world": world_step}


def run(work: str, threads: int, seconds: float, policy: str = "default") -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy.upper()
    cmd = [sys.executable, __file__, "--worker", work, "--threads", str(threads), "--seconds", str(seconds)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def rate(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate()
    tokens, secs = json.loads(out.strip().splitlines()[-1])
    return tokens / secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--burner-threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--wait-policy", nargs="+", default=["default"], choices=["default", "active", "passive"])
    ap.add_argument(
        "--work", nargs="+", default=list(WORK), choices=list(WORK), help="workloads (default: all)"
    )
    ap.add_argument("--worker")
    a = ap.parse_args()
    if a.worker:
        import warnings

        import torch

        warnings.filterwarnings("ignore")  # transformers' cache deprecations: noise in the table
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"

        torch.set_num_threads(a.threads[0])
        print(json.dumps(WORK[a.worker](a.seconds)))
        return
    print(f"{os.cpu_count()} cores; burner: the same workload with {a.burner_threads} threads; tokens/s, best of "
          f"{a.repeat}")  # fmt: skip
    print(f"{'workload':>8} {'threads':>7} {'wait':>8} | {'idle':>8} {'loaded':>8} | loaded/idle")
    for work in a.work:
        for n in a.threads:
            for pol in a.wait_policy if n > 1 else a.wait_policy[:1]:  # one thread: no OpenMP workers to wait
                idle = max(rate(run(work, n, a.seconds, pol)) for _ in range(a.repeat))
                loaded = []
                for _ in range(a.repeat):
                    burner = run(work, a.burner_threads, a.seconds + 4)
                    time.sleep(2)
                    loaded.append(rate(run(work, n, a.seconds, pol)))
                    burner.communicate()
                print(
                    f"{work:>8} {n:>7} {pol:>8} | {idle:8.0f} {max(loaded):8.0f} | {max(loaded) / idle:.2f}"
                )


if __name__ == "__main__":
    main()
