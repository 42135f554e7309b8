# Shared by scripts/gpu_validate.sh and scripts/gpu_sanitize.sh (sourced, not run): one deadline for the
# whole command, steps run under it, a summary line per step, and $OUT kept within what the device tool
# brings back (at most 8 files, 16 MiB each, no deeper than $OUT/a/b/file, names of [A-Za-z0-9._-]).
#
# A script sets BUDGET (seconds for the whole command) and calls gpu_init NAME; then each
#   run_step NAME CAP FUNCTION [ARGS...]
# runs FUNCTION under a limit of min(CAP, time left - GRACE) seconds, or skips it when that is under
# MIN_STEP seconds. Inside FUNCTION, commands run through `capped` (timeout -s INT -k GRACE with what
# is left of the step's limit): SIGINT first, so pytest still prints its summary and writes its junit
# XML; SIGKILL GRACE seconds later if the command is stuck (a hung kernel blocks the interpreter).
# FUNCTION may set STEP_DETAIL (appended to its summary line) and return GPU_SKIP (a status of its
# own, not a failure). Each step's line is appended to $OUT/summary.txt as the step ends, so a run cut
# short still returns what it did; gpu_finish writes the last line and enforces the $OUT limits.
#
# Environment: OUT (default ./gpu_out), PYTHON (default python3), BUDGET, GRACE (default 10),
# MIN_STEP (default 10), DRY_RUN=1 (no GPU expected: CUDA tests skip, nothing is built).

GPU_SKIP=200

gpu_init() {  # NAME: the script's name, for messages
  GPU_NAME=$1
  ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  cd "$ROOT" || exit 2
  PYTHON=${PYTHON:-python3}
  GRACE=${GRACE:-10}
  MIN_STEP=${MIN_STEP:-10}
  DRY_RUN=${DRY_RUN:-0}
  OUT=${OUT:-$ROOT/gpu_out}
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
  # A fresh start where an earlier run left its files (the device tool empties $OUT anyway).
  rm -f "$OUT"/{summary.txt,env.txt,build.log,tests.log,bench.log,sanitize.log,results.tar.gz,overflow.tar.gz}
  SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/$GPU_NAME.XXXXXX")
  mkdir -p "$SCRATCH/results"
  T0=$SECONDS
  DEADLINE=$((T0 + BUDGET))
  N_OK=0 N_FAIL=0 N_TIMEOUT=0 N_SKIP=0
  export PYTHONUNBUFFERED=1
  # The interpreter's own bin folder (a venv's ninja, cmake, pytest live there) on PATH.
  local pybin
  pybin=$("$PYTHON" -c "import os, sys; print(os.path.dirname(sys.executable))" 2>/dev/null) &&
    [ -n "$pybin" ] && PATH="$pybin:$PATH"
  gpu_say "$GPU_NAME: budget ${BUDGET}s, OUT=$OUT$( [ "$DRY_RUN" = 1 ] && echo ', DRY RUN (no GPU expected)')"
}

elapsed() { echo $((SECONDS - T0)); }

gpu_say() {  # a line to stdout and summary.txt
  local line
  line=$(printf '[+%4ss] %s' "$(elapsed)" "$*")
  echo "$line"
  echo "$line" >>"$OUT/summary.txt"
}

# capped CMD...: CMD under timeout -s INT -k GRACE with what is left of the current step's limit.
capped() {
  local rem=$((STEP_END - SECONDS))
  [ $rem -lt 1 ] && return 124
  timeout -s INT -k "$GRACE" "$rem" "$@"
}

