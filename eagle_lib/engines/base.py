"""The engine interface of stage 03 (no torch): one set of request/result types for every engine.

    engine.check(tokenizer)            -> dict      health/vocabulary probe; raises EngineError, clearly worded
    engine.generate(requests)          -> Iterator[Result | Failure], in completion order, each request once

Engines: `eagle_lib.engines.embedded.EmbeddedEngine` (the target in-process through transformers) and the HTTP
engines in `eagle_lib.engines.http_apis` (SGLang native `/generate`, OpenAI-compatible `/v1/completions` as served by
vLLM). Raw token ids are the record: no engine detokenizes and retokenizes. A finished output ends with its stop
token when finish_reason is "stop"; "length" means max_new_tokens (or the context window) was reached.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass


class EngineError(RuntimeError):
    """The engine cannot serve this run (server down, wrong model, bad settings): stop before any work."""


@dataclass(frozen=True)
class Sampling:
    """Decoding settings shared by every engine; temperature 0 = greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def record(self) -> dict:
        """What each response record keeps: {temperature, top_p, max_new_tokens, seed}."""
        d = asdict(self)
        d.pop("stop_token_ids")
        return d

    def seed_for(self, sample_id: str) -> int:
        """Per-sample seed: sampled outputs do not depend on batching, server or restarts."""
        h = hashlib.sha256(f"{self.seed}:{sample_id}".encode()).digest()
        return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True)
class Request:
    """One prompt to answer: its sample id and token ids (already rendered with the chat template)."""

    id: str
    prompt_ids: list[int]


@dataclass
class Result:
    """A generated response: output ids (the stop token included when finish_reason is "stop")."""

    id: str
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    latency_s: float
    server: str = ""
    retries: int = 0


@dataclass
class Failure:
    """A request that will not get a response in this run; `reason` is a short machine-readable key."""

    id: str
    reason: str
    detail: str = ""
    server: str = ""
    retries: int = 0


def check_vocab(model_vocab: int, tokenizer, where: str) -> None:
    """The model must have a row for every tokenizer id (it may have more: padded vocabularies are common)."""
    n_tok = len(tokenizer)
    if model_vocab < n_tok:
        raise EngineError(
            f"{where}: the model's vocabulary has {model_vocab} ids but the target tokenizer has {n_tok}: "
            "this model does not belong to this tokenizer"
        )
