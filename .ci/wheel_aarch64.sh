#!/usr/bin/env bash
# The linux_aarch64 wheel (GB10 / DGX Spark, Grace), built on an x86_64 machine:
#
#   bash .ci/wheel_aarch64.sh OUT_DIR [PYTHON]
#
# 1. cross-compiles the CUDA 13 library's host side for aarch64 (.ci/cuda13_aarch64.sh: the nvcc on PATH
#    plus PyPI's aarch64 CUDA runtime; aarch64-linux-gnu-g++), the device code being the same for any CPU;
# 2. builds the wheel from a copy of the working tree whose qmuon/_lib holds that library only;
# 3. checks the wheel: the library is an AArch64 ELF with the shipped SASS / PTX, and, run under
#    qemu-aarch64 through .ci/abi_probe.c, it loads, its static CUDA runtime starts and reports no driver,
#    and its C-ABI struct layout equals the ctypes mirror's (qmuon/ops/_cabi.py).
# Exit 0: wheel in OUT_DIR; 3: the cross tools are missing and cannot be installed (the caller reports a
# skip); anything else: a failure.
set -euo pipefail

OUT="$1"
PYTHON="${2:-python}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if [[ ${#need[@]} -gt 0 ]]; then
  if [[ "$(id -u)" == "0" ]] && command -v apt-get >/dev/null; then
    echo "installing ${need[*]} (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
  else
    echo "no ${need[*]}, and no root apt-get to install them" >&2
    exit 3
  fi
fi
command -v nvcc >/dev/null || { echo "no nvcc on PATH" >&2; exit 3; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
NVCC="$(bash .ci/cuda13_aarch64.sh)"
"$PYTHON" -m qmuon.ops.build_gpu --nvcc "$NVCC" --host aarch64 --out "$WORK/lib" \
  --cache "${QMUON_NVCC_CACHE:-$HOME/.cache/qmuon/nvcc}"

# The working tree (tracked and untracked files git does not ignore), with the aarch64 library only.
SRC="$WORK/src"
mkdir -p "$SRC"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$SRC"
mkdir -p "$SRC/qmuon/_lib"
cp "$WORK"/lib/libqmuon_cuda*.so "$SRC/qmuon/_lib/"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" -C--build-option=--plat-name=linux_aarch64 "$SRC"
WHEEL="$(ls "$OUT"/*linux_aarch64.whl)"
echo "wheel: $(basename "$WHEEL"), $(( $(stat -c %s "$WHEEL") / 1024 )) KiB"

aarch64-linux-gnu-gcc -O1 -o "$WORK/abi_probe" .ci/abi_probe.c -ldl
"$PYTHON" - "$WHEEL" "$WORK" <<'PY'
import json, struct, subprocess, sys, zipfile
from qmuon.ops import _cabi, build_gpu

wheel, work = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    libs = [n for n in z.namelist() if n.startswith("qmuon/_lib/") and n.endswith(".so")]
    if libs != ["qmuon/_lib/libqmuon_cuda13.so"]:
        sys.exit(f"FAIL: the aarch64 wheel holds {libs}, expected qmuon/_lib/libqmuon_cuda13.so only")
    path = z.extract(libs[0], work + "/wheel")
with open(path, "rb") as f:
    machine, = struct.unpack_from("<H", f.read(20), 18)
if machine != 183:  # EM_AARCH64
    sys.exit(f"FAIL: {libs[0]} is ELF machine {machine}, not AArch64 (183)")
d = build_gpu.describe(path)
want_sass, want_ptx = [f"sm_{a}" for a in build_gpu.DEFAULT_ARCHS], [f"compute_{a}" for a in build_gpu.DEFAULT_PTX]
if d["sass"] != want_sass or d["ptx"] != want_ptx or not set(build_gpu.EXPORTS) <= set(d["exports"]):
    sys.exit(f"FAIL: {libs[0]}: SASS {d['sass']}, PTX {d['ptx']}, exports {d['exports']}")
out = subprocess.run(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", work + "/abi_probe", path],
                     capture_output=True, text=True, timeout=300)
if out.returncode != 0:
    sys.exit(f"FAIL: the aarch64 library did not load under qemu-aarch64:\n{out.stdout}{out.stderr}")
got = json.loads(out.stdout)
if got["layout"] != _cabi.layout():
    sys.exit(f"FAIL: the aarch64 library's struct layout {got['layout']} differs from the ctypes mirror's")
if got["build_info"].get("host") != "aarch64" or got["probe"] not in (35, 100):
    sys.exit(f"FAIL: unexpected build record or probe: {got}")
print(f"{libs[0]} (aarch64): {d['bytes'] / 2**20:.1f} MiB, SASS {' '.join(d['sass'])}, PTX {' '.join(d['ptx'])}; "
      f"under qemu-aarch64 it loads, its struct layout equals the ctypes mirror's, and the CUDA runtime reports "
      f"{'cudaErrorInsufficientDriver' if got['probe'] == 35 else 'no device'} ({got['probe']})")
PY
