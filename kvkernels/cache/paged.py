"""``PagedKVCache``: the K/V storage of every layer plus the sequences that live in it.

Per-sequence state is kept in rows of preallocated numpy arrays (block table, lengths, the token ids
of the block being filled) so that a decode step for a whole batch is a handful of vectorized
operations; Python loops run only over the few sequences that need a new block, a copy-on-write, or
a hash (a block just became full). Block tables grow by one entry when a block is added and are
never rebuilt.

Sequences are named by int ids that are never reused, so a freed id stays an error. Every public
method takes one re-entrant lock (the pool's), which makes the cache safe to share between threads;
every check that can fail runs before the first change, so a failed call changes nothing.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from kvkernels import memory, ops
from kvkernels.cache.cascade import plan_cascade
from kvkernels.cache.pool import BlockPool, EvictionPolicy, HashFn, encode_extra_keys
from kvkernels.cache.sparse import SparsePolicy
from kvkernels.cache.stats import CacheStats
from kvkernels.cache.tokens import as_token_array, check_count


class UnknownSequenceError(KeyError):
    """A sequence id that was never returned by this cache, or was freed."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class DecodeStep(NamedTuple):
    """What one batched decode step hands to the kernels (all on the cache's device)."""
    slot_mapping: torch.Tensor  # int64 [num_seqs]: where to write each new token's K/V
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]; padding is the null block 0
    seq_lens: torch.Tensor  # int32 [num_seqs]: KV tokens per sequence, the new token included


