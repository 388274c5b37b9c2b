"""Training-time test (TTT): the EAGLE-3 unroll, its loss and its acceptance metrics.

Step ``i`` (0-based) at row index ``t`` simulates draft step ``i`` after a prefix ending at position ``t``
(see `eagle_lib.drafter.model` for the inference alignment):

* input token ``x[t+1+i]`` (the true token; the chain only continues when the drafts were right), or with
  ``feed="drafted"`` at steps ``i >= 1`` the drafter's own step ``i-1`` argmax at ``t`` (as drafting feeds its
  drafts; equal to ``x[t+1+i]`` wherever that draft was right), position ``t + i``, hidden = ``fc(f_t)`` at
  step 0, else the step ``i-1`` output hidden at ``t`` (`Eagle3Drafter.feedback`);
* attention: step-0 keys at rows ``s <= t`` of the same sequence, plus the keys of steps ``1..i`` at row
  ``t`` only (the diagonal), exactly the keys a drafter sees at draft step ``i`` in vLLM / SGLang;
* target: the target's distribution at position ``t+1+i`` (it predicts ``x[t+2+i]``) restricted to the
  draft vocab and renormalized; label position ``t+2+i`` must have ``loss_mask`` set and lie in the same
  sequence.

Loss = sum_i decay^i * mean per-position loss over label positions whose target argmax is in the draft
vocab, between the target p = ``softmax(target_logits / target_temperature)`` over the draft vocab (1.0: the
target's own distribution; below 1 sharper, towards the argmax that greedy verification accepts) and the draft
q (`served.LOSSES`, the ``loss`` param; the names and formulas follow speculators' loss options, docs.vllm.ai/projects/
speculators "Loss Functions", with alpha = sum_v min(p_v, q_v), the acceptance rate of speculative sampling). ``acc_i`` counts every label position (an argmax outside the draft vocab is a miss, as it is at
serving time); ``cond_acc_i`` is acc given steps ``< i`` were right at the same row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle_lib.drafter import longseq, seqpar, served
from eagle_lib.drafter.model import Eagle3Drafter

# (steps k, per-step loss decay) of the public trainers
PRESETS = {"eagle": (7, 0.8), "specforge": (7, 0.8), "speculators": (3, 1.0), "modelopt": (3, 0.9)}

# columns of the per-step stats tensor (sums, so micro-batches and ranks add up)
LOSS_SUM, N_LOSS, N_CORRECT, N_LABELS, COND_NUM, COND_DEN = range(6)
N_STATS = 6
# bins of the target's own top-1 probability at a label (held-out breakdown of the first draft's misses):
# a miss where the target itself hesitates needs its exact near-tie order, one where it is sure does not
CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.9, 0.99)


def resolve_preset(preset: str, steps: int, decay: float) -> tuple[int, float]:
    """Named preset, with explicit non-zero steps / decay overriding it."""
    if preset not in PRESETS and preset != "custom":
        raise ValueError(f"ttt_preset {preset!r}: choose one of {sorted(PRESETS)} or custom")
    k, d = PRESETS.get(preset, (0, 0.0))
    k, d = steps or k, decay or d
    if k < 1 or d <= 0:
        raise ValueError(f"TTT needs steps >= 1 and decay > 0 (got {k}, {d}); set ttt_steps and loss_decay")
    return k, d


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32 for softmax and loss; fp32/fp64 unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def shift(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, t] <- x[:, t+n] along dim 1, filling the last n with ``fill``."""
    if n >= x.shape[1]:
        return torch.full_like(x, fill)
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_attention(q, k0, v0, mask0, ks: list, vs: list) -> torch.Tensor:
    """q (B,h,T,D) over step-0 keys k0/v0 (B,h,T,D) under mask0 (B,1,T,T) and diagonal keys ks/vs."""
    q = q * q.shape[-1] ** -0.5  # scale the (T, D) side, not the (T, T) scores
    s = at_least_fp32(torch.matmul(q, k0.transpose(-1, -2)))  # (B, h, T, T)
    s.masked_fill_(~mask0, float("-inf"))  # in place: matmul's backward needs q and k, not s
    if ks:
        diag = at_least_fp32(torch.stack([(q * k).sum(-1) for k in ks], dim=-1))  # (B, h, T, i)
        s = torch.cat([s, diag], dim=-1)
    p = torch.softmax(s, dim=-1).to(v0.dtype)
    t = k0.shape[2]
    out = torch.matmul(p[..., :t], v0)
    for j, v in enumerate(vs):
        out = out + p[..., t + j, None] * v
    return out


