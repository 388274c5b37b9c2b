"""Draft vocabulary: the N target tokens most frequent at loss-masked (label) positions, and its maps.

Convention (EAGLE / SGLang / vLLM): ``d2t`` int64 [N] with ``target_id = draft_id + d2t[draft_id]``; draft ids
keep the target's order (the kept target ids sorted ascending), so ``d2t + arange(N)`` is strictly increasing.
``t2d`` bool [V] marks the kept target ids. Ties in frequency go to the lower target id, so the map is a
pure function of the counts. Maps are cached under a key naming the tokenizer, the data and N.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from eagle_lib.store import stable_hash


class VocabMapError(ValueError):
    """A vocab map breaks the convention (names the check that failed)."""


def count_label_tokens(sequences: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> np.ndarray:
    """(V,) int64 counts of ``input_ids[i]`` over positions with ``loss_mask[i] == 1``."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    ids_buf, n_buf = [], 0
    for ids, mask in sequences:
        ids_a = np.asarray(ids, dtype=np.int64)
        sel = ids_a[np.asarray(mask, dtype=bool)]
        ids_buf.append(sel)
        n_buf += sel.size
        if n_buf > 1 << 22:  # flush in large vectorized chunks
            counts += _bincount(np.concatenate(ids_buf), vocab_size)
            ids_buf, n_buf = [], 0
    if ids_buf:
        counts += _bincount(np.concatenate(ids_buf), vocab_size)
    return counts


def _bincount(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise VocabMapError(f"token id {bad} outside the target vocab [0, {vocab_size})")
    return np.bincount(ids, minlength=vocab_size)


def build_vocab_map(counts: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-n ids by count (ties: lower id first) -> (d2t int64 [n], t2d bool [V])."""
    v = counts.shape[0]
    if not 0 < n <= v:
        raise VocabMapError(f"draft vocab size {n} must be in [1, {v}] (the target vocab size)")
    order = np.lexsort((np.arange(v), -counts))  # primary: count desc, secondary: id asc
    kept = np.sort(order[:n])
    d2t = torch.from_numpy(kept - np.arange(n)).long()
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[torch.from_numpy(kept)] = True
    check_vocab_map(d2t, t2d)
    return d2t, t2d


def map_rules(d2t: torch.Tensor, t2d: torch.Tensor | None, v_target: int) -> list[tuple[str, bool, str]]:
    """The one statement of the vocab-map convention (training, export and preflight check it through this):
    (rule, holds, what was found) for: target ids d2t + arange(N) inside [0, V); strictly increasing (no
    duplicate, the target's order); t2d of length V marking exactly those ids."""
    n = d2t.numel()
    ids = d2t.long() + torch.arange(n)
    lo, hi = (int(ids.min()), int(ids.max())) if n else (0, -1)
    in_range, increasing = lo >= 0 and hi < v_target, n < 2 or bool((ids[1:] > ids[:-1]).all())
    out = [
        ("d2t range", in_range, f"target ids in [{lo}, {hi}]" + (f" < {v_target}" if in_range
                                 else f": outside the target vocab [0, {v_target})")),
        ("d2t increasing", increasing, "d2t + arange(N) strictly increasing" if increasing
         else "d2t + arange(N) is not strictly increasing (duplicate or unsorted target ids)"),
    ]  # fmt: skip
    if t2d is not None:
        marked = t2d.bool().nonzero().flatten()
        ok = t2d.numel() == v_target and torch.equal(marked, ids.sort().values)
        found = f"{int(t2d.sum())} kept of {t2d.numel()}"
        if not ok:
            found = (f"t2d.sum() = {int(t2d.sum())} != N = {n}" if int(t2d.sum()) != n
                     else f"t2d (len {t2d.numel()}) does not mark exactly d2t's target ids")  # fmt: skip
        out.append(("t2d agrees with d2t", ok, found))
    return out


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise VocabMapError unless d2t/t2d follow the convention (`map_rules`) and agree with each other."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise VocabMapError(f"d2t must be int64 and t2d bool (got {d2t.dtype}, {t2d.dtype})")
    for rule, ok, found in map_rules(d2t, t2d, t2d.numel()):
        if not ok:
            raise VocabMapError(f"{rule}: {found}")


def coverage(counts: np.ndarray, t2d: torch.Tensor) -> float:
    """Share of label tokens (by count) whose target id is in the draft vocab."""
    total = counts.sum()
    return float(counts[t2d.numpy()].sum() / total) if total else 0.0


def cache_key(tokenizer_fp: str, data_fp: str, n: int) -> str:
    return stable_hash({"tokenizer": tokenizer_fp, "data": data_fp, "n": n})


def load_or_build(
    cache_dir: str | Path, key: str, n: int, vocab_size: int, sequences
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, bool]:
    """The map for ``key`` from ``cache_dir/vocab-<key>.safetensors``, else counted from ``sequences``.

    Returns (d2t, t2d, counts, from_cache). ``sequences`` is a zero-argument callable yielding
    (input_ids, loss_mask) pairs, only called on a cache miss.
    """
    from safetensors.torch import load_file, save_file

    path = Path(cache_dir) / f"vocab-{key}.safetensors"
    if path.exists():
        t = load_file(str(path))
        if t["t2d"].numel() != vocab_size or t["d2t"].numel() != n:
            raise VocabMapError(f"{path}: cached map has V={t['t2d'].numel()}, N={t['d2t'].numel()}")
        check_vocab_map(t["d2t"], t["t2d"])
        return t["d2t"], t["t2d"], t["counts"].numpy(), True
    counts = count_label_tokens(sequences(), vocab_size)
    d2t, t2d = build_vocab_map(counts, n)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"d2t": d2t, "t2d": t2d, "counts": torch.from_numpy(counts)}, str(tmp))
    tmp.replace(path)
    return d2t, t2d, counts, False


def for_stage(cfg, train_seqs, vocab_size: int):
    """Stage 05's draft vocab map (cached under drafter/vocab/, built on the main rank first) and its stats."""
    from eagle_lib import distributed, models
    from eagle_lib.data import batches

    p = cfg.stage
    tok_fp = models.tokenizer_fingerprint(models.load_tokenizer(cfg.shared))
    data_fp = batches.data_fingerprint(
        cfg.run_dir,
        heldout=cfg.shared.heldout_percent,
        max_seq_len=p.max_seq_len,
        max_train=p.max_train_samples,
        source=p.hidden_source,
    )
    key = cache_key(tok_fp, data_fp, p.draft_vocab_size)

    def seqs():
        return ((s.input_ids, s.loss_mask) for s in train_seqs)

    vdir = cfg.out("drafter", "vocab")
    if distributed.is_main():
        res = load_or_build(vdir, key, p.draft_vocab_size, vocab_size, seqs)
    distributed.barrier()
    if not distributed.is_main():
        res = load_or_build(vdir, key, p.draft_vocab_size, vocab_size, seqs)
    d2t, t2d, counts, cached = res
    return (
        d2t,
        t2d,
        {
            "key": key,
            "coverage": coverage(counts, t2d),
            "from_cache": cached,
            "label_tokens": int(counts.sum()),
            "distinct_label_tokens": int((counts > 0).sum()),
            "majority_share": float(counts.max() / max(1, counts.sum())),
        },
    )
