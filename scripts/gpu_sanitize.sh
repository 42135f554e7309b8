#!/usr/bin/env bash
# compute-sanitizer on a handful of small attention / MLA cases: the second, shorter command of a GPU
# session (the rerun slot, ~2-3 minutes), best run right after scripts/gpu_validate.sh while the machine
# is still warm, so that the build in the tree is reused (without one it builds first, ~1.5 min).
#
#   device tool:  command "bash scripts/gpu_sanitize.sh", timeout_s 240 (BUDGET default 170 s)
#   here (no GPU): DRY_RUN=1 bash scripts/gpu_sanitize.sh   (no sanitizer: the same pytest runs without
#                 it, every case skips; exercises the steps, summary and $OUT)
#
# Steps (each under its own cap and the shared deadline, as in gpu_validate.sh):
#   env        torch, the device, compute-sanitizer's path and version
#   build      only when the tree has no CUDA build (TORCH_CUDA_ARCH_LIST=9.0a, MAX_JOBS=16)
#   racecheck  shared-memory hazards: every case of scripts/gpu_sanitize_cases.txt
#   synccheck  barrier misuse (divergent __syncthreads, bar.sync / mbarrier errors): the same cases
#   memcheck   out-of-bounds / misaligned accesses: the cases marked memcheck (rows that are not 16-byte
#              aligned: the plain-load fallbacks), with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that each
#              tensor is its own allocation and an access past its end is caught
# Only kvkernels' kernels are instrumented (--kernel-name kns=kvkernels); the tests still compare with the
# float64 reference. A sanitizer error makes the step fail (--error-exitcode 86); its report is in
# sanitize.log.
#
# $OUT: summary.txt, env.txt, build.log (when it built), sanitize.log (every run, one section each),
# results.tar.gz (junit-<step>.xml). Environment: BUDGET, OUT, PYTHON, DRY_RUN=1, SANITIZER (path of
# compute-sanitizer), CAP_<step>, GRACE, MIN_STEP.
set -u
BUDGET=${BUDGET:-170}
# shellcheck source=scripts/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"
gpu_init gpu_sanitize
CASES_FILE=scripts/gpu_sanitize_cases.txt
mapfile -t ALL_CASES < <(grep -vE '^\s*(#|$)' "$CASES_FILE" | awk '{print $1}')
mapfile -t MEM_CASES < <(grep -vE '^\s*(#|$)' "$CASES_FILE" | awk '$2 == "memcheck" {print $1}')

