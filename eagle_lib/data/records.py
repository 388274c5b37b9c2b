"""The body stages 01 and 02 share: rows mapped on worker processes (tokenizer loaded once per worker), each row
guarded (malformed rows and template failures become rejects with reasons), one dataset's output staged in a partial
directory and published with its meta.json, the stage meta, and the tally tables of the reports.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import re
import shutil
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle_lib import models, params, store
from eagle_lib.data import chat, formats

# tqdm.auto, imported by transformers / datasets, warns on stderr in a kernel without ipywidgets: noise in the
# executed 01/02 reports (their progress bars are off anyway)
warnings.filterwarnings("ignore", message="IProgress not found")


def unique_names(datasets: list) -> list:
    """Dataset names name output directories: they must be unique."""
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate dataset names: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return datasets


class StageFailed(RuntimeError):
    """A dataset failed a stage check (e.g. too many rejects); the message names dataset, numbers and files."""


# ---------------------------------------------------------------- workers (shared with 02_extract_B)

_WORKER: dict[str, Any] = {}


def init_worker(tokenizer_path: str, hub: dict, template_kwargs: dict, stage_params: Any) -> None:
    """Load the tokenizer once per worker process (and in-process when running single-worker); `hub`:
    `models.hub_kwargs` (trust_remote_code and the pinned revision)."""
    from transformers import AutoTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = AutoTokenizer.from_pretrained(tokenizer_path, **hub)
    _WORKER.update(encoder=chat.ChatEncoder(tok, template_kwargs), vocab_size=len(tok), params=stage_params)


def worker_state() -> dict[str, Any]:
    """The worker's encoder, vocab size and stage params (set by :func:`init_worker`)."""
    return _WORKER


def reject(where: dict, reason: str) -> tuple[str, dict]:
    return "rejected", {**where, "reason": reason}


def guarded(src: formats.Source, where: dict, row: dict | None, error: str | None, fn: Callable) -> tuple:
    """Run ``fn(conversation)`` on one row: malformed rows and template failures become rejects with reasons."""
    if error is not None:
        return reject(where, error)
    try:
        return fn(formats.adapt(row, src, where))
    except formats.Skip as s:
        return "dropped", s.reason
    except (formats.Malformed, chat.ChatError) as e:
        return reject(where, str(e))
    except Exception as e:  # an adapter tripping on data of an unforeseen shape: reject it, keep going
        return reject(where, f"unexpected {type(e).__name__}: {e}")


def parallel_map(fn: Callable, tasks: Iterator, n_workers: int, initargs: tuple) -> Iterator:
    """``fn`` over ``tasks`` in order on ``n_workers`` processes, with a bounded number of tasks in flight."""
    if n_workers <= 1:
        init_worker(*initargs)
        yield from map(fn, tasks)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(n_workers, initializer=init_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(fn, (task,)))
            if len(pending) >= 2 * n_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def batches(src: formats.Source, size: int) -> Iterator[tuple[formats.Source, list]]:
    """(source, rows) tasks of ``size`` rows each."""
    buf: list = []
    for item in formats.iter_rows(src):
        buf.append(item)
        if len(buf) >= size:
            yield src, buf
            buf = []
    if buf:
        yield src, buf


# ---------------------------------------------------------------- per-dataset output


def fingerprint(src: formats.Source, stage_params: dict, tokenizer: Any) -> str:
    """Key of a dataset output: source (file size + mtime, or hub id), params, tokenizer (vocab + template), code."""
    path = formats.resolve_path(src.path)
    p = Path(path)
    stat = [p.stat().st_size, p.stat().st_mtime_ns] if p.exists() else [path]
    tok = hashlib.sha256(
        f"{len(tokenizer)}|{tokenizer.chat_template}|{tokenizer.name_or_path}".encode()
    ).hexdigest()
    return store.stable_hash(
        {
            "source": src.model_dump(),
            "stat": stat,
            "params": stage_params,
            "tokenizer": tok,
            "code": _code_key(),
        }
    )


def _code_key() -> str:
    """Hash of the modules that decide a record (adapters, rendering, masks): an output made by older code,
    e.g. masks from a fallback that verified nothing, is redone rather than reused."""
    from eagle_lib.data import chat_spans, readers

    blob = b"".join(Path(m.__file__).read_bytes() for m in (chat, chat_spans, formats, readers))
    return hashlib.sha256(blob).hexdigest()[:16]


def reason_key(reason: str) -> str:
    """A reject reason without its record-specific parts, for counting: "message 4: the template does not
    render the assistant content verbatim" -> "the template does not render the assistant content verbatim"."""
    reason = re.sub(r"^message \d+( \(\w+\))?: ", "", reason)
    return re.sub(r"\d+", "N", reason.split(" (")[0].split(": ")[0])[:80]


