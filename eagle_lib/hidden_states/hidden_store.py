"""Kept hidden states, per sequence: reused by any later training on the same target, layers and dtypes.

With ``keep_hidden_states`` the vllm source moves each consumed unit file into a store instead of deleting it,
and indexes every sequence in it by its token ids (`eagle_lib.data.batches.seq_key`)::

    <hidden_dump_dir or drafter/hidden_buffer>/kept/<identity key>/
        identity.json   target (resolved path or hub id, config hash, embedding/lm_head fingerprint),
                        layer_ids, storage dtype, model dtype: what the key is a hash of
        files/*.safetensors  moved unit files (hidden_states [N, n_ids, H], token_ids [N], lengths, scale)
        index.jsonl     {key, file, offset, n, bytes_per_token}: sequence `key` is rows offset..offset+n of file

Any later training whose sequences are indexed here reads them and starts no producer (a rerun with more
steps, another seed, 07's subsets of 05's data); a partly kept set has only the missing sequences produced.
`eagle_lib.hidden_states.kept_source.KeptSource` is that reader for 07 (`eagle_lib.drafter.retrain`): it has the missing sequences of each
training set made by one producer that stays up for all of them (`prepare`), and serves every call from the
store.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from eagle_lib import models, store
from eagle_lib.hidden_states import hidden_buffer as hb


def identity(target: str, hf_config, embed: torch.Tensor, lm_head: torch.Tensor, producer_cfg: dict) -> dict:
    """What kept hidden states depend on: the target (path or hub id, config, weight fingerprint), the
    captured layer ids and the model and storage dtypes (not TP, producers or the buffer bound)."""
    return {
        "target": target,
        "config_sha256": models.config_fingerprint(models.text_config(hf_config)),
        "weights_sha256": models.weights_fingerprint(embed, lm_head),
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
