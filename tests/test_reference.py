"""Checks of kvkernels.reference against independent computations (SDPA on contiguous K/V, scalar
Python loops, hand-picked fp8 values), so the oracle the kernel tests compare against is itself right."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvkernels import reference as ref

F64, I32 = torch.float64, torch.int32


def _block_table(seq_lens, block_size, num_blocks, gen):
    """Shuffled, non-contiguous block ids; entries past a sequence's blocks are junk (-1, 10**9)."""
    need = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max(need, default=0) + 2), -1, dtype=I32)
    table[:, -1] = 10**9  # would crash (or read garbage) if ever used as an index
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
    return table


def _slots(table, seq_lens, block_size):
    """Slot of every token of every sequence, in order (int64)."""
    return torch.tensor([int(table[i, j // block_size]) * block_size + j % block_size
                         for i, s in enumerate(seq_lens) for j in range(s)], dtype=torch.int64)


def _caches(layout, n, b, h, d):
    """Zeroed K/V caches [n, b, h, d]: contiguous, HND transposed views, or a stacked layer slice."""
    if layout == "hnd":
        return tuple(torch.zeros(n, h, b, d, dtype=F64).transpose(1, 2) for _ in range(2))
    stacked = torch.zeros(3, 2, n, b, h, d, dtype=F64)  # [layers, k/v, blocks, block_size, heads, dim]
    return (stacked[1, 0], stacked[1, 1]) if layout == "stacked" else (stacked[1, 0].clone(), stacked[1, 1].clone())


def _causal_mask(q_len, seq_len, window_left=-1):
    """Bottom-right aligned causal (optionally sliding-window) mask, as a band of a ones matrix."""
    visible = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
    return visible if window_left < 0 else visible.triu(seq_len - q_len - window_left)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)


@pytest.mark.parametrize("layout", ["nhd", "hnd", "stacked"])
def test_reshape_and_cache_then_gather_roundtrip(layout):
    gen = torch.Generator().manual_seed(1)
    seq_lens, block_size, heads, dim = [5, 9, 1], 4, 2, 8
    table = _block_table(seq_lens, block_size, 12, gen)
    key_cache, value_cache = _caches(layout, 12, block_size, heads, dim)
    key = torch.randn(sum(seq_lens), heads, dim, dtype=F64, generator=gen)
    value = torch.randn(sum(seq_lens), heads, dim, dtype=F64, generator=gen)
    # Padding tokens (slot -1) between the real ones must be skipped.
    pad = torch.full((3, heads, dim), 7.0, dtype=F64)
    slots = torch.cat([_slots(table, seq_lens, block_size), torch.full((3,), -1)])
    ref.reshape_and_cache(torch.cat([key, pad]), torch.cat([value, pad]), key_cache, value_cache, slots)
    assert not (key_cache == 7.0).any() and not (value_cache == 7.0).any()
    k, v = ref.gather_kv(key_cache, value_cache, table, torch.tensor(seq_lens, dtype=I32), num_tokens=15)
    assert k.dtype == F64 and torch.equal(k, key) and torch.equal(v, value)


@pytest.mark.parametrize("layout", ["nhd", "hnd", "stacked"])
@pytest.mark.parametrize("window_left", [-1, 3])
@pytest.mark.parametrize("decode", [False, True])
def test_paged_attention_matches_sdpa(layout, window_left, decode):
    gen = torch.Generator().manual_seed(0)
    hq, hkv, dim, block_size, num_blocks = 4, 2, 16, 4, 24
    seq_lens = [5, 17, 1, 32]  # partial last blocks, a single-token sequence
    q_lens = [1, 1, 1, 1] if decode else [5, 3, 1, 2]
    table = _block_table(seq_lens, block_size, num_blocks, gen)
    key_cache, value_cache = _caches(layout, num_blocks, block_size, hkv, dim)
    keys = torch.randn(sum(seq_lens), hkv, dim, dtype=F64, generator=gen)
    values = torch.randn(sum(seq_lens), hkv, dim, dtype=F64, generator=gen)
    slots = _slots(table, seq_lens, block_size)
    key_cache[slots // block_size, slots % block_size] = keys  # filled by hand, not by the oracle
    value_cache[slots // block_size, slots % block_size] = values
    query = torch.randn(sum(q_lens), hq, dim, dtype=F64, generator=gen)

    out, lse = ref.paged_attention(query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=I32),
                                   None if decode else _cu(q_lens), window_left=window_left)
    assert out.dtype == F64 and lse.dtype == torch.float32

    for q, k, v, o, l, s in zip(query.split(q_lens), keys.split(seq_lens), values.split(seq_lens),
                                out.split(q_lens), lse.split(q_lens), seq_lens):
        mask = _causal_mask(len(q), s, window_left)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, tokens, dim]
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(o, expected.transpose(0, 1), rtol=0, atol=1e-12)
        logits = (q @ k.repeat_interleave(hq // hkv, 0).transpose(1, 2)) * dim**-0.5
        expected_lse = torch.logsumexp(logits.masked_fill(~mask, -math.inf), -1)
        torch.testing.assert_close(l, expected_lse.T.float())


def test_paged_attention_softcap_alibi_sinks_against_scalar_loops():
    gen = torch.Generator().manual_seed(2)
    hq, hkv, dim, block_size, scale, cap, window = 4, 2, 8, 2, 0.7, 2.0, 2
    seq_lens, q_lens = [3, 6], [2, 3]
    table = _block_table(seq_lens, block_size, 8, gen)
    key_cache, value_cache = _caches("nhd", 8, block_size, hkv, dim)
    keys = torch.randn(sum(seq_lens), hkv, dim, dtype=F64, generator=gen)
    values = torch.randn(sum(seq_lens), hkv, dim, dtype=F64, generator=gen)
    ref.reshape_and_cache(keys, values, key_cache, value_cache, _slots(table, seq_lens, block_size))
    query = torch.randn(sum(q_lens), hq, dim, dtype=F64, generator=gen)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    sinks = torch.tensor([0.3, -1.0, 2.0, 0.0])
    out, lse = ref.paged_attention(query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=I32),
                                   _cu(q_lens), scale=scale, window_left=window, soft_cap=cap,
                                   alibi_slopes=slopes, sinks=sinks)

    qs, ks, vs = query.split(q_lens), keys.split(seq_lens), values.split(seq_lens)
    row = 0
    for q, k, v, s in zip(qs, ks, vs, seq_lens):
        for i in range(len(q)):
            pos = s - len(q) + i
            for h in range(hq):
                kv = h // (hq // hkv)
                weights = {}
                for j in range(max(0, pos - window), pos + 1):
                    x = scale * sum(a * b for a, b in zip(q[i, h].tolist(), k[j, kv].tolist()))
                    weights[j] = math.exp(cap * math.tanh(x / cap) + slopes[h].item() * (j - pos))
                denom = sum(weights.values()) + math.exp(sinks[h].item())
                expected = sum(w / denom * v[j, kv] for j, w in weights.items())
                torch.testing.assert_close(out[row + i, h], expected, rtol=0, atol=1e-12)
                assert lse[row + i, h].item() == pytest.approx(math.log(denom), rel=1e-6)
        row += len(q)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_no_visible_key_and_empty_inputs(with_sinks):
    hq, dim = 2, 8
    key_cache, value_cache = _caches("nhd", 4, 4, 1, dim)
    key_cache.normal_(), value_cache.normal_()
    table = torch.tensor([[-1, 10**9], [2, -1]], dtype=I32)  # sequence 0 has no key at all
    sinks = torch.tensor([0.5, -2.0]) if with_sinks else None
    query = torch.randn(2, hq, dim, dtype=F64)
    out, lse = ref.paged_attention(query, key_cache, value_cache, table, torch.tensor([0, 3], dtype=I32),
                                   sinks=sinks)
    assert torch.equal(out[0], torch.zeros(hq, dim, dtype=F64)) and not out.isnan().any()
    assert torch.equal(lse[0], sinks if with_sinks else torch.full((hq,), -math.inf))

    empty = torch.empty(0, dtype=I32)
    out, lse = ref.paged_attention(query[:0], key_cache, value_cache, table[:0], empty, _cu([]), sinks=sinks)
    assert out.shape == (0, hq, dim) and lse.shape == (0, hq)
    k, v = ref.gather_kv(key_cache, value_cache, table[:0], empty)
    assert k.shape == (0, 1, dim) and v.shape == (0, 1, dim)


def test_merge_of_two_halves_equals_whole():
    gen = torch.Generator().manual_seed(3)
    hq, hkv, dim, block_size = 4, 1, 8, 4
    key_cache = torch.randn(6, block_size, hkv, dim, dtype=F64, generator=gen)
    value_cache = torch.randn(6, block_size, hkv, dim, dtype=F64, generator=gen)
    query = torch.randn(1, hq, dim, dtype=F64, generator=gen)
    blocks = torch.tensor([[4, 0, 5, 2]], dtype=I32)

    def attend(table, seq_len):  # decode: the single query sees every key of the table
        return ref.paged_attention(query, key_cache, value_cache, table, torch.tensor([seq_len], dtype=I32))

    whole_out, whole_lse = attend(blocks, 14)
    out_a, lse_a = attend(blocks[:, :2], 8)
    out_b, lse_b = attend(blocks[:, 2:], 6)
    out, lse = ref.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, whole_out, rtol=0, atol=1e-6)  # lse inputs are float32
    torch.testing.assert_close(lse, whole_lse)

    # An empty side (lse = -inf) is neutral; two empty sides give 0 and -inf, never NaN.
    neg_inf = torch.full_like(lse_a, -math.inf)
    out, lse = ref.merge_attention_states(out_a, lse_a, torch.zeros_like(out_a), neg_inf)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = ref.merge_attention_states(torch.zeros_like(out_a), neg_inf, torch.zeros_like(out_a), neg_inf)
    assert torch.equal(out, torch.zeros_like(out_a)) and torch.equal(lse, neg_inf)


def test_fp8_quantize_hand_values():
    one = torch.ones(1)
    x = torch.tensor([1000.0, -1000.0, 1.0625, 1.1875, 3.0, math.nan])
    # Saturate at 448; 1.0625 and 1.1875 are ties between 3-bit mantissas: round to even.
    stored = ref.quantize_fp8(x, one, torch.float8_e4m3fn)
    assert stored.dtype == torch.float8_e4m3fn
    assert stored.float()[:5].tolist() == [448.0, -448.0, 1.0, 1.25, 3.0] and stored.float()[5].isnan()
    stored = ref.quantize_fp8(torch.tensor([1e6, 1.125, 1.375]), one, torch.float8_e5m2)
    assert stored.float().tolist() == [57344.0, 1.0, 1.5]
    # Per-kv-head scales broadcast over the head dim of [T, H, D].
    per_head = torch.tensor([1.0, 4.0])
    stored = ref.quantize_fp8(torch.full((1, 2, 2), 3.0, dtype=F64), per_head, torch.float8_e4m3fn)
    assert stored.float().tolist() == [[[3.0, 3.0], [0.75, 0.75]]]
    assert ref.dequantize(stored, per_head).tolist() == [[[3.0, 3.0], [3.0, 3.0]]]

    # Through the cache: written quantized, gathered dequantized (bfloat16 unless out_dtype says otherwise).
    cache = torch.zeros(2, 2, 2, 2, dtype=torch.float8_e4m3fn)
    key = torch.tensor([[[1000.0, 1.0625], [2.0, -8.0]]])
    ref.reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([3]), k_scale=per_head, v_scale=per_head)
    assert cache[1, 1].float().tolist() == [[448.0, 1.0], [0.5, -2.0]]
    k, _ = ref.gather_kv(cache, cache, torch.tensor([[0, 1]], dtype=I32), torch.tensor([4], dtype=I32),
                         k_scale=per_head, v_scale=per_head)
    assert k.dtype == torch.bfloat16 and k[3].float().tolist() == [[448.0, 1.0], [2.0, -8.0]]
    # MLA rows [kv_c ; k_pe] use one per-tensor scale.
    mla_cache = torch.zeros(2, 2, 4, dtype=torch.float8_e4m3fn)
    ref.concat_and_cache_mla(torch.tensor([[1.0, 300.0]]), torch.tensor([[-1.0, 0.25]]), mla_cache,
                             torch.tensor([2]), scale=torch.tensor([0.5]))
    assert mla_cache[1, 0].float().tolist() == [2.0, 448.0, -2.0, 0.5]


