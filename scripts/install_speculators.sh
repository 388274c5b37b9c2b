#!/usr/bin/env bash
# Separate venv with PyPI speculators 0.9.0 for benchmarks/bench_train.py (it pins another transformers than
# the project's .venv). Idempotent.
#
#   bash scripts/install_speculators.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECULATORS_VENV:-$ROOT/.venv-speculators}"
PYTHON="${PYTHON:-python3.11}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import speculators, torch" 2>/dev/null; then
    echo "speculators already installed in $VENV"
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0  # the same CPU build as .venv
"$VENV/bin/python" -m pip install -q speculators==0.9.0 transformers==5.19.0 hs-connectors==0.9.0 --no-deps
"$VENV/bin/python" -m pip install -q pydantic pydantic-settings loguru openai datasets rich typer psutil safetensors \
    tokenizers huggingface-hub numpy pyyaml tqdm regex
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version  # speculators defines no __version__

import speculators, torch, transformers  # noqa: F401  (imports must work, not only the metadata)

print("speculators", version("speculators"), "torch", torch.__version__, "transformers", transformers.__version__)
PY