def ttt_attention_sdpa(q, k0, v0, mask0, ks: list, vs: list) -> torch.Tensor:
    """Same result as `ttt_attention`, through one SDPA call over the keys of all steps.

    The keys of steps 0..i are concatenated (B, h, (i+1)T, D) under a mask that keeps the step-0 block's
    mask0 and only the diagonal of every later block. On GPU this runs the memory-efficient kernel (no
    (T, T) score tensor kept for backward), at (i+1) times the attention FLOPs of the eager path.
    """
    t = q.shape[2]
    if not ks:
        return F.scaled_dot_product_attention(q, k0, v0, attn_mask=mask0)
    eye = torch.eye(t, dtype=torch.bool, device=q.device).expand(mask0.shape)
    mask = torch.cat([mask0] + [eye] * len(ks), dim=-1)  # (B, 1, T, (i+1)T)
    return F.scaled_dot_product_attention(q, torch.cat([k0, *ks], 2), torch.cat([v0, *vs], 2), attn_mask=mask)


ATTENTION = {"eager": ttt_attention, "sdpa": ttt_attention_sdpa, "chunked": longseq.ttt_attention_chunked}
FEEDS = ("label", "drafted")  # input token of steps >= 1: the data's next token | the drafter's own draft


POSITIONS = ("assistant", "all")  # label positions: the data's loss mask | every token of a document


