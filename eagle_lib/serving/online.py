"""Online acceptance: the held-out prompts sent to a server with the drafter loaded, tau from its own counters.

* vLLM (OpenAI ``/v1/completions`` with token ids): tau = 1 + accepted / drafts from the deltas of the
  ``vllm:spec_decode_*`` counters on ``/metrics``, per dataset (datasets run one after another, so each delta
  belongs to one dataset; the server must carry no other traffic meanwhile).
* SGLang (native ``/generate`` with ``input_ids``): tau = sum completion_tokens / sum spec_verify_ct from each
  answer's ``meta_info`` (SGLang's accept length, which counts the prefill token too).

Requests use the same sampling as the offline run (temperature, top_p, top_k; temperature 0 = greedy). Sampled
requests carry a per-prompt seed so a rerun sends the same requests.

Faults (as 03's HTTP engines count them): a refused or reset connection, a timeout, HTTP 429 or 5xx are retried
with exponential backoff (`RETRIES`); a prompt that still fails is left out of its dataset's tau and listed
(``failed``: id and error) instead of aborting 06. A wrong key (401), another 4xx or a reply without usage
counts is the server's configuration, the same for every prompt: 06 stops with that error.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from eagle_lib.decoding.specdec import Prompt
from eagle_lib.engines import client


@dataclass(frozen=True)
class Sampling:
    """The request sampling: temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


GREEDY = Sampling()


def vllm_spec_counters(metrics_text: str) -> dict:
    """vLLM's spec-decode counters from /metrics text, summed over label sets: drafts, draft_tokens, accepted,
    and accepted per draft position (pos_0, pos_1, ...); ``series`` counts the matching lines."""
    names = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted",
        "vllm:generation_tokens_total": "generated",
    }
    out: dict[str, float] = {v: 0.0 for v in names.values()}
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        base, _, labels = name.partition("{")
        if base in names:
            out[names[base]] += float(value)
            if base.startswith("vllm:spec_decode"):
                out["series"] = out.get("series", 0) + 1
        elif base == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = labels.split('position="')[1].split('"')[0]
            out[f"pos_{pos}"] = out.get(f"pos_{pos}", 0.0) + float(value)
    return out


RETRIES, BACKOFF_S, BACKOFF_MAX_S = 4, 1.0, 30.0  # per request: transient faults only


def transient(e: client.ServerError) -> bool:
    """A fault of the moment (retry): no connection, no answer in time, 429, 5xx."""
    return e.status is None or e.status == 429 or e.status >= 500


def _map(fn, items, concurrency: int) -> list:
    """fn over items in parallel; an item whose transient faults outlast RETRIES gives a ServerError instead of
    its value (any other error propagates)."""

    def robust(item):
        for attempt in range(RETRIES + 1):
            try:
                return fn(item)
            except client.ServerError as e:
                if not transient(e) or attempt == RETRIES:
                    if transient(e):
                        return e
                    raise
                time.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt) * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable")

    with ThreadPoolExecutor(max(1, concurrency)) as ex:
        return list(ex.map(robust, items))


def _split(ps: list[Prompt], results: list) -> tuple[list, list, list[dict]]:
    """(prompts answered, their results, [{id, error}] of those that failed)."""
    ok = [(pr, r) for pr, r in zip(ps, results, strict=True) if not isinstance(r, client.ServerError)]
    failed = [
        {"id": pr.id, "error": str(r)}
        for pr, r in zip(ps, results, strict=True)
        if isinstance(r, client.ServerError)
    ]
    return [pr for pr, _ in ok], [r for _, r in ok], failed


def _seed(pr: Prompt, seed: int) -> int:
    """A per-prompt request seed (stable across runs: no Python hash randomisation)."""
    return (seed * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(pr.id))) % (2**31)


def metrics_counters(base_url: str, headers: dict | None = None) -> dict:
    """The spec-decode counters now; an error naming the cause when the server has none."""
    c = vllm_spec_counters(client.get_text(base_url + "/metrics", headers=headers))
    if not c.get("series"):
        raise ValueError(
            f"{base_url}/metrics has no vllm:spec_decode_* counters: speculative decoding is off, "
            "or the server runs with --disable-log-stats (which also disables the metrics)"
        )
    return c


def completion_tokens(reply: dict, url: str) -> int:
    """The reply's usage.completion_tokens; an error naming the server when the reply has no usage."""
    usage = reply.get("usage") if isinstance(reply, dict) else None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(n, int):
        raise ValueError(f"{url}: the reply has no usage.completion_tokens (got {str(reply)[:200]})")
    return n


