"""The mini-Kimi world's data: the toy datasets as folders laid out like their hub repositories (the Kimi params'
hub ids, configs, splits and data files), and Kimi's own SWE-agent sessions as an OpenAI-style A set."""

from __future__ import annotations

import json
from pathlib import Path

from eagle_lib.toy import datasets

# hub id -> (toy dataset, {config: {split: file}} inside the repo folder), as each repo is laid out on the hub
HUB_LAYOUT: dict[str, tuple[str, dict[str, dict[str, str]]]] = {
    "glaiveai/glaive-function-calling-v2": ("glaive", {"default": {"train": "glaive-function-calling-v2.json"}}),
    "open-r1/Mixture-of-Thoughts": ("mot", {"all": {"train": "all/train-00000-of-00001.jsonl"}}),
    "open-thoughts/OpenThoughts-114k": ("openthoughts_114k", {"default": {"train": "data/train-00000-of-00001.jsonl"}}),
    "open-thoughts/OpenThoughts3-1.2M": ("openthoughts3", {"default": {"train": "data/train-00000-of-00001.parquet"}}),
    "nebius/SWE-agent-trajectories": ("swe_agent", {"default": {"train": "data/train-00000-of-00001.jsonl"}}),
    "nvidia/OpenCodeInstruct": ("opencodeinstruct", {"default": {"train": "data/train-00000-of-00001.parquet"}}),
    "Aeala/ShareGPT_Vicuna_unfiltered": ("sharegpt", {"default": {"train": "ShareGPT_V4.3_unfiltered_cleaned_split.json"}}),
    "HuggingFaceH4/ultrachat_200k": ("ultrachat", {"default": {"train_sft": "data/train_sft-00000-of-00001.parquet",
                                                               "test_sft": "data/test_sft-00000-of-00001.parquet"}}),
}  # fmt: skip


def write_hub_repos(root: Path, valid: dict[str, list[dict]]) -> dict[str, int]:
    """One folder per hub id under ``root``, holding the toy dataset's well-formed rows in that repo's layout
    (configs and splits in a README card, the files where the repo has them); returns rows per repo."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    counts = {}
    for hub_id, (name, configs) in HUB_LAYOUT.items():
        repo, rows = root / hub_id, valid[name]
        card = ["---", "configs:"]
        for c, (config, splits) in enumerate(configs.items()):
            card += [f"- config_name: {config}"] + (["  default: true"] if c == 0 else []) + ["  data_files:"]
            for k, (split, rel) in enumerate(splits.items()):
                part = rows if len(splits) == 1 else rows[k :: len(splits)]
                f = repo / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                if rel.endswith(".parquet"):
                    pq.write_table(pa.Table.from_pylist(part), f)
                elif rel.endswith(".jsonl"):
                    f.write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
                else:  # one JSON array, as glaive's and ShareGPT's files are
                    f.write_text(json.dumps(part), encoding="utf-8")
                card += [f"  - split: {split}", f"    path: {rel}"]
        (repo / "README.md").write_text(
            "\n".join(card + ["---", f"# {hub_id} (mini-Kimi world: toy rows)", ""])
        )
        counts[hub_id] = len(rows)
    return counts


def write_native_swe(path: Path, seed: int, n: int) -> int:
    """Kimi's own SWE-agent sessions as OpenAI-style records (the A set the Kimi params read as native_swe)."""
    convs = datasets.native_conversations(seed, {"swe": n}, "native_swe")
    path.parent.mkdir(parents=True, exist_ok=True)
    recs = [{"id": f"native_swe-{i}", "messages": c["messages"]} for i, c in enumerate(convs)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return len(recs)
