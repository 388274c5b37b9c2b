"""Training sequences for stage 05: read A records and B responses, split off held-out ids, pack into rows.

A sequence is token ids plus a label mask (``loss_mask[i] == 1``: token ``i`` is an assistant token to be
predicted, see docs/CONTRACTS.md). Packing puts several sequences in one row of at most ``pack_len`` tokens;
``position_ids`` restart at 0 for each and ``doc_ids`` tell them apart, so neither the target nor the
drafter attends across sequences, and no label crosses a sequence boundary.

The one home of the training data's order, shared by the trainer (`eagle_lib.drafter`), the hidden-state
sources that produce ahead of it (`eagle_lib.hidden_states`) and 07's subsets: `BatchStream`, the micro-batches
a step takes (`micro_batches`), the step count (`total_steps`) and a sequence's content key (`seq_key`).
"""

from __future__ import annotations

import bisect
import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from eagle_lib import store
from eagle_lib.data import multiturn


def seq_key(ids) -> str:
    """Content key of a token sequence (matches dumps and kept hidden states to training sequences)."""
    arr = np.asarray(ids, dtype=np.int64)
    return hashlib.sha1(arr.tobytes()).hexdigest()


@dataclass
class Sequence:
    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long, 0 in padding
    loss_mask: torch.Tensor  # (B, T) bool, label positions
    position_ids: torch.Tensor  # (B, T) long, restarting per packed sequence
    doc_ids: torch.Tensor  # (B, T) long, -1 in padding
    segments: list[list[tuple[str, int, int]]] = field(default_factory=list)  # per row: (seq_key, start, len)

    @property
    def n_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())


@dataclass
class Tally:
    read: int = 0
    kept: int = 0
    heldout: int = 0
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    torn_lines: list[str] = field(default_factory=list)  # file:line of every torn line skipped
    # label tokens (loss-mask positions >= 2) per "kind/dataset" and length bucket of the whole sequence:
    # {"train", "heldout", "cut" (past max_seq_len), "dropped" (their sequence dropped, any reason)}
    labels: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def count(self, dataset: str, length: int, **n: int) -> None:
        b = bucket_label(length)
        row = self.labels.setdefault(dataset, {}).setdefault(b, dict.fromkeys(LABEL_FATES, 0))
        for k, v in n.items():
            row[k] += v


LABEL_FATES = ("train", "heldout", "cut", "dropped")
LENGTH_EDGES = (1024, 4096, 16384, 32768)  # sequence-length buckets of 05's label-token table


def bucket_label(n: int) -> str:
    """'<1k', '1k-4k', '4k-16k', '16k-32k', '>=32k' for a sequence of n tokens."""
    names = ["<1k", "1k-4k", "4k-16k", "16k-32k", ">=32k"]
    return names[sum(n >= e for e in LENGTH_EDGES)]


def label_table(tally: Tally) -> list[dict]:
    """One row per dataset x length bucket (and an 'all' row per dataset): label tokens trained, held out, cut
    past max_seq_len and dropped, with the trained share."""
    rows = []
    for ds, per in sorted(tally.labels.items()):
        total = dict.fromkeys(LABEL_FATES, 0)
        for b in ["<1k", "1k-4k", "4k-16k", "16k-32k", ">=32k"]:
            if b in per:
                rows.append({"dataset": ds, "length": b, **per[b]})
                total = {k: total[k] + per[b][k] for k in LABEL_FATES}
        rows.append({"dataset": ds, "length": "all", **total})
    for r in rows:
        n = sum(r[k] for k in LABEL_FATES)
        r["trained_share"] = round(r["train"] / n, 4) if n else None
    return rows


def _check(path: Path, rec: dict, ids, mask) -> None:
    where = f"{path}: record {rec.get('id')!r}"
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise ValueError(f"{where}: token ids and loss mask must be lists")
    if len(ids) != len(mask):
        raise ValueError(f"{where}: {len(ids)} token ids but {len(mask)} loss-mask entries")
    if any(m not in (0, 1) for m in mask):
        raise ValueError(f"{where}: loss mask must hold only 0/1")


