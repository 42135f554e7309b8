"""The CUDA paged_attention kernels (csrc/cuda/attention*) against the float64 reference.

Every attention case of test_attention.py (all CONFIGS and FEATURE_CONFIGS, decode and varlen, long
contexts, empty sequences, partial blocks, shuffled block ids with junk past each sequence, GQA ratios,
window edges) runs here on CUDA tensors, on the kernel the planner picks ("auto": tensor cores for fp16 /
bf16 queries, CUDA cores for float32) and on the generic CUDA-core kernel for every dtype
(KVKERNELS_CUDA_ATTN_PATH=simt) and on the tensor-core kernels' deep configurations
(KVKERNELS_CUDA_ATTN_PATH=mma-decode-deep,mma-prefill-deep, kept for A/B runs), without and with forced KV splits (KVKERNELS_CUDA_ATTN_SPLITS, which
exercises the split-K partials and the merge kernel even on small cases). Then: head dims and block sizes
off the fast paths, unaligned cache views (the plain-load fallback), opcheck on CUDA, bad input on CUDA,
debug-mode index checks, a non-default stream, and a CUDA-graph capture of a decode step replayed with
new seq_lens / block table contents.

Caches keep their layout on the device (the whole storage is copied and the same strided view taken), so
NaN in unused slots and the NHD / HND / stacked strides reach the kernel exactly as on the CPU. The outputs
are new tensors the op allocates: before each call the CUDA caching allocator is handed NaN-filled blocks
(best effort: the op's allocations usually reuse them), and the comparison requires NaN, +inf and -inf at
the reference's positions only, so an output row the kernel never wrote shows up as a mismatch.

Every test skips, with the reason, without a CUDA device or without the CUDA kernel in the build.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (TOLERANCES, assert_close, cuda_only, force_cuda_plan, generator, make_paged_kv, make_query,
                     query_start_loc, randn, unaligned_copy, upcast)
from kvkernels import ops, reference
from test_attention import CONFIGS, FEATURE_CONFIGS, FEATURE_NAMES, LONG_CONFIGS, features, make_case

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


pytestmark = cuda_only("paged_attention")

DEV = "cuda"
# (path, splits): the planner's choice (tensor-core decode and prefill in their wide configurations for fp16 /
# bf16), the tensor-core decode and prefill in their deep configurations
# (KVKERNELS_CUDA_ATTN_PATH=mma-decode-deep,mma-prefill-deep: kept for A/B runs; float32 cases run as in
# "auto"), the CUDA-core kernel, and each with 5 forced KV splits.
DEEP = "mma-decode-deep,mma-prefill-deep"
PATHS = {"auto": (None, None), "deep": (DEEP, None), "simt": ("simt", None),
         "auto-split5": (None, 5), "deep-split5": (DEEP, 5), "simt-split5": ("simt", 5)}


@pytest.fixture(params=list(PATHS), ids=list(PATHS))
def path(request, monkeypatch):
    kind, splits = PATHS[request.param]
    force_cuda_plan(monkeypatch, "ATTN", kind, splits)
    return request.param


# ----------------------------------------------------------------------------------------------------
# moving cases to the device
# ----------------------------------------------------------------------------------------------------


def like_on(t: torch.Tensor | None, device=DEV) -> torch.Tensor | None:
    """``t`` on ``device`` with the same sizes, strides and storage offset: the whole storage is copied
    (poison in unused slots included) and the same view taken."""
    if t is None:
        return None
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))
    return flat.to(device).as_strided(t.size(), t.stride(), t.storage_offset())


def opt_on(x, device=DEV):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def poison_allocator(nbytes: int) -> None:
    """Hand the caching allocator NaN-filled blocks of about ``nbytes`` (and small ones) so that the op's
    freshly allocated outputs most likely start as NaN instead of zeros or stale results."""
    blocks = [torch.full((max(nbytes, 1 << 20) // 4,), float("nan"), device=DEV)]
    blocks += [torch.full((n,), float("nan"), device=DEV) for n in (64, 512, 4096, 32768, 131072)]
    del blocks


def run_cuda(kv, query, qsl=None, **kwargs):
    """The CUDA kernel vs the float64 reference (on the CPU copies); returns (out, lse) on the CPU."""
    q = like_on(query)
    k, v = like_on(kv.key_cache), like_on(kv.value_cache)
    bt, sl = kv.block_tables.to(DEV), kv.seq_lens.to(DEV)
    qsl_d = qsl.to(DEV) if qsl is not None else None
    kw = {name: opt_on(x) for name, x in {**kwargs, **kv.scales}.items()}
    t, hq, _ = query.shape
    d = kv.value_cache.shape[-1]  # out has the value's head dim
    poison_allocator(8 * t * hq * d * 4)
    out, lse = ops.paged_attention(q, k, v, bt, sl, qsl_d, **kw)
    torch.cuda.synchronize()
    assert out.device.type == DEV and lse.device.type == DEV
    assert out.dtype == query.dtype and out.shape == (t, hq, d) and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (t, hq) and lse.is_contiguous()
    kr, vr = kv.ref_caches()
    ref_out, ref_lse = reference.paged_attention(upcast(query), kr, vr, kv.block_tables, kv.seq_lens, qsl,
                                                 **kwargs, **kv.scales)
    out, lse = out.cpu(), lse.cpu()
    assert_close(out, ref_out, query.dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    return out, lse


# ----------------------------------------------------------------------------------------------------
# the cases of test_attention.py
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_paged_attention(config, mode, path):
    dtype, fp8, per_head, layout, hq, hkv, d, b, strided = config
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, strided=strided)
    out, lse = run_cuda(kv, query, qsl)
    if mode == "decode":
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("feature", FEATURE_NAMES)
@pytest.mark.parametrize("config", FEATURE_CONFIGS.values(), ids=FEATURE_CONFIGS.keys())
def test_paged_attention_features(config, feature, mode, path):
    dtype, fp8, per_head, layout, hkv, d, b = config
    seq_lens = [2 * b, 2 * b + 1, 3 * b - 1, 1, 0, b, 40]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=8, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, seed=3)
    kwargs = features(b, d)[feature]
    out, lse = run_cuda(kv, query, qsl, **kwargs)
    if mode == "decode":
        assert torch.equal(out[4], torch.zeros_like(out[4]))
        sinks = kwargs.get("sinks")
        expected = sinks if sinks is not None else torch.full((8,), float("-inf"))
        assert_close(lse[4], expected, f32, msg="lse of the empty sequence")


@pytest.mark.parametrize("splits", [None, 1, 16, 128], ids=["planned", "1", "16", "128"])
@pytest.mark.parametrize("opts", [{}, dict(window_left=1500, sinks=torch.linspace(-1, 1, 8))],
                         ids=["plain", "window-sinks"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", LONG_CONFIGS.values(), ids=LONG_CONFIGS.keys())
def test_long_context(config, mode, opts, splits, monkeypatch):
    """Thousands of keys over few sequences: the planner splits them (4 x 2 work items leave any GPU
    idle); the forced counts cover no split, many, and more splits than some sequences have tiles."""
    if splits:
        monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", str(splits))
    dtype, fp8, layout, b = config
    seq_lens = [4100, 1, 2049, 700]
    kv, query, qsl = make_case("decode", seq_lens, dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=128,
                               block_size=b, layout=layout, fp8=fp8, per_head=True, seed=41)
    if mode == "varlen":
        q_lens = [min(n, 40) for n in seq_lens]
        qsl = query_start_loc(q_lens)
        query = make_query(sum(q_lens), 8, 128, dtype, generator(42))
    run_cuda(kv, query, qsl, **opts)


@pytest.mark.parametrize("window_left", [0, 4, 15, 16])
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_window_against_dense(window_left, dtype):
    b, d, seq_len, q_len = 16, 16, 50, 20
    kv = make_paged_kv(seq_lens=[seq_len], num_kv_heads=1, head_dim=d, block_size=b, seed=11, dtype=dtype)
    query = make_query(q_len, 2, d, dtype, generator(12))
    out, lse = ops.paged_attention(like_on(query), like_on(kv.key_cache), like_on(kv.value_cache),
                                   kv.block_tables.to(DEV), kv.seq_lens.to(DEV),
                                   query_start_loc([q_len]).to(DEV), window_left=window_left)
    out, lse = out.cpu(), lse.cpu()
    k, v = kv.keys[0][:, 0], kv.values[0][:, 0]
    for i in range(q_len):
        pos = seq_len - q_len + i
        lo = max(pos - window_left, 0)
        s = query[i].double() @ k[lo:pos + 1].T * d ** -0.5
        assert_close(lse[i], torch.logsumexp(s, dim=-1), f32, msg=f"lse of query {i}")
        assert_close(out[i], torch.softmax(s, dim=-1) @ v[lo:pos + 1], dtype, msg=f"out of query {i}")


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_empty_sequences(mode, sinks, dtype, path):
    seq_lens = [0, 5, 0, 33]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=16, seed=5)
    sink = randn(4, gen=generator(6)) if sinks else None
    out, lse = run_cuda(kv, query, qsl, sinks=sink)
    if mode == "decode":
        no_key = sink if sinks else torch.full((4,), float("-inf"))
        for row in (0, 2):
            assert torch.equal(out[row], torch.zeros(4, 16, dtype=dtype))
            assert_close(lse[row], no_key, f32, msg="lse of an empty sequence")
    # An empty batch, and a varlen batch whose sequences have no queries: nothing to launch.
    table = torch.zeros(0, 3, dtype=torch.int32, device=DEV)
    lens = torch.zeros(0, dtype=torch.int32, device=DEV)
    q0 = torch.randn(0, 4, 16, device=DEV).to(dtype)
    qsl0 = None if mode == "decode" else torch.zeros(1, dtype=torch.int32, device=DEV)
    out, lse = ops.paged_attention(q0, like_on(kv.key_cache), like_on(kv.value_cache), table, lens, qsl0,
                                   sinks=opt_on(sink))
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


# ----------------------------------------------------------------------------------------------------
# beyond test_attention.py: generic head dims / block sizes, GQA extremes, alignment, path agreement
# ----------------------------------------------------------------------------------------------------

# (dtype, fp8, head_dim, block_size): every padded head dim (64 / 128 / 256) hit exactly and off its
# fast path, block sizes 1..256 including non-powers of two.
GENERIC = [
    (bf16, None, 8, 5), (f16, None, 40, 7), (bf16, None, 72, 32), (f32, None, 96, 13), (f16, None, 136, 16),
    (bf16, None, 192, 24), (bf16, None, 256, 16), (f32, None, 256, 2), (f16, "e4m3", 256, 32),
    (bf16, "e5m2", 120, 64), (bf16, "e4m3", 24, 256), (f32, "e4m3", 200, 9), (bf16, None, 128, 128),
]


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype,fp8,d,b", GENERIC, ids=[f"{str(t)[6:]}-{f}-d{d}-b{b}" for t, f, d, b in GENERIC])
def test_generic_head_dims_and_block_sizes(dtype, fp8, d, b, mode, path):
    seq_lens = [3 * b + 5, 1, 2 * b, 77]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=4, num_kv_heads=2, head_dim=d,
                               block_size=b, fp8=fp8, per_head=True, seed=17)
    run_cuda(kv, query, qsl, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]), soft_cap=3.0)


# (num_heads, num_kv_heads): MHA, GQA 2..16, the decode group limit of the tensor-core decode kernel (16),
# groups above it (prefill kernel for decode), above the 64 rows of a prefill CTA (head chunks), MQA.
GQA = [(4, 4), (8, 4), (12, 3), (32, 8), (32, 2), (48, 2), (40, 1), (64, 1), (96, 1), (128, 2)]


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("hq,hkv", GQA, ids=[f"{a}-{b}" for a, b in GQA])
def test_gqa_ratios(hq, hkv, dtype, mode, path):
    seq_lens = [70, 17, 1, 33]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=64,
                               block_size=16, seed=23)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / hq) for h in range(hq)], dtype=f32)
    run_cuda(kv, query, qsl, alibi_slopes=slopes, window_left=30)


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype,fp8", [(f32, None), (bf16, None), (f16, "e4m3")], ids=["f32", "bf16", "e4m3"])
def test_unaligned_cache_rows(dtype, fp8, mode, path):
    """Caches whose rows are not 16-byte aligned (a [..., 2:2+D] slice of wider rows, NaN around it) take the plain-load
    fallback instead of cp.async; the query is a strided slice too."""
    d, b = 64, 16
    kv, query, qsl = make_case(mode, [40, 9, 0, 16], dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=d,
                               block_size=b, fp8=fp8, strided="fused", seed=29)
    for name in ("key_cache", "value_cache"):
        setattr(kv, name, unaligned_copy(getattr(kv, name)))
    run_cuda(kv, query, qsl)


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f16, None), (bf16, "e4m3"), (f16, "e5m2")])
def test_tensor_core_and_simt_agree(dtype, fp8, mode, monkeypatch):
    """The tensor-core and CUDA-core kernels on the same inputs agree to the query dtype's tolerance."""
    kv, query, qsl = make_case(mode, [300, 64, 1, 129], dtype=dtype, num_heads=16, num_kv_heads=4,
                               head_dim=128, block_size=16, fp8=fp8, per_head=True, seed=37)
    args = (like_on(query), like_on(kv.key_cache), like_on(kv.value_cache), kv.block_tables.to(DEV),
            kv.seq_lens.to(DEV), opt_on(qsl))
    kw = {k: opt_on(v) for k, v in dict(soft_cap=5.0, **kv.scales).items()}
    monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PATH", raising=False)
    out_tc, lse_tc = ops.paged_attention(*args, **kw)
    monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", "simt")
    out_s, lse_s = ops.paged_attention(*args, **kw)
    rtol, atol = TOLERANCES[dtype]
    assert_close(out_tc.cpu(), out_s.cpu().double(), dtype, rtol=2 * rtol, atol=2 * atol, msg="out")
    assert_close(lse_tc.cpu(), lse_s.cpu().double(), f32, rtol=1e-4, atol=1e-4, msg="lse")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f16, "e4m3"), (bf16, "e5m2")])
