"""The bounded hidden-state buffer between vLLM producers and the stage-05 trainer (stdlib only: both venvs).

One buffer directory per plan (``<root>/<plan key>/rank<r>/``)::

    producer_config.json   target, layer ids, dtypes, TP, connector, the byte bound
    sequences.jsonl        line i: the token ids of sequence i (train then held-out)
    plan.json              {"units": [[sequence index, ...], ...], "session": s}: unit u = the u-th source call of
                           the trainer; s names the plan (kept while the units stay the same): a producer started
                           with ``--session`` for another plan refuses this one
    COMMAND                start_producers: false: the producer command lines for this plan (removed, with
                           every producer_<i>.json, when a trainer run starts on the buffer, then rewritten)
    cursor.json            {"next": u}: the trainer has consumed every unit < u (written by the trainer)
    unit_NNNNNNNN.safetensors  hidden_states [N, n_ids, H] (storage dtype), token_ids [N], lengths [n_seq]
                           (float8_e4m3fn also scale [N, n_ids] float32: value = stored x scale)
    producer_<i>.json      producer i's own accounting: peak/pending bytes, tokens, busy and blocked seconds
    STOP, STOP.<session>   stop every producer (by hand) / those one trainer session started
    TRAINER.lock           flock of the one trainer process reading the buffer (its pid): a second is refused
    TRAINER.owner          where the filesystem has no flock (Lustre mounted ``noflock``: ENOSYS): {host, pid}
                           of that trainer, created exclusively instead (`take_trainer_lock` says so when it falls
                           back); a killed node's trainer leaves it, and the refusal names it for removal

Producer ``i`` of ``n`` makes the non-empty units ``u % n == i`` in order (a unit whose sequences are all
kept, `eagle_lib.hidden_states.hidden_store`, is planned empty and never made). A unit's file appears by rename, so a file that
exists is complete; the trainer deletes it after use unless ``keep_hidden_states``. Each producer may hold at
most ``max_buffer_bytes / n`` of unconsumed units plus its in-flight reservation (the engine's per-request
scratch files and the shard being written); it blocks before starting work that would exceed that. The scratch
lives on the producer's local disk (`vllm_producer --scratch`), not under the buffer: on shared storage every
token would cross it four times (engine write, producer read, unit write, trainer read) instead of twice.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
HEADER_SLACK = 4096  # safetensors JSON header + alignment, an upper bound for our four tensors
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def unit_name(u: int) -> str:
    return f"unit_{u:08d}.safetensors"


def write_json(path: Path, obj) -> None:
    """Atomic JSON write (rename), so a reader never sees a partial file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


def read_cursor(buf: Path) -> int:
    return int((read_json(buf / "cursor.json") or {"next": 0})["next"])


def shard_bytes(n_tokens: int, n_seqs: int, n_ids: int, hidden: int, dtype: str) -> int:
    """Upper bound of a unit file's size: hidden states + int64 token ids and lengths + header."""
    scale = 4 * n_tokens * n_ids if dtype == "float8_e4m3fn" else 0  # one float32 per token and layer
    return n_tokens * n_ids * hidden * ITEMSIZE[dtype] + scale + 8 * (n_tokens + n_seqs) + HEADER_SLACK


def encode(hs, dtype: str) -> dict:
    """hidden_states [N, n_ids, H] in the storage dtype; float8_e4m3fn is scaled per token and layer (each row's
    max |x| maps to 448, so outliers keep their range) with ``scale`` [N, n_ids] float32 beside it."""
    import torch

    if dtype != "float8_e4m3fn":
        return {"hidden_states": hs.to(getattr(torch, dtype)).contiguous()}
    x = hs.float()
    scale = (x.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [N, n_ids]
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"hidden_states": q.contiguous(), "scale": scale.contiguous()}


def decode(hs, scale=None):
    """float32 [N, n_ids, H] from a stored hidden_states (and its scale, for float8)."""
    x = hs.float()
    return x if scale is None else x * scale.float()[..., None]


def scratch_bytes(lengths: list[int], n_ids: int, hidden: int, dtype: str) -> int:
    """Upper bound of the engine's per-request files for these sequences (model dtype)."""
    return sum(shard_bytes(n, 0, n_ids, hidden, dtype) for n in lengths)


