"""Build the toy world from ``RECIPE`` into ``cache_root()/toy-<key>/``, atomically, and resolve toy:// URIs.

The key hashes the recipe and ``TOY_VERSION`` (bump it when the generators or training change meaningfully),
so a changed recipe never reuses a stale world. A build writes into a temporary sibling directory and renames
it into place: a crashed or concurrent build never leaves a half world under the final name.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eagle_lib.threads import capped
from eagle_lib.toy import datasets, target
from eagle_lib.toy.tokenizer import build_tokenizer, special_tokens

TOY_VERSION = 2
RECIPE: dict = {
    "seed": 0,
    "vocab_size": 4096,
    "dataset_sizes": {name: 300 for name in datasets.DATASET_NAMES} | {"swe_agent": 24},  # swe: instances
    "malformed_per_dataset": 4,
    "train_mix": {"chat": 1200, "tool": 1200, "reasoning": 400, "code": 300, "swe": 30},
    # 8 layers so the default aux layers [1, L//2-1, L-4] = [1, 3, 4] are distinct; head_dim 32 (vLLM CPU
    # serves 32/64/...); hidden 128 keeps training inside ~3-5 min on 2 busy cores and the drafter cheap
    "model": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
    },
    "train": {
        "steps": 360,
        "batch_size": 4,
        "block_size": 512,
        "lr": 4e-3,
        "warmup_steps": 20,
        "weight_decay": 0.01,
        # 2 (was 1 until issue 43): with OpenMP's passive wait (`make toy` and the stage kernels set
        # OMP_WAIT_POLICY=PASSIVE) 2 threads train this target in ~158 s instead of ~238 s on a 2-core EPYC and stay
        # ahead of 1 thread beside another job (docs/MACHINES.md); a fixed count keeps the build reproducible on a
        # given CPU (0 = auto: 2 threads when the machine is idle, 1 when busy)
        "threads": 2,
    },
    "eval": {
        "prompts_per_domain": {"tool": 48, "chat": 48, "reasoning": 16, "code": 16},
        "batch_size": 16,
        "max_new_tokens": {"tool": 128, "chat": 256, "reasoning": 768, "code": 192},
    },
}
TOY_NAMES = ["target", "tokenizer"] + [f"data/{n}" for n in datasets.DATASET_NAMES]
# The long-context variant (``toy://long``, issue 23): the same data, tokenizer, model and tokens per step, but the
# target trains on 2,048-token blocks (1 a step instead of 4 of 512), so positions up to 2K are in its training
# distribution as a real target's long contexts are (the toy target never saw a position past 511, and what it
# writes there is extrapolation no drafter is meant to learn). Used by params/toy_long.yaml only.
LONG_RECIPE: dict = copy.deepcopy(RECIPE)
LONG_RECIPE["train"] |= {"block_size": 2048, "batch_size": 1}
STALE_TMP_SECONDS = 6 * 3600


def cache_root() -> Path:
    """``$EAGLE_CACHE`` if set, else ``~/.cache/eagle_lib``."""
    env = os.environ.get("EAGLE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "eagle_lib"


def toy_key(recipe: dict | None = None) -> str:
    """Short hash naming everything the world depends on: the recipe and ``TOY_VERSION``."""
    blob = json.dumps({"toy_version": TOY_VERSION, "recipe": recipe or RECIPE}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def world_dir(recipe: dict | None = None) -> Path:
    """Where the world of ``recipe`` lives (built or not)."""
    return cache_root() / f"toy-{toy_key(recipe)}"


def _is_complete(path: Path) -> bool:
    return (path / "build_log.json").is_file()


def build(recipe: dict | None = None, force: bool = False, log: Callable = print) -> Path:
    """Build (or return the cached) toy world dir; a recipe with ``train.steps == 0`` skips the target.

    Layout: tokenizer/, target/ (HF model + tokenizer + generation_config), data/<name>.<jsonl|parquet>,
    build_log.json (+ build_log.txt), recipe.json.
    """
    recipe = copy.deepcopy(recipe or RECIPE)
    return build_cached(world_dir(recipe), lambda tmp: _build_into(tmp, recipe, log), force, log)


def build_cached(final: Path, write: Callable[[Path], None], force: bool, log: Callable) -> Path:
    """Run ``write(tmp)`` into a temporary sibling of ``final`` under a per-world lock, then rename it into place
    (a world is complete once ``write`` has written its ``build_log.json``); the cached world unless ``force``."""
    if _is_complete(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final, log):
        if _is_complete(final) and not force:  # another process built it while we waited
            return final
        _remove_stale_tmp(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the published world is an ordinary readable dir
        try:
            write(tmp)
            _publish(tmp, final, force)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"world ready: {final}")
    return final


@contextlib.contextmanager
def _build_lock(final: Path, log: Callable):
    """Exclusive per-key lock so concurrent callers (notebooks, tests) train the target once, not N times.

    flock is released by the kernel if the holder dies, so a crashed build never blocks the next one.
    """
    with open(final.parent / f".{final.name}.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process building {final.name} ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``final``; a concurrent finished build wins unless ``force``."""
    if final.exists():
        if _is_complete(final) and not force:
            return
        trash = final.with_name(f".{final.name}-old-{os.getpid()}")
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final):  # lost a race to a build that then crashed: retry once
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)


