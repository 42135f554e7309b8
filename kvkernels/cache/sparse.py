"""Block-sparse eviction policies for long sequences.

A policy looks at one sequence (its logical length and the logical index of every block still in
its block table) and says which blocks to keep. ``PagedKVCache`` then drops the others from the
block table (the table is compacted, so ``seq_lens`` shrinks by ``block_size`` per dropped block and
the attention kernels simply see fewer keys) and releases them to the pool. Positions are already
baked into the cached keys (RoPE is applied before caching), so dropping blocks needs no rewrite of
the ones kept. The block being written (the last one) is always kept, whatever the policy says.

KV computed after a sequence lost blocks depends on what it could still attend to, so such a
sequence stops registering new full blocks in the prefix cache (they would not match a full
prefill of the same tokens); the blocks it registered before stay valid.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from kvkernels.cache.tokens import check_count


class SparsePolicy:
    """Base class. ``min_tokens``: sequences with at most this many logical tokens are never
    touched, which lets the cache skip the policy without calling it (it runs on the decode path)."""

    min_tokens: int = 0

    def select(self, num_tokens: int, block_size: int, logical_blocks: np.ndarray) -> Optional[np.ndarray]:
        """Boolean mask over ``logical_blocks`` (the logical index of each block-table entry, in
        order) of the blocks to keep, or None to keep all. ``num_tokens``: logical length."""
        raise NotImplementedError


class KeepRecentRatio(SparsePolicy):
    """Once a sequence is longer than ``threshold_tokens``, keep only the most recent
    ``ceil(keep_ratio * logical_blocks)`` blocks (recent blocks first, the usual block-sparse mode
    of compressed MLA caches; defaults 8192 and 0.5). The kept set follows the sequence as it grows: at
    16K tokens and ratio 0.5, the last 8K tokens stay."""

    def __init__(self, threshold_tokens: int = 8192, keep_ratio: float = 0.5) -> None:
        self.threshold_tokens = check_count("KeepRecentRatio: threshold_tokens", threshold_tokens, 0)
        if not isinstance(keep_ratio, (int, float)) or isinstance(keep_ratio, bool) or not 0 < keep_ratio <= 1:
            raise ValueError(f"kvkernels.KeepRecentRatio: keep_ratio: expected a number in (0, 1], got {keep_ratio!r}")
        self.keep_ratio = float(keep_ratio)
        self.min_tokens = self.threshold_tokens

    def select(self, num_tokens, block_size, logical_blocks):
        if num_tokens <= self.threshold_tokens:
            return None
        total = -(-num_tokens // block_size)
        keep = max(1, math.ceil(self.keep_ratio * total))
        mask = logical_blocks >= total - keep
        return None if mask.all() else mask

    def __repr__(self) -> str:
        return f"KeepRecentRatio(threshold_tokens={self.threshold_tokens}, keep_ratio={self.keep_ratio})"


class SinkRecentWindow(SparsePolicy):
    """Attention sinks + a recent window (StreamingLLM): keep the blocks holding the first
    ``sink_tokens`` tokens and every block that holds one of the last ``window_tokens`` tokens.
    Block granularity: up to ``block_size - 1`` extra tokens are kept at each edge."""

    def __init__(self, sink_tokens: int = 4, window_tokens: int = 1024) -> None:
        self.sink_tokens = check_count("SinkRecentWindow: sink_tokens", sink_tokens, 0)
        self.window_tokens = check_count("SinkRecentWindow: window_tokens", window_tokens, 1)
        self.min_tokens = self.sink_tokens + self.window_tokens

    def select(self, num_tokens, block_size, logical_blocks):
        if num_tokens <= self.min_tokens:
            return None
        sink_blocks = -(-self.sink_tokens // block_size)
        first_recent = (num_tokens - self.window_tokens) // block_size
        mask = (logical_blocks < sink_blocks) | (logical_blocks >= first_recent)
        return None if mask.all() else mask

    def __repr__(self) -> str:
        return f"SinkRecentWindow(sink_tokens={self.sink_tokens}, window_tokens={self.window_tokens})"
