"""Producer of target hidden states for stage 05: vLLM prefill with ``extract_hidden_states`` into the buffer.

Run with the vLLM venv's interpreter (it pins its own torch), by the stage or by hand on a cluster::

    .venv-vllm/bin/python -m eagle_lib.hidden_states.vllm_producer --buffer DIR [--index i --count n]
        [--scratch LOCAL_DIR]

``DIR`` holds ``producer_config.json``, ``sequences.jsonl`` and ``plan.json`` written by the trainer
(`eagle_lib.hidden_states.engine_hidden`; layout in `eagle_lib.hidden_states.hidden_buffer`). Every planned sequence is
one vLLM request with ``max_tokens=1`` (prefill only, no decoding); the speculative method
``extract_hidden_states`` captures the configured layers (HF ``hidden_states`` indices; id L = the last
layer before the final norm) and a KV connector writes them per request: vLLM's own
``ExampleHiddenStatesConnector`` on GPU, `eagle_lib.hidden_states.vllm_connector` on CPU. The producer regroups
them into one file per unit, cast to the storage dtype (float8 with a per-row scale, `hidden_buffer.encode`);
a unit planned empty (all its sequences kept) is never made. The per-request files go to a scratch directory on
the producer's own disk (``--scratch``; default `default_scratch`, under ``$TMPDIR`` or /tmp), not under the
shared buffer: there every token would cross the shared storage four times instead of twice. The connector
locks each request file with flock, so a scratch directory without flock is refused at start. Imports nothing
of the main venv beyond the stdlib-only buffer protocol and the connector.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from eagle_lib.hidden_states import hidden_buffer as hb


class VllmPrefill:
    """A `vllm.LLM` that captures ``cfg['layer_ids']`` during prefill; its connector writes under ``scratch``."""

    def __init__(self, cfg: dict, scratch: Path):
        from vllm import LLM

        if cfg["connector"] == "cpu":
            from eagle_lib.hidden_states import vllm_connector

            conn = {"kv_connector": vllm_connector.CLASS, "kv_connector_module_path": vllm_connector.MODULE}
        else:  # vLLM's own (CUDA streams, pinned memory, a writer thread pool)
            conn = {"kv_connector": "ExampleHiddenStatesConnector"}
        conn.update(kv_role="kv_producer", kv_connector_extra_config={"shared_storage_path": str(scratch)})
        spec = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": cfg["layer_ids"]}},
        }
        self.llm = LLM(
            model=cfg["target"],
            dtype=cfg["model_dtype"],
            tensor_parallel_size=cfg["tensor_parallel_size"],
            max_model_len=cfg["max_model_len"],
            trust_remote_code=cfg["trust_remote_code"],
            revision=cfg.get("revision"),
            enforce_eager=cfg["connector"] == "cpu",
            enable_prefix_caching=False,  # every request's hidden states come from its own prefill
            skip_tokenizer_init=True,
            speculative_config=spec,
            kv_transfer_config=conn,
            seed=0,
            **{
                k: cfg[k]
                for k in ("language_model_only", "compilation_config", "attention_config")
                if cfg.get(k)
            },
        )

    def prefill(self, seqs: list[list[int]]) -> list[str]:
        """One request per sequence, max_tokens 1 (no decoding): the per-request hidden-state files, in order."""
        from vllm import SamplingParams, TokensPrompt

        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], sp, use_tqdm=False)
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        if None in paths:
            raise RuntimeError(f"vLLM returned no hidden_states_path for request {paths.index(None)}")
        return paths


def read_request_file(path: str) -> dict:
    """A connector's per-request file, after the writer released its lock (vLLM's protocol)."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)  # sleeps until the writer releases LOCK_EX
            data = load_file(path, device="cpu")
        os.remove(lock)
    else:
        data = load_file(path, device="cpu")
    os.remove(path)
    return data


make_engine = VllmPrefill  # tests substitute an engine with the same prefill()