def test_decode_variants_agree(dtype, fp8, d, monkeypatch):
    """The tensor-core decode kernel's wide (default) and deep (KVKERNELS_CUDA_ATTN_PATH=mma-decode-deep)
    configurations on the same inputs, sequences of many key tiles (the deep pipeline's ring wraps), planned
    and with 7 forced splits: each matches the reference, and they agree to the query dtype's tolerance
    (their key slices differ, so their float32 sums round differently). Over fp8 caches also the wide kernel
    with its stages dequantized in shared memory (mma-decode-fp8-smem) against the default, which converts
    fragments in registers at head dims 64 / 128: the same products in another order. And the opt-in occ3,
    fused and persistent decode variants against the wide one (the persistent one at head dims 64 / 128; the
    wide one at 256)."""
    kv, query, _ = make_case("decode", [1500, 64, 1, 333, 0], dtype=dtype, num_heads=16, num_kv_heads=4,
                             head_dim=d, block_size=16, fp8=fp8, per_head=True, seed=38)
    rtol, atol = TOLERANCES[dtype]
    for splits in (None, 7):
        force_cuda_plan(monkeypatch, "ATTN", None, splits)
        wide = run_cuda(kv, query, soft_cap=5.0)
        force_cuda_plan(monkeypatch, "ATTN", "mma-decode-deep", splits)
        deep = run_cuda(kv, query, soft_cap=5.0)
        assert_close(deep[0], wide[0].double(), dtype, rtol=2 * rtol, atol=2 * atol, msg="out")
        assert_close(deep[1], wide[1].double(), f32, rtol=1e-4, atol=1e-4, msg="lse")
        # The opt-in variants of csrc/cuda/README.md "Decode at the bandwidth limit": occ3 (3 CTAs per SM, its
        # own split count), fused (split merge in the last CTA of each work item, arrival counters) and persistent
        # (a grid of the resident slots walking (item, split) units, the fused merge), also with 5 CTAs (each
        # walks several items; with 7 splits, ranges that start and end inside items).
        for variant in ("mma-decode-occ3", "mma-decode-fused", "mma-decode-persistent", "persistent-5"):
            monkeypatch.delenv("KVKERNELS_CUDA_ATTN_PERSISTENT_CTAS", raising=False)
            if variant == "persistent-5":
                variant = "mma-decode-persistent"
                monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PERSISTENT_CTAS", "5")
            force_cuda_plan(monkeypatch, "ATTN", variant, splits)
            other = run_cuda(kv, query, soft_cap=5.0)
            assert_close(other[0], wide[0].double(), dtype, rtol=2 * rtol, atol=2 * atol, msg=f"out ({variant})")
            assert_close(other[1], wide[1].double(), f32, rtol=1e-4, atol=1e-4, msg=f"lse ({variant})")
        if fp8:
            force_cuda_plan(monkeypatch, "ATTN", "mma-decode-fp8-smem", splits)
            smem = run_cuda(kv, query, soft_cap=5.0)
            assert_close(smem[0], wide[0].double(), dtype, rtol=2 * rtol, atol=2 * atol, msg="out (fp8-smem)")
            assert_close(smem[1], wide[1].double(), f32, rtol=1e-4, atol=1e-4, msg="lse (fp8-smem)")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f16, "e4m3"), (bf16, "e5m2")])
