"""Target hidden states for training, from three sources behind one interface (docs/CONTRACTS.md).

A source is called on a `eagle_lib.data.batches.Batch` and returns ``(aux, logits)``: ``aux`` (B, T, 3H_t) the
concatenated outputs of the target's aux decoder layers at every position, ``logits`` (B, T, V) the target's
next-token logits there.

* `OnlineHidden`: runs the HF target; forward hooks capture only the aux layers (no hidden-state tuple).
  Packed rows restart ``position_ids`` per sequence; transformers then masks attention per sequence.
* `OfflineHidden`: reads engine dumps in speculators' format, one ``hs_{i}.safetensors`` per sample with
  ``token_ids`` [T] and ``hidden_states`` [T, 4, H] (3 aux layers + the last layer); logits come from the
  target's final norm and lm_head applied to the last layer (`TargetHead`, loaded alone from the target's
  safetensors). Dumps are matched to training sequences by their token ids.
* `eagle_lib.hidden_states.engine_hidden.VllmHidden` (``hidden_source: vllm``): vLLM prefill streamed through a
  bounded buffer; logits through `TargetHead` as for dumps.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from eagle_lib import models
from eagle_lib.data.batches import seq_key


def width_error(got: int, target_hidden: int, where: str) -> str:
    """The message for a feature whose width is not 3 x the target's hidden size."""
    msg = f"{where}: feature width {got}, expected 3 x target hidden = {3 * target_hidden}."
    if got == target_hidden:
        msg += (
            " Only the final layer was captured: the engine was likely started for EAGLE "
            "(--speculative-algorithm EAGLE) instead of EAGLE3, which captures the three aux layers."
        )
    elif got % 3 == 0:
        msg += f" It looks like 3 layers of a {got // 3}-wide model: is this dump from another target?"
    return msg


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's list of decoder layers (Llama-like, Deepseek/Kimi, multimodal wrappers)."""
    cfg = models.text_config(model.config)
    n = cfg.num_hidden_layers
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n and name.endswith("layers"):
            return mod
    raise ValueError(f"{type(model).__name__}: no ModuleList of {n} decoder layers found")


class LayerCapture:
    """The outputs of the aux decoder layers during one forward: ``with capture: model(...)``, then `take`.

    Hooks read each layer's own output, so the last layer (id L-1) comes before the final norm, as vLLM captures
    it; HF ``hidden_states[L]`` is after the norm and would hand a drafter trained here other features. The hooks
    live only inside the ``with``: several runners on one target never pile hooks onto it.
    """

    def __init__(self, model: nn.Module, aux_layers: list[int]):
        self.layers = decoder_layers(model)
        bad = [i for i in aux_layers if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"aux layers {bad} outside the target's {len(self.layers)} decoder layers")
        self.aux_layers = list(aux_layers)
        self._captured: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, i: int):
        def fn(_mod, _inp, out):
            self._captured[i] = out[0] if isinstance(out, tuple) else out

        return fn

    def __enter__(self) -> LayerCapture:
        self._captured.clear()
        self._handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in self.aux_layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> torch.Tensor:
        """The concatenated aux features (B, T, 3H_t) of the forward inside the last ``with``."""
        aux = torch.cat([self._captured[i] for i in self.aux_layers], dim=-1)
        self._captured.clear()
        return aux


class OnlineHidden:
    """Aux features and logits from an HF causal LM, capturing only the aux layers via hooks."""

    def __init__(self, model: nn.Module, aux_layers: list[int]):
        self.model = model
        self.capture = LayerCapture(model, aux_layers)
        self.aux_layers = self.capture.aux_layers

    @torch.no_grad()
    def __call__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        dev = next(self.model.parameters()).device
        with self.capture:
            out = self.model(
                input_ids=batch.input_ids.to(dev), position_ids=batch.position_ids.to(dev), use_cache=False
            )
        return self.capture.take(), out.logits  # (B, T, 3H_t), (B, T, V)

    def close(self) -> None:
        """The sources' common interface: nothing to release, no hook stays on the model between calls."""


