#!/usr/bin/env bash
# GPU check of the compiled kernels, one script, < 10 minutes on one H200 (step time limits add up
# to 570 s; expected ~4 minutes):
#   1. build the CPU + CUDA extension (QMUON_BACKEND=extension: a build failure is an error, not a
#      silent fallback to the reference),
#   2. run the cuda-marked tests of tests/test_kernels.py (8-bit) and tests/test_kernels_4bit.py
#      (int4 / e0m3 / dense updates and the 4-bit codecs: CUDA kernel == reference, bit for bit),
#      then the rest of both files (CPU comparisons, opcheck, nvcc compile for sm_90/100/121),
#   3. run the bandwidth benchmark on the GPU (8-bit, 4-bit and dense updates),
#   4. print a summary table.
# Logs and the benchmark table go to $OUT (the device tool's output folder) or /tmp/qmuon_gpu_check.
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
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"   # H200; one arch keeps the build short
export MAX_JOBS="${MAX_JOBS:-8}"
export QMUON_NVCC_ARCHS="${QMUON_NVCC_ARCHS:-90,100,121}"
export PYTHONDONTWRITEBYTECODE=1

T0=$(date +%s)
declare -a NAMES=() RESULTS=() SECONDS_TAKEN=() DETAILS=()

record() {  # name rc seconds detail
    NAMES+=("$1")
    if [ "$2" -eq 0 ]; then RESULTS+=("PASS"); else RESULTS+=("FAIL (rc $2)"); fi
    SECONDS_TAKEN+=("$3")
    DETAILS+=("$4")
}

run_step() {  # name timeout_s logfile command...
    local name="$1" limit="$2" log="$3"
    shift 3
    echo "=== $name (limit ${limit}s) ==="
    local t=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    local dt=$(( $(date +%s) - t ))
    tail -n 25 "$log"
    STEP_RC=$rc
    STEP_DT=$dt
}

# ---- 0. environment -------------------------------------------------------------------------
{
    echo "date: $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "nvidia-smi failed"
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"
} 2>&1 | tee "$OUT_DIR/env.txt"

# ---- 1. build ---------------------------------------------------------------------------------
run_step "build CPU+CUDA extension" 200 "$OUT_DIR/build.log" "$PY" -m qmuon_lightning.ops.build
BACKEND=$(grep -m1 '^backend:' "$OUT_DIR/build.log" | awk '{print $2}')
rc=$STEP_RC
if [ "$rc" -eq 0 ] && [ "$BACKEND" != "cpu+cuda-extension" ]; then rc=1; fi
record "build" "$rc" "$STEP_DT" "backend=${BACKEND:-?}"
BUILD_OK=$rc

# ---- 2. tests ---------------------------------------------------------------------------------
summary_line() { grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$1" | tail -n 1; }
if [ "$BUILD_OK" -eq 0 ]; then
    run_step "cuda-marked tests" 130 "$OUT_DIR/pytest_cuda.log" \
        "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs tests/test_kernels.py tests/test_kernels_4bit.py tests/test_kernels_sharded.py tests/test_newton_schulz.py
    rc=$STEP_RC
    # A run where every cuda test skipped (or any was skipped: the CUDA kernels must load) is not a pass.
    if [ "$rc" -eq 0 ] && ! grep -qE '[0-9]+ passed' "$OUT_DIR/pytest_cuda.log"; then rc=1; fi
    if [ "$rc" -eq 0 ] && grep -qE '[0-9]+ skipped' "$OUT_DIR/pytest_cuda.log"; then rc=1; fi
    record "pytest -m cuda" "$rc" "$STEP_DT" "$(summary_line "$OUT_DIR/pytest_cuda.log")"

    run_step "other kernel tests" 140 "$OUT_DIR/pytest_all.log" \
        "$PY" -m pytest -q -m "not cuda" -p no:cacheprovider -rs tests/test_kernels.py tests/test_kernels_4bit.py tests/test_kernels_sharded.py
    record "pytest -m 'not cuda' test_kernels*.py" "$STEP_RC" "$STEP_DT" "$(summary_line "$OUT_DIR/pytest_all.log")"
else
    record "pytest -m cuda" 1 0 "skipped: build failed"
    record "pytest -m 'not cuda' test_kernels*.py" 1 0 "skipped: build failed"
fi

# ---- 3. benchmark -----------------------------------------------------------------------------
if [ "$BUILD_OK" -eq 0 ]; then
    run_step "bandwidth benchmark (cuda)" 100 "$OUT_DIR/bench.log" \
        "$PY" benchmarks/bench_update.py --device cuda --numel $((1 << 27)) --reps 15 --warmup 3 \
        --out "$OUT_DIR/update_bandwidth_cuda.md"
    # bench exits 1 when its target line fails; that is reported, the script's status follows it.
    record "bench_update.py --device cuda" "$STEP_RC" "$STEP_DT" "$(grep -m1 -- '- overall' "$OUT_DIR/bench.log")"
else
    record "bench_update.py --device cuda" 1 0 "skipped: build failed"
fi

# ---- 4. summary -------------------------------------------------------------------------------
{
    echo
    echo "## qmuon_lightning GPU check ($(( $(date +%s) - T0 )) s)"
    echo
    echo "| step | result | seconds | detail |"
    echo "| --- | --- | ---: | --- |"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${RESULTS[$i]} | ${SECONDS_TAKEN[$i]} | ${DETAILS[$i]} |"
    done
    echo
    if [ -f "$OUT_DIR/update_bandwidth_cuda.md" ]; then
        cat "$OUT_DIR/update_bandwidth_cuda.md"
    fi
} | tee "$OUT_DIR/summary.md"

status=0
for r in "${RESULTS[@]}"; do
    [ "$r" = "PASS" ] || status=1
done
exit $status