def settled_counters(
    base_url: str, before: dict, generated: int, timeout_s: float = 60.0, headers: dict | None = None
) -> dict:
    """The counters once they account for `generated` tokens more than `before` did. vLLM records an engine
    step's stats after it hands the step's outputs on, so a /metrics read right after the last reply can miss
    the steps of that traffic; polling until ``vllm:generation_tokens_total`` has grown by what the replies
    reported makes the spec-decode counters read after the traffic, never before."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = metrics_counters(base_url, headers)
        seen = after.get("generated", 0.0) - before.get("generated", 0.0)
        if seen >= generated:
            return after
        if time.monotonic() > deadline:
            raise ValueError(
                f"{base_url}/metrics counted {seen:.0f} generated tokens {timeout_s:.0f} s after replies that "
                f"reported {generated}: its counters lag (or other traffic reset them)"
            )
        time.sleep(0.2)


def counter_delta(before: dict, after: dict, num_steps: int) -> dict:
    """tau, drafts, accepted, per-position acceptance from two counter snapshots."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = d["drafts"]
    tau = 1 + d["accepted"] / n if n else float("nan")
    acc = [d.get(f"pos_{i}", 0.0) / n if n else float("nan") for i in range(num_steps)]
    return dict(tau=tau, drafts=n, accepted=d["accepted"], draft_tokens=d["draft_tokens"], acc=acc)


def online_vllm(
    base_url: str,
    model: str,
    prompts: dict[str, list[Prompt]],
    max_new_tokens: int,
    num_steps: int = 3,
    concurrency: int = 4,
    timeout_s: float = 600.0,
    sampling: Sampling = GREEDY,
    seed: int = 0,
    headers: dict | None = None,
    stop_ids: list[int] | None = None,
    buckets: list[int] | None = None,
    spec: bool = True,
) -> dict[str, dict]:
    """Per dataset (and per prompt-length bucket of `buckets`, ``by_bucket``): completions from a vLLM server, tau = 1 + accepted / drafts from /metrics deltas;
    `headers` go with every request (the API key: `auth_headers`), `stop_ids` as its stop_token_ids. `spec`
    False: a server without a drafter (06's `online_speed` baseline): outputs, tokens and seconds only."""
    model = model or client.get_json(base_url + "/v1/models", headers=headers)["data"][0]["id"]

    def one(pr: Prompt) -> tuple[list[int], int]:
        body = dict(
            model=model,
            prompt=pr.prompt_ids,
            max_tokens=max_new_tokens,
            temperature=sampling.temperature,
            return_token_ids=True,
        )
        if stop_ids:
            body["stop_token_ids"] = list(stop_ids)
        if not sampling.greedy:
            body.update(top_p=sampling.top_p, top_k=sampling.top_k or -1, seed=_seed(pr, seed))
        ans = client.post_json(base_url + "/v1/completions", body, timeout_s, headers)
        return list(ans["choices"][0]["token_ids"]), completion_tokens(ans, base_url)

    out = {}
    for ds, ps in prompts.items():
        outputs, failed, parts = {}, [], {}
        sums, pos = {"drafts": 0.0, "accepted": 0.0, "draft_tokens": 0.0}, [0.0] * num_steps
        wall, tokens = 0.0, 0
        for label, group in by_bucket(ps, buckets):  # one counter delta per prompt-length bucket
            before = metrics_counters(base_url, headers) if spec else {}
            t0 = time.monotonic()
            done, answers, bad = _split(group, _map(one, group, concurrency))
            wall, tokens = wall + time.monotonic() - t0, tokens + sum(n for _, n in answers)
            if spec:
                after = settled_counters(base_url, before, sum(n for _, n in answers), headers=headers)
                res = counter_delta(before, after, num_steps)
            else:
                res = dict(
                    tau=float("nan"), drafts=0.0, accepted=0.0, draft_tokens=0.0, acc=[0.0] * num_steps
                )
            outputs |= {pr.id: ids for pr, (ids, _) in zip(done, answers, strict=True)}
            failed += bad
            parts[label] = {k: res[k] for k in ("tau", "drafts", "accepted")} | {"prompts": len(done)}
            sums = {k: v + res[k] for k, v in sums.items()}
            pos = [
                a + (b * res["drafts"] if res["drafts"] else 0.0)
                for a, b in zip(pos, res["acc"], strict=True)
            ]
        n = sums["drafts"]
        tau, acc = (
            (1 + sums["accepted"] / n, [x / n for x in pos])
            if n
            else (float("nan"), [float("nan")] * num_steps)
        )
        out[ds] = {"tau": tau, **sums, "acc": acc, "outputs": outputs, "failed": failed, "by_bucket": parts,
                   "seconds": wall, "completion_tokens": tokens}  # fmt: skip
    return out


