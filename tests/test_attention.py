"""paged_attention and merge_attention_states against the float64 reference (docs/ops.md).

The cases are a compact cover, not a cross product: every dtype, fp8 format, scale kind, layout, GQA
ratio, head dim and block size appears in at least one configuration, decode and varlen each.
"""

import math

import pytest
import torch

from helpers import (TOLERANCES, assert_close, generator, make_block_tables, make_paged_kv, make_query,
                     query_start_loc, randn, upcast)
from kvkernels import ops, reference

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def varlen_q_lens(seq_lens):
    """Per-sequence query counts cycling through: full prefill, chunked prefill, one query, none."""
    pattern = (lambda n: n, lambda n: (n + 1) // 2, lambda n: min(n, 1), lambda n: 0)
    return [pattern[i % 4](n) for i, n in enumerate(seq_lens)]


def make_case(mode, seq_lens, *, dtype, num_heads, num_kv_heads, head_dim, block_size, layout="NHD", fp8=None,
              per_head=False, strided=None, seed=0):
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                       dtype=dtype, layout=layout, fp8=fp8, per_head_scale=per_head, seed=seed)
    if mode == "decode":
        q_lens, qsl = [1] * len(seq_lens), None
    else:
        q_lens = varlen_q_lens(seq_lens)
        qsl = query_start_loc(q_lens)
    query = make_query(sum(q_lens), num_heads, head_dim, dtype, generator(seed + 1), strided=strided)
    return kv, query, qsl


def run_paged_attention(kv, query, qsl=None, op=ops.paged_attention, **kwargs):
    """Kernel vs reference (float64 query and caches; fp8 caches as they are); returns the kernel result.
    ``op``: the kernel, ``ops.paged_attention``'s signature (tests/test_cuda_emulated.py passes the emulated
    CUDA one)."""
    out, lse = op(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                                   **kwargs, **kv.scales)
    kr, vr = kv.ref_caches()
    ref_out, ref_lse = reference.paged_attention(upcast(query), kr, vr, kv.block_tables, kv.seq_lens, qsl,
                                                 **kwargs, **kv.scales)
    t, hq, _ = query.shape
    dv = kv.value_cache.shape[-1]  # out has the value's head dim
    assert out.dtype == query.dtype and out.shape == (t, hq, dv) and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (t, hq) and lse.is_contiguous()
    assert_close(out, ref_out, query.dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")  # float32, accumulated in float32 for every query dtype
    return out, lse


# id: dtype, fp8, per-head scale (or a (k, v) pair), layout, Hq, Hkv, D, B, strided query
CONFIGS = {
    "f32-NHD-mha-d64-b16": (f32, None, False, "NHD", 4, 4, 64, 16, None),
    "f16-HND-gqa4-d128-b3": (f16, None, False, "HND", 8, 2, 128, 3, "fused"),
    "bf16-stacked-mqa-d72-b1": (bf16, None, False, "stacked", 6, 1, 72, 1, None),
    "f32-NHD-gqa8-d8-b256": (f32, None, False, "NHD", 16, 2, 8, 256, "transposed"),
    "bf16-NHD-gqa4-d256-b16": (bf16, None, False, "NHD", 8, 2, 256, 16, None),
    "e4m3-tensor-bf16-NHD-gqa4-d64-b16": (bf16, "e4m3", False, "NHD", 8, 2, 64, 16, None),
    "e5m2-head-f16-HND-mha-d128-b3": (f16, "e5m2", True, "HND", 4, 4, 128, 3, "fused"),
    "e4m3-head-f32-stacked-mqa-d64-b16": (f32, "e4m3", True, "stacked", 8, 1, 64, 16, None),
    "e5m2-tensor-f32-NHD-gqa8-d8-b1": (f32, "e5m2", False, "NHD", 8, 1, 8, 1, "transposed"),
    "e4m3-khead-vtensor-bf16-HND-gqa4-d64-b16": (bf16, "e4m3", (True, False), "HND", 8, 2, 64, 16, None),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_paged_attention(config, mode):
    dtype, fp8, per_head, layout, hq, hkv, d, b, strided = config
    # Partial and exactly-full last blocks, a one-token and an empty sequence.
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, strided=strided)
    out, lse = run_paged_attention(kv, query, qsl)
    # The sequence with seq_len 0 sees no key: out = 0, lse = -inf (decode: its one query is row 1).
    if mode == "decode":
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isneginf(lse[1]).all()


def features(b, d):
    """Logit options of docs/ops.md; window widths chosen so window starts hit block boundaries."""
    hq = 8
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / hq) for h in range(hq)], dtype=f32)
    sinks = randn(hq, gen=generator(7), std=2.0)
    return {
        "window0": dict(window_left=0),
        "window=B-1": dict(window_left=b - 1),
        "window=B": dict(window_left=b),
        "window=2B+1": dict(window_left=2 * b + 1),
        "softcap": dict(soft_cap=1.5, scale=2.0 / math.sqrt(d)),
        "alibi": dict(alibi_slopes=slopes),
        "sinks": dict(sinks=sinks),
        "scale": dict(scale=0.3),
        "all": dict(window_left=b, soft_cap=2.0, scale=1.5 / math.sqrt(d), alibi_slopes=slopes, sinks=sinks),
    }


