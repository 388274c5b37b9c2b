#!/usr/bin/env bash
# Create the virtual environment of SGLang's router (PyPI sglang-router, a Rust binary with a Python launcher),
# used by tests/server/test_sglang_router.py: 03 sends all its work to one router URL in front of the workers,
# as a user runs it in front of SGLang nodes:
#   .venv-router/bin/python -m sglang_router.launch_router --worker-urls http://node0:30000 http://node1:30000 \
#       --host 0.0.0.0 --port 30100 --policy cache_aware
#
#   bash scripts/install_sglang_router.sh          # idempotent: does nothing when .venv-router already works
#   ROUTER_VENV=/path PYTHON=python3.11 bash scripts/install_sglang_router.sh
# Measured here: 15 s, 144 MB (the wheel is abi3 manylinux x86_64; it needs no torch).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROUTER_VENV:-$ROOT/.venv-router}"
PYTHON="${PYTHON:-python3.11}"
VERSION="0.3.2"
MARKER="$VENV/.installed-sglang-router-$VERSION"

if [ -f "$MARKER" ] && "$VENV/bin/python" -m sglang_router.launch_router --help >/dev/null 2>&1; then
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "sglang-router==$VERSION"
"$VENV/bin/python" -m sglang_router.launch_router --help >/dev/null
touch "$MARKER"
echo "sglang-router $VERSION in $VENV"
