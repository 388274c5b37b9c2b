"""The served-temperature objective: 05 trains the drafter for the temperatures it will be served at.

One term per served temperature T (``serve_temperatures``), each a per-position loss between the target's
distribution p_T and the draft distribution q_T over the draft vocab, summed with the terms' weights:

* T = 0 (greedy verification accepts the draft iff it is the target's argmax): p_0 =
  softmax(target logits / ``target_temperature``), the soft target sharpened towards the argmax, against
  q_0 = softmax(draft logits) with the ``loss`` param: the recipe 05 trained with before this module existed.
* T > 0 (speculative sampling): p_T = the target's sampling distribution as the engine warps it
  (softmax(logits / T), then the nucleus ``serve_top_p`` over the WHOLE target vocab), restricted to the draft
  vocab and renormalised; q_T = softmax(draft logits / T), the distribution vLLM 0.32 draws a draft from with
  ``draft_sample_method: probabilistic`` (it divides the draft logits by the request's temperature and applies
  no top-p / top-k to drafts: ``compute_probs_and_sample_next_token`` in vllm/v1/spec_decode/
  llm_base_proposer.py). A draft drawn from q is then accepted with probability sum_v min(p_v, q_v) = 1 - TV,
  which is what ``sampled_loss: tv`` minimises (the default). Greedy drafts (vLLM's default, SGLang's only
  mode) are accepted at T > 0 with probability p(argmax q) at most, the oracle's ceiling in 06.

The nucleus leaves p_T = 0 on cut tokens: losses that divide by p (reverse KL) are refused with it, and every
other loss treats 0 * log 0 as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSSES = ("soft_ce", "forward_kl", "reverse_kl", "jsd", "tv", "nla", "lk_hybrid")
# losses of `per_position_loss` that stay finite where the target's nucleus cuts tokens (p = 0 with q > 0)
FINITE_WITH_ZEROS = ("soft_ce", "forward_kl", "jsd", "tv", "nla", "lk_hybrid")


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32; fp32/fp64 unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def per_position_loss(logp: torch.Tensor, logq: torch.Tensor, kind: str) -> torch.Tensor:
    """(n,) loss between target log-probs `logp` and draft log-probs `logq` (n, N), one of `LOSSES`.

    ``logp`` may be -inf (a token the target's nucleus cut, `served`): 0 log 0 counts as 0 (reverse KL is then
    infinite, as it is)."""
    p, q = logp.exp(), logq.exp()
    safe = torch.where(p > 0, logp, torch.zeros_like(logp))  # p log p and p log q are 0 where p is
    if kind == "soft_ce":  # -sum p log q (forward KL + H(p): the same gradient)
        return -(p * logq).sum(-1)
    kl = (p * (safe - logq)).sum(-1)
    if kind == "forward_kl":
        return kl
    if kind == "reverse_kl":
        return (q * (logq - logp)).sum(-1)
    if kind == "jsd":  # 0.5 KL(p||m) + 0.5 KL(q||m), m = (p + q) / 2
        logm = torch.logaddexp(logp, logq) - torch.log(torch.tensor(2.0, dtype=logp.dtype))
        return 0.5 * (p * (safe - logm)).sum(-1) + 0.5 * (q * (logq - logm)).sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    if kind == "tv":  # 1 - alpha = 0.5 sum |p - q|
        return 1 - alpha
    if kind == "nla":  # -log(alpha): TV's optimum, a 1/alpha stronger gradient from a cold start
        return -alpha.clamp(min=1e-12).log()
    if kind == "lk_hybrid":  # lambda KL + (1 - lambda) TV, lambda = exp(-3 alpha) (not differentiated)
        lam = torch.exp(-3 * alpha).detach()
        return lam * kl + (1 - lam) * (1 - alpha)
    raise ValueError(f"loss {kind!r}: choose one of {LOSSES}")


@dataclass(frozen=True)
class Term:
    """One served temperature's loss term."""

    serve_temperature: float  # 0 = greedy verification
    target_temperature: float  # p = softmax(target logits / this) before the nucleus
    draft_temperature: float  # q = softmax(draft logits / this)
    top_p: float  # the target's nucleus (1.0: none)
    loss: str  # a `LOSSES` name
    weight: float

    @property
    def plain(self) -> bool:
        """No nucleus: p needs only the draft vocab's target logits."""
        return self.top_p >= 1.0


