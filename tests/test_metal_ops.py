"""Every Metal kernel against kvkernels.reference, run through the MSL emulator on CPU tensors.

``kvkernels.metal.dispatch`` is the code registered as the MPS implementation of the ops; with CPU
tensors it compiles the same metal/*.metal source with the emulator instead of torch.mps.compile_shader.
Every case runs in the three lane orders (forward, reverse, random): a kernel with a missing barrier or a
race inside a threadgroup gives an order-dependent result and fails at least one of them (the emulator's
own negative tests show that). Shapes are small (emulation costs microseconds per GPU thread) but cover
odd head dims, partial blocks, partial threadgroups, GQA, strided inputs and every dtype pairing the
dispatch compiles.

Nothing here ran on an Apple GPU: this is type-checked and emulated MSL, not measured Metal.
"""

import math

import pytest
import torch

from helpers import (FP8_DTYPES, alloc_kv_cache, make_paged_mla, assert_bytes_equal, assert_close, clone_storage, generator,
                     kv_views, make_paged_kv, make_query, make_scale, poison, query_start_loc, randn, upcast)
from kvkernels import reference
from kvkernels.metal import dispatch, emulator

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
ORDERS = emulator.LANE_ORDERS


@pytest.fixture(params=ORDERS)
def lane_order(request):
    with emulator.lane_order(request.param, seed=11):
        yield request.param


def random_bytes(shape, dtype, gen):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).clone()


# ----------------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------------

# id: key dtype, cache fp8 (None: same dtype), per-head scale (k, v), layout, head dim
WRITE_CASES = {
    "f32-NHD-d40": (f32, None, (False, False), "NHD", 40),
    "f16-HND-d24": (f16, None, (False, False), "HND", 24),
    "bf16-stacked-d40": (bf16, None, (False, False), "stacked", 40),
    "bf16->e4m3-khead-HND-d40": (bf16, "e4m3", (True, False), "HND", 40),
    "f32->e5m2-vhead-NHD-d24": (f32, "e5m2", (False, True), "NHD", 24),
    "f16->e4m3-stacked-d8": (f16, "e4m3", (False, False), "stacked", 8),
}


@pytest.mark.parametrize("case", WRITE_CASES.values(), ids=WRITE_CASES.keys())
def test_reshape_and_cache(case, lane_order):
    dtype, fp8, (k_head, v_head), layout, d = case
    gen = generator(1)
    n, b, h, t = 5, 3, 2, 9
    cache_dtype = FP8_DTYPES[fp8] if fp8 else dtype
    storage = tuple(random_bytes(s.shape, cache_dtype, gen) for s in alloc_kv_cache(layout, n, b, h, d, cache_dtype))
    ref_storage = clone_storage(storage)
    qkv = randn(t, 4 + 2 * h, d, gen=gen, dtype=dtype, std=3.0)  # non-contiguous key/value
    key, value = qkv[:, 4:4 + h], qkv[:, 4 + h:]
    if fp8:  # saturation, infinities, subnormals, NaN
        key[0, 0, :4] = torch.tensor([1e30, -1e30, float("inf"), float("-inf")]).to(dtype)
        key[1, 0, :3] = torch.tensor([1e-6, -3e-7, 2e-3]).to(dtype)
        value[2, 1, 3] = float("nan")
    slots = torch.randperm(n * b, generator=gen)[:t]
    slots[[2, 6]] = torch.tensor([-1, -(2**40)])
    scales = dict(k_scale=make_scale(h, k_head, gen), v_scale=make_scale(h, v_head, gen)) if fp8 else {}
    key_cache, value_cache = kv_views(storage, layout)
    dispatch.reshape_and_cache(key, value, key_cache, value_cache, slots, **scales)
    ref_k, ref_v = kv_views(ref_storage, layout)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots, **scales)
    for a, r in zip(storage, ref_storage):
        assert_bytes_equal(a, r, msg="cache bytes vs reference")


