"""The Metal type-check (scripts/check_metal.py, run by CI as `make metal-check`) rejects broken MSL.

CI type-checks every real kernel variant; these tests show that the check is not vacuous: a unit with a
write through a `constant` pointer, an undeclared function, or a wrong argument type fails, and a
correct one passes. g++ always; clang++ too when one is installed.
"""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_metal", ROOT / "scripts" / "check_metal.py")
check_metal = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_metal)

COMPILERS = ["g++"] + [c for c in ("clang++",) if shutil.which(c)]

GOOD = """
kernel void ok(device float* out [[buffer(0)]], constant float& c [[buffer(1)]],
               uint i [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[32];
  tile[lane] = out[i] + c;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float4 v = float4(tile[0], tile[1], 2.0f, 3.0f);
  out[i] = simd_sum(v.x + float2(v.yz).y + dot(v.xy, v.zw)) + to_float(from_float<bf16_t>(c));
}
"""

BROKEN = {
    "write through constant": GOOD.replace("out[i] = simd_sum", "c = 1.0f; out[i] = simd_sum"),
    "undeclared function": GOOD.replace("simd_sum(", "simd_summ("),
    "wrong argument type": GOOD.replace("to_float(from_float<bf16_t>(c))", "to_float(tile)"),
}


def check(tmp_path, text, cxx):
    unit = tmp_path / "unit.cpp"
    unit.write_text("#include <metal_stdlib>\nusing namespace metal;\n" + check_metal.source.read("common.h") + text)
    return check_metal.check(cxx, [unit])


@pytest.mark.parametrize("cxx", COMPILERS)
def test_good_unit_passes(tmp_path, cxx):
    ok, err = check(tmp_path, GOOD, cxx)
    assert ok, err


@pytest.mark.parametrize("cxx", COMPILERS)
@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_unit_fails(tmp_path, cxx, name):
    ok, err = check(tmp_path, BROKEN[name], cxx)
    assert not ok and "error" in err
