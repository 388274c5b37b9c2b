"""Offline speculative decoding with greedy verification: the target (transformers) checks every draft.

One step: the proposer drafts up to k tokens after the newest token ``x_n``; the target reads
``[x_n, d_1..d_k]`` in ONE forward (KV cache) and its argmax ``g_0..g_k`` accepts the longest prefix with
``d_i == g_{i-1}``; the step then emits ``d_1..d_a`` plus the bonus token ``g_a``. The output is therefore the
target's own greedy decoding token for token, whatever the proposer does (tests check this). Each step's
accepted count ``a`` is logged: acceptance length tau = mean(a + 1) over steps.

Proposers share one small protocol (``start`` / ``propose`` / ``advance``):
* ``EagleProposer`` — our EAGLE-3 drafter, run exactly as SGLang (topk 1) and vLLM run it: prefill over the
  prompt's target features, a chain of k drafts (k-1 drafter passes after the first), then crop the drafter
  cache back to the rows made from target features and extend it with the accepted tokens' features.
* ``NgramProposer`` — prompt lookup: copy what followed the latest earlier occurrence of the context's suffix.
* ``NoProposer`` — drafts nothing: plain greedy decoding, tau = 1, the speed baseline.
* ``OracleProposer`` — the target's own greedy continuation: every draft is accepted (checks the accounting).

Accounting (``acceptance_stats``, ``tables``): tau, per-position acceptance (unconditional P(a >= i) and
conditional P(a >= i | a >= i-1)), the histogram of accepted lengths, seconds per token and the speedup implied
by the measured drafter/target forward-cost ratio, tau / (1 + ratio * k).

Online, the same greedy requests go to a server with the drafter loaded and acceptance comes from the
server's own counters: vLLM's ``/metrics`` (tau = 1 + accepted / drafts, from counter deltas per dataset)
or SGLang's ``meta_info`` (completion_tokens / spec_verify_ct).
"""

from __future__ import annotations

import inspect
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import pandas as pd
import torch


@dataclass
class Prompt:
    """A held-out prompt: its record id, dataset and token ids in the target's vocabulary."""

    id: str
    dataset: str
    prompt_ids: list[int]


@dataclass
class Generation:
    """One prompt's speculative run: output ids, per-step accepted/drafted counts, forward timings."""

    output_ids: list[int]
    accepted: list[int] = field(default_factory=list)  # a per target verify step (0..drafted)
    drafted: list[int] = field(default_factory=list)  # drafts proposed per step
    target_s: float = 0.0  # seconds in target forwards (prefill excluded)
    target_calls: int = 0
    draft_s: float = 0.0  # seconds in proposer calls (propose + advance, start excluded)
    draft_calls: int = 0
    total_s: float = 0.0


def aux_features(hidden_states: tuple[torch.Tensor, ...], aux_layers: list[int]) -> torch.Tensor:
    """Concatenated outputs of decoder layers ``aux_layers`` (0-based): HF hidden_states[a + 1]. (B, T, 3H)."""
    return torch.cat([hidden_states[a + 1] for a in aux_layers], dim=-1)


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
        self.model = model
        self.aux_layers = aux_layers  # None: no features needed (proposers without a drafter)
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
        out = self.model(input_ids=x, use_cache=True, output_hidden_states=self.aux_layers is not None, **kw)
        feats = aux_features(out.hidden_states, self.aux_layers)[0] if self.aux_layers is not None else None
        return out.logits[0], feats  # (T, V), (T, 3H) | None

    def prefill(self, prompt_ids: list[int]) -> tuple[int, torch.Tensor | None]:
        """Read the prompt from scratch: (the target's next token, features (T, 3H) of the prompt)."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        logits, feats = self._forward(prompt_ids)
        return int(logits[-1].argmax()), feats

    def verify(self, block: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Read [x_n, d_1..d_k]: greedy next token after each prefix (k+1,), features (k+1, 3H)."""
        logits, feats = self._forward(block)
        return logits.argmax(-1).tolist(), feats

    def keep(self, n: int) -> None:
        """Drop cached positions >= n (rejected drafts)."""
        _crop(self.cache, n)


class NoProposer:
    """Drafts nothing: every step verifies one token (greedy decoding, tau = 1)."""

    name = "none"
    needs_features = False

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
    """The target's own greedy continuation (full recompute, no cache): acceptance must be perfect."""

    name = "oracle"
    needs_features = False

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        self.seq: list[int] = []

    def start(self, seq: list[int], feats) -> None:
        self.seq = list(seq)

    @torch.no_grad()
    def propose(self, k: int) -> list[int]:
        ids = list(self.seq)
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits
            ids.append(int(logits[0, -1].argmax()))
        return ids[len(self.seq) :]

    def advance(self, new: list[int], feats) -> None:
        self.seq.extend(new)


