#!/usr/bin/env bash
# Assemble a CUDA 12 compiler for the prebuilt libqmuon_cuda12.so, from packages this machine can reach:
#
#   .ci/cuda12_toolkit.sh [PREFIX]        # default ~/.cache/qmuon/cuda-12.4; prints PREFIX/bin/nvcc
#
# * nvcc 12.4 and its tools (cicc, cudafe++, ptxas, fatbinary, nvlink), the CUDA headers and the static
#   runtime come from Debian 13's non-free nvidia-cuda-toolkit / nvidia-cuda-dev, libcu++ (nv/target)
#   from libcu++-dev: the newest CUDA 12 front end in Debian, and PyPI's nvidia-cuda-nvcc-cu12 has none.
# * nvcc 12.4 predates sm_100 and sm_120, so ptxas 12.9 from PyPI's nvidia-cuda-nvcc-cu12 compiles the
#   library's PTX for them (python -m qmuon.ops.build_gpu --ptxas ... --ptxas-archs 100,120).
#
# Nothing is installed system-wide: the packages are unpacked into PREFIX, laid out as NVIDIA's toolkit
# (bin/, nvvm/, include/, lib64/) with an nvcc.profile that points there. Every download is checked
# against its SHA256 (Debian's Packages index of trixie; PyPI's). A finished PREFIX is reused.
set -euo pipefail

PREFIX="${1:-$HOME/.cache/qmuon/cuda-12.4}"
if [[ -f "$PREFIX/.complete" ]]; then
  echo "$PREFIX/bin/nvcc"
  exit 0
fi
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
POOL="$MIRROR/pool"
DEBS=(
  "non-free/n/nvidia-cuda-toolkit/nvidia-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb cd5fe85aee38d108b315f408a688641478f2402622a10c677478eb7a6c4e5319"
  "non-free/n/nvidia-cuda-toolkit/nvidia-cuda-dev_12.4.127~12.4.1-2_amd64.deb d846838f914a0176948d48a8bcade5d6dbcccb5c9374343f6475f5503f173ee0"
  "main/c/cccl/libcu++-dev_2.3.2-2_all.deb 30e911c1909265591b5ea793df0e49e56bed631238b68b3e75c97590c4985686"
)
PTXAS_WHEEL="nvidia-cuda-nvcc-cu12==12.9.86"
PTXAS_SHA256="5d6a0d32fdc7ea39917c20065614ae93add6f577d840233237ff08e9a38f58f0"

if [[ "$(uname -m)" != "x86_64" ]]; then
  echo "cuda12_toolkit.sh: the pinned packages are x86_64 builds; this machine is $(uname -m)" >&2
  exit 1
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
T0=$(date +%s)
for entry in "${DEBS[@]}"; do
  read -r path sha <<<"$entry"
  name="$(basename "$path")"
  curl -fsS --retry 3 -o "$WORK/$name" "$POOL/$path"
  echo "$sha  $WORK/$name" | sha256sum -c --quiet - || { echo "cuda12_toolkit.sh: $name: SHA256 mismatch" >&2; exit 1; }
done
python -m pip download -q --no-deps -d "$WORK/wheel" "$PTXAS_WHEEL" 2>&1 | grep -v "^WARNING" >&2 || true
WHEEL="$(ls "$WORK"/wheel/nvidia_cuda_nvcc_cu12-*.whl)"
echo "$PTXAS_SHA256  $WHEEL" | sha256sum -c --quiet - || { echo "cuda12_toolkit.sh: $WHEEL: SHA256 mismatch" >&2; exit 1; }

X="$WORK/x"
mkdir -p "$X"
dpkg-deb --fsys-tarfile "$WORK"/nvidia-cuda-toolkit_*.deb | tar -x -C "$X" \
  ./usr/lib/nvidia-cuda-toolkit/bin ./usr/lib/nvidia-cuda-toolkit/libdevice \
  ./usr/bin/cudafe++ ./usr/bin/ptxas ./usr/bin/fatbinary ./usr/bin/nvlink ./usr/bin/bin2c ./usr/bin/nvprune \
  ./usr/bin/cuobjdump
dpkg-deb --fsys-tarfile "$WORK"/nvidia-cuda-dev_*.deb | tar -x -C "$X" \
  ./usr/include ./usr/lib/x86_64-linux-gnu/libcudart_static.a ./usr/lib/x86_64-linux-gnu/libcudadevrt.a
dpkg-deb --fsys-tarfile "$WORK"/libcu++-dev_*.deb | tar -x -C "$X" ./usr/include
python - "$WHEEL" "$X/ptxas-12.9" <<'PY'
import shutil, stat, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("nvidia/cuda_nvcc/bin/ptxas") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
import os
os.chmod(sys.argv[2], 0o755)
PY

rm -rf "$PREFIX"
mkdir -p "$PREFIX"/{bin/crt,nvvm/bin,nvvm/libdevice,lib64,include,ptxas-12.9}
cp "$X"/usr/lib/nvidia-cuda-toolkit/bin/nvcc "$PREFIX/bin/"
cp "$X"/usr/lib/nvidia-cuda-toolkit/bin/crt/* "$PREFIX/bin/crt/"
cp "$X"/usr/lib/nvidia-cuda-toolkit/bin/cicc "$PREFIX/nvvm/bin/"
cp "$X"/usr/lib/nvidia-cuda-toolkit/libdevice/* "$PREFIX/nvvm/libdevice/"
cp "$X"/usr/bin/{cudafe++,ptxas,fatbinary,nvlink,bin2c,nvprune,cuobjdump} "$PREFIX/bin/"
cp -r "$X"/usr/include/. "$PREFIX/include/"
cp "$X"/usr/lib/x86_64-linux-gnu/*.a "$PREFIX/lib64/"
cp "$X/ptxas-12.9" "$PREFIX/ptxas-12.9/ptxas"
# NVIDIA's layout (TOP = PREFIX) instead of Debian's /usr paths.
cat >"$PREFIX/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
# The version text is captured before matching: `tool --version | grep -q` under pipefail fails whenever
# grep exits at its match before the tool has finished writing (SIGPIPE, exit 141).
nvcc_version="$("$PREFIX/bin/nvcc" --version 2>&1)" || true
[[ "$nvcc_version" == *"release 12.4"* ]] || { echo "cuda12_toolkit.sh: the assembled nvcc does not run: $nvcc_version" >&2; exit 1; }
ptxas_version="$("$PREFIX/ptxas-12.9/ptxas" --version 2>&1)" || true
[[ "$ptxas_version" == *"release 12.9"* ]] || { echo "cuda12_toolkit.sh: ptxas 12.9 does not run: $ptxas_version" >&2; exit 1; }
touch "$PREFIX/.complete"
echo "cuda12_toolkit.sh: assembled $PREFIX ($(du -sh "$PREFIX" | cut -f1)) in $(( $(date +%s) - T0 )) s" >&2
echo "$PREFIX/bin/nvcc"
