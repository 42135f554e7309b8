#!/usr/bin/env bash
# GPU validation of kvkernels on a CUDA machine (H100/H200), offline, in a session of <= 30 minutes:
# builds the extension with the machine's own torch and nvcc, runs the whole test suite on CUDA, runs
# the CUDA benchmark, and leaves every log and result under $OUT (default ./gpu_out).
#
#   scripts/gpu_validate.sh            # all steps: env, build, test, bench
#   scripts/gpu_validate.sh build      # one step (env | build | check | test | bench), e.g. when each
#   scripts/gpu_validate.sh test       # command of a remote session may run at most 10 minutes;
#   scripts/gpu_validate.sh bench      # the build stays in the tree between steps
#
# Environment: PYTHON (default python3), OUT, TEST_TIMEOUT (s, default 540), BENCH_TIMEOUT (default 540),
# MLA_BENCH_TIMEOUT (default 540), MLA_BENCH_ARGS (e.g. --quick),
# BENCH_ARGS (extra arguments for `python -m kvkernels bench --device cuda`, e.g. --quick),
# TESTS (test paths, default tests; e.g. "tests/test_cuda_ops.py tests/test_cache_ops.py" to split the
# suite over two commands; "tests/test_cuda_mla.py" for the MLA kernels alone), PYTEST_ARGS (extra pytest arguments, e.g. "-k cuda"), MAX_JOBS (parallel
# compile jobs, default: cores), TORCH_CUDA_ARCH_LIST (default: this GPU's, e.g. 9.0).
#
# Outputs in $OUT: env.txt, build.log, check_cuda.log, test.log (+ junit.xml), bench.log, bench_attention.log,
# bench_mla.log,
# benchmarks/results/cuda-<device>-<date>.{json,txt}, summary.txt (one line per step and its status).
# The exit status is that of the last step run; summary.txt has all of them.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env build test bench)

log() { echo "[gpu_validate $(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }

step_env() {
  {
    echo "date: $(date -Is)"
    echo "host: $(hostname)  kernel: $(uname -r)"
    echo "git: $(git rev-parse HEAD 2>/dev/null || echo 'no git') $(git status --short 2>/dev/null | wc -l) changed files"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    echo "--- nvcc"; (command -v nvcc && nvcc --version) 2>&1 || echo "nvcc: not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
    echo "--- python"; "$PYTHON" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", p.total_memory >> 20, "MiB")
from torch.utils import cpp_extension
print("CUDA_HOME", cpp_extension.CUDA_HOME)
for mod in ("pytest", "numpy", "expecttest", "hypothesis", "ninja", "matplotlib"):
    try:
        m = importlib.import_module(mod)
        print(f"module {mod}: {getattr(m, '__version__', 'ok')}")
    except Exception as e:  # noqa: BLE001
        print(f"module {mod}: MISSING ({type(e).__name__}: {e})")
EOF
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  return 0
}

step_build() {
  # Only this machine's architecture (e.g. 9.0 on H100/H200): faster than torch's default list.
  local arch
  arch=$("$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.major}.{p.minor}')" 2>/dev/null)
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch}
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS" >"$OUT/build.log"
  # In place, against the installed torch (no pip, no network); setup.py adds csrc/cuda when torch has
  # CUDA. Without ninja setup.py compiles one file at a time (too slow for a 10-minute step), so then
  # CMake builds the same sources in parallel (its module lands in kvkernels/ too).
  local start=$SECONDS ok=1
  if command -v ninja >/dev/null || "$PYTHON" -c "import ninja" 2>/dev/null || ! command -v cmake >/dev/null; then
    echo "builder: setup.py build_ext --inplace" >>"$OUT/build.log"
    "$PYTHON" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1 || ok=0
  else
    echo "builder: cmake (no ninja for setup.py)" >>"$OUT/build.log"
    rm -f kvkernels/_C*.so
    { cmake -S . -B build-gpu -DPython_EXECUTABLE="$(command -v "$PYTHON")" \
        -DCMAKE_CUDA_ARCHITECTURES="${TORCH_CUDA_ARCH_LIST//./}" &&
      cmake --build build-gpu -j "$MAX_JOBS"; } >>"$OUT/build.log" 2>&1 || ok=0
  fi
  if [ $ok = 0 ]; then
    echo "build failed after $((SECONDS - start)) s"; tail -50 "$OUT/build.log"; return 1
  fi
  echo "built in $((SECONDS - start)) s"
  # ptxas register / spill report of the CUDA kernels as built (from -Xptxas=-v).
  grep -E "Compiling entry|registers|spill" "$OUT/build.log" >"$OUT/ptxas.txt" || true
  "$PYTHON" -m kvkernels info 2>&1 | tee -a "$OUT/build.log"
  "$PYTHON" -c "import torch, kvkernels; assert all(torch._C._dispatch_has_kernel_for_dispatch_key('kvkernels::' + op, 'CUDA') for op in ('copy_blocks', 'paged_attention', 'mla_decompress', 'mla_paged_attention')), 'CUDA kernels missing from the build'"
}

step_check() {  # the CI compile gate, also here (nvcc of this machine)
  NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")} scripts/check_cuda.sh \
    >"$OUT/check_cuda.log" 2>&1
  local rc=$?
  cat "$OUT/check_cuda.log"
  return $rc
}

step_test() {
  local start=$SECONDS rc
  # -rs lists every skip with its reason; CUDA tests must not skip here for want of a device.
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-540}" "$PYTHON" -m pytest ${TESTS:-tests} -q -rs --continue-on-collection-errors \
    --junitxml="$OUT/junit.xml" ${PYTEST_ARGS:-} >"$OUT/test.log" 2>&1
  rc=$?
  tail -40 "$OUT/test.log"
  [ $rc -eq 124 ] && echo "tests stopped by the ${TEST_TIMEOUT:-540} s timeout"
  echo "tests took $((SECONDS - start)) s (exit $rc)"
  grep -c "needs a CUDA device" "$OUT/test.log" | xargs -I{} echo "skip lines saying 'needs a CUDA device': {}"
  return $rc
}

