"""The behavioural fingerprint of a served target (stage 03): what tells two servers' models apart when their
names, paths and tokenizers agree (another checkpoint of the same family, e.g. another Kimi).

Every live server answers one fixed probe (`probe_ids`: PROBE_TEXT under the target tokenizer) teacher-forced:
the log-probability of each probe token given the ones before it (SGLang ``/generate`` with ``return_logprob``
and ``logprob_start_len: 0``, read from ``meta_info.input_token_logprobs``; vLLM ``/v1/completions`` with
``prompt_logprobs: 0``, read from ``choices[0].prompt_logprobs``), and its greedy continuation of GREEDY_TOKENS
tokens. Two fingerprints are of one model when the mean absolute difference of their log-probs is at most
TOLERANCE nats per token (`difference`). A server that returns no log-probs is compared by its greedy
continuation alone (exact ids): a weaker check, as two checkpoints may continue the probe alike.

TOLERANCE, measured as that mean on the probe (92 tokens) with SmolLM2-135M-Instruct (fp32, from its packaged
GGUF) and its variants: the same model in a left-padded batch 0.0000, in fp16 0.005, in bf16 0.034 (max 0.20 on
one token; bf16 vs fp16 0.035); after fine-tuning on one unrelated chat (AdamW, lr 1e-5) 3 steps 0.016, 5 steps
0.025, 10 steps 0.046, 20 steps 0.089; with 0.3% / 1% relative noise on every weight 0.025 / 0.081. The tiny
test targets (tests/unit/test_target_identity.py checks these): fp32 vs bf16 0.005, two seeds 1.33. 0.05 accepts
every change of precision measured (servers of one deployment differ far less than fp32 from bf16) and refuses a
checkpoint fine-tuned for 20 steps; checkpoints fine-tuned for less are nearly the same model by this measure.

`settle`: the fingerprint a run's first probe agreed on is kept in ``infer/target_fingerprint-<key>.json``
(key: the target identity and the probe ids; written once, never rewritten); every later run of the same target
compares each live server with it, so a restart whose servers all serve another checkpoint is refused too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from eagle_lib import store
from eagle_lib.engines.base import EngineError

PROBE_TEXT = (
    "The committee met on Tuesday to review the budget. After a long discussion, they agreed to fund the new "
    "library, but only if the city matched the grant.\n\ndef mean(xs):\n    return sum(xs) / len(xs)\n\n"
    "Q: What is 17 * 23?\nA: 391. Paris is the capital of France; Tokyo (東京) is the capital of Japan."
)
GREEDY_TOKENS = 4
TOLERANCE = 0.05  # mean |delta log-prob| per probe token, nats (measured: see the module docstring)


class FingerprintError(ValueError):
    """A probe reply whose log-probs do not belong to the probe (scored other tokens, wrong length)."""


@dataclass(frozen=True)
class Fingerprint:
    """One server's answer to the probe: the probe ids, log p(ids[i] | ids[:i]) (None where not given: the
    first token; None for all when the server gives none) and the greedy continuation."""

    ids: tuple[int, ...]
    logprobs: tuple[float | None, ...] | None
    greedy: tuple[int, ...]

    def record(self) -> dict:
        lps = None if self.logprobs is None else list(self.logprobs)
        return {"ids": list(self.ids), "logprobs": lps, "greedy": list(self.greedy)}

    @classmethod
    def from_record(cls, d: dict) -> Fingerprint:
        lps = d.get("logprobs")
        return cls(tuple(d["ids"]), None if lps is None else tuple(lps), tuple(d["greedy"]))

    @property
    def kind(self) -> str:
        return "greedy" if self.logprobs is None else "logprobs"


def probe_ids(tokenizer) -> list[int]:
    return list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])


def distance(a: Fingerprint, b: Fingerprint) -> float | None:
    """Mean absolute difference of the probe's log-probs (nats/token, where both have one); None when either
    has none."""
    if a.logprobs is None or b.logprobs is None or a.ids != b.ids:
        return None
    pairs = [(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True) if x is not None and y is not None]
    return sum(abs(x - y) for x, y in pairs) / len(pairs) if pairs else None


def difference(a: Fingerprint, b: Fingerprint) -> str:
    """'' when `a` and `b` can be one model; else what differs, in words."""
    if a.ids != b.ids:
        return "they were probed with other token ids"
    if (d := distance(a, b)) is not None:
        if d <= TOLERANCE:
            return ""
        return f"the probe's log-probs differ by {d:.3f} nats/token on average (tolerance {TOLERANCE})"
    if a.greedy != b.greedy:
        return f"the probe's greedy continuation is {list(b.greedy)}, not {list(a.greedy)}"
    return ""


def _aligned(ids: list[int], scored: list[tuple[float | None, int | None]]) -> tuple[float | None, ...]:
    """The log-probs of `scored` ((log-prob, token id) per probe position) checked against the probe ids."""
    if len(scored) != len(ids):
        raise FingerprintError(f"{len(scored)} log-probs for a probe of {len(ids)} tokens")
    wrong = [
        i for i, ((_, t), want) in enumerate(zip(scored, ids, strict=True)) if t is not None and t != want
    ]
    if wrong:
        raise FingerprintError(f"log-probs of other tokens than the probe's (first at position {wrong[0]})")
    return tuple(None if lp is None else float(lp) for lp, _ in scored)


def sglang_body(ids: list[int]) -> dict:
    """SGLang native /generate: the probe teacher-forced from its first token, then a greedy continuation."""
    sp = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "skip_special_tokens": False}
    return {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "logprob_start_len": 0,
            "stream": False}  # fmt: skip


def from_sglang(ids: list[int], data) -> Fingerprint:
    """meta_info.input_token_logprobs: [[log-prob or None, token id, text or None], ...], one per probe token."""
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    greedy = data.get("output_ids") if isinstance(data, dict) else None
    if not isinstance(greedy, list):
        raise FingerprintError(f"no output_ids in the probe's reply: {str(data)[:200]}")
    entries = (data.get("meta_info") or {}).get("input_token_logprobs")
    if not isinstance(entries, list) or not entries:
        return Fingerprint(tuple(ids), None, tuple(greedy))
    scored = [
        (e[0], e[1] if len(e) > 1 else None) if isinstance(e, list | tuple) else (None, None) for e in entries
    ]
    return Fingerprint(tuple(ids), _aligned(ids, scored), tuple(greedy))


def openai_body(model: str, ids: list[int]) -> dict:
    """vLLM /v1/completions: prompt_logprobs 0 = the log-prob of each prompt token itself."""
    return {"model": model, "prompt": ids, "max_tokens": GREEDY_TOKENS, "temperature": 0, "prompt_logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False, "n": 1, "stream": False}  # fmt: skip


def from_openai(ids: list[int], data) -> Fingerprint:
    """choices[0].prompt_logprobs: [null, {"<token id>": {"logprob": x, "rank": r, ...}, ...}, ...]."""
    try:
        choice = data["choices"][0]
        greedy = choice["token_ids"]
    except (KeyError, IndexError, TypeError):
        raise FingerprintError(f"no choices[0].token_ids in the probe's reply: {str(data)[:200]}") from None
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or not entries:
        return Fingerprint(tuple(ids), None, tuple(greedy))
    if len(entries) != len(ids):
        raise FingerprintError(f"{len(entries)} prompt_logprobs for a probe of {len(ids)} tokens")
    scored: list[tuple[float | None, int | None]] = []
    for tok, e in zip(ids, entries, strict=True):
        v = e.get(str(tok)) if isinstance(e, dict) else None  # JSON object keys are strings
        if e is not None and v is None:
            raise FingerprintError(f"prompt_logprobs without the probe's token {tok}: {str(e)[:120]}")
        scored.append((None, None) if v is None else (v["logprob"] if isinstance(v, dict) else v, tok))
    return Fingerprint(tuple(ids), _aligned(ids, scored), tuple(greedy))


def consensus(live: dict[str, Fingerprint]) -> Fingerprint:
    """The fingerprint every live server agrees on; EngineError naming each one that serves another model
    (against the largest group that agrees; the first server's when none is larger)."""
    urls = list(live)
    groups = {u: [v for v in urls if not difference(live[u], live[v])] for u in urls}
    ref = max(urls, key=lambda u: len(groups[u]))
    odd = [u for u in urls if u not in groups[ref]]
    if odd:
        raise EngineError("the live servers do not serve one model:\n  " + "\n  ".join(
            f"{u}: serves another model than {ref} ({difference(live[ref], live[u])})" for u in odd))  # fmt: skip
    return live[ref]


def settle(engine, infer_dir: Path, identity: dict) -> dict:
    """Compare every live server of `engine` (its `fingerprints` from check()) with the fingerprint recorded for
    this target, or record theirs (created once: a shard starting at the same moment reads the other's). The
    engine then checks servers returning mid-run against it. Returns what the stage meta reports."""
    fps: dict[str, Fingerprint] = getattr(engine, "fingerprints", {})
    if not fps or engine.reference is None:
        return {}
    key = store.stable_hash({"target": identity, "probe": list(engine.reference.ids)}, 12)
    path = Path(infer_dir) / f"target_fingerprint-{key}.json"
    if not path.exists():
        rec = {"target": identity, "fingerprint": engine.reference.record(), "servers": sorted(fps),
               "written": store.now_iso()}  # fmt: skip
        _create_once(path, rec)
    stored = store.read_json(path)
    ref = Fingerprint.from_record(stored["fingerprint"])
    bad = {u: why for u, fp in fps.items() if (why := difference(ref, fp))}
    if bad:
        raise EngineError(
            f"{len(bad)} server(s) serve another model than the one this target's earlier responses were made "
            f"with ({path}, recorded {stored['written']} from {stored['servers']}):\n  "
            + "\n  ".join(f"{u}: {why}" for u, why in bad.items())
            + f"\nFix or drop those servers. If this model is meant to be the same target, delete {path.name}."
        )
    engine.reference = ref
    return {"path": str(path), "kind": ref.kind, "recorded": stored["written"]}


def _create_once(path: Path, rec: dict) -> None:
    """Write `path` unless it exists, never half of it (a hard link of a complete temp file; last writer wins
    where the file system has no hard links)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    store.write_json(tmp, rec)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
