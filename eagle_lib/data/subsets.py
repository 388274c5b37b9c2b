"""Training subsets for the data-value studies (stage 07): nested fractions, leave-out pools, original responses.

All subsets are drawn from 05's training sequences (never a held-out id). Within each dataset the sequences are
ordered by a seeded hash of their id (an order-independent uniform shuffle); a subset of fraction f takes, per
dataset, the shortest prefix of that order holding >= f of the dataset's tokens. So every subset keeps the
datasets' token proportions, and the subsets of growing f are nested (each contains the smaller ones).

Original responses: a B dataset that carries its own answers (ShareGPT, UltraChat, OpenThoughts, MoT,
OpenCodeInstruct) is re-read with its 02 source (``data/B/<name>/meta.json``) through its adapter; the answer
after the stored prompt messages is the original response, encoded with the target's chat template (the
assistant turn is the label) exactly as the regenerated one is (prompt + response, truncated the same way).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

from eagle_lib import store
from eagle_lib.data.batches import Sequence, iter_raw


def dataset_of(run_dir: str | Path) -> dict[str, str]:
    """Sample id -> dataset name (A records' and B responses' directory names) for every training input."""
    return {str(rec.get("id")): path.parent.name for path, rec, _ids, _mask in iter_raw(run_dir)}


def order_key(seed: int, sid: str) -> str:
    """A sequence's place in its dataset's seeded order: a hash of (seed, id), so sorting by it is a uniform
    shuffle that does not depend on the order the sequences were read in (07's multi-turn study orders 03's
    conversations by it too)."""
    return hashlib.blake2b(f"{seed}:{sid}".encode(), digest_size=8).hexdigest()


def by_dataset(seqs: list[Sequence], names: dict[str, str], seed: int) -> dict[str, list[Sequence]]:
    """Sequences per dataset, each list in its seeded order (the order every prefix subset is cut from)."""
    out: dict[str, list[Sequence]] = {}
    for s in seqs:
        if s.id not in names:
            raise KeyError(f"training sequence {s.id!r} is in no A/B dataset under the run dir")
        out.setdefault(names[s.id], []).append(s)
    return {d: sorted(v, key=lambda s: order_key(seed, s.id)) for d, v in sorted(out.items())}


def tokens(seqs: list[Sequence]) -> int:
    return sum(len(s.input_ids) for s in seqs)


def prefix(ordered: list[Sequence], fraction: float) -> list[Sequence]:
    """Shortest prefix of `ordered` holding >= fraction of its tokens (at least one sequence if fraction > 0)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"subset fraction {fraction} must be in (0, 1]")
    want, got, out = fraction * tokens(ordered), 0, []
    for s in ordered:
        if got >= want and out:
            break
        out.append(s)
        got += len(s.input_ids)
    return out


def fraction_subset(groups: dict[str, list[Sequence]], fraction: float) -> list[Sequence]:
    """The stratified subset of `fraction` (every dataset cut at the same token fraction)."""
    return [s for d in groups for s in prefix(groups[d], fraction)]


def resampled(groups: dict[str, list[Sequence]], seed: int) -> dict[str, list[Sequence]]:
    """Another training set of the same size and strata: per dataset, as many sequences as it holds, drawn with
    replacement (a bootstrap of the training set) in draw order, so any prefix of it is a random subset."""
    import numpy as np

    rng = np.random.default_rng([seed, 2654435761])
    return {d: [v[i] for i in rng.integers(0, len(v), size=len(v))] for d, v in groups.items()}


def leave_out(groups: dict[str, list[Sequence]], left_out: set[str], budget: int) -> list[Sequence]:
    """`budget` tokens from the datasets not in `left_out`, their proportions kept (raises if they hold fewer)."""
    pool = {d: v for d, v in groups.items() if d not in left_out}
    have = sum(tokens(v) for v in pool.values())
    if have < budget:
        raise ValueError(
            f"leaving out {sorted(left_out)} leaves {have} training tokens, fewer than the budget {budget}: "
            "lower lodo_fraction"
        )
    return fraction_subset(pool, budget / have)


