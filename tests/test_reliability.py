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

import kvkernels
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
# 1. a cache with 0 kv heads: the query-head modulo divided by zero (SIGFPE killed the process)
# ----------------------------------------------------------------------------------------------------

ZERO_HEADS = """
import torch, kvkernels
from kvkernels import ops
kc = torch.zeros(4, 16, 0, 64)
try:
    ops.paged_attention(torch.zeros(1, 4, 64), kc, kc, torch.zeros(1, 1, dtype=torch.int32),
                        torch.ones(1, dtype=torch.int32))
except RuntimeError as e:
    print(e)
"""


def test_zero_kv_heads_raises_instead_of_sigfpe():
    # In a child process: without the check the process dies of SIGFPE, which would take pytest with it. The
    # child imports the kvkernels this process imported (make sanitize's instrumented copy there).
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(kvkernels.__file__)))
    env = dict(os.environ, PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", ZERO_HEADS], capture_output=True, text=True, cwd=pkg_root, env=env,
                       timeout=300)
    assert r.returncode == 0, f"the process died (return code {r.returncode}): {r.stderr[-2000:]}"
    assert r.stdout.startswith("kvkernels.paged_attention: key_cache: num_kv_heads"), r.stdout


@pytest.mark.parametrize("name", ["metal", "reference"])
def test_zero_kv_heads_named_by_metal_and_reference(name):
    kc = torch.zeros(4, 16, 0, 64)
    kwargs = dict(query=torch.zeros(1, 4, 64), key_cache=kc, value_cache=kc,
                  block_tables=torch.zeros(1, 1, dtype=I32), seq_lens=torch.ones(1, dtype=I32))
    raises_named(impl(name, "paged_attention"), "paged_attention", "key_cache", kwargs)


# ----------------------------------------------------------------------------------------------------
# 3. sizes narrowed from int64 to int: 2**32 + 1 heads became 1 head
# ----------------------------------------------------------------------------------------------------


def wide(*shape, dim):
    """A zero tensor of ``shape`` whose dimension ``dim`` is BIG, expand()ed (no memory)."""
    small = list(shape)
    small[dim] = 1
    full = list(shape)
    full[dim] = BIG
    return torch.zeros(small).expand(full)


def narrowing_cases():
    table, lens = torch.zeros(1, 1, dtype=I32), torch.ones(1, dtype=I32)
    cache = torch.zeros(4, 16, 2, 64)
    lse = torch.zeros(1, 1).expand(1, BIG)
    return {
        # 2**32 + 2 heads over 2 kv heads: a multiple, so only the narrowing can catch it.
        "paged_attention-query-heads": ("paged_attention", "query", dict(
            query=torch.zeros(1, 1, 64).expand(1, 2**32 + 2, 64), key_cache=cache, value_cache=cache, block_tables=table, seq_lens=lens)),
        "merge-out_a-heads": ("merge_attention_states", "out_a", dict(
            out_a=wide(1, 0, 16, dim=1), lse_a=lse, out_b=wide(1, 0, 16, dim=1), lse_b=lse)),
        "gather_kv-cache-heads": ("gather_kv", "key_cache", dict(
            key_cache=wide(4, 16, 0, 64, dim=2), value_cache=wide(4, 16, 0, 64, dim=2), block_tables=table,
            seq_lens=lens)),
        "mla_paged_attention-q-heads": ("mla_paged_attention", "q", dict(
            q=wide(1, 0, 80, dim=1), kv_cache=torch.zeros(4, 16, 80), block_tables=table, seq_lens=lens,
            kv_lora_rank=64, scale=0.1)),
        "mla_decompress-w_kv_b-heads": ("mla_decompress", "w_kv_b", dict(
            kv_cache=torch.zeros(4, 16, 80), block_tables=table, seq_lens=lens,
            w_kv_b=torch.zeros(1, 64).expand(BIG * 32, 64), kv_lora_rank=64, qk_nope_head_dim=16, v_head_dim=16)),
        "reshape_and_cache-key-heads": ("reshape_and_cache", "key", dict(
            key=wide(1, 0, 16, dim=1), value=wide(1, 0, 16, dim=1), key_cache=wide(4, 16, 0, 16, dim=2),
            value_cache=wide(4, 16, 0, 16, dim=2), slot_mapping=torch.zeros(1, dtype=I64))),
    }


