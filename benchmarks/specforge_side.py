"""SpecForge 0.2.0's EAGLE-3 trainer as one side of the equal-budget quality benchmark (bench_quality.py).

    .venv-specforge/bin/python benchmarks/specforge_side.py SPEC_JSON   (scripts/install_specforge.sh)

Reads the spec bench_quality.py writes for its speculators worker (target, aux_layers, intermediate_size, k,
decay, lr, betas, weight_decay, warmup, min_lr_ratio, grad_clip, seed, vocab_map, steps, out, attention;
optional: ``export_dtype`` float32 (default) or bfloat16, ``compile`` false (default) or true; ``features``: the
run's kept hidden states (benchmarks/stored_features.py; steps entries then end in each sequence's key), read
instead of running the target, its final norm applied to the last layer; ``save_at``: steps after which the
draft is exported to ``out/step_<n>``, the result then written to ``out/result.json``) and trains
SpecForge's own draft model with SpecForge's own TTT forward and loss, one optimizer step per ``steps`` entry,
then saves it in the SGLang / EAGLE layout that ``eagle_lib.drafter.export.load_export`` reads. Imports
nothing from eagle_lib. The last line on stdout is one JSON object: train_s (the step loop, target forward
included), final_loss, out, losses (the loss of every step) and label_losses (the same per supervised
position: SpecForge averages over every position of the padded batch, so its loss moves with the share of
label tokens in a step).

What of SpecForge runs here (all of it called, none copied):

* draft config: ``specforge.training.model_loading._generate_draft_config`` with the EAGLE-3 provider
  (``specforge.algorithms.eagle3.providers``), as SpecForge's launcher derives it from the target when no
  draft config is given; then draft_vocab_size = len(d2t) and the spec's intermediate_size.
* draft model: ``specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3`` (one decoder layer, built by
  ``specforge.modeling.auto.AutoDraftModel.from_config``), ``load_vocab_mapping``, ``load_embedding`` from the
  target + ``freeze_embedding``.
* data: ``specforge.algorithms.eagle3.data.normalize_offline_sample`` per sequence (SpecForge's offline
  EAGLE-3 sample: aux features, the target's last hidden state, loss_mask with its last position cleared), and
  ``specforge.modeling.target.target_head.TargetHead`` (its ``preprocess`` shifts input_ids / target one
  position left; its fc is the target lm_head) through the strategy, as SpecForge's offline mode does.
* forward + loss: ``specforge.training.strategies.base.Eagle3TrainStrategy(OnlineEagle3Model(draft, length=k),
  ploss_decay=decay).forward_loss`` on a ``specforge.runtime.contracts.TrainBatch`` (target_repr
  "hidden_state"): the TTT unroll of ``specforge.algorithms.eagle3.model.OnlineEagle3Model.forward`` and the
  weighted sum of its per-step losses.
* save: the pieces of ``specforge.export.to_sglang.export_to_sglang`` (``_serving_state`` checks the SGLang
  key set, ``save_pretrained``, ``apply_legacy_rope_scaling``) on the trained float32 model; with export_dtype
  bfloat16, ``export_to_sglang`` itself on a ``training_state.pt`` in SpecForge's checkpoint layout (it
  materialises the draft in bfloat16, as SpecForge's ``specforge export --to sglang`` ships drafts).

Adaptations, each forced by this machine or by the benchmark:

* SpecForge's KL loss in the TTT unroll is ``specforge.core.loss.LogSoftmaxLoss``, a Triton kernel (GPU only).
  It is replaced, in ``specforge.algorithms.eagle3.model``'s namespace, by
  ``specforge.core.loss._compute_loss``, SpecForge's own pure-torch reference of the same quantity (mean over
  batch x positions of -sum_v p_target * log_softmax(draft logits), masked by position_mask); autograd gives
  the kernel's gradient. ``specforge.core.loss`` imports triton at module level: where triton is not installed
  (the venv leaves it out, 286 MB), a stand-in module exists only while that import runs, and no kernel is
  ever launched.
* Data collation: SpecForge's ``DataCollatorWithPadding`` lives in ``specforge.data.utils``, which imports the
  ``datasets`` package; its padding (right, zeros, every tensor to the longest row) is redone in ``_collate``.
* lm_head starts from the target lm_head rows of the draft vocab (SpecForge starts it random), as both other
  sides do. The embedding is frozen (SpecForge's default too).
* Config keys added before saving (SpecForge's exporter writes none): ``eagle_config.
  eagle_aux_hidden_state_layer_ids`` = aux_layers (SGLang's convention, which SpecForge's own
  ``resolve_eagle_capture_layers`` reads back) and top-level ``eagle_aux_hidden_state_layer_ids`` = aux_layers
  + 1 (vLLM's HF hidden_states indices), as eagle_lib's sglang export writes them. No norm flag is written:
  SpecForge's ``norm_output`` (default True: lm_head(norm(h)), h fed back) is the original layer, which is
  what a missing flag means to eagle_lib's reader and the engines; SpecForge's own key would mean the opposite
  there.
* float32 on CPU throughout (SpecForge trains in bfloat16 on GPU), and eager: SpecForge decorates its RMSNorm,
  RoPE, target softmax and loss with ``torch.compile``, which on CPU adds 35-50 s of compiling to a 20-step
  toy run (6-9x its steps) for the same losses; ``"compile": true`` in the spec turns it back on.

SpecForge's objective, as its code has it (not the speculators side's): per TTT step i (0-based), a soft
cross-entropy against the target distribution renormalised over the draft vocab (softmax of the target logits'
t2d columns), at positions whose loss_mask is set and whose target argmax is in the draft vocab, averaged over
every (row, position) of the padded batch, not over the supervised ones; the step losses summed with weight
decay**i. Position t (features of t, token t+1, predicting token t+2) is supervised by loss_mask[t]: token t+2
is trained iff token t is a label (eagle_lib: iff token t+2 is; the speculators side: iff token t+1 is), and
each sequence's last position is dropped (``normalize_offline_sample``).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import types
from pathlib import Path

ATTENTION = ("sdpa", "flex_attention")  # SpecForge's backends that run without flash-attn / a process group


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """bench_quality.lr_factor (stage 05's schedule): linear warmup, cosine to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def _import_loss_without_triton() -> None:
    """Import specforge.core.loss; without triton, under a stand-in that exists only during the import."""
    import torch.utils._triton as tt

    if importlib.util.find_spec("triton") is not None:
        import specforge.core.loss  # noqa: F401

        return
    import torch

    # what torch looks up about triton, and imports for a torch.compile decorator (specforge.core.loss applies
    # two), is settled before the stand-in appears: torch sees no triton
    tt.has_triton_package()
    torch.compile(lambda x: x, dynamic=None)

    class Kernel:  # what @triton.jit returns: kernel[grid](...) launches, which cannot happen here
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, _grid):
            raise RuntimeError(
                f"SpecForge Triton kernel {self.fn.__name__} launched; triton is not installed"
            )

    def jit(fn=None, **_kw):
        return Kernel(fn) if fn is not None else Kernel

    triton = types.ModuleType("triton")
    tl = types.ModuleType("triton.language")
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    tl.__spec__ = importlib.machinery.ModuleSpec("triton.language", None)
    tl.constexpr = int  # only read as an annotation at def time
    triton.language, triton.jit = tl, jit
    triton.next_power_of_2 = lambda n: 1 << max(0, n - 1).bit_length()
    sys.modules.update({"triton": triton, "triton.language": tl})
    try:
        import specforge.core.loss  # noqa: F401
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]


