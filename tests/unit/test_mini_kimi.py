"""The mini-Kimi world's parts that need no trained target: its remote-code tiktoken tokenizer (Kimi's ids, Kimi's
layout, masks exact against tiktoken itself), the hub-layout folders, and the compact-head expansion."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import tiktoken
import torch
from transformers import AutoTokenizer

from eagle_lib.data import chat
from eagle_lib.toy import datasets, kimi_data, mini_kimi, target
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
    ranks = mini_kimi.train_ranks(corpus, 1500)
    mini_kimi.write_tokenizer(out, ranks, 8192)
    return out, ranks


@pytest.fixture(scope="module")
def tok(built):
    return AutoTokenizer.from_pretrained(str(built[0]), trust_remote_code=True)


@pytest.fixture(scope="module")
def reference(built) -> tiktoken.Encoding:
    """tiktoken itself over the same ranks and specials: the independent encoder the HF class must agree with."""
    ranks = tokenization_kimi.load_ranks(str(built[0] / "tiktoken.model"))
    return tiktoken.Encoding(name="ref", pat_str=tokenization_kimi.PAT_STR, mergeable_ranks=ranks,
                             special_tokens=mini_kimi.special_names())  # fmt: skip


def test_loads_as_remote_code_with_kimis_vocabulary_and_special_ids(tok):
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    assert len(tok) == 163840
    assert {name: tok.convert_tokens_to_ids(name) for name in KIMI_IDS} == KIMI_IDS
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (163584, 163585, 163839)
    assert tok.chat_template == mini_kimi.KIMI_LIKE_TEMPLATE


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


def test_chat_masks_are_exact_against_tiktoken_offsets(tok, reference):
    """Loss masks through the slow-tokenizer path equal the reference: the marked template's generation blocks,
    tokens located by tiktoken's own decode_with_offsets."""
    enc, n = chat.ChatEncoder(tok), 0
    for c in convs():
        got = enc.encode(c["messages"], c["tools"])
        text, spans = T.reference_render("kimi", c["messages"], c["tools"])
        ids = reference.encode(text, allowed_special="all")
        _, starts = reference.decode_with_offsets(ids)
        ends = starts[1:] + [len(text)]
        mask = [
            int(s < e and any(a <= s and e <= b for a, b in spans)) for s, e in zip(starts, ends, strict=True)
        ]
        assert (got.input_ids, got.loss_mask) == (ids, mask)
        n += sum(mask)
    assert n > 1000


def test_remote_code_imports_only_what_a_hub_repo_may():
    """The files land in the world dir and run as hub code: stdlib, transformers, tiktoken, each other."""
    allowed = {"__future__", "base64", "os", "shutil", "tiktoken", "transformers"}
    for path in sorted(mini_kimi.REMOTE_DIR.glob("*.py")):
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
    assert json.dumps(mini_kimi.special_names()["</think>"]) == "163607"
