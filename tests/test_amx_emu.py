"""The AMX emulator (tests/amx_emu/amx_emu.h) and the emulated build of `make amx-emu-test`.

- The emulator alone: tests/amx_emu/selftest.cpp, built with the host compiler, checks the arithmetic and
  data movement of the emulated tile instructions and that each misuse aborts with its message.
- The extension: a plain build must contain the real tile instructions and no emulator; an emulator build
  (scripts/amx_emu.sh) none of them, and there the avx512amx path must really run the (emulated) tiles
  for bf16 prefill — not fall back to the FMA tiles — and match the reference.
Everything else of the AMX path is tested by the ISA-parametrized test files, which scripts/amx_emu.sh
runs against the emulated build (their avx512amx cases skip on CPUs without AMX in a plain build).
"""

import os
import re
import shutil
import signal
import subprocess

import pytest
import torch

import kvkernels
from kvkernels import _C
from helpers import generator, make_paged_kv, make_query, query_start_loc, use_isa
from test_attention import run_paged_attention

HERE = os.path.dirname(os.path.abspath(__file__))
EMU_DIR = os.path.join(HERE, "amx_emu")
EMULATED = _C.amx_emulated_dot_products() is not None
# scripts/amx_emu.sh sets it: there a plain build means the script tested the wrong extension.
EXPECT_EMU = os.environ.get("KVKERNELS_EXPECT_AMX_EMU") == "1"
TILE_MNEMONICS = ("ldtilecfg", "tilerelease", "tilezero", "tileloadd", "tilestored", "tdpbf16ps")


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the emulator's self-test")
    exe = str(tmp_path_factory.mktemp("amx_emu") / "selftest")
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I", EMU_DIR,
                    os.path.join(EMU_DIR, "selftest.cpp"), "-o", exe], check=True)
    return exe


def test_emulator_arithmetic(selftest):
    run = subprocess.run([selftest, "arith"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.parametrize("misuse,message", [
    ("unconfigured", "tilezero: tile state not configured"),
    ("released", "tileloadd: tile state not configured"),
    ("unset_tile", "tilezero: tile not configured (#UD) (tile 5)"),
    ("palette", "ldtilecfg: palette other than 0 / 1"),
    ("too_wide", "ldtilecfg: more than 16 rows or 64 bytes a row (#GP) (tile 3)"),
    ("same_operand", "tdpbf16ps: operands not distinct"),
    ("shape", "tdpbf16ps: A colsb / 4 != B rows"),
])
def test_emulator_faults(selftest, misuse, message):
    run = subprocess.run([selftest, misuse], capture_output=True, text=True)
    assert run.returncode == -signal.SIGABRT, run.stdout + run.stderr
    assert f"amx_emu: {message}" in run.stderr


def test_build_kind():
    if EXPECT_EMU:
        assert EMULATED, "scripts/amx_emu.sh imported a build without the AMX emulator"
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to list the extension's instructions")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", _C.__file__], capture_output=True, text=True,
                          check=True).stdout
    found = {m for m in TILE_MNEMONICS if re.search(rf"\s{m}\s", text)}
    if EMULATED:
        assert not found, f"the emulator build still executes tile instructions: {sorted(found)}"
    else:
        assert found == set(TILE_MNEMONICS), f"plain build: tile instructions found {sorted(found)}"


@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_amx_path_runs_on_the_tiles(monkeypatch, fp8):
    if not EMULATED:
        pytest.skip("not an AMX-emulator build (make amx-emu-test); on AMX hardware test_cpu_paths covers it")
    use_isa(monkeypatch, "avx512amx")
    q_lens = [40, 33]
    kv = make_paged_kv(seq_lens=[70, 33], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16,
                       fp8=fp8, seed=5)
    query = make_query(sum(q_lens), 4, 64, torch.bfloat16, generator(6))
    before = _C.amx_emulated_dot_products()
    run_paged_attention(kv, query, query_start_loc(q_lens))  # against the float64 reference
    assert _C.amx_emulated_dot_products() > before, "bf16 prefill on avx512amx did not use the tiles"
    # A head dim that is a multiple of 16 but not of 32 takes the FMA tiles: the counter must not move
    # (it counts the tile path only).
    kv48 = make_paged_kv(seq_lens=[70, 33], num_kv_heads=2, head_dim=48, block_size=16, dtype=torch.bfloat16,
                         fp8=fp8, seed=7)
    before = _C.amx_emulated_dot_products()
    run_paged_attention(kv48, make_query(sum(q_lens), 4, 48, torch.bfloat16, generator(8)), query_start_loc(q_lens))
    assert _C.amx_emulated_dot_products() == before
    assert kvkernels.cpu_isa() == "avx512amx"
