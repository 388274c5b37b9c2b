"""Preflight against the running server: its own account of its speculative settings, not the pasted command.

* vLLM: ``GET /server_info?config_format=json`` (served when the server runs with ``VLLM_SERVER_DEV_MODE=1``)
  gives its ``speculative_config`` — method, draft model path, num_speculative_tokens; ``/metrics`` gives the
  spec-decode counters after a few probe requests (drafts, draft tokens per draft, accepted).
* SGLang: ``GET /server_info`` (``/get_server_info`` on older versions) returns the server args —
  ``speculative_algorithm``, ``speculative_draft_model_path``, ``speculative_num_steps``,
  ``speculative_eagle_topk``, ``speculative_num_draft_tokens`` — and ``internal_states[0].avg_spec_accept_length``
  (its documented response shape; tested here against a stand-in of that shape, not a real SGLang server).

Flags: EAGLE instead of EAGLE3 (acceptance ~1.0: fc and the aux layers dropped), a draft model path other
than the checked drafter, a different number of draft tokens, speculative decoding off, tau near 1.0.

    python -m eagle_lib.serving.live vllm|sglang URL DRAFTER_DIR [--num-steps 3] [--api-key-env VAR]
"""

from __future__ import annotations

import argparse
import sys

from eagle_lib.engines import client
from eagle_lib.serving.checks import Check, same_path
from eagle_lib.serving.online import (
    auth_headers,
    completion_tokens,
    counter_delta,
    metrics_counters,
    settled_counters,
)

COLLAPSED_TAU = 1.1  # below this the server accepts almost no drafts
PROBE_TEXT = "Write a short Python function that adds two numbers, then explain it in one sentence."


# --- the server's own account of its settings --------------------------------------------------------------
def _method_check(out: list[Check], name: str, got: str | None, want: str, eagle: str) -> None:
    ok = str(got or "").lower() == want.lower()
    bad = f"{got!r}: must be {want!r}"
    if str(got or "").lower() == eagle.lower():
        bad += " (EAGLE-1 reads one hidden layer: fc and the aux layers are dropped, acceptance ~1.0)"
    out.append(Check(name, ok, str(got) if ok else bad))


def _path_check(out: list[Check], name: str, got: str | None, drafter_dir: str) -> None:
    ok = same_path(str(got or ""), drafter_dir)
    out.append(Check(name, ok, str(got) if ok else f"{got!r} is not the checked drafter {drafter_dir}"))


def _tau_check(out: list[Check], tau: float | None, source: str) -> None:
    if tau is None or tau != tau:
        out.append(Check("live tau", False, f"no acceptance measured ({source})", "warning"))
        return
    ok = tau >= COLLAPSED_TAU
    bad = (
        f"tau {tau:.2f} ~ 1.0 ({source}): the server accepts almost no drafts (wrong method, path or layers)"
    )
    out.append(Check("live tau", ok, f"tau {tau:.2f} ({source})" if ok else bad))


def vllm_spec_config(base_url: str, timeout: float = 30.0, headers: dict | None = None) -> dict | None:
    """The server's speculative_config from /server_info, or None when the endpoint is not served."""
    try:
        info = client.get_json(base_url + "/server_info?config_format=json", timeout, headers)
    except client.ServerError as e:
        if e.status == 404:
            return None
        raise
    cfg = info.get("vllm_config") or {}
    return cfg.get("speculative_config") if isinstance(cfg, dict) else None


def probe_vllm(
    base_url: str, model: str = "", n: int = 3, max_tokens: int = 32, timeout: float = 300.0,
    headers: dict | None = None,
) -> dict:  # fmt: skip
    """Counter deltas over n greedy probe requests of `max_tokens` each (``ignore_eos``: a model that answers
    the probe with its stop token at once still takes speculative steps), read once the counters account for
    every token the replies report: tau, drafts, draft_tokens, accepted, generated."""
    model = model or client.get_json(base_url + "/v1/models", headers=headers)["data"][0]["id"]
    before, generated = metrics_counters(base_url, headers), 0
    for i in range(n):
        body = dict(model=model, prompt=f"{i}. {PROBE_TEXT}", max_tokens=max_tokens, temperature=0.0,
                    ignore_eos=True)  # fmt: skip
        generated += completion_tokens(
            client.post_json(base_url + "/v1/completions", body, timeout, headers), base_url
        )
    return counter_delta(before, settled_counters(base_url, before, generated, headers=headers), 1) | {
        "generated": generated
    }


