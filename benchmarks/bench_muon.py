"""Muon's step on a CPU: torch.optim.Muon (Newton-Schulz in bfloat16) against `eagle_lib.drafter.optim.Muon`
(float32 on a CPU), side by side in one process, on the drafter matrices 05 puts under Muon.

The drafter is built with a real target's shapes (default SmolLM2-135M-Instruct: hidden 576, MLP 1536, 9/3 heads of
64, 3 aux layers), its gradients random and fixed; each optimizer takes the same steps from the same weights,
alternating, on one thread (05's thread count beside its producer). Prints seconds per step of each, their ratio,
and how far the two updates are apart (relative Frobenius norm of the difference, first step).

    .venv/bin/python benchmarks/bench_muon.py [--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3]
        [--steps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_lib.drafter import optim  # noqa: E402
from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter  # noqa: E402
from eagle_lib.engines import machine  # noqa: E402


def matrices(a) -> list[torch.Tensor]:
    c = Eagle3Config(hidden_size=a.hidden, intermediate_size=a.intermediate, num_attention_heads=a.heads,
                     num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads, vocab_size=a.draft_vocab,
                     draft_vocab_size=a.draft_vocab, target_hidden_size=a.hidden, aux_layers=[1, 2, 3])  # fmt: skip
    d = Eagle3Drafter(c)
    return [q.detach() for n, q in d.named_parameters() if q.requires_grad and optim.muon_param(n, q)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    start = matrices(a)
    grads = [torch.randn_like(w) for w in start]
    model, flags = machine.cpu_model_and_flags(Path("/proc/cpuinfo").read_text())
    isa = " ".join(f for f, v in flags.items() if v) or "none of " + " ".join(flags)
    print(f"{model} ({isa}); torch {torch.__version__}, {a.threads} thread(s)")
    print(f"{len(start)} matrices under Muon: " + ", ".join("x".join(map(str, w.shape)) for w in start))
    runs = {"torch.optim.Muon (bf16 iterations)": torch.optim.Muon, "optim.Muon (fp32 on CPU)": optim.Muon}
    weights, opts, secs = {}, {}, {k: [] for k in runs}
    for name, make in runs.items():
        weights[name] = [torch.nn.Parameter(w.clone()) for w in start]
        opts[name] = make(weights[name], lr=2e-3, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    first = {}
    for step in range(a.steps):
        for name in runs:  # alternating: both see the same machine state
            for q, g in zip(weights[name], grads, strict=True):
                q.grad = g.clone()
            t0 = time.perf_counter()
            opts[name].step()
            secs[name].append(time.perf_counter() - t0)
            if step == 0:
                first[name] = [q.detach() - w for q, w in zip(weights[name], start, strict=True)]
    for name in runs:
        s = sorted(secs[name])
        print(
            f"{name:36s} {s[len(s) // 2]:8.3f} s/step (median of {a.steps}; min {s[0]:.3f}, max {s[-1]:.3f})"
        )
    (bf, fp) = (sorted(secs[k])[a.steps // 2] for k in runs)
    u_bf, u_fp = (torch.cat([d.flatten() for d in first[k]]) for k in runs)
    print(f"bf16 / fp32 time per step: {bf / fp:.1f}x; first updates differ by "
          f"{float((u_bf - u_fp).norm() / u_fp.norm()):.4f} of their norm")  # fmt: skip


if __name__ == "__main__":
    main()
