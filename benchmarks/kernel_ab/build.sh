#!/usr/bin/env bash
# Build an A/B timing binary from two copies of the 8-bit CPU kernel (see README.md here).
#   bash benchmarks/kernel_ab/build.sh A.cpp B.cpp OUT ["extra flags for A"] ["extra flags for B"]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CSRC="$HERE/../../csrc"
# The flags of the JIT build (qmuon/ops/_extension.py), with a stand-in ATen/Parallel.h.
CF=(-O3 -ffp-contract=off -fopenmp -march="${QMUON_CPU_ARCH:-native}" -std=c++20 -I"$HERE/shim")
RENAME=(-Dqmuon_cpu_quantize_rows=quantize_rows_X -Dqmuon_cpu_dequantize_rows=dequantize_rows_X
        -Dqmuon_cpu_vector_isa=vector_isa_X)
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# shellcheck disable=SC2086
g++ "${CF[@]}" ${4:-} -I"$CSRC" -Dqmuon_cpu_q8_momentum_update=upd_A "${RENAME[@]//X/A}" -c -x c++ "$1" -o "$TMP/a.o"
# shellcheck disable=SC2086
g++ "${CF[@]}" ${5:-} -I"$CSRC" -Dqmuon_cpu_q8_momentum_update=upd_B "${RENAME[@]//X/B}" -c -x c++ "$2" -o "$TMP/b.o"
g++ "${CF[@]}" -I"$CSRC" "$HERE/pair.cpp" "$TMP/a.o" "$TMP/b.o" -o "$3"
echo "built $3"