class DatasetOutput:
    """Writes one dataset's records + rejects into a partial directory; publishes it with meta.json at the end."""

    def __init__(self, root: Path, name: str, records_file: str, key: str):
        # staged outside root, so that readers globbing root/*/records.jsonl never see a half-written dataset
        self.final, self.tmp = root / name, root.parent / f".{root.name}.partial" / name
        self.records_file, self.key = records_file, key
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.counts: Counter = Counter()
        self.dropped: Counter = Counter()
        self.reject_reasons: Counter = Counter()
        self.ids: set[str] = set()
        self._buf: dict[str, list] = {records_file: [], "rejects.jsonl": []}
        self.started = time.time()

    def add(self, kind: str, payload: Any) -> None:
        """One row's outcome; a kept row's payload is a record or, for ``turns: each``, a list of them."""
        self.counts["read"] += 1
        recs = payload if isinstance(payload, list) else [payload]
        if kind == "kept" and any(
            r["id"] in self.ids for r in recs
        ):  # a source id seen before: keep the first
            kind, payload = "dropped", "duplicate_id"
        if kind == "kept":
            self.counts["kept"] += 1
            self.ids.update(r["id"] for r in recs)
            for rec in recs:
                self.counts["sequences"] += 1
                self._write(self.records_file, rec)
        elif kind == "dropped":
            self.dropped[payload] += 1
        else:
            self.counts["rejected"] += 1
            self.reject_reasons[reason_key(payload["reason"])] += 1
            self._write("rejects.jsonl", payload)

    def _write(self, fname: str, rec: dict) -> None:
        self._buf[fname].append(rec)
        if len(self._buf[fname]) >= 256:
            self.flush()

    def flush(self) -> None:
        for fname, recs in self._buf.items():
            store.append_jsonl(self.tmp / fname, recs)
            recs.clear()

    def publish(self, extra: dict) -> dict:
        """Flush, write meta.json (tally checked) and move the directory into place."""
        self.flush()
        meta = {
            "read": self.counts["read"],
            "kept": self.counts["kept"],
            "dropped": dict(self.dropped),
            "rejected": self.counts["rejected"],
            "sequences": self.counts["sequences"],  # records written (turns: each writes several per row)
            "reject_reasons": dict(self.reject_reasons),
            "fingerprint": self.key,
        } | extra
        store.check_tally(meta, str(self.final / "meta.json"))
        meta = store.write_meta(self.tmp, meta, self.started)
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.tmp, self.final)
        try:
            self.tmp.parent.rmdir()
        except OSError:  # another dataset is still staged there
            pass
        return meta


def reusable(root: Path, name: str, key: str) -> dict | None:
    """The meta of a complete, passing earlier output made with the same fingerprint, else None."""
    path = root / name / "meta.json"
    if not path.exists():
        return None
    meta = store.read_json(path)
    return meta if meta.get("fingerprint") == key and meta.get("status") == "ok" else None


def finish_dataset(out: DatasetOutput, extra: dict, limit: float) -> dict:
    """Publish a dataset; it fails (status "failed", message in "failure") if it rejected more than ``limit``."""
    read, rejected = out.counts["read"], out.counts["rejected"]
    extra = {"status": "ok"} | extra
    if read and rejected / read > limit:
        top = ", ".join(f"{r} x{n}" for r, n in out.reject_reasons.most_common(3))
        extra["status"] = "failed"
        extra["failure"] = (
            f"dataset {out.final.name}: {rejected}/{read} rows rejected ({rejected / read:.1%} > "
            f"max_reject_fraction {limit:.1%}); reasons: {top}; see {out.final / 'rejects.jsonl'}"
        )
    return out.publish(extra) | {"reused": False}


def finish_stage(
    cfg: params.StageConfig, root: Path, metas: dict[str, dict], started: float, extra: dict | None = None
) -> dict:
    """Write the stage meta.json (sums over datasets); raise StageFailed naming every failed dataset."""
    total = {"read": 0, "kept": 0, "rejected": 0, "dropped": Counter()}
    for m in metas.values():
        for k in ("read", "kept", "rejected"):
            total[k] += m[k]
        total["dropped"].update(m["dropped"])
    failed = [m["failure"] for m in metas.values() if m.get("failure")]
    meta = (
        total
        | {
            "dropped": dict(total["dropped"]),
            "datasets": metas,
            "params": cfg.stage.model_dump(mode="json"),
            "shared": cfg.shared.model_dump(mode="json"),
            "status": "failed" if failed else "ok",
        }
        | (extra or {})
    )
    meta = store.write_meta(root, meta, started, tally=True)
    if failed:
        raise StageFailed(f"{cfg.name} failed:\n" + "\n".join(failed))
    return meta


