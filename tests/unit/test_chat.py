"""eagle_lib.data.chat: every record of every template family is masked exactly or rejected with a reason.

The reference is independent of the module under test: each template of the matrix (tests/support/templates.py,
written for this project) marks what the model generated with {% generation %} blocks; the tokenizers get the
template without the markers, and transformers' own jinja renderer reports the marked character ranges
(:func:`templates.reference_mask`). A kept record must equal it token for token; a fast tokenizer (offsets) and a
slow stand-in (no offsets) must take the same decision on the same record.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from eagle_lib.data import chat, formats
from eagle_lib.toy import datasets as toy_data
from eagle_lib.toy import kimi_tokenizer
from eagle_lib.toy import tokenizer as toy_tok
from tests.support import templates as T

ALPHABET = "abcdefghij klmnop qrstuvwxyz ABC 0123456789 .,;:!?'\"-_(){}[]<>/|\\\n\téü中文🙂"
TOOLS = T.TOOLS


def _mini_kimi_marked() -> str:
    """The mini-Kimi template (Kimi-K2.5's thinking rules on the toy's) with generation markers: the toy's marked
    copy with mini-Kimi's edits, its marker moved past the <think> that the generation prompt now writes."""
    t = kimi_tokenizer.kimi_template(T.kimi_marked())
    old = "assistant<|im_middle|>" + T.G + "<think>"
    assert t.count(old) == 1
    return t.replace(old, "assistant<|im_middle|><think>" + T.G)


# the matrix (tests/support/templates.py) gets the mini-Kimi template here: it lives in eagle_lib.toy.mini_kimi
T.MATRIX.setdefault("mini_kimi", (_mini_kimi_marked(), "kimi", {}))


def _corpus() -> list[str]:
    rng = random.Random(0)
    rows = toy_data.make_rows("native_tools", 0, 20) + toy_data.make_rows("native_chat", 0, 20)
    texts = [s for r, _ in rows for s in toy_data.string_leaves(r)]
    return texts + ["".join(rng.choice(ALPHABET) for _ in range(200)) for _ in range(50)]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """The toy Kimi-like tokenizer (same builder and template as the toy world), trained on a small corpus."""
    out = tmp_path_factory.mktemp("kimi_tok")
    toy_tok.build_tokenizer(out, _corpus(), vocab_size=1024)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def chatml():
    return T.tokenizer("chatml")


_ENCODERS: dict = {}


def encoders(name: str) -> tuple[chat.ChatEncoder, chat.ChatEncoder]:
    """(fast, slow stand-in) encoders of a matrix template, built once."""
    if name not in _ENCODERS:
        fast, kw = T.tokenizer(name), T.MATRIX[name][2]
        _ENCODERS[name] = chat.ChatEncoder(fast, kw), chat.ChatEncoder(T.SlowTokenizer(fast), kw)
    return _ENCODERS[name]


def outcome(enc: chat.ChatEncoder, messages, tools, turns):
    """What the encoder decides: the sequences (ids, mask, turns) or ("rejected", reason)."""
    try:
        encs = enc.encode_each(messages, tools) if turns == "each" else [enc.encode(messages, tools, turns)]
    except chat.ChatError as e:
        return "rejected", str(e)
    return [(e.input_ids, e.loss_mask, e.turns) for e in encs]


def check(name: str, messages: list[dict], tools: list, turns: str = "all") -> str:
    """Exact or rejected, the same for fast and slow tokenizers; returns "kept" or "rejected"."""
    fast, slow = encoders(name)
    got = outcome(fast, messages, tools, turns)
    assert outcome(slow, messages, tools, turns) == got, "fast and slow tokenizers decide differently"
    if got[0] == "rejected":
        assert got[1], "a rejection names its reason"
        return "rejected"
    if turns == "each":
        want = T.reference_each(name, messages, tools)
    else:
        want = [(*T.reference_mask(name, messages, tools, only_last=turns == "last")[:2], None)]
    assert got == [tuple(w) for w in want]
    return "kept"