def test_fp8_encoders_exhaustive():
    """Every float16 value (and float32 values around each fp8 rounding boundary) quantized by the kernel
    equals torch's conversion, for both fp8 formats."""
    all_f16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x32 = all_f16.to(f32)
    # float32 values just around every halfway point between adjacent e4m3/e5m2 values
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        grid = torch.arange(0, 256, dtype=torch.uint8).view(fp8).to(f32)
        grid = grid[torch.isfinite(grid)].unique()
        mids = (grid[:-1] + grid[1:]) / 2
        edges = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                           torch.nextafter(mids, torch.full_like(mids, -1e9))])
        x = torch.cat([x32, edges, -edges, torch.tensor([1e30, -1e30, float("inf"), float("-inf")])])
        x = x.reshape(-1, 1, 1)
        cache = torch.zeros(x.shape[0], 1, 1, 1, dtype=fp8)
        one = torch.ones(1)
        slots = torch.arange(x.shape[0])
        dispatch.reshape_and_cache(x, x, cache, cache.clone(), slots, k_scale=one, v_scale=one)
        want = reference.quantize_fp8(x.reshape(-1, 1, 1), one, fp8)
        assert_bytes_equal(cache.reshape(-1), want.reshape(-1), msg=str(fp8))


# ----------------------------------------------------------------------------------------------------
# gather_kv
# ----------------------------------------------------------------------------------------------------

# id: data dtype, fp8, per-head scale, layout, head dim, block size, out dtype
GATHER_CASES = {
    "f32-NHD-d24-b3": (f32, None, False, "NHD", 24, 3, None),
    "bf16-HND-d40-b4->f32": (bf16, None, False, "HND", 40, 4, f32),
    "f16-stacked-d8-b5": (f16, None, False, "stacked", 8, 5, None),
    "e4m3-head-NHD-d24-b3": (f32, "e4m3", True, "NHD", 24, 3, None),
    "e5m2-tensor-HND-d40-b4->f16": (bf16, "e5m2", False, "HND", 40, 4, f16),
}


@pytest.mark.parametrize("case", GATHER_CASES.values(), ids=GATHER_CASES.keys())
def test_gather_kv(case, lane_order):
    dtype, fp8, per_head, layout, d, b, out_dtype = case
    seq_lens = [b + 1, 0, 2 * b, 1]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=d, block_size=b, dtype=dtype, layout=layout,
                       fp8=fp8, per_head_scale=per_head, seed=5)
    got = dispatch.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **kv.scales,
                             out_dtype=out_dtype)
    want = reference.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **kv.scales,
                               out_dtype=out_dtype)
    for g, w, name in zip(got, want, ("key", "value")):
        assert_bytes_equal(g, w, msg=name)


# ----------------------------------------------------------------------------------------------------
# copy_blocks
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["NHD-f32", "stacked-bf16-dim2", "HND-view-u8", "int64-negdim"])
def test_copy_blocks(case, lane_order):
    gen = generator(3)
    if case == "NHD-f32":
        cache, block_dim = randn(7, 3, 2, 5, gen=gen), 0
    elif case == "stacked-bf16-dim2":
        cache, block_dim = randn(2, 2, 7, 3, 2, 5, gen=gen, dtype=bf16), 2
    elif case == "HND-view-u8":
        cache, block_dim = torch.randint(0, 255, (7, 2, 3, 6), generator=gen, dtype=torch.uint8).transpose(1, 2), 0
    else:
        cache, block_dim = torch.randint(-9, 9, (3, 4, 7), generator=gen), -1
    mapping = torch.tensor([[0, 4], [2, 5], [0, 6]])
    ref = cache.clone()
    dispatch.copy_blocks(cache, mapping, block_dim=block_dim)
    reference.copy_blocks(ref, mapping, block_dim=block_dim)
    assert_bytes_equal(cache, ref)


