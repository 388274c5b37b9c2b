"""Offline speculative decoding: the target (transformers) verifies every draft, greedily or by sampling.

One step: the proposer drafts up to k tokens after the newest token ``x_n``; the target reads
``[x_n, d_1..d_k]`` in ONE forward (KV cache) and :class:`~eagle_lib.decoding.sampling.Sampler` judges the
drafts. Greedy (temperature 0): accept the longest prefix with ``d_i == argmax p_{i-1}`` and emit the argmax
after it (the bonus token), so the output is the target's own greedy decoding token for token, whatever the
proposer does. Sampled (temperature > 0, with top_p / top_k): the speculative accept/reject rule with residual
resampling, so the output is distributed exactly as the target's own sampling (see sampling.py).

Accounting is honest about the end of the output: a step's ``accepted`` counts only drafts that end up in the
output — drafts accepted after the stop token or past max_new_tokens are not counted (``matched`` keeps the raw
count, which is what vLLM's counters report). tau = mean(accepted + 1) over steps; ``ctx`` is the context
length (prompt + generated) each step verified at.

Proposers share one small protocol (``start`` / ``propose`` / ``advance``; ``q`` after ``propose``: the
distributions (len, V) the drafts were drawn from, None for deterministic drafts):
* ``EagleProposer`` — our EAGLE-3 drafter, run exactly as SGLang (topk 1) and vLLM run it: prefill over the
  prompt's target features, a chain of k drafts (k-1 drafter passes after the first), then crop the drafter
  cache back to the rows made from target features and extend it with the accepted tokens' features. Drafts are
  the drafter's argmax (as both engines draft), or drawn from its own warped distribution with ``draft_sampler``.
* ``NgramProposer`` — prompt lookup: copy what followed the latest earlier occurrence of the context's suffix.
* ``NoProposer`` — drafts nothing: plain decoding, tau = 1, the speed baseline.
* ``OracleProposer`` — the target's own greedy continuation: every greedy draft is accepted.

The tables (tau, per-position acceptance, speedups) are in :mod:`eagle_lib.serving.tables`; the same prompts
against a server in :mod:`eagle_lib.serving.online`.
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from eagle_lib.data.evalsets import Prompt  # noqa: F401  (re-exported: specdec.Prompt)
from eagle_lib.decoding.sampling import Sampler, warp


@dataclass
class Generation:
    """One prompt's speculative run: output ids, per-step accepted/drafted counts, forward timings."""

    output_ids: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts per verify step that end up in the output
    drafted: list[int] = field(default_factory=list)  # drafts proposed per step
    matched: list[int] = field(default_factory=list)  # drafts the verify accepted, past the output's end too
    ctx: list[int] = field(default_factory=list)  # context length (prompt + generated) at each step
    target_s: float = 0.0  # seconds in target forwards (prefill excluded)
    target_calls: int = 0
    draft_s: float = 0.0  # seconds in proposer calls (propose + advance, start excluded)
    draft_calls: int = 0
    total_s: float = 0.0


def _crop(cache, keep: int) -> None:
    """Keep the first `keep` positions of an HF cache.

    A negative argument removes that many positions in every transformers version (the positive one changed
    meaning in 5.x, and crop(0) empties the cache in 4.x), so only ever pass a negative one.
    """
    drop = cache.get_seq_length() - keep
    if drop < 0:
        raise ValueError(f"cannot keep {keep} positions of a cache holding {cache.get_seq_length()}")
    if drop:
        cache.crop(-drop)


