"""SGLang's own loader reads our SGLang-format export: every exported tensor lands where SGLang puts it, unchanged.

SGLang's ``LlamaForCausalLMEagle3.load_weights`` drops any weight name it does not know without a word, so a
renamed tensor in our export would leave that parameter at its (uninitialised) value and serve garbage
drafts, with no error anywhere. Here a tiny drafter built with the project's code is exported
(``eagle_lib.drafter.export.export_sglang``) and loaded by PyPI sglang 0.5.23 itself, in its own venv
(``.venv-sglang``, made by scripts/install_sglang_cpu.sh), through its ModelConfig / get_model / load_weights
on CPU (tests/support/sglang_load.py, run by that venv's interpreter; no server: SGLang cannot serve on
these CPUs). The loaded model's parameters and buffers come back and are compared both ways:

* every tensor of the export file is found in SGLang's model where SGLang maps it (``SGLANG_NAMES``), with
  equal values;
* every row of every loaded parameter comes from the file, except ``LEGITIMATELY_ABSENT`` (each with its
  reason), and the module attributes SGLang derived from config.json (norm eps, rope, fc width, vocab sizes)
  are the drafter's.

Values are compared exactly: SGLang copies each tensor into its parameter, cast to the model dtype (SGLang's
``--dtype``; ``auto`` keeps a bf16 checkpoint's bf16 and serves a float32 one as float16), so the expected
value is the file's tensor cast to that dtype (the same round-to-nearest cast), compared with torch.equal; no
tolerance is needed in any dtype.

A second test renames one weight in a copy of the export and checks that the comparison then fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_lib.drafter import export
from eagle_lib.drafter.model import Eagle3Config
from tests.support import models as tiny

pytestmark = [pytest.mark.server, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON_ENV = "EAGLE_SGLANG_PYTHON"
LOADER = REPO / "tests" / "support" / "sglang_load.py"
LOAD_TIMEOUT_S = 300
V, N = tiny.EXPORT_VOCAB, tiny.EXPORT_DRAFT_VOCAB

# Names as sglang 0.5.23's LlamaForCausalLMEagle3.load_weights maps them (read from its source): "midlayer"
# becomes "layers.0"; q/k/v_proj are stacked into one qkv_proj (rows q | k | v) and gate/up_proj into
# gate_up_proj (rows gate | up); a name that is not a top-level parameter gets "model." in front; d2t becomes
# the attribute hot_token_id = d2t + arange (no parameter) and t2d is skipped.
SGLANG_NAMES = {
    "fc.weight": "model.fc.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "midlayer.hidden_norm.weight": "model.layers.0.hidden_norm.weight",
    "midlayer.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight": "model.layers.0.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight": "model.layers.0.self_attn.qkv_proj.weight",
    "midlayer.self_attn.k_proj.weight": "model.layers.0.self_attn.qkv_proj.weight",
    "midlayer.self_attn.v_proj.weight": "model.layers.0.self_attn.qkv_proj.weight",
    "midlayer.self_attn.o_proj.weight": "model.layers.0.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight": "model.layers.0.mlp.gate_up_proj.weight",
    "midlayer.mlp.up_proj.weight": "model.layers.0.mlp.gate_up_proj.weight",
    "midlayer.mlp.down_proj.weight": "model.layers.0.mlp.down_proj.weight",
    "d2t": "hot_token_id",
}
# In the export, consumed by vLLM but not by SGLang (it derives nothing from it: the draft -> target map is d2t)
NOT_CONSUMED = {"t2d": "SGLang skips t2d; its draft -> target map is hot_token_id = d2t + arange"}
# Rows of SGLang's parameters and buffers that no export tensor fills, and why that is right.
LEGITIMATELY_ABSENT = {
    "model.embed_tokens.weight": "the target's token embedding: SGLang's EAGLE-3 worker replaces it with the "
    "target's (set_embed; hidden_size == target_hidden_size), and the export never carries it",
    "lm_head.weight[draft_vocab:]": "vocab padding: ParallelLMHead pads the draft vocab to a multiple of 64; "
    "the logits processor cuts the logits back to draft_vocab_size",
    "model.layers.0.self_attn.rotary_emb.cos_sin_cache": "a buffer SGLang computes from rope_theta, head_dim "
    "and max_position_embeddings (checked against them below), not a checkpoint tensor",
}


def sglang_python() -> Path:
    """The SGLang venv's interpreter: $EAGLE_SGLANG_PYTHON, else <repo>/.venv-sglang/bin/python."""
    return Path(os.environ.get(SGLANG_PYTHON_ENV) or REPO / ".venv-sglang" / "bin" / "python")


