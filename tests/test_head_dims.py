"""Head dims of paged attention (docs/ops.md): a value head dim Dv different from the key's Dk, and head
dims up to 512, on every CPU ISA path against the float64 reference.

Dv != Dk is what DeepSeek-style MLA prefill runs over decompressed K/V (qk 192 = 128 + 64 rope, v 128):
the cache writer (reshape_and_cache with key [T, H, Dk] and value [T, H, Dv]), the reader (gather_kv
returns each in its own width) and paged_attention (out [T, Hq, Dv]) all take it. The showcase at the end
runs that pipeline end to end: mla_decompress -> paged caches -> chunked-prefill paged_attention.
avx512amx runs only on CPUs with AMX (not this AMD machine): there its cases skip with the reason.
The Metal kernels (emulated) are at the end; the CUDA kernels are in tests/test_cuda_emulated.py.
"""

import math

import pytest
import torch

from helpers import (assert_bytes_equal, assert_close, dense_attention, generator, make_block_tables,
                     make_paged_kv, make_paged_mla, make_query, poison, query_start_loc, randn,
                     token_slots, upcast, use_isa)
from test_attention import features, run_paged_attention, varlen_q_lens
from kvkernels import ops, reference

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
ISAS = ["avx512amx", "avx512bf16", "avx512vbmi", "avx512", "avx2", "portable"]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    return use_isa(monkeypatch, request.param)


def dv_case(mode, seq_lens, *, dtype, hq, hkv, dk, dv, b, layout="NHD", fp8=None, per_head=False, seed=0,
            strided=None):
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=dk, head_dim_v=dv, block_size=b,
                       dtype=dtype, layout=layout, fp8=fp8, per_head_scale=per_head, seed=seed)
    q_lens = [1] * len(seq_lens) if mode == "decode" else varlen_q_lens(seq_lens)
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    query = make_query(sum(q_lens), hq, dk, dtype, generator(seed + 1), strided=strided)
    return kv, query, qsl


# id: dtype, fp8, per-head scales, layout, Hq, Hkv, Dk, Dv, B. Dv half, double, a non-power-of-two
# multiple of Dk; smaller and larger than Dk in the stacked layout (whose views are slices of a
# max(Dk, Dv)-wide NaN-filled allocation, so a read past either head dim shows as NaN); head dims 512.
DV_CONFIGS = {
    "f32-NHD-gqa4-k64-v32-b16": (f32, None, False, "NHD", 8, 2, 64, 32, 16),
    "f32-HND-mha-k64-v128-b3": (f32, None, False, "HND", 4, 4, 64, 128, 3),
    "bf16-NHD-gqa4-k192-v128-b16": (bf16, None, False, "NHD", 8, 2, 192, 128, 16),
    "bf16-stacked-gqa2-k128-v64-b16": (bf16, None, False, "stacked", 4, 2, 128, 64, 16),
    "f16-stacked-mqa-k32-v96-b5": (f16, None, False, "stacked", 4, 1, 32, 96, 5),
    "f16-NHD-mqa-k32-v256-b5": (f16, None, False, "NHD", 4, 1, 32, 256, 5),
    "f32-NHD-gqa2-k8-v16-b1": (f32, None, False, "NHD", 4, 2, 8, 16, 1),
    "f32-NHD-gqa2-k40-v8-b16": (f32, None, False, "NHD", 4, 2, 40, 8, 16),
    "e4m3-head-bf16-NHD-gqa4-k128-v64-b16": (bf16, "e4m3", True, "NHD", 8, 2, 128, 64, 16),
    "e5m2-tensor-f32-HND-gqa2-k64-v192-b16": (f32, "e5m2", False, "HND", 4, 2, 64, 192, 16),
    "e4m3-khead-vtensor-f16-NHD-k192-v128-b16": (f16, "e4m3", (True, False), "NHD", 8, 2, 192, 128, 16),
    "bf16-NHD-gqa4-k512-v512-b16": (bf16, None, False, "NHD", 8, 2, 512, 512, 16),
    "f32-NHD-gqa2-k512-v128-b16": (f32, None, False, "NHD", 4, 2, 512, 128, 16),
    "f16-HND-mha-k128-v512-b3": (f16, None, False, "HND", 2, 2, 128, 512, 3),
    "e4m3-tensor-bf16-NHD-gqa4-k512-v512-b16": (bf16, "e4m3", False, "NHD", 8, 2, 512, 512, 16),
    "f32-NHD-mha-k504-v504-b16": (f32, None, False, "NHD", 2, 2, 504, 504, 16),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", DV_CONFIGS.values(), ids=DV_CONFIGS.keys())
def test_head_dims(isa, config, mode):
    dtype, fp8, per_head, layout, hq, hkv, dk, dv, b = config
    # Partial and exactly-full last blocks, a one-token and an empty sequence; in varlen a full prefill
    # long enough for the tile kernels (16+ rows per kv head) on AVX-512.
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b]
    kv, query, qsl = dv_case(mode, seq_lens, dtype=dtype, hq=hq, hkv=hkv, dk=dk, dv=dv, b=b, layout=layout,
                             fp8=fp8, per_head=per_head)
    out, lse = run_paged_attention(kv, query, qsl)
    assert out.shape == (query.shape[0], hq, dv)
    if mode == "decode":  # the empty sequence's query: out = 0, lse = -inf
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isneginf(lse[1]).all()


