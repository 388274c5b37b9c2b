"""A local folder laid out like a hub dataset repository, made from toy jsonl files (the hub-path tests).

repo/README.md                          YAML card: two configs (chat: parquet, tools: jsonl)
repo/chat/train-00000-of-00002.parquet  the chat rows, split over two parquet shards
repo/chat/train-00001-of-00002.parquet
repo/tools/train.jsonl                  the tool rows as they were
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CARD = """---
configs:
- config_name: chat
  default: true
  data_files:
  - split: train
    path: chat/train-*.parquet
- config_name: tools
  data_files:
  - split: train
    path: tools/train-*.parquet
---
# toy hub-layout dataset (tests only)
"""


def build(repo: Path, chat_jsonl: Path, tools_jsonl: Path) -> Path:
    """Write the repository folder; returns it."""
    (repo / "chat").mkdir(parents=True, exist_ok=True)
    for sub in ("tools", "raw"):
        (repo / sub).mkdir(parents=True, exist_ok=True)
    (repo / "README.md").write_text(CARD)
    rows = _rows(chat_jsonl)
    half = len(rows) // 2
    for k, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.Table.from_pylist(part), repo / "chat" / f"train-0000{k}-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(tools_jsonl)), repo / "tools" / "train-00000-of-00001.parquet")
    shutil.copy(tools_jsonl, repo / "raw" / "native_tools.jsonl")
    return repo


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
