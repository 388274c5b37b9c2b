"""Standard prompt sets for measuring acceptance (stage 06): MT-Bench, GSM8K, HumanEval, MATH500, SPEED-Bench.

Each set is read from a hub id or a local json / jsonl / parquet file through :func:`eagle_lib.data.formats.
iter_rows` and turned into one user message per row by a small adapter for its published schema:

* ``mt_bench`` — FastChat's question.jsonl ``{question_id, category, turns: [str, ...]}`` or
  HuggingFaceH4/mt_bench_prompts ``{prompt_id, category, prompt: [str, ...]}``; the first turn, and with
  ``turns: all`` the later ones too (`followups`: each asked after the target's own greedy answer to the turns
  before it, as MT-Bench is run).
* ``gsm8k`` — openai/gsm8k (config main, split test) ``{question, answer}``.
* ``humaneval`` — openai/openai_humaneval (split test) ``{task_id, prompt, canonical_solution, test,
  entry_point}``; the code stub is the message.
* ``math500`` — HuggingFaceH4/MATH-500 (split test) ``{problem, solution, answer, subject, level, unique_id}``.
* ``speed_bench`` — nvidia/SPEED-Bench (configs qualitative, throughput_1k ... throughput_32k; split test)
  ``{question_id, category, sub_category, turns: [str, ...], source, src_id, difficulty, multiturn}``; the first
  turn (``turns: all`` as for MT-Bench). The qualitative config is 11 categories of 80 rows (coding, humanities,
  math, multilingual, qa, rag, reasoning, roleplay, stem, summarization, writing): "SPEED-Bench coding" is
  ``category: coding``, not the config's first 80 rows. Rows whose turns begin with "FULL BENCHMARK DATA SHOULD
  BE FETCHED ..." are stubs that NVIDIA's loader rebuilds from other datasets (Model-Optimizer's
  ``examples/specdec_bench/prepare_data.py``); they are no prompts, so they are REFUSED here, not rebuilt:
  counted as ``dropped.stub`` in the set's tally (06's meta.json ``eval_sets``) and printed. A set with only
  stubs raises; to measure those rows, rebuild them with that script and point ``path`` at its parquet.

``category`` (any schema with one: mt_bench and speed_bench ``category``, math500 ``subject``) keeps only the rows
of that category; the others are counted as ``dropped.other_category``.

The message is rendered with the target's chat template (generation prompt added) into prompt token ids.
A row that does not follow its schema raises an error naming the file, the row and the reason.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from eagle_lib import params, store
from eagle_lib.data import formats

REPO_ROOT = Path(__file__).resolve().parents[2]
Schema = Literal["mt_bench", "gsm8k", "humaneval", "math500", "speed_bench"]


@dataclass
class Prompt:
    """A prompt to decode (held-out record or eval-set row): its id, dataset and token ids in the target's vocab."""

    id: str
    dataset: str
    prompt_ids: list[int]


class EvalSet(params.Strict):
    """One evaluation prompt set: where it lives, its schema, how many prompts to take."""

    name: str  # the dataset name in 06's tables (e.g. mt_bench)
    path: str  # hub dataset id or a local .jsonl/.json/.parquet file
    benchmark: Schema  # its schema: mt_bench | gsm8k | humaneval | math500 | speed_bench
    config: str = ""  # hub config (gsm8k: main; SPEED-Bench: qualitative, throughput_1k, ...)
    split: str = "test"  # hub split
    max_prompts: int = 8  # the first N rows that fit max_prompt_tokens
    category: str = ""  # only rows of this category (SPEED-Bench coding: coding); empty: every row
    turns: Literal["first", "all"] = (
        "first"  # all (mt_bench, speed_bench): later turns too, after the target's own answers, as <name>_turn<k>
    )


class EvalSetError(ValueError):
    """A row of an eval set that does not follow its schema (the message names file, row and reason)."""


def _text(row: dict, key: str) -> str:
    v = row.get(key)
    if not isinstance(v, str) or not v.strip():
        raise EvalSetError(f"field '{key}' must be a non-empty string, got {type(v).__name__}")
    return v


def _first_turn(row: dict, keys: tuple[str, ...]) -> str:
    for key in keys:
        if key in row:
            turns = row[key]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
                raise EvalSetError(f"field '{key}' must be a non-empty list of strings")
            return turns[0]
    raise EvalSetError(f"missing field {' or '.join(repr(k) for k in keys)}")