def iter_raw(run_dir: str | Path, torn: list[str] | None = None):
    """(path, record, input_ids, loss_mask) for every A record and B response under run_dir; torn lines
    skipped are appended to `torn` (``file:line``)."""
    run_dir = Path(run_dir)
    for path in sorted(run_dir.glob("data/A/*/records.jsonl")):
        for rec in store.iter_jsonl(path, torn=torn):
            if "input_ids" not in rec or "loss_mask" not in rec:
                raise ValueError(f"{path}: record {rec.get('id')!r} lacks input_ids/loss_mask")
            _check(path, rec, rec["input_ids"], rec["loss_mask"])
            yield path, rec, rec["input_ids"], rec["loss_mask"]
    for path in sorted(run_dir.glob("infer/*/responses.jsonl")):
        turns = []  # each_turn records (03): a conversation's turns merged into few sequences, data.multiturn
        for rec in store.iter_jsonl(path, torn=torn):
            if "prompt_ids" not in rec or "output_ids" not in rec:
                raise ValueError(f"{path}: response {rec.get('id')!r} lacks prompt_ids/output_ids")
            if "turn" in rec:
                turns.append(rec)
                continue
            ids = list(rec["prompt_ids"]) + list(rec["output_ids"])
            mask = [0] * len(rec["prompt_ids"]) + [1] * len(rec["output_ids"])
            _check(path, rec, ids, mask)
            yield path, rec, ids, mask
        for rec, ids, mask in multiturn.training_records(turns):
            _check(path, rec, ids, mask)
            yield path, rec, ids, mask


def input_files(run_dir: str | Path) -> list[Path]:
    run_dir = Path(run_dir)
    return sorted(run_dir.glob("data/A/*/records.jsonl")) + sorted(run_dir.glob("infer/*/responses.jsonl"))


def data_fingerprint(run_dir: str | Path, **settings) -> str:
    """Key of the training data: input files (name, size, mtime) and the settings that select from them."""
    files = [
        (str(p.relative_to(run_dir)), p.stat().st_size, p.stat().st_mtime_ns) for p in input_files(run_dir)
    ]
    return store.stable_hash({"files": files, **settings})


MAX_TORN_SHARE = (
    0.01  # torn lines above this share of the lines read fail the stage (a crash leaves one per file)
)


def load_sequences(
    run_dir, heldout_percent: float, max_seq_len: int, max_train: int = 0, max_eval: int = 0, keep=None
) -> tuple[list[Sequence], list[Sequence], Tally]:
    """(train, heldout, tally): held-out ids by `store.is_heldout`; long sequences truncated to max_seq_len.

    ``keep(ids) -> bool`` (optional) drops sequences a hidden source cannot serve (reason no_hidden_dump).
    """
    train, held, tally = [], [], Tally()
    for path, rec, ids, mask in iter_raw(run_dir, tally.torn_lines):
        tally.read += 1
        sid = str(rec.get("id"))
        ds, length, labels = (
            f"{'A' if path.parent.parent.name == 'A' else 'B'}/{path.parent.name}",
            len(ids),
            sum(mask[2:]),
        )
        if len(ids) > max_seq_len:
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            tally.truncated += 1
        kept_labels = sum(mask[2:])
        tally.count(ds, length, cut=labels - kept_labels)
        if kept_labels == 0:  # labels at positions < 2 have no feature two tokens before them
            tally.drop("no_trainable_labels")
            continue
        if keep is not None and not keep(ids):
            tally.drop("no_hidden_dump")
            tally.count(ds, length, dropped=kept_labels)
            continue
        heldout = store.is_heldout(store.split_key(rec), heldout_percent)
        bucket, cap = (held, max_eval) if heldout else (train, max_train)
        if cap and len(bucket) >= cap:
            tally.drop("over_max_eval_samples" if heldout else "over_max_train_samples")
            tally.count(ds, length, dropped=kept_labels)
            continue
        tally.count(ds, length, **{"heldout" if heldout else "train": kept_labels})
        bucket.append(Sequence(sid, list(ids), list(mask)))
        tally.heldout += heldout
        tally.kept += not heldout
    if tally.torn_lines:  # lines that held a record once: counted as read and dropped, and named
        tally.read += len(tally.torn_lines)
        tally.dropped["torn_line"] = len(tally.torn_lines)
        if len(tally.torn_lines) > MAX_TORN_SHARE * tally.read:
            raise ValueError(
                f"{len(tally.torn_lines)} of {tally.read} record lines are torn writes (more than "
                f"{MAX_TORN_SHARE:.0%}): {', '.join(tally.torn_lines[:10])}: rerun the stage that wrote them"
            )
    return train, held, tally


