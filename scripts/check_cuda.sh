#!/usr/bin/env bash
# Compile every CUDA source (csrc/cuda/*.cu) with nvcc for sm_80 and sm_90a, without torch (the
# kernels are torch-free templates, DESIGN.md §5), and fail on compile errors or on any register
# spill / local-memory use reported by ptxas. Arguments: files to check instead of csrc/cuda/*.cu.
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
for src in "${sources[@]}"; do
  for arch in sm_80 sm_90a; do
    log="$out/$(basename "$src" .cu).$arch.log"
    if ! "$NVCC" -std=c++17 -O3 -arch="$arch" -Icsrc/include -Xptxas -v -c "$src" \
         -o "$out/$(basename "$src" .cu).$arch.o" >"$log" 2>&1; then
      echo "FAIL $src ($arch): compile error"; cat "$log"; status=1; continue
    fi
    if grep -E "[1-9][0-9]* bytes spill (stores|loads)|[1-9][0-9]* bytes stack frame" "$log" >/dev/null; then
      echo "FAIL $src ($arch): register spills / local memory"; grep -E "spill|stack frame" "$log"
      status=1
    else
      echo "ok   $src ($arch)"
    fi
  done
done
exit $status
