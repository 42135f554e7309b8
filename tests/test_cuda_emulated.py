"""The CUDA cache-op kernels and launchers (csrc/cuda/cache_ops.cu) and the paged-attention kernels
(csrc/cuda/attention*.cu / .cuh: SIMT, tensor-core decode and prefill, split merge), compiled for
the CPU with the emulator of tests/cuda_emu/cuda_emu.h, against the same checks as the CPU and
CUDA tests (attention: the float64 reference, outputs poisoned before every launch).

Opt-in (KVKERNELS_CUDA_EMU=1; `make cuda-emu-test`, which CI runs): building takes under a minute. It needs the CUDA headers (nvcc's
include directory), not a GPU, and is how the kernels' logic was checked on a machine without one.
What it cannot show: anything about real hardware (speed, alignment faults, races between CTAs,
launch limits, the rounding order of real tensor cores) and the CUDA bindings (cache_ops_binding.cpp,
attention_binding.cpp), which tests/test_cuda_ops.py, tests/test_cuda_attention.py and the device
parameters of the other tests cover on a GPU (mla_binding.cpp: tests/test_cuda_mla.py).

The MLA kernels (csrc/cuda/mla_*: mla_paged_attention on every path the planner has, SIMT, tensor cores
16 / 64 rows, with splits and the merge; mla_decompress's persist kernel with 64- and 128-row token tiles
and its tile64 kernel with cp.async and TMA weight pipelines) run
on the emulator too, through kvkernels_emu.mla_* ops that use the real planners and launchers, against
the float64 reference with tests/test_cuda_mla.py's tolerances; shapes are smaller than the GPU tests'
where the emulator would be slow (it runs a 64-row CTA of 576-wide rows in about 0.1 s).

The emulator's sm_90 model (wgmma, setmaxnreg, named barriers, mbarrier phases with cp.async arrivals) has
self-tests of its own (test_sm90_*: tests/cuda_emu/sm90_selftest.cpp), and the Hopper wgmma prefill
(csrc/cuda/attention_sm90.cuh, opt-in) runs on it (test_wgmma_prefill*), as do the sm_90a wgmma
mla_decompress (csrc/cuda/mla_decompress_sm90.cuh, KVKERNELS_CUDA_DECOMPRESS=wgmma: every decompress case
of the `variant` fixture, bit for bit against persist128 / tile64, test_mla_decompress_wgmma*) and the Hopper
wgmma MLA decode (csrc/cuda/mla_attention_sm90.cuh, opt-in: test_mla_wgmma_*) and its varlen prefill (the
mla_path fixture's wgmma kinds, the DeepSeek and non-finite MLA cases on wgmma).
"""

import dataclasses
import functools
import math
import os
import sys

import pytest
import torch

import kvkernels  # noqa: F401
import test_cache_ops as cache_tests
from helpers import (assert_bytes_equal, assert_close, force_cuda_plan, generator, make_paged_kv, make_query,
                     query_start_loc, randn, unaligned_copy, upcast)
from test_attention import FEATURE_NAMES, check_features, features, make_case, run_paged_attention
from test_cuda_mla import ATTN_CASES as CUDA_MLA_ATTN_CASES
from test_mla import DECOMPRESS_CASES, make_mla_case, varlen_q_lens
from kvkernels import ops, reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cuda_emu"))
import build_emu  # noqa: E402

pytestmark = [
    pytest.mark.skipif(os.environ.get("KVKERNELS_CUDA_EMU") != "1",
                       reason="opt-in: set KVKERNELS_CUDA_EMU=1 to build the CUDA kernels for the CPU emulator"),
    pytest.mark.skipif(not build_emu.available()[0], reason=build_emu.available()[1]),
]
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def emu():
    return build_emu.build()


def test_reshape_and_cache(emu):
    for case in cache_tests.WRITE_CASES.values():
        cache_tests.check_reshape_and_cache(case, op=lambda k, v, kc, vc, s, k_scale=None, v_scale=None:
                                            emu.reshape_and_cache(k, v, kc, vc, s, k_scale, v_scale))


def test_concat_and_cache_mla(emu):
    import test_mla
    for case in test_mla.CONCAT_CASES.values():
        test_mla.check_concat_and_cache_mla(case, op=lambda kv_c, k_pe, cache, slots, scale=None:
                                            emu.concat_and_cache_mla(kv_c, k_pe, cache, slots, scale))


def test_mixed_layouts(emu):
    cache_tests.check_mixed_layouts_write(op=lambda k, v, kc, vc, s, k_scale=None, v_scale=None:
                                          emu.reshape_and_cache(k, v, kc, vc, s, k_scale, v_scale))
    cache_tests.check_gather_kv_mixed_layouts(
        op=lambda kc, vc, bt, sl, num_tokens, out_dtype, k_scale, v_scale:
        emu.gather_kv(kc, vc, bt, sl, k_scale, v_scale, num_tokens, out_dtype))


def test_reshape_and_cache_scalar_path(emu):
    """head_dim 12: no 16-byte vector fits, the scalar kernel runs."""
    gen = generator(3)
    key, value = randn(9, 2, 12, gen=gen, dtype=bf16), randn(9, 2, 12, gen=gen, dtype=bf16)
    for cache_dtype, scale in ((bf16, None), (torch.float8_e4m3fn, torch.tensor([0.02, 0.05]))):
        caches = [torch.zeros(4, 3, 2, 12, dtype=cache_dtype) for _ in range(4)]
        slots = torch.tensor([0, 5, -1, 11, 2, 7, 1, 3, 4])
        emu.reshape_and_cache(key, value, caches[0], caches[1], slots, scale, scale)
        reference.reshape_and_cache(key, value, caches[2], caches[3], slots, k_scale=scale, v_scale=scale)
        assert_bytes_equal(caches[0], caches[2])
        assert_bytes_equal(caches[1], caches[3])


def test_reshape_and_cache_skips_out_of_range_slots(emu):
    """Without debug checks (device index data), a slot beyond the cache is skipped, never written."""
    key = value = torch.ones(3, 2, 8)
    kc, vc = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    emu.reshape_and_cache(key, value, kc, vc, torch.tensor([1, 8, 2**40]), None, None)
    assert kc.view(8, 16).sum(1).tolist() == [0, 16, 0, 0, 0, 0, 0, 0]


def test_copy_blocks(emu):
    op = lambda cache, m, block_dim=0: emu.copy_blocks(cache, m, block_dim)  # noqa: E731
    for dtype in (f32, bf16, torch.float8_e4m3fn, torch.uint8):
        for block_dim in (2, -4):
            cache_tests.check_copy_blocks_stacked(dtype, block_dim, op=op)
    for kind in cache_tests.BLOCK_DIM0_CASES:
        for pairs in (cache_tests.COPY_PAIRS, []):
            cache_tests.check_copy_blocks_block_dim0(kind, pairs, op=op)


def test_copy_blocks_odd_alignment(emu):
    """A view starting 3 bytes into its storage with 5-byte rows: 1-byte accesses."""
    whole = torch.randint(0, 255, (9 * 4 * 8 + 3,), dtype=torch.uint8)
    view = whole[3:].view(9, 4, 8)[..., :5]
    expected = whole.clone()
    ev = expected[3:].view(9, 4, 8)[..., :5]
    for s, d in cache_tests.COPY_PAIRS:
        ev[d] = ev[s].clone()
    emu.copy_blocks(view, cache_tests.mapping(cache_tests.COPY_PAIRS), 0)
    assert_bytes_equal(whole, expected)


def test_copy_blocks_skips_out_of_range_pairs(emu):
    cache = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    before = cache.clone()
    emu.copy_blocks(cache, torch.tensor([[0, 1], [7, 2], [3, 9], [-1, 4], [5, 3]]), 0)
    before[1], before[3] = before[0], before[5]
    assert_bytes_equal(cache, before)


@pytest.mark.parametrize("path", [0, 1], ids=["kernel", "memcpy"])
def test_swap_blocks(emu, path):
    def op(src, dst, m, block_dim=0):
        emu.swap_blocks(src, dst, m, block_dim, path, False)

    for dtype in (f32, bf16, torch.float8_e5m2):
        for shape, block_dim in (((6, 4, 2, 8), 0), ((2, 2, 6, 4, 2, 8), 2), ((2, 2, 6, 4, 2, 8), -4)):
            cache_tests.check_swap_blocks(dtype, shape, block_dim, op=op)


def test_swap_blocks_memcpy_layouts(emu):
    """The cudaMemcpy2DAsync path on an HND view (one run per block) and a row slice (2D copies)."""
    gen = generator(11)
    for shape, view, dim in (((6, 2, 4, 8), lambda x: x.transpose(1, 2), 0), ((6, 16, 80), lambda x: x[..., :72], 0),
                             ((3, 2, 6, 4, 2, 8), lambda x: x[1:], 2), ((6, 4, 2, 8), lambda x: x, 0)):
        src, dst = randn(*shape, gen=gen), randn(*shape, gen=gen)
        pairs = [(5, 1), (0, 3), (1, 4), (2, 5)]  # 0->3, 1->4, 2->5: merged into one copy when contiguous
        expected = dst.clone()
        for s, d in pairs:
            view(expected).select(dim, d).copy_(view(src).select(dim, s))
        emu.swap_blocks(view(src), view(dst), cache_tests.mapping(pairs), dim, 1, False)
        assert_bytes_equal(dst, expected)


def test_swap_blocks_overlapping_staged(emu):
    for views, pairs in (("same", [(0, 1), (1, 2), (2, 0), (3, 5)]), ("shifted", [(0, 2), (1, 0), (4, 1)])):
        cache_tests.check_swap_blocks_overlapping(
            views, pairs, op=lambda src, dst, m, block_dim=0: emu.swap_blocks(src, dst, m, block_dim, 0, True))


def test_gather_kv(emu):
    def op(key_cache, value_cache, block_tables, seq_lens, *, num_tokens=None, out_dtype=None, k_scale=None,
           v_scale=None):
        n = int(seq_lens.sum()) if num_tokens is None else num_tokens
        return emu.gather_kv(key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, n, out_dtype)

    for case in cache_tests.GATHER_CASES.values():
        cache_tests.check_gather_kv(case, op=op)


def test_gather_kv_many_sequences(emu):
    """More sequences than one scan chunk (1024), many of them empty; tokens of several CTAs."""
    from helpers import make_paged_kv
    gen = generator(12)
    lens = [int(x) for x in torch.randint(0, 4, (1500,), generator=gen)]
    kv = make_paged_kv(seq_lens=lens, num_kv_heads=1, head_dim=8, block_size=2, seed=13)
    key, value = emu.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, None, None, sum(lens),
                               None)
    assert_bytes_equal(key, torch.cat(kv.keys).float())
    assert_bytes_equal(value, torch.cat(kv.values).float())


def test_gather_kv_bad_indices_give_zeros(emu):
    """num_tokens beyond sum(seq_lens) and a block id out of range: zeros, no out-of-bounds read."""
    from helpers import make_paged_kv
    kv = make_paged_kv(seq_lens=[3, 5], num_kv_heads=2, head_dim=8, block_size=4, seed=14)
    table = kv.block_tables.clone()
    table[1, 1] = 10**6
    key, _ = emu.gather_kv(kv.key_cache, kv.value_cache, table, kv.seq_lens, None, None, 10, None)
    assert_bytes_equal(key[:7], torch.cat(kv.keys)[:7].float())
    assert key[7:].eq(0).all()


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
def test_merge_attention_states(emu, dtype):
    gen = generator(21)
    t, h, d = 9, 4, 64
    out_a = randn(t, h, d, gen=gen, dtype=dtype)
    out_b = randn(h, t, d, gen=gen, dtype=dtype).transpose(0, 1)
    lse_a, lse_b = randn(t, h, gen=gen, std=3.0), randn(t, h, gen=gen, std=3.0)
    lse_a[0] = float("-inf")
    lse_b[1] = float("-inf")
    lse_a[2, :2] = lse_b[2, :2] = float("-inf")
    lse_a[3], lse_b[3] = 1000.0, 999.0
    out_b[0, 0, 0] = float("nan")  # weight 1 side: stays NaN
    out_a[0, 1, 0] = float("nan")  # weight 0 side: must not leak
    out, lse = emu.merge_attention_states(out_a, lse_a, out_b, lse_b)
    cpu_out, cpu_lse = ops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attention_states(upcast(out_a), lse_a, upcast(out_b), lse_b)
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    assert torch.equal(out[2, :2], torch.zeros(2, d, dtype=dtype))
    assert_close(out, cpu_out.double(), dtype, rtol=0, atol=0, msg="out vs the CPU kernel")
    assert_close(lse, cpu_lse.double(), f32, rtol=1e-6, atol=1e-6, msg="lse vs the CPU kernel")
    # Scalar path: head_dim 6 fits no 16-byte vector.
    out6, _ = emu.merge_attention_states(out_a[..., :6], lse_a, out_b[..., :6], lse_b)
    assert_close(out6, reference.merge_attention_states(upcast(out_a[..., :6]), lse_a, upcast(out_b[..., :6]),
                                                        lse_b)[0], dtype, msg="head_dim 6")


# ---------------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------------

SIMT, MMA_DECODE, MMA_PREFILL, MMA_DECODE_DEEP, MMA_PREFILL_DEEP, MMA_DECODE_FP8_SMEM, MMA_PREFILL_TALL = range(7)
WGMMA_PREFILL = 7  # the sm_90a kernel (opt-in: KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill; section "wgmma prefill")
# The opt-in decode variants of csrc/cuda/README.md "Decode at the bandwidth limit": the wide kernel held to the
# registers of 3 CTAs per SM (query fragments from shared memory), and the one that issues its first tiles before
# the query load and merges splits in its last CTA per work item.
MMA_DECODE_OCC3, MMA_DECODE_FUSED = 8, 9
WGMMA_PREFILL_OVERLAP = 10  # its intra-warpgroup overlapped loop (wgmma-prefill-overlap; padded head dims 64 / 128)
# The fused decode as a persistent grid (mma-decode-persistent; padded head dims 64 / 128, the wide one at 256).
MMA_DECODE_PERSISTENT = 11
# its persistent form (wgmma-prefill-persistent: min(work items, SMs) CTAs walking the items longest-first; the
# overlapped loop at 64 / 128, the plain one at 256; the emulated device has 4 SMs, so most cases have more items)
WGMMA_PREFILL_PERSISTENT = 12
# The tensor-core kernels' two configurations each (csrc/cuda/attention_common.cuh, mma_wn / key_tile_of):
# "wide", the default (decode: 64 keys per stage, 2 stages at head dim 128 / 256; prefill: 64 keys per stage,
# 32 at head dim 256, 2 stages at head dim 128 / 256), and "deep" (16 KiB stages, 4 in flight), chosen by
# KVKERNELS_CUDA_ATTN_PATH=mma-decode-deep / mma-prefill-deep. A test mode "decode-deep" is a decode case run
# with the first set, expecting MMA_DECODE_DEEP where the planner would take MMA_DECODE; "varlen-deep" a
# varlen case with the second, expecting MMA_PREFILL_DEEP where it would take MMA_PREFILL. Over fp8 caches the
# decode kernels convert K / V fragments in registers (head dims 64 / 128); "decode-fp8-smem" runs a decode case
# of an fp8 config with KVKERNELS_CUDA_ATTN_PATH=mma-decode-fp8-smem, the wide kernel converting each stage in
# shared memory (MMA_DECODE_FP8_SMEM), kept for the A/B. "varlen-tall" runs a varlen case with
# KVKERNELS_CUDA_ATTN_PATH=mma-prefill-tall: the prefill kernel with 2 row tiles per warp (MMA_PREFILL_TALL) over
# 16-bit caches at head dims up to 128, the wide one elsewhere. "decode-occ3" / "decode-fused" run a decode case
# of a 16-bit-query config on MMA_DECODE_OCC3 / MMA_DECODE_FUSED (KVKERNELS_CUDA_ATTN_PATH=mma-decode-occ3 /
# mma-decode-fused); "decode-fused-rev" runs the fused one with the emulator's CTAs in reverse order
# (KVKERNELS_EMU_CTA_ORDER=reverse), so that another split of each work item arrives last and merges.
# "decode-persist" / "decode-persist-rev" run it on MMA_DECODE_PERSISTENT (mma-decode-persistent: the planner's
# grid of 2 CTAs per emulated SM, 8, each walking a range of (work item, split) units), in either CTA order;
# "decode-persist-5x3" forces 3 splits and 5 CTAs (PERSIST_FORCED), so that the CTAs' unit ranges start and end
# inside work items, cross sequences and kv heads, and hold empty splits and empty sequences.
VARIANT_ENV = {"decode": None, "decode-deep": "mma-decode-deep", "decode-fp8-smem": "mma-decode-fp8-smem",
               "decode-occ3": "mma-decode-occ3", "decode-fused": "mma-decode-fused",
               "decode-fused-rev": "mma-decode-fused", "decode-persist": "mma-decode-persistent",
               "decode-persist-rev": "mma-decode-persistent", "decode-persist-5x3": "mma-decode-persistent",
               "varlen": None, "varlen-deep": "mma-prefill-deep", "varlen-tall": "mma-prefill-tall"}
PERSIST_FORCED = {"decode-persist-5x3": {"KVKERNELS_CUDA_ATTN_PERSISTENT_CTAS": "5", "KVKERNELS_CUDA_ATTN_SPLITS": "3"}}
# (decode-persist-rev is not among them, for CI time: test_persistent_decode_unit_ranges and test_forced_splits run
# the persistent decode in both CTA orders)
DECODE_MODES = ("decode", "decode-deep", "decode-fp8-smem", "decode-occ3", "decode-fused", "decode-fused-rev",
                "decode-persist", "decode-persist-5x3")


def use_mode(mode: str, monkeypatch) -> str:
    """Sets KVKERNELS_CUDA_ATTN_PATH for a test mode (a key of VARIANT_ENV);
    returns the mode make_case takes ("decode" / "varlen")."""
    monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PATH", raising=False)
    monkeypatch.delenv("KVKERNELS_EMU_CTA_ORDER", raising=False)
    monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PERSISTENT_CTAS", raising=False)
    for name, value in PERSIST_FORCED.get(mode, {}).items():
        monkeypatch.setenv(name, value)
    if VARIANT_ENV.get(mode):
        monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", VARIANT_ENV[mode])
    if mode.endswith("-rev"):
        monkeypatch.setenv("KVKERNELS_EMU_CTA_ORDER", "reverse")
    return "varlen" if mode.startswith("varlen") else "decode"


def expected_path(path, env: str | None, dpad: int = 64, fp8: bool = False):
    """The kernel a case meant for ``path`` runs with KVKERNELS_CUDA_ATTN_PATH=``env`` (a deep configuration
    where it is asked for; the tall prefill where asked for, over a 16-bit cache at a padded head dim ``dpad``
    up to 128)."""
    deep = (env or "").split(",")
    if path == MMA_DECODE and "mma-decode-deep" in deep:
        return MMA_DECODE_DEEP
    if path == MMA_DECODE and "mma-decode-fp8-smem" in deep:  # the modes use it with fp8 caches only
        return MMA_DECODE_FP8_SMEM
    if path == MMA_DECODE and "mma-decode-occ3" in deep:
        return MMA_DECODE_OCC3
    if path == MMA_DECODE and "mma-decode-fused" in deep:
        return MMA_DECODE_FUSED
    if path == MMA_DECODE and "mma-decode-persistent" in deep:  # the wide one at a padded head dim of 256
        return MMA_DECODE_PERSISTENT if dpad <= 128 else MMA_DECODE
    if path == MMA_PREFILL and "mma-prefill-deep" in deep:
        return MMA_PREFILL_DEEP
    if path == MMA_PREFILL and "mma-prefill-tall" in deep and dpad <= 128 and not fp8:
        return MMA_PREFILL_TALL
    if path == 7 and "wgmma-prefill-persistent" in deep:
        return WGMMA_PREFILL_PERSISTENT
    if path == 7 and "wgmma-prefill-overlap" in deep:  # the overlapped loop where it exists, else the plain one
        return WGMMA_PREFILL_OVERLAP if dpad <= 128 else WGMMA_PREFILL
    if path == 7 and "wgmma-prefill" not in deep:  # (WGMMA_PREFILL: asked for, not a default)
        return MMA_PREFILL
    return path


def modes_for(configs: dict, dtype_of=lambda config: config[0], fp8_of=lambda config: config[1]) -> list:
    """(config, mode) parameters: every config in decode and varlen, the 16-bit ones (the tensor-core
    kernels) in decode-deep and varlen-deep as well (float32 queries run the SIMT kernel in every mode), and
    the 16-bit ones over fp8 caches in decode-fp8-smem, and the 16-bit ones in varlen-tall, decode-occ3,
    decode-fused, decode-fused-rev and the decode-persist modes."""
    def runs(config, mode):
        tensor_core = dtype_of(config) != f32
        if mode == "decode-fp8-smem":
            return tensor_core and fp8_of(config) is not None
        return mode in ("decode", "varlen") or tensor_core
    return [pytest.param(config, mode, id=f"{name}-{mode}") for name, config in configs.items()
            for mode in DECODE_MODES + ("varlen", "varlen-deep", "varlen-tall")
            if runs(config, mode)]


def plan_of(emu, kv, query, qsl):
    path, dpad, splits, hpc, q_tile, gx, gy, pc = emu.attention_plan(query, kv.key_cache, kv.value_cache,
                                                                  kv.block_tables, kv.seq_lens, qsl,
                                                                  kv.scales.get("k_scale"), kv.scales.get("v_scale"))
    return dict(path=path, dpad=dpad, splits=splits, heads_per_cta=hpc, q_tile=q_tile, grid=(gx, gy),
                persistent_ctas=pc)


def emulated_paged_attention(emu, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *,
                             scale=None, window_left=-1, soft_cap=0.0, alibi_slopes=None, sinks=None, k_scale=None,
                             v_scale=None, causal=True):
    """``kvkernels_emu::paged_attention`` (positional schema) with ``ops.paged_attention``'s signature."""
    return emu.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                               window_left, soft_cap, alibi_slopes, sinks, k_scale, v_scale, causal)


def check_plan(plan, path, splits) -> None:
    """The plan a case is meant to exercise (``path``; ``splits``: a predicate on the split count),
    asserted so that a planner change cannot quietly move the case to another kernel."""
    if path is not None:
        assert plan["path"] == path, plan
    if splits is not None:
        assert splits(plan["splits"]), plan


def run_emu_attention(emu, kv, query, qsl=None, *, path=None, splits=None, **kwargs):
    """Emulated CUDA kernels vs the float64 reference (test_attention.run_paged_attention's checks);
    `path` / `splits`: the plan the case is meant to exercise, asserted so it cannot drift (with
    KVKERNELS_CUDA_ATTN_PATH=mma-decode-deep set, a case meant for MMA_DECODE must run MMA_DECODE_DEEP, and
    with mma-prefill-deep one meant for MMA_PREFILL MMA_PREFILL_DEEP)."""
    plan = plan_of(emu, kv, query, qsl)
    fp8 = kv.key_cache.element_size() == 1
    check_plan(plan, expected_path(path, os.environ.get("KVKERNELS_CUDA_ATTN_PATH"), plan["dpad"], fp8), splits)
    out, lse = run_paged_attention(kv, query, qsl, op=functools.partial(emulated_paged_attention, emu), **kwargs)
    return out, lse, plan


# id: dtype, fp8, per-head scale, layout, Hq, Hkv, D, B, strided query, expected (decode, varlen) paths
ATTN_CONFIGS = {
    "f32-NHD-mha-d64-b16": (f32, None, False, "NHD", 4, 4, 64, 16, None, (SIMT, SIMT)),
    "f32-HND-gqa4-d128-b5": (f32, None, False, "HND", 8, 2, 128, 5, "transposed", (SIMT, SIMT)),
    "f32-NHD-mqa-d40-b1": (f32, None, False, "NHD", 8, 1, 40, 1, None, (SIMT, SIMT)),
    "f16-NHD-gqa4-d128-b16": (f16, None, False, "NHD", 8, 2, 128, 16, None, (MMA_DECODE, MMA_PREFILL)),
    "f16-HND-gqa8-d64-b5": (f16, None, False, "HND", 16, 2, 64, 5, "fused", (MMA_DECODE, MMA_PREFILL)),
    "f16-NHD-mqa-d72-b16": (f16, None, False, "NHD", 8, 1, 72, 16, None, (MMA_DECODE, MMA_PREFILL)),
    "f16-NHD-gqa32-d64-b16": (f16, None, False, "NHD", 32, 1, 64, 16, None, (MMA_PREFILL, MMA_PREFILL)),
    "bf16-stacked-mha-d64-b1": (bf16, None, False, "stacked", 4, 4, 64, 1, None, (MMA_DECODE, MMA_PREFILL)),
    "bf16-NHD-gqa8-d128-b16": (bf16, None, False, "NHD", 16, 2, 128, 16, "transposed", (MMA_DECODE, MMA_PREFILL)),
    "bf16-NHD-gqa4-d256-b16": (bf16, None, False, "NHD", 8, 2, 256, 16, None, (MMA_DECODE, MMA_PREFILL)),
    "bf16-HND-mqa-d200-b5": (bf16, None, False, "HND", 4, 1, 200, 5, None, (MMA_DECODE, MMA_PREFILL)),
    "e4m3-tensor-bf16-NHD-gqa4-d64-b16": (bf16, "e4m3", False, "NHD", 8, 2, 64, 16, None, (MMA_DECODE, MMA_PREFILL)),
    "e5m2-head-f16-HND-mha-d128-b3": (f16, "e5m2", True, "HND", 4, 4, 128, 3, "fused", (MMA_DECODE, MMA_PREFILL)),
    "e4m3-head-f16-NHD-gqa8-d256-b16": (f16, "e4m3", True, "NHD", 8, 1, 256, 16, None, (MMA_DECODE, MMA_PREFILL)),
    "e4m3-head-bf16-NHD-gqa4-d72-b16": (bf16, "e4m3", True, "NHD", 8, 2, 72, 16, None, (MMA_DECODE, MMA_PREFILL)),
    "e4m3-head-f32-stacked-mqa-d64-b16": (f32, "e4m3", True, "stacked", 8, 1, 64, 16, None, (SIMT, SIMT)),
    "e5m2-tensor-f32-NHD-gqa4-d128-b1": (f32, "e5m2", False, "NHD", 8, 2, 128, 1, None, (SIMT, SIMT)),
}