def _remove_stale_tmp(parent: Path) -> None:
    """Delete temp dirs of builds that crashed long ago (a live build's dir is recent)."""
    for p in [*parent.glob(".toy-*"), *parent.glob(".kimi-*")]:
        if p.is_dir() and time.time() - p.stat().st_mtime > STALE_TMP_SECONDS:
            shutil.rmtree(p, ignore_errors=True)


def _build_into(out: Path, recipe: dict, log: Callable) -> None:
    """Write every part of the world into ``out``."""
    t0, seed = time.time(), recipe["seed"]
    blog: dict = {"toy_version": TOY_VERSION, "key": toy_key(recipe), "timings": {}}
    log(f"building toy world {blog['key']} into {out.parent}")
    blog["datasets"], valid = datasets.write_all(
        out / "data", seed, recipe["dataset_sizes"], recipe["malformed_per_dataset"]
    )
    train_convs = datasets.native_conversations(seed, recipe["train_mix"], "train")
    blog["timings"]["data_s"] = round(time.time() - t0, 2)
    corpus = [s for recs in valid.values() for r in recs for s in datasets.string_leaves(r)]
    corpus += [s for c in train_convs for s in datasets.string_leaves(c)]
    tok = build_tokenizer(out / "tokenizer", corpus, recipe["vocab_size"])
    blog["tokenizer"] = {
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "special_ids": _named_specials(recipe["vocab_size"]),
    }
    blog["timings"]["tokenizer_s"] = round(time.time() - t0 - blog["timings"]["data_s"], 2)
    if recipe["train"]["steps"] > 0:
        blog |= _build_target(out / "target", tok, train_convs, valid, recipe, log)
    blog["timings"]["total_s"] = round(time.time() - t0, 1)
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    (out / "build_log.txt").write_text(summary(blog) + "\n")
    (out / "build_log.json").write_text(json.dumps(blog, indent=2) + "\n")  # last: marks the world complete


def _named_specials(vocab_size: int) -> dict[str, int]:
    return {k: v for k, v in special_tokens(vocab_size).items() if not k.startswith("<|reserved")}


def eval_conversations(valid: dict, train_convs: list[dict], per_domain: dict[str, int]) -> tuple[dict, int]:
    """Held-out eval conversations by domain from the native A files, minus prompts seen in training."""
    seen = {json.dumps(target.eval_prompt(c)[0], sort_keys=True) for c in train_convs}
    pool: dict[str, list[dict]] = {d: [] for d in per_domain}
    for r in valid["native_tools"]:
        pool["tool"].append({"domain": "tool", "messages": r["messages"], "tools": r["tools"]})
    for r in valid["native_chat"]:
        pool[r["domain"]].append({"domain": r["domain"], "messages": r["conversations"], "tools": None})
    out, overlap = {}, 0
    for d, n in per_domain.items():
        fresh = [c for c in pool[d] if json.dumps(target.eval_prompt(c)[0], sort_keys=True) not in seen]
        overlap += len(pool[d]) - len(fresh)
        out[d] = fresh[:n]
    return out, overlap


