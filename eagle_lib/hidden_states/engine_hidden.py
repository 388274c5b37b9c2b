"""`VllmHidden`: stage 05's hidden states from the serving engine (vLLM prefill), streamed through a bounded buffer.

The trainer's calls to its hidden source are a pure function of the settings: micro-batch ``m`` of
`eagle_lib.data.batches.BatchStream` for each step of this rank, then the held-out batches of the final
evaluation. `plan` lists them as units (unit u = the u-th call); producers
(`eagle_lib.hidden_states.vllm_producer`, vLLM's venv) fill the buffer ahead of the trainer, at most
``max_buffer_gb`` (`eagle_lib.hidden_states.hidden_buffer`), and the trainer deletes each unit after use unless
``keep_hidden_states``, which moves it into the per-sequence store (`eagle_lib.hidden_states.hidden_store`). A
sequence kept there (by any earlier run on the same target, layers and dtypes), or kept by an earlier unit of
this plan, is read from the store and not produced: a unit's planned sequences are only its missing ones, and
no producer starts when none is missing. Resuming from checkpoint step s starts at unit ``s * grad_accum``:
units made ahead by a killed run are reused, consumed ones are made again (or read from the store), so every
sequence is used once per epoch.

Each unit holds, per token, the layers ``layer_ids`` (HF hidden_states indices, sorted: our 0-based aux
decoder layer i is id i + 1, and id L is the last layer before the final norm). ``__call__`` returns the
contract of `eagle_lib.hidden_states.hidden`: aux (B, T, 3H) and logits (B, T, V) = the target's final norm +
lm_head (`TargetHead`, loaded alone from the checkpoint) applied to layer L.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
import weakref
from pathlib import Path

import torch

from eagle_lib import distributed, models, store
from eagle_lib.data import batches
from eagle_lib.hidden_states import hidden, hidden_store, producer_procs
from eagle_lib.hidden_states import hidden_buffer as hb


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
    rank, world = distributed.data_world(p.sequence_parallel)  # a sequence-parallel group reads the same
    total = batches.total_steps(p, stream.per_epoch, world)  # the trainer's own step count and batch order
    mbs = [
        stream.micro_batch(m)
        for s in range(total)
        for m in batches.micro_batches(s, rank, world, p.grad_accum)
    ]
    rows = batches.pack([len(s.input_ids) for s in held], p.pack_len)
    mbs += [
        batches.make_batch(held, rows[i : i + p.rows_per_batch], batches.PAD_TO)
        for i in range(0, len(rows), p.rows_per_batch)
    ]
    tokens = {batches.seq_key(s.input_ids): list(s.input_ids) for s in train + held}
    units = [[k for row in b.segments for k, _, _ in row] for b in mbs]
    return units, tokens, start_step * p.grad_accum


def producer_config(
    p: dict, shared, text, ids: list[int], max_len: int, cpu: bool, multimodal: bool = False, world: int = 1
) -> dict:
    """producer_config.json from 05's params (as a dict), the shared params and the target's text config;
    `multimodal`: the target is a wrapper around its language model (Kimi-K2.5), served language-model-only.
    ``max_buffer_gb`` bounds the whole run: each of `world` trainer ranks' buffers gets its share."""
    return {
        "target": models.resolve(shared.target),
        "layer_ids": ids,
        "num_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "model_dtype": "float32" if cpu else "bfloat16",
        "storage_dtype": p["hidden_dtype"],
        "tensor_parallel_size": p["tensor_parallel_size"],
        "max_model_len": max_len,
        "trust_remote_code": shared.trust_remote_code,
        "revision": models.hub_kwargs(shared)["revision"],  # the pinned commit (remote code runs in vLLM too)
        "connector": "cpu" if cpu else "vllm",
        "units_per_call": 8,
        "max_buffer_bytes": int(p["max_buffer_gb"] * 2**30) // world,
        "exit_with_parent": p["start_producers"],
        "language_model_only": multimodal,  # no vision tower: text prefill needs none (and vLLM loads none)
        # vLLM's CPU rotary custom op mis-rotates MLA queries in eager mode (hidden states ~1% off): native rope
        "compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}
        if cpu and getattr(text, "kv_lora_rank", None)
        else None,
        # on an AMX CPU vLLM picks its AMX MLA backend, which refuses fp32 weights ("expect weight to be
        # bfloat16..."): ask for the reference CPU MLA backend, which runs the fp32 target on every x86 CPU
        "attention_config": {"backend": "CPU_MLA"} if cpu and getattr(text, "kv_lora_rank", None) else None,
    }


