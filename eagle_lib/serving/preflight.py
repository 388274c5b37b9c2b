"""Preflight: check a drafter directory against the target and the intended server command, before serving.

Catches the mistakes that silently give acceptance ~1.0: SGLang started with ``EAGLE`` instead of ``EAGLE3``,
vLLM with method ``eagle``, an fc that reads one layer instead of three, a vocab map off the target's vocab,
aux layer ids outside the target (or in the other engine's convention), vLLM's default
``norm_before_residual: true`` applied to a drafter trained without it. Prints the exact launch commands.

    python -m eagle_lib.serving.preflight DRAFTER_DIR --target TARGET [--revision COMMIT] [--sglang-cmd "..."]
        [--vllm-spec JSON] [--server URL --engine vllm|sglang]   (or --params FILE: target and pinned revision)

``--server`` also checks the running server's own account of its speculative settings
(:mod:`eagle_lib.serving.live`, over :mod:`eagle_lib.engines.client`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle_lib import models
from eagle_lib.drafter import export, vocab
from eagle_lib.drafter.model import MLA_SHAPES, Eagle3Config
from eagle_lib.serving import commands
from eagle_lib.serving.checks import Check, same_path

MLA_WEIGHTS = [
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
]
VLLM_CPU_HEAD_SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]  # vLLM 0.32 CPU attention backend


@dataclass
class Preflight:
    """All checks of one drafter directory, the launch commands and the verdict."""

    drafter_dir: str
    format: str
    checks: list[Check] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok or c.severity != "error" for c in self.checks)

    def to_dict(self) -> dict:
        return {
            "drafter_dir": self.drafter_dir,
            "format": self.format,
            "ok": self.ok,
            "checks": [asdict(c) for c in self.checks],
            "commands": self.commands,
        }

    def text(self) -> str:
        """Human-readable report: one line per check, then the commands."""
        lines = [f"preflight {self.drafter_dir} ({self.format}): {'OK' if self.ok else 'FAILED'}"]
        for c in self.checks:
            mark = "ok  " if c.ok else ("FAIL" if c.severity == "error" else "warn")
            lines.append(f"  [{mark}] {c.name}: {c.message}")
        lines += [f"{name} launch:\n  {cmd}" for name, cmd in self.commands.items()]
        return "\n".join(lines)


def target_text_config(target: str, trust_remote_code: bool = False, revision: str | None = None) -> dict:
    """The target's text-model config as a dict (hidden_size, num_hidden_layers, vocab_size, ...), from the hub
    commit `revision` (the params' pinned ``shared.revision``: `models.hub_kwargs`) when given."""
    path = Path(models.resolve(target))
    if path.is_file():  # a config.json given directly
        cfg = json.loads(path.read_text())
        return {"architectures": cfg.get("architectures"), **(cfg.get("text_config") or cfg)}
    return text_config_dict(models.load_config(str(path), trust_remote_code, revision or None))


def text_config_dict(cfg) -> dict:
    """An HF config's text-model part as a dict, keeping the top-level architectures (multimodal wrappers)."""
    text = models.text_config(cfg)
    out = text.to_dict()
    out["architectures"] = out.get("architectures") or getattr(cfg, "architectures", None)
    out["multimodal_wrapper"] = text is not cfg  # Kimi-K2.5: served language-model-only
    return out


def _check(checks: list[Check], name: str, ok: bool, good: str, bad: str, severity: str = "error") -> None:
    checks.append(Check(name, bool(ok), good if ok else bad, severity))


def check_config(
    fmt: str, cfg: dict, target: dict, trained_aux: list[int] | None = None, trained_norms: dict | None = None
) -> list[Check]:
    """Architecture name, shapes and aux layer ids of an export config against the target config; its norm flags
    (as the engine reads them) against the drafter's own (``trained_norms``, `export.norm_flags`) when known."""
    out: list[Check] = []
    if fmt == "sglang":
        arch = cfg.get("architectures") or []
        bad = (
            f"{arch}: the EAGLE-3 loaders need {[export.SGLANG_ARCH]} (or {[export.MLA_ARCH]}: an MLA layer)"
        )
        _check(out, "architectures", arch in ([export.SGLANG_ARCH], [export.MLA_ARCH]), f"{arch}", bad)
        bad = "norm_before_residual set: SGLang 0.5.23's EAGLE-3 layer has no such option (served without it)"
        _check(
            out, "norm flags (SGLang)", not cfg.get("norm_before_residual"), "no norm_before_residual", bad
        )
        layer = cfg
    else:
        kind = cfg.get("speculators_model_type")
        _check(out, "speculators_model_type", kind == "eagle3", "eagle3", f"{kind!r}: must be 'eagle3'")
        missing = [k for k in ("norm_before_residual", "norm_before_fc") if k not in cfg]
        bad = f"{missing} missing: vLLM then assumes norm_before_residual=True" if missing else ""
        on = [k for k in export.NORM_FLAGS if cfg.get(k)]
        _check(out, "norm flags", not missing, f"written out ({', '.join(on) or 'none on'})", bad)
        layer = cfg.get("transformer_layer_config") or {}
    if (
        trained_norms is not None
    ):  # a flag without a weight (norm_output) is only seen here: the layer it runs
        served = {
            n: bool(cfg.get(n, fmt == "speculators" and n == "norm_before_residual"))
            for n in export.NORM_FLAGS
        }
        diff = [f"{n} {served[n]} (trained {bool(trained_norms.get(n))})" for n in export.NORM_FLAGS
                if served[n] != bool(trained_norms.get(n))]  # fmt: skip
        bad = f"the engine would run another layer than the trained one: {', '.join(diff)}"
        _check(
            out, "norm flags = trained", not diff, ", ".join(n for n in served if served[n]) or "none on", bad
        )
    n = layer.get("num_hidden_layers")
    _check(out, "num_hidden_layers", n == 1, "1", f"{n}: an EAGLE-3 drafter has one decoder layer")
    th, tv, tl = target["hidden_size"], target["vocab_size"], target["num_hidden_layers"]
    got_th = cfg.get("target_hidden_size") or layer.get("hidden_size")
    _check(out, "target_hidden_size", got_th == th, f"{got_th}", f"{got_th} != target hidden {th}")
    v = layer.get("vocab_size")
    _check(
        out, "vocab_size", v == tv, f"{tv}", f"{v} != target vocab {tv}: trained for another target/tokenizer"
    )
    if export.MLA_ARCH in (cfg.get("architectures") or []):
        out += check_mla(layer, target)
    else:
        head_dim = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
        bad = f"{head_dim}: vLLM's CPU backend supports {VLLM_CPU_HEAD_SIZES}"
        _check(out, "head_dim (vLLM CPU)", head_dim in VLLM_CPU_HEAD_SIZES, f"{head_dim}", bad, "warning")
    out += check_aux_layers(fmt, cfg, tl, trained_aux)
    return out


def check_mla(layer: dict, target: dict) -> list[Check]:
    """An MLA draft layer: every MLA shape set, an MLA target, and the target's latent cache width (the draft
    layer's KV cache sits in the target's MLA cache layout; served here only with the target's shapes)."""
    out: list[Check] = []
    shapes = {n: layer.get(n) for n in MLA_SHAPES}
    bad = f"{shapes}: each must be > 0 (SGLang's MLA draft class refuses a draft without q_lora_rank)"
    _check(out, "MLA shapes", all(shapes.values()), ", ".join(f"{k} {v}" for k, v in shapes.items()), bad)
    if not target.get("kv_lora_rank"):
        out.append(Check("MLA target", False, "an MLA draft layer on a target without MLA (no kv_lora_rank): "
                         "train with draft_attention gqa"))  # fmt: skip
        return out
    cache = ("kv_lora_rank", "qk_rope_head_dim")
    diff = [f"{n} {layer.get(n)} (target {target.get(n)})" for n in cache if layer.get(n) != target.get(n)]
    bad = f"{', '.join(diff)}: a latent cache unlike the target's (never served by us)"
    _check(
        out,
        "MLA cache = target's",
        not diff,
        "kv_lora_rank and qk_rope_head_dim as the target",
        bad,
        "warning",
    )
    return out


def check_aux_layers(fmt: str, cfg: dict, n_layers: int, trained: list[int] | None = None) -> list[Check]:
    """Aux layer ids: three, inside the target, each engine's key in its own convention, and (when known) the
    layers the drafter was trained on."""
    out: list[Check] = []
    ours = export.aux_layers_of(fmt, cfg) or models.default_aux_layers(n_layers)
    if trained is not None:
        bad = (
            f"the config makes the engine read layers {ours}, the drafter was trained on {list(trained)} "
            "(vLLM's top-level ids are HF hidden_states indices: decoder-layer output + 1)"
        )
        _check(out, "aux layers = trained", list(trained) == ours, f"{ours}", bad)
    ok = len(set(ours)) == 3 == len(ours) and all(0 <= a < n_layers for a in ours)
    good = f"{ours} (decoder-layer outputs, 0-based) < {n_layers} layers"
    bad = (
        f"{ours}: need 3 distinct ids in [0, {n_layers}) (0-based decoder-layer outputs; vLLM captures a "
        "repeated layer once and its fc then reads a narrower feature)"
    )
    _check(out, "aux layers", ok, good, bad)
    if fmt == "sglang" and ok:
        # SGLang takes the input of decoder layer id + 1 (hidden + residual) as layer id's output, inside its
        # loop over the layers: the last layer's output (id L-1) is never captured and fc gets 2 features
        bad = (
            f"{ours} holds the last decoder layer ({n_layers - 1}): SGLang captures a layer's output as the "
            "next layer's input and never captures the last one (fc would read 2 features); vLLM can "
            "serve it (the speculators export)"
        )
        _check(out, "aux layers (SGLang)", n_layers - 1 not in ours, "none is the last decoder layer", bad)
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if fmt == "sglang" and nested and top is None:
        msg = (
            f"only eagle_config ids {nested}: vLLM reads them as HF hidden_states indices, one layer earlier "
            f"than SGLang does; add the top-level eagle_aux_hidden_state_layer_ids {[a + 1 for a in nested]}"
        )
        out.append(Check("aux layers (vLLM)", False, msg, "warning"))
    elif fmt == "sglang" and nested and top is not None:
        bad = f"top-level {top} != eagle_config {nested} + 1: the two engines would read different layers"
        _check(out, "aux layers (vLLM)", list(top) == [a + 1 for a in nested], f"top-level {top}", bad)
    return out


def check_weights(tensors: dict[str, torch.Tensor], cfg: Eagle3Config, target: dict) -> list[Check]:
    """fc width, lm_head / vocab-map shapes, and the vocab map's range against the target vocab."""
    out: list[Check] = []
    th, tv = target["hidden_size"], target["vocab_size"]
    att = MLA_WEIGHTS if cfg.attention == "mla" else ["q_proj", "k_proj", "v_proj", "o_proj"]
    need = ["fc.weight", "lm_head.weight", "norm.weight", *(f"midlayer.self_attn.{w}.weight" for w in att)]
    missing = [k for k in need if k not in tensors]
    _check(out, "weights present", not missing, "fc, midlayer, norm, lm_head", f"missing {missing}")
    if missing:
        return out
    fc = tuple(tensors["fc.weight"].shape)
    bad = f"{list(fc)}, expected [{cfg.hidden_size}, {3 * th}] (3 x target hidden)"
    if fc[1] == th:
        bad += ": one layer wide, an EAGLE(-1) drafter or features from the final layer only"
    _check(out, "fc input = 3 x target hidden", fc == (cfg.hidden_size, 3 * th), f"{list(fc)}", bad)
    n = tensors["lm_head.weight"].shape[0]
    bad = f"{n} != draft_vocab_size {cfg.draft_vocab_size}"
    _check(out, "lm_head rows = draft_vocab_size", n == cfg.draft_vocab_size, f"{n}", bad)
    out += check_vocab_map(tensors.get("d2t"), tensors.get("t2d"), n, tv)
    # the norm flags and their weights: an engine drops input_norm.* silently when its flag is off, and runs a
    # flagged norm whose weight is missing at its initial ones (vLLM 0.32, SGLang 0.5.23)
    want = {"input_norm.weight"} if cfg.norm_before_fc else set()
    want |= {f"fc_norm.{i}.weight" for i in range(3)} if cfg.fc_norm else set()
    have = {k for k in tensors if k.startswith(("input_norm.", "fc_norm."))}
    bad = f"config flags need {sorted(want) or 'no norm weights'}, the weights hold {sorted(have) or 'none'}"
    _check(out, "norm weights = norm flags", want == have, ", ".join(sorted(want)) or "none", bad)
    return out


def check_vocab_map(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, n_draft: int, v_target: int
) -> list[Check]:
    """target_id = draft_id + d2t[draft_id]: every id inside the target vocab, increasing, agreeing with t2d."""
    out: list[Check] = []
    if d2t is None:
        bad = f"absent while the draft vocab ({n_draft}) is smaller than the target's ({v_target})"
        _check(out, "d2t", n_draft == v_target, "absent (draft vocab = full vocab)", bad)
        return out
    if n_draft == v_target:
        msg = "present with a full-size draft vocab: vLLM 0.32 refuses it (no draft_id_to_target_id); drop d2t/t2d"
        out.append(Check("d2t", False, msg))
    _check(out, "d2t length", len(d2t) == n_draft, f"{len(d2t)}", f"{len(d2t)} != draft vocab {n_draft}")
    out += [Check(rule, ok, found) for rule, ok, found in vocab.map_rules(d2t, t2d, v_target)]
    return out


def _flags(cmd: str) -> dict[str, str]:
    """--flag value / --flag=value pairs of a command line (bare flags map to "")."""
    toks, out = shlex.split(cmd), {}
    for i, t in enumerate(toks):
        if t.startswith("--"):
            key, eq, val = t.partition("=")
            nxt = toks[i + 1] if i + 1 < len(toks) else ""
            out[key] = val if eq else ("" if nxt.startswith("--") else nxt)
    return out


def check_sglang_cmd(cmd: str, drafter_dir: str, target: str) -> list[Check]:
    """The SGLang launch flags: EAGLE3 (not EAGLE), this drafter, this target, consistent step counts."""
    f, out = _flags(cmd), []
    algo = f.get("--speculative-algorithm", "")
    bad = f"{algo!r}: must be EAGLE3"
    if algo.upper() == "EAGLE":
        bad += " (EAGLE drops fc and the aux layers: features 1 x hidden wide, acceptance ~1.0)"
    _check(out, "sglang --speculative-algorithm", algo == "EAGLE3", "EAGLE3", bad)
    path = f.get("--speculative-draft-model-path", "")
    bad = f"{path!r} is not the checked drafter {drafter_dir}"
    _check(out, "sglang --speculative-draft-model-path", same_path(path, drafter_dir), path, bad, "warning")
    model = f.get("--model-path", f.get("--model", ""))
    bad = f"{model!r} != target {target}"
    _check(out, "sglang --model-path", same_path(model, target), model, bad, "warning")
    steps = int(f.get("--speculative-num-steps", 0) or 0)
    topk = int(f.get("--speculative-eagle-topk", 1) or 1)
    tokens = int(f.get("--speculative-num-draft-tokens", 0) or 0)
    if topk == 1:
        ok, good = tokens == steps + 1 and steps > 0, f"{steps} steps, {tokens} draft tokens"
        bad = f"{steps} steps with topk 1 needs --speculative-num-draft-tokens {steps + 1}, got {tokens}"
        _check(out, "sglang draft tokens = steps + 1", ok, good, bad, "warning")
    return out


def check_vllm_spec(spec: dict, drafter_dir: str) -> list[Check]:
    """vLLM's --speculative-config: method eagle3 (not eagle), this drafter, at least one token."""
    out: list[Check] = []
    method = spec.get("method")
    _check(
        out,
        "vllm method",
        method == "eagle3",
        "eagle3",
        f"{method!r}: must be 'eagle3' ('eagle' builds an EAGLE-1 head that cannot read this drafter)",
    )
    _check(
        out,
        "vllm model",
        same_path(str(spec.get("model", "")), drafter_dir),
        str(spec.get("model")),
        f"{spec.get('model')!r} is not the checked drafter {drafter_dir}",
        "warning",
    )
    n = spec.get("num_speculative_tokens", 0)
    _check(out, "vllm num_speculative_tokens", isinstance(n, int) and n >= 1, f"{n}", f"{n!r}: need >= 1")
    ds = spec.get("draft_sample_method", "greedy")
    _check(
        out,
        "vllm draft_sample_method",
        ds in ("greedy", "probabilistic")
        and (ds == "greedy" or spec.get("rejection_sample_method", "standard") == "standard"),
        ds,
        f"{ds!r} with rejection_sample_method {spec.get('rejection_sample_method')!r}: vLLM 0.32 knows greedy and "
        "probabilistic, and uses the draft's q only with rejection_sample_method 'standard'",
    )
    return out


def preflight(
    drafter_dir: str | Path,
    target: str,
    sglang_cmd: str = "",
    vllm_spec: dict | None = None,
    trust_remote_code: bool = False,
    target_config: dict | None = None,
    trained_aux: list[int] | None = None,
    trained_norms: dict | None = None,
    **launch,
) -> Preflight:
    """Run every check on an export directory (either format); commands default to the generated ones.

    trained_aux: the aux layers the drafter was trained on (decoder-layer outputs, 0-based), when known;
    trained_norms: its normalisation flags (`export.norm_flags` of its config), when known.
    """
    d = str(drafter_dir)
    try:
        fmt, cfg = export.read_config(d)
    except export.ExportError as e:
        return Preflight(d, "unknown", [Check("config.json", False, str(e))])
    rep = Preflight(d, fmt)
    tcfg = target_config or target_text_config(target, trust_remote_code, launch.get("revision") or None)
    rep.checks += check_config(fmt, cfg, tcfg, trained_aux, trained_norms)
    try:
        dcfg = export.drafter_config(fmt, cfg, models.default_aux_layers(tcfg["num_hidden_layers"]))
        rep.checks += check_weights(export.read_tensors(d, fmt), dcfg, tcfg)
    except (export.ExportError, KeyError, ValueError, OSError) as e:
        rep.checks.append(Check("weights", False, f"{type(e).__name__}: {e}"))
    served = models.resolve(target)  # toy:// worlds: the local directory the server loads
    rep.commands = commands.launch_commands(served, d, fmt, trust_remote_code=trust_remote_code, **launch)
    if fmt == "sglang":
        rep.checks += check_sglang_cmd(sglang_cmd or rep.commands["sglang"], d, served)
    elif sglang_cmd:
        msg = "SGLang cannot load a speculators-format drafter: serve the sglang export (LlamaForCausalLMEagle3)"
        rep.checks.append(Check("sglang format", False, msg))
    words = shlex.split(rep.commands["vllm"])
    gen_spec = json.loads(words[words.index("--speculative-config") + 1])
    rep.checks += check_vllm_spec(vllm_spec or gen_spec, d)
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eagle_lib.serving.preflight", description=__doc__.split("\n")[0]
    )
    p.add_argument("drafter_dir", help="an export directory (sglang or speculators format)")
    p.add_argument("--target", default="", help="target model dir, hub id, or its config.json")
    p.add_argument(
        "--params",
        default="",
        help="a params file: target, remote code, revision and 06's serving settings "
        "(steps, TP, API key variable) from it, as 06 prints them (flags given as well still apply)",
    )
    p.add_argument("--sglang-cmd", default="", help="the intended SGLang launch command line")
    p.add_argument("--vllm-spec", default="", help="the intended vLLM --speculative-config JSON")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--revision", default="", help="the target's hub commit (with --params: shared.revision)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size for the printed commands")
    p.add_argument("--aux-layers", default="", help="aux layers the drafter was trained on, e.g. 1,29,57")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--vllm-hidden", action="store_true", help="also check vLLM can stream the aux hidden states (05)"
    )
    p.add_argument(
        "--server", default="", help="a running server's base URL: check its live speculative config"
    )
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="the server's engine")
    p.add_argument("--num-steps", type=int, default=3, help="intended drafts per step (live check)")
    a = p.parse_args(argv)
    launch, tcfg = {"tp": a.tp, "revision": a.revision}, None
    if a.params:
        from eagle_lib import params

        run = params.load_params(a.params)
        a.target, a.trust_remote_code = (
            a.target or run.shared.target,
            a.trust_remote_code or run.shared.trust_remote_code,
        )
        # the pinned commit (refused unpinned with remote code, as every stage does) unless --revision names one
        a.revision = a.revision or models.hub_kwargs(run.shared)["revision"] or ""
        tcfg = target_text_config(a.target, a.trust_remote_code, a.revision)
        launch = commands.launch_kwargs(run.stage("06_eval_acceptance"), run.shared, tcfg) | {
            "revision": a.revision
        }
    if not a.target:
        p.error("--target or --params is required")
    rep = preflight(
        a.drafter_dir,
        a.target,
        a.sglang_cmd,
        json.loads(a.vllm_spec) if a.vllm_spec else None,
        a.trust_remote_code,
        target_config=tcfg,
        trained_aux=[int(x) for x in a.aux_layers.split(",")] if a.aux_layers else None,
        **launch,
    )
    if a.vllm_hidden:  # 05 hidden_source vllm: the target's vLLM class must output aux hidden states
        from eagle_lib.hidden_states import vllm_preflight

        aux = [int(x) for x in a.aux_layers.split(",")] if a.aux_layers else None
        rep.checks += [
            Check(**c) for c in vllm_preflight.check(a.target, aux, a.trust_remote_code, revision=a.revision)
        ]
    if a.server:
        from eagle_lib.serving import live

        rep.checks += live.check_server(a.engine, a.server, a.drafter_dir, a.num_steps)
    print(json.dumps(rep.to_dict(), indent=2) if a.json else rep.text())
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