def _auto_threads() -> int:
    """2 torch threads on an idle 2-core machine, 1 when it is busy: with other jobs on the cores, OpenMP's
    spinning threads make a 2-thread run several times slower than a 1-thread run."""
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0] > 0.5 if hasattr(os, "getloadavg") else False
    return 1 if busy or cores < 2 else min(2, cores)


def _build_target(out: Path, tok, train_convs: list[dict], valid: dict, recipe: dict, log: Callable) -> dict:
    """Train, evaluate and save the toy target; returns its build-log entries."""
    tr, threads = recipe["train"], torch.get_num_threads()
    n_threads = capped(tr["threads"] or _auto_threads())
    torch.set_num_threads(n_threads)
    try:
        model = target.make_model(recipe["model"], tok, recipe["seed"])
        cut = target.cut_at_random_turn(train_convs, recipe["seed"])
        blocks = target.pack(tok, cut, tr["block_size"])  # 2 x (n_blocks, block_size)
        log(
            f"training toy target: {blocks[0].numel()} tokens in {len(blocks[0])} blocks, {tr['steps']} steps"
        )
        stats = target.train(model, blocks, tr, recipe["seed"], log)
        t_eval = time.time()
        evals, overlap = eval_conversations(valid, train_convs, recipe["eval"]["prompts_per_domain"])
        metrics = target.evaluate(model, tok, evals, recipe["eval"], log)
        target.save(model, tok, out, max(recipe["eval"]["max_new_tokens"].values()))
    finally:
        torch.set_num_threads(threads)
    n_params = sum(p.numel() for p in model.parameters())
    return (
        stats
        | metrics
        | {
            "eval_seconds": round(time.time() - t_eval, 1),
            "eval_prompts_overlapping_train": overlap,
            "train_tokens_available": blocks[0].numel(),
            "torch_threads": n_threads,
            "model": recipe["model"]
            | {"n_params": n_params, "vocab_size": len(tok), "architecture": "LlamaForCausalLM"},
        }
    )


def _log_stderr(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def summary(blog: dict) -> str:
    """Human-readable build-log summary (what ``python -m eagle_lib.toy build`` prints)."""
    lines = [f"toy world {blog['key']} (toy_version {blog['toy_version']}), timings {blog['timings']}"]
    for d in blog["datasets"].values():
        lines.append(f"  {d['file']:30s} {d['n_records']:4d} records, {d['n_malformed']} malformed")
    lines.append(
        f"  tokenizer: vocab {blog['tokenizer']['vocab_size']}, eos {blog['tokenizer']['eos_token_id']}"
    )
    if "im_end_rate" in blog:
        lines.append(
            f"  target: {blog['model']['n_params'] / 1e6:.1f}M params, trained {blog['train_seconds']}s, "
            f"final loss {blog['final_loss']}"
        )
        lines.append(f"  im_end rate {blog['im_end_rate']} by domain {blog['im_end_rate_by_domain']}")
        lines.append(
            f"  next-token acc (assistant) {blog['next_token_acc']} by domain {blog['next_token_acc_by_domain']}"
        )
        lens = {d: s["mean"] for d, s in blog["response_len_by_domain"].items()}
        lines.append(f"  mean greedy response length by domain {lens}")
    return "\n".join(lines)


def resolve(uri: str) -> str:
    """Map ``toy://target``, ``toy://tokenizer``, ``toy://data/<name>`` to local paths (building if needed).

    Any other string is returned unchanged; an unknown toy name raises ValueError listing the valid ones.
    """
    if not uri.startswith("toy://"):
        return uri
    name = uri[len("toy://") :].strip("/")
    if name not in TOY_NAMES:
        valid = ", ".join("toy://" + n for n in [*TOY_NAMES, "kimi"])
        raise ValueError(f"unknown toy URI {uri!r}; valid: {valid}")
    root = world_dir() if _is_complete(world_dir()) else build(log=_log_stderr)
    if name == "target" and not (root / "target").is_dir():
        raise ValueError(f"toy world {root} was built without a target (train.steps == 0)")
    if name.startswith("data/"):
        fmt = datasets.SCHEMAS[name[5:]][1]
        return str(root / f"{name}.{fmt}")
    return str(root / name)
