"""Stage 03_infer: regenerate every B prompt with the target, exactly once, resumable, on one or many machines.

Input ``data/B/<dataset>/prompts.jsonl`` (stage 02); output ``infer/<dataset>/responses.jsonl`` (one record per
prompt id: prompt_ids, output_ids, text, finish_reason, sampling, engine, latency), ``errors.jsonl`` (requests
that got no response, with the reason) and ``meta.json`` (read = kept + rejected), plus ``infer/meta.json`` and,
for servers, ``infer/target_fingerprint-<key>.json`` (what later runs' servers must match: `engines.fingerprint`).

Exactly once: a response is committed when its line is appended (whole batches, fsync). A restart reads the
committed ids and generates only the others; a torn last line (a crash mid-write) is skipped and redone.
Records made from other prompts, sampling settings, another target or other stop ids are never mixed in: the
run stops and names them, or sets them aside (`engines.resume`). Each dataset's pending prompts are taken in a
seeded random order, and every start is recorded in ``started.jsonl`` (`engines.ledger`): mid-run, the
started set is a random sample of the dataset, and 04 knows which responses are still being generated.
Sharding: ``python -m eagle_lib.infer PARAMS --shard i/n`` on n machines writes
``infer/<dataset>/shards/i-of-n/``; the unsharded run (the notebook) merges the shards into responses.jsonl
and generates whatever is still missing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import random
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from eagle_lib import models, params, store
from eagle_lib.engines import commit, fingerprint, machine
from eagle_lib.engines.base import EngineError, Sampling
from eagle_lib.engines.resume import InferError, Resume, error_ids, merge_shards, target_identity


class Params(params.Strict):
    """03_infer parameters."""

    datasets: list[str] = []  # B datasets (dirs under data/B) to regenerate; empty: all with prompts.jsonl
    limit: int = 0  # first N prompts of each dataset (0: all)
    engine: Literal["embedded", "sglang", "openai", "vllm"] = (
        "embedded"  # in-process | SGLang | an OpenAI-API server (vLLM) | vllm: a local vLLM CPU server 03 runs
    )
    vllm_threads: int = 0  # vllm: the server's CPU threads (0: the machine rule, engines.machine.cpu_threads)
    vllm_max_model_len: int = 0  # vllm: the server's context window (0: 02's longest prompt + max_new_tokens)
    server_urls: list[str] = []  # base URLs of the servers for sglang/openai, e.g. http://node0:30000
    served_model: str = ""  # openai: model name on the server; empty: the first one /v1/models lists
    api_key_env: str = ""  # NAME of the environment variable holding the servers' API key; empty: none
    concurrency: int = 8  # requests in flight per server
    timeout_s: float = 1800.0  # floor of one request's deadline (stall_s + max_new_tokens / measured rate)
    stream: bool = True  # sglang/openai: stream answers (a slow answer delivering tokens is alive)
    stall_s: float = 300.0  # streamed: a server with no new token on any request this long is dropped
    min_tokens_per_s: float = 1.0  # tokens/s per request the deadline assumes until the run measured its own
    max_retries: int = 6  # charged retries of a request (its deadline passed; faults on every server)
    all_down_s: float = 1800.0  # sglang/openai: stop (resumable) when no server is in rotation this long
    backoff_s: float = 1.0  # first retry delay; doubles per retry, +-50% jitter
    backoff_max_s: float = 60.0  # longest retry delay
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling mass (temperature > 0)
    stop_token_ids: list[int] = []  # empty: the target generation config's eos ids (else the tokenizer's)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # embedded; auto: fp32 on CPU, bf16 on GPU
    batch_size: int = 32  # embedded: prompts decoded together
    max_batch_tokens: int = 32768  # embedded: cap on batch rows x (longest prompt + max_new_tokens)
    max_model_len: int = 0  # embedded: context window; 0: the target config's
    write_every: int = 64  # responses per durable append (also flushed every 30 s)
    ledger_seconds: float = 5.0  # the ledger of started requests is appended at least this often
    shuffle: bool = True  # take each dataset's prompts in a seeded random order (unbiased mid-run estimates)
    retry_errors: bool = True  # re-run ids that failed in an earlier run
    on_stale: Literal["error", "set_aside"] = "error"  # records of other prompts/sampling: stop | set aside
    max_error_fraction: float = 0.01  # the stage fails when more prompts error (a server run stops early)
    progress: bool = True  # progress bar with tokens/s and ETA per dataset


def shard_of(sample_id: str, n: int) -> int:
    """Which of n shards owns a sample id (stable across machines and runs)."""
    return int.from_bytes(hashlib.sha256(str(sample_id).encode()).digest()[:8], "big") % n


def parse_shard(text: str) -> tuple[int, int] | None:
    """'i/n' -> (i, n) with 0 <= i < n; '' -> None."""
    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InferError(f"--shard {text!r}: expected i/n, e.g. 0/4") from None
    if not 0 <= i < n:
        raise InferError(f"--shard {text!r}: need 0 <= i < n")
    return i, n


def dataset_names(cfg: params.StageConfig) -> list[str]:
    root = cfg.out("data", "B")
    names = cfg.stage.datasets or sorted(p.parent.name for p in root.glob("*/prompts.jsonl"))
    missing = [n for n in names if not (root / n / "prompts.jsonl").exists()]
    if missing or not names:
        raise InferError(f"{root}: no prompts.jsonl for {missing or 'any dataset'} (run 02_extract_B first)")
    return names


def load_prompts(path: Path, limit: int = 0) -> list[dict]:
    """The prompt records, checked: a string id, unique, and a non-empty list of int prompt_ids."""
    out, seen = [], set()
    for k, rec in enumerate(store.iter_jsonl(path), 1):
        sid, ids = rec.get("id"), rec.get("prompt_ids")
        where = f"{path}: record {k} (id {sid!r})"
        if not isinstance(sid, str) or not sid:
            raise InferError(f"{where}: id must be a non-empty string")
        if sid in seen:
            raise InferError(f"{where}: duplicate id")
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise InferError(f"{where}: prompt_ids must be a non-empty list of non-negative ints")
        seen.add(sid)
        out.append(rec)
    return out[:limit] if limit else out


def file_sha256(path: Path) -> str:
    """Input fingerprint for meta.json."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_stop_ids(cfg: params.StageConfig, tokenizer, model=None) -> list[int]:
    """stop_token_ids, else the target generation config's eos ids, else the tokenizer's eos id."""
    if cfg.stage.stop_token_ids:
        return list(cfg.stage.stop_token_ids)
    gen = getattr(model, "generation_config", None)
    if gen is None:
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(
                models.resolve(cfg.shared.target), **models.hub_kwargs(cfg.shared)
            )
        except (OSError, ValueError):
            gen = None
    eos = getattr(gen, "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    if not eos:
        raise InferError("no stop token: set 03_infer.stop_token_ids (the target has no eos id)")
    return eos


def make_engine(cfg: params.StageConfig, tokenizer, server_urls: list[str] | None = None):
    """The configured engine, with its Sampling (stop ids resolved); `server_urls` replace the params' (the
    local server of ``engine: vllm``)."""
    p, shared = cfg.stage, cfg.shared

    def sampling(model=None) -> Sampling:
        stop = tuple(resolve_stop_ids(cfg, tokenizer, model))
        return Sampling(p.temperature, p.top_p, shared.max_new_tokens, shared.seed, stop)

    if p.engine == "embedded":
        import torch

        from eagle_lib.engines.embedded import EmbeddedEngine

        if models.pick_device(shared.device).type == "cpu":
            machine.set_cpu_threads(shared.num_workers)  # the machine rule unless num_workers is set
        model = models.load_target(shared, dtype=None if p.dtype == "auto" else getattr(torch, p.dtype))
        return EmbeddedEngine(model, sampling(model), p.batch_size, p.max_batch_tokens, p.max_model_len,
                              max_error_fraction=p.max_error_fraction)  # fmt: skip
    from eagle_lib.engines.http_apis import OpenAIEngine, SGLangEngine

    cls = {"sglang": SGLangEngine, "openai": OpenAIEngine, "vllm": OpenAIEngine}[p.engine]
    api_key = params.secret_from_env(p.api_key_env, "03_infer servers")
    return cls(server_urls or p.server_urls, sampling(), vocab_size=len(tokenizer), concurrency=p.concurrency,
               timeout_s=p.timeout_s, max_retries=p.max_retries, backoff_s=p.backoff_s, backoff_max_s=p.backoff_max_s,
               api_key=api_key, model=p.served_model, all_down_s=p.all_down_s, stream=p.stream, stall_s=p.stall_s,
               min_tokens_per_s=p.min_tokens_per_s, max_error_fraction=p.max_error_fraction)  # fmt: skip


@contextlib.contextmanager
def local_server(cfg: params.StageConfig, names: list[str]):
    """``engine: vllm``: a vLLM CPU server on 127.0.0.1 serving the target (float32, `vllm_threads`), started
    here and stopped when the stage ends; yields its URLs ([] for the other engines)."""
    p = cfg.stage
    if p.engine != "vllm":
        yield []
        return
    from eagle_lib.engines.vllm_server import start_vllm

    longest = max((int(r["n_prompt_tokens"]) for n in names
                   for r in store.iter_jsonl(cfg.out("data", "B", n, "prompts.jsonl"))), default=0)  # fmt: skip
    max_len = p.vllm_max_model_len or longest + cfg.shared.max_new_tokens + 8
    threads = machine.cpu_threads(p.vllm_threads)
    with start_vllm(models.resolve(cfg.shared.target), tokenizer=models.resolve(cfg.shared.tokenizer_path),
                    max_model_len=max_len, log_dir=cfg.out("infer"),  # a file: infer/<dir> is a dataset
                    env={"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as srv:  # fmt: skip
        yield [srv.base_url]


def pending_order(pending: list[dict], seed: int, name: str, shuffle: bool = True) -> list[dict]:
    """The prompts in a seeded random order per dataset (same seed, same order on every machine and restart)."""
    out = list(pending)
    if shuffle:
        random.Random(f"{seed}:{name}").shuffle(out)
    return out


def generate_pending(engine, pending: list[dict], tokenizer, out_dir: Path, p: Params, name: str,
                     identity: dict | None = None) -> dict:  # fmt: skip
    """Run the engine over one dataset's pending prompts, committing responses and errors; returns run counters."""
    return commit.generate_many(engine, {name: (pending, out_dir)}, tokenizer, p, identity)[name]


@dataclass
class DatasetPlan:
    """One single-turn dataset's part of a 03 run: what is selected, resumed and still pending."""

    name: str
    started: float
    src: Path
    ds_dir: Path
    out_dir: Path
    selected: list[dict]
    pending: list[dict]
    resume: Resume
    resumed: int
    merged: int
    dups: int
    moved: int


def plan_dataset(
    cfg: params.StageConfig, name: str, engine, shard: tuple[int, int] | None, identity: dict | None
):
    """A single-turn dataset's `DatasetPlan`, or None for an each_turn one (`run_multiturn`)."""
    started = time.time()
    p = cfg.stage
    src = cfg.out("data", "B", name, "prompts.jsonl")
    ds_dir = cfg.out("infer", name)
    out_dir = ds_dir / "shards" / f"{shard[0]}-of-{shard[1]}" if shard else ds_dir
    everything = load_prompts(src)
    if any("followups" in r for r in everything):  # 02 turn: each_turn
        return None
    prompts = {r["id"]: r for r in everything}
    selected = [
        r for r in everything[: p.limit or None] if shard is None or shard_of(r["id"], shard[1]) == shard[0]
    ]
    resume = Resume(ds_dir, prompts, engine.sampling.record(), identity, list(engine.sampling.stop_token_ids))
    done, dups, moved = resume.load(p.on_stale)
    if moved:
        print(f"03_infer {name}: set aside {moved} record(s) made by another target, stop ids, sampling or "
              f"prompts -> {ds_dir / 'stale.jsonl'}")  # fmt: skip
    merged = merge_shards(ds_dir, done) if shard is None else 0
    failed_before = error_ids(ds_dir)
    pending = [
        r for r in selected if r["id"] not in done and (p.retry_errors or r["id"] not in failed_before)
    ]
    pending = pending_order(pending, cfg.shared.seed, name, p.shuffle)
    resumed = sum(r["id"] in done for r in selected)
    return DatasetPlan(
        name, started, src, ds_dir, out_dir, selected, pending, resume, resumed, merged, dups, moved
    )


def finish_dataset(cfg: params.StageConfig, plan: DatasetPlan, stats: dict, engine, identity, shard) -> dict:
    """Count what the run left in a dataset's files; its meta (also written to meta.json)."""
    p, name = cfg.stage, plan.name
    done, dups, _ = plan.resume.load()
    errs = error_ids(plan.ds_dir)
    selected = plan.selected
    kept = [done[r["id"]] for r in selected if r["id"] in done]
    rejected = [errs[r["id"]] for r in selected if r["id"] not in done and r["id"] in errs]
    if len(kept) + len(rejected) != len(selected):
        raise InferError(
            f"{name}: {len(selected) - len(kept) - len(rejected)} prompts neither answered nor failed"
        )
    n_out = [k["n_output_tokens"] for k in kept]
    meta = {
        "read": len(selected), "kept": len(kept), "dropped": {}, "rejected": len(rejected),
        "errors_by_reason": dict(Counter(e["reason"] for e in rejected)),
        "finish_reason": dict(Counter(k["finish_reason"] for k in kept)),
        "output_tokens": sum(n_out), "mean_output_tokens": round(sum(n_out) / max(len(n_out), 1), 2),
        "max_output_tokens": max(n_out, default=0), "resumed": plan.resumed, "merged_from_shards": plan.merged,
        "duplicates_ignored": dups, "set_aside": plan.moved, **stats, "engine": engine.name, "target": identity, "sampling": engine.sampling.record(),
        "stop_token_ids": list(engine.sampling.stop_token_ids), "shard": f"{shard[0]}/{shard[1]}" if shard else None,
        "input": {"path": str(plan.src), "sha256": file_sha256(plan.src)}, "params": p.model_dump(mode="json"),
    }  # fmt: skip
    return store.write_meta(plan.out_dir, meta, plan.started, tally=True)


def run_dataset(cfg: params.StageConfig, name: str, engine, tokenizer, shard: tuple[int, int] | None,
                identity: dict | None = None) -> dict:  # fmt: skip
    """Regenerate one dataset's missing responses; returns its meta (also written to meta.json)."""
    plan = plan_dataset(cfg, name, engine, shard, identity)
    if plan is None:
        everything = load_prompts(cfg.out("data", "B", name, "prompts.jsonl"))
        return run_multiturn(cfg, name, engine, tokenizer, shard, identity, everything, time.time())
    stats = generate_pending(engine, plan.pending, tokenizer, plan.out_dir, cfg.stage, name, identity)
    return finish_dataset(cfg, plan, stats, engine, identity, shard)


def run_datasets(
    cfg: params.StageConfig, names: list[str], engine, tokenizer, shard, identity
) -> tuple[dict, float]:
    """Every dataset of the stage: the single-turn ones' pending prompts in one interleaved run (a snapshot at any
    moment samples all of them), then the each_turn ones (turn by turn, one dataset at a time); (metas, the
    seconds spent generating)."""
    plans = {n: plan_dataset(cfg, n, engine, shard, identity) for n in names}
    single = {n: pl for n, pl in plans.items() if pl is not None}
    t0 = time.monotonic()
    jobs = {n: (pl.pending, pl.out_dir) for n, pl in single.items()}
    ids = [r["id"] for pend, _ in jobs.values() for r in pend]
    if len(set(ids)) == len(ids):  # 02's ids start with the dataset's name: one interleaved run
        stats = commit.generate_many(engine, jobs, tokenizer, cfg.stage, identity)
    else:  # ids shared between datasets (hand-made prompt files): one run per dataset
        stats = {
            n: commit.generate_many(engine, {n: job}, tokenizer, cfg.stage, identity)[n]
            for n, job in jobs.items()
        }
    seconds = time.monotonic() - t0
    metas = {}
    for n in names:
        if plans[n] is not None:
            metas[n] = finish_dataset(cfg, plans[n], stats[n], engine, identity, shard)
        else:
            metas[n] = run_dataset(cfg, n, engine, tokenizer, shard, identity)
            seconds += metas[n]["generate_seconds"]
    return metas, seconds


def run_multiturn(cfg: params.StageConfig, name: str, engine, tokenizer, shard, identity, everything: list[dict],
                  started: float) -> dict:  # fmt: skip
    """Regenerate every turn of one each_turn dataset (`engines.turns`); meta counts conversations."""
    from eagle_lib.engines import turns

    p, src, ds_dir = cfg.stage, cfg.out("data", "B", name, "prompts.jsonl"), cfg.out("infer", name)
    out_dir = ds_dir / "shards" / f"{shard[0]}-of-{shard[1]}" if shard else ds_dir
    mine = [r for r in everything[: p.limit or None] if not shard or shard_of(r["id"], shard[1]) == shard[0]]
    stop = list(engine.sampling.stop_token_ids)
    encoder, stop_strings = turns.encoder_for(src.parent, tokenizer, stop)

    def generate(todo: list) -> dict:
        reqs = pending_order([x.request() for x in todo], cfg.shared.seed, name, p.shuffle)
        return generate_pending(engine, reqs, tokenizer, out_dir, p, name, identity)

    res = turns.run_conversations(convs := {r["id"]: r for r in mine}, ds_dir, out_dir, encoder, stop_strings, engine.sampling.record(), identity,
                                  stop, generate, p.on_stale, p.retry_errors, merge=shard is None)  # fmt: skip
    meta = turns.meta(res, convs, error_ids(ds_dir)) | {
        "engine": engine.name, "target": identity, "sampling": engine.sampling.record(), "stop_token_ids": stop,
        "shard": f"{shard[0]}/{shard[1]}" if shard else None, "input": {"path": str(src), "sha256": file_sha256(src)},
        "params": p.model_dump(mode="json"),
    }  # fmt: skip
    return store.write_meta(out_dir, meta, started, tally=True)


def run(cfg: params.StageConfig, shard: str = "") -> dict:
    """Run 03_infer over every selected B dataset; returns the stage meta (written to infer/meta.json)."""
    started = time.time()
    where = parse_shard(shard)
    names = dataset_names(cfg)
    with local_server(cfg, names) as urls:
        with warnings.catch_warnings():  # tqdm's "IProgress not found" (no ipywidgets) is noise
            warnings.filterwarnings("ignore", message="IProgress not found")
            tokenizer = models.load_tokenizer(cfg.shared)
            engine = make_engine(cfg, tokenizer, urls)
        try:  # the live servers serve one model, the one earlier runs of this target recorded
            probe = engine.check(tokenizer)
            identity = target_identity(engine, cfg.shared, probe, tokenizer)
            probe["fingerprint"] = fingerprint.settle(engine, cfg.out("infer"), identity)
        except EngineError as e:
            raise InferError(f"03_infer: {e}") from None
        try:
            metas, seconds = run_datasets(cfg, names, engine, tokenizer, where, identity)
        except commit.Stopped as e:  # the answers written are kept; infer/meta.json says it stopped early
            if not where:
                commit.record_stop(cfg.out("infer", "meta.json"), e, engine, probe, cfg.stage, started)
            raise
    keys = ("read", "kept", "rejected", "output_tokens", "generated", "generated_tokens")
    total = {k: sum(m[k] for m in metas.values()) for k in keys} | {"generate_seconds": round(seconds, 3)}
    meta = total | {
        "dropped": {}, "datasets": metas, "probe": probe, "shard": shard or None, "target": identity,
        "servers": engine.server_stats() if hasattr(engine, "server_stats") else [],
        "deadlines": engine.deadlines.record() if hasattr(engine, "deadlines") else None,
        "tokens_per_s": round(total["generated_tokens"] / max(total["generate_seconds"], 1e-9), 2),
        "finish_reason": dict(sum((Counter(m["finish_reason"]) for m in metas.values()), Counter())),
        "params": cfg.stage.model_dump(mode="json"), "shared": cfg.shared.model_dump(mode="json"),
        "started": store.now_iso(started), "finished": store.now_iso(), "seconds": round(time.time() - started, 3),
    }  # fmt: skip
    store.check_tally(meta, "infer/meta.json")
    too_many = total["rejected"] > cfg.stage.max_error_fraction * total["read"]
    meta["status"] = "failed" if too_many else "ok"
    if not where:
        store.write_json(cfg.out("infer", "meta.json"), meta)
    if too_many:
        reasons = sum((Counter(m["errors_by_reason"]) for m in metas.values()), Counter()).most_common(3)
        raise InferError(
            f"03_infer: {total['rejected']}/{total['read']} prompts failed (> max_error_fraction "
            f"{cfg.stage.max_error_fraction}); reasons {reasons}; see infer/<dataset>/errors.jsonl"
        )
    return meta


def main(argv: list[str] | None = None) -> int:
    """CLI: python -m eagle_lib.infer PARAMS.yaml [--run-dir DIR] [--shard i/n]."""
    ap = argparse.ArgumentParser(
        prog="python -m eagle_lib.infer", description="Stage 03_infer (one shard or all)."
    )
    ap.add_argument("params_file")
    ap.add_argument("--run-dir", default="", help="default: outputs/<run_name>")
    ap.add_argument("--shard", default="", help="i/n: this machine generates shard i of n (0-based)")
    a = ap.parse_args(argv)
    run_params = params.load_params(a.params_file)
    cfg = params.StageConfig(
        "03_infer", Path(a.run_dir or run_params.run_dir), run_params.shared, run_params.stage("03_infer")
    )
    meta = run(cfg, shard=a.shard)
    from eagle_lib import infer_tables

    print(infer_tables.summary_table(meta).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
