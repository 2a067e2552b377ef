#!/usr/bin/env bash
# A CUDA 13 toolkit that cross-compiles the prebuilt GPU library for aarch64 hosts (GB10 / DGX Spark, Grace):
#
#   .ci/cuda13_aarch64.sh [NVCC] [PREFIX]   # NVCC: the x86_64 nvcc 13 (default: PATH's); prints PREFIX/bin/nvcc
#   python -m qmuon.ops.build_gpu --nvcc "$(.ci/cuda13_aarch64.sh)" --host aarch64 --out build/lib-aarch64
#
# The device code is the same for every host CPU; only the host launchers and the static CUDA runtime
# differ. PREFIX gets hard links (else copies) of NVCC's bin/, links to its nvvm/ and x86_64 target, and
# targets/sbsa-linux: the (architecture-independent) headers of NVCC's toolkit and the aarch64 runtime of
# PyPI's nvidia-cuda-runtime of the same release (SHA256 checked by pip against PyPI). The host side is
# compiled by aarch64-linux-gnu-g++ (Debian: g++-aarch64-linux-gnu).
set -euo pipefail

NVCC="$(command -v "${1:-nvcc}")" || { echo "cuda13_aarch64.sh: no nvcc ${1:-on PATH}" >&2; exit 1; }
PREFIX="${2:-$HOME/.cache/qmuon/cuda13-aarch64}"
# The toolkit's root as nvcc sees it (PATH's nvcc may be a wrapper script), and its CUDA release.
read -r TOP RELEASE < <(python -c 'import sys; from qmuon.ops.build_gpu import cuda_release, nvcc_root
print(nvcc_root(sys.argv[1]), cuda_release(sys.argv[1]))' "$NVCC")
if [[ "${RELEASE%%.*}" != "13" ]]; then
  echo "cuda13_aarch64.sh: $NVCC is CUDA $RELEASE, not 13" >&2
  exit 1
fi
if [[ -f "$PREFIX/.complete" ]] && [[ "$(cat "$PREFIX/.complete")" == "$TOP $RELEASE" ]]; then
  echo "$PREFIX/bin/nvcc"
  exit 0
fi
command -v aarch64-linux-gnu-g++ >/dev/null || { echo "cuda13_aarch64.sh: no aarch64-linux-gnu-g++ (apt-get install g++-aarch64-linux-gnu)" >&2; exit 1; }
# The runtime release that matches the toolkit's own (its dist-info, else the newest of its CUDA release).
RT="$( (ls -d "$TOP"/dist-info/nvidia_cuda_runtime-*.dist-info 2>/dev/null || true) |
  sed -n 's/.*nvidia_cuda_runtime-\(.*\)\.dist-info/\1/p' | head -n 1)"
RT="${RT:-$RELEASE.*}"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_aarch64 -d "$WORK" \
  "nvidia-cuda-runtime==$RT" 2>&1 | grep -v "^WARNING" >&2 || true
WHEEL="$(ls "$WORK"/nvidia_cuda_runtime-*.whl)"
python - "$WHEEL" "$WORK/rt" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if "/lib/" in n])
PY

rm -rf "$PREFIX"
mkdir -p "$PREFIX/targets/sbsa-linux"
cp -al "$TOP/bin" "$PREFIX/bin" 2>/dev/null || cp -a "$TOP/bin" "$PREFIX/bin"
ln -s "$TOP/nvvm" "$PREFIX/nvvm"
ln -s "$TOP/targets/x86_64-linux" "$PREFIX/targets/x86_64-linux"
ln -s "$TOP/targets/x86_64-linux/include" "$PREFIX/targets/sbsa-linux/include"
cp -r "$WORK"/rt/nvidia/cu13/lib "$PREFIX/targets/sbsa-linux/lib"
echo "$TOP $RELEASE" >"$PREFIX/.complete"
echo "cuda13_aarch64.sh: $PREFIX (nvcc $RELEASE, aarch64 runtime $(basename "$WHEEL"))" >&2
echo "$PREFIX/bin/nvcc"
