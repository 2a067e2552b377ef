#!/usr/bin/env bash
# GPU check of qmuon_lightning, one script: at most GPU_CHECK_BUDGET_S seconds (default 570, inside the
# device tool's 10-minute command limit) from start to summary, setup included. Every step has its own
# hard time limit, cut to what is left of the budget (a step that no longer fits is "not run: budget
# spent", not left to hang); a hung step is killed at its limit and the rest still runs.
#
# THE PREPARED COMMAND (lent H200 machine; device tool run, from the repository root):
#   here, once:  python -m qmuon.ops.build_gpu --cache ~/.cache/qmuon/nvcc   # qmuon/_lib/libqmuon_cuda13.so
#                bash benchmarks/gpu_wheels.sh                                # .gpu_wheels/ (1.3 MB)
#   run:         command="bash benchmarks/gpu_check.sh --wheels .gpu_wheels", carry=["qmuon/_lib", ".gpu_wheels"],
#                timeout_s=600
# That machine has Python 3.12, torch 2.11 (CUDA 13), lightning, transformers, accelerate, peft, pytest,
# ninja and nvcc, no network, and nothing of this project installed. --wheels DIR installs the wheels of
# DIR with `pip install --no-index --no-deps --target` into GPU_CHECK_SITE (default /tmp/qmuon_gpu_site;
# no dependency resolution, so no second torch), and the project runs from this checkout through
# PYTHONPATH (no install, no build). Carried: the tracked tree (~11 MB) + qmuon/_lib (5.1 MB) +
# .gpu_wheels (1.3 MB), under the 64 MiB limit. Rehearsal: benchmarks/results/gpu_check_rehearsal.md.
#
# Steps (CUDA-only ones print "no CUDA" and skip without a GPU; the rest run on the CPU, which is the
# rehearsal of this script):
#   1. the prebuilt GPU library (qmuon/_lib/libqmuon_cuda<major>.so): its SASS / PTX, and which library
#      the loader picks for this torch and driver (the load needs CUDA);
#   2. qmuon-doctor (python -m qmuon_lightning.doctor): versions, kernel loading order, device / arch,
#      every op on the GPU against its reference (the first-use canary runs too), bandwidth vs copy_;
#   3. a training step under torch.cuda.set_sync_debug_mode("error") (benchmarks/gpu_step_check.py):
#      the host-reads test's model on the GPU, configurations int8, int4, grasp4, normuon, bf16 weights +
#      stochastic + int8 AdamW, gradient release, compile_step; 2 warm-up steps outside the mode (state
#      creation and the first-use canary read back, and compile_step compiles, as expected), then 4 whole
#      steps inside it, one with a NaN loss; pass / fail per configuration with the exception;
#   4. pytest -m cuda: the CUDA-marked tests (kernels vs reference, GPU-risk cases, graphs, streams);
#   5. eager vs compiled (qmuon.compile_step, inductor) vs captured (qmuon.capture_step, one CUDA graph)
#      optimizer.step() time against torch.optim.Muon, GPT-small matrices (d=768 x 12 layers, 85M in the
#      matrices: a 124M model) and 1B matrices (d=2048 x 16 layers, 805M) (benchmarks/bench_step.py
#      --device cuda, -compiled / -captured names); the warm-up rounds compile and capture;
#   6. the first-use canary's cost on the GPU, in cold processes (benchmarks/bench_canary.py --device cuda);
#   7. the per-call overhead of the prebuilt (ctypes) path on a small call (bench_call_overhead.py
#      --device cuda); with GPU_CHECK_JIT=1 and nvcc present, the same on the JIT-built kernels;
#   8. 50 steps of the smoke recipe (recipes/cpu/smoke.yaml) on the GPU through qmuon-train;
#   9. the fused-update bandwidth table (benchmarks/bench_update.py --device cuda);
#  10. optimizer.step() time against torch.optim.Muon at GPT-small shapes: QMuon int8 with its defaults
#      and with bf16 / fp32 NS.
# The order puts the step's checks first: when the budget runs out, the later, older tables go.
# Without CUDA, steps 5-10 run small CPU stand-ins where they can (same programs, tiny sizes: they check
# that the programs start and their imports resolve) and the 1B table skips.
#
# Output: $OUT (the device tool's output folder; else /tmp/qmuon_gpu_check) gets summary.md (the one
# summary, rewritten after every step, so a cut-off run still returns one) and logs.tar.gz (every log
# and table); the work files stay in GPU_CHECK_WORK (default /tmp/qmuon_gpu_check_work). With a GPU the
# summary is also copied to benchmarks/results/gpu_check.md. The CUDA kernels come from the prebuilt
# library when it is there (no nvcc needed); QMUON_BACKEND=extension makes a missing one an error, not
# a silent fallback to the reference. The CPU kernels are JIT-built (g++).
# Exit status: 0 when every step that ran passed and none was cut by the budget.
#
#   bash benchmarks/gpu_check.sh [--wheels DIR]     # from anywhere; python3 unless $PYTHON is set
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
T0=$(date +%s)
BUDGET="${GPU_CHECK_BUDGET_S:-570}"
DEADLINE=$((T0 + BUDGET))
RESERVE=10  # seconds kept for the summary
WHEELS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="${2:?--wheels needs a folder}"; shift 2 ;;
        --wheels=*) WHEELS="${1#--wheels=}"; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (use --wheels DIR)" >&2; exit 2 ;;
    esac
