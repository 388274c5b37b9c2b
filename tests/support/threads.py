"""Which torch thread count decoding ran on, and in which process, for the tests of `machine.decoding_threads` and
`machine.decoding_processes` (05's meter, 07's decoder)."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch


@contextlib.contextmanager
def training_threads_on_two_cores(monkeypatch, training: int = 2):
    """A 2-core machine (`machine.usable_cores`) whose torch holds `training` threads, as a 05/07 training step with
    threads_alone leaves it; yields a function that returns (pid, torch threads) of every `speculative_generate`
    call so far, forked decode processes included (each call appends a line to a file). Puts torch's own count
    back afterwards."""
    from eagle_lib.decoding import specdec
    from eagle_lib.engines import machine

    real = specdec.speculative_generate
    fd, path = tempfile.mkstemp(prefix="decode-calls-", suffix=".txt")
    os.close(fd)

    def spy(*a, **k):
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {torch.get_num_threads()}\n")
        return real(*a, **k)

    def seen() -> list[tuple[int, int]]:
        with open(path) as f:
            return [tuple(int(x) for x in line.split()) for line in f if line.strip()]

    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(specdec, "speculative_generate", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(training)
    try:
        yield seen
    finally:
        torch.set_num_threads(before)
        os.unlink(path)
