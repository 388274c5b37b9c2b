"""Multi-turn regeneration (02 turn: each_turn, 03, 05): the turn split, the continue/stop rule, history fed back
with the target's template, exactly once per (conversation, turn) across SIGKILLs, and 05's merged masks."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from eagle_lib import extract, infer, models, params, store
from eagle_lib.data import batches, multiturn
from eagle_lib.data.chat import ChatEncoder
from eagle_lib.engines.base import Request, Sampling
from eagle_lib.engines.embedded import EmbeddedEngine
from eagle_lib.pipeline import REPO_ROOT
from tests.support import slow_append

torch.set_num_threads(1)
NEW = 128  # toy answers are 40-120 tokens: most turns stop, some hit the limit (the "length" stop)
NON_ASCII = "tëst ✓"


def call(name: str, args: str, idx: int = 0) -> dict:
    return {
        "id": f"functions.{name}:{idx}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


TOOL_CONV = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Price of MSFT?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("get_price", '{"symbol": "MSFT", "ccy": "USD"}')],
    },
    {"role": "tool", "tool_call_id": "functions.get_price:0", "content": '{"price": 1}'},
    {"role": "assistant", "content": "It is 1."},
    {"role": "user", "content": "And AAPL?"},
    {"role": "assistant", "content": "Let me check."},
]


def test_split_turns_and_the_continue_or_stop_rule():
    first, follow = multiturn.split_turns(TOOL_CONV)
    assert first == TOOL_CONV[:2] and len(follow) == 2
    assert follow[0] == {"calls": TOOL_CONV[2]["tool_calls"], "messages": [TOOL_CONV[3]]}
    assert follow[1] == {"calls": [], "messages": [TOOL_CONV[5]]}
    same = {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("get_price", '{ "ccy":"USD","symbol":"MSFT"}', 7)],
    }
    more, why = multiturn.next_turn(same, "stop", follow[0])  # equal after JSON normalisation
    assert why == "" and more == [TOOL_CONV[3] | {"tool_call_id": "functions.get_price:7"}]  # the target's id
    other = {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("get_price", '{"symbol": "AAPL", "ccy": "USD"}')],
    }
    assert multiturn.next_turn(other, "stop", follow[0]) == (None, "tool_call_mismatch")
    assert multiturn.next_turn({"role": "assistant", "content": "no"}, "stop", follow[0]) == (
        None,
        "tool_call_mismatch",
    )
    assert multiturn.next_turn(same, "stop", follow[1]) == (
        None,
        "tool_call_mismatch",
    )  # a call the source lacks
    assert multiturn.next_turn({"role": "assistant", "content": "ok"}, "stop", follow[1]) == (
        [TOOL_CONV[5]],
        "",
    )
    assert multiturn.next_turn({"role": "assistant", "content": "ok"}, "length", follow[1]) == (
        None,
        "length",
    )
    assert multiturn.next_turn({"role": "assistant", "content": "ok"}, "stop", None) == (None, "complete")
    assert multiturn.split_turns([{"role": "system", "content": "x"}]) is None
    ends_on_user = TOOL_CONV[:6]
    assert len(multiturn.split_turns(ends_on_user)[1]) == 2  # its last user turn is answered too


def test_parse_answer_splits_reasoning_whether_the_prompt_or_the_answer_opened_the_think_block():
    """Kimi-K2.5's prompt ends with <think> (the answer starts inside the reasoning); the toy's model writes
    <think> itself; a template without thinking gives plain content. The reasoning never lands in the content."""
    want = {"role": "assistant", "content": "It is 5 C.", "reasoning_content": "Look it up."}
    stop = ["<|im_end|>"]
    assert multiturn.parse_answer("Look it up.</think>It is 5 C.<|im_end|>", stop, think_open=True) == want
    assert multiturn.parse_answer("<think>Look it up.</think>It is 5 C.<|im_end|>", stop) == want
    assert multiturn.parse_answer("It is 5 C.<|im_end|>", stop) == {
        "role": "assistant",
        "content": "It is 5 C.",
    }
    assert multiturn.parse_answer("</think>It is 5 C.", stop, think_open=True) == {
        "role": "assistant",
        "content": "It is 5 C.",
    }  # an empty reasoning
    calls = multiturn.parse_answer(
        "Call it.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_price:0"
        '<|tool_call_argument_begin|>{"symbol": "MSFT"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        stop,
        think_open=True,
    )
    assert calls == {"role": "assistant", "content": "", "reasoning_content": "Call it.",
                     "tool_calls": [call("get_price", '{"symbol": "MSFT"}')]}  # fmt: skip


def test_an_answer_whose_think_block_never_closes_is_not_replayed():
    """Cut at max_new_tokens inside the reasoning (or stopped there): no message to replay, so the conversation
    stops (length, unparsable) instead of feeding half a reasoning back as the answer's content."""
    follow = {"calls": [], "messages": [{"role": "user", "content": "And then?"}]}
    for text, think_open in [("Still thinking about", True), ("<think>Still thinking about", False)]:
        assert multiturn.parse_answer(text, ["<|im_end|>"], think_open=think_open) is None
        assert multiturn.parse_answer(text + "<|im_end|>", ["<|im_end|>"], think_open=think_open) is None
    assert multiturn.next_turn(None, "length", follow) == (None, "length")
    assert multiturn.next_turn(None, "stop", follow) == (None, "unparsable")
    assert multiturn.next_turn(None, "stop", None) == (None, "complete")


