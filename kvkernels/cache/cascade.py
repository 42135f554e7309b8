"""Shared-prefix ("cascade") decode attention: rows that share the leading blocks of their block
tables — the beams of one prompt, parallel samples, branches — attend those blocks in one call
for all of them, then their own blocks each, and the two states are merged exactly.

Plain decode reads a shared prompt once per row: 8 beams of a 4096-token prompt read it 8 times
per step. Here the rows of a group become the query heads of one sequence over the shared blocks
(``group_size x`` the GQA ratio: every key and value row of the prompt is loaded once for all of
them), a second ``paged_attention`` covers each row's remaining blocks, and
``merge_attention_states`` combines the two softmax states (the split is exact: softmax over a
union of disjoint key sets). Measured on the 2-core Xeon (8 rows, 32 query / 8 kv heads of 128,
4096 shared + 40 own tokens, 2 threads; ``python -m kvkernels bench --cases extra``, case
``cascade_decode``): bfloat16 9.3 -> 2.5 ms per call, float32 13.1 -> 6.4 ms. Two calls and a merge
cost more than one for short prefixes: with 2 kv heads of 64 in float32 (8 rows, one thread, a
one-off timing script) it ran 0.57x at 64 shared tokens, 0.79x at 128, 1.09x at 256: hence
``PagedCache``'s default ``cascade_min_tokens=256``.

Only for what the split keeps exact: no sliding window (positions would have to follow the split),
no attention sinks (a sink belongs to exactly one softmax), no ALiBi. Soft capping is per logit
and fine. ``PagedKVCache.cascade_plan`` builds the plan from the host-side tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from kvkernels import ops


@dataclass(frozen=True)
class CascadePlan:
    """``groups`` groups of ``group_size`` rows; ``order`` lists the rows group by group (``None``:
    rows are already grouped, consecutive) and ``inverse`` undoes it. Prefix: int32
    ``prefix_tables [groups, blocks]`` / ``prefix_lens [groups]`` (whole blocks shared by every row of
    the group); suffix: int32 ``suffix_tables [rows, blocks]`` / ``suffix_lens [rows]`` (each row's
    other blocks, in row order, at least one token each)."""
    groups: int
    group_size: int
    order: Optional[Tensor]
    inverse: Optional[Tensor]
    prefix_tables: Tensor
    prefix_lens: Tensor
    suffix_tables: Tensor
    suffix_lens: Tensor

    @property
    def shared_tokens(self) -> int:
        """Tokens read once per group instead of once per row."""
        return int(self.prefix_lens.sum())


def plan_cascade(tables: np.ndarray, lens: np.ndarray, block_size: int, device, *,
                 min_shared_tokens: int = 256) -> Optional[CascadePlan]:
    """The cascade plan of decode rows with block tables ``tables [rows, >= blocks]`` and KV lengths
    ``lens [rows]`` (the new token included), or ``None`` when the rows do not form groups of one
    size that share at least one whole block each and ``min_shared_tokens`` on average.

    Rows are grouped by their first block. A group's prefix is its leading columns equal in every
    row, cut to whole blocks that end before each row's newest token (that block is the row's own:
    copy-on-write gave it a private copy before the write)."""
    rows = int(lens.shape[0])
    if rows < 2:
        return None
    lens = lens.astype(np.int64)
    whole = (lens - 1) // block_size  # whole blocks before the newest token
    if (whole < 1).any():
        return None
    _, first, group_of, counts = np.unique(tables[:, 0], return_index=True, return_inverse=True,
                                           return_counts=True)
    size = int(counts[0])
    if size < 2 or (counts != size).any():
        return None
    groups = len(counts)
    rank = np.argsort(np.argsort(first))  # groups numbered in order of their first row
    order = np.argsort(rank[group_of.ravel()], kind="stable")
    cols = tables.shape[1]
    grouped = tables[order].reshape(groups, size, cols)
    limit = whole[order].reshape(groups, size).min(1)
    differs = (grouped != grouped[:, :1]).any(1) | (np.arange(cols)[None, :] >= limit[:, None])
    shared = np.where(differs.any(1), differs.argmax(1), cols)  # leading equal columns per group
    if (shared < 1).any() or shared.mean() * block_size < min_shared_tokens:
        return None
    row_shared = np.empty(rows, dtype=np.int64)
    row_shared[order] = np.repeat(shared, size)
    own_blocks = -(-lens // block_size) - row_shared
    width = int(own_blocks.max())
    cols_idx = np.minimum(row_shared[:, None] + np.arange(width)[None, :], cols - 1)
    suffix_tables = np.take_along_axis(tables, cols_idx, 1)
    identity = bool((order == np.arange(rows)).all())

    def dev(a: np.ndarray, dtype) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device)
    return CascadePlan(
        groups, size, None if identity else dev(order, np.int64),
        None if identity else dev(np.argsort(order), np.int64),
        dev(grouped[:, 0, :int(shared.max())], np.int32), dev(shared * block_size, np.int32),
        dev(suffix_tables, np.int32), dev(lens - row_shared * block_size, np.int32))


def cascade_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, plan: CascadePlan, *,
                      scale: Optional[float] = None, soft_cap: float = 0.0, k_scale: Optional[Tensor] = None,
                      v_scale: Optional[Tensor] = None, out: Optional[Tensor] = None,
                      lse: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Decode attention of ``query [rows, num_heads, head_dim]`` (one token per row) as
    ``ops.paged_attention`` would compute it over the rows' whole block tables, through ``plan``.
    Returns ``(out [rows, num_heads, head_dim], lse float32 [rows, num_heads])``; ``out=`` / ``lse=``
    as in ``ops.paged_attention`` (the final merge writes them)."""
    rows = plan.groups * plan.group_size
    if query.dim() != 3 or query.shape[0] != rows:
        raise ValueError(f"kvkernels cascade_attention: query: expected [{rows}, num_heads, head_dim] (the "
                         f"plan's rows), got {tuple(query.shape)}")
    heads, dim = query.shape[1:]
    kv_heads = key_cache.shape[2] if key_cache.dim() == 4 else 0
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"kvkernels cascade_attention: query: {heads} heads is not a multiple of the "
                         f"key_cache's kv heads (key_cache shape {tuple(key_cache.shape)})")
    group, g, n = heads // kv_heads, plan.groups, plan.group_size
    common = dict(scale=scale, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    q = query if plan.order is None else query.index_select(0, plan.order)
    # Row r of a group, query head (h, j) of kv head h -> head (h, r, j) of one sequence.
    q = q.reshape(g, n, kv_heads, group, dim).transpose(1, 2).reshape(g, kv_heads * n * group, dim)
    out_p, lse_p = ops.paged_attention(q, key_cache, value_cache, plan.prefix_tables, plan.prefix_lens, **common)
    out_p = out_p.view(g, kv_heads, n, group, -1).transpose(1, 2).reshape(rows, heads, -1)
    lse_p = lse_p.view(g, kv_heads, n, group).transpose(1, 2).reshape(rows, heads)
    if plan.inverse is not None:
        out_p, lse_p = out_p.index_select(0, plan.inverse), lse_p.index_select(0, plan.inverse)
    out_s, lse_s = ops.paged_attention(query, key_cache, value_cache, plan.suffix_tables, plan.suffix_lens,
                                       **common)
    return ops.merge_attention_states(out_p, lse_p, out_s, lse_s, out=out, lse=lse)
