#!/usr/bin/env bash
# `pip check` for every combination a user installs, each in a fresh venv with the CPU torch wheel:
#   qmuon | qmuon[hf] | qmuon[accelerate] | qmuon[deepspeed] | qmuon[litgpt] | qmuon-lightning |
#   qmuon-lightning + qmuon[hf]
# from the two wheels of this checkout (built here unless DIST names a folder holding them). In each:
# `pip check` exits 0; `import qmuon` works from outside the checkout; the kit (and with it Lightning,
# jsonargparse, omegaconf) is there only where it was asked for (LitGPT brings Lightning itself);
# qmuon[hf] runs the README's Hugging Face example; the kit's combinations import it and run
# `qmuon-train --help`; qmuon[litgpt] runs `qmuon-litgpt --help`.
#
# The venvs are made and filled by uv (pip would copy the 700 MB torch wheel into each of seven venvs:
# about 100 s each, against 2 s from uv's cache); the check itself is pip's own `pip check` (uv seeds pip
# into each venv). uv gets pip's configuration: its find-links, extra index URLs and constraint file.
#
#   bash .ci/pip_check.sh            # DIST=/path/with/wheels, PYTHON, TORCH_VERSION (default 2.13.0)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

command -v uv >/dev/null 2>&1 || "$PYTHON" -m pip install -q uv
UV_ARGS=(--index-strategy unsafe-best-match)  # pip's rule: the best version across every index
for link in $("$PYTHON" -m pip config get global.find-links 2>/dev/null || true); do UV_ARGS+=(--find-links "$link"); done
for url in $("$PYTHON" -m pip config get global.extra-index-url 2>/dev/null || true); do
  [[ "$url" == file://* && ! -d "${url#file://}" ]] && continue  # pip ignores a missing local index too
  UV_ARGS+=(--extra-index-url "$url")
done
constraint="$("$PYTHON" -m pip config get global.constraint 2>/dev/null || true)"
[[ -n "$constraint" && -f "$constraint" ]] && UV_ARGS+=(--constraint "$constraint")

DIST="${DIST:-}"
if [[ -z "$DIST" ]]; then
  DIST="$WORK/dist"
  for project in "$ROOT" "$ROOT/kit"; do
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DIST" "$project"
  done
fi
LIB="$(ls "$DIST"/qmuon-[0-9]*.whl)"
KIT="$(ls "$DIST"/qmuon_lightning-*.whl)"
VERSION="$(basename "$LIB" | cut -d- -f2)"
echo "wheels: $(basename "$LIB") $(basename "$KIT"); both found by version in $DIST"
Q="qmuon==$VERSION" K="qmuon-lightning==$VERSION"

# The README's Hugging Face example (the python block that builds a Trainer with QMuonFactory).
"$PYTHON" - "$ROOT/README.md" > "$WORK/hf_example.py" <<'PY'
import re, sys
blocks = re.findall(r"```python\n(.*?)```", open(sys.argv[1]).read(), re.S)
(hf,) = [b for b in blocks if "QMuonFactory" in b]
print(hf)
PY

#    name               requirements                       must be absent                            then run
CASES=(
  "qmuon|$Q|qmuon_lightning lightning jsonargparse omegaconf transformers|"
  "qmuon[hf]|qmuon[hf]==$VERSION|qmuon_lightning lightning jsonargparse omegaconf|python $WORK/hf_example.py"
  "qmuon[accelerate]|qmuon[accelerate]==$VERSION|qmuon_lightning lightning jsonargparse omegaconf|python -c 'import qmuon.integrations.accelerate'"
  "qmuon[deepspeed]|qmuon[deepspeed]==$VERSION|qmuon_lightning lightning jsonargparse omegaconf|python -c 'import deepspeed, qmuon.integrations.deepspeed'"
  "qmuon[litgpt]|qmuon[litgpt]==$VERSION|qmuon_lightning omegaconf|qmuon-litgpt --help"
  "qmuon-lightning|$K|transformers|qmuon-train --help"
  "qmuon-lightning + qmuon[hf]|$K qmuon[hf]==$VERSION||python -c 'import qmuon_lightning, transformers, trl, peft'"
)

FAILED=()
for case in "${CASES[@]}"; do
  IFS='|' read -r name reqs absent run <<<"$case"
  T=$(date +%s)
  venv="$WORK/venv"
  rm -rf "$venv"
  printf '\n==== %s\n' "$name"
  set +e
  (
    set -eo pipefail
    uv venv -q --seed -p "$PYTHON" "$venv"
    export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
    uv pip install -q "${UV_ARGS[@]}" "torch==$TORCH_VERSION"
    # shellcheck disable=SC2086
    uv pip install -q "${UV_ARGS[@]}" --find-links "$DIST" $reqs
    cd "$WORK"  # not the checkout: the installed packages must be the ones imported
    python -m pip check
    python - "$absent" <<'PY'
import importlib.util, sys, qmuon
print("qmuon", qmuon.__version__, "from", qmuon.__file__)
present = [m for m in sys.argv[1].split() if importlib.util.find_spec(m) is not None]
if present:
    sys.exit(f"FAIL: installed although not asked for: {present}")
if "/venv/" not in qmuon.__file__:
    sys.exit(f"FAIL: qmuon imported from {qmuon.__file__}")
PY
    if [[ -n "$run" ]]; then
      echo "\$ $run"
      # only the venv's commands (a console script missing from it must not be found elsewhere)
      env PATH="$venv/bin:/usr/bin:/bin" bash -c "$run" > "$WORK/run.log" 2>&1 || { tail -n 40 "$WORK/run.log"; exit 1; }
    fi
  )
  rc=$?
  set -e
  echo "$name: exit code $rc, $(( $(date +%s) - T ))s"
  [[ $rc -eq 0 ]] || FAILED+=("$name")
done

if [[ ${#FAILED[@]} -gt 0 ]]; then
  printf 'FAIL: pip check matrix: %s\n' "${FAILED[*]}" >&2
  exit 1
fi
echo "pip check matrix: all ${#CASES[@]} combinations clean"
