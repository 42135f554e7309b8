"""Counters and gauges of a ``PagedKVCache`` (``cache.stats()``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CacheStats:
    """A snapshot. Counters accumulate since the cache was created; ``num_*`` fields are gauges.

    Token granularity where it matters: a prefix query counts every prompt token, a hit counts the
    tokens whose KV was found (whole blocks, never the last prompt token); a copy-on-write counts
    the tokens the copied block held, not the block size.
    """

    # prefix cache
    prefix_queries: int  # add_sequence calls
    prefix_hits: int  # ... that found at least one cached block
    prefix_query_tokens: int  # prompt tokens looked up
    prefix_hit_tokens: int  # ... whose KV was already cached
    evictions: int  # cached blocks whose entry was dropped because the block was reused
    evicted_tokens: int
    # sharing
    forks: int
    cow_copies: int  # blocks copied because a sequence wrote into a block it did not own alone
    cow_copied_tokens: int  # tokens those blocks held
    # block-sparse eviction
    sparse_evicted_blocks: int  # blocks dropped from block tables by a sparse policy
    sparse_freed_blocks: int  # ... of which no other sequence held a reference (memory returned)
    # offload
    offloads: int
    restores: int
    restore_cache_hit_blocks: int  # blocks a restore found still cached on the device (not copied)
    # gauges
    num_sequences: int  # live sequences, offloaded ones included
    num_offloaded: int
    num_blocks: int  # allocatable blocks (the null block excluded)
    num_free_blocks: int  # unreferenced blocks, cached ones included
    num_used_blocks: int
    num_cached_blocks: int  # blocks holding a prefix-cache entry (referenced or free)
    num_shared_blocks: int  # blocks referenced by more than one sequence

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens that were cached."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    # Alternative names of some statistics (other prompt-sharing caches report these).
    @property
    def prompt_cache_hits(self) -> int:
        return self.prefix_hits

    @property
    def shared_prompt_blocks(self) -> int:
        return self.num_shared_blocks

    @property
    def cow_operations(self) -> int:
        return self.cow_copies

    def as_dict(self) -> dict:
        return dict(asdict(self), prefix_hit_rate=self.prefix_hit_rate)