def _later_turns(row: dict, keys: tuple[str, ...]) -> list[str]:
    turns = next((row[k] for k in keys if k in row), [])
    if not all(isinstance(t, str) and t.strip() for t in turns[1:]):
        raise EvalSetError(
            f"field '{next(k for k in keys if k in row)}': later turns must be non-empty strings"
        )
    return list(turns[1:])


def later_turns(schema: str, row: dict) -> list[str]:
    """The user turns after the first of a multi-turn row (mt_bench, speed_bench); [] for other schemas."""
    keys = {"mt_bench": ("turns", "prompt"), "speed_bench": ("turns",)}.get(schema)
    return _later_turns(row, keys) if keys else []


# the opening of SPEED-Bench rows whose prompts are built elsewhere (NVIDIA's prepare_data.py)
FETCH_ELSEWHERE_PREFIX = "FULL BENCHMARK DATA SHOULD BE FETCHED"


def is_stub(schema: str, row: dict) -> bool:
    """A SPEED-Bench row whose turns say to fetch the data elsewhere (rebuilt from other datasets), not a prompt."""
    turns = row.get("turns") if schema == "speed_bench" else None
    return isinstance(turns, list) and any(
        isinstance(t, str) and t.lstrip().startswith(FETCH_ELSEWHERE_PREFIX) for t in turns
    )


def _id(row: dict, keys: tuple[str, ...], fallback: str) -> str:
    return next((str(row[k]) for k in keys if row.get(k) not in (None, "")), fallback)


def adapt(schema: str, row: dict, fallback_id: str) -> tuple[str, str, str]:
    """(id, user message, category) of one row in ``schema``; raises EvalSetError."""
    if schema == "mt_bench":
        rid = _id(row, ("question_id", "prompt_id"), fallback_id)
        return rid, _first_turn(row, ("turns", "prompt")), str(row.get("category") or "")
    if schema == "speed_bench":
        rid = _id(row, ("question_id",), fallback_id)
        return rid, _first_turn(row, ("turns",)), str(row.get("category") or "")
    if schema == "gsm8k":
        return fallback_id, _text(row, "question"), ""
    if schema == "humaneval":
        return _id(row, ("task_id",), fallback_id), _text(row, "prompt"), ""
    if schema == "math500":
        return _id(row, ("unique_id",), fallback_id), _text(row, "problem"), str(row.get("subject") or "")
    raise EvalSetError(f"unknown eval-set schema {schema!r}")


def local_path(path: str) -> str:
    """A relative local file is looked up in the working directory, then in the repository root (so a notebook
    run from notebooks/ finds tests/data/...); hub ids pass through."""
    p = Path(path)
    if p.is_absolute() or p.exists() or formats.is_hub_id(path) or not (REPO_ROOT / p).exists():
        return path
    return str(REPO_ROOT / p)


