"""A small slice of params/smollm2.yaml, end to end in the suite, so the real path cannot rot: SmolLM2-135M-Instruct
from its PyPI GGUF (converted once into the cache), ShareGPT from its wheel, 03 through a vLLM CPU server the stage
starts itself, 05 on vLLM's hidden states, 06 on held-out ShareGPT, MT-Bench (both turns) and HumanEval at T=0 and
T=1, offline and served by vLLM with the drafter; 07 on the same run in the `full` tier (`make test-all`: ~190 s
here on top of the slice's ~550 s; the toy pipeline's run keeps 07 in `make test`).

The slice is the same params file with only sizes changed (`SLICE`): a handful of prompts, a few steps; 06
without the oracle method and, in `make test`, without its second server (the target alone, for served tokens/s:
the `full` tier reruns 06 with it).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from eagle_lib import store
from eagle_lib.pipeline import REPO_ROOT, run_pipeline

REAL = REPO_ROOT / "params" / "smollm2.yaml"
SLICE = {  # stage -> keys replaced in params/smollm2.yaml (datasets: per-dataset keys)
    "shared": {"max_new_tokens": 48},
    "01_prepare_A": {"max_seq_len": 512, "datasets": {"max_read": 40}},
    "02_extract_B": {"max_seq_len": 512, "datasets": {"max_read": 60, "max_prompts": 10}},
    "03_infer": {"concurrency": 10, "vllm_threads": 1},  # one core: the suite runs two workers side by side
    # 8 steps: what the slice checks (vLLM serves the drafter, its tau agrees with offline) holds for any drafter
    "05_train_eagle3": {"max_steps": 8, "draft_vocab_size": 1024, "pack_len": 512, "max_seq_len": 512,
                        "warmup_steps": 2, "checkpoint_every": 8, "measure_every": 0, "max_eval_samples": 8},
    # no oracle (3 target forwards a cycle, ~15 s here; the toy pipeline's 06 decodes it)
    "06_eval_acceptance": {"methods": ["none", "ngram", "eagle3"], "sampled_methods": ["eagle3"],
                           "max_prompts_per_dataset": 1, "eval_max_new_tokens": 16, "max_prompt_tokens": 384,
                           "sampled_max_prompts": 1, "online_max_prompts": 1, "online_temperatures": [0.0],
                           # the second vLLM server (the same requests without the drafter): the `full` tier's
                           # test_the_slice_serves_the_same_requests_without_the_drafter
                           "online_speed": False, "eval_sets": {"max_prompts": 1}},
    "07_data_value": {"fractions": [0.5, 1.0], "max_prompts_per_dataset": 2, "eval_max_new_tokens": 16,
                      "max_prompt_tokens": 384, "bootstrap_reps": 50, "noise_seeds": 0, "noise_fractions": None,
                      "regen_fraction": 1.0},
}  # fmt: skip


def slice_params(path: Path) -> Path:
    """params/smollm2.yaml with SLICE's sizes, written to `path` (run_name real_ci); 06 also serves the drafter in
    llama.cpp beside the GGUF target where llama.cpp is built (`make test` builds it)."""
    from eagle_lib.serving import llamacpp

    run = yaml.safe_load(REAL.read_text())
    out = copy.deepcopy(run)
    out["run_name"] = "real_ci"
    # built, or being built behind the tests (`make test`: 06's llama.cpp step waits for it)
    out["stages"]["06_eval_acceptance"]["llamacpp"] = llamacpp.missing() is None or llamacpp.building()
    out["shared"].update(SLICE["shared"])
    for stage, keys in SLICE.items():
        if stage == "shared":
            continue
        sec = out["stages"].setdefault(stage, {})
        for k, v in keys.items():
            if k in ("datasets", "eval_sets"):
                sec[k] = [{**d, **v} for d in sec[k]]
            else:
                sec[k] = v
    path.write_text(yaml.safe_dump(out, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    params_file = slice_params(tmp_path_factory.mktemp("real") / "real_ci.yaml")
    # a fresh run each time: an earlier one's records were made by other code (03 would rightly refuse them as
    # stale, as it did when 03's target identity changed)
    shutil.rmtree(REPO_ROOT / "outputs" / "real_ci", ignore_errors=True)
    manifest = run_pipeline(params_file, stages="01-06")
    return Path(manifest["run_dir"])


def _meta(run_dir: Path, *parts: str) -> dict:
    return json.loads(run_dir.joinpath(*parts, "meta.json").read_text())


@pytest.mark.server
def test_the_slice_runs_the_real_model_from_its_gguf_through_vllm_03(real_run):
    from eagle_lib import models
    from eagle_lib.targets import gguf_target

    src = gguf_target.source_of(models.resolve(yaml.safe_load(REAL.read_text())["shared"]["target"]))
    assert src["architecture"] == "llama" and src["file"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    a = _meta(real_run, "data", "A", "sharegpt_orig")
    assert a["read"] == 40 and a["kept"] > 20 and a["trainable_tokens"] > 5_000
    infer = _meta(real_run, "infer")
    assert infer["kept"] == 10 and infer["rejected"] == 0 and infer["probe"]["engine"] == "openai"
    rec = next(store.iter_jsonl(real_run / "infer" / "sharegpt" / "responses.jsonl"))
    assert rec["engine"] == "openai" and rec["n_output_tokens"] > 0 and rec["text"].strip()
    assert list((real_run / "infer").glob("vllm-*.log"))  # the server's log, a file: a folder is a dataset
    assert set(_meta(real_run, "analysis")["inputs"]) == {"A/sharegpt_orig", "B/sharegpt"}


@pytest.mark.server
def test_the_slice_measures_tau_on_mt_bench_and_humaneval_offline_and_served(real_run):
    tau = pd.read_csv(real_run / "eval" / "tau.csv")
    eagle = tau[tau["method"] == "eagle3"]
    sets = set(eagle["dataset"])
    assert {"mt_bench", "mt_bench_turn2", "humaneval", "sharegpt"} <= sets
    assert set(eagle["temperature"]) == {0.0, 1.0}
    for m in ("none", "ngram"):  # the baselines stand beside it
        assert set(tau[tau["method"] == m]["dataset"]) >= {"mt_bench", "humaneval"}
    ev = _meta(real_run, "eval")
    assert (
        ev["eval_sets"]["mt_bench"]["in_training"] == {} and ev["eval_sets"]["humaneval"]["in_training"] == {}
    )
    h = ev["headline"]
    # vLLM serving the drafter beside SmolLM2: the target's greedy output on every prompt, tau = offline's
    assert h["online_greedy_equal"] == 1.0, h.get("online_verdict")
    assert h["online_verdict"]["verdict"] == "agree", h["online_verdict"]["message"]


@pytest.mark.full
@pytest.mark.server
def test_the_slice_runs_07_on_its_own_drafter_and_kept_states(real_run):
    """07 after the slice's 06 (the `full` tier), on 05's kept hidden states: both fractions' arms and the
    regenerated-vs-original pair ran."""
    params_file = json.loads((real_run / "manifest.json").read_text())["params_file"]
    assert "07_data_value" in run_pipeline(params_file, stages="07")["stages"]
    h = _meta(real_run, "value")["headline"]
    assert {"0.5", "1"} <= set(h["tau_by_fraction"])
    assert {"diff", "lo", "hi"} <= set(h["regen_minus_original"])


@pytest.mark.server
def test_the_slice_serves_its_drafter_in_llama_cpp_beside_the_gguf_target(real_run):
    """06 with `llamacpp: true` (the notebook's own cell): our speculators export through llama.cpp's converter,
    llama-server with the Q4_1 target and the draft answers 06's online prompts as the target alone does."""
    from eagle_lib.serving import llamacpp

    if llamacpp.missing():
        pytest.skip(llamacpp.missing())
    table = pd.read_csv(real_run / "eval" / "llamacpp.csv")
    greedy = table[table["temperature"] == 0.0]
    assert len(greedy) > 0 and (greedy["greedy_equal_or_tie"] == 1.0).all(), greedy.to_string()
    assert (table["tokens_per_s"] > 0).all() and (table["tokens_per_s_no_draft"] > 0).all()
    recorded = json.loads((real_run / "metrics" / "06_eval_acceptance.json").read_text())["llamacpp"]
    assert recorded["T=0"]["verdict"] == "agree" and "--spec-type draft-eagle3" in recorded["command"]


@pytest.mark.full
@pytest.mark.server
def test_the_slice_serves_the_same_requests_without_the_drafter(real_run):
    """06 again with params/smollm2.yaml's `online_speed: true` (the slice turns it off in `make test`): a second
    vLLM server, the target alone, answers the same requests; wall-clock tokens/s of both and their ratio. Last in
    the file: it rewrites the run's 06."""
    params_file = json.loads((real_run / "manifest.json").read_text())["params_file"]
    run_pipeline(params_file, stages="06", overrides=["06_eval_acceptance.online_speed=true"])
    speed = _meta(real_run, "eval")["headline"]["served_tokens_per_s"]["T=0"]
    assert speed["tokens_per_s"] > 0 and speed["tokens_per_s_no_draft"] > 0
    assert speed["speedup"] == pytest.approx(speed["tokens_per_s"] / speed["tokens_per_s_no_draft"], rel=1e-2)