def _mla_setup(gen, seq_lens, hq=3, rank=16, rope=8, dn=12, dv=10, block_size=4):
    table = _block_table(seq_lens, block_size, 10, gen)
    cache = torch.zeros(10, block_size, rank + rope, dtype=F64)
    latent = torch.randn(sum(seq_lens), rank, dtype=F64, generator=gen)
    k_pe = torch.randn(sum(seq_lens), rope, dtype=F64, generator=gen)
    ref.concat_and_cache_mla(latent, k_pe, cache, _slots(table, seq_lens, block_size))
    w_kv_b = torch.randn(hq * (dn + dv), rank, dtype=F64, generator=gen) / rank**0.5
    w = w_kv_b.view(hq, dn + dv, rank)
    return table, cache, latent, k_pe, w_kv_b, w[:, :dn], w[:, dn:]


def test_mla_decompress_rmsnorm_and_shared_rope():
    gen = torch.Generator().manual_seed(4)
    seq_lens = [6, 3]
    table, cache, latent, k_pe, w_kv_b, w_k, w_v = _mla_setup(gen, seq_lens)
    norm_weight = torch.rand(16, dtype=F64, generator=gen) + 0.5
    key, value = ref.mla_decompress(cache, table, torch.tensor(seq_lens, dtype=I32), w_kv_b, kv_lora_rank=16,
                                    qk_nope_head_dim=12, v_head_dim=10, norm_weight=norm_weight, norm_eps=1e-5)
    c = F.rms_norm(latent, (16,), norm_weight, eps=1e-5)
    torch.testing.assert_close(key[:, :, :12], torch.einsum("hdr,tr->thd", w_k, c), rtol=0, atol=1e-12)
    torch.testing.assert_close(value, torch.einsum("hdr,tr->thd", w_v, c), rtol=0, atol=1e-12)
    assert torch.equal(key[:, :, 12:], k_pe[:, None].expand(-1, 3, -1))


