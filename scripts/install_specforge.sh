#!/usr/bin/env bash
# Separate venv with PyPI SpecForge 0.2.0 for benchmarks/specforge_side.py (SpecForge's EAGLE-3 trainer as a
# side of benchmarks/bench_quality.py). Idempotent.
#
#   bash scripts/install_specforge.sh            # venv: .venv-specforge (SPECFORGE_VENV overrides)
#
# What was learned installing it (2-core CPU box, torch 2.13.0+cpu from the local wheel, PyPI for the rest):
# * specforge 0.2.0 requires torch==2.11.0, transformers==5.8.1, sglang==0.5.14 (CUDA), yunchang, wandb,
#   tensorboard, datasets, accelerate, openai-harmony, ...: installed with --no-deps, and torch is pinned by a
#   constraint on every later pip call, so nothing can replace the local CPU torch. pip then prints "ERROR:
#   pip's dependency resolver ... specforge 0.2.0 requires ..., which is not installed": expected, harmless.
# * What the worker's path imports (the Llama EAGLE-3 draft model, OnlineEagle3Model's TTT unroll, the
#   Eagle3TrainStrategy loss, TargetHead, the SGLang export): torch, transformers (pinned 5.8.1, SpecForge's
#   own pin; its deps pull no torch), safetensors and huggingface-hub (both transformers deps). Nothing else.
# * Left out on purpose: triton (286 MB wheel): specforge.core.loss imports it at module level for a GPU-only
#   kernel; the worker routes the loss to SpecForge's pure-torch reference and gives that one import a
#   stand-in (see benchmarks/specforge_side.py). datasets (pyarrow, pandas...): imported only by
#   specforge.data.utils, whose padding collator the worker redoes. flash_attn: SpecForge falls back to
#   sdpa / flex attention with a warning.
# * Size 1.2 GB (torch ~750 MB, transformers ~100 MB); 64 s from nothing with no pip cache (measured).
# * SpecForge's AutoDraftModel.from_pretrained on transformers 5.8.1 leaves the draft's non-persistent RoPE
#   cos cache uninitialised (NaN logits); its exporter's way, from_config + load_state_dict, is fine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECFORGE_VENV:-$ROOT/.venv-specforge}"
PYTHON="${PYTHON:-python3.11}"
TORCH=2.13.0  # the same CPU build as .venv

check() {  # imports what benchmarks/specforge_side.py imports, through its triton stand-in; prints versions
    "$VENV/bin/python" - "$ROOT/benchmarks" <<'PY'
import sys
import warnings
from importlib.metadata import version  # specforge defines no __version__

warnings.filterwarnings("ignore", message="flash_attn is not found")
sys.path.insert(0, sys.argv[1])
import specforge_side  # noqa: E402
import torch, transformers, safetensors  # noqa: E402,F401

specforge_side._specforge()  # specforge.algorithms.eagle3.model, its loss on torch
import specforge.export.to_sglang, specforge.modeling.draft.llama3_eagle  # noqa: E402,F401
import specforge.modeling.target.target_head, specforge.training.strategies.base  # noqa: E402,F401
import specforge.training.model_loading, specforge.algorithms.eagle3.providers  # noqa: E402,F401

assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
print("specforge", version("specforge"), "torch", torch.__version__, "transformers", transformers.__version__,
      "safetensors", version("safetensors"))
PY
}

if [ -x "$VENV/bin/python" ] && check 2>/dev/null; then
    echo "specforge already installed in $VENV"
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIN="$(mktemp)"
trap 'rm -f "$PIN"' EXIT
echo "torch==$TORCH" >"$PIN"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$TORCH"  # first: the local CPU build
"$VENV/bin/python" -m pip install -q -c "$PIN" --no-deps specforge==0.2.0
"$VENV/bin/python" -m pip install -q -c "$PIN" transformers==5.8.1 safetensors huggingface-hub
check
