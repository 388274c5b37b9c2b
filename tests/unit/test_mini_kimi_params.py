"""params/mini_kimi.yaml is params/kimi_k25.yaml with only targets, paths, URLs and sizes changed: what CI runs on
the mini-Kimi world is the Kimi recipe. The files are compared key by key (dataset lists by dataset name); every
difference must match a rule below, each with its reason."""

from __future__ import annotations

import copy
import fnmatch
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
KIMI, MINI = ROOT / "params" / "kimi_k25.yaml", ROOT / "params" / "mini_kimi.yaml"

# key pattern (fnmatch over the dotted path; lists of datasets are keyed by their name) -> why it may differ
ALLOWED: dict[str, str] = {
    "run_name": "name",
    "shared.target": "target",
    "shared.device": "machine: no GPU here",
    "shared.max_new_tokens": "size",
    "stages.0[12]_*.datasets.*.path": "path: local files and hub-layout folders for hub ids",
    "stages.0[12]_*.datasets.*.max_read": "size",
    "stages.0[12]_*.datasets.*.max_prompts": "size",
    "stages.0[12]_*.batch_size": "size",
    "stages.03_infer.server_urls": "URLs",
    "stages.03_infer.concurrency": "size",
    "stages.03_infer.write_every": "size",
    "stages.04_length_analysis.min_samples_to_project": "size",
    "stages.05_train_eagle3.hidden_dump_dir": "path",
    "stages.05_train_eagle3.tensor_parallel_size": "size: one CPU vLLM per producer",
    "stages.05_train_eagle3.max_buffer_gb": "size",
    "stages.05_train_eagle3.aux_layers": "size: [1, L//2-1, L-4] of the mini target's 8 layers",
    "stages.05_train_eagle3.draft_vocab_size": "size",
    "stages.05_train_eagle3.warmup_steps": "size",
    "stages.05_train_eagle3.pack_len": "size",
    "stages.05_train_eagle3.max_seq_len": "size",
    "stages.05_train_eagle3.max_eval_samples": "size",
    "stages.05_train_eagle3.nproc_per_node": "size: 2 processes on 2 cores",
    "stages.05_train_eagle3.ranks_per_producer": "size: one producer a rank here (the pipeline test runs every rank's "
    "COMMAND); Kimi's 3 ranks a TP-8 producer fit 4 x 8 GPUs",
    "stages.05_train_eagle3.checkpoint_every": "size",
    "stages.05_train_eagle3.log_every": "size",
    "stages.06_eval_acceptance.online_engine": "machine: SGLang cannot serve on these CPUs, vLLM CPU does",
    "stages.06_eval_acceptance.online_format": "machine: the export the engine serves (SGLang: sglang, vLLM here: "
    "speculators), which the live check compares with the server's draft path",
    "stages.06_eval_acceptance.online_url": "URL",
    "stages.06_eval_acceptance.online_max_prompts": "size",
    "stages.06_eval_acceptance.online_concurrency": "size",
    "stages.06_eval_acceptance.max_prompts_per_dataset": "size",
    "stages.06_eval_acceptance.max_prompt_tokens": "size",
    "stages.06_eval_acceptance.eval_max_new_tokens": "size",
    "stages.06_eval_acceptance.serve_tp": "size",
    "stages.06_eval_acceptance.context_buckets": "size",
    "stages.06_eval_acceptance.eval_sets.*.path": "path: local files in each benchmark's schema",
    "stages.06_eval_acceptance.eval_sets.*.max_prompts": "size",
    "stages.07_data_value.max_prompts_per_dataset": "size",
    "stages.07_data_value.bootstrap_reps": "size",
}


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """Dotted paths -> leaf values; a list of dicts with a ``name`` is keyed by name, other lists are leaves."""
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            out |= flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(obj, list) and obj and all(isinstance(x, dict) and "name" in x for x in obj):
        out = {f"{prefix}.names": [x["name"] for x in obj]}
        for x in obj:
            out |= flatten({k: v for k, v in x.items() if k != "name"}, f"{prefix}.{x['name']}")
        return out
    return {prefix: obj}


def unexplained(kimi: dict, mini: dict) -> list[str]:
    """Every key whose value differs (or that only one file has) and that no ALLOWED rule covers."""
    a, b = flatten(kimi), flatten(mini)
    bad = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            if not any(fnmatch.fnmatchcase(key, pat) for pat in ALLOWED):
                bad.append(
                    f"{key}: kimi_k25 {a.get(key, '<absent>')!r} vs mini_kimi {b.get(key, '<absent>')!r}"
                )
    return bad


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_mini_kimi_differs_from_kimi_k25_only_in_targets_paths_urls_and_sizes():
    assert unexplained(load(KIMI), load(MINI)) == []


def test_the_diff_catches_a_recipe_change_a_new_key_and_a_dataset_swap():
    kimi, mini = load(KIMI), load(MINI)
    for edit, key in [
        (lambda m: m["stages"]["05_train_eagle3"].update(learning_rate=0.01), "learning_rate"),
        (lambda m: m["stages"]["05_train_eagle3"].update(max_steps=10), "max_steps"),
        (lambda m: m["stages"]["03_infer"].update(temperature=0.0), "temperature"),
        (lambda m: m["stages"]["02_extract_B"]["datasets"][0].update(turn="first"), "glaive.turn"),
        (lambda m: m["stages"]["02_extract_B"]["datasets"].pop(), "datasets.names"),
        (lambda m: m["shared"].update(trust_remote_code=False), "trust_remote_code"),
    ]:
        changed = copy.deepcopy(mini)
        edit(changed)
        assert any(key in line for line in unexplained(kimi, changed)), key


def test_every_allowed_rule_is_used():
    """A rule nothing needs any more would silently allow a future recipe change: each must match a difference."""
    a, b = flatten(load(KIMI)), flatten(load(MINI))
    differing = [k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>")]
    unused = [pat for pat in ALLOWED if not any(fnmatch.fnmatchcase(k, pat) for k in differing)]
    assert unused == []