def test_mla_absorbed_attention_equals_decompressed_attention():
    gen = torch.Generator().manual_seed(5)
    seq_lens, q_lens, scale = [7, 12, 1], [3, 1, 1], 0.15
    table, cache, _, _, w_kv_b, w_k, w_v = _mla_setup(gen, seq_lens)
    q_nope = torch.randn(sum(q_lens), 3, 12, dtype=F64, generator=gen)
    q_pe = torch.randn(sum(q_lens), 3, 8, dtype=F64, generator=gen)
    lens = torch.tensor(seq_lens, dtype=I32)

    # Standard MLA: decompress per-head K/V, then ordinary causal attention.
    key, value = ref.mla_decompress(cache, table, lens, w_kv_b, kv_lora_rank=16, qk_nope_head_dim=12, v_head_dim=10)
    q_full = torch.cat([q_nope, q_pe], -1)
    # Absorbed MLA: fold W_k into the query, attend the latent rows, apply W_v afterwards.
    q_absorbed = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_k), q_pe], -1)
    out_latent, lse = ref.mla_paged_attention(q_absorbed, cache, table, lens, kv_lora_rank=16, scale=scale,
                                              query_start_loc=_cu(q_lens))
    assert out_latent.shape == (5, 3, 16) and lse.dtype == torch.float32
    out = torch.einsum("thr,hvr->thv", out_latent, w_v)

    for q, k, v, o, l, s in zip(q_full.split(q_lens), key.split(seq_lens), value.split(seq_lens),
                                out.split(q_lens), lse.split(q_lens), seq_lens):
        mask = _causal_mask(len(q), s)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        torch.testing.assert_close(o, expected.transpose(0, 1), rtol=0, atol=1e-10)
        expected_lse = torch.logsumexp((scale * q @ k.transpose(1, 2)).masked_fill(~mask, -math.inf), -1)
        torch.testing.assert_close(l, expected_lse.T.float())