# ---------------------------------------------------------------- random conversations

text = st.text(alphabet=ALPHABET, min_size=1, max_size=30).map(str.strip).filter(bool)


@st.composite
def conversations(draw):
    """Random chats: system, users quoting the assistant or pasting chat markup, answers with reasoning,
    tool-call-only turns with tool results, now and then an empty assistant message."""
    msgs = [{"role": "system", "content": draw(text)}] if draw(st.booleans()) else []
    said = None
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["plain", "plain", "quote", "markup"]))
        c = draw(text)
        if kind == "quote" and said:
            c = f"You said: {said}"
        elif kind == "markup":
            c = f"{c} {draw(st.sampled_from(T.MARKUP))} {draw(text)}"
        msgs.append({"role": "user", "content": c})
        shape = draw(st.sampled_from(["answer", "reasoning", "tools", "tools"] * 3 + ["empty"]))
        if shape == "empty":
            msgs.append({"role": "assistant", "content": ""})
            continue
        if shape == "tools":
            calls = [T.tool_call(n, {"q": draw(text)}, k)
                     for k, n in enumerate(draw(st.lists(st.sampled_from(["get_weather", "add"]), min_size=1, max_size=2)))]  # fmt: skip
            asst = {
                "role": "assistant",
                "content": draw(st.sampled_from(["", "Let me check."])),
                "tool_calls": calls,
            }
            if draw(st.booleans()):
                asst["reasoning_content"] = draw(text)
            msgs.append(asst)
            msgs += [{"role": "tool", "tool_call_id": tc["id"], "content": draw(text)} for tc in calls]
        said = draw(text)
        asst = {"role": "assistant", "content": said}
        if shape != "answer":
            asst["reasoning_content"] = draw(text)
        msgs.append(asst)
    return msgs, (TOOLS if draw(st.booleans()) else [])


@pytest.mark.parametrize("name", list(T.MATRIX))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv=conversations(), turns=st.sampled_from(["all", "all", "last", "each"]))
def test_every_template_masks_exactly_or_rejects(name, conv, turns):
    check(name, *conv, turns)


# ---------------------------------------------------------------- the cases that used to get through

QUOTE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "sure, here it is"},
         {"role": "user", "content": "You wrote: sure, here it is"}, {"role": "assistant", "content": "Yes."}]  # fmt: skip
TWO = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
       {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Then done."}]  # fmt: skip


def test_closing_token_only_after_the_final_message_never_trains_the_next_user():
    fast, _ = encoders("final_close")
    assert check("final_close", TWO, []) == "kept"
    got = fast.encode(TWO)
    trained = T.tokenizer("final_close").decode(
        [t for t, m in zip(got.input_ids, got.loss_mask, strict=False) if m]
    )
    assert got.method == "fallback" and trained == "Hello thereThen done.<|im_end|>"


def test_empty_assistant_message_is_rejected_by_every_template():
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Yes."}]  # fmt: skip
    for name in ("skip_empty", "qwen3", "chatml", "mistral"):
        with pytest.raises(chat.ChatError, match="empty assistant message"):
            encoders(name)[0].encode(conv)


def test_transformed_assistant_content_quoted_later_is_rejected():
    with pytest.raises(chat.ChatError, match="verbatim"):
        encoders("transform_quote")[0].encode(QUOTE)
    assert (
        check(
            "transform_quote",
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "OK 42"}],
            [],
        )
        == "kept"
    )


def test_system_prompt_depending_on_later_messages_exact_by_scan_else_rejected():
    assert check("system_later", TWO, []) == "kept"  # the scan's walk finds every message where it belongs
    pasted = [dict(TWO[0], content="see <|im_start|>assistant\n here")] + TWO[1:]
    with pytest.raises(chat.ChatError, match="depends on later messages"):  # the fallback cannot verify it
        encoders("system_later")[0].encode(pasted)