class EagleProposer:
    """An Eagle3Drafter run with a KV cache the way SGLang (topk 1) and vLLM run it (see module doc)."""

    name = "eagle3"
    needs_features = True

    def __init__(self, drafter):
        self.drafter = drafter
        self.device = next(drafter.parameters()).device
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
        d, drafts = self.drafter, []
        tok, hidden = self.last_logits.argmax(), self.last_hidden
        for j in range(k):
            drafts.append(int(d.draft_to_target(tok)))
            if j == k - 1:
                break
            pos = torch.tensor([[self.rows + j]], device=self.device)
            hidden, logits = d(torch.tensor([[drafts[-1]]], device=self.device), hidden, pos, self.cache)
            tok = logits[0, -1].argmax()
        return drafts

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
) -> Generation:
    """Greedy speculative decoding of one prompt; the output equals the target's greedy output."""
    if k < 0 or max_new_tokens < 1:
        raise ValueError(
            f"speculative_generate: need k >= 0 and max_new_tokens >= 1 (got {k}, {max_new_tokens})"
        )
    eos = set(eos_ids or [])
    t0 = time.perf_counter()
    first, feats = target.prefill(prompt_ids)
    gen, seq = Generation(output_ids=[first]), list(prompt_ids) + [first]
    proposer.start(seq, feats)
    stopped = first in eos
    while len(gen.output_ids) < max_new_tokens and not stopped:
        t1 = time.perf_counter()
        drafts = proposer.propose(k)[:k]
        t2 = time.perf_counter()
        greedy, feats = target.verify([seq[-1]] + drafts)
        t3 = time.perf_counter()
        a = 0
        while a < len(drafts) and drafts[a] == greedy[a]:
            a += 1
        new = drafts[:a] + [greedy[a]]
        target.keep(len(seq) + a)  # cache holds every position whose token is now final
        seq += new
        gen.output_ids += new
        stopped = any(t in eos for t in new)  # an accepted draft may be the EOS: the sequence ends there
        proposer.advance(new, None if feats is None else feats[: a + 1])
        t4 = time.perf_counter()
        gen.accepted.append(a)
        gen.drafted.append(len(drafts))
        gen.target_s += t3 - t2
        gen.target_calls += 1
        gen.draft_s += (t2 - t1) + (t4 - t3)
        gen.draft_calls += max(len(drafts), 1) if proposer.needs_features else 0
    gen.output_ids = _clip(gen.output_ids, max_new_tokens, eos)
    gen.total_s = time.perf_counter() - t0
    return gen


def _clip(ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Cut at max_new_tokens and just after the first EOS (a step can overshoot both)."""
    ids = ids[:max_new_tokens]
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


# --- accounting: tau, per-position acceptance, speedups ----------------------------------------------
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


def tables(
    gens: list[dict], k: int, cost_ratio: float | None
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(tau per method x dataset incl. 'all', per-position long table, accepted-length histogram)."""
    rows = []
    for (method, ds), g in _groups(gens):
        st = acceptance_stats([a for r in g for a in r["accepted"]], k)
        tokens = sum(len(r["output_ids"]) for r in g)
        secs = sum(r["total_s"] for r in g)
        per_step, per_token = tokens / max(st["steps"], 1), secs / max(tokens, 1)
        lossless = all(r["lossless"] for r in g)
        rows.append(
            dict(
                method=method,
                dataset=ds,
                prompts=len(g),
                tokens=tokens,
                tokens_per_step=per_step,
                s_per_token=per_token,
                lossless=lossless,
                **st,
            )
        )
    tau = pd.DataFrame(rows)
    base = tau[tau.method == "none"].set_index("dataset")["s_per_token"]
    tau["measured_speedup"] = [
        base.get(d, float("nan")) / s for d, s in zip(tau.dataset, tau.s_per_token, strict=True)
    ]
    ratio = {"eagle3": cost_ratio if cost_ratio is not None else float("nan"), "ngram": 0.0, "none": 0.0}
    tau["est_speedup"] = [
        t / (1 + ratio[m] * (k if m == "eagle3" else 0)) for m, t in zip(tau.method, tau.tau, strict=True)
    ]
    pos = [
        dict(
            method=r["method"],
            dataset=r["dataset"],
            position=i,
            acc=r[f"acc_{i}"],
            cond_acc=r[f"cond_acc_{i}"],
        )
        for r in rows
        for i in range(1, k + 1)
    ]
    hist = tau[["method", "dataset"] + [f"a={j}" for j in range(k + 1)]]
    return tau, pd.DataFrame(pos), hist


def _groups(gens: list[dict]):
    by: dict[tuple[str, str], list[dict]] = {}
    for r in gens:
        by.setdefault((r["method"], r["dataset"]), []).append(r)
        by.setdefault((r["method"], "all"), []).append(r)
    return sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] == "all", kv[0][1]))


