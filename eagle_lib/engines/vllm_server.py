"""Start, wait for and stop a local vLLM OpenAI-compatible server (tests, stage 03 checks, stage 06 drafters).

    with start_vllm("path/to/model", extra_args=["--speculative-config", json.dumps({...})]) as srv:
        requests.post(srv.base_url + "/v1/completions", ...)

vLLM runs from its own virtual environment (`.venv-vllm`, made by scripts/install_vllm_cpu.sh) because its
pinned torch/transformers differ from the project's. The server binds 127.0.0.1 on a free port, runs in its
own process group (stopped by PID: SIGTERM to the group, SIGKILL after a grace period) and logs to a file
whose tail is quoted in every error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_lib import threads as cap
from eagle_lib.engines import client
from eagle_lib.engines.local_process import LocalServer

REPO_ROOT = Path(__file__).resolve().parents[2]  # eagle_lib/engines/ -> the repo
SINGLE_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
VLLM_PYTHON_ENV = "EAGLE_VLLM_PYTHON"  # environment variable overriding the vLLM interpreter


class VllmServerError(RuntimeError):
    """The server could not start or answer: the message carries the command and the log tail."""


def vllm_python() -> Path:
    """The interpreter of the vLLM venv: $EAGLE_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python."""
    return Path(os.environ.get(VLLM_PYTHON_ENV) or REPO_ROOT / ".venv-vllm" / "bin" / "python")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(kv_cache_gib: int = 1, threads: int | None = None, cpu_fixes: bool = True) -> dict[str, str]:
    """Environment for the CPU backend: a small KV cache, optionally a thread count (within
    `eagle_lib.threads.thread_cap`; with none, the cap where $EAGLE_MAX_THREADS sets one); with `cpu_fixes`, the plugin
    `eagle_lib.engines.vllm_cpu_fixes` (its dist-info dir and the repository on PYTHONPATH): without it vLLM 0.32's
    CPU backend samples speculative steps at T > 0 from uninitialised temperatures (vllm-project/vllm#55005)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if cpu_fixes:
        from eagle_lib.engines import vllm_cpu_fixes

        paths = [str(Path(vllm_cpu_fixes.__file__).parent / vllm_cpu_fixes.PLUGIN_DIR_NAME), str(REPO_ROOT)]
        env["PYTHONPATH"] = os.pathsep.join(paths + [x for x in [os.environ.get("PYTHONPATH", "")] if x])
    if threads is None and cap.thread_cap():
        threads = cap.thread_cap()  # a machine shared by several jobs (eagle_lib.threads)
    if threads:
        env.update(OMP_NUM_THREADS=str(cap.capped(threads)), VLLM_CPU_OMP_THREADS_BIND="nobind")
    return env


def one_process(env: dict[str, str]) -> dict[str, str]:
    """A server's `env` with vLLM's engine core and its one CPU worker in a single process where OpenMP is left
    unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind``): vLLM 0.32's CPU platform turns the single-process executor into
    the multiprocess one only so that it can bind OpenMP threads in a fresh worker, which nobind does not do. Each
    process spared is one import of vLLM and torch: the toy target's server answers 27 s after its start instead of 38
    (benchmarks/bench_vllm_start.py). A value already set is kept; with the binding left to vLLM, nothing changes.
    Servers only: in the offline `vllm.LLM` (the hidden-state producer) the same variable also moves the engine core
    into the caller's process, where the mini-Kimi producer dies as vLLM rebinds its Triton kernels
    (docs/MACHINES.md, "Time")."""
    if env.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
        env.setdefault(SINGLE_PROCESS_ENV, "0")
    return env


def server_env(env: dict[str, str]) -> dict[str, str]:
    """A vLLM process's environment: this one's, without OpenMP's wait policy (a stage kernel runs with PASSIVE,
    eagle_lib.console; vLLM's CPU kernels keep libgomp's default spin), plus `env`."""
    full = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return {**full, **env}


@dataclass
class VllmServer(LocalServer):
    """A running server: `base_url`, `model` (the served name), `log_path`; `stop()` ends it."""

    proc: subprocess.Popen
    port: int
    model: str
    log_path: Path
    cmd: list[str] = field(default_factory=list)


def wait_ready(srv: VllmServer, timeout_s: float) -> None:
    """Poll /health and /v1/models until the server answers; raise with the log tail if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not srv.alive():
            raise VllmServerError(
                f"vLLM exited with code {srv.proc.returncode} while starting\n"
                f"command: {' '.join(srv.cmd)}\nlog {srv.log_path}:\n{srv.log_tail()}"
            )
        try:
            client.request(srv.base_url + "/health", timeout=5.0)
            models = client.get_json(srv.base_url + "/v1/models", timeout=5.0)
            if models and models.get("data"):
                return
        except client.ServerError:  # not listening yet, or still loading
            pass
        time.sleep(1.0)
    srv.stop()
    raise VllmServerError(
        f"vLLM not ready after {timeout_s:.0f}s\ncommand: {' '.join(srv.cmd)}\n{srv.log_tail()}"
    )


def start_vllm(
    model_dir: str | Path,
    port: int | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    *,
    tokenizer: str | Path | None = None,
    dtype: str = "float32",
    max_model_len: int = 1024,
    served_name: str | None = None,
    startup_timeout_s: float = 600.0,
    log_dir: str | Path | None = None,
    python: str | Path | None = None,
    cpu_fixes: bool = True,
) -> VllmServer:
    """Start `vllm serve`-equivalent on 127.0.0.1 and wait until it answers; returns the handle (a context manager).

    `extra_args` are appended to the command line (e.g. a speculative config); `env` adds to a CPU-friendly
    environment (`cpu_env()`; `cpu_fixes`: load `eagle_lib.engines.vllm_cpu_fixes` into the server). fp32 is the default dtype so greedy ids can be compared with an fp32 reference.
    """
    py = Path(python) if python else vllm_python()
    if not py.exists():
        raise VllmServerError(
            f"no vLLM interpreter at {py}: run scripts/install_vllm_cpu.sh or set {VLLM_PYTHON_ENV}"
        )
    port = port or free_port()
    name = served_name or Path(model_dir).name
    # Not `vllm serve`: its CLI asks for the version of a distribution named "vllm", which vllm-cpu is not.
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    # No --disable-log-stats: it also turns off /metrics, where spec-decoding counters live.
    cmd += ["--max-model-len", str(max_model_len), "--enforce-eager"]
    if tokenizer:
        cmd += ["--tokenizer", str(tokenizer)]
    cmd += list(extra_args or [])
    full_env = one_process(server_env({**cpu_env(cpu_fixes=cpu_fixes), **(env or {})}))
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    srv = VllmServer(proc, port, name, log_path, cmd)
    try:
        wait_ready(srv, startup_timeout_s)
    except BaseException:
        srv.stop()
        raise
    return srv