class TTT(nn.Module):
    """Wraps the drafter so one forward = one TTT unroll (DDP/FSDP wrap this module)."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        steps: int,
        decay: float,
        attention: str = "eager",
        feed: str = "label",
        target_temperature: float = 1.0,
        loss: str = "soft_ce",
        loss_chunk: int = 0,
        checkpoint_steps: bool = False,
        shard: seqpar.Shard | None = None,
        terms: list[served.Term] | None = None,
        positions: str = "assistant",
    ):
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"loss_positions {positions!r}: choose one of {list(POSITIONS)}")
        self.positions = positions
        if attention not in ATTENTION:
            raise ValueError(f"attention {attention!r}: choose one of {sorted(ATTENTION)}")
        if feed not in FEEDS:
            raise ValueError(f"ttt_input {feed!r}: choose one of {list(FEEDS)}")
        self.drafter, self.steps, self.decay, self.feed = drafter, steps, decay, feed
        # the objective (`served`): one term per served temperature; None = the greedy recipe's single term
        # (`served.terms` checks the loss names and temperatures)
        self.terms = terms or served.terms([], 1.0, [], target_temperature, loss, loss)
        self.plain = all(t.plain for t in self.terms)  # no nucleus: the draft vocab's target logits suffice
        self.attention, self.chunked = ATTENTION[attention], attention == "chunked"
        self.loss_chunk = loss_chunk  # > 0: head + loss this many label rows at a time (`longseq`)
        self.checkpoint_steps = checkpoint_steps  # recompute each step's decoder layer in backward
        self.shard = shard or seqpar.Shard()  # sequence parallel: this rank's rows (`seqpar`)
        # set by `evaluate`: the first draft's (labels, correct) per CONFIDENCE_EDGES bin are added up here
        self.confidence: torch.Tensor | None = None
        # set by `evaluate`: per sampled term (T > 0), the draft vocab's share of the target's served distribution
        # at the first draft's labels (`served.vocab_mass`) and the labels, added up here
        self.served_mass: torch.Tensor | None = None
        # set by `evaluate`: per sampled term, the teacher-forced acceptance of a probabilistic draft
        # (`served.acceptance`) summed per unroll step with its labels (R, k, 2), and the first draft's summed per
        # CONFIDENCE_EDGES bin (R, bins)
        self.served_alpha: torch.Tensor | None = None
        self.served_alpha_bins: torch.Tensor | None = None

    def _objective(self, target_rows: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        """(n,) the objective at label rows: target logits (n, V), or (n, N) draft columns when plain."""
        cols = None if self.plain else self.drafter.draft_ids()
        return served.objective(target_rows, cols, draft_logits, self.terms)

    def forward(self, input_ids, position_ids, doc_ids, loss_mask, aux, target_logits):
        """Returns (weighted loss, stats (k, N_STATS) of sums); under sequence parallel (`seqpar`) the loss of
        this rank's rows times the group size and their stats. aux (B,T,3H_t); target_logits (B,T,V), or a
        `longseq.HeadTarget` (then ``loss_chunk`` must be set: logits are only made chunk by chunk)."""
        d = self.drafter
        c = d.config
        rep = c.num_attention_heads // c.num_key_value_heads
        if (
            self.positions == "all"
        ):  # every token of a document is a label: the target's distribution is known there
            loss_mask = doc_ids >= 0
        lazy = isinstance(target_logits, longseq.HeadTarget)
        if lazy and not self.loss_chunk:
            raise ValueError("a HeadTarget (no (B, T, V) logits) needs loss_chunk > 0")
        with torch.no_grad():
            if self.loss_chunk:
                t_arg = longseq.target_argmax(target_logits, self.loss_chunk)
            else:
                t_arg = target_logits.argmax(-1)  # (B, T) target ids
                flat = target_logits.reshape(-1, target_logits.shape[-1])
                flat = flat[:, d.draft_ids()] if self.plain else flat
                cols = None if self.plain else d.draft_ids()
                t_logps = [lp.view(*t_arg.shape, -1) for lp in served.target_terms(flat, cols, self.terms)]
            t_in = d.t2d[t_arg]  # (B, T) argmax in the draft vocab
            if self.chunked:
                ctx = doc_ids
            else:
                same = doc_ids[:, :, None] == doc_ids[:, None, :]
                ctx = (same & torch.ones_like(same).tril())[:, None]  # (B, 1, T, T)
        sh = self.shard  # sequence parallel: this rank computes rows a..b-1 of every row of the batch
        a, _ = sh.bounds(input_ids.shape[1])
        hidden = d.project(sh.local(aux).to(d.fc.weight.dtype))  # (B, T_local, H)
        k0 = v0 = None
        ks, vs = [], []
        prefix = sh.local(torch.ones_like(loss_mask))
        total = at_least_fp32(hidden.new_zeros(()))
        stats = []
        fed = None  # (B, T_local) drafted input ids of the next step (feed="drafted")
        for i in range(self.steps):
            tokens = sh.local(shift(input_ids, 1 + i, 0)) if fed is None else fed

            def layer(hidden, *kv, tokens=tokens, i=i):
                q, k, v, res = d.qkv(tokens, hidden, sh.local(position_ids) + i)
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                q, k, v = sh.to_heads(q), sh.to_heads(k), sh.to_heads(v)  # every row, this rank's heads
                k0_, v0_, ks_, vs_ = (
                    (k, v, [], []) if not kv else (kv[0], kv[1], [*kv[2::2], k], [*kv[3::2], v])
                )
                att = sh.to_rows(self.attention(q, k0_, v0_, ctx, ks_, vs_))
                return d.finish(att, res), k, v  # (B, T_local, H) pre-norm

            kv = [] if i == 0 else [k0, v0, *(x for pair in zip(ks, vs, strict=True) for x in pair)]
            if self.checkpoint_steps and torch.is_grad_enabled():
                out, k, v = checkpoint(layer, hidden, *kv, use_reentrant=False)
            else:
                out, k, v = layer(hidden, *kv)
            if i == 0:
                k0, v0 = k, v
            else:
                ks.append(k)
                vs.append(v)
            hidden = d.feedback(out)
            # label rows (row t reads the target at t+1+i and predicts x[t+2+i] of the same document)
            labels = sh.local(shift(loss_mask, 2 + i, False) & (shift(doc_ids, 2 + i, -2) == doc_ids))
            bi, ti = labels.nonzero(as_tuple=True)
            ti = ti + a + 1 + i  # the target rows they read, in the whole row
            tgt_arg, in_vocab = t_arg[bi, ti], t_in[bi, ti]
            if self.loss_chunk:
                ce, arg = longseq.chunked_head_loss(d, out[labels], target_logits, bi, ti, self._objective,
                                                    self.loss_chunk, full_vocab=not self.plain)  # fmt: skip
            else:
                logits = at_least_fp32(d.head(out[labels]))  # (n, N) only at label rows
                ce = served.objective_from([lp[bi, ti] for lp in t_logps], logits, self.terms)  # (n,)
                arg = logits.detach().argmax(-1)
            loss_sum = (ce * in_vocab).sum()
            n_loss = in_vocab.sum()
            total = total + self.decay**i * loss_sum / sh.total(n_loss).clamp(min=1)
            with torch.no_grad():
                drafted = d.draft_ids()[arg]  # (n,) target ids
                if self.feed == "drafted":  # rows without a label keep the data's token
                    fed = sh.local(shift(input_ids, 2 + i, 0)).clone()
                    fed[labels] = drafted
                correct = torch.zeros_like(labels)
                correct[labels] = drafted == tgt_arg
                den = (labels & prefix).sum()
                prefix = prefix & labels & correct
                if (i == 0 and self.confidence is not None) or self.served_alpha is not None:
                    self._add_heldout(i, out[labels], correct[labels], target_logits, bi, ti)
                row = [loss_sum.detach(), n_loss, correct.sum(), labels.sum(), prefix.sum(), den]
                stats.append(torch.stack([x.float() for x in row]))
        # this rank's rows' stats; the loss times the group size (the gradient average over ranks sums the group)
        return total * sh.size, torch.stack(stats)

    def sampled_terms(self) -> list[served.Term]:
        return [t for t in self.terms if t.serve_temperature > 0]

    def _add_heldout(self, i: int, out_rows, hits, target_logits, bi, ti) -> None:
        """Add to the held-out accumulators `evaluate` sets (each None: skipped), a chunk of label rows at a time
        with one fetch of the target's rows: at step 0 the first draft's labels and hits per bin of the target's own
        top-1 probability (`confidence`) and the draft vocab's share of each sampled term's served distribution
        (`served_mass`, `served.vocab_mass`); at every step each sampled term's acceptance of a probabilistic draft
        (`served_alpha`, `served.acceptance`; at step 0 per bin too)."""
        d, cols, terms = self.drafter, self.drafter.draft_ids(), self.sampled_terms()
        step = self.loss_chunk or max(1, len(bi))
        n_bins = len(CONFIDENCE_EDGES) + 1
        for j in range(0, len(bi), step):
            tl = longseq.target_rows(target_logits, bi[j : j + step], ti[j : j + step])
            p1 = at_least_fp32(tl).softmax(-1).amax(-1)  # (n,) the target's own top-1 probability (T=1)
            b = torch.bucketize(
                p1, torch.tensor(CONFIDENCE_EDGES, dtype=p1.dtype, device=p1.device), right=True
            )
            if i == 0 and self.confidence is not None:
                self.confidence[0] += torch.bincount(b, minlength=n_bins).to(self.confidence)
                hit = hits[j : j + step].to(p1.dtype)
                self.confidence[1] += torch.bincount(b, weights=hit, minlength=n_bins).to(self.confidence)
            z = (
                at_least_fp32(d.head(out_rows[j : j + step]))
                if self.served_alpha is not None and terms
                else None
            )
            for r, t in enumerate(terms):
                if i == 0 and self.served_mass is not None:
                    self.served_mass[r, 0] += (
                        served.vocab_mass(tl, cols, t).double().sum().to(self.served_mass)
                    )
                    self.served_mass[r, 1] += len(tl)
                if z is None:
                    continue
                a = served.acceptance(tl, cols, z, t).double()
                self.served_alpha[r, i, 0] += a.sum().to(self.served_alpha)
                self.served_alpha[r, i, 1] += len(a)
                if i == 0 and self.served_alpha_bins is not None:
                    self.served_alpha_bins[r] += torch.bincount(b, weights=a, minlength=n_bins).to(
                        self.served_alpha_bins
                    )


SAMPLED = "T={:g}"  # the key of a sampled term's served vocab mass


def confidence_table(counts: torch.Tensor, alpha: dict[str, list[float]] | None = None) -> list[dict]:
    """Rows per bin of the target's top-1 probability: labels, their share, acc_0, and the share of all misses;
    with ``alpha`` ({"T=t": summed acceptance per bin}), each served temperature's mean acceptance of a
    probabilistic first draft there (``alpha_T=t``)."""
    labels, hits = (x.double().cpu().tolist() for x in counts)
    misses = sum(labels) - sum(hits)
    lows, highs = (0.0, *CONFIDENCE_EDGES), (*CONFIDENCE_EDGES, 1.0)
    return [
        {
            "target_p_top1": f"[{lo:.2f}, {hi:.2f}{']' if hi == 1.0 else ')'}",
            "p_top1_below": hi,
            "labels": int(n),
            "share": n / sum(labels) if sum(labels) else float("nan"),
            "acc_0": h / n if n else float("nan"),
            "miss_share": (n - h) / misses if misses else float("nan"),
            **{f"alpha_{t}": (v[b] / n if n else float("nan")) for t, v in (alpha or {}).items()},
        }
        for b, (lo, hi, n, h) in enumerate(zip(lows, highs, labels, hits, strict=True))
    ]


def summarize(stats: torch.Tensor) -> dict:
    """Per-step metrics from summed stats (k, N_STATS): loss_i, acc_i, cond_acc_i, sim_tau, chain_tau."""
    s = stats.double().cpu()

    def ratio(a, b):
        return [float(x / y) if y > 0 else float("nan") for x, y in zip(s[:, a], s[:, b], strict=True)]

    acc = ratio(N_CORRECT, N_LABELS)
    out = {"loss": ratio(LOSS_SUM, N_LOSS), "acc": acc, "cond_acc": ratio(COND_NUM, COND_DEN)}
    prod, tau = 1.0, 1.0
    for a in acc:
        prod *= a if a == a else 0.0
        tau += prod
    out["sim_tau"] = tau
    n0 = float(s[0, N_LABELS])
    out["chain_tau"] = 1.0 + (float(s[:, COND_NUM].sum()) / n0 if n0 else 0.0)
    out["n_labels"] = int(n0)
    return out


def weighted_loss(per_step: list[float], decay: float) -> float:
    """The scalar training loss from per-step mean losses (for logs)."""
    return float(sum(decay**i * x for i, x in enumerate(per_step) if x == x))


def log_row(step, lr, stats, gnorm, tokens, seconds, decay) -> dict:
    """One train_log.jsonl line from a step's summed stats (k, N_STATS)."""
    m = summarize(stats)
    return {
        "step": step,
        "lr": lr,
        "loss": weighted_loss(m["loss"], decay),
        "loss_k": m["loss"],
        "acc_k": m["acc"],
        "cond_acc_k": m["cond_acc"],
        "sim_tau": m["sim_tau"],
        "grad_norm": gnorm,
        "tokens": tokens,
        "seconds": seconds,
    }