def terms(
    serve_temperatures: list[float],
    top_p: float,
    weights: list[float],
    target_temperature: float,
    loss: str,
    sampled_loss: str,
    greedy_draft_temperature: float = 1.0,
) -> list[Term]:
    """The objective's terms; [] serve temperatures = today's single greedy-recipe term."""
    temps = list(serve_temperatures) or [0.0]
    if any(t < 0 for t in temps) or len(set(temps)) != len(temps):
        raise ValueError(f"serve_temperatures must be distinct and >= 0 (got {serve_temperatures})")
    if weights and len(weights) != len(temps):
        raise ValueError(
            f"serve_weights needs one weight per serve temperature ({len(temps)}), got {weights}"
        )
    w = list(weights) or [1.0 / len(temps)] * len(temps)
    if any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"serve_weights must be >= 0 and not all 0 (got {weights})")
    if min(target_temperature, greedy_draft_temperature) <= 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"need target_temperature > 0, greedy_draft_temperature > 0 and 0 < top_p <= 1 "
            f"(got {target_temperature}, {greedy_draft_temperature}, {top_p})"
        )
    for name in (loss, sampled_loss):
        if name not in LOSSES:
            raise ValueError(f"loss {name!r}: choose one of {LOSSES}")
    out = []
    for t, wt in zip(temps, w, strict=True):
        if t == 0:
            out.append(Term(0.0, target_temperature, greedy_draft_temperature, 1.0, loss, wt))
            continue
        if top_p < 1 and sampled_loss not in FINITE_WITH_ZEROS:
            raise ValueError(
                f"sampled_loss {sampled_loss!r} is infinite where the target's nucleus (top_p {top_p}) cuts a token "
                f"the draft keeps; choose one of {FINITE_WITH_ZEROS}"
            )
        out.append(Term(float(t), float(t), float(t), top_p, sampled_loss, wt))
    return out


def nucleus(p: torch.Tensor, top_p: float, k: int = 256) -> torch.Tensor:
    """(n, V) bool: the smallest set of most likely tokens whose mass reaches ``top_p`` (each token kept while the
    mass of the tokens more likely than it is below top_p), as the engines cut.

    Rows whose `k` most likely tokens already hold top_p (nearly all: a nucleus of 0.95 rarely spans hundreds of
    tokens) are cut from a top-k; only the others sort the whole vocab. Same set as a full sort (ties at the cut
    aside, which no order defines): a full-vocab sort of every label row was half of a real target's step time
    (SmolLM2, vocab 49,152: 2,048 rows a micro-batch)."""
    V = p.shape[-1]
    out = torch.zeros_like(p, dtype=torch.bool)
    rows, sub = None, p  # the rows not cut yet (None: all of them) and their probabilities
    for kk in (min(k, V), min(16 * k, V), V):  # widen only for the rows whose nucleus lies past the top kk
        vals, order = sub.topk(kk, dim=-1) if kk < V else sub.sort(-1, descending=True)
        before = vals.cumsum(-1) - vals  # mass of the more likely tokens
        inside = (before[:, -1] + vals[:, -1] >= top_p) | (kk == V)
        cut = torch.zeros_like(sub, dtype=torch.bool).scatter(-1, order, before < top_p)
        if rows is None and bool(inside.all()):
            return cut
        where = inside.nonzero().flatten() if rows is None else rows[inside]
        out[where] = cut[inside]
        rows = (~inside).nonzero().flatten() if rows is None else rows[~inside]
        if not len(rows):
            break
        sub = p[rows]
    return out


