"""03 through SGLang's real router (PyPI sglang-router 0.3.2, `scripts/install_sglang_router.sh`) in front of two
local SGLang-API servers (stand-ins serving a tiny model through transformers, `tests/support/sglang_standin`),
with one router URL in `server_urls`, as users run it in front of their SGLang nodes: every prompt answered once,
the ids those of transformers' own greedy decoding, the work spread over both workers by the router."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from eagle_lib import infer, params, store
from eagle_lib.engines.vllm_server import free_port
from tests.support.sglang_standin import ServerThread, StandIn
from tests.support.tiny import build_world, make_prompts

pytestmark = pytest.mark.server
ROUTER_PY = Path(__file__).resolve().parents[2] / ".venv-router" / "bin" / "python"


def start_router(workers: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(ROUTER_PY), "-m", "sglang_router.launch_router", "--worker-urls", *workers, "--host", "127.0.0.1",
           "--port", str(port), "--policy", "round_robin"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"the router did not start: {log.read_text()[-2000:]}")


def test_03_through_a_real_sglang_router(tmp_path):
    if not ROUTER_PY.exists():
        pytest.fail(f"no router at {ROUTER_PY}: run scripts/install_sglang_router.sh")
    from transformers import AutoTokenizer

    from tests.unit.test_infer import STOP, reference

    d = build_world(tmp_path / "w")
    tok = AutoTokenizer.from_pretrained(d)
    prompts = [p | {"id": f"a:{p['id']}", "source": "tiny"} for p in make_prompts(tok, 10, seed=3)]
    run = tmp_path / "run"
    store.append_jsonl(run / "data" / "B" / "a" / "prompts.jsonl", prompts)
    one, two = StandIn(str(d)), StandIn(str(d))
    with ServerThread(one) as a, ServerThread(two) as b:
        proc, url = start_router([a, b], tmp_path / "router.log")
        try:
            stage = infer.Params(engine="sglang", server_urls=[url], concurrency=2, timeout_s=30.0,
                                 stop_token_ids=[STOP], write_every=3, progress=False)  # fmt: skip
            shared = params.SharedParams(target=str(d), num_workers=1, max_new_tokens=12)
            meta = infer.run(params.StageConfig("03_infer", run, shared, stage))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    rows = store.read_jsonl(run / "infer" / "a" / "responses.jsonl")
    assert (meta["kept"], meta["rejected"]) == (10, 0) and sorted(r["id"] for r in rows) == sorted(
        p["id"] for p in prompts
    )
    assert {r["id"]: r["output_ids"] for r in rows} == reference(d, prompts)
    served = [len([k for k, act in s.log if act == "ok"]) for s in (one, two)]
    assert min(served) >= 3 and sum(served) >= 10, served  # the router spread the work over both workers