@pytest.mark.parametrize("config,mode", modes_for(ATTN_CONFIGS))
def test_paged_attention(emu, config, mode, monkeypatch):
    dtype, fp8, per_head, layout, hq, hkv, d, b, strided, paths = config
    mode = use_mode(mode, monkeypatch)
    # Partial and exactly-full last blocks, a one-token and an empty sequence; shuffled block ids. A 4 * 64 + 5
    # key sequence (varlen: a chunk of its last 131 queries): more key tiles than the pipelines have stages at
    # every head dim (16 to 64 keys per stage, 4 stages), so their rings wrap around.
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b, 261]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, strided=strided)
    out, lse, _ = run_emu_attention(emu, kv, query, qsl, path=paths[mode == "varlen"])
    if mode == "decode":  # the empty sequence's query: out = 0, lse = -inf
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isneginf(lse[1]).all()


# id: dtype, fp8, per-head, layout, Hkv, D, B (Hq = 8)
SIMT_CONFIGS = {
    "f16-NHD-gqa4-d128-b16": (f16, None, False, "NHD", 2, 128, 16),
    "bf16-HND-mqa-d64-b5": (bf16, None, False, "HND", 1, 64, 5),
    "e4m3-bf16-NHD-gqa4-d64-b16": (bf16, "e4m3", True, "NHD", 2, 64, 16),
    "e5m2-f16-NHD-gqa8-d256-b16": (f16, "e5m2", False, "NHD", 1, 256, 16),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", SIMT_CONFIGS.values(), ids=SIMT_CONFIGS.keys())
def test_paged_attention_simt_16bit(emu, config, mode, monkeypatch):
    """KVKERNELS_CUDA_ATTN_PATH=simt (read per call by the planner): the SIMT kernel for fp16 / bf16."""
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", "simt")
    dtype, fp8, per_head, layout, hkv, d, b = config
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=8, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head)
    run_emu_attention(emu, kv, query, qsl, path=SIMT)


# id: dtype, fp8, per-head, layout, Hkv, D, B (Hq = 8)
FEATURE_CONFIGS = {
    "f32-NHD-b16": (f32, None, False, "NHD", 2, 64, 16),
    "bf16-HND-b3": (bf16, None, False, "HND", 1, 64, 3),
    "f16-NHD-d128-b16": (f16, None, False, "NHD", 2, 128, 16),
    "e4m3-f16-stacked-b16": (f16, "e4m3", True, "stacked", 2, 64, 16),
}


@pytest.mark.parametrize("feature", FEATURE_NAMES)
@pytest.mark.parametrize("config,mode", modes_for(FEATURE_CONFIGS))
def test_paged_attention_features(emu, config, feature, mode, monkeypatch):
    """test_attention's feature cases (window edges, soft cap, ALiBi, sinks, scale, all) on the emulated kernels,
    plus a sequence long enough for several key tiles."""
    mode = use_mode(mode, monkeypatch)
    check_features(lambda kv, q, qsl, **kw: run_emu_attention(emu, kv, q, qsl, **kw)[:2], config, feature, mode,
                   more_seq_lens=(100,))


# id: dtype, fp8, layout, B, Hkv, D
LONG_CONFIGS = {
    "f32-NHD-b16": (f32, None, "NHD", 16, 1, 64),
    "f16-NHD-b16-d128": (f16, None, "NHD", 16, 1, 128),
    "bf16-e4m3-HND-b64": (bf16, "e4m3", "HND", 64, 1, 64),
    "bf16-HND-b7-gqa4": (bf16, None, "HND", 7, 2, 64),
    "e5m2-f16-NHD-b16-d256": (f16, "e5m2", "NHD", 16, 1, 256),
}


@pytest.mark.parametrize("opts", [{}, dict(window_left=700, sinks=torch.linspace(-1, 1, 8), soft_cap=3.0)],
                         ids=["plain", "window-sinks-cap"])
@pytest.mark.parametrize("config,mode", modes_for(LONG_CONFIGS))
def test_long_context_splits(emu, config, mode, opts, monkeypatch):
    """Few work items and long contexts: the planner (4 emulated SMs) splits the keys and the merge
    kernel combines the partials."""
    dtype, fp8, layout, b, hkv, d = config
    mode = use_mode(mode, monkeypatch)
    seq_lens = [2100, 1]
    kv, query, qsl = make_case("decode", seq_lens, dtype=dtype, num_heads=8, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=True, seed=41)
    if mode == "varlen":  # chunked prefill: a 6-token chunk at the end of the long context (few tiles)
        q_lens = [6, 1]
        qsl = query_start_loc(q_lens)
        query = make_query(sum(q_lens), 8, d, dtype, generator(42))
    run_emu_attention(emu, kv, query, qsl, splits=lambda n: n > 1, **opts)


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_decode_plan_depends_on_shapes_only(emu, dtype):
    """A decode launch is a function of shapes and the device, never of seq_lens (a CUDA graph
    captures it once and replays it as the sequences grow): the same block-table shape with other
    lengths gives the same plan, splits and grid included, and the kernels are right for them."""
    kv, query, _ = make_case("decode", [2100, 900], dtype=dtype, num_heads=8, num_kv_heads=1, head_dim=64,
                             block_size=16, seed=43)
    plan = plan_of(emu, kv, query, None)
    assert plan["splits"] > 1, plan
    for lens in ([1, 1], [2100, 0], [17, 899], [1000, 900]):
        other = dataclasses.replace(kv, seq_lens=torch.tensor(lens, dtype=torch.int32))
        assert plan_of(emu, other, query, None) == plan, lens
        run_emu_attention(emu, other, query)
    # ... while the shapes do steer it: a table of 20 blocks per row describes too few keys to split.
    narrow = dataclasses.replace(kv, block_tables=kv.block_tables[:, :20].contiguous(),
                                 seq_lens=torch.tensor([300, 300], dtype=torch.int32))
    assert plan_of(emu, narrow, query, None)["splits"] == 1


# The planners on an emulated H200 (KVKERNELS_EMU_SM_COUNT=132, 227 / 228 KiB of shared memory per block / SM;
# attention.cu caches the SM count per process, hence a process of its own): only shapes are needed, so the
# caches are 4 blocks and the tables all zeros. Case -> (op, batch, keys, heads, cache dtype,
# KVKERNELS_CUDA_ATTN_PATH or None, expected splits).
H200_DECODE_SPLITS = {
    # paged_attention, the default (wide) decode, head dim 128, 32 / 8 heads, bf16: 2 CTAs per SM, 264 slots.
    # 512 work items over 64 key tiles: 1 split (2 waves, the second 94% full; 2 splits would be 4 waves).
    "attn-b64-4k-bf16": ("attn", 64, 4096, 32, "bfloat16", None, 1),
    # 8 work items over 512 tiles: 32 splits fill one wave of 256 CTAs (33 would too, at the same 16 tiles
    # per CTA: the smaller count wins the tie).
    "attn-b1-32k-bf16": ("attn", 1, 32768, 32, "bfloat16", None, 32),
    "attn-b64-4k-e4m3": ("attn", 64, 4096, 32, "float8_e4m3fn", None, 1),
    "attn-b1-32k-e4m3": ("attn", 1, 32768, 32, "float8_e4m3fn", None, 32),
    # The deep decode (mma-decode-deep): 3 CTAs per SM, 396 slots. 512 work items over 128 key tiles: 3 splits
    # (4 waves of 1536 CTAs) instead of 1 (2 waves, the second 29% full).
    "attn-deep-b64-4k-bf16": ("attn", 64, 4096, 32, "bfloat16", "mma-decode-deep", 3),
    # 8 work items over 1024 tiles: 49 splits fill one wave of 392 CTAs.
    "attn-deep-b1-32k-bf16": ("attn", 1, 32768, 32, "bfloat16", "mma-decode-deep", 49),
    # e4m3: 4 CTAs per SM, 528 slots: 512 items are one wave already.
    "attn-deep-b64-4k-e4m3": ("attn", 64, 4096, 32, "float8_e4m3fn", "mma-decode-deep", 1),
    # 66 splits would fill 528 slots; 64 already give 16 tiles per CTA, the least time, and win the tie.
    "attn-deep-b1-32k-e4m3": ("attn", 1, 32768, 32, "float8_e4m3fn", "mma-decode-deep", 64),
    # The occ3 decode (mma-decode-occ3): 3 CTAs per SM at every head dim and cache format, 396 slots. 8 work items
    # over 512 tiles: 47 splits, one wave of 376 CTAs of 11 tiles (up to 49 splits give 11 tiles too: the
    # smallest count wins the tie); 512 items over 64 tiles: 3 splits (4 waves of 1536 CTAs: 4 x (22 + 2) + 1 =
    # 97 tile times against 2 x (64 + 2) = 132 for 1 split in 2 waves).
    "attn-occ3-b1-32k-bf16": ("attn", 1, 32768, 32, "bfloat16", "mma-decode-occ3", 47),
    "attn-occ3-b1-32k-e4m3": ("attn", 1, 32768, 32, "float8_e4m3fn", "mma-decode-occ3", 47),
    "attn-occ3-b64-4k-e4m3": ("attn", 64, 4096, 32, "float8_e4m3fn", "mma-decode-occ3", 3),
    # The fused decode counts the wide one's 2 CTAs per SM.
    "attn-fused-b1-32k-bf16": ("attn", 1, 32768, 32, "bfloat16", "mma-decode-fused", 32),
    # The persistent decode: [splits, CTAs]. 2 CTAs per SM (264 slots; ~77 KiB each); its units cost their tiles
    # only (choose_persistent_splits): 512 items over 64 tiles stay unsplit, 264 CTAs of 1 or 2 items; 8 items over
    # 512 tiles take 32 splits, 256 CTAs of one unit each (33 would fill 264 at the same 16 tiles: the tie).
    "attn-persist-b64-4k-bf16": ("attn", 64, 4096, 32, "bfloat16", "mma-decode-persistent", [1, 264]),
    "attn-persist-b1-32k-bf16": ("attn", 1, 32768, 32, "bfloat16", "mma-decode-persistent", [32, 256]),
    "attn-persist-b64-4k-e4m3": ("attn", 64, 4096, 32, "float8_e4m3fn", "mma-decode-persistent", [1, 264]),
    "attn-persist-b1-32k-e4m3": ("attn", 1, 32768, 32, "float8_e4m3fn", "mma-decode-persistent", [32, 256]),
    # mla_paged_attention, 16 heads: the 16-row kernel, 2 CTAs per SM (264 slots): 4 splits make 256 CTAs,
    # one wave (the first planner: 5, 320 CTAs in two waves).
    "mla-b64-4k-h16": ("mla", 64, 4096, 16, "bfloat16", None, 4),
    # 128 heads: the 64-row kernel, 1 CTA per SM (132 slots): 128 work items are one wave (the first planner: 2
    # splits, two waves).
    "mla-b64-4k-h128": ("mla", 64, 4096, 128, "bfloat16", None, 1),
}
_H200_PLAN = """
import json, os, sys, torch, build_emu
emu = build_emu.build()
out = {}
for name, (op, batch, keys, heads, dtype, path, _) in json.loads(sys.argv[1]).items():
    os.environ.pop("KVKERNELS_CUDA_ATTN_PATH", None)
    if path:
        os.environ["KVKERNELS_CUDA_ATTN_PATH"] = path  # read per call
    tables = torch.zeros(batch, keys // 16, dtype=torch.int32)
    lens = torch.full((batch,), keys, dtype=torch.int32)
    if op == "attn":
        cache = torch.zeros(4, 16, 8, 128).to(getattr(torch, dtype))
        scale = torch.ones(1) if dtype.startswith("float8") else None
        query = torch.zeros(batch, heads, 128, dtype=torch.bfloat16)
        plan = emu.attention_plan(query, cache, cache, tables, lens, None, scale, scale)
        out[name] = [plan[2], plan[7]] if plan[0] == 11 else plan[2]  # the persistent decode: its grid too
    else:
        cache = torch.zeros(4, 16, 576, dtype=getattr(torch, dtype))
        query = torch.zeros(batch, heads, 576, dtype=torch.bfloat16)
        out[name] = emu.mla_attention_plan(query, cache, tables, lens, 512, None, None)[6]
print(json.dumps(out))
"""


