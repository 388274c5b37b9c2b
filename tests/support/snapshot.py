"""Cut a finished 03 run's files as the run would have left them at an earlier moment (issue 16's snapshots).

For each B dataset, the moment is when `fraction` of its responses had been written (by `finished_at`): the
snapshot keeps the responses finished by then and the ledger lines started by then, in file order, and drops
03's meta.json files (a run in progress has none). A and data/ are copied as they are.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eagle_lib import store


def cut_moment(responses: list[dict], fraction: float) -> float:
    ends = sorted(r["finished_at"] for r in responses)
    return ends[max(int(fraction * len(ends)) - 1, 0)]


def cut_run(src: Path, dst: Path, fraction: float) -> dict[str, float]:
    """Write the snapshot of run `src` at `fraction` to `dst`; returns dataset -> the moment it was cut."""
    shutil.copytree(src / "data", dst / "data", dirs_exist_ok=True)
    moments = {}
    for ds in sorted(p for p in (src / "infer").iterdir() if p.is_dir()):
        recs = store.read_jsonl(ds / "responses.jsonl")
        if not recs:
            continue
        t = moments[ds.name] = cut_moment(recs, fraction)
        out = dst / "infer" / ds.name
        store.append_jsonl(out / "responses.jsonl", [r for r in recs if r["finished_at"] <= t], fsync=False)
        starts = [s for s in store.read_jsonl(ds / "started.jsonl") if s["t"] <= t]
        store.append_jsonl(out / "started.jsonl", starts, fsync=False)
    return moments


def cut_run_at(src: Path, dst: Path, fraction: float) -> float:
    """Write the snapshot of run `src` at ONE moment for every dataset: when `fraction` of all its responses
    (every B dataset together) had been written, as a SIGKILL of 03 then would leave it. Returns the moment."""
    shutil.copytree(src / "data", dst / "data", dirs_exist_ok=True)
    dirs = sorted(p for p in (src / "infer").iterdir() if p.is_dir())
    recs = {ds.name: store.read_jsonl(ds / "responses.jsonl") for ds in dirs}
    t = cut_moment([r for rs in recs.values() for r in rs], fraction)
    for ds in dirs:
        out = dst / "infer" / ds.name
        out.mkdir(parents=True, exist_ok=True)
        store.append_jsonl(
            out / "responses.jsonl", [r for r in recs[ds.name] if r["finished_at"] <= t], fsync=False
        )
        starts = [s for s in store.read_jsonl(ds / "started.jsonl") if s["t"] <= t]
        store.append_jsonl(out / "started.jsonl", starts, fsync=False)
    return t