class TargetRunner:
    """The target with a KV cache: prefill, verify a block, crop after a rejection."""

    def __init__(self, model, aux_layers: list[int] | None = None):
        from eagle_lib.hidden_states.hidden import LayerCapture

        self.model = model
        self.aux_layers = aux_layers  # None: no features needed (proposers without a drafter)
        # hooks, as 05 captures: HF hidden_states[L] is the last layer after the final norm, 05 trains on it before
        self.capture = LayerCapture(model, aux_layers) if aux_layers is not None else None
        self.device = next(model.parameters()).device
        self.cache = None
        # transformers renamed the cache argument (past_key_values -> cache); use what this version takes
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    @torch.no_grad()
    def _forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = torch.tensor([ids], device=self.device)
        kw = {self._cache_kw: self.cache}
        if self.capture is None:
            return self.model(input_ids=x, use_cache=True, **kw).logits[0], None
        with self.capture:
            out = self.model(input_ids=x, use_cache=True, **kw)
        return out.logits[0], self.capture.take()[0]  # (T, V), (T, 3H)

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Read the prompt from scratch: (logits (V,) of the next token, features (T, 3H) of the prompt)."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        logits, feats = self._forward(prompt_ids)
        return logits[-1], feats

    def verify(self, block: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Read [x_n, d_1..d_k]: logits (k+1, V) of the token after each prefix, features (k+1, 3H)."""
        return self._forward(block)

    def keep(self, n: int) -> None:
        """Drop cached positions >= n (rejected drafts)."""
        _crop(self.cache, n)


class NoProposer:
    """Drafts nothing: every step verifies one token (greedy decoding, tau = 1)."""

    name = "none"
    needs_features = False
    q = None

    def start(self, seq: list[int], feats) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return []

    def advance(self, new: list[int], feats) -> None:
        pass


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n_max down to n_min) and
    propose the k tokens that followed it."""

    name = "ngram"
    needs_features = False
    q = None

    def __init__(self, n_max: int = 3, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"NgramProposer: need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.seq: list[int] = []

    def start(self, seq: list[int], feats) -> None:
        self.seq = list(seq)

    def propose(self, k: int) -> list[int]:
        s = self.seq
        for n in range(min(self.n_max, len(s) - 1), self.n_min - 1, -1):
            suffix = s[-n:]
            for i in range(len(s) - n - 1, -1, -1):  # latest match first, never the suffix itself
                if s[i : i + n] == suffix:
                    return s[i + n : i + n + k]
        return []

    def advance(self, new: list[int], feats) -> None:
        self.seq.extend(new)


class OracleProposer:
    """The target's own greedy continuation: acceptance must be perfect at T=0.

    It keeps a KV cache of its own over the accepted sequence (a full recompute of prompt + answer for each of
    the k drafts of every step cost a real target, SmolLM2 with 768-token prompts, ~5 s a step): each proposal
    reads the tokens accepted since the last one, drafts k tokens through the cache, then crops the drafts away.
    """

    name = "oracle"
    needs_features = False
    q = None

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.seq: list[int] = []
        self.cache = None
        self._cache_kw = (  # as TargetRunner: the cache argument's name in this transformers version
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def start(self, seq: list[int], feats) -> None:
        from transformers import DynamicCache

        self.seq, self.cache = list(seq), DynamicCache()

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        x, out = self.seq[self.cache.get_seq_length() :], []
        for _ in range(k):
            kw = {self._cache_kw: self.cache}
            logits = self.model(input_ids=torch.tensor([x], device=self.device), use_cache=True, **kw).logits
            out.append(int(logits[0, -1].argmax()))
            x = out[-1:]
        _crop(self.cache, len(self.seq))  # the drafts were read only to draft the next one
        return out

    def advance(self, new: list[int], feats) -> None:
        self.seq.extend(new)


class EagleProposer:
    """An Eagle3Drafter run with a KV cache the way SGLang (topk 1) and vLLM run it (see module doc)."""

    name = "eagle3"
    needs_features = True

    def __init__(self, drafter, draft_sampler: Sampler | None = None):
        self.drafter = drafter
        self.device = next(drafter.parameters()).device
        self.sampler = draft_sampler if draft_sampler is not None and not draft_sampler.greedy else None
        self.q: torch.Tensor | None = None  # (len(drafts), V_target) when drafts are sampled
        self.cache = None
        self.rows = 0  # drafter rows computed from target features (positions 0..rows-1)
        self.last_hidden: torch.Tensor | None = None  # (1, 1, H) pre-norm output of the last such row
        self.last_logits: torch.Tensor | None = None  # (N_draft,)

    @torch.no_grad()
    def _extend(self, ids: list[int], feats: torch.Tensor) -> None:
        """Rows for positions rows..rows+T-1: tokens x_{t+1} with target features f_t (T, 3H)."""
        d = self.drafter
        t = len(ids)
        hidden = d.project(feats[None].to(self.device, d.fc.weight.dtype))  # (1, T, H)
        pos = torch.arange(self.rows, self.rows + t, device=self.device)[None]
        out, logits = d(torch.tensor([ids], device=self.device), hidden, pos, self.cache)
        self.rows += t
        self.last_hidden, self.last_logits = out[:, -1:], logits[0, -1]

    def start(self, seq: list[int], feats: torch.Tensor) -> None:
        self.cache, self.rows = self.drafter.new_cache(), 0
        self._extend(seq[1:], feats)  # target positions 0..n-1 read x_0..x_{n-1}; inputs x_1..x_n

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        d, drafts, qs = self.drafter, [], []
        tok, hidden = self._pick(self.last_logits, qs), self.last_hidden
        for j in range(k):
            drafts.append(int(d.draft_to_target(tok)))
            if j == k - 1:
                break
            pos = torch.tensor([[self.rows + j]], device=self.device)
            hidden, logits = d(torch.tensor([[drafts[-1]]], device=self.device), hidden, pos, self.cache)
            tok = self._pick(logits[0, -1], qs)
        self.q = torch.stack(qs[: len(drafts)]) if qs and drafts else None
        return drafts

    def _pick(self, logits: torch.Tensor, qs: list) -> torch.Tensor:
        """The next draft-vocab id: argmax, or a draw from the warped drafter distribution (kept in qs, mapped
        onto the target vocab (V_target,))."""
        if self.sampler is None:
            return logits.argmax()
        s = self.sampler
        p = warp(logits.detach().cpu(), s.temperature, s.top_k, s.top_p)  # (N_draft,)
        q = torch.zeros(self.drafter.config.vocab_size, dtype=p.dtype)
        q[self.drafter.draft_ids().cpu()] = p
        qs.append(q)
        return torch.tensor(s.draw(p), device=self.device)

    def advance(self, new: list[int], feats: torch.Tensor) -> None:
        self.cache.crop(self.rows)  # drop the speculative rows made from the drafter's own hidden
        self._extend(new, feats)


def speculative_generate(
    target: TargetRunner,
    proposer,
    prompt_ids: list[int],
    max_new_tokens: int,
    k: int = 3,
    eos_ids: list[int] | None = None,
    sampler: Sampler | None = None,
) -> Generation:
    """Speculative decoding of one prompt. Greedy (sampler None or temperature 0): the output equals the target's
    greedy output; sampled: it is distributed as the target's sampling."""
    if k < 0 or max_new_tokens < 1:
        raise ValueError(
            f"speculative_generate: need k >= 0 and max_new_tokens >= 1 (got {k}, {max_new_tokens})"
        )
    sampler = sampler or Sampler()
    eos = set(eos_ids or [])
    t0 = time.perf_counter()
    logits, feats = target.prefill(prompt_ids)
    first = sampler.first(logits)
    gen, seq = Generation(output_ids=[first]), list(prompt_ids) + [first]
    proposer.start(seq, feats)
    stopped = first in eos or max_new_tokens == 1
    while not stopped:
        t1 = time.perf_counter()
        drafts = proposer.propose(k)[:k]
        q = proposer.q[: len(drafts)] if proposer.q is not None and drafts else None
        t2 = time.perf_counter()
        logits, feats = target.verify([seq[-1]] + drafts)
        a, nxt = sampler.verify(drafts, logits, q)
        t3 = time.perf_counter()
        new = drafts[:a] + [nxt]
        kept = _clip(new, max_new_tokens - len(gen.output_ids), eos)  # the part that is output
        gen.ctx.append(len(seq))
        target.keep(len(seq) + a)  # cache holds every position whose token is now final
        seq += new
        gen.output_ids += kept
        stopped = len(kept) < len(new) or kept[-1] in eos or len(gen.output_ids) >= max_new_tokens
        if not stopped:
            proposer.advance(new, None if feats is None else feats[: a + 1])
        t4 = time.perf_counter()
        gen.accepted.append(min(a, len(kept)))
        gen.matched.append(a)
        gen.drafted.append(len(drafts))
        gen.target_s += t3 - t2
        gen.target_calls += 1
        gen.draft_s += (t2 - t1) + (t4 - t3)
        gen.draft_calls += max(len(drafts), 1) if proposer.needs_features else 0
    gen.total_s = time.perf_counter() - t0
    return gen


def _clip(ids: list[int], room: int, eos: set[int]) -> list[int]:
    """The first `room` tokens, cut just after the first EOS (a step can overshoot both)."""
    ids = ids[:room]
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


CYCLE_STARTS = ("first cycle", "after all accepted", "after a rejection")


def first_draft_by_cycle_start(runs) -> dict[str, tuple[int, int]]:
    """(first drafts accepted, cycles) per way a cycle starts: a prompt's first cycle, after a cycle whose drafts
    were all accepted (at T > 0 the next token was drawn from the target's distribution), or after a rejection
    (drawn from the residual max(0, p - q)). ``runs``: (matched, drafted) per prompt run (a `Generation`'s
    lists, or a generation record's). Cycles that drafted nothing are not counted."""
    out = {how: [0, 0] for how in CYCLE_STARTS}
    for matched, drafted in runs:
        for i, (m, d) in enumerate(zip(matched, drafted, strict=True)):
            if d == 0:
                continue
            if i == 0:
                how = CYCLE_STARTS[0]
            else:
                how = CYCLE_STARTS[1] if matched[i - 1] == drafted[i - 1] else CYCLE_STARTS[2]
            out[how][0] += m >= 1
            out[how][1] += 1
    return {how: (a, n) for how, (a, n) in out.items()}


def acceptance_stats(accepted: list[int], k: int) -> dict:
    """tau, per-position acceptance (unconditional, conditional) and the histogram of accepted lengths."""
    n = len(accepted)
    at_least = [sum(a >= i for a in accepted) for i in range(k + 1)]  # at_least[0] = n
    out = {"steps": n, "tau": (sum(accepted) + n) / n if n else float("nan")}
    for i in range(1, k + 1):
        out[f"acc_{i}"] = at_least[i] / n if n else float("nan")
        out[f"cond_acc_{i}"] = at_least[i] / at_least[i - 1] if at_least[i - 1] else float("nan")
    hist = Counter(accepted)
    out.update({f"a={j}": hist.get(j, 0) for j in range(k + 1)})
    return out