FEATURE_NAMES = list(features(16, 64))
# id: dtype, fp8, per-head, layout, Hkv, D, B (Hq = 8)
FEATURE_CONFIGS = {
    "f32-NHD-b16": (f32, None, False, "NHD", 2, 64, 16),
    "bf16-HND-b3": (bf16, None, False, "HND", 1, 32, 3),
    "e4m3-f16-stacked-b16": (f16, "e4m3", True, "stacked", 2, 64, 16),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("feature", FEATURE_NAMES)
@pytest.mark.parametrize("config", FEATURE_CONFIGS.values(), ids=FEATURE_CONFIGS.keys())
def test_paged_attention_features(config, feature, mode):
    check_features(run_paged_attention, config, feature, mode)


def check_features(run, config, feature, mode, more_seq_lens=()):
    """One logit option of ``features`` on a case of ``config``; ``run(kv, query, qsl, **kwargs)``
    returns ``(out, lse)`` after checking them against the reference (shared with the emulated CUDA
    kernels of tests/test_cuda_emulated.py)."""
    dtype, fp8, per_head, layout, hkv, d, b = config
    seq_lens = [2 * b, 2 * b + 1, 3 * b - 1, 1, 0, b, 40, *more_seq_lens]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=8, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, seed=3)
    kwargs = features(b, d)[feature]
    out, lse = run(kv, query, qsl, **kwargs)
    if mode == "decode":  # sequence 4 is empty: out = 0, lse = -inf, or the sink logit
        assert torch.equal(out[4], torch.zeros_like(out[4]))
        sinks = kwargs.get("sinks")
        expected = sinks if sinks is not None else torch.full((8,), float("-inf"))
        assert_close(lse[4], expected, f32, msg="lse of the empty sequence")


LONG_CONFIGS = {
    "f32-NHD-gqa4-d128-b16": (f32, None, "NHD", 16),
    "bf16-e4m3-HND-gqa4-d128-b64": (bf16, "e4m3", "HND", 64),
}


