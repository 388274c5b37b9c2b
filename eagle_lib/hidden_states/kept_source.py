"""07's reader of kept hidden states (`KeptSource`): every call served from the per-sequence store
(`eagle_lib.hidden_states.hidden_store`), the missing sequences made first by one vLLM producer session
(`eagle_lib.hidden_states.engine_hidden`)."""

from __future__ import annotations

import json
import os
import shutil
import time
import weakref
from pathlib import Path

import torch

from eagle_lib import models
from eagle_lib.hidden_states import engine_hidden, hidden
from eagle_lib.hidden_states import hidden_buffer as hb
from eagle_lib.hidden_states.hidden_store import HiddenStore, assemble, identity


def _close(procs: list, buf: Path, session: str) -> None:
    engine_hidden.stop(procs, buf / f"STOP.{session}")
    shutil.rmtree(buf, ignore_errors=True)


class KeptSource:
    """07's ``hidden_source: vllm``: every call served from the kept store; what is missing is produced first
    (one producer session per `prepare`d training set), then kept for the next arms."""

    def __init__(self, recipe: dict, shared, hf_config, device):
        from eagle_lib.drafter.model import Eagle3Config

        text = models.text_config(hf_config)
        aux = list(recipe["aux_layers"] or Eagle3Config.from_target_config(hf_config, 1).aux_layers)
        self.ids = engine_hidden.layer_ids(aux, text.num_hidden_layers)
        self.aux_cols = [self.ids.index(i + 1) for i in aux]
        self.last_col, self.h, self.device = self.ids.index(text.num_hidden_layers), text.hidden_size, device
        self.recipe, self.shared, self.text = recipe, shared, text
        self.target = models.resolve(shared.target)
        self.head = hidden.load_target_head(self.target, hf_config).to(device)
        self.embed = hidden.load_target_embedding(self.target)
        self.pcfg = engine_hidden.producer_config(
            recipe, shared, text, self.ids, 0, device.type == "cpu", text is not hf_config
        )
        self.ident = identity(self.target, hf_config, self.embed, self.head.lm_head, self.pcfg)
        self.kept: HiddenStore | None = None
        self.stats = {"kept_tokens": 0, "produced_tokens": 0, "producer_sessions": 0}
        self.buf, self.session, self.procs, self.plan, self.n_seqs = None, "", [], [], 0
        self._finalizer = None

    def use_root(self, run_dir: str | Path, prepare: bool = True) -> None:
        """The store of the run whose 05 kept them (``hidden_dump_dir`` or run_dir/drafter/hidden_buffer); with
        `prepare`, the run's training sequences that 05 did not keep (05 may stop before an epoch ends) are
        produced now, in one session, since 07's subsets are drawn from all of them."""
        if self.kept is not None:
            return
        root = Path(self.recipe["hidden_dump_dir"]) if self.recipe["hidden_dump_dir"] else None
        self.kept = HiddenStore(root or Path(run_dir) / "drafter" / "hidden_buffer", self.ident)
        if prepare:
            from eagle_lib.drafter import batches

            r = self.recipe
            train = batches.load_sequences(
                run_dir, self.shared.heldout_percent, r["max_seq_len"], r["max_train_samples"], 1
            )[0]
            self.prepare(train)

    def _store(self) -> HiddenStore:
        if self.kept is None:
            raise RuntimeError("KeptSource: no store yet (call use_root(run_dir), as Trainer.sequences does)")
        return self.kept

    def prepare(self, seqs) -> None:
        """Produce the sequences of `seqs` that are not kept (none: no producer starts)."""
        kept = self._store()
        missing = {k: list(s.input_ids) for s in seqs if (k := hidden.seq_key(s.input_ids)) not in kept}
        if missing:
            self.produce(missing)

    def produce(self, tokens: dict[str, list[int]]) -> None:
        """Make `tokens` (key -> ids) into units of about a micro-batch, each moved into the store as it
        appears (the cursor advances as they are moved, so the buffer bound holds). The producers start once
        per source and follow the plan (``follow``): later calls append units instead of starting vLLM again."""

        kept, r = self._store(), self.recipe
        units, cur, budget = [], [], r["rows_per_batch"] * r["pack_len"]
        for k in tokens:  # consecutive keys, about one micro-batch of tokens per unit
            if cur and sum(len(tokens[c]) for c in cur) + len(tokens[k]) > budget:
                units.append(cur)
                cur = []
            cur.append(k)
        units.append(cur)
        if self.buf is None:
            self.session = f"{os.getpid()}-{time.time_ns()}"
            self.buf = kept.dir / "produce" / self.session
            self.buf.mkdir(parents=True)
            (self.buf / "sequences.jsonl").touch()
            max_len = max(r["max_seq_len"], *map(len, tokens.values())) + 8  # 07's sequences are cut to it
            hb.write_json(
                self.buf / "producer_config.json", {**self.pcfg, "max_model_len": max_len, "follow": True}
            )
            hb.write_json(self.buf / "cursor.json", {"next": 0})
            self._finalizer = weakref.finalize(self, _close, self.procs, self.buf, self.session)
        index = {k: self.n_seqs + i for i, k in enumerate(tokens)}
        with open(self.buf / "sequences.jsonl", "a") as f:  # before the plan that names them
            f.writelines(json.dumps(tokens[k]) + "\n" for k in tokens)
        self.n_seqs += len(tokens)
        first = len(self.plan)
        self.plan += [[index[k] for k in u] for u in units]
        hb.write_json(self.buf / "plan.json", {"units": self.plan})
        if r["start_producers"] and all(p.poll() is not None for p in self.procs):
            n, cpu = r["num_producers"], self.device.type == "cpu"
            self.procs[:] = [engine_hidden.launch(self.buf, i, n, self.session, cpu) for i in range(n)]
            self.stats["producer_sessions"] += 1
        elif not r["start_producers"] and not (self.buf / engine_hidden.COMMAND_FILE).exists():
            engine_hidden.external_producers(self.buf, r["num_producers"])
            self.stats["producer_sessions"] += 1
        for j, unit in enumerate(units):
            path = self.buf / hb.unit_name(first + j)
            engine_hidden.wait_for(path, self.procs, self.buf)
            # the cursor first, then the move (as 05's consumer deletes): a producer that finds the unit gone
            # then also finds it below the cursor, and does not make it again
            hb.write_json(self.buf / "cursor.json", {"next": first + j + 1})
            kept.add(path, unit, [len(tokens[k]) for k in unit])
            self.stats["produced_tokens"] += sum(len(tokens[k]) for k in unit)

    def close(self) -> None:
        """Stop the producers and remove their buffer (also at garbage collection or exit)."""
        if self._finalizer is not None:
            self._finalizer()

    @torch.no_grad()
    def __call__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        kept = self._store()
        need = {k: batch.input_ids[r, s : s + n].tolist() for r, segs in enumerate(batch.segments)
                for k, s, n in segs if k not in kept}  # fmt: skip
        if need:  # a call outside prepared sets (e.g. teacher-forced held-out tau)
            self.produce(need)

        def rows(key: str, n: int) -> torch.Tensor:
            self.stats["kept_tokens"] += n
            return kept.read(key, n)

        aux, last = assemble(batch, rows, self.aux_cols, self.last_col, self.h)
        return aux.to(self.device), self.head(last.to(self.device))
