"""Which torch thread count decoding ran on, for the tests of `machine.decoding_threads` (05's meter, 07's decoder)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def training_threads_on_two_cores(monkeypatch, training: int = 2):
    """A 2-core machine (`machine.usable_cores`) whose torch holds `training` threads, as a 05/07 training step with
    threads_alone leaves it; yields the list of torch's thread counts seen at each `speculative_generate` call.
    Puts torch's own count back afterwards."""
    from eagle_lib.decoding import specdec
    from eagle_lib.engines import machine

    seen, real = [], specdec.speculative_generate
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(
        specdec, "speculative_generate", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(training)
    try:
        yield seen
    finally:
        torch.set_num_threads(before)