def online_sglang(
    base_url: str,
    prompts: dict[str, list[Prompt]],
    max_new_tokens: int,
    concurrency: int = 4,
    timeout_s: float = 600.0,
    sampling: Sampling = GREEDY,
    seed: int = 0,
    headers: dict | None = None,
    stop_ids: list[int] | None = None,
    buckets: list[int] | None = None,
) -> dict[str, dict]:
    """Per dataset (and per prompt-length bucket, ``by_bucket``): /generate calls (with `headers`, `stop_ids` as stop_token_ids); tau = sum completion_tokens / sum spec_verify_ct (SGLang's own accept
    length, which counts the prefill token too)."""

    def one(pr: Prompt) -> dict:
        sp: dict = {"temperature": sampling.temperature, "max_new_tokens": max_new_tokens}
        if stop_ids:
            sp["stop_token_ids"] = list(stop_ids)
        if not sampling.greedy:
            sp.update(top_p=sampling.top_p, top_k=sampling.top_k or -1, sampling_seed=_seed(pr, seed))
        body = {"input_ids": pr.prompt_ids, "sampling_params": sp}
        r = client.post_json(base_url + "/generate", body, timeout_s, headers)
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
        done, res, failed = _split(ps, _map(one, ps, concurrency))
        tokens, verify = sum(r["tokens"] for r in res), sum(r["verify"] for r in res)
        ids = {pr.id: r["ids"] for pr, r in zip(done, res, strict=True)}
        tau = tokens / verify if verify else float("nan")
        parts = {}
        for label, group in by_bucket(
            list(zip(done, res, strict=True)), buckets, key=lambda x: len(x[0].prompt_ids)
        ):
            t, v = sum(r["tokens"] for _, r in group), sum(r["verify"] for _, r in group)
            parts[label] = {"tau": t / v if v else float("nan"), "completion_tokens": t, "spec_verify_ct": v,
                            "prompts": len(group)}  # fmt: skip
        out[ds] = {"tau": tau, "completion_tokens": tokens, "spec_verify_ct": verify, "outputs": ids,
                   "failed": failed, "by_bucket": parts}  # fmt: skip
    return out


def by_bucket(
    items: list, edges: list[int] | None, key=lambda pr: len(pr.prompt_ids)
) -> list[tuple[str, list]]:
    """(bucket label, items) per non-empty prompt-length bucket of 06's ``context_buckets`` (online, a request's
    context is known before it runs only by its prompt: the buckets here are by prompt tokens)."""
    from eagle_lib.serving.tables import bucket_labels, bucket_of

    edges = list(edges or [])
    labels = bucket_labels(edges)
    groups: dict[int, list] = {}
    for it in items:
        groups.setdefault(bucket_of(key(it), edges), []).append(it)
    return [(labels[i], groups[i]) for i in sorted(groups)]


def context_table(raw: dict[float, dict[str, dict]], engine: str):
    """Online tau per temperature x prompt-length bucket, pooled over datasets (drafts or verify steps added)."""
    import pandas as pd

    rows = []
    for temp, per in sorted(raw.items()):
        pooled: dict[str, list[float]] = {}
        for o in per.values():
            for label, b in (o.get("by_bucket") or {}).items():
                acc = pooled.setdefault(label, [0.0, 0.0, 0])
                vllm = engine == "vllm"
                num, den = (
                    (b["accepted"], b["drafts"]) if vllm else (b["completion_tokens"], b["spec_verify_ct"])
                )
                acc[0], acc[1], acc[2] = acc[0] + num, acc[1] + den, acc[2] + b["prompts"]
        for label, (num, den, n) in pooled.items():
            tau = (1 + num / den if engine == "vllm" else num / den) if den else float("nan")
            rows.append(dict(temperature=temp, bucket=label, prompts=n, online_tau=tau))
    return pd.DataFrame(rows, columns=["temperature", "bucket", "prompts", "online_tau"])


# --- what stage 06 runs ----------------------------------------------------------------------------------
def auth_headers(api_key_env: str) -> dict:
    """The Authorization header for servers started with ``--api-key``, the key read from the environment
    variable named `api_key_env` (params name the variable, never the key); {} when the name is empty."""
    from eagle_lib import params

    key = params.secret_from_env(api_key_env, "06_eval_acceptance online server")
    return client.bearer(key)


def measure(
    p,
    seed: int,
    url: str,
    model: str,
    prompts: dict[str, list[Prompt]],
    stop_ids: list[int] | None = None,
    spec: bool = True,
) -> dict[float, dict]:
    """{temperature: results per dataset} for every online temperature of 06's params ``p``; requests stop at
    `stop_ids` (06's offline ones). `spec` False: a vLLM server without a drafter (no spec-decode counters)."""
    if not p.online_temps or (max(p.online_temps) > 0 and not p.top_p):
        raise ValueError("online.measure: 06's params leave temperatures / top_p to the shared serving settings; "
                         "pass Params.served(shared)")  # fmt: skip
    raw, headers = {}, auth_headers(p.online_api_key_env)
    for temp in p.online_temps:
        s = Sampling(temp, p.top_p if temp else 1.0, p.top_k if temp else 0)
        kw = dict(concurrency=p.online_concurrency, timeout_s=p.online_timeout_s, sampling=s, seed=seed,
                  headers=headers, stop_ids=stop_ids, buckets=p.context_buckets)  # fmt: skip
        if p.online_engine == "sglang":
            raw[temp] = online_sglang(url, prompts, p.eval_max_new_tokens, **kw)
        else:
            raw[temp] = online_vllm(url, model, prompts, p.eval_max_new_tokens, p.num_steps, spec=spec, **kw)
    return raw