done
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-/tmp/qmuon_gpu_check}"
WORK="${GPU_CHECK_WORK:-/tmp/qmuon_gpu_check_work}"
mkdir -p "$OUT_DIR" "$WORK"
rm -f "$WORK"/*.log "$WORK"/*.md "$WORK"/*.json

# ---- setup: the carried wheels (no index, no dependencies: the preinstalled torch stays the only one)
if [ -n "$WHEELS" ]; then
    SITE="${GPU_CHECK_SITE:-/tmp/qmuon_gpu_site}"
    shopt -s nullglob
    whls=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ ${#whls[@]} -eq 0 ]; then
        echo "gpu_check: --wheels $WHEELS holds no .whl (bash benchmarks/gpu_wheels.sh fetches them)" >&2
        exit 1
    fi
    echo "=== setup: pip install --no-index --no-deps --target $SITE ${#whls[@]} wheels from $WHEELS ==="
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "${whls[@]}" || { echo "gpu_check: installing the wheels failed" >&2; exit 1; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export QMUON_BACKEND=extension
export MAX_JOBS="${MAX_JOBS:-8}"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$WORK/torch_extensions}"
if ! "$PY" -c 'import sys, torch, qmuon, qmuon_lightning, lightning, jsonargparse, omegaconf
print("gpu_check: python", sys.version.split()[0], "torch", torch.__version__, "(" + torch.__file__ + ")",
      "lightning", lightning.__version__, "jsonargparse", jsonargparse.__version__, "omegaconf", omegaconf.__version__,
      "qmuon from", qmuon.__file__)'; then
    echo "gpu_check: the imports above failed: carry the wheels (bash benchmarks/gpu_wheels.sh; --wheels .gpu_wheels)" >&2
    exit 1
fi
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() > 0 else 1)'; then
    CUDA=1
    DEV=cuda
    # For a JIT build of the CUDA kernels (no prebuilt library, or GPU_CHECK_JIT=1): the visible archs + PTX.
    if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
        TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch
caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
print(";".join(f"{a}.{b}+PTX" for a, b in caps))')"
    fi
    export TORCH_CUDA_ARCH_LIST
    nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader > "$WORK/nvidia_smi.txt" 2>&1
    TITLE="$(head -n 1 "$WORK/nvidia_smi.txt")"
else
    CUDA=0
    DEV=cpu
    echo "gpu_check: no CUDA: torch.cuda.device_count() == 0; CUDA-only steps are skipped, the rest runs on the CPU" \
         "(a rehearsal of this script, not a GPU check)"
    TITLE="no CUDA: CPU rehearsal of the script, not a GPU check"
fi
echo "gpu_check: $TITLE; budget ${BUDGET}s; logs in $WORK, summary in $OUT_DIR/summary.md"

VERSIONS="$("$PY" -c 'import platform, torch; print("Python", platform.python_version(), "torch", torch.__version__)')"
declare -a NAMES=() RESULTS=() RCS=() SECS=()
summary() {
    {
        echo "## qmuon_lightning GPU check ($TITLE)"
        echo
        echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $VERSIONS, budget ${BUDGET}s, $(( $(date +%s) - T0 ))s so far. Logs: logs.tar.gz beside this file."
        echo
        echo "| step | result | exit status | seconds |"
        echo "| --- | --- | ---: | ---: |"
        for i in "${!NAMES[@]}"; do echo "| ${NAMES[$i]} | ${RESULTS[$i]} | ${RCS[$i]} | ${SECS[$i]} |"; done
        echo "| captured CUDA-graph step | n/a: capturable step not implemented | - | - |"
        echo
        [ -f "$WORK/doctor.log" ] && sed -n '/^| check/,/^$/p' "$WORK/doctor.log"
        [ -f "$WORK/pytest_cuda.log" ] && grep -E '[0-9]+ (passed|failed|skipped)' "$WORK/pytest_cuda.log" | tail -n 1
        [ -f "$WORK/step_sync_debug.md" ] && { echo; cat "$WORK/step_sync_debug.md"; }
        if [ -f "$WORK/step_compiled_gpt_small.json" ] || [ -f "$WORK/step_compiled_1b.json" ]; then
            echo
            "$PY" benchmarks/gpu_check_tables.py $DEV "$WORK/step_compiled_gpt_small.json" "$WORK/step_compiled_1b.json"
        fi
        for f in step_compiled_gpt_small.md step_compiled_1b.md canary_cost_$DEV.md \
                 call_overhead_$DEV.md call_overhead_cuda_jit.md update_bandwidth_$DEV.md step_time_$DEV.md; do
            [ -f "$WORK/$f" ] && { echo; cat "$WORK/$f"; }
        done
    } > "$OUT_DIR/summary.md"
    tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" --exclude=torch_extensions --exclude=smoke . 2>/dev/null || true
}

record() {  # name result rc seconds
    NAMES+=("$1"); RESULTS+=("$2"); RCS+=("$3"); SECS+=("$4")
    summary
}

step() {  # name limit_s logfile command...: runs it under min(limit, what is left of the budget)
    local name="$1" limit="$2" log="$3"
    shift 3
    local left=$((DEADLINE - $(date +%s) - RESERVE))
    if [ "$left" -lt 15 ]; then
        echo "=== $name: not run: the script's ${BUDGET}s budget is spent ==="
        record "$name" "not run: budget spent" "-" 0
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s) ==="
    local t=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    tail -n 40 "$log"
    local res=pass
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then res="**timed out** (${limit}s)"
    elif [ "$rc" -ne 0 ]; then res="**FAIL**"; fi
    record "$name" "$res" "$rc" "$(( $(date +%s) - t ))"
}

skip() {  # name reason
    echo "=== $1: skipped: $2 ==="
    record "$1" "skipped: $2" "-" 0
}

fail_last() {  # mark the last step failed (a check on its log), with a reason
    local i=$((${#RESULTS[@]} - 1))
    RESULTS[$i]="**FAIL** ($1)"
    [ "${RCS[$i]}" = "0" ] && RCS[$i]=1
    summary
}

# 1. the prebuilt library
step "prebuilt GPU library" 30 "$WORK/gpu_library.log" "$PY" -c '
import glob, subprocess, sys, torch
libs = sorted(glob.glob("qmuon/_lib/libqmuon_cuda*.so"))
print("libraries:", libs or "none")
for lib in libs:
    print(subprocess.run([sys.executable, "-m", "qmuon.ops.build_gpu", "--list", lib], capture_output=True,
                         text=True).stdout)
if not torch.cuda.is_available():
    print("no CUDA: the load of the library is not tried")
    sys.exit(0 if libs else 1)
from qmuon.ops import _prebuilt
found = _prebuilt.load()
print(found.summary())
sys.exit(0 if found.usable else 1)'

# 2. the doctor
step "qmuon-doctor" 180 "$WORK/doctor.log" "$PY" -m qmuon_lightning.doctor --json "$WORK/doctor.json"

# 3. a step under set_sync_debug_mode("error")
step "step under set_sync_debug_mode(\"error\") ($DEV)" 180 "$WORK/step_sync_debug.log" "$PY" \
    benchmarks/gpu_step_check.py --limit $([ $CUDA = 1 ] && echo 45 || echo 90) --out "$WORK/step_sync_debug.md"

# 4. the CUDA tests (on the CPU: collected, every one skips)
step "pytest -m cuda" 150 "$WORK/pytest_cuda.log" "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs \
    tests/test_gpu_risk.py tests/test_kernels.py tests/test_kernels_4bit.py tests/test_kernels_adamw.py \
    tests/test_kernels_sharded.py tests/test_newton_schulz.py tests/test_canary.py tests/test_cabi.py \
    tests/test_capturable.py
if [ $CUDA = 1 ]; then
    # A run in which cuda tests skipped (the CUDA kernels must load) is not a pass; cuda:1 tests may skip
    # on a single GPU.
    # (the count, not grep -q: under pipefail an early-exiting grep -q fails the pipe it ends)
    if [ "$(grep -E '^SKIPPED' "$WORK/pytest_cuda.log" | grep -vc 'second CUDA device')" != 0 ]; then
        fail_last "CUDA tests skipped"
    fi
elif [ "${RCS[-1]}" = 5 ]; then  # every test deselected or skipped on the CPU: collected and skipped
    RESULTS[-1]="pass (no CUDA: collected, all skipped)"; RCS[-1]=0; summary
fi

# 5. eager vs compiled step time vs torch.optim.Muon
COMPILED="torch.Muon,qmuon-int8-noparts,qmuon-int8-noparts-compiled"
[ $CUDA = 1 ] && COMPILED="$COMPILED,qmuon-int8-noparts-captured"  # CUDA graphs: GPU only
if [ $CUDA = 1 ]; then
    step "step time eager vs compile_step, GPT-small d=768 x 12" 150 "$WORK/step_compiled_gpt_small.log" \
        "$PY" benchmarks/bench_step.py --device cuda --configs 768x12:10 --warmup 3 --pool 2 --profile-steps 0 \
        --optimizers "$COMPILED" --out "$WORK/step_compiled_gpt_small.md"
    step "step time eager vs compile_step, 1B d=2048 x 16" 180 "$WORK/step_compiled_1b.log" \
        "$PY" benchmarks/bench_step.py --device cuda --configs 2048x16:8 --warmup 3 --pool 1 --profile-steps 0 \
        --optimizers "$COMPILED" --out "$WORK/step_compiled_1b.md"
else
    step "step time eager vs compile_step (no CUDA: CPU stand-in d=64 x 2)" 240 "$WORK/step_compiled_gpt_small.log" \
        "$PY" benchmarks/bench_step.py --device cpu --configs 64x2:2 --warmup 2 --pool 1 --profile-steps 0 \
        --optimizers "$COMPILED" --out "$WORK/step_compiled_gpt_small.md"
    skip "step time eager vs compile_step, 1B d=2048 x 16" "no CUDA"
fi

# 6. the canary's cost, cold processes
step "first-use canary cost, cold processes ($DEV)" 90 "$WORK/canary.log" "$PY" benchmarks/bench_canary.py \
    --device $DEV --runs $([ $CUDA = 1 ] && echo 3 || echo 1) --out "$WORK/canary_cost_$DEV.md"

# 7. per-call overhead
if [ $CUDA = 1 ]; then
    step "call overhead + canary (prebuilt)" 60 "$WORK/overhead.log" "$PY" benchmarks/bench_call_overhead.py \
        --device cuda --calls 2001 --out "$WORK/call_overhead_cuda.md"
    if [ "${GPU_CHECK_JIT:-0}" = "1" ] && command -v nvcc >/dev/null 2>&1; then
        step "call overhead (JIT build)" 400 "$WORK/overhead_jit.log" env QMUON_GPU_LIB=0 "$PY" \
            benchmarks/bench_call_overhead.py --device cuda --calls 2001 --out "$WORK/call_overhead_cuda_jit.md"
    fi
else
    step "call overhead (no CUDA: CPU stand-in)" 60 "$WORK/overhead.log" "$PY" benchmarks/bench_call_overhead.py \
        --device cpu --calls 201 --canary-reps 1 --out "$WORK/call_overhead_cpu.md"
fi

# 8. the smoke recipe through qmuon-train
if [ $CUDA = 1 ]; then
    step "smoke recipe, 50 steps on the GPU" 90 "$WORK/smoke.log" "$PY" -m qmuon_lightning.cli fit \
        --config recipes/cpu/smoke.yaml --trainer.accelerator=gpu --trainer.devices=1 --trainer.max_steps=50 \
        --trainer.val_check_interval=25 --ckpt_path=null --trainer.default_root_dir="$WORK/smoke"
else
    step "smoke recipe (no CUDA: 6 steps on the CPU)" 120 "$WORK/smoke.log" "$PY" -m qmuon_lightning.cli fit \
        --config recipes/cpu/smoke.yaml --trainer.accelerator=cpu --trainer.devices=1 --trainer.max_steps=6 \
        --trainer.val_check_interval=3 --trainer.limit_val_batches=2 --ckpt_path=null \
        --trainer.default_root_dir="$WORK/smoke"
fi

# 9. fused-update bandwidth
if [ $CUDA = 1 ]; then
    step "bench_update.py --device cuda" 60 "$WORK/bench.log" "$PY" benchmarks/bench_update.py --device cuda \
        --numel $((1 << 27)) --reps 15 --warmup 3 --out "$WORK/update_bandwidth_cuda.md"
else
    step "bench_update.py (no CUDA: CPU stand-in)" 90 "$WORK/bench.log" "$PY" benchmarks/bench_update.py --device cpu \
        --numel $((1 << 18)) --cols 1024 --reps 2 --warmup 1 --no-reference --no-4bit --out "$WORK/update_bandwidth_cpu.md"
    # its bandwidth targets are for a GPU (and a quiet machine): on the stand-in only a crash fails
    if [ "${RCS[-1]}" = 1 ] && [ -f "$WORK/update_bandwidth_cpu.md" ] && ! grep -q Traceback "$WORK/bench.log"; then
        RESULTS[-1]="pass (ran; its targets are not judged on a CPU stand-in)"; RCS[-1]=0; summary
    fi
fi

# 10. step time vs torch.optim.Muon, NS dtypes, GPT-small
if [ $CUDA = 1 ]; then
    step "step time vs torch.optim.Muon, NS dtypes (GPT-small)" 120 "$WORK/step_time.log" "$PY" \
        benchmarks/bench_step.py --device cuda --preset gpt-small --steps 10 --warmup 2 --profile-steps 0 \
        --optimizers torch.Muon,qmuon-int8-noparts,qmuon-int8-noparts-nsbf16,qmuon-int8-noparts-nsfp32,qmuon-int8 \
        --out "$WORK/step_time_cuda.md"
else
    step "step time vs torch.optim.Muon, NS dtypes (no CUDA: CPU stand-in d=64 x 2)" 90 "$WORK/step_time.log" "$PY" \
        benchmarks/bench_step.py --device cpu --configs 64x2:2 --warmup 1 --pool 1 --profile-steps 0 \
        --optimizers torch.Muon,qmuon-int8-noparts,qmuon-int8-noparts-nsbf16,qmuon-int8-noparts-nsfp32,qmuon-int8 \
        --out "$WORK/step_time_cpu.md"
fi

summary
cat "$OUT_DIR/summary.md"
[ $CUDA = 1 ] && cp "$OUT_DIR/summary.md" "$REPO/benchmarks/results/gpu_check.md" 2>/dev/null
echo "gpu_check: $(( $(date +%s) - T0 ))s in all; summary $OUT_DIR/summary.md, logs $OUT_DIR/logs.tar.gz"

status=0
for i in "${!RCS[@]}"; do
    case "${RESULTS[$i]}" in pass*|skipped*) ;; *) status=1 ;; esac
done
exit $status