@pytest.fixture(scope="module")
def sglang_py() -> Path:
    py = sglang_python()
    if not py.exists():  # CI installs it (make sglang-env): a missing venv is a failure, not a skip
        pytest.fail(
            f"no SGLang interpreter at {py}: run scripts/install_sglang_cpu.sh (or set {SGLANG_PYTHON_ENV})"
        )
    return py


def make_drafter(norms: tuple[str, ...] = ()):
    """The export tests' drafter (10-layer target, draft vocab 96 of 160, GQA 2:1 heads, noisy norms), with a
    non-default norm eps so the eps SGLang reads from config.json is checked for real; ``norms`` on."""
    cfg = tiny.llama_config(
        vocab_size=V, intermediate_size=96, num_hidden_layers=10, rope_theta=5e4, rms_norm_eps=1e-5
    )
    return tiny.drafter(cfg, N, seed=0, noisy_norms=True, norms=norms)


# the norm options' weights and where SGLang 0.5.23 puts them (its input_norm / fc_norm ModuleList)
NORM_NAMES = {
    "norm_before_fc": {"input_norm.weight": "model.input_norm.weight"},
    "fc_norm": {f"fc_norm.{i}.weight": f"model.fc_norm.{i}.weight" for i in range(3)},
}


def sglang_load(py: Path, export_dir: Path, out: Path, dtype: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Run tests/support/sglang_load.py in the SGLang venv; (loaded tensors, sidecar)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [str(py), str(LOADER), "--export", str(export_dir), "--out", str(out), "--dtype", dtype]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=LOAD_TIMEOUT_S, cwd=out.parent
    )
    if proc.returncode != 0:
        pytest.fail(
            f"SGLang's loader failed (rc {proc.returncode}): {' '.join(cmd)}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
        )
    print(f"sglang load of {export_dir.name} ({dtype}): {time.monotonic() - t0:.1f} s")
    return load_file(str(out)), json.loads(out.with_suffix(".json").read_text())


def shard_rows(key: str, c: Eagle3Config) -> slice:
    """The rows of SGLang's (stacked) parameter that the export tensor key fills."""
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    return {
        "midlayer.self_attn.q_proj.weight": slice(0, q),
        "midlayer.self_attn.k_proj.weight": slice(q, q + kv),
        "midlayer.self_attn.v_proj.weight": slice(q + kv, q + 2 * kv),
        "midlayer.mlp.gate_proj.weight": slice(0, inter),
        "midlayer.mlp.up_proj.weight": slice(inter, 2 * inter),
        "lm_head.weight": slice(0, c.draft_vocab_size),
    }.get(key, slice(None))


def fmt(rows: slice) -> str:
    return f"[{'' if rows.start is None else rows.start}:{'' if rows.stop is None else rows.stop}]"


def sglang_name(key: str) -> str:
    """Where SGLang puts an export tensor (SGLANG_NAMES; an unknown name by SGLang's rules, which is how a
    renamed weight ends up naming no parameter)."""
    if key in SGLANG_NAMES:
        return SGLANG_NAMES[key]
    return "model." + key.replace("midlayer.", "layers.0.")