def check_vllm(
    base_url: str, drafter_dir: str, num_steps: int, tau: float | None = None, headers: dict | None = None
) -> list[Check]:
    out: list[Check] = []
    spec = vllm_spec_config(base_url, headers=headers)
    if spec is None:
        msg = "not served: start vLLM with VLLM_SERVER_DEV_MODE=1 to check its speculative config; /metrics only"
        out.append(Check("vllm /server_info", False, msg, "warning"))
    elif not spec:
        out.append(
            Check("vllm speculative_config", False, "none: the server runs without speculative decoding")
        )
    else:
        _method_check(out, "vllm method (live)", spec.get("method"), "eagle3", "eagle")
        _path_check(out, "vllm draft model (live)", spec.get("model"), drafter_dir)
        n = spec.get("num_speculative_tokens")
        out.append(
            Check(
                "vllm num_speculative_tokens (live)", n == num_steps, f"{n} (intended {num_steps})", "warning"
            )
        )
    try:
        d = probe_vllm(base_url, headers=headers)
    except ValueError as e:  # no spec-decode counters
        out.append(Check("vllm spec-decode metrics", False, str(e)))
        return out
    per = d["draft_tokens"] / d["drafts"] if d["drafts"] else None
    ok = per is not None and abs(per - num_steps) < 1e-9
    msg = f"{per} (intended {num_steps}; {d['drafts']:.0f} drafts over {d['generated']} probe tokens)"
    out.append(Check("vllm draft tokens per step (metrics)", ok, msg, "warning"))
    _tau_check(
        out, tau if tau is not None else d["tau"], "measured" if tau is not None else "3 probe requests"
    )
    return out


def sglang_server_args(base_url: str, timeout: float = 30.0, headers: dict | None = None) -> dict:
    """SGLang's server args from /server_info, falling back to /get_server_info (older versions)."""
    try:
        return client.get_json(base_url + "/server_info", timeout, headers)
    except client.ServerError as e:
        if e.status != 404:
            raise
        return client.get_json(base_url + "/get_server_info", timeout, headers)


def check_sglang(
    base_url: str, drafter_dir: str, num_steps: int, tau: float | None = None, headers: dict | None = None
) -> list[Check]:
    out: list[Check] = []
    a = sglang_server_args(base_url, headers=headers)
    _method_check(
        out, "sglang speculative_algorithm (live)", a.get("speculative_algorithm"), "EAGLE3", "EAGLE"
    )
    _path_check(
        out, "sglang speculative_draft_model_path (live)", a.get("speculative_draft_model_path"), drafter_dir
    )
    steps, topk, tokens = (
        a.get(k) for k in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    )
    ok = steps == num_steps and (topk != 1 or tokens == steps + 1)
    msg = f"{steps} steps, topk {topk}, {tokens} draft tokens (intended {num_steps} steps)"
    out.append(Check("sglang draft steps (live)", ok, msg, "warning"))
    states = a.get("internal_states") or [{}]
    live_tau = states[0].get("avg_spec_accept_length") if isinstance(states[0], dict) else None
    _tau_check(
        out, tau if tau is not None else live_tau, "measured" if tau is not None else "avg_spec_accept_length"
    )
    return out


def check_server(
    engine: str, base_url: str, drafter_dir: str, num_steps: int, tau: float | None = None,
    headers: dict | None = None,
) -> list[Check]:  # fmt: skip
    """Every live check of a running vLLM or SGLang server; tau = an acceptance measured by the caller;
    `headers` with every request (the API key)."""
    url = base_url.rstrip("/")
    if engine == "vllm":
        return check_vllm(url, drafter_dir, num_steps, tau, headers)
    if engine == "sglang":
        return check_sglang(url, drafter_dir, num_steps, tau, headers)
    raise ValueError(f"live preflight: engine must be vllm or sglang, got {engine!r}")


def live_checks(p, url: str, drafter_dir, raw: dict[float, dict]) -> list[dict]:
    """06's live checks: the running server's own account of its speculative settings against 06's params
    ``p``, with the tau 06 measured (`online.measure`'s ``raw``) in place of the probe's."""
    taus = [r["tau"] for per in raw.values() for r in per.values()]
    tau = sum(taus) / len(taus) if taus else None
    headers = auth_headers(p.online_api_key_env)
    checks = check_server(p.online_engine, url, str(drafter_dir), p.num_steps, tau=tau, headers=headers)
    return [c.__dict__ for c in checks]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle_lib.serving.live", description=__doc__.split("\n")[0])
    ap.add_argument("engine", choices=["vllm", "sglang"])
    ap.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:30000")
    ap.add_argument("drafter_dir", help="the drafter the server should serve")
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--api-key-env", default="", help="NAME of the variable holding the server's --api-key")
    a = ap.parse_args(argv)
    checks = check_server(a.engine, a.url, a.drafter_dir, a.num_steps, headers=auth_headers(a.api_key_env))
    for c in checks:
        print(f"[{'ok  ' if c.ok else ('FAIL' if c.severity == 'error' else 'warn')}] {c.name}: {c.message}")
    return 0 if all(c.ok or c.severity != "error" for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