def pack(lengths: list[int], pack_len: int) -> list[list[int]]:
    """First-fit-decreasing bin packing: rows of sequence indices with total length <= pack_len."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, row index)
    for i in order:
        n = lengths[i]
        if n > pack_len:
            raise ValueError(
                f"sequence of {n} tokens exceeds pack_len {pack_len} (set max_seq_len <= pack_len)"
            )
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            cap, r = free.pop(j)
            rows[r].append(i)
            bisect.insort(free, (cap - n, r))
        else:
            rows.append([i])
            bisect.insort(free, (pack_len - n, len(rows) - 1))
    return rows


PAD_TO = 16  # row widths are padded to a multiple of this (aligned masks keep GPU kernels on the fast path)


def make_batch(seqs: list[Sequence], rows: list[list[int]], pad_to: int = 1) -> Batch:
    """Pad packed rows to the longest one, rounded up to a multiple of ``pad_to``."""
    width = max(sum(len(seqs[i].input_ids) for i in row) for row in rows)
    width = -(-width // pad_to) * pad_to
    b = len(rows)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.bool)
    pos = torch.zeros(b, width, dtype=torch.long)
    doc = torch.full((b, width), -1, dtype=torch.long)
    segments = []
    for r, row in enumerate(rows):
        start, segs = 0, []
        for d, i in enumerate(row):
            s = seqs[i]
            n = len(s.input_ids)
            ids[r, start : start + n] = torch.tensor(s.input_ids)
            mask[r, start : start + n] = torch.tensor(s.loss_mask, dtype=torch.bool)
            pos[r, start : start + n] = torch.arange(n)
            doc[r, start : start + n] = d
            segs.append((seq_key(s.input_ids), start, n))
            start += n
        pos[r, start:] = torch.arange(width - start)  # padding: its own run of positions
        segments.append(segs)
    return Batch(ids, mask, pos, doc, segments)


class BatchStream:
    """Deterministic micro-batches: micro-batch ``m`` of the run is a pure function of (seed, m).

    Each epoch shuffles the packed rows with ``seed + epoch``; rows are grouped ``rows_per_batch`` at a time.
    Optimizer step ``s`` with ``G = world_size * grad_accum`` consumes micro-batches ``s*G .. s*G+G-1``;
    rank ``r`` takes ``s*G + r*grad_accum + a`` for ``a < grad_accum``, so any world size sees the same data.
    """

    def __init__(self, seqs: list[Sequence], pack_len: int, rows_per_batch: int, seed: int):
        if not seqs:
            raise ValueError("no training sequences (check the A records / B responses and held-out share)")
        self.seqs, self.rows_per_batch, self.seed = seqs, rows_per_batch, seed
        self.rows = pack([len(s.input_ids) for s in seqs], pack_len)
        self.per_epoch = -(-len(self.rows) // rows_per_batch)

    def micro_batch(self, m: int) -> Batch:
        epoch, j = divmod(m, self.per_epoch)
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
        chosen = order[j * self.rows_per_batch : (j + 1) * self.rows_per_batch]
        return make_batch(self.seqs, [self.rows[i] for i in chosen], PAD_TO)


def total_steps(p, per_epoch: int, world: int) -> int:
    """Optimizer steps of a run with 05's params `p` (``max_steps``, ``epochs``, ``grad_accum``): max_steps,
    else epochs x micro-batches per epoch / micro-batches per step (grad_accum on each of `world` processes)."""
    return p.max_steps or max(1, p.epochs * per_epoch // (world * p.grad_accum))


def micro_batches(step: int, rank: int, world: int, grad_accum: int) -> range:
    """The indices (into `BatchStream`) of the micro-batches rank `rank` trains at `step`: a step takes
    world x grad_accum consecutive ones, so one process with grad_accum x world takes the same, in order."""
    first = step * world * grad_accum + rank * grad_accum
    return range(first, first + grad_accum)