# ----------------------------------------------------------------------------------------------------
# merge_attention_states
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
def test_merge_attention_states(dtype, lane_order):
    gen = generator(4)
    t, h, d = 5, 3, 24
    out_a = randn(h, t, d, gen=gen, dtype=dtype).transpose(0, 1)  # non-contiguous
    out_b = randn(t, h, d, gen=gen, dtype=dtype)
    lse_a, lse_b = randn(t, h, gen=gen, std=3.0), randn(t, h, gen=gen, std=3.0)
    lse_a[0, 0] = float("-inf")          # side a saw no key: its NaN out must not be read
    out_a[0, 0] = float("nan")
    lse_b[1, :] = float("-inf")
    lse_a[2, 1] = lse_b[2, 1] = float("-inf")  # neither side: out 0, lse -inf
    out, lse = dispatch.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attention_states(upcast(out_a), lse_a, upcast(out_b), lse_b)
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


# ----------------------------------------------------------------------------------------------------
# paged_attention
# ----------------------------------------------------------------------------------------------------


def varlen_q_lens(seq_lens):
    """Per-sequence query counts: full prefill, chunked prefill, one query, none (cycling)."""
    pattern = (lambda n: n, lambda n: (n + 1) // 2, lambda n: min(n, 1), lambda n: 0)
    return [pattern[i % 4](n) for i, n in enumerate(seq_lens)]


def attention_case(mode, seq_lens, *, dtype, hq, hkv, d, b, layout="NHD", fp8=None, per_head=False, strided=None,
                   seed=0):
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype, layout=layout,
                       fp8=fp8, per_head_scale=per_head, seed=seed)
    if mode == "decode":
        q_lens, qsl = [1] * len(seq_lens), None
    else:
        q_lens = varlen_q_lens(seq_lens)
        qsl = query_start_loc(q_lens)
    query = make_query(sum(q_lens), hq, d, dtype, generator(seed + 1), strided=strided)
    return kv, query, qsl


def check_paged_attention(kv, query, qsl=None, **kwargs):
    out, lse = dispatch.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                                        **kwargs, **kv.scales)
    kr, vr = kv.ref_caches()
    ref_out, ref_lse = reference.paged_attention(upcast(query), kr, vr, kv.block_tables, kv.seq_lens, qsl,
                                                 **kwargs, **kv.scales)
    assert out.dtype == query.dtype and out.shape == query.shape and lse.dtype == f32
    assert_close(out, ref_out, query.dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    return out, lse


# id: dtype, fp8, per-head scale, layout, Hq, Hkv, D, B, strided query
ATTENTION_CASES = {
    "f32-NHD-gqa2-d40-b3": (f32, None, False, "NHD", 4, 2, 40, 3, None),
    "f16-HND-mqa-d24-b4-fused": (f16, None, False, "HND", 3, 1, 24, 4, "fused"),
    "bf16-stacked-mha-d72-b5": (bf16, None, False, "stacked", 2, 2, 72, 5, "transposed"),
    "e4m3-head-bf16-NHD-gqa2-d32-b3": (bf16, "e4m3", True, "NHD", 4, 2, 32, 3, None),
    "e5m2-tensor-f32-HND-gqa3-d8-b2": (f32, "e5m2", False, "HND", 3, 1, 8, 2, None),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_paged_attention(case, mode, lane_order):
    dtype, fp8, per_head, layout, hq, hkv, d, b, strided = case
    seq_lens = [b + 1, 0, 3 * b - 1, 1, 2 * b]  # partial and full last blocks, empty, one token
    kv, query, qsl = attention_case(mode, seq_lens, dtype=dtype, hq=hq, hkv=hkv, d=d, b=b, layout=layout, fp8=fp8,
                                    per_head=per_head, strided=strided)
    out, lse = check_paged_attention(kv, query, qsl)
    if mode == "decode":  # the empty sequence sees no key
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


def attention_features(b, d, hq):
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / hq) for h in range(hq)], dtype=f32)
    sinks = randn(hq, gen=generator(7), std=2.0)
    return {
        "window0": dict(window_left=0),
        "window=B": dict(window_left=b),
        "softcap": dict(soft_cap=1.5, scale=2.0 / math.sqrt(d)),
        "alibi": dict(alibi_slopes=slopes),
        "sinks": dict(sinks=sinks),
        "all": dict(window_left=b + 1, soft_cap=2.0, scale=1.5 / math.sqrt(d), alibi_slopes=slopes, sinks=sinks),
    }


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("fi, feature", list(enumerate(attention_features(4, 32, 4))))
def test_paged_attention_features(fi, feature, mode, lane_order):
    b, d, hq = 3, 32, 4
    seq_lens = [2 * b, 2 * b + 1, 1, 0, 3 * b + 2]
    kv, query, qsl = attention_case(mode, seq_lens, dtype=f32, hq=hq, hkv=2, d=d, b=b, fp8="e4m3" if fi % 2 else None,
                                    per_head=True, seed=3)
    out, lse = check_paged_attention(kv, query, qsl, **attention_features(b, d, hq)[feature])
    if mode == "decode":
        sinks = attention_features(b, d, hq)[feature].get("sinks")
        assert torch.equal(out[3], torch.zeros_like(out[3]))
        assert torch.equal(lse[3], sinks if sinks is not None else torch.full((hq,), float("-inf")))