def _specforge():
    """SpecForge's EAGLE-3 modules, its Triton loss routed to its pure-torch reference."""
    _import_loss_without_triton()
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core import loss as sf_loss

    class TorchLogSoftmaxLoss:  # LogSoftmaxLoss.apply(logits, target_p, position_mask), in torch
        apply = staticmethod(sf_loss._compute_loss)

    eagle3_model.LogSoftmaxLoss = TorchLogSoftmaxLoss
    return eagle3_model


def _target_features(target, aux_layers: list[int], ids: list[int]):
    """(aux (T, 3H) = outputs of decoder layers aux_layers, last (T, H) = the final norm's output, the lm_head
    input: what SpecForge's offline capture stores as hidden_state)."""
    import torch

    layers, got = target.model.layers, {}
    mods = {i: layers[i] for i in set(aux_layers)} | {"norm": target.model.norm}
    hooks = [
        m.register_forward_hook(
            lambda _m, _i, out, k=k: got.__setitem__(k, out[0] if isinstance(out, tuple) else out)
        )
        for k, m in mods.items()
    ]
    try:
        with torch.no_grad():
            target.model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[i][0] for i in aux_layers], -1), got["norm"][0]


def _collate(samples: list[dict]) -> dict:
    """specforge.data.utils.DataCollatorWithPadding (sequence parallel 1): every tensor right-padded with
    zeros to the longest row, rows concatenated."""
    import torch

    n = max(s["input_ids"].shape[1] for s in samples)

    def pad(t):
        return torch.cat([t, t.new_zeros(t.shape[0], n - t.shape[1], *t.shape[2:])], dim=1)

    return {k: torch.cat([pad(s[k]) for s in samples]) for k in samples[0]}