def test_decode_splits_fill_whole_waves():
    """Decode splits minimise wave-quantized time (attention_common.cuh choose_splits) with each kernel's
    residency (2 CTAs per SM; the deep decode: 3 or 4 on sm_90, from its shared memory), at the issue-24 target
    shapes of paged_attention and mla_paged_attention."""
    import json
    import subprocess
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVKERNELS_CUDA_ATTN_", "KVKERNELS_CUDA_MLA_"))}
    env["KVKERNELS_EMU_SM_COUNT"] = "132"
    done = subprocess.run([sys.executable, "-c", _H200_PLAN, json.dumps(H200_DECODE_SPLITS)], env=env,
                          cwd=os.path.join(os.path.dirname(__file__), "cuda_emu"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {name: case[-1] for name, case in H200_DECODE_SPLITS.items()}


@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_variant_override(emu, d, monkeypatch):
    """KVKERNELS_CUDA_ATTN_PATH picks the decode configuration (read per call): wide by default (also for
    `auto` / `mma-decode-wide`), deep when asked; varlen stays on the prefill kernel and float32 queries on
    SIMT whatever it says; the split cap counts the chosen kernel's key tiles (16 / 32 / 64 keys deep, 32 / 64
    wide); an unknown value is an error instead of a silent default (a misspelt A/B would time one kernel
    twice)."""
    kv, query, _ = make_case("decode", [300, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=d,
                             block_size=16, seed=44)
    kv32, query32, _ = make_case("decode", [300, 7], dtype=f32, num_heads=8, num_kv_heads=2, head_dim=d,
                                 block_size=16, seed=44)
    _, varlen_query, qsl = make_case("varlen", [300, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=d,
                                     block_size=16, seed=44)
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", "128")
    max_keys = kv.block_tables.shape[1] * 16
    for value, path, key_tile in ((None, MMA_DECODE, {64: 64, 128: 64, 256: 32}[d]),
                                  ("auto", MMA_DECODE, {64: 64, 128: 64, 256: 32}[d]),
                                  ("mma-decode-wide", MMA_DECODE, {64: 64, 128: 64, 256: 32}[d]),
                                  ("mma-decode-deep", MMA_DECODE_DEEP, {64: 64, 128: 32, 256: 16}[d]),
                                  ("mma-decode-occ3", MMA_DECODE_OCC3, {64: 64, 128: 64, 256: 32}[d]),
                                  ("mma-decode-fused", MMA_DECODE_FUSED, {64: 64, 128: 64, 256: 32}[d]),
                                  ("mma-decode-persistent", MMA_DECODE_PERSISTENT if d <= 128 else MMA_DECODE,
                                   {64: 64, 128: 64, 256: 32}[d])):
        monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PATH", raising=False)
        if value:
            monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", value)
        plan = plan_of(emu, kv, query, None)
        assert plan["path"] == path and plan["splits"] == -(-max_keys // key_tile), (value, plan)
        assert plan_of(emu, kv, varlen_query, qsl)["path"] == MMA_PREFILL
        assert plan_of(emu, kv32, query32, None)["path"] == SIMT
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", "mma-decode-wdie")
    with pytest.raises(RuntimeError, match="KVKERNELS_CUDA_ATTN_PATH=mma-decode-wdie is not one of"):
        plan_of(emu, kv, query, None)
    # mma-decode-fp8-smem: the wide kernel converting fp8 stages in shared memory, over an fp8 cache only (over
    # a 16-bit one the wide kernel); the same key tile as wide; one decode choice at a time.
    kv8, query8, _ = make_case("decode", [300, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=d,
                               block_size=16, fp8="e4m3", seed=44)
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", "mma-decode-fp8-smem")
    plan = plan_of(emu, kv8, query8, None)
    assert plan["path"] == MMA_DECODE_FP8_SMEM and plan["splits"] == -(-max_keys // {64: 64, 128: 64, 256: 32}[d])
    assert plan_of(emu, kv, query, None)["path"] == MMA_DECODE
    monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PATH")
    assert plan_of(emu, kv8, query8, None)["path"] == MMA_DECODE
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", "mma-decode-fp8-smem,mma-decode-deep")
    with pytest.raises(RuntimeError, match="is not one of"):
        plan_of(emu, kv8, query8, None)


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_decode_bf16_query_range(emu, d, fp8, monkeypatch):
    """bf16 queries over an fp8 cache: the decode kernels run the mma in fp16 with each query row scaled by a
    power of two into fp16's range (attention_mma.cuh, Q_RESCALE). Rows far outside it (values up to ~1e6, past
    fp16's 65504; ~1e-7, fp16 subnormals; one row mixing 4e4 with normal values, one NaN row element) still
    match the float64 reference, in every decode configuration that converts fragments in registers (occ3
    reloads the scaled query fragments from shared memory at every k-step)."""
    kv, query, _ = make_case("decode", [300, 7, 64], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=d,
                             block_size=16, fp8=fp8, per_head=True, seed=46)
    query[:, 0] *= 3e5
    query[:, 1] *= 1e-7
    query[:, 2, :5] = 4e4
    query[1, 3, 7] = float("nan")
    for value in (None, "mma-decode-deep", "mma-decode-occ3", "mma-decode-fused", "mma-decode-persistent"):
        monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PATH", raising=False)
        if value:
            monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", value)
        out, lse, _ = run_emu_attention(emu, kv, query, path=MMA_DECODE)
        assert out[1, 3].isnan().all() and not out[0].isnan().any()


@pytest.mark.parametrize("d", [64, 128, 256])
def test_prefill_variant_override(emu, d, monkeypatch):
    """KVKERNELS_CUDA_ATTN_PATH picks the prefill configuration as it picks the decode one: wide by default
    (also for `auto` / `mma-prefill-wide`), deep when asked, alone or next to a decode choice (a comma-separated
    list); decode plans stay as they were and float32 queries on SIMT; the split cap counts the chosen kernel's
    key tiles (64 / 32 / 16 keys deep, 64 / 64 / 32 wide); a list naming one kernel twice, `simt` with anything
    else, an empty item or an unknown name is an error."""
    kv, query, qsl = make_case("varlen", [300, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=d,
                               block_size=16, seed=45)
    kv32, query32, qsl32 = make_case("varlen", [300, 7], dtype=f32, num_heads=8, num_kv_heads=2, head_dim=d,
                                     block_size=16, seed=45)
    _, decode_query, _ = make_case("decode", [300, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=d,
                                   block_size=16, seed=45)
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", "128")
    max_keys = kv.block_tables.shape[1] * 16
    deep, wide = {64: 64, 128: 32, 256: 16}[d], {64: 64, 128: 64, 256: 32}[d]
    for value, path, key_tile, decode_path in (
            (None, MMA_PREFILL, wide, MMA_DECODE),
            ("auto", MMA_PREFILL, wide, MMA_DECODE),
            ("mma-prefill-wide", MMA_PREFILL, wide, MMA_DECODE),
            ("mma-prefill-deep", MMA_PREFILL_DEEP, deep, MMA_DECODE),
            ("mma-decode-deep", MMA_PREFILL, wide, MMA_DECODE_DEEP),
            ("mma-decode-deep,mma-prefill-deep", MMA_PREFILL_DEEP, deep, MMA_DECODE_DEEP),
            ("mma-prefill-deep,mma-decode-wide", MMA_PREFILL_DEEP, deep, MMA_DECODE),
            ("auto,mma-prefill-wide", MMA_PREFILL, wide, MMA_DECODE)):
        monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PATH", raising=False)
        if value:
            monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", value)
        plan = plan_of(emu, kv, query, qsl)
        assert plan["path"] == path and plan["splits"] == -(-max_keys // key_tile), (value, plan)
        assert plan["q_tile"] == 64 // 4 and plan["heads_per_cta"] == 4, plan  # 64 rows in both
        assert plan_of(emu, kv, decode_query, None)["path"] == decode_path, value
        assert plan_of(emu, kv32, query32, qsl32)["path"] == SIMT
    # mma-prefill-tall: 2 row tiles per warp, 128 rows (32 queries x 4 heads) and 32 keys per stage, at head dims
    # up to 128; at 256 the wide kernel. Decode plans stay as they were.
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", "mma-prefill-tall")
    plan = plan_of(emu, kv, query, qsl)
    if d <= 128:
        assert plan["path"] == MMA_PREFILL_TALL and plan["splits"] == -(-max_keys // 32), plan
        assert plan["q_tile"] == 128 // 4 and plan["heads_per_cta"] == 4, plan
    else:
        assert plan["path"] == MMA_PREFILL and plan["q_tile"] == 64 // 4, plan
    assert plan_of(emu, kv, decode_query, None)["path"] == MMA_DECODE
    for bad in ("mma-prefill-tall,mma-prefill-deep", "mma-prefill-wdie", "mma-prefill-wide,mma-prefill-deep",
                "mma-decode-wide,mma-decode-wide",
                "simt,mma-prefill-wide", "mma-prefill-wide,", ",", "mma-prefill-wide mma-decode-wide"):
        monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", bad)
        with pytest.raises(RuntimeError, match=f"KVKERNELS_CUDA_ATTN_PATH={bad} is not one of"):
            plan_of(emu, kv, query, qsl)


@pytest.mark.parametrize("splits", [3, 128])
@pytest.mark.parametrize("dtype,variant", [(f32, None), (bf16, None), (bf16, "decode-occ3"), (bf16, "decode-fused"),
                                           (bf16, "decode-fused-rev"), (bf16, "decode-persist"),
                                           (bf16, "decode-persist-rev")],
                         ids=["f32", "bf16", "bf16-occ3", "bf16-fused", "bf16-fused-rev", "bf16-persist",
                              "bf16-persist-rev"])
def test_forced_splits(emu, dtype, variant, splits, monkeypatch):
    """KVKERNELS_CUDA_ATTN_SPLITS: more splits than some sequences have key tiles (empty splits); with bf16
    queries also on the opt-in decode variants (the fused one merges in its last CTA per work item, which is
    the last split in the emulator's order and the first one in reverse order)."""
    if variant:
        use_mode(variant, monkeypatch)
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", str(splits))
    for mode in ("decode", "varlen"):
        kv, query, qsl = make_case(mode, [300, 0, 1, 77, 16], dtype=dtype, num_heads=4, num_kv_heads=2,
                                   head_dim=64, block_size=16, seed=5)
        run_emu_attention(emu, kv, query, qsl, splits=lambda n: n > 1, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))


@pytest.mark.parametrize("fp8,d", [(None, 64), ("e4m3", 128)], ids=["bf16-d64", "e4m3-d128"])
@pytest.mark.parametrize("ctas,splits", [(1, 1), (1, 4), (3, 1), (7, 4), (1000, 2)])
def test_persistent_decode_unit_ranges(emu, ctas, splits, fp8, d, monkeypatch):
    """The persistent decode (mma-decode-persistent) with forced grids and splits: one CTA walking every unit
    (its pipeline crosses every work item, empty sequences and empty splits between them), ranges that start and
    end inside work items (7 CTAs over 4 splits of 14 items), and more CTAs than units (capped at the units);
    in both CTA orders (another CTA arrives last at each item). Sequence 1 is empty, 2 has one key, 5 fills
    exactly one 64-key tile, 6 is empty at the end."""
    kv, query, _ = make_case("decode", [300, 0, 1, 130, 77, 64, 0], dtype=bf16, num_heads=8, num_kv_heads=2,
                             head_dim=d, block_size=16, fp8=fp8, per_head=fp8 is not None, seed=47)
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", "mma-decode-persistent")
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PERSISTENT_CTAS", str(ctas))
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", str(splits))
    units = 7 * 2 * splits
    for order in ("forward", "reverse"):
        monkeypatch.setenv("KVKERNELS_EMU_CTA_ORDER", order)
        out, lse, plan = run_emu_attention(emu, kv, query, path=MMA_DECODE, splits=lambda n: n == splits,
                                           sinks=torch.tensor([0.5, -1.0, 2.0, 0.0, 0.1, 0.2, 0.3, 0.4]))
        assert plan["persistent_ctas"] == min(ctas, units), plan
        assert lse[1].isfinite().all() and torch.equal(out[6], torch.zeros_like(out[6]))  # sinks; no keys


# id: dtype, Hq, Hkv, D, B, forced path (None: the planner's), forced splits
NONCAUSAL_CONFIGS = {
    "f32-simt-gqa2": (f32, 4, 2, 64, 16, None, None),
    "f16-mma-gqa4": (f16, 8, 2, 128, 16, None, None),
    "bf16-mma-mqa-b5": (bf16, 4, 1, 64, 5, None, None),
    "bf16-simt-split3": (bf16, 4, 2, 64, 16, "simt", 3),
    "f16-mma-split3": (f16, 8, 2, 64, 16, None, 3),
}


@pytest.mark.parametrize("opts", [{}, dict(window_left=9), dict(alibi_slopes=torch.linspace(-0.2, 0.3, 8)[:4],
                                                                 sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))],
                         ids=["plain", "window9", "alibi-sinks"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("config", NONCAUSAL_CONFIGS.values(), ids=NONCAUSAL_CONFIGS.keys())
def test_noncausal_and_more_queries_than_keys(emu, config, causal, opts, monkeypatch):
    """causal=False (a window keeps its lower bound; keys past seq_len in a sequence's last tile masked) and
    sequences with more queries than keys (causal: leading rows see no key), on the SIMT and tensor-core
    kernels, with forced splits (the merge kernel finds each row's sequence to tell 'no key' from NaN)."""
    dtype, hq, hkv, d, b, path, splits = config
    force_cuda_plan(monkeypatch, "ATTN", path, splits)
    if "alibi_slopes" in opts and hq != 4:
        opts = dict(opts, alibi_slopes=torch.linspace(-0.2, 0.3, hq), sinks=torch.linspace(-1.0, 1.0, hq))
    seq_lens, q_lens = [b + 1, 0, 70, 3, 40, 9], [b + 1, 3, 33, 7, 1, 70]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype, seed=13)
    query = make_query(sum(q_lens), hq, d, dtype, generator(14))
    qsl = query_start_loc(q_lens)
    out, lse, _ = run_emu_attention(emu, kv, query, qsl, splits=(lambda n: n > 1) if splits else None,
                                    causal=causal, **opts)
    starts = qsl.tolist()
    empty = list(range(starts[1], starts[2]))  # seq_len 0
    if causal:  # 4 of the 7 queries over 3 keys, 61 of the 70 over 9
        empty += list(range(starts[3], starts[3] + 4)) + list(range(starts[5], starts[5] + 61))
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    # decode with causal=False: the same numbers as causal
    kv_d, query_d, _ = make_case("decode", seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                                 block_size=b, seed=15)
    if not causal:
        a = run_emu_attention(emu, kv_d, query_d, None, causal=False, **opts)[:2]
        c = run_emu_attention(emu, kv_d, query_d, None, **opts)[:2]
        assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


@pytest.mark.parametrize("opts", [{}, dict(window_left=37)], ids=["causal", "window"])
@pytest.mark.parametrize("dtype,hq,hkv,b", [(f32, 2, 2, 16), (f16, 2, 2, 16), (bf16, 8, 2, 5)],
                         ids=["f32-mha-b16", "f16-mha-b16", "bf16-gqa4-b5"])
def test_full_prefill_many_tiles(emu, dtype, hq, hkv, b, opts):
    """Full prefill of sequences longer than a query tile: several tiles per sequence, key tiles past
    the causal diagonal (or before the window) skipped, the last tile of a sequence partial."""
    seq_lens = [150, 3, 70]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=64, block_size=b, dtype=dtype, seed=9)
    query = make_query(sum(seq_lens), hq, 64, dtype, generator(10))
    qsl = query_start_loc(seq_lens)
    _, _, plan = run_emu_attention(emu, kv, query, qsl, **opts)
    assert plan["grid"][0] > len(seq_lens), plan


# ---------------------------------------------------------------------------------------------------
# a value head dim different from the key's (docs/ops.md; tests/test_head_dims.py on the CPU): the
# kernels run on the padding of max(Dk, Dv), K zero-filled past Dk and V past Dv
# ---------------------------------------------------------------------------------------------------

# id: dtype, fp8, layout, Hq, Hkv, Dk, Dv, B, expected (decode, varlen) paths, expected padded dim.
# The stacked layout's views are slices of a max(Dk, Dv)-wide NaN-filled allocation: a read past either
# head dim shows as NaN.
DV_CONFIGS = {
    "f32-NHD-k64-v32-b16": (f32, None, "NHD", 4, 2, 64, 32, 16, (SIMT, SIMT), 64),
    "f32-HND-k64-v128-b5": (f32, None, "HND", 4, 1, 64, 128, 5, (SIMT, SIMT), 128),
    "bf16-NHD-k192-v128-b16": (bf16, None, "NHD", 8, 2, 192, 128, 16, (MMA_DECODE, MMA_PREFILL), 256),
    "f16-stacked-k32-v96-b16": (f16, None, "stacked", 4, 1, 32, 96, 16, (MMA_DECODE, MMA_PREFILL), 128),
    "bf16-stacked-k128-v40-b7": (bf16, None, "stacked", 8, 2, 128, 40, 7, (MMA_DECODE, MMA_PREFILL), 128),
    "e4m3-head-bf16-NHD-k192-v128-b16": (bf16, "e4m3", "NHD", 8, 2, 192, 128, 16, (MMA_DECODE, MMA_PREFILL), 256),
    "e5m2-f32-NHD-k64-v192-b16": (f32, "e5m2", "NHD", 4, 2, 64, 192, 16, (SIMT, SIMT), 256),
}


def dv_case(mode, seq_lens, dtype, fp8, layout, hq, hkv, dk, dv, b, seed=0):
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=dk, head_dim_v=dv, block_size=b,
                       dtype=dtype, layout=layout, fp8=fp8, per_head_scale=(True, False), seed=seed)
    q_lens = [1] * len(seq_lens) if mode == "decode" else varlen_q_lens(seq_lens)
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    return kv, make_query(sum(q_lens), hq, dk, dtype, generator(seed + 1)), qsl


@pytest.mark.parametrize("config,mode", modes_for(DV_CONFIGS))
def test_paged_attention_value_head_dim(emu, config, mode, monkeypatch):
    dtype, fp8, layout, hq, hkv, dk, dv, b, paths, dpad = config
    mode = use_mode(mode, monkeypatch)
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b]
    kv, query, qsl = dv_case(mode, seq_lens, dtype, fp8, layout, hq, hkv, dk, dv, b)
    out, lse, plan = run_emu_attention(emu, kv, query, qsl, path=paths[mode == "varlen"])
    assert plan["dpad"] == dpad and out.shape[-1] == dv
    if mode == "decode":
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("variant", ["simt", "splits3", "all-features"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_paged_attention_value_head_dim_variants(emu, variant, mode, monkeypatch):
    """The SIMT kernel for 16-bit queries, forced KV splits (partials and merge Dv wide) and every logit
    option, with Dk 192 / Dv 128 and Dk 64 / Dv 128."""
    force_cuda_plan(monkeypatch, "ATTN", "simt" if variant == "simt" else None, 3 if variant == "splits3" else None)
    kwargs = features(16, 192)["all"] if variant == "all-features" else {}
    for dk, dv in ((192, 128), (64, 128)):
        kv, query, qsl = dv_case(mode, [40, 0, 17, 1], bf16, None, "NHD", 8, 2, dk, dv, 16, seed=dk)
        run_emu_attention(emu, kv, query, qsl, path=SIMT if variant == "simt" else None,
                          splits=(lambda n: n > 1) if variant == "splits3" else None, **kwargs)


@pytest.mark.parametrize("dtype", [f32, f16])
def test_paged_attention_nonfinite_values_past_dk(emu, dtype):
    """Prefill, Dk 32 / Dv 96: NaN / inf in value columns past Dk, on the causal diagonal of a tile (the
    tensor-core kernel's fix-up of keys some rows do not see covers every V column), reach exactly the
    output columns of the rows that see them."""
    seq_lens = [70, 5]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=32, head_dim_v=96, block_size=16,
                       dtype=dtype, seed=33)
    qsl = query_start_loc(seq_lens)
    query = make_query(sum(seq_lens), 4, 32, dtype, generator(34))
    _poke(kv.value_cache, kv.blocks[0], 70, 20, 0, 40, "nan")
    _poke(kv.value_cache, kv.blocks[0], 70, 41, 1, 95, "+inf")
    out, _, _ = run_emu_attention(emu, kv, query, qsl, path=SIMT if dtype == f32 else MMA_PREFILL)
    assert out[:20].isfinite().all() and out[20:70, :, 40].isnan().any() and out[41:70, :, 95].isinf().any()


def between_nan_blocks(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` [N, ...] copied into blocks 1..N of an [N + 2, ...] allocation whose blocks 0 and N + 1
    are NaN: a read of block id -1 or N through the returned view finds NaN."""
    big = torch.full((cache.shape[0] + 2, *cache.shape[1:]), float("nan"), dtype=cache.dtype)
    big[1:-1] = cache
    return big[1:-1]


def out_of_range_ids(table: torch.Tensor, used: list, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``table`` with the (row, column) entries of ``used`` (blocks the sequences read) set to -1, N,
    INT32_MIN and INT32_MAX in turn, and the table the reference reads instead: those entries -> N,
    a zero block appended to the cache (without KVKERNELS_DEBUG the CUDA kernels read an out-of-range
    id as a zero row, docs/design.md section 6)."""
    bad, ref = table.clone(), table.clone()
    for (row, col), value in zip(used, (-1, n, -2**31, 2**31 - 1)):
        bad[row, col], ref[row, col] = value, n
    return bad, ref


@pytest.mark.parametrize("kind", [None, "simt"], ids=["planned", "simt"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_paged_attention_out_of_range_block_ids_read_nothing(emu, mode, kind, monkeypatch):
    """Block ids -1, N, INT32_MIN and INT32_MAX in visible blocks: zero rows, nothing read outside the
    caches (they sit between NaN blocks; the two extreme ids would fault). The loaders check an id where
    they use it, a tile after loading it (csrc/cuda/attention_common.cuh, TileLoader)."""
    force_cuda_plan(monkeypatch, "ATTN", kind, None)
    b, seq_lens = 16, [3 * 16 + 5, 2 * 16, 16 + 1]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=128, block_size=b, dtype=bf16, seed=71)
    n = kv.key_cache.shape[0]
    k, v = between_nan_blocks(kv.key_cache), between_nan_blocks(kv.value_cache)
    table, ref_table = out_of_range_ids(kv.block_tables, [(0, 1), (1, 0), (0, 3), (2, 1)], n)
    q_lens = [1] * 3 if mode == "decode" else [20, 1, 17]
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    query = make_query(sum(q_lens), 8, 128, bf16, generator(72))
    out, lse = emulated_paged_attention(emu, query, k, v, table, kv.seq_lens, qsl)
    zero = torch.zeros(1, *k.shape[1:], dtype=k.dtype)
    ref_out, ref_lse = reference.paged_attention(upcast(query), upcast(torch.cat([k, zero])),
                                                 upcast(torch.cat([v, zero])), ref_table, kv.seq_lens, qsl)
    assert out.isfinite().all()
    assert_close(out, ref_out, bf16, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_paged_attention_value_cache_a_prefix_view(emu, mode):
    """value_cache = key_cache[..., :64]: the same first byte as the key cache (read-only ops may take
    overlapping views); the planner takes it like any two caches."""
    kv, query, qsl = dv_case(mode, [40, 0, 17, 33], bf16, None, "NHD", 8, 2, 128, 128, 16, seed=61)
    kv = dataclasses.replace(kv, value_cache=kv.key_cache[..., :64])
    out, _, plan = run_emu_attention(emu, kv, query, qsl)
    assert out.shape[-1] == 64 and plan["dpad"] == 128


@pytest.mark.parametrize("fp8", [None, "e4m3"])
@pytest.mark.parametrize("dk,dv", [(192, 128), (24, 64)])
def test_gather_kv_value_head_dim(emu, dk, dv, fp8):
    """K and V of different widths: one launch each (vector loads where the widths allow)."""
    kv = make_paged_kv(seq_lens=[5, 0, 33, 16], num_kv_heads=2, head_dim=dk, head_dim_v=dv, block_size=16,
                       dtype=bf16, fp8=fp8, per_head_scale=(False, True), seed=15)
    for out_dtype in (None, f32):
        key, value = emu.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, kv.k_scale,
                                   kv.v_scale, 54, out_dtype)
        ref = reference.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **kv.scales,
                                  out_dtype=out_dtype)
        assert_bytes_equal(key, ref[0], "key")
        assert_bytes_equal(value, ref[1], "value")


def test_reshape_and_cache_value_head_dim(emu):
    kv = make_paged_kv(seq_lens=[5, 9], num_kv_heads=2, head_dim=192, head_dim_v=128, block_size=4,
                       dtype=f16, fp8="e5m2", per_head_scale=(True, False), seed=16)
    gen = generator(17)
    slots = torch.tensor([5 % 4 + kv.blocks[0][1] * 4, -1, (kv.num_blocks - 1) * 4 + 1])
    key, value = randn(3, 2, 192, gen=gen, dtype=f16), randn(3, 2, 128, gen=gen, dtype=f16)
    ref_k, ref_v = kv.key_cache.clone(), kv.value_cache.clone()
    emu.reshape_and_cache(key, value, kv.key_cache, kv.value_cache, slots, kv.k_scale, kv.v_scale)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots, **kv.scales)
    assert_bytes_equal(kv.key_cache, ref_k, "key_cache")
    assert_bytes_equal(kv.value_cache, ref_v, "value_cache")


# ---------------------------------------------------------------------------------------------------
# mla_paged_attention (csrc/cuda/mla_attention*.cu / .cuh, mla_merge.cuh)
# ---------------------------------------------------------------------------------------------------

MLA_SIMT, MLA_MMA16, MLA_MMA64, MLA_WGMMA = 0, 1, 2, 3
# (KVKERNELS_CUDA_MLA_PATH, KVKERNELS_CUDA_MLA_SPLITS), as tests/test_cuda_mla.py's PATHS; and the opt-in sm_90a
# wgmma kernel (both consumer schedules; decode and varlen prefill), which force_mla_path runs with
# KVKERNELS_CUDA_WGMMA=require (a fallback fails the test) under the shape-only split plan.
MLA_PATHS = {"auto": (None, None), "simt": ("simt", None), "mma16": ("mma16", None), "mma64": ("mma64", None),
             "auto-split5": (None, 5), "simt-split5": ("simt", 5), "mma64-split3": ("mma64", 3),
             "wgmma": ("wgmma", None), "wgmma-seesaw": ("wgmma-seesaw", None), "wgmma-split3": ("wgmma", 3),
             "wgmma-seesaw-split3": ("wgmma-seesaw", 3)}
TENSOR_CORE_ONLY = ("mma16", "mma64", "wgmma", "wgmma-seesaw")  # paths float32 q never takes


def force_mla_path(monkeypatch, kind, splits):
    """KVKERNELS_CUDA_MLA_PATH / _SPLITS; the wgmma kinds also KVKERNELS_CUDA_WGMMA=require and no metadata plan."""
    monkeypatch.delenv("KVKERNELS_CUDA_MLA_SCHED", raising=False)
    if kind and kind.startswith("wgmma"):
        force_wgmma_plan(monkeypatch, "MLA", kind, splits)
    else:
        monkeypatch.delenv("KVKERNELS_CUDA_WGMMA", raising=False)
        force_cuda_plan(monkeypatch, "MLA", kind, splits)


@pytest.fixture(params=list(MLA_PATHS), ids=list(MLA_PATHS))
def mla_path(request, monkeypatch):
    kind, splits = MLA_PATHS[request.param]
    force_mla_path(monkeypatch, kind, splits)
    return kind, splits


def mla_plan_of(emu, mla, q, qsl):
    names = ("path", "dp", "stages", "smem", "heads_per_cta", "q_tile", "splits", "grid_x", "grid_y", "seesaw", "parts",
             "pdl")
    return dict(zip(names, emu.mla_attention_plan(q, mla.kv_cache, mla.block_tables, mla.seq_lens, mla.kv_lora_rank,
                                                  qsl, mla.scale)))


def expected_mla_path(dtype, heads, decode, kind):
    if kind == "simt" or dtype == f32:
        return MLA_SIMT
    if kind == "mma16":
        return MLA_MMA16
    if kind == "mma64":
        return MLA_MMA64
    if kind and kind.startswith("wgmma"):
        return MLA_WGMMA
    return MLA_MMA64 if heads > 16 or not decode else MLA_MMA16


def expected_forced_splits(mla, plan, splits):
    """KVKERNELS_CUDA_MLA_SPLITS=splits, capped by the key tiles a block-table row can describe."""
    key_tile = {MLA_SIMT: 8, MLA_WGMMA: 64}.get(plan["path"], 32)
    max_tiles = max(1, -(-mla.block_tables.shape[1] * mla.kv_cache.shape[1] // key_tile))
    return min(splits, 128, max_tiles)


def run_emu_mla_attention(emu, mla, q, qsl, scale, *, path=None, splits=None):
    """The emulated CUDA MLA kernels vs the float64 reference (tests/test_cuda_mla.py's run_attention
    checks); outputs and split partials are poisoned before the launch. `path` / `splits`: the plan the
    case is meant to exercise, asserted so it cannot drift."""
    plan = mla_plan_of(emu, mla, q, qsl)
    check_plan(plan, path, splits)
    if plan["path"] == MLA_WGMMA:  # the wgmma decode's schedule and split plan are the ones the test asked for
        assert plan["seesaw"] == (os.environ.get("KVKERNELS_CUDA_MLA_PATH") == "wgmma-seesaw"), plan
        # (varlen prefill keeps the shape-only plan)
        assert (plan["parts"] > 0) == (os.environ.get("KVKERNELS_CUDA_MLA_SCHED") == "metadata" and qsl is None), plan
    t, h, _ = q.shape
    r = mla.kv_lora_rank
    out, lse = emu.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, r, scale, qsl, mla.scale)
    assert out.dtype == q.dtype and out.shape == (t, h, r) and out.is_contiguous()
    assert lse.dtype == f32 and lse.shape == (t, h) and lse.is_contiguous()
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables, mla.seq_lens,
                                                     kv_lora_rank=r, scale=scale, query_start_loc=qsl,
                                                     kv_scale=mla.scale)
    assert_close(out, ref_out, q.dtype, msg="out")  # NaN / +-inf at the reference's positions, exactly
    assert_close(lse, ref_lse, f32, msg="lse")
    return out, lse, plan


# id: q dtype, cache fp8, R, P, heads, block size, strided q. Run on every kernel (mla_path): the cases
# of tests/test_cuda_mla.py with small rows, so that the emulator stays fast (DeepSeek widths below),
# and the transposed / fp8-bf16 variants of their R512 cases at R64.
MLA_ATTN_CASES = {
    **{name: case for name, case in CUDA_MLA_ATTN_CASES.items() if case[2] <= 128},
    "f16-R64-P16-H4-b16-transposed": (f16, None, 64, 16, 4, 16, "transposed"),
    "e4m3-bf16-R64-P16-H8-b16": (bf16, "e4m3", 64, 16, 8, 16, None),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("case", MLA_ATTN_CASES.values(), ids=MLA_ATTN_CASES.keys())
def test_mla_paged_attention(emu, case, mode, mla_path):
    dtype, fp8, r, p, h, b, strided = case
    kind, splits = mla_path
    if kind in TENSOR_CORE_ONLY and dtype == f32:
        pytest.skip("float32 q has only the SIMT kernel (the planner keeps it there)")
    # Partial and exactly-full last blocks, an empty and a one-token sequence; shuffled block ids.
    seq_lens = [b + 1, 0, 2 * b + 5, 1, b]
    # varlen: test_mla.varlen_q_lens (full / chunked prefill, one query, none), at most 40 queries each.
    q_lens = [min(n, 40) for n in varlen_q_lens(seq_lens)]
    mla, q, qsl = make_mla_case(mode, seq_lens, dtype, fp8, r, p, h, b, strided, q_lens=q_lens)
    out, lse, plan = run_emu_mla_attention(
        emu, mla, q, qsl, (128 + p) ** -0.5, path=expected_mla_path(dtype, h, mode == "decode", kind))
    if splits:
        assert plan["splits"] == expected_forced_splits(mla, plan, splits), plan
    if mode == "decode":  # the empty sequence: out = 0, lse = -inf
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


# DeepSeek widths (R 512 + rope 64), the planner's own choice; varlen: chunked prefill of a few queries
# at the end of each sequence (the emulator runs a 64-row CTA of 576-wide rows in ~0.1 s).
MLA_DEEPSEEK_CASES = {
    "bf16-H16-b64": (bf16, None, 512, 64, 16, 64, None),
    "bf16-H128-b64": (bf16, None, 512, 64, 128, 64, None),
    "f16-H64-b16-transposed": (f16, None, 512, 64, 64, 16, "transposed"),
    "f32-H8-b16-fused": (f32, None, 512, 64, 8, 16, "fused"),
    "e4m3-bf16-H16-b64": (bf16, "e4m3", 512, 64, 16, 64, None),
}


@pytest.mark.parametrize("kind", [None, "wgmma", "wgmma-seesaw"], ids=["planned", "wgmma", "wgmma-seesaw"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("case", MLA_DEEPSEEK_CASES.values(), ids=MLA_DEEPSEEK_CASES.keys())
def test_mla_paged_attention_deepseek(emu, case, mode, kind, monkeypatch):
    """kind: the planner's choice, or the opt-in wgmma kernel (KVKERNELS_CUDA_WGMMA=require): H 16 its 4 tokens
    per CTA, H 64 / 128 one token per head chunk."""
    force_mla_path(monkeypatch, kind, None)
    dtype, fp8, r, p, h, b, strided = case
    if kind and dtype == f32:
        pytest.skip("float32 q has only the SIMT kernel")
    if mode == "varlen" and h > 64 and not kind:
        pytest.skip("too slow on the emulator (H 128 decode covers two head chunks of 64 rows)")
    seq_lens = [b + 1, 0, 2 * b + 5, 1, b]
    mla, q, qsl = make_mla_case(mode, seq_lens, dtype, fp8, r, p, h, b, strided, q_lens=[3, 0, 5, 1, 2])
    out, lse, _ = run_emu_mla_attention(emu, mla, q, qsl, 192 ** -0.5,
                                        path=expected_mla_path(dtype, h, mode == "decode", kind))
    if mode == "decode":
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("kind", [None, "simt"], ids=["planned", "simt"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_mla_paged_attention_out_of_range_block_ids_read_nothing(emu, mode, kind, monkeypatch):
    """As test_paged_attention_out_of_range_block_ids_read_nothing, for the latent cache: the MLA
    loaders fetch a tile's block ids a tile ahead and check them where they use them (mla_common.cuh)."""
    force_cuda_plan(monkeypatch, "MLA", kind, None)
    b, seq_lens = 16, [3 * 16 + 5, 2 * 16, 16 + 1]
    mla, q, qsl = make_mla_case(mode, seq_lens, bf16, None, 64, 16, 8, b, q_lens=[20, 1, 17])
    n = mla.kv_cache.shape[0]
    cache = between_nan_blocks(mla.kv_cache)
    table, ref_table = out_of_range_ids(mla.block_tables, [(0, 1), (1, 0), (0, 3), (2, 1)], n)
    out, lse = emu.mla_paged_attention(q, cache, table, mla.seq_lens, 64, 80 ** -0.5, qsl, None)
    ref_cache = torch.cat([cache, torch.zeros(1, *cache.shape[1:], dtype=cache.dtype)])
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), upcast(ref_cache), ref_table, mla.seq_lens,
                                                     kv_lora_rank=64, scale=80 ** -0.5, query_start_loc=qsl)
    assert out.isfinite().all()
    assert_close(out, ref_out, bf16, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


@pytest.mark.parametrize("splits", [None, 1, 128], ids=["planned", "1", "128"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f32, None), (bf16, "e4m3")], ids=["bf16", "f32", "e4m3"])
def test_mla_long_context(emu, dtype, fp8, mode, splits, monkeypatch):
    """Thousands of keys over few sequences: the planner (4 emulated SMs) splits them; forced counts
    cover no split and more splits than the short sequences have key tiles (empty splits)."""
    from helpers import make_paged_mla
    force_cuda_plan(monkeypatch, "MLA", None, splits)
    seq_lens = [2100, 1, 700]
    mla = make_paged_mla(seq_lens, 128, 16, 64, dtype=dtype, fp8=fp8, seed=41)
    q_lens = [1, 1, 1] if mode == "decode" else [min(n, 6) for n in seq_lens]
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    q = make_query(sum(q_lens), 16, 144, dtype, generator(42))
    _, _, plan = run_emu_mla_attention(emu, mla, q, qsl, 144 ** -0.5)
    if splits:
        assert plan["splits"] == expected_forced_splits(mla, plan, splits) and (splits == 1) == (plan["splits"] == 1)
    elif mode == "decode":  # 3 work items on 4 emulated SMs: the planner splits
        assert plan["splits"] > 1, plan


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_mla_decode_plan_depends_on_shapes_only(emu, dtype, monkeypatch):
    """As test_decode_plan_depends_on_shapes_only, for mla_paged_attention."""
    force_cuda_plan(monkeypatch, "MLA", None, None)
    mla, q, _ = make_mla_case("decode", [2100, 700], dtype, None, 128, 16, 16, 64, seed=44)
    plan = mla_plan_of(emu, mla, q, None)
    assert plan["splits"] > 1, plan
    for lens in ([1, 1], [2100, 0], [65, 699]):
        other = dataclasses.replace(mla, seq_lens=torch.tensor(lens, dtype=torch.int32))
        assert mla_plan_of(emu, other, q, None) == plan, lens
        run_emu_mla_attention(emu, other, q, None, 144 ** -0.5)
    narrow = dataclasses.replace(mla, block_tables=mla.block_tables[:, :4].contiguous(),
                                 seq_lens=torch.tensor([200, 200], dtype=torch.int32))
    assert mla_plan_of(emu, narrow, q, None)["splits"] == 1


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_mla_empty_sequences_and_batch(emu, mode, dtype, mla_path):
    seq_lens = [0, 5, 0, 33]
    mla, q, qsl = make_mla_case(mode, seq_lens, dtype, None, 64, 16, 4, 16, seed=5)
    if mla_path[0] in TENSOR_CORE_ONLY and dtype == f32:
        pytest.skip("float32 q has only the SIMT kernel")
    out, lse, _ = run_emu_mla_attention(emu, mla, q, qsl, 0.1)
    if mode == "decode":
        for row in (0, 2):
            assert torch.equal(out[row], torch.zeros(4, 64, dtype=dtype))
            assert torch.isneginf(lse[row]).all()
    # An empty batch, and a varlen batch whose sequences have no queries: nothing to launch.
    table = torch.zeros(0, 3, dtype=torch.int32)
    lens = torch.zeros(0, dtype=torch.int32)
    q0 = torch.randn(0, 4, 80).to(dtype)
    qsl0 = None if mode == "decode" else torch.zeros(1, dtype=torch.int32)
    out, lse = emu.mla_paged_attention(q0, mla.kv_cache, table, lens, 64, 0.1, qsl0, None)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_mla_more_queries_than_keys(emu, dtype, mla_path):
    """FlashMLA's empty-context prefill: more queries than keys (seq_len 0 included); the leading rows
    see no key (out 0, lse -inf), also through split partials and the merge."""
    if mla_path[0] in TENSOR_CORE_ONLY and dtype == f32:
        pytest.skip("float32 q has only the SIMT kernel")
    seq_lens, q_lens = [3, 0, 40, 17], [7, 2, 40, 20]
    mla, q, qsl = make_mla_case("varlen", seq_lens, dtype, None, 64, 16, 16, 16, q_lens=q_lens, seed=7)
    out, lse, _ = run_emu_mla_attention(emu, mla, q, qsl, 0.1)
    empty = [0, 1, 2, 3, 7, 8, 49, 50, 51]
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f16, None), (bf16, "e4m3"), (f16, "e5m2")])
def test_mla_tensor_core_and_simt_agree(emu, dtype, fp8, mode, monkeypatch):
    """The tensor-core (16- and 64-row) and CUDA-core kernels on the same inputs agree to the q dtype's
    tolerance (tests/test_cuda_mla.py's check)."""
    from helpers import TOLERANCES
    mla, q, qsl = make_mla_case(mode, [150, 64, 1, 129], dtype, fp8, 128, 16, 32, 64, seed=37,
                                q_lens=[7, 3, 1, 0])
    args = (q, mla.kv_cache, mla.block_tables, mla.seq_lens, 128, 0.07, qsl, mla.scale)
    monkeypatch.setenv("KVKERNELS_CUDA_MLA_PATH", "simt")
    out_s, lse_s = emu.mla_paged_attention(*args)
    rtol, atol = TOLERANCES[dtype]
    for kind in ("mma16", "mma64"):
        monkeypatch.setenv("KVKERNELS_CUDA_MLA_PATH", kind)
        out_tc, lse_tc = emu.mla_paged_attention(*args)
        assert_close(out_tc, out_s.double(), dtype, rtol=2 * rtol, atol=2 * atol, msg=f"{kind} out")
        assert_close(lse_tc, lse_s.double(), f32, rtol=1e-4, atol=1e-4, msg=f"{kind} lse")


def test_mla_splits_are_exact(emu, monkeypatch):
    """float32 (CUDA cores, float32 math): 1 split vs many splits differ only by float32 rounding."""
    from helpers import make_paged_mla
    mla = make_paged_mla([2000, 1000, 17], 512, 64, 64, dtype=f32, seed=43)
    q = make_query(3, 8, 576, f32, generator(44))
    results = []
    for splits in (1, 3, 64):
        monkeypatch.setenv("KVKERNELS_CUDA_MLA_SPLITS", str(splits))
        assert mla_plan_of(emu, mla, q, None)["splits"] == splits
        results.append(emu.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, 512, 0.05, None, None))
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f32, "e4m3")], ids=["bf16", "e4m3-f32"])
def test_mla_unaligned_cache_rows(emu, dtype, fp8, mla_path):
    """A latent cache whose rows are not 16-byte aligned (a [..., 2:2+W] slice of wider rows, NaN around
    it) takes the plain-load fallback instead of cp.async."""
    if mla_path[0] in TENSOR_CORE_ONLY and dtype == f32:
        pytest.skip("float32 q has only the SIMT kernel")
    r, p = 64, 16
    mla, q, qsl = make_mla_case("decode", [40, 9, 0, 16], dtype, fp8, r, p, 8, 16, seed=29)
    mla.kv_cache = unaligned_copy(mla.kv_cache)
    run_emu_mla_attention(emu, mla, q, qsl, 0.1)


# ---------------------------------------------------------------------------------------------------
# mla_decompress (csrc/cuda/mla_decompress.cu / .cuh): the cp.async weight pipeline
# ---------------------------------------------------------------------------------------------------

DECOMPRESS_VARIANTS = ("persist64", "persist128", "tile64", "wgmma")


@pytest.fixture(params=DECOMPRESS_VARIANTS)
def variant(request, monkeypatch):
    """KVKERNELS_CUDA_DECOMPRESS=<variant>: the persist kernel with 64- or 128-row token tiles (the default,
    "persist", picks one by the device's shared memory; float32 weights run tile64's CUDA-core kernel under
    every value), the tile64 kernel on its cp.async weight pipeline (KVKERNELS_CUDA_NO_TMA=1; its TMA pipeline
    has its own tests below) or the sm_90a wgmma kernel (opt-in; TMA always: KVKERNELS_CUDA_NO_TMA does not
    concern it)."""
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "1")
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", request.param)
    return request.param


def run_emu_decompress(emu, case, seq_lens, seed=2, w_offset=0):
    """tests/test_cuda_mla.py's run_decompress on the emulator (outputs poisoned before the launch).
    w_offset: w_kv_b as a contiguous view that many elements into its storage (not 16-byte aligned)."""
    from helpers import make_paged_mla
    from test_mla import random_weight
    dtype, fp8, r, p, h, dn, dv, norm, b, with_num_tokens = case
    gen = generator(seed)
    mla = make_paged_mla(seq_lens, r, p, b, dtype=dtype, fp8=fp8, seed=seed + 1, strided=(b == 3))
    w = random_weight(h * (dn + dv), r, dtype, gen)
    if w_offset:
        storage = torch.full((w.numel() + 8,), float("nan"), dtype=dtype)
        w_view = storage[w_offset:w_offset + w.numel()].view_as(w)
        w_view.copy_(w)
        assert w_view.is_contiguous() and w_view.data_ptr() % 16 != 0
    else:
        w_view = w
    norm_weight = (1 + 0.5 * randn(r, gen=gen)).to(dtype) if norm else None
    t = sum(seq_lens)
    key, value = emu.mla_decompress(mla.kv_cache, mla.block_tables, mla.seq_lens, w_view, r, dn, dv, norm_weight,
                                    1e-5, mla.scale, t if with_num_tokens else None)
    assert key.dtype == value.dtype == dtype
    assert key.shape == (t, h, dn + p) and value.shape == (t, h, dv)
    assert key.is_contiguous() and value.is_contiguous()
    ref_key, ref_value = reference.mla_decompress(mla.ref_cache(), mla.block_tables, mla.seq_lens, w,
                                                  kv_lora_rank=r, qk_nope_head_dim=dn, v_head_dim=dv,
                                                  norm_weight=upcast(norm_weight), norm_eps=1e-5, scale=mla.scale)
    assert_close(key, ref_key, dtype, msg="key")
    assert_close(value, ref_value, dtype, msg="value")
    if t:
        k_pe = torch.cat(mla.rows)[:, None, r:].expand(-1, h, -1).to(dtype)
        assert_bytes_equal(key[..., dn:], k_pe, msg="k_pe part of key")
    return key, value


# id: w dtype, cache fp8, R, P, heads, dn, dv, RMSNorm, block size, pass num_tokens
# (tests/test_mla.py's DECOMPRESS_CASES and tests/test_cuda_mla.py's additions)
MLA_DECOMPRESS_CASES = dict(DECOMPRESS_CASES, **{
    "f16-R64-P3-H3-dn5-dv7-b1": (f16, None, 64, 3, 3, 5, 7, False, 1, True),
    "e4m3-bf16-R512-P64-H3-dn48-dv40-norm-b64-num_tokens": (bf16, "e4m3", 512, 64, 3, 48, 40, True, 64, True),
    "f32-R72-P8-H2-b5": (f32, None, 72, 8, 2, 16, 16, False, 5, False),
    "bf16-R200-P8-H5-dn24-dv16-norm": (bf16, None, 200, 8, 5, 24, 16, True, 16, False),
    "e4m3-f16-R200-P16-H2-dn40-dv28-norm": (f16, "e4m3", 200, 16, 2, 40, 28, True, 64, False),
})


@pytest.mark.parametrize("case", MLA_DECOMPRESS_CASES.values(), ids=MLA_DECOMPRESS_CASES.keys())
def test_mla_decompress(emu, case, variant):
    # 70 + 1 + b + 200 + 5 tokens: partial last token tiles (BM 64 / 32).
    run_emu_decompress(emu, case, [5, 0, 70, 1, case[8], 200])


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_mla_decompress_many_tokens(emu, dtype, variant):
    """More token tiles than one wave, sequences spanning many blocks, a partial last tile."""
    run_emu_decompress(emu, (dtype, None, 512, 64, 2, 32, 32, True, 64, True), [301, 17, 250, 0, 64], seed=9)


@pytest.mark.parametrize("with_num_tokens", [False, True])
def test_mla_decompress_no_tokens(emu, with_num_tokens, variant):
    from helpers import make_paged_mla
    run_emu_decompress(emu, (bf16, None, 64, 16, 2, 16, 16, True, 16, with_num_tokens), [0, 0, 0])
    mla = make_paged_mla([5], 64, 16, 16, dtype=bf16, seed=3)
    key, value = emu.mla_decompress(mla.kv_cache, torch.zeros(0, 2, dtype=torch.int32),
                                    torch.zeros(0, dtype=torch.int32), torch.randn(2 * 32, 64).to(bf16), 64, 16, 16,
                                    None, 1e-6, None, 0 if with_num_tokens else None)
    assert key.shape == (0, 2, 32) and value.shape == (0, 2, 16)


@pytest.mark.parametrize("dtype", [f16, bf16, f32])
def test_mla_decompress_unaligned_weight(emu, dtype, variant):
    """w_kv_b at a 1-element offset into its storage: element loads instead of cp.async. The wgmma kernel
    (TMA only; opt-in, so no silent fallback) refuses it, naming w_kv_b and the alignment."""
    case = (dtype, None, 64, 16, 2, 16, 24, True, 16, False)
    if variant == "wgmma" and dtype != f32:
        with pytest.raises(RuntimeError, match=r"KVKERNELS_CUDA_DECOMPRESS=wgmma: w_kv_b is not 16-byte aligned"):
            run_emu_decompress(emu, case, [9, 40, 3], seed=63, w_offset=1)
        return
    run_emu_decompress(emu, case, [9, 40, 3], seed=63, w_offset=1)


# ---------------------------------------------------------------------------------------------------
# mla_decompress: the TMA weight pipeline (emulated sm_90: tensor map, mbarriers, bulk tensor copies)
# ---------------------------------------------------------------------------------------------------

# tests/test_cuda_mla.py's TMA_CASES: a partial last token tile (243 tokens), N = heads * (dn + dv) not a
# multiple of 64 but in the first (partial TMA boxes along the rows), R = 200: a partial last column box.
MLA_TMA_CASES = {
    "bf16-R512-P64-H2-d128-norm": (bf16, None, 512, 64, 2, 128, 128, True, 64, False),
    "f16-R512-P64-H3-dn48-dv40": (f16, None, 512, 64, 3, 48, 40, False, 16, True),
    "bf16-R200-P8-H5-dn24-dv16-norm": (bf16, None, 200, 8, 5, 24, 16, True, 16, False),
    "f16-R200-P16-H2-dn40-dv28": (f16, None, 200, 16, 2, 40, 28, False, 64, True),
    "e4m3-bf16-R512-P64-H3-dn48-dv40-norm": (bf16, "e4m3", 512, 64, 3, 48, 40, True, 64, True),
    "e5m2-f16-R200-P8-H5-dn24-dv16": (f16, "e5m2", 200, 8, 5, 24, 16, False, 16, False),
    "e4m3-f16-R200-P16-H2-dn40-dv28-norm": (f16, "e4m3", 200, 16, 2, 40, 28, True, 64, False),
}
MLA_TMA_SEQ_LENS = [5, 0, 70, 1, 130, 37]


def _tma_env(monkeypatch, tma: bool):
    """The tile64 kernel (the one with a TMA pipeline) with TMA required, or on cp.async."""
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "tile64")
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_TMA" if tma else "KVKERNELS_CUDA_NO_TMA", "require" if tma else "1")


@pytest.mark.parametrize("case", MLA_TMA_CASES.values(), ids=MLA_TMA_CASES.keys())
def test_mla_decompress_tma_and_cp_async(emu, case, monkeypatch):
    """KVKERNELS_CUDA_TMA=require (the launch fails unless it takes TMA) and KVKERNELS_CUDA_NO_TMA=1 both
    match the float64 reference and agree bit for bit (the same swizzled tiles feed the same mma.sync)."""
    results = {}
    for tma in (True, False):
        _tma_env(monkeypatch, tma)
        results[tma] = run_emu_decompress(emu, case, MLA_TMA_SEQ_LENS, seed=61)
    for i, name in enumerate(("key", "value")):
        assert_bytes_equal(results[True][i], results[False][i], msg=f"{name}: TMA vs cp.async")


@pytest.mark.parametrize("dtype", [f16, bf16])
def test_mla_decompress_tma_unaligned_weight(emu, dtype, monkeypatch):
    """A w_kv_b whose base is not 16-byte aligned is not eligible for TMA: KVKERNELS_CUDA_TMA=require
    reports why; without it the launch takes the element-load path and matches the reference."""
    case = (dtype, None, 64, 16, 2, 16, 24, False, 16, False)
    _tma_env(monkeypatch, True)
    with pytest.raises(RuntimeError, match=r"not 16-byte aligned"):
        run_emu_decompress(emu, case, [9, 40, 3], seed=63, w_offset=1)
    monkeypatch.delenv("KVKERNELS_CUDA_TMA")
    run_emu_decompress(emu, case, [9, 40, 3], seed=63, w_offset=1)


def test_mla_decompress_tma_require_float32(emu, monkeypatch):
    """KVKERNELS_CUDA_TMA=require with float32 weights fails with the reason (no TMA variant)."""
    _tma_env(monkeypatch, True)
    with pytest.raises(RuntimeError, match=r"float32 weights have no TMA path"):
        run_emu_decompress(emu, (f32, None, 64, 16, 2, 16, 24, False, 16, False), [9, 3])


@pytest.mark.parametrize("kernel", ["persist", "tile64-cp.async", "tile64-tma", "wgmma"])
def test_mla_decompress_rounds_the_latent(emu, kernel, monkeypatch):
    """docs/ops.md: the normalised latent is rounded to w_kv_b's dtype before the product."""
    from test_mla import check_decompress_rounding
    _tma_env(monkeypatch, kernel == "tile64-tma")
    if kernel in ("persist", "wgmma"):
        monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", kernel)
        monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA")

    def op(kv_cache, block_tables, seq_lens, w, *, kv_lora_rank, qk_nope_head_dim, v_head_dim, norm_eps,
           norm_weight):
        return emu.mla_decompress(kv_cache, block_tables, seq_lens, w, kv_lora_rank, qk_nope_head_dim, v_head_dim,
                                  norm_weight, norm_eps, None, None)
    check_decompress_rounding(op)


# ---------------------------------------------------------------------------------------------------
# mla_decompress: the persist kernel's work decomposition (csrc/cuda/mla_decompress_persist.cuh)
# ---------------------------------------------------------------------------------------------------

# With KVKERNELS_EMU_SM_COUNT=1 the launcher sees 2 CTA slots for persist64 (two CTAs of <= 112 KiB share
# the emulated 228 KiB SM) and 1 for persist128, and launch_persist's cost model (waves x (column tiles per
# CTA + 1)) gives:
#   243 tokens (persist64: 4 token tiles, the last 51 rows; persist128: 2, the last 115): one run per token
#     tile, so every CTA streams all of its column tiles through one ring (N = 264: 3 tiles of 128, the
#     last 8 columns wide; N = 200: 2);
#   53 tokens (1 token tile), N = 552 (5 tiles, the last 40 wide): persist64 2 runs of 3 and 2 tiles, whose
#     CTAs split the k_pe copies by heads (2 + 1); persist128 1 run of 5.
# id: w dtype, cache fp8, R, P, heads, dn, dv, RMSNorm, block size, pass num_tokens
SEQ_243 = [5, 0, 70, 1, 130, 37]
PERSIST_CASES = {
    "e4m3-bf16-R512-P64-H3-dn48-dv40-norm-b64": ((bf16, "e4m3", 512, 64, 3, 48, 40, True, 64, True), SEQ_243),
    "f16-R200-P8-H5-dn24-dv16-b16": ((f16, None, 200, 8, 5, 24, 16, False, 16, False), SEQ_243),
    # dn, dv, P odd: element stores (no pairs); N = 11 x 12 = 132: 2 tiles, the second 4 columns wide.
    "bf16-R64-P3-H11-dn5-dv7-norm-b1": ((bf16, None, 64, 3, 11, 5, 7, True, 1, True), SEQ_243),
    "e5m2-bf16-R128-P16-H3-dn96-dv88-b16": ((bf16, "e5m2", 128, 16, 3, 96, 88, False, 16, True), [40, 0, 13]),
}


@pytest.mark.parametrize("case,seq_lens", PERSIST_CASES.values(), ids=PERSIST_CASES.keys())
def test_mla_decompress_persist_equals_tile64(emu, case, seq_lens, monkeypatch):
    """Several column tiles per CTA (the weight ring streaming across tile boundaries), partial last
    column and token tiles, CTAs of one token tile splitting the k_pe copies: the persist kernel (64- and
    128-row token tiles) and the wgmma kernel (one persistent CTA walking every tile: a new token tile
    staged mid-range) match the float64 reference and the tile64 kernel bit for bit (the same products,
    summed 16 at a time in the same k order per element)."""
    monkeypatch.setenv("KVKERNELS_EMU_SM_COUNT", "1")
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "1")
    results = {}
    for variant in DECOMPRESS_VARIANTS:
        monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", variant)
        results[variant] = run_emu_decompress(emu, case, seq_lens, seed=71)
    for variant in ("persist64", "persist128", "wgmma"):
        for i, name in enumerate(("key", "value")):
            assert_bytes_equal(results[variant][i], results["tile64"][i], msg=f"{name}: {variant} vs tile64")


# (KVKERNELS_EMU_SMEM_OPTIN, KVKERNELS_EMU_SMEM_PER_SM) of a smaller part -> what launch_persist_variant does
# at R 512 (latent tile 64 KiB at BM 64, 128 KiB at BM 128; ring stages of 16 KiB):
#   sm_86 / sm_89 (99 / 100 KiB): persist128 does not fit (fails); persist64: 2 stages, one CTA per SM;
#     persist (auto) takes persist64;
#   A100 (163 / 164 KiB): persist128: 2 stages (160 KiB); persist64: 4 stages (one CTA); auto: persist64.
SMALL_SMEM = {"sm86": (99 * 1024, 100 * 1024), "a100": (163 * 1024, 164 * 1024)}


@pytest.mark.parametrize("part", SMALL_SMEM.keys())
def test_mla_decompress_persist_with_less_shared_memory(emu, part, monkeypatch):
    """The persist kernel's 2- and 4-stage rings (an H100's 227 KiB gives BM 64 3 stages and BM 128 4 at
    R 512) and its token-tile choice on parts with less shared memory: every kernel that fits matches
    tile64 bit for bit (several column tiles per CTA); one that does not fit fails, naming the others."""
    optin, per_sm = SMALL_SMEM[part]
    monkeypatch.setenv("KVKERNELS_EMU_SMEM_OPTIN", str(optin))
    monkeypatch.setenv("KVKERNELS_EMU_SMEM_PER_SM", str(per_sm))
    monkeypatch.setenv("KVKERNELS_EMU_SM_COUNT", "1")
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "1")
    case = (bf16, "e4m3", 512, 64, 3, 48, 40, True, 64, True)
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "tile64")
    expected = run_emu_decompress(emu, case, SEQ_243, seed=73)
    variants = ["persist", "persist64"]
    if part == "sm86":
        monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "persist128")
        with pytest.raises(RuntimeError, match=r"persist128 does not fit .*persist64 or tile64"):
            run_emu_decompress(emu, case, SEQ_243, seed=73)
        # wgmma: 128 KiB of latent rows + 2 stages of 16 KiB do not fit 99 KiB
        monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "wgmma")
        with pytest.raises(RuntimeError, match=r"wgmma does not fit this device's shared memory"):
            run_emu_decompress(emu, case, SEQ_243, seed=73)
    else:
        variants += ["persist128", "wgmma"]  # wgmma: the 2-stage ring (161 KiB)
    for variant in variants:
        monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", variant)
        got = run_emu_decompress(emu, case, SEQ_243, seed=73)
        for i, name in enumerate(("key", "value")):
            assert_bytes_equal(got[i], expected[i], msg=f"{name}: {variant} vs tile64 on {part}")


@pytest.mark.parametrize("variant", DECOMPRESS_VARIANTS)
def test_mla_decompress_tokens_past_the_sequences_are_zero(emu, variant, monkeypatch):
    """num_tokens > sum(seq_lens) (what a device backend allocates without KVKERNELS_DEBUG): the extra
    rows are zeros (key and value; k_pe included), the others what num_tokens = sum(seq_lens) gives."""
    from helpers import make_paged_mla
    from test_mla import random_weight
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "1")
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", variant)
    r, p, h, dn, dv = 128, 16, 3, 48, 40
    seq_lens = [30, 0, 41]
    mla = make_paged_mla(seq_lens, r, p, 16, dtype=bf16, seed=5)
    w = random_weight(h * (dn + dv), r, bf16, generator(6))
    t = sum(seq_lens)
    outs = {n: emu.mla_decompress(mla.kv_cache, mla.block_tables, mla.seq_lens, w, r, dn, dv, None, 1e-6, None, n)
            for n in (t, t + 70)}
    for i, name in enumerate(("key", "value")):
        assert_bytes_equal(outs[t + 70][i][:t], outs[t][i], msg=f"{name}: the tokens of the sequences")
        extra = outs[t + 70][i][t:]
        assert torch.equal(extra, torch.zeros_like(extra)), f"{name}: rows past sum(seq_lens)"


def test_mla_decompress_variant_errors(emu, monkeypatch):
    """An unknown KVKERNELS_CUDA_DECOMPRESS raises naming the variable (on a call with no tokens too); KVKERNELS_CUDA_TMA=require with the
    persist kernel (no TMA path) raises saying so."""
    case = (bf16, None, 64, 16, 2, 16, 24, False, 16, False)
    monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA", raising=False)
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "tile128")
    with pytest.raises(RuntimeError, match=r"kvkernels\.mla_decompress: .*KVKERNELS_CUDA_DECOMPRESS must be persist"):
        run_emu_decompress(emu, case, [9, 3])
    with pytest.raises(RuntimeError, match=r"KVKERNELS_CUDA_DECOMPRESS must be persist"):
        run_emu_decompress(emu, case, [0, 0])  # no tokens: checked all the same
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "persist")
    monkeypatch.setenv("KVKERNELS_CUDA_TMA", "require")
    with pytest.raises(RuntimeError, match=r"the persist kernel has no TMA path"):
        run_emu_decompress(emu, case, [9, 3])


# ---------------------------------------------------------------------------------------------------
# mla_decompress: the sm_90a wgmma kernel (csrc/cuda/mla_decompress_sm90.cuh; opt-in)
# ---------------------------------------------------------------------------------------------------

# (case, seq_lens, KVKERNELS_EMU_SM_COUNT, KVKERNELS_EMU_SMEM_OPTIN or None). The static schedule gives CTA b
# tiles [b total / grid, (b + 1) total / grid) of the token-tile-major tile list (128 x 128 tiles):
#   R512-H3 (N 264: 3 column tiles), 243 tokens (2 token tiles, the second 115 rows): 6 tiles;
#     1 SM: one CTA walks all 6 (re-stages the latent at tile 3; the 6-stage ring wraps 8 times);
#     4 SMs: ranges [0,1) [1,3) [3,4) [4,6): CTAs of one token tile split its k_pe heads (2 + 1);
#     5 SMs with 163 KiB of shared memory: a 2-stage ring, 5 CTAs, the last two tiles in one CTA;
#   R64-H11 (dn 5, dv 7, P 3: element stores; N 132: 2 column tiles, the second 4 columns), 1 SM;
#   R200 (a partial last TMA box along k) fp8 e5m2, 3 SMs: 2 tiles x 4 token tiles = 8 over 3 CTAs
#     ([0,2) [2,5) [5,8)): ranges that start and end inside token tiles.
WGMMA_SCHEDULES = {
    "e4m3-bf16-R512-H3-1sm": ((bf16, "e4m3", 512, 64, 3, 48, 40, True, 64, True), SEQ_243, 1, None),
    "e4m3-bf16-R512-H3-4sm": ((bf16, "e4m3", 512, 64, 3, 48, 40, True, 64, True), SEQ_243, 4, None),
    "f16-R512-H3-5sm-2stages": ((f16, None, 512, 64, 3, 48, 40, True, 16, False), SEQ_243, 5, 163 * 1024),
    "bf16-R64-P3-H11-dn5-dv7-1sm": ((bf16, None, 64, 3, 11, 5, 7, True, 1, True), SEQ_243, 1, None),
    "e5m2-f16-R200-H2-3sm": ((f16, "e5m2", 200, 16, 2, 40, 28, False, 16, False), [300, 0, 77, 9], 3, None),
}


@pytest.mark.parametrize("case,seq_lens,sms,optin", WGMMA_SCHEDULES.values(), ids=WGMMA_SCHEDULES.keys())
def test_mla_decompress_wgmma_schedules(emu, case, seq_lens, sms, optin, monkeypatch):
    """The wgmma kernel's persistent static schedule (ranges crossing token tiles, k_pe heads split between
    CTAs), its ring at 2 and 6 stages, partial tiles along every dimension: the float64 reference and the
    persist128 kernel bit for bit (emulated: the same products summed 16 at a time in the same k order)."""
    monkeypatch.setenv("KVKERNELS_EMU_SM_COUNT", str(sms))
    if optin:
        monkeypatch.setenv("KVKERNELS_EMU_SMEM_OPTIN", str(optin))
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "1")
    results = {}
    for variant in ("persist128", "wgmma"):
        monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", variant)
        results[variant] = run_emu_decompress(emu, case, seq_lens, seed=81)
    for i, name in enumerate(("key", "value")):
        assert_bytes_equal(results["wgmma"][i], results["persist128"][i], msg=f"{name}: wgmma vs persist128")


def test_mla_decompress_wgmma_errors(emu, monkeypatch):
    """KVKERNELS_CUDA_DECOMPRESS=wgmma is opt-in: where it cannot run the call fails with the reason instead
    of falling back (a build without sm_90a code: KVKERNELS_EMU_PTX_VERSION=80 models it); float32 weights
    run the tile64 kernel under it, as under every value."""
    case = (bf16, None, 64, 16, 2, 16, 24, False, 16, False)
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "wgmma")
    monkeypatch.setenv("KVKERNELS_EMU_PTX_VERSION", "80")
    with pytest.raises(RuntimeError, match=r"wgmma: the kernels were compiled without sm_90a device code"):
        run_emu_decompress(emu, case, [9, 3])
    monkeypatch.delenv("KVKERNELS_EMU_PTX_VERSION")
    run_emu_decompress(emu, case, [9, 3])
    run_emu_decompress(emu, (f32, None, 64, 16, 2, 16, 24, False, 16, False), [9, 3])


# ---------------------------------------------------------------------------------------------------
# non-finite values (docs/ops.md "Non-finite values"; the CPU paths: tests/test_nonfinite.py)
# ---------------------------------------------------------------------------------------------------

# Element byte of each non-finite value per fp8 format (e4m3fn has no inf).
_FP8_BYTE = {torch.float8_e4m3fn: {"nan": 0x7F}, torch.float8_e5m2: {"nan": 0x7E, "+inf": 0x7C, "-inf": 0xFC}}
_VALUE = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def _poke(cache, block_ids, seq_len, pos, head, col, value):
    from helpers import token_slots
    slot = int(token_slots(block_ids, seq_len, cache.shape[1])[pos])
    b, o = slot // cache.shape[1], slot % cache.shape[1]
    if cache.dtype in _FP8_BYTE:
        cache.view(torch.uint8)[b, o, head, col] = _FP8_BYTE[cache.dtype][value]
    else:
        cache[b, o, head, col] = _VALUE[value]


# id: dtype, fp8, Hq, Hkv, D, mode, path, forced splits. Prefill (MMA_PREFILL) puts the values on the
# causal diagonal of a tile, which takes the tensor-core kernel's fix-up of keys some rows do not see; in
# both prefill configurations (MMA_PREFILL_DEEP: KVKERNELS_CUDA_ATTN_PATH=mma-prefill-deep), whose key tiles
# differ at head dim 128 / 256 (deep: 32 / 16 keys, wide: 64 / 32).
NONFINITE_ATTN = {
    "f32-simt-varlen": (f32, None, 4, 2, 64, "varlen", SIMT, None),
    "bf16-mma-decode": (bf16, None, 8, 2, 64, "decode", MMA_DECODE, None),
    "f16-mma-prefill": (f16, None, 2, 2, 64, "prefill", MMA_PREFILL, None),
    "e5m2-bf16-mma-prefill-d128": (bf16, "e5m2", 4, 1, 128, "prefill", MMA_PREFILL, None),
    "e5m2-bf16-mma-prefill-deep-d128": (bf16, "e5m2", 4, 1, 128, "prefill", MMA_PREFILL_DEEP, None),
    "bf16-mma-prefill-d256": (bf16, None, 4, 1, 256, "prefill", MMA_PREFILL, None),
    "bf16-split3": (bf16, None, 4, 2, 64, "decode", MMA_DECODE, 3),
    # the wgmma prefill over fp8 caches (the producer's dequantization: NaN bytes, e5m2 inf, scales)
    "e4m3-bf16-wgmma-prefill-d128": (bf16, "e4m3", 4, 1, 128, "prefill", WGMMA_PREFILL, None),
    "bf16-wgmma-prefill-d256": (bf16, None, 4, 1, 256, "prefill", WGMMA_PREFILL, None),
    "e5m2-f16-wgmma-prefill-d64": (f16, "e5m2", 2, 2, 64, "prefill", WGMMA_PREFILL, None),
    # and its overlapped loop (the fix-up of a diagonal tile while the next tile's S is in flight)
    "e4m3-bf16-wgmma-overlap-d128": (bf16, "e4m3", 4, 1, 128, "prefill", WGMMA_PREFILL_OVERLAP, None),
    "f16-wgmma-overlap-d64": (f16, None, 2, 2, 64, "prefill", WGMMA_PREFILL_OVERLAP, None),
}


@pytest.mark.parametrize("config", NONFINITE_ATTN.values(), ids=NONFINITE_ATTN.keys())
def test_paged_attention_nonfinite(emu, config, monkeypatch):
    dtype, fp8, hq, hkv, d, mode, path, splits = config
    force_cuda_plan(monkeypatch, "ATTN", {MMA_PREFILL_DEEP: "mma-prefill-deep", WGMMA_PREFILL: "wgmma-prefill",
                                          WGMMA_PREFILL_OVERLAP: "wgmma-prefill-overlap"}.get(path), splits)
    monkeypatch.setenv("KVKERNELS_CUDA_WGMMA", "require") if path in (WGMMA_PREFILL, WGMMA_PREFILL_OVERLAP) else None
    seq_lens = [70, 5]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=dtype, fp8=fp8,
                       seed=31)
    q_lens = {"decode": [1, 1], "varlen": [6, 3], "prefill": seq_lens}[mode]
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    query = make_query(sum(q_lens), hq, d, dtype, generator(32))
    inf = "nan" if fp8 == "e4m3" else "+inf"
    # NaN key at 20, inf value at 40 (kv head 0); in prefill both lie on a diagonal tile; a NaN key
    # and an inf key (kv head hkv - 1) at the last position (seen by the last query only).
    _poke(kv.key_cache, kv.blocks[0], 70, 20, 0, 3, "nan")
    _poke(kv.value_cache, kv.blocks[0], 70, 40, 0, 5, inf)
    _poke(kv.key_cache, kv.blocks[0], 70, 69, hkv - 1, 1, inf)
    _poke(kv.value_cache, kv.blocks[0], 70, 69, hkv - 1, 2, "nan")
    sinks = torch.linspace(-1.0, 1.0, hq)
    sinks[1] = float("nan")
    slopes = torch.linspace(0.01, 0.1, hq)
    slopes[-1] = float("inf")
    for opts in ({}, dict(sinks=sinks), dict(alibi_slopes=slopes, window_left=30)):
        out, lse, _ = run_emu_attention(emu, kv, query, qsl, path=path,
                                        splits=None if splits is None else (lambda n: n > 1), **opts)
        if mode == "prefill" and not opts:  # rows before key 20 saw no NaN
            assert out[:20].isfinite().all() and lse[:20].isfinite().all()
    if fp8:
        kv.k_scale[0] = float("nan")
        kv.v_scale[-1] = float("inf")
        run_emu_attention(emu, kv, query, qsl, path=path)
        # An inf k_scale counts as NaN also under a soft cap (whose tanh would make +-inf logits finite).
        kv.k_scale[0] = float("-inf")
        out, lse, _ = run_emu_attention(emu, kv, query, qsl, path=path, soft_cap=5.0)
        group = hq // hkv
        assert out[:, :group].isnan().all() and lse[:, :group].isnan().all()


@pytest.mark.parametrize("kind", ["mma16", "mma64", "simt", "mma64-split3", "wgmma", "wgmma-seesaw", "wgmma-split3",
                                  "wgmma-seesaw-split3"])
def test_mla_paged_attention_nonfinite(emu, kind, monkeypatch):
    """inf in a value column on the prefill diagonal (16 heads: 4 tokens per 64-row CTA, the rows before key 45 do
    not see it: the kernels' non-finite fix-up), NaN in a rope column; an inf kv_scale (fp8)."""
    path, splits = MLA_PATHS[kind]
    force_mla_path(monkeypatch, path, splits)
    r, p, h, b = 64, 16, 16, 16
    seq_lens = [70, 5]
    for mode, q_lens in (("decode", None), ("varlen", [40, 5])):
        mla, q, qsl = make_mla_case(mode, seq_lens, bf16, None, r, p, h, b, q_lens=q_lens, seed=33)
        slot = lambda pos: int(__import__("helpers").token_slots(mla.blocks[0], 70, b)[pos])  # noqa: E731
        s = slot(45)
        mla.kv_cache[s // b, s % b, 7] = float("inf")  # a value element on the prefill diagonal
        s = slot(50)
        mla.kv_cache[s // b, s % b, r + 3] = float("nan")  # a rope (key-only) element
        s = int(__import__("helpers").token_slots(mla.blocks[1], 5, b)[1])
        mla.kv_cache[s // b, s % b, 9] = float("-inf")  # sequence 1's key 1: in the first 32 keys of a tile
        out, lse, _ = run_emu_mla_attention(emu, mla, q, qsl, 0.1)
        if mode == "varlen":  # queries at positions 30..44 do not see key 45, sequence 1's first (40) not key 1
            assert out[:15, :, 7].isfinite().all() and out[40].isfinite().all()
    mla, q, qsl = make_mla_case("decode", seq_lens, bf16, "e4m3", r, p, h, b, seed=34)
    mla.scale[0] = float("inf")
    run_emu_mla_attention(emu, mla, q, qsl, 0.1)


def test_merge_attention_states_nonfinite(emu):
    """Every pair of lse kinds (finite, far below, -inf, +inf, NaN) as on the CPU (tests/test_nonfinite.py)."""
    kinds = [0.7, -150.0, float("-inf"), float("inf"), float("nan")]
    pairs = [(a, b) for a in kinds for b in kinds]
    gen = generator(35)
    out_a = randn(len(pairs), 2, 40, gen=gen, dtype=bf16)
    out_b = randn(len(pairs), 2, 40, gen=gen, dtype=bf16)
    lse_a = torch.tensor([[a, a] for a, _ in pairs])
    lse_b = torch.tensor([[b, b] for _, b in pairs])
    out_a[:, 0, ::3] = torch.where(lse_a[:, :1].isfinite(), out_a[:, 0, ::3], float("nan"))
    out_b[:, 0, 1::3] = torch.where(lse_b[:, :1].isfinite(), out_b[:, 0, 1::3], float("inf"))
    out_a[:, 1, 17] = float("nan")  # read whenever lse_a is not +-inf
    out, lse = emu.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attention_states(upcast(out_a), lse_a, upcast(out_b), lse_b)
    assert_close(out, ref_out, bf16, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


def merge_splits_reference(part_o, part_lse, seq_lens, sinks=None):
    """float64 merge of split partials (attention_merge.cuh, docs/ops.md "Non-finite values"): part_o
    [S, T, H, Dv], part_lse [S, T, H] in log2 units, one token per sequence. A split whose lse is -inf
    is not read; a NaN or +inf lse makes the row NaN; no finite lse and no sink: 0 / -inf without keys,
    NaN with keys. Returns out [T, H, Dv] and lse [T, H] (natural log)."""
    inf = float("inf")
    o, l = part_o.double(), part_lse.double()
    finite = l.isfinite()
    m = torch.where(finite, l, -inf).amax(0)
    w = torch.where(finite, torch.exp2(l - m), 0.0)
    num = (w[..., None] * torch.where(finite[..., None], o, 0.0)).sum(0)
    den = w.sum(0)
    sink = torch.full_like(m, -inf) if sinks is None else (sinks.double() / math.log(2.0)).expand_as(m)
    top = torch.maximum(m, sink)
    keys_part = torch.where(m > -inf, torch.exp2(m - top), 0.0)
    den = den * keys_part + torch.where(sink > -inf, torch.exp2(sink - top), 0.0)
    out = num * (keys_part / den)[..., None]
    lse = (top + torch.log2(den)) * math.log(2.0)
    none = top == -inf  # no finite lse, no sink
    has_keys = (seq_lens > 0)[:, None].expand_as(m)
    out = torch.where(none[..., None], torch.where(has_keys, float("nan"), 0.0)[..., None], out)
    lse = torch.where(none, torch.where(has_keys, float("nan"), -inf), lse)
    bad = (l.isnan() | (l == inf)).any(0)
    return torch.where(bad[..., None], float("nan"), out), torch.where(bad, float("nan"), lse)


# id: splits, value head dim, output dtype (Dv <= 128: 4 columns per lane, else 8)
MERGE_SPLITS_CASES = {"s2-dv8-f32": (2, 8, f32), "s5-dv64-f16": (5, 64, f16), "s49-dv128-bf16": (49, 128, bf16),
                      "s49-dv256-f32": (49, 256, f32), "s130-dv136-bf16": (130, 136, bf16)}


@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sinks"])
@pytest.mark.parametrize("case", MERGE_SPLITS_CASES)
def test_merge_splits_skips_empty_splits(emu, case, with_sinks):
    """The split merge alone (kvkernels_emu.merge_splits) on written partials: a split whose lse is -inf
    has NaN / inf garbage in its out row, which must be skipped, not weighted by 0 (0 * NaN is NaN), also in
    runs of empty splits as long as a whole batch of the kernel; a finite lse whose weight underflows to 0
    is still read; a NaN or +inf lse, all splits empty (with and without keys) and sinks as documented."""
    splits, dv, dtype = MERGE_SPLITS_CASES[case]
    t, h = 3, 4
    gen = generator(61)
    part_o = randn(splits, t, h, dv, gen=gen)
    part_lse = randn(splits, t, h, gen=gen, std=3.0)
    empty = torch.zeros(splits, t, h, dtype=torch.bool)
    empty[1::3] = True
    empty[8:16] = True  # a whole batch (8 splits at Dv <= 128, two of 4 above)
    empty[-1] = splits > 2
    empty[:, 1, 0] = True  # token 1 has keys: 0 / 0, NaN (or the sink)
    empty[:, 2, 1] = True  # token 2 has none: 0 / -inf (or the sink)
    part_lse[empty] = float("-inf")
    part_o[empty] = float("nan")
    part_o[..., 1::4] = torch.where(empty[..., None], float("inf"), part_o[..., 1::4])
    part_o[..., 2::4] = torch.where(empty[..., None], float("-inf"), part_o[..., 2::4])
    part_lse[splits // 2, 0, 3] = float("nan")
    part_lse[-2 if splits > 2 else 0, 2, 3] = float("inf")
    live = (~empty[:, 1, 2]).nonzero()[0, 0]  # weight 2^-200 rounds to 0 in float32 but is read
    part_lse[live, 1, 2] = part_lse[:, 1, 2].max() - 200.0
    part_o[live, 1, 2, 0] = float("nan")
    seq_lens = torch.tensor([5, 7, 0], dtype=torch.int32)
    sinks = torch.tensor([0.3, 2.0, float("-inf"), -1.0]) if with_sinks else None
    out, lse = emu.merge_splits(part_o, part_lse, seq_lens, dtype, sinks)
    ref_out, ref_lse = merge_splits_reference(part_o, part_lse, seq_lens, sinks)
    assert ref_out[0, :3].isfinite().all() and ref_out[1, 2, 0].isnan() and ref_out[1, 2, 1:].isfinite().all()
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    # A non-finite v_scale (already in the partials) makes every output NaN, rows without keys too.
    out, lse = emu.merge_splits(part_o, part_lse, seq_lens, dtype, sinks, torch.tensor([float("inf")]))
    assert out.isnan().all()
    assert_close(lse, ref_lse, f32, msg="lse with v_scale inf")


# ---------------------------------------------------------------------------------------------------
# caller-provided outputs (the *_out ops): the CUDA bindings' out= path (ensure_lse, finish) on the emulator
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [bf16, f32], ids=["bf16-mma", "f32-simt"])
@pytest.mark.parametrize("dv", [64, 32], ids=["dv64", "dv32"])
def test_out_noncausal(emu, dv, dtype):
    """causal=False through paged_attention_out (the binding's out path passes causal to prepare), with more
    queries than keys and Dv != Dk: the bytes of the allocating causal=False call, which is the reference's
    non-causal answer and differs from the causal one."""
    q_lens = [5, 2, 30, 9]
    kv = make_paged_kv(seq_lens=[17, 0, 40, 3], num_kv_heads=2, head_dim=64, head_dim_v=dv, block_size=16,
                       dtype=dtype, seed=41)
    query = make_query(sum(q_lens), 8, 64, dtype, generator(42))
    qsl = query_start_loc(q_lens)
    want, want_lse = run_paged_attention(kv, query, qsl, op=functools.partial(emulated_paged_attention, emu),
                                         causal=False, window_left=20)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl)
    out, lse = torch.full_like(want, float("nan")), torch.full_like(want_lse, 7.0)
    emu.paged_attention_out(*args, window_left=20, causal=False, **kv.scales, out=out, lse=lse)
    assert_bytes_equal(out, want, "out")
    assert_bytes_equal(lse, want_lse, "lse")
    emu.paged_attention_out(*args, window_left=20, **kv.scales, out=out, lse=lse)  # causal=True by default
    assert not torch.equal(out, want)


def test_causal_none_refused(emu):
    """causal=None through the CUDA binding's preparation (the schema is ``bool? causal=True``, so None
    reaches it instead of becoming False): refused by name, nothing launched or written."""
    kv = make_paged_kv(seq_lens=[17, 3], num_kv_heads=2, head_dim=64, block_size=16, dtype=bf16, seed=43)
    query = make_query(7, 4, 64, bf16, generator(44))
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, query_start_loc([5, 2]))
    message = r"^kvkernels\.paged_attention: causal: expected a bool, got None"
    with pytest.raises(RuntimeError, match=message):
        emu.paged_attention(*args, causal=None)
    out, lse = torch.full((7, 4, 64), float("nan"), dtype=bf16), torch.full((7, 4), 7.0)
    with pytest.raises(RuntimeError, match=message):
        emu.paged_attention_out(*args, causal=None, out=out, lse=lse)
    assert out.isnan().all() and (lse == 7.0).all()


@pytest.mark.parametrize("case", ["f16-decode-mma", "bf16-varlen-mma", "f32-decode-simt", "mla-bf16", "merge-f16"])
def test_out_variants(emu, case):
    """out= + lse= (contiguous: written directly) and out= alone into a padded view (through a temporary, with
    a scratch lse): the bytes of the allocating emulated call, and nothing around the view written."""
    if case == "mla-bf16":
        mla, q, _ = make_mla_case("decode", [37, 0, 70], bf16, None, 512, 64, 16, 64)
        args, kw = (q, mla.kv_cache, mla.block_tables, mla.seq_lens), dict(kv_lora_rank=512, scale=0.1)
        fn, fn_out, width = emu.mla_paged_attention, emu.mla_paged_attention_out, 512
    elif case == "merge-f16":
        gen = generator(31)
        args = (randn(9, 4, 64, gen=gen, dtype=f16), randn(9, 4, gen=gen), randn(9, 4, 64, gen=gen, dtype=f16),
                randn(9, 4, gen=gen))
        kw, fn, fn_out, width = {}, emu.merge_attention_states, emu.merge_attention_states_out, 64
    else:
        dtype = {"f16": f16, "bf16": bf16, "f32": f32}[case.split("-")[0]]
        mode = case.split("-")[1]
        kv, query, qsl = make_case(mode, [17, 0, 40, 1], dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=64,
                                   block_size=16)
        args, kw = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl), dict(kv.scales)
        fn, fn_out, width = emu.paged_attention, emu.paged_attention_out, 64
    want, want_lse = fn(*args, **kw)
    out, lse = torch.full_like(want, float("nan")), torch.full_like(want_lse, 7.0)
    fn_out(*args, **kw, out=out, lse=lse)
    assert_bytes_equal(out, want, "out")
    assert_bytes_equal(lse, want_lse, "lse")
    t, h = want.shape[:2]
    buf = torch.full((t, h, width + 8), 3.0, dtype=want.dtype)
    fn_out(*args, **kw, out=buf[..., 4:4 + width])
    expect = torch.full_like(buf, 3.0)
    expect[..., 4:4 + width] = want
    assert_bytes_equal(buf, expect, "padded out")


# ---------------------------------------------------------------------------------------------------
# the emulator's sm_90 model (tests/cuda_emu/cuda_emu.h, through the wrappers of csrc/cuda/sm90_ptx.cuh;
# kernels in tests/cuda_emu/sm90_selftest.cpp): wgmma against a plain matmul in every operand layout and
# swizzle, misuse reported, a warp-specialized mbarrier / named-barrier / setmaxnreg pipeline
# ---------------------------------------------------------------------------------------------------

# swizzle ids of the matrix descriptor: 0 none (interleaved core matrices), 1 128B, 2 64B, 3 32B
SWIZZLES = {"none": 0, "128B": 1, "64B": 2, "32B": 3}


@pytest.mark.parametrize("swizzle", SWIZZLES.keys())
def test_sm90_wgmma_matches_matmul(emu, swizzle):
    """D = A B over two chained k16 steps (scale-d 0, then 1: the accumulators' initial junk ignored) for
    m64n64k16 and m64n128k16, fp16 and bf16, A from shared memory K-major or M-major or from registers, B
    K-major or N-major, against the float64 product (the products are exact in float32, the sums float32)."""
    gen = generator(90 + SWIZZLES[swizzle])
    for dtype in (bf16, f16):
        for n in (64, 128):
            a = randn(64, 32, gen=gen, dtype=dtype)
            b = randn(32, n, gen=gen, dtype=dtype)
            want = a.double() @ b.double()
            for a_kind in ("K", "MN", "regs"):
                for b_mn in (False, True):
                    d = emu.wgmma_gemm(a, b, SWIZZLES[swizzle], a_kind == "MN", b_mn, a_kind == "regs", 0)
                    torch.testing.assert_close(d.double(), want, rtol=1e-5, atol=1e-4,
                                               msg=lambda m: f"{dtype} n{n} A {a_kind} B {'MN' if b_mn else 'K'}: {m}")


def test_sm90_wgmma_result_not_visible_before_the_wait(emu):
    """Accumulators read between the wgmma and its wait_group hold NaN (the emulator writes the result at the
    wait); the same kernel reading after the wait gets the product."""
    a, b = torch.ones(64, 16, dtype=bf16), torch.ones(16, 64, dtype=bf16)
    assert emu.wgmma_gemm(a, b, 1, False, False, False, 1).isnan().all()
    assert (emu.wgmma_gemm(a, b, 1, False, False, False, 0) == 16).all()
    assert emu.sm90_misuse(a, 100, 128).isnan().all()


def test_pdl_wait_then_read_is_not_reported(emu):
    """A grid launched with programmatic stream serialization that waits (griddepcontrol.wait) before reading its
    predecessor's output runs without a report (misuses 40 / 41 below break the rule)."""
    before = emu.pdl_counts(torch.zeros(1))
    assert (emu.sm90_misuse(torch.zeros(1), 42, 64) == 1).all()
    assert emu.pdl_counts(torch.zeros(1))[0] == before[0] + 1


# kind -> (threads, message): one broken rule each (tests/cuda_emu/sm90_selftest.cpp, misuse_kernel)
SM90_MISUSE = {
    0: (128, "descriptor start / LBO / SBO not 16-byte aligned"),
    1: (128, "not in the first row of a repeating pattern"),
    2: (128, "wait_group with wgmma.mma_async not committed"),
    3: (128, "without a wgmma.fence"),
    4: (128, "without a wgmma.fence"),
    5: (128, "shared memory read by a wgmma in flight changed"),
    6: (128, "A registers of a wgmma in flight changed"),
    7: (128, "differ between the threads of a warpgroup"),
    8: (128, "ended with wgmma.mma_async in flight"),
    10: (256, "named barrier 1 count mismatch"),
    11: (256, "deadlock .*named barrier 2 \\(128 of 256 arrived\\)"),
    12: (128, "ended with named barrier 3 part-way"),
    13: (128, "not a positive multiple of 32"),
    20: (128, "setmaxnreg count 100 not a multiple of 8"),
    21: (128, "setmaxnreg differs between the threads of a warpgroup"),
    22: (384, "deadlock .*setmaxnreg.inc"),
    23: (128, "setmaxnreg.dec above the current register count 40"),
    30: (128, "deadlock .*mbarrier"),
    31: (32, "more mbarrier arrivals than its count"),
    40: (64, "read its predecessor's output before griddepcontrol.wait"),
    41: (64, "never executed griddepcontrol.wait"),
}


@pytest.mark.parametrize("kind", SM90_MISUSE.keys())
def test_sm90_misuse_is_reported(emu, kind):
    """Each misuse of wgmma / named barriers / setmaxnreg / mbarriers that the ISA leaves undefined or that
    would hang on a GPU fails the emulated launch with a message naming it (instead of passing silently)."""
    threads, message = SM90_MISUSE[kind]
    with pytest.raises(RuntimeError, match=message):
        emu.sm90_misuse(torch.zeros(1), kind, threads)


@pytest.mark.parametrize("schedule", ["low", "high", "pass"])
def test_emulator_schedule_runs_the_reader_first(emu, schedule, monkeypatch):
    """A wgmma of one warpgroup reading shared memory another warpgroup writes with no barrier between
    (misuse 14: warpgroup 0 reads, 1 writes; 15: the reverse). The adverse orders run one end of the CTA
    ahead (KVKERNELS_EMU_SCHEDULE=low: low threads first, high: high threads first; the default alternates
    per CTA): when that puts the reader first, the write lands under the wgmma in flight and the launch fails;
    when it puts the writer first the race is not shown. Round-robin passes ('pass', the emulator's only
    schedule before) finish the writer's pass before the reader's warpgroup moves on and miss both: the hole
    through which a missing named barrier of the MLA wgmma decode passed."""
    monkeypatch.setenv("KVKERNELS_EMU_SCHEDULE", schedule)
    for kind, reader_first in ((14, "low"), (15, "high")):
        if schedule == reader_first:
            with pytest.raises(RuntimeError, match="read by a wgmma in flight changed before its wgmma.wait_group"):
                emu.sm90_misuse(torch.zeros(1), kind, 256)
        else:
            emu.sm90_misuse(torch.zeros(1), kind, 256)
    monkeypatch.setenv("KVKERNELS_EMU_SCHEDULE", "random")
    with pytest.raises(RuntimeError, match="KVKERNELS_EMU_SCHEDULE must be low, high, pass or alternate"):
        emu.sm90_misuse(torch.zeros(1), 14, 256)


def tma_box_expected(src, dims, strides, box, coords, swizzle128):
    """The bytes cp.async.bulk.tensor writes for one box, by a formula of the test's own: element (x0, x1, ..)
    of the map at byte x0 * esz + sum(x_i * strides[i - 1]) of ``src``'s storage, zero outside ``dims`` on any
    dimension; box rows (box[0] elements) in order, dimension 1 fastest; with the 128B swizzle (128-byte rows
    here) chunk c of row r at (c ^ (r % 8)) * 16."""
    flat = src.reshape(-1)
    esz = flat.element_size()
    rows = math.prod(box[1:])
    out = torch.zeros(rows, box[0], dtype=flat.dtype)
    for r in range(rows):
        idx, rest = [], r
        for i in range(1, len(dims)):
            idx.append(coords[i] + rest % box[i])
            rest //= box[i]
        if not all(0 <= x < dims[i + 1] for i, x in enumerate(idx)):
            continue
        at = sum(x * st for x, st in zip(idx, strides)) // esz
        for c in range(box[0]):
            x0 = coords[0] + c
            if 0 <= x0 < dims[0]:
                out[r, c] = flat[at + x0]
    raw = out.view(torch.uint8).reshape(rows, box[0] * esz)
    if not swizzle128:
        return raw.reshape(-1)
    assert raw.shape[1] == 128
    placed = torch.empty_like(raw)
    for r in range(rows):
        for c in range(8):
            placed[r, (c ^ (r % 8)) * 16:(c ^ (r % 8)) * 16 + 16] = raw[r, c * 16:c * 16 + 16]
    return placed.reshape(-1)


# id: (dtype, storage elements, dims, byte strides, box, coords, 128B swizzle). Ranks 1 to 5; each case puts part
# of its box outside the tensor on some dimension (and the 4-d ones on every dimension between them), with
# negative coordinates; strides that are not the packed ones (an NHD / HND paged cache's slot / head orders).
TMA_BOX_CASES = {
    "rank1-f32-negative": (f32, 64, [40], [], [16], [-8], False),
    "rank2-bf16-swizzle-rows-past-end": (bf16, 40 * 72, [72, 40], [144], [64, 16], [64, 30], True),
    "rank3-bf16-swizzle-heads-rows": (bf16, 5 * 40 * 80, [72, 5, 40], [160, 800], [64, 1, 16], [0, 3, -4], True),
    "rank4-nhd-cache-swizzle": (bf16, 6 * 16 * 3 * 64, [64, 3, 16, 6], [128, 384, 6144], [64, 1, 8, 1], [0, 2, 12, 5],
                                True),
    "rank4-hnd-cache-block-oob": (bf16, 6 * 3 * 16 * 64, [64, 16, 3, 6], [128, 2048, 6144], [64, 8, 1, 2],
                                  [0, 8, 1, 5], True),
    "rank4-head-negative": (bf16, 6 * 3 * 16 * 64, [64, 16, 3, 6], [128, 2048, 6144], [64, 8, 2, 1], [0, 4, -1, 2],
                            True),
    "rank5-u8-every-dim": (torch.uint8, 2 * 3 * 4 * 5 * 48, [48, 5, 4, 3, 2], [48, 240, 960, 2880], [32, 2, 3, 2, 2],
                           [32, 4, -1, 2, 1], False),
}


@pytest.mark.parametrize("case", TMA_BOX_CASES.values(), ids=TMA_BOX_CASES.keys())
def test_sm90_tma_box_matches_formula(emu, case):
    """The emulator's tensor-map model (cuTensorMapEncodeTiled + cp.async.bulk.tensor.<rank>d, ranks 1-5; ranks
    2 and 4 through the kernels' wrappers tma_load_2d / tma_load_4d): each box equals the test's formula (zero
    fill outside the tensor on each dimension, negative coordinates, strides, the 128B swizzle)."""
    dtype, n, dims, strides, box, coords, swz = case
    src = torch.arange(1, n + 1, dtype=torch.float64).remainder(251).add(1).to(dtype)
    got = emu.tma_box(src, dims, strides, box, coords, swz, len(dims))
    want = tma_box_expected(src, dims, strides, box, coords, swz)
    assert got.shape == want.shape and torch.equal(got, want)
    assert (want == 0).any() and (want != 0).any()  # some of the box inside the tensor and some outside


# id: (dims, byte strides, box, coords, 128B swizzle, instruction rank, message)
TMA_BOX_ERRORS = {
    "stride-not-16": ([64, 8, 2], [128, 1000], [64, 8, 1], [0, 0, 0], True, 3, "rejected the map"),
    "stride-2^40": ([64, 8], [1 << 40], [64, 8], [0, 0], True, 2, "rejected the map"),
    "box-257": ([64, 300], [128], [64, 257], [0, 0], False, 2, "rejected the map"),
    "swizzle-wider-than-128B": ([128, 8], [256], [128, 8], [0, 0], True, 2, "rejected the map"),
    "row-stride-below-row": ([64, 8, 2], [64, 1024], [64, 8, 1], [0, 0, 0], True, 3, "rejected the map"),
    "dim-zero": ([64, 0], [128], [64, 8], [0, 0], True, 2, "rejected the map"),
    "instruction-rank": ([64, 8, 2], [128, 1024], [64, 8, 1], [0, 0, 0, 0], True, 4,
                         "cp.async.bulk.tensor.4d with a map of rank 3"),
    "chunk-straddles-edge": ([72, 8], [144], [64, 8], [-4, 0], True, 2, "straddles the tensor's edge"),
}


@pytest.mark.parametrize("case", TMA_BOX_ERRORS.values(), ids=TMA_BOX_ERRORS.keys())
def test_sm90_tma_misuse_is_reported(emu, case):
    """Maps the driver rejects (strides not multiples of 16 or from 2^40, a box extent above 256, a swizzled box
    row wider than 128 bytes, a row stride below the row, an empty dimension) fail to encode; an instruction
    of another rank than the map's and a 16-byte chunk partly outside the tensor (not emulated) are reported."""
    dims, strides, box, coords, swz, rank, message = case
    src = torch.ones(4096, dtype=bf16)
    with pytest.raises(RuntimeError, match=message):
        emu.tma_box(src, dims, strides, box, coords, swz, rank)


@pytest.mark.parametrize("stages", [2, 3])
def test_sm90_warp_specialized_pipeline(emu, stages):
    """A producer warpgroup (setmaxnreg.dec) fills a ring of stages with cp.async, each stage's full mbarrier
    completed by cp.async.mbarrier.arrive.noinc; two consumer warpgroups (setmaxnreg.inc) wait for each
    phase, take turns on named barriers (ping-pong) and release the stage on its empty mbarrier: every item
    is read intact by both (not the poison of a stage being refilled) and the turns alternate."""
    src = torch.randint(-1000, 1000, (7, 512), dtype=torch.int32, generator=generator(97))
    out, order = emu.sm90_pipeline(src, stages)
    want = src.long().sum(1)
    assert torch.equal(out[:, 0], want) and torch.equal(out[:, 1], want)
    assert order.tolist() == [0, 1] * 7


# ---------------------------------------------------------------------------------------------------
# the Hopper wgmma prefill (csrc/cuda/attention_sm90.cuh, Path::kWgmmaPrefill; opt-in with
# KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill): the planner takes it where wgmma_prefill_unsupported() has no
# reason against it, else the wide prefill; KVKERNELS_CUDA_WGMMA=require turns such a fallback into an
# error, so every case below fails if it did not run the wgmma kernel. The emulated device is an sm_90
# part (4 SMs, 227 KiB of opt-in shared memory).
# ---------------------------------------------------------------------------------------------------

# Every test_wgmma_prefill* runs twice (the wgmma_variant fixture): on the kernel's plain loop (wgmma-prefill) and
# on its intra-warpgroup overlapped loop (wgmma-prefill-overlap; at padded head dim 256 the planner runs the plain
# loop for it, which run_emu_attention / wgmma_path expect).
WGMMA_VARIANTS = {"plain": "wgmma-prefill", "overlap": "wgmma-prefill-overlap"}


@pytest.fixture(params=list(WGMMA_VARIANTS.values()), ids=list(WGMMA_VARIANTS))
def wgmma_variant(request):
    return request.param


# The persistent kernel (wgmma-prefill-persistent: min(work items, SMs) CTAs, each walking items longest-first
# with the stage ring running on across items; its overlapped loop at 64 / 128, the plain one at 256) joins the
# two loops in the tests that take wgmma_variant_all (the varlen configs, head dim 256, fp8, splits, a non-finite
# tile mid-loop) and in test_wgmma_prefill_persistent_schedule; not in every test_wgmma_prefill* (CI time). The
# emulated device has 4 SMs, so each of its CTAs walks several items in almost every case.
WGMMA_ALL_VARIANTS = {**WGMMA_VARIANTS, "persistent": "wgmma-prefill-persistent"}


@pytest.fixture(params=list(WGMMA_ALL_VARIANTS.values()), ids=list(WGMMA_ALL_VARIANTS))
def wgmma_variant_all(request):
    return request.param


def wgmma_path(variant: str, dpad: int) -> int:
    """The path KVKERNELS_CUDA_ATTN_PATH=``variant`` runs at padded head dim ``dpad``."""
    return expected_path(WGMMA_PREFILL, variant, dpad)


def force_wgmma_plan(monkeypatch, op, path, splits=None, require=True):
    """KVKERNELS_CUDA_<op>_PATH = path (force_cuda_plan), and KVKERNELS_CUDA_WGMMA=require unless not
    ``require`` (a wgmma kernel that falls back then raises instead of quietly running the mma.sync one)."""
    force_cuda_plan(monkeypatch, op, path, splits)
    monkeypatch.delenv("KVKERNELS_CUDA_WGMMA", raising=False)
    if require:
        monkeypatch.setenv("KVKERNELS_CUDA_WGMMA", "require")


def use_wgmma(variant, monkeypatch, splits=None, require=True):
    force_wgmma_plan(monkeypatch, "ATTN", variant, splits, require)
    monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA", raising=False)  # (TMA where the block size allows: the default)


def tma_block_size(b: int, dpad: int) -> bool:
    """Whether the wgmma prefill loads K / V tiles by TMA at block size ``b`` (attention.cu, encode_kv_tma): a
    multiple of the key tile (128 keys, 64 at padded head dim 256), or a divisor of it of at least 8 rows."""
    kt = 64 if dpad == 256 else 128
    return b % kt == 0 or (kt % b == 0 and b >= 8)


# id: dtype, layout, Hq, Hkv, D, B, strided query. Block sizes 1 / 5 / 13 / 16 (none divides the 128-key
# tile but 16; 1 and 5 put several blocks in one tile row range), GQA groups 1 (MHA), 3 (128 rows hold 42
# queries x 3 heads), 4, 8 and 32 (4 queries x 32 heads), head dims 64 / 72 / 96 / 128.
WGMMA_CONFIGS = {
    "bf16-NHD-gqa4-d128-b16": (bf16, "NHD", 8, 2, 128, 16, None),
    "f16-HND-gqa8-d64-b5": (f16, "HND", 16, 2, 64, 5, "fused"),
    "bf16-stacked-mha-d64-b1": (bf16, "stacked", 4, 4, 64, 1, None),
    "f16-NHD-mqa-d72-b16": (f16, "NHD", 8, 1, 72, 16, "transposed"),
    "bf16-HND-gqa3-d96-b13": (bf16, "HND", 6, 2, 96, 13, None),
    "f16-NHD-gqa32-d128-b16": (f16, "NHD", 32, 1, 128, 16, None),
}


@pytest.mark.parametrize("config", WGMMA_CONFIGS.values(), ids=WGMMA_CONFIGS.keys())
def test_wgmma_prefill(emu, config, wgmma_variant_all, monkeypatch):
    """Varlen prefill on the wgmma kernel against the float64 reference: full prefill, chunked prefill,
    single queries and empty sequences (test_attention.varlen_q_lens), partial and exactly-full last blocks,
    shuffled block ids, junk past each sequence; a 261-key sequence (3 key tiles, its last 131 queries: two
    query tiles, the causal diagonal inside a tile) wraps the stage ring at head dim 128 (2 stages)."""
    dtype, layout, hq, hkv, d, b, strided = config
    use_wgmma(wgmma_variant_all, monkeypatch)
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b, 261]
    kv, query, qsl = make_case("varlen", seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, strided=strided)
    emu.tma_boxes_taken(query)
    _, _, plan = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL)
    hpc = min(hq // hkv, 128)
    assert plan["heads_per_cta"] == hpc and plan["q_tile"] == 128 // hpc, plan
    # block size 16: the fully visible tiles by TMA (the 261-key chunk's first tile at least); 1 / 5 / 13 gather
    assert (emu.tma_boxes_taken(query) > 0) == tma_block_size(b, plan["dpad"])



# The persistent kernel's schedule (wgmma-prefill-persistent). id: block size (16: whole-page tiles by TMA; 5: every
# tile gathered), forced splits, the emulator's CTA order, dtype, Hq, Hkv, D. Sequences of very different lengths
# (a 390-key full prefill: 13 (d64) / 7 (d128) key tiles, a 60-query chunk of 200 keys, 3 and 1 queries, two
# empty sequences), so items differ in length and several per CTA leave the ring mid-way through a wrap.
WGMMA_PERSISTENT_CASES = {
    "bf16-gqa4-d128-b16-tma": (16, None, None, bf16, 8, 2, 128),
    "f16-mha-d64-b5-gather-reverse": (5, None, "reverse", f16, 2, 2, 64),
    "bf16-gqa2-d64-b16-split3-reverse": (16, 3, "reverse", bf16, 4, 2, 64),
}


@pytest.mark.parametrize("case", WGMMA_PERSISTENT_CASES.values(), ids=WGMMA_PERSISTENT_CASES.keys())
def test_wgmma_prefill_persistent_schedule(emu, case, monkeypatch):
    """The persistent kernel against the float64 reference and, byte for byte, against the non-persistent
    overlapped loop (the same products in the same order per item): every item taken (a skipped one leaves the
    poisoned output), the ring's stages and phases carried from item to item (one off by an item deadlocks or
    reads another tile), more items than the 4 emulated SMs, both CTA orders, splits, TMA and gathered tiles."""
    b, splits, order, dtype, hq, hkv, d = case
    seq_lens, q_lens = [390, 0, 3, 200, 0, 1], [390, 0, 3, 60, 0, 1]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype, seed=91)
    query = make_query(sum(q_lens), hq, d, dtype, generator(92))
    qsl = query_start_loc(q_lens)
    results = {}
    for variant in ("wgmma-prefill-overlap", "wgmma-prefill-persistent"):
        use_wgmma(variant, monkeypatch, splits)
        if order:
            monkeypatch.setenv("KVKERNELS_EMU_CTA_ORDER", order)
        emu.tma_boxes_taken(query)
        out, lse, plan = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL,
                                           splits=None if splits is None else (lambda n: n == splits))
        results[variant] = (out, lse, emu.tma_boxes_taken(query))
    gx, gy = plan["grid"]
    assert gx * gy * plan["splits"] >= 3 * 4, plan  # at least 3 items per CTA on the 4 emulated SMs
    a, p = results["wgmma-prefill-overlap"], results["wgmma-prefill-persistent"]
    assert_bytes_equal(p[0], a[0], "out")
    assert_bytes_equal(p[1], a[1], "lse")
    assert p[2] == a[2] and (p[2] > 0) == (b == 16), (p[2], a[2])  # the same tiles by TMA

# id: dtype, layout, Hq, Hkv, Dk, Dv, B, loop. Block sizes whose tiles load by TMA: 8 (16 boxes of 8 keys per
# 64-column block: one swizzle atom each), 16, 32 (with MQA: one kv head, whose stride is never stepped), 64,
# 128 (one page per tile) and 256 (half a page: tile 1's box starts at slot 128); NHD (map dims (columns, head,
# slot, block)), HND ((columns, slot, head, block)) and stacked K / V (one allocation); head dims 64, 96 (columns
# 96-127 outside the map: zeros), 128, 256 (64-key tiles, 4 column blocks) and Dv 64 < Dk 128 (V's second
# column block wholly outside the map); each config on one of the two loops (the producer is the same code).
WGMMA_TMA_CONFIGS = {
    "bf16-NHD-gqa4-d128-b16-plain": (bf16, "NHD", 8, 2, 128, 128, 16, "plain"),
    "f16-HND-gqa2-d64-b8-overlap": (f16, "HND", 4, 2, 64, 64, 8, "overlap"),
    "bf16-stacked-mha-d96-b64-overlap": (bf16, "stacked", 2, 2, 96, 96, 64, "overlap"),
    "f16-NHD-mqa-d64-b32-plain": (f16, "NHD", 4, 1, 64, 64, 32, "plain"),
    "f16-NHD-gqa8-d128-b128-overlap": (f16, "NHD", 8, 1, 128, 128, 128, "overlap"),
    "bf16-HND-gqa4-d128-b256-plain": (bf16, "HND", 8, 2, 128, 128, 256, "plain"),
    "bf16-NHD-gqa2-d256-b16-plain": (bf16, "NHD", 4, 2, 256, 256, 16, "plain"),
    "f16-stacked-gqa4-k128-v64-b32-overlap": (f16, "stacked", 8, 2, 128, 64, 32, "overlap"),
    "bf16-HND-gqa2-d128-b16-persistent": (bf16, "HND", 4, 2, 128, 128, 16, "persistent"),
}


def run_tma_and_gathers(emu, kv, query, qsl, monkeypatch, table=None, **kwargs):
    """The emulated wgmma prefill with TMA (the default) and with KVKERNELS_CUDA_NO_TMA=1 (every tile gathered):
    the boxes each run copied (some with TMA, none without; a whole number of tiles' worth, K and V) and the
    two results, which must be equal byte for byte. With ``table`` (a block table with out-of-range ids) the
    kernel reads it in place of kv.block_tables and the caller checks the result against a reference."""
    results, boxes = {}, {}
    for tma in (True, False):
        monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "0" if tma else "1")
        monkeypatch.setenv("KVKERNELS_CUDA_TMA", "require" if tma else "0")  # (a launch without maps: an error)
        emu.tma_boxes_taken(query)
        if table is None:
            out, lse, plan = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL, **kwargs)
        else:
            out, lse = emulated_paged_attention(emu, query, kv.key_cache, kv.value_cache, table, kv.seq_lens, qsl,
                                                **kwargs)
            plan = plan_of(emu, kv, query, qsl)
        boxes[tma] = emu.tma_boxes_taken(query)
        results[tma] = (out, lse)
    kt = 64 if plan["dpad"] == 256 else 128
    per_tile = kt // min(kv.key_cache.shape[1], kt) * plan["dpad"] // 64
    assert boxes[True] > 0 and boxes[True] % (2 * per_tile) == 0 and boxes[False] == 0, boxes
    assert_bytes_equal(results[True][0], results[False][0], "out")
    assert_bytes_equal(results[True][1], results[False][1], "lse")
    return results[True]


@pytest.mark.parametrize("config", WGMMA_TMA_CONFIGS.values(), ids=WGMMA_TMA_CONFIGS.keys())
def test_wgmma_prefill_tma_and_gathers(emu, config, monkeypatch):
    """K / V tiles by TMA (whole pages, or a tile's part of one page, of keys the CTA may read) against the same
    kernel gathering every tile: bit-identical, both against the float64 reference. A full causal prefill of 261
    keys, a chunk of the last 150 of 300 (every CTA's first tiles whole), 5 queries over 5 keys (no whole tile:
    gathered) and one query over 250 keys (its last tile ends 6 keys past the sequence, in the last page at every
    block size here, whose ids are all valid); the last pages are partial with NaN in their unused slots, shuffled
    block ids. (A tile read by TMA past the sequence's end shows in the one-query CTA: with several rows per CTA
    the non-finite V scan would send the tile to the scalar P V, which skips the unseen keys.)"""
    dtype, layout, hq, hkv, dk, dv, b, loop = config
    use_wgmma(WGMMA_ALL_VARIANTS[loop], monkeypatch)
    seq_lens, q_lens = [261, 300, 5, 250], [261, 150, 5, 1]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=dk, head_dim_v=dv, block_size=b, dtype=dtype,
                       layout=layout, seed=91)
    query = make_query(sum(q_lens), hq, dk, dtype, generator(92))
    run_tma_and_gathers(emu, kv, query, query_start_loc(q_lens), monkeypatch)


@pytest.mark.parametrize("b", [16, 128])
def test_wgmma_prefill_tma_out_of_range_block_ids(emu, b, monkeypatch):
    """Out-of-range block ids (-1, N, INT32_MIN, INT32_MAX) in tiles the producer would load by TMA: such a tile
    is gathered (zero rows for those ids, as every kernel reads them), the other tiles still by TMA; the result
    bit-identical to the all-gather run and equal to the reference over a zero block (nothing read outside the
    cache: NaN blocks on both sides)."""
    use_wgmma("wgmma-prefill", monkeypatch)
    seq_lens, q_lens = [300, 400], [40, 100]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=128, block_size=b, dtype=bf16, seed=93)
    n = kv.key_cache.shape[0]
    kv.key_cache, kv.value_cache = between_nan_blocks(kv.key_cache), between_nan_blocks(kv.value_cache)
    # logical blocks in each sequence's first tile (keys < 128) and, at block size 16, in a later one
    used = [(0, 2), (1, 0), (1, 9), (0, 0)] if b == 16 else [(0, 0), (1, 1), (1, 2), (0, 1)]
    table, ref_table = out_of_range_ids(kv.block_tables, used, n)
    qsl = query_start_loc(q_lens)
    query = make_query(sum(q_lens), 8, 128, bf16, generator(94))
    out, lse = run_tma_and_gathers(emu, kv, query, qsl, monkeypatch, table=table)
    zero = torch.zeros(1, *kv.key_cache.shape[1:], dtype=bf16)
    ref_out, ref_lse = reference.paged_attention(upcast(query), upcast(torch.cat([kv.key_cache, zero])),
                                                 upcast(torch.cat([kv.value_cache, zero])), ref_table, kv.seq_lens, qsl)
    assert out.isfinite().all()
    assert_close(out, ref_out, bf16, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


def test_wgmma_prefill_tma_require_names_why(emu, monkeypatch):
    """KVKERNELS_CUDA_TMA=require fails a wgmma prefill launch whose K / V tiles would all be gathered, naming the
    reason: a block size that neither divides the key tile (at least 8) nor is a multiple of it (1, 5, 13, 4, 96),
    an fp8 cache, KVKERNELS_CUDA_NO_TMA=1; a block size that fits runs."""
    use_wgmma("wgmma-prefill", monkeypatch)
    monkeypatch.setenv("KVKERNELS_CUDA_TMA", "require")
    qsl = query_start_loc([3])
    cases = [(b, None, "neither divides the key tile") for b in (1, 5, 13, 4, 96)] + [(16, "e4m3", "fp8 caches")]
    for b, fp8, why in cases:
        kv = make_paged_kv(seq_lens=[3], num_kv_heads=1, head_dim=64, block_size=b, dtype=bf16, fp8=fp8, seed=95)
        query = make_query(3, 1, 64, bf16, generator(96))
        with pytest.raises(RuntimeError, match="KVKERNELS_CUDA_TMA=require: .*" + why):
            emulated_paged_attention(emu, query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                                     **kv.scales)
    kv = make_paged_kv(seq_lens=[3], num_kv_heads=1, head_dim=64, block_size=32, dtype=bf16, seed=95)
    emulated_paged_attention(emu, query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl)
    monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "1")
    with pytest.raises(RuntimeError, match="KVKERNELS_CUDA_TMA=require: .*KVKERNELS_CUDA_NO_TMA=1"):
        emulated_paged_attention(emu, query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl)


# id: dtype, layout, Hq, Hkv, Dk, Dv, B. Padded head dim 256: 64-key tiles, 2 stages, P V as two n128 halves.
# Head dims 160 / 192 (zero-filled columns past them) and 256; Dv != Dk both ways (the larger sets the padding);
# block sizes 16 (a 64-key tile spans 4 blocks), 7 and 1; the 261-key sequence runs 5 key tiles
# (the 2-stage ring wraps twice) and its 131 last queries 2 query tiles.
WGMMA_D256_CONFIGS = {
    "bf16-NHD-gqa4-d256-b16": (bf16, "NHD", 8, 2, 256, 256, 16),
    "f16-HND-gqa3-d160-b7": (f16, "HND", 6, 2, 160, 160, 7),
    "bf16-stacked-mha-k192-v64-b1": (bf16, "stacked", 2, 2, 192, 64, 1),
    "f16-stacked-gqa8-k128-v256-b16": (f16, "stacked", 8, 1, 128, 256, 16),
}


@pytest.mark.parametrize("config", WGMMA_D256_CONFIGS.values(), ids=WGMMA_D256_CONFIGS.keys())
def test_wgmma_prefill_head_dim_256(emu, config, wgmma_variant_all, monkeypatch):
    """Padded head dim 256 on the wgmma kernel against the float64 reference: full / chunked prefill, empty and
    one-key sequences, a value head dim other than the key's (out Dv wide), KV splits of the 64-key tiles."""
    dtype, layout, hq, hkv, dk, dv, b = config
    use_wgmma(wgmma_variant_all, monkeypatch)
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b, 261]
    kv, query, qsl = dv_case("varlen", seq_lens, dtype, None, layout, hq, hkv, dk, dv, b, seed=71)
    out, _, plan = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL)
    assert plan["dpad"] == 256 and out.shape[-1] == dv, plan
    use_wgmma(wgmma_variant_all, monkeypatch, splits=3)
    _, _, plan = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL, window_left=70, soft_cap=4.0)
    assert plan["splits"] == 3, plan


def test_wgmma_prefill_head_dim_256_all_features(emu, wgmma_variant, monkeypatch):
    """check_features' "all" case (window, soft cap, ALiBi, sinks and scale at once) at head dim 256 with a 300-key
    sequence (5 tiles of 64 keys); each option alone runs at 64 / 128 (test_wgmma_prefill_features), and
    window + soft cap with splits at 256 above: one case here keeps the emulated time small."""
    use_wgmma(wgmma_variant, monkeypatch)
    check_features(lambda kv, q, qsl, **kw: run_emu_attention(emu, kv, q, qsl, path=WGMMA_PREFILL, **kw)[:2],
                   (bf16, None, False, "NHD", 2, 256, 16), "all", "varlen", more_seq_lens=(300,))


def test_wgmma_prefill_group_above_128(emu, wgmma_variant, monkeypatch):
    """A GQA group of 160 heads: 128 rows hold one query's first 128 heads, a second head chunk its last 32
    (warpgroup 1 of that chunk has no valid row: it still takes part in the pipeline and writes nothing)."""
    use_wgmma(wgmma_variant, monkeypatch)
    kv, query, qsl = make_case("varlen", [20, 2, 0], dtype=bf16, num_heads=160, num_kv_heads=1, head_dim=64,
                               block_size=16, seed=48)
    _, _, plan = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL)
    assert plan["heads_per_cta"] == 128 and plan["q_tile"] == 1 and plan["grid"][1] == 2, plan


# id: dtype, fp8, per-head scales (one flag for k and v, or a (k, v) pair), layout, Hq, Hkv, D, B. The
# producer gathers raw fp8 rows and dequantizes them into the 16-bit stages: e4m3 and e5m2, under bf16 and
# f16 queries, per-tensor and per-head k / v scales, block sizes that do (16) and do not (1, 5, 13) divide
# the 128-key tile, head dims 64 / 80 / 96 / 128 (fp8 rows must be 16-byte aligned: the head dim a multiple of
# 16 here; a raw chunk partly past the head dim: the e5m2 k40 case of WGMMA_DV_CONFIGS).
WGMMA_FP8_CONFIGS = {
    "e4m3-bf16-NHD-gqa4-d128-b16-head": (bf16, "e4m3", True, "NHD", 8, 2, 128, 16),
    "e5m2-f16-HND-gqa3-d96-b13-tensor": (f16, "e5m2", False, "HND", 6, 2, 96, 13),
    "e5m2-bf16-stacked-mha-d64-b1-khead": (bf16, "e5m2", (True, False), "stacked", 4, 4, 64, 1),
    "e4m3-f16-NHD-mqa-d80-b5-vhead": (f16, "e4m3", (False, True), "NHD", 8, 1, 80, 5),
}


@pytest.mark.parametrize("config", WGMMA_FP8_CONFIGS.values(), ids=WGMMA_FP8_CONFIGS.keys())
def test_wgmma_prefill_fp8(emu, config, wgmma_variant_all, monkeypatch):
    """Varlen prefill over an fp8 cache on the wgmma kernel against the float64 reference (the reference reads
    the fp8 values times the scales): test_wgmma_prefill's sequences, the 261-key one wrapping the stage ring at
    head dim 128."""
    dtype, fp8, per_head, layout, hq, hkv, d, b = config
    use_wgmma(wgmma_variant_all, monkeypatch)
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b, 261]
    kv, query, qsl = make_case("varlen", seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, seed=61)
    _, _, plan = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL)
    assert plan["dpad"] == (64 if d <= 64 else 128), plan


@pytest.mark.parametrize("fp8,dtype,d", [("e4m3", bf16, 128), ("e5m2", f16, 64)], ids=["e4m3-bf16-d128", "e5m2-f16-d64"])
def test_wgmma_prefill_fp8_bitwise_as_16bit(emu, fp8, dtype, d, wgmma_variant, monkeypatch):
    """With unit scales, an fp8 cache gives bit for bit the output of a 16-bit cache holding its values (the
    dequantization is exact, and the consumers' code is the same): a misplaced chunk, a wrong swizzle or a
    converted tile read before it lands changes bits even where it stays within the reference's tolerance."""
    use_wgmma(wgmma_variant, monkeypatch)
    seq_lens = [150, 7, 300]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=d, block_size=16, dtype=dtype, fp8=fp8, seed=63)
    kv.k_scale.fill_(1.0)
    kv.v_scale.fill_(1.0)
    q_lens = [150, 2, 130]
    qsl = query_start_loc(q_lens)
    query = make_query(sum(q_lens), 8, d, dtype, generator(64))
    assert plan_of(emu, kv, query, qsl)["path"] == wgmma_path(wgmma_variant, d)
    out8, lse8 = emulated_paged_attention(emu, query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                          qsl, window_left=100, **kv.scales)
    k16, v16 = kv.key_cache.to(dtype), kv.value_cache.to(dtype)  # exact: every fp8 value is an f16 / bf16 value
    out16, lse16 = emulated_paged_attention(emu, query, k16, v16, kv.block_tables, kv.seq_lens, qsl, window_left=100)
    assert out8.isfinite().all() and torch.equal(out8, out16) and torch.equal(lse8, lse16)


# id: dtype, fp8, per-head, layout, Hkv, D, B (Hq = 8): check_features' cases
WGMMA_FEATURE_CONFIGS = {
    "bf16-HND-d64-b3": (bf16, None, False, "HND", 1, 64, 3),
    "f16-NHD-d128-b16": (f16, None, False, "NHD", 2, 128, 16),
    "e4m3-bf16-NHD-d64-b16-head": (bf16, "e4m3", True, "NHD", 2, 64, 16),
}


@pytest.mark.parametrize("feature", FEATURE_NAMES)
@pytest.mark.parametrize("config", WGMMA_FEATURE_CONFIGS.values(), ids=WGMMA_FEATURE_CONFIGS.keys())
def test_wgmma_prefill_features(emu, config, feature, wgmma_variant, monkeypatch):
    """Window edges, soft cap, ALiBi, sinks, scale and all of them at once on the wgmma prefill, plus a
    300-key sequence (3 key tiles)."""
    use_wgmma(wgmma_variant, monkeypatch)
    check_features(lambda kv, q, qsl, **kw: run_emu_attention(emu, kv, q, qsl, path=WGMMA_PREFILL, **kw)[:2],
                   config, feature, "varlen", more_seq_lens=(300,))


@pytest.mark.parametrize("opts", [{}, dict(window_left=9), dict(alibi_slopes=torch.linspace(-0.2, 0.3, 8),
                                                                 sinks=torch.linspace(-1.0, 1.0, 8))],
                         ids=["plain", "window9", "alibi-sinks"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("splits", [None, 3], ids=["planned", "split3"])
def test_wgmma_prefill_noncausal_and_more_queries_than_keys(emu, splits, causal, opts, wgmma_variant, monkeypatch):
    """causal=False and sequences with more queries than keys (causal: the leading rows see no key: out 0,
    lse -inf) on the wgmma prefill, with the planner's splits and 3 forced ones (capped at the 2 key tiles
    of the longest block table row; partials merged)."""
    use_wgmma(wgmma_variant, monkeypatch, splits)
    seq_lens, q_lens = [17, 0, 170, 3, 40, 9], [17, 3, 33, 7, 1, 70]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=128, block_size=16, dtype=f16, seed=13)
    query = make_query(sum(q_lens), 8, 128, f16, generator(14))
    qsl = query_start_loc(q_lens)
    out, lse, plan = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL, causal=causal,
                                       splits=(lambda n: n > 1) if splits else None, **opts)
    starts = qsl.tolist()
    empty = list(range(starts[1], starts[2]))  # seq_len 0
    if causal:  # 4 of the 7 queries over 3 keys, 61 of the 70 over 9
        empty += list(range(starts[3], starts[3] + 4)) + list(range(starts[5], starts[5] + 61))
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    if "sinks" not in opts:
        assert torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("splits", [None, 5, 128], ids=["planned", "split5", "split128"])
def test_wgmma_prefill_long_context_splits(emu, splits, wgmma_variant_all, monkeypatch):
    """Chunks at the end of long contexts: few work items, so the planner splits the keys (its own count, 5,
    or 128: capped at the 17 key tiles, some splits empty), float32 partials merged by the merge kernel."""
    use_wgmma(wgmma_variant_all, monkeypatch, splits)
    seq_lens, q_lens = [2100, 1], [6, 1]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=1, head_dim=64, block_size=16, dtype=bf16, seed=41)
    query = make_query(sum(q_lens), 8, 64, bf16, generator(42))
    run_emu_attention(emu, kv, query, query_start_loc(q_lens), path=WGMMA_PREFILL, splits=lambda n: n > 1,
                      window_left=1000, sinks=torch.linspace(-1, 1, 8), soft_cap=3.0)


# id: dtype, layout, Hq, Hkv, Dk, Dv, B (the stacked views sit in a NaN-filled max(Dk, Dv)-wide allocation)
WGMMA_DV_CONFIGS = {  # id: dtype, fp8, layout, Hq, Hkv, Dk, Dv, B
    "f16-stacked-k32-v96-b16": (f16, None, "stacked", 4, 1, 32, 96, 16),
    "bf16-stacked-k128-v40-b7": (bf16, None, "stacked", 8, 2, 128, 40, 7),
    "e5m2-bf16-stacked-k40-v128-b7": (bf16, "e5m2", "stacked", 8, 2, 40, 128, 7),
}


@pytest.mark.parametrize("config", WGMMA_DV_CONFIGS.values(), ids=WGMMA_DV_CONFIGS.keys())
def test_wgmma_prefill_value_head_dim(emu, config, wgmma_variant, monkeypatch):
    """A value head dim other than the key's: K zero-filled past Dk and V past Dv (the padded dim of the
    larger), out Dv wide."""
    dtype, fp8, layout, hq, hkv, dk, dv, b = config
    use_wgmma(wgmma_variant, monkeypatch)
    kv, query, qsl = dv_case("varlen", [b + 1, 0, max(3 * b - 1, 37), 1, b, 150], dtype, fp8, layout, hq, hkv,
                             dk, dv, b)
    run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL)


@pytest.mark.parametrize("d,hq,hkv,dtype", [(64, 2, 2, f16), (128, 4, 1, bf16)], ids=["f16-d64", "bf16-d128"])
def test_wgmma_prefill_nonfinite(emu, d, hq, hkv, dtype, wgmma_variant, monkeypatch):
    """test_paged_attention_nonfinite's prefill case on the wgmma kernel: a NaN key and an inf value on the
    causal diagonal of a key tile (the scalar P V of a partly visible tile whose V holds inf / NaN: rows
    before them stay finite), NaN / inf at the last position; plain, with a NaN sink, with an inf ALiBi slope
    and a window."""
    use_wgmma(wgmma_variant, monkeypatch)
    seq_lens = [70, 5]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=dtype, seed=31)
    qsl = query_start_loc(seq_lens)
    query = make_query(sum(seq_lens), hq, d, dtype, generator(32))
    _poke(kv.key_cache, kv.blocks[0], 70, 20, 0, 3, "nan")
    _poke(kv.value_cache, kv.blocks[0], 70, 40, 0, 5, "+inf")
    _poke(kv.key_cache, kv.blocks[0], 70, 69, hkv - 1, 1, "+inf")
    _poke(kv.value_cache, kv.blocks[0], 70, 69, hkv - 1, 2, "nan")
    sinks = torch.linspace(-1.0, 1.0, hq)
    sinks[1] = float("nan")
    slopes = torch.linspace(0.01, 0.1, hq)
    slopes[-1] = float("inf")
    for opts in ({}, dict(sinks=sinks), dict(alibi_slopes=slopes, window_left=30)):
        out, lse, _ = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL, **opts)
        if not opts:  # rows before key 20 saw no NaN, rows before key 40 no inf
            assert out[:20].isfinite().all() and lse[:20].isfinite().all()


@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_prefill_nonfinite_tile_mid_loop(emu, d, wgmma_variant_all, monkeypatch):
    """Tiles taking the non-finite fix-up first, in the middle and last in a CTA's loop (test_wgmma_prefill_nonfinite's
    sequences fit in one key tile): a chunk of 300 queries at positions 100-399 of a 400-key sequence, MHA (128
    queries per CTA: rows 100-227, 228-355, 356-399), inf values at keys 110 and 300 (kv head 0) and a NaN value
    at key 240 (kv head 1). The first CTA fixes up its tile 0 (rows 100-109 do not see key 110) and its last
    tile 1 (key 240 is past all its rows); the second its tile 1 (rows 228-239 do not see key 240), then tile
    2 (key 300). In the overlapped loop a fix-up tile's zero P V runs with the next tile's S in flight. Rows
    before key 110 stay finite; plain and with a 150-key window (window edges in tiles 0 / 1 / 2)."""
    use_wgmma(wgmma_variant_all, monkeypatch)
    kv = make_paged_kv(seq_lens=[400], num_kv_heads=2, head_dim=d, block_size=16, dtype=bf16, seed=81)
    qsl = query_start_loc([300])
    query = make_query(300, 2, d, bf16, generator(82))
    _poke(kv.value_cache, kv.blocks[0], 400, 110, 0, 1, "+inf")
    _poke(kv.value_cache, kv.blocks[0], 400, 300, 0, 6, "+inf")
    _poke(kv.value_cache, kv.blocks[0], 400, 240, 1, 4, "nan")
    for opts in ({}, dict(window_left=150)):
        out, lse, _ = run_emu_attention(emu, kv, query, qsl, path=WGMMA_PREFILL, **opts)
        assert out[:10].isfinite().all() and not out[10:].isfinite().all() and lse.isfinite().all()


def test_wgmma_prefill_out_of_range_block_ids_read_nothing(emu, wgmma_variant, monkeypatch):
    """test_paged_attention_out_of_range_block_ids_read_nothing on the wgmma producer: ids -1, N, INT32_MIN,
    INT32_MAX in visible blocks give zero rows, nothing read outside the caches (between NaN blocks)."""
    use_wgmma(wgmma_variant, monkeypatch)
    b, seq_lens = 16, [3 * 16 + 5, 2 * 16, 16 + 1]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=128, block_size=b, dtype=bf16, seed=71)
    n = kv.key_cache.shape[0]
    k, v = between_nan_blocks(kv.key_cache), between_nan_blocks(kv.value_cache)
    table, ref_table = out_of_range_ids(kv.block_tables, [(0, 1), (1, 0), (0, 3), (2, 1)], n)
    q_lens = [20, 1, 17]
    qsl = query_start_loc(q_lens)
    query = make_query(sum(q_lens), 8, 128, bf16, generator(72))
    assert plan_of(emu, kv, query, qsl)["path"] == wgmma_path(wgmma_variant, 128)
    out, lse = emulated_paged_attention(emu, query, k, v, table, kv.seq_lens, qsl)
    zero = torch.zeros(1, *k.shape[1:], dtype=k.dtype)
    ref_out, ref_lse = reference.paged_attention(upcast(query), upcast(torch.cat([k, zero])),
                                                 upcast(torch.cat([v, zero])), ref_table, kv.seq_lens, qsl)
    assert out.isfinite().all()
    assert_close(out, ref_out, bf16, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


def test_wgmma_prefill_plan_and_fallbacks(emu, wgmma_variant, monkeypatch):
    """KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill (-overlap) takes the wgmma kernel (128 rows: q_tile x the group's
    heads, 128-key tiles for the split cap) where it applies; elsewhere the planner runs the wide prefill / the
    decode or SIMT kernels, and with KVKERNELS_CUDA_WGMMA=require says why (docs/ops.md). Not a default. The
    overlapped loop at padded head dims 64 / 128 (16-bit and fp8 caches), the plain one at 256."""
    wgmma = wgmma_path(wgmma_variant, 128)
    kv, query, qsl = make_case("varlen", [300, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=128,
                               block_size=16, seed=45)
    use_wgmma(wgmma_variant, monkeypatch, splits=None, require=False)
    plan = plan_of(emu, kv, query, qsl)
    assert plan["path"] == wgmma and plan["q_tile"] == 32 and plan["heads_per_cta"] == 4, plan
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", "128")
    assert plan_of(emu, kv, query, qsl)["splits"] == -(-kv.block_tables.shape[1] * 16 // 128)
    monkeypatch.delenv("KVKERNELS_CUDA_ATTN_SPLITS")
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", "mma-decode-deep," + wgmma_variant)
    assert plan_of(emu, kv, query, qsl)["path"] == wgmma
    monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PATH")
    assert plan_of(emu, kv, query, qsl)["path"] == MMA_PREFILL  # not the default
    for bad in (wgmma_variant + ",mma-prefill-deep", wgmma_variant + "," + wgmma_variant, "wgmma",
                "wgmma-prefill,wgmma-prefill-overlap", "wgmma-overlap"):
        monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", bad)
        with pytest.raises(RuntimeError, match=f"KVKERNELS_CUDA_ATTN_PATH={bad} is not one of"):
            plan_of(emu, kv, query, qsl)
    _, decode_query, _ = make_case("decode", [300, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=128,
                                   block_size=16, seed=45)
    kv_gqa32, q_gqa32, _ = make_case("decode", [30, 7], dtype=bf16, num_heads=32, num_kv_heads=1, head_dim=64,
                                     block_size=16)
    kv_fp8, q_fp8, qsl_fp8 = make_case("varlen", [30, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=64,
                                       block_size=16, fp8="e4m3")
    kv256, q256, qsl256 = make_case("varlen", [30, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=256,
                                    block_size=16)
    kv256_fp8, q256_fp8, qsl256_fp8 = make_case("varlen", [30, 7], dtype=bf16, num_heads=8, num_kv_heads=2,
                                                head_dim=256, block_size=16, fp8="e4m3")
    kv32, q32, qsl32 = make_case("varlen", [30, 7], dtype=f32, num_heads=8, num_kv_heads=2, head_dim=64,
                                 block_size=16)
    kvu, qu, qslu = make_case("varlen", [30, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=64,
                              block_size=16)
    kvu = dataclasses.replace(kvu, key_cache=unaligned_copy(kvu.key_cache))
    cases = {  # (kv, query, qsl) -> the path without require, the reason with it
        "decode": ((kv, decode_query, None), MMA_DECODE, None),  # (the decode kernel: the wgmma choice unread)
        "decode-gqa32": ((kv_gqa32, q_gqa32, None), MMA_PREFILL, "decode"),
        "fp8": ((kv_fp8, q_fp8, qsl_fp8), wgmma_path(wgmma_variant, 64), None),
        "d256": ((kv256, q256, qsl256), WGMMA_PREFILL, None),  # (no overlapped loop at 256: the plain one)
        "fp8-d256": ((kv256_fp8, q256_fp8, qsl256_fp8), MMA_PREFILL, "fp8 caches at head dims above 128"),
        "f32": ((kv32, q32, qsl32), SIMT, None),
        "unaligned": ((kvu, qu, qslu), MMA_PREFILL, "not 16-byte aligned"),
    }
    for name, ((k, q, s), path, reason) in cases.items():
        use_wgmma(wgmma_variant, monkeypatch, require=False)
        assert plan_of(emu, k, q, s)["path"] == path, name
        if reason:
            use_wgmma(wgmma_variant, monkeypatch)
            with pytest.raises(RuntimeError, match=f"KVKERNELS_CUDA_WGMMA=require: .*{reason}"):
                plan_of(emu, k, q, s)
    # a part with less opt-in shared memory than the kernel's ~193 KiB
    use_wgmma(wgmma_variant, monkeypatch)
    monkeypatch.setenv("KVKERNELS_EMU_SMEM_OPTIN", str(160 * 1024))
    with pytest.raises(RuntimeError, match="less opt-in shared memory"):
        plan_of(emu, kv, query, qsl)
    # over an fp8 cache at head dim 128 it needs 225 KiB (the raw fp8 K / V tile on top of the stages)
    kv_fp8_128, q_fp8_128, qsl_fp8_128 = make_case("varlen", [30, 7], dtype=bf16, num_heads=8, num_kv_heads=2,
                                                   head_dim=128, block_size=16, fp8="e5m2")
    monkeypatch.setenv("KVKERNELS_EMU_SMEM_OPTIN", str(200 * 1024))
    assert plan_of(emu, kv, query, qsl)["path"] == wgmma
    with pytest.raises(RuntimeError, match="less opt-in shared memory"):
        plan_of(emu, kv_fp8_128, q_fp8_128, qsl_fp8_128)
    monkeypatch.setenv("KVKERNELS_EMU_SMEM_OPTIN", str(227 * 1024))
    assert plan_of(emu, kv_fp8_128, q_fp8_128, qsl_fp8_128)["path"] == wgmma


# ---------------------------------------------------------------------------------------------------
# The sm_90a wgmma MLA decode (csrc/cuda/mla_attention_sm90.cuh; KVKERNELS_CUDA_MLA_PATH=wgmma, opt-in).
# Every case runs with KVKERNELS_CUDA_WGMMA=require, so a planner fallback fails the test instead of
# quietly testing the mma.sync kernels; the plan's path is asserted too.
# ---------------------------------------------------------------------------------------------------

# Every wgmma MLA test runs both consumer schedules, in step (KVKERNELS_CUDA_MLA_PATH=wgmma) and the seesaw
# (=wgmma-seesaw), each with the shape-only split plan and with the metadata pass's (+metadata:
# KVKERNELS_CUDA_MLA_SCHED=metadata); run_emu_mla_attention asserts the plan's schedule and split plan.
@pytest.fixture(params=["wgmma", "wgmma-seesaw", "wgmma+metadata", "wgmma-seesaw+metadata"])
def mla_wgmma_schedule(request):
    return request.param


def use_mla_wgmma(monkeypatch, schedule, splits=None, require=True):
    """``schedule``: path[+metadata]. ``splits``: KVKERNELS_CUDA_MLA_SPLITS (under the metadata plan the CTAs per
    head chunk)."""
    path, _, sched = schedule.partition("+")
    force_wgmma_plan(monkeypatch, "MLA", path, splits, require)
    if sched:
        monkeypatch.setenv("KVKERNELS_CUDA_MLA_SCHED", sched)
    else:
        monkeypatch.delenv("KVKERNELS_CUDA_MLA_SCHED", raising=False)


def mla_wgmma_splits(plan):
    """The split count a case asked for: KV splits of the shape-only plan, CTAs per head chunk of the metadata one."""
    return plan["parts"] if plan["parts"] else plan["splits"]


# id: q dtype, cache fp8, R, P, heads, block size, strided q. DeepSeek widths (R 512 + 64: both consumers'
# two V slices, 2 stages so the ring wraps), H 128 (two head chunks), fp8 (converted by the producer),
# R not a multiple of 256 / 128 (slices past R), rows whose last 16-byte chunk is partial (R + P = 131
# 16-bit, 72 fp8), block sizes 1 / 7 / 13 / 16 / 64 / 256.
MLA_WGMMA_CASES = {
    "bf16-R512-P64-H16-b64": (bf16, None, 512, 64, 16, 64, None),
    "bf16-R512-P64-H128-b64": (bf16, None, 512, 64, 128, 64, None),
    "f16-R512-P64-H64-b16-transposed": (f16, None, 512, 64, 64, 16, "transposed"),
    "e4m3-bf16-R512-P64-H16-b64": (bf16, "e4m3", 512, 64, 16, 64, None),
    "e5m2-f16-R64-P16-H4-b1": (f16, "e5m2", 64, 16, 4, 1, None),
    "e4m3-f16-R64-P8-H24-b13": (f16, "e4m3", 64, 8, 24, 13, None),
    "bf16-R128-P3-H20-b7": (bf16, None, 128, 3, 20, 7, None),
    "f16-R72-P8-H5-b256-fused": (f16, None, 72, 8, 5, 256, "fused"),
    "bf16-R384-P64-H3-b16": (bf16, None, 384, 64, 3, 16, None),
}


@pytest.mark.parametrize("splits", [None, 3], ids=["planned", "split3"])
@pytest.mark.parametrize("case", MLA_WGMMA_CASES.values(), ids=MLA_WGMMA_CASES.keys())
def test_mla_wgmma_decode(emu, mla_wgmma_schedule, case, splits, monkeypatch):
    """Decode over shuffled blocks: a sequence of 6 key tiles (the 2-stage ring wraps), an empty one (out 0,
    lse -inf), one key, a tile exactly full, one a key past it."""
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule, splits)
    dtype, fp8, r, p, h, b, strided = case
    mla, q, _ = make_mla_case("decode", [330, 0, 1, 64, 65], dtype, fp8, r, p, h, b, strided, seed=61)
    out, lse, plan = run_emu_mla_attention(emu, mla, q, None, (128 + p) ** -0.5, path=MLA_WGMMA)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    assert plan["heads_per_cta"] == min(h, 64) and plan["dp"] >= -(-r // 128) * 128, plan
    if splits:
        assert mla_wgmma_splits(plan) == 3, plan


@pytest.mark.parametrize("case", ["bf16-R512-P64-H16-b64", "f16-R64-P16-H8-b64", "bf16-R72-P8-H3-b64-strided"])
def test_mla_wgmma_tma_and_cp_async(emu, mla_wgmma_schedule, case, monkeypatch):
    """Block size 64: whole-page tiles load by TMA (64 x 64 boxes, 128B swizzle; R + P = 80: a box partly past
    the row, zero-filled), partial / masked tiles by the gathers; KVKERNELS_CUDA_NO_TMA=1 gathers every tile.
    Both against the reference and bit-identical to each other. "strided": rows of a wider allocation (the
    page stride is still 64 rows), which the map's row stride carries."""
    r, p, h = {"bf16-R512-P64-H16-b64": (512, 64, 16), "f16-R64-P16-H8-b64": (64, 16, 8),
               "bf16-R72-P8-H3-b64-strided": (72, 8, 3)}[case]
    dtype = f16 if case.startswith("f16") else bf16
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule)
    mla, q, _ = make_mla_case("decode", [330, 0, 64, 65, 128], dtype, None, r, p, h, 64, seed=68)
    if case.endswith("strided"):
        wide = torch.full((*mla.kv_cache.shape[:2], r + p + 16), float("nan"), dtype=dtype)
        wide[..., 8:8 + r + p] = mla.kv_cache
        mla.kv_cache = wide[..., 8:8 + r + p]
    results = []
    for no_tma in ("0", "1"):
        monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", no_tma)
        out, lse, _ = run_emu_mla_attention(emu, mla, q, None, 0.1, path=MLA_WGMMA)
        results.append((out, lse))
    assert_bytes_equal(results[0][0], results[1][0], "out")
    assert_bytes_equal(results[0][1], results[1][1], "lse")


def test_mla_wgmma_plan(emu, mla_wgmma_schedule, monkeypatch):
    """DeepSeek widths: 576-wide tiles, 2 stages of 72 KiB beside the 72-KiB query tile (226 KiB of the
    227 KiB opt-in limit); narrower rows get up to 4 stages; heads above 64 take head chunks."""
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule)
    mla, q, _ = make_mla_case("decode", [100, 3], bf16, None, 512, 64, 128, 64)
    plan = mla_plan_of(emu, mla, q, None)
    assert (plan["path"], plan["dp"], plan["stages"], plan["smem"]) == (MLA_WGMMA, 576, 2, 231520), plan
    assert plan["seesaw"] == mla_wgmma_schedule.startswith("wgmma-seesaw"), plan
    assert (plan["parts"] > 0) == mla_wgmma_schedule.endswith("+metadata"), plan
    assert (plan["heads_per_cta"], plan["grid_y"], plan["q_tile"]) == (64, 2, 1), plan
    mla, q, _ = make_mla_case("decode", [100, 3], bf16, None, 64, 16, 8, 16)
    plan = mla_plan_of(emu, mla, q, None)
    assert (plan["path"], plan["dp"], plan["stages"]) == (MLA_WGMMA, 128, 4), plan


@pytest.mark.parametrize("splits", [None, 128], ids=["planned", "128"])
@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_mla_wgmma_long_context(emu, mla_wgmma_schedule, fp8, splits, monkeypatch):
    """Thousands of keys over few sequences: the planner splits them (4 emulated SMs); 128 forced splits
    leave the short sequences' splits empty (lse -inf partials the merge skips)."""
    from helpers import make_paged_mla
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule, splits)
    mla = make_paged_mla([2100, 1, 700], 128, 16, 16, dtype=bf16, fp8=fp8, seed=62)
    q = make_query(3, 16, 144, bf16, generator(63))
    _, _, plan = run_emu_mla_attention(emu, mla, q, None, 144 ** -0.5, path=MLA_WGMMA)
    assert mla_wgmma_splits(plan) > 1, plan


def test_mla_wgmma_agrees_with_mma64(emu, mla_wgmma_schedule, monkeypatch):
    """The wgmma and the mma.sync 64-row kernels on the same inputs agree to the q dtype's tolerance."""
    from helpers import TOLERANCES
    mla, q, _ = make_mla_case("decode", [150, 64, 1, 129], bf16, None, 512, 64, 32, 64, seed=64)
    args = (q, mla.kv_cache, mla.block_tables, mla.seq_lens, 512, 0.07, None, mla.scale)
    force_cuda_plan(monkeypatch, "MLA", "mma64", None)
    out_m, lse_m = emu.mla_paged_attention(*args)
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule)
    out_w, lse_w = emu.mla_paged_attention(*args)
    rtol, atol = TOLERANCES[bf16]
    assert_close(out_w, out_m.double(), bf16, rtol=2 * rtol, atol=2 * atol, msg="out")
    assert_close(lse_w, lse_m.double(), f32, rtol=1e-4, atol=1e-4, msg="lse")


def test_mla_wgmma_out_variants(emu, mla_wgmma_schedule, monkeypatch):
    """out= + lse= and out= into a padded view: the bytes of the allocating call, nothing around the view."""
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule)
    mla, q, _ = make_mla_case("decode", [37, 0, 70], bf16, None, 512, 64, 16, 64)
    args, kw = (q, mla.kv_cache, mla.block_tables, mla.seq_lens), dict(kv_lora_rank=512, scale=0.1)
    assert mla_plan_of(emu, mla, q, None)["path"] == MLA_WGMMA
    want, want_lse = emu.mla_paged_attention(*args, **kw)
    out, lse = torch.full_like(want, float("nan")), torch.full_like(want_lse, 7.0)
    emu.mla_paged_attention_out(*args, **kw, out=out, lse=lse)
    assert_bytes_equal(out, want, "out")
    assert_bytes_equal(lse, want_lse, "lse")
    buf = torch.full((3, 16, 520), 3.0, dtype=bf16)
    emu.mla_paged_attention_out(*args, **kw, out=buf[..., 4:516])
    expect = torch.full_like(buf, 3.0)
    expect[..., 4:516] = want
    assert_bytes_equal(buf, expect, "padded out")


@pytest.mark.parametrize("splits", [None, 3], ids=["planned", "split3"])
def test_mla_wgmma_nonfinite(emu, mla_wgmma_schedule, splits, monkeypatch):
    """inf in a value column and NaN in a rope column of visible keys (their rows NaN, as the reference), NaN
    in cache slots past the sequences and in blocks no table names (never read), an inf kv_scale (fp8)."""
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule, splits)
    r, p, h, b = 64, 16, 16, 16
    seq_lens = [70, 5, 200]
    mla, q, _ = make_mla_case("decode", seq_lens, bf16, None, r, p, h, b, seed=65)
    slots = lambda i, pos: int(__import__("helpers").token_slots(mla.blocks[i], seq_lens[i], b)[pos])  # noqa: E731
    s = slots(0, 45)
    mla.kv_cache[s // b, s % b, 7] = float("inf")
    s = slots(2, 150)
    mla.kv_cache[s // b, s % b, r + 3] = float("nan")
    out, lse, _ = run_emu_mla_attention(emu, mla, q, None, 0.1, path=MLA_WGMMA)
    assert out[1].isfinite().all() and not out[0].isfinite().all() and lse[2].isnan().all()
    mla, q, _ = make_mla_case("decode", seq_lens, bf16, "e4m3", r, p, h, b, seed=66)
    mla.scale[0] = float("inf")
    out, _, _ = run_emu_mla_attention(emu, mla, q, None, 0.1, path=MLA_WGMMA)
    assert out.isnan().all()


def test_mla_wgmma_out_of_range_block_ids_read_nothing(emu, mla_wgmma_schedule, monkeypatch):
    """Block ids past the cache or negative, between NaN blocks: zero rows, nothing read."""
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule)
    b, seq_lens = 16, [3 * 16 + 5, 2 * 16, 16 + 1]
    mla, q, _ = make_mla_case("decode", seq_lens, bf16, None, 64, 16, 8, b)
    n = mla.kv_cache.shape[0]
    cache = between_nan_blocks(mla.kv_cache)
    table, ref_table = out_of_range_ids(mla.block_tables, [(0, 1), (1, 0), (0, 3), (2, 1)], n)
    assert mla_plan_of(emu, dataclasses.replace(mla, kv_cache=cache, block_tables=table), q, None)["path"] == MLA_WGMMA
    out, lse = emu.mla_paged_attention(q, cache, table, mla.seq_lens, 64, 80 ** -0.5, None, None)
    ref_cache = torch.cat([cache, torch.zeros(1, *cache.shape[1:], dtype=cache.dtype)])
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), upcast(ref_cache), ref_table, mla.seq_lens,
                                                     kv_lora_rank=64, scale=80 ** -0.5)
    assert out.isfinite().all()
    assert_close(out, ref_out, bf16, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f16, "e4m3")], ids=["bf16", "e4m3"])
def test_mla_wgmma_unaligned_cache_rows(emu, mla_wgmma_schedule, dtype, fp8, monkeypatch):
    """Latent rows not 16-byte aligned (a [..., 2:2+W] slice of wider rows, NaN around it): the producer's
    register path with element loads instead of cp.async."""
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule)
    mla, q, qsl = make_mla_case("decode", [140, 9, 0, 16], dtype, fp8, 64, 16, 8, 16, seed=29)
    mla.kv_cache = unaligned_copy(mla.kv_cache)
    run_emu_mla_attention(emu, mla, q, qsl, 0.1, path=MLA_WGMMA)


@pytest.mark.parametrize("why", ["float32", "smem"])
def test_mla_wgmma_fallbacks(emu, mla_wgmma_schedule, why, monkeypatch):
    """Where the wgmma decode cannot run, the planner takes the mma.sync / SIMT kernels (results still
    right) and KVKERNELS_CUDA_WGMMA=require fails naming the reason."""
    dtype = f32 if why == "float32" else bf16
    mode = "varlen" if why == "float32" else "decode"  # (float32: a varlen prefill falls back too)
    mla, q, qsl = make_mla_case(mode, [40, 9, 0, 16], dtype, None, 64, 16, 8, 16, q_lens=[3, 2, 0, 1], seed=67)
    if why == "smem":
        monkeypatch.setenv("KVKERNELS_EMU_SMEM_OPTIN", str(99 * 1024))
        mla, q, qsl = make_mla_case(mode, [40, 9], dtype, None, 512, 64, 8, 16, seed=67)
    reason = {"float32": "float32 queries", "smem": "less opt-in shared memory"}[why]
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule, require=True)
    with pytest.raises(RuntimeError, match=f"KVKERNELS_CUDA_WGMMA=require: the wgmma MLA decode cannot run this call: .*{reason}"):
        emu.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, mla.kv_lora_rank, 0.1, qsl, None)
    use_mla_wgmma(monkeypatch, mla_wgmma_schedule, require=False)
    _, _, plan = run_emu_mla_attention(emu, mla, q, qsl, 0.1)
    assert plan["path"] != MLA_WGMMA, plan


# ---------------------------------------------------------------------------------------------------
# The wgmma MLA decode's split plan from a metadata pass (csrc/cuda/mla_sched.cuh; KVKERNELS_CUDA_MLA_SCHED=metadata,
# opt-in): a one-warp kernel divides the batch's key tiles among `parts` CTAs per head chunk, a CTA walks its range
# across sequence boundaries, split sequences get one partial per piece and the merge combines only them. The
# decode and the merge are launched with programmatic dependent launch (the emulated device is an sm_90).
# Every test_mla_wgmma_* above also runs under it (mla_wgmma_schedule "+metadata").
# ---------------------------------------------------------------------------------------------------

SCHED_FIXED_COST = 2  # kSchedFixedCost: a CTA's fixed work, in 64-key tiles
SCHED_CTA_INTS = 8    # kSchedCtaInts


def sched_pieces(seq_lens, parts):
    """The pass's division from its definition (mla_sched.cuh, top of file): item i of sequence s (its 64-key tiles, at
    least one) at unit start(s) + 2 + i, owned by CTA unit // ceil(total / parts). Per CTA its pieces (seq, first
    item, end item)."""
    items = [max(-(-int(n) // 64), 1) for n in seq_lens]
    starts, total = [], 0
    for n in items:
        starts.append(total)
        total += SCHED_FIXED_COST + n
    share = max(1, -(-total // parts))
    ctas = [[] for _ in range(parts)]
    for s, n in enumerate(items):
        for i in range(n):
            pieces = ctas[(starts[s] + SCHED_FIXED_COST + i) // share]
            if pieces and pieces[-1][0] == s:
                pieces[-1][2] = i + 1
            else:
                pieces.append([s, i, i + 1])
    return [[tuple(p) for p in c] for c in ctas]


def read_schedule(meta, num_seqs, parts):
    """emu.mla_schedule's int32 output: per CTA its pieces (walked from its [begin, end) range as the decode walks it)
    and its first piece's number; per sequence items, pieces, first partial."""
    meta = meta.tolist()
    items, _, pieces, part_off = (meta[parts * SCHED_CTA_INTS + k * num_seqs:][:num_seqs] for k in range(4))
    ctas, first_piece = [], []
    for c in range(parts):
        bs, bi, es, ei, fp = meta[c * SCHED_CTA_INTS:][:5]
        walked, s, i = [], bs, bi
        while (s, i) < (es, ei):
            walked.append((s, i, ei if s == es else items[s]))
            s, i = s + 1, 0
        ctas.append(walked)
        first_piece.append(fp)
    return ctas, first_piece, items, pieces, part_off


MIXED_LENS = [4000, 1, 0, 1, 64, 0, 130, 1, 65, 0, 700]  # a 32k-ish sequence among short and empty ones, scaled down


@pytest.mark.parametrize("seq_lens,parts", [
    (MIXED_LENS, 4), (MIXED_LENS, 3), (MIXED_LENS, 9), ([1, 0, 64, 65], 16), ([0, 0, 0], 3), ([300], 1),
    ([4096] * 64, 132)], ids=["mixed-4", "mixed-3", "mixed-9", "more-ctas-than-work", "all-empty", "one-cta",
                              "b64x4k-132"])
def test_mla_schedule_pass(emu, seq_lens, parts):
    """The metadata pass alone: every CTA's range is the division of its definition (equal shares of the units,
    walked across sequence boundaries), each sequence's piece count is the number of CTAs holding it, a CTA's first
    piece is numbered by the CTAs before it, and the split sequences' partials are disjoint rows below 2 x parts."""
    mla, q, _ = make_mla_case("decode", seq_lens, bf16, None, 64, 16, 16, 16, seed=70)
    meta = emu.mla_schedule(q, mla.kv_cache, mla.block_tables, mla.seq_lens, 64, parts)
    ctas, first_piece, items, pieces, part_off = read_schedule(meta, len(seq_lens), parts)
    want = sched_pieces(seq_lens, parts)
    assert ctas == want
    assert items == [max(-(-n // 64), 1) for n in seq_lens]
    holders = [[c for c in range(parts) if any(p[0] == s for p in ctas[c])] for s in range(len(seq_lens))]
    assert pieces == [len(h) for h in holders]
    for c in range(parts):
        if ctas[c]:
            assert first_piece[c] == holders[ctas[c][0][0]].index(c)
    rows = [r for s in range(len(seq_lens)) if pieces[s] > 1 for r in range(part_off[s], part_off[s] + pieces[s])]
    assert len(rows) == len(set(rows)) and all(0 <= r < 2 * parts for r in rows)
    if seq_lens == MIXED_LENS and parts in (4, 9):  # what test_mla_wgmma_metadata_mixed_lengths relies on
        assert max(pieces) >= 3 and any(sum(1 for p in c if pieces[p[0]] == 1) >= 2 for c in ctas)


@pytest.fixture(params=["wgmma+metadata", "wgmma-seesaw+metadata"])
def mla_metadata_schedule(request):
    return request.param


@pytest.mark.parametrize("parts", [None, 3, 9], ids=["planned", "parts3", "parts9"])
@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_mla_wgmma_metadata_mixed_lengths(emu, mla_metadata_schedule, fp8, parts, monkeypatch):
    """A long sequence among one-key and empty ones (shuffled block ids): the long one split over 3+ CTAs (one
    partial per piece, merged), short ones sharing a CTA (written straight to out), empty ones out 0 / lse -inf;
    the planned count (4 emulated SMs, one head chunk: 4 CTAs), 3, and 9 (pieces of one or two tiles)."""
    use_mla_wgmma(monkeypatch, mla_metadata_schedule, parts)
    mla, q, _ = make_mla_case("decode", MIXED_LENS, bf16, fp8, 64, 16, 16, 16, seed=71)
    out, lse, plan = run_emu_mla_attention(emu, mla, q, None, 0.1, path=MLA_WGMMA)
    assert plan["parts"] == (parts or 4) and plan["grid_x"] == plan["parts"] and plan["splits"] == 1, plan
    for s in (2, 5, 9):
        assert torch.equal(out[s], torch.zeros_like(out[s])) and torch.isneginf(lse[s]).all()


def test_mla_wgmma_metadata_head_chunks(emu, mla_metadata_schedule, monkeypatch):
    """128 heads (two head chunks, a grid dimension): the 4 emulated SMs give 2 CTAs per chunk, both chunks walking the
    same ranges; DeepSeek widths, fp8 latents."""
    use_mla_wgmma(monkeypatch, mla_metadata_schedule)
    mla, q, _ = make_mla_case("decode", [700, 0, 1, 65], bf16, "e4m3", 512, 64, 128, 64, seed=73)
    _, _, plan = run_emu_mla_attention(emu, mla, q, None, 0.05, path=MLA_WGMMA)
    assert (plan["parts"], plan["grid_x"], plan["grid_y"]) == (2, 2, 2), plan


def test_mla_wgmma_metadata_plan_from_shapes(emu, monkeypatch):
    """The metadata plan (grid, workspace) comes from shapes only, as the shape-only plan does (capturable: other
    seq_lens of the same shapes give the same launch); KVKERNELS_CUDA_MLA_SCHED=shape is the default; other values
    fail naming the variable."""
    use_mla_wgmma(monkeypatch, "wgmma+metadata")
    mla, q, _ = make_mla_case("decode", [300, 0, 64, 5], bf16, None, 64, 16, 8, 16, seed=72)
    plan = mla_plan_of(emu, mla, q, None)
    assert (plan["parts"], plan["grid_x"], plan["splits"], plan["pdl"]) == (4, 4, 1, 1), plan
    other = dataclasses.replace(mla, seq_lens=torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    assert mla_plan_of(emu, other, q, None) == plan
    monkeypatch.setenv("KVKERNELS_CUDA_MLA_SCHED", "shape")
    assert mla_plan_of(emu, mla, q, None)["parts"] == 0
    monkeypatch.setenv("KVKERNELS_CUDA_MLA_SCHED", "balanced")
    with pytest.raises(RuntimeError, match="KVKERNELS_CUDA_MLA_SCHED must be shape or metadata"):
        mla_plan_of(emu, mla, q, None)


def test_mla_wgmma_metadata_pdl(emu, monkeypatch):
    """On the (emulated) sm_90 device the decode and the merge are launched with programmatic dependent launch (the
    emulator reports a read of the pass's / the decode's output before griddepcontrol.wait); KVKERNELS_CUDA_NO_PDL=1
    launches them plainly, with the same bytes."""
    use_mla_wgmma(monkeypatch, "wgmma+metadata", 3)
    mla, q, _ = make_mla_case("decode", [300, 0, 64, 5], bf16, None, 64, 16, 8, 16, seed=72)
    args = (q, mla.kv_cache, mla.block_tables, mla.seq_lens, 64, 0.1, None, None)
    n0, t0 = emu.pdl_counts(q)
    out, lse = emu.mla_paged_attention(*args)
    n1, t1 = emu.pdl_counts(q)
    assert n1 - n0 == 2 and t1 > t0  # decode + merge; the pass and the decode's producers trigger
    monkeypatch.setenv("KVKERNELS_CUDA_NO_PDL", "1")
    assert mla_plan_of(emu, mla, q, None)["pdl"] == 0
    out2, lse2 = emu.mla_paged_attention(*args)
    assert emu.pdl_counts(q)[0] == n1
    assert_bytes_equal(out2, out, "out")
    assert_bytes_equal(lse2, lse, "lse")
