"""The Python cache layer: ``BlockPool`` (blocks, refcounts, prefix cache) and ``PagedKVCache``
(K/V storage of every layer plus the sequences in it). API: docs/api.md."""

from kvkernels.cache.mla import MLAPagedCache
from kvkernels.cache.paged import DecodeStep, PagedKVCache, UnknownSequenceError
from kvkernels.cache.pool import BlockPool, EvictionPolicy, LRUEvictionPolicy, OutOfBlocksError
from kvkernels.cache.sparse import KeepRecentRatio, SinkRecentWindow, SparsePolicy
from kvkernels.cache.stats import CacheStats

__all__ = ["BlockPool", "CacheStats", "DecodeStep", "EvictionPolicy", "KeepRecentRatio", "LRUEvictionPolicy",
           "MLAPagedCache", "OutOfBlocksError", "PagedKVCache", "SinkRecentWindow", "SparsePolicy", "UnknownSequenceError"]
