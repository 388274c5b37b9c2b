"""The target's sampling and the speculative accept/reject rule that keeps its output distribution exact.

``warp`` turns logits into the distribution the target samples from: softmax(logits / T), then top-k, then top-p
(nucleus: the smallest set of most likely tokens whose mass reaches top_p), renormalised — the order
transformers, vLLM and SGLang apply them in.

``Sampler.verify`` judges a block of drafts d_1..d_k against the target distributions p_0..p_k read by one
verify forward (Leviathan et al. 2023, Chen et al. 2023): draft d_i is accepted with probability
min(1, p_{i-1}(d_i) / q_i(d_i)), where q_i is the distribution the proposer drew d_i from (one-hot for a
deterministic proposer: greedy EAGLE drafting as vLLM and SGLang run it, n-gram lookup); at the first rejection
the step emits a token drawn from the residual norm(max(p_{i-1} - q_i, 0)); when all k are accepted it emits a
bonus token drawn from p_k. Every emitted token is then distributed exactly as the target's own sampling
(tests/unit/test_specdec.py checks this against exact marginals). Temperature 0 is greedy: accept while
d_i == argmax p_{i-1}, emit the argmax — the target's greedy decoding token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def warp(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution(s) (..., V) from logits (..., V), in float64; temperature must be > 0."""
    if temperature <= 0:
        raise ValueError(f"warp: temperature must be > 0 (got {temperature}); 0 means greedy")
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]  # (..., 1) the k-th largest probability
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        keep_sorted = before < top_p * sorted_p.sum(-1, keepdim=True)  # always keeps the most likely token
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


@dataclass
class Sampler:
    """The target's sampling (temperature 0 = greedy) with its own seeded generator."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"Sampler: need temperature >= 0, 0 < top_p <= 1, top_k >= 0 "
                f"(got {self.temperature}, {self.top_p}, {self.top_k})"
            )
        self.gen = torch.Generator().manual_seed(self.seed)  # CPU generator: draws do not depend on device

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's sampling distribution(s) (..., V) on the CPU."""
        return warp(logits.detach().cpu(), self.temperature, self.top_k, self.top_p)

    def _draw(self, p: torch.Tensor) -> int:
        return int(torch.multinomial(p, 1, generator=self.gen))

    def _uniform(self) -> float:
        return float(torch.rand((), generator=self.gen, dtype=torch.float64))

    def draw(self, p: torch.Tensor) -> int:
        """One token from a distribution p (V,)."""
        return self._draw(p)

    def first(self, logits: torch.Tensor) -> int:
        """The token after the prompt from the prefill's last logits (V,)."""
        return int(logits.argmax()) if self.greedy else self._draw(self.probs(logits))

    def verify(
        self, drafts: list[int], logits: torch.Tensor, q: torch.Tensor | None = None
    ) -> tuple[int, int]:
        """(accepted drafts a, the token the step emits after them) from the verify logits (len+1, V).

        q: (len, V) distributions the drafts were drawn from; None = deterministic drafts (one-hot q).
        """
        if self.greedy:
            g = logits.argmax(-1).tolist()
            a = 0
            while a < len(drafts) and drafts[a] == g[a]:
                a += 1
            return a, g[a]
        p = self.probs(logits)  # (len+1, V)
        for i, d in enumerate(drafts):
            qd = 1.0 if q is None else float(q[i, d])
            if qd > 0 and self._uniform() < float(p[i, d]) / qd:
                continue
            return i, self._draw(_residual(p[i], d, None if q is None else q[i].to(p.dtype).cpu()))
        return len(drafts), self._draw(p[len(drafts)])


def _residual(p: torch.Tensor, draft: int, q: torch.Tensor | None) -> torch.Tensor:
    """norm(max(p - q, 0)), q one-hot at the draft when None; p itself if nothing is left (p <= q)."""
    if q is None:
        q = torch.zeros_like(p)
        q[draft] = 1.0
    r = (p - q).clamp_min(0)
    total = float(r.sum())
    return r / total if total > 0 else p


DRAFT_SAMPLING = ("greedy", "probabilistic")


def draft_sampler(mode: str, temperature: float, seed: int) -> Sampler | None:
    """How EAGLE drafts at a sampled temperature: None = the drafter's argmax (SGLang; vLLM's default
    ``draft_sample_method: greedy``), or a draw from softmax(draft logits / T) with no top-p / top-k, as vLLM 0.32
    draws with ``draft_sample_method: probabilistic`` (its proposer applies only the request's temperature to
    drafts) and passes q to its rejection sampler."""
    if mode not in DRAFT_SAMPLING:
        raise ValueError(f"draft sampling {mode!r}: choose one of {DRAFT_SAMPLING}")
    if mode == "greedy" or temperature <= 0:
        return None
    return Sampler(temperature, 1.0, 0, seed)
