"""The mini-Kimi world's parts that need no trained target: its remote-code tiktoken tokenizer (Kimi's ids, Kimi's
layout, masks exact against tiktoken itself), its chat template (Kimi-K2.5's generation prompt and history rule)
and the each_turn histories replayed with it, the hub-layout folders, and the compact-head expansion."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import tiktoken
import torch
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from eagle_lib.data import chat, multiturn
from eagle_lib.engines import turns
from eagle_lib.toy import datasets, kimi_data, kimi_tokenizer, mini_kimi, target
from eagle_lib.toy.kimi_remote import tokenization_kimi
from tests.support import templates as T

# Kimi-K2.5's special ids as the shared reference lists them (eagle3-facts.md), typed in, not derived
KIMI_IDS = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
            "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
            "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
            "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
            "<think>": 163606, "</think>": 163607, "<|media_pad|>": 163605, "[PAD]": 163839}  # fmt: skip


def convs(n: int = 12) -> list[dict]:
    mix = {"chat": n, "tool": n, "reasoning": max(1, n // 4), "code": max(1, n // 4), "swe": 1}
    return datasets.native_conversations(7, mix, "test")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, list[bytes]]:
    out = tmp_path_factory.mktemp("mini_kimi_tok")
    corpus = [s for c in convs(40) for s in datasets.string_leaves(c)]
    ranks = kimi_tokenizer.train_ranks(corpus, 1500)
    kimi_tokenizer.write_tokenizer(out, ranks, 8192)
    return out, ranks


@pytest.fixture(scope="module")
def tok(built):
    return AutoTokenizer.from_pretrained(str(built[0]), trust_remote_code=True)


@pytest.fixture(scope="module")
def reference(built) -> tiktoken.Encoding:
    """tiktoken itself over the same ranks and specials: the independent encoder the HF class must agree with."""
    ranks = tokenization_kimi.load_ranks(str(built[0] / "tiktoken.model"))
    return tiktoken.Encoding(name="ref", pat_str=tokenization_kimi.PAT_STR, mergeable_ranks=ranks,
                             special_tokens=kimi_tokenizer.special_names())  # fmt: skip


def test_loads_as_remote_code_with_kimis_vocabulary_and_special_ids(tok):
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    assert len(tok) == 163840
    assert {name: tok.convert_tokens_to_ids(name) for name in KIMI_IDS} == KIMI_IDS
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (163584, 163585, 163839)
    assert tok.chat_template == kimi_tokenizer.MINI_KIMI_TEMPLATE


def test_encoding_equals_tiktoken_and_round_trips(tok, reference):
    for c in convs():
        text = target.render(tok, c["messages"], c["tools"])
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == reference.encode(text, allowed_special="all")
        assert tok.decode(ids) == text


def test_ids_above_the_trained_bpe_are_unreachable(tok, built, reference):
    _, ranks = built
    seen = {i for c in convs() for i in tok(target.render(tok, c["messages"], c["tools"]))["input_ids"]}
    assert max(i for i in seen if i < 163584) < len(ranks)
    pad = reference.decode_single_token_bytes(len(ranks) + 5)
    assert pad.startswith(b"\xff\xff")  # 0xFF is no UTF-8 byte: no text encodes to it
    with pytest.raises(UnicodeDecodeError):
        pad.decode("utf-8")


def marked_template() -> str:
    """The mini-Kimi template with generation markers: what the model writes starts after the <think> that the
    generation prompt wrote (the toy's marked copy, given mini-Kimi's edits, its marker moved past <think>)."""
    t = kimi_tokenizer.kimi_template(T.kimi_marked())
    old = "assistant<|im_middle|>" + T.G + "<think>"
    assert t.count(old) == 1
    return t.replace(old, "assistant<|im_middle|><think>" + T.G)


def test_marked_copy_renders_exactly_like_the_mini_kimi_template(tok):
    plain = T.strip_markers(marked_template())
    for c in convs():
        want = tok.apply_chat_template(c["messages"], tools=c["tools"] or None, tokenize=False)
        got = render_jinja_template(
            conversations=[c["messages"]], tools=c["tools"] or None, chat_template=plain
        )
        assert got[0][0] == want


def test_chat_masks_are_exact_against_tiktoken_offsets(tok, reference):
    """Loss masks through the slow-tokenizer path equal the reference: the marked template's generation blocks,
    tokens located by tiktoken's own decode_with_offsets. The <think> of the generation prompt is not trained:
    the model never writes it."""
    enc, n, marked = chat.ChatEncoder(tok), 0, marked_template()
    for c in convs():
        got = enc.encode(c["messages"], c["tools"])
        texts, spans = render_jinja_template(conversations=[c["messages"]], tools=c["tools"] or None,
                                             chat_template=marked, return_assistant_tokens_mask=True)  # fmt: skip
        text, spans = texts[0], [(a, b) for a, b in spans[0] if b > a]
        ids = reference.encode(text, allowed_special="all")
        _, starts = reference.decode_with_offsets(ids)
        ends = starts[1:] + [len(text)]
        mask = [
            int(s < e and any(a <= s and e <= b for a, b in spans)) for s, e in zip(starts, ends, strict=True)
        ]
        assert (got.input_ids, got.loss_mask) == (ids, mask)
        n += sum(mask)
        runs = [i for i in range(1, len(ids)) if mask[i] and not mask[i - 1]]
        assert runs and all(ids[i - 1] == KIMI_IDS["<think>"] for i in runs)  # the prompt's, untrained
    assert n > 1000


# ---------------------------------------------------------------- thinking as Kimi-K2.5's template does

U, A = "<|im_user|>user<|im_middle|>", "<|im_assistant|>assistant<|im_middle|>"
CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>')  # fmt: skip
RESULT = "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n5 C<|im_end|>"
WEATHER = {"id": "functions.get_weather:0", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
# a conversation 02 (turn: each_turn) makes: the first prompt, then what follows each of the target's answers
CONV = {"messages": [{"role": "user", "content": "Weather?"}], "tools": None, "source": "test",
        "followups": [{"calls": [], "messages": [{"role": "user", "content": "Oslo"}]},
                      {"calls": [WEATHER], "messages": [{"role": "tool", "tool_call_id": "", "content": "5 C"}]},
                      {"calls": [], "messages": [{"role": "user", "content": "And Rome?"}]}]}  # fmt: skip


def test_generation_prompt_opens_the_think_block_as_kimis_does(tok):
    """Kimi-K2.5's chat_template.jinja ends the generation prompt with <think> (<think></think> with
    thinking: false): its answers start inside the reasoning. The texts are typed in."""
    hi = [{"role": "user", "content": "Hi"}]
    assert (
        tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=False)
        == f"{U}Hi<|im_end|>{A}<think>"
    )
    no_thinking = tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=False, thinking=False)
    assert no_thinking == f"{U}Hi<|im_end|>{A}<think></think>"
    ids = tok.apply_chat_template(hi, add_generation_prompt=True, return_dict=False)
    assert ids[-2:] == [KIMI_IDS["<|im_middle|>"], KIMI_IDS["<think>"]]


def test_history_keeps_reasoning_only_in_the_current_tool_chain(tok):
    """Kimi-K2.5's rule: no reasoning up to the last answer without tool calls; the tool calls after it keep
    theirs. A final message keeps its own (the renders the target is trained on)."""
    ask = {"role": "assistant", "content": "Which city?", "reasoning_content": "Ask which."}
    calls = {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [WEATHER]}
    msgs = [{"role": "user", "content": "Weather?"}, ask, {"role": "user", "content": "Oslo"}]
    tool = {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "5 C"}

    def prompt(m):
        return tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)

    history = f"{U}Weather?<|im_end|>{A}<think></think>Which city?<|im_end|>{U}Oslo<|im_end|>"
    assert prompt(msgs) == f"{history}{A}<think>"
    assert (
        prompt(msgs + [calls, tool])
        == f"{history}{A}<think>Call it.</think>{CALL}<|im_end|>{RESULT}{A}<think>"
    )
    final = tok.apply_chat_template(msgs[:2], tokenize=False)
    assert final == f"{U}Weather?<|im_end|>{A}<think>Ask which.</think>Which city?<|im_end|>"


def answer_turns(enc, conv: dict, answers: list[tuple[str, str]]):
    """03's each_turn loop without an engine: replay the committed turns, commit the pending turn's record with
    the next (text, finish_reason), again; returns (records, pending, stopped) of the last replay."""
    done: dict = {}
    recs: list[dict] = []
    convs = {"c": conv | {"prompt_ids": enc.encode_prompt(conv["messages"], conv["tools"])}}
    for text, finish in answers:
        pending, stopped, _ = turns.replay(convs, done, enc, ["<|im_end|>"])
        assert not stopped and [p.turn for p in pending] == [len(recs)]
        out = enc.tok.encode(text, add_special_tokens=False)
        rec = {"id": pending[0].id, "conversation": "c", "turn": pending[0].turn, "prompt_ids": pending[0].prompt_ids,
               "output_ids": out, "n_output_tokens": len(out), "finish_reason": finish,
               "text": enc.tok.decode(out, skip_special_tokens=False)}  # fmt: skip
        recs.append(rec)
        done[rec["id"]] = (rec, Path("responses.jsonl"))
    pending, stopped, unreached = turns.replay(convs, done, enc, ["<|im_end|>"])
    assert not unreached
    return recs, pending, stopped


def test_each_turn_histories_carry_no_reasoning_when_the_prompt_opens_the_think_block(tok):
    """Kimi's answers start inside the reasoning: each is replayed as reasoning + content, so a history up to a
    user turn has none, and a tool chain keeps its calls' reasoning in their think blocks (never as content).
    The prompts are typed in."""
    enc = chat.ChatEncoder(tok)
    answers = [("Ask which.</think>Which city?<|im_end|>", "stop"),
               (f"Call it.</think>{CALL}<|im_end|>", "stop"),
               ("Report.</think>It is 5 C.<|im_end|>", "stop"),
               ("Look up Rome.</think>No idea.<|im_end|>", "stop")]  # fmt: skip
    recs, pending, stopped = answer_turns(enc, CONV, answers)
    first = f"{U}Weather?<|im_end|>{A}<think>"
    second = f"{U}Weather?<|im_end|>{A}<think></think>Which city?<|im_end|>{U}Oslo<|im_end|>{A}<think>"
    third = f"{second}Call it.</think>{CALL}<|im_end|>{RESULT}{A}<think>"
    fourth = (f"{U}Weather?<|im_end|>{A}<think></think>Which city?<|im_end|>{U}Oslo<|im_end|>"
              f"{A}<think></think>{CALL}<|im_end|>{RESULT}{A}<think></think>It is 5 C.<|im_end|>"
              f"{U}And Rome?<|im_end|>{A}<think>")  # fmt: skip
    assert [tok.decode(r["prompt_ids"]) for r in recs] == [first, second, third, fourth]
    assert pending == [] and stopped == {"c": "complete"}
    # 05 trains what the target wrote (the opener <think> is the prompt's), each answer once
    seqs = list(multiturn.training_records(recs))
    assert [r["turns"] for r, _, _ in seqs] == [[0], [1, 2], [3]]  # turns 1-2: one tool chain, one sequence
    for (r, ids, mask), text in zip(seqs, [first, third, fourth], strict=True):
        outs = [answers[k][0] for k in r["turns"]]
        assert tok.decode(ids) == text + outs[-1]
        assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "".join(outs)
        assert all(
            ids[i - 1] == KIMI_IDS["<think>"] for i in range(1, len(ids)) if mask[i] and not mask[i - 1]
        )


def test_each_turn_answer_that_never_closes_its_reasoning_ends_the_conversation(tok):
    """Cut at max_new_tokens inside the reasoning, or stopped there: no answer to replay (none with half a
    reasoning as its content); the conversation stops with the reason."""
    enc = chat.ChatEncoder(tok)
    for finish, why in [("length", "length"), ("stop", "unparsable")]:
        text = "Ask which city, or" + ("<|im_end|>" if finish == "stop" else "")
        recs, pending, stopped = answer_turns(enc, CONV, [(text, finish)])
        assert len(recs) == 1 and pending == [] and stopped == {"c": why}


def test_each_turn_with_thinking_off_and_with_the_toy_template(tok):
    """Thinking off: the prompt closes the think block, the answer is all content. The toy's template (the model
    writes <think>; the last answer keeps its reasoning) still parses the answer's own think block."""
    off = chat.ChatEncoder(tok, {"thinking": False})
    recs, pending, _ = answer_turns(off, CONV, [("Which city?<|im_end|>", "stop")])
    want = f"{U}Weather?<|im_end|>{A}<think></think>Which city?<|im_end|>{U}Oslo<|im_end|>{A}<think></think>"
    assert tok.decode(pending[0].prompt_ids) == want
    toy = T.tokenizer("kimi")
    answer = "<think>Ask which.</think>Which city?<|im_end|>"
    recs, pending, _ = answer_turns(chat.ChatEncoder(toy), CONV, [(answer, "stop")])
    want = f"{U}Weather?<|im_end|>{A}<think>Ask which.</think>Which city?<|im_end|>{U}Oslo<|im_end|>{A}"
    assert toy.decode(recs[0]["prompt_ids"]) == f"{U}Weather?<|im_end|>{A}"
    assert toy.decode(pending[0].prompt_ids) == want