# id: dtype, fp8, Hkv, Dk, Dv, B (Hq = 8)
FEATURE_DV = {
    "f32-k64-v32-b16": (f32, None, 2, 64, 32, 16),
    "bf16-k192-v128-b16": (bf16, None, 2, 192, 128, 16),
    "e4m3-f16-k64-v128-b3": (f16, "e4m3", 1, 64, 128, 3),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("feature", list(features(16, 64)))
@pytest.mark.parametrize("config", FEATURE_DV.values(), ids=FEATURE_DV.keys())
def test_head_dims_features(config, feature, mode):
    """Window edges, soft cap, ALiBi, sinks, a scale (the default is Dk ** -0.5) with Dv != Dk."""
    dtype, fp8, hkv, dk, dv, b = config
    seq_lens = [2 * b, 2 * b + 1, 3 * b - 1, 1, 0, b, 40]
    kv, query, qsl = dv_case(mode, seq_lens, dtype=dtype, hq=8, hkv=hkv, dk=dk, dv=dv, b=b, fp8=fp8, seed=3)
    kwargs = features(b, dk)[feature]
    out, lse = run_paged_attention(kv, query, qsl, **kwargs)
    if mode == "decode":  # sequence 4 is empty
        assert torch.equal(out[4], torch.zeros_like(out[4]))


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", FEATURE_DV.values(), ids=FEATURE_DV.keys())
def test_head_dims_all_features_every_isa(isa, config, mode):
    dtype, fp8, hkv, dk, dv, b = config
    seq_lens = [2 * b, 2 * b + 1, 3 * b - 1, 1, 0, b, 40]
    kv, query, qsl = dv_case(mode, seq_lens, dtype=dtype, hq=8, hkv=hkv, dk=dk, dv=dv, b=b, fp8=fp8, seed=5)
    run_paged_attention(kv, query, qsl, **features(b, dk)["all"])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dk,dv,dtype", [(192, 128, bf16), (64, 128, f32), (512, 256, bf16)])
def test_head_dims_long_context_splits(isa, dk, dv, dtype, threads):
    """One sequence, one kv head, a long context: the keys are split over threads and merged (plan.dv
    wide partials), in decode and in a chunked prefill."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for mode, q_len in (("decode", 1), ("varlen", 24)):
            kv = make_paged_kv(seq_lens=[1500], num_kv_heads=1, head_dim=dk, head_dim_v=dv, block_size=16,
                               dtype=dtype, seed=9)
            qsl = None if mode == "decode" else query_start_loc([q_len])
            query = make_query(q_len, 4, dk, dtype, generator(10))
            run_paged_attention(kv, query, qsl, window_left=1200)
    finally:
        torch.set_num_threads(old)


def _poke(cache, blocks, block_size, pos, head, col, value):
    cache[blocks[pos // block_size], pos % block_size, head, col] = value


@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_nonfinite_values_in_columns_past_dk(isa, mode):
    """NaN / inf in value columns past Dk reach exactly those output columns of the rows that see them
    (the kernels must not cut V at Dk); in keys nobody sees they change nothing."""
    b, dk, dv = 16, 32, 96
    seq_lens = [40, 21, 33]
    kv, query, qsl = dv_case(mode, seq_lens, dtype=f32, hq=4, hkv=2, dk=dk, dv=dv, b=b, seed=21)
    _poke(kv.value_cache, kv.blocks[0], b, 3, 0, dk + 5, float("nan"))
    _poke(kv.value_cache, kv.blocks[1], b, 20, 1, dv - 1, float("inf"))
    _poke(kv.value_cache, kv.blocks[2], b, 30, 0, dk, float("-inf"))
    _poke(kv.value_cache, kv.blocks[2], b, 32, 1, dk + 1, float("nan"))
    out, _ = run_paged_attention(kv, query, qsl)
    assert torch.isnan(out[..., dk + 5]).any() and torch.isinf(out[..., dv - 1]).any()
    assert torch.isfinite(out[..., :dk]).all()


@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_value_cache_a_prefix_view_of_the_key_cache(isa, mode):
    """value_cache = key_cache[..., :Dv] (one allocation, the same first byte; read-only ops may take
    overlapping views): the kernels that treat such a V as the prefix of each K row (MLA's layout) and
    those that read it on its own give the same answer."""
    kv, query, qsl = dv_case(mode, [40, 0, 17, 33], dtype=bf16, hq=8, hkv=2, dk=128, dv=128, b=16, seed=60)
    value_cache = kv.key_cache[..., :64]
    out, lse = ops.paged_attention(query, kv.key_cache, value_cache, kv.block_tables, kv.seq_lens, qsl)
    ref_out, ref_lse = reference.paged_attention(upcast(query), upcast(kv.key_cache), upcast(value_cache),
                                                 kv.block_tables, kv.seq_lens, qsl)
    assert_close(out, ref_out, bf16, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


# ----------------------------------------------------------------------------------------------------
# the cache writer and reader
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND", "stacked"])
@pytest.mark.parametrize("dtype,fp8", [(f32, None), (bf16, None), (f16, "e4m3"), (bf16, "e5m2")])
@pytest.mark.parametrize("dk,dv", [(192, 128), (24, 64), (512, 8)])
def test_write_and_gather(isa, dk, dv, dtype, fp8, layout):
    """reshape_and_cache writes key [T, H, Dk] and value [T, H, Dv] into their own caches (bit for bit
    as the reference, fp8 included); gather_kv returns them in their own widths."""
    b, h = 16, 2
    kv = make_paged_kv(seq_lens=[5, 17, 0, 33], num_kv_heads=h, head_dim=dk, head_dim_v=dv, block_size=b,
                       dtype=dtype, layout=layout, fp8=fp8, per_head_scale=(False, True), seed=4)
    gen = generator(5)
    # New tokens into free slots of the last blocks and into a spare block, a padding token (-1).
    slots = torch.tensor([17 % b + kv.blocks[1][1] * b, 40 % b + kv.blocks[3][2] * b, -1,
                          (kv.num_blocks - 1) * b + 3])
    key, value = randn(4, h, dk, gen=gen, dtype=dtype), randn(4, h, dv, gen=gen, dtype=dtype)
    ref_k, ref_v = kv.key_cache.clone(), kv.value_cache.clone()
    ops.reshape_and_cache(key, value, kv.key_cache, kv.value_cache, slots, **kv.scales)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots, **kv.scales)
    assert_bytes_equal(kv.key_cache, ref_k, "key_cache")
    assert_bytes_equal(kv.value_cache, ref_v, "value_cache")
    for out_dtype in (None, f32):
        got = ops.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **kv.scales,
                            num_tokens=int(kv.seq_lens.sum()), out_dtype=out_dtype)
        want = reference.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **kv.scales,
                                   out_dtype=out_dtype)
        assert got[0].shape[-1] == dk and got[1].shape[-1] == dv
        assert_bytes_equal(got[0], want[0], "key")
        assert_bytes_equal(got[1], want[1], "value")


# ----------------------------------------------------------------------------------------------------
# the showcase: DeepSeek-style prefill over decompressed K/V (qk 192 = 128 + 64 rope, v 128)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_deepseek_prefill_pipeline(isa, dtype):
    """mla_decompress of the latent cache -> reshape_and_cache into paged K [.., 192] / V [.., 128] caches
    (blocks of their own, shuffled) -> chunked-prefill paged_attention, against the reference at each step
    and against a dense float64 attention over the decompressed K/V (no paging at all)."""
    r, rope, dn, dv, hq, b = 64, 64, 128, 128, 4, 16
    seq_lens = [37, 64, 5, 20]
    mla = make_paged_mla(seq_lens, r, rope, block_size=b, dtype=dtype, seed=30)
    gen = generator(31)
    w_kv_b = randn(hq * (dn + dv), r, gen=gen, dtype=dtype, std=r ** -0.5)
    norm_weight = (1 + 0.1 * randn(r, gen=gen)).to(dtype)
    total = sum(seq_lens)
    key, value = ops.mla_decompress(mla.kv_cache, mla.block_tables, mla.seq_lens, w_kv_b, kv_lora_rank=r,
                                    qk_nope_head_dim=dn, v_head_dim=dv, norm_weight=norm_weight,
                                    num_tokens=total)
    ref_key, ref_value = reference.mla_decompress(mla.ref_cache(), mla.block_tables, mla.seq_lens, w_kv_b,
                                                  kv_lora_rank=r, qk_nope_head_dim=dn, v_head_dim=dv,
                                                  norm_weight=norm_weight)
    assert key.shape == (total, hq, dn + rope) and value.shape == (total, hq, dv)
    assert_close(key, ref_key, dtype, msg="key")
    assert_close(value, ref_value, dtype, msg="value")

    # Paged K/V caches with their own (shuffled) blocks; every slot without a token stays NaN.
    table, num_blocks, blocks = make_block_tables(seq_lens, b, generator(32))
    key_cache = poison(torch.empty(num_blocks, b, hq, dn + rope, dtype=dtype))
    value_cache = poison(torch.empty(num_blocks, b, hq, dv, dtype=dtype))
    slots = torch.cat([token_slots(blocks[i], n, b) for i, n in enumerate(seq_lens)])
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    # Chunked prefill: each sequence's last q_len tokens query all of its keys (bottom-right causal).
    q_lens = [37, 20, 1, 7]
    qsl = query_start_loc(q_lens)
    query = make_query(sum(q_lens), hq, dn + rope, dtype, generator(33))
    scale = (dn + rope) ** -0.5
    out, lse = ops.paged_attention(query, key_cache, value_cache, table, lens, qsl, scale=scale)
    ref_out, ref_lse = reference.paged_attention(upcast(query), upcast(key_cache), upcast(value_cache), table,
                                                 lens, qsl, scale=scale)
    assert out.shape == (sum(q_lens), hq, dv)
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    # An independent oracle: dense attention over each sequence's decompressed K/V.
    starts = [0] + list(torch.tensor(seq_lens).cumsum(0)[:-1].tolist())
    for i, (s0, n) in enumerate(zip(starts, seq_lens)):
        q = query[int(qsl[i]):int(qsl[i + 1])]
        dense_out, dense_lse = dense_attention(q, key[s0:s0 + n], value[s0:s0 + n], scale)
        assert_close(out[int(qsl[i]):int(qsl[i + 1])], dense_out, dtype, msg=f"dense out, sequence {i}")
        assert_close(lse[int(qsl[i]):int(qsl[i + 1])], dense_lse, f32, msg=f"dense lse, sequence {i}")


def test_paged_kv_cache_with_a_narrower_value():
    """PagedKVCache keeps one head dim for K and V (one stacked allocation): with Dv < Dk, allocate
    head_dim = Dk and pass the value view's slice [..., :Dv] (docs/api.md); the ops read strided views."""
    import kvkernels

    dk, dv, h, b = 64, 32, 2, 16
    cache = kvkernels.PagedKVCache(num_layers=1, num_kv_heads=h, head_dim=dk, num_blocks=8, block_size=b,
                                   dtype=f32)
    kc, vc = cache.key_cache(0), cache.value_cache(0)[..., :dv]
    seq_lens = [21, 9]
    table, _, blocks = make_block_tables(seq_lens, b, generator(40), extra_blocks=8 - 3)
    slots = torch.cat([token_slots(blocks[i], n, b) for i, n in enumerate(seq_lens)])
    gen = generator(41)
    key, value = randn(30, h, dk, gen=gen), randn(30, h, dv, gen=gen)
    ops.reshape_and_cache(key, value, kc, vc, slots)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = randn(2, 4, dk, gen=gen)
    out, lse = ops.paged_attention(query, kc, vc, table, lens)
    ref_out, ref_lse = reference.paged_attention(upcast(query), upcast(kc), upcast(vc), table, lens)
    assert out.shape == (2, 4, dv)
    assert_close(out, ref_out, f32, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")


# ----------------------------------------------------------------------------------------------------
# Metal (the MSL emulator on CPU tensors; docs/design.md §10: never run on Apple hardware)
# ----------------------------------------------------------------------------------------------------


# id: dtype, fp8, Hkv, Dk, Dv, B (Hq = 8, the ALiBi slopes and sinks of test_attention.features)
METAL_CONFIGS = {
    "f32-k64-v32": (f32, None, 2, 64, 32, 5),
    "f16-k32-v96-stacked": (f16, None, 1, 32, 96, 4),
    "e4m3-bf16-k192-v128": (bf16, "e4m3", 2, 192, 128, 4),
    "f32-k512-v512": (f32, None, 1, 512, 512, 4),
    "bf16-k128-v512": (bf16, None, 2, 128, 512, 3),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", METAL_CONFIGS.values(), ids=METAL_CONFIGS.keys())
def test_metal_head_dims(config, mode):
    from kvkernels.metal import dispatch

    dtype, fp8, hkv, dk, dv, b = config
    layout = "stacked" if dk == 32 else "NHD"
    kv, query, qsl = dv_case(mode, [b + 1, 0, 2 * b - 1, 1], dtype=dtype, hq=8, hkv=hkv, dk=dk, dv=dv, b=b,
                             fp8=fp8, layout=layout, seed=50)
    run_paged_attention(kv, query, qsl, op=dispatch.paged_attention, **features(b, dk)["all"])


@pytest.mark.parametrize("fp8", [None, "e5m2"])
def test_metal_write_and_gather(fp8):
    from kvkernels.metal import dispatch

    b, h, dk, dv = 4, 2, 24, 40
    kv = make_paged_kv(seq_lens=[5, 0, 9], num_kv_heads=h, head_dim=dk, head_dim_v=dv, block_size=b,
                       dtype=f16, fp8=fp8, per_head_scale=(True, False), seed=6)
    gen = generator(7)
    slots = torch.tensor([5 % b + kv.blocks[0][1] * b, -1, (kv.num_blocks - 1) * b + 2])
    key, value = randn(3, h, dk, gen=gen, dtype=f16), randn(3, h, dv, gen=gen, dtype=f16)
    ref_k, ref_v = kv.key_cache.clone(), kv.value_cache.clone()
    dispatch.reshape_and_cache(key, value, kv.key_cache, kv.value_cache, slots, **kv.scales)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots, **kv.scales)
    assert_bytes_equal(kv.key_cache, ref_k, "key_cache")
    assert_bytes_equal(kv.value_cache, ref_v, "value_cache")
    got = dispatch.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **kv.scales)
    want = reference.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **kv.scales)
    assert_bytes_equal(got[0], want[0], "key")
    assert_bytes_equal(got[1], want[1], "value")


def test_metal_bad_head_dims():
    from kvkernels.metal import dispatch

    kv, query, _ = dv_case("decode", [3, 4], dtype=f32, hq=2, hkv=1, dk=16, dv=16, b=4)
    for name, vc in (("value_cache", kv.value_cache[..., :12]), ("value_cache", torch.zeros(kv.num_blocks, 4, 1, 520)),
                     ("value_cache", kv.value_cache[:, :, :0])):
        with pytest.raises(RuntimeError, match=rf"kvkernels\.paged_attention: {name}:"):
            dispatch.paged_attention(query, kv.key_cache, vc, kv.block_tables, kv.seq_lens)
    with pytest.raises(RuntimeError, match=r"kvkernels\.mla_paged_attention: kv_cache: latent caches with several"):
        dispatch.mla_paged_attention(torch.zeros(2, 4, 80), torch.zeros(4, 4, 2, 80), kv.block_tables,
                                     kv.seq_lens, kv_lora_rank=64, scale=0.1)
