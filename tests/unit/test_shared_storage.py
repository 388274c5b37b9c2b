"""The hidden-state buffer on shared storage (issue 42, item 9): a filesystem without flock (Lustre mounted
noflock) detected, with the trainer lock falling back to an owner file and saying so; the producers' command
lines naming the buffer by its absolute path; the producer's per-request scratch on local disk, not under the
shared buffer. No Lustre mount exists here: flock's ENOSYS is simulated (the errno Lustre's noflock returns)."""

from __future__ import annotations

import errno
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from eagle_lib.hidden_states import hidden_buffer as hb
from eagle_lib.hidden_states import producer_procs, vllm_producer


def _noflock(monkeypatch, code: int = errno.ENOSYS) -> None:
    def flock(f, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(hb.fcntl, "flock", flock)


def test_no_flock_errors_are_told_apart_from_a_held_lock(tmp_path, monkeypatch):
    for code in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
        assert hb.no_flock(OSError(code, "x")), code
    assert not hb.no_flock(BlockingIOError(errno.EAGAIN, "held")) and not hb.no_flock(
        OSError(errno.EACCES, "x")
    )
    assert hb.flock_error(tmp_path) is None  # this machine's tmp has flock
    _noflock(monkeypatch)
    assert hb.flock_error(tmp_path).errno == errno.ENOSYS
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_trainer_lock_without_flock_falls_back_to_an_owner_file(tmp_path, monkeypatch, capsys):
    _noflock(monkeypatch)
    lock = hb.take_trainer_lock(tmp_path)
    owner = tmp_path / hb.TRAINER_OWNER
    assert json.loads(owner.read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    assert "flock unavailable here" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match=r"another trainer .* no flock .*TRAINER\.owner.*delete that file"):
        hb.take_trainer_lock(tmp_path)  # a live holder (this process) is refused, as a held flock is
    lock.close()
    assert not owner.exists()
    hb.take_trainer_lock(tmp_path).close()  # released: taken again
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a killed trainer of this host left its file: taken over
    owner.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    lock = hb.take_trainer_lock(tmp_path)
    assert json.loads(owner.read_text())["pid"] == os.getpid()
    lock.close()
    owner.write_text(json.dumps({"host": "another-node", "pid": 1}))  # its life cannot be checked from here
    with pytest.raises(RuntimeError, match="another-node"):
        hb.take_trainer_lock(tmp_path)


def test_trainer_lock_with_flock_is_unchanged(tmp_path):
    lock = hb.take_trainer_lock(tmp_path)
    with pytest.raises(RuntimeError, match=rf"another trainer \(pid {os.getpid()}\)"):
        hb.take_trainer_lock(tmp_path)
    lock.close()
    assert not (tmp_path / hb.TRAINER_OWNER).exists()


def test_producer_commands_name_the_buffer_absolutely(tmp_path, monkeypatch):
    """A relative hidden_dump_dir: the lines in COMMAND must not depend on where the serving nodes run them."""
    monkeypatch.chdir(tmp_path)
    buf = Path("outputs/run/hidden_buffer/key/rank0")
    buf.mkdir(parents=True)
    cmds = producer_procs.external_producers(buf, 2, log=lambda s: None, session="s1")
    assert (buf / producer_procs.COMMAND_FILE).read_text().splitlines() == cmds
    for i, line in enumerate(cmds):
        argv = shlex.split(line)
        named = Path(argv[argv.index("--buffer") + 1])
        assert named.is_absolute() and named.resolve() == (tmp_path / buf).resolve(), line
        assert argv[argv.index("--index") + 1] == str(i)


def _buffer(buf: Path) -> Path:
    """A buffer with an empty plan: a producer starts its engine, finds nothing to make and ends."""
    buf.mkdir(parents=True)
    hb.write_json(buf / "producer_config.json", {"layer_ids": [2, 4], "hidden_size": 8, "storage_dtype": "float32",
                                                 "model_dtype": "float32", "units_per_call": 2,
                                                 "max_buffer_bytes": 10**6})  # fmt: skip
    hb.write_json(buf / "plan.json", {"units": []})
    (buf / "sequences.jsonl").write_text("")
    return buf


def test_producer_scratch_is_on_local_disk_not_under_the_shared_buffer(tmp_path, monkeypatch):
    buf = _buffer(tmp_path / "shared" / "buf")
    seen = []

    def engine(cfg, scratch):
        seen.append((Path(scratch), Path(scratch).is_dir()))
        return object()

    monkeypatch.setattr(vllm_producer, "make_engine", engine)
    vllm_producer.Producer(buf, 0, 1).run()
    (scratch, existed), = seen  # fmt: skip
    assert existed and not scratch.is_relative_to(buf) and not scratch.is_relative_to(tmp_path / "shared")
    assert scratch.parent == Path(tempfile.gettempdir()) / "eagle3_producer"
    assert not scratch.exists()  # removed when the producer is done
    assert hb.read_json(buf / "producer_0.json")["scratch"] == str(scratch)
    mine = tmp_path / "local"
    vllm_producer.main(["--buffer", str(buf), "--scratch", str(mine)])  # a directory of the user's choice
    assert seen[-1] == (mine, True)


def test_producer_refuses_a_scratch_without_flock_and_tells_the_trainer(tmp_path, monkeypatch):
    buf = _buffer(tmp_path / "buf")
    monkeypatch.setattr(vllm_producer, "make_engine", lambda cfg, scratch: pytest.fail("engine started"))
    _noflock(monkeypatch)
    with pytest.raises(RuntimeError, match=r"no flock .*--scratch on a local disk"):
        vllm_producer.main(["--buffer", str(buf), "--scratch", str(tmp_path / "lustre_scratch")])
    state = hb.read_json(buf / "producer_0.json")
    assert state["state"] == "failed" and "no flock" in state["error"]  # the waiting trainer stops on it