def test_opens_think_reads_the_end_of_the_prompt():
    assert multiturn.opens_think("<|im_assistant|>assistant<|im_middle|><think>")  # Kimi-K2.5
    assert multiturn.opens_think("<|im_start|>assistant\n<think>\n")  # opened, then a newline
    assert not multiturn.opens_think("<|im_assistant|>assistant<|im_middle|>")  # the toy: the model writes it
    assert not multiturn.opens_think("<|im_middle|><think></think>")  # Kimi-K2.5 with thinking: false
    assert not multiturn.opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, no thinking


@pytest.fixture(scope="module")
def toy():
    shared = params.SharedParams(target="toy://target", num_workers=1, max_new_tokens=NEW)
    tok = models.load_tokenizer(shared)
    return shared, tok, ChatEncoder(tok)


@pytest.mark.slow
def test_parse_answer_inverts_the_template(toy):
    _, _, enc = toy
    msg = {"role": "assistant", "content": "Sure.", "reasoning_content": "think ✓",
           "tool_calls": [call("f", '{"a": 1}'), call("g", "{}", 1)]}  # fmt: skip
    user = [{"role": "user", "content": "hi"}]
    text = enc.render(user + [msg])[len(enc.render(user, add_generation_prompt=True)) :]
    assert text.endswith("<|im_end|>")
    assert multiturn.parse_answer(text, ["<|im_end|>"]) == msg


def extract_each_turn(run: Path, shared, names=("glaive", "ultrachat", "sharegpt"), n=8) -> None:
    ds = [
        extract.BSource(name=x, path=f"toy://data/{x}", adapter=x, max_prompts=n, turn="each_turn")
        for x in names
    ]
    extract.run(
        params.StageConfig("02_extract_B", run, shared, extract.Params(datasets=ds, max_seq_len=2048))
    )


def infer_cfg(run: Path, shared, **stage) -> params.StageConfig:
    return params.StageConfig("03_infer", run, shared, infer.Params(**({"progress": False} | stage)))


@pytest.fixture(scope="module")
def answered(toy, tmp_path_factory):
    shared, _, _ = toy
    run = tmp_path_factory.mktemp("mt") / "run"
    extract_each_turn(run, shared)
    return run, infer.run(infer_cfg(run, shared))


