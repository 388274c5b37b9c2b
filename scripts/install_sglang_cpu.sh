#!/usr/bin/env bash
# Create the separate SGLang virtual environment used by tests/server/test_sglang_loader.py: SGLang's own
# EAGLE-3 class (sglang.srt.models.llama_eagle3) loads our SGLang-format export on CPU; no server is started.
#
#   bash scripts/install_sglang_cpu.sh            # idempotent: does nothing when .venv-sglang already works
#   SGLANG_VENV=/path PYTHON=python3.11 bash scripts/install_sglang_cpu.sh
#
# What we learned (sglang 0.5.23 on PyPI):
# - it pins torch==2.14.1 (CUDA) and ~80 GPU-only packages (flashinfer, sglang-kernel, deep-gemm, ...); none of
#   them is needed to import the model class, build it and run its load_weights on CPU, so sglang goes in with
#   --no-deps, after torch 2.13.0 (the CPU build these machines resolve), and then only the packages its import
#   chain needs, under a constraint that keeps torch at 2.13.0 (compressed-tensors and torchvision would
#   otherwise pull torch 2.14.1 and its 3 GB of CUDA wheels);
# - triton 3.8.0 is the one torch 2.14.1 (sglang's pin) asks for; on CPU it is only imported;
# - SGLang cannot serve on these CPUs: only construct the class and load weights.
# Measured on the 2-core CI machine: ~3 min from scratch, ~1.5 GB of disk.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="0.5.23"
TORCH_PIN="torch==2.13.0"
MARKER="$VENV/.installed-sglang-$SGLANG_VERSION"
# What `import sglang.srt.models.llama_eagle3` and the loader (tests/support/sglang_load.py) need on CPU; the
# versions are sglang 0.5.23's own pins where it has one, else the ones this was tested with.
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
)

check() {
    OMP_NUM_THREADS=1 "$VENV/bin/python" - "$SGLANG_VERSION" <<'EOF'
import sys
from importlib.metadata import version
assert version("sglang") == sys.argv[1], version("sglang")
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
import sglang.srt.models.llama_eagle3  # noqa: F401  (the class the loader test builds)
print("sglang", version("sglang"), "torch", torch.__version__)
EOF
}

if [ -f "$MARKER" ] && [ -x "$VENV/bin/python" ] && check >/dev/null 2>&1; then
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
