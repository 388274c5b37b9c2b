"""03's multi-turn regeneration (02 ``turn: each_turn``): every turn of a conversation answered by the target,
exactly once per (conversation, turn), resumable after a crash.

The state of a conversation is never stored apart from its answers: it is REPLAYED from the committed turn
records (``responses.jsonl``, one record per answered turn, id ``<conversation>#<turn>``, fields
``conversation`` and ``turn``). Replaying turn k checks that the committed record's prompt_ids equal the
history rebuilt from turns < k (the target's own answers, parsed and rendered with its chat template; an
answer whose prompt opened the think block is parsed as starting inside its reasoning), then
applies the continue/stop rule of `eagle_lib.data.multiturn` to its answer. So after a SIGKILL the next run
finds every conversation at its last committed turn and asks only for the next one: no turn is generated twice
(its record is committed before the next turn exists) and none is skipped (the next turn is derived from it).

Rounds: all conversations' pending turns go to the engine together (one `generate` call per round: the engine
batches them), then the next round is replayed from the files. A turn that fails is not retried in the same run;
its conversation stops there this run (``error``) and is continued by the next run when ``retry_errors``.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from eagle_lib import store
from eagle_lib.data import multiturn
from eagle_lib.data.chat import ChatError
from eagle_lib.engines.resume import InferError, stale_reason


@dataclass
class Pending:
    id: str  # the turn record id
    conversation: str
    turn: int
    prompt_ids: list[int]
    source: str

    def request(self) -> dict:
        """03's pending-prompt dict; `extra` goes into the committed record."""
        return {"id": self.id, "prompt_ids": self.prompt_ids, "source": self.source,
                "extra": {"conversation": self.conversation, "turn": self.turn}}  # fmt: skip


def encoder_for(prompts_dir: Path, tokenizer, stop: list[int]):
    """(ChatEncoder with 02's template kwargs, the stop ids as text: the end of an answer to strip)."""
    from eagle_lib.data.chat import ChatEncoder

    meta = prompts_dir / "meta.json"
    kwargs = store.read_json(meta).get("params", {}).get("chat_template_kwargs", {}) if meta.exists() else {}
    return ChatEncoder(tokenizer, kwargs), [tokenizer.decode([i], skip_special_tokens=False) for i in stop]


def files_of(ds_dir: Path) -> list[Path]:
    return [ds_dir / "responses.jsonl", *sorted(ds_dir.glob("shards/*/responses.jsonl"))]


def load(files: list[Path], convs: dict[str, dict], sampling: dict, target, stop: list[int]):
    """(turn id -> (record, file), [(file, record, reason)] stale, duplicate lines ignored)."""
    done: dict[str, tuple[dict, Path]] = {}
    stale, dups = [], 0
    for f in files:
        for rec in store.iter_jsonl(f) if f.exists() else ():
            conv = rec.get("conversation")
            if conv not in convs or not isinstance(rec.get("turn"), int):
                stale.append((f, rec, "its conversation is not in prompts.jsonl"))
                continue
            if why := stale_reason(rec, {rec["id"]: rec}, sampling, target, stop):
                stale.append((f, rec, why))
            elif rec["id"] in done:
                dups += 1
            else:
                done[rec["id"]] = (rec, f)
    return done, stale, dups


def opens_think(encoder, prompt_ids: list[int]) -> bool:
    """Whether this prompt ends inside an open think block (Kimi-K2.5's generation prompt ends with <think>)."""
    return multiturn.opens_think(encoder.tok.decode(prompt_ids[-8:], skip_special_tokens=False))


def replay(convs: dict[str, dict], done: dict[str, tuple], encoder, stop_strings: list[str]):
    """(pending turns, stop reason per finished conversation, committed ids that the replay does not reach).

    A committed turn whose prompt_ids differ from the replayed history (other prompts, another template) is
    not reached: it and the conversation's later turns are stale, and the conversation resumes from it.
    """
    pending: list[Pending] = []
    stopped: dict[str, str] = {}
    reached: set[str] = set()
    for cid, conv in convs.items():
        msgs, ids, k = list(conv["messages"]), list(conv["prompt_ids"]), 0
        follow = conv.get("followups") or []
        while True:
            rid = multiturn.turn_id(cid, k)
            got = done.get(rid)
            if got is None or got[0]["prompt_ids"] != ids:
                pending.append(Pending(rid, cid, k, ids, conv.get("source", "")))
                break
            rec = got[0]
            reached.add(rid)
            answer = multiturn.parse_answer(rec["text"], stop_strings, opens_think(encoder, ids))
            more, why = multiturn.next_turn(
                answer, rec["finish_reason"], follow[k] if k < len(follow) else None
            )
            if more is None:
                stopped[cid] = why
                break
            msgs = msgs + [answer] + more
            try:
                ids = encoder.encode_prompt(msgs, conv.get("tools"))
            except ChatError:
                stopped[cid] = "unrenderable"
                break
            if len(ids) > conv.get("max_prompt_tokens", 1 << 62):
                stopped[cid] = "too_long"
                break
            k += 1
    return pending, stopped, set(done) - reached


def set_aside(
    ds_dir: Path, files: list[Path], bad: dict[Path, set[str]], stale_lines: dict[Path, list]
) -> int:
    """Move stale records to <dataset>/stale.jsonl (appended first, then each file replaced atomically)."""
    n = 0
    for f in files:
        ids, lines = bad.get(f, set()), stale_lines.get(f, [])
        if not ids and not lines:
            continue
        keep, moved = [], list(lines)
        for rec in store.iter_jsonl(f):
            if any(rec is r or rec == r for r in lines):
                continue
            (moved if rec.get("id") in ids else keep).append(rec)
        store.append_jsonl(ds_dir / "stale.jsonl", moved)
        tmp = f.with_suffix(".jsonl.tmp")
        tmp.unlink(missing_ok=True)
        store.append_jsonl(tmp, keep)
        tmp.touch()
        os.replace(tmp, f)
        n += len(moved)
    return n


