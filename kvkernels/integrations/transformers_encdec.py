"""Encoder-decoder models (BART and its kin) on kvkernels: ``PagedEncoderDecoderCache``.

Self-attention of the decoder runs on a ``PagedCache``. Cross-attention K/V are computed by the model
once per generation (first decoder step) from the encoder output, which ``generate()`` has expanded
to ``batch * num_beams`` identical rows per input. The stock ``EncoderDecoderCache`` keeps all those
copies and ``index_select``s every one of them on each beam-search step. Here:

* rows whose cross K/V are bitwise identical (and whose source padding is identical) form one group;
  each group is one sequence of a separate ``PagedKVCache`` holding its source tokens once (padding
  excluded, slot -1), for all layers;
* a row reads its group's blocks through a row -> group map, so a beam reorder only permutes that
  map (``reorder_cache`` copies no KV), and the attention runs ``ops.paged_attention`` on the shared
  blocks with ``causal=False``: every query of a row sees all of its source tokens.

Groups are formed from the first layer's K/V; the others are checked against them, and should a
later layer differ inside a group (the rows were not copies of one input after all) the cache gives
each row its own copy (``ungrouped`` counts it) and stays exact.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin, EncoderDecoderCache

from kvkernels import ops
from kvkernels.cache import PagedKVCache
from kvkernels.integrations.transformers_attention import PagedKV
from kvkernels.integrations.transformers_cache import (PagedCache, check_attn_implementation, decoder_num_layers,
                                                       model_config)


class _SelfAttentionCache(PagedCache):
    """The decoder self-attention half (a plain ``PagedCache``; the subclass only skips the
    encoder-decoder dispatch of ``PagedCache.__new__``)."""


class _CrossLayer(CacheLayerMixin):
    """One decoder layer's cross-attention face. ``keys``/``values`` are the layer's ``PagedKV`` read
    handle once written: BART-style models read them back on every later step."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "PagedCrossAttentionCache") -> None:
        super().__init__()
        self._owner = owner
        self.source_len = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("kvkernels: update the cross-attention cache through PagedCrossAttentionCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.source_len, 0

    def get_seq_length(self) -> int:
        return self.source_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.source_len = 0


class PagedCrossAttentionCache(Cache):
    """Cross-attention K/V held once per distinct input and shared by its rows (beams)."""

    def __init__(self, config, block_size: int = 16, dtype: Optional[torch.dtype] = None, device=None) -> None:
        self.config = config = model_config(config, "PagedCrossAttentionCache")
        self.num_layers = decoder_num_layers(config.get_text_config(decoder=True))
        self.block_size, self.dtype = block_size, dtype
        self.device = torch.device(device) if device is not None else None
        self.kv: Optional[PagedKVCache] = None
        self._group_seqs: list[int] = []  # group -> sequence of self.kv
        self._slots: Optional[Tensor] = None  # int64 [groups * S]: where a group's source tokens go, -1 = padding
        self._reps: Optional[Tensor] = None  # int64 [groups]: the row each group was formed from
        self._row_group: Optional[np.ndarray] = None  # row -> group
        self._row_view = None  # (q, block_tables, seq_lens) of the rows, rebuilt after a reorder
        self._real: Optional[np.ndarray] = None  # source padding of the rows at grouping time
        self._written: set[int] = set()  # layers written since the groups were formed
        self.ungrouped = 0
        super().__init__(layers=[_CrossLayer(self) for _ in range(self.num_layers)])

    # ---- transformers' Cache interface -----------------------------------------------------------

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """The model computed this layer's cross K/V ``[N, H, S, D]`` (first decoder step only); they
        are written by the attention function (which knows the source padding) and read back
        through the layer's handle afterwards."""
        layer = self.layers[layer_idx]
        layer.keys = layer.values = PagedKV(self, layer_idx, None, None)
        layer.source_len, layer.is_initialized = key_states.shape[2], True
        handle = PagedKV(self, layer_idx, key_states, value_states)
        return handle, handle

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].source_len if 0 <= layer_idx < self.num_layers else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.get_seq_length(layer_idx), 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` continues row ``beam_idx[i]``: only the row -> group map moves."""
        if self._row_group is not None:
            self._row_group = self._row_group[beam_idx.cpu().numpy()]
            self._row_view = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._row_group is not None:
            self._row_group = np.repeat(self._row_group, repeats)
            self._row_view = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._row_group is not None:
            self._row_group = self._row_group[indices.cpu().numpy()]
            self._row_view = None

    def crop(self, tokens_to_remove: int) -> None:  # the source never changes
        pass

    def reset(self) -> None:
        if self.kv is not None:
            for seq in self._group_seqs:
                self.kv.free(seq)
        self._group_seqs, self._slots, self._reps, self._row_group, self._row_view = [], None, None, None, None
        self._real, self._written = None, set()
        for layer in self.layers:
            layer.reset()

    @property
    def num_groups(self) -> int:
        return len(self._group_seqs)

    def memory_usage(self) -> dict:
        return self.kv.memory_usage() if self.kv is not None else {"stored_bytes": 0, "allocated_bytes": 0}

    # ---- writing -------------------------------------------------------------------------------

    def _group(self, key: Tensor, value: Tensor, real: Optional[np.ndarray]) -> None:
        """Form the groups from one layer's K/V ``[N, H, S, D]`` and the source padding, and give each
        group a sequence holding its real source tokens."""
        check_attn_implementation(self.config)
        rows, heads, src, dim = key.shape
        reps: list[int] = []
        group = np.empty(rows, dtype=np.int64)
        for n in range(rows):
            for g in range(len(reps) - 1, -1, -1):  # copies of one input are adjacent: last group first
                r = reps[g]
                if ((real is None or (real[n] == real[r]).all()) and torch.equal(key[n], key[r])
                        and torch.equal(value[n], value[r])):
                    group[n] = g
                    break
            else:
                group[n] = len(reps)
                reps.append(n)
        self._alloc(reps, real, heads, dim, key)
        self._row_group, self._row_view = group, None

    def _alloc(self, reps: list[int], real: Optional[np.ndarray], heads: int, dim: int, like: Tensor) -> None:
        src = like.shape[2]
        counts = [src if real is None else int(real[r].sum()) for r in reps]
        bs = self.block_size
        if self.kv is None:
            self.dtype = self.dtype or like.dtype
            self.device = self.device or like.device
        else:  # new source (a new generation without reset): the old groups go
            for seq in self._group_seqs:
                self.kv.free(seq)
            self._group_seqs = []
        need = sum(-(-c // bs) for c in counts) + 1
        if self.kv is None or self.kv.pool.num_free_blocks < need - 1:
            self.kv = PagedKVCache(self.num_layers, heads, dim, need, bs, dtype=self.dtype, device=self.device,
                                   enable_prefix_caching=False, max_sequences=max(len(reps), 1))
        slots = np.full((len(reps), src), -1, dtype=np.int64)
        seqs = []
        for g, r in enumerate(reps):
            seq = self.kv.add_sequence([])[0]
            s = self.kv.append(seq, np.zeros(counts[g], dtype=np.int64)).cpu().numpy()
            if real is None:
                slots[g] = s
            else:
                slots[g, real[r]] = s
            seqs.append(seq)
        self._group_seqs = seqs
        self._reps = torch.tensor(reps, dtype=torch.int64, device=like.device)
        self._slots = torch.from_numpy(slots.ravel()).to(self.kv.device)
        self._real = real

    def _write(self, layer: int, key: Tensor, value: Tensor) -> None:
        rep_of_row = self._reps[torch.from_numpy(self._row_group).to(self._reps.device)]
        if not (torch.equal(key, key[rep_of_row]) and torch.equal(value, value[rep_of_row])):
            self._ungroup(layer, key)
        heads, dim = key.shape[1], key.shape[3]
        k = key[self._reps].transpose(1, 2).reshape(-1, heads, dim).to(self.dtype)
        v = value[self._reps].transpose(1, 2).reshape(-1, heads, dim).to(self.dtype)
        ops.reshape_and_cache(k, v, self.kv.key_cache(layer), self.kv.value_cache(layer), self._slots)

    def _ungroup(self, layer: int, like: Tensor) -> None:
        """A layer differs inside a group: one group per row from now on. The layers written so far
        (equal within each group) are copied to the new rows' blocks."""
        # Writes happen in the first decoder forward, before any reorder: rows are still the rows
        # the groups were formed from, and self._real is their padding.
        old_kv, old_slots, old_seqs = self.kv, self._slots.view(len(self._group_seqs), -1), self._group_seqs
        rows = len(self._row_group)
        src_slots = old_slots[torch.from_numpy(self._row_group).to(old_slots.device)]
        self.kv, self._group_seqs = None, []
        self._alloc(list(range(rows)), self._real, like.shape[1], like.shape[3], like)
        keep = src_slots.reshape(-1) >= 0
        flat_old, flat_new = old_kv.kv.flatten(2, 3), self.kv.kv.flatten(2, 3)
        flat_new[:layer, :, self._slots[keep]] = flat_old[:layer, :, src_slots.reshape(-1)[keep]]
        for seq in old_seqs:
            old_kv.free(seq)
        self._row_group, self._row_view = np.arange(rows), None
        self.ungrouped += 1

    # ---- attention -----------------------------------------------------------------------------

    def attend(self, module, query: Tensor, handle: PagedKV, attention_mask, *, scale: Optional[float],
               window_left: int, soft_cap: float, sinks: Optional[Tensor]) -> Tensor:
        """Cross-attention of ``query [N, Hq, q, D]`` over each row's group: ``[N, q, Hq, D]``."""
        if handle.key is not None:
            if self._row_group is None or handle.layer_idx in self._written:  # first layer of a source
                self._group(handle.key, handle.value, source_mask(attention_mask, handle.key.shape[0]))
                self._written = set()
            self._write(handle.layer_idx, handle.key, handle.value)
            self._written.add(handle.layer_idx)
            handle.key = handle.value = None
        batch, heads, q, dim = query.shape
        if self._row_view is None or self._row_view[0] != q:
            rows = torch.from_numpy(self._row_group).to(self.kv.device)
            tables = self.kv.block_tables(self._group_seqs)[rows]
            lens = self.kv.seq_lens(self._group_seqs)[rows]
            # One sequence per row; several decoder queries of a row are its varlen rows, and
            # causal=False lets each of them see the whole source. One query: decode mode.
            qsl = None
            if q > 1:
                qsl = torch.arange(0, (batch + 1) * q, q, dtype=torch.int32, device=self.kv.device)
            self._row_view = (q, tables, lens, qsl)
        _, tables, lens, qsl = self._row_view
        layer = handle.layer_idx
        qry = query.transpose(1, 2).reshape(batch * q, heads, dim).to(self.dtype)
        out, _ = ops.paged_attention(qry, self.kv.key_cache(layer), self.kv.value_cache(layer), tables, lens, qsl,
                                     scale=scale, soft_cap=soft_cap, sinks=None if sinks is None else sinks.float(),
                                     causal=False)
        return out.view(batch, q, heads, out.shape[-1]).to(query.dtype)


def source_mask(attention_mask, rows: int) -> Optional[np.ndarray]:
    """Real (non-padding) source tokens ``bool [rows, S]`` from a cross-attention mask
    ``[rows | 1, 1, q, S]`` (True / 0 = attend; every query row is the same), or None."""
    if attention_mask is None:
        return None
    mask = attention_mask
    while mask.dim() > 2:
        mask = mask[:, 0]
    if mask.dtype != torch.bool:
        mask = mask == 0
    real = mask.expand(rows, mask.shape[-1]).cpu().numpy()
    return None if real.all() else real


class PagedEncoderDecoderCache(EncoderDecoderCache):
    """``EncoderDecoderCache`` of a ``PagedCache`` (decoder self-attention) and a
    ``PagedCrossAttentionCache`` (cross-attention, one copy per input shared by its beams).
    ``PagedCache(config, ...)`` returns one for an encoder-decoder config."""

    def __init__(self, config, block_size: int = 16, num_blocks: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device=None) -> None:
        config = model_config(config, "PagedEncoderDecoderCache")
        super().__init__(_SelfAttentionCache(config, block_size, num_blocks, dtype, device),
                         PagedCrossAttentionCache(config, block_size, dtype, device))

    def crop(self, tokens_to_remove: int) -> None:
        self.self_attention_cache.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.self_attention_cache.batch_repeat_interleave(repeats)
        self.cross_attention_cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.self_attention_cache.batch_select_indices(indices)
        self.cross_attention_cache.batch_select_indices(indices)

    def memory_usage(self) -> dict:
        """``{"self_attention": ..., "cross_attention": ...}`` (see ``PagedCache.memory_usage``)."""
        return {"self_attention": self.self_attention_cache.memory_usage(),
                "cross_attention": self.cross_attention_cache.memory_usage()}


# PagedCache(config) of an encoder-decoder config builds this class (transformers_cache does not import
# this module: the dependency runs one way, from here to there).
PagedCache.encoder_decoder_cache = PagedEncoderDecoderCache