def test_user_pasting_chat_markup_stays_exact():
    conv = [{"role": "user", "content": "What does <|im_start|>assistant\n mean? <|im_end|>"},
            {"role": "assistant", "content": "It opens a turn.", "reasoning_content": "Explain."},
            {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Welcome."}]  # fmt: skip
    for name in ("chatml", "qwen3", "final_close"):
        assert check(name, conv, []) == "kept"
    assert encoders("chatml")[0].encode(conv).method == "fallback"


def test_bpe_merge_across_the_header_boundary_is_excluded_by_both_kinds():
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello world"}]
    fast, slow = encoders("bpe_merge")
    tok = T.tokenizer("bpe_merge")
    got = fast.encode(conv)
    pieces = [tok.decode([t]) for t in got.input_ids]
    k = pieces.index(" Hello")  # the header's trailing space merged with the first content word
    assert got.loss_mask[k] == 0 and got.loss_mask[k + 1] == 1
    assert check("bpe_merge", conv, []) == "kept"


def test_tool_call_only_turn_is_exact_where_the_template_renders_tool_calls():
    conv = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [T.tool_call("get_weather", {"city": "Oslo"}, 0)]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "3 C"},
            {"role": "assistant", "content": "It is 3 C."}]  # fmt: skip
    kept = {n for n in T.MATRIX if n != "gemma" and check(n, conv, TOOLS) == "kept"}
    assert {"chatml", "qwen3", "llama3", "mistral", "deepseek_v3", "harmony", "kimi", "final_close"} <= kept
    for n in ("phi3", "llava"):  # these render no tool calls: the turn is not in the text, so rejected
        assert check(n, conv, TOOLS) == "rejected"


@pytest.mark.parametrize("name", ["mistral", "phi3", "llava"])
def test_families_refused_before_now_prepare_data(name):
    assert check(name, TWO, []) == "kept"
    assert encoders(name)[0].encode(TWO).method in ("scan", "fallback")


def test_probe_learns_headers_ends_and_reasoning_dropping():
    p = {
        n: encoders(n)[0].probe for n in ("chatml", "qwen3", "llama3", "mistral", "harmony", "kimi", "gemma")
    }
    assert p["chatml"].header == "<|im_start|>assistant\n" and p["chatml"].ends == ("<|im_end|>",)
    assert p["mistral"].header == "" and p["mistral"].ends == ("</s>",)
    assert set(p["harmony"].ends) == {"<|return|>", "<|end|>", "<|call|>"}
    assert p["gemma"].header == "<start_of_turn>model\n"
    assert {n for n, q in p.items() if q.drops_history_reasoning} == {"chatml", "qwen3", "harmony", "kimi"}


def test_qwen3_enable_thinking_false_prompt_block_is_not_trained():
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    got = encoders("qwen3_no_thinking")[0].encode(conv)
    tok = T.tokenizer("qwen3_no_thinking")
    assert (
        tok.decode([t for t, m in zip(got.input_ids, got.loss_mask, strict=False) if m]) == "Hello<|im_end|>"
    )
    assert check("qwen3_no_thinking", conv, []) == "kept"


def test_each_trains_every_turn_once_with_its_reasoning_as_the_target_saw_it():
    conv = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]  # fmt: skip
    for name in ("kimi", "qwen3", "harmony"):
        fast, _ = encoders(name)
        tok = T.tokenizer(name)
        seqs = fast.encode_each(conv)
        assert sorted(k for e in seqs for k in e.turns) == [0, 1]  # every turn trained exactly once
        by_turn = {k: e for e in seqs for k in e.turns}
        first = tok.decode([t for t, m in zip(by_turn[0].input_ids, by_turn[0].loss_mask, strict=True) if m])
        second = tok.decode([t for t, m in zip(by_turn[1].input_ids, by_turn[1].loss_mask, strict=True) if m])
        assert "R1" in first and "A1" in first and "R2" in second and "A1" not in second
        prompt = fast.render(conv[:3], add_generation_prompt=True)  # what the target read before writing A2
        assert by_turn[1].text.startswith(prompt)
        assert "R1" not in fast.encode(conv).text  # `all` never shows R1: the template drops it
        assert check(name, conv, [], "each") == "kept"