def expected_rope_cache(c: Eagle3Config, dtype: torch.dtype) -> torch.Tensor:
    """cos | sin of position x inverse frequency (neox rope over the whole head), from the drafter's config."""
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim))
    freqs = torch.outer(torch.arange(c.max_position_embeddings, dtype=torch.float), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def compare(
    c: Eagle3Config, file: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], side: dict
) -> list[str]:
    """Every problem found between the export file and SGLang's loaded model (empty: they agree)."""
    problems = []
    if side["class"] != "sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3":
        problems.append(f"SGLang built {side['class']}, not its LlamaForCausalLMEagle3")
    if sorted(side["given"]) != sorted(file):
        problems.append(
            f"SGLang's weight iterator gave {sorted(side['given'])}, the file holds {sorted(file)}"
        )
    if c.hidden_size != c.target_hidden_size:  # SGLang's set_embed returns early then: embed left unset
        problems.append("hidden_size != target_hidden_size: SGLang would not share the target's embedding")
    dtype = getattr(torch, side["dtype"])
    covered = {name: torch.zeros(t.shape[0], dtype=torch.bool) for name, t in loaded.items() if t.dim() > 0}

    # 1. file -> model: each exported tensor where SGLang maps it, equal
    for key, t in sorted(file.items()):
        if key in NOT_CONSUMED:
            continue
        name = sglang_name(key)
        if name not in loaded:
            problems.append(
                f"{key}: SGLang maps it to {name}, which its model does not have (dropped silently)"
            )
            continue
        if key == "d2t":
            want = t + torch.arange(t.shape[0])
            if not torch.equal(loaded[name], want):
                problems.append("d2t: SGLang's hot_token_id != d2t + arange")
            if "t2d" in file and not torch.equal(want, file["t2d"].nonzero().flatten()):
                problems.append("d2t / t2d disagree: SGLang's draft -> target ids are not t2d's kept ids")
            continue
        rows = shard_rows(key, c)
        got = loaded[name][rows]
        if got.shape != t.shape:
            problems.append(
                f"{key}: shape {tuple(t.shape)} but SGLang's {name}{fmt(rows)} is {tuple(got.shape)}"
            )
            continue
        if got.dtype != dtype:
            problems.append(f"{key}: SGLang holds {name} in {got.dtype}, its model dtype is {dtype}")
        if not torch.equal(got, t.to(got.dtype)):
            diff = (got.float() - t.float()).abs().max().item()
            problems.append(f"{key}: values differ from SGLang's {name}{fmt(rows)} (max |diff| {diff:.3g})")
        if covered[name][rows].any():
            problems.append(f"{key}: rows {fmt(rows)} of {name} filled twice")
        covered[name][rows] = True

    # 2. model -> file: every loaded row came from the file, or is legitimately absent
    absent = {
        "model.embed_tokens.weight": slice(None),
        "lm_head.weight": slice(c.draft_vocab_size, None),
        "model.layers.0.self_attn.rotary_emb.cos_sin_cache": slice(None),
        "hot_token_id": slice(None),  # checked against d2t above
    }
    for name, mask in covered.items():
        if name in absent:
            if mask[absent[name]].any():
                problems.append(
                    f"{name}: rows {fmt(absent[name])} are meant to be absent from the export but got filled"
                )
            mask[absent[name]] = True
        if not mask.all():
            rows = mask.logical_not().nonzero().flatten()
            problems.append(
                f"{name}: rows {rows.min().item()}..{rows.max().item()} ({len(rows)} of {len(mask)}) come from no "
                "export tensor (left at SGLang's initial values)"
            )
    for name in side["params"] + side["buffers"]:
        if name not in loaded:
            problems.append(f"{name}: missing from the loader's dump")

    # 3. what SGLang read from config.json
    rope = loaded.get("model.layers.0.self_attn.rotary_emb.cos_sin_cache")
    if rope is None or not torch.allclose(
        rope.float(), expected_rope_cache(c, rope.dtype).float(), atol=1e-6
    ):
        problems.append("rotary cos/sin cache != the drafter's rope (rope_theta, head_dim, max positions)")
    mods = side["modules"]
    want = {
        ("model", "num_aux_hidden_states"): len(c.aux_layers),
        ("model", "hidden_size_in"): c.target_hidden_size,
        ("model", "norm_before_fc"): c.norm_before_fc,
        ("model", "norm_output"): c.norm_output,
        ("model.embed_tokens", "org_vocab_size"): c.vocab_size,
        ("lm_head", "org_vocab_size"): c.draft_vocab_size,
        ("model.layers.0.self_attn.rotary_emb", "base"): c.rope_theta,
        ("model.layers.0.self_attn.rotary_emb", "rotary_dim"): c.head_dim,
        ("model.layers.0.self_attn.rotary_emb", "max_position_embeddings"): c.max_position_embeddings,
        ("model.layers.0.self_attn.rotary_emb", "is_neox_style"): True,
        **{
            (m, "variance_epsilon"): c.rms_norm_eps
            for m in (
                "model.norm",
                *(["model.input_norm"] if c.norm_before_fc else []),
                *(f"model.fc_norm.{i}" for i in range(3 if c.fc_norm else 0)),
                *(
                    f"model.layers.0.{n}"
                    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")
                ),
            )
        },
    }
    for (mod, attr), value in want.items():
        got = mods.get(mod, {}).get(attr)
        if got != value:
            problems.append(f"SGLang's {mod}.{attr} = {got!r}, the drafter's is {value!r}")
    return problems


