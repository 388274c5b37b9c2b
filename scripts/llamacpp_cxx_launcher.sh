#!/usr/bin/env bash
# Compiler launcher for llama.cpp's suite build (scripts/install_llamacpp.sh with LLAMACPP_PROFILE=test, which
# `--background` sets; cmake's CMAKE_{C,CXX}_COMPILER_LAUNCHER runs `launcher <compiler> <args...>`): every source
# outside ggml/ is compiled at -O0 instead of the release flags' -O3, ggml's (the tensor kernels) as released. What
# it serves is unchanged, only slower outside the kernels, so served speeds are measured on a release build
# (`make llamacpp-env`) only.
# Measured (AVX2 EPYC, gcc 12), user CPU-s at -O3 / -O1 / -O0, each file's own command from
# `ninja -C <build> -t commands llama-server` run under /usr/bin/time with the -O flag swapped: llama-model.cpp
# 15.3 / 10.0 / 8.9, server-context.cpp 21.5 / 14.1 / 12.2, common/chat.cpp 9.8 / 6.7 / 6.0, mtmd/clip.cpp
# 24.6 / 10.9 / 6.6 (-38% to -73% at -O0). The whole test-profile build: 797 CPU-s, 598 s wall beside other work
# (`LLAMACPP_DIR=/tmp/lct LLAMACPP_PROFILE=test /usr/bin/time -v bash scripts/install_llamacpp.sh`); a release build
# was not timed on the same host. With the unity build the test profile adds (scripts/llamacpp_unity.cmake): 458
# CPU-s, 232 s wall on the idle host (ninja -j2 under /usr/bin/time; tests/server/test_llamacpp.py passes on it).
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
