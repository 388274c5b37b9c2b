"""Training throughput of our EAGLE-3 TTT step vs speculators 0.9's Eagle3DraftModel, side by side on CPU.

Same drafter shape (small: H 256, 4 heads of 64, 2 KV heads, MLP 768, V 4096, draft vocab 1024),
same packed rows (T tokens, 4 sequences per row), same target features, same k. One forward + backward per
iteration. speculators runs with eager and sdpa attention and its eager loss (kl_div); ours with its eager
TTT attention and soft cross-entropy (same gradient as KL). Each side runs in its own subprocess (speculators
in .venv-speculators: it pins another torch/transformers), single-threaded, and reports tokens/s and peak RSS.

    .venv/bin/python benchmarks/bench_train.py [--tokens 1024] [--steps 3 7] [--iters 5]

Setup of the separate venv (once): `bash scripts/install_speculators.sh` (or `make bench-env`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=768, vocab=4096, draft_vocab=1024, docs=4)
ROOT = Path(__file__).resolve().parent.parent


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def inputs(t: int):
    """Features, token ids, doc ids (4 packed sequences), last hidden and a draft vocab map."""
    import torch

    g = torch.Generator().manual_seed(0)
    h, v, n = SHAPE["hidden"], SHAPE["vocab"], SHAPE["draft_vocab"]
    aux = torch.randn(1, t, 3 * h, generator=g)
    ids = torch.randint(0, v, (1, t), generator=g)
    doc = (torch.arange(t) * SHAPE["docs"] // t)[None]
    pos = torch.cat([torch.arange((doc == d).sum()) for d in range(SHAPE["docs"])])[None]
    last = torch.randn(1, t, h, generator=g)
    kept = torch.randperm(v, generator=g)[:n].sort().values
    return aux, ids, doc, pos, last, kept


def time_it(step, iters: int) -> tuple[float, float]:
    """(seconds per iteration, best of iters) after one warmup."""
    step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return sum(times) / len(times), min(times)


def worker_ours(t: int, k: int, iters: int, attention: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from eagle_lib.drafter.model import Eagle3Config, Eagle3Drafter
    from eagle_lib.drafter.ttt import TTT

    s = SHAPE
    aux, ids, doc, pos, last, kept = inputs(t)
    cfg = Eagle3Config(
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=s["vocab"],
        draft_vocab_size=s["draft_vocab"],
        target_hidden_size=s["hidden"],
        aux_layers=[1, 3, 4],
    )
    d = Eagle3Drafter(cfg)
    t2d = torch.zeros(s["vocab"], dtype=torch.bool)
    t2d[kept] = True
    d.set_vocab_map(kept - torch.arange(len(kept)), t2d)
    target_head = torch.randn(s["vocab"], s["hidden"]) * 0.05
    model = TTT(d, k, 0.8, attention)
    mask = torch.ones(1, t, dtype=torch.bool)
    base = rss_mb()

    def step():
        with torch.no_grad():
            tl = last @ target_head.T  # target logits (1, T, V) from the target's last hidden
        loss, _ = model(ids, pos, doc, mask, aux, tl)
        loss.backward()
        d.zero_grad(set_to_none=True)

    mean, best = time_it(step, iters)
    return {
        "impl": f"ours ({attention})",
        "s_per_iter": mean,
        "best_s": best,
        "peak_rss_mb": rss_mb(),
        "train_rss_mb": rss_mb() - base,
    }


def worker_speculators(t: int, k: int, iters: int, attention: str) -> dict:
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    s = SHAPE
    aux, ids, doc, pos, last, kept = inputs(t)
    tl = LlamaConfig(
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=s["vocab"],
        num_hidden_layers=1,
        max_position_embeddings=4096,
    )
    tl._attn_implementation = attention
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl,
        draft_vocab_size=s["draft_vocab"],
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[1, 3, 4],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 if p.dim() > 1 else torch.ones_like(p))
    model.lm_head.weight.requires_grad_(True)
    t2d = torch.zeros(s["vocab"], dtype=torch.bool)
    t2d[kept] = True
    model.load_vocab_mappings(t2d, kept - torch.arange(len(kept)))
    loss_cfg = resolve_loss_config("kl_div", "eager")
    mask = torch.ones(1, t, dtype=torch.bool)
    base = rss_mb()

    def step():
        _, loss, _ = model(
            aux,
            ids,
            doc,
            loss_mask=mask,
            position_ids=pos,
            verifier_last_hidden_states=last,
            ttt_steps=k,
            ttt_step_loss_decay=0.8,
            loss_config=loss_cfg,
        )
        loss.backward()
        model.zero_grad(set_to_none=True)

    mean, best = time_it(step, iters)
    return {
        "impl": f"speculators 0.9 ({attention})",
        "s_per_iter": mean,
        "best_s": best,
        "peak_rss_mb": rss_mb(),
        "train_rss_mb": rss_mb() - base,
    }


def spawn(python: str, impl: str, attention: str, t: int, k: int, iters: int) -> dict:
    cmd = [
        python,
        __file__,
        "--worker",
        impl,
        "--attention",
        attention,
        "--tokens",
        str(t),
        "--steps",
        str(k),
        "--iters",
        str(iters),
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    )
    if out.returncode != 0:
        return {"impl": f"{impl} ({attention})", "error": out.stderr.strip().splitlines()[-1:]}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["tokens_per_s"] = t / res["s_per_iter"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--worker", choices=["ours", "speculators"])
    ap.add_argument("--attention", default="eager")
    ap.add_argument("--spec-python", default=str(ROOT / ".venv-speculators/bin/python"))
    a = ap.parse_args()
    if a.worker:
        import torch

        torch.set_num_threads(1)
        fn = worker_ours if a.worker == "ours" else worker_speculators
        print(json.dumps(fn(a.tokens, a.steps[0], a.iters, a.attention)))
        return
    if not Path(a.spec_python).exists():
        sys.exit(f"{a.spec_python} missing: set up the speculators venv (see this file's docstring)")
    print(f"T={a.tokens} tokens/iter, shape {SHAPE}, 1 thread, forward+backward")
    for k in a.steps:
        ours = spawn(sys.executable, "ours", "eager", a.tokens, k, a.iters)
        rows = [ours, spawn(sys.executable, "ours", "sdpa", a.tokens, k, a.iters)]
        rows += [spawn(a.spec_python, "speculators", att, a.tokens, k, a.iters) for att in ("eager", "sdpa")]
        print(f"\nk={k}")
        for r in rows:
            if "error" in r:
                print(f"  {r['impl']:<28} failed: {r['error']}")
                continue
            ratio = ours["tokens_per_s"] / r["tokens_per_s"]
            print(
                f"  {r['impl']:<28} {r['tokens_per_s']:>8.0f} tok/s  peak RSS {r['peak_rss_mb']:>6.0f} MiB "
                f"(+{r['train_rss_mb']:.0f} in training)  ours/this = {ratio:.2f}x"
            )


if __name__ == "__main__":
    main()
