"""06's online step: the held-out prompts sent to a given server (SGLang or vLLM at ``online_url``), or to a
local vLLM CPU server that 06 starts on the drafter's export, and, with ``online_speed``, the same requests to
the target served without the drafter (tokens/s with and without)."""

from __future__ import annotations

import json
from pathlib import Path

from eagle_lib.decoding.specdec import Prompt


def serve_and_measure(
    p,
    shared,
    exports: dict[str, Path],
    prompts: dict[str, list[Prompt]],
    out: Path,
    max_pos: int,
    eos: list[int],
):
    """({temperature: raw online results per dataset}, live checks, served speed rows) for 06's params ``p``: a
    given server, or a local vLLM CPU server on the export; requests stop at `eos`, the ids offline decoding stops
    at."""
    from eagle_lib import models
    from eagle_lib.serving import live, online

    if p.online_format not in exports:
        raise ValueError(
            f"06 online_format {p.online_format!r}: the drafter has no such export (it has {sorted(exports)}; an MLA "
            "draft layer has the sglang layout only, which vLLM serves as Eagle3DeepseekV2ForCausalLM)"
        )
    url = p.online_url.rstrip("/")
    if p.online_engine == "sglang" or url:
        raw = online.measure(p, shared.seed, url, p.online_model, prompts, eos)
        return raw, live.live_checks(p, url, exports[p.online_format], raw), []
    from eagle_lib.engines.vllm_server import start_vllm
    from eagle_lib.serving import commands

    spec = commands.vllm_spec(str(exports[p.online_format]), p.num_steps, p.draft_sampling)
    max_len = min(max_pos, p.max_prompt_tokens + p.eval_max_new_tokens + 2 * p.num_steps + 8)
    kw = dict(tokenizer=models.resolve(shared.tokenizer_path), max_model_len=max_len, log_dir=out / "vllm")
    with start_vllm(
        models.resolve(shared.target),
        extra_args=["--speculative-config", json.dumps(spec)],
        env={"VLLM_SERVER_DEV_MODE": "1"},  # exposes /server_info: the live preflight reads its spec config
        **kw,
    ) as srv:
        raw = online.measure(p, shared.seed, srv.base_url, srv.model, prompts, eos)
        checks = live.live_checks(p, srv.base_url, exports[p.online_format], raw)
    if p.online_speed:  # the same requests on the same target without the drafter, one server at a time
        with start_vllm(models.resolve(shared.target), **kw) as srv:
            plain = online.measure(p, shared.seed, srv.base_url, srv.model, prompts, eos, spec=False)
        from eagle_lib.serving import tables

        return raw, checks, tables.served_speed(raw, plain)
    return raw, checks, []
