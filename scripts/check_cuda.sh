#!/usr/bin/env bash
# Compile every CUDA source (csrc/cuda/*.cu) with nvcc for sm_80 and sm_90a (*_sm90_*.cu: sm_90a only), without torch (the
# kernels are torch-free templates, docs/design.md §10), and fail on compile errors or on any register
# spill / local-memory use reported by ptxas. Arguments: files to check instead of csrc/cuda/*.cu.
# PTXAS_LOG_DIR=<dir>: keep each compile's log (the ptxas -v register report) there as <file>.<arch>.log.
# Without arguments it also compiles the CUDA bindings (csrc/cuda/*.cpp, host C++ with -DUSE_CUDA)
# with -fsyntax-only against the headers of the torch that $PYTHON imports (skipped, with a note, when
# there is none: a CPU-only torch has every header they use).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
shopt -s nullglob
if [ $# -gt 0 ]; then sources=("$@"); else sources=(csrc/cuda/*.cu); fi
if [ ${#sources[@]} -eq 0 ]; then
  echo "check_cuda: no CUDA sources in csrc/cuda yet; nothing to compile"
  exit 0
fi
[ -x "$NVCC" ] || { echo "check_cuda: nvcc not found" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
# The compiles (one nvcc per source and architecture, single-threaded) run CHECK_JOBS at a time (default:
# the CPU count; CI's 2 CPUs halve the ~13 minutes), each into its own log; the report below reads
# them in order once all have finished.
jobs_max=${CHECK_JOBS:-$(nproc 2>/dev/null || echo 1)}
# The Hopper units (*_sm90_*.cu: wgmma, setmaxnreg, ...) have kernel bodies for sm_90a only (an empty
# stub elsewhere): compiled for sm_90a alone.
archs_of() { case "$1" in *_sm90_*) echo sm_90a ;; *) echo sm_80 sm_90a ;; esac; }
for src in "${sources[@]}"; do
  for arch in $(archs_of "$src"); do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
    base="$out/$(basename "$src" .cu).$arch"
    ( if "$NVCC" -std=c++17 -O3 -arch="$arch" -Icsrc/include -Xptxas -v -c "$src" -o "$base.o" \
           >"$base.log" 2>&1; then echo 0 >"$base.rc"; else echo 1 >"$base.rc"; fi ) &
  done
done
wait
for src in "${sources[@]}"; do
  for arch in $(archs_of "$src"); do
    log="$out/$(basename "$src" .cu).$arch.log"
    if [ "$(cat "$out/$(basename "$src" .cu).$arch.rc" 2>/dev/null)" != 0 ]; then
      echo "FAIL $src ($arch): compile error"; cat "$log"; status=1; continue
    fi
    if [ -n "${PTXAS_LOG_DIR:-}" ]; then mkdir -p "$PTXAS_LOG_DIR" && cp "$log" "$PTXAS_LOG_DIR/"; fi
    if grep -E "[1-9][0-9]* bytes spill (stores|loads)|[1-9][0-9]* bytes stack frame" "$log" >/dev/null; then
      echo "FAIL $src ($arch): register spills / local memory"; grep -E "spill|stack frame" "$log"
      status=1
    else
      echo "ok   $src ($arch)"
    fi
  done
done
if [ $# -eq 0 ]; then
  PYTHON=${PYTHON:-$(command -v python3 || true)}
  torch_inc=$("${PYTHON:-false}" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))" 2>/dev/null || true)
  py_inc=$("${PYTHON:-false}" -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null || true)
  cuda_inc=""
  for dir in ${CUDA_HOME:+"$CUDA_HOME"} "$(dirname "$(dirname "$(readlink -f "$NVCC")")")" /usr/local/cuda; do
    if [ -f "$dir/include/cuda_runtime_api.h" ]; then cuda_inc=$dir/include; break; fi
  done
  if [ -z "$torch_inc" ]; then
    echo "skip csrc/cuda/*.cpp: no torch importable by PYTHON=${PYTHON:-<none>}"
  elif [ -z "$cuda_inc" ]; then
    echo "skip csrc/cuda/*.cpp: no cuda_runtime_api.h next to $NVCC (set CUDA_HOME)"
  else
    for src in csrc/cuda/*.cpp; do
      if ${CXX:-c++} -std=c++17 -fsyntax-only -Wall -DUSE_CUDA -DTORCH_TARGET_VERSION=0x020a000000000000 \
           -Icsrc -Icsrc/include -I"$torch_inc" -I"$cuda_inc" -I"$py_inc" "$src" >"$out/cpp.log" 2>&1; then
        echo "ok   $src (host C++, -DUSE_CUDA)"
      else
        echo "FAIL $src (host C++, -DUSE_CUDA)"; cat "$out/cpp.log"; status=1
      fi
    done
  fi
fi
exit $status
