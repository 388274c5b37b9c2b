"""Stage 04 on a snapshot of a finished 03 run, against that run's final totals (issue 16's check).

    .venv/bin/python -m benchmarks.midrun_04 RUN_DIR [--fraction 0.4 ...] [--params params/toy.yaml]

Cuts each B dataset of RUN_DIR (a finished 03 run with a ledger) as the run would have left it when
`fraction` of its responses were written (tests/support/snapshot.py), runs 04 on the cut, and prints per dataset
the censoring-aware estimate of the final trainable tokens and truncation share with its 95% interval, the
finished-only estimate, and the final values; then the report's answer sentence and truncation verdicts. With
several fractions, a last line gives the coverage over all of them (datasets x fractions).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from eagle_lib import lengths, params, store
from tests.support.snapshot import cut_run


def final_values(run_dir: Path) -> dict[str, dict]:
    out = {}
    for f in sorted((run_dir / "infer").glob("*/responses.jsonl")):
        recs = store.read_jsonl(f)
        out[f.parent.name] = {"tokens": sum(r["n_output_tokens"] for r in recs),
                              "share": sum(r["finish_reason"] == "length" for r in recs) / max(len(recs), 1)}  # fmt: skip
    return out


def snapshot_04(src: Path, fraction: float, shared, stage):
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "snap"
        cut_run(src, dst, fraction)
        return lengths.run(params.StageConfig("04_length_analysis", dst, shared, stage))


def one(res, final: dict, fraction: float, src: Path, cover: dict) -> None:
    proj = res.projection[res.projection.tokens == "completion"].set_index("dataset")
    print(f"snapshot at {fraction:.0%} of each B dataset's responses of {src}")
    hits = []
    for name, fv in final.items():
        r, est = proj.loc[name], res.estimates.get(name)
        lim = est["share_at_limit"] if est else (float("nan"),) * 3
        inside = r.lo <= fv["tokens"] <= r.hi
        hits.append(inside)
        cover["tokens"].append(inside)
        cover["share"].append(lim[1] <= fv["share"] <= lim[2] if est else True)
        print(f"{name:20s} in flight {r.in_flight:3d}  tokens {r.projected:9,.0f} [{r.lo:9,.0f}, {r.hi:9,.0f}] "
              f"final {fv['tokens']:8,d} {'inside' if inside else 'OUTSIDE'}  finished-only {r.naive_projected:9,.0f} "
              f"[{r.naive_lo:9,.0f}, {r.naive_hi:9,.0f}]  at limit {lim[0]:.1%} [{lim[1]:.1%}, {lim[2]:.1%}] "
              f"final {fv['share']:.1%}")  # fmt: skip
    c, a_tokens = res.corpus["completion"], int(res.tokens.trainable_tokens[res.tokens.kind == "A"].sum())
    total = a_tokens + sum(v["tokens"] for v in final.values())
    inside = "inside" if c["lo"] <= total <= c["hi"] else "OUTSIDE"
    print(f"corpus trainable tokens (A measured + B) {c['projected']:,.0f} [{c['lo']:,.0f}, {c['hi']:,.0f}], "
          f"final {total:,d} {inside}")  # fmt: skip
    print(f"{sum(hits)}/{len(hits)} datasets' final tokens inside their interval")
    print("answer:", res.answer_text)
    v = res.verdicts[res.verdicts.check == "truncation"]
    print(v[["level", "dataset", "message"]].to_string(index=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.midrun_04", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--fraction", type=float, nargs="+", default=[0.4])
    ap.add_argument("--params", default="params/toy.yaml", help="its shared block and 04 block are used")
    a = ap.parse_args(argv)
    src = Path(a.run_dir)
    raw = __import__("yaml").safe_load(Path(a.params).read_text())
    shared = params.SharedParams(**raw.get("shared", {}))
    stage = lengths.Params(**(raw.get("stages", {}).get("04_length_analysis") or {}))
    final = final_values(src)
    cover = {"tokens": [], "share": []}
    for fraction in a.fraction:
        res = snapshot_04(src, fraction, shared, stage)
        one(res, final, fraction, src, cover)
    if len(a.fraction) > 1:
        print(f"coverage over {len(a.fraction)} snapshots x {len(final)} datasets: tokens "
              f"{sum(cover['tokens'])}/{len(cover['tokens'])}, share at the limit {sum(cover['share'])}/{len(cover['share'])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
