#!/usr/bin/env bash
# FlashInfer for the GPU machine, which has no registry: a pinned FlashInfer with the kernel modules the CUDA
# attention benchmark's FlashInfer rows use (kvkernels/bench/flashinfer_peer.py) compiled ahead of time for
# sm_90a, as one tarball that scripts/gpu_validate.sh unpacks and puts on the path.
#
#   bash scripts/flashinfer_bundle.sh        # -> .whl/flashinfer-bundle-<version>-sm90a.tar.gz (~25 MB)
#
# Run here, on a development machine (nvcc 13.0, no GPU needed; ~1 CPU-hour: FlashInfer's prefill modules are
# 8-10 CUTLASS units each). Steps: download the pinned wheels (FlashInfer and the one dependency the GPU
# image lacks, apache-tvm-ffi; the rest of its imports are in that image), install them into a scratch
# site, compile each module with FlashInfer's own JIT for sm_90a (linking against a libcuda stub: this
# machine has no driver; the real libcuda.so.1 resolves the symbols there), place each .so where FlashInfer
# looks for ahead-of-time modules (flashinfer/data/aot/<name>/<name>.so: loaded without its sources), drop
# the sources (csrc, CUTLASS, CCCL: only the compiler needs them) and pack the site. The bundle is fetched
# code: it stays in the git-ignored .whl/ and is never committed.
#
# WORK=<dir> keeps the downloads and the compiled modules between runs (default build-flashinfer/): a second
# run recompiles nothing. The tvm-ffi ABI the modules are built against is the bundled tvm-ffi's, not torch's,
# so the torch here (2.13, CPU) and there (2.11 + CUDA 13) need not match.
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHINFER_VERSION=0.7.4
TVM_FFI_VERSION=0.1.15.post2
CURAND_VERSION=10.4.5.25   # headers only: CUTLASS's util headers that FlashInfer's FA3 units include want curand_kernel.h
PY=${PY:-.venv/bin/python}
WORK=$(realpath -m "${WORK:-build-flashinfer}")
OUT=.whl/flashinfer-bundle-$FLASHINFER_VERSION-sm90a.tar.gz
# The toolkit's root (FlashInfer links against $CUDA_HOME/lib64; nvcc on the PATH may be a wrapper script)
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")"; do
    if [ -x "$d/bin/nvcc" ] && [ -d "$d/lib64" ]; then CUDA_HOME=$d; break; fi
  done
fi
[ -n "${CUDA_HOME:-}" ] || { echo "flashinfer_bundle: no CUDA toolkit (set CUDA_HOME)" >&2; exit 1; }
NVCC=$CUDA_HOME/bin/nvcc
mkdir -p "$WORK/wheels" .whl

pip_get() { "$PY" -m pip download -q --no-deps -d "$WORK/wheels" "$@"; }
[ -n "$(ls "$WORK"/wheels/flashinfer_python-$FLASHINFER_VERSION-*.whl 2>/dev/null)" ] || pip_get "flashinfer-python==$FLASHINFER_VERSION"
[ -n "$(ls "$WORK"/wheels/apache_tvm_ffi-$TVM_FFI_VERSION-*.whl 2>/dev/null)" ] || \
  pip_get --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "apache-tvm-ffi==$TVM_FFI_VERSION"
[ -n "$(ls "$WORK"/wheels/nvidia_curand-$CURAND_VERSION-*.whl 2>/dev/null)" ] || \
  pip_get --only-binary=:all: --platform manylinux_2_27_x86_64 "nvidia-curand==$CURAND_VERSION"

# The compile site: FlashInfer + tvm-ffi for this machine's python (tvm-ffi for the GPU image's 3.12 goes
# into the bundle below); the light pure-python imports FlashInfer needs at import time, which the GPU
# image has (requests, click, einops, tabulate, tqdm, packaging, nvidia-ml-py, ninja).
if [ ! -d "$WORK/site/flashinfer" ]; then
  "$PY" -m pip install -q --no-deps --target "$WORK/site" "$WORK"/wheels/flashinfer_python-$FLASHINFER_VERSION-*.whl
  "$PY" -m pip install -q --target "$WORK/site" "apache-tvm-ffi==$TVM_FFI_VERSION" requests click einops tabulate tqdm \
    packaging nvidia-ml-py ninja
