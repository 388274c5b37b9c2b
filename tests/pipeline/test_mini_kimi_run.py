"""params/mini_kimi.yaml (= params/kimi_k25.yaml at small scale, see tests/unit/test_mini_kimi_params.py) run end
to end on the mini-Kimi world with the real parts: the remote-code tiktoken tokenizer in 01/02's workers, hub-layout
folders read through `datasets`, 03's SGLang engine against three local SGLang-API servers that demand the API
key (stand-ins: vLLM does not speak SGLang's native /generate), 04 with Kimi's </think> id, 05 on vLLM producers
started by hand (FSDP, 2 processes, bf16), 06 against a real vLLM server with the drafter and the API key, started
with the command `python -m eagle_lib.serving.preflight <export> --params <file>` prints, and 07 (ttt) on the
same producers' hidden states.

The 03 servers are SGLang stand-ins serving the mini-Kimi target through transformers (tests/support/sglang_standin);
the run's params file is mini_kimi.yaml with only the servers' URLs written in.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from eagle_lib import store
from eagle_lib.hidden_states import producer_procs
from eagle_lib.pipeline import REPO_ROOT, run_pipeline
from tests.support import sglang_standin

# `make test-all` only: the mini-Kimi world (a ~8 min build) and its run (~6 min) are the suite's largest item;
# `make test` exercises the same real parts (vLLM, the SGLang API engine, FSDP, 06's live checks) elsewhere
pytestmark = pytest.mark.full

MINI = REPO_ROOT / "params" / "mini_kimi.yaml"
KEY_ENV, KEY = "SGLANG_API_KEY", "mini-kimi-test-key"


class Producers:
    """The serving nodes' side of ``start_producers: false``: whenever 05 or 07 writes a buffer's COMMAND file
    (and prints it), run its lines from the repository root, as a user would on the nodes (CPU: 1 thread each)."""

    def __init__(self, root: Path):
        self.root, self.procs, self.seen = root, [], set()
        self.since = time.time_ns()  # a COMMAND left by an earlier run of this test is no request of this one
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        from eagle_lib.engines.vllm_server import cpu_env

        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **cpu_env(kv_cache_gib=1, threads=1)}
        while not self.stop.wait(0.5):
            for cmd_file in self.root.rglob(producer_procs.COMMAND_FILE) if self.root.exists() else []:
                try:
                    if cmd_file.stat().st_mtime_ns < self.since:
                        continue
                    lines = cmd_file.read_text().splitlines()
                except FileNotFoundError:  # removed by a trainer that plans this buffer again
                    continue
                for line in lines:
                    if line and (cmd_file, line) not in self.seen:
                        self.seen.add((cmd_file, line))
                        log = open(cmd_file.parent / f"by_hand_{len(self.seen)}.log", "ab")  # noqa: SIM115
                        self.procs.append(subprocess.Popen(shlex.split(line), cwd=REPO_ROOT, env=env, stdout=log,
                                                           stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip

    def __enter__(self) -> Producers:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        for p in self.procs:  # by PID: the process group each was started in
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def mini_run(tmp_path_factory) -> Path:
    from eagle_lib import models

    target = models.resolve("toy://kimi")  # builds the mini-Kimi world once (cached like the toy world)
    state = sglang_standin.StandIn(target, api_key=KEY, trust_remote_code=True)
    with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as mp:
        urls = [stack.enter_context(sglang_standin.ServerThread(state)) for _ in range(3)]
        cfg = yaml.safe_load(MINI.read_text())
        # this test's own run, from nothing: what it asserts (one producer session in 07, tokens produced) is a
        # fresh run's, and a kept store left by an earlier `make test` would serve everything without a producer
        shutil.rmtree(REPO_ROOT / "outputs" / cfg["run_name"], ignore_errors=True)
        cfg["stages"]["03_infer"]["server_urls"] = urls
        params = tmp_path_factory.mktemp("mini_kimi") / "mini_kimi.yaml"
        params.write_text(yaml.safe_dump(cfg, sort_keys=False))
        mp.setenv(KEY_ENV, KEY)
        buffers = REPO_ROOT / cfg["stages"]["05_train_eagle3"]["hidden_dump_dir"]
        producers = stack.enter_context(Producers(buffers))
        manifest = run_pipeline(params, stages="01-05")
        assert producers.seen, "05 never asked for producers"
        run = Path(manifest["run_dir"])
        cfg["stages"]["06_eval_acceptance"]["online_url"] = stack.enter_context(served(run, params, cfg))
        params.write_text(yaml.safe_dump(cfg, sort_keys=False))
        run_pipeline(params, stages="06-07")
    return run


@contextlib.contextmanager
def served(run: Path, params: Path, cfg: dict):
    """The serving node of 06 (``offline: false``): the vLLM command preflight prints for these params, run by
    a shell from the repository root with the key in the environment, on a free local port; yields its URL."""
    import sys
    import time

    from eagle_lib.engines import client
    from eagle_lib.engines.vllm_server import free_port

    export = run / "drafter" / "export" / "speculators"
    out = subprocess.run([sys.executable, "-m", "eagle_lib.serving.preflight", str(export), "--params", str(params),
                          "--json"], cwd=REPO_ROOT, capture_output=True, text=True, check=False)  # fmt: skip
    rep = json.loads(out.stdout)
    assert rep["ok"], out.stdout
    port = free_port()
    cmd = rep["commands"]["vllm"] + f" --host 127.0.0.1 --port {port} --max-model-len 2048 --enforce-eager"
    env = {**os.environ, KEY_ENV: KEY, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    log = open(run / "vllm_06.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 900
    try:
        while True:
            assert proc.poll() is None, (run / "vllm_06.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vLLM did not start in 900 s"
            try:
                client.request(url + "/health", timeout=5.0)
                break
            except client.ServerError:
                time.sleep(2)
        with pytest.raises(client.ServerError, match="401"):  # the server demands the key
            client.get_json(url + "/v1/models", timeout=10.0)
        yield url
    finally:
        if proc.poll() is None:  # by PID: its process group
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def meta(run: Path, rel: str) -> dict:
    return json.loads((run / rel / "meta.json").read_text())


def test_01_tokenizes_with_the_remote_code_tokenizer_one_sequence_per_turn(mini_run):
    for name in ("kimi_native_chat", "kimi_native_tools", "kimi_native_swe"):
        m = meta(mini_run, f"data/A/{name}")
        assert m["kept"] == m["read"] > 0 and m["sequences"] >= m["kept"], (name, m)
        recs = list(store.iter_jsonl(mini_run / f"data/A/{name}/records.jsonl"))
        assert len(recs) == m["sequences"] and all(max(r["input_ids"]) < 163840 for r in recs)
        assert all(r["id"].startswith(f"{name}:native_") for r in recs)  # the rows' own ids
        assert any(163607 in r["input_ids"] for r in recs)  # Kimi's </think>
    assert (
        meta(mini_run, "data/A/kimi_native_chat")["sequences"]
        > meta(mini_run, "data/A/kimi_native_chat")["kept"]
    )


def test_02_reads_every_hub_layout_folder_by_its_configs_and_splits(mini_run):
    for name in ("glaive", "mot", "openthoughts_114k", "openthoughts3", "swe_agent", "opencodeinstruct",
                 "sharegpt", "ultrachat"):  # fmt: skip
        m = meta(mini_run, f"data/B/{name}")
        assert m["kept"] == (1 if name == "swe_agent" else 2) and m["rejected"] == 0, (name, m)


def test_03_answers_every_prompt_through_the_keyed_sglang_servers(mini_run):
    m = meta(mini_run, "infer")
    assert m["kept"] == m["read"] > 0 and m["dropped"] == {} and m["target"]["engine"] == "sglang", m
    servers = set()
    for d in ("glaive", "mot", "openthoughts_114k", "openthoughts3", "swe_agent", "opencodeinstruct",
              "sharegpt", "ultrachat"):  # fmt: skip
        dm = meta(mini_run, f"infer/{d}")
        assert dm["errors"] == 0 and dm["stop_token_ids"] == [163586], (d, dm)
        assert dm["sampling"]["temperature"] == 1.0 and dm["sampling"]["top_p"] == 0.95
        rows = list(store.iter_jsonl(mini_run / f"infer/{d}/responses.jsonl"))
        assert rows and all(r["output_ids"] and max(r["output_ids"]) < 163840 for r in rows)
        servers |= {r["server"] for r in rows}
    assert len(servers) == 3  # the work went to all three servers
    assert meta(mini_run, "infer/sharegpt")["turns"] > meta(mini_run, "infer/sharegpt")["kept"]  # each_turn


def test_04_counts_reasoning_by_kimis_end_of_thinking_id(mini_run):
    import pandas as pd

    s = json.loads((mini_run / "analysis" / "summary.json").read_text())
    assert s["end_of_thinking_id"] == 163607 and s["datasets"] == 11
    comp = pd.read_csv(mini_run / "analysis" / "completion.csv").set_index("dataset")
    assert comp.loc["kimi_native_chat", "reasoning_tokens"] > 0  # Kimi's native chats think
    assert comp["reasoning_tokens"].sum() + comp["answer_tokens"].sum() > 0


def test_05_trains_on_producers_started_by_hand_fsdp_bf16(mini_run):
    m = meta(mini_run, "drafter")
    p = m["params"]
    assert (p["hidden_source"], p["start_producers"], p["distributed"], p["precision"]) == (
        "vllm",
        False,
        "fsdp",
        "bf16",
    )
    assert m["world_size"] == 2 and m["kept"] > 0 and m["torn_lines"] == []
    bound = int(p["max_buffer_gb"] * 2**30)
    ranks = sorted(
        (mini_run / p["hidden_dump_dir"].removeprefix("outputs/mini_kimi/")).glob("*/rank*"),
        key=lambda r: r.name,
    )
    assert [r.name for r in ranks] == ["rank0", "rank1"]
    peaks = []
    for r in ranks:  # each rank's buffer was served by the command it wrote, within its share of the bound
        stats = json.loads((r / "producer_0.json").read_text())
        assert stats["state"] == "done" and 0 < stats["peak_buffer_bytes"] <= bound // 2
        assert json.loads((r / "producer_config.json").read_text())["max_buffer_bytes"] == bound // 2
        peaks.append(stats["peak_buffer_bytes"])
        assert (r / producer_procs.COMMAND_FILE).read_text().startswith(".venv-vllm/bin/python -m eagle_lib")
    assert sum(peaks) <= bound  # max_buffer_gb bounds the run, not each rank
    for fmt in ("sglang", "speculators"):
        cfg = json.loads((mini_run / "drafter" / "export" / fmt / "config.json").read_text())
        assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
    assert (mini_run / "drafter" / "final" / "model.safetensors").is_file()


def test_06_measures_the_live_vllm_server_with_the_key_and_kimis_stop_ids(mini_run):
    m = meta(mini_run, "eval")
    assert m["stop_ids"] == [163585, 163586]  # [EOS] and <|im_end|> (generation_config), as 03's [163586]
    on = json.loads((mini_run / "eval" / "online.json").read_text())
    assert on["engine"] == "vllm" and set(on["by_temperature"]) == {"0.0", "1.0"}
    for temp, per_ds in on["by_temperature"].items():
        assert per_ds, temp
        for ds, r in per_ds.items():  # the server drafted and counted (its own /metrics)
            assert r["drafts"] > 0 and 1.0 <= r["tau"] <= 4.0, (temp, ds, r)
            assert all(ids and max(ids) < 163840 for ids in r["outputs"].values())
    live = {c["name"]: c for c in json.loads((mini_run / "eval" / "live_preflight.json").read_text())}
    assert live["vllm draft tokens per step (metrics)"]["ok"]  # the server drafted num_steps a step
    pf = json.loads((mini_run / "eval" / "preflight.json").read_text())
    cmd = next(r["commands"]["vllm"] for r in pf if r["format"] == "speculators")
    assert (
        '--api-key "$SGLANG_API_KEY"' in cmd
        and "--language-model-only" in cmd
        and "--trust-remote-code" in cmd
    )


def test_07_retrains_on_the_producers_within_the_bound(mini_run):
    m = meta(mini_run, "value")
    assert m["params"]["tau_source"] == "ttt" and m["arms"], m.get("arms")
    h = m["hidden"]
    assert h["producer_sessions"] == 1 and h["peak_buffer_bytes"] <= h["max_buffer_bytes"]
    assert h["mode"] == "keep" and h["produced_tokens"] > 0  # the mini run fits its bound: kept once, reused
    assert (
        m["recipe"]["nproc_per_node"] == 2 and m["headline"]["recipe_world_size"] == 2
    )  # 05's 2-rank recipe
    full = m["headline"]["arms"]["1"]
    assert (
        full["drafter"] == "05's final drafter" and full["steps"] == m["steps_05"]
    )  # 07's full point is 05's
    import pandas as pd

    curve = pd.read_csv(mini_run / "value" / "curve.csv")
    assert len(curve) == len(m["params"]["fractions"]) and curve["tau_all"].between(1.0, 4.0).all()
    lodo = pd.read_csv(mini_run / "value" / "lodo.csv")
    assert len(lodo) > 0  # one arm per dataset (lodo_units: {}), as the Kimi params ask


def test_every_stage_records_the_targets_revision(mini_run):
    """The hub commit whose remote code ran (mini: "", a local directory) in every stage's meta and the manifest."""
    manifest = json.loads((mini_run / "manifest.json").read_text())
    assert (
        manifest["params"]["shared"]["revision"] == "" and manifest["params"]["shared"]["trust_remote_code"]
    )
    for rel in ("data/A", "data/B", "infer", "analysis", "drafter", "eval", "value"):
        assert meta(mini_run, rel)["shared"]["revision"] == "", rel