@pytest.mark.slow
def test_every_turn_answered_with_its_own_history(toy, answered):
    """Turn k's prompt is the template's render of the source turns with the target's own earlier answers; each
    output is the target's greedy answer to exactly that prompt (an independent one-at-a-time engine)."""
    shared, tok, enc = toy
    run, meta = answered
    m = meta["datasets"]["glaive"]
    assert m["regenerate"] == "each_turn" and m["read"] == m["kept"] + m["rejected"]
    assert sum(m["stopped"].values()) == m["kept"] and set(m["stopped"]) <= {
        "complete",
        "length",
        "tool_call_mismatch",
        "too_long",
        "unparsable",
    }
    later = 0
    for name in ("glaive", "ultrachat", "sharegpt"):
        convs = {c["id"]: c for c in store.read_jsonl(run / f"data/B/{name}/prompts.jsonl")}
        recs = store.read_jsonl(run / f"infer/{name}/responses.jsonl")
        assert Counter(r["id"] for r in recs).most_common(1)[0][1] == 1  # each (conversation, turn) once
        by = {(r["conversation"], r["turn"]): r for r in recs}
        for (cid, k), r in by.items():
            c, msgs = convs[cid], list(convs[cid]["messages"])
            for j in range(k):  # rebuild the history the target was given
                prev = by[(cid, j)]
                assert prev["finish_reason"] == "stop"
                ans = multiturn.parse_answer(prev["text"], ["<|im_end|>"])
                assert multiturn.calls_match(ans.get("tool_calls") or [], c["followups"][j]["calls"])
                ids = iter(tc["id"] for tc in ans.get("tool_calls") or [])
                msgs += [ans] + [m | {"tool_call_id": next(ids)} if m["role"] == "tool" else m
                                 for m in c["followups"][j]["messages"]]  # fmt: skip
            assert r["prompt_ids"] == tok.encode(enc.render(msgs, c["tools"], True), add_special_tokens=False)
            later += k > 0
        # the last turn of each conversation stopped for the reason meta counts
    assert later >= 5, "too few later turns to test history feeding"
    model = models.load_target(shared)
    eng = EmbeddedEngine(
        model,
        Sampling(max_new_tokens=NEW, stop_token_ids=tuple(meta["datasets"]["glaive"]["stop_token_ids"])),
        batch_size=1,
    )
    sample = [r for r in store.read_jsonl(run / "infer/glaive/responses.jsonl") if r["turn"] > 0][:3]
    ref = {x.id: x.output_ids for x in eng.generate([Request(r["id"], r["prompt_ids"]) for r in sample])}
    assert ref == {r["id"]: r["output_ids"] for r in sample}


def reference_mask(tok, enc, seq_ids: list[int], turns: list[dict], conv: dict) -> list[int]:
    """The slow prefix-by-prefix method: every turn's generation prompt rendered from the messages, its answer's
    characters located after it in the decoded sequence, tokens inside those character spans -> 1."""
    text = tok.decode(seq_ids, skip_special_tokens=False)
    spans, msgs = [], list(conv["messages"])
    for k, r in enumerate(turns):
        prompt = enc.render(msgs, conv["tools"], add_generation_prompt=True)
        answer = tok.decode(r["output_ids"], skip_special_tokens=False)
        if text.startswith(prompt + answer):  # the turn as the target wrote it, right after its prompt
            spans.append((len(prompt), len(prompt) + len(answer)))
        if k + 1 < len(turns):
            ans = multiturn.parse_answer(answer, ["<|im_end|>"])
            more, _ = multiturn.next_turn(ans, r["finish_reason"], conv["followups"][k])
            msgs += [ans] + more
    mask, pos = [], 0
    for t in seq_ids:
        piece = tok.decode([t], skip_special_tokens=False)
        mask.append(int(any(a <= pos and pos + len(piece) <= b for a, b in spans)))
        pos += len(piece)
    return mask


@pytest.mark.slow
def test_05_trains_each_conversation_once_with_every_answer_masked(toy, answered):
    _, tok, enc = toy
    run, _ = answered
    train, held, tally = batches.load_sequences(run, 0.0, 4096)
    merged = [s for s in train if multiturn.SEP in s.id]
    n_turns = sum(
        len(store.read_jsonl(run / f"infer/{n}/responses.jsonl")) for n in ("glaive", "ultrachat", "sharegpt")
    )
    assert len(merged) == tally.read and len(merged) < n_turns  # some conversations hold several turns in one
    for name in ("glaive", "ultrachat"):
        convs = {c["id"]: c for c in store.read_jsonl(run / f"data/B/{name}/prompts.jsonl")}
        recs = store.read_jsonl(run / f"infer/{name}/responses.jsonl")
        for rec, ids, mask in multiturn.training_records(recs):
            own = sorted(
                (r for r in recs if r["conversation"] == rec["conversation"]), key=lambda r: r["turn"]
            )
            inside = [r for r in own if r["turn"] in rec["turns"]]
            assert sum(mask) == sum(
                r["n_output_tokens"] for r in inside
            )  # every answer of these turns, only them
            assert mask == reference_mask(
                tok, enc, ids, own[: max(rec["turns"]) + 1], convs[rec["conversation"]]
            )
    assert any(len(rec["turns"]) > 1 for n in ("glaive", "ultrachat") for rec, _, _ in
               multiturn.training_records(store.read_jsonl(run / f"infer/{n}/responses.jsonl")))  # fmt: skip


