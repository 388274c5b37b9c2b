"""Stage 01_prepare_A: native (A) conversations -> token ids + assistant loss masks in the target's space.

Each A source is read row by row (:mod:`eagle_lib.data.formats`), normalized, rendered with the target's chat
template and tokenized with its loss mask in one pass (:mod:`eagle_lib.data.chat`) on all cores, truncated to
``max_seq_len``, and written to ``data/A/<dataset>/records.jsonl`` (``rejects.jsonl`` for malformed rows,
``meta.json`` with read = kept + dropped + rejected). A dataset whose reject rate passes
``max_reject_fraction`` fails the stage after every dataset has been processed. A dataset whose complete
output was made from the same source, params and tokenizer is reused.

The machinery shared with stage 02 (parallel row mapping, per-dataset output with tally and rejects, the
final tally table) lives in :mod:`eagle_lib.data.records`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import field_validator

from eagle_lib import models, params, store
from eagle_lib.data import formats, records
from eagle_lib.data.records import headline, reasons_table, rejects_sample, tally_table  # the report's tables

__all__ = ["Params", "answer", "headline", "masking_table", "preview", "reasons_table", "rejects_sample", "run",
           "tally_table"]  # fmt: skip

_TOY_A = [
    formats.Source(name="native_chat", path="toy://data/native_chat", adapter="openai"),
    formats.Source(name="native_tools", path="toy://data/native_tools", adapter="openai"),
]


class Params(params.Strict):
    """01_prepare_A parameters."""

    datasets: list[formats.Source] = _TOY_A  # A sources: {name, path, adapter, config, split, max_read, ...}
    max_seq_len: int = 2048  # longer records are truncated to this many tokens (counted in meta.json)
    # assistant turns trained: all (one sequence), the last one only, or each: every turn once, in a sequence
    # showing it as the target saw it (extra sequences only where the template drops reasoning)
    turns: Literal["all", "last", "each"] = "all"
    max_reject_fraction: float = 0.1  # a dataset rejecting more than this share of its rows fails the stage
    chat_template_kwargs: dict[str, Any] = {}  # extra chat-template variables, e.g. {"thinking": true}
    batch_size: int = 64  # rows per worker task

    _unique = field_validator("datasets")(records.unique_names)


# ---------------------------------------------------------------- workers


def _prepare_one(conv: dict) -> tuple:
    state = records.worker_state()
    p: Params = state["params"]
    if "input_ids" in conv:
        ids = conv["input_ids"]
        if ids and max(ids) >= state["vocab_size"]:
            raise formats.Malformed(
                f"token id {max(ids)} >= the tokenizer's vocab size {state['vocab_size']}"
            )
        seqs = [(ids, conv["loss_mask"], None)]
        method = "pretokenized"
    else:
        enc = state["encoder"]
        if p.turns == "each":
            encs = enc.encode_each(conv["messages"], conv["tools"])
        else:
            encs = [enc.encode(conv["messages"], conv["tools"], p.turns)]
        seqs = [(e.input_ids, e.loss_mask, e.turns) for e in encs]
        method = "fallback" if any(e.method == "fallback" for e in encs) else "scan"
    seqs = [s for s in seqs if any(s[1])]
    if not seqs:
        return "dropped", "no_assistant_turn"
    out = []
    for k, (ids, mask, turns) in enumerate(seqs):
        truncated = len(ids) > p.max_seq_len
        ids, mask = ids[: p.max_seq_len], mask[: p.max_seq_len]
        if n_trainable := sum(mask):
            rid = f"{conv['id']}#s{k}" if p.turns == "each" else conv["id"]
            rec = {"id": rid, "source": conv["source"], "input_ids": ids, "loss_mask": mask}
            if p.turns == "each":  # the conversation and its assistant turns (0-based) this sequence trains
                rec |= {"conversation": conv["id"], "turns": turns}
            out.append(rec | {"n_tokens": len(ids), "n_trainable": n_trainable, "truncated": truncated})
    if not out:
        return "dropped", "truncated_away"
    out[0]["_method"] = method  # counted in meta.json (how the row was masked), not written
    return "kept", out


def _prepare_batch(task: tuple[formats.Source, list]) -> list[tuple]:
    src, rows = task
    return [records.guarded(src, where, row, err, _prepare_one) for where, row, err in rows]


# ---------------------------------------------------------------- the stage


def run_dataset(cfg: params.StageConfig, src: formats.Source, root: Path, tok: Any, initargs: tuple) -> dict:
    """Tokenize one A dataset into data/A/<name>/ (or reuse a complete identical earlier output)."""
    p: Params = cfg.stage
    key = records.fingerprint(src, p.model_dump(mode="json", exclude={"datasets"}), tok)
    if (meta := records.reusable(root, src.name, key)) is not None:
        return meta | {"reused": True}
    out = records.DatasetOutput(root, src.name, "records.jsonl", key)
    tokens = trainable = truncated = 0
    located: Counter = Counter()  # how turns were found: scan (one pass), prefix (fallback), pretokenized
    n_workers = models.num_workers(cfg.shared.num_workers)
    for results in records.parallel_map(
        _prepare_batch, records.batches(src, p.batch_size), n_workers, initargs
    ):
        for kind, payload in results:
            if kind == "kept":
                located[payload[0].pop("_method")] += 1
                for rec in payload:
                    tokens, trainable = tokens + rec["n_tokens"], trainable + rec["n_trainable"]
                    truncated += rec["truncated"]
            out.add(kind, payload)
    extra = {"dataset": src.name, "source": src.model_dump(), "tokens": tokens, "trainable_tokens": trainable}
    extra["masked_by"] = dict(
        located
    )  # kept rows by how their spans were found: scan / fallback / pretokenized
    extra |= {"truncated": truncated, "params": p.model_dump(mode="json", exclude={"datasets"})}
    return records.finish_dataset(out, extra, p.max_reject_fraction)


def run(cfg: params.StageConfig) -> dict:
    """Run 01_prepare_A: every A dataset -> data/A/<name>/records.jsonl; returns the stage meta."""
    return records.run_stage(cfg, "A", run_dataset)


def answer_text(meta: dict) -> str:
    """The report's first sentence: records kept and why others were not, trainable tokens, masking methods,
    and a warning when the template drops earlier turns' reasoning and ``turns`` is not ``each``."""
    sets = meta["datasets"].values()
    masked: Counter = Counter()
    for m in sets:
        masked.update(m.get("masked_by", {}))
    seqs = sum(m.get("sequences", m["kept"]) for m in sets)
    trainable = sum(m.get("trainable_tokens", 0) for m in sets)
    text = f"**{meta['kept']:,} of {meta['read']:,} A records kept**{records.outcome_clause(meta)}"
    text += f", {seqs:,} training sequences" if seqs != meta["kept"] else ""
    text += f", {trainable:,} trainable tokens; masks: {masked['scan']:,} scan, {masked['fallback']:,} verified fallback"
    text += f", {masked['pretokenized']:,} pre-tokenized." if masked["pretokenized"] else "."
    turns = meta["params"].get("turns")
    if (meta.get("template") or {}).get("drops_history_reasoning") and turns != "each":
        text += (
            f" **The chat template drops the reasoning of earlier turns**, so with `turns: {turns}` those turns"
            " train an empty think block + answer, a continuation the target never produces while it thinks:"
            " set `turns: each` (every turn trained once, as the target saw it)."
        )
    return text


