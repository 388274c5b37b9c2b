"""Target hidden states for the peers' workers of bench_quality.py's real-model mode, read from stage 05's kept
store (`eagle_lib.hidden_states.hidden_store`) without importing eagle_lib: the workers run in the peers' own
venvs. The main process writes, in each worker's spec, ``features``: ``{"files": dir of the store's unit files,
"index": {sequence key: [file, offset, n]}, "aux_cols": [...], "last_col": c}``; a unit file holds
``hidden_states`` [N, n_ids, H] (float32 or bfloat16: the reader refuses float8 stores, whose per-token scale
only eagle_lib decodes), sequence `key` being rows offset..offset+n.

Columns: the store keeps vLLM's ids (aux decoder layer i -> HF hidden_states index i + 1, and L, the last
decoder layer's output before the final norm); aux_cols / last_col are their positions, as 05 reads them.
"""

from __future__ import annotations

from pathlib import Path


class StoredFeatures:
    """``(aux (n, len(aux_cols) * H), last (n, H))`` float32 of a kept sequence: ``feats(key, n)``."""

    def __init__(self, spec: dict):
        self.dir = Path(spec["files"])
        self.index = spec["index"]
        self.aux_cols, self.last_col = list(spec["aux_cols"]), int(spec["last_col"])
        self._open: dict[str, object] = {}

    def _file(self, name: str):
        from safetensors import safe_open

        if name not in self._open:
            f = safe_open(str(self.dir / name), "pt")
            if "scale" in f.keys():
                raise ValueError(f"{self.dir / name}: a float8 store (per-token scales): not read here")
            self._open[name] = f
        return self._open[name]

    def __call__(self, key: str, n: int):
        name, offset, stored = self.index[key]
        if n > stored:
            raise ValueError(f"{self.dir / name}: sequence {key} holds {stored} positions, {n} asked")
        x = self._file(name).get_slice("hidden_states")[offset : offset + n].float()  # (n, n_ids, H)
        return x[:, self.aux_cols].reshape(n, -1), x[:, self.last_col]
