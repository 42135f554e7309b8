"""Hugging Face ``transformers`` (5.x) on kvkernels' paged cache and kernels.

Use::

    from kvkernels.integrations.transformers import PagedCache, register
    register()                                             # -> "kvkernels"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvkernels")
    out = model.generate(input_ids, attention_mask=mask, cache=PagedCache(model.config),
                         max_new_tokens=64, num_beams=4)

(``past_key_values=`` instead of ``cache=`` before transformers 5.24, which renamed the argument;
``cache_kwargs(model.generate, cache)`` gives the keyword the installed version takes.)

``register()`` adds the attention function ``paged_attention_forward`` to ``AttentionInterface``
and transformers' ``sdpa_mask`` to ``AttentionMaskInterface``, both under ``"kvkernels"``. Without
the mask registration transformers hands every attention function ``attention_mask=None``, and
left-padded batches would attend their padding.

How a forward runs on a ``PagedCache``
--------------------------------------
1. The model builds its masks with ``sdpa_mask``, sized by ``PagedCache.get_mask_sizes`` (every
   column seen so far plus the new ones).
2. Each attention layer calls ``PagedCache.update(k, v, layer_idx)`` with the new tokens' states.
   The cache returns a ``PagedKV`` handle (cache, layer, pending K/V) instead of tensors; the model
   passes it unchanged to the attention function. The first ``update`` of a forward (a layer index
   not above the previous one) starts the forward.
3. The attention function of the first layer does the forward's bookkeeping, once for all layers:
   it reads which new tokens are real off the mask — a token is real exactly when it may attend
   itself, so the mask's diagonal over the new columns is the padding information (``None``: no
   padding) — appends the real ones to each row's ``PagedKVCache`` sequence (``append_decode`` for a
   plain one-token step) and keeps the slot mapping (``-1`` for padding, which the write skips),
   block tables, sequence lengths, ``query_start_loc`` and the indices of the real query rows.
4. Every layer then writes its new K/V with ``ops.reshape_and_cache`` and attends with
   ``ops.paged_attention`` directly on the paged storage (no gather into dense K/V): ``window_left``
   from the layer's sliding window (``W - 1``), ``soft_cap`` from ``softcap`` (Gemma2), ``sinks`` from
   ``s_aux`` (GPT-OSS), ``scale`` from ``scaling``. Padding queries are left out of the kernel call
   and come back as zero rows (they are discarded by the model's consumers).

So padding never enters a sequence's KV, and each real token sees exactly the real tokens before
it (within its window) — the keys the stock cache + SDPA path lets it see.

Beam search: ``generate()`` expands every prompt to ``num_beams`` identical rows before the prefill.
A prefill into empty rows finds rows whose padding and first-layer K/V are bitwise equal to an
earlier row's and makes them zero-copy forks of it (they write nothing, and the prefill attention runs
once per distinct row when the queries are equal too); each later layer checks they are still
equal, and a row that is not gets its own blocks. ``reorder_cache(beam_idx)`` is
``PagedKVCache.reorder``: block tables and refcounts are permuted, no KV is copied; a partial block
shared after the reorder is copied on the next write (copy-on-write). ``batch_repeat_interleave``
forks (prefill once, then branch).

MLA models (config with ``kv_lora_rank``; DeepSeek-V2/V3, AXK1, GLM-4-MoE-Lite, Youtu, MiniCPM3,
Mistral-4, LongCat-Flash): the storage is a ``kvkernels.MLAPagedCache``,
one row of latent + rotary key per token and layer (``kv_lora_rank + qk_rope_head_dim`` values,
nothing per head), with the same bookkeeping as above (padding never stored, duplicate prefill rows
forked, beams reordered by block table, copy-on-write, growth). transformers' MLA attention calls
``update(latent, k_rot)`` and then ``self.expand_kv(...)``, which would multiply every cached latent by
``kv_b_proj`` into per-head K/V, every step. ``update`` returns a ``PagedKV`` handle here too, and
``register()`` wraps ``expand_kv`` of the MLA attention classes listed in
``transformers_mla.MLA_ATTENTION_CLASSES`` so that a handle passes through unchanged while tensors still go to the original method (no cache, a stock cache: the model
runs exactly as before). The attention function then writes the rows (``ops.concat_and_cache_mla``)
and runs the absorbed attention (``transformers_mla.latent_attention``): ``q_nope`` is multiplied by
``W_UK`` per head, ``ops.mla_paged_attention`` attends the latent rows in place, and the latent
output is multiplied by ``W_UV``; ``kv_b_proj``'s weight touches only the new queries. Why a wrapper
of ``expand_kv``: it is the one call between ``update`` and the attention function, the model code
offers no hook there, and replacing the whole attention module's ``forward`` would copy model code
(query LoRA, RoPE variants) that differs between models; the wrapper is a type check in front of the
original. Another MLA class of the same shape is enabled with ``wrap_expand_kv(cls)``; an unwrapped
one gets an ``AttributeError`` that says so when it first treats the handle as a tensor.

Encoder-decoder models: ``PagedCache(config)`` of an encoder-decoder config builds a
``PagedEncoderDecoderCache`` (see ``transformers_encdec``).

Compiled decoding: ``PagedDecoder`` (see ``transformers_decode``), MLA models included.

Continuous batching (``model.generate_batch``, ``transformers serve --continuous-batching``) runs on
transformers' own paged cache, not on ``PagedCache``: ``continuous_batching_kernel()`` registers kvkernels
as a flash-attention kernel module and returns the attention implementation to load the model with
(see ``transformers_flash``).
"""

from __future__ import annotations

import contextlib

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvkernels.integrations.transformers_attention import PagedKV, dense_attention, paged_attention_forward
from kvkernels.integrations.transformers_cache import ATTENTION_NAME, PagedCache, Step
from kvkernels.integrations.transformers_compat import cache_kwargs
from kvkernels.integrations.transformers_decode import PagedDecoder
from kvkernels.integrations.transformers_encdec import PagedEncoderDecoderCache
from kvkernels.integrations.transformers_flash import continuous_batching_kernel
from kvkernels.integrations.transformers_mla import latent_attention, register_mla, wrap_expand_kv

__all__ = ["ATTENTION_NAME", "PagedCache", "PagedDecoder", "PagedEncoderDecoderCache", "PagedKV", "Step",
           "attention_implementation", "cache_kwargs", "continuous_batching_kernel", "dense_attention", "latent_attention",
           "paged_attention_forward", "register", "wrap_expand_kv"]


def register() -> str:
    """Register the attention function and its mask function (``sdpa_mask``) under ``"kvkernels"``
    in transformers' global interfaces, and let ``PagedKV`` handles through ``expand_kv`` of the MLA
    attention classes (``transformers_mla.MLA_ATTENTION_CLASSES``); returns the name. Idempotent."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    register_mla()
    return ATTENTION_NAME


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Run ``model`` with attention implementation ``name`` (e.g. ``"sdpa"`` for the stock cache, or
    ``"kvkernels"``) inside the block; the previous one is restored on exit."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