NARROWING = narrowing_cases()


@pytest.mark.parametrize("name", ["ops", "torch.ops", "metal"])
@pytest.mark.parametrize("case", NARROWING, ids=NARROWING)
def test_sizes_beyond_int_raise_naming_the_argument(case, name):
    op, arg, kwargs = narrowing_cases()[case]
    raises_named(impl(name, op), op, arg, kwargs)


# ----------------------------------------------------------------------------------------------------
# 4. gather_kv / mla_decompress allocated [num_tokens, ...] before checking num_tokens
# ----------------------------------------------------------------------------------------------------


def length_cases(num_tokens):
    table, lens = torch.zeros(1, 1, dtype=I32), torch.ones(1, dtype=I32)
    cache = torch.zeros(4, 16, 2, 64)
    return {
        "gather_kv": dict(key_cache=cache, value_cache=cache, block_tables=table, seq_lens=lens,
                          num_tokens=num_tokens),
        "mla_decompress": dict(kv_cache=torch.zeros(4, 16, 80), block_tables=table, seq_lens=lens,
                               w_kv_b=torch.zeros(64, 64), kv_lora_rank=64, qk_nope_head_dim=16, v_head_dim=16,
                               num_tokens=num_tokens),
    }


@pytest.mark.parametrize("name", ["ops", "torch.ops", "reference"])
@pytest.mark.parametrize("op", ["gather_kv", "mla_decompress"])
def test_num_tokens_checked_before_the_outputs_are_allocated(op, name):
    # The Metal dispatch compared num_tokens with sum(seq_lens) before allocating already (on the
    # emulator; on MPS in debug mode): test_metal_num_tokens_checks below.
    raises_named(impl(name, op), op, "num_tokens", length_cases(2**34)[op])


@pytest.mark.parametrize("num_tokens", [2**34, -1], ids=["2**34", "negative"])
@pytest.mark.parametrize("op", ["gather_kv", "mla_decompress"])
def test_metal_num_tokens_checks(op, num_tokens):
    raises_named(impl("metal", op), op, "num_tokens", length_cases(num_tokens)[op])


# ----------------------------------------------------------------------------------------------------
# 5. outputs that share memory: with themselves (expand(), overlapping strides), with each other, with
#    an input. Rejected by shape and strides alone. K and V interleaved in one allocation are accepted.
# ----------------------------------------------------------------------------------------------------

def rc_args(key_cache, value_cache, key=None, value=None, slot_mapping=None):
    gen = generator(22)
    return dict(key=randn(T, H, D, gen=gen) if key is None else key,
                value=randn(T, H, D, gen=gen) if value is None else value,
                key_cache=key_cache, value_cache=value_cache,
                slot_mapping=torch.tensor([0, 5, 9]) if slot_mapping is None else slot_mapping)


