#!/usr/bin/env bash
# Stable-ABI check (README, Build notes): one build serves torch 2.10 and newer. A wheel of kvkernels
# is built against the torch of the project venv (2.13), installed unchanged into a second venv that
# holds the oldest supported torch (2.10.0) and nothing of the build, and run there:
# scripts/abi_smoke.py (every op against kvkernels.reference, opcheck of two ops) and
# tests/test_opcheck.py (opcheck of every op).
#
#   scripts/check_stable_abi.sh      # make test-abi
#
# PY         python that builds the wheel (default .venv/bin/python; the one `make build` uses)
# PYTHON     interpreter of the old-torch venv (default python3, >= 3.10)
# ABI_TORCH  torch version to run on (default 2.10.0)
# ABI_PIP_ARGS  extra pip arguments for installing that torch. PyPI's Linux x86-64 torch 2.10.0 is the
#            CUDA 12.8 build: 4.1 GB with its nvidia-* packages. Where download.pytorch.org is
#            reachable, ABI_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" takes the CPU
#            build instead (~200 MB; then numpy and pytest come from there too, or pass
#            --extra-index-url https://pypi.org/simple).
# The venv is kept in build-abi/ (git-ignored): a rerun only rebuilds the wheel (incremental) and
# reinstalls it.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PY=${PY:-.venv/bin/python}
PYTHON=${PYTHON:-python3}
ABI_TORCH=${ABI_TORCH:-2.10.0}
out=build-abi
venv=$out/venv-torch$ABI_TORCH
vpy=$root/$venv/bin/python
start=$(date +%s)
step() { echo "check_stable_abi: [$(( $(date +%s) - start )) s] $*"; }

built_with=$("$PY" -c 'import torch; print(torch.__version__)')
step "building the wheel against torch $built_with ($PY), CPU kernels only"
rm -rf "$out/dist"
mkdir -p "$out"
# Logged, not shown: the build output is the same as `make build`'s.
KVKERNELS_NO_CUDA=1 "$PY" -m pip wheel --no-build-isolation --no-deps -w "$out/dist" . >"$out/wheel.log" 2>&1 ||
  { tail -n 30 "$out/wheel.log"; echo "check_stable_abi: wheel build failed (log: $out/wheel.log)"; exit 1; }
wheel=$(ls "$out"/dist/kvkernels-*.whl)
step "built $(basename "$wheel")"

if [ "$(cat "$venv/.ready" 2>/dev/null)" != "$ABI_TORCH" ]; then
  step "creating $venv with torch==$ABI_TORCH (download: see ABI_PIP_ARGS above)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  # shellcheck disable=SC2086  # ABI_PIP_ARGS is a list of arguments
  "$vpy" -m pip install -q ${ABI_PIP_ARGS:-} "torch==$ABI_TORCH" numpy pytest
  echo "$ABI_TORCH" >"$venv/.ready"
fi
"$vpy" -m pip install -q --no-deps --force-reinstall "$wheel"
step "installed into $venv: torch $("$vpy" -c 'import torch; print(torch.__version__)')"

# From $out, so that nothing imports the source tree's kvkernels/ (which holds the in-place build).
cd "$out"
"$vpy" "$root/scripts/abi_smoke.py" --torch "$ABI_TORCH" --installed
step "abi_smoke passed"
"$vpy" -m pytest -q -p no:cacheprovider --rootdir "$root" "$root/tests/test_opcheck.py"
step "done: the wheel built on torch $built_with runs on torch $ABI_TORCH"
