"""Embedded engine vs transformers' model.generate on the same prompts: tokens/s side by side, identical tokens.

    .venv/bin/python benchmarks/bench_infer.py [--target toy://target] [--prompts 'outputs/toy/data/B/*/prompts.jsonl']
                                               [--n 64] [--max-new-tokens 128] [--batch-size 16] [--threads 1]

Three runs over the same prompts, greedy, the same stop ids (the target's generation config):
  generate-1   model.generate one prompt at a time (no padding: the exact reference);
  generate-B   model.generate on batches of --batch-size in file order, left-padded (HF's batched path);
  engine       EmbeddedEngine: longest prompts first, KV cache, continuous batching (finished rows leave,
               waiting prompts join).
Prints tokens/s of each and the engine's speedup over both, and checks the engine's ids equal generate-1's.
"""

from __future__ import annotations

import argparse
import glob
import random
import time

import torch

from eagle_lib import models, params, store
from eagle_lib.engines.base import Request, Sampling
from eagle_lib.engines.embedded import EmbeddedEngine


def load_prompts(path: str, n: int, tokenizer, seed: int = 0) -> list[Request]:
    """A seeded sample of B prompts from stage-02 files (a glob), else synthetic chat prompts."""
    files = sorted(glob.glob(path))
    recs = list({r["id"]: r for f in files for r in store.iter_jsonl(f)}.values())  # runs share ids
    rng = random.Random(seed)
    if recs:
        rng.shuffle(recs)
        return [Request(r["id"], r["prompt_ids"]) for r in recs[:n]]
    words = "please explain how a tool call works and why the answer is correct step by step".split()
    out = []
    for i in range(n):
        msg = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))}]
        ids = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
        out.append(Request(f"syn{i}", list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
    return out


def cut(ids: list[int], stop: set[int]) -> list[int]:
    """Generated ids up to and including the first stop id (batched generate pads finished rows)."""
    for k, t in enumerate(ids):
        if t in stop:
            return ids[: k + 1]
    return ids


def generate_one(model, reqs, max_new, stop) -> dict[str, list[int]]:
    out = {}
    for r in reqs:
        ids = torch.tensor([r.prompt_ids])  # explicit mask: without it generate masks every pad-id token
        g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                           eos_token_id=list(stop), pad_token_id=0)  # fmt: skip
        out[r.id] = cut(g[0, len(r.prompt_ids) :].tolist(), stop)
    return out


def generate_batched(model, reqs, max_new, stop, bs, pad_id) -> dict[str, list[int]]:
    out = {}
    for i in range(0, len(reqs), bs):
        batch = reqs[i : i + bs]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        g = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                           eos_token_id=list(stop), pad_token_id=pad_id)  # fmt: skip
        for r, row in zip(batch, g[:, width:].tolist(), strict=True):
            out[r.id] = cut(row, stop)
    return out


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="toy://target")
    ap.add_argument(
        "--prompts", default="outputs/*/data/B/*/prompts.jsonl", help="glob of stage-02 prompt files"
    )
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shared = params.SharedParams(target=a.target, device="cpu")
    tok, model = models.load_tokenizer(shared), models.load_target(shared)
    eos = model.generation_config.eos_token_id
    stop = {eos} if isinstance(eos, int) else set(eos)
    reqs = load_prompts(a.prompts, a.n, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    engine = EmbeddedEngine(
        model, Sampling(max_new_tokens=a.max_new_tokens, stop_token_ids=tuple(stop)), a.batch_size
    )
    next(engine.generate(reqs[:2]))  # warm-up
    times: dict[str, list[float]] = {"generate-1": [], "generate-B": [], "engine": []}
    for _ in range(a.repeats):  # interleaved repeats, best of each: the machine's load varies between runs
        ref, t = timed(lambda: generate_one(model, reqs, a.max_new_tokens, stop))
        times["generate-1"].append(t)
        bat, t = timed(lambda: generate_batched(model, reqs, a.max_new_tokens, stop, a.batch_size, pad))
        times["generate-B"].append(t)
        got, t = timed(lambda: {r.id: r.output_ids for r in engine.generate(reqs)})
        times["engine"].append(t)
    t_one, t_bat, t_eng = (min(times[k]) for k in ("generate-1", "generate-B", "engine"))
    n_tok = sum(len(v) for v in ref.values())
    same = sum(got[k] == ref[k] for k in ref)
    same_b = sum(bat[k] == ref[k] for k in ref)
    print(f"target {a.target}: {len(reqs)} prompts, {sum(len(r.prompt_ids) for r in reqs)} prompt tokens, "
          f"{n_tok} generated tokens, max_new_tokens {a.max_new_tokens}, batch {a.batch_size}, {a.threads} threads, best of {a.repeats}")  # fmt: skip
    for name, ts in times.items():
        print(
            f"  {name:<11} {min(ts):8.2f} s  {n_tok / min(ts):9.1f} tok/s   (runs: {', '.join(f'{t:.2f}' for t in ts)} s)"
        )
    print(f"  engine speedup: {t_one / t_eng:.2f}x vs generate-1, {t_bat / t_eng:.2f}x vs generate-B")
    print(f"  identical ids: engine {same}/{len(ref)}, generate-B {same_b}/{len(ref)} (vs generate-1)")


if __name__ == "__main__":
    main()
