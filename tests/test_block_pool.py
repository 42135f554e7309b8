"""kvkernels.BlockPool: allocation order, refcounts, the null block, prefix hashing and lookup, lazy
eviction, pluggable hash and eviction policy, bad use, and concurrent use."""

import hashlib
import struct
import threading

import numpy as np
import pytest
import torch  # noqa: F401  (libtorch before the kvkernels extension)

import kvkernels
from kvkernels.cache import BlockPool, EvictionPolicy, OutOfBlocksError


def pool_state(pool: BlockPool):
    """Everything a failed call must leave unchanged."""
    return (list(pool.policy), pool.ref.copy().tolist(), pool.stats(), pool.cached.copy().tolist())


def tokens(*values):
    return np.array(values, dtype=np.int64)


def register(pool: BlockPool, token_ids, extra=b""):
    """Allocate and register full blocks for ``token_ids`` (as a sequence's append would)."""
    token_ids = np.asarray(token_ids, dtype=np.int64)
    hashes = pool.prefix_hashes(token_ids, extra)
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes):
        assert pool.cache_block(block, h)
    return blocks


def test_exports():
    assert kvkernels.BlockPool is BlockPool and kvkernels.OutOfBlocksError is OutOfBlocksError
    assert issubclass(OutOfBlocksError, RuntimeError)


def test_null_block_is_never_allocated():
    pool = BlockPool(6, 4)
    assert pool.null_block == 0 and pool.num_free_blocks == 5
    blocks = pool.allocate(5)
    assert sorted(blocks) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 0 and all(pool.refcount(b) == 1 for b in blocks)
    pool.check_invariants([blocks])


def test_out_of_blocks_allocates_nothing():
    pool = BlockPool(5, 4)
    held = pool.allocate(1)
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError, match=r"need 4, 3 free of 4") as info:
        pool.allocate(4, "a test")
    assert "for a test" in str(info.value) and (info.value.needed, info.value.free) == (4, 3)
    assert pool_state(pool) == before
    assert len(pool.allocate(3)) == 3
    pool.check_invariants([held + [b for b in range(1, 5) if b not in held]])


def test_unreferenced_blocks_are_reused_before_cached_ones_and_cached_ones_lru():
    pool = BlockPool(8, 2)
    a = register(pool, [1, 2, 3, 4, 5, 6])  # three cached blocks of one sequence
    b = register(pool, [7, 8, 9, 10])
    plain = pool.allocate(1)
    pool.free(a)  # tail-first: a[2] is evicted before a[1] before a[0]
    pool.free(plain)
    pool.free(b)
    order = list(pool.policy)
    # Uncached first (the untouched block 8 and the partial `plain`), then cached, oldest free first.
    assert order[:2] == [plain[0], 7]  # block 7 was never used
    assert order[-5:] == [a[2], a[1], a[0], b[1], b[0]]
    # Allocating everything but one block evicts in that order and keeps b[0] (the last freed head).
    got = pool.allocate(6)
    assert got == order[:6] and list(pool.policy) == [b[0]]
    assert pool.stats()["evictions"] == 4


def test_shared_block_is_free_only_after_its_last_reference():
    pool = BlockPool(4, 2)
    (block,) = pool.allocate(1)
    pool.incref([block])
    assert pool.refcount(block) == 2 and pool.stats()["num_shared_blocks"] == 1
    assert pool.free([block]) == [] and not pool.is_free(block)
    assert pool.free([block]) == [block] and pool.is_free(block)
    pool.check_invariants([])


@pytest.mark.parametrize("call, blocks, error, message", [
    ("free", [2], ValueError, r"block 2 is already free \(double free\)"),
    ("free", [0], ValueError, r"block id 0 out of range \[1, 4\)"),
    ("free", [4], ValueError, r"block id 4 out of range"),
    ("free", [-1], ValueError, r"block id -1 out of range"),
    ("free", [1.0], TypeError, r"expected a flat sequence of int block ids"),
    ("free", [[1]], TypeError, r"expected a flat sequence of int block ids"),
    ("free", [1, 1], ValueError, r"the same block appears twice"),
    ("incref", [2], ValueError, r"block 2 is free"),
    ("touch", [0], ValueError, r"block id 0 out of range"),
])
def test_bad_block_ids_raise_and_change_nothing(call, blocks, error, message):
    pool = BlockPool(4, 2)
    pool.allocate(1)  # block 1 in use, 2 and 3 free
    pool.incref([1])
    before = pool_state(pool)
    with pytest.raises(error, match=message):
        getattr(pool, call)(blocks)
    assert pool_state(pool) == before


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_blocks=1, block_size=4), "num_blocks: expected an int >= 2"),
    (dict(num_blocks=4, block_size=0), "block_size: expected an int >= 1"),
    (dict(num_blocks=4.0, block_size=4), "num_blocks: expected an int"),
    (dict(num_blocks=4, block_size=4, hash_algorithm="nope"), "unknown hashlib algorithm 'nope'"),
    (dict(num_blocks=4, block_size=4, hash_algorithm="shake_128"), "no fixed digest size"),
])
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockPool(**kwargs)


