"""MLA latent-cache ops: concat_and_cache_mla, mla_decompress, mla_paged_attention (docs/ops.md)."""

import pytest
import torch

from helpers import (DEVICES, FP8_DTYPES, assert_bytes_equal, assert_close, dense_attention, generator,
                     make_paged_mla, make_query, poison, quantize, query_start_loc, randn, require_kernel, upcast)
from kvkernels import ops, reference

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def varlen_q_lens(seq_lens):
    """Full prefill, chunked prefill, one query, none (cycling), never more than seq_len."""
    pattern = (lambda n: n, lambda n: (n + 1) // 2, lambda n: min(n, 1), lambda n: 0)
    return [pattern[i % 4](n) for i, n in enumerate(seq_lens)]


def make_mla_case(mode, seq_lens, dtype, fp8, r, p, h, b, strided=None, seed=4, q_lens=None):
    """A paged latent cache of ``seq_lens`` (helpers.make_paged_mla) and queries for ``mode``: one per
    sequence (decode) or ``q_lens`` (default ``varlen_q_lens``) with their ``query_start_loc``.
    Shared by the CUDA tests (tests/test_cuda_mla.py) and the emulated ones (tests/test_cuda_emulated.py)."""
    mla = make_paged_mla(seq_lens, r, p, b, dtype=dtype, fp8=fp8, seed=seed)
    if q_lens is None or mode == "decode":
        q_lens = [1] * len(seq_lens) if mode == "decode" else varlen_q_lens(seq_lens)
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    q = make_query(sum(q_lens), h, r + p, dtype, generator(seed + 1), strided=strided)
    return mla, q, qsl


def random_weight(rows, cols, dtype, gen):
    return randn(rows, cols, gen=gen, std=cols ** -0.5, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# concat_and_cache_mla
# ----------------------------------------------------------------------------------------------------

# id: dtype, fp8, R, P, strided cache rows
CONCAT_CASES = {
    "f32-R64-P16": (f32, None, 64, 16, False),
    "bf16-R512-P64-strided": (bf16, None, 512, 64, True),
    "f16-R64-P16": (f16, None, 64, 16, False),
    "bf16->e4m3-R512-P64": (bf16, "e4m3", 512, 64, False),
    "f32->e5m2-R64-P16-strided": (f32, "e5m2", 64, 16, True),
}


@pytest.mark.parametrize("case", CONCAT_CASES.values(), ids=CONCAT_CASES.keys())
@pytest.mark.parametrize("device", DEVICES)
def test_concat_and_cache_mla(case, device):
    require_kernel("concat_and_cache_mla", device)
    check_concat_and_cache_mla(case, device)


def check_concat_and_cache_mla(case, device="cpu", op=ops.concat_and_cache_mla):
    """Inputs built on the CPU, the kernel run on ``device`` (the allocation copied whole)."""
    dtype, fp8, r, p, strided = case
    gen = generator(1)
    n, b, t = 5, 4, 13
    cache_dtype = FP8_DTYPES[fp8] if fp8 else dtype
    alloc = torch.randint(0, 256, (n, b, r + p + (8 if strided else 0)), generator=gen, dtype=torch.uint8)
    alloc = alloc.view(cache_dtype).clone() if fp8 else randn(*alloc.shape, gen=gen, dtype=dtype)
    initial = alloc.clone()
    ref_alloc = alloc.clone()
    cache, ref_cache = alloc[..., :r + p], ref_alloc[..., :r + p]

    # kv_c and k_pe are the two parts of one projection output [T, R + P]: non-contiguous inputs.
    fused = randn(t, r + p, gen=gen, dtype=dtype, std=2.0)
    kv_c, k_pe = fused[:, :r], fused[:, r:]
    slots = torch.randperm(n * b, generator=gen)[:t]
    slots[[2, 7]] = -1
    scale = torch.tensor([0.03]) if fp8 else None

    dev_alloc, dev_fused = alloc.to(device), fused.to(device)
    op(dev_fused[:, :r], dev_fused[:, r:], dev_alloc[..., :r + p], slots.to(device),
       scale=None if scale is None else scale.to(device))
    alloc = dev_alloc.cpu()
    cache = alloc[..., :r + p]
    reference.concat_and_cache_mla(kv_c, k_pe, ref_cache, slots, scale=scale)
    assert_bytes_equal(alloc, ref_alloc, msg="vs reference")

    written = slots >= 0
    blk, off = slots[written] // b, slots[written] % b
    expected_rows = quantize(fused[written], scale, cache_dtype) if fp8 else fused[written]
    assert_bytes_equal(cache[blk, off], expected_rows, msg="written rows")
    untouched = torch.ones(n, b, dtype=torch.bool)
    untouched[blk, off] = False
    assert_bytes_equal(alloc[untouched], initial[untouched], msg="untouched slots")
    if strided:  # the padding after each row is never written
        assert_bytes_equal(alloc[..., r + p:], initial[..., r + p:], msg="row padding")


# ----------------------------------------------------------------------------------------------------
# mla_decompress
# ----------------------------------------------------------------------------------------------------

# id: w dtype, cache fp8, R, P, heads, dn, dv, RMSNorm, block size, pass num_tokens
DECOMPRESS_CASES = {
    "f32-R64-P16-H2": (f32, None, 64, 16, 2, 16, 24, False, 16, False),
    "bf16-R64-P16-H3-norm-b3": (bf16, None, 64, 16, 3, 16, 16, True, 3, True),
    "f32-R512-P64-H4-norm-b64": (f32, None, 512, 64, 4, 32, 48, True, 64, False),
    "bf16-R512-P64-H2-d128": (bf16, None, 512, 64, 2, 128, 128, False, 16, True),
    "f16-R512-P16-H2-norm": (f16, None, 512, 16, 2, 64, 32, True, 16, False),
    "e4m3-f32-R512-P64-H2-norm": (f32, "e4m3", 512, 64, 2, 64, 64, True, 64, False),
    "e5m2-bf16-R64-P16-H4-num_tokens": (bf16, "e5m2", 64, 16, 4, 16, 16, False, 16, True),
}


@pytest.mark.parametrize("case", DECOMPRESS_CASES.values(), ids=DECOMPRESS_CASES.keys())
def test_mla_decompress(case):
    dtype, fp8, r, p, h, dn, dv, norm, b, with_num_tokens = case
    gen = generator(2)
    seq_lens = [5, 0, 70, 1, b]
    mla = make_paged_mla(seq_lens, r, p, b, dtype=dtype, fp8=fp8, seed=3, strided=(b == 3))
    w = random_weight(h * (dn + dv), r, dtype, gen)
    norm_weight = (1 + 0.5 * randn(r, gen=gen)).to(dtype) if norm else None
    kwargs = dict(kv_lora_rank=r, qk_nope_head_dim=dn, v_head_dim=dv, norm_eps=1e-5, scale=mla.scale,
                  num_tokens=sum(seq_lens) if with_num_tokens else None)
    key, value = ops.mla_decompress(mla.kv_cache, mla.block_tables, mla.seq_lens, w, norm_weight=norm_weight,
                                    **kwargs)
    ref_key, ref_value = reference.mla_decompress(mla.ref_cache(), mla.block_tables, mla.seq_lens, w,
                                                  norm_weight=upcast(norm_weight), **kwargs)
    t = sum(seq_lens)
    assert key.dtype == value.dtype == dtype
    assert key.shape == (t, h, dn + p) and value.shape == (t, h, dv)
    assert key.is_contiguous() and value.is_contiguous()
    assert_close(key, ref_key, dtype, msg="key")
    assert_close(value, ref_value, dtype, msg="value")
    # k_pe is copied into every head unchanged (dequantized and rounded once for fp8 caches).
    k_pe = torch.cat(mla.rows)[:, None, r:].expand(-1, h, -1).to(dtype)
    assert_bytes_equal(key[..., dn:], k_pe, msg="k_pe part of key")


def decompress_rounding_case(dtype=bf16):
    """An mla_decompress whose result depends on docs/ops.md's rounding of the normalised latent to
    w_kv_b's dtype: each output row is the difference of two latent columns whose float32 values
    differ by 2^-7 relative (norm weights 1 and 1 + 2^-7 on equal cache columns), so rounding each to
    bf16 first changes the result by up to ~30%. Returns (mla, w, norm_weight, kwargs) and the
    reference outputs with and without the rounding."""
    r, p, h, dn, dv = 64, 16, 2, 8, 8
    mla = make_paged_mla([9, 4], r, p, 16, dtype=dtype, seed=11)
    cache = mla.kv_cache
    cache[..., 1:r:2] = cache[..., 0:r:2]  # columns 2i and 2i + 1 equal (unused slots stay NaN)
    norm_weight = torch.ones(r, dtype=dtype)
    norm_weight[1::2] = 1 + 2.0 ** -7
    # Row n of w_kv_b picks latent columns 2j and 2j + 1 with +1 / -1 (n = j within each head's rows).
    w = torch.zeros(h * (dn + dv), r, dtype=dtype)
    for n in range(h * (dn + dv)):
        j = (n * 5 + 3) % (r // 2)
        w[n, 2 * j], w[n, 2 * j + 1] = 1.0, -1.0
    kwargs = dict(kv_lora_rank=r, qk_nope_head_dim=dn, v_head_dim=dv, norm_eps=1e-5, norm_weight=norm_weight)
    rounded = reference.mla_decompress(upcast(cache), mla.block_tables, mla.seq_lens, w, **kwargs)
    exact = reference.mla_decompress(upcast(cache), mla.block_tables, mla.seq_lens, upcast(w), **kwargs)
    return mla, w, kwargs, rounded, exact


def check_decompress_rounding(op):
    """``op`` (ops.mla_decompress's signature) rounds the latent as docs/ops.md says: its result is the
    rounded reference's to bf16 output precision, far from the unrounded one (which the case makes
    differ by percents)."""
    mla, w, kwargs, (ref_key, ref_value), (exact_key, _) = decompress_rounding_case()
    key, value = op(mla.kv_cache, mla.block_tables, mla.seq_lens, w, **kwargs)
    gap = ((ref_key.double() - exact_key.double()).abs() / exact_key.double().abs().clamp_min(1e-30))[..., :8]
    assert gap.max() > 0.05, "the case does not tell the two roundings apart"
    assert_close(key, ref_key.double(), bf16, rtol=2 ** -7, atol=0, msg="key")
    assert_close(value, ref_value.double(), bf16, rtol=2 ** -7, atol=0, msg="value")


def test_mla_decompress_rounds_the_latent_to_the_weight_dtype():
    check_decompress_rounding(ops.mla_decompress)


# ----------------------------------------------------------------------------------------------------
# mla_paged_attention
# ----------------------------------------------------------------------------------------------------

# id: q dtype, cache fp8, R, P, heads, block size, strided q
ATTN_CASES = {
    "bf16-R512-P64-H16-b64": (bf16, None, 512, 64, 16, 64, None),
    "f32-R512-P64-H8-b16": (f32, None, 512, 64, 8, 16, "fused"),
    "f32-R64-P16-H4-b16": (f32, None, 64, 16, 4, 16, None),
    "f16-R64-P16-H4-b64": (f16, None, 64, 16, 4, 64, "transposed"),
    "e4m3-bf16-R512-P64-H16-b64": (bf16, "e4m3", 512, 64, 16, 64, None),
    "e5m2-f32-R64-P16-H4-b16": (f32, "e5m2", 64, 16, 4, 16, "fused"),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("case", ATTN_CASES.values(), ids=ATTN_CASES.keys())
def test_mla_paged_attention(case, mode):
    dtype, fp8, r, p, h, b, strided = case
    seq_lens = [b + 1, 0, 2 * b + 5, 1, b]
    mla = make_paged_mla(seq_lens, r, p, b, dtype=dtype, fp8=fp8, seed=4)
    q_lens = [1] * len(seq_lens) if mode == "decode" else varlen_q_lens(seq_lens)
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    q = make_query(sum(q_lens), h, r + p, dtype, generator(5), strided=strided)
    scale = (128 + p) ** -0.5
    kwargs = dict(kv_lora_rank=r, scale=scale, query_start_loc=qsl, kv_scale=mla.scale)
    out, lse = ops.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, **kwargs)
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables, mla.seq_lens,
                                                     **kwargs)
    t = sum(q_lens)
    assert out.dtype == dtype and out.shape == (t, h, r) and out.is_contiguous()
    assert lse.dtype == f32 and lse.shape == (t, h)
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")  # float32 whatever the q dtype
    if mode == "decode":  # the empty sequence: out = 0, lse = -inf
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("fp8", [None, "e4m3"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_absorbed_equals_decompress_then_attend(mode, fp8):
    """MLA with W_UK absorbed into q and W_UV applied to the latent output equals ordinary attention over
    the keys/values that mla_decompress produces (DeepSeek-V2's two equivalent formulations)."""
    gen = generator(6)
    r, p, h, dn, dv, b = 64, 16, 4, 32, 24, 16
    seq_lens = [37, 1, 16, 0, 50]
    mla = make_paged_mla(seq_lens, r, p, b, dtype=f32, fp8=fp8, seed=7)
    w = random_weight(h * (dn + dv), r, f32, gen)
    w_k, w_v = w.double().reshape(h, dn + dv, r).split([dn, dv], dim=1)  # [H, dn, R], [H, dv, R]
    q_lens = [1] * len(seq_lens) if mode == "decode" else varlen_q_lens(seq_lens)
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    q_nope = randn(sum(q_lens), h, dn, gen=gen)
    q_pe = randn(sum(q_lens), h, p, gen=gen)
    scale = (dn + p) ** -0.5

    q_absorbed = torch.cat([torch.einsum("thd,hdr->thr", q_nope.double(), w_k).float(), q_pe], dim=-1)
    out_latent, lse = ops.mla_paged_attention(q_absorbed, mla.kv_cache, mla.block_tables, mla.seq_lens,
                                              kv_lora_rank=r, scale=scale, query_start_loc=qsl, kv_scale=mla.scale)
    out = torch.einsum("thr,hvr->thv", out_latent.double(), w_v)

    key, value = ops.mla_decompress(mla.kv_cache, mla.block_tables, mla.seq_lens, w, kv_lora_rank=r,
                                    qk_nope_head_dim=dn, v_head_dim=dv, scale=mla.scale)
    q_full = torch.cat([q_nope, q_pe], dim=-1)
    expected_out = poison(torch.empty(sum(q_lens), h, dv, dtype=torch.float64))
    expected_lse = poison(torch.empty(sum(q_lens), h, dtype=torch.float64))
    q_start = k_start = 0
    for q_len, seq_len in zip(q_lens, seq_lens):
        qs, ks = slice(q_start, q_start + q_len), slice(k_start, k_start + seq_len)
        expected_out[qs], expected_lse[qs] = dense_attention(q_full[qs], key[ks], value[ks], scale)
        q_start, k_start = q_start + q_len, k_start + seq_len
    assert_close(out, expected_out, f32, rtol=2e-5, atol=2e-5, msg="W_UV(absorbed out) vs attention over decompressed")
    assert_close(lse, expected_lse, f32, rtol=2e-5, atol=2e-5, msg="lse")
