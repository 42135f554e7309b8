#!/usr/bin/env bash
# make jax: the kvkernels.jax XLA FFI libraries (csrc/jax/, docs/jax.md) from the same kernel sources
# as the torch extension and the ONNX Runtime library:
#   build-jax/libkvkernels_jax.so       CPU: the kernels of csrc/cpu/ with their run-time ISA dispatch
#   build-jax/libkvkernels_jax_cuda.so  CUDA: the kernels of csrc/cuda/ (when nvcc is found; JAX_CUDA=0
#                                       skips it, JAX_CUDA=1 makes a missing nvcc an error)
# Headers: XLA's FFI API from the installed jaxlib (jax.ffi.include_dir()); torch/headeronly
# (BFloat16 / Half conversions of csrc/cpu/convert.h) from the python in $PY, as build_ort.sh does.
# Nothing of libtorch or jaxlib is linked: XLA passes its API to the handlers at call time.
# JAX_OPTIONAL=1: exit 0 with a message when jax is not installed (make test on a venv without jax).
# Arguments: make targets of scripts/jax.mk (default: the libraries; cuda-handlers: compile the CUDA
# handlers only, make jax-cuda-check).
# Incremental: objects and header dependencies in build-jax/obj, build-jax/cuda-obj.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=build-jax

if ! JAX_INCLUDE=$("$PY" -c "import jax.ffi; print(jax.ffi.include_dir())" 2>/dev/null); then
  if [ "${JAX_OPTIONAL:-0}" = 1 ]; then
    echo "build_jax: jax is not installed in $PY: skipping the kvkernels.jax libraries" >&2
    exit 0
  fi
  echo "build_jax: jax is not installed in $PY (pip install -c requirements/lock.txt jax jaxlib)" >&2
  exit 1
fi
[ -f "$JAX_INCLUDE/xla/ffi/api/ffi.h" ] || { echo "build_jax: no xla/ffi/api/ffi.h under $JAX_INCLUDE" >&2; exit 1; }
TORCH_INCLUDE=$("$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
[ -f "$TORCH_INCLUDE/torch/headeronly/util/BFloat16.h" ] || {
  echo "build_jax: no torch/headeronly under $TORCH_INCLUDE" >&2; exit 1; }

CUDA=0
NVCC=${NVCC:-$(command -v nvcc || true)}
if [ "${JAX_CUDA:-auto}" != 0 ]; then
  if [ -n "$NVCC" ] && [ -x "$NVCC" ]; then
    CUDA=1
  elif [ "${JAX_CUDA:-auto}" = 1 ]; then
    echo "build_jax: JAX_CUDA=1 but no nvcc found (NVCC / PATH)" >&2
    exit 1
  fi
fi

mkdir -p "$OUT"
# JAX_CUDA_ARCHS: nvcc's -gencode flags (default sm_80 and sm_90a, as make cuda-check).
exec make --no-print-directory -f scripts/jax.mk -j"${MAX_JOBS:-2}" OUT="$OUT" JAX_INCLUDE="$JAX_INCLUDE" \
  TORCH_INCLUDE="$TORCH_INCLUDE" CUDA="$CUDA" NVCC="${NVCC:-nvcc}" \
  ${JAX_CUDA_ARCHS:+"CUDA_ARCHS=$JAX_CUDA_ARCHS"} "$@"
