"""03's two CPU engines on the same prompts, side by side in one run: the embedded engine (the target in-process,
continuous batching) and `engine: vllm` (a local vLLM CPU server 03 starts itself). Which is faster sets 03's
default in a params file.

    .venv/bin/python benchmarks/bench_engines.py --params params/smollm2.yaml --run-dir outputs/smollm2 [--n 48]

Each engine runs stage 03 itself (`eagle_lib.infer.run`) on a copy of the run's data/B with `limit` N per dataset
and the params' sampling, in a fresh run directory, so nothing is resumed. Prints per engine the generation
tokens/s (03's own `tokens_per_s`: tokens / seconds generating), the stage's wall seconds (server start and model
load included), and how many answers are token-identical between the two (greedy: both fp32, so differences
come from near-ties of the target's logits only).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from eagle_lib import infer, params, store


def run_engine(run: params.RunParams, src: Path, engine: str, n: int, threads: int) -> tuple[dict, dict]:
    """03 with `engine` on the first `n` prompts of each dataset; (its meta, {id: output_ids})."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-{engine}-"))
    shutil.copytree(src / "data" / "B", work / "data" / "B")
    stage = run.stage("03_infer").model_copy(
        update={"engine": engine, "limit": n, "progress": False, "vllm_threads": threads}
    )
    shared = run.shared.model_copy(update={"num_workers": threads})
    meta = infer.run(params.StageConfig("03_infer", work, shared, stage))
    outs = {
        r["id"]: r["output_ids"] for f in work.glob("infer/*/responses.jsonl") for r in store.iter_jsonl(f)
    }
    shutil.rmtree(work, ignore_errors=True)
    return meta, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="params/smollm2.yaml")
    ap.add_argument("--run-dir", default="outputs/smollm2", help="a run whose 02 has written data/B")
    ap.add_argument("--n", type=int, default=48, help="prompts per dataset")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of each engine (the machine rule: 1)")
    a = ap.parse_args()
    run = params.load_params(a.params)
    res = {e: run_engine(run, Path(a.run_dir), e, a.n, a.threads) for e in ("embedded", "vllm")}
    (m_e, o_e), (m_v, o_v) = res["embedded"], res["vllm"]
    same = sum(o_e[k] == o_v.get(k) for k in o_e)
    tokens = {e: m["generated_tokens"] for e, (m, _) in res.items()}
    print(
        f"{a.params}: {len(o_e)} prompts, max_new_tokens {run.shared.max_new_tokens}, {a.threads} thread(s)"
    )
    for e, (m, _) in res.items():
        print(f"  {e:<9} {m['tokens_per_s']:8.1f} tokens/s generating   {m['seconds']:7.1f} s wall   "
              f"{tokens[e]:,} tokens")  # fmt: skip
    print(f"  vllm / embedded: {m_v['tokens_per_s'] / m_e['tokens_per_s']:.2f}x generating, "
          f"{m_e['seconds'] / m_v['seconds']:.2f}x wall; identical answers {same}/{len(o_e)}")  # fmt: skip


if __name__ == "__main__":
    main()