@pytest.mark.parametrize(
    "export_dtype, sglang_dtype, loaded_dtype",
    [
        ("float32", "float32", "float32"),  # the default export, served in float32
        # the real case's export (export_dtype: bfloat16), SGLang's default
        pytest.param("bfloat16", "auto", "bfloat16", marks=pytest.mark.full),
    ],
)
def test_sglang_loads_every_exported_tensor(sglang_py, tmp_path, export_dtype, sglang_dtype, loaded_dtype):
    d = make_drafter()
    path = export.export_sglang(d, tmp_path / "export", dtype=export_dtype)
    file = load_file(str(path / export.WEIGHTS))
    loaded, side = sglang_load(sglang_py, path, tmp_path / "loaded.safetensors", sglang_dtype)
    assert side["dtype"] == loaded_dtype
    problems = compare(d.config, file, loaded, side)
    assert not problems, "\n".join(problems)
    # the comparison did compare: every export tensor but t2d has a home in SGLang's model
    assert set(file) - set(NOT_CONSUMED) == set(SGLANG_NAMES)
    absent = {"model.embed_tokens.weight", "model.layers.0.self_attn.rotary_emb.cos_sin_cache"}
    assert absent <= set(LEGITIMATELY_ABSENT)
    assert set(loaded) == {*SGLANG_NAMES.values(), *absent}


@pytest.mark.parametrize(
    "norms",
    [
        pytest.param(("fc_norm", "norm_output"), marks=pytest.mark.full),
        ("norm_before_fc", "fc_norm", "norm_output"),
    ],
    ids=["eagle3.1", "all"],
)
def test_sglang_loads_the_eagle31_export_with_its_norms(sglang_py, tmp_path, norms):
    """EAGLE-3.1 (fc_norm + norm_output; SGLang's kimi_k25_eagle3 names it so) and every servable norm: SGLang
    builds the norms the flags ask for (norm_output and norm_before_fc read back from its model, eps included)
    and fills each from the file, equal; a norm weight it did not build would be reported as dropped."""
    d = make_drafter(norms)
    path = export.export_sglang(d, tmp_path / "export", dtype="float32")
    cfg = json.loads((path / "config.json").read_text())
    assert {n: cfg[n] for n in export.NORM_FLAGS} == {n: n in norms for n in export.NORM_FLAGS}
    file = load_file(str(path / export.WEIGHTS))
    names = {k: v for n in norms for k, v in NORM_NAMES.get(n, {}).items()}
    assert set(file) - set(NOT_CONSUMED) == set(SGLANG_NAMES) | set(names)
    loaded, side = sglang_load(sglang_py, path, tmp_path / "loaded.safetensors", "float32")
    problems = compare(d.config, file, loaded, side)
    assert not problems, "\n".join(problems)
    assert set(names.values()) <= set(loaded)