def _micro_batch(target, aux_layers, sequences, normalize, feats=None) -> dict:
    """One optimizer step's sequences as SpecForge's offline EAGLE-3 batch: one row per sequence, padded.
    Hidden states from the target, or (`feats`, real-model mode) the run's kept ones with the target's final
    norm applied to the last layer (SpecForge's capture stores the lm_head input)."""
    import torch

    samples = []
    for ids, mask, *key in sequences:
        if feats is not None:
            aux, last = feats(key[0], len(ids))
            with torch.no_grad():
                last = target.model.norm(last[None])[0]
        else:
            aux, last = _target_features(target, aux_layers, ids)
        raw = {
            "aux_hidden_state": aux[None],
            "hidden_state": last[None],
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "loss_mask": torch.tensor(mask, dtype=torch.long),
        }
        samples.append(normalize(raw, max_len=len(ids)))
    return _collate(samples)


def _draft_config(spec: dict, n_draft: int):
    from types import SimpleNamespace as NS

    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.training.model_loading import _generate_draft_config
    from transformers import AutoConfig

    provider = algorithm_providers().model.draft_config
    cfg = _generate_draft_config(
        NS(model=NS(target_model_path=spec["target"], cache_dir=None, trust_remote_code=False)), provider
    )
    cfg.draft_vocab_size = n_draft
    cfg.intermediate_size = spec.get("intermediate_size") or cfg.intermediate_size
    tgt = AutoConfig.from_pretrained(spec["target"])
    tgt_theta = (getattr(tgt, "rope_parameters", None) or {}).get("rope_theta") or getattr(
        tgt, "rope_theta", None
    )
    if tgt_theta is not None and cfg.rope_parameters["rope_theta"] != tgt_theta:
        raise ValueError(f"draft rope_theta {cfg.rope_parameters['rope_theta']} != the target's {tgt_theta}")
    aux = list(spec["aux_layers"])
    # read back by SGLang / SpecForge (eagle_config, decoder-layer outputs) and vLLM (top level, ids + 1)
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    cfg.eagle_aux_hidden_state_layer_ids = [i + 1 for i in aux]
    return cfg


def _check_vocab_map(d2t, t2d) -> None:
    """SpecForge selects target columns with t2d (ascending ids) against lm_head rows: the map must keep the
    target's order."""
    import torch

    ids = d2t + torch.arange(len(d2t))
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("vocab map: d2t + arange(N) is not strictly increasing")
    if not torch.equal(t2d.nonzero().flatten(), ids):
        raise ValueError("vocab map: t2d does not mark exactly the target ids d2t + arange(N)")