class VllmHidden:
    """Hidden source reading units made by vLLM producers from a bounded buffer directory (and, for sequences
    kept earlier, from `kept`)."""

    def __init__(self, buf: Path, units, tokens, start: int, ids: list[int], aux_layers: list[int],
                 head: hidden.TargetHead, hidden_size: int, device, *, producer_cfg: dict,
                 num_producers: int = 1, keep: bool = False, start_producers: bool = True,
                 kept: hidden_store.HiddenStore | None = None, write_command: bool = True):  # fmt: skip
        self.buf, self.units, self.next = Path(buf), units, start
        self.ids, self.h, self.device, self.keep, self.kept = ids, hidden_size, device, keep, kept
        self.aux_cols = [ids.index(i + 1) for i in aux_layers]  # unit columns of the aux layers, in order
        self.last_col = ids.index(producer_cfg["num_layers"])
        self.head = head.to(device)
        self.lazy_logits = False  # True: return a hidden.HeadTarget, not (B, T, V) logits
        self.stats = {"tokens": 0, "made_tokens": 0, "kept_tokens": 0, "bytes": 0, "wait_s": 0.0,
                      "compute_s": 0.0, "observed_peak_bytes": 0}  # fmt: skip
        self._last_return = None
        self.session = f"{os.getpid()}-{time.time_ns()}"  # one trainer run (served.jsonl groups by it)
        self.made = self._to_make(start)
        self.buf.mkdir(parents=True, exist_ok=True)
        lock = hb.take_trainer_lock(self.buf)  # before touching anything in it
        (self.buf / "STOP").unlink(missing_ok=True)
        # an earlier run's request and its producers' states: a watcher on the serving nodes must not act on
        # that COMMAND, nor this rank read a stale "done" or "failed" as its own producers' word
        (self.buf / producer_procs.COMMAND_FILE).unlink(missing_ok=True)
        for f in self.buf.glob("producer_*.json"):
            f.unlink()
        self._write_plan(tokens, producer_cfg)
        hb.write_json(self.buf / "cursor.json", {"next": start})
        if not keep:  # consumed before the checkpoint we resume from
            for u in range(start):
                (self.buf / hb.unit_name(u)).unlink(missing_ok=True)
        self.procs: list[subprocess.Popen] = []
        missing = any(
            self.made[u] and not (self.buf / hb.unit_name(u)).exists() for u in range(start, len(units))
        )
        self.missing = missing
        if start_producers and missing:
            cpu = self.device.type == "cpu"
            self.procs = [producer_procs.launch(self.buf, i, num_producers, self.session, cpu, self.plan_session)
                          for i in range(num_producers)]  # fmt: skip
        elif missing and write_command:  # else the rank group's first rank writes it (`group_command`)
            producer_procs.external_producers(self.buf, num_producers, session=self.plan_session)
        self._finalizer = weakref.finalize(
            self, producer_procs.release, self.procs, self.buf / f"STOP.{self.session}", lock
        )

    def producing(self) -> bool:
        """Whether a producer this source started still runs on this machine (external ones run elsewhere)."""
        return any(p.poll() is None for p in self.procs)

    def _to_make(self, start: int) -> list[list[str]]:
        """Per unit, the sequences the producers make: those neither kept in the store nor (when keeping)
        made by an earlier unit from `start` on, which is in the store by the time this unit is read."""
        if self.kept is None:
            return [list(u) for u in self.units]
        seen: set[str] = set()
        made = []
        for u, unit in enumerate(self.units):
            made.append([k for k in unit if k not in self.kept and k not in seen] if u >= start else [])
            if self.keep and u >= start:
                seen.update(unit)
        return made

    def _write_plan(self, tokens: dict[str, list[int]], producer_cfg: dict) -> None:
        keys = list(dict.fromkeys(k for unit in self.made for k in unit))
        index = {k: i for i, k in enumerate(keys)}
        self.lengths = {k: len(tokens[k]) for unit in self.units for k in unit}
        plan = {"units": [[index[k] for k in u] for u in self.made]}
        old = hb.read_json(self.buf / "plan.json") or {}
        if old.get("units") != plan["units"]:  # the store changed since: units made ahead are void
            for f in self.buf.glob("unit_*"):
                f.unlink()
            with open(self.buf / "sequences.jsonl.tmp", "w") as f:
                f.writelines(json.dumps(tokens[k]) + "\n" for k in keys)
            os.replace(self.buf / "sequences.jsonl.tmp", self.buf / "sequences.jsonl")
        # a session names the plan: a producer started for another plan refuses this one. The same units keep
        # their session, so producers already serving them (a trainer restarted on the same plan) go on
        same = old.get("units") == plan["units"] and old.get("session")
        self.plan_session = old["session"] if same else self.session
        hb.write_json(self.buf / "plan.json", {**plan, "session": self.plan_session})
        hb.write_json(self.buf / "producer_config.json", producer_cfg)  # the bound may change on resume
        self.max_bytes = producer_cfg["max_buffer_bytes"]

    def log_tail(self, i: int, n: int = 30) -> str:
        return producer_procs.log_tail(self.buf, i, n)

    def observed_bytes(self) -> int:
        """Bytes the buffer holds right now, by listing it (independent of the producers' accounting). A file
        that a producer renames (``.part`` -> final) or the consumer deletes between the listing and its stat is
        skipped: the listing is a snapshot of a directory that other processes change."""
        cursor = self.next
        total = 0
        for f in self.buf.iterdir():
            if f.name.startswith("unit_") and (
                not f.name.endswith(".safetensors") or int(f.name[5:13]) >= cursor
            ):
                total += _size(f)
            elif f.name.startswith("scratch_") and f.is_dir():
                try:
                    total += sum(_size(g) for g in f.iterdir())
                except FileNotFoundError:  # the scratch dir itself went away
                    pass
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
        made, path, hs = self.made[u], self.buf / hb.unit_name(u), None
        if made:
            self.stats["wait_s"] += producer_procs.wait_for(path, self.procs, self.buf)
            self.stats["observed_peak_bytes"] = max(self.stats["observed_peak_bytes"], self.observed_bytes())
            data = load_file(str(path))
            hs = hb.decode(data["hidden_states"], data.get("scale"))  # [N, n_ids, H]
        pos = {"j": 0, "off": 0}

        def rows(key: str, n: int) -> torch.Tensor:
            if pos["j"] < len(made) and made[pos["j"]] == key:  # made for this unit, in plan order
                x = hs[pos["off"] : pos["off"] + n]
                pos["j"], pos["off"] = pos["j"] + 1, pos["off"] + n
                return x
            if self.kept is None or key not in self.kept:
                raise RuntimeError(f"{self.buf}: unit {u}: sequence {key} is neither made nor kept")
            self.stats["kept_tokens"] += n
            self.stats["bytes"] += n * self.kept.index[key]["bytes_per_token"]
            return self.kept.read(key, n)

        aux, last = hidden_store.assemble(batch, rows, self.aux_cols, self.last_col, self.h)
        if hs is not None and pos["off"] != hs.shape[0]:
            raise ValueError(f"{path}: {hs.shape[0]} positions for {pos['off']} planned tokens")
        self.stats["tokens"] += sum(n for row in batch.segments for _, _, n in row)
        self.stats["made_tokens"] += pos["off"]
        store.append_jsonl(self.buf / "served.jsonl", [{"unit": u, "session": self.session}], fsync=False)
        if made:
            self.stats["bytes"] += path.stat().st_size
        self.next = u + 1
        hb.write_json(
            self.buf / "cursor.json", {"next": self.next}
        )  # before the unlink (producers rely on it)
        if made and self.keep and self.kept is not None:
            self.kept.add(path, made, [self.lengths[k] for k in made])
        elif made and not self.keep:
            path.unlink()
        if self.next == len(self.units):
            self.close()
        logits = hidden.target_of(self.head, last.to(self.device), self.lazy_logits)
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
            "kept_tokens_read": s["kept_tokens"],
            "made_tokens_read": s["made_tokens"],
            "producers_started": len(self.procs),
            "kept_dir": str(self.kept.dir) if self.kept is not None else None,
            "units_consumed": self.next,
            "units_planned": len(self.units),
        }

    def close(self) -> None:
        self._finalizer()