def test_each_without_reasoning_is_one_sequence_like_all():
    for name in ("kimi", "mistral", "llama3", "deepseek_v3"):
        fast, _ = encoders(name)
        (seq,) = fast.encode_each(TWO)
        assert seq.turns == [0, 1] and (seq.input_ids, seq.loss_mask) == (
            fast.encode(TWO).input_ids, fast.encode(TWO).loss_mask)  # fmt: skip
    # Qwen3 drops the (empty) think block the model wrote from history turns: that turn gets its own sequence
    assert [e.turns for e in encoders("qwen3")[0].encode_each(TWO)] == [[1], [0]]


def test_mini_kimi_generation_prompt_think_opener_is_never_trained():
    """Kimi-K2.5's generation prompt writes <think> (<think></think> with thinking: false): the model never
    writes it, so it is the header's, not the turn's; with thinking on, the turn starts with its reasoning."""
    fast, _ = encoders("mini_kimi")
    assert fast.probe.header == "<|im_assistant|>assistant<|im_middle|><think>"
    assert fast.probe.drops_history_reasoning
    tok = T.tokenizer("mini_kimi")
    conv = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]  # fmt: skip
    got = fast.encode(conv)
    assert tok.decode([t for t, m in zip(got.input_ids, got.loss_mask, strict=True) if m]) == (
        "</think>A1<|im_end|>R2</think>A2<|im_end|>"
    )
    each = {k: e for e in fast.encode_each(conv) for k in e.turns}
    first = [t for t, m in zip(each[0].input_ids, each[0].loss_mask, strict=True) if m]
    assert tok.decode(first) == "R1</think>A1<|im_end|>"  # as the target wrote it, after its prompt's <think>
    assert each[0].text.startswith(fast.render(conv[:1], add_generation_prompt=True))
    off = chat.ChatEncoder(tok, {"thinking": False})
    got = off.encode(conv[:2] + [conv[2], {"role": "assistant", "content": "A2"}])
    assert tok.decode([t for t, m in zip(got.input_ids, got.loss_mask, strict=True) if m]) == (
        "A1<|im_end|>A2<|im_end|>"
    )


@pytest.mark.parametrize("turns", ["all", "last", "each"])
def test_every_toy_conversation_is_exact_with_the_mini_kimi_template(turns):
    assert {check("mini_kimi", conv["messages"], conv["tools"], turns) for conv in TOY_CONVS} == {"kept"}


# ---------------------------------------------------------------- the toy world's own Kimi-like tokenizer


def _toy_conversations(n: int = 25):
    out = []
    for name, adapter in [("native_chat", "openai"), ("native_tools", "openai"), ("glaive", "glaive"),
                          ("mot", "mot"), ("openthoughts_114k", "openthoughts"), ("openthoughts3", "openthoughts"),
                          ("opencodeinstruct", "opencodeinstruct"), ("sharegpt", "sharegpt"),
                          ("ultrachat", "ultrachat"), ("swe_agent", "swe_agent")]:  # fmt: skip
        src = formats.Source(name=name, path="-", adapter=adapter)
        rows = toy_data.make_rows(name, 0, 3 if name == "swe_agent" else n)
        for i, (row, _) in enumerate(rows):
            try:
                out.append(formats.adapt(row, src, {"row": i}))
            except formats.Skip:
                pass
    return out


TOY_CONVS = _toy_conversations()


