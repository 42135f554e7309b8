"""MLAPagedCache: latent rows written through its slot mappings with concat_and_cache_mla and read by
mla_paged_attention through its block tables, against the float64 reference over exactly the tokens
each sequence wrote (after forks, copy-on-write, prefix hits, block-sparse eviction, offload)."""

import pytest
import torch

import kvkernels
from helpers import assert_close, generator, randn, upcast
from kvkernels import MLAPagedCache, ops, reference
from kvkernels.cache import KeepRecentRatio

R, P, H = 64, 16, 16  # kv_lora_rank, rope dim, query heads (small, the kernels take any width)
W = R + P
SCALE = W ** -0.5


class Writer:
    """Writes a distinct random latent row per (sequence, token) and remembers every sequence's rows."""

    def __init__(self, cache, seed=0):
        self.cache, self.gen, self.rows = cache, generator(seed), {}

    def append(self, seq, tokens):
        slots = self.cache.append(seq, tokens)
        rows = randn(self.cache.num_layers, len(tokens), W, gen=self.gen, dtype=self.cache.dtype)  # per layer
        for layer in range(self.cache.num_layers):
            ops.concat_and_cache_mla(rows[layer, :, :R], rows[layer, :, R:], self.cache.latent_cache(layer), slots)
        self.rows[seq] = torch.cat([self.rows.get(seq, rows[:, :0]), rows], dim=1)
        return slots

    def fork(self, seq):
        child = self.cache.fork(seq)
        self.rows[child] = self.rows[seq].clone()
        return child


def attend(cache, seqs, layer=0, seed=5):
    q = randn(len(seqs), H, W, gen=generator(seed), dtype=torch.bfloat16)
    out, lse = ops.mla_paged_attention(q, cache.latent_cache(layer), cache.block_tables(seqs), cache.seq_lens(seqs),
                                       kv_lora_rank=R, scale=SCALE)
    return q, out, lse


def expected(q, rows_per_seq):
    """Reference attention of each query over a contiguous cache holding exactly the given rows."""
    outs, lses = [], []
    for i, rows in enumerate(rows_per_seq):
        rows = upcast(rows)
        n = rows.shape[0]
        dense = rows.view(1, n, W) if n else torch.zeros(1, 1, W, dtype=torch.float64)
        out, lse = reference.mla_paged_attention(upcast(q[i:i + 1]), dense, torch.zeros(1, 1, dtype=torch.int32),
                                                 torch.tensor([n], dtype=torch.int32), kv_lora_rank=R, scale=SCALE)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check(cache, writer, seqs, layer=0, rows=None):
    q, out, lse = attend(cache, seqs, layer)
    ref_out, ref_lse = expected(q, rows if rows is not None else [writer.rows[s][layer] for s in seqs])
    assert_close(out, ref_out, torch.bfloat16, msg="out")
    assert_close(lse, ref_lse, torch.float32, msg="lse")


def test_storage_views_and_bytes():
    cache = MLAPagedCache(3, R, P, num_blocks=9, block_size=16)
    assert cache.kv.shape == (3, 9, 16, W)
    assert cache.latent_cache(2).shape == (9, 16, W) and cache.latent_cache(2).data_ptr() == cache.kv[2].data_ptr()
    assert cache.bytes_per_token == 3 * W * 2
    assert cache.standard_bytes_per_token(num_heads=16, qk_head_dim=192, v_head_dim=128) == 3 * 16 * 320 * 2
    assert torch.equal(cache.latent_cache(0)[0], torch.zeros(16, W, dtype=torch.bfloat16))  # null block
    with pytest.raises(TypeError, match="latent_cache"):
        cache.key_cache(0)
    with pytest.raises(IndexError, match="layer 3"):
        cache.latent_cache(3)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAPagedCache(1, 0, P, num_blocks=4)
    assert kvkernels.MLAPagedCache is MLAPagedCache


@pytest.mark.parametrize("block_size", [16, 64, 5])
def test_forks_copy_on_write_and_attention(block_size):
    cache = MLAPagedCache(2, R, P, num_blocks=64, block_size=block_size)
    w = Writer(cache, seed=1)
    a, _ = cache.add_sequence(list(range(101)))
    w.append(a, list(range(101)))  # a partial last block for every block size
    b = w.fork(a)  # shares the partial last block
    c = w.fork(a)
    w.append(b, [1, 2, 3])
    w.append(c, [4])
    w.append(a, list(range(2 * block_size)))  # the parent writes on too
    assert cache.stats().cow_copies >= 2
    for layer in range(2):
        check(cache, w, [a, b, c], layer)
    # Each child's own KV beyond the shared prefix is its own; the prefix blocks are shared.
    usage = cache.memory_usage(b)
    assert usage["shared_tokens"] > 0 and usage["own_tokens"] >= 3
    assert cache.memory_usage_mb(b) == pytest.approx((usage["own_bytes"] + usage["shared_bytes"]) / 2**20)


def test_prefix_hit_reuses_latent_rows():
    cache = MLAPagedCache(1, R, P, num_blocks=32, block_size=16)
    w = Writer(cache, seed=2)
    prompt = list(range(50))
    a, cached = cache.add_sequence(prompt)
    assert cached == 0
    w.append(a, prompt)
    b, cached = cache.add_sequence(prompt + [99])
    assert cached == 48  # three full blocks; never the last token
    w.rows[b] = w.rows[a][:, :48].clone()
    w.append(b, (prompt + [99])[48:])
    check(cache, w, [a, b])


def test_block_sparse_mode_attends_exactly_the_kept_blocks():
    bs = 16
    cache = MLAPagedCache(1, R, P, num_blocks=64, block_size=bs,
                          sparse_policy=KeepRecentRatio(threshold_tokens=128, keep_ratio=0.5))
    w = Writer(cache, seed=3)
    s, _ = cache.add_sequence([1])
    for step in range(20):  # 20 x 13 = 260 tokens: sparse from 128 on
        w.append(s, list(range(13)))
    stats = cache.block_sparse_stats(s)
    assert stats["sparse_mode_active"] and stats["active_blocks"] < stats["total_logical_blocks"]
    assert stats["memory_saved_mb"] == pytest.approx(stats["evicted_blocks"] * cache.bytes_per_block / 2**20)
    assert cache.get_block_sparse_stats(s) == stats
    # The kept blocks are the most recent ones: the tokens the kernel sees are the tail of what was written.
    kept = int(cache.seq_lens([s])[0])
    assert kept == stats["active_tokens"] and kept % bs == 260 % bs
    check(cache, w, [s], rows=[w.rows[s][0, -kept:]])


def test_offload_restore_keeps_the_latents():
    # No prefix caching: restore must copy every block back (a cached block would be reused in place,
    # and this test overwrites the whole device storage while the sequence is away).
    cache = MLAPagedCache(2, R, P, num_blocks=32, block_size=16, enable_prefix_caching=False)
    w = Writer(cache, seed=4)
    s, _ = cache.add_sequence(list(range(40)))
    w.append(s, list(range(40)))
    moved = cache.offload(s)
    assert moved == 3 * cache.bytes_per_block and cache.is_offloaded(s)
    cache.latent_cache(0).normal_()  # whatever the device blocks hold now must not matter
    cache.latent_cache(1).normal_()
    cache.restore(s)
    for layer in range(2):
        check(cache, w, [s], layer)