@pytest.mark.parametrize(
    "old, new",
    [
        ("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.query_proj.weight"),
        pytest.param("fc.weight", "fc_in.weight", marks=pytest.mark.full),
    ],
)
def test_a_renamed_weight_fails_the_comparison(sglang_py, tmp_path, old, new):
    """SGLang loads a renamed weight without complaint; the comparison must not."""
    d = make_drafter()
    good = export.export_sglang(d, tmp_path / "export")
    bad = tmp_path / "renamed"
    shutil.copytree(good, bad)
    tensors = load_file(str(bad / export.WEIGHTS))
    tensors[new] = tensors.pop(old)
    save_file(tensors, str(bad / export.WEIGHTS), metadata={"format": "pt"})
    loaded, side = sglang_load(sglang_py, bad, tmp_path / "loaded.safetensors", "float32")
    assert new in side["given"]  # SGLang's loader was given the renamed tensor and raised nothing
    problems = compare(d.config, tensors, loaded, side)
    target = SGLANG_NAMES[old]
    assert any(p.startswith(f"{new}: SGLang maps it to") for p in problems), problems
    assert any(p.startswith(f"{target}: rows") for p in problems), problems


@pytest.mark.full
def test_sglang_loads_the_mla_export_into_its_eagle3_mla_class(sglang_py, tmp_path):
    """The MLA drafter (``draft_attention: mla``) through SGLang 0.5.23's own Eagle3DeepseekV2ForCausalLM
    (kimi_k25_eagle3.py): every exported tensor lands where that class's load_weights puts it, equal (q_a_proj and
    kv_a_proj_with_mqa stacked into fused_qkv_a_proj_with_mqa, gate/up into gate_up_proj, d2t into hot_token_id),
    every loaded row comes from the file but the target's embedding, lm_head's padding and the rope cache, and the
    rope SGLang builds is the trained one (adjacent-pair rotation, the drafter's theta and width)."""
    from transformers import DeepseekV3Config

    from eagle_lib.drafter.model import Eagle3Drafter

    t = DeepseekV3Config(hidden_size=64, num_hidden_layers=8, num_attention_heads=2, q_lora_rank=16,
                         kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                         intermediate_size=96, vocab_size=V, rms_norm_eps=1e-5, rope_theta=5e4)  # fmt: skip
    c = Eagle3Config.from_target_config(t, N, attention="mla")
    torch.manual_seed(0)
    d = Eagle3Drafter(c)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p))  # norms away from 1: every weight distinct from its initial value
    kept = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:N].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    d.set_vocab_map(kept - torch.arange(N), t2d)
    path = export.export_sglang(d, tmp_path / "export", dtype="float32")
    file = load_file(str(path / export.WEIGHTS))
    loaded, side = sglang_load(sglang_py, path, tmp_path / "loaded.safetensors", "float32")
    assert side["class"].endswith("kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM")
    att = "model.midlayer.self_attn."
    want = {
        att + "fused_qkv_a_proj_with_mqa.weight": torch.cat(
            [file["midlayer.self_attn.q_a_proj.weight"], file["midlayer.self_attn.kv_a_proj_with_mqa.weight"]]
        ),
        "model.midlayer.mlp.gate_up_proj.weight": torch.cat(
            [file["midlayer.mlp.gate_proj.weight"], file["midlayer.mlp.up_proj.weight"]]
        ),
        "hot_token_id": file["d2t"] + torch.arange(N),
        "lm_head.weight": file["lm_head.weight"],
    }
    stacked = {"midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.kv_a_proj_with_mqa.weight",
               "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "d2t", "t2d", "lm_head.weight"}  # fmt: skip
    for key in set(file) - stacked:
        want["model." + key] = file[key]
    problems = []
    for name, w in want.items():
        got = loaded.get(name)
        got = got[: w.shape[0]] if name == "lm_head.weight" and got is not None else got  # vocab padding rows
        if got is None or got.shape != w.shape or not torch.equal(got, w.to(got.dtype)):
            problems.append(f"{name}: {'missing' if got is None else 'differs'}")
    assert not problems, problems
    unfilled = set(loaded) - set(want) - {"model.embed_tokens.weight", att + "rotary_emb.cos_sin_cache"}
    assert not unfilled, f"SGLang parameters no export tensor filled: {sorted(unfilled)}"
    rope = side["modules"]["model.midlayer.self_attn.rotary_emb"]
    assert (rope["is_neox_style"], rope["base"], rope["rotary_dim"]) == (
        False,
        c.rope_theta,
        c.qk_rope_head_dim,
    )
    eps = {m["variance_epsilon"] for m in side["modules"].values() if m["type"] == "RMSNorm"}
    assert eps == {c.rms_norm_eps}
