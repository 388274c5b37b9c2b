"""03's resume: what was committed before, by whom, and what must be set aside; the durable batch writer.

A committed response belongs to this run only if its id is a current prompt, its prompt_ids and sampling are
this run's, it was made by the same target (`target_identity`: engine + the configured target + revision +
config and weights fingerprints for the embedded engine, config and tokenizer fingerprints for servers, whose
weights `engines.fingerprint` checks on every live server; never which servers are up or the paths they
report) and with the same stop ids. Anything else is never mixed in silently: the run stops naming the record
(on_stale "error") or moves such records to `<dataset>/stale.jsonl` ("set_aside", appended there first, then
the file replaced atomically) and says how many.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from eagle_lib import models, store


class InferError(RuntimeError):
    """Bad input or inconsistent earlier output: names the file, the record and the reason."""


def target_identity(engine, shared, probe: dict | None = None, tokenizer=None) -> dict:
    """Who generates: the engine and the model as configured (+ revision and fingerprints), the same whichever
    servers are up (`probe`, check()'s report, is not part of it). Servers need the target `tokenizer`."""
    if engine.name != "embedded":
        if tokenizer is None:
            raise ValueError("target_identity: a server engine's identity needs the target tokenizer")
        try:
            config = models.load_config(shared.target, **models.hub_kwargs(shared))
        except (OSError, ValueError) as e:
            raise InferError(
                f"03 names its target by its config: cannot read {shared.target}'s here ({e})"
            ) from e
        return {
            "engine": engine.name,
            "model": shared.target,  # as configured; the servers' own paths may differ from node to node
            "revision": getattr(shared, "revision", "") or config.to_dict().get("_commit_hash", "") or "",
            "config_sha256": models.config_fingerprint(config),
            "tokenizer_sha256": models.tokenizer_fingerprint(tokenizer),
        }
    model = engine.model
    revision = getattr(shared, "revision", "") or model.config.to_dict().get("_commit_hash", "") or ""
    return {
        "engine": "embedded",
        "model": shared.target,  # as configured (a local path or hub id; toy://target for the toy)
        "revision": revision,
        "config_sha256": models.config_fingerprint(model.config),
        "weights_sha256": models.weights_fingerprint(model.get_input_embeddings().weight),
    }


def stale_reason(rec: dict, prompts: dict[str, dict], sampling: dict, target: dict, stop: list[int]) -> str:
    """Why a committed record does not belong to this run ('' when it does)."""
    p = prompts.get(rec.get("id"))
    if p is None:
        return "its id is not in prompts.jsonl"
    if rec.get("prompt_ids") != p["prompt_ids"]:
        return "its prompt_ids differ from prompts.jsonl"
    if rec.get("sampling") != sampling:
        return f"it was sampled with {rec.get('sampling')}, this run asks {sampling}"
    if rec.get("target") != target:
        made = rec.get("target") or "an unrecorded target (written before 03 recorded its target)"
        if isinstance(made, dict) and isinstance(made.get("model"), list):
            made = (f"{made} (an older 03 named a served target by the model paths its servers reported, '?' for "
                    "one down; this one by its config and tokenizer, the weights checked on every server: to keep "
                    "these records, finish the run with the 03 that started it)")  # fmt: skip
        return f"it was made by {made}, this run's target is {target}"
    if rec.get("stop_token_ids") != stop:
        return f"it was made with stop ids {rec.get('stop_token_ids')}, this run stops at {stop}"
    return ""


class Resume:
    """The committed state of one dataset directory, checked against this run's prompts, sampling and target."""

    def __init__(self, ds_dir: Path, prompts: dict[str, dict], sampling: dict, target: dict, stop: list[int]):
        self.ds_dir, self.prompts, self.sampling = ds_dir, prompts, sampling
        self.target, self.stop = target, list(stop)

    def why(self, rec: dict) -> str:
        return stale_reason(rec, self.prompts, self.sampling, self.target, self.stop)

    def set_aside(self, f: Path) -> int:
        """Move a file's stale records to <dataset>/stale.jsonl; returns how many."""
        keep, stale = [], []
        for rec in store.iter_jsonl(f):
            (stale if self.why(rec) else keep).append(rec)
        if stale:
            store.append_jsonl(self.ds_dir / "stale.jsonl", stale)
            tmp = f.with_suffix(".jsonl.tmp")
            tmp.unlink(missing_ok=True)
            store.append_jsonl(tmp, keep)
            tmp.touch()
            os.replace(tmp, f)
        return len(stale)

    def files(self) -> list[Path]:
        return [self.ds_dir / "responses.jsonl", *sorted(self.ds_dir.glob("shards/*/responses.jsonl"))]

    def load(self, on_stale: str = "error") -> tuple[dict, int, int]:
        """(id -> {finish_reason, n_output_tokens, file}, duplicate lines ignored, records set aside)."""
        moved = 0
        if on_stale == "set_aside":
            moved = sum(self.set_aside(f) for f in self.files() if f.exists())
        done: dict[str, dict] = {}
        dups = 0
        for f in self.files():
            for rec in store.iter_jsonl(f):
                if why := self.why(rec):
                    raise InferError(f"{f}: record {rec.get('id')!r} is stale: {why}. Set on_stale: set_aside, "
                                     f"move {self.ds_dir} away or restore the params that made it (nothing was "
                                     "deleted).")  # fmt: skip
                if rec["id"] in done:
                    dups += 1
                    continue
                done[rec["id"]] = {
                    "finish_reason": rec["finish_reason"],
                    "n_output_tokens": rec["n_output_tokens"],
                    "file": f,
                }
        return done, dups, moved


def merge_shards(ds_dir: Path, done: dict[str, dict], batch: int = 1000) -> int:
    """Append shard responses not yet in the main responses.jsonl to it (idempotent, crash-safe).

    A crash mid-merge leaves the main file with a prefix of a shard's records (plus at most a torn tail, which
    store skips): the next run reads them as done from the main file and appends only the others.
    """
    main = ds_dir / "responses.jsonl"
    n = 0
    for f in sorted(ds_dir.glob("shards/*/responses.jsonl")):
        buf = []
        for rec in store.iter_jsonl(f):
            if done[rec["id"]]["file"] == f:
                buf.append(rec)
                done[rec["id"]]["file"] = main
            if len(buf) >= batch:
                n += store.append_jsonl(main, buf)
                buf = []
        n += store.append_jsonl(main, buf)
    return n


def error_ids(ds_dir: Path) -> dict[str, dict]:
    """Latest error record per id over errors.jsonl and the shards' errors.jsonl."""
    out: dict[str, dict] = {}
    for f in [ds_dir / "errors.jsonl", *sorted(ds_dir.glob("shards/*/errors.jsonl"))]:
        for rec in store.iter_jsonl(f):
            out[rec["id"]] = rec
    return out


class Writer:
    """Buffers records and appends them durably every `every` records or `seconds`; `before` runs first."""

    def __init__(self, path: Path, every: int, seconds: float = 30.0, before=None):
        self.path, self.every, self.seconds, self.before = path, max(1, every), seconds, before
        self.buf: list[dict] = []
        self.last = time.monotonic()

    def add(self, rec: dict) -> None:
        self.buf.append(rec)
        if len(self.buf) >= self.every or time.monotonic() - self.last > self.seconds:
            self.flush()

    def flush(self) -> None:
        if self.before is not None:
            self.before()  # the ledger first: a reader never sees a response whose start is not recorded
        store.append_jsonl(self.path, self.buf)
        self.buf, self.last = [], time.monotonic()
