"""The vLLM hidden-state producers as processes (`eagle_lib.hidden_states.vllm_producer` runs in vLLM's venv): start
one on a buffer (`launch`), the command for producers started by hand (`external_producers`), wait for a unit they
write (`wait_for`: raises when they all exited or all failed, or after `PRODUCER_WAIT_S`), and stop them (`stop`).
Used by 05's `engine_hidden.VllmHidden` and 07's `kept_source.KeptSource`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from eagle_lib import distributed
from eagle_lib.hidden_states import hidden_buffer as hb

REPO_ROOT = Path(__file__).resolve().parents[2]


def launch(buf: Path, i: int, n: int, session: str, cpu: bool, plan_session: str = "") -> subprocess.Popen:
    """Producer i of n on buffer `buf` in the vLLM venv, in its own process group (stopped by `stop`, through
    the stop file of `session`); `plan_session`: the plan it serves (plan.json's ``session``)."""
    from eagle_lib.engines.vllm_server import cpu_env, server_env, vllm_python

    py = vllm_python()
    if not py.exists():
        raise FileNotFoundError(f"no vLLM interpreter at {py}: run scripts/install_vllm_cpu.sh")
    buf = Path(buf).absolute()  # the command names the buffer alone, wherever it runs
    env = server_env({"PYTHONPATH": str(REPO_ROOT)})
    if cpu:
        env.update(cpu_env(kv_cache_gib=1, threads=max(1, (os.cpu_count() or 2) // 2)))
    cmd = [str(py), "-m", "eagle_lib.hidden_states.vllm_producer", "--buffer", str(buf)]
    cmd += ["--index", str(i), "--count", str(n), "--stop-file", f"STOP.{session}"]
    cmd += ["--session", plan_session] if plan_session else []
    with open(buf / f"producer_{i}.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


COMMAND_FILE = (
    "COMMAND"  # in a buffer waiting for producers started by hand: the lines to run, one per producer
)


def release(procs: list[subprocess.Popen], stop_file: Path, lock) -> None:
    """Stops the producers (`stop`) and releases the buffer's lock: a source's finalizer."""
    stop(procs, stop_file)
    lock.close()


def external_producers(buf: Path, n: int, log=print, session: str = "",
                       group: list[tuple[str, str]] | None = None) -> list[str]:  # fmt: skip
    """``start_producers: false``: the commands that serve this buffer (run them on the serving nodes, from the
    repository, with the vLLM venv), written to ``<buf>/COMMAND`` and printed; returns them. With `session` (the
    plan's), a producer started from this command refuses a buffer that a later trainer run has planned again.
    The buffer is named by its absolute path: a relative ``hidden_dump_dir`` would make the line depend on the
    directory the serving nodes run it from."""
    buf = Path(buf).absolute()
    # `group`: (buffer, session) of every trainer rank one producer serves (ranks_per_producer), this one's first
    pairs = group or [(str(buf), session)]
    bufs = " ".join(f"--buffer {b}" for b, _ in pairs)
    tail = "".join(f" --session {x}" for _, x in pairs) if all(x for _, x in pairs) else ""
    cmds = [f".venv-vllm/bin/python -m eagle_lib.hidden_states.vllm_producer {bufs} --index {i} --count {n}"
            f"{tail}" for i in range(n)]  # fmt: skip
    (buf / COMMAND_FILE).write_text("\n".join(cmds) + "\n")
    log(
        f"waiting for {n} producer(s) started by hand on {buf} (start_producers: false); run:\n  "
        + "\n  ".join(cmds)
    )
    return cmds


def log_tail(buf: Path, i: int, n: int = 30) -> str:
    path = buf / f"producer_{i}.log"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return f"--- {path}\n" + "\n".join(lines[-n:])


# how long a rank waits for an external producer's unit: shorter than the process group's timeout, so a slow
# producer ends in this error on the waiting rank, not in a collective's abort on the others
PRODUCER_WAIT_S = distributed.PROCESS_GROUP_TIMEOUT_S - 600.0


def wait_for(path: Path, procs: list[subprocess.Popen], buf: Path) -> float:
    """Seconds spent waiting for a unit file; raises when every producer exited without writing it."""
    t0 = last_check = time.perf_counter()
    while not path.exists():
        if procs and all(p.poll() is not None for p in procs) and not path.exists():
            tails = [log_tail(buf, i) for i in range(len(procs))]
            raise RuntimeError(f"{path}: every vLLM producer exited before writing it\n" + "\n".join(tails))
        if not procs and time.perf_counter() - last_check > 1.0:
            last_check = time.perf_counter()
            if failed := failed_producers(buf):
                raise RuntimeError(f"{path}: every external producer of {buf} failed (restart them, then resume "
                                   "05):\n" + "\n".join(failed))  # fmt: skip
            if last_check - t0 > PRODUCER_WAIT_S:
                raise TimeoutError(f"{path}: no external producer wrote it within {PRODUCER_WAIT_S:.0f} s")
        time.sleep(0.01)
    return time.perf_counter() - t0


def failed_producers(buf: Path) -> list[str]:
    """The errors of the producers that wrote stats in `buf`, when every one of them says ``failed``."""
    states = []
    for f in sorted(buf.glob("producer_*.json")):
        try:
            states.append((f, hb.read_json(f)))
        except (OSError, ValueError):  # being rewritten: look again next time
            return []
    if not states or any(s.get("state") != "failed" for _, s in states):
        return []
    return [f"{f.name} (pid {s.get('pid')}): {s.get('error')}\n{s.get('traceback', '')}" for f, s in states]


def stop(procs: list[subprocess.Popen], stop_file: Path, grace_s: float = 30.0) -> None:
    """This launch's stop file, then SIGTERM/SIGKILL each producer's process group (by its pid)."""
    if all(p.poll() is not None for p in procs):
        return
    stop_file.touch()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()) if sig is None else 10.0)
                break
            except subprocess.TimeoutExpired:
                continue