@pytest.mark.slow
def test_sigkill_mid_conversation_resumes_each_turn_exactly_once(toy, answered, tmp_path):
    shared, _, _ = toy
    ref_run, _ = answered
    run = tmp_path / "run"
    src = ref_run / "data/B/glaive/prompts.jsonl"
    convs = [c | {"source": NON_ASCII} for c in store.read_jsonl(src)]
    store.append_jsonl(run / "data/B/glaive/prompts.jsonl", convs)
    (run / "data/B/glaive/meta.json").write_bytes((src.parent / "meta.json").read_bytes())
    pfile = tmp_path / "kill.yaml"
    sh = {"target": "toy://target", "num_workers": 1, "max_new_tokens": NEW}
    stage = {"datasets": ["glaive"], "write_every": 1, "progress": False, "batch_size": 4}
    pfile.write_text(yaml.safe_dump({"run_name": "kill", "shared": sh, "stages": {"03_infer": stage}}))
    out, env = run / "infer/glaive/responses.jsonl", {**os.environ, "OMP_NUM_THREADS": "1"}
    slow = [sys.executable, "-m", "tests.support.slow_append", str(pfile), "--run-dir", str(run)]
    first = slow_append.kill_mid_write(slow, out, env, cwd=REPO_ROOT)  # during the first round
    assert first["turn"] == 0
    # mid-conversation: killed while writing a later turn's answer
    later = slow_append.kill_mid_write(slow, out, env, lambda data, rec: rec["turn"] > 0, cwd=REPO_ROOT)
    before = [json.loads(x) for x in out.read_bytes().split(b"\n")[:-1]]
    committed = {(r["conversation"], r["turn"]) for r in before}
    assert (later["conversation"], later["turn"] - 1) in committed  # its earlier turn was committed ...
    assert (later["conversation"], later["turn"]) not in committed  # ... and this one was torn
    meta = infer.run(infer_cfg(run, shared, datasets=["glaive"], write_every=1, batch_size=4))["datasets"][
        "glaive"
    ]
    recs = store.read_jsonl(out)
    ref = {r["id"]: r["output_ids"] for r in store.read_jsonl(ref_run / "infer/glaive/responses.jsonl")}
    assert Counter(r["id"] for r in recs) == Counter(
        list(ref)
    )  # every turn once: none lost, none generated twice
    assert {r["id"]: r["output_ids"] for r in recs} == ref  # the same answers as the uninterrupted run
    assert meta["resumed"] == len(before) and meta["generated"] == len(ref) - len(before)
    assert meta["duplicates_ignored"] == 0


@pytest.mark.slow
def test_first_turns_cut_a_merged_conversation_to_its_turn_0(answered):
    """07's single-turn view (regenerated vs original, multi vs single): turn 0's own record, named by its
    conversation; later sequences dropped."""
    from eagle_lib.data import subsets

    run, _ = answered
    recs = store.read_jsonl(run / "infer/glaive/responses.jsonl")
    seqs = [batches.Sequence(r["id"], ids, mask) for r, ids, mask in multiturn.training_records(recs)]
    firsts = {s.id: s for s in subsets.first_turns(seqs)}
    zero = {r["conversation"]: r for r in recs if r["turn"] == 0}
    assert set(firsts) == set(zero)
    for cid, r in zero.items():
        assert firsts[cid].input_ids == r["prompt_ids"] + r["output_ids"]
        assert firsts[cid].loss_mask == [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"])
