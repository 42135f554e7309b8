#!/usr/bin/env bash
# make amx-emu-test: the avx512amx path on a CPU without AMX. Builds the CPU extension with the tile
# instructions emulated (KVKERNELS_AMX_EMU=1: tests/amx_emu/amx_emu.h; everything else of the path, AVX-512
# with VBMI and BF16, runs natively) into build-amx-emu/ (the in-place build is not touched), then runs the
# tests that exercise the AMX path against it: there the avx512amx path is supported, and is the default,
# so bf16 prefill and MLA decode of every attention test take the AMX tiles.
#
# Needs a CPU with AVX-512 F/BW/VL, VBMI and BF16 (AMD Zen 4, Intel Ice Lake / Sapphire Rapids and later);
# on one without, the tests skip the avx512amx cases with the reason, as everywhere. On a CPU with real AMX
# the plain build runs these tests on the hardware (make test); this script is for the others.
# What the emulator models and what it does not: tests/amx_emu/amx_emu.h. AMX_EMU_TESTS / AMX_EMU_ISA_TESTS
# choose other test files (below).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OUT=build-amx-emu
start=$(date +%s)

. scripts/side_build.sh
KVKERNELS_AMX_EMU=1 side_build "$OUT"
built=$(date +%s)

# The ISA-parametrized files run their avx512amx cases only (the other paths are the plain build's, tested
# by make test); the others run whole: there the default path is avx512amx. Then the fuzzer's short pass
# (valid calls against the reference, bad ones against the error contract) on avx512amx alone.
isa_tests=${AMX_EMU_ISA_TESTS:-"test_cpu_paths.py test_nonfinite.py test_causal.py test_head_dims.py test_out.py"}
tests=${AMX_EMU_TESTS:-"test_amx_emu.py test_attention.py test_mla.py test_cascade.py"}
paths() { for t in "$@"; do printf '%s\n' "$ROOT/tests/$t"; done; }

cd "$OUT/pkg"
side_import_check "$OUT"
export KVKERNELS_EXPECT_AMX_EMU=1
status=0
# shellcheck disable=SC2046,SC2086  # word splitting of the lists is intended
"$PY" -m pytest -q -p no:cacheprovider $(paths $tests) || status=$?
# shellcheck disable=SC2046,SC2086
"$PY" -m pytest -q -p no:cacheprovider -k avx512amx $(paths $isa_tests) || status=$?
KVKERNELS_CPU_ISA=avx512amx "$PY" -m pytest -q -p no:cacheprovider "$ROOT/tests/test_fuzz.py" || status=$?
echo "amx-emu: build $((built - start)) s, tests $(($(date +%s) - built)) s, exit status $status"
exit $status