fi
if [ ! -f "$WORK/curand/nvidia/cu13/include/curand_kernel.h" ]; then
  (cd "$WORK" && mkdir -p curand && cd curand && unzip -q -o ../wheels/nvidia_curand-$CURAND_VERSION-*.whl 'nvidia/cu13/include/*')
fi
mkdir -p "$WORK/stub"
[ -f "$WORK/stub/libcuda.so" ] || { echo 'void kvkernels_libcuda_stub(void) {}' >"$WORK/stub/s.c";
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$WORK/stub/libcuda.so" "$WORK/stub/s.c"; }

# Compile the modules (FlashInfer's JIT; MAX_JOBS units at a time) and list their .so files.
PYTHONPATH="$WORK/site" FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$WORK/jit" CUDA_HOME="$CUDA_HOME" \
  PATH="$(dirname "$NVCC"):$PATH" LIBRARY_PATH="$WORK/stub" MAX_JOBS=${MAX_JOBS:-2} \
  FLASHINFER_EXTRA_CUDAFLAGS="-I$WORK/curand/nvidia/cu13/include" \
  "$PY" - "$WORK/modules.txt" <<'EOF'
import sys, time, torch
from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
bf16, e4m3, i32 = torch.bfloat16, torch.float8_e4m3fn, torch.int32
# What the benchmark's FlashInfer rows load at head dim 128, bfloat16 queries (flashinfer_peer.py):
specs = [
    gen_batch_decode_module(bf16, bf16, bf16, i32, 128, 128, 0, False, False),         # CUDA-core decode
    gen_batch_decode_module(bf16, e4m3, bf16, i32, 128, 128, 0, False, False),         # ... over an e4m3 cache
    gen_batch_prefill_module("fa2", bf16, bf16, bf16, i32, 128, 128, 0, False, False, False),  # tensor-core decode
    gen_batch_prefill_module("fa2", bf16, e4m3, bf16, i32, 128, 128, 0, False, False, False),  # ... e4m3 cache
    gen_batch_prefill_module("fa3", bf16, bf16, bf16, i32, 128, 128, 0, False, False, False),  # FA3 prefill
]
with open(sys.argv[1], "w") as listing:
    for spec in specs:
        t = time.time()
        spec.build()
        print(f"flashinfer_bundle: {spec.name} ({time.time() - t:.0f} s)", flush=True)
        listing.write(f"{spec.name} {spec.get_library_path()}\n")
EOF

# The bundle: FlashInfer without its sources, the modules as ahead-of-time ones, tvm-ffi for python 3.12.
rm -rf "$WORK/bundle" && mkdir -p "$WORK/bundle"
cp -r "$WORK/site/flashinfer" "$WORK/bundle/"
# (data/csrc's top-level files stay: FlashInfer renders its module specs from those templates and sources
# before it looks for an ahead-of-time module; ~13 MB, 2 MB packed)
rm -rf "$WORK"/bundle/flashinfer/data/{cutlass,cccl,include,spdlog}
find "$WORK/bundle/flashinfer/data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
find "$WORK/bundle/flashinfer" -type d \( -name kernel_src -o -name __pycache__ \) -prune -exec rm -rf {} +
find "$WORK/bundle/flashinfer" -mindepth 2 -type d -name csrc -not -path "*/flashinfer/data/csrc" -prune -exec rm -rf {} +
while read -r name path; do
  mkdir -p "$WORK/bundle/flashinfer/data/aot/$name"
  cp "$path" "$WORK/bundle/flashinfer/data/aot/$name/$name.so"
done <"$WORK/modules.txt"
(cd "$WORK/bundle" && unzip -q -o "$WORK"/wheels/apache_tvm_ffi-$TVM_FFI_VERSION-*.whl)
tar czf "$OUT" -C "$WORK/bundle" .
echo "flashinfer_bundle: $OUT ($(du -h "$OUT" | cut -f1)), modules:"
sed 's/ .*//; s/^/  /' "$WORK/modules.txt"
