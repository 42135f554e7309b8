"""Regression tests of issue 22 (validation and memory safety), one named test per defect.

Every op validates in the binding layer shared by the backends (csrc/prepare.cpp, csrc/checks.cpp);
the Metal dispatch (kvkernels.metal.dispatch, run here on the MSL emulator with CPU tensors) and the
oracle (kvkernels.reference) check the same things, so each case runs on the implementations it
concerns. Contract: RuntimeError "kvkernels.<op>: <argument>: ..." before anything is written; no
crash, no silently wrong shape, no allocation sized by an unchecked argument.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import assert_bytes_equal, generator, randn
from kvkernels import MLAPagedCache, ops, reference
from kvkernels.metal import dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
I32, I64 = torch.int32, torch.int64
BIG = 2**32 + 1  # a head count that wraps to 1 in an int
N, B, H, D, T = 6, 4, 2, 16, 3  # small caches: blocks, block size, kv heads, head dim, tokens
R, P = 64, 16  # MLA: kv_lora_rank, rope dim


def impl(name, op):
    """The function of ``op`` in ``name``: the Python wrapper, the registered op (CPU kernel), the Metal
    dispatch (emulated on CPU tensors) or the reference."""
    if name == "ops":
        return getattr(ops, op)
    if name == "torch.ops":
        return getattr(torch.ops.kvkernels, op)
    if name == "metal":
        return getattr(dispatch, op)
    return getattr(reference, op)


def raises_named(fn, op, arg, kwargs, keep=()):
    """fn(**kwargs) raises "kvkernels.<op>: <arg>:" and leaves every tensor in ``keep`` unchanged."""
    before = [t.clone() for t in keep]
    with pytest.raises(RuntimeError, match=rf"^kvkernels\.{op}: {arg}:"):
        fn(**kwargs)
    for t, old in zip(keep, before):
        assert_bytes_equal(t, old, msg="written before the error")


# ----------------------------------------------------------------------------------------------------
# 7. MLAPagedCache.check_invariants() with an offloaded sequence
# ----------------------------------------------------------------------------------------------------


def test_mla_check_invariants_with_an_offloaded_sequence():
    # block_size (16) differs from the block count (3): the old check compared the host copy's block
    # size with the number of blocks.
    cache = MLAPagedCache(2, R, P, num_blocks=32, block_size=16, enable_prefix_caching=False)
    s, _ = cache.add_sequence(list(range(40)))
    cache.append(s, list(range(40)))
    cache.offload(s)
    cache.check_invariants()
    cache.restore(s)
    cache.check_invariants()


# ----------------------------------------------------------------------------------------------------
# 8. memcpy(nullptr, nullptr, 0) on empty rows / blocks (undefined behaviour, caught by UBSan)
# ----------------------------------------------------------------------------------------------------

UBSAN_HARNESS = r"""
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cpu/convert.h"
#include "kvkernels/softmax.h"
#include "cpu/rows.h"

#define KVK_ISA portable
#include "cpu/vec_portable.h"
#include "cpu/row_io_portable.h"
#include "cpu/rows_kernel.h"
#undef KVK_ISA

#include "cpu/block_copy.h"

int main(int argc, char** argv) {
  // What an empty tensor hands the kernels: null data pointers and zero lengths (not constants, so
  // nothing is folded away).
  const int64_t n = std::atoi(argv[1]);
  float* null_f = argc > 2 ? static_cast<float*>(std::malloc(4)) : nullptr;
  kvkernels::cpu::portable::write_row<float, float>(null_f, null_f, n, 1.0f);
  kvkernels::cpu::portable::read_row<float, float>(null_f, null_f, n, 1.0f);
  kvkernels::BlockCopyParams p;  // one block whose innermost run folded to 0 bytes
  p.num_pairs = 1;
  p.run_bytes = n;
  const int64_t strides[7] = {};
  char* null_c = reinterpret_cast<char*>(null_f);
  kvkernels::cpu::copy_block(p, null_c, strides, null_c, strides);
  p.num_dims = 1;  // and one with an empty outer dimension
  p.sizes[0] = n;
  p.run_bytes = 4;
  kvkernels::cpu::copy_block(p, null_c, strides, null_c, strides);
  return 0;
}
"""


def test_empty_row_and_block_copies_skip_memcpy_under_ubsan(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    probe = tmp_path / "probe.cpp"
    probe.write_text("int main() { return 0; }\n")
    if subprocess.run([cxx, "-fsanitize=undefined", str(probe), "-o", str(tmp_path / "probe")],
                      capture_output=True).returncode != 0:
        pytest.skip("the compiler cannot link UBSan")
    src = tmp_path / "harness.cpp"
    src.write_text(UBSAN_HARNESS)
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    exe = tmp_path / "harness"
    # -fno-builtin: a builtin memcpy is not instrumented; the library call's nonnull arguments are.
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-g", "-fsanitize=undefined", "-fno-sanitize-recover=all",
                            "-fno-builtin", f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/include", f"-I{torch_include}",
                            str(src), "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe), "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "runtime error" not in run.stderr, run.stderr[-4000:]


@pytest.mark.parametrize("op", ["reshape_and_cache", "gather_kv", "copy_blocks", "swap_blocks"])
def test_empty_rows_and_blocks_run(op):
    """The zero-size calls the harness above models, through the ops (null data pointers)."""
    if op == "reshape_and_cache":
        kc, vc = torch.zeros(4, 4, 2, 0), torch.zeros(4, 4, 2, 0)
        ops.reshape_and_cache(torch.zeros(2, 2, 0), torch.zeros(2, 2, 0), kc, vc, torch.tensor([0, 5]))
    elif op == "gather_kv":
        kc = torch.zeros(4, 4, 2, 0)
        k, v = ops.gather_kv(kc, kc, torch.tensor([[1, 2]], dtype=I32), torch.tensor([6], dtype=I32))
        assert k.shape == v.shape == (6, 2, 0)
    elif op == "copy_blocks":
        ops.copy_blocks(torch.zeros(4, 0, 8), torch.tensor([[0, 1]]))
    else:
        ops.swap_blocks(torch.zeros(4, 0, 8), torch.zeros(3, 0, 8), torch.tensor([[0, 1]]))