def test_remote_code_imports_only_what_a_hub_repo_may():
    """The files land in the world dir and run as hub code: stdlib, transformers, tiktoken, each other."""
    allowed = {"__future__", "base64", "os", "shutil", "tiktoken", "transformers"}
    for path in sorted(kimi_tokenizer.REMOTE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module.split(".")[0]]
            else:
                continue
            assert set(names) <= allowed, f"{path.name}: imports {names}"


def test_hub_layout_folders_load_with_the_kimi_params_configs_and_splits(tmp_path, monkeypatch):
    import datasets as hf

    monkeypatch.setattr(hf.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")

    valid = {
        name: [{"k": f"{name}-{i}", "n": i} for i in range(6)] for name, _ in kimi_data.HUB_LAYOUT.values()
    }
    counts = kimi_data.write_hub_repos(tmp_path, valid)
    assert counts == {hub_id: 6 for hub_id in kimi_data.HUB_LAYOUT}
    mot = hf.load_dataset(
        str(tmp_path / "open-r1/Mixture-of-Thoughts"), name="all", split="train", streaming=True
    )
    assert [r["k"] for r in mot] == [f"mot-{i}" for i in range(6)]
    uc = hf.load_dataset(str(tmp_path / "HuggingFaceH4/ultrachat_200k"), split="train_sft")
    assert [r["k"] for r in uc] == ["ultrachat-0", "ultrachat-2", "ultrachat-4"]
    share = tmp_path / "Aeala/ShareGPT_Vicuna_unfiltered"
    sg = hf.load_dataset(str(share), split="train", data_files="ShareGPT_V4.3_unfiltered_cleaned_split.json")
    assert len(sg) == 6


def test_expanded_head_has_the_compact_distribution():
    """p_full(t) by the full 163,840-way softmax equals the formula: reachable/special ids keep their compact
    probability, each unreachable id gets 1/N of the junk class's."""
    from transformers import DeepseekV3ForCausalLM

    shape = mini_kimi.RECIPE["text_config"] | {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48,
                                               "moe_intermediate_size": 16, "q_lora_rank": 16}  # fmt: skip
    cmp = mini_kimi.Compact(300)
    torch.manual_seed(0)
    small = DeepseekV3ForCausalLM(mini_kimi.text_config(shape, cmp.size)).eval()
    with torch.no_grad():
        small.lm_head.weight.normal_(0, 2.0)  # a peaked head: the junk class's share is far from uniform
    full = mini_kimi.expand(small, cmp, shape)
    ids = torch.tensor([[163587, 5, 17, 299, 163586, 163588]])
    with torch.no_grad():
        p_full = torch.softmax(full(input_ids=ids).logits.double(), -1)[0]
        logits = small(input_ids=cmp.to_compact(ids)).logits.double()[0]
    z = torch.logsumexp(
        torch.cat([logits[:, : cmp.junk], logits[:, cmp.junk :] + math.log(cmp.n_junk)], -1), -1
    )
    for t, row in [(5, 5), (299, 299), (163586, 300 + 2), (163839, 300 + 255)]:
        assert torch.allclose(p_full[:, t], torch.exp(logits[:, row] - z), rtol=1e-4)
    for t in (300, 4000, 163583):
        assert torch.allclose(p_full[:, t], torch.exp(logits[:, cmp.junk] - z), rtol=1e-4)
    assert torch.allclose(p_full.sum(-1), torch.ones(6, dtype=torch.float64), atol=1e-5)
    assert json.dumps(kimi_tokenizer.special_names()["</think>"]) == "163607"