step_bench() {
  local start=$SECONDS rc
  mkdir -p "$OUT/benchmarks/results"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-540}" "$PYTHON" -m kvkernels bench --device cuda --out "$OUT/benchmarks/results" \
    ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  rc=$?
  cat "$OUT/bench.log" | tail -60
  # The attention cases have their own entry point (kvkernels/bench/cuda_attention.py), not yet wired
  # into the suite above: run it too, with its rows as JSON next to the suite's results.
  timeout "${ATTN_BENCH_TIMEOUT:-540}" "$PYTHON" -m kvkernels.bench.cuda_attention \
    --json "$OUT/benchmarks/results/cuda-attention-$(date +%Y%m%d-%H%M%S).json" >"$OUT/bench_attention.log" 2>&1
  local rc_attn=$?
  tail -60 "$OUT/bench_attention.log"
  # The MLA cases (kvkernels/bench/cuda_mla.py: absorbed decode vs copy bandwidth, mla_decompress vs a
  # torch matmul of the same shape), also their own entry point.
  timeout "${MLA_BENCH_TIMEOUT:-540}" "$PYTHON" -m kvkernels.bench.cuda_mla ${MLA_BENCH_ARGS:-} \
    --json "$OUT/benchmarks/results/cuda-mla-$(date +%Y%m%d-%H%M%S).json" >"$OUT/bench_mla.log" 2>&1
  local rc_mla=$?
  tail -60 "$OUT/bench_mla.log"
  echo "benchmark took $((SECONDS - start)) s (exit $rc, attention $rc_attn, mla $rc_mla)"
  [ $rc -ne 0 ] && return $rc
  [ $rc_attn -ne 0 ] && return $rc_attn
  return $rc_mla
}

for step in "${STEPS[@]}"; do
  case "$step" in
    env | build | check | test | bench) ;;
    *) echo "unknown step '$step' (env | build | check | test | bench)"; exit 2 ;;
  esac
done
status=0
for step in "${STEPS[@]}"; do
  log "step $step: start"
  "step_$step"
  status=$?
  log "step $step: exit $status"
done
exit $status