def _save(draft, out: Path, dtype: str) -> None:
    """SpecForge's SGLang export of the trained draft (see the module docstring)."""
    import torch
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.export.to_sglang import WEIGHT_MAPS, _serving_state, export_to_sglang

    out.mkdir(parents=True, exist_ok=True)
    if dtype == "float32":
        state = {k: v for k, v in draft.state_dict().items() if "embed" not in k.lower()}
        weight_map = WEIGHT_MAPS.get(type(draft).__name__, {})
        draft.save_pretrained(str(out), state_dict=_serving_state(state, weight_map))
        apply_legacy_rope_scaling(str(out))
        return
    if dtype != "bfloat16":
        raise ValueError(f"export_dtype {dtype!r}: float32 or bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        state = {k: v for k, v in draft.state_dict().items() if "embed" not in k.lower()}
        torch.save({"draft_state_dict": state, "strategy": "eagle3"}, Path(tmp) / "training_state.pt")
        draft.config.to_json_file(str(Path(tmp) / "draft_config.json"))
        export_to_sglang(tmp, str(Path(tmp) / "draft_config.json"), str(out))


def worker_specforge(spec_path: str) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    # SpecForge wraps its RMSNorm, RoPE and loss in torch.compile; on this CPU that costs 35-50 s of compiling
    # for a 20-step run (4x the steps themselves) and changes no number: eager unless the spec says compile
    torch._dynamo.config.disable = not spec.get("compile", False)
    attention = spec.get("attention", "sdpa")
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}: SpecForge's EAGLE-3 backends on CPU are {ATTENTION}")
    eagle3_model = _specforge()
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    torch.manual_seed(spec["seed"])
    vmap = load_file(spec["vocab_map"])
    d2t, t2d = vmap["d2t"].long(), vmap["t2d"].bool()
    _check_vocab_map(d2t, t2d)
    target = AutoModelForCausalLM.from_pretrained(spec["target"], dtype=torch.float32).eval()
    target.requires_grad_(False)

    draft = AutoDraftModel.from_config(
        _draft_config(spec, len(d2t)), attention_backend=attention, torch_dtype=torch.float32
    )
    with tempfile.TemporaryDirectory() as tmp:  # SpecForge's loader reads a torch.save'd {t2d, d2t}
        torch.save({"t2d": t2d, "d2t": d2t}, Path(tmp) / "vocab_mapping.pt")
        draft.load_vocab_mapping(str(Path(tmp) / "vocab_mapping.pt"))
    draft.load_embedding(spec["target"], embedding_key="model.embed_tokens.weight")
    draft.freeze_embedding()
    lm_head = target.get_output_embeddings().weight.detach()
    with torch.no_grad():
        draft.lm_head.weight.copy_(lm_head[torch.arange(len(d2t)) + d2t])

    model = eagle3_model.OnlineEagle3Model(draft_model=draft, length=spec["k"], attention_backend=attention)
    head = TargetHead(spec["target"])  # its fc = the target lm_head, float32 (from_pretrained casts to bf16)
    with torch.no_grad():
        head.fc.weight.copy_(lm_head)
    head.freeze_weights()
    head.eval()
    strategy = Eagle3TrainStrategy(model, target_head=head, ploss_decay=spec["decay"])

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        trainable, lr=spec["lr"], betas=tuple(spec["betas"]), weight_decay=spec["weight_decay"]
    )
    total = len(spec["steps"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, spec["warmup"], total, spec["min_lr_ratio"])
    )
    model.train()
    losses, label_losses, train_s = [], [], 0.0
    save_at = set(spec.get("save_at", []))  # the steps-to-quality points (real-model mode)
    feats = None
    if spec.get("features"):  # real-model mode: the run's kept hidden states, the same for every side
        from stored_features import StoredFeatures

        feats = StoredFeatures(spec["features"])
    for m, sequences in enumerate(spec["steps"]):
        t0 = time.perf_counter()
        tensors = _micro_batch(target, spec["aux_layers"], sequences, normalize_offline_sample, feats)
        batch = TrainBatch(
            sample_ids=[f"{m}-{i}" for i in range(len(sequences))],
            strategy="eagle3",
            tensors=tensors,
            metadata={"target_repr": "hidden_state"},
        )
        step = strategy.forward_loss(batch)
        step.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, spec["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        train_s += time.perf_counter() - t0
        losses.append(float(step.loss.detach()))
        # SpecForge's loss is a mean over every (row, position), masked or not; per supervised position:
        label_losses.append(
            losses[-1] * tensors["loss_mask"].numel() / max(1, int(tensors["loss_mask"].sum()))
        )
        acc = [round(float(a), 3) for a in step.metrics["acces"]]
        print(
            f"step {m + 1}/{total} loss {losses[-1]:.4f} per label {label_losses[-1]:.4f} acc {acc} "
            f"{time.perf_counter() - t0:.2f} s",
            file=sys.stderr,
            flush=True,
        )
        if m + 1 in save_at:
            _save(draft, Path(spec["out"]) / f"step_{m + 1}", spec.get("export_dtype", "float32"))
    out = {
        "train_s": train_s,
        "final_loss": losses[-1] if losses else None,
        "out": spec["out"],
        "losses": losses,
        "label_losses": label_losses,
    }
    if save_at:
        (Path(spec["out"]) / "result.json").write_text(json.dumps(out))
    else:
        _save(draft, Path(spec["out"]), spec.get("export_dtype", "float32"))
    return out


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} SPEC_JSON")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    print(json.dumps(worker_specforge(sys.argv[1])))


if __name__ == "__main__":
    main()