# run_step NAME CAP FUNCTION [ARGS...]
run_step() {
  local name=$1 cap=$2 func=$3 rc status
  shift 3
  local remaining=$((DEADLINE - SECONDS))
  local limit=$((remaining - GRACE))
  [ $limit -gt "$cap" ] && limit=$cap
  if [ $limit -lt "$MIN_STEP" ]; then
    N_SKIP=$((N_SKIP + 1))
    gpu_say "$(printf '%-16s %-8s %s' "$name" SKIPPED "deadline: ${remaining}s left (cap ${cap}s; a step needs ${MIN_STEP}s + ${GRACE}s grace)")"
    return 0
  fi
  STEP_NAME=$name STEP_LIMIT=$limit STEP_END=$((SECONDS + limit)) STEP_DETAIL=""
  local start=$SECONDS
  echo "[+$(printf '%4s' "$(elapsed)")s] $name: start (limit ${limit}s of cap ${cap}s)"
  "$func" "$@" </dev/null
  rc=$?
  case $rc in
    0) status=ok; N_OK=$((N_OK + 1)) ;;
    "$GPU_SKIP") status=SKIPPED; N_SKIP=$((N_SKIP + 1)) ;;
    124) status=TIMEOUT; N_TIMEOUT=$((N_TIMEOUT + 1)); STEP_DETAIL="SIGINT at ${limit}s; $STEP_DETAIL" ;;
    137) status=KILLED; N_TIMEOUT=$((N_TIMEOUT + 1)); STEP_DETAIL="SIGKILL ${GRACE}s after SIGINT at ${limit}s; $STEP_DETAIL" ;;
    *) status=FAIL; N_FAIL=$((N_FAIL + 1)) ;;
  esac
  gpu_say "$(printf '%-16s %-8s rc=%-3s %5s of %-5s %s' "$name" "$status" "$rc" "$((SECONDS - start))s" "${limit}s" \
    "$STEP_DETAIL")"
  save_results
  return 0
}

# Everything a step leaves in $SCRATCH/results (junit XML, benchmark JSON, ...) as one archive in $OUT,
# rewritten after every step.
save_results() {
  if [ -n "$(ls -A "$SCRATCH/results" 2>/dev/null)" ]; then
    tar -czf "$SCRATCH/results.tar.gz" -C "$SCRATCH" results 2>/dev/null &&
      mv -f "$SCRATCH/results.tar.gz" "$OUT/results.tar.gz"
  fi
}

# pytest_step LOG [PYTEST ARGS...]: one pytest run under `capped`, output appended to $OUT/LOG, junit
# XML to results/junit-<step>.xml; the array PYTEST_PREFIX, if set, is a command that runs the
# interpreter (compute-sanitizer and its options). SIGINT becomes KeyboardInterrupt even where the shell that started
# this script ignores it (a background job), so pytest ends the run with its summary and the XML.
# HANG_EXIT_S=<s> (per step): a test whose call still runs after s seconds is taken for a hung kernel (a GPU
# kernel waiting on an mbarrier phase or named barrier that never completes cannot be interrupted: SIGINT
# would wait for it until the step's cap and SIGKILL): faulthandler dumps every thread's stack to the log and
# ends the process at once, so the step fails then and leaves the rest of its cap to the next steps.
PYTEST_MAIN='import faulthandler, os, signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
class HangExit:
    def __init__(self, seconds):
        self.seconds = seconds
        self.log = os.fdopen(os.dup(2), "w")  # the real stderr: pytest captures fd 2 while a test runs
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        faulthandler.dump_traceback_later(self.seconds, exit=True, file=self.log)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
hang = float(os.environ.get("HANG_EXIT_S") or 0)
sys.exit(pytest.main(sys.argv[1:], plugins=[HangExit(hang)] if hang > 0 else []))'

