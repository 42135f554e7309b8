"""A functional paged K/V cache for JAX, and the host-side page allocator that feeds it.

``PagedKVCache`` is a pytree: per layer a key and a value page array ``[num_pages, page_size, num_kv_heads,
head_dim]``, the block tables ``int32 [batch, max_pages_per_seq]`` and the lengths ``int32 [batch]`` (plus
per-layer fp8 scales for fp8 pages). A jitted step takes it and returns the updated one; with the cache
donated (``jax.jit(step, donate_argnums=...)``) every layer's pages are written in place by
``kvkernels.jax.reshape_and_cache`` (its results alias its inputs), so a step costs no cache copy.

``PageManager`` runs on the host between steps, like JetStream's page manager: it owns the free list and
each batch slot's pages, grows a sequence by whole pages before a step needs them, frees a finished
sequence's pages, and produces the block tables, lengths and slot mappings the next step takes (numpy
arrays; the step never reads anything back to decide them). Page 0 is never handed out: it pads block
tables (entries past a sequence's pages are never read).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvkernels.jax import ops

__all__ = ["PagedKVCache", "PageManager", "OutOfPagesError"]


class OutOfPagesError(RuntimeError):
    """The page pool has too few free pages for a request (nothing was allocated)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """K/V pages of every layer, block tables and lengths (a pytree; see the module docstring).

    ``seq_lens[i]`` counts the tokens of batch slot ``i`` whose K/V the pages hold. ``k_scale`` /
    ``v_scale``: per layer a float32 scale array (1 or num_kv_heads elements) for fp8 pages, else None.
    """

    k: tuple
    v: tuple
    block_tables: jax.Array
    seq_lens: jax.Array
    k_scale: Optional[tuple] = None
    v_scale: Optional[tuple] = None

    @classmethod
    def create(cls, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               batch: int, max_pages_per_seq: int, dtype=jnp.float32, head_dim_v: int | None = None,
               k_scale: Sequence | None = None, v_scale: Sequence | None = None) -> "PagedKVCache":
        """Zeroed pages, block tables of page 0, lengths 0. fp8 ``dtype`` needs ``k_scale`` / ``v_scale``
        (one scale array per layer, or one for all layers)."""
        dv = head_dim if head_dim_v is None else head_dim_v
        fp8 = np.dtype(dtype) in ops.FP8_DTYPES
        if fp8 and (k_scale is None or v_scale is None):
            raise ValueError("PagedKVCache.create: k_scale, v_scale: required for an fp8 dtype")

        def per_layer(s):
            if s is None or not fp8:
                return None
            s = list(s) if isinstance(s, (list, tuple)) else [s] * num_layers
            if len(s) != num_layers:
                raise ValueError(f"PagedKVCache.create: expected {num_layers} scales, got {len(s)}")
            # One array per layer (copies): the cache is donated to each step, and one buffer must not
            # be donated twice.
            return tuple(jnp.array(x, jnp.float32, copy=True).reshape(-1) for x in s)

        return cls(
            k=tuple(jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros((num_pages, page_size, num_kv_heads, dv), dtype) for _ in range(num_layers)),
            block_tables=jnp.zeros((batch, max_pages_per_seq), jnp.int32),
            seq_lens=jnp.zeros((batch,), jnp.int32),
            k_scale=per_layer(k_scale), v_scale=per_layer(v_scale))

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def layer_scales(self, layer: int) -> dict:
        if self.k_scale is None:
            return {}
        return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    def with_tables(self, block_tables, seq_lens) -> "PagedKVCache":
        """The same pages with new block tables and lengths (host arrays from ``PageManager``). The host
        arrays are copied: on the CPU, JAX may use a numpy array's memory without copying it, and the page
        manager updates its lengths in place for the next step while this step may still be running (JAX
        dispatches asynchronously)."""
        return dataclasses.replace(self, block_tables=jnp.asarray(np.array(block_tables, np.int32, copy=True)),
                                   seq_lens=jnp.asarray(np.array(seq_lens, np.int32, copy=True)))

    def write(self, layer: int, key, value, slot_mapping) -> "PagedKVCache":
        """``reshape_and_cache`` of one layer's new K/V; returns the cache with that layer's pages updated."""
        k, v = ops.reshape_and_cache(key, value, self.k[layer], self.v[layer], slot_mapping,
                                     **self.layer_scales(layer))
        return dataclasses.replace(self, k=_replace(self.k, layer, k), v=_replace(self.v, layer, v))

    def attend(self, layer: int, query, *, block_tables=None, seq_lens=None, query_start_loc=None, **options):
        """``paged_attention`` of ``query`` over one layer's pages, through this cache's block tables and
        lengths or the given ones (a prefill adds a row for its padding, kvkernels/jax/llama.py)."""
        return ops.paged_attention(query, self.k[layer], self.v[layer],
                                   self.block_tables if block_tables is None else block_tables,
                                   self.seq_lens if seq_lens is None else seq_lens, query_start_loc,
                                   **self.layer_scales(layer), **options)

    def copy_pages(self, mapping) -> "PagedKVCache":
        """``copy_blocks`` on every layer's K and V pages (copy-on-write of shared pages)."""
        return dataclasses.replace(self, k=tuple(ops.copy_blocks(x, mapping) for x in self.k),
                                   v=tuple(ops.copy_blocks(x, mapping) for x in self.v))


