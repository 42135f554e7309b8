#!/usr/bin/env bash
# make ort: build-ort/libkvkernels_ort.so, the kvkernels CPU kernels as ONNX Runtime custom ops
# (csrc/ort/, docs/onnx.md), from the same kernel sources as the torch extension.
#
# - Headers: ONNX Runtime's C/C++ API headers are not in the PyPI onnxruntime wheel. They come from
#   Debian's libonnxruntime-dev (trixie, 1.21.0+dfsg-1: ORT API 21, which every onnxruntime from 1.21
#   on accepts), downloaded from the Debian archive by exact version, checked against the sha256
#   below, and unpacked (headers only, never installed: its runtime library needs a newer libc) into
#   build-ort/include. Nothing is vendored. ORT_DEB=<path> uses a copy of that .deb already on disk
#   (still checked).
# - Compile: the torch-free kernel sources (csrc/cpu/attention_<isa>.cpp, rows_<isa>.cpp, isa.cpp, with
#   run-time ISA dispatch as in the torch extension), csrc/index_checks.cpp and csrc/ort/*.cpp, with
#   setup.py's flags. The only torch headers used are torch/headeronly (BFloat16 / Half conversions,
#   csrc/cpu/convert.h), from the python in $PY. No libtorch, no libonnxruntime: ORT passes its API
#   table to RegisterCustomOps at load time.
# - Incremental: objects and header dependencies (-MMD) in build-ort/obj, rebuilt by make.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=build-ort

ORT_DEB_NAME=libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb
ORT_DEB_URL=${ORT_DEB_URL:-https://deb.debian.org/debian/pool/main/o/onnxruntime/$ORT_DEB_NAME}
ORT_DEB_SHA256=14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08

mkdir -p "$OUT"
if [ ! -f "$OUT/include/.sha256-$ORT_DEB_SHA256" ]; then
  deb=$OUT/$ORT_DEB_NAME
  if [ -n "${ORT_DEB:-}" ]; then
    cp "$ORT_DEB" "$deb"
  elif [ ! -f "$deb" ]; then
    echo "build_ort: downloading $ORT_DEB_URL" >&2
    curl -sSfL --retry 3 -o "$deb.part" "$ORT_DEB_URL"
    mv "$deb.part" "$deb"
  fi
  if ! echo "$ORT_DEB_SHA256  $deb" | sha256sum -c --quiet -; then
    echo "build_ort: $deb does not have the pinned sha256 $ORT_DEB_SHA256" >&2
    rm -f "$deb"
    exit 1
  fi
  rm -rf "$OUT/include" "$OUT/deb"
  mkdir -p "$OUT/deb" "$OUT/include"
  dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$OUT/deb" ./usr/include/onnxruntime
  mv "$OUT/deb/usr/include/onnxruntime" "$OUT/include/onnxruntime"
  rm -rf "$OUT/deb"
  touch "$OUT/include/.sha256-$ORT_DEB_SHA256"
fi

TORCH_INCLUDE=$("$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
[ -f "$TORCH_INCLUDE/torch/headeronly/util/BFloat16.h" ] || {
  echo "build_ort: no torch/headeronly under $TORCH_INCLUDE" >&2; exit 1; }

exec make --no-print-directory -f scripts/ort.mk -j"${MAX_JOBS:-2}" OUT="$OUT" TORCH_INCLUDE="$TORCH_INCLUDE" \
  ORT_INCLUDE="$OUT/include/onnxruntime"
