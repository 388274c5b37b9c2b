"""The in-process engine of stage 03: the target through transformers, continuous batching with a KV cache
(the interface and its types: `eagle_lib.engines.base`)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from eagle_lib.engines.base import EngineError, Failure, Request, Result, Sampling, check_vocab
from eagle_lib.engines.faults import ErrorBudget


def _pick_tokens(logits: torch.Tensor, sampling: Sampling, gens: list[torch.Generator]) -> torch.Tensor:
    """Next token per row from float32 logits (B, V): argmax, or temperature + top-p sampling per row."""
    if sampling.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)  # (B, V)
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= sampling.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    rows = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)]
    return torch.cat(rows)


class _Rows:
    """Prompts in flight: row k of the KV cache, the mask (rows, W) and the positions belongs to reqs[k].

    Rows are left-padded, so every row's next token sits in the last column: rows can be added (padding the
    narrower side on the left) and removed (selecting cache rows) between decoding steps.
    """

    def __init__(self, reqs, cache, mask, next_pos, limits, gens):
        self.reqs, self.cache, self.mask, self.next_pos = reqs, cache, mask, next_pos
        self.limits, self.gens = limits, gens
        self.outs: list[list[int]] = [[] for _ in reqs]
        self.t0 = [time.perf_counter()] * len(reqs)

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def mergeable(self) -> bool:
        """Only plain full-attention dynamic layers can be padded and concatenated safely."""
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def merge(self, other: _Rows) -> None:
        """Append other's rows: pad the narrower cache/mask on the left to a common width W."""
        w = max(self.width, other.width)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            for attr in ("keys", "values"):  # (rows, kv_heads, W, head_dim)
                a, b = getattr(mine, attr), getattr(theirs, attr)
                pad_a, pad_b = (0, 0, w - a.shape[-2], 0), (0, 0, w - b.shape[-2], 0)
                setattr(mine, attr, torch.cat([F.pad(a, pad_a), F.pad(b, pad_b)]))
        self.mask = torch.cat(
            [F.pad(self.mask, (w - self.width, 0)), F.pad(other.mask, (w - other.width, 0))]
        )
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        for attr in ("reqs", "limits", "gens", "outs", "t0"):
            setattr(self, attr, getattr(self, attr) + getattr(other, attr))

    def select(self, keep: list[int]) -> None:
        """Keep these rows; drop left columns that no remaining row uses."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
        for attr in ("reqs", "limits", "gens", "outs", "t0"):
            setattr(self, attr, [getattr(self, attr)[k] for k in keep])
        first = int(self.mask.any(dim=0).float().argmax())  # first column some row attends to
        if first > 0 and self.mergeable():
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.mask = self.mask[:, first:]


class EmbeddedEngine:
    """The target in-process: batched decoding with a KV cache, continuous batching.

    Prompts are taken in the order given (03 shuffles them, so the started set is a random sample of the
    dataset), sorted longest first only within windows of `window_batches` x batch_size prompts: batching by
    length saves padding, and the window keeps the order random at any larger scale. `on_start(id, server)`,
    when set, is called as each prompt joins the batch (03's ledger of started requests).

    Finished rows leave the batch at once and waiting prompts take their place (prefilled together, then
    merged into the running batch), so the batch stays full until the queue is empty. Greedy output equals
    `model.generate(do_sample=False)` with the same stop ids (the generation config's own logits processors,
    e.g. repetition penalty, are not applied). Rows are left-padded with an attention mask and position ids
    counted from each row's first real token, as `generate` does.

    Its only per-request failures are the checks before decoding (a prompt too long for the context, an empty
    one); anything else raises and stops the run. So the early stop of the HTTP engines (`max_error_fraction`,
    `faults.ErrorBudget`, over every generate() call) is checked once per call, on exact counts, after those
    failures are yielded (03 writes them) and before any decoding.
    """

    name = "embedded"
    on_start = None  # callable(id, server) or None
    on_progress = None  # callable([(id, tokens produced so far)]) or None, every `progress_s` while decoding
    progress_s = 5.0

    def __init__(self, model, sampling: Sampling, batch_size: int = 16, max_batch_tokens: int = 16384,
                 max_model_len: int = 0, window_batches: int = 1, max_error_fraction: float | None = None):  # fmt: skip
        self.model, self.sampling, self.window_batches = model, sampling, max(1, window_batches)
        self.batch_size, self.max_batch_tokens = batch_size, max_batch_tokens
        self.max_model_len = max_model_len or int(
            getattr(model.config, "max_position_embeddings", 0) or 1 << 30
        )
        self.device = next(model.parameters()).device
        self._stop = torch.tensor(sorted(sampling.stop_token_ids), dtype=torch.long, device=self.device)
        self.budget = None if max_error_fraction is None else ErrorBudget(max_error_fraction)

    def check(self, tokenizer) -> dict:
        """Vocabulary check against the target tokenizer (no server to probe)."""
        n = self.model.get_input_embeddings().weight.shape[0]
        check_vocab(n, tokenizer, f"embedded target ({self.model.config._name_or_path})")
        return {"engine": self.name, "model_vocab": n, "max_model_len": self.max_model_len}

    def generate(self, requests: list[Request]) -> Iterator[Result | Failure]:
        """Yield one Result or Failure per request, each as soon as its row finishes."""
        fits, failed = [], []
        for r in requests:
            if len(r.prompt_ids) >= self.max_model_len:
                failed.append(Failure(
                    r.id, "prompt_too_long", f"{len(r.prompt_ids)} tokens >= context {self.max_model_len}"
                ))  # fmt: skip
            elif not r.prompt_ids:
                failed.append(Failure(r.id, "empty_prompt", "no prompt tokens"))
            else:
                fits.append(r)
        yield from failed
        if self.budget is not None:  # every outcome is known now: the rest are answered (or the run raises)
            self.budget.ok += len(fits)
            for f in failed:
                self.budget.add(f.reason)
            if self.budget.exceeded():
                raise EngineError(f"engine {self.name}: {self.budget.summary()}: stopped before decoding (the "
                                  "failures are written; check max_model_len and the prompts)")  # fmt: skip
        w = self.window_batches * self.batch_size
        windows = [
            sorted(fits[i : i + w], key=lambda r: len(r.prompt_ids), reverse=True)
            for i in range(0, len(fits), w)
        ]
        yield from self._decode(deque(r for win in windows for r in win))

    def _admit(self, queue: deque, rows: _Rows | None) -> list[Request]:
        """Next prompts to join: up to batch_size rows and max_batch_tokens of rows x (width + max_new_tokens)."""
        n, width = (len(rows), rows.width) if rows else (0, 0)
        out: list[Request] = []
        while queue and n + len(out) < self.batch_size:
            w = max(width, len(out[0].prompt_ids) if out else 0, len(queue[0].prompt_ids))
            if (n or out) and (n + len(out) + 1) * (w + self.sampling.max_new_tokens) > self.max_batch_tokens:
                break
            out.append(queue.popleft())
        return out

    def _prefill(self, reqs: list[Request]) -> tuple[_Rows, torch.Tensor]:
        """Run the prompts (left-padded) through the model; returns their rows and last logits (rows, V)."""
        from transformers import DynamicCache

        dev, width = self.device, max(len(r.prompt_ids) for r in reqs)
        ids = torch.zeros((len(reqs), width), dtype=torch.long, device=dev)
        mask = torch.zeros((len(reqs), width), dtype=torch.long, device=dev)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (rows, width): positions count real tokens only
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=1)  # fmt: skip
        s = self.sampling
        limits = [min(s.max_new_tokens, self.max_model_len - len(r.prompt_ids)) for r in reqs]
        gens = [torch.Generator(device=dev).manual_seed(s.seed_for(r.id)) for r in reqs]
        return _Rows(reqs, cache, mask, pos[:, -1] + 1, limits, gens), out.logits[:, -1]

    @torch.inference_mode()
    def _decode(self, queue: deque) -> Iterator[Result]:
        rows: _Rows | None = None
        logits = None  # (rows, V) next-token logits of every row in flight
        reported = time.monotonic()
        while queue or rows:
            if self.on_progress and rows and time.monotonic() - reported > self.progress_s:
                self.on_progress([(r.id, len(o)) for r, o in zip(rows.reqs, rows.outs, strict=True)])
                reported = time.monotonic()
            refill = rows is None or (len(rows) <= self.batch_size // 2 and rows.mergeable())
            if queue and refill and (new := self._admit(queue, rows)):
                for r in new if self.on_start else ():
                    self.on_start(r.id, self.name)
                fresh, fresh_logits = self._prefill(new)
                if rows is None:
                    rows, logits = fresh, fresh_logits
                else:
                    rows.merge(fresh)
                    logits = torch.cat([logits, fresh_logits])
            tok = _pick_tokens(logits.float(), self.sampling, rows.gens)  # (rows,)
            is_stop = torch.isin(tok, self._stop).tolist() if len(self._stop) else [False] * len(rows)
            keep = []
            for k, t in enumerate(tok.tolist()):
                out = rows.outs[k]
                out.append(t)
                reason = "stop" if is_stop[k] else "length" if len(out) >= rows.limits[k] else None
                if reason:
                    yield Result(rows.reqs[k].id, out, reason, time.perf_counter() - rows.t0[k])
                else:
                    keep.append(k)
            if not keep:
                rows = None
                continue
            if len(keep) < len(rows):
                rows.select(keep)
                tok = tok[keep]
            rows.mask = torch.cat([rows.mask, rows.mask.new_ones((len(rows), 1))], dim=1)  # (rows, W + 1)
            out = self.model(input_ids=tok[:, None], attention_mask=rows.mask, position_ids=rows.next_pos[:, None],
                             cache=rows.cache, use_cache=True)  # fmt: skip
            rows.next_pos = rows.next_pos + 1
            logits = out.logits[:, -1]
