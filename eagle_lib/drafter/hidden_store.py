"""Kept hidden states, per sequence: reused by any later training on the same target, layers and dtypes.

With ``keep_hidden_states`` the vllm source moves each consumed unit file into a store instead of deleting it,
and indexes every sequence in it by its token ids (`eagle_lib.drafter.batches.seq_key`)::

    <hidden_dump_dir or drafter/hidden_buffer>/kept/<identity key>/
        identity.json   target (resolved path or hub id, config hash, embedding/lm_head fingerprint),
                        layer_ids, storage dtype, model dtype: what the key is a hash of
        files/*.safetensors  moved unit files (hidden_states [N, n_ids, H], token_ids [N], lengths, scale)
        index.jsonl     {key, file, offset, n, bytes_per_token}: sequence `key` is rows offset..offset+n of file

Any later training whose sequences are indexed here reads them and starts no producer (a rerun with more
steps, another seed, 07's subsets of 05's data); a partly kept set has only the missing sequences produced.
`KeptSource` is that reader for 07 (`eagle_lib.drafter.retrain`): it has the missing sequences of each
training set made by one producer that stays up for all of them (`prepare`), and serves every call from the
store.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import weakref
from pathlib import Path

import torch

from eagle_lib import models, store
from eagle_lib.drafter import hidden
from eagle_lib.drafter import hidden_buffer as hb


def identity(target: str, hf_config, embed: torch.Tensor, lm_head: torch.Tensor, producer_cfg: dict) -> dict:
    """What kept hidden states depend on: the target (path or hub id, config, weight fingerprint), the
    captured layer ids and the model and storage dtypes (not TP, producers or the buffer bound)."""
    import hashlib

    cfg = models.text_config(hf_config).to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"):
        cfg.pop(volatile, None)
    h = hashlib.sha256()
    for w in (embed, lm_head):  # (V, H): the first rows tell two checkpoints of one config apart
        h.update(w[: min(64, w.shape[0])].detach().float().cpu().numpy().tobytes())
    return {
        "target": target,
        "config_sha256": store.stable_hash(cfg),
        "weights_sha256": h.hexdigest()[:16],
        **{k: producer_cfg[k] for k in ("layer_ids", "model_dtype", "storage_dtype")},
    }


class HiddenStore:
    """The kept sequences of one identity: ``key in store``, ``read(key, n)``, ``add(unit file, keys)``."""

    def __init__(self, root: str | Path, ident: dict):
        self.identity = ident
        self.dir = Path(root) / "kept" / store.stable_hash(ident)
        (self.dir / "files").mkdir(parents=True, exist_ok=True)
        if not (self.dir / "identity.json").exists():
            hb.write_json(self.dir / "identity.json", ident)
        self.index: dict[str, dict] = {}
        path = self.dir / "index.jsonl"
        for r in store.iter_jsonl(path) if path.exists() else []:
            self.index.setdefault(r["key"], r)

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def read(self, key: str, n: int) -> torch.Tensor:
        """The first n positions of kept sequence `key`: float32 [n, n_ids, H]."""
        from safetensors import safe_open

        r = self.index[key]
        if n > r["n"]:
            raise ValueError(
                f"{self.dir}/files/{r['file']}: sequence {key} holds {r['n']} positions, {n} asked"
            )
        a, b = r["offset"], r["offset"] + n
        with safe_open(str(self.dir / "files" / r["file"]), "pt") as f:
            hs = f.get_slice("hidden_states")[a:b]
            scale = f.get_slice("scale")[a:b] if "scale" in f.keys() else None
        return hb.decode(hs, scale)

    def add(self, unit: Path, keys: list[str], lengths: list[int]) -> None:
        """Move a consumed unit file (sequences `keys` of `lengths`, in order) into the store and index it."""
        name = f"{store.stable_hash([str(unit), keys, time.time_ns()])}.safetensors"
        per_token = unit.stat().st_size / max(1, sum(lengths))
        os.replace(unit, self.dir / "files" / name)
        rows, off = [], 0
        for k, n in zip(keys, lengths, strict=True):
            if k not in self.index:
                r = {"key": k, "file": name, "offset": off, "n": n, "bytes_per_token": per_token}
                self.index[k] = r
                rows.append(r)
            off += n
        store.append_jsonl(self.dir / "index.jsonl", rows)  # after the move: an entry names a complete file


def _close(procs: list, buf: Path, session: str) -> None:
    from eagle_lib.drafter import engine_hidden

    engine_hidden.stop(procs, buf / f"STOP.{session}")
    shutil.rmtree(buf, ignore_errors=True)


def assemble(batch, rows_of, aux_cols: list[int], last_col: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """aux (B, T, len(aux_cols) * H) and last (B, T, H) of a packed batch; ``rows_of(key, n)`` gives each
    segment's [n, n_ids, H] (padding positions stay 0)."""
    b, t = batch.input_ids.shape
    aux = torch.zeros(b, t, len(aux_cols) * h)
    last = torch.zeros(b, t, h)
    for row, segs in enumerate(batch.segments):
        for key, start, n in segs:
            x = rows_of(key, n)
            aux[row, start : start + n] = x[:, aux_cols].reshape(n, -1)
            last[row, start : start + n] = x[:, last_col]
    return aux, last


class KeptSource:
    """07's ``hidden_source: vllm``: every call served from the kept store; what is missing is produced first
    (one producer session per `prepare`d training set), then kept for the next arms."""

    def __init__(self, recipe: dict, shared, hf_config, device):
        from eagle_lib.drafter import engine_hidden
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
        self.pcfg = engine_hidden.producer_config(recipe, shared, text, self.ids, 0, device.type == "cpu")
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
        from eagle_lib.drafter import engine_hidden

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