def cost_ratio(gens: list[dict]) -> float | None:
    """Measured seconds per drafter forward / seconds per target verify forward (eagle3 runs)."""
    g = [r for r in gens if r["method"] == "eagle3"]
    d_calls, t_calls = sum(r["draft_calls"] for r in g), sum(r["target_calls"] for r in g)
    if not d_calls or not t_calls:
        return None
    return (sum(r["draft_s"] for r in g) / d_calls) / (sum(r["target_s"] for r in g) / t_calls)


# --- online: the same greedy requests against a server, acceptance from its own counters ---------------
def _http(url: str, body: dict | None = None, timeout: float = 60.0):
    """GET (body None) or POST JSON; returns parsed JSON, or text for non-JSON (Prometheus) bodies."""
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def vllm_spec_counters(metrics_text: str) -> dict:
    """vLLM's spec-decode counters from /metrics text, summed over label sets: drafts, draft_tokens, accepted,
    and accepted per draft position (pos_0, pos_1, ...)."""
    names = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    }
    out: dict[str, float] = {v: 0.0 for v in names.values()}
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        base, _, labels = name.partition("{")
        if base in names:
            out[names[base]] += float(value)
            out["series"] = out.get("series", 0) + 1
        elif base == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = labels.split('position="')[1].split('"')[0]
            out[f"pos_{pos}"] = out.get(f"pos_{pos}", 0.0) + float(value)
    return out


def _map(fn, items, concurrency: int) -> list:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, concurrency)) as ex:
        return list(ex.map(fn, items))


def online_vllm(
    base_url: str,
    model: str,
    prompts: dict[str, list[Prompt]],
    max_new_tokens: int,
    num_steps: int = 3,
    concurrency: int = 4,
    timeout_s: float = 600.0,
) -> dict[str, dict]:
    """Per dataset: greedy completions from a vLLM server, tau = 1 + accepted / drafts from /metrics deltas
    (datasets run one after another, so the counters' deltas belong to one dataset; no other traffic)."""
    model = model or _http(base_url + "/v1/models")["data"][0]["id"]

    def one(pr: Prompt) -> list[int]:
        body = dict(
            model=model,
            prompt=pr.prompt_ids,
            max_tokens=max_new_tokens,
            temperature=0.0,
            return_token_ids=True,
        )
        return list(_http(base_url + "/v1/completions", body, timeout_s)["choices"][0]["token_ids"])

    out = {}
    for ds, ps in prompts.items():
        before = vllm_spec_counters(_http(base_url + "/metrics"))
        if not before.get("series"):
            raise ValueError(
                f"{base_url}/metrics has no vllm:spec_decode_* counters: speculative decoding is off, "
                "or the server runs with --disable-log-stats (which also disables the metrics)"
            )
        outputs = _map(one, ps, concurrency)
        after = vllm_spec_counters(_http(base_url + "/metrics"))
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        tau = 1 + d["accepted"] / d["drafts"] if d["drafts"] else float("nan")
        per_pos = [
            d.get(f"pos_{i}", 0.0) / d["drafts"] if d["drafts"] else float("nan") for i in range(num_steps)
        ]
        ids = {pr.id: o for pr, o in zip(ps, outputs, strict=True)}
        out[ds] = dict(tau=tau, drafts=d["drafts"], accepted=d["accepted"], acc=per_pos, outputs=ids)
    return out


def online_sglang(
    base_url: str,
    prompts: dict[str, list[Prompt]],
    max_new_tokens: int,
    concurrency: int = 4,
    timeout_s: float = 600.0,
) -> dict[str, dict]:
    """Per dataset: greedy /generate calls; tau = sum completion_tokens / sum spec_verify_ct (SGLang's own
    accept length, which counts the prefill token too)."""

    def one(pr: Prompt) -> dict:
        body = {
            "input_ids": pr.prompt_ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
        }
        r = _http(base_url + "/generate", body, timeout_s)
        meta = r.get("meta_info", {})
        if "spec_verify_ct" not in meta:
            raise ValueError(
                f"{base_url}/generate: meta_info has no spec_verify_ct (speculative decoding is off)"
            )
        return {
            "ids": list(r.get("output_ids", [])),
            "tokens": meta["completion_tokens"],
            "verify": meta["spec_verify_ct"],
        }

    out = {}
    for ds, ps in prompts.items():
        res = _map(one, ps, concurrency)
        tokens, verify = sum(r["tokens"] for r in res), sum(r["verify"] for r in res)
        ids = {pr.id: r["ids"] for pr, r in zip(ps, res, strict=True)}
        tau = tokens / verify if verify else float("nan")
        out[ds] = {"tau": tau, "completion_tokens": tokens, "spec_verify_ct": verify, "outputs": ids}
    return out