def render(tokenizer, message: str) -> list[int]:
    """The user message through the target's chat template, generation prompt added: prompt token ids."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def read(es: EvalSet, tokenizer, max_prompt_tokens: int) -> tuple[list[dict], dict]:
    """Up to ``es.max_prompts`` prompts ``{id, dataset, category, prompt_ids}`` and the tally
    ``{read, kept, dropped: {too_long, other_category, stub}, rejected: 0}`` (a malformed row raises; SPEED-Bench
    stubs are refused and counted, `is_stub`)."""
    # formats.Source needs an adapter name; iter_rows only reads rows, the eval-set schema adapts them
    src = formats.Source(
        name=es.name, path=local_path(es.path), adapter="openai", config=es.config, split=es.split
    )
    out, dropped, n_read = [], Counter(), 0
    for where, row, err in formats.iter_rows(src):
        loc = f"{where['file']}: {'line' if 'line' in where else 'row'} {where.get('line', where.get('row'))}"
        if err is not None:
            raise EvalSetError(f"eval set {es.name}: {loc}: {err}")
        if len(out) >= es.max_prompts:
            break  # the first N that fit: nothing past them is read
        n_read += 1
        try:
            rid, text, cat = adapt(es.benchmark, row, f"{es.name}:{where.get('line', where.get('row'))}")
        except EvalSetError as e:
            raise EvalSetError(f"eval set {es.name} ({es.benchmark}): {loc}: {e}") from None
        if es.category and cat != es.category:
            dropped["other_category"] += 1
            continue
        if is_stub(es.benchmark, row):
            dropped["stub"] += 1
            continue
        ids = render(tokenizer, text)
        if len(ids) > max_prompt_tokens:
            dropped["too_long"] += 1
            continue
        rec = {"id": rid, "dataset": es.name, "category": cat, "prompt_ids": ids, "message": text}
        if es.turns == "all":
            try:
                rec["later_turns"] = later_turns(es.benchmark, row)
            except EvalSetError as e:
                raise EvalSetError(f"eval set {es.name} ({es.benchmark}): {loc}: {e}") from None
        out.append(rec)
    if dropped["stub"]:
        print(f"06 eval set {es.name}: refused {dropped['stub']} SPEED-Bench stub row(s) of {es.path} (turns "
              f"'{FETCH_ELSEWHERE_PREFIX}...': NVIDIA's loader rebuilds them from other datasets); {len(out)} prompts kept")  # fmt: skip
    if not out:
        stubs = (
            f"; {dropped['stub']} of them are SPEED-Bench stubs ('{FETCH_ELSEWHERE_PREFIX}...'): rebuild them with "
            "Model-Optimizer's examples/specdec_bench/prepare_data.py and point path at its parquet"
            if dropped["stub"] else ""
        )  # fmt: skip
        wanted = f" of category {es.category!r}" if es.category else ""
        raise EvalSetError(
            f"eval set {es.name}: no prompt{wanted} of {es.path} fits max_prompt_tokens={max_prompt_tokens} "
            f"(read {n_read} rows, dropped {dict(dropped)}{stubs})"
        )
    return out, {"read": n_read, "kept": len(out), "dropped": dict(dropped), "rejected": 0}


def answer_text(tokenizer, output_ids: list[int], end_of_thinking: str = "</think>") -> str:
    """An answer as a client sends it back in the history: the text after the last end-of-thinking marker (all
    of it when there is none), special tokens (the stop token) dropped."""
    text = tokenizer.decode(output_ids, skip_special_tokens=False)
    if end_of_thinking and end_of_thinking in text:
        text = text.rpartition(end_of_thinking)[2]
    for tok in tokenizer.all_special_tokens:
        text = text.replace(tok, "")
    return text.strip()


def followups(
    rows: list[dict], tokenizer, answer, max_prompt_tokens: int, end_of_thinking: str = "</think>"
) -> tuple[dict[str, list[Prompt]], dict]:
    """Prompts for the later turns of multi-turn rows (`read` with ``turns: all``), per label ``<set>_turn<k>``:
    turn k is asked after the user turns before it and the target's own answers to them, ``answer(prompt_ids)
    -> output ids`` (06: its greedy decoding, eval_max_new_tokens long). A conversation stops at its first turn
    longer than max_prompt_tokens (counted as too_long). Returns (prompts, {kept, dropped: {too_long}})."""
    out: dict[str, list[Prompt]] = {}
    kept, too_long = 0, 0
    for r in rows:
        msgs, ids = [{"role": "user", "content": r["message"]}], r["prompt_ids"]
        for k, turn in enumerate(r.get("later_turns", []), 2):
            msgs += [
                {"role": "assistant", "content": answer_text(tokenizer, answer(ids), end_of_thinking)},
                {"role": "user", "content": turn},
            ]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            if len(ids) > max_prompt_tokens:
                too_long += 1
                break
            label = f"{r['dataset']}_turn{k}"
            out.setdefault(label, []).append(Prompt(f"{r['id']}#t{k}", label, ids))
            kept += 1
    return out, {"kept": kept, "dropped": {"too_long": too_long} if too_long else {}}


# --- contamination: an eval prompt must not be in the training data -----------------------------------------
def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _grams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(max(len(words) - n + 1, 1))} if words else set()


def overlap(eval_texts: dict[str, str], train_texts, n: int = 13) -> dict[str, float]:
    """Per eval prompt (id -> text), the share of its word n-grams (lower-cased ``\\w+`` words; a prompt shorter
    than n words is one gram) that occur in any training text (an iterable, read once). 1.0: the prompt is in the
    training data; > 0: a passage of it is (GPT-3's 13-gram contamination test, per prompt)."""
    grams = {k: _grams(_words(t), n) for k, t in eval_texts.items()}
    wanted = set().union(*grams.values()) if grams else set()
    seen: set[tuple[str, ...]] = set()
    for text in train_texts:
        w = _words(text)
        seen |= {g for g in _grams(w, n) if g in wanted} if len(w) >= n else ({tuple(w)} & wanted)
    return {k: (len(g & seen) / len(g) if g else 0.0) for k, g in grams.items()}


def training_texts(run_dir: str | Path, tokenizer, batch: int = 256):
    """The text of everything a run trains on: its A records and B prompts + 03's answers, decoded."""
    run_dir = Path(run_dir)
    for f in sorted(run_dir.glob("data/B/*/prompts.jsonl")):
        for rec in store.iter_jsonl(f):
            yield from (m.get("content") or "" for m in rec.get("messages", []))
    for pattern, key in (("data/A/*/records.jsonl", "input_ids"), ("infer/*/responses.jsonl", "output_ids")):
        for f in sorted(run_dir.glob(pattern)):
            ids = [rec[key] for rec in store.iter_jsonl(f)]
            for i in range(0, len(ids), batch):
                yield from tokenizer.batch_decode(ids[i : i + batch], skip_special_tokens=True)


def refuse_contaminated(run_dir: Path, tallies: dict, tokenizer, max_share: float = 0.5) -> None:
    """No eval prompt may be in the run's training data (A records, B prompts, 03's answers): per set the
    prompts sharing a 13-word passage with it are counted in its tally (`in_training`, `evalsets.overlap`); one
    whose passages are mostly there (>= max_share) stops the stage, naming set, prompt and share."""
    texts = {}
    for name, t in tallies.items():
        for r in t.pop("rows", []):
            texts[(name, r["id"])] = r["message"]
            texts |= {(name, f"{r['id']}#t{k}"): turn for k, turn in enumerate(r.get("later_turns", []), 2)}
    if not texts:
        return
    shares = overlap(texts, training_texts(run_dir, tokenizer))
    for name, t in tallies.items():
        t["in_training"] = {rid: round(v, 3) for (n, rid), v in shares.items() if n == name and v > 0}
    bad = [(n, rid, v) for (n, rid), v in shares.items() if v >= max_share]
    if bad:
        raise ValueError(
            f"06: {len(bad)} eval prompt(s) are in this run's training data ({run_dir / 'data'}, infer/): "
            + "; ".join(f"{n} {rid} ({v:.0%} of its 13-word passages)" for n, rid, v in bad[:5])
            + " - drop those rows from the training sources, or measure on another set"
        )


# --- the run's own held-out prompts (06 and 07 decode the same ones) ---------------------------------------
def a_prompt_ids(rec: dict, mode: str) -> list[int] | None:
    """Prompt of an A record: tokens before the first / the last run of loss-masked tokens (None if none)."""
    mask = rec["loss_mask"]
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    start = (starts[0] if mode == "first_turn" else starts[-1]) if starts else 0
    return list(rec["input_ids"][:start]) if start else None


def heldout_prompts(
    run_dir: str | Path, percent: float, per_dataset: int, max_prompt_tokens: int, a_prompt: str = "last_turn"
) -> tuple[dict[str, list[Prompt]], dict]:
    """Held-out prompts per dataset (A records and B prompts whose split key is held out, `store.split_key`),
    at most ``per_dataset`` each, none longer than ``max_prompt_tokens``; and the read/kept/dropped tally."""
    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("data/A/*/records.jsonl")) + sorted(run_dir.glob("data/B/*/prompts.jsonl"))
    names = [f.parent.name for f in files]
    out: dict[str, list[Prompt]] = {}
    tally = {"read": 0, "kept": 0, "dropped": Counter(), "rejected": 0}
    for f in files:
        kind, ds = f.parent.parent.name, f.parent.name
        label = ds if names.count(ds) == 1 else f"{kind}/{ds}"
        kept = out.setdefault(label, [])
        for n, rec in enumerate(store.iter_jsonl(f), 1):
            tally["read"] += 1
            try:
                held = store.is_heldout(store.split_key(rec), percent)
                ids = (
                    (a_prompt_ids(rec, a_prompt) if kind == "A" else list(rec["prompt_ids"]))
                    if held
                    else None
                )
            except (KeyError, TypeError, IndexError) as e:
                raise store.RecordError(f"{f}: record {n} (id {rec.get('id')!r}): malformed, {e!r}") from None
            why = (
                "not_heldout" if not held else "no_prompt" if not ids
                else "too_long" if len(ids) > max_prompt_tokens else "over_cap" if len(kept) >= per_dataset else None
            )  # fmt: skip
            if why:
                tally["dropped"][why] += 1
                continue
            kept.append(Prompt(str(rec["id"]), label, ids))
            tally["kept"] += 1
    tally["dropped"] = dict(tally["dropped"])
    return {k: v for k, v in out.items() if v}, tally