class TargetHead(nn.Module):
    """The target's final RMSNorm + lm_head, to turn a dumped last-layer hidden into logits."""

    def __init__(self, norm_weight: torch.Tensor, lm_head: torch.Tensor, eps: float):
        super().__init__()
        self.norm_weight = nn.Parameter(norm_weight, requires_grad=False)
        self.lm_head = nn.Parameter(lm_head, requires_grad=False)
        self.eps = eps

    def forward(self, last: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, V) logits, or (B, T, len(cols)) of the vocabulary ids `cols` only (the draft vocab's)."""
        x = last.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (self.norm_weight.float() * x).to(self.lm_head.dtype)
        return x @ (self.lm_head if cols is None else self.lm_head[cols]).T


class HeadTarget:
    """The target's logits, never materialised whole: last hidden (B, T, H) through `TargetHead` only at the
    rows asked for (`eagle_lib.drafter.longseq`). Sources return one instead of (B, T, V) logits when their
    ``lazy_logits`` is set (05/07 with ``loss_chunk``)."""

    def __init__(self, last_hidden: torch.Tensor, head: TargetHead, argmax: torch.Tensor | None = None):
        self.last, self.head = last_hidden, head
        self.shape = (*last_hidden.shape[:2], head.lm_head.shape[0])
        self.argmax = argmax  # (B, T) the target's argmax over its whole vocab, when the source knows it

    def rows(self, bi: torch.Tensor, ti: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """(n, V) logits at rows (bi, ti), or (n, len(cols)) of the ids `cols` only."""
        return self.head(self.last[bi, ti][None], cols)[0]


def target_of(head: TargetHead, last: torch.Tensor, lazy: bool, argmax: torch.Tensor | None = None):
    """(B, T, V) logits of a last hidden (B, T, H), or the `HeadTarget` that makes them row by row (with the
    whole-vocab `argmax` when the source has it)."""
    return HeadTarget(last, head, argmax) if lazy else head(last)


@torch.no_grad()
def head_argmax(head: TargetHead, last: torch.Tensor, chunk: int) -> torch.Tensor:
    """(T,) argmax over the whole vocab of the logits of a last hidden (T, H), ``chunk`` rows at a time."""
    out = [head(last[i : i + chunk]).argmax(-1) for i in range(0, last.shape[0], max(1, chunk))]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=last.device)


class HubError(RuntimeError):
    """The hub could not be asked (auth, gated repo, network, offline cache miss): not the same as 'absent'."""


def _local_file(target: str, name: str, revision: str | None = None) -> Path | None:
    """The file `name` of a target directory or hub repo; None only when the hub says the repo has no such
    file (404). Every other failure (401 / gated, missing repo, timeout, DNS, an offline cache miss) raises
    HubError saying which: a user whose token expired must not read "no model.safetensors". `revision`: the
    pinned hub commit (`models.hub_kwargs`), so the shards are those of the commit whose code and config ran."""
    p = Path(target) / name
    if p.parent.is_dir():
        return p if p.exists() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(target, name, revision=revision or None))
    except LocalEntryNotFoundError as e:  # offline, or the hub unreachable, and not in the cache
        raise HubError(
            f"{target}/{name}: not in the local cache and the hub cannot be reached ({e})"
        ) from None
    except EntryNotFoundError:  # the hub answered: no such file in the repo
        return None
    except Exception as e:  # noqa: BLE001  (auth, gated, missing repo, network: all named as such)
        raise HubError(f"{target}/{name}: {type(e).__name__}: {e}") from None