def test_06_greedy_answers_through_vllm_with_the_drafter_equal_transformers(mini_run):
    """What the Kimi-shaped target answers through vLLM CPU with the EAGLE-3 drafter at T=0 (MLA off, as the
    printed command runs it) is what transformers' greedy decoding of the same target answers: speculative
    serving is lossless. (The mini drafter trains 1 step at Kimi's learning rate, so its drafts are rarely
    accepted: tau ~1.0 and 06 says "collapsed"; the mini run checks the mechanics, the toy world the quality.)"""
    import torch

    from eagle_lib import acceptance, models, params
    from eagle_lib.serving import verdict

    run = params.load_params(MINI)
    p = run.stage("06_eval_acceptance")
    shared = run.shared
    tok = models.load_tokenizer(shared)
    prompts, _ = acceptance.heldout_prompts(mini_run, shared.heldout_percent, p)
    prompts |= acceptance.eval_set_prompts(p, tok)[0]
    target = models.load_target(shared, device="cpu")
    eos = models.stop_ids(tok, target)
    served = json.loads((mini_run / "eval" / "online.json").read_text())["by_temperature"]["0.0"]
    n = 0
    for ds, ps in prompts.items():
        for pr in ps[: p.online_max_prompts]:
            x = torch.tensor([pr.prompt_ids])
            with torch.no_grad():
                g = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=eos,
                                    max_new_tokens=p.eval_max_new_tokens, pad_token_id=163839)  # fmt: skip
            ref = g[0, x.shape[1] :].tolist()
            ref = ref[: next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]
            assert verdict.same_output(served[ds]["outputs"][pr.id], ref, set(eos)), (ds, pr.id)
            n += 1
    assert n >= 10