# id: case of ATTENTION_CASES, logit options (causal=False and/or q_len > seq_len in every row set)
NONCAUSAL_CASES = {
    "f32-noncausal": ("f32-NHD-gqa2-d40-b3", dict(causal=False)),
    "bf16-noncausal-window": ("bf16-stacked-mha-d72-b5", dict(causal=False, window_left=4)),
    "e4m3-noncausal-alibi-sinks": ("e4m3-head-bf16-NHD-gqa2-d32-b3",
                                   dict(causal=False, alibi_slopes=torch.tensor([0.3, 0.1, -0.2, 0.05]),
                                        sinks=torch.tensor([0.5, -1.0, 1.0, 2.0]))),
    "f16-causal-window": ("f16-HND-mqa-d24-b4-fused", dict(window_left=2)),
}


@pytest.mark.parametrize("name", NONCAUSAL_CASES)
def test_paged_attention_noncausal_and_more_queries_than_keys(name, lane_order):
    """causal=False (window: lower bound only) and sequences with more queries than keys (causal: the
    leading rows see no key), mixed with shorter and empty sequences."""
    case, opts = NONCAUSAL_CASES[name]
    dtype, fp8, per_head, layout, hq, hkv, d, b, strided = ATTENTION_CASES[case]
    seq_lens, q_lens = [b + 1, 0, 3 * b - 1, 2], [b + 1, 3, 2 * b, 5]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype, layout=layout,
                       fp8=fp8, per_head_scale=per_head, seed=5)
    query = make_query(sum(q_lens), hq, d, dtype, generator(6), strided=strided)
    out, lse = check_paged_attention(kv, query, query_start_loc(q_lens), **opts)
    causal = opts.get("causal", True)
    empty = list(range(b + 1, b + 4)) + ([b + 4 + 2 * b, b + 5 + 2 * b, b + 6 + 2 * b] if causal else [])
    sinks = opts.get("sinks")
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.equal(lse[empty], (sinks if sinks is not None else torch.full((hq,), float("-inf"))).expand(len(empty), hq))


# ----------------------------------------------------------------------------------------------------
# MLA
# ----------------------------------------------------------------------------------------------------

# id: dtype, fp8, R, P, strided cache rows
CONCAT_CASES = {
    "f32-R40-P8-strided": (f32, None, 40, 8, True),
    "bf16-R64-P16": (bf16, None, 64, 16, False),
    "f16->e4m3-R40-P8": (f16, "e4m3", 40, 8, False),
    "f32->e5m2-R64-P16-strided": (f32, "e5m2", 64, 16, True),
}