def test_prefill_variants_agree(dtype, fp8, d, monkeypatch):
    """The tensor-core prefill kernel's wide (default) and deep (KVKERNELS_CUDA_ATTN_PATH=mma-prefill-deep)
    configurations on the same inputs: full and chunked prefill of sequences of many key tiles (the deep
    pipeline's ring wraps, causal diagonal tiles of both key-tile sizes), a sliding window and a soft cap,
    planned and with 3 forced splits: each matches the reference, and they agree to the query dtype's
    tolerance (their key tiles differ, so their online-softmax rescalings round differently). The same for the
    tall configuration (KVKERNELS_CUDA_ATTN_PATH=mma-prefill-tall: 2 row tiles per warp, 32 keys per stage;
    the wide kernel at head dim 256)."""
    # A CTA of the 300-key sequence sees up to ~216 keys inside the window (201 per row): 4-5 key tiles of 64,
    # 7-8 of 32, 14-15 of 16, so every 4-stage ring wraps; small enough that each float64 reference on the
    # CPU takes well under a second.
    kv, query, qsl = make_case("varlen", [300, 150, 64, 1, 0], dtype=dtype, num_heads=16, num_kv_heads=4,
                               head_dim=d, block_size=16, fp8=fp8, per_head=True, seed=40)
    rtol, atol = TOLERANCES[dtype]
    for splits in (None, 3):
        force_cuda_plan(monkeypatch, "ATTN", None, splits)
        wide = run_cuda(kv, query, qsl, soft_cap=5.0, window_left=200)
        force_cuda_plan(monkeypatch, "ATTN", "mma-prefill-deep", splits)
        deep = run_cuda(kv, query, qsl, soft_cap=5.0, window_left=200)
        assert_close(deep[0], wide[0].double(), dtype, rtol=2 * rtol, atol=2 * atol, msg="out")
        assert_close(deep[1], wide[1].double(), f32, rtol=1e-4, atol=1e-4, msg="lse")
        force_cuda_plan(monkeypatch, "ATTN", "mma-prefill-tall", splits)
        tall = run_cuda(kv, query, qsl, soft_cap=5.0, window_left=200)
        assert_close(tall[0], wide[0].double(), dtype, rtol=2 * rtol, atol=2 * atol, msg="out (tall)")
        assert_close(tall[1], wide[1].double(), f32, rtol=1e-4, atol=1e-4, msg="lse (tall)")


