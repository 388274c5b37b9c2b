"""eagle_lib.data.chat: the one-pass mask equals a slow prefix-by-prefix reference, on two templates, token for token.

References used here are independent of the module under test:
- `reference_mask`: renders the conversation prefix by prefix (the obvious method), locates each assistant turn
  in the FULL render (eagle3-facts "two traps") and maps characters to tokens with a plain loop over offsets;
- HF transformers' own `return_assistant_tokens_mask` on a ChatML template with `{% generation %}` blocks.
"""

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from eagle_lib.data import chat, formats
from eagle_lib.toy import datasets as toy_data
from eagle_lib.toy import tokenizer as toy_tok

# A Qwen/ChatML-style template written for these tests: newline after <|im_end|> (a separator, not trained),
# reasoning kept only on the last assistant turn, tool calls as JSON in <tool_call> tags, tool results as user
# turns, and {% generation %} blocks so HF can compute its own assistant mask for comparison.
CHATML = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for t in tools -%}{{ t | tojson }}{{ '\\n' }}{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{%- if loop.index0 == ns.last and m.reasoning_content -%}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif -%}{{ m.content }}"
    "{%- for tc in m.tool_calls or [] -%}"
    '{{ \'\\n<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' + tc.function.arguments }}'
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
ALPHABET = "abcdefghij klmnop qrstuvwxyz ABC 0123456789 .,;:!?'\"-_(){}[]<>/|\\\n\téü中文🙂"

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]


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
def chatml(tmp_path_factory):
    """A ChatML/Qwen-style tokenizer: its own byte-level BPE, trained here, with the template above."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in CHATML_SPECIALS])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHATML)
    out = tmp_path_factory.mktemp("chatml_tok")
    hf.save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))


END_TOKEN = {"kimi": "<|im_end|>", "chatml": "<|im_end|>"}


def _no_think(msgs):
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]


def reference_mask(tok, messages, tools=None, turns="all", end_token="<|im_end|>"):
    """Slow, obvious: render prefix by prefix; each assistant turn = its text in the full render, through <end>."""

    def render(msgs, gen=False):
        return tok.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=gen, tokenize=False)

    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = [render(h, True) for h in (messages[:i], _no_think(messages[:i]))]
        through = [
            render(h)
            for h in (messages[: i + 1], _no_think(messages[:i]) + [m], _no_think(messages[: i + 1]))
        ]
        start = next(len(p) for p in before if full.startswith(p))
        turn = next(q for q in through if full.startswith(q))[start:]
        spans.append((start, start + turn.rindex(end_token) + len(end_token)))
    if turns == "last":
        spans = spans[-1:]
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for s, e in enc["offset_mapping"]:
        mask.append(int(any(s < b and e > a for a, b in spans)))
    return enc["input_ids"], mask


# ---------------------------------------------------------------- conversations


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

text = st.text(alphabet=ALPHABET, max_size=40)


@st.composite
def conversations(draw):
    """Random chats: optional system, user turns, assistant turns with reasoning / tool calls, tool results."""
    msgs = [{"role": "system", "content": draw(text)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(text)})
        for _ in range(draw(st.integers(0, 2))):
            calls = [
                {"id": f"functions.{name}:{k}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps({"q": draw(text)})}}
                for k, name in enumerate(draw(st.lists(st.sampled_from(["get_weather", "add"]), max_size=2)))
            ]  # fmt: skip
            asst = {"role": "assistant", "content": draw(text)}
            if calls:
                asst["tool_calls"] = calls
            if draw(st.booleans()):
                asst["reasoning_content"] = draw(text)
            msgs.append(asst)
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": draw(text)} for c in calls]
    tools = TOOLS if draw(st.booleans()) else []
    return msgs, tools


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("which", ["kimi", "chatml"])
def test_probe_finds_header_and_end(which, request):
    probe = chat.ChatEncoder(request.getfixturevalue(which)).probe
    expected = {
        "kimi": chat.Probe("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
        "chatml": chat.Probe("<|im_start|>assistant\n", "<|im_end|>"),
    }
    assert probe == expected[which]


@pytest.mark.parametrize("which", ["kimi", "chatml"])
@pytest.mark.parametrize("turns", ["all", "last"])
def test_every_toy_conversation_matches_reference(which, turns, request):
    tok = request.getfixturevalue(which)
    enc = chat.ChatEncoder(tok)
    n_scan = 0
    for conv in TOY_CONVS:
        got = enc.encode(conv["messages"], conv["tools"], turns)
        ids, mask = reference_mask(tok, conv["messages"], conv["tools"], turns, END_TOKEN[which])
        assert got.input_ids == ids, conv["id"]
        assert got.loss_mask == mask, conv["id"]
        n_scan += got.method == "scan"
    assert n_scan == len(TOY_CONVS)  # the one-pass path served all of them


@pytest.mark.parametrize("which", ["kimi", "chatml"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations(), turns=st.sampled_from(["all", "last"]))
def test_random_conversations_match_reference(which, conv, turns, request):
    tok = request.getfixturevalue(which)
    messages, tools = conv
    got = chat.ChatEncoder(tok).encode(messages, tools, turns)
    ids, mask = reference_mask(tok, messages, tools, turns, END_TOKEN[which])
    assert got.input_ids == ids
    assert got.loss_mask == mask


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations())
def test_matches_transformers_generation_mask(chatml, conv):
    """Peer reference: HF's own assistant mask from the template's {% generation %} blocks."""
    messages, tools = conv
    hf = chatml.apply_chat_template(
        messages, tools=tools or None, return_dict=True, return_assistant_tokens_mask=True
    )
    got = chat.ChatEncoder(chatml).encode(messages, tools)
    assert got.input_ids == hf["input_ids"]
    assert got.loss_mask == hf["assistant_masks"]


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
    inputs, labels, label_mask = chat.shift_labels(got.input_ids, got.loss_mask)
    assert len(inputs) == len(labels) == len(label_mask) == len(got.input_ids) - 1
    for i in firsts:
        assert labels[i - 1] == think and label_mask[i - 1] == 1  # predicted from the header's last token
        assert inputs[i - 1] == kimi.convert_tokens_to_ids("<|im_middle|>")
    buggy = got.loss_mask[:-1]  # the peer bug: mask not shifted with the labels
    assert all(buggy[i - 1] == 0 for i in firsts)


def test_header_pasted_in_user_text_falls_back_to_prefix_method(kimi):
    """A user quoting chat markup makes the one-pass scan ambiguous: the prefix path takes over, still exact."""
    messages = [
        {"role": "user", "content": "What does <|im_assistant|>assistant<|im_middle|> mean?"},
        {"role": "assistant", "content": "It opens an assistant turn.", "reasoning_content": "Explain."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Be polite."},
    ]
    got = chat.ChatEncoder(kimi).encode(messages)
    assert got.method == "prefix"
    assert (got.input_ids, got.loss_mask) == reference_mask(kimi, messages)


def test_pieces_path_for_tokenizers_without_offsets(kimi):
    """Slow/tiktoken tokenizers (Kimi-K2.5's own) get the same ids and mask by tokenizing cut pieces."""
    fast, slow = chat.ChatEncoder(kimi), chat.ChatEncoder(kimi)
    slow.backend = None
    for conv in TOY_CONVS[:60]:
        a, b = fast.encode(conv["messages"], conv["tools"]), slow.encode(conv["messages"], conv["tools"])
        assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask)


def test_pieces_path_detects_a_token_across_the_boundary(chatml):
    """With a boundary inside a BPE merge, the pieces differ from the whole text: an error, never a wrong mask."""
    enc = chat.ChatEncoder(chatml)
    enc.backend = None
    with pytest.raises(chat.ChatError, match="crosses a mask boundary"):
        enc._tokenize_pieces("hello world", [(3, 8)])


def test_prompt_ends_with_generation_prompt(kimi):
    msgs = [{"role": "user", "content": "Hi"}]
    ids = chat.ChatEncoder(kimi).encode_prompt(msgs)
    assert ids == kimi.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert kimi.decode(ids).endswith("<|im_assistant|>assistant<|im_middle|>")


def test_template_without_chat_template_is_an_error(chatml):
    tok = PreTrainedTokenizerFast(tokenizer_object=chatml.backend_tokenizer)
    with pytest.raises(chat.ChatError, match="no chat template"):
        chat.ChatEncoder(tok)


@pytest.mark.slow
def test_every_conversation_of_the_built_toy_world_matches_reference():
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
            assert (got.input_ids, got.loss_mask) == reference_mask(tok, conv["messages"], conv["tools"]), (
                conv["id"]
            )
            n += 1
    assert n > 2000