@pytest.mark.parametrize("case", CONCAT_CASES.values(), ids=CONCAT_CASES.keys())
def test_concat_and_cache_mla(case, lane_order):
    dtype, fp8, r, p, strided = case
    gen = generator(1)
    n, b, t = 4, 3, 7
    cache_dtype = FP8_DTYPES[fp8] if fp8 else dtype
    alloc = random_bytes((n, b, r + p + (8 if strided else 0)), cache_dtype, gen)
    ref_alloc = alloc.clone()
    fused = randn(t, r + p, gen=gen, dtype=dtype, std=2.0)
    kv_c, k_pe = fused[:, :r], fused[:, r:]
    slots = torch.randperm(n * b, generator=gen)[:t]
    slots[[2, 5]] = -1
    scale = torch.tensor([0.03]) if fp8 else None
    dispatch.concat_and_cache_mla(kv_c, k_pe, alloc[..., :r + p], slots, scale=scale)
    reference.concat_and_cache_mla(kv_c, k_pe, ref_alloc[..., :r + p], slots, scale=scale)
    assert_bytes_equal(alloc, ref_alloc, msg="cache bytes vs reference")


# id: w dtype, fp8, R, P, heads, dn, dv, RMSNorm, block size, strided cache
DECOMPRESS_CASES = {
    "f32-R40-P8-H2-b3-strided": (f32, None, 40, 8, 2, 16, 24, False, 3, True),
    "bf16-R64-P16-H3-norm-b4": (bf16, None, 64, 16, 3, 16, 8, True, 4, False),
    "f16-R72-P0-H1-norm": (f16, None, 72, 0, 1, 40, 8, True, 5, False),
    "e4m3-f32-R64-P8-H2-norm": (f32, "e4m3", 64, 8, 2, 24, 16, True, 4, False),
    "e5m2-bf16-R40-P16-H2": (bf16, "e5m2", 40, 16, 2, 16, 16, False, 3, False),
}


@pytest.mark.parametrize("case", DECOMPRESS_CASES.values(), ids=DECOMPRESS_CASES.keys())
def test_mla_decompress(case, lane_order):
    """Tokens 35 (two token tiles, the second partial), Hq * (dn + dv) rows of w_kv_b not a multiple of the
    32-row tile, R not a multiple of the 32-element K step."""
    dtype, fp8, r, p, h, dn, dv, norm, b, strided = case
    gen = generator(2)
    seq_lens = [5, 0, 25, 1, b]
    mla = make_paged_mla(seq_lens, r, p, b, dtype=dtype, fp8=fp8, seed=3, strided=strided)
    w = randn(h * (dn + dv), r, gen=gen, std=r ** -0.5, dtype=dtype)
    norm_weight = (1 + 0.5 * randn(r, gen=gen)).to(dtype) if norm else None
    kwargs = dict(kv_lora_rank=r, qk_nope_head_dim=dn, v_head_dim=dv, norm_eps=1e-5, scale=mla.scale)
    key, value = dispatch.mla_decompress(mla.kv_cache, mla.block_tables, mla.seq_lens, w, norm_weight=norm_weight,
                                         **kwargs)
    ref_key, ref_value = reference.mla_decompress(mla.ref_cache(), mla.block_tables, mla.seq_lens, w,
                                                  norm_weight=upcast(norm_weight), **kwargs)
    assert key.shape == (sum(seq_lens), h, dn + p) and value.shape == (sum(seq_lens), h, dv)
    assert_close(key, ref_key, dtype, msg="key")
    assert_close(value, ref_value, dtype, msg="value")


# id: q dtype, fp8, R, P, heads, block size, strided q
MLA_ATTN_CASES = {
    "f32-R64-P16-H5-b3": (f32, None, 64, 16, 5, 3, "fused"),
    "bf16-R512-P64-H4-b4": (bf16, None, 512, 64, 4, 4, None),
    "f16-R40-P8-H3-b5": (f16, None, 40, 8, 3, 5, "transposed"),
    "e4m3-bf16-R64-P16-H4-b3": (bf16, "e4m3", 64, 16, 4, 3, None),
    "e5m2-f32-R40-P0-H6-b4": (f32, "e5m2", 40, 0, 6, 4, None),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("case", MLA_ATTN_CASES.values(), ids=MLA_ATTN_CASES.keys())
def test_mla_paged_attention(case, mode, lane_order):
    """Hq not a multiple of the 4 heads per threadgroup (H5, H3, H6), sequences ending inside an 8-row tile."""
    dtype, fp8, r, p, h, b, strided = case
    seq_lens = [b + 1, 0, 2 * b + 5, 1, 9]
    mla = make_paged_mla(seq_lens, r, p, b, dtype=dtype, fp8=fp8, seed=4)
    q_lens = [1] * len(seq_lens) if mode == "decode" else varlen_q_lens(seq_lens)
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    q = make_query(sum(q_lens), h, r + p, dtype, generator(5), strided=strided)
    kwargs = dict(kv_lora_rank=r, scale=(r + p) ** -0.5 * 2, query_start_loc=qsl, kv_scale=mla.scale)
    out, lse = dispatch.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, **kwargs)
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables, mla.seq_lens,
                                                     **kwargs)
    assert out.shape == (sum(q_lens), h, r) and out.dtype == dtype
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    if mode == "decode":
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