def test_block_hash_is_sha256_of_parent_extra_and_int64_tokens():
    pool = BlockPool(4, 2)
    data = tokens(5, 7).tobytes()
    root = hashlib.sha256(b"kvkernels prefix-cache root").digest()
    first = hashlib.sha256(root + struct.pack("<I", 3) + b"abc" + data).digest()
    assert pool.root_hash == root
    assert pool.hash_block(None, data, b"abc") == first
    assert pool.hash_block(first, data) == hashlib.sha256(first + struct.pack("<I", 0) + data).digest()


def test_hash_chain_depends_on_parent_tokens_and_extra_keys():
    pool = BlockPool(4, 2)
    (a1, a2) = pool.prefix_hashes(tokens(1, 2, 3, 4))
    (b1, b2) = pool.prefix_hashes(tokens(9, 2, 3, 4))
    assert a2 != b2  # same second block, different parent
    assert pool.prefix_hashes(tokens(1, 2, 3, 4), b"tenant-a") != [a1, a2]
    assert pool.prefix_hashes(tokens(1, 2, 3, 4, 5)) == [a1, a2]  # only full blocks


def test_pluggable_hash_function_is_used():
    calls = []

    def weak_hash(data: bytes) -> bytes:
        calls.append(data)
        return hashlib.md5(data).digest()

    pool = BlockPool(6, 2, hash_algorithm=weak_hash)
    assert len(pool.root_hash) == 16
    register(pool, [1, 2, 3, 4])
    blocks, hashes = pool.acquire_prefix(tokens(1, 2, 3, 4, 5))
    assert len(blocks) == 2 and all(len(h) == 16 for h in hashes) and len(calls) >= 5
    assert BlockPool(4, 2, hash_algorithm="blake2b").root_hash == hashlib.blake2b(
        b"kvkernels prefix-cache root").digest()


def test_a_hash_collision_never_puts_one_block_twice_in_a_prefix():
    pool = BlockPool(6, 2, hash_algorithm=lambda data: b"same")  # every block collides
    a, b = pool.allocate(2)
    assert pool.cache_block(a, pool.hash_block(None, tokens(1, 2).tobytes()))
    assert not pool.cache_block(b, b"same")
    got, _ = pool.acquire_prefix(tokens(1, 2, 3, 4, 5))
    assert got == [a] and pool.refcount(a) == 2


def test_prefix_hit_never_covers_the_last_token():
    pool = BlockPool(8, 4)
    blocks = register(pool, range(8))  # two full blocks
    got, _ = pool.acquire_prefix(tokens(*range(8)))  # 8 tokens: the second block holds the last one
    assert got == blocks[:1]
    got2, _ = pool.acquire_prefix(tokens(*range(9)))
    assert got2 == blocks
    assert pool.refcount(blocks[0]) == 3 and pool.refcount(blocks[1]) == 2
    s = pool.stats()
    assert (s["prefix_queries"], s["prefix_hits"], s["prefix_query_tokens"], s["prefix_hit_tokens"]) == (2, 2, 17, 12)


def test_prefix_lookup_stops_at_the_first_miss_and_respects_extra_keys():
    pool = BlockPool(8, 2)
    blocks = register(pool, [1, 2, 3, 4, 5, 6], b"adapter-1")
    assert pool.acquire_prefix(tokens(1, 2, 9, 9, 5, 6, 7), b"adapter-1")[0] == blocks[:1]
    assert pool.acquire_prefix(tokens(1, 2, 3, 4, 5, 6, 7), b"adapter-2")[0] == []
    assert pool.acquire_prefix(tokens(1, 2, 3, 4, 5, 6, 7))[0] == []


