"""The bounded hidden-state buffer between vLLM producers and the stage-05 trainer (stdlib only: both venvs).

One buffer directory per plan (``<root>/<plan key>/rank<r>/``)::

    producer_config.json   target, layer ids, dtypes, TP, connector, the byte bound
    sequences.jsonl        line i: the token ids of sequence i (train then held-out)
    plan.json              {"units": [[sequence index, ...], ...]}: unit u = the u-th source call of the trainer
    cursor.json            {"next": u}: the trainer has consumed every unit < u (written by the trainer)
    unit_NNNNNNNN.safetensors  hidden_states [N, n_ids, H] (storage dtype), token_ids [N], lengths [n_seq]
    producer_<i>.json      producer i's own accounting: peak/pending bytes, tokens, busy and blocked seconds
    STOP, STOP.<session>   stop every producer (by hand) / those one trainer session started

Producer ``i`` of ``n`` makes units ``u % n == i`` in order. A unit's file appears by rename, so a file that
exists is complete; the trainer deletes it after use unless ``keep_hidden_states``. Each producer may hold at
most ``max_buffer_bytes / n`` of unconsumed units plus its in-flight reservation (the engine's per-request
scratch file and the shard being written); it blocks before starting work that would exceed that.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADER_SLACK = 4096  # safetensors JSON header + alignment, an upper bound for our three tensors


def unit_name(u: int) -> str:
    return f"unit_{u:08d}.safetensors"


def write_json(path: Path, obj) -> None:
    """Atomic JSON write (rename), so a reader never sees a partial file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


def read_cursor(buf: Path) -> int:
    return int((read_json(buf / "cursor.json") or {"next": 0})["next"])


def shard_bytes(n_tokens: int, n_seqs: int, n_ids: int, hidden: int, dtype: str) -> int:
    """Upper bound of a unit file's size: hidden states + int64 token ids and lengths + header."""
    return n_tokens * n_ids * hidden * ITEMSIZE[dtype] + 8 * (n_tokens + n_seqs) + HEADER_SLACK


def scratch_bytes(lengths: list[int], n_ids: int, hidden: int, dtype: str) -> int:
    """Upper bound of the engine's per-request files for these sequences (model dtype)."""
    return sum(shard_bytes(n, 0, n_ids, hidden, dtype) for n in lengths)


class Ledger:
    """A producer's accounting of the bytes it holds in the buffer (the bound is asserted from this)."""

    def __init__(self, share: int):
        self.share = share
        self.units: dict[int, int] = {}  # unit -> bytes of its complete, unconsumed file
        self.peak = 0

    def pending(self) -> int:
        return sum(self.units.values())

    def release_consumed(self, cursor: int) -> None:
        self.units = {u: b for u, b in self.units.items() if u >= cursor}

    def fits(self, reserve: int) -> bool:
        return self.pending() + reserve <= self.share

    def reserve(self, reserve: int) -> None:
        """Start work that may transiently occupy ``reserve`` more bytes."""
        if not self.fits(reserve):
            raise RuntimeError(f"reservation of {reserve} B exceeds the buffer share {self.share} B")
        self.peak = max(self.peak, self.pending() + reserve)

    def add(self, u: int, size: int) -> None:
        self.units[u] = size
        self.peak = max(self.peak, self.pending())