def test_mla_paged_attention_more_queries_than_keys(lane_order):
    """FlashMLA's empty-context prefill: sequences with more queries than keys (seq_len 0 included); the
    leading rows see no key: out 0, lse -inf."""
    r, p, h, b = 40, 8, 3, 4
    seq_lens, q_lens = [3, 0, 9], [5, 2, 9]
    mla = make_paged_mla(seq_lens, r, p, b, dtype=f32, seed=6)
    qsl = query_start_loc(q_lens)
    q = make_query(sum(q_lens), h, r + p, f32, generator(7))
    kwargs = dict(kv_lora_rank=r, scale=0.2, query_start_loc=qsl, kv_scale=None)
    out, lse = dispatch.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, **kwargs)
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables, mla.seq_lens,
                                                     **kwargs)
    assert_close(out, ref_out, f32, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    empty = [0, 1, 5, 6]
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and torch.isneginf(lse[empty]).all()


def test_mla_decompress_rounds_the_latent(lane_order):
    """docs/ops.md: the normalised latent is rounded to w_kv_b's dtype before the product."""
    from test_mla import check_decompress_rounding
    check_decompress_rounding(dispatch.mla_decompress)


# ----------------------------------------------------------------------------------------------------
# non-finite values (docs/ops.md "Non-finite values"; every CPU path: tests/test_nonfinite.py)
# ----------------------------------------------------------------------------------------------------


def _poke(cache, blocks, seq_len, pos, head, col, value):
    """One element of the token at `pos` (fp8 caches: the byte of `value`)."""
    from helpers import token_slots
    slot = int(token_slots(blocks, seq_len, cache.shape[1])[pos])
    b, o = slot // cache.shape[1], slot % cache.shape[1]
    idx = (b, o, head, col) if cache.dim() == 4 else (b, o, col)
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        byte = {"nan": 0x7F if cache.dtype == torch.float8_e4m3fn else 0x7E, "+inf": 0x7C, "-inf": 0xFC}[value]
        cache.view(torch.uint8)[idx] = byte
    else:
        cache[idx] = float(value.replace("+", ""))


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("fp8", [None, "e5m2"])
def test_paged_attention_nonfinite(mode, fp8):
    """NaN / inf keys and values at the first and last key of a sequence and in a partial block, NaN /
    inf sinks and ALiBi slopes, a non-finite v_scale; keys outside the window carry NaN as well."""
    b, hq, hkv, d = 4, 4, 2, 32
    seq_lens = [2 * b + 3, 0, 3 * b]
    kv, query, qsl = attention_case(mode, seq_lens, dtype=bf16, hq=hq, hkv=hkv, d=d, b=b, fp8=fp8, per_head=True,
                                    seed=8)
    _poke(kv.key_cache, kv.blocks[0], seq_lens[0], 0, 1, 3, "nan")  # outside window 5 of every query
    _poke(kv.value_cache, kv.blocks[0], seq_lens[0], 0, 1, 4, "nan")
    _poke(kv.key_cache, kv.blocks[0], seq_lens[0], 2 * b + 2, 0, 5, "+inf")  # the last key
    _poke(kv.value_cache, kv.blocks[2], seq_lens[2], 2, 1, 6, "+inf")
    _poke(kv.key_cache, kv.blocks[2], seq_lens[2], 3 * b - 2, 1, 1, "nan")
    sinks = torch.tensor([0.5, float("nan"), float("-inf"), float("inf")])
    slopes = torch.tensor([0.1, float("nan"), 0.2, float("-inf")])
    out, lse = check_paged_attention(kv, query, qsl, window_left=5)
    assert out[:, 3].isfinite().any()
    check_paged_attention(kv, query, qsl, sinks=sinks)
    check_paged_attention(kv, query, qsl, alibi_slopes=slopes, window_left=5)
    if fp8:
        kv.v_scale[1] = float("inf")
        kv.k_scale[0] = float("nan")
        out, lse = check_paged_attention(kv, query, qsl)
        # Sequence 0's last query: heads of kv head 0 NaN through k_scale, of kv head 1 through v_scale.
        last = 0 if qsl is None else int(qsl[1]) - 1
        assert out[last].isnan().all() and lse[last, :2].isnan().all()
        # An inf k_scale counts as NaN also under a soft cap (whose tanh would make +-inf logits finite).
        kv.k_scale[0], kv.v_scale[1] = float("inf"), 1.0
        out, lse = check_paged_attention(kv, query, qsl, soft_cap=5.0)
        assert lse[last, :2].isnan().all() and out[last, :2].isnan().all()


@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_mla_paged_attention_nonfinite(mode):
    r, p, h, b = 32, 8, 5, 4
    seq_lens = [2 * b + 1, 0, 9]
    for fp8 in (None, "e5m2"):
        mla = make_paged_mla(seq_lens, r, p, b, dtype=bf16, fp8=fp8, seed=9)
        q_lens = [1] * len(seq_lens) if mode == "decode" else [3, 0, 9]
        qsl = None if mode == "decode" else query_start_loc(q_lens)
        q = make_query(sum(q_lens), h, r + p, bf16, generator(10))
        _poke(mla.kv_cache, mla.blocks[0], seq_lens[0], 2 * b, 0, 3, "+inf")  # last key, a value element
        _poke(mla.kv_cache, mla.blocks[2], seq_lens[2], 4, 0, r + 1, "nan")  # a rope element
        kwargs = dict(kv_lora_rank=r, scale=0.2, query_start_loc=qsl, kv_scale=mla.scale)
        for scale in ([None] if fp8 is None else [mla.scale, torch.tensor([float("nan")])]):
            kwargs["kv_scale"] = scale
            out, lse = dispatch.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, **kwargs)
            ref_out, ref_lse = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables,
                                                             mla.seq_lens, **kwargs)
            assert_close(out, ref_out, bf16, msg="out")
            assert_close(lse, ref_lse, f32, msg="lse")


