"""``PagedCache``: a ``transformers`` ``Cache`` whose K/V live in a ``kvkernels.PagedKVCache`` (an
``MLAPagedCache`` of latent rows for MLA models).

One row of the model's batch is one sequence of the ``PagedKVCache``; every layer's K/V sit in the
same blocks (the cache stores all layers in one stacked tensor), so the bookkeeping of a forward —
appending the new tokens, the slot mapping, block tables, sequence lengths — is done once, by the
first layer, and reused by the others. See ``kvkernels.integrations.transformers`` for the flow.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvkernels import ops
from kvkernels.cache import MLAPagedCache, OutOfBlocksError, PagedKVCache
from kvkernels.cache.cascade import CascadePlan, cascade_attention
from kvkernels.integrations.transformers_attention import PagedKV, new_token_mask
from kvkernels.integrations.transformers_mla import latent_attention

ATTENTION_NAME = "kvkernels"


class Step(NamedTuple):
    """The kernels' view of one forward, shared by every layer (all on the cache's device)."""
    slot_mapping: Tensor  # int64 [batch * q]: slot of each new token, -1 for padding
    block_tables: Tensor  # int32 [batch, max_blocks]
    seq_lens: Tensor  # int32 [batch]: KV tokens per sequence, this forward's included
    query_start_loc: Optional[Tensor]  # int32 [batch + 1]; None: decode (one real token per row)
    real_index: Optional[Tensor]  # int64: rows of [batch * q] that are real tokens; None: all are


def model_config(config, who: str = "PagedCache"):
    """``config`` itself when it is a ``transformers`` config; a model's ``config`` when a model was
    passed (``PagedCache(model)`` means ``PagedCache(model.config)``); anything else: a TypeError."""
    if hasattr(config, "get_text_config"):
        return config
    inner = getattr(config, "config", None)
    if hasattr(inner, "get_text_config"):
        return inner
    raise TypeError(f"kvkernels {who}: expected the model's config (PagedCache(model.config)) or the model, "
                    f"got {type(config).__name__}")


def decoder_num_layers(text_config) -> int:
    """Layers of the decoder. ``config.get_text_config(decoder=True)`` maps ``num_hidden_layers`` to the
    decoder's count for encoder-decoder configs too (BART's own ``decoder_layers`` field of that view
    is not reliable)."""
    value = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(value, int) or value < 1:
        raise ValueError("kvkernels PagedCache: cannot tell the number of decoder layers from the config")
    return value


def check_attn_implementation(config) -> None:
    name = getattr(config, "_attn_implementation", None)
    if name is not None and name != ATTENTION_NAME:
        raise ValueError(f"kvkernels PagedCache: the model runs attn_implementation={name!r}; the paged cache "
                         f"needs attn_implementation={ATTENTION_NAME!r} (call kvkernels.integrations."
                         f"transformers.register() first)")


def duplicate_rows(key: Tensor, value: Tensor, real: Optional[np.ndarray]) -> np.ndarray:
    """``rep[r]``: the first row whose padding and K/V ``[N, H, q, D]`` are bitwise equal to row r's
    (``r`` itself when none). Candidates are found by a per-row fingerprint, then compared whole."""
    rows = key.shape[0]
    k, v = key.detach().reshape(rows, -1), value.detach().reshape(rows, -1)
    prints = torch.stack([k.sum(1), v.sum(1), k[:, ::7].sum(1), v[:, 3::5].sum(1)], 1).double().cpu().numpy()
    first: dict[bytes, list[int]] = {}
    rep = np.arange(rows)
    for r in range(rows):
        tag = prints[r].tobytes() + (b"" if real is None else real[r].tobytes())
        for cand in first.get(tag, ()):
            if torch.equal(k[r], k[cand]) and torch.equal(v[r], v[cand]):
                rep[r] = cand
                break
        else:
            first.setdefault(tag, []).append(r)
    return rep


def token_slots(store: PagedKVCache) -> Tensor:
    """A view of ``store``'s storage with the token slots (``block * block_size + offset``, what a slot
    mapping indexes) on dim 1: ``[L, slots, 2, H, D]`` for K/V, ``[L, slots, R + rope]`` for latent rows."""
    dim = store._block_dim
    return store.kv.flatten(dim, dim + 1).movedim(dim, 1)


class _PagedLayer(CacheLayerMixin):
    """One layer's face of a paged cache. The storage and the bookkeeping belong to the owning cache
    (all layers share block tables), so this only forwards; ``keys``/``values`` stay ``None``."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner, layer_idx: int) -> None:
        super().__init__()
        self._owner, self._layer_idx = owner, layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:  # the owner allocates
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner.update(key_states, value_states, self._layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.get_mask_sizes(query_length, self._layer_idx)

    def get_seq_length(self) -> int:
        return self._owner.get_seq_length(self._layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def offload(self):
        raise NotImplementedError("kvkernels PagedCache: use PagedKVCache.offload / restore per sequence")

    prefetch = offload


class PagedCache(Cache):
    """A ``transformers`` ``Cache`` backed by ``kvkernels.PagedKVCache`` (``kvkernels.MLAPagedCache``
    for MLA models: ``kv_lora_rank`` set in the config, attention class in
    ``transformers_mla.MLA_ATTENTION_CLASSES``).

    Args:
        config: the model's config (``model.config``; the model itself is taken for its config); the
            number of layers and whether the model is MLA come from it (head dims / latent widths from
            the first states ``update`` gets).
        block_size: tokens per block.
        num_blocks: blocks of the storage (block 0 is the null block). ``None``: sized on first use
            and grown (doubled) whenever an append would run out.
        dtype, device: of the storage; default: those of the first key states.
        cascade_min_tokens: decode steps whose rows form groups sharing at least this many prompt
            tokens on average (beams, parallel samples) attend the shared blocks once per group
            (``kvkernels.cache.cascade``) in the layers without a sliding window or sinks; ``None``
            turns it off.

    For an encoder-decoder config, ``PagedCache(config, ...)`` builds a ``PagedEncoderDecoderCache``
    (self-attention on a ``PagedCache``, one cross-attention copy per input shared by its beams).
    The model must run ``attn_implementation="kvkernels"`` (``register()`` first).
    """

    # The class PagedCache(config) builds for an encoder-decoder config. transformers_encdec, which
    # builds on this module, sets it when imported (kvkernels.integrations.transformers imports both);
    # this module never imports that one, so the dependency runs one way.
    encoder_decoder_cache: Optional[type] = None

    def __new__(cls, config=None, *args, **kwargs):
        if cls is PagedCache and config is not None:
            config = model_config(config)
            if getattr(config, "is_encoder_decoder", False):
                if PagedCache.encoder_decoder_cache is None:
                    raise TypeError("kvkernels PagedCache: an encoder-decoder config needs the encoder-decoder "
                                    "cache: import kvkernels.integrations.transformers (not only its "
                                    "transformers_cache module)")
                return PagedCache.encoder_decoder_cache(config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, config, block_size: int = 16, num_blocks: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device=None, cascade_min_tokens: Optional[int] = 256) -> None:
        config = model_config(config)
        text = config.get_text_config(decoder=True)
        if num_blocks is not None and (not isinstance(num_blocks, int) or num_blocks < 2):
            raise ValueError(f"kvkernels PagedCache: num_blocks: expected an int >= 2 or None, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"kvkernels PagedCache: block_size: expected an int >= 1, got {block_size!r}")
        if cascade_min_tokens is not None and (not isinstance(cascade_min_tokens, int) or cascade_min_tokens < 1):
            raise ValueError(f"kvkernels PagedCache: cascade_min_tokens: expected an int >= 1 or None, got "
                             f"{cascade_min_tokens!r}")
        if dtype is not None and dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError("kvkernels PagedCache: fp8 storage needs scales; not supported by this integration")
        self.config = config
        self.num_layers = decoder_num_layers(text)
        self.block_size, self.dtype = block_size, dtype
        self.cascade_min_tokens = cascade_min_tokens
        self.device = torch.device(device) if device is not None else None
        self._fixed_blocks = num_blocks
        # MLA (the classes of transformers_mla.MLA_ATTENTION_CLASSES): update() receives the latent
        # [B, 1, q, kv_lora_rank] and the rotary key
        # [B, 1, q, rope_dim], stored as one row of an MLAPagedCache and attended with absorbed weights.
        self.latent = getattr(text, "kv_lora_rank", None) is not None
        self.kv: Optional[PagedKVCache] = None
        self._seqs: list[int] = []  # batch row -> sequence id
        self._cols = [0] * self.num_layers  # columns (tokens, padding included) seen by each layer
        self._pads: list[list[int]] = []  # per row: columns that were padding (never stored)
        self._last_layer: Optional[int] = None
        self._q = 0  # new columns of the forward in progress
        self._base = 0  # columns before it
        self._step: Optional[Step] = None
        self._static: Optional[Step] = None  # set by PagedDecoder around a compiled step
        self._dups = None  # prefill rows forked from a duplicate row: (rep, real, counts, slots)
        self._unique = None  # (step, _unique_rows result): the distinct rows of that step, for every layer
        self._cascade = None  # (step, CascadePlan or None): built by the first layer that can use it
        self._held: list[Optional[int]] = []  # sequences kept outside the batch rows (hold_row), None: released
        self.peak_used_blocks = 0  # most blocks held at once (see memory_usage)
        self.grow_count = 0  # storage growths
        self.split_rows = 0  # prefill duplicates that turned out to differ in a later layer
        super().__init__(layers=[_PagedLayer(self, i) for i in range(self.num_layers)])

    # ---- transformers' Cache interface -----------------------------------------------------------

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Called by the model with this forward's new states ``[B, H, q, D]`` (RoPE applied).
        Returns a ``PagedKV`` handle twice (the ``"kvkernels"`` attention function writes and
        attends). MLA models pass the latent ``[B, 1, q, R]`` and rotary key ``[B, 1, q, rope]`` and
        get the handle back the same way (their ``expand_kv`` lets it through, see ``transformers_mla``)."""
        if self._static is not None:  # a PagedDecoder step: bookkeeping done outside the graph
            handle = PagedKV(self, layer_idx, key_states, value_states)
            return handle, handle
        batch, _, q, _ = key_states.shape
        if self._last_layer is None or layer_idx <= self._last_layer:
            self._begin_forward(key_states, value_states, batch, q, layer_idx)
        elif q != self._q or batch != len(self._seqs):
            raise ValueError(f"kvkernels PagedCache: layer {layer_idx} got [{batch}, q={q}] states in a forward "
                             f"that started with [{len(self._seqs)}, q={self._q}]")
        self._last_layer = layer_idx
        self._cols[layer_idx] += q
        self.layers[layer_idx].is_initialized = True
        handle = PagedKV(self, layer_idx, key_states, value_states)
        return handle, handle

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._cols[layer_idx] if 0 <= layer_idx < self.num_layers else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        # Every layer sees every column (sliding windows are applied by the kernel), so the mask
        # spans them all; the attention function only reads its diagonal (see new_token_mask).
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def batch_size(self) -> int:
        return len(self._seqs) if self._seqs else -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues row ``beam_idx[i]``. Block tables and refcounts are
        permuted (``PagedKVCache.reorder``); no KV is copied (a shared partial block is copied on
        the next write into it)."""
        if not self._seqs:
            return
        idx = beam_idx.tolist()
        self.kv.reorder(self._seqs, idx)
        self._pads = [list(self._pads[i]) for i in idx]
        self._step = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` consecutive rows sharing its blocks (zero-copy forks): the
        "prefill once, then branch" pattern before beam search or parallel sampling."""
        if not self._seqs or repeats == 1:
            return
        seqs, pads = [], []
        for seq, pad in zip(self._seqs, self._pads):
            seqs.append(seq)
            seqs.extend(self.kv.fork(seq) for _ in range(repeats - 1))
            pads.extend(list(pad) for _ in range(repeats))
        self._seqs, self._pads, self._step = seqs, pads, None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (in that order; a repeated index forks)."""
        if not self._seqs:
            return
        idx = indices.tolist()
        keep: set[int] = set()
        seqs = []
        for i in idx:
            seqs.append(self._seqs[i] if i not in keep else self.kv.fork(self._seqs[i]))
            keep.add(i)
        for i, seq in enumerate(self._seqs):
            if i not in keep:
                self.kv.free(seq)
        self._pads = [list(self._pads[i]) for i in idx]
        self._seqs, self._step = seqs, None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (transformers 5.x passes a negative count).
        Zero-copy: each row becomes a prefix fork of itself. Columns that were padding are not
        stored, so only the real ones are removed."""
        if tokens_to_remove > 0:
            raise ValueError("kvkernels PagedCache.crop: pass a negative number of tokens to remove")
        n = -tokens_to_remove
        if n == 0 or not self._seqs:
            return
        cols = self._cols[0]
        if n > cols:
            raise ValueError(f"kvkernels PagedCache.crop: cannot remove {n} of {cols} tokens")
        lens = self.kv.seq_lens(self._seqs).tolist()
        new_seqs = []
        for r, seq in enumerate(self._seqs):
            pads = self._pads[r]
            dropped_pads = sum(1 for c in pads if c >= cols - n)
            keep = lens[r] - (n - dropped_pads)
            new_seqs.append(self.kv.fork(seq, keep))
            self.kv.free(seq)
            self._pads[r] = [c for c in pads if c < cols - n]
        self._seqs = new_seqs
        self._cols = [max(c - n, 0) for c in self._cols]
        self._step = None

    def reserve(self, new_tokens: int) -> None:
        """Make room now (one storage growth at most) for ``new_tokens`` more tokens in every row,
        so that no growth interrupts the steps that follow (``num_blocks=None`` caches only)."""
        if self.kv is not None and self._seqs and self._fixed_blocks is None:
            self._reserve(np.full(len(self._seqs), int(new_tokens), dtype=np.int64))

    def hold_row(self, row: int) -> int:
        """Keep what row ``row`` holds now alive outside the batch (a zero-copy fork that later
        ``batch_select_indices`` / ``reorder_cache`` calls do not touch): generation strategies park
        finished continuations this way. Returns a handle; ``held_sequence(handle)`` is its
        ``PagedKVCache`` sequence id (a storage growth moves it into the new storage under a new id)."""
        self._held.append(self.kv.fork(self._seqs[row]))
        return len(self._held) - 1

    def held_sequence(self, handle: int) -> int:
        seq = self._held[handle]
        if seq is None:
            raise ValueError(f"kvkernels PagedCache: held sequence {handle} was released")
        return seq

    def release_held(self) -> None:
        """Free every sequence kept by ``hold_row``."""
        for i, seq in enumerate(self._held):
            if seq is not None and self.kv is not None:
                self.kv.free(seq)
            self._held[i] = None

    def reset(self) -> None:
        """Forget every sequence, held ones included (the storage is kept for the next batch)."""
        self.release_held()
        self._held = []
        if self.kv is not None:
            for seq in self._seqs:
                self.kv.free(seq)
        self._seqs, self._pads = [], []
        self._cols = [0] * self.num_layers
        self._last_layer, self._step = None, None
        for layer in self.layers:
            layer.reset()

    # ---- compiled decode steps (PagedDecoder) ----------------------------------------------------

    def append_decode_step(self) -> Step:
        """One more token in every row (``PagedKVCache.append_decode``), the columns counted: the
        eager half of a ``PagedDecoder`` step, run before the compiled forward."""
        step = self._append(None, len(self._seqs), 1)
        self._cols = [c + 1 for c in self._cols]
        return step

    @contextlib.contextmanager
    def static_step(self, step: Step):
        """Within the block, ``update`` and ``attend`` use ``step`` (tensors that keep their identity
        and shape from step to step) and do no Python bookkeeping, so a compiled forward has no
        graph input that changes with the sequence lengths."""
        self._static = step
        try:
            yield
        finally:
            self._static = None
            self._last_layer, self._step = None, None

    # ---- inspection ------------------------------------------------------------------------------

    @property
    def sequences(self) -> list[int]:
        """``PagedKVCache`` sequence id of each batch row."""
        return list(self._seqs)

    def memory_usage(self) -> dict:
        """``PagedKVCache.memory_usage()`` (token-granular: ``stored_bytes`` counts each shared
        block once) plus ``peak_allocated_bytes``: the most whole blocks held at any step so far."""
        if self.kv is None:
            return {"stored_bytes": 0, "allocated_bytes": 0, "peak_allocated_bytes": 0}
        usage = self.kv.memory_usage()
        usage["peak_allocated_bytes"] = self.peak_used_blocks * self.kv.bytes_per_block
        return usage

    # ---- storage ---------------------------------------------------------------------------------

    def _new_storage(self, num_blocks: int) -> PagedKVCache:
        common = dict(dtype=self.dtype, device=self.device, enable_prefix_caching=False,
                      max_sequences=max(64, 2 * len(self._seqs)))
        if self.latent:
            return MLAPagedCache(self.num_layers, self._kv_lora_rank, self._rope_dim, num_blocks, self.block_size,
                                 **common)
        return PagedKVCache(self.num_layers, self._kv_heads, self._head_dim, num_blocks, self.block_size, **common)

    def _begin_forward(self, key_states: Tensor, value_states: Tensor, batch: int, q: int, layer_idx: int) -> None:
        if self.kv is None:
            check_attn_implementation(self.config)
            self.dtype = self.dtype or key_states.dtype
            self.device = self.device or key_states.device
            if self.latent:  # one latent row [c ; k_pe] per token
                if key_states.shape[1] != 1 or value_states.shape[1] != 1:
                    raise ValueError(f"kvkernels PagedCache: MLA update: expected the latent [B, 1, q, R] and the "
                                     f"rotary key [B, 1, q, rope], got {list(key_states.shape)} and "
                                     f"{list(value_states.shape)}")
                self._kv_lora_rank, self._rope_dim = key_states.shape[-1], value_states.shape[-1]
            else:
                if key_states.shape[-1] != value_states.shape[-1]:
                    raise ValueError("kvkernels PagedCache: key and value head dims differ")
                self._kv_heads, self._head_dim = key_states.shape[1], key_states.shape[-1]
            blocks = self._fixed_blocks or batch * (math.ceil(q / self.block_size) + 2) + 1
            self.kv = self._new_storage(blocks)
        if not self._seqs:
            self._seqs = [self.kv.add_sequence([])[0] for _ in range(batch)]
            self._pads = [[] for _ in range(batch)]
        elif batch != len(self._seqs):
            raise ValueError(f"kvkernels PagedCache: batch of {batch} rows for a cache holding {len(self._seqs)} "
                             f"(reset() it, or batch_repeat_interleave() to branch)")
        self._q, self._base, self._step = q, self.get_seq_length(layer_idx), None

    def _reserve(self, counts: np.ndarray) -> None:
        """Grow the storage unless appending ``counts[r]`` tokens to each row surely fits
        (a copy-on-write per row included)."""
        lens = self.kv.seq_lens(self._seqs).cpu().numpy().astype(np.int64)
        bs = self.block_size
        need = int((-(-(lens + counts) // bs) - (-(-lens // bs))).sum()) + len(lens)
        if need > self.kv.pool.num_free_blocks:
            self._grow(need)

    def _grow(self, need: int) -> None:
        """Move everything into a storage of at least twice the blocks. Built with the public
        ``PagedKVCache`` API: each row forks the rebuilt row it shares the longest block prefix
        with (so shared blocks stay shared) and its other tokens are copied over."""
        if self._fixed_blocks is not None:
            raise OutOfBlocksError(need, self.kv.pool.num_free_blocks, self.kv.pool.num_usable_blocks,
                                   "PagedCache with a fixed num_blocks")
        old, bs = self.kv, self.block_size
        used = old.pool.num_usable_blocks - old.pool.num_free_blocks
        new = self._new_storage(max(2 * old.num_blocks, used + need + 1))
        held = [i for i, seq in enumerate(self._held) if seq is not None]
        everything = self._seqs + [self._held[i] for i in held]  # batch rows, then held sequences
        tables = old.block_tables(everything).cpu().numpy()
        lens = old.seq_lens(everything).tolist()
        flat_old, flat_new = token_slots(old), token_slots(new)
        rebuilt: list[tuple[np.ndarray, int, int]] = []  # (old blocks, length, new seq) of each row done
        seqs = []
        for r, seq in enumerate(everything):
            blocks = tables[r, :-(-lens[r] // bs)]
            shared, parent = 0, None
            for prev_blocks, prev_len, prev_seq in rebuilt:
                k = min(len(blocks), len(prev_blocks))
                same = blocks[:k] == prev_blocks[:k]
                common = min((k if same.all() else int(np.argmin(same))) * bs, lens[r], prev_len)
                if common > shared:
                    shared, parent = common, prev_seq
            child = new.fork(parent, shared) if parent is not None else new.add_sequence([])[0]
            if lens[r] > shared:  # copied now: a later row may fork this one (and copy-on-write it)
                dst = new.append(child, np.zeros(lens[r] - shared, dtype=np.int64))
                flat_new[:, dst] = flat_old[:, old.slot_mapping(seq, shared, lens[r])]
            rebuilt.append((blocks, lens[r], child))
            seqs.append(child)
        new._counters.update(old._counters)  # forks / copy-on-write counts go on (the rebuild's own are not counted)
        rows = len(self._seqs)
        for i, seq in zip(held, seqs[rows:]):
            self._held[i] = seq
        self.kv, self._seqs, self._step = new, seqs[:rows], None
        self.grow_count += 1

    # ---- the step: bookkeeping once per forward --------------------------------------------------

    def _append(self, real: Optional[np.ndarray], batch: int, q: int, handle: Optional[PagedKV] = None) -> Step:
        """Append this forward's real tokens to every row; the kernels' tensors for the step.

        A prefill into empty rows first looks for duplicate rows (``generate()`` expands each prompt
        to ``num_beams`` / ``num_return_sequences`` identical rows): rows whose padding and first-layer
        K/V are bitwise equal to an earlier row's become zero-copy forks of it and write nothing."""
        self._dups = None
        if real is None and q == 1:
            zeros = np.zeros(batch, dtype=np.int64)
            try:
                ds = self.kv.append_decode(self._seqs, zeros)
            except OutOfBlocksError as err:
                self._grow(err.needed)
                ds = self.kv.append_decode(self._seqs, zeros)
            step = Step(ds.slot_mapping, ds.block_tables, ds.seq_lens, None, None)
        else:
            counts = np.full(batch, q, dtype=np.int64) if real is None else real.sum(1).astype(np.int64)
            base = self._base
            rep = np.arange(batch)
            if handle is not None and base == 0 and batch > 1:
                rep = duplicate_rows(handle.key, handle.value, real)
            self._reserve(counts)  # room for every row: a duplicate may still need its own (see below)
            slots = np.full((batch, q), -1, dtype=np.int64)
            for r in np.flatnonzero(rep == np.arange(batch)).tolist():
                if counts[r]:
                    s = self.kv.append(self._seqs[r], np.zeros(int(counts[r]), dtype=np.int64)).cpu().numpy()
                    if real is None:
                        slots[r] = s
                    else:
                        slots[r, real[r]] = s
            for r in np.flatnonzero(rep != np.arange(batch)).tolist():
                self.kv.free(self._seqs[r])
                self._seqs[r] = self.kv.fork(self._seqs[rep[r]])
            if real is not None:
                for r in np.flatnonzero(counts < q).tolist():
                    self._pads[r].extend((base + np.flatnonzero(~real[r])).tolist())
            if (rep != np.arange(batch)).any():
                self._dups = (rep, real, counts, slots)
            step = self._make_step(real, counts, slots)
        pool = self.kv.pool
        self.peak_used_blocks = max(self.peak_used_blocks, pool.num_usable_blocks - pool.num_free_blocks)
        return step

    def _make_step(self, real: Optional[np.ndarray], counts: np.ndarray, slots: np.ndarray) -> Step:
        dev = self.kv.device
        qsl = np.zeros(len(counts) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(counts)
        real_index = None if real is None else torch.from_numpy(np.flatnonzero(real.ravel())).to(dev)
        return Step(torch.from_numpy(slots.ravel()).to(dev), self.kv.block_tables(self._seqs),
                    self.kv.seq_lens(self._seqs), torch.from_numpy(qsl).to(dev), real_index)

    def _check_duplicates(self, layer: int, key: Tensor, value: Tensor) -> None:
        """Rows forked from a duplicate at prefill write nothing; check that this layer's K/V of
        each still equals its source row's, and give rows that differ their own blocks."""
        rep, real, counts, slots = self._dups
        rows = np.flatnonzero(rep != np.arange(len(rep)))
        idx = torch.from_numpy(rows).to(key.device)
        src = torch.from_numpy(rep[rows]).to(key.device)
        if torch.equal(key[idx], key[src]) and torch.equal(value[idx], value[src]):
            return
        bad = [int(r) for r in rows
               if not (torch.equal(key[r], key[rep[r]]) and torch.equal(value[r], value[rep[r]]))]
        flat = token_slots(self.kv)
        for r in bad:
            self.kv.free(self._seqs[r])
            self._seqs[r] = self.kv.add_sequence([])[0]
            new = self.kv.append(self._seqs[r], np.zeros(int(counts[r]), dtype=np.int64)).cpu().numpy()
            mine = slice(None) if real is None else real[r]
            old = slots[rep[r]][mine]
            slots[r][mine] = new
            if layer:  # the layers written so far are the source row's
                dst, src = torch.from_numpy(new).to(flat.device), torch.from_numpy(old).to(flat.device)
                flat[:layer, dst] = flat[:layer, src]
            rep[r] = r
        self.split_rows += len(bad)
        self._dups = (rep, real, counts, slots) if (rep != np.arange(len(rep))).any() else None
        self._step = self._make_step(real, counts, slots)

    def _get_step(self, attention_mask, handle: Optional[PagedKV] = None) -> Step:
        if self._static is not None:
            return self._static
        if self._step is None:
            real = new_token_mask(attention_mask, len(self._seqs), self._q)
            self._step = self._append(real, len(self._seqs), self._q, handle)
        return self._step

    # ---- attention (called by the "kvkernels" attention function) --------------------------------

    def attend(self, module, query: Tensor, handle: PagedKV, attention_mask, *, scale: Optional[float],
               window_left: int, soft_cap: float, sinks: Optional[Tensor]) -> Tensor:
        """Write the layer's new K/V into the paged storage and run ``ops.paged_attention`` over it
        (MLA models: ``transformers_mla.latent_attention``, absorbed weights over the latent rows).
        ``query [B, Hq, q, D]`` -> ``[B, q, Hq, Dv]``. Rows of padding queries come out as zeros."""
        if not getattr(module, "is_causal", True):
            raise NotImplementedError("kvkernels PagedCache: bidirectional self-attention is not paged")
        step = self._get_step(attention_mask, handle)
        layer = handle.layer_idx
        if self._dups is not None and handle.key is not None:
            self._check_duplicates(layer, handle.key, handle.value)
            step = self._step
        if self.latent and (window_left >= 0 or soft_cap or sinks is not None):
            raise NotImplementedError("kvkernels PagedCache: MLA attention takes no sliding window, soft cap "
                                      "or sinks")
        rows = self._unique_rows(query)
        if rows is not None:  # duplicate prefill rows: attend once per distinct row, then copy
            unique, source, sub = rows
            out = self._attend_rows(module, query.index_select(0, unique), handle, sub, scale=scale,
                                    window_left=window_left, soft_cap=soft_cap, sinks=sinks)
            return out.index_select(0, source)
        return self._attend_rows(module, query, handle, step, scale=scale, window_left=window_left,
                                 soft_cap=soft_cap, sinks=sinks)

    def _attend_rows(self, module, query: Tensor, handle: PagedKV, step: Step, *, scale: Optional[float],
                     window_left: int, soft_cap: float, sinks: Optional[Tensor]) -> Tensor:
        """``attend`` for the rows of ``step`` (all rows, or the distinct ones of a duplicated
        prefill); the handle's new K/V are written for every row of the forward."""
        if self.latent:
            return latent_attention(self.kv, module, query, handle, step, scale)
        layer = handle.layer_idx
        key_cache, value_cache = self.kv.key_cache(layer), self.kv.value_cache(layer)
        heads, q, dim = query.shape[1:]
        if handle.key is not None:
            k = handle.key.transpose(1, 2).reshape(-1, self._kv_heads, dim).to(self.dtype)
            v = handle.value.transpose(1, 2).reshape(-1, self._kv_heads, dim).to(self.dtype)
            ops.reshape_and_cache(k, v, key_cache, value_cache, step.slot_mapping)
            handle.key = handle.value = None
        qry = query.transpose(1, 2).reshape(-1, heads, dim).to(self.dtype)
        if step.real_index is not None:
            qry = qry.index_select(0, step.real_index)
        plan = self._cascade_plan(step) if window_left < 0 and sinks is None else None
        if plan is not None:  # rows sharing a prompt
            out, _ = cascade_attention(qry, key_cache, value_cache, plan, scale=scale, soft_cap=soft_cap)
        else:
            out, _ = ops.paged_attention(qry, key_cache, value_cache, step.block_tables, step.seq_lens,
                                         step.query_start_loc, scale=scale, window_left=window_left,
                                         soft_cap=soft_cap, sinks=None if sinks is None else sinks.float())
        if step.real_index is not None:
            full = out.new_zeros((query.shape[0] * q, heads, out.shape[-1]))
            out = full.index_copy_(0, step.real_index, out)
        return out.view(-1, q, heads, out.shape[-1]).to(query.dtype)

    def _cascade_plan(self, step: Step) -> Optional[CascadePlan]:
        """The shared-prefix plan of a decode step (``kvkernels.cache.cascade``), built once per step
        by the first layer that can use it (none, for a model whose every layer has a window or
        sinks); ``None`` for prefill, compiled ``PagedDecoder`` steps, or rows that share too little."""
        if self._cascade is None or self._cascade[0] is not step:
            plan = None
            if (self.cascade_min_tokens is not None and self._static is None and step.query_start_loc is None
                    and len(self._seqs) > 1):
                plan = self.kv.cascade_plan(self._seqs, min_shared_tokens=self.cascade_min_tokens)
            self._cascade = (step, plan)
        return self._cascade[1]

    def _unique_rows(self, query: Tensor) -> Optional[tuple[Tensor, Tensor, Step]]:
        """For a prefill whose rows include zero-copy duplicates (``self._dups``) with bitwise equal
        queries: the distinct rows, each row's index among them, and the step restricted to the
        distinct rows. ``generate()`` with beams prefills ``num_beams`` copies of each prompt; this
        attends each prompt once. ``None`` when there is nothing to share."""
        if self._dups is None:
            return None
        rep, real, counts, _ = self._dups
        batch = len(rep)
        dup = np.flatnonzero(rep != np.arange(batch))
        dev = query.device
        if not torch.equal(query[torch.from_numpy(dup).to(dev)], query[torch.from_numpy(rep[dup]).to(dev)]):
            return None  # equal K/V but different queries: attend every row
        if self._unique is not None and self._unique[0] is self._step:  # built by an earlier layer
            return self._unique[1]
        unique = np.flatnonzero(rep == np.arange(batch))
        source = np.searchsorted(unique, rep)  # rep[r] is a distinct row: its position in `unique`
        step = self._step
        qsl = np.zeros(len(unique) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(counts[unique])
        real_index = None if real is None else torch.from_numpy(np.flatnonzero(real[unique].ravel())).to(dev)
        idx = torch.from_numpy(unique).to(dev)
        sub = Step(step.slot_mapping, step.block_tables.index_select(0, idx), step.seq_lens.index_select(0, idx),
                   torch.from_numpy(qsl).to(dev), real_index)
        self._unique = (step, (idx, torch.from_numpy(source).to(dev), sub))
        return self._unique[1]