def served_probs(logits: torch.Tensor, term: Term) -> torch.Tensor:
    """(n, V) the target's served distribution: softmax(logits / T), its nucleus over the whole vocab, renormalised."""
    p = (_fp32(logits) / term.target_temperature).softmax(-1)
    if term.top_p < 1:
        p = torch.where(nucleus(p, term.top_p), p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True)
    return p


def vocab_mass(logits: torch.Tensor, cols: torch.Tensor, term: Term) -> torch.Tensor:
    """(n,) the share of the target's served distribution (`served_probs`) that lies on the draft ids ``cols``: a
    draft drawn from the draft vocab is accepted with sum_v min(p_v, q_v) <= this, whatever the drafter (the draft
    vocab's ceiling at this temperature)."""
    return served_probs(logits, term)[:, cols].sum(-1)


def acceptance(
    logits: torch.Tensor, cols: torch.Tensor, draft_logits: torch.Tensor, term: Term
) -> torch.Tensor:
    """(n,) sum_v min(p_v, q_v): how often a draft drawn from q = softmax(draft logits / T) over the draft ids
    ``cols`` (vLLM's probabilistic drafts: the request's temperature, no top-p) is accepted by speculative
    sampling against the target's served p (`served_probs`, over the whole vocab: mass off the draft ids is lost)."""
    p = served_probs(logits, term)[:, cols]
    q = (_fp32(draft_logits) / term.serve_temperature).softmax(-1)
    return torch.minimum(p, q).sum(-1)


def target_logprobs(logits: torch.Tensor, cols: torch.Tensor | None, term: Term) -> torch.Tensor:
    """(n, N) log p over the draft vocab: softmax(logits / T), the nucleus over the whole vocab, restricted to
    ``cols`` (the draft ids; None when ``logits`` already holds only those columns: plain terms) and
    renormalised; -inf where the nucleus cut a token."""
    x = _fp32(logits) / term.target_temperature
    if term.plain:
        x = x if cols is None else x[:, cols]
        return x.log_softmax(-1)
    if cols is None:
        raise ValueError("a nucleus (top_p < 1) needs the target's logits over its whole vocab")
    keep = nucleus(x.softmax(-1), term.top_p)
    kept = torch.where(keep, x, torch.full_like(x, float("-inf")))[:, cols]
    # a row whose whole nucleus lies outside the draft vocab: no draft can be accepted there; fall back to the
    # untruncated distribution so the row stays finite (its label's argmax is outside the vocab: not trained)
    empty = torch.isinf(kept).all(-1, keepdim=True)
    kept = torch.where(empty, x[:, cols], kept)
    return kept.log_softmax(-1)


def target_terms(
    target_rows: torch.Tensor, cols: torch.Tensor | None, terms_: list[Term]
) -> list[torch.Tensor]:
    """Each term's (n, N) target log-probs (`target_logprobs`), computed once for all TTT steps."""
    return [target_logprobs(target_rows, cols, t) for t in terms_]


def objective_from(logps: list[torch.Tensor], draft_logits: torch.Tensor, terms_: list[Term]) -> torch.Tensor:
    """(n,) sum_t w_t * loss_t(p_t, q_t): the terms' target log-probs (n, N) and the draft logits (n, N)."""
    z = _fp32(draft_logits)
    total = None
    for logp, t in zip(logps, terms_, strict=True):
        logq = (z / t.draft_temperature).log_softmax(-1)
        part = t.weight * per_position_loss(logp, logq, t.loss)
        total = part if total is None else total + part
    return total


def objective(
    target_rows: torch.Tensor, cols: torch.Tensor | None, draft_logits: torch.Tensor, terms_: list[Term]
):
    """(n,) the objective at label rows: target logits (n, V) (or (n, N) when every term is plain and ``cols``
    is None), draft logits (n, N)."""
    return objective_from(target_terms(target_rows, cols, terms_), draft_logits, terms_)