def test_merge_attention_states_nonfinite():
    """Every pair of lse kinds: ±inf = empty (not read), NaN = NaN row, finite read even when its weight
    underflows."""
    kinds = [0.7, -150.0, float("-inf"), float("inf"), float("nan")]
    pairs = [(a, b) for a in kinds for b in kinds]
    gen = generator(12)
    out_a = randn(len(pairs), 2, 8, gen=gen, dtype=f16)
    out_b = randn(len(pairs), 2, 8, gen=gen, dtype=f16)
    lse_a = torch.tensor([[a, a] for a, _ in pairs])
    lse_b = torch.tensor([[b, b] for _, b in pairs])
    out_a[:, 0, ::3] = torch.where(lse_a[:, :1].isfinite(), out_a[:, 0, ::3], float("nan"))
    out_b[:, 0, 1::3] = torch.where(lse_b[:, :1].isfinite(), out_b[:, 0, 1::3], float("inf"))
    out_a[:, 1, 5] = float("nan")
    out, lse = dispatch.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attention_states(upcast(out_a), lse_a, upcast(out_b), lse_b)
    assert_close(out, ref_out, f16, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


# ----------------------------------------------------------------------------------------------------
# registration, validation, and the real device (Apple Silicon only)
# ----------------------------------------------------------------------------------------------------


def test_mps_kernels_registered():
    """Every op has an MPS kernel (the dispatch functions above) and keeps its CPU kernel."""
    import kvkernels.metal

    for op in kvkernels.metal.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvkernels::{op}", "MPS"), op
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvkernels::{op}", "CPU"), op


@pytest.mark.parametrize("call, message", [
    (lambda kv, q: dispatch.paged_attention(q.to(torch.float64), kv.key_cache, kv.value_cache, kv.block_tables,
                                            kv.seq_lens), "kvkernels.paged_attention: query: expected float32"),
    (lambda kv, q: dispatch.paged_attention(q[..., :12], kv.key_cache[..., :12], kv.value_cache[..., :12],
                                            kv.block_tables, kv.seq_lens),
     "kvkernels.paged_attention: key_cache: head_dim must be a positive multiple of 8"),  # as the CPU names it
    (lambda kv, q: dispatch.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables.fill_(99), kv.seq_lens),
     "kvkernels.paged_attention: block_tables: block id out of range"),
    (lambda kv, q: dispatch.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens + 100),
     "kvkernels.gather_kv: seq_lens: a sequence is longer than its block table"),
    (lambda kv, q: dispatch.reshape_and_cache(q[:, :2], q[:, :2], kv.key_cache, kv.value_cache,
                                              torch.tensor([0, 1, 2, 10**6])),
     "kvkernels.reshape_and_cache: slot_mapping: slot out of range"),
    (lambda kv, q: dispatch.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                            scale=float("nan")), "kvkernels.paged_attention: scale: must be finite"),
    (lambda kv, q: dispatch.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                            soft_cap=float("inf")), "kvkernels.paged_attention: soft_cap: must be >= 0"),
])
def test_validation(call, message):
    kv = make_paged_kv(seq_lens=[3, 5, 1, 2], num_kv_heads=2, head_dim=16, block_size=2, seed=1)
    q = make_query(4, 4, 16, f32, generator(2))
    before = kv.key_cache.clone()
    with pytest.raises(RuntimeError, match=message):
        call(kv, q)
    assert_bytes_equal(kv.key_cache, before, msg="cache unchanged")