find_sanitizer() {
  local c
  for c in "${SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
    /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer /opt/nvidia/*/compute-sanitizer; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

# Options this compute-sanitizer knows (its --help is read once): SAN_FILTER instruments kvkernels'
# kernels only (--kernel-name in recent versions, --kernel-regex before).
san_has() { grep -q -- "$1" "$SCRATCH/sanitizer-help.txt" 2>/dev/null; }

step_env() {
  SANITIZER=$(find_sanitizer) || SANITIZER=""
  SAN_FILTER=()
  if [ -n "$SANITIZER" ]; then
    capped "$SANITIZER" --help >"$SCRATCH/sanitizer-help.txt" 2>&1
    if san_has "--kernel-name "; then SAN_FILTER=(--kernel-name kns=kvkernels)
    elif san_has "--kernel-regex "; then SAN_FILTER=(--kernel-regex kns=kvkernels); fi
  fi
  {
    echo "date: $(date -Is)  host: $(hostname)  git: $(git rev-parse HEAD 2>/dev/null || echo 'no git')"
    capped nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi: not available"
    echo "compute-sanitizer: ${SANITIZER:-MISSING} $([ -n "$SANITIZER" ] && "$SANITIZER" --version 2>&1 | tail -1)"
    echo "kernel filter: ${SAN_FILTER[*]:-none (all kernels instrumented)}"
    capped "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1
    echo "cases: ${#ALL_CASES[@]} (memcheck: ${#MEM_CASES[@]})"
  } >"$OUT/env.txt" 2>&1
  STEP_DETAIL=$(grep -E "^(torch|compute-sanitizer|cases)" "$OUT/env.txt" | tr '\n' ';')
  if [ "$DRY_RUN" = 1 ]; then return 0; fi
  [ -n "$SANITIZER" ] && grep -q "available True" "$OUT/env.txt"
}

has_cuda_build() {
  "$PYTHON" -c "import sys, torch, kvkernels; sys.exit(0 if all(torch._C._dispatch_has_kernel_for_dispatch_key('kvkernels::' + op, 'CUDA') for op in ('paged_attention', 'mla_paged_attention', 'mla_decompress')) else 1)" 2>/dev/null
}

step_build() {
  if [ "$DRY_RUN" = 1 ] || has_cuda_build; then
    STEP_DETAIL="$([ "$DRY_RUN" = 1 ] && echo 'DRY_RUN: not built' || echo 'the CUDA build in the tree is used')"
    return "$GPU_SKIP"
  fi
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS $(date -Is)" >"$OUT/build.log"
  capped "$PYTHON" setup.py build_ext --inplace >>"$OUT/build.log" 2>&1
  local rc=$?
  STEP_DETAIL="$(grep -c "Compiling entry function" "$OUT/build.log") kernels compiled"
  return $rc
}

# sanitize TOOL [OPTION VALUE]... -- CASES...: pytest on CASES under compute-sanitizer --tool TOOL; an
# OPTION this compute-sanitizer does not list is left out (and said so).
sanitize() {
  local tool=$1 opts=() dropped="" rc offset
  shift
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    if san_has "$1 "; then opts+=("$1" "$2"); else dropped="$dropped $1"; fi
    shift 2
  done
  shift
  if [ "$DRY_RUN" = 1 ]; then  # the same pytest run without the sanitizer
    pytest_step sanitize.log "$@"
    rc=$?
    STEP_DETAIL="dry run, no sanitizer: $STEP_DETAIL"
    return $rc
  fi
  [ -z "${SANITIZER:-}" ] && { STEP_DETAIL="no compute-sanitizer found"; return 1; }
  offset=$(stat -c %s "$OUT/sanitize.log" 2>/dev/null || echo 0)
  PYTEST_PREFIX=("$SANITIZER" --tool "$tool" ${SAN_FILTER[@]+"${SAN_FILTER[@]}"} --error-exitcode 86 --print-limit 20
                 ${opts[@]+"${opts[@]}"})
  pytest_step sanitize.log "$@"
  rc=$?
  unset PYTEST_PREFIX
  local report
  report=$(tail -c +$((offset + 1)) "$OUT/sanitize.log" | grep -E "(ERROR|RACECHECK|SYNCCHECK) SUMMARY" | tail -1 |
    sed 's/^=* *//')
  STEP_DETAIL="$STEP_DETAIL; ${report:-no sanitizer summary line}${dropped:+; options not known here:$dropped}"
  [ $rc -eq 86 ] && STEP_DETAIL="sanitizer errors; $STEP_DETAIL"
  return $rc
}

step_racecheck() { sanitize racecheck --racecheck-report all -- "${ALL_CASES[@]}"; }
step_synccheck() { sanitize synccheck -- "${ALL_CASES[@]}"; }
step_memcheck() {
  local rc
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  sanitize memcheck --leak-check no -- "${MEM_CASES[@]}"
  rc=$?
  unset PYTORCH_NO_CUDA_MEMORY_CACHING
  return $rc
}

PLAN="env 20
build 150
racecheck 75
synccheck 45
memcheck 40"
while read -r name cap; do
  override="CAP_$name"
  run_step "$name" "${!override:-$cap}" "step_$name"
done <<<"$PLAN"
gpu_finish
status=$?
cat "$OUT/summary.txt"
exit $status