def test_marked_kimi_copy_renders_exactly_like_the_toy_template(kimi):
    plain = T.strip_markers(T.kimi_marked())
    assert plain != toy_tok.KIMI_LIKE_TEMPLATE  # the copy is restructured ...
    for conv in TOY_CONVS:  # ... yet renders the same text
        want = kimi.apply_chat_template(conv["messages"], tools=conv["tools"] or None, tokenize=False)
        got = render_jinja_template(
            conversations=[conv["messages"]], tools=conv["tools"] or None, chat_template=plain
        )
        assert got[0][0] == want, conv["id"]


@pytest.mark.parametrize("turns", ["all", "last"])
def test_every_toy_conversation_is_exact_with_the_toy_tokenizer(kimi, turns):
    enc, slow = chat.ChatEncoder(kimi), chat.ChatEncoder(T.SlowTokenizer(kimi))
    methods = []
    for conv in TOY_CONVS:
        got = enc.encode(conv["messages"], conv["tools"], turns)
        ids, mask, _ = T.reference_mask("kimi", conv["messages"], conv["tools"], turns == "last", tok=kimi)
        assert (got.input_ids, got.loss_mask) == (ids, mask), conv["id"]
        s = slow.encode(conv["messages"], conv["tools"], turns)
        assert (s.input_ids, s.loss_mask) == (ids, mask), conv["id"]
        methods.append(got.method)
    assert methods.count("scan") == len(TOY_CONVS)  # the one-pass path served all of them


def test_ids_equal_apply_chat_template(kimi):
    for conv in TOY_CONVS[:40]:
        got = chat.ChatEncoder(kimi).encode(conv["messages"], conv["tools"])
        want = kimi.apply_chat_template(conv["messages"], tools=conv["tools"] or None, return_dict=False)
        assert got.input_ids == want


def test_kimi_mask_covers_assistant_parts_only(kimi):
    """Decode what is trained: think block, content, tool-call markup and <|im_end|>; never headers or users."""
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "old thought",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"t": 3}'},
        {"role": "assistant", "content": "It is 3 degrees.", "reasoning_content": "Report it."},
    ]  # fmt: skip
    got = chat.ChatEncoder(kimi).encode(messages, TOOLS)
    trained = kimi.decode([t for t, m in zip(got.input_ids, got.loss_mask, strict=True) if m])
    untrained = kimi.decode([t for t, m in zip(got.input_ids, got.loss_mask, strict=True) if not m])
    assert trained == (
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<think>Report it.</think>It is 3 degrees.<|im_end|>"
    )
    assert "old thought" not in got.text  # history thinking dropped by the template, so never trained
    assert "Weather in Oslo?" in untrained and "<|im_assistant|>assistant<|im_middle|>" in untrained
    assert '{"t": 3}' in untrained