def check_stale(ds_dir, files, done, unreached, stale, on_stale: str) -> int:
    """Stop naming the first stale record (on_stale "error") or set them all aside; returns how many moved."""
    if not stale and not unreached:
        return 0
    if on_stale != "set_aside":
        f, rec, why = stale[0] if stale else (done[min(unreached)][1], done[min(unreached)][0], "")
        why = (
            why
            or "its prompt_ids differ from the history replayed from the earlier turns (or it follows a stop)"
        )
        raise InferError(f"{f}: record {rec.get('id')!r} is stale: {why}. Set on_stale: set_aside, move {ds_dir} "
                         "away or restore the params that made it (nothing was deleted).")  # fmt: skip
    bad: dict[Path, set[str]] = {}
    for rid in unreached:
        bad.setdefault(done[rid][1], set()).add(rid)
    lines: dict[Path, list] = {}
    for f, rec, _ in stale:
        lines.setdefault(f, []).append(rec)
    return set_aside(ds_dir, files, bad, lines)


def run_conversations(convs: dict[str, dict], ds_dir: Path, out_dir: Path, encoder, stop_strings: list[str],
                      sampling: dict, target, stop: list[int], generate, on_stale: str = "error",
                      retry_errors: bool = True, merge: bool = True) -> dict:  # fmt: skip
    """Answer every turn of `convs` (id -> 02 prompt record with followups); `generate(pending)` runs one round
    through the engine and commits its turn records (with `conversation` and `turn`) to out_dir. Returns counters."""
    from eagle_lib.engines.resume import error_ids, merge_shards

    files = files_of(ds_dir)
    done, stale, dups = load(files, convs, sampling, target, stop)
    _, _, unreached = replay(convs, done, encoder, stop_strings)
    moved = check_stale(ds_dir, files, done, unreached, stale, on_stale)
    if moved:
        done, _, dups = load(files, convs, sampling, target, stop)
    merged = 0
    if merge:
        dmap = {rid: {"file": f} for rid, (_, f) in done.items()}
        merged = merge_shards(ds_dir, dmap)
    resumed = len(done)
    failed_before, tried = set(error_ids(ds_dir)), set()
    stats: Counter = Counter()
    rounds = 0
    while True:
        done, _, _ = load(files, convs, sampling, target, stop)
        pending, stopped, unreached = replay(convs, done, encoder, stop_strings)
        if unreached:
            raise InferError(
                f"{ds_dir}: {len(unreached)} committed turn(s) no longer follow from their history"
            )
        todo = [x for x in pending if x.id not in tried and (retry_errors or x.id not in failed_before)]
        if not todo:
            break
        rounds += 1
        tried |= {x.id for x in todo}
        stats.update(generate(todo))
    for x in pending:
        stopped[x.conversation] = "error"
    turns = Counter(rec["turn"] for rec, _ in done.values())
    return {
        "stats": dict(stats), "done": done, "stopped": stopped, "resumed_turns": resumed, "merged_from_shards": merged,
        "duplicates_ignored": dups, "set_aside": moved, "rounds": rounds,
        "turns_by_index": {str(k): turns[k] for k in sorted(turns)},
    }  # fmt: skip


def meta(res: dict, convs: dict[str, dict], errors: dict[str, dict]) -> dict:
    """A dataset's meta counts conversations (read = kept + rejected: turn 0 answered or failed) and turns."""
    recs = [r for r, _ in res["done"].values()]
    answered = {r["conversation"] for r in recs}
    rejected = [c for c in convs if c not in answered]
    n_out = [r["n_output_tokens"] for r in recs]
    st = {"generated": 0, "errors": 0, "generated_tokens": 0, "retries": 0, "generate_seconds": 0.0} | res[
        "stats"
    ]
    st["tokens_per_s"] = round(st["generated_tokens"] / max(st["generate_seconds"], 1e-9), 2)
    why = [errors.get(multiturn.turn_id(c, 0), {}).get("reason", "error") for c in rejected]
    return {
        "read": len(convs), "kept": len(answered), "dropped": {}, "rejected": len(rejected), "regenerate": "each_turn",
        "errors_by_reason": dict(Counter(why)), "turns": len(recs), "turns_by_index": res["turns_by_index"],
        "stopped": dict(Counter(res["stopped"].values())),
        "finish_reason": dict(Counter(r["finish_reason"] for r in recs)), "output_tokens": sum(n_out),
        "mean_output_tokens": round(sum(n_out) / max(len(n_out), 1), 2), "max_output_tokens": max(n_out, default=0),
        "resumed": res["resumed_turns"], "merged_from_shards": res["merged_from_shards"], "rounds": res["rounds"],
        "duplicates_ignored": res["duplicates_ignored"], "set_aside": res["set_aside"], **st,
    }  # fmt: skip


def stops_table(meta: dict):
    """03's each_turn datasets: conversations, turns answered (by turn index) and why each conversation ended."""
    import pandas as pd

    rows = [
        {"dataset": n, "conversations": m["kept"], "turns": m["turns"],
         **{f"turn_{k}": v for k, v in m["turns_by_index"].items()}, **{f"stop_{k}": v for k, v in m["stopped"].items()}}
        for n, m in meta["datasets"].items() if m.get("regenerate") == "each_turn"
    ]  # fmt: skip
    if not rows:
        return "no each_turn dataset in this run (02 turn: first / last)"
    df = pd.DataFrame(rows).fillna(0)
    return df.astype({c: int for c in df.columns if c != "dataset"})