@pytest.mark.parametrize("block_dim", [2, -4])
def test_copy_and_swap_blocks(block_dim):
    stacked = torch.randn(2, 2, 5, 3, 2, 4)  # [layers, k/v, blocks, block_size, heads, dim]
    expected = stacked.clone()
    ref.copy_blocks(stacked, torch.tensor([[0, 3], [0, 4], [2, 1]]), block_dim=block_dim)
    expected[:, :, 3], expected[:, :, 4], expected[:, :, 1] = expected[:, :, 0], expected[:, :, 0], expected[:, :, 2]
    assert torch.equal(stacked, expected)

    # In place (src is dst): every source is read before any destination is written.
    before = stacked.clone()
    ref.swap_blocks(stacked, stacked, torch.tensor([[0, 1], [1, 0]]), block_dim=block_dim)
    assert torch.equal(stacked[:, :, 0], before[:, :, 1]) and torch.equal(stacked[:, :, 1], before[:, :, 0])

    # Between tensors with different block counts (e.g. a GPU cache and a smaller CPU pool).
    pool = torch.zeros(2, 2, 2, 3, 2, 4)
    ref.swap_blocks(stacked, pool, torch.tensor([[4, 1]]), block_dim=block_dim)
    assert torch.equal(pool[:, :, 1], stacked[:, :, 4]) and not pool[:, :, 0].any()
