"""params/mini_kimi.yaml (= params/kimi_k25.yaml at small scale, see tests/unit/test_mini_kimi_params.py) run end
to end on the mini-Kimi world with the real parts: the remote-code tiktoken tokenizer in 01/02's workers, hub-layout
folders read through `datasets`, 03's SGLang engine against three local SGLang-API servers that demand the API
key (stand-ins: vLLM does not speak SGLang's native /generate), 04 with Kimi's </think> id.

The servers are SGLang stand-ins serving the mini-Kimi target through transformers (tests/support/sglang_standin);
the run's params file is mini_kimi.yaml with only their URLs written in.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import yaml

from eagle_lib import store
from eagle_lib.pipeline import REPO_ROOT, run_pipeline
from tests.support import sglang_standin

MINI = REPO_ROOT / "params" / "mini_kimi.yaml"
KEY_ENV, KEY = "SGLANG_API_KEY", "mini-kimi-test-key"


@pytest.fixture(scope="module")
def mini_run(tmp_path_factory) -> Path:
    from eagle_lib import models

    target = models.resolve("toy://kimi")  # builds the mini-Kimi world once (cached like the toy world)
    state = sglang_standin.StandIn(target, api_key=KEY, trust_remote_code=True)
    with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as mp:
        urls = [stack.enter_context(sglang_standin.ServerThread(state)) for _ in range(3)]
        cfg = yaml.safe_load(MINI.read_text())
        cfg["stages"]["03_infer"]["server_urls"] = urls
        params = tmp_path_factory.mktemp("mini_kimi") / "mini_kimi.yaml"
        params.write_text(yaml.safe_dump(cfg, sort_keys=False))
        mp.setenv(KEY_ENV, KEY)
        manifest = run_pipeline(params, stages="01-04")
    return Path(manifest["run_dir"])


def meta(run: Path, rel: str) -> dict:
    return json.loads((run / rel / "meta.json").read_text())


def test_01_tokenizes_with_the_remote_code_tokenizer_one_sequence_per_turn(mini_run):
    for name in ("kimi_native_chat", "kimi_native_tools", "kimi_native_swe"):
        m = meta(mini_run, f"data/A/{name}")
        assert m["n_records"] > 0 and m["tokenizer"]["vocab_size"] == 163840, (name, m)
        recs = list(store.iter_jsonl(mini_run / f"data/A/{name}/records.jsonl"))
        assert all(max(r["input_ids"]) < 163840 for r in recs)
        assert any(163607 in r["input_ids"] for r in recs)  # Kimi's </think>


def test_02_reads_every_hub_layout_folder(mini_run):
    for name in ("glaive", "mot", "openthoughts_114k", "openthoughts3", "swe_agent", "opencodeinstruct",
                 "sharegpt", "ultrachat"):  # fmt: skip
        m = meta(mini_run, f"data/B/{name}")
        assert m["n_prompts"] > 0, (name, m)


def test_03_answers_every_prompt_through_the_keyed_sglang_servers(mini_run):
    for name in ("glaive", "sharegpt", "swe_agent"):
        rows = list(store.iter_jsonl(mini_run / f"infer/{name}/responses.jsonl"))
        assert rows and all(r["output_ids"] for r in rows)
    m = meta(mini_run, "infer")
    assert m["n_errors"] == 0, m


def test_04_finds_the_end_of_thinking_by_kimis_id(mini_run):
    assert (mini_run / "analysis").is_dir()
