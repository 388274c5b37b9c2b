"""Stage 02_extract_B: prompt-only (B) datasets -> prompts in the target's token space, for regeneration.

Each B row is normalized (:mod:`eagle_lib.data.formats`), cut before the assistant turn to regenerate (the first or
the last one; a conversation ending on a user turn is, for `last`, a prompt as it stands; ``each_turn`` keeps the
first prompt plus the later user turns / tool results and the source's tool calls as ``followups``, which 03
answers turn by turn, `eagle_lib.data.multiturn`), rendered with the target's
chat template plus its generation prompt and tokenized: ``prompt_ids`` is exactly what stage 03 sends to the
engine. Prompts are filtered (``n_prompt_tokens + max_new_tokens <= max_seq_len``), deduplicated (a hash of the
normalized prompt; SWE trajectories by instance id, since many agent runs share one issue) and capped per
dataset by a seeded sample (the ``max_prompts`` prompts with the smallest seeded hash of their id: the same
sample whatever the worker count or batch size). Output: ``data/B/<dataset>/prompts.jsonl`` (+ rejects.jsonl,
meta.json with read = kept + dropped + rejected).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import field_validator

from eagle_lib import models, params, store
from eagle_lib.data import formats, multiturn, records


class BSource(formats.Source):
    """A B dataset: where it lives, its adapter, which turn to regenerate and how many prompts to keep."""

    turn: Literal["first", "last", "each_turn"] = (
        "first"  # assistant turn(s) to regenerate: first | last (the prompt is what precedes it) | every one
    )
    max_prompts: int = 0  # cap on kept prompts, a seeded sample (0: keep all)


def _toy(name: str, adapter: str, **kw: Any) -> BSource:
    """A toy B dataset; 64 prompts each keeps the toy regeneration (03) a few CPU minutes."""
    return BSource(name=name, path=f"toy://data/{name}", adapter=adapter, max_prompts=64, **kw)


_TOY_B = [
    _toy("glaive", "glaive"),
    _toy("mot", "mot"),
    _toy("openthoughts_114k", "openthoughts", drop_system=True),
    _toy("openthoughts3", "openthoughts"),
    _toy("swe_agent", "swe_agent"),
    _toy("opencodeinstruct", "opencodeinstruct"),
    _toy("sharegpt", "sharegpt"),
    _toy("ultrachat", "ultrachat"),
]


class Params(params.Strict):
    """02_extract_B parameters."""

    datasets: list[BSource] = _TOY_B  # B sources: {name, path, adapter, turn, max_prompts, ...}
    max_seq_len: int = 2048  # a prompt is kept only if its tokens + shared max_new_tokens fit in this
    dedup: bool = True  # drop prompts whose normalized text (or SWE instance id) was already kept
    max_reject_fraction: float = 0.1  # a dataset rejecting more than this share of its rows fails the stage
    chat_template_kwargs: dict[str, Any] = {}  # extra chat-template variables, e.g. {"thinking": true}
    batch_size: int = 64  # rows per worker task

    _unique = field_validator("datasets")(records.unique_names)


# the tally helpers are the same for both data stages (the notebook imports this module only)
reasons_table, rejects_sample, tally_table, headline = (
    records.reasons_table, records.rejects_sample, records.tally_table, records.headline
)  # fmt: skip


def prompt_messages(messages: list[dict], turn: str) -> list[dict] | None:
    """The messages before the assistant turn to regenerate; None when there is no such turn.

    A conversation that ends on a user or tool turn is a prompt as it stands for ``last`` (its answer is
    missing), and for ``first`` too when it has no assistant turn at all.
    """
    if messages and messages[-1]["role"] in ("user", "tool") and turn == "last":
        return messages
    answers = [
        k for k, m in enumerate(messages) if m["role"] == "assistant" and k > 0 and messages[k - 1]["role"] != "assistant"
    ]  # fmt: skip
    if answers:
        return messages[: answers[0] if turn == "first" else answers[-1]]
    return messages if messages and messages[-1]["role"] in ("user", "tool") else None


def prompt_key(messages: list[dict], tools: list) -> str:
    """Dedup key: hash of the prompt with case and whitespace normalized (tool names included)."""

    def norm(m: dict) -> list:
        calls = [
            tc["function"]["name"] + " ".join(tc["function"]["arguments"].split())
            for tc in m.get("tool_calls") or []
        ]
        return [m["role"], " ".join(m.get("content", "").lower().split()), calls]

    blob = json.dumps([[norm(m) for m in messages], sorted(t["function"].get("name", "") for t in tools)])
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def _extract_one(conv: dict, src: BSource) -> tuple:
    state = records.worker_state()
    if "input_ids" in conv:
        raise formats.Malformed("pre-tokenized rows have no messages to regenerate from")
    extra = {}
    if src.turn == "each_turn":  # the first prompt + the later turns 03 answers one by one (data.multiturn)
        cut = multiturn.split_turns(conv["messages"])
        msgs, extra = (None, {}) if cut is None else (cut[0], {"followups": cut[1]})
    else:
        msgs = prompt_messages(conv["messages"], src.turn)
    if msgs is None:
        return "dropped", "no_prompt"
    ids = state["encoder"].encode_prompt(msgs, conv["tools"])
    key = f"group:{conv['group']}" if conv.get("group") else prompt_key(msgs, conv["tools"])
    rec = {"id": conv["id"], "source": conv["source"], "messages": msgs, "tools": conv["tools"]}
    return "kept", (rec | {"prompt_ids": ids, "n_prompt_tokens": len(ids)} | extra, key)


def _extract_batch(task: tuple[formats.Source, list]) -> list[tuple]:
    src, rows = task
    return [records.guarded(src, where, row, err, lambda c: _extract_one(c, src)) for where, row, err in rows]


def sample_key(seed: int, rid: str) -> str:
    """Seeded hash of a prompt id: the cap keeps the smallest ones (an order-independent uniform sample)."""
    return hashlib.blake2b(f"{seed}:{rid}".encode(), digest_size=8).hexdigest()


class _Candidates:
    """Kept-so-far prompts (after filter and dedup) staged in a file until the cap's sample is known."""

    def __init__(self, out: records.DatasetOutput, seed: int, dedup: bool, max_prompt_tokens: int):
        self.out, self.seed, self.dedup, self.max_prompt_tokens = out, seed, dedup, max_prompt_tokens
        self.path = out.tmp / "candidates.jsonl"
        self.seen: set[str] = set()
        self.ids: set[str] = set()
        self.keys: list[str] = []
        self.buf: list[dict] = []

    def add(self, kind: str, payload: Any) -> None:
        if kind != "kept":
            return self.out.add(kind, payload)
        rec, key = payload
        if rec["n_prompt_tokens"] > self.max_prompt_tokens:  # no room left for the generation budget
            return self.out.add("dropped", "too_long")
        if self.dedup and key in self.seen:
            return self.out.add("dropped", "duplicate")
        if rec["id"] in self.ids:  # two rows with one source id (dedup off): the first is kept
            return self.out.add("dropped", "duplicate_id")
        self.seen.add(key)
        self.ids.add(rec["id"])
        if "followups" in rec:  # each_turn: 03 stops a conversation whose next prompt leaves no room either
            rec["max_prompt_tokens"] = self.max_prompt_tokens
        self.keys.append(sample_key(self.seed, rec["id"]))
        self.buf.append(rec)
        if len(self.buf) >= 256:
            self.flush()

    def flush(self) -> None:
        store.append_jsonl(self.path, self.buf)
        self.buf.clear()

    def publish(self, cap: int) -> tuple[int, int]:
        """Write the sampled prompts (in source order) to prompts.jsonl; returns (prompts, prompt tokens)."""
        self.flush()
        chosen = set(sorted(range(len(self.keys)), key=self.keys.__getitem__)[:cap]) if cap else None
        tokens = 0
        for i, rec in enumerate(store.iter_jsonl(self.path)):
            if chosen is None or i in chosen:
                tokens += rec["n_prompt_tokens"]
                self.out.add("kept", rec)
            else:
                self.out.add("dropped", "over_cap")
        self.path.unlink(missing_ok=True)
        return self.out.counts["kept"], tokens


