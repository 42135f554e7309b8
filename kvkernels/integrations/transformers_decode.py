"""``PagedDecoder``: decode steps of a ``transformers`` model on a ``PagedCache``, compiled with
``torch.compile(fullgraph=True)`` (and CUDA graphs with ``mode="reduce-overhead"``).

A step is split in two:

* outside the compiled region (plain Python, a few microseconds): ``PagedKVCache.append_decode``
  for every row, then the step's tensors are copied *in place* into fixed buffers — slot mapping
  ``[B]``, sequence lengths ``[B]``, a block table ``[B, max_blocks]`` of fixed width (the unused
  tail is the null block, which the kernel never reads past ``seq_lens``) — and the positions
  ``seq_lens - 1`` into the ``position_ids`` buffer;
* the compiled region: the model's forward for one token per row. ``PagedCache.update`` and the
  attention function read the fixed buffers (same tensors, same shapes every step), so nothing in
  the graph depends on the sequence lengths as Python numbers: one compile serves every step while
  the sequences grow. The model gets a ``[B, 1, 1, 1]`` all-True 4-D attention mask, which
  transformers passes through untouched (no mask construction, which would read the cache length):
  padding was dealt with at prefill (it never entered the cache), and a decode token is real.

Prefill (and any step that is not one token per row) runs eagerly through the same cache, e.g.
``model(input_ids, attention_mask=mask, cache=cache)`` (``past_key_values=cache`` before
transformers 5.24).

Inference only: the ``kvkernels`` ops have no backward, so a step runs under ``torch.no_grad()``
whatever the caller's grad mode (no ``with torch.no_grad():`` needed around it; its logits do not
require grad). Without that, a compiled step in grad mode had AOTAutograd trace a backward through
``paged_attention``, which warned "an autograd kernel was not registered to the Autograd key(s)".
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from kvkernels.integrations.transformers_cache import PagedCache, Step
from kvkernels.integrations.transformers_compat import cache_kwargs, pop_cache


class PagedDecoder:
    """One-token-per-row decode steps of ``model`` on ``cache`` (a prefilled ``PagedCache``).

    ``decoder(next_tokens)`` (int64 ``[B]`` or ``[B, 1]``) appends the tokens, runs the model and
    returns the last position's logits ``[B, vocab]``. Inference only: the step runs under
    ``torch.no_grad()`` (see the module docs).

    Args:
        cache: the ``PagedCache`` (``past_key_values=`` is accepted too: transformers' name for it
            before 5.24).
        max_length: longest sequence (tokens per row, padding not counted) the steps will reach;
            sets the fixed block-table width. Default: ``config.max_position_embeddings``.
        max_new_tokens: steps to reserve storage for now (a storage growth later changes the
            storage tensor, which costs one recompile). Default: none reserved.
        compile: wrap the step in ``torch.compile(fullgraph=True, **compile_kwargs)``
            (``backend``, ``mode``, ``dynamic`` ...); ``False`` runs the same step eagerly.
    """

    def __init__(self, model, cache: Optional[PagedCache] = None, *, max_length: Optional[int] = None,
                 max_new_tokens: int = 0, compile: bool = True, past_key_values: Optional[PagedCache] = None,
                 **compile_kwargs) -> None:
        cache = pop_cache({"past_key_values": past_key_values}, "kvkernels PagedDecoder", cache)
        if not isinstance(cache, PagedCache) or cache.kv is None or not cache.sequences:
            raise ValueError("kvkernels PagedDecoder: needs a PagedCache that holds a prefilled batch")
        self.model, self.cache = model, cache
        self._cache_arg = cache_kwargs(model.forward, cache)  # resolved here, not inside the compiled step
        kv, bs, batch = cache.kv, cache.block_size, len(cache.sequences)
        if max_length is None:
            max_length = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 4096))
        if max_new_tokens:
            cache._reserve(np.full(batch, max_new_tokens, dtype=np.int64))  # no growth (recompile) later
        dev = kv.device
        self.max_blocks = max(math.ceil(max_length / bs), 1)
        self._slots = torch.zeros(batch, dtype=torch.int64, device=dev)
        self._seq_lens = torch.zeros(batch, dtype=torch.int32, device=dev)
        self._tables = torch.zeros(batch, self.max_blocks, dtype=torch.int32, device=dev)
        self._positions = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self._mask = torch.ones(batch, 1, 1, 1, dtype=torch.bool, device=dev)
        self._step = Step(self._slots, self._tables, self._seq_lens, None, None)
        # CUDA graphs replay fixed addresses: the storage and the step buffers are updated in place,
        # never reallocated, so they are marked static instead of copied every replay.
        self._graphs = compile and compile_kwargs.get("mode") in ("reduce-overhead", "max-autotune")
        self._marked = None  # the storage tensor marked last (cache.kv is replaced when it grows)
        self._mark_static()
        self._forward = torch.compile(self._run, fullgraph=True, **compile_kwargs) if compile else self._run

    def _mark_static(self) -> None:
        """Marks the current storage (and once, the step buffers) static for CUDA graphs. Read from
        ``self.cache`` each time: the reservation above, or a growth later, replaces the storage."""
        storage = self.cache.kv.kv
        if not self._graphs or storage is self._marked:
            return
        for t in (storage,) if self._marked is not None else (storage, self._slots, self._seq_lens, self._tables):
            torch._dynamo.mark_static_address(t)
        self._marked = storage

    def _run(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         **self._cache_arg, use_cache=True)
        return out.logits[:, -1]

    def __call__(self, next_tokens: Tensor) -> Tensor:
        with torch.no_grad():  # inference only (no backward through the kvkernels ops)
            return self._step_tokens(next_tokens)

    def _step_tokens(self, next_tokens: Tensor) -> Tensor:
        cache = self.cache
        tokens = next_tokens.reshape(-1, 1)
        if tokens.shape[0] != self._slots.shape[0]:
            raise ValueError(f"kvkernels PagedDecoder: {tokens.shape[0]} tokens for {self._slots.shape[0]} rows")
        longest = int(cache.kv.seq_lens(cache.sequences).max()) + 1
        if longest > self.max_blocks * cache.block_size:  # checked before anything changes
            raise ValueError(f"kvkernels PagedDecoder: a sequence would outgrow max_length "
                             f"({self.max_blocks * cache.block_size} tokens)")
        step = cache.append_decode_step()
        self._mark_static()  # a storage grown by this step (one recompile) is static as well
        width = step.block_tables.shape[1]
        self._slots.copy_(step.slot_mapping)
        self._seq_lens.copy_(step.seq_lens)
        self._tables[:, :width].copy_(step.block_tables)
        self._positions.copy_((step.seq_lens - 1).view(-1, 1))
        with cache.static_step(self._step):
            return self._forward(tokens, self._positions, self._mask)