def test_first_assistant_token_is_trained_after_label_shift(kimi):
    """The mask moves with the labels: the first token of each turn (<think>) is a trained label."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]  # fmt: skip
    got = chat.ChatEncoder(kimi).encode(messages)
    think = kimi.convert_tokens_to_ids("<think>")
    firsts = [i for i in range(1, len(got.loss_mask)) if got.loss_mask[i] and not got.loss_mask[i - 1]]
    assert [got.input_ids[i] for i in firsts] == [think, think]
    ids = got.input_ids  # next-token training: position t reads ids[:t+1], predicts ids[t+1] when mask[t+1]
    inputs, labels, label_mask = ids[:-1], ids[1:], got.loss_mask[1:]
    assert len(inputs) == len(labels) == len(label_mask) == len(got.input_ids) - 1
    for i in firsts:
        assert labels[i - 1] == think and label_mask[i - 1] == 1  # predicted from the header's last token
        assert inputs[i - 1] == kimi.convert_tokens_to_ids("<|im_middle|>")
    buggy = got.loss_mask[:-1]  # the peer bug: mask not shifted with the labels
    assert all(buggy[i - 1] == 0 for i in firsts)


def test_prompt_ends_with_generation_prompt(kimi):
    msgs = [{"role": "user", "content": "Hi"}]
    ids = chat.ChatEncoder(kimi).encode_prompt(msgs)
    assert ids == kimi.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert kimi.decode(ids).endswith("<|im_assistant|>assistant<|im_middle|>")


def test_template_without_chat_template_is_an_error(chatml):
    tok = PreTrainedTokenizerFast(tokenizer_object=chatml.backend_tokenizer)
    with pytest.raises(chat.ChatError, match="no chat template"):
        chat.ChatEncoder(tok)


def test_slow_path_excludes_a_token_across_the_boundary_like_the_fast_path(chatml):
    """A span boundary inside a BPE merge: the slow path excludes the crossing tokens exactly as the fast one;
    with a decode that cannot give character ranges, it rejects instead of guessing."""
    fast, slow = chat.ChatEncoder(chatml), chat.ChatEncoder(T.SlowTokenizer(chatml))
    spans = [(3, 8)]  # "hel|lo wo|rld"
    assert slow._tokenize_masked("hello world", spans) == fast._tokenize_masked("hello world", spans)
    assert 0 in fast._tokenize_masked("hello world", spans)[1]
    broken = T.SlowTokenizer(chatml)
    broken.decode = lambda ids, **kw: "?"
    with pytest.raises(chat.ChatError, match="crosses a mask boundary"):
        chat.ChatEncoder(broken)._tokenize_masked("hello world", spans)


def test_slow_tokenizer_whose_decode_is_not_exact_uses_checked_pieces(kimi):
    """No offsets and an inexact decode: pieces cut at span boundaries, checked against the whole text."""
    slow = T.SlowTokenizer(kimi)
    slow.decode = lambda ids, **kw: "?"  # a decoder that cannot give character ranges
    enc, ref = chat.ChatEncoder(slow), chat.ChatEncoder(kimi)
    for conv in TOY_CONVS[:30]:
        a, b = enc.encode(conv["messages"], conv["tools"]), ref.encode(conv["messages"], conv["tools"])
        assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask)


@pytest.mark.slow
def test_every_conversation_of_the_built_toy_world_is_exact():
    """All rows of every toy dataset file, with the toy world's own tokenizer (skipped until the world is built)."""
    from eagle_lib import extract, prepare, toy

    if not (toy.world_dir() / "build_log.json").exists():
        pytest.skip("toy world not built (python -m eagle_lib.toy build)")
    tok = AutoTokenizer.from_pretrained(toy.resolve("toy://tokenizer"))
    enc, n = chat.ChatEncoder(tok), 0
    for src in prepare.Params().datasets + extract.Params().datasets:
        for where, row, err in formats.iter_rows(src):
            try:
                conv = formats.adapt(row, src, where) if err is None else None
            except (formats.Malformed, formats.Skip):
                conv = None
            if conv is None:
                continue
            got = enc.encode(conv["messages"], conv["tools"])
            ids, mask, _ = T.reference_mask("kimi", conv["messages"], conv["tools"], tok=tok)
            assert (got.input_ids, got.loss_mask) == (ids, mask), conv["id"]
            n += 1
    assert n > 2000


TWIN_CALLS = [  # two identical parallel tool calls: the fallback once located the first twice (hypothesis found it)
    {"role": "user", "content": "0"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": f"functions.get_weather:{i}", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"q": "0"}'}} for i in range(2)]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "0"},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "0"},
    {"role": "assistant", "content": "0", "reasoning_content": "0"},
]  # fmt: skip


@pytest.mark.parametrize("name", list(T.MATRIX))
def test_identical_parallel_tool_calls_are_both_trained(name):
    """Exact or rejected on every template (check compares with the generation-marker reference); the final_close
    fallback keeps it, with both calls in the mask."""
    got = check(name, TWIN_CALLS, [])
    if name == "final_close":
        assert got == "kept"