def make_source(cfg, device, hf_config, start_step: int):
    """Stage 05's `vllm` source: (VllmHidden, embedding (V, H), lm_head, None) from the stage config, for a run
    that resumes at optimizer step `start_step` (0: from the start; the trainer's newest complete checkpoint)."""
    p = cfg.stage
    text = models.text_config(hf_config)
    aux = list(p.aux_layers or models.default_aux_layers(text.num_hidden_layers))
    ids = layer_ids(aux, text.num_hidden_layers)
    out = cfg.out("drafter")
    units, tokens, start = plan(cfg, start_step)
    max_len = max(len(v) for v in tokens.values()) + 8
    producer_cfg = producer_config(p.model_dump(), cfg.shared, text, ids, max_len, device.type == "cpu",
                                   text is not hf_config, distributed.world()[1])  # fmt: skip
    target = producer_cfg["target"]
    key = store.stable_hash({k: v for k, v in producer_cfg.items() if k in ("target", "layer_ids", "storage_dtype",
                             "model_dtype")} | {"units": units})  # fmt: skip
    root = Path(p.hidden_dump_dir) if p.hidden_dump_dir else out / "hidden_buffer"
    root = root.absolute()  # as the producers' COMMAND names it
    buf = root / key / f"rank{distributed.world()[0]}"
    head = hidden.load_target_head(target, hf_config, producer_cfg["revision"])
    embed = hidden.load_target_embedding(target, producer_cfg["revision"])
    kept = hidden_store.HiddenStore(
        root, hidden_store.identity(target, hf_config, embed, head.lm_head, producer_cfg)
    )
    grouped = p.ranks_per_producer > 1 and distributed.launched()
    src = VllmHidden(buf, units, tokens, start, ids, aux, head, text.hidden_size, device,
                     producer_cfg=producer_cfg, num_producers=p.num_producers, keep=p.keep_hidden_states,
                     start_producers=p.start_producers, kept=kept, write_command=not grouped)  # fmt: skip
    if grouped:
        group_command(src, p.ranks_per_producer, p.num_producers)
    return src, embed, head.lm_head, None


def group_command(src: VllmHidden, ranks_per_producer: int, num_producers: int) -> list[str]:
    """``ranks_per_producer > 1`` (external producers): every rank shares its buffer and plan session; the
    first rank of each group (`distributed.producer_groups`) writes the command of the producers that serve the
    whole group (one engine, every rank's buffer) to its own buffer's COMMAND; the others write none."""
    import torch.distributed as dist

    rank, size, _ = distributed.world()
    every: list = [None] * size
    dist.all_gather_object(every, (str(src.buf), src.plan_session, src.missing))
    group = distributed.producer_groups(size, ranks_per_producer)[
        distributed.producer_group(rank, ranks_per_producer)
    ]
    if rank != group[0] or not any(every[r][2] for r in group):
        return []
    return producer_procs.external_producers(
        src.buf, num_producers, group=[(every[r][0], every[r][1]) for r in group]
    )


def _size(f: Path) -> int:
    """A file's size, 0 when it is gone (renamed or deleted since it was listed) or is not a file."""
    try:
        st = f.stat()
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0
