#!/usr/bin/env bash
# The Python packages benchmarks/gpu_check.sh needs that the lent GPU machine lacks, as wheels for its
# Python (3.12, x86-64), fetched here (that machine has no network) into an ignored folder that the
# device tool carries beside the prebuilt library:
#
#   bash benchmarks/gpu_wheels.sh                  # -> .gpu_wheels/ (ignored by .gitignore)
#   bash benchmarks/gpu_wheels.sh DIR              # elsewhere
#
# That machine already has torch (2.11, CUDA 13), lightning, transformers, accelerate, peft, pytest,
# ninja, tensorboard, PyYAML and typing-extensions (/work/.library/device/KINDS.md). What qmuon_lightning
# imports beyond them is qmuon-train's parser: jsonargparse[signatures] (>= 4.53, pyproject.toml) with
# its two extra needs docstring-parser and typeshed-client (which needs typing-extensions only), and
# omegaconf (>= 2.3; 2.4 needs PyYAML only, no antlr4). All four are pure-Python wheels (about 1.3 MB).
# Each is fetched without its dependencies (--no-deps): nothing here may pull a second torch, and
# gpu_check.sh --wheels installs them the same way (pip --no-index --no-deps --target).
# Override the list with GPU_WHEELS="name==version ..." (one version of each: two stop the install).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$REPO/.gpu_wheels}"
PY="${PYTHON:-python3}"
PKGS=(${GPU_WHEELS:-jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 omegaconf==2.4.0})

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DEST" "${PKGS[@]}"
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels in $DEST ($(du -sh "$DEST" | cut -f1)):"
ls -l "$DEST"/*.whl | awk '{print "  " $5 "  " $NF}'
for w in "$DEST"/*.whl; do  # a dependency that is neither carried nor on the GPU machine would fail there
    unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed "s|^|  $(basename "$w"): |" || true
done
