"""The pipeline runner's console: the stage kernels it starts talk over IPC sockets (`ipc_kernel_manager`), and
the progress lines a stage writes (`eagle_lib.progress`) are tailed onto the terminal (`ConsoleTail`).

Over TCP, ipykernel warns on every start that the kernel runs "over TCP without encryption": the kernel only ever
talks to this process on this host, so its sockets are Unix sockets in a private directory (mode 0700) instead,
removed with the kernel.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

SUN_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un.sun_path is 108 with its NUL on Linux)
# the longest name jupyter_client gives a socket here: <connection stem>-ipc-<n>
SOCKET_NAME = "kernel-ipc-99"


def socket_dir() -> str:
    """A new private directory for one kernel's connection file and sockets, short enough for socket paths
    (the temp dir, else /tmp when $TMPDIR is too long)."""
    base = tempfile.gettempdir()
    if len(os.fsencode(os.path.join(base, "eagle-k-xxxxxxxx", SOCKET_NAME))) > SUN_PATH_MAX:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="eagle-k-", dir=base)


def ipc_kernel_manager():
    """nbclient's kernel manager class (AsyncKernelManager) on the ipc transport, its connection file and
    sockets in a `socket_dir` that goes with the kernel."""
    from jupyter_client import AsyncKernelManager
    from traitlets import default

    class IPCKernelManager(AsyncKernelManager):
        @default("transport")
        def _transport_ipc(self) -> str:
            return "ipc"

        @default("connection_file")
        def _connection_file_private(self) -> str:
            return os.path.join(socket_dir(), "kernel.json")  # sockets: <dir>/kernel-ipc-<n>

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart)  # removes the connection file and the sockets
            if not restart:
                shutil.rmtree(os.path.dirname(self.connection_file), ignore_errors=True)

        cleanup_resources = _async_cleanup_resources  # AsyncKernelManager binds the base class's function

    return IPCKernelManager


class ConsoleTail(threading.Thread):
    """While open, hands each whole line appended to `path` to `show` (every `poll_s` s); on close, the rest.
    The file is new when opened and removed when closed."""

    def __init__(self, path: Path, show: Callable[[str], None], poll_s: float = 0.5):
        super().__init__(daemon=True)
        self.path, self.show, self.poll_s = Path(path), show, poll_s
        self.stop, self.pos, self.buf = threading.Event(), 0, b""

    def __enter__(self) -> ConsoleTail:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()
        self.read()  # lines written after the last poll
        self.path.unlink(missing_ok=True)

    def run(self) -> None:
        while not self.stop.wait(self.poll_s):
            self.read()

    def read(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.pos += len(chunk)
        *lines, self.buf = (self.buf + chunk).split(b"\n")
        for line in lines:
            self.show(line.decode("utf-8", "replace"))


# Progress bars and load chatter are noise in an executed report (and tqdm without ipywidgets prints
# "IProgress not found" to stderr): the kernel papermill starts inherits these.
REPORT_ENV = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore:IProgress not found",  # tqdm.auto's warning when ipywidgets is absent
}
# OpenMP's wait policy of the stage kernels (read once, when torch loads libgomp): idle worker threads sleep
# instead of spinning, so a stage on 2 threads beside another CPU-bound job slows down instead of collapsing
# (benchmarks/bench_threads.py --wait-policy default passive: docs/MACHINES.md). A value the user set is kept.
# The vLLM servers and producers a stage starts get the default back (vllm_server.server_env).
WAIT_POLICY = "OMP_WAIT_POLICY"


@contextlib.contextmanager
def report_env(extra: dict | None = None):
    """Set REPORT_ENV (and `extra`) for the duration (the notebook kernel is started inside), then restore."""
    want = {**REPORT_ENV, WAIT_POLICY: os.environ.get(WAIT_POLICY, "PASSIVE"), **(extra or {})}
    saved = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