def test_freed_cached_block_stays_a_hit_until_reused():
    pool = BlockPool(4, 2)  # 3 usable blocks
    (block,) = register(pool, [1, 2])
    pool.free([block])
    assert pool.is_free(block) and pool.num_free_blocks == 3 and pool.num_cached_blocks == 1
    got, _ = pool.acquire_prefix(tokens(1, 2, 3))  # revives it: out of the free list, refcount 1
    assert got == [block] and not pool.is_free(block) and pool.num_free_blocks == 2
    assert block not in list(pool.policy)
    pool.free([block])
    others = pool.allocate(2)  # uncached blocks go first: the cached one survives
    assert block not in others and pool.cached_block(pool.block_hash(block)) == block
    pool.allocate(1)  # now it is reused: its entry is evicted
    assert pool.block_hash(block) is None and pool.num_cached_blocks == 0
    assert pool.acquire_prefix(tokens(1, 2, 3))[0] == []
    assert pool.stats()["evictions"] == 1 and pool.stats()["evicted_tokens"] == 2


def test_identical_blocks_are_not_merged():
    pool = BlockPool(6, 2)
    (h,) = pool.prefix_hashes(tokens(1, 2))
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h) and not pool.cache_block(b, h)
    assert pool.cached_block(h) == a and pool.block_hash(b) is None
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_block(a, b"other")
    pool.free([a, b])
    with pytest.raises(ValueError, match="is free"):
        pool.cache_block(b, b"x")


def test_prefix_caching_off_registers_nothing_but_counts_queries():
    pool = BlockPool(6, 2, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    assert not pool.cache_block(block, b"h")
    assert pool.acquire_prefix(tokens(1, 2, 3)) == ([], [])
    assert pool.stats()["prefix_query_tokens"] == 3 and pool.stats()["prefix_hit_tokens"] == 0


class StackPolicy(EvictionPolicy):
    """Most recently freed first, no regard for cached blocks: just to prove the pool uses the
    policy it is given."""

    def reset(self, num_blocks):
        self.stack = []

    def push(self, block, cached):
        self.stack.append(block)

    def remove(self, block):
        self.stack.remove(block)

    def pop(self):
        return self.stack.pop()

    def __len__(self):
        return len(self.stack)

    def __iter__(self):
        return iter(reversed(self.stack))


def test_pluggable_eviction_policy_decides_the_order():
    pool = BlockPool(6, 2, eviction_policy=StackPolicy())
    first = pool.allocate(2)
    assert first == [1, 2]  # the pool pushed 5..1, the stack pops 1 first
    (cached,) = register(pool, [1, 2])
    pool.free([cached])
    pool.free(first)
    assert pool.allocate(1) == [first[0]]  # LRU would have taken an untouched block instead
    assert pool.acquire_prefix(tokens(1, 2, 3))[0] == [cached]  # remove() on a hit
    pool.check_invariants()


def test_check_invariants_detects_a_wrong_refcount():
    pool = BlockPool(4, 2)
    blocks = pool.allocate(2)
    pool.check_invariants([blocks])
    with pytest.raises(AssertionError, match="refcount of block"):
        pool.check_invariants([blocks[:1]])
    pool.ref[blocks[0]] = 0  # corrupt: unreferenced but not in the free list
    with pytest.raises(AssertionError, match="not free"):
        pool.check_invariants()


def test_concurrent_allocate_share_free_keeps_the_pool_consistent():
    pool = BlockPool(64, 4)
    held: dict[int, list] = {}
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        mine = []
        try:
            for _ in range(400):
                op = rng.integers(4)
                if op == 0:
                    try:
                        mine.append(pool.allocate(int(rng.integers(1, 4))))
                    except OutOfBlocksError:
                        pass
                elif op == 1 and mine:
                    blocks = mine[int(rng.integers(len(mine)))]
                    pool.incref(blocks)
                    mine.append(list(blocks))
                elif op == 2 and mine:
                    pool.free(mine.pop(int(rng.integers(len(mine)))))
                elif op == 3:
                    data = rng.integers(0, 3, size=9)
                    got, _ = pool.acquire_prefix(data)
                    if got:
                        mine.append(got)
                    elif mine and len(mine[-1]) == 2:
                        with pool.lock:  # check-then-register as one step, as the cache does
                            for block, h in zip(mine[-1], pool.prefix_hashes(data, max_blocks=2)):
                                if pool.block_hash(block) is None:
                                    pool.cache_block(block, h)
            held[seed] = mine
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    tables = [blocks for mine in held.values() for blocks in mine]
    counts = np.zeros(64, dtype=np.int64)
    for blocks in tables:
        np.add.at(counts, blocks, 1)
    assert (counts == pool.ref).all()
    assert pool.num_free_blocks == 63 - int((counts[1:] > 0).sum())
    for blocks in tables:
        pool.free(blocks)
    assert pool.num_free_blocks == 63 and not pool.ref.any()