def load_target_tensors(
    target: str, patterns: dict[str, list[str]], revision: str | None = None
) -> dict[str, torch.Tensor]:
    """Load only the named tensors of a target (dir or hub id) from its safetensors shards.

    ``patterns`` maps a wanted name to candidate key suffixes, e.g. {"lm_head": ["lm_head.weight"]};
    the first candidate found wins. Raises naming the target and the missing tensor.
    """
    from safetensors import safe_open

    index = _local_file(target, "model.safetensors.index.json", revision)
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        single = _local_file(target, "model.safetensors", revision)
        if single is None:
            raise FileNotFoundError(f"{target}: no model.safetensors(.index.json)")
        with safe_open(str(single), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    out = {}
    for want, suffixes in patterns.items():
        key = next((k for s in suffixes for k in sorted(weight_map) if k == s or k.endswith("." + s)), None)
        if key is None:
            raise KeyError(f"{target}: no tensor for {want} (looked for keys ending in {suffixes})")
        with safe_open(str(_local_file(target, weight_map[key], revision)), "pt") as f:
            out[want] = f.get_tensor(key)
    return out


def load_target_head(target: str, hf_config, revision: str | None = None) -> TargetHead:
    """TargetHead from the target's safetensors (final norm + lm_head only), at the pinned `revision`."""
    cfg = models.text_config(hf_config)
    head = ["lm_head.weight"]
    if getattr(cfg, "tie_word_embeddings", False):  # tied (SmolLM2, Llama-3.2-1B, Qwen2.5-0.5B): saved once
        head += ["model.embed_tokens.weight", "embed_tokens.weight"]
    t = load_target_tensors(target, {"norm": ["model.norm.weight"], "lm_head": head}, revision)
    return TargetHead(t["norm"], t["lm_head"], getattr(cfg, "rms_norm_eps", 1e-6))


def load_target_embedding(target: str, revision: str | None = None) -> torch.Tensor:
    """The target's input embedding (V, H) without loading the model, at the pinned `revision`."""
    names = {"embed": ["model.embed_tokens.weight", "embed_tokens.weight"]}
    return load_target_tensors(target, names, revision)["embed"]


class OfflineHidden:
    """Aux features + logits from speculators-format dumps (``hs_{i}.safetensors``) in ``dump_dir``."""

    def __init__(self, dump_dir: str | Path, head: TargetHead, target_hidden: int, device="cpu"):
        from safetensors import safe_open

        self.dir = Path(dump_dir)
        files = sorted(self.dir.glob("hs_*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.dir}: no hs_*.safetensors hidden-state dumps")
        self.head, self.h, self.device = head.to(device), target_hidden, device
        self.lazy_logits = False  # True: return a HeadTarget, not (B, T, V) logits
        self.index: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), "pt") as f:
                if "token_ids" not in f.keys() or "hidden_states" not in f.keys():
                    raise ValueError(
                        f"{path}: needs tensors token_ids and hidden_states (got {list(f.keys())})"
                    )
                self.index[seq_key(f.get_tensor("token_ids").numpy())] = path
        self._check(files[0])

    def _check(self, path: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            self.check_shape(tuple(f.get_slice("hidden_states").get_shape()), path)

    def check_shape(self, shape: tuple[int, ...], where) -> None:
        """A dump must be [T, 4, H_t]; otherwise raise naming the likely cause."""
        if len(shape) == 3 and shape[1:] == (4, self.h):
            return
        if len(shape) == 2 or (len(shape) == 3 and shape[1] == 1):
            width = shape[-1]
        else:
            width = shape[-1] * min(shape[1], 3) if len(shape) == 3 else -1
        if len(shape) == 3 and shape[1] == 3 and shape[2] == self.h or width == 3 * self.h:
            raise ValueError(
                f"{where}: hidden_states {list(shape)} has the 3 aux layers but not the last layer, "
                "which the target distribution needs: dump [T, 4, H] (3 aux + last)"
            )
        raise ValueError(width_error(width, self.h, f"{where}: hidden_states {list(shape)}"))

    def split(self, hs: torch.Tensor, where) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 4, H] dump -> aux (T, 3H), last (T, H)."""
        self.check_shape(tuple(hs.shape), where)
        return hs[:, :3].reshape(hs.shape[0], 3 * self.h), hs[:, 3]

    def has(self, ids) -> bool:
        return seq_key(ids) in self.index

    @torch.no_grad()
    def __call__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors.torch import load_file

        b, t = batch.input_ids.shape
        aux = torch.zeros(b, t, 3 * self.h)
        last = torch.zeros(b, t, self.h)
        for row, segs in enumerate(batch.segments):
            for key, start, length in segs:
                path = self.index.get(key)
                if path is None:
                    raise KeyError(f"{self.dir}: no dump for a training sequence of {length} tokens")
                a, l_ = self.split(load_file(str(path))["hidden_states"].float(), path)
                aux[row, start : start + length] = a[:length]
                last[row, start : start + length] = l_[:length]
        return aux.to(self.device), target_of(self.head, last.to(self.device), self.lazy_logits)