mps = pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple GPU (MPS)")


@mps
@pytest.mark.parametrize("dtype", [f32, f16])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_mps_paged_attention(dtype, mode):  # pragma: no cover (never ran: no Apple hardware here)
    kv, query, qsl = attention_case(mode, [5, 0, 11, 1], dtype=dtype, hq=4, hkv=2, d=64, b=4)
    dev = torch.device("mps")
    out, lse = torch.ops.kvkernels.paged_attention(query.to(dev), kv.key_cache.to(dev), kv.value_cache.to(dev),
                                                   kv.block_tables.to(dev), kv.seq_lens.to(dev),
                                                   None if qsl is None else qsl.to(dev))
    ref_out, ref_lse = reference.paged_attention(upcast(query), *kv.ref_caches(), kv.block_tables, kv.seq_lens, qsl)
    assert_close(out.cpu(), ref_out, dtype, msg="out")
    assert_close(lse.cpu(), ref_lse, f32, msg="lse")


@mps
def test_mps_cache_ops():  # pragma: no cover (never ran: no Apple hardware here)
    dev = torch.device("mps")
    kv = make_paged_kv(seq_lens=[5, 0, 11], num_kv_heads=2, head_dim=32, block_size=4, dtype=f16)
    k, v = (t.to(dev) for t in kv_views(tuple(s.to(dev) for s in kv.storage), kv.layout))
    got = torch.ops.kvkernels.gather_kv(k, v, kv.block_tables.to(dev), kv.seq_lens.to(dev))
    want = reference.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    for g, w in zip(got, want):
        assert_bytes_equal(g.cpu(), w)
    cache = randn(6, 4, 2, 8, gen=generator(1)).to(dev)
    mapping = torch.tensor([[0, 3], [1, 4]], device=dev)
    ref = cache.cpu()
    torch.ops.kvkernels.copy_blocks(cache, mapping)
    reference.copy_blocks(ref, mapping.cpu())
    assert_bytes_equal(cache.cpu(), ref)
