"""Shared-prefix (cascade) decode attention (kvkernels.cache.cascade): the plan finds the groups of
rows that share leading blocks and how far; the cascade result equals the float64 reference of
plain decode over each row's whole block table; PagedKVCache.cascade_plan on real forks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvkernels import reference
from kvkernels.cache import PagedKVCache, UnknownSequenceError
from kvkernels.cache.cascade import cascade_attention, plan_cascade

from helpers import DEVICES, assert_close, generator, randn

BS = 16


def shared_tables(prefix_blocks, group_size, own_lens, gen, shuffle_rows=False):
    """Block tables of ``len(prefix_blocks)`` groups of ``group_size`` rows: group i's rows share
    ``prefix_blocks[i]`` whole blocks, then row r has ``own_lens[r]`` tokens of its own. Block ids
    are a random permutation; returns (tables [rows, width] int32, lens [rows], blocks used)."""
    groups = len(prefix_blocks)
    rows = groups * group_size
    own_blocks = [-(-n // BS) for n in own_lens]
    total = sum(prefix_blocks) + sum(own_blocks)
    ids = (torch.randperm(total + 4, generator=gen)[:total] + 1).tolist()  # block 0 stays unused
    width = max(prefix_blocks) + max(own_blocks)
    tables = np.full((rows, width), -1, dtype=np.int32)  # junk past each row's blocks
    lens = np.zeros(rows, dtype=np.int64)
    for g in range(groups):
        prefix = [ids.pop() for _ in range(prefix_blocks[g])]
        for j in range(group_size):
            r = g * group_size + j
            own = [ids.pop() for _ in range(own_blocks[r])]
            tables[r, :len(prefix) + len(own)] = prefix + own
            lens[r] = prefix_blocks[g] * BS + own_lens[r]
    if shuffle_rows:
        perm = torch.randperm(rows, generator=gen).numpy()
        tables, lens = tables[perm], lens[perm]
    return tables, lens, total + 5


def nan_past_lens(cache, tables, lens):
    """NaN in every slot no row reads (the tail of each row's last block), as a block pool leaves it."""
    for r in range(len(lens)):
        last, fill = int(tables[r, (lens[r] - 1) // BS]), int(lens[r] - 1) % BS + 1
        cache[last, fill:] = float("nan")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_blocks,group_size,kv_heads,group,dim,shuffle,soft_cap", [
    ([4], 8, 2, 4, 64, False, 0.0),          # 8 beams of one prompt, GQA 4
    ([3, 5, 1], 2, 1, 1, 128, True, 0.0),    # three prompts x 2 samples, MHA, rows interleaved
    ([2, 2], 4, 4, 2, 64, False, 30.0),      # soft cap
    ([6], 3, 2, 8, 32, True, 0.0),           # GQA 8
])
def test_cascade_equals_reference(device, dtype, prefix_blocks, group_size, kv_heads, group, dim, shuffle,
                                  soft_cap):
    gen = generator(sum(prefix_blocks) * 31 + group_size)
    rows = len(prefix_blocks) * group_size
    own_lens = [int(x) for x in torch.randint(1, 3 * BS, (rows,), generator=gen)]  # partial blocks too
    tables, lens, num_blocks = shared_tables(prefix_blocks, group_size, own_lens, gen, shuffle)
    key = randn(num_blocks, BS, kv_heads, dim, gen=gen, dtype=dtype)
    value = randn(num_blocks, BS, kv_heads, dim, gen=gen, dtype=dtype)
    nan_past_lens(key, tables, lens)
    nan_past_lens(value, tables, lens)
    query = randn(rows, kv_heads * group, dim, gen=gen, dtype=dtype)
    plan = plan_cascade(tables, lens, BS, device, min_shared_tokens=1)
    assert plan is not None and plan.groups == len(prefix_blocks) and plan.group_size == group_size
    if not shuffle:
        assert plan.order is None  # rows already grouped: no gather
    out, lse = cascade_attention(query.to(device), key.to(device), value.to(device), plan, soft_cap=soft_cap)
    safe = torch.from_numpy(np.where(tables < 0, 0, tables))
    expected, expected_lse = reference.paged_attention(query.double(), key, value, safe,
                                                       torch.from_numpy(lens).int(), soft_cap=soft_cap)
    assert out.dtype == dtype
    assert_close(out, expected, dtype)
    assert_close(lse, expected_lse, torch.float32, rtol=1e-4, atol=1e-4)
    # out= / lse=: the same bytes, written into the caller's (NaN-poisoned) tensors.
    given, given_lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    got = cascade_attention(query.to(device), key.to(device), value.to(device), plan, soft_cap=soft_cap, out=given,
                            lse=given_lse)
    assert got[0] is given and got[1] is given_lse
    assert torch.equal(given, out) and torch.equal(given_lse, lse)


def test_plan_groups_and_limits():
    gen = generator(3)
    tables, lens, _ = shared_tables([3, 2], 4, [5] * 8, gen)
    plan = plan_cascade(tables, lens, BS, "cpu", min_shared_tokens=1)
    assert plan.prefix_lens.tolist() == [3 * BS, 2 * BS] and plan.suffix_lens.tolist() == [5] * 8
    assert plan.order is None and plan.shared_tokens == 5 * BS
    assert torch.equal(plan.suffix_tables[:, 0], torch.from_numpy(tables[np.arange(8), [3] * 4 + [2] * 4]))
    # Average shared tokens below the threshold, a single row, groups of different sizes, a row
    # alone: no plan.
    assert plan_cascade(tables, lens, BS, "cpu", min_shared_tokens=2.5 * BS + 1) is None
    assert plan_cascade(tables[:1], lens[:1], BS, "cpu", min_shared_tokens=1) is None
    assert plan_cascade(tables[:7], lens[:7], BS, "cpu", min_shared_tokens=1) is None
    # The shared prefix stops before a row's newest token: a row whose length ends exactly at the
    # end of a shared block keeps that block as its own (the new token is in it).
    tables, lens, _ = shared_tables([3], 2, [0, 5], gen)
    plan = plan_cascade(tables, lens, BS, "cpu", min_shared_tokens=1)
    assert plan.prefix_lens.tolist() == [2 * BS] and plan.suffix_lens.tolist() == [BS, BS + 5]
    # Rows whose first block differ share nothing: no plan (no group of two).
    tables, lens, _ = shared_tables([2, 2], 1, [3, 3], gen)
    assert plan_cascade(tables, lens, BS, "cpu", min_shared_tokens=1) is None
    # A prompt shorter than one block: no whole block to share.
    tables = np.array([[7], [7]], dtype=np.int32)
    assert plan_cascade(tables, np.array([9, 9]), BS, "cpu", min_shared_tokens=1) is None


def test_paged_cache_plan_on_forks():
    """Forks of one prompt (one forked mid-block as a prefix) decoding together."""
    cache = PagedKVCache(1, 2, 64, 64, block_size=BS, dtype=torch.float32)
    gen = generator(5)
    parent, _ = cache.add_sequence([])
    cache.append(parent, np.zeros(70, dtype=np.int64))  # 4 whole blocks + 6 tokens
    seqs = [parent, cache.fork(parent), cache.fork(parent), cache.fork(parent, 40)]
    cache.key_cache(0).copy_(randn(*cache.key_cache(0).shape, gen=gen))
    cache.value_cache(0).copy_(randn(*cache.value_cache(0).shape, gen=gen))
    for _ in range(3):
        step = cache.append_decode(seqs, np.zeros(len(seqs), dtype=np.int64))
        cache.key_cache(0).view(-1, 2, 64)[step.slot_mapping] = randn(len(seqs), 2, 64, gen=gen)
        cache.value_cache(0).view(-1, 2, 64)[step.slot_mapping] = randn(len(seqs), 2, 64, gen=gen)
    plan = cache.cascade_plan(seqs, min_shared_tokens=1)
    # The prefix fork (40 tokens: 2 whole blocks + 8) limits the group to 2 shared blocks.
    assert plan.groups == 1 and plan.group_size == 4 and plan.prefix_lens.tolist() == [2 * BS]
    assert plan.suffix_lens.tolist() == [73 - 32, 73 - 32, 73 - 32, 43 - 32]
    assert cache.cascade_plan(seqs, min_shared_tokens=2 * BS + 1) is None
    with pytest.raises(UnknownSequenceError):
        cache.cascade_plan(seqs + [999])
    query = randn(4, 8, 64, gen=gen)
    out, _ = cascade_attention(query, cache.key_cache(0), cache.value_cache(0), plan)
    expected, _ = reference.paged_attention(query.double(), cache.key_cache(0), cache.value_cache(0),
                                            cache.block_tables(seqs), cache.seq_lens(seqs))
    assert_close(out, expected)
    cache.check_invariants()


def test_cascade_attention_bad_input():
    """A query that does not match the plan's rows or the cache's kv heads: a ValueError naming
    query, before any kernel runs (the reshape would otherwise fail with torch's shape message)."""
    gen = generator(9)
    tables, lens, num_blocks = shared_tables([2], 4, [5] * 4, gen)
    key = randn(num_blocks, BS, 2, 32, gen=gen)
    plan = plan_cascade(tables, lens, BS, "cpu", min_shared_tokens=1)
    for query, match in ((randn(3, 4, 32, gen=gen), r"query: expected \[4, num_heads, head_dim\]"),
                         (randn(4, 4, 32, gen=gen)[0], "query: expected"),
                         (randn(4, 3, 32, gen=gen), "query: 3 heads is not a multiple")):
        with pytest.raises(ValueError, match=match):
            cascade_attention(query, key, key, plan)
