"""A server process this project started on 127.0.0.1 (vLLM, llama.cpp) in its own process group: its URL, the
tail of its log, and a stop by PID (SIGTERM to the group, SIGKILL after a grace period)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


class LocalServer:
    """Mixin of the server dataclasses (`vllm_server.VllmServer`, `serving.llamacpp_server.LlamaServer`): they
    hold `proc`, `port` and `log_path`."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    LOG_LINES = 40  # log_tail's default
    STOP_WAITS = (20.0, 10.0)  # seconds after SIGTERM, then after SIGKILL

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int | None = None) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-(n or self.LOG_LINES) :])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; idempotent."""
        if self.proc.poll() is not None:
            return
        term, kill = self.STOP_WAITS
        for sig, wait in ((signal.SIGTERM, term if grace_s is None else grace_s), (signal.SIGKILL, kill)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