pytest_step() {
  local log=$OUT/$1 rc offset section
  shift
  offset=$(stat -c %s "$log" 2>/dev/null || echo 0)
  {
    echo
    echo "===== $STEP_NAME: pytest $* (limit ${STEP_LIMIT}s, $(date +%H:%M:%S))"
  } >>"$log"
  # -v: each test's id is written before it runs, so a hang shows which one; faulthandler dumps the
  # stacks of a test that runs longer than FAULT_S (and goes on).
  capped ${PYTEST_PREFIX[@]+"${PYTEST_PREFIX[@]}"} "$PYTHON" -c "$PYTEST_MAIN" "$@" -v -rfEs --tb=short -p no:cacheprovider --durations=10 \
    -o faulthandler_timeout="${FAULT_S:-60}" --junitxml="$SCRATCH/results/junit-$STEP_NAME.xml" >>"$log" 2>&1
  rc=$?
  section=$(tail -c +$((offset + 1)) "$log")
  STEP_DETAIL=$(printf '%s\n' "$section" | grep -E '^=+ .*( in [0-9.]+s).* =+$' | tail -1 | sed -E 's/^=+ //; s/ =+$//')
  [ -z "$STEP_DETAIL" ] && STEP_DETAIL="no pytest summary line (killed?)"
  if [ -n "${HANG_EXIT_S:-}" ] && printf '%s\n' "$section" | grep -q "Timeout ([0-9:]*)!"; then
    # faulthandler's "Timeout (h:mm:ss)!" follows the -v line of the test it stopped
    STEP_DETAIL="hang guard: a test ran past HANG_EXIT_S=${HANG_EXIT_S}s, run ended: $(printf '%s\n' "$section" |
      grep -m1 "Timeout ([0-9:]*)!" | grep -oE '[^ /]+::[^ ]+' | head -1 | cut -c1-160); $STEP_DETAIL"
  fi
  if [ "$DRY_RUN" != 1 ]; then  # on the GPU, no test may skip for want of a device or of a kernel
    local nodev
    nodev=$(printf '%s\n' "$section" |
      grep -cE "^SKIPPED .*(needs a CUDA device|built without its CUDA kernels|has no CUDA kernel)")
    [ "$nodev" -gt 0 ] && STEP_DETAIL="$STEP_DETAIL; $nodev skip lines: no CUDA device or kernel"
  fi
  [ "$rc" -eq 5 ] && STEP_DETAIL="no test selected (pytest exit 5): $STEP_DETAIL"
  return "$rc"
}

# clocks_start / clocks_stop: around a benchmark, nvidia-smi samples the card's clocks, power and
# temperature every 200 ms (read only: the clocks are measured as found, never set) into
# results/clocks-<step>.csv; clocks_stop ends the sampling and prints scripts/gpu_clocks.py's one-line
# summary (nothing where nvidia-smi is missing, as on a machine without a GPU).
CLOCK_FIELDS=timestamp,utilization.gpu,clocks.sm,clocks.mem,power.draw,temperature.gpu
clocks_start() {
  CLOCKS_PID="" CLOCKS_FILE="$SCRATCH/results/clocks-$STEP_NAME.csv"
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  local fields=$CLOCK_FIELDS,clocks_event_reasons.active
  # An older driver without the event-reason field rejects the whole query: sample without it.
  timeout 10 nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits >/dev/null 2>&1 || fields=$CLOCK_FIELDS
  nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits -lms 200 >"$CLOCKS_FILE" 2>&1 &
  CLOCKS_PID=$!
}
clocks_stop() {
  [ -n "${CLOCKS_PID:-}" ] || return 0
  kill "$CLOCKS_PID" 2>/dev/null
  local i
  for i in 1 2 3 4 5 6 7 8 9 10; do  # up to 1 s for SIGTERM, then SIGKILL: the wait must not hang
    kill -0 "$CLOCKS_PID" 2>/dev/null || break
    sleep 0.1
  done
  kill -9 "$CLOCKS_PID" 2>/dev/null
  wait "$CLOCKS_PID" 2>/dev/null
  CLOCKS_PID=""
  "$PYTHON" "$ROOT/scripts/gpu_clocks.py" "$CLOCKS_FILE" 2>&1 | head -1
}

# gpu_finish: the closing summary line, the $OUT limits, the summary on stdout; exit status 0 when no
# step failed or timed out, else 1.
gpu_finish() {
  gpu_say "$GPU_NAME: done in $(elapsed)s of ${BUDGET}s: $N_OK ok, $N_FAIL failed, $N_TIMEOUT timed out, $N_SKIP skipped"
  save_results
  "$PYTHON" "$ROOT/scripts/gpu_out_limits.py" "$OUT" >>"$OUT/summary.txt" 2>&1 ||
    echo "gpu_out_limits.py failed; check \$OUT by hand" >>"$OUT/summary.txt"
  rm -rf "$SCRATCH"
  [ $((N_FAIL + N_TIMEOUT)) -eq 0 ]
}
