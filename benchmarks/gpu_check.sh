#!/usr/bin/env bash
# GPU check of qmuon_lightning, one script (at most about 10 minutes on one GPU, every step has a time limit;
# a few minutes when nothing hangs):
#   1. the prebuilt GPU library (qmuon/_lib/libqmuon_cuda<major>.so, python -m qmuon.ops.build_gpu; not
#      in git: carry it to the GPU machine, e.g. the device tool's carry=["qmuon/_lib"]): its SASS / PTX,
#      and which library the loader picks for this torch and driver;
#   2. qmuon-doctor (python -m qmuon_lightning.doctor): versions, kernel loading order, device / arch,
#      every op on the GPU against its reference (the first-use canary runs too), bandwidth vs copy_;
#   3. pytest -m cuda: the CUDA-marked tests (kernels vs reference, GPU-risk cases, graphs, streams);
#   4. the per-call overhead of the prebuilt (ctypes) path on a small call, and the canary's cost on the
#      GPU (benchmarks/bench_call_overhead.py --device cuda); with GPU_CHECK_JIT=1 and nvcc present, the
#      same benchmark again on the JIT-built CUDA kernels (QMUON_GPU_LIB=0), for the side-by-side figure;
#   5. 50 steps of the smoke recipe (recipes/cpu/smoke.yaml) on the GPU through qmuon-train;
#   6. the fused-update bandwidth table (benchmarks/bench_update.py --device cuda);
#   7. optimizer.step() time against torch.optim.Muon at GPT-small shapes (d=768 x 12 layers;
#      benchmarks/bench_step.py --device cuda): QMuon int8 with its defaults and with bf16 / fp32 NS.
# The summary table goes to $OUT/summary.md and benchmarks/results/gpu_check.md.
# The CUDA kernels come from the prebuilt library when it is there (no nvcc needed); QMUON_BACKEND=extension
# makes a missing one an error, not a silent fallback to the reference. The CPU kernels are JIT-built (g++).
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
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$OUT_DIR/torch_extensions}"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() > 0 else 1)'; then
    echo "gpu_check: no CUDA device visible (torch.cuda.device_count() == 0); nothing to check" >&2
    exit 1
fi
# For a JIT build of the CUDA kernels (no prebuilt library, or GPU_CHECK_JIT=1): the visible devices' archs + PTX.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch
caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
print(";".join(f"{a}.{b}+PTX" for a, b in caps))')"
fi
export TORCH_CUDA_ARCH_LIST
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader > "$OUT_DIR/nvidia_smi.txt" 2>&1
cat "$OUT_DIR/nvidia_smi.txt"

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

step "prebuilt GPU library" 30 "$OUT_DIR/gpu_library.log" "$PY" -c '
import glob, json, subprocess, sys, warnings
libs = sorted(glob.glob("qmuon/_lib/libqmuon_cuda*.so"))
for lib in libs:
    print(subprocess.run([sys.executable, "-m", "qmuon.ops.build_gpu", "--list", lib], capture_output=True,
                         text=True).stdout)
from qmuon.ops import _prebuilt
found = _prebuilt.load()
print(found.summary())
sys.exit(0 if found.usable else 1)'
step "qmuon-doctor" 200 "$OUT_DIR/doctor.log" "$PY" -m qmuon_lightning.doctor --json "$OUT_DIR/doctor.json"
step "pytest -m cuda" 150 "$OUT_DIR/pytest_cuda.log" "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs \
    tests/test_gpu_risk.py tests/test_kernels.py tests/test_kernels_4bit.py tests/test_kernels_adamw.py \
    tests/test_kernels_sharded.py tests/test_newton_schulz.py tests/test_canary.py tests/test_cabi.py
# A run in which cuda tests skipped (the CUDA kernels must load) is not a pass; cuda:1 tests may skip
# on a single GPU.
if grep -E '^SKIPPED' "$OUT_DIR/pytest_cuda.log" | grep -v 'second CUDA device' | grep -q .; then
    RCS[${#RCS[@]}-1]=1
fi
step "call overhead + canary (prebuilt)" 60 "$OUT_DIR/overhead.log" "$PY" benchmarks/bench_call_overhead.py \
    --device cuda --calls 2001 --out "$OUT_DIR/call_overhead_cuda.md"
if [ "${GPU_CHECK_JIT:-0}" = "1" ] && command -v nvcc >/dev/null 2>&1; then
    step "call overhead (JIT build)" 400 "$OUT_DIR/overhead_jit.log" env QMUON_GPU_LIB=0 "$PY" \
        benchmarks/bench_call_overhead.py --device cuda --calls 2001 --out "$OUT_DIR/call_overhead_cuda_jit.md"
fi
step "smoke recipe, 50 steps on the GPU" 90 "$OUT_DIR/smoke.log" "$PY" -m qmuon_lightning.cli fit \
    --config recipes/cpu/smoke.yaml --trainer.accelerator=gpu --trainer.devices=1 --trainer.max_steps=50 \
    --trainer.val_check_interval=25 --ckpt_path=null --trainer.default_root_dir="$OUT_DIR/smoke"
step "bench_update.py --device cuda" 60 "$OUT_DIR/bench.log" "$PY" benchmarks/bench_update.py --device cuda \
    --numel $((1 << 27)) --reps 15 --warmup 3 --out "$OUT_DIR/update_bandwidth_cuda.md"
step "step time vs torch.optim.Muon (GPT-small)" 150 "$OUT_DIR/step_time.log" "$PY" benchmarks/bench_step.py \
    --device cuda --preset gpt-small --steps 10 --warmup 2 --profile-steps 0 \
    --optimizers torch.Muon,qmuon-int8-noparts,qmuon-int8-noparts-nsbf16,qmuon-int8-noparts-nsfp32,qmuon-int8 \
    --out "$OUT_DIR/step_time_cuda.md"

{
    echo
    echo "## qmuon_lightning GPU check ($(cat "$OUT_DIR/nvidia_smi.txt" | head -n 1))"
    echo
    echo "| step | exit status | seconds |"
    echo "| --- | ---: | ---: |"
    for i in "${!NAMES[@]}"; do echo "| ${NAMES[$i]} | ${RCS[$i]} | ${SECS[$i]} |"; done
    echo
    sed -n '/^| check/,/^$/p' "$OUT_DIR/doctor.log"
    grep -E '[0-9]+ (passed|failed)' "$OUT_DIR/pytest_cuda.log" | tail -n 1
    for f in call_overhead_cuda.md call_overhead_cuda_jit.md update_bandwidth_cuda.md step_time_cuda.md; do
        [ -f "$OUT_DIR/$f" ] && cat "$OUT_DIR/$f"
    done
} | tee "$OUT_DIR/summary.md"
cp "$OUT_DIR/summary.md" "$REPO/benchmarks/results/gpu_check.md" 2>/dev/null || true

status=0
for rc in "${RCS[@]}"; do [ "$rc" -eq 0 ] || status=1; done
exit $status