@pytest.mark.parametrize("opts", [{}, dict(window_left=1500, sinks=torch.linspace(-1, 1, 8))],
                         ids=["plain", "window-sinks"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", LONG_CONFIGS.values(), ids=LONG_CONFIGS.keys())
def test_long_context(config, mode, opts):
    """Contexts of thousands of tokens, long enough for any split-K schedule to split them."""
    dtype, fp8, layout, b = config
    seq_lens = [4100, 1, 2049, 700]
    kv, query, qsl = make_case("decode", seq_lens, dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=128,
                               block_size=b, layout=layout, fp8=fp8, per_head=True, seed=41)
    if mode == "varlen":  # chunked prefill: a 40-token chunk at the end of each context
        q_lens = [min(n, 40) for n in seq_lens]
        qsl = query_start_loc(q_lens)
        query = make_query(sum(q_lens), 8, 128, dtype, generator(42))
    run_paged_attention(kv, query, qsl, **opts)


@pytest.mark.parametrize("window_left", [0, 4, 15, 16])
def test_window_against_dense(window_left):
    """Sliding window checked against an explicit per-query loop (independent of the reference)."""
    b, d, seq_len, q_len = 16, 16, 50, 20
    kv = make_paged_kv(seq_lens=[seq_len], num_kv_heads=1, head_dim=d, block_size=b, seed=11)
    query = make_query(q_len, 2, d, f32, generator(12))
    out, lse = ops.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                   query_start_loc([q_len]), window_left=window_left)
    k, v = kv.keys[0][:, 0], kv.values[0][:, 0]
    for i in range(q_len):
        pos = seq_len - q_len + i
        lo = max(pos - window_left, 0)
        s = query[i].double() @ k[lo:pos + 1].T * d ** -0.5  # [Hq, keys]
        assert_close(lse[i], torch.logsumexp(s, dim=-1), f32, msg=f"lse of query {i}")
        assert_close(out[i], torch.softmax(s, dim=-1) @ v[lo:pos + 1], f32, msg=f"out of query {i}")


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_empty_sequences(mode, sinks):
    """Sequences with seq_len 0 (decode) or no queries (varlen) in a batch, and an empty batch."""
    seq_lens = [0, 5, 0, 33]
    kv, query, qsl = make_case(mode, seq_lens, dtype=f32, num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=16, seed=5)
    sink = randn(4, gen=generator(6)) if sinks else None
    out, lse = run_paged_attention(kv, query, qsl, sinks=sink)
    if mode == "decode":
        no_key = sink if sinks else torch.full((4,), float("-inf"))
        for row in (0, 2):
            assert torch.equal(out[row], torch.zeros(4, 16))
            assert_close(lse[row], no_key, f32, msg="lse of an empty sequence")

    # An empty batch: no sequences at all.
    table = torch.zeros(0, 3, dtype=torch.int32)
    lens = torch.zeros(0, dtype=torch.int32)
    q0 = torch.randn(0, 4, 16)
    qsl0 = None if mode == "decode" else torch.zeros(1, dtype=torch.int32)
    out, lse = ops.paged_attention(q0, kv.key_cache, kv.value_cache, table, lens, qsl0, sinks=sink)
    assert out.shape == (0, 4, 16) and out.dtype == f32
    assert lse.shape == (0, 4) and lse.dtype == f32


# ----------------------------------------------------------------------------------------------------
# merge_attention_states
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
def test_merge_attention_states(dtype):
    gen = generator(21)
    t, h, d = 9, 4, 64
    out_a = randn(t, h, d, gen=gen, dtype=dtype)
    out_b = randn(h, t, d, gen=gen, dtype=dtype).transpose(0, 1)  # non-contiguous input
    lse_a = randn(t, h, gen=gen, std=3.0)
    lse_b = randn(t, h, gen=gen, std=3.0)
    lse_a[0] = float("-inf")  # only b saw keys
    lse_b[1] = float("-inf")  # only a saw keys
    lse_a[2, :2] = lse_b[2, :2] = float("-inf")  # neither: out = 0, lse = -inf
    lse_a[3], lse_b[3] = 1000.0, 999.0  # exp would overflow without the max shift
    lse_a[4], lse_b[4] = -1000.0, 30.0
    out, lse = ops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attention_states(upcast(out_a), lse_a, upcast(out_b), lse_b)
    assert out.dtype == dtype and out.shape == (t, h, d) and out.is_contiguous()
    assert lse.dtype == f32 and lse.shape == (t, h)
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    assert torch.equal(out[2, :2], torch.zeros(2, d, dtype=dtype))
    assert torch.isneginf(lse[2, :2]).all()
    assert torch.equal(out[0], out_b[0]) and torch.equal(out[1], out_a[1])  # weight exactly 1 and 0


def split_tables(kv, split_blocks):
    """Block tables/lens of the first ``split_blocks`` blocks of each sequence and of the rest."""
    b = kv.block_size
    lens = kv.seq_lens.tolist()
    lens_a = [min(n, split_blocks * b) for n in lens]
    lens_b = [n - a for n, a in zip(lens, lens_a)]
    tab_a, _, _ = make_block_tables(lens_a, b, generator(0))  # junk layout; ids overwritten below
    tab_b, _, _ = make_block_tables(lens_b, b, generator(0))
    for i, ids in enumerate(kv.blocks):
        tab_a[i, :len(ids[:split_blocks])] = torch.tensor(ids[:split_blocks], dtype=torch.int32)
        if ids[split_blocks:]:
            tab_b[i, :len(ids) - split_blocks] = torch.tensor(ids[split_blocks:], dtype=torch.int32)
    return (tab_a, torch.tensor(lens_a, dtype=torch.int32)), (tab_b, torch.tensor(lens_b, dtype=torch.int32))


@pytest.mark.parametrize("soft_cap", [0.0, 2.0])
@pytest.mark.parametrize("dtype,fp8", [(f32, None), (bf16, None), (f32, "e4m3")], ids=["f32", "bf16", "e4m3"])
def test_merge_equals_full_attention(dtype, fp8, soft_cap):
    """Attention over two halves of each sequence's blocks, merged, equals attention over all of it
    (decode: the one query sees every key of both halves). Sequences shorter than the split give an
    empty second half (lse = -inf)."""
    b = 8
    kv = make_paged_kv(seq_lens=[37, 5, 64, 1, 17], num_kv_heads=2, head_dim=64, block_size=b, dtype=dtype,
                       fp8=fp8, per_head_scale=True, seed=31)
    query = make_query(5, 8, 64, dtype, generator(32))
    (tab_a, lens_a), (tab_b, lens_b) = split_tables(kv, split_blocks=2)
    caches = (kv.key_cache, kv.value_cache)
    opts = dict(soft_cap=soft_cap, **kv.scales)
    out_a, lse_a = ops.paged_attention(query, *caches, tab_a, lens_a, **opts)
    out_b, lse_b = ops.paged_attention(query, *caches, tab_b, lens_b, **opts)
    assert torch.isneginf(lse_b[1]).all() and torch.isneginf(lse_b[3]).all()
    out, lse = ops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    full_out, full_lse = run_paged_attention(kv, query, soft_cap=soft_cap)
    rtol, atol = TOLERANCES[dtype]
    # Two roundings to the output dtype (the halves, then the merge) instead of one.
    assert_close(out, full_out, dtype, rtol=2 * rtol, atol=2 * atol, msg="merged out")
    assert_close(lse, full_lse, f32, msg="merged lse")
