"""A discrete-event simulation of a long 03 run: what its ledger and responses would hold at any moment.

The motivating mixture: short tool-call answers, long reasoning with a tail cut at max_new_tokens, very long
SWE traces; tens of thousands of prompts over several servers with many requests in flight each. Prompts are
taken in a shuffled order (as 03 does); a request starts when a server slot frees up, runs for its prefill and
queueing overhead plus its length over a per-request decode rate, and finishes. The simulation knows every
length, so the final totals a snapshot must predict are exact.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle_lib.length_study.censored import RunState

LIMIT = 16384
# name: (prompts, lognormal median of the uncut length, sigma)
MIXTURE = {"tool_calls": (16000, 60.0, 0.7), "reasoning": (8000, 8000.0, 1.0), "swe": (3000, 12000.0, 0.8)}
SERVER_RATES = (42.0, 40.0, 30.0, 26.0)  # decode tokens/s of one request on each server
CONCURRENCY = 64  # requests in flight per server


@dataclass
class SimRun:
    """One dataset's full run: its final state and the finish order."""

    name: str
    final: RunState

    def snapshot(self, fraction: float) -> RunState:
        """The state when `fraction` of the responses had been written (as the issue's cut of the file)."""
        ends = np.sort(self.final.end)
        return self.final.at(float(ends[max(int(fraction * ends.size) - 1, 0)]))

    @property
    def truth(self) -> dict:
        f = self.final
        return {"tokens": float(f.completion.sum()), "share_at_limit": float((f.status == 1).mean())}


def simulate(name: str, seed: int, scale: float = 1.0, concurrency: int = CONCURRENCY) -> SimRun:
    """Simulate one dataset of MIXTURE (its prompt count times `scale`) on SERVER_RATES x concurrency slots."""
    n, median, sigma = MIXTURE[name]
    n = int(n * scale)
    rng = np.random.default_rng(seed)
    uncut = rng.lognormal(np.log(median), sigma, n)
    length = np.minimum(np.maximum(np.rint(uncut), 1), LIMIT).astype(np.int64)
    status = np.where(uncut >= LIMIT, 1, 0).astype(np.int8)
    prompt = rng.lognormal(np.log(800), 0.8, n)
    server_of_slot = [s for s in range(len(SERVER_RATES)) for _ in range(concurrency)]
    slots = [(0.0, j) for j in range(len(server_of_slot))]  # (free at, slot)
    heapq.heapify(slots)
    start, end, server = np.empty(n), np.empty(n), np.empty(n, np.int64)
    jitter = rng.lognormal(0.0, 0.25, n)  # per-request speed (batch composition, KV pressure)
    overhead = rng.exponential(0.4, n) + prompt / 8000.0  # queueing and prefill seconds
    for i in rng.permutation(n):  # 03's seeded random order
        t, j = heapq.heappop(slots)
        srv = server_of_slot[j]
        start[i], server[i] = t, srv
        end[i] = t + overhead[i] + length[i] / (SERVER_RATES[srv] * jitter[i])
        heapq.heappush(slots, (end[i], j))
    empty = np.empty(0)
    final = RunState(
        length, status, start, end, server, empty, empty.astype(np.int64), LIMIT, n, float(end.max())
    )
    return SimRun(name, final)


def write_files(run_dir: Path, name: str, state: RunState) -> None:
    """The files 03 would have written by `state.as_of`: responses (finish order) and the ledger (start order)."""
    from eagle_lib import store

    ds, order = run_dir / "infer" / name, np.argsort(state.end, kind="stable")
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": state.limit, "seed": 0}
    store.append_jsonl(ds / "responses.jsonl", [
        {"id": f"{name}-{i}", "prompt_ids": [1] * 8, "output_ids": [7] * int(state.completion[i]),
         "finish_reason": "length" if state.status[i] == 1 else "stop", "n_prompt_tokens": 8,
         "n_output_tokens": int(state.completion[i]), "sampling": sampling, "server": f"s{state.server[i]}",
         "latency_s": float(state.end[i] - state.start[i]), "finished_at": float(state.end[i])}
        for i in order], fsync=False)  # fmt: skip
    starts = [(t, f"{name}-{i}", s) for i, (t, s) in enumerate(zip(state.start, state.server, strict=True))]
    starts += [
        (t, f"{name}-run{j}", s) for j, (t, s) in enumerate(zip(state.in_start, state.in_server, strict=True))
    ]
    store.append_jsonl(ds / "started.jsonl", [{"id": i, "t": float(t), "server": f"s{s}"} for t, i, s in sorted(starts)],
                       fsync=False)  # fmt: skip