def answer(meta: dict):
    """:func:`answer_text` as Markdown, for the top of the report."""
    return records.markdown(answer_text(meta))


def masking_table(meta: dict):
    """Per dataset, how the rows were masked: scan (one pass), verified fallback, pre-tokenized, rejected."""
    import pandas as pd

    rows = []
    for name, m in meta["datasets"].items():
        by = m.get("masked_by", {})
        row = {"dataset": name, "scan": by.get("scan", 0), "verified_fallback": by.get("fallback", 0)}
        row |= {"pretokenized": by.get("pretokenized", 0), "rejected": m["rejected"]}
        rows.append(row | {"reject_reasons": records.top_reasons(m.get("reject_reasons", {}))})
    return pd.DataFrame(rows)


def preview(cfg: params.StageConfig, dataset: str, n_chars: int = 1500) -> str:
    """The first record of a dataset decoded, trained tokens in [[...]]: what the drafter learns, visibly."""
    rec = next(store.iter_jsonl(cfg.out("data", "A", dataset, "records.jsonl")), None)
    if rec is None:
        return f"{dataset}: no records"
    tok = models.load_tokenizer(cfg.shared)
    out, prev = [], 0
    for t, m in zip(rec["input_ids"], rec["loss_mask"], strict=True):
        out.append(("[[" if m and not prev else "]]" if prev and not m else "") + tok.decode([t]))
        prev = m
    text = "".join(out) + ("]]" if prev else "")
    return f"{rec['id']} ({rec['n_tokens']} tokens, {rec['n_trainable']} trained):\n" + text[:n_chars]
