"""Block allocator of a paged KV cache: refcounts, the free list, and the prefix cache.

A block is a fixed-size run of token slots (``block_size`` tokens of one sequence). Block 0 is the
*null block*: never handed out, used as padding in block tables so a kernel that reads past a
sequence's length reads a valid (harmless) block instead of a wild id.

Free blocks wait in an eviction policy, by default an intrusive doubly linked list (two int lists
indexed by block id, so allocate, free and touch are O(1) with no per-node objects). Full blocks are
registered in the prefix cache under a chained hash ``H(parent hash, extra keys, block tokens)``; when
such a block's last reference goes away it stays in the free list *with* its hash, so a later
request can still hit it ("touch" takes it back out), and the hash is dropped only when the block is
popped for reuse (lazy eviction).
"""

from __future__ import annotations

import hashlib
import struct
import threading
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

NULL_BLOCK = 0

HashFn = Callable[[bytes], bytes]


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than an operation needs. Nothing was allocated or changed:
    the caller can catch it, preempt or free something, and retry."""

    def __init__(self, needed: int, free: int, usable: int, what: str = "") -> None:
        self.needed, self.free, self.usable = needed, free, usable
        where = f" for {what}" if what else ""
        super().__init__(f"kvkernels: out of KV-cache blocks{where}: need {needed}, {free} free of "
                         f"{usable} (nothing was allocated)")


# ---- eviction policies ---------------------------------------------------------------------------


class EvictionPolicy:
    """Holds the free blocks and decides which one is reused next.

    The pool calls ``push`` when a block loses its last reference (``cached``: it still holds a
    prefix-cache entry worth keeping), ``remove`` when a prefix hit revives a free block, and
    ``pop`` to get the block to reuse. All four must be cheap: they run on every allocation.
    """

    def reset(self, num_blocks: int) -> None:
        """Forget everything; block ids will be in ``[0, num_blocks)``."""
        raise NotImplementedError

    def push(self, block: int, cached: bool) -> None:
        raise NotImplementedError

    def remove(self, block: int) -> None:
        raise NotImplementedError

    def pop(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        """Free blocks in the order they would be popped (for inspection and tests)."""
        raise NotImplementedError


class LRUEvictionPolicy(EvictionPolicy):
    """Least recently freed first, with blocks that hold nothing worth keeping reused before any
    cached block.

    A block freed with ``cached=False`` (a partial block, or prefix caching off) goes to the front:
    reusing it loses nothing. A cached block goes to the back and is evicted last. Together with the
    cache freeing a sequence's blocks tail-first, the first blocks of a prompt (the ones most likely
    to be shared) are the last to go.
    """

    def reset(self, num_blocks: int) -> None:
        # Intrusive list over block ids; index num_blocks is the sentinel (head = next[s], tail = prev[s]).
        self._sentinel = s = num_blocks
        self._next = [s] * (num_blocks + 1)
        self._prev = [s] * (num_blocks + 1)
        self._member = [False] * num_blocks
        self._len = 0

    def _link(self, block: int, after: int) -> None:
        nxt = self._next[after]
        self._prev[block], self._next[block] = after, nxt
        self._next[after] = block
        self._prev[nxt] = block
        self._member[block] = True
        self._len += 1

    def push(self, block: int, cached: bool) -> None:
        self._link(block, self._prev[self._sentinel] if cached else self._sentinel)

    def remove(self, block: int) -> None:
        prev, nxt = self._prev[block], self._next[block]
        self._next[prev], self._prev[nxt] = nxt, prev
        self._member[block] = False
        self._len -= 1

    def pop(self) -> int:
        block = self._next[self._sentinel]
        self.remove(block)
        return block

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return self._member[block]

    def __iter__(self) -> Iterator[int]:
        block = self._next[self._sentinel]
        while block != self._sentinel:
            yield block
            block = self._next[block]


# ---- hashing -------------------------------------------------------------------------------------


def _hash_fn(algorithm: Union[str, HashFn]) -> HashFn:
    if callable(algorithm):
        return algorithm
    if algorithm not in hashlib.algorithms_available:
        raise ValueError(f"kvkernels.BlockPool: hash_algorithm: unknown hashlib algorithm {algorithm!r}")
    if algorithm.startswith("shake"):
        raise ValueError(f"kvkernels.BlockPool: hash_algorithm: {algorithm!r} has no fixed digest size")
    # The named constructor (hashlib.sha256) is faster than hashlib.new(name) on every call.
    constructor = getattr(hashlib, algorithm, None) or (lambda data: hashlib.new(algorithm, data))
    return lambda data: constructor(data).digest()


_EXTRA_TYPES = (str, int, bytes)


def encode_extra_keys(extra_keys) -> bytes:
    """Canonical bytes of the extra keys that separate otherwise identical prefixes (adapter id,
    multimodal ids, per-tenant salt). Only str / int / bytes and tuples of them are accepted: their
    repr is deterministic across processes, unlike an object's default repr (an address)."""
    if extra_keys is None:
        return b""
    if not isinstance(extra_keys, (tuple, list)):
        extra_keys = (extra_keys,)

    def check(key) -> None:
        if isinstance(key, (tuple, list)):
            for k in key:
                check(k)
        elif not isinstance(key, _EXTRA_TYPES) or isinstance(key, bool):
            raise TypeError(f"kvkernels: extra_keys: expected str, int or bytes (or tuples of them), "
                            f"got {type(key).__name__}")
    check(extra_keys)
    return repr(tuple(tuple(k) if isinstance(k, list) else k for k in extra_keys)).encode()


