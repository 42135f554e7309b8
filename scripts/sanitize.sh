#!/usr/bin/env bash
# make sanitize: the CPU extension built with AddressSanitizer + UndefinedBehaviorSanitizer into build-asan/
# (the in-place build is not touched), then the CPU kernel tests and a short fuzz run against it.
#
# - Build: KVKERNELS_SANITIZE=1 (setup.py: -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer, compile
#   and link, no CUDA) into build-asan/ (scripts/side_build.sh).
# - Import: build-asan/pkg/kvkernels is a copy of the package with the sanitized _C; pytest runs from
#   build-asan/pkg, so `import kvkernels` finds that copy first (the fuzz worker imports the same one).
# - Python and torch are not instrumented: libasan (and libstdc++, which it must come before) is preloaded.
#   ASAN_OPTIONS, each needed here:
#     detect_leaks=0              CPython and torch keep allocations until exit; leak reports would be theirs
#     abort_on_error=1            a report kills the process with SIGABRT: pytest fails, or the fuzz worker dies
#                                 and the fuzzer records the spec as a crash with the report
#     allocator_may_return_null=1 + max_allocation_size_mb=4096: an allocation sized from a bad argument
#                                 fails as it does without ASan (torch raises) instead of an ASan abort or of
#                                 filling the machine's memory (the fuzz worker's address-space limit cannot
#                                 apply under ASan)
#     symbolize=1                 file:line in reports
#   UBSAN_OPTIONS: print_stacktrace=1:halt_on_error=1 (the first undefined behaviour fails the run).
#   No suppressions are needed: the run below reports nothing in torch or CPython.
# - Tests: the CPU kernel tests (attention, cache ops, CPU paths, CPU rows, MLA, validation, the issue-22
#   regression tests) and KVKERNELS_FUZZ_EXAMPLES (default 15) fuzz calls per op. Set SANITIZE_TESTS to run
#   other test files.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
CXX=${CXX:-c++}
OUT=build-asan
start=$(date +%s)

. scripts/side_build.sh
KVKERNELS_SANITIZE=1 side_build "$OUT"
built=$(date +%s)

export LD_PRELOAD="$("$CXX" -print-file-name=libasan.so) $("$CXX" -print-file-name=libstdc++.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:max_allocation_size_mb=4096:symbolize=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export KVKERNELS_FUZZ_EXAMPLES=${KVKERNELS_FUZZ_EXAMPLES:-15}
tests=${SANITIZE_TESTS:-"test_attention.py test_cache_ops.py test_cpu_paths.py test_cpu_rows.py test_mla.py
  test_validation.py test_reliability.py test_fuzz.py"}
args=()
for t in $tests; do args+=("$ROOT/tests/$t"); done

cd "$OUT/pkg"
side_import_check "$OUT"
status=0
"$PY" -m pytest -q -p no:cacheprovider "${args[@]}" || status=$?
echo "sanitize: build $((built - start)) s, tests $(($(date +%s) - built)) s, exit status $status"
exit $status