def default_scratch(buf: Path, index: int) -> Path:
    """Producer `index`'s scratch for buffer `buf` on this machine's local disk: ``$TMPDIR`` (else /tmp) /
    eagle3_producer/<digest of the buffer's absolute path>_<index>; one directory per buffer and producer."""
    digest = hashlib.sha256(str(Path(buf).absolute()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "eagle3_producer" / f"{digest}_{index}"


def check_scratch(scratch: Path, buf: Path) -> None:
    """Refuse a scratch directory whose filesystem has no flock (the connector's per-request lock needs it): a
    failure `record_failure` reports to the waiting trainer."""
    err = hb.flock_error(scratch)
    if err is not None:
        raise RuntimeError(
            f"{scratch}: the filesystem has no flock ({err}; Lustre mounted noflock?), which vLLM's hidden-states "
            f"connector takes on every request file: start the producer of {buf} with --scratch on a local disk"
        )


class StalePlan(SystemExit):
    """The buffer's plan belongs to another trainer run than the one this producer was started for."""


class Producer:
    def __init__(self, buf: Path, index: int, count: int, stop_file: str = "STOP", session: str = "",
                 scratch: Path | None = None):  # fmt: skip
        self.buf, self.index, self.count, self.session = buf, index, count, session
        self.scratch = Path(scratch) if scratch else default_scratch(buf, index)  # local disk (module doc)
        self.stop_files = [buf / "STOP", buf / stop_file]  # by hand, or by the trainer that started us
        self.cfg = hb.read_json(buf / "producer_config.json")
        if self.cfg is None:
            raise FileNotFoundError(f"{buf / 'producer_config.json'}: missing (the trainer writes it; is --buffer "
                                    "the directory its COMMAND file names?)")  # fmt: skip
        self.plan_mtime = self._check_session()
        self.units = hb.read_json(buf / "plan.json")["units"]
        with open(buf / "sequences.jsonl") as f:
            self.seqs = [json.loads(line) for line in f]
        self.n_ids, self.h = len(self.cfg["layer_ids"]), self.cfg["hidden_size"]
        self.ledger = hb.Ledger(self.cfg["max_buffer_bytes"] // count)
        self.stats = {"tokens": 0, "units": 0, "bytes_written": 0, "busy_s": 0.0, "blocked_s": 0.0}
        self.stats_path = buf / f"producer_{index}.json"
        self.parent = os.getppid() if self.cfg.get("exit_with_parent") else None

    def _check_session(self) -> int:
        """plan.json's mtime (ns); raises StalePlan when the plan names another session than ours (a trainer
        run started since the COMMAND this producer was started from: its plan may list other sequences)."""
        path = self.buf / "plan.json"
        mtime = path.stat().st_mtime_ns
        theirs = (hb.read_json(path) or {}).get("session", "")
        if self.session and theirs != self.session:
            raise StalePlan(
                f"{path}: planned by trainer session {theirs or '(none)'}, not {self.session} that this producer was "
                "started for: a later 05 run re-planned this buffer; run the line in its COMMAND file instead"
            )
        return mtime

    def mine(self, first: int) -> list[int]:
        """This producer's non-empty units from `first` on; refuses one that cannot fit its buffer share."""
        mine = [u for u in range(first, len(self.units)) if u % self.count == self.index and self.units[u]]
        for u in mine:
            if self.need(u) > self.ledger.share:
                raise SystemExit(
                    f"{self.buf}: unit {u} needs {self.need(u)} B in flight, more than this producer's "
                    f"share {self.ledger.share} B of max_buffer_gb: raise max_buffer_gb or lower rows_per_batch"
                )
        return mine

    def reload(self, known: int) -> list[int]:
        """Units appended to plan.json since `known` units (its writer appends sequences.jsonl first)."""
        units = hb.read_json(self.buf / "plan.json")["units"]
        if len(units) <= known:
            return []
        with open(self.buf / "sequences.jsonl") as f:
            self.seqs = [json.loads(line) for line in f]
        self.units = units
        return self.mine(known)

    def need(self, u: int) -> int:
        lengths = [len(self.seqs[i]) for i in self.units[u]]
        shard = hb.shard_bytes(sum(lengths), len(lengths), self.n_ids, self.h, self.cfg["storage_dtype"])
        return shard + hb.scratch_bytes(lengths, self.n_ids, self.h, self.cfg["model_dtype"])

    def write_stats(self, state: str) -> None:
        hb.write_json(
            self.stats_path,
            {
                **self.stats,
                "state": state,
                "pid": os.getpid(),
                "share_bytes": self.ledger.share,
                "peak_buffer_bytes": self.ledger.peak,
                "pending_bytes": self.ledger.pending(),
                "scratch": str(self.scratch),
            },
        )

    def run(self) -> None:
        serve([self])

    def open(self) -> None:
        """Start serving this buffer: drop a killed run's partial units, list this producer's units."""
        for part in self.buf.glob("unit_*.part"):
            part.unlink()
        self.todo, self.pos = self.mine(0), 0
        self.write_stats("starting")

    def poll(self):
        """The next units to make now, reserved in the ledger (a list); else "done" (stopped, or every unit
        made without ``follow``), "blocked" (the buffer share is full) or "idle" (waiting for the plan)."""
        while True:
            if any(f.exists() for f in self.stop_files) or (self.parent and os.getppid() != self.parent):
                return "done"  # asked to stop, or the trainer that started us is gone
            if self.session and (self.buf / "plan.json").stat().st_mtime_ns != self.plan_mtime:
                self.plan_mtime = self._check_session()  # rewritten: still ours (resume of the same run)?
            if self.pos == len(self.todo):  # all planned units made: done, or (follow) units appended later
                if not self.cfg.get("follow"):
                    return "done"
                self.todo += self.reload(len(self.units))
                return "idle"
            # Look at the files first, then at the cursor: the trainer advances the cursor before it deletes
            # a unit, so a unit seen missing here and consumed meanwhile is below the cursor read after.
            ahead = self.todo[self.pos : self.pos + self.cfg["units_per_call"]]
            exists = [(self.buf / hb.unit_name(v)).exists() for v in ahead]
            cursor = hb.read_cursor(self.buf)
            self.ledger.release_consumed(cursor)
            u = ahead[0]
            if u < cursor or exists[0]:
                if u >= cursor:  # made by an earlier run of this producer: counts until consumed
                    try:
                        self.ledger.add(u, (self.buf / hb.unit_name(u)).stat().st_size)
                    except FileNotFoundError:  # consumed in the meantime
                        pass
                self.pos += 1
                continue
            batch, reserve = [], 0
            for v, made in zip(ahead, exists, strict=True):
                if made or v < cursor or not self.ledger.fits(reserve + self.need(v)):
                    break
                batch.append(v)
                reserve += self.need(v)
            if not batch:  # the buffer is full: wait for the trainer
                return "blocked"
            self.ledger.reserve(reserve)
            self.pos += len(batch)
            return batch

    def produce(self, engine, batch: list[int]) -> None:
        self.write_units(batch, iter(engine.prefill(self.batch_seqs(batch))))

    def batch_seqs(self, batch: list[int]) -> list[list[int]]:
        return [self.seqs[i] for u in batch for i in self.units[u]]

    def write_units(self, batch: list[int], got) -> None:
        """Regroup the engine's per-request files (`got`, in `batch_seqs` order) into this buffer's units."""
        import torch
        from safetensors.torch import save_file

        for u in batch:
            parts, lengths = [], []
            for i in self.units[u]:
                data = read_request_file(next(got))
                ids = data["token_ids"].tolist()
                if ids != self.seqs[i]:
                    raise RuntimeError(
                        f"unit {u}, sequence {i}: the engine's file holds {len(ids)} token ids that differ "
                        f"from the {len(self.seqs[i])} planned ones"
                    )
                hs = data["hidden_states"]
                if tuple(hs.shape) != (len(ids), self.n_ids, self.h):
                    raise RuntimeError(
                        f"unit {u}: hidden_states {list(hs.shape)}, expected [{len(ids)}, {self.n_ids}, {self.h}]"
                    )
                parts.append(hs)
                lengths.append(len(ids))
            tensors = {
                **hb.encode(torch.cat(parts), self.cfg["storage_dtype"]),
                "token_ids": torch.tensor([t for i in self.units[u] for t in self.seqs[i]], dtype=torch.long),
                "lengths": torch.tensor(lengths, dtype=torch.long),
            }
            final = self.buf / hb.unit_name(u)
            part = final.with_suffix(".part")
            save_file(tensors, str(part), metadata={"layer_ids": json.dumps(self.cfg["layer_ids"])})
            size = (
                part.stat().st_size
            )  # before the rename: a consumer may take the unit at once (07's kept store)
            os.replace(part, final)
            self.ledger.add(u, size)
            self.stats["tokens"] += sum(lengths)
            self.stats["units"] += 1
            self.stats["bytes_written"] += size


# settings of a producer's engine that every buffer it serves must share (max_model_len: the largest is taken)
ENGINE_KEYS = ("target", "layer_ids", "model_dtype", "tensor_parallel_size", "trust_remote_code", "revision",
               "connector", "language_model_only", "compilation_config", "attention_config")  # fmt: skip


def engine_config(lanes: list[Producer]) -> dict:
    """The one engine's settings for the buffers of `lanes` (several trainer ranks' buffers: one producer
    serving them all); refuses buffers planned for different engines."""
    cfg = dict(lanes[0].cfg)
    for lane in lanes[1:]:
        diff = [k for k in ENGINE_KEYS if lane.cfg.get(k) != cfg.get(k)]
        if diff:
            raise SystemExit(f"{lane.buf}: its producer_config.json differs from {lanes[0].buf}'s in {diff}: one "
                             "producer serves only buffers of the same engine settings")  # fmt: skip
    if len(lanes) > 1:
        cfg["max_model_len"] = max(lane.cfg["max_model_len"] for lane in lanes)
    return cfg


def serve(lanes: list[Producer]) -> None:
    """Fill the buffers of `lanes` (one trainer rank's buffer each) from one engine: each round takes what each
    buffer has room for and makes it in one engine call (the ranks' sequences batched together), so a
    producer node feeds several trainer ranks; each buffer keeps its own share, cursor and stats. The engine's
    busy time is charged to each buffer by its share of the round's tokens."""
    scratch = lanes[0].scratch
    shutil.rmtree(scratch, ignore_errors=True)  # a killed run's per-request files
    scratch.mkdir(parents=True)
    check_scratch(scratch, lanes[0].buf)
    for lane in lanes:
        lane.open()
    engine = make_engine(engine_config(lanes), scratch)
    active = list(lanes)
    while active:
        work, blocked = [], []
        for lane in list(active):
            got = lane.poll()
            if got == "done":
                lane.write_stats("done")
                active.remove(lane)
            elif got == "blocked":
                blocked.append(lane)
            elif got != "idle":
                work.append((lane, got))
        if not work:
            if active:
                t0 = time.perf_counter()
                time.sleep(0.02)
                for lane in blocked:
                    lane.stats["blocked_s"] += time.perf_counter() - t0
                    lane.write_stats("blocked")
            continue
        t0 = time.perf_counter()
        seqs = [lane.batch_seqs(batch) for lane, batch in work]
        got = iter(engine.prefill([x for part in seqs for x in part]))
        for lane, batch in work:
            lane.write_units(batch, got)
        busy, total = time.perf_counter() - t0, sum(len(x) for part in seqs for x in part)
        for (lane, _), part in zip(work, seqs, strict=True):
            lane.stats["busy_s"] += busy * sum(map(len, part)) / max(1, total)
            lane.write_stats("running")
    shutil.rmtree(scratch, ignore_errors=True)  # every request file was read (and removed) by write_units


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buffer", required=True, type=Path, action="append",
                    help="a trainer rank's buffer; repeated: one producer (one engine) serves several ranks")  # fmt: skip
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--stop-file", default="STOP", help="exit when this file appears in the buffer")
    ap.add_argument("--session", default=[], action="append",
                    help="the trainer session whose plan this producer serves (one per --buffer, in order)")  # fmt: skip
    ap.add_argument("--scratch", type=Path, default=None,
                    help="local directory for the engine's per-request files (default: under $TMPDIR or /tmp)")  # fmt: skip
    a = ap.parse_args(argv)
    if a.session and len(a.session) != len(a.buffer):
        ap.error(f"{len(a.session)} --session for {len(a.buffer)} --buffer: give one per buffer, in order")
    sessions = a.session or [""] * len(a.buffer)
    scratch = a.scratch or default_scratch(a.buffer[0], a.index)
    try:
        serve(
            [
                Producer(b, a.index, a.count, a.stop_file, s, scratch)
                for b, s in zip(a.buffer, sessions, strict=True)
            ]
        )
    except (
        BaseException
    ) as e:  # the trainers wait on these buffers, maybe on other nodes: tell them, then fail
        # SystemExit includes StalePlan: that buffer's stats are the current run's, left alone
        if not isinstance(e, (KeyboardInterrupt, SystemExit)):
            for b in a.buffer:
                record_failure(b, a.index, e)
        raise


def record_failure(buf: Path, index: int, err: BaseException) -> None:
    """producer_<index>.json says ``failed`` with the error and its traceback's tail (`producer_procs.wait_for`
    reads it: a rank waiting on external producers stops at once instead of after PRODUCER_WAIT_S)."""
    import traceback

    path = buf / f"producer_{index}.json"
    try:
        old = hb.read_json(path) if path.exists() else {}
    except (OSError, ValueError):
        old = {}
    tail = "".join(traceback.format_exception(err))[-3000:]
    hb.write_json(path, {**old, "state": "failed", "pid": os.getpid(), "error": f"{type(err).__name__}: {err}",
                         "traceback": tail})  # fmt: skip


if __name__ == "__main__":  # the multiprocessing engine re-imports __main__ in its workers
    main(sys.argv[1:])
