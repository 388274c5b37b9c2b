"""Load an EAGLE / SGLang-format drafter export with SGLang's own loader, on CPU, and dump what it loaded.

Run with the SGLang venv's interpreter (scripts/install_sglang_cpu.sh), never the project's:

    .venv-sglang/bin/python tests/support/sglang_load.py --export DIR --out FILE [--dtype auto|float32|...]

It imports nothing from eagle_lib. Steps, as an SGLang server's draft worker takes them (sglang 0.5.23):

1. a single-process gloo world (torch.distributed, world size 1) and SGLang's model-parallel groups, after
   publishing a ServerArgs for a CPU EAGLE3 run (SGLang's layers read their TP rank / size and the spec
   settings from that published context);
2. ``ModelConfig.from_server_args(server_args, model_path=DIR, is_draft_model=True)`` (as the scheduler
   builds the draft's config from ``--speculative-draft-model-path``) and SGLang's ``get_model``
   (DefaultModelLoader, load format ``auto``, device ``cpu``): it resolves the class from
   ``architectures`` (``LlamaForCausalLMEagle3``), constructs it with ``config`` / ``quant_config`` under
   the model dtype, and feeds DIR's safetensors, through SGLang's own weight iterator, to the class's
   ``load_weights`` (which silently drops names it does not know);
3. writes every parameter and buffer of the loaded model (name -> tensor, in its loaded dtype) to FILE
   (safetensors), plus ``hot_token_id`` (what ``load_weights`` makes of ``d2t``: a plain attribute, no
   parameter) under the key ``hot_token_id`` when set; and FILE with suffix ``.json``:
   ``{"given": [names load_weights was given, in order], "dtype": ..., "class": ...,
   "params": [parameter names], "buffers": [buffer names], "modules": {module: {attribute: value}}}``
   (``modules``: what SGLang's modules took from config.json: norm eps, rope, fc width, vocab sizes).

Two adjustments for these CPUs, neither touching a weight or a weight loader: ``define_torchvision_ops``
(PyPI's torchvision cannot load its C++ ops beside the CPU torch) and ``rope_without_kernel`` (SGLang's CPU
engine needs a kernel build PyPI lacks), and ``mla_rope_as_on_gpu`` (an MLA layer's plain rope is built as
on a GPU server: SGLang's CPU branch knows DeepSeek YaRN only). No forward pass is run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path


def define_torchvision_ops() -> None:
    """Declare the two torchvision ops its Python package registers fakes for at import.

    sglang.srt.configs imports torchvision (internvl_utils, for image transforms), and PyPI's torchvision is a
    CUDA build whose C++ ops cannot load next to the CPU torch: ``import torchvision`` then fails in
    ``_meta_registrations`` on ``torchvision::nms`` / ``qnms``, which it expects the C++ library to define.
    Declaring their schemas lets the pure-Python package import; nothing here runs a torchvision op.
    """
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018  (the C++ ops did load: nothing to do)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    define_torchvision_ops.lib = lib  # keep the registrations alive


def rope_without_kernel() -> None:
    """Let SGLang's RotaryEmbedding be constructed without a rope kernel.

    SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) needs sgl_kernel's CPU build, which PyPI does not carry
    (its import chain reaches ``from sgl_kernel import ...`` in sglang.kernels.ops.kvcache). Without that
    switch SGLang takes this machine for a non-CUDA GPU build, and RotaryEmbedding.__init__ imports
    ``vllm._custom_ops.rotary_embedding`` as its fallback kernel. Telling that one module it runs on CPU
    makes it keep its native torch rope instead: it changes no parameter, buffer or weight loader (the
    cos/sin cache is computed the same way), and no forward is run here.
    """
    from sglang.srt.layers.rotary_embedding import base

    base._is_cpu = True


def mla_rope_as_on_gpu() -> None:
    """Build an MLA draft layer's rope as SGLang's GPU servers do (``get_rope``), not through its CPU-engine branch.

    ``DeepseekV2AttentionMLA`` asks ``get_rope_wrapper`` for its rotary embedding; on a CPU device that routes to
    ``get_rope_cpu``, which only knows DeepSeek's YaRN (it asserts a ``rope_scaling``), while the GPU branch
    builds the plain rope the config names (``rope_scaling: null``: our MLA drafter's, as trained). The draft's
    servers are GPUs; this makes the CPU load take their branch. It touches no parameter, weight or loader.
    """
    from sglang.srt.layers.rotary_embedding import factory
    from sglang.srt.models import deepseek_v2

    def gpu_branch(*args, device=None, **kwargs):
        return factory.get_rope(*args, **kwargs)

    deepseek_v2.get_rope_wrapper = gpu_branch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(export: str, dtype: str):
    """gloo world of one + SGLang's parallel state, with a CPU EAGLE3 ServerArgs published; returns it."""
    import torch
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    server_args = ServerArgs(
        model_path=export,  # the target's path in a real launch; only the draft is built here
        device="cpu",
        dtype=dtype,
        tp_size=1,
        pp_size=1,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=export,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    parallel_state.init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        backend="gloo",
    )
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")
    assert torch.distributed.get_world_size() == 1
    return server_args


def load(server_args, export: str):
    """(model, names given to load_weights, model config) via SGLang's ModelConfig + get_model, on CPU."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model
    from sglang.srt.model_loader.utils import get_model_architecture

    # as the scheduler builds the draft's config from --speculative-draft-model-path
    model_config = ModelConfig.from_server_args(server_args, model_path=export, is_draft_model=True)
    cls, _ = get_model_architecture(model_config)
    given: list[str] = []
    original = cls.load_weights

    def recording_load_weights(self, weights):
        def tee():
            for name, tensor in weights:
                given.append(name)
                yield name, tensor

        return original(self, tee())

    cls.load_weights = recording_load_weights
    try:
        model = get_model(
            model_config=model_config,
            load_config=LoadConfig(load_format=server_args.load_format, tp_rank=0),
            device_config=DeviceConfig("cpu"),
        )
    finally:
        cls.load_weights = original
    return model, given, model_config


# Attributes SGLang's modules keep from config.json that decide what the weights mean (the test checks them
# against the drafter's config): norm eps, rope, the fc input width and the vocab sizes of the padded heads.
FACTS = (
    "variance_epsilon",
    "base",
    "rotary_dim",
    "head_size",
    "max_position_embeddings",
    "is_neox_style",
    "num_aux_hidden_states",
    "hidden_size_in",
    "org_vocab_size",
    "num_embeddings",
    "num_embeddings_padded",
    "norm_before_fc",
    "norm_output",
)


def module_facts(model) -> dict:
    """{module name: {attribute: value}} for the FACTS attributes a module has (JSON-able values only)."""
    out = {}
    for name, mod in model.named_modules():
        facts = {
            a: getattr(mod, a)
            for a in FACTS
            if isinstance(getattr(mod, a, None), bool | int | float | str) and a in vars(mod)
        }
        if facts:
            out[name or "."] = {"type": type(mod).__name__, **facts}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--export", required=True, help="SGLang-format export directory (config.json + safetensors)"
    )
    ap.add_argument("--out", required=True, help="safetensors file for the loaded model's tensors")
    ap.add_argument(
        "--dtype", default="auto", help="SGLang's --dtype (auto: float32 configs load as float16)"
    )
    args = ap.parse_args(argv)

    define_torchvision_ops()
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    rope_without_kernel()
    mla_rope_as_on_gpu()
    server_args = init_single_process(args.export, args.dtype)
    model, given, model_config = load(server_args, args.export)

    tensors = {}
    params = [n for n, _ in model.named_parameters()]
    buffers = [n for n, _ in model.named_buffers()]
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        tensors[name] = t.detach().cpu().contiguous()
    hot = getattr(model, "hot_token_id", None)
    if hot is not None:
        tensors["hot_token_id"] = hot.detach().cpu().contiguous()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    side = {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "given": given,
        "params": params,
        "buffers": buffers,
        "hot_token_id": hot is not None,
        "modules": module_facts(model),
    }
    out.with_suffix(".json").write_text(json.dumps(side, indent=2) + "\n")
    print(f"loaded {len(given)} checkpoint tensors into {side['class']} ({side['dtype']}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