def evaluate(model, source, seqs, pack_len: int, rows_per_batch: int, device, autocast: bool) -> dict:
    """TTT metrics (teacher-forced acc_i etc.) of ``model`` (a TTT module) over held-out sequences."""
    from eagle_lib.data import batches

    if not seqs:
        return {}
    from eagle_lib import distributed

    rows = batches.pack([len(s.input_ids) for s in seqs], pack_len)
    total = None
    model.eval()
    inner = distributed.unwrap(model)
    inner.confidence = torch.zeros(2, len(CONFIDENCE_EDGES) + 1, dtype=torch.float64, device=device)
    n_sampled = len(inner.sampled_terms())
    inner.served_mass = torch.zeros(n_sampled, 2, dtype=torch.float64, device=device)
    inner.served_alpha = torch.zeros(n_sampled, inner.steps, 2, dtype=torch.float64, device=device)
    inner.served_alpha_bins = torch.zeros(
        n_sampled, len(CONFIDENCE_EDGES) + 1, dtype=torch.float64, device=device
    )
    trained_on, inner.positions = inner.positions, "assistant"  # measured where drafts are served
    try:
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            for i in range(0, len(rows), rows_per_batch):
                batch = batches.make_batch(seqs, rows[i : i + rows_per_batch], batches.PAD_TO)
                aux, tlogits = source(batch)
                x = [
                    t.to(device)
                    for t in (batch.input_ids, batch.position_ids, batch.doc_ids, batch.loss_mask)
                ]
                _, stats = model(*x, aux, tlogits)
                total = stats if total is None else total + stats
        total = inner.shard.total(total)  # sequence parallel: every rank held a part of each row
        out = summarize(total)
        keys = [SAMPLED.format(t.serve_temperature) for t in inner.sampled_terms()]
        bins = inner.shard.total(inner.served_alpha_bins).cpu().tolist()
        out["by_target_confidence"] = confidence_table(
            inner.shard.total(inner.confidence), dict(zip(keys, bins, strict=True))
        )
        mass = inner.shard.total(inner.served_mass).cpu().tolist()
        out["served_vocab_mass"] = {
            key: (m / n if n else float("nan")) for key, (m, n) in zip(keys, mass, strict=True)
        }
        alpha = inner.shard.total(inner.served_alpha).cpu().tolist()
        out["served_acceptance"] = {
            key: [a / n if n else float("nan") for a, n in per] for key, per in zip(keys, alpha, strict=True)
        }
    finally:
        inner.confidence = None
        inner.served_mass = None
        inner.served_alpha = None
        inner.served_alpha_bins = None
        inner.positions = trained_on
        model.train()
    return out


def run_summary(history, heldout, vinfo, tally, k, decay, total, world) -> dict:
    """summary.json's training part: steps, TTT settings, data sizes, throughput, last and held-out metrics."""
    secs = sum(r["seconds"] for r in history) or float("nan")
    last = history[-1]
    return {
        "steps": total,
        "ttt_steps": k,
        "loss_decay": decay,
        "world_size": world,
        "train_sequences": tally.kept,
        "heldout_sequences": tally.heldout,
        "train_tokens": sum(r["tokens"] for r in history),
        "tokens_per_s": sum(r["tokens"] for r in history) / secs,
        "final_train_loss": last["loss"],
        "final_train_acc_k": last["acc_k"],
        "heldout": heldout,
        "vocab": vinfo,
    }