class Ledger:
    """A producer's accounting of the bytes it holds in the buffer (the bound is asserted from this)."""

    def __init__(self, share: int):
        self.share = share
        self.units: dict[int, int] = {}  # unit -> bytes of its complete, unconsumed file
        self.peak = 0

    def pending(self) -> int:
        return sum(self.units.values())

    def release_consumed(self, cursor: int) -> None:
        self.units = {u: b for u, b in self.units.items() if u >= cursor}

    def fits(self, reserve: int) -> bool:
        return self.pending() + reserve <= self.share

    def reserve(self, reserve: int) -> None:
        """Start work that may transiently occupy ``reserve`` more bytes."""
        if not self.fits(reserve):
            raise RuntimeError(f"reservation of {reserve} B exceeds the buffer share {self.share} B")
        self.peak = max(self.peak, self.pending() + reserve)

    def add(self, u: int, size: int) -> None:
        self.units[u] = size
        self.peak = max(self.peak, self.pending())


TRAINER_LOCK = "TRAINER.lock"  # held (flock) by the one trainer process reading a buffer; its pid inside
TRAINER_OWNER = "TRAINER.owner"  # the lock where the filesystem has no flock: {host, pid}, made exclusively
# flock's errors on a filesystem without it: Lustre mounted noflock (ENOSYS), NFS without a lock manager
# (ENOLCK), FUSE and others (EOPNOTSUPP / ENOTSUP)
NO_FLOCK = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})


def no_flock(err: OSError) -> bool:
    """Whether `err` (raised by flock) says the filesystem has no flock at all, not that the lock is held."""
    return not isinstance(err, BlockingIOError) and err.errno in NO_FLOCK


def flock_error(directory: Path) -> OSError | None:
    """The error flock raises in `directory` when its filesystem has none (`no_flock`), else None."""
    probe = Path(directory) / f".flock_probe.{socket.gethostname()}.{os.getpid()}"
    try:
        with open(probe, "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
            except OSError as e:
                if no_flock(e):
                    return e
                raise
    finally:
        probe.unlink(missing_ok=True)
    return None


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # another user's process, or an unreadable owner: assume it lives
    return True


class OwnerFile:
    """The trainer lock without flock: ``TRAINER.owner`` holding {host, pid}, removed by `close` (if still
    ours). Unlike a flock it outlives a killed process; `take_trainer_lock` takes over a dead one of this host."""

    def __init__(self, path: Path, me: dict):
        self.path, self.me, self.closed = path, me, False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if read_owner(self.path) == self.me:
            self.path.unlink(missing_ok=True)


def read_owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        return {}
    except ValueError:
        return {"unreadable": str(path)}


def take_owner_file(buf: Path, why: OSError) -> OwnerFile:
    """The no-flock trainer lock (`OwnerFile`), printed as such; raises when a live trainer holds it (or one of
    another host, whose life cannot be checked from here: the message names the file to remove)."""
    path, me = buf / TRAINER_OWNER, {"host": socket.gethostname(), "pid": os.getpid()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_owner(path)
            if holder.get("host") == me["host"] and not _alive(holder.get("pid")):
                path.unlink(missing_ok=True)  # a dead trainer of this host: take over
                continue
            raise RuntimeError(
                f"{buf}: another trainer ({holder}) is reading this buffer; two would consume each other's units. "
                f"The filesystem has no flock ({why}; Lustre mounted noflock?), so {path} stands in for the lock: "
                "if that trainer is gone (a killed node), delete that file; else stop it, or give this run another "
                "hidden_dump_dir (mounting with flock or localflock restores the automatic lock)"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me))
        print(f"{buf}: flock unavailable here ({why}): the trainer lock is the owner file {path} instead")
        return OwnerFile(path, me)
    raise RuntimeError(f"{path}: could not be created or taken over")


def take_trainer_lock(buf: Path):
    """The buffer's trainer lock (an open file holding an exclusive flock, released when closed or when the
    process dies; where the filesystem has no flock, `take_owner_file`); raises when another trainer holds it:
    two consumers would take each other's units."""
    f = open(buf / TRAINER_LOCK, "a+")  # noqa: SIM115  (held for the source's lifetime)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        _held(buf)
    except OSError as e:
        f.close()
        if not no_flock(e):
            raise
        return take_owner_file(buf, e)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _held(buf: Path):
    """Raise: another trainer holds the flock of `buf` (its pid, as it wrote it)."""
    try:
        holder = (buf / TRAINER_LOCK).read_text().strip() or "unknown"
    except OSError:
        holder = "unknown"
    raise RuntimeError(
        f"{buf}: another trainer (pid {holder}) is reading this buffer; two would consume each other's units. "
        "Stop it (a 05 or a killed run's surviving rank), or give this run another hidden_dump_dir"
    ) from None
