#!/usr/bin/env bash
# Compiler launcher for llama.cpp's suite build (scripts/install_llamacpp.sh --profile test; cmake's
# CMAKE_{C,CXX}_COMPILER_LAUNCHER runs `launcher <compiler> <args...>`): every source outside ggml/ is compiled at
# -O0 instead of the release flags' -O3, ggml's (the tensor kernels) as released. Compiling four of the largest
# such files took 38-73% less CPU at -O0 (AVX2 EPYC, gcc 12); what it serves is unchanged, only slower outside the
# kernels, so served speeds are measured on a release build (`make llamacpp-env`) only.
set -euo pipefail
src=""
prev=""
for a in "$@"; do
    [ "$prev" = "-c" ] && src="$a"
    prev="$a"
done
case "$src" in
    */ggml/*|"") exec "$@" ;;
esac
args=()
for a in "$@"; do
    case "$a" in
        -O1|-O2|-O3|-Os|-Ofast) args+=("-O0") ;;
        *) args+=("$a") ;;
    esac
done
exec "${args[@]}"
