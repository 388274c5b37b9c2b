"""One engine run over the pending prompts of several 03 datasets, each answer committed to its own dataset's
responses, errors and ledger (`generate_many`), in an interleaved seeded order (`interleaved`); an engine that
stops the run (failures clearly past max_error_fraction, no server left) is a `Stopped`, recorded by
`record_stop`."""

from __future__ import annotations

import random
import time
from pathlib import Path

from eagle_lib import store
from eagle_lib.engines.base import EngineError, Failure, Request, Result
from eagle_lib.engines.ledger import NAME as LEDGER
from eagle_lib.engines.ledger import Ledger
from eagle_lib.engines.resume import InferError, Writer


class Stopped(InferError):
    """The engine stopped 03 mid-run (resumable): `datasets` = per dataset this run's {pending, answered,
    failed, not_finished}; `reason` = the engine's."""

    def __init__(self, reason: str, datasets: dict[str, dict]):
        self.reason, self.datasets = reason, datasets
        counts = "; ".join(f"{n}: {c['answered']} answered, {c['failed']} failed, {c['not_finished']} not finished "
                           f"of {c['pending']} pending" for n, c in datasets.items())  # fmt: skip
        super().__init__(f"03_infer stopped early in {', '.join(datasets)} ({counts}): {reason}. The answers "
                         "written are kept (responses.jsonl, errors.jsonl); a restart resumes")  # fmt: skip


def record_stop(path: Path, e: Stopped, engine, probe: dict, p, started: float) -> None:
    """03's stage meta of a stopped run: status "stopped_early", why, and what each dataset got."""
    store.write_json(path, {
        "status": "stopped_early", "reason": e.reason, "datasets": e.datasets, "probe": probe,
        "servers": engine.server_stats() if hasattr(engine, "server_stats") else [],
        "deadlines": engine.deadlines.record() if hasattr(engine, "deadlines") else None,
        "params": p.model_dump(mode="json"), "started": store.now_iso(started), "finished": store.now_iso(),
    })  # fmt: skip


def progress_bar(enabled: bool, total: int, name: str):
    """A progress line on stdout every ~15 s (prompts done, tokens/s, elapsed, ETA), also on the pipeline's
    console (`eagle_lib.progress`); tqdm's update/set_postfix_str/close."""
    from eagle_lib import progress

    return progress.Bar(progress.Progress(name, total, "prompts"), enabled)


def generate_many(engine, jobs: dict[str, tuple[list[dict], Path]], tokenizer, p,
                  identity: dict | None = None) -> dict[str, dict]:  # fmt: skip
    """One engine run over the pending prompts of several datasets (name -> (pending, out dir)), in the order
    given (their ids are unique: each starts with its dataset's name), each answer committed to its own dataset's
    responses, errors and ledger; returns each dataset's counters (``generate_seconds``: the shared run's)."""
    ledgers = {n: Ledger(d / LEDGER, p.ledger_seconds) for n, (_, d) in jobs.items()}
    writers = {n: (Writer(d / "responses.jsonl", p.write_every, before=ledgers[n].flush),
                   Writer(d / "errors.jsonl", 1, before=ledgers[n].flush)) for n, (_, d) in jobs.items()}  # fmt: skip
    owner = {r["id"]: n for n, (pend, _) in jobs.items() for r in pend}
    by_id = {r["id"]: r for pend, _ in jobs.values() for r in pend}
    order = interleaved(jobs)
    sampling, stop = engine.sampling.record(), list(engine.sampling.stop_token_ids)
    stats = {n: {"generated": 0, "errors": 0, "generated_tokens": 0, "retries": 0} for n in jobs}
    t0 = time.monotonic()
    bar = progress_bar(p.progress, len(order), ", ".join(jobs) if len(jobs) <= 3 else f"{len(jobs)} datasets")

    def progress(counts: list[tuple[str, int]]) -> None:
        for n in jobs:
            if mine := [(i, c) for i, c in counts if owner.get(i) == n]:
                ledgers[n].progress(mine)

    engine.on_start = lambda i, server="": ledgers[owner[i]].started(i, server)
    engine.on_progress = progress
    for lg in ledgers.values():
        lg.start()
    try:
        yield_all = engine.generate([Request(r["id"], r["prompt_ids"]) for r in order])
        for item in _stopping(yield_all, jobs, stats):
            src, name = by_id[item.id], owner[item.id]
            st, (responses, errors) = stats[name], writers[name]
            st["retries"] += item.retries
            if isinstance(item, Result):
                responses.add({
                    "id": item.id, "source": src.get("source", name), "prompt_ids": src["prompt_ids"],
                    "output_ids": item.output_ids, "text": tokenizer.decode(item.output_ids, skip_special_tokens=False),
                    "finish_reason": item.finish_reason, "n_prompt_tokens": len(src["prompt_ids"]),
                    "n_output_tokens": len(item.output_ids), "sampling": sampling, "engine": engine.name,
                    "target": identity, "stop_token_ids": stop, "server": item.server or engine.name,
                    "latency_s": round(item.latency_s, 4), "finished_at": round(time.time(), 3),
                    **src.get("extra", {}),
                })  # fmt: skip
                st["generated"] += 1
                st["generated_tokens"] += len(item.output_ids)
            else:
                assert isinstance(item, Failure)
                errors.add({
                    "id": item.id, "source": src.get("source", name), "reason": item.reason, "detail": item.detail,
                    "server": item.server, "retries": item.retries, "engine": engine.name, "time": time.time(),
                })  # fmt: skip
                st["errors"] += 1
            bar.update(1)
            done = sum(x["generated_tokens"] for x in stats.values())
            bar.set_postfix_str(f"{done / max(time.monotonic() - t0, 1e-9):.0f} tok/s", refresh=False)
    finally:
        for lg in ledgers.values():
            lg.close()
        engine.on_start = engine.on_progress = None
        for responses, errors in writers.values():
            responses.flush()
            errors.flush()
        bar.close()
    wall = round(time.monotonic() - t0, 3)
    for st in stats.values():
        st["generate_seconds"] = wall
        st["tokens_per_s"] = round(st["generated_tokens"] / max(wall, 1e-9), 2)
    return stats


def _stopping(items, jobs: dict, stats: dict):
    """The engine's items; its EngineError mid-run as a Stopped with each dataset's counts so far."""
    try:
        yield from items
    except EngineError as e:
        raise Stopped(str(e), {n: {"pending": len(pend), "answered": stats[n]["generated"],
                                   "failed": stats[n]["errors"],
                                   "not_finished": len(pend) - stats[n]["generated"] - stats[n]["errors"]}
                               for n, (pend, _) in jobs.items()}) from None  # fmt: skip


def interleaved(jobs: dict[str, tuple[list[dict], Path]]) -> list[dict]:
    """The pending prompts of every job in one list: each job's own order kept, the jobs merged at random (seeded
    by their ids), so that any prefix (a snapshot mid-run) is a random sample of the whole plan, every dataset
    in proportion to its pending prompts."""
    queues = {n: list(pend) for n, (pend, _) in jobs.items() if pend}
    rng = random.Random(store.stable_hash(sorted((n, len(q)) for n, q in queues.items())))
    slots = [n for n, q in queues.items() for _ in q]
    rng.shuffle(slots)
    return [queues[n].pop(0) for n in slots]
