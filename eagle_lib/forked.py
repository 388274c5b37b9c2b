"""One function over many items in forked worker processes, the results in item order. Stdlib only.

For work that is many independent, single-threaded jobs over models already in memory: decoding held-out prompts
one by one (07's arms, 05's measured tau, 06), and training 07's arms side by side, one thread each
(`eagle_lib.data_value.value_study.Study.train_side_by_side`: a training step on two threads is ~1.5x one). A
decode runs fastest on one torch thread (its many small matmuls each pay a wake-up on two:
`eagle_lib.engines.machine.decoding_threads`), so on a stage that owns two cores one of them idled while it decoded.
A forked child inherits the parent's memory as it is at the call (the target, the drafter just trained),
copy-on-write, so nothing is pickled but the item indices and the results.

Each item is computed exactly as in the parent (the same function, weights and thread count), so the results are
the parent's own, bit for bit, whatever the number of processes (tests/unit/test_value.py, test_measure.py and
test_acceptance.py decode with one and two processes and compare, test_value.py trains 07's arms so too;
test_forked.py: order, errors). The children inherit
torch's thread count as the parent set it (`decoding_threads` sets it before the call); a forked child must not
enter a multi-threaded OpenMP region its parent's threads were running (GNU OpenMP is not fork-safe), so callers
fork only on one thread a child.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

_CALL: Callable[[int], Any] | None = None  # the job of the running forked_map, inherited by its children


def _run(i: int) -> Any:
    return _CALL(i)


def forked_map(
    fn: Callable[[int], Any],
    n: int,
    processes: int,
    what: str = "job",
    done: Callable[[int, Any], None] | None = None,
) -> list:
    """[fn(0), ..., fn(n - 1)]: in this process when `processes` <= 1 or n <= 1 (or on a system without fork),
    otherwise by min(processes, n) forked children, each taking the next index as it finishes one (chunks of one,
    so long and short items balance). `fn`'s results must pickle. `done(i, result)` runs here as each item ends (in
    the order they end: progress lines). A child's exception is raised here (the items not yet begun are dropped);
    a child that dies (killed, out of memory) raises RuntimeError naming `what`."""
    global _CALL
    if processes <= 1 or n <= 1 or not hasattr(os, "fork"):
        results = []
        for i in range(n):
            results.append(fn(i))
            if done is not None:
                done(i, results[-1])
        return results
    if _CALL is not None:
        raise RuntimeError(
            f"forked_map for {what}: already inside a forked_map (nested calls are not supported)"
        )
    _CALL = fn
    try:
        ctx = multiprocessing.get_context("fork")
        with cf.ProcessPoolExecutor(min(processes, n), mp_context=ctx) as pool:
            futures = {pool.submit(_run, i): i for i in range(n)}  # queued in index order, as map queues them
            results: list = [None] * n
            try:
                for f in cf.as_completed(futures):
                    i = futures[f]
                    results[i] = f.result()
                    if done is not None:
                        done(i, results[i])
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            return results
    except cf.process.BrokenProcessPool as e:
        raise RuntimeError(
            f"forked_map for {what}: a worker process died ({e}); rerun with one process (EAGLE_MAX_THREADS=1) "
            "to see the error in this process"
        ) from None
    finally:
        _CALL = None