def _replace(t: tuple, i: int, x) -> tuple:
    return t[:i] + (x,) + t[i + 1:]


class PageManager:
    """Host-side page allocation for a batch of ``batch`` sequence slots (see the module docstring).

    ``reserve(slot, n)`` makes slot ``slot`` hold pages for ``n`` tokens in total (allocating whole pages),
    ``release(slot)`` frees them. ``block_tables()``, ``lengths`` and ``slot_mapping()`` describe the state
    for the next step. A failed call changes nothing.
    """

    def __init__(self, *, num_pages: int, page_size: int, batch: int, max_pages_per_seq: int):
        if num_pages < 2:
            raise ValueError(f"PageManager: num_pages: expected >= 2 (page 0 pads block tables), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"PageManager: page_size: expected >= 1, got {page_size}")
        self.num_pages, self.page_size, self.batch = num_pages, page_size, batch
        self.max_pages_per_seq = max_pages_per_seq
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._pages: list[list[int]] = [[] for _ in range(batch)]
        self.lengths = np.zeros(batch, np.int32)  # tokens whose K/V are (or are being) written

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages(self, slot: int) -> list[int]:
        return list(self._pages[slot])

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Pages for ``num_tokens`` tokens in slot ``slot`` (its length becomes ``num_tokens``)."""
        if not 0 <= slot < self.batch:
            raise ValueError(f"PageManager.reserve: slot: {slot} is out of range [0, {self.batch})")
        if num_tokens < self.lengths[slot]:
            raise ValueError(f"PageManager.reserve: num_tokens: {num_tokens} is below the slot's length "
                             f"{self.lengths[slot]}")
        need = -(-num_tokens // self.page_size)
        if need > self.max_pages_per_seq:
            raise ValueError(f"PageManager.reserve: num_tokens: {num_tokens} tokens need {need} pages, a block "
                             f"table row holds {self.max_pages_per_seq}")
        more = need - len(self._pages[slot])
        if more > len(self._free):
            raise OutOfPagesError(f"PageManager.reserve: {more} more pages needed, {len(self._free)} free")
        for _ in range(more):
            self._pages[slot].append(self._free.pop())
        self.lengths[slot] = num_tokens

    def release(self, slot: int) -> None:
        """Frees slot ``slot``'s pages (its length becomes 0)."""
        self._free.extend(reversed(self._pages[slot]))
        self._pages[slot] = []
        self.lengths[slot] = 0

    def block_tables(self) -> np.ndarray:
        table = np.zeros((self.batch, self.max_pages_per_seq), np.int32)
        for i, pages in enumerate(self._pages):
            table[i, :len(pages)] = pages
        return table

    def slot_mapping(self, slot: int, start: int, count: int) -> np.ndarray:
        """int32 cache slots of tokens ``start .. start + count - 1`` of slot ``slot`` (reserved already)."""
        pos = np.arange(start, start + count)
        if count and pos[-1] >= len(self._pages[slot]) * self.page_size:
            raise ValueError(f"PageManager.slot_mapping: tokens up to {pos[-1]} of slot {slot} have no page")
        pages = np.asarray(self._pages[slot], np.int64)
        return (pages[pos // self.page_size] * self.page_size + pos % self.page_size).astype(np.int32)