# ---- the pool ------------------------------------------------------------------------------------


class BlockPool:
    """Refcounted block allocator with prefix caching.

    Args:
        num_blocks: blocks in the storage, the null block (id 0) included, so ``num_blocks - 1``
            can be allocated.
        block_size: tokens per block (used to split token ids into blocks for hashing).
        enable_prefix_caching: register full blocks by hash and serve hits (``acquire_prefix``).
        hash_algorithm: a ``hashlib`` name (default ``"sha256"``) or any ``bytes -> bytes`` function.
        eviction_policy: an ``EvictionPolicy`` (default ``LRUEvictionPolicy()``).

    Every public method takes the pool's re-entrant lock, so the pool may be shared between
    threads; ``PagedKVCache`` holds the same lock around its own multi-step updates.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 hash_algorithm: Union[str, HashFn] = "sha256",
                 eviction_policy: Optional[EvictionPolicy] = None) -> None:
        for name, value, low in (("num_blocks", num_blocks, 2), ("block_size", block_size, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"kvkernels.BlockPool: {name}: expected an int >= {low}, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.lock = threading.RLock()
        self._hash = _hash_fn(hash_algorithm)
        # The parent "hash" of a first block: a digest of the same function, hence the same length.
        self.root_hash = self._hash(b"kvkernels prefix-cache root")
        # Refcounts as numpy: the cache checks whole batches of blocks at once (ref[blocks] > 1).
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self._block_hash: list[Optional[bytes]] = [None] * num_blocks
        # cached[b]: b holds a prefix-cache entry. The cache writes into such a block only after
        # copying it, even when it is the only holder, so a hit never sees modified content.
        self.cached = np.zeros(num_blocks, dtype=bool)
        self._by_hash: dict[bytes, int] = {}  # hash -> block holding it
        self.policy = eviction_policy if eviction_policy is not None else LRUEvictionPolicy()
        self.policy.reset(num_blocks)
        for block in range(num_blocks - 1, 0, -1):  # pushed to the front: block 1 comes out first
            self.policy.push(block, False)
        # Token-level counters (see stats()).
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.evictions = 0

    # -- sizes -------------------------------------------------------------------------------------

    @property
    def null_block(self) -> int:
        return NULL_BLOCK

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references, cached ones included (they are evicted on reuse)."""
        return len(self.policy)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix-cache entry, referenced or not."""
        return len(self._by_hash)

    def refcount(self, block: int) -> int:
        return int(self.ref[self._check_id(block)])

    def block_hash(self, block: int) -> Optional[bytes]:
        return self._block_hash[self._check_id(block)]

    def is_free(self, block: int) -> bool:
        with self.lock:
            return self.ref[self._check_id(block)] == 0 and block != NULL_BLOCK

    # -- allocate / share / free -------------------------------------------------------------------

    def check_available(self, needed: int, what: str = "") -> None:
        """Raise OutOfBlocksError unless ``needed`` blocks can be allocated now."""
        if needed > len(self.policy):
            raise OutOfBlocksError(needed, len(self.policy), self.num_usable_blocks, what)

    def allocate(self, n: int, what: str = "") -> list[int]:
        """``n`` blocks with refcount 1, least valuable first. All or nothing: OutOfBlocksError
        if fewer than ``n`` are free. A cached block loses its hash here (lazy eviction)."""
        with self.lock:
            self.check_available(n, what)
            blocks = [self.policy.pop() for _ in range(n)]
            for block in blocks:
                h = self._block_hash[block]
                if h is not None:
                    self._block_hash[block] = None
                    self.cached[block] = False
                    if self._by_hash.get(h) == block:
                        del self._by_hash[h]
                    self.evictions += 1
            if blocks:
                self.ref[blocks] = 1
            return blocks

    def incref(self, blocks: Sequence[int], *, distinct: bool = False) -> None:
        """One more reference per occurrence in ``blocks`` (all currently referenced), e.g. on a
        fork. ``distinct=True`` promises no repeats (one block table): a plain vectorized add,
        several times faster than the repeat-safe one on long tables."""
        with self.lock:
            arr = self._check_ids(blocks)
            if arr.size and (self.ref[arr] <= 0).any():
                bad = int(arr[self.ref[arr] <= 0][0])
                raise ValueError(f"kvkernels.BlockPool.incref: block {bad} is free")
            if distinct:
                self.ref[arr] += 1
            else:
                np.add.at(self.ref, arr, 1)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to each of ``blocks``, reviving free (cached) ones: a prefix hit."""
        with self.lock:
            arr = self._check_ids(blocks)
            for block in arr.tolist():
                if self.ref[block] == 0:
                    self.policy.remove(block)
                self.ref[block] += 1

    def free(self, blocks: Sequence[int], *, distinct: bool = False) -> list[int]:
        """Drop one reference to each of ``blocks`` (distinct ids, in block-table order). Blocks
        reaching zero go to the eviction policy tail-first: the end of a sequence is reused before
        its beginning. Returns the blocks that became free. ``distinct=True``: the caller promises
        no repeats (one block table), which skips that check."""
        with self.lock:
            arr = self._check_ids(blocks)
            if not arr.size:
                return []
            if (self.ref[arr] <= 0).any():
                bad = int(arr[self.ref[arr] <= 0][0])
                raise ValueError(f"kvkernels.BlockPool.free: block {bad} is already free (double free)")
            if not distinct and np.unique(arr).size != arr.size:
                raise ValueError("kvkernels.BlockPool.free: blocks: the same block appears twice")
            self.ref[arr] -= 1
            released = arr[self.ref[arr] == 0].tolist()
            for block in reversed(released):
                self.policy.push(block, self._block_hash[block] is not None)
            return released

    # -- prefix cache ------------------------------------------------------------------------------

    def hash_block(self, parent_hash: Optional[bytes], token_bytes: bytes, extra: bytes = b"") -> bytes:
        """Chained hash of one full block: H(parent, len(extra), extra, tokens as int64).

        ``token_bytes`` is the block's token ids as little-endian int64 (``np.int64`` array
        ``.tobytes()``); ``extra`` comes from ``encode_extra_keys``. ``parent_hash=None`` means the
        first block of a sequence.
        """
        parent = self.root_hash if parent_hash is None else parent_hash
        return self._hash(b"".join((parent, struct.pack("<I", len(extra)), extra, token_bytes)))

    def cache_block(self, block: int, block_hash: bytes) -> bool:
        """Register a full, referenced block under ``block_hash``. Returns False (and leaves the
        block unregistered) when prefix caching is off or another block already holds the hash:
        identical blocks are not merged, block tables stay append-only."""
        with self.lock:
            if not self.enable_prefix_caching or block_hash in self._by_hash:
                return False
            if self.ref[self._check_id(block)] <= 0:
                raise ValueError(f"kvkernels.BlockPool.cache_block: block {block} is free")
            if self._block_hash[block] is not None:
                raise ValueError(f"kvkernels.BlockPool.cache_block: block {block} is already cached")
            self._block_hash[block] = block_hash
            self.cached[block] = True
            self._by_hash[block_hash] = block
            return True

    def cached_block(self, block_hash: bytes) -> Optional[int]:
        """The block holding ``block_hash``, or None (no reference is taken)."""
        with self.lock:
            return self._by_hash.get(block_hash)

    def prefix_hashes(self, token_ids: np.ndarray, extra: bytes = b"", max_blocks: Optional[int] = None,
                      parent_hash: Optional[bytes] = None) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids`` (int64 array), at most ``max_blocks``."""
        bs = self.block_size
        n = len(token_ids) // bs if max_blocks is None else min(max_blocks, len(token_ids) // bs)
        data = np.ascontiguousarray(token_ids[:n * bs], dtype="<i8").tobytes()
        hashes, parent, step = [], parent_hash, 8 * bs
        for i in range(n):
            parent = self.hash_block(parent, data[i * step:(i + 1) * step], extra)
            hashes.append(parent)
        return hashes

    def acquire_prefix(self, token_ids: np.ndarray, extra: bytes = b"") -> tuple[list[int], list[bytes]]:
        """Longest run of cached full blocks at the start of ``token_ids``, with a reference taken on
        each (lookup and pin under one lock, so no other thread can evict them in between).

        Never covers the last token: its logits are needed, so at least one token is left to compute.
        Counts one query of ``len(token_ids)`` tokens and the hit tokens. Returns (blocks, hashes).
        """
        with self.lock:
            self.prefix_queries += 1
            self.prefix_query_tokens += len(token_ids)
            if not self.enable_prefix_caching or len(token_ids) == 0:
                return [], []
            max_blocks = (len(token_ids) - 1) // self.block_size
            blocks, hashes, parent, seen = [], [], None, set()
            bs8 = 8 * self.block_size
            data = np.ascontiguousarray(token_ids[:max_blocks * self.block_size], dtype="<i8").tobytes()
            for i in range(max_blocks):
                parent = self.hash_block(parent, data[i * bs8:(i + 1) * bs8], extra)
                block = self._by_hash.get(parent)
                if block is None or block in seen:  # a repeat can only be a custom-hash collision
                    break
                blocks.append(block)
                hashes.append(parent)
                seen.add(block)
            self.touch(blocks)
            if blocks:
                self.prefix_hits += 1
                self.prefix_hit_tokens += len(blocks) * self.block_size
            return blocks, hashes

    # -- inspection --------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self.lock:
            return {
                "num_blocks": self.num_usable_blocks,
                "num_free_blocks": len(self.policy),
                "num_used_blocks": self.num_usable_blocks - len(self.policy),
                "num_cached_blocks": len(self._by_hash),
                "num_shared_blocks": int((self.ref > 1).sum()),
                "prefix_queries": self.prefix_queries,
                "prefix_hits": self.prefix_hits,
                "prefix_query_tokens": self.prefix_query_tokens,
                "prefix_hit_tokens": self.prefix_hit_tokens,
                "evictions": self.evictions,
                "evicted_tokens": self.evictions * self.block_size,
            }

    def check_invariants(self, tables: Optional[Iterable[Sequence[int]]] = None) -> None:
        """Assert the pool's internal consistency (tests, debugging). With ``tables`` (every live
        block table), also that each refcount equals the number of tables holding the block."""
        with self.lock:
            free = list(self.policy)
            assert len(free) == len(set(free)) == len(self.policy), "free list has duplicates"
            assert NULL_BLOCK not in free and self.ref[NULL_BLOCK] == 0, "null block in use or free"
            for block in free:
                assert self.ref[block] == 0, f"block {block} is free with refcount {self.ref[block]}"
            assert int((self.ref[1:] == 0).sum()) == len(free), "an unreferenced block is not free"
            assert (self.ref >= 0).all(), "negative refcount"
            for h, block in self._by_hash.items():
                assert self._block_hash[block] == h, f"cached hash of block {block} disagrees"
            assert sum(h is not None for h in self._block_hash) == len(self._by_hash), "stray block hash"
            assert int(self.cached.sum()) == len(self._by_hash), "cached mask disagrees with the hashes"
            if tables is not None:
                counts = np.zeros(self.num_blocks, dtype=np.int64)
                for table in tables:
                    table = np.asarray(table, dtype=np.int64)
                    assert np.unique(table).size == table.size, "a block appears twice in one table"
                    np.add.at(counts, table, 1)
                assert counts[NULL_BLOCK] == 0, "null block inside a table"
                bad = np.flatnonzero(counts != self.ref)
                assert bad.size == 0, (f"refcount of block {int(bad[0])} is {int(self.ref[bad[0]])}, "
                                       f"{int(counts[bad[0]])} tables hold it")

    # -- argument checks ---------------------------------------------------------------------------

    def _check_id(self, block) -> int:
        if not isinstance(block, (int, np.integer)) or isinstance(block, bool):
            raise TypeError(f"kvkernels.BlockPool: block id: expected an int, got {type(block).__name__}")
        if not 0 < block < self.num_blocks:
            raise ValueError(f"kvkernels.BlockPool: block id {block} out of range [1, {self.num_blocks})")
        return int(block)

    def _check_ids(self, blocks) -> np.ndarray:
        arr = np.asarray(blocks)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(f"kvkernels.BlockPool: blocks: expected a flat sequence of int block ids, got "
                            f"{arr.ndim}-d {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        if arr.min() < 1 or arr.max() >= self.num_blocks:
            bad = int(arr[(arr < 1) | (arr >= self.num_blocks)][0])
            raise ValueError(f"kvkernels.BlockPool: block id {bad} out of range [1, {self.num_blocks})")
        return arr