def run_dataset(cfg: params.StageConfig, src: BSource, root: Path, tok: Any, initargs: tuple) -> dict:
    """Extract one B dataset into data/B/<name>/ (or reuse a complete identical earlier output)."""
    p: Params = cfg.stage
    budget = cfg.shared.max_new_tokens
    stage_params = p.model_dump(mode="json", exclude={"datasets"}) | {
        "seed": cfg.shared.seed,
        "max_new_tokens": budget,
    }
    key = records.fingerprint(src, stage_params, tok)
    if (meta := records.reusable(root, src.name, key)) is not None:
        return meta | {"reused": True}
    out = records.DatasetOutput(root, src.name, "prompts.jsonl", key)
    cands = _Candidates(out, cfg.shared.seed, p.dedup, p.max_seq_len - budget)
    n_workers = models.num_workers(cfg.shared.num_workers)
    for results in records.parallel_map(
        _extract_batch, records.batches(src, p.batch_size), n_workers, initargs
    ):
        for kind, payload in results:
            cands.add(kind, payload)
    _, tokens = cands.publish(src.max_prompts)
    extra = {"dataset": src.name, "source": src.model_dump(), "tokens": tokens, "params": stage_params}
    return records.finish_dataset(out, extra, p.max_reject_fraction)


def run(cfg: params.StageConfig) -> dict:
    """Run 02_extract_B: every B dataset -> data/B/<name>/prompts.jsonl; returns the stage meta."""
    return records.run_stage(cfg, "B", run_dataset)


def answer_text(meta: dict) -> str:
    """The report's first sentence: prompts kept out of rows read, why the others were not, prompt tokens."""
    tokens = sum(m.get("tokens", 0) for m in meta["datasets"].values())
    return (
        f"**{meta['kept']:,} prompts kept from {meta['read']:,} B rows** in {len(meta['datasets'])} datasets"
        f"{records.outcome_clause(meta)}, {tokens:,} prompt tokens to regenerate."
    )


def answer(meta: dict):
    """:func:`answer_text` as Markdown, for the top of the report."""
    return records.markdown(answer_text(meta))


def datasets_table(meta: dict):
    """Per dataset: rows read, prompts kept, dropped by reason, rejected, seconds, reused."""
    import pandas as pd

    rows = [
        {"dataset": n, "read": m["read"], "prompts": m["kept"], "dropped": records.top_reasons(m["dropped"], 4),
         "rejected": m["rejected"], "seconds": m["seconds"], "reused": m.get("reused", False)}
        for n, m in meta["datasets"].items()
    ]  # fmt: skip
    return pd.DataFrame(rows)


def preview(cfg: params.StageConfig, dataset: str, n_chars: int = 800) -> str:
    """The first prompt of a dataset decoded from its prompt_ids (exactly what the engine will be sent)."""
    rec = next(store.iter_jsonl(cfg.out("data", "B", dataset, "prompts.jsonl")), None)
    if rec is None:
        return f"{dataset}: no prompts"
    text = models.load_tokenizer(cfg.shared).decode(rec["prompt_ids"])
    return f"{rec['id']} ({rec['n_prompt_tokens']} tokens):\n" + (
        text if len(text) <= n_chars else "..." + text[-n_chars:]
    )
