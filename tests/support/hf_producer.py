"""The vllm hidden source's producer without vLLM: an engine answering ``prefill`` from transformers, and a
producer run in a thread where the stage would start a vLLM process (`producer_procs.launch`)."""

from __future__ import annotations

import subprocess
import threading

import torch
from safetensors.torch import save_file

from eagle_lib.hidden_states import vllm_producer


def assert_matches_online(src, model, aux: list[int], batches, delay_s: float = 0.0) -> None:
    """Every batch's (aux features, target logits) from `src` equal transformers' own (`hidden.OnlineHidden`) on
    the real tokens, to 1e-4; `delay_s` before each batch plays a slow trainer."""
    import time

    from eagle_lib.hidden_states import hidden

    online = hidden.OnlineHidden(model, aux)
    try:
        for b in batches:
            time.sleep(delay_s)
            got_aux, got_logits = src(b)
            ref_aux, ref_logits = online(b)
            real = b.doc_ids >= 0
            torch.testing.assert_close(got_aux[real], ref_aux[real], rtol=0, atol=1e-4)
            torch.testing.assert_close(got_logits[real], ref_logits[real], rtol=0, atol=1e-4)
    finally:
        online.close()


NO_SUCH_PGID = 2**30  # above any pid_max: producer_procs.stop's killpg on it finds no process


class HFEngine:
    """``prefill`` like `vllm_producer.VllmPrefill`, computed by transformers (``output_hidden_states`` + a
    hook on the last decoder layer: an independent capture); one file per request under ``scratch``."""

    def __init__(self, model, ids: list[int], scratch):
        self.model, self.ids, self.scratch, self.n = model, ids, scratch, 0
        self.last = model.config.num_hidden_layers

    @torch.no_grad()
    def prefill(self, seqs):
        paths = []
        for s in seqs:
            got = {}
            hook = self.model.model.layers[-1].register_forward_hook(
                lambda m, i, o, got=got: got.setdefault("x", o[0] if isinstance(o, tuple) else o)
            )
            out = self.model(torch.tensor([s]), output_hidden_states=True)
            hook.remove()
            layers = [got["x"][0] if i == self.last else out.hidden_states[i][0] for i in self.ids]
            path = self.scratch / f"req{self.n}.safetensors"
            save_file({"hidden_states": torch.stack(layers, 1), "token_ids": torch.tensor(s)}, str(path))
            paths.append(str(path))
            self.n += 1
        return paths


class ThreadProducer:
    """A `vllm_producer.Producer` in a thread, with the Popen methods `producer_procs` uses."""

    pid = NO_SUCH_PGID

    def __init__(self, buf, index: int, count: int, session: str, plan_session: str = ""):
        self.errors: list[str] = []
        self.prod = vllm_producer.Producer(buf, index, count, f"STOP.{session}", plan_session)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.prod.run()
        except BaseException as e:  # surfaced by the test
            self.errors.append(repr(e))

    def poll(self):
        return None if self.thread.is_alive() else (1 if self.errors else 0)

    def wait(self, timeout=None):
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise subprocess.TimeoutExpired("thread producer", timeout)
        return self.poll()


def patch(monkeypatch, model) -> list[ThreadProducer]:
    """Route `producer_procs.launch` to thread producers computing with `model`; returns the started ones."""
    from eagle_lib.hidden_states import producer_procs

    started: list[ThreadProducer] = []
    monkeypatch.setattr(
        vllm_producer, "make_engine", lambda cfg, scratch: HFEngine(model, cfg["layer_ids"], scratch)
    )

    def launch(buf, i, n, session, cpu, plan_session=""):  # producer_procs.launch's signature
        started.append(ThreadProducer(buf, i, n, session, plan_session))
        return started[-1]

    monkeypatch.setattr(producer_procs, "launch", launch)
    return started
