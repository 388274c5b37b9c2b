"""Reading a dataset source row by row: local json / jsonl / parquet files (json and jsonl also gzipped),
``toy://data/<name>``, ``pypi://<package>/<file>`` (a file inside an installed package), and hub ids or local
folders laid out like a hub dataset repository (both through ``datasets.load_dataset``).

A JSON array is read record by record: a file cut off inside a record (ShareGPT V3's file in its PyPI wheel) gives
every whole record before the cut and one unreadable row for the rest, with its byte offsets, which the stages
count and report like any rejected row.

:func:`iter_rows` yields ``(where, row, error)``: where = {file, line | row}, error = why a row is unreadable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Malformed(ValueError):
    """A row that does not follow its schema: rejected (written to rejects.jsonl with the reason)."""


def is_hub_id(path: str) -> bool:
    """True for strings that look like a hub dataset id ("owner/name") and are not a local file."""
    return (
        re.fullmatch(r"[\w.-]+/[\w.-]+", path) is not None
        and not Path(path).exists()
        and Path(path).suffix not in (".json", ".jsonl", ".parquet", ".gz")
        and not path.startswith("pypi://")
    )


def resolve_path(path: str) -> str:
    """toy://data/<name> -> the toy world's file; other strings pass through."""
    from eagle_lib.models import resolve

    return resolve(path)


def iter_rows(src: Any) -> Iterator[tuple[dict, dict | None, str | None]]:
    """Yield ``(where, row, error)`` for every row of ``src``: ``where`` = {file, line|row}; error = why unreadable."""
    path = resolve_path(src.path)
    if is_hub_id(path) or Path(path).is_dir():  # a folder laid out like a hub dataset repo reads the same way
        rows = _iter_hub(src, path)
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"dataset {src.name}: {path}: no such file (and not a hub id)")
        rows = _iter_parquet(p) if p.suffix == ".parquet" else _iter_json(p)
    skip = getattr(src, "skip", 0)
    for n, item in enumerate(rows):
        if n < skip:
            continue
        if src.max_read and n - skip >= src.max_read:
            return
        yield item


def _open(path: Path):
    """A binary file object, gunzipped when the name ends in .gz."""
    if path.suffix == ".gz":
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


def _iter_json(path: Path) -> Iterator[tuple[dict, dict | None, str | None]]:
    with _open(path) as f:
        head = f.read(1024).lstrip()
    if path.name.removesuffix(".gz").endswith(".json") and head.startswith(b"["):
        yield from _iter_json_array(path)
        return
    with _open(path) as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = {"file": str(path), "line": lineno}
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield where, None, f"invalid UTF-8 at byte {e.start}"
                continue
            except json.JSONDecodeError as e:
                yield where, None, f"invalid JSON: {e.msg} (column {e.colno})"
                continue
            yield _checked(where, row)


def _iter_json_array(path: Path) -> Iterator[tuple[dict, dict | None, str | None]]:
    """The records of a JSON array one by one; where the array cannot be read on (a file cut off inside a
    record, or broken JSON), one unreadable row for the rest of the file, naming its byte offsets."""
    with _open(path) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Malformed(f"{path}: invalid UTF-8 at byte {e.start}") from None
    dec = json.JSONDecoder()
    pos, n, end = text.index("[") + 1, 0, len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n":
            pos += 1
        if pos < end and text[pos] == "]":
            return
        if pos < end and text[pos] == "," and n:
            pos += 1
            while pos < end and text[pos] in " \t\r\n":
                pos += 1
        where = {"file": str(path), "row": n}
        try:
            row, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            closed = text.rstrip().endswith("]")
            cut = f"invalid JSON: {e.msg}" if closed else "the file is cut off: the array is never closed"
            rest = len(text[pos:].encode("utf-8"))
            yield where, None, f"unreadable rest of the JSON array ({cut}): {rest:,} bytes from record {n} on"
            return
        yield _checked(where, row)
        n += 1


def _checked(where: dict, row: Any) -> tuple[dict, dict | None, str | None]:
    if not isinstance(row, dict):
        return where, None, f"expected a JSON object, got {type(row).__name__}"
    return where, row, None


def _iter_parquet(path: Path) -> Iterator[tuple[dict, dict | None, str | None]]:
    import pyarrow.parquet as pq

    i = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield {"file": str(path), "row": i}, row, None
            i += 1


def _iter_hub(src: Any, hub_id: str) -> Iterator[tuple[dict, dict | None, str | None]]:
    import datasets

    datasets.disable_progress_bars()  # progress bars go to stderr: noise in the executed reports
    datasets.logging.set_verbosity_error()
    kw = {"data_files": src.data_files} if src.data_files else {}
    if Path(hub_id).is_dir():  # a local folder: cache under its content, never another folder's of that name
        kw["cache_dir"] = str(Path(datasets.config.HF_DATASETS_CACHE) / "local" / folder_key(Path(hub_id)))
    ds = datasets.load_dataset(
        hub_id, name=src.config or None, split=src.split, streaming=src.streaming, **kw
    )
    label = f"{hub_id}[{src.config or 'default'}:{src.split}]"
    for i, row in enumerate(ds):
        yield {"file": label, "row": i}, _without_nulls(row), None


def folder_key(folder: Path) -> str:
    """A hash of a folder's path and its files' names, sizes and mtimes: `datasets` names its cache of a local
    folder by the folder's name and the data files' names alone, so two folders called ``ultrachat_200k`` (or a
    rebuilt one) would otherwise read each other's cached rows."""
    import hashlib

    h = hashlib.sha256(str(folder.resolve()).encode())
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _without_nulls(val: Any) -> Any:
    """Arrow stores rows as structs: a key one row lacks comes back as None in every other row (a tool schema
    gains the properties of all the others' tools). Keys with None values are dropped, as if missing."""
    if isinstance(val, dict):
        return {k: _without_nulls(v) for k, v in val.items() if v is not None}
    if isinstance(val, list):
        return [_without_nulls(v) for v in val]
    return val