def tally_table(meta: dict, item: str = "records"):
    """The final tally: per dataset read / kept ``item`` / dropped / rejected (+ token sums), and a TOTAL row."""
    import pandas as pd

    rows = []
    for name, m in meta["datasets"].items():
        row = {"dataset": name, "read": m["read"], item: m["kept"], "dropped": sum(m["dropped"].values())}
        row |= {"rejected": m["rejected"]}
        if m.get("sequences", m["kept"]) != m["kept"]:
            row["sequences"] = m["sequences"]  # turns: each, one sequence per assistant turn
        row |= {k: m[k] for k in ("tokens", "trainable_tokens") if k in m}
        rows.append(row)
    df = pd.DataFrame(rows)
    if "sequences" in df:
        df["sequences"] = df["sequences"].fillna(df[item]).astype(int)
    total = df.drop(columns="dataset").sum(numeric_only=True)
    return pd.concat([df, pd.DataFrame([{"dataset": "TOTAL", **total.to_dict()}])], ignore_index=True)


def run_stage(cfg: params.StageConfig, part: str, run_one) -> dict:
    """Shared body of 01 (part "A") and 02 (part "B"): load the tokenizer, check its template, run
    `run_one(cfg, src, root, tok, initargs)` per dataset into data/<part>/, write the stage meta."""
    started = time.time()
    tok = models.load_tokenizer(cfg.shared)
    probe = chat.ChatEncoder(tok, cfg.stage.chat_template_kwargs).probe  # fail early on an unusable template
    root = cfg.out("data", part)
    root.mkdir(parents=True, exist_ok=True)
    initargs = (models.resolve(cfg.shared.tokenizer_path), models.hub_kwargs(cfg.shared, tokenizer=True),
                cfg.stage.chat_template_kwargs, cfg.stage)  # fmt: skip
    metas = {src.name: run_one(cfg, src, root, tok, initargs) for src in cfg.stage.datasets}
    template = {"assistant_header": probe.header, "end_of_turn": list(probe.ends),
                "drops_history_reasoning": probe.drops_history_reasoning}  # fmt: skip
    return finish_stage(cfg, root, metas, started, {"template": template})


def reasons_table(meta: dict):
    """Every dropped and rejected row counted by dataset and reason."""
    import pandas as pd

    rows = [
        {"dataset": name, "outcome": outcome, "reason": reason, "rows": n}
        for name, m in meta["datasets"].items()
        for outcome, reasons in (("dropped", m["dropped"]), ("rejected", m["reject_reasons"]))
        for reason, n in reasons.items()
    ]
    return pd.DataFrame(rows, columns=["dataset", "outcome", "reason", "rows"])


def rejects_sample(cfg: params.StageConfig, kind: str, per_dataset: int = 3):
    """The first rejected rows of each dataset of data/<kind>/: file, line or row, reason."""
    import pandas as pd

    rows = []
    for path in sorted(cfg.out("data", kind).glob("*/rejects.jsonl")):
        for k, rec in enumerate(store.iter_jsonl(path)):
            if k >= per_dataset:
                break
            at = f"line {rec['line']}" if "line" in rec else f"row {rec.get('row')}"
            file = Path(
                str(rec.get("file"))
            ).name  # the full path is in rejects.jsonl; the name answers "where"
            rows.append({"dataset": path.parent.name, "file": file, "at": at, "reason": rec.get("reason")})
    return pd.DataFrame(rows)


def headline(meta: dict) -> dict:
    """The stage's headline numbers for report.record."""
    sets = meta["datasets"].values()
    out = {k: meta[k] for k in ("read", "kept", "rejected")} | {"dropped": sum(meta["dropped"].values())}
    out["tokens"] = sum(m.get("tokens", 0) for m in sets)
    if any("trainable_tokens" in m for m in sets):
        out["trainable_tokens"] = sum(m.get("trainable_tokens", 0) for m in sets)
    out["seconds"] = meta["seconds"]
    out["datasets"] = {
        n: {k: m[k] for k in ("read", "kept", "rejected")} for n, m in meta["datasets"].items()
    }
    return out


def top_reasons(counts: dict[str, int], k: int = 3) -> str:
    """ "reason x n, ..." of the k most frequent reasons (and how many more)."""
    items = sorted(counts.items(), key=lambda kv: -kv[1])
    out = ", ".join(f"{r} x{n}" for r, n in items[:k])
    return out + (f", +{len(items) - k} more" if len(items) > k else "")


def outcome_clause(meta: dict) -> str:
    """ "(3 rejected: reason x2, ...; 5 dropped: duplicate x5)" or "" when nothing was lost."""
    parts = []
    reasons: Counter = Counter()
    dropped: Counter = Counter()
    for m in meta["datasets"].values():
        reasons.update(m.get("reject_reasons", {}))
        dropped.update(m["dropped"])
    if meta["rejected"]:
        parts.append(f"{meta['rejected']:,} rejected: {top_reasons(reasons)}")
    if sum(dropped.values()):
        parts.append(f"{sum(dropped.values()):,} dropped: {top_reasons(dropped)}")
    return f" ({'; '.join(parts)})" if parts else ""


def markdown(text: str):
    """Rendered as Markdown in a notebook (plain text elsewhere)."""
    from IPython.display import Markdown

    return Markdown(text)