class PagedKVCache:
    """Paged K/V storage for ``num_layers`` layers with refcounted block sharing.

    Storage is one tensor ``kv`` ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
    ``key_cache(layer)`` / ``value_cache(layer)`` are its ``[num_blocks, block_size, H, D]`` views,
    the layout of ``kvkernels.ops``. Block 0 is the null block (padding), so ``num_blocks - 1``
    blocks hold tokens.

    Typical use::

        seq, cached = cache.add_sequence(prompt)          # cached prefix tokens (never the last)
        slots = cache.append(seq, prompt[cached:])        # slots of the tokens to prefill
        step = cache.append_decode(seqs, next_tokens)     # one token per sequence, batched
        ops.reshape_and_cache(k, v, cache.key_cache(l), cache.value_cache(l), step.slot_mapping)
        ops.paged_attention(q, ..., step.block_tables, step.seq_lens)

    Keyword options: ``hash_algorithm`` (hashlib name or ``bytes -> bytes``, default SHA-256) and
    ``eviction_policy`` go to the ``BlockPool``; ``sparse_policy`` (a ``SparsePolicy``) is applied
    automatically to a sequence each time it gets a new block; ``max_sequences`` is the initial
    number of rows (they grow on demand); ``pin_memory`` pins offload buffers (default: when the
    cache is on CUDA).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                 device: Union[str, torch.device] = "cpu", enable_prefix_caching: bool = True, *,
                 hash_algorithm: Union[str, HashFn] = "sha256",
                 eviction_policy: Optional[EvictionPolicy] = None,
                 sparse_policy: Optional[SparsePolicy] = None, max_sequences: int = 64,
                 pin_memory: Optional[bool] = None) -> None:
        for name, value, low in (("num_layers", num_layers, 1), ("num_kv_heads", num_kv_heads, 1),
                                 ("head_dim", head_dim, 1), ("num_blocks", num_blocks, 2),
                                 ("block_size", block_size, 1), ("max_sequences", max_sequences, 1)):
            check_count(f"PagedKVCache: {name}", value, low)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"kvkernels.PagedKVCache: dtype: expected a floating torch.dtype, got {dtype!r}")
        if sparse_policy is not None and not isinstance(sparse_policy, SparsePolicy):
            raise TypeError("kvkernels.PagedKVCache: sparse_policy: expected a kvkernels.cache.SparsePolicy")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.device = torch.device(device)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                              hash_algorithm=hash_algorithm, eviction_policy=eviction_policy)
        self._lock = self.pool.lock
        self.sparse_policy = sparse_policy
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        self.kv = self._allocate_storage()
        self.kv.select(self._block_dim, 0).zero_()  # the null block: padding must never read as NaN garbage
        self.bytes_per_token = self.kv.numel() // (num_blocks * block_size) * self.kv.element_size()
        self.bytes_per_block = self.bytes_per_token * block_size
        self._init_rows(max_sequences)
        self._next_id = 0
        self._row_of: dict[int, int] = {}
        self._counters = dict(forks=0, cow_copies=0, cow_copied_tokens=0, sparse_evicted_blocks=0,
                              sparse_freed_blocks=0, offloads=0, restores=0, restore_cache_hit_blocks=0)

    # Storage is [layers, 2 (K, V), blocks, block_size, heads, dim]; blocks are along this dim (what
    # copy_blocks / swap_blocks take). Subclasses with another storage (MLAPagedCache) override both.
    _block_dim = 2

    def _allocate_storage(self) -> torch.Tensor:
        return memory.empty((self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                             self.head_dim), self.dtype, self.device)

    # ---- row storage -----------------------------------------------------------------------------

    def _init_rows(self, rows: int) -> None:
        bs = self.block_size
        self._tables = np.zeros((rows, 8), dtype=np.int32)  # block ids; 0 (null) past the end
        self._nblocks = np.zeros(rows, dtype=np.int32)  # entries in the block table
        self._kv_len = np.zeros(rows, dtype=np.int32)  # tokens in the table (the kernels' seq_lens)
        self._num_tokens = np.zeros(rows, dtype=np.int64)  # logical length (> kv_len once sparse)
        self._tail = np.zeros((rows, bs), dtype=np.int64)  # token ids of the block being filled
        self._hashing = np.zeros(rows, dtype=bool)  # register this row's full blocks for prefix hits
        self._sparse = np.zeros(rows, dtype=bool)  # a sparse policy dropped blocks of this row
        self._resident = np.zeros(rows, dtype=bool)  # live and on the device (not offloaded)
        self._seq_of_row: list[Optional[int]] = [None] * rows
        self._chain: list[list] = [[] for _ in range(rows)]  # hashes of the full logical blocks
        self._history: list[list] = [[] for _ in range(rows)]  # token bytes of the full logical blocks
        self._extra: list[bytes] = [b""] * rows  # encoded extra keys
        self._logical: list[Optional[np.ndarray]] = [None] * rows  # see _logical_blocks
        self._divergence: list[int] = [0] * rows  # tokens shared with the parent at fork time
        self._host: list[Optional[torch.Tensor]] = [None] * rows  # offloaded K/V
        self._free_rows = list(range(rows - 1, -1, -1))

    def _grow_rows(self) -> None:
        old = len(self._nblocks)
        new = 2 * old
        for name in ("_tables", "_nblocks", "_kv_len", "_num_tokens", "_tail", "_hashing", "_sparse",
                     "_resident"):
            a = getattr(self, name)
            b = np.zeros((new,) + a.shape[1:], dtype=a.dtype)
            b[:old] = a
            setattr(self, name, b)
        self._seq_of_row += [None] * old
        self._chain += [[] for _ in range(old)]
        self._history += [[] for _ in range(old)]
        self._extra += [b""] * old
        self._logical += [None] * old
        self._divergence += [0] * old
        self._host += [None] * old
        self._free_rows = list(range(new - 1, old - 1, -1)) + self._free_rows

    def _ensure_cols(self, needed: int) -> None:
        cols = self._tables.shape[1]
        if needed > cols:
            cols = min(max(needed, 2 * cols), self.num_blocks)
            wider = np.zeros((self._tables.shape[0], cols), dtype=np.int32)
            wider[:, :self._tables.shape[1]] = self._tables
            self._tables = wider

    def _new_row(self, seq: int) -> int:
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self._seq_of_row[row] = seq
        self._resident[row] = True
        self._hashing[row] = self.pool.enable_prefix_caching
        return row

    def _release_row(self, row: int) -> None:
        self._tables[row, :self._nblocks[row]] = 0
        self._nblocks[row] = self._kv_len[row] = self._num_tokens[row] = 0
        self._hashing[row] = self._sparse[row] = self._resident[row] = False
        self._seq_of_row[row] = None
        self._chain[row], self._history[row] = [], []
        self._extra[row], self._logical[row], self._divergence[row], self._host[row] = b"", None, 0, None
        self._free_rows.append(row)

    def _blocks(self, row: int) -> np.ndarray:
        return self._tables[row, :self._nblocks[row]]

    # ---- sequence lookup -------------------------------------------------------------------------

    def _unknown(self, seq, what: str) -> UnknownSequenceError:
        if isinstance(seq, int) and 0 <= seq < self._next_id:
            return UnknownSequenceError(f"kvkernels.PagedKVCache.{what}: sequence {seq} was freed")
        return UnknownSequenceError(f"kvkernels.PagedKVCache.{what}: unknown sequence {seq!r}")

    def _row(self, seq, what: str, resident: bool = True) -> int:
        try:
            row = self._row_of[seq]
        except (KeyError, TypeError):
            raise self._unknown(seq, what) from None
        if resident and not self._resident[row]:
            raise RuntimeError(f"kvkernels.PagedKVCache.{what}: sequence {seq} is offloaded; restore() it first")
        return row

    def _batch_rows(self, seqs, what: str) -> np.ndarray:
        """Rows of distinct, resident sequences (one vectorized lookup on the decode path)."""
        if not isinstance(seqs, (list, tuple)):
            if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Iterable):
                raise TypeError(f"kvkernels.PagedKVCache.{what}: seqs: expected a list of sequence ids")
            seqs = list(seqs)
        try:
            rows = np.fromiter(map(self._row_of.__getitem__, seqs), dtype=np.intp, count=len(seqs))
        except (KeyError, TypeError):
            bad = next(s for s in seqs if not isinstance(s, int) or s not in self._row_of)
            raise self._unknown(bad, what) from None
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"kvkernels.PagedKVCache.{what}: seqs: a sequence appears more than once")
        if rows.size and not self._resident[rows].all():
            bad = seqs[int(np.flatnonzero(~self._resident[rows])[0])]
            raise RuntimeError(f"kvkernels.PagedKVCache.{what}: sequence {bad} is offloaded; restore() it first")
        return rows

    # ---- views -----------------------------------------------------------------------------------

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv[self._layer(layer), 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.kv[self._layer(layer), 1]

    def _layer(self, layer) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise IndexError(f"kvkernels.PagedKVCache: layer {layer!r} out of range [0, {self.num_layers})")
        return layer

    # ---- adding and growing sequences ------------------------------------------------------------

    def add_sequence(self, token_ids, *, extra_keys=None) -> tuple[int, int]:
        """New sequence for prompt ``token_ids``; attaches the cached blocks of its longest cached
        prefix. Returns ``(seq, num_cached)``: the first ``num_cached`` tokens (whole blocks, never
        the last token) already hold KV; pass ``token_ids[num_cached:]`` to ``append``.

        ``extra_keys`` (str / int / bytes or a tuple of them: adapter id, tenant salt...) enter
        every block hash of this sequence, so prefixes only match under equal keys. Never raises
        OutOfBlocksError: hits reuse blocks that hold KV already.
        """
        with self._lock:
            tokens = as_token_array(token_ids, "PagedKVCache.add_sequence: token_ids")
            extra = encode_extra_keys(extra_keys)
            blocks, hashes = self.pool.acquire_prefix(tokens, extra)
            seq = self._next_id
            self._next_id += 1
            row = self._new_row(seq)
            self._row_of[seq] = row
            n, bs = len(blocks), self.block_size
            if n:
                self._ensure_cols(n)
                self._tables[row, :n] = blocks
                self._nblocks[row] = n
                self._kv_len[row] = self._num_tokens[row] = n * bs
                data = tokens[:n * bs].astype("<i8").tobytes()
                self._history[row] = [data[i * 8 * bs:(i + 1) * 8 * bs] for i in range(n)]
                self._chain[row] = hashes
            self._extra[row] = extra
            return seq, n * bs

    def append(self, seq: int, token_ids) -> torch.Tensor:
        """Add ``token_ids`` to ``seq``; returns their int64 slot mapping (where the caller writes
        their K/V, e.g. with ``ops.reshape_and_cache``). New blocks come from the pool; a shared (or
        prefix-cached) partly filled last block is copied first (copy-on-write). Blocks that become
        full are hashed and registered for prefix hits. OutOfBlocksError: nothing changed."""
        with self._lock:
            row = self._row(seq, "append")
            tokens = as_token_array(token_ids, "PagedKVCache.append: token_ids")
            n, bs = len(tokens), self.block_size
            if n == 0:
                return torch.empty(0, dtype=torch.int64, device=self.device)
            kv, nb = int(self._kv_len[row]), int(self._nblocks[row])
            off = kv % bs
            cow = off != 0 and self._needs_copy(int(self._tables[row, nb - 1]))
            new = -(-(kv + n) // bs) - nb
            self.pool.check_available(new + cow, f"append to sequence {seq}")
            self._ensure_cols(nb + new)
            if cow:
                self._copy_on_write([row])
            if new:
                self._tables[row, nb:nb + new] = self.pool.allocate(new)
                self._nblocks[row] = nb + new
            pos = np.arange(kv, kv + n)
            slots = self._tables[row, pos // bs].astype(np.int64) * bs + pos % bs
            # Token bookkeeping: hash each block that this call fills, keep the rest as the tail.
            if off:
                tokens = np.concatenate((self._tail[row, :off], tokens))
            full = len(tokens) // bs
            first = (kv - off) // bs
            for i in range(full):
                self._block_full(row, int(self._tables[row, first + i]), tokens[i * bs:(i + 1) * bs])
            rest = tokens[full * bs:]
            self._tail[row, :len(rest)] = rest
            self._kv_len[row] = kv + n
            self._num_tokens[row] += n
            if new and self.sparse_policy is not None:
                # The blocks this call wrote into stay: their slots were just handed out.
                self._auto_sparsify(np.array([row]), keep_from=first)
            return torch.from_numpy(slots).to(self.device)

    def append_decode(self, seqs: Sequence[int], token_ids) -> DecodeStep:
        """One token for each of ``seqs`` (distinct): the batched decode step.

        Returns ``DecodeStep(slot_mapping, block_tables, seq_lens)``, the three tensors a decode
        step needs, with the new tokens counted in ``seq_lens``. Copy-on-writes of the whole step
        run as one ``copy_blocks`` call before this returns. All checks (ids, types, free blocks for
        every sequence) run before anything changes.
        """
        with self._lock:
            rows = self._batch_rows(seqs, "append_decode")
            tokens = as_token_array(token_ids, "PagedKVCache.append_decode: token_ids")
            if len(tokens) != len(rows):
                raise ValueError(f"kvkernels.PagedKVCache.append_decode: token_ids: {len(tokens)} tokens "
                                 f"for {len(rows)} sequences")
            bs, pool = self.block_size, self.pool
            kv = self._kv_len[rows]
            off = kv % bs
            nb = self._nblocks[rows]
            fresh = off == 0  # the token opens a new block (also: an empty sequence)
            last = self._tables[rows, nb - 1]  # nb == 0 reads the padding column: masked by `fresh`
            shared = ~fresh & ((pool.ref[last] > 1) | pool.cached[last])
            fresh_idx = np.flatnonzero(fresh)
            shared_idx = np.flatnonzero(shared)
            need = fresh_idx.size + (self._copies_needed(last[shared_idx]) if shared_idx.size else 0)
            if need:
                pool.check_available(need, f"append_decode of {len(rows)} sequences")
            if fresh_idx.size:
                self._ensure_cols(int(nb[fresh_idx].max()) + 1)
            if shared_idx.size:
                self._copy_on_write(rows[shared_idx].tolist())
            if fresh_idx.size:
                grow = rows[fresh_idx]
                self._tables[grow, nb[fresh_idx]] = pool.allocate(fresh_idx.size)
                self._nblocks[grow] += 1
            blocks = self._tables[rows, kv // bs]
            slots = blocks.astype(np.int64) * bs + off
            self._tail[rows, off] = tokens
            self._kv_len[rows] = kv + 1
            self._num_tokens[rows] += 1
            for i in np.flatnonzero(off == bs - 1).tolist():  # blocks that just became full
                self._block_full(int(rows[i]), int(blocks[i]), self._tail[rows[i]])
            if fresh_idx.size and self.sparse_policy is not None:
                self._auto_sparsify(rows[fresh_idx])
            return DecodeStep(torch.from_numpy(slots).to(self.device), self._gather_tables(rows),
                              torch.from_numpy(self._kv_len[rows]).to(self.device))

    def _block_full(self, row: int, block: int, tokens: np.ndarray) -> None:
        """Record a block that just became full, and register it for prefix hits (hash it once)."""
        data = tokens.astype("<i8", copy=False).tobytes()
        self._history[row].append(data)
        if self._hashing[row]:
            chain = self._chain[row]
            h = self.pool.hash_block(chain[-1] if chain else None, data, self._extra[row])
            chain.append(h)
            self.pool.cache_block(block, h)

    # ---- copy-on-write ---------------------------------------------------------------------------

    def _needs_copy(self, block: int) -> bool:
        # A cached block is copied even by its only holder: the prefix cache promises its content.
        return bool(self.pool.ref[block] > 1 or self.pool.cached[block])

    def _copies_needed(self, blocks: np.ndarray) -> int:
        """Exact number of copies ``_copy_on_write`` makes for writers of these last blocks: k
        writers of a block with r references copy min(k, r - 1) times (the last one left owns it),
        or k times if the block is cached."""
        uniq, k = np.unique(blocks, return_counts=True)
        r = self.pool.ref[uniq]
        return int(np.where(self.pool.cached[uniq], k, np.minimum(k, r - 1)).sum())

    def _copy_on_write(self, rows: list[int]) -> None:
        """Give each row a private copy of its shared last block; one copy_blocks call for all.
        The caller has checked that the pool has the blocks. Tables change only after the copy
        succeeded."""
        ref, cached, bs = self.pool.ref, self.pool.cached, self.block_size
        writers, sources, pending = [], [], {}
        for row in rows:
            src = int(self._tables[row, int(self._nblocks[row]) - 1])
            # The last of k writers of an uncached block with k references keeps it.
            if cached[src] or ref[src] - pending.get(src, 0) > 1:
                writers.append(row)
                sources.append(src)
                pending[src] = pending.get(src, 0) + 1
        if not writers:
            return
        targets = self.pool.allocate(len(writers))
        try:
            mapping = torch.tensor(list(zip(sources, targets)), dtype=torch.int64, device=self.device)
            ops.copy_blocks(self.kv, mapping, block_dim=self._block_dim)
        except BaseException:
            self.pool.free(targets, distinct=True)
            raise
        for row, dst in zip(writers, targets):
            self._tables[row, int(self._nblocks[row]) - 1] = dst
            self._counters["cow_copied_tokens"] += int(self._kv_len[row]) % bs
        # Sources are released only after the copy, so none of them was handed out as a target.
        for src in sources:
            self.pool.free([src])
        self._counters["cow_copies"] += len(writers)

    # ---- sharing ---------------------------------------------------------------------------------

    def fork(self, seq: int, num_tokens: Optional[int] = None) -> int:
        """New sequence sharing ``seq``'s blocks by reference (no KV is copied; refcounts go up, the
        block table row is copied). ``num_tokens``: share only the first ``num_tokens`` tokens
        (not for a sequence a sparse policy has dropped blocks from). The first write of either side
        into a shared, partly filled block copies that block."""
        with self._lock:
            src = self._row(seq, "fork")
            n = self._prefix_len(src, num_tokens, "fork")
            child = self._next_id
            self._next_id += 1
            row = self._new_row(child)
            self._row_of[child] = row
            self._attach(row, src, n)
            self._divergence[row] = n
            self._counters["forks"] += 1
            return child

    def _prefix_len(self, row: int, num_tokens, what: str) -> int:
        total = int(self._num_tokens[row])
        if num_tokens is None:
            return total
        check_count(f"PagedKVCache.{what}: num_tokens", num_tokens, 0)
        if num_tokens > total:
            raise ValueError(f"kvkernels.PagedKVCache.{what}: num_tokens: {num_tokens} > the sequence's "
                             f"{total} tokens")
        if self._sparse[row] and num_tokens != total:
            raise ValueError(f"kvkernels.PagedKVCache.{what}: num_tokens: the sequence has dropped blocks "
                             f"(sparse policy); only all of it can be shared")
        return num_tokens

    def _attach(self, dst: int, src: int, n: int) -> None:
        """Make empty row ``dst`` share the first ``n`` tokens of row ``src``."""
        bs = self.block_size
        whole = n == self._num_tokens[src]
        nb = int(self._nblocks[src]) if whole else -(-n // bs)
        blocks = self._tables[src, :nb]
        self.pool.incref(blocks, distinct=True)
        self._tables[dst, :nb] = blocks
        self._nblocks[dst] = nb
        self._kv_len[dst] = self._kv_len[src] if whole else n
        self._num_tokens[dst] = n
        full = n // bs
        self._history[dst] = self._history[src][:full]
        self._chain[dst] = self._chain[src][:full]
        if whole:
            self._tail[dst] = self._tail[src]
        elif n % bs:  # the partial block's tokens: a full block of the source, or its tail
            history = self._history[src]
            part = np.frombuffer(history[full], dtype="<i8") if full < len(history) else self._tail[src]
            self._tail[dst, :n % bs] = part[:n % bs]
        self._hashing[dst] = self._hashing[src]
        self._sparse[dst] = self._sparse[src]
        self._logical[dst] = self._logical[src]  # never mutated in place: shared safely
        self._extra[dst] = self._extra[src]

    def share_prompt_blocks(self, src: int, dsts: Sequence[int], num_prefix_tokens: int) -> None:
        """Batch prompt sharing: each of ``dsts`` (existing sequences holding no tokens,
        e.g. from ``add_sequence([])``) shares the first ``num_prefix_tokens`` tokens of ``src``
        by reference. The destinations take ``src``'s extra keys (their blocks are ``src``'s)."""
        with self._lock:
            src_row = self._row(src, "share_prompt_blocks")
            rows = self._batch_rows(dsts, "share_prompt_blocks")
            n = self._prefix_len(src_row, num_prefix_tokens, "share_prompt_blocks")
            if src_row in rows.tolist():
                raise ValueError("kvkernels.PagedKVCache.share_prompt_blocks: dsts: contains src")
            busy = [s for s, r in zip(dsts, rows.tolist()) if self._num_tokens[r]]
            if busy:
                raise ValueError(f"kvkernels.PagedKVCache.share_prompt_blocks: dsts: sequence {busy[0]} "
                                 f"already holds tokens")
            for row in rows.tolist():
                self._attach(row, src_row, n)
                self._divergence[row] = n
            self._counters["forks"] += len(rows)

    def reorder(self, seqs: Sequence[int], src_index) -> None:
        """Beam-search reorder without copying KV: afterwards ``seqs[i]`` holds what
        ``seqs[src_index[i]]`` held (block tables and token state; refcounts adjusted, indices may
        repeat). The next write into a now-shared partial block copies it (copy-on-write)."""
        with self._lock:
            rows = self._batch_rows(seqs, "reorder")
            idx = as_token_array(src_index, "PagedKVCache.reorder: src_index", "indices")
            if len(idx) != len(rows) or (idx.size and idx.max() >= len(rows)):
                raise ValueError(f"kvkernels.PagedKVCache.reorder: src_index: expected {len(rows)} indices "
                                 f"in [0, {len(rows)})")
            moved = np.flatnonzero(idx != np.arange(len(rows)))
            if not moved.size:
                return
            dst, src = rows[moved], rows[idx[moved]]
            # Take the new references before dropping the old ones: a block kept by both stays put.
            self.pool.incref(np.concatenate([self._blocks(r) for r in src.tolist()]))
            for r in dst.tolist():
                self.pool.free(self._blocks(r).copy(), distinct=True)
            for name in ("_tables", "_nblocks", "_kv_len", "_num_tokens", "_tail", "_hashing", "_sparse"):
                a = getattr(self, name)
                a[dst] = a[src]  # fancy indexing reads every source row before any is written
            for name in ("_chain", "_history", "_extra", "_logical", "_divergence"):
                values = getattr(self, name)
                snapshot = [values[r] for r in src.tolist()]
                for r, value in zip(dst.tolist(), snapshot):
                    # Lists grow in place later: each row needs its own.
                    values[r] = list(value) if isinstance(value, list) else value

    # ---- freeing ---------------------------------------------------------------------------------

    def free(self, seq: int) -> None:
        """Release ``seq`` (offloaded or not). Its blocks lose a reference; those reaching zero
        become free, tail-first, cached ones still serving prefix hits until reused."""
        with self._lock:
            row = self._row(seq, "free", resident=False)
            if self._resident[row]:
                self.pool.free(self._blocks(row), distinct=True)
            del self._row_of[seq]
            self._release_row(row)

    # ---- offload / restore -----------------------------------------------------------------------

    def offload(self, seq: int) -> int:
        """Move ``seq``'s K/V to host memory (``swap_blocks``) and release its device blocks.
        Returns the bytes moved. The sequence keeps its id and token state; ``restore`` brings it
        back. Blocks still held by other sequences (or cached) stay on the device for them."""
        with self._lock:
            row = self._row(seq, "offload")
            blocks = self._blocks(row).copy()
            shape = list(self.kv.shape)
            shape[self._block_dim] = len(blocks)
            host = torch.empty(shape, dtype=self.dtype, pin_memory=self.pin_memory)
            if len(blocks):
                mapping = torch.from_numpy(np.stack([blocks, np.arange(len(blocks))], axis=1).astype(np.int64))
                ops.swap_blocks(self.kv, host, mapping, block_dim=self._block_dim)
            self.pool.free(blocks, distinct=True)
            self._tables[row, :len(blocks)] = 0
            self._host[row] = host
            self._resident[row] = False
            self._counters["offloads"] += 1
            return len(blocks) * self.bytes_per_block

    def restore(self, seq: int) -> int:
        """Bring an offloaded ``seq`` back to the device. Full blocks whose prefix-cache entry is
        still on the device are reused instead of copied; the others are allocated and copied in
        with one ``swap_blocks``. Returns the bytes copied. OutOfBlocksError: nothing changed."""
        with self._lock:
            row = self._row(seq, "restore", resident=False)
            if self._resident[row]:
                raise RuntimeError(f"kvkernels.PagedKVCache.restore: sequence {seq} is not offloaded")
            nb, pool = int(self._nblocks[row]), self.pool
            found: dict[int, int] = {}  # table index -> cached block
            if self._hashing[row] and not self._sparse[row]:
                for j, h in enumerate(self._chain[row][:nb]):
                    block = pool.cached_block(h)
                    if block is not None:
                        found[j] = block  # distinct hashes -> distinct blocks
            missing = [j for j in range(nb) if j not in found]
            revived = sum(1 for b in found.values() if pool.ref[b] == 0)
            pool.check_available(len(missing) + revived, f"restore of sequence {seq}")
            pool.touch(list(found.values()))
            fresh = pool.allocate(len(missing))
            try:
                if missing:
                    mapping = torch.tensor(list(zip(missing, fresh)), dtype=torch.int64)
                    ops.swap_blocks(self._host[row], self.kv, mapping, block_dim=self._block_dim)
            except BaseException:  # leave the pool as it was
                pool.free(fresh + list(found.values()), distinct=True)
                raise
            for j, block in found.items():
                self._tables[row, j] = block
            self._tables[row, missing] = fresh
            self._host[row] = None
            self._resident[row] = True
            self._counters["restores"] += 1
            self._counters["restore_cache_hit_blocks"] += len(found)
            return len(missing) * self.bytes_per_block

    def is_offloaded(self, seq: int) -> bool:
        with self._lock:
            return not self._resident[self._row(seq, "is_offloaded", resident=False)]

    # ---- block-sparse eviction -------------------------------------------------------------------

    def sparsify(self, seq: int, policy: Optional[SparsePolicy] = None) -> int:
        """Apply ``policy`` (default: the cache's ``sparse_policy``) to ``seq`` now: drop the blocks
        it does not keep from the block table and release them. Returns the number dropped."""
        with self._lock:
            row = self._row(seq, "sparsify")
            policy = policy if policy is not None else self.sparse_policy
            if not isinstance(policy, SparsePolicy):
                raise TypeError("kvkernels.PagedKVCache.sparsify: policy: expected a SparsePolicy "
                                "(none given and the cache has no sparse_policy)")
            return self._sparsify_row(row, policy)

    def _logical_blocks(self, row: int) -> np.ndarray:
        """Logical block index of each table entry. A row never sparsified is the identity; after a
        sparsification, ``_logical`` holds the kept entries and every later entry continues the
        sequence up to the last logical block."""
        nb = int(self._nblocks[row])
        kept = self._logical[row]
        if kept is None:
            return np.arange(nb)
        total = -(-int(self._num_tokens[row]) // self.block_size)
        later = nb - len(kept)
        return np.concatenate((kept, np.arange(total - later, total)))

    def _sparsify_row(self, row: int, policy: SparsePolicy, keep_from: Optional[int] = None) -> int:
        """Drop the table entries ``policy`` does not keep, except the last one and every entry
        from index ``keep_from`` on. Returns the number dropped."""
        nb = int(self._nblocks[row])
        if nb <= 1:
            return 0
        logical = self._logical_blocks(row)
        keep = policy.select(int(self._num_tokens[row]), self.block_size, logical)
        if keep is None:
            return 0
        keep = np.asarray(keep, dtype=bool).copy()
        keep[-1] = True  # the block being written stays
        if keep_from is not None:
            keep[keep_from:] = True
        drop = np.flatnonzero(~keep)
        if not drop.size:
            return 0
        table = self._tables[row, :nb].copy()
        dropped = table[drop]
        k = nb - drop.size
        self._tables[row, :k] = table[keep]
        self._tables[row, k:nb] = 0
        self._nblocks[row] = k
        self._kv_len[row] -= drop.size * self.block_size  # dropped blocks are full: never the last
        self._logical[row] = logical[keep]
        self._sparse[row] = True
        self._hashing[row] = False  # later KV depends on what was dropped: not a prefill's KV
        released = self.pool.free(dropped, distinct=True)
        self._counters["sparse_evicted_blocks"] += drop.size
        self._counters["sparse_freed_blocks"] += len(released)
        return int(drop.size)

    def _auto_sparsify(self, rows: np.ndarray, keep_from: Optional[int] = None) -> None:
        policy = self.sparse_policy
        for row in rows[self._num_tokens[rows] > policy.min_tokens].tolist():
            self._sparsify_row(row, policy, keep_from)

    def sparse_stats(self, seq: int) -> dict:
        """Block-sparse statistics for one sequence: whether blocks were dropped, logical
        vs active blocks, and the bytes the dropped blocks no longer take (per sequence; a dropped
        block another sequence still holds stays in memory, see ``stats().sparse_freed_blocks``)."""
        with self._lock:
            row = self._row(seq, "sparse_stats", resident=False)
            total = -(-int(self._num_tokens[row]) // self.block_size)
            active = int(self._nblocks[row])
            return {"sparse_mode_active": bool(self._sparse[row]), "total_logical_blocks": total,
                    "active_blocks": active, "evicted_blocks": total - active,
                    "num_tokens": int(self._num_tokens[row]), "active_tokens": int(self._kv_len[row]),
                    "bytes_saved": (total - active) * self.bytes_per_block,
                    "memory_saved_mb": (total - active) * self.bytes_per_block / 2**20}

    # ---- what the kernels read -------------------------------------------------------------------

    def _gather_tables(self, rows: np.ndarray) -> torch.Tensor:
        width = max(int(self._nblocks[rows].max()) if rows.size else 1, 1)
        return torch.from_numpy(self._tables[rows, :width]).to(self.device)

    def block_tables(self, seqs: Sequence[int]) -> torch.Tensor:
        """int32 ``[len(seqs), max_blocks]`` block tables of ``seqs``, padded with the null block."""
        with self._lock:
            return self._gather_tables(self._batch_rows(seqs, "block_tables"))

    def cascade_plan(self, seqs: Sequence[int], *, min_shared_tokens: int = 256):
        """``kvkernels.cache.cascade.CascadePlan`` of a decode step of ``seqs`` (after their
        ``append_decode``): groups of rows that share leading blocks, for ``cascade_attention``;
        ``None`` when they do not share enough (see ``plan_cascade``)."""
        with self._lock:
            rows = self._batch_rows(seqs, "cascade_plan")
            width = max(int(self._nblocks[rows].max()) if rows.size else 1, 1)
            return plan_cascade(self._tables[rows, :width], self._kv_len[rows], self.block_size, self.device,
                                min_shared_tokens=min_shared_tokens)

    def seq_lens(self, seqs: Sequence[int]) -> torch.Tensor:
        """int32 ``[len(seqs)]``: KV tokens of each sequence (what ``paged_attention`` attends)."""
        with self._lock:
            return torch.from_numpy(self._kv_len[self._batch_rows(seqs, "seq_lens")]).to(self.device)

    def slot_mapping(self, seq: int, start: int, end: int) -> torch.Tensor:
        """int64 slots of KV positions ``[start, end)`` of ``seq`` (e.g. to rewrite some tokens)."""
        with self._lock:
            row = self._row(seq, "slot_mapping")
            kv = int(self._kv_len[row])
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= kv):
                raise ValueError(f"kvkernels.PagedKVCache.slot_mapping: [{start}, {end}) not within [0, {kv}]")
            pos = np.arange(start, end)
            slots = self._tables[row, pos // self.block_size].astype(np.int64) * self.block_size
            return torch.from_numpy(slots + pos % self.block_size).to(self.device)

    # ---- inspection ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, seq) -> bool:
        return seq in self._row_of

    @property
    def sequences(self) -> list[int]:
        with self._lock:
            return list(self._row_of)

    def num_tokens(self, seq: int) -> int:
        """Logical length of ``seq`` (tokens appended so far, dropped ones included)."""
        with self._lock:
            return int(self._num_tokens[self._row(seq, "num_tokens", resident=False)])

    def token_ids(self, seq: int) -> list[int]:
        with self._lock:
            row = self._row(seq, "token_ids", resident=False)
            full = np.frombuffer(b"".join(self._history[row]), dtype="<i8")
            tail = self._tail[row, :int(self._num_tokens[row]) % self.block_size]
            return np.concatenate((full, tail)).tolist()

    def stats(self) -> CacheStats:
        with self._lock:
            pool = self.pool.stats()
            pool.pop("num_blocks")
            return CacheStats(**pool, **self._counters, num_sequences=len(self._row_of),
                              num_offloaded=sum(h is not None for h in self._host),
                              num_blocks=self.pool.num_usable_blocks)

    def memory_usage(self, seq: Optional[int] = None) -> dict:
        """Memory at token granularity (a partly filled block counts its tokens, not its size).

        With ``seq``: ``own_*`` = tokens/bytes in blocks only this sequence references,
        ``shared_*`` = in blocks others reference too, plus blocks and ``allocated_own_bytes``
        (whole blocks it holds alone, empty slots included). Without: totals over the cache —
        ``stored_bytes`` (token slots holding live tokens, each shared block once),
        ``allocated_bytes`` (referenced blocks, whole), ``unshared_bytes`` (what every sequence
        holding a private copy of its tokens would take) and ``sharing_ratio`` = stored / unshared.
        """
        with self._lock:
            if seq is not None:
                return self._seq_memory(self._row(seq, "memory_usage", resident=False))
            return self._total_memory()

    def _fills(self, row: int) -> np.ndarray:
        nb, bs = int(self._nblocks[row]), self.block_size
        fills = np.full(nb, bs, dtype=np.int64)
        if nb:
            fills[-1] = int(self._kv_len[row]) - (nb - 1) * bs
        return fills

    def _seq_memory(self, row: int) -> dict:
        bpt = self.bytes_per_token
        resident = bool(self._resident[row])
        fills = self._fills(row)
        own = self.pool.ref[self._blocks(row)] == 1 if resident else np.ones(len(fills), dtype=bool)
        own_tokens, shared_tokens = int(fills[own].sum()), int(fills[~own].sum())
        return {"num_tokens": int(self._num_tokens[row]), "kv_tokens": int(self._kv_len[row]),
                "num_blocks": len(fills), "own_blocks": int(own.sum()), "shared_blocks": int((~own).sum()),
                "own_tokens": own_tokens, "shared_tokens": shared_tokens,
                "own_bytes": own_tokens * bpt if resident else 0,
                "shared_bytes": shared_tokens * bpt,
                "allocated_own_bytes": int(own.sum()) * self.bytes_per_block if resident else 0,
                "host_bytes": 0 if resident else self._host[row].numel() * self._host[row].element_size(),
                "divergence_point": self._divergence[row], "offloaded": not resident}

    def _total_memory(self) -> dict:
        rows = [r for r in self._row_of.values() if self._resident[r]]
        fill = np.zeros(self.num_blocks, dtype=np.int64)
        for r in rows:
            np.maximum.at(fill, self._blocks(r), self._fills(r))
        stored = int(fill.sum())
        unshared = int(self._kv_len[rows].sum()) if rows else 0
        used = self.pool.num_usable_blocks - self.pool.num_free_blocks
        bpt = self.bytes_per_token
        return {"num_sequences": len(self._row_of), "used_blocks": used, "stored_tokens": stored,
                "stored_bytes": stored * bpt, "allocated_bytes": used * self.bytes_per_block,
                "unshared_tokens": unshared, "unshared_bytes": unshared * bpt,
                "sharing_ratio": stored / unshared if unshared else 1.0,
                "capacity_bytes": self.pool.num_usable_blocks * self.bytes_per_block,
                "host_bytes": sum(h.numel() * h.element_size() for h in self._host if h is not None)}

    def check_invariants(self) -> None:
        """Assert that pool and tables agree (tests, debugging): refcounts equal the number of
        tables holding each block, no block is both free and in a table, lengths match tables."""
        with self._lock:
            tables = []
            for seq, row in self._row_of.items():
                nb, bs = int(self._nblocks[row]), self.block_size
                assert self._seq_of_row[row] == seq
                assert (self._tables[row, nb:] == 0).all(), f"sequence {seq}: junk past its table"
                assert self._num_tokens[row] >= self._kv_len[row]
                assert (self._num_tokens[row] - self._kv_len[row]) % bs == 0
                if self._resident[row]:
                    assert nb == -(-int(self._kv_len[row]) // bs), f"sequence {seq}: {nb} blocks for " \
                                                                    f"{self._kv_len[row]} tokens"
                    tables.append(self._blocks(row))
                else:
                    assert (self._tables[row] == 0).all() and self._host[row] is not None
                    assert self._host[row].shape[self._block_dim] == nb  # the offloaded blocks
                assert len(self._history[row]) == self._num_tokens[row] // bs
            self.pool.check_invariants(tables)
            assert len(self._free_rows) + len(self._row_of) == len(self._nblocks)

    # ---- alternative names (other copy-on-write / prompt-sharing cache APIs use them) ------------

    def branch(self, seq: int) -> int:
        """``fork`` as ``branch()``: a zero-copy fork; the child stores only its divergent tokens."""
        return self.fork(seq)

    def fork_sequence(self, src: int) -> int:
        """``fork`` as ``fork_sequence``; the cache picks the new id (returned)."""
        return self.fork(src)

    def add_sequence_with_prompt(self, prompt_tokens, *, extra_keys=None) -> tuple[int, int]:
        """``add_sequence`` under a prompt-cache name (chained block hashes subsume a prompt hash)."""
        return self.add_sequence(prompt_tokens, extra_keys=extra_keys)

    def get_stats(self) -> CacheStats:
        """``stats()`` under another name (``prompt_cache_hits``, ``shared_prompt_blocks`` and
        ``cow_operations`` are properties of the result)."""
        return self.stats()

    def get_memory_usage(self, seq: int) -> dict:
        """One sequence's memory report: own / parent (shared) / total MB at token
        granularity, the divergence point (tokens shared with its parent at fork time), length."""
        m = self.memory_usage(seq)
        own, shared = m["own_bytes"] / 2**20, m["shared_bytes"] / 2**20
        return {"own_memory_mb": own, "parent_memory_mb": shared, "total_memory_mb": own + shared,
                "divergence_point": m["divergence_point"], "sequence_length": m["num_tokens"]}

    beam_select = reorder
