#!/usr/bin/env bash
# Create the separate SGLang virtual environment used by tests/server/test_sglang_loader.py: SGLang's own
# EAGLE-3 class (sglang.srt.models.llama_eagle3) loads our SGLang-format export on CPU; no server is started
# (SGLang cannot serve on these CPUs).
#
#   bash scripts/install_sglang_cpu.sh            # idempotent: does nothing when .venv-sglang already works
#   SGLANG_VENV=/path PYTHON=python3.11 bash scripts/install_sglang_cpu.sh
#
# What we learned (sglang 0.5.23 on PyPI):
# - it pins torch==2.14.1 (CUDA) and ~80 GPU-only packages (flashinfer, sglang-kernel, deep-gemm, ...); none
#   of them is needed to import the model class, build it and run its load_weights on CPU. So: torch 2.13.0
#   first (the CPU build these machines resolve), sglang with --no-deps, then only what its import chain and
#   tests/support/sglang_load.py need, under a constraint that keeps torch at 2.13.0 (compressed-tensors and
#   torchvision would otherwise pull torch 2.14.1 and its 3 GB of CUDA wheels);
# - triton 3.8.0 is the one torch 2.14.1 (sglang's pin) asks for; on CPU it is only imported;
# - sglang.srt.configs imports torchvision, and PyPI's torchvision is a CUDA build: its C++ ops cannot load
#   beside the CPU torch, and `import torchvision` then fails unless the schemas of torchvision::nms / qnms
#   are declared first (the check below and sglang_load.py do; no torchvision op ever runs);
# - SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) needs sgl_kernel's CPU build, which PyPI does not carry: the
#   loader runs SGLang's generic path instead (see tests/support/sglang_load.py).
# Measured on the 2-core CI machine (shared): 3 min 19 s from scratch, 2.4 GB of disk (triton 0.9 GB, torch
# 0.75 GB, sglang 0.2 GB); a re-run with the marker present takes ~1 s.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="0.5.23"
TORCH_PIN="torch==2.13.0"
MARKER="$VENV/.installed-sglang-$SGLANG_VERSION"
# What `import sglang.srt.models.llama_eagle3`, SGLang's ModelConfig / get_model and its weight iterator need
# on CPU; sglang 0.5.23's own pins where it has one, else the versions this was tested with.
DEPS=(
    triton==3.8.0
    transformers==5.19.0
    tokenizers==0.23.2
    safetensors==0.8.0
    numpy==2.4.6
    orjson==3.13.0
    psutil==7.2.2
    pybase64==1.5.1
    requests==2.34.2
    pillow==13.0.0
    starlette==1.10.0
    fastapi==0.165.0
    uvicorn==0.54.0
    msgspec==0.23.0
    pyzmq==27.3.0
    ipython==9.18.1
    aiohttp==3.14.5
    torchvision==0.28.0
    dill==0.4.1
    apache-tvm-ffi==0.1.11
    sentencepiece==0.2.1
    compressed-tensors==0.18.0
    gguf==0.19.0
    openai==2.8.0
    partial-json-parser==0.2.1.1.post7
    einops==0.8.2
)

check() {
    OMP_NUM_THREADS=1 "$VENV/bin/python" - "$SGLANG_VERSION" <<'EOF'
import sys
from importlib.metadata import version
assert version("sglang") == sys.argv[1], version("sglang")
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
lib = torch.library.Library("torchvision", "DEF")  # PyPI torchvision's C++ ops cannot load: see above
lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import sglang.srt.models.llama_eagle3  # noqa: F401  (the class tests/support/sglang_load.py builds)
print("sglang", version("sglang"), "torch", torch.__version__)
EOF
}

# The marker is written only after a full check passed; then only the versions are re-read (no sglang import).
if [ -f "$MARKER" ] && [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$SGLANG_VERSION" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
assert version("sglang") == sys.argv[1] and version("torch").startswith("2.13.0")
EOF
    echo "SGLang $SGLANG_VERSION already installed in $VENV"
    exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH_PIN"
"$VENV/bin/python" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
CONSTRAINT="$VENV/torch-constraint.txt"
echo "$TORCH_PIN" >"$CONSTRAINT"
"$VENV/bin/python" -m pip install -q -c "$CONSTRAINT" "${DEPS[@]}"
check
touch "$MARKER"
