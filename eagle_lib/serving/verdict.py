"""Online tau beside offline tau: the verdict (agree | lower | higher | collapsed | ...) with the likely causes
when a server accepts less than the offline decoder, and the check that a server's greedy output is the offline
one (`serving.online` measures the server; 06 and the llama.cpp evaluation compare with these)."""

from __future__ import annotations

# --- online tau against offline tau: the diagnosis ---------------------------------------------------------
COLLAPSE_CAUSES = [
    "SGLang started with --speculative-algorithm EAGLE instead of EAGLE3: fc and the aux layers are dropped, "
    "the drafter sees a 1 x hidden feature",
    "vLLM --speculative-config with method 'eagle' instead of 'eagle3'",
    "aux layer ids in the other engine's convention (SGLang eagle_config ids are layer outputs, vLLM's "
    "top-level ids are HF hidden_states indices = +1): the drafter reads the wrong layers",
    "vocab map not applied (d2t missing or for another vocab): drafts land on the wrong target ids",
    "drafter trained for another target, tokenizer or chat template than the server's",
    "speculators config without norm_before_residual: false (vLLM then assumes true)",
    "requests sampled with temperature > 0 or penalties while tau was measured greedily offline",
]


def _verdict(verdict: str, message: str, causes: list[str] | None = None) -> dict:
    return {"verdict": verdict, "message": message, "causes": causes or []}


def diagnose(offline_tau: float | None, online_tau: float | None, tolerance: float = 0.2) -> dict:
    """Compare online with offline tau: verdict agree | lower | higher | collapsed | online_only | no_online,
    a message, and the likely causes when the server accepts less."""
    if online_tau is None or online_tau != online_tau:
        return _verdict("no_online", "no online acceptance measured")
    off = "" if offline_tau is None else f" while offline tau is {offline_tau:.2f}"
    if online_tau < 1.1 and (offline_tau is None or offline_tau > 1.3):
        msg = f"online tau {online_tau:.2f} ~ 1.0{off}: the server accepts almost no drafts"
        return _verdict("collapsed", msg, COLLAPSE_CAUSES)
    if offline_tau is None:
        return _verdict("online_only", f"online tau {online_tau:.2f} (no offline tau)")
    gap = online_tau - offline_tau
    if abs(gap) <= tolerance:
        return _verdict(
            "agree", f"online tau {online_tau:.2f} agrees with offline {offline_tau:.2f} (±{tolerance})"
        )
    verdict = "lower" if gap < 0 else "higher"
    msg = f"online tau {online_tau:.2f} is {verdict} than offline {offline_tau:.2f} by {abs(gap):.2f}"
    causes = COLLAPSE_CAUSES[2:] + ["bf16/fp16 serving vs fp32 offline (near-ties flip)", "different prompts"]
    return _verdict(verdict, msg, causes if gap < 0 else ["different prompts or stopping rules"])


# --- online beside offline ----------------------------------------------------------------------------------
def same_output(server: list[int], reference: list[int], eos: set[int]) -> bool:
    """The server's whole output equals the offline greedy one; the only difference allowed is the stop token
    itself, which a server may leave out of its token ids."""
    if server == reference:
        return True
    return bool(reference) and reference[-1] in eos and server == reference[:-1]


def compare(
    raw: dict[float, dict[str, dict]], tau, gens: list[dict], engine: str, tol: float, eos_ids: list[int]
):
    """Online tau beside the offline eagle3 tau per temperature x dataset and pooled ('all'), the greedy-output
    check (T=0) and the diagnosis. vLLM's tau is set beside the offline tau_uncut (its counters also count
    drafts accepted past the stop token); SGLang's (tokens / verify steps) beside the offline tokens per step."""
    import pandas as pd

    col = "tau_uncut" if engine == "vllm" else "tokens_per_step"
    eos, rows = set(eos_ids), []
    for temp, per in sorted(raw.items()):
        off = (
            tau[(tau.method == "eagle3") & (tau.temperature == temp)].set_index("dataset")[col]
            if len(tau)
            else {}
        )
        ref = {
            (r["dataset"], r["id"]): r["output_ids"]
            for r in gens
            if r["method"] == "none" and r["temperature"] == temp
        }
        same = {
            ds: [same_output(ids, ref[(ds, i)], eos) for i, ids in o["outputs"].items() if (ds, i) in ref]
            for ds, o in per.items()
        }
        same["all"] = [x for v in same.values() for x in v]
        taus = {ds: o["tau"] for ds, o in per.items()} | {"all": _pooled(per, engine)}
        for ds, t in taus.items():
            off_tau = float(off[ds]) if ds in getattr(off, "index", []) else None
            diag = diagnose(off_tau, t, tol)
            eq = sum(same[ds]) / len(same[ds]) if same[ds] and temp == 0 else float("nan")
            n_failed = (
                len(per[ds].get("failed", []))
                if ds in per
                else sum(len(o.get("failed", [])) for o in per.values())
            )
            rows.append(dict(temperature=temp, dataset=ds, engine=engine, online_tau=t, offline=off_tau,
                             greedy_equal=eq, failed_requests=n_failed, verdict=diag["verdict"],
                             message=diag["message"], causes=diag["causes"]))  # fmt: skip
    return pd.DataFrame(rows)


def _pooled(per: dict[str, dict], engine: str) -> float:
    if engine == "vllm":
        drafts = sum(o["drafts"] for o in per.values())
        return 1 + sum(o["accepted"] for o in per.values()) / drafts if drafts else float("nan")
    verify = sum(o["spec_verify_ct"] for o in per.values())
    return sum(o["completion_tokens"] for o in per.values()) / verify if verify else float("nan")