def alias_cases():
    """id -> (op, argument the error names, kwargs, allocations that must stay unchanged)."""
    cases = {}
    kc = torch.zeros(N, B, H, D)
    cases["rc-key_cache-is-value_cache"] = ("reshape_and_cache", "value_cache", rc_args(kc, kc), [kc])
    base = torch.zeros(1, B, H, D)
    vc = torch.zeros(N, B, H, D)
    cases["rc-key_cache-expanded"] = ("reshape_and_cache", "key_cache",
                                      rc_args(base.expand(N, B, H, D), vc), [base, vc])
    flat = torch.zeros(N * B * H * D)
    half = flat.as_strided((N, B, H, D), (B * H * D // 2, H * D, D, 1))  # block i+1 starts mid-block i
    kc = torch.zeros(N, B, H, D)
    cases["rc-value_cache-overlapping-strides"] = ("reshape_and_cache", "value_cache", rc_args(kc, half),
                                                   [kc, flat])
    kv = torch.zeros(N, B, H, 2 * D)
    cases["rc-K-V-half-overlap"] = ("reshape_and_cache", "value_cache",
                                    rc_args(kv[..., :D], kv[..., D // 2:D // 2 + D]), [kv])
    kc, vc = randn(N, B, H, D, gen=generator(1)), torch.zeros(N, B, H, D)
    cases["rc-key-view-of-key_cache"] = ("reshape_and_cache", "key", rc_args(kc, vc, key=kc[0, :T]), [kc, vc])
    kc, vc = torch.zeros(N, B, H, D), randn(N, B, H, D, gen=generator(2))
    cases["rc-value-view-of-value_cache"] = ("reshape_and_cache", "value", rc_args(kc, vc, value=vc[1, 1:]),
                                             [kc, vc])
    # The slots live in the last block of key_cache, which this call does not write (in a block it
    # writes, the old kernel read its own key rows back as slots and crashed).
    kc, vc = torch.zeros(N, B, H, D), torch.zeros(N, B, H, D)
    slots = kc[N - 1].view(-1)[:2 * T].view(I64)
    slots.copy_(torch.tensor([0, 5, 9]))
    cases["rc-slot_mapping-in-key_cache"] = ("reshape_and_cache", "slot_mapping", rc_args(kc, vc, slot_mapping=slots),
                                             [kc, vc])
    # A scale next to a non-fp8 cache is never read; inside a cache it is rejected all the same (one rule
    # for every argument, docs/ops.md).
    kc, vc = torch.zeros(N, B, H, D), torch.zeros(N, B, H, D)
    cases["rc-unread-k_scale-in-value_cache"] = ("reshape_and_cache", "k_scale",
                                                 dict(rc_args(kc, vc), k_scale=vc[N - 1, 0, 0, :1]), [kc, vc])

    gen = generator(23)
    mla = randn(N, B, R + P, gen=gen)
    cases["mla-unread-scale-in-kv_cache"] = ("concat_and_cache_mla", "scale", dict(
        kv_c=randn(T, R, gen=gen), k_pe=randn(T, P, gen=gen), kv_cache=mla, slot_mapping=torch.tensor([0, 5, 9]),
        scale=mla[N - 1, 0, :1]), [mla])
    mla = torch.zeros(1, B, R + P)
    cases["mla-kv_cache-expanded"] = ("concat_and_cache_mla", "kv_cache", dict(
        kv_c=randn(T, R, gen=gen), k_pe=randn(T, P, gen=gen), kv_cache=mla.expand(N, B, R + P),
        slot_mapping=torch.tensor([0, 5, 9])), [mla])
    mla = randn(N, B, R + P, gen=gen)
    cases["mla-kv_c-view-of-kv_cache"] = ("concat_and_cache_mla", "kv_c", dict(
        kv_c=mla[0, :T, :R], k_pe=randn(T, P, gen=gen), kv_cache=mla, slot_mapping=torch.tensor([0, 5, 9])), [mla])
    mla = randn(N, B, R + P, gen=gen)
    cases["mla-k_pe-view-of-kv_cache"] = ("concat_and_cache_mla", "k_pe", dict(
        kv_c=randn(T, R, gen=gen), k_pe=mla[2, :T, R:], kv_cache=mla, slot_mapping=torch.tensor([0, 5, 9])), [mla])

    base = randn(1, B, H, D, gen=gen)
    cases["copy_blocks-cache-expanded"] = ("copy_blocks", "cache", dict(
        cache=base.expand(N, B, H, D), block_mapping=torch.tensor([[0, 1]]), block_dim=0), [base])
    base = randn(1, 2, N, B, H, D, gen=gen)
    cases["copy_blocks-stacked-layers-expanded"] = ("copy_blocks", "cache", dict(
        cache=base.expand(3, 2, N, B, H, D), block_mapping=torch.tensor([[0, 1]]), block_dim=2), [base])
    cache = torch.zeros(N, 8, dtype=I64)
    cache[5, :4] = torch.tensor([0, 1, 2, 3])
    cases["copy_blocks-block_mapping-in-cache"] = ("copy_blocks", "block_mapping", dict(
        cache=cache, block_mapping=cache[5, :4].view(2, 2), block_dim=0), [cache])
    base = torch.zeros(1, B, H, D)
    cases["swap_blocks-dst-expanded"] = ("swap_blocks", "dst", dict(
        src=randn(N, B, H, D, gen=gen), dst=base.expand(N, B, H, D), block_mapping=torch.tensor([[0, 1], [2, 3]]),
        block_dim=0), [base])
    return cases


ALIAS = alias_cases()


@pytest.mark.parametrize("name", ["ops", "torch.ops", "metal"])
@pytest.mark.parametrize("case", ALIAS, ids=ALIAS)
def test_outputs_sharing_memory_are_rejected(case, name):
    op, arg, kwargs, allocations = alias_cases()[case]
    raises_named(impl(name, op), op, arg, kwargs, keep=allocations)


def element_offsets(t):
    """Storage offsets of every element of ``t`` (a list, with repeats)."""
    idx = torch.arange(t.untyped_storage().nbytes() // t.element_size())
    return idx.as_strided(t.shape, t.stride(), t.storage_offset()).flatten().tolist()


def random_view(buf, gen, shape=None):
    """A random [N, B, H, D] view of ``buf`` with a unit last stride (strides may be 0 or overlap)."""
    while True:
        shape = shape or torch.randint(1, 4, (4,), generator=gen).tolist()
        strides = torch.randint(0, 24, (3,), generator=gen).tolist() + [1]
        span = sum((n - 1) * st for n, st in zip(shape, strides)) + 1
        if span <= buf.numel():
            offset = int(torch.randint(0, buf.numel() - span + 1, (1,), generator=gen))
            return buf.as_strided(shape, strides, offset)


@pytest.mark.parametrize("seed", range(4))
def test_memory_checks_are_sound_on_random_views(seed):
    """Random key_cache / value_cache views of one buffer: whenever reshape_and_cache accepts them (a call
    with no tokens runs every check and writes nothing), no two elements share memory, within either
    view or across them. The Metal dispatch's Python twin of the checks decides the same way."""
    gen = generator(100 + seed)
    buf = torch.zeros(160)
    accepted = interleaved = 0
    for _ in range(400):
        k = random_view(buf, gen)
        v = random_view(buf, gen, list(k.shape))
        shift = int(torch.randint(1, 24, (1,), generator=gen))
        if int(torch.randint(0, 2, (1,), generator=gen)) and max(element_offsets(k)) + shift < buf.numel():
            v = buf.as_strided(k.shape, k.stride(), k.storage_offset() + shift)  # interleaved, or overlapping
        key = torch.zeros(0, k.shape[2], k.shape[3])
        try:
            ops.reshape_and_cache(key, key, k, v, torch.zeros(0, dtype=I64))
            ok = True
        except RuntimeError as e:
            assert "share" in str(e), str(e)
            ok = False
        ko, vo = element_offsets(k), element_offsets(v)
        if ok:
            accepted += 1
            interleaved += min(vo) < max(ko) and min(ko) < max(vo)  # the byte ranges meet
            assert len(set(ko)) == len(ko) and len(set(vo)) == len(vo) and not set(ko) & set(vo), \
                (k.shape, k.stride(), k.storage_offset(), v.stride(), v.storage_offset())
        python_ok = not (dispatch.has_internal_overlap(k) or dispatch.has_internal_overlap(v)
                         or dispatch.may_overlap(k, v))
        assert python_ok == ok, (k.shape, k.stride(), k.storage_offset(), v.stride(), v.storage_offset())
    print(f"{accepted} accepted, {interleaved} of them with meeting byte ranges")
    assert accepted > 0 and interleaved > 0  # the cases exercise the exact test, not only range checks


def kv_layouts():
    """id -> (key_cache, value_cache, the allocation): K and V views of one allocation that share no
    element, each [N, B, H, D] with a unit last stride."""
    vllm = torch.zeros(N, B, H, 2 * D)  # vLLM's [blocks, block, heads, 2 * D]: K and V interleaved per row
    stacked = torch.zeros(2, 2, N, B, H, D)  # [layers, k/v, ...]: layer 1's slices
    per_block = torch.zeros(N, 2, B, H, D)  # K and V blocks alternate
    hnd = torch.zeros(N, H, B, 2 * D)  # HND with K/V interleaved, passed as NHD views
    return {
        "vllm-interleaved": (vllm[..., :D], vllm[..., D:], vllm),
        "stacked-layer-slices": (stacked[1, 0], stacked[1, 1], stacked),
        "per-block-kv": (per_block[:, 0], per_block[:, 1], per_block),
        "hnd-interleaved": (hnd.transpose(1, 2)[..., :D], hnd.transpose(1, 2)[..., D:], hnd),
    }


KV_LAYOUTS = kv_layouts()


@pytest.mark.parametrize("name", ["ops", "metal"])
@pytest.mark.parametrize("layout", KV_LAYOUTS, ids=KV_LAYOUTS)
def test_interleaved_kv_views_of_one_allocation_are_accepted(layout, name):
    key_cache, value_cache, alloc = kv_layouts()[layout]
    gen = generator(24)
    alloc.copy_(randn(*alloc.shape, gen=gen))
    key, value = randn(T, H, D, gen=gen), randn(T, H, D, gen=gen)
    slots = torch.tensor([0, 5, 22])
    expected = alloc.clone()
    # The same views of the clone: the reference writes there.
    ref_k = expected.as_strided(key_cache.shape, key_cache.stride(), key_cache.storage_offset())
    ref_v = expected.as_strided(value_cache.shape, value_cache.stride(), value_cache.storage_offset())
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    impl(name, "reshape_and_cache")(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                                    slot_mapping=slots)
    assert_bytes_equal(alloc, expected, msg="allocation vs reference")
    # Read back through the same views: token j of a sequence over blocks [0, 1, 5] is slot 0, 5, 22
    # for j = 0, 5, 10.
    got_k, got_v = ops.gather_kv(key_cache, value_cache, torch.tensor([[0, 1, 5]], dtype=I32),
                                 torch.tensor([11], dtype=I32))
    assert torch.equal(got_k[[0, 5, 10]], key) and torch.equal(got_v[[0, 5, 10]], value)


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


# ----------------------------------------------------------------------------------------------------
# 9. error message details
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ops", "metal"])
def test_swap_blocks_dtype_message_names_both_dtypes(name):
    with pytest.raises(RuntimeError, match=r"^kvkernels\.swap_blocks: dst: dtype .*(Half|float16).* must equal "
                                           r"src's dtype .*(Float|float32)"):
        impl(name, "swap_blocks")(src=torch.zeros(4, 2), dst=torch.zeros(4, 2, dtype=torch.float16),
                                  block_mapping=torch.tensor([[0, 1]]), block_dim=0)


@pytest.mark.parametrize("name", ["ops", "torch.ops", "metal"])
def test_reshape_and_cache_wrong_key_heads_blames_key(name):
    kc, vc = torch.zeros(N, B, H, D), torch.zeros(N, B, H, D)
    kwargs = rc_args(kc, vc, key=torch.zeros(T, 2 * H, D), value=torch.zeros(T, 2 * H, D))
    raises_named(impl(name, "reshape_and_cache"), "reshape_and_cache", "key", kwargs, keep=[kc, vc])


@pytest.mark.parametrize("name", ["ops", "metal", "reference"])
def test_one_block_is_singular(name):
    cache = torch.zeros(4, 64, 2, 64)
    with pytest.raises(RuntimeError, match=r"^kvkernels\.paged_attention: seq_lens: .*\(1 block of 64\)"):
        impl(name, "paged_attention")(query=torch.zeros(1, 4, 64), key_cache=cache, value_cache=cache,
                                      block_tables=torch.zeros(1, 1, dtype=I32),
                                      seq_lens=torch.tensor([65], dtype=I32))


@pytest.mark.parametrize("name", ["ops", "metal"])
@pytest.mark.parametrize("arg,dn,dv", [("qk_nope_head_dim", 2**63 - 1, 1), ("v_head_dim", 2**31 - 1, 2**31 - 1)],
                         ids=["dn-int64-max", "sum-beyond-int"])
def test_mla_decompress_head_dim_overflow_is_reported_without_wrapping(name, arg, dn, dv):
    kwargs = dict(kv_cache=torch.zeros(4, 16, 80), block_tables=torch.zeros(1, 1, dtype=I32),
                  seq_lens=torch.ones(1, dtype=I32), w_kv_b=torch.zeros(64, 64), kv_lora_rank=64,
                  qk_nope_head_dim=dn, v_head_dim=dv)
    with pytest.raises(RuntimeError, match=rf"^kvkernels\.mla_decompress: {arg}: ") as e:
        impl(name, "mla_decompress")(**kwargs)
    assert "-" not in str(e.value).split(":", 2)[2], str(e.value)  # no wrapped (negative) number


def paged_args(op, **changes):
    table = torch.tensor([[1, 2], [3, 0]], dtype=I32)
    lens = torch.tensor([5, 3], dtype=I32)
    if op == "paged_attention":
        cache = torch.zeros(4, 4, 2, 8, dtype=torch.float64)
        kwargs = dict(query=torch.zeros(2, 2, 8, dtype=torch.float64), key_cache=cache, value_cache=cache,
                      block_tables=table, seq_lens=lens)
    elif op == "gather_kv":
        cache = torch.zeros(4, 4, 2, 8, dtype=torch.float64)
        kwargs = dict(key_cache=cache, value_cache=cache, block_tables=table, seq_lens=lens)
    elif op == "mla_paged_attention":
        kwargs = dict(q=torch.zeros(2, 2, 80, dtype=torch.float64), kv_cache=torch.zeros(4, 4, 80, dtype=torch.float64),
                      block_tables=table, seq_lens=lens, kv_lora_rank=64, scale=0.1)
    else:
        kwargs = dict(kv_cache=torch.zeros(4, 4, 80, dtype=torch.float64), block_tables=table, seq_lens=lens,
                      w_kv_b=torch.zeros(64, 64, dtype=torch.float64), kv_lora_rank=64, qk_nope_head_dim=16,
                      v_head_dim=16)
    kwargs.update(changes)
    return kwargs


def as_float32(kwargs):
    """The reference's float64 arguments as float32 (what the kernels take)."""
    return {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 else v
            for k, v in kwargs.items()}


PAGED_OPS = ["paged_attention", "gather_kv", "mla_paged_attention", "mla_decompress"]
BAD_INDICES = {
    "block_tables-int64": ("block_tables", lambda a: dict(block_tables=a["block_tables"].long())),
    "seq_lens-int64": ("seq_lens", lambda a: dict(seq_lens=a["seq_lens"].long())),
    "seq_len-over-capacity": ("seq_lens", lambda a: dict(seq_lens=torch.tensor([9, 3], dtype=I32))),
    "block-id-out-of-range": ("block_tables", lambda a: dict(block_tables=torch.tensor([[1, 4], [3, 0]],
                                                                                        dtype=I32))),
}


@pytest.mark.parametrize("bad", BAD_INDICES, ids=BAD_INDICES)
@pytest.mark.parametrize("op", PAGED_OPS)
def test_reference_validates_indices_like_the_op(op, bad):
    arg, change = BAD_INDICES[bad]
    kwargs = paged_args(op)
    kwargs.update(change(kwargs))
    raises_named(impl("reference", op), op, arg, kwargs)
    raises_named(impl("ops", op), op, arg, as_float32(kwargs))  # the op names the same argument


@pytest.mark.parametrize("op,kwargs,arg", [
    ("reshape_and_cache", lambda: rc_args(torch.zeros(N, B, H, D), torch.zeros(N, B, H, D),
                                          slot_mapping=torch.tensor([0, 5, N * B])), "slot_mapping"),
    ("reshape_and_cache", lambda: rc_args(torch.zeros(N, B, H, D), torch.zeros(N, B, H, D),
                                          slot_mapping=torch.tensor([0, 5, 9], dtype=I32)), "slot_mapping"),
    ("copy_blocks", lambda: dict(cache=torch.zeros(N, 4), block_mapping=torch.tensor([[0, 1], [1, 2]])),
     "block_mapping"),
    ("swap_blocks", lambda: dict(src=torch.zeros(N, 4), dst=torch.zeros(2, 4), block_mapping=torch.tensor([[0, 2]])),
     "block_mapping"),
    ("paged_attention", lambda: paged_args("paged_attention", query=torch.zeros(3, 2, 8, dtype=torch.float64)),
     "query"),
], ids=["slot-out-of-range", "slot_mapping-int32", "copy-dst-is-source", "swap-dst-out-of-range",
        "decode-tokens-ne-seqs"])
def test_reference_validates_writes_and_queries_like_the_op(op, kwargs, arg):
    raises_named(impl("reference", op), op, arg, kwargs())
    raises_named(impl("ops", op), op, arg, as_float32(kwargs()))


# ----------------------------------------------------------------------------------------------------
# found by tests/test_fuzz.py: an expand()ed index tensor, ALiBi slope or sink vector of the wrong length was
# copied to contiguous memory before its length was checked (2^31 elements: gigabytes allocated and written
# before the size error; where the allocation failed, torch's error, naming no argument). Lengths are now
# checked first, a block_mapping with more pairs than destination blocks is an error before it is copied,
# and a copy that cannot be allocated names its argument. 2^61 elements: any copy would need >= 2^63 bytes.
# ----------------------------------------------------------------------------------------------------

HUGE = 2**61


def huge_paged(op, **change):
    kwargs = as_float32(paged_args(op))
    kwargs.update(change)
    return kwargs


@pytest.mark.parametrize("api", ["ops", "torch.ops"])
@pytest.mark.parametrize("op,arg,make", [
    ("paged_attention", "sinks", lambda: huge_paged("paged_attention", sinks=torch.zeros(1).expand(HUGE))),
    ("paged_attention", "alibi_slopes",
     lambda: huge_paged("paged_attention", alibi_slopes=torch.zeros(1).expand(HUGE))),
    ("paged_attention", "seq_lens", lambda: huge_paged("paged_attention", seq_lens=torch.ones(1, dtype=I32).expand(HUGE))),
    ("paged_attention", "query_start_loc",
     lambda: huge_paged("paged_attention", query_start_loc=torch.zeros(1, dtype=I32).expand(HUGE))),
    ("gather_kv", "seq_lens", lambda: huge_paged("gather_kv", seq_lens=torch.ones(1, dtype=I32).expand(HUGE))),
    ("copy_blocks", "block_mapping",
     lambda: dict(cache=torch.zeros(N, 4), block_mapping=torch.tensor([[0, 1]]).expand(HUGE, 2))),
    ("swap_blocks", "block_mapping", lambda: dict(src=torch.zeros(N, 4), dst=torch.zeros(N, 4),
                                                  block_mapping=torch.tensor([[0, 1]]).expand(HUGE, 2))),
    ("paged_attention", "block_tables",  # a legal width, but its copy cannot be allocated: named
     lambda: huge_paged("paged_attention", block_tables=torch.zeros(2, 1, dtype=I32).expand(2, HUGE))),
], ids=["sinks", "alibi_slopes", "seq_lens", "query_start_loc", "gather-seq_lens", "copy-block_mapping",
        "swap-block_mapping", "block_tables-copy-fails"])
def test_expanded_argument_checked_before_it_is_copied(op, arg, make, api):
    kwargs = make()
    keep = [t for t in kwargs.values() if isinstance(t, torch.Tensor) and t.numel() < 2**20]
    raises_named(impl(api, op), op, arg, kwargs, keep)


def strided_huge(tokens, heads, width):
    """[tokens, heads, width] of stride 0 along tokens and stride 2 along width: the op must copy it to read
    it (a unit last stride), and the copy (>= 2^64 bytes) cannot be allocated."""
    return torch.zeros(1, heads, 2 * width)[..., ::2].expand(tokens, heads, width)


@pytest.mark.parametrize("api", ["ops", "torch.ops"])
@pytest.mark.parametrize("op,arg,make", [
    # query_start_loc says 2 tokens: checked before the query is copied (it was copied first: torch's error)
    ("paged_attention", "query_start_loc", lambda: huge_paged(
        "paged_attention", query=strided_huge(2**58, 2, 8),
        query_start_loc=torch.tensor([0, 1, 2], dtype=I32))),
    ("mla_paged_attention", "query_start_loc", lambda: huge_paged(
        "mla_paged_attention", q=strided_huge(2**55, 2, 80), query_start_loc=torch.tensor([0, 1, 2], dtype=I32))),
    # consistent shapes, a copy that cannot be allocated: named
    ("merge_attention_states", "out_a", lambda: dict(
        out_a=strided_huge(2**58, 2, 8), lse_a=torch.zeros(1, 2).expand(2**58, 2),
        out_b=torch.zeros(1, 2, 8).expand(2**58, 2, 8), lse_b=torch.zeros(1, 2).expand(2**58, 2))),
], ids=["paged-varlen-query", "mla-varlen-q", "merge-out_a"])
def test_strided_input_checked_before_it_is_copied(op, arg, make, api):
    kwargs = make()
    keep = [t for t in kwargs.values() if isinstance(t, torch.Tensor) and t.numel() < 2**20]
    raises_named(impl(api, op), op, arg, kwargs, keep)