def require_sm90a():
    """The wgmma prefill runs on compute capability 9.0 with the sm_90a build only."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the wgmma prefill needs an sm_90 device, this is sm_{''.join(map(str, torch.cuda.get_device_capability()))}")


# Each wgmma test runs the kernel's plain loop (wgmma-prefill), its intra-warpgroup overlapped loop
# (wgmma-prefill-overlap; the plain loop at padded head dim 256) and its persistent form (wgmma-prefill-persistent:
# min(work items, SMs) CTAs walking the items, on the overlapped loop, the plain one at 256).
@pytest.fixture(params=["wgmma-prefill", "wgmma-prefill-overlap", "wgmma-prefill-persistent"],
                ids=["plain", "overlap", "persistent"])
def wgmma_variant(request):
    return request.param


def use_wgmma(monkeypatch, variant, splits=None):
    """KVKERNELS_CUDA_ATTN_PATH=variant with KVKERNELS_CUDA_WGMMA=require: a call the kernel does not take fails,
    naming why (a build without 9.0a in TORCH_CUDA_ARCH_LIST, an unexpected fallback)."""
    force_cuda_plan(monkeypatch, "ATTN", variant, splits)
    monkeypatch.setenv("KVKERNELS_CUDA_WGMMA", "require")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [bf16, f16])
def test_wgmma_prefill_matches_reference_and_wide(dtype, d, wgmma_variant, monkeypatch):
    """The Hopper wgmma prefill (csrc/cuda/attention_sm90.cuh) against the reference and the wide mma.sync
    prefill on the same inputs: full and chunked prefill of sequences of many 128-key tiles (the stage ring
    wraps: 2 stages at head dim 128, 4 at 64; causal diagonal tiles; a 1000-key sequence), GQA 4, plain /
    window + soft cap / ALiBi + sinks non-causal, planned and 3 forced splits."""
    require_sm90a()
    kv, query, qsl = make_case("varlen", [300, 150, 64, 1, 0, 1000], dtype=dtype, num_heads=16, num_kv_heads=4,
                               head_dim=d, block_size=16, seed=44)
    rtol, atol = TOLERANCES[dtype]
    slopes, sinks = torch.linspace(-0.2, 0.3, 16), torch.linspace(-1.0, 1.0, 16)
    for splits in (None, 3):
        for opts in ({}, dict(soft_cap=5.0, window_left=200), dict(alibi_slopes=slopes, sinks=sinks, causal=False)):
            force_cuda_plan(monkeypatch, "ATTN", None, splits)
            monkeypatch.delenv("KVKERNELS_CUDA_WGMMA", raising=False)
            wide = run_cuda(kv, query, qsl, **opts)
            use_wgmma(monkeypatch, wgmma_variant, splits)
            wg = run_cuda(kv, query, qsl, **opts)
            assert_close(wg[0], wide[0].double(), dtype, rtol=2 * rtol, atol=2 * atol, msg=f"out {opts}")
            assert_close(wg[1], wide[1].double(), f32, rtol=1e-4, atol=1e-4, msg=f"lse {opts}")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fp8,dtype", [("e4m3", bf16), ("e5m2", f16)], ids=["e4m3-bf16", "e5m2-f16"])
def test_wgmma_prefill_fp8_caches(fp8, dtype, d, wgmma_variant, monkeypatch):
    """The wgmma prefill over fp8 caches (the producer dequantizes each raw tile into the 16-bit stages; k_scale on
    the logits, v_scale on the output), per-head scales: against the reference and the wide mma.sync prefill over
    the same cache, plain and with window + soft cap, planned and 3 forced splits."""
    require_sm90a()
    kv, query, qsl = make_case("varlen", [300, 150, 64, 1, 0, 1000], dtype=dtype, num_heads=16, num_kv_heads=4,
                               head_dim=d, block_size=16, fp8=fp8, per_head=True, seed=48)
    rtol, atol = TOLERANCES[dtype]
    for splits in (None, 3):
        for opts in ({}, dict(soft_cap=5.0, window_left=200)):
            force_cuda_plan(monkeypatch, "ATTN", None, splits)
            monkeypatch.delenv("KVKERNELS_CUDA_WGMMA", raising=False)
            wide = run_cuda(kv, query, qsl, **opts)
            use_wgmma(monkeypatch, wgmma_variant, splits)
            wg = run_cuda(kv, query, qsl, **opts)
            assert_close(wg[0], wide[0].double(), dtype, rtol=2 * rtol, atol=2 * atol, msg=f"out {opts}")
            assert_close(wg[1], wide[1].double(), f32, rtol=1e-4, atol=1e-4, msg=f"lse {opts}")


@pytest.mark.parametrize("b", [1, 7, 16, 64])
def test_wgmma_prefill_block_sizes_and_gqa(b, wgmma_variant, monkeypatch):
    """Any block size (the producer gathers each row by cp.async through the block table; 64: a 128-key tile
    spans two blocks) and GQA groups 1, 8 and 32 (128 rows = 128 / group queries), a value head dim of its
    own (Dk 128, Dv 64)."""
    require_sm90a()
    use_wgmma(monkeypatch, wgmma_variant)
    for hq, hkv in ((4, 4), (16, 2), (32, 1)):
        kv, query, qsl = make_case("varlen", [b + 1, 3 * b + 5, 200, 9], dtype=bf16, num_heads=hq, num_kv_heads=hkv,
                                   head_dim=128, block_size=b, seed=45)
        run_cuda(kv, query, qsl)
    kv = make_paged_kv(seq_lens=[257, 40], num_kv_heads=2, head_dim=128, head_dim_v=64, block_size=b, dtype=f16,
                       seed=46)
    q_lens = [130, 40]
    run_cuda(kv, make_query(sum(q_lens), 8, 128, f16, generator(47)), query_start_loc(q_lens))


@pytest.mark.parametrize("b,layout,d", [(8, "HND", 64), (16, "NHD", 128), (64, "stacked", 96), (128, "NHD", 128),
                                         (256, "HND", 128), (16, "NHD", 256)])
def test_wgmma_prefill_tma_and_gathers(b, layout, d, wgmma_variant, monkeypatch):
    """K / V tiles by TMA (block sizes that divide the key tile or are multiples of it: whole pages, or a tile's
    part of one page, of keys the CTA may read) against the same kernel with every tile gathered
    (KVKERNELS_CUDA_NO_TMA=1): the same shared-memory tiles, so the same bits; both against the reference. Full
    and chunked prefill, one query over 250 keys (its last tile runs past the sequence into NaN slots), GQA 4."""
    require_sm90a()
    use_wgmma(monkeypatch, wgmma_variant)
    seq_lens, q_lens = [261, 300, 5, 250, 1000], [261, 150, 5, 1, 500]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=d, block_size=b, dtype=bf16, layout=layout,
                       seed=49)
    query, qsl = make_query(sum(q_lens), 8, d, bf16, generator(50)), query_start_loc(q_lens)
    monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_TMA", "require")  # (the driver rejecting the maps would fail, not gather)
    tma = run_cuda(kv, query, qsl)
    monkeypatch.delenv("KVKERNELS_CUDA_TMA")
    monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "1")
    gather = run_cuda(kv, query, qsl)
    assert torch.equal(tma[0].view(torch.int16), gather[0].view(torch.int16)), "out"
    assert torch.equal(tma[1].view(torch.int32), gather[1].view(torch.int32)), "lse"


def test_unknown_attention_path_is_an_error(monkeypatch):
    """A misspelt KVKERNELS_CUDA_ATTN_PATH raises (naming the variable) instead of running the default."""
    kv, query, _ = make_case("decode", [40, 3], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=128,
                             block_size=16, seed=39)
    for bad in ("mma-decode-wdie", "mma-prefill-wdie", "mma-prefill-wide,mma-prefill-deep", "simt,mma-decode-wide"):
        monkeypatch.setenv("KVKERNELS_CUDA_ATTN_PATH", bad)
        with pytest.raises(RuntimeError, match=f"KVKERNELS_CUDA_ATTN_PATH={bad} is not one of"):
            ops.paged_attention(like_on(query), like_on(kv.key_cache), like_on(kv.value_cache),
                                kv.block_tables.to(DEV), kv.seq_lens.to(DEV))


def test_splits_are_exact(monkeypatch):
    """float32 (CUDA cores, float32 math): 1 split vs many splits differ only by float32 rounding."""
    kv, query, _ = make_case("decode", [5000, 3000, 17], dtype=f32, num_heads=8, num_kv_heads=2,
                             head_dim=128, block_size=16, seed=43)
    args = (like_on(query), like_on(kv.key_cache), like_on(kv.value_cache), kv.block_tables.to(DEV),
            kv.seq_lens.to(DEV))
    results = []
    for splits in (1, 3, 64):
        monkeypatch.setenv("KVKERNELS_CUDA_ATTN_SPLITS", str(splits))
        results.append([x.cpu() for x in ops.paged_attention(*args, sinks=torch.ones(8, device=DEV))])
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=2e-6, atol=2e-6)


def test_current_stream():
    """The kernels run on the current stream: work queued on a side stream, read after a sync of it."""
    kv, query, _ = make_case("decode", [700, 5], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=128,
                             block_size=16, seed=47)
    args = (like_on(query), like_on(kv.key_cache), like_on(kv.value_cache), kv.block_tables.to(DEV),
            kv.seq_lens.to(DEV))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out, lse = ops.paged_attention(*args)
    side.synchronize()
    ref_out, ref_lse = reference.paged_attention(upcast(query), *kv.ref_caches(), kv.block_tables, kv.seq_lens)
    assert_close(out.cpu(), ref_out, bf16, msg="out")
    assert_close(lse.cpu(), ref_lse, f32, msg="lse")


# ----------------------------------------------------------------------------------------------------
# opcheck, bad input, debug checks
# ----------------------------------------------------------------------------------------------------


def _finite(t):
    if t.dtype in (E4M3, E5M2):
        b = t.view(torch.uint8)
        b.masked_fill_(torch.isnan(t.float()), 0)
    else:
        t.nan_to_num_(0.0)
    return t


OPCHECK = {
    "f32-decode-NHD": dict(dtype=f32, layout="NHD"),
    "bf16-varlen-HND-strided-window-softcap": dict(dtype=bf16, layout="HND", varlen=True, strided="fused",
                                                   opts=dict(window_left=3, soft_cap=2.0)),
    "e4m3-head-f16-stacked-alibi-sinks": dict(dtype=f16, layout="stacked", fp8="e4m3", per_head=True,
                                              strided="transposed",
                                              opts=dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
                                                        sinks=torch.tensor([0.1, -0.2, 0.3, 1.0]))),
    "e5m2-varlen-f32-scale": dict(dtype=f32, layout="NHD", fp8="e5m2", varlen=True, opts=dict(scale=0.3)),
}


@pytest.mark.parametrize("name", list(OPCHECK))
def test_opcheck(name):
    c = OPCHECK[name]
    kv = make_paged_kv(seq_lens=[5, 0, 9], num_kv_heads=2, head_dim=16, block_size=4, dtype=c["dtype"],
                       layout=c["layout"], fp8=c.get("fp8"), per_head_scale=c.get("per_head", False))
    for t in kv.storage:
        _finite(t)
    q_lens = [3, 0, 4] if c.get("varlen") else [1, 1, 1]
    q = make_query(sum(q_lens), 4, 16, c["dtype"], generator(3), strided=c.get("strided"))
    qsl = query_start_loc(q_lens).to(DEV) if c.get("varlen") else None
    args = (like_on(q), like_on(kv.key_cache), like_on(kv.value_cache), kv.block_tables.to(DEV),
            kv.seq_lens.to(DEV), qsl)
    kwargs = {k: opt_on(v) for k, v in dict(c.get("opts", {}), **kv.scales).items()}
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if c.get("fp8"):
        utils = utils[1:]  # SchemaCheckMode compares fp8 tensors with allclose, which has no fp8 kernel
    torch.library.opcheck(torch.ops.kvkernels.paged_attention.default, args, kwargs, test_utils=utils)


def _base(varlen=False, fp8=None):
    kv, query, qsl = make_case("varlen" if varlen else "decode", [5, 9, 12], dtype=f16 if not fp8 else bf16,
                               num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, fp8=fp8, seed=53)
    return dict(query=like_on(query), key_cache=like_on(kv.key_cache), value_cache=like_on(kv.value_cache),
                block_tables=kv.block_tables.to(DEV), seq_lens=kv.seq_lens.to(DEV),
                query_start_loc=opt_on(qsl), k_scale=opt_on(kv.k_scale), v_scale=opt_on(kv.v_scale))


BAD = [
    ("query-float64", "query", lambda a: a.update(query=a["query"].double())),
    ("cache-dtype", "query|key_cache", lambda a: a.update(query=a["query"].float())),
    ("block_tables-on-cpu", "block_tables", lambda a: a.update(block_tables=a["block_tables"].cpu())),
    ("seq_lens-on-cpu", "seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].cpu())),
    ("value_cache-on-cpu", "value_cache", lambda a: a.update(value_cache=a["value_cache"].cpu())),
    ("block_tables-int64", "block_tables", lambda a: a.update(block_tables=a["block_tables"].long())),
    ("head_dim-mismatch", "query|key_cache", lambda a: a.update(query=a["query"][..., :8])),
    ("heads-not-multiple", "query|key_cache", lambda a: a.update(query=a["query"][:, :3])),
    ("decode-tokens-ne-seqs", "query|seq_lens", lambda a: a.update(query=a["query"][:2])),
    ("alibi-size", "alibi_slopes", lambda a: a.update(alibi_slopes=torch.ones(2, device=DEV))),
    ("sinks-on-cpu", "sinks", lambda a: a.update(sinks=torch.ones(4))),
    ("value_cache-heads", "value_cache", lambda a: a.update(value_cache=a["value_cache"][:, :, :1])),
    ("value_cache-head_dim-12", "value_cache", lambda a: a.update(value_cache=a["value_cache"][..., :12])),
    # Head dims above 256: supported on the CPU and Metal, refused on CUDA (docs/ops.md) before any
    # output is allocated.
    ("key_cache-head_dim-512", "key_cache", lambda a: a.update(
        query=torch.zeros(3, 4, 512, dtype=f16, device=DEV), key_cache=torch.zeros(16, 4, 2, 512, dtype=f16, device=DEV))),
    ("value_cache-head_dim-264", "value_cache", lambda a: a.update(
        value_cache=torch.zeros(16, 4, 2, 264, dtype=f16, device=DEV))),
]


@pytest.mark.parametrize("name,arg,mutate", BAD, ids=[b[0] for b in BAD])
def test_bad_input(name, arg, mutate):
    a = _base()
    mutate(a)
    with pytest.raises(RuntimeError, match=rf"kvkernels\.paged_attention: ({arg}):"):
        ops.paged_attention(**a)
    torch.cuda.synchronize()  # and the device is still fine


def test_fp8_without_scale():
    a = _base(fp8="e4m3")
    a["k_scale"] = None
    with pytest.raises(RuntimeError, match=r"kvkernels\.paged_attention: k_scale:"):
        ops.paged_attention(**a)


@pytest.mark.parametrize("bad", ["block-id-too-large", "block-id-negative", "seq_len-over-capacity",
                                 "qsl-decreasing"])
def test_debug_index_checks(bad, monkeypatch):
    """KVKERNELS_DEBUG=1 runs the host range checks on copies of the index tensors; without it bad ids
    give wrong numbers at worst, never a device fault (the kernels clamp / zero-fill)."""
    a = _base(varlen=bad.startswith("qsl"))
    bt, sl = a["block_tables"], a["seq_lens"]
    if bad == "block-id-too-large":
        bt[1, 1], arg = 10 ** 6, "block_tables"
    elif bad == "block-id-negative":
        bt[2, 0], arg = -5, "block_tables"
    elif bad == "seq_len-over-capacity":
        sl[0], arg = bt.shape[1] * 4 + 1, "seq_lens"
    else:
        a["query_start_loc"] = torch.tensor([0, 3, 2, a["query"].shape[0]], dtype=torch.int32, device=DEV)
        arg = "query_start_loc"
    monkeypatch.setenv("KVKERNELS_DEBUG", "1")
    with pytest.raises(RuntimeError, match=rf"kvkernels\.paged_attention: {arg}:"):
        ops.paged_attention(**a)
    monkeypatch.delenv("KVKERNELS_DEBUG")
    ops.paged_attention(**a)
    torch.cuda.synchronize()  # no illegal address: the context is still usable
    torch.ones(1, device=DEV).add_(1)
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,fp8,path", [(bf16, None, None), (f32, None, None), (bf16, "e4m3", None),
                                            (bf16, None, "mma-decode-fused"), (bf16, None, "mma-decode-persistent"),
                                            (bf16, "e4m3", "mma-decode-persistent")],
                         ids=["bf16", "f32", "e4m3", "bf16-fused", "bf16-persistent", "e4m3-persistent"])
def test_cuda_graph_decode_step(dtype, fp8, path, monkeypatch):
    """Capture one decode step (long enough contexts that the plan splits: workspace allocated inside the
    capture), then change seq_lens and the block tables' contents in place and replay: the replays match
    the reference for the new contents. Nothing in the launch depends on device data. Also on the fused and
    persistent decodes, whose arrival counters must start from zero at every replay (a memset node)."""
    force_cuda_plan(monkeypatch, "ATTN", path, None)
    b, hq, hkv, d = 16, 8, 2, 128
    lens_a = [1500, 33, 900]
    lens_b = [1700, 1, 2047]  # different lengths, same table width (2048 / 16 = 128 columns + junk)
    kv = make_paged_kv(seq_lens=[2048, 2048, 2048], num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype,
                       fp8=fp8, per_head_scale=True, seed=59)
    key_cache, value_cache = like_on(kv.key_cache), like_on(kv.value_cache)
    scales = {k: opt_on(v) for k, v in kv.scales.items()}
    block_tables = kv.block_tables.to(DEV)
    seq_lens = torch.tensor(lens_a, dtype=torch.int32, device=DEV)
    query = make_query(3, hq, d, dtype, generator(60)).to(DEV)

    def step():
        return ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, **scales)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture (first-use kernel attributes, allocator pools)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()

    def check(lens, table):
        ref_out, ref_lse = reference.paged_attention(upcast(query.cpu()), *kv.ref_caches(), table,
                                                     torch.tensor(lens, dtype=torch.int32), **kv.scales)
        assert_close(out.cpu(), ref_out, dtype, msg="graph out")
        assert_close(lse.cpu(), ref_lse, f32, msg="graph lse")

    seq_lens.copy_(torch.tensor(lens_a, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    check(lens_a, kv.block_tables)

    # New lengths, and the rows of sequences 0 and 2 swapped in the table (same storage, new contents).
    table_b = kv.block_tables.clone()
    table_b[[0, 2]] = kv.block_tables[[2, 0]]
    block_tables.copy_(table_b)
    seq_lens.copy_(torch.tensor(lens_b, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    check(lens_b, table_b)


# ----------------------------------------------------------------------------------------------------
# a value head dim different from the key's (tests/test_head_dims.py on the CPU)
# ----------------------------------------------------------------------------------------------------

# id: dtype, fp8, layout, Hq, Hkv, Dk, Dv, B
DV_CONFIGS = {
    "f32-NHD-k64-v32-b16": (f32, None, "NHD", 4, 2, 64, 32, 16),
    "bf16-NHD-k192-v128-b16": (bf16, None, "NHD", 8, 2, 192, 128, 16),
    "f16-stacked-k32-v96-b16": (f16, None, "stacked", 4, 1, 32, 96, 16),
    "bf16-HND-k128-v40-b7": (bf16, None, "HND", 8, 2, 128, 40, 7),
    "e4m3-bf16-NHD-k192-v128-b16": (bf16, "e4m3", "NHD", 8, 2, 192, 128, 16),
    "e5m2-f32-NHD-k64-v256-b16": (f32, "e5m2", "NHD", 4, 2, 64, 256, 16),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", DV_CONFIGS.values(), ids=DV_CONFIGS.keys())
def test_value_head_dim(config, mode, path):
    from test_head_dims import dv_case

    dtype, fp8, layout, hq, hkv, dk, dv, b = config
    kv, query, qsl = dv_case(mode, [b + 1, 0, max(3 * b - 1, 37), 1, b], dtype=dtype, hq=hq, hkv=hkv, dk=dk, dv=dv,
                             b=b, layout=layout, fp8=fp8)
    run_cuda(kv, query, qsl, **(features(b, dk)["all"] if hq == 8 else {}))


# ----------------------------------------------------------------------------------------------------
# causal=False, more queries than keys, caller-provided outputs (tests/test_causal.py and
# tests/test_out.py on the CPU; tests/test_cuda_emulated.py runs the same kernels emulated)
# ----------------------------------------------------------------------------------------------------

# id: dtype, fp8, Hq, Hkv, D, B
CAUSAL_CONFIGS = {
    "f32-gqa2-d64-b16": (f32, None, 4, 2, 64, 16),
    "bf16-gqa4-d128-b16": (bf16, None, 8, 2, 128, 16),
    "f16-mqa-d64-b7": (f16, None, 4, 1, 64, 7),
    "e4m3-bf16-gqa4-d128-b16": (bf16, "e4m3", 8, 2, 128, 16),
}


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("config", CAUSAL_CONFIGS.values(), ids=CAUSAL_CONFIGS.keys())
def test_causal_flag_and_more_queries_than_keys(config, causal, path):
    """Varlen rows with q_len below, equal to and above seq_len (seq_len 0 included); causal=False with a
    window (its lower bound only), ALiBi and sinks."""
    dtype, fp8, hq, hkv, d, b = config
    seq_lens, q_lens = [3 * b + 5, 4, 0, 2 * b, 1], [7, 9, 3, 2 * b, 1]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype, fp8=fp8,
                       seed=41)
    query = make_query(sum(q_lens), hq, d, dtype, generator(42))
    qsl = query_start_loc(q_lens)
    run_cuda(kv, query, qsl, causal=causal)
    run_cuda(kv, query, qsl, causal=causal, window_left=5, alibi_slopes=torch.linspace(0.01, 0.2, hq),
             sinks=torch.linspace(-1.0, 1.0, hq))


@pytest.mark.parametrize("config", CAUSAL_CONFIGS.values(), ids=CAUSAL_CONFIGS.keys())
def test_out_variant(config, path):
    """out= / lse= on CUDA: bit-identical to the allocating call, every element written (NaN-poisoned
    buffers), a row slice of a bigger buffer (vLLM's output) written in place, the rows around untouched."""
    dtype, fp8, hq, hkv, d, b = config
    seq_lens, q_lens = [3 * b + 5, 4, 2 * b], [7, 4, 1]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype, fp8=fp8,
                       seed=43)
    query = make_query(sum(q_lens), hq, d, dtype, generator(44))
    q, k, v = like_on(query), like_on(kv.key_cache), like_on(kv.value_cache)
    args = (q, k, v, kv.block_tables.to(DEV), kv.seq_lens.to(DEV), query_start_loc(q_lens).to(DEV))
    scales = {name: opt_on(x) for name, x in kv.scales.items()}
    want_out, want_lse = ops.paged_attention(*args, causal=False, **scales)
    t = query.shape[0]
    buf = torch.full((t + 4, hq, d), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((t, hq), float("nan"), dtype=f32, device=DEV)
    got_out, got_lse = ops.paged_attention(*args, causal=False, **scales, out=buf[2:2 + t], lse=lse)
    torch.cuda.synchronize()
    assert got_out.data_ptr() == buf[2:2 + t].data_ptr() and got_lse is lse
    assert torch.equal(buf[2:2 + t], want_out) and torch.equal(lse, want_lse)
    assert buf[:2].isnan().all() and buf[2 + t:].isnan().all()
    out_only = torch.full_like(want_out, float("nan"))
    got_out, got_lse = ops.paged_attention(*args, causal=False, **scales, out=out_only)
    assert got_lse is None and torch.equal(out_only, want_out)
