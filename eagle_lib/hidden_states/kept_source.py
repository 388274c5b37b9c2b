"""07's vLLM hidden source (`KeptSource`), within ``max_buffer_gb`` for the whole of 07 (one process).

Two modes, chosen when 07 opens the run (`use_root`) from the bytes the training sequences would take:
- keep (they fit the bound, or 05 kept them): every call served from the per-sequence store
  (`eagle_lib.hidden_states.hidden_store`), the missing sequences made first by one vLLM producer session
  (`eagle_lib.hidden_states.engine_hidden`) and kept for the next arms;
- stream (they do not: the Kimi run, ~57 KB a token): each arm's micro-batches are planned in training order
  (`expect`) and made again by the same producers, read once and deleted, as 05 streams them; the buffer holds
  at most ``max_buffer_gb`` of them (the producers' own accounting, in ``producer_<i>.json``).
One producer session serves the whole stage in both modes (its plan is appended to: ``follow``), so with
``start_producers: false`` the producers are started by hand once, with the command in the buffer's COMMAND.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import weakref
from pathlib import Path

import torch

from eagle_lib import models
from eagle_lib.data import batches
from eagle_lib.hidden_states import engine_hidden, hidden, producer_procs
from eagle_lib.hidden_states import hidden_buffer as hb
from eagle_lib.hidden_states.hidden_store import HiddenStore, assemble, identity

ARGMAX_CACHE_TOKENS = 64 << 20  # sequences' target argmax kept in memory (8 bytes a token: at most 512 MiB)


def _close(procs: list, buf: Path, session: str) -> None:
    producer_procs.stop(procs, buf / f"STOP.{session}")
    shutil.rmtree(buf, ignore_errors=True)


class KeptSource:
    """07's ``hidden_source: vllm``: every call served from the kept store; what is missing is produced first
    (one producer session per `prepare`d training set), then kept for the next arms."""

    def __init__(self, recipe: dict, shared, hf_config, device):
        text = models.text_config(hf_config)
        aux = list(recipe["aux_layers"] or models.default_aux_layers(text.num_hidden_layers))
        self.ids = engine_hidden.layer_ids(aux, text.num_hidden_layers)
        self.aux_cols = [self.ids.index(i + 1) for i in aux]
        self.last_col, self.h, self.device = self.ids.index(text.num_hidden_layers), text.hidden_size, device
        self.recipe, self.shared, self.text = recipe, shared, text
        self.target = models.resolve(shared.target)
        rev = models.hub_kwargs(shared)["revision"]
        self.head = hidden.load_target_head(self.target, hf_config, rev).to(device)
        self.lazy_logits = False  # True: return a hidden.HeadTarget, not (B, T, V) logits
        # lazy: each sequence's whole-vocab target argmax, made once and reused by every later arm (it is the
        # (T, V) product of a training step's target side; 07 trains many arms on the same sequences)
        self.argmax: dict[str, torch.Tensor] = {}
        self.argmax_tokens = 0
        self.embed = hidden.load_target_embedding(self.target, rev)
        self.pcfg = engine_hidden.producer_config(
            recipe, shared, text, self.ids, 0, device.type == "cpu", text is not hf_config
        )
        self.ident = identity(self.target, hf_config, self.embed, self.head.lm_head, self.pcfg)
        self.kept: HiddenStore | None = None
        self.bound = int(recipe["max_buffer_gb"] * 2**30)  # the whole stage's (07 runs in one process)
        self.pcfg["max_buffer_bytes"] = self.bound
        self.mode = "keep"
        self.stats = {"kept_tokens": 0, "produced_tokens": 0, "producer_sessions": 0, "streamed_tokens": 0}
        self.buf, self.session, self.procs, self.plan, self.n_seqs = None, "", [], [], 0
        self.index: dict[str, int] = {}  # sequence key -> line of this session's sequences.jsonl
        self.queue: list[tuple[int, list[str], list[str]]] = []  # stream: (unit, batch keys, keys it makes)
        self.added_bytes, self._closed_prods = 0, []  # keep mode: what 07 added to the store (<= bound)
        self._finalizer = None

    def use_root(self, run_dir: str | Path, prepare: bool = True) -> None:
        """The store of the run whose 05 kept them (``hidden_dump_dir`` or run_dir/drafter/hidden_buffer); with
        `prepare`, the run's training sequences that 05 did not keep (05 may stop before an epoch ends) are
        produced now, in one session, since 07's subsets are drawn from all of them, when they fit the bound;
        else 07 streams (mode ``stream``)."""
        if self.kept is not None:
            return
        root = Path(self.recipe["hidden_dump_dir"]) if self.recipe["hidden_dump_dir"] else None
        self.kept = HiddenStore(root or Path(run_dir) / "drafter" / "hidden_buffer", self.ident)
        if prepare:
            r = self.recipe
            train = batches.load_sequences(
                run_dir, self.shared.heldout_percent, r["max_seq_len"], r["max_train_samples"], 1
            )[0]
            self.prepare(train)  # keep mode when they fit the bound, else stream mode

    def missing_bytes(self, seqs) -> int:
        """Bytes the store would grow by to keep every sequence of `seqs` it does not hold."""
        kept = self._store()
        missing = {k: len(s.input_ids) for s in seqs if (k := batches.seq_key(s.input_ids)) not in kept}
        n_tok = sum(missing.values())
        return (
            0
            if not missing
            else hb.shard_bytes(n_tok, len(missing), len(self.ids), self.h, self.pcfg["storage_dtype"])
        )

    def _store(self) -> HiddenStore:
        if self.kept is None:
            raise RuntimeError("KeptSource: no store yet (call use_root(run_dir), as Trainer.sequences does)")
        return self.kept

    def prepare(self, seqs) -> None:
        """Keep mode: produce the sequences of `seqs` that are not kept (none: no producer starts). Stream mode:
        nothing (`expect` plans each arm's batches)."""
        kept = self._store()
        if self.mode == "keep" and self.added_bytes + self.missing_bytes(seqs) > self.bound:
            self.mode = (
                "stream"  # keeping these too would pass the bound: from now on, stream what is not kept
            )
        if self.mode == "stream":
            return
        missing = {k: list(s.input_ids) for s in seqs if (k := batches.seq_key(s.input_ids)) not in kept}
        if missing:
            self.produce(missing)

    def _append(self, units: list[list[str]], tokens: dict[str, list[int]]) -> int:
        """Append `units` (lists of sequence keys, ids in `tokens`) to the session's plan, starting the producers
        (or writing the COMMAND for them) once; returns the index of the first appended unit."""
        r = self.recipe
        if self.buf is None:
            self.session = f"{os.getpid()}-{time.time_ns()}"
            self.buf = self._store().dir / "produce" / self.session
            self.buf.mkdir(parents=True)
            (self.buf / "sequences.jsonl").touch()
            # 07's sequences are cut to max_seq_len (05's limit); longer on-demand ones raise the engine's limit
            max_len = max(r["max_seq_len"], *map(len, tokens.values())) + 8
            hb.write_json(
                self.buf / "producer_config.json", {**self.pcfg, "max_model_len": max_len, "follow": True}
            )
            hb.write_json(self.buf / "cursor.json", {"next": 0})
            self._finalizer = weakref.finalize(self, _close, self.procs, self.buf, self.session)
        new = [k for k in dict.fromkeys(k for u in units for k in u) if k not in self.index]
        with open(self.buf / "sequences.jsonl", "a") as f:  # before the plan that names them
            f.writelines(json.dumps(tokens[k]) + "\n" for k in new)
        self.index |= {k: self.n_seqs + i for i, k in enumerate(new)}
        self.n_seqs += len(new)
        first = len(self.plan)
        self.plan += [[self.index[k] for k in u] for u in units]
        hb.write_json(self.buf / "plan.json", {"units": self.plan})
        if r["start_producers"] and all(p.poll() is not None for p in self.procs):
            n, cpu = r["num_producers"], self.device.type == "cpu"
            self.procs[:] = [producer_procs.launch(self.buf, i, n, self.session, cpu) for i in range(n)]
            self.stats["producer_sessions"] += 1
        elif not r["start_producers"] and not (self.buf / producer_procs.COMMAND_FILE).exists():
            producer_procs.external_producers(self.buf, r["num_producers"])
            self.stats["producer_sessions"] += 1
        return first

    def producing(self) -> bool:
        """Whether a producer this source started may still be making units (keep mode: `prepare` made them
        all before training; the producers that wait for a next plan sit idle)."""
        return self.mode == "stream" and any(p.poll() is None for p in self.procs)

    def _consumed(self, u: int, path: Path) -> None:
        """Unit u read: the cursor first, then the file goes (a producer that finds the unit gone then also finds
        it below the cursor, and does not make it again)."""
        hb.write_json(self.buf / "cursor.json", {"next": u + 1})
        path.unlink(missing_ok=True)

    def produce(self, tokens: dict[str, list[int]]) -> None:
        """Keep mode: make `tokens` (key -> ids) into units of about a micro-batch, each moved into the store as
        it appears (the cursor advances as they are moved, so the buffer bound holds)."""
        kept, r = self._store(), self.recipe
        units, cur, budget = [], [], r["rows_per_batch"] * r["pack_len"]
        for k in tokens:  # consecutive keys, about one micro-batch of tokens per unit
            if cur and sum(len(tokens[c]) for c in cur) + len(tokens[k]) > budget:
                units.append(cur)
                cur = []
            cur.append(k)
        units.append(cur)
        first = self._append(units, tokens)
        for j, unit in enumerate(units):
            path = self.buf / hb.unit_name(first + j)
            producer_procs.wait_for(path, self.procs, self.buf)
            hb.write_json(self.buf / "cursor.json", {"next": first + j + 1})  # before the move, as _consumed
            self.added_bytes += path.stat().st_size
            kept.add(path, unit, [len(tokens[k]) for k in unit])
            self.stats["produced_tokens"] += sum(len(tokens[k]) for k in unit)

    def expect(self, micro_batches) -> None:
        """Stream mode: the micro-batches an arm will ask for, in order (each call then reads its unit, made
        ahead by the producers within the bound); keep mode: nothing."""
        if self.mode != "stream":
            return
        kept = self._store()
        todo, tokens = [], {}
        for b in micro_batches:
            keys = _keys(b)
            make = [k for k in keys if k not in kept]
            tokens |= _ids(b)
            if make:
                todo.append((keys, make))
        if todo:
            first = self._append([m for _, m in todo], tokens)
            self.queue += [(first + j, keys, make) for j, (keys, make) in enumerate(todo)]

    def _streamed(self, batch) -> dict[str, torch.Tensor]:
        """Stream mode: key -> [n, n_ids, H] of the batch's sequences that the store does not hold, from the
        batch's planned unit (units planned before it were skipped, e.g. by a resumed arm) or from a unit made
        now (a call nobody planned, e.g. teacher-forced held-out tau)."""
        from safetensors.torch import load_file

        kept, keys = self._store(), _keys(batch)
        make = [k for k in keys if k not in kept]
        if not make:
            return {}
        at = next((i for i, q in enumerate(self.queue) if q[1] == keys), None)
        if at is None:
            self.queue.insert(0, (self._append([make], _ids(batch)), keys, make))
            at = 0
        for u, _, _ in self.queue[:at]:  # planned, never asked for
            self._consumed(u, self.buf / hb.unit_name(u))
        u, _, make = self.queue[at]
        del self.queue[: at + 1]
        path = self.buf / hb.unit_name(u)
        producer_procs.wait_for(path, self.procs, self.buf)
        data = load_file(str(path))
        hs = hb.decode(data["hidden_states"], data.get("scale"))
        self._consumed(u, path)
        out, off = {}, 0
        lengths = {k: n for row in batch.segments for k, _, n in row}
        for k in make:
            out[k], off = hs[off : off + lengths[k]], off + lengths[k]
        if off != hs.shape[0]:
            raise ValueError(f"{path}: {hs.shape[0]} positions for {off} planned tokens")
        self.stats["streamed_tokens"] += off
        return out

    def producer_stats(self) -> list[dict]:
        """The producers' own accounting (``producer_<i>.json``: peak buffer bytes, tokens, ...)."""
        if self.buf is None:
            return []
        return [s for i in range(self.recipe["num_producers"])
                if (s := hb.read_json(self.buf / f"producer_{i}.json")) is not None]  # fmt: skip

    def summary(self) -> dict:
        """For 07's meta: mode, bound, the producers' peak buffer and what was kept, produced and streamed."""
        prods = self.producer_stats() if self.buf is not None and self.buf.exists() else self._closed_prods
        return {
            "mode": self.mode,
            "max_buffer_bytes": self.bound,
            "peak_buffer_bytes": sum(p.get("peak_buffer_bytes", 0) for p in prods),
            "kept_dir": str(self.kept.dir) if self.kept is not None else None,
            **self.stats,
        }

    def close(self) -> None:
        """Stop the producers and remove their buffer (also at garbage collection or exit)."""
        if self._finalizer is not None:
            self._closed_prods = self.producer_stats()  # their accounting, before the buffer goes
            self._finalizer()

    @torch.no_grad()
    def __call__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self._store()
        streamed = self._streamed(batch) if self.mode == "stream" else {}
        need = {k: v for k, v in _ids(batch).items() if k not in kept and k not in streamed}
        if need:  # keep mode: a call outside prepared sets (e.g. teacher-forced held-out tau)
            self.produce(need)

        def rows(key: str, n: int) -> torch.Tensor:
            if key in streamed:
                return streamed[key]
            self.stats["kept_tokens"] += n
            return kept.read(key, n)

        aux, last = assemble(batch, rows, self.aux_cols, self.last_col, self.h)
        last = last.to(self.device)
        arg = self._argmax(batch, last) if self.lazy_logits else None
        return aux.to(self.device), hidden.target_of(self.head, last, self.lazy_logits, arg)

    def _argmax(self, batch, last: torch.Tensor) -> torch.Tensor:
        """(B, T) the target's whole-vocab argmax: per sequence from the cache, else made and cached (up to
        ARGMAX_CACHE_TOKENS tokens in all); padding 0 (never a label row)."""
        out = torch.zeros(last.shape[:2], dtype=torch.long, device=last.device)
        chunk = self.recipe.get("loss_chunk") or 1024
        for r, segs in enumerate(batch.segments):
            for key, s, n in segs:
                got = self.argmax.get(key)
                if got is None or got.numel() != n:
                    got = hidden.head_argmax(self.head, last[r, s : s + n], chunk)
                    if self.argmax_tokens + n <= ARGMAX_CACHE_TOKENS:
                        self.argmax[key], self.argmax_tokens = got, self.argmax_tokens + n
                out[r, s : s + n] = got
        return out


def _keys(batch) -> list[str]:
    return [k for row in batch.segments for k, _, _ in row]


def _ids(batch) -> dict[str, list[int]]:
    return {
        k: batch.input_ids[r, s : s + n].tolist() for r, segs in enumerate(batch.segments) for k, s, n in segs
    }