def equalize(a: list[Sequence], b: list[Sequence], seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """Cut the arm with more tokens (a seeded-order prefix) to the other's token count."""
    ta, tb = tokens(a), tokens(b)
    order = sorted(a if ta > tb else b, key=lambda s: order_key(seed, s.id))
    cut = prefix(order, min(ta, tb) / max(ta, tb)) if max(ta, tb) else order
    return (cut, b) if ta > tb else (a, cut)


def b_source(run_dir: Path, dataset: str):
    """(02's `formats.Source` of B `dataset`, its chat_template_kwargs) from data/B/<dataset>/meta.json: how to
    re-read the dataset's source rows through its adapter (the original answers here, 07's conversations)."""
    from eagle_lib.data import formats

    path = run_dir / "data" / "B" / dataset / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no 02 meta.json for B dataset {dataset}")
    meta = store.read_json(path)
    src = {k: v for k, v in meta["source"].items() if k in formats.Source.model_fields}
    return formats.Source(**src), meta.get("params", {}).get("chat_template_kwargs", {})


def original_sequences(
    run_dir: str | Path, dataset: str, ids: set[str], tokenizer, max_seq_len: int
) -> tuple[list[Sequence], dict]:
    """Original-response training sequences of B `dataset` for the prompt ids `ids`; and a tally.

    A prompt whose source conversation has no assistant answer right after the stored prompt messages (or whose
    messages no longer match the stored prompt) is dropped and counted.
    """
    from eagle_lib.data import formats
    from eagle_lib.data.chat import ChatEncoder, ChatError

    run_dir = Path(run_dir)
    src, kwargs = b_source(run_dir, dataset)
    stored = {
        str(r["id"]): r
        for r in store.iter_jsonl(run_dir / "data/B" / dataset / "prompts.jsonl")
        if str(r["id"]) in ids
    }
    enc, out, tally = ChatEncoder(tokenizer, kwargs), [], Counter()
    for where, row, err in formats.iter_rows(src):
        rid = formats.record_id(src, where, row)
        if rid not in stored or err:
            continue
        try:
            conv = formats.adapt(row, src, where)
        except (formats.Malformed, formats.Skip):
            tally["unreadable"] += 1
            continue
        prompt, msgs = stored.pop(rid)["messages"], conv.get("messages", [])
        if msgs[: len(prompt)] != prompt:
            tally["prompt_mismatch"] += 1
            continue
        if len(msgs) <= len(prompt) or msgs[len(prompt)]["role"] != "assistant":
            tally["no_original_answer"] += 1
            continue
        try:
            e = enc.encode(prompt + [msgs[len(prompt)]], conv.get("tools"), turns="last")
        except ChatError:
            tally["unencodable"] += 1
            continue
        seq_ids, mask = e.input_ids[:max_seq_len], e.loss_mask[:max_seq_len]
        if sum(mask[2:]) == 0:  # as 05: labels need a feature two tokens before them
            tally["no_trainable_labels"] += 1
            continue
        out.append(Sequence(rid, list(seq_ids), list(mask)))
        tally["kept"] += 1
    tally["not_in_source"] += len(stored)
    return out, dict(tally)


def first_turns(seqs: list[Sequence]) -> list[Sequence]:
    """The single-turn view of sequences: an each_turn conversation's sequence (id ``<conversation>#0``) cut after
    its first answer and named by its conversation (as 02's prompt id, the one the original answers carry); its
    later sequences (``#k``, k > 0) dropped; other sequences unchanged."""
    from eagle_lib.data.multiturn import SEP

    out = []
    for s in seqs:
        conv, sep, turn = s.id.rpartition(SEP)
        if not sep:
            out.append(s)
        elif turn == "0" and 1 in s.loss_mask:
            start = s.loss_mask.index(1)
            end = next((i for i in range(start, len(s.loss_mask)) if not s.loss_mask[i]), len(s.loss_mask))
            out.append(Sequence(conv, s.input_ids[:end], s.loss_mask[:end]))
    return out
