#!/usr/bin/env bash
# GPU check of qmuon_lightning, one script (a few minutes on one GPU): a thin wrapper around
#   1. qmuon-doctor (python -m qmuon_lightning.doctor): versions, kernel build, device / arch, every op
#      on the GPU against its reference, fused-update bandwidth vs copy_, NCCL all-to-all (several GPUs);
#   2. pytest -m cuda: the CUDA-marked tests (kernels vs reference, GPU-risk cases, graphs, streams);
#   3. the bandwidth benchmark table (benchmarks/bench_update.py --device cuda).
# The kernels are built for the device this runs on: TORCH_CUDA_ARCH_LIST defaults to its compute
# capability plus PTX (e.g. "12.1+PTX" on a GB10, "9.0+PTX" on an H100/H200), so the build always has an
# image the driver can run. QMUON_BACKEND=extension makes a failed build an error, not a silent fallback.
# Logs and tables go to $OUT (the device tool's output folder) or /tmp/qmuon_gpu_check.
# Exit status: 0 when every step passed.
#
#   bash benchmarks/gpu_check.sh                 # from anywhere; uses python3 unless $PYTHON is set
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-/tmp/qmuon_gpu_check}"
mkdir -p "$OUT_DIR"

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export QMUON_BACKEND=extension
export MAX_JOBS="${MAX_JOBS:-8}"
export PYTHONDONTWRITEBYTECODE=1
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    # The capability of every visible device, each with PTX (JIT fallback for a newer one).
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch
caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
print(";".join(f"{a}.{b}+PTX" for a, b in caps))' 2>/dev/null)"
fi
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    echo "gpu_check: no CUDA device visible (torch.cuda.device_count() == 0); nothing to check" >&2
    exit 1
fi
export TORCH_CUDA_ARCH_LIST
echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"

declare -a NAMES=() RCS=() SECS=()
step() {  # name timeout_s logfile command...
    local name="$1" limit="$2" log="$3"
    shift 3
    echo "=== $name (limit ${limit}s) ==="
    local t=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    tail -n 40 "$log"
    NAMES+=("$name"); RCS+=("$rc"); SECS+=("$(( $(date +%s) - t ))")
}

step "qmuon-doctor" 400 "$OUT_DIR/doctor.log" "$PY" -m qmuon_lightning.doctor --json "$OUT_DIR/doctor.json"
step "pytest -m cuda" 300 "$OUT_DIR/pytest_cuda.log" "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs \
    tests/test_gpu_risk.py tests/test_kernels.py tests/test_kernels_4bit.py tests/test_kernels_sharded.py \
    tests/test_newton_schulz.py
# A run in which cuda tests skipped (the CUDA kernels must load) is not a pass; cuda:1 tests may skip
# on a single GPU.
if grep -E '^SKIPPED' "$OUT_DIR/pytest_cuda.log" | grep -v 'second CUDA device' | grep -q .; then
    RCS[${#RCS[@]}-1]=1
fi
step "bench_update.py --device cuda" 150 "$OUT_DIR/bench.log" "$PY" benchmarks/bench_update.py --device cuda \
    --numel $((1 << 27)) --reps 15 --warmup 3 --out "$OUT_DIR/update_bandwidth_cuda.md"

{
    echo
    echo "## qmuon_lightning GPU check (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
    echo
    echo "| step | exit status | seconds |"
    echo "| --- | ---: | ---: |"
    for i in "${!NAMES[@]}"; do echo "| ${NAMES[$i]} | ${RCS[$i]} | ${SECS[$i]} |"; done
    echo
    sed -n '/^| check/,/^$/p' "$OUT_DIR/doctor.log"
    grep -E '[0-9]+ (passed|failed)' "$OUT_DIR/pytest_cuda.log" | tail -n 1
    [ -f "$OUT_DIR/update_bandwidth_cuda.md" ] && cat "$OUT_DIR/update_bandwidth_cuda.md"
} | tee "$OUT_DIR/summary.md"

status=0
for rc in "${RCS[@]}"; do [ "$rc" -eq 0 ] || status=1; done
exit $status
