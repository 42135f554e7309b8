"""MLA models (DeepSeek-V2/V3, AXK1, GLM-4-MoE-Lite, Youtu, MiniCPM3, Mistral-4, LongCat-Flash: the
classes of ``MLA_ATTENTION_CLASSES``) on a ``PagedCache``: absorbed-weight attention straight over the
paged latent rows (see ``kvkernels.integrations.transformers`` for how a forward runs).

transformers' MLA attention calls ``past_key_values.update(kv_nope, k_rot, layer)`` with the latent
``[B, 1, q, kv_lora_rank]`` and the rotary key ``[B, 1, q, rope]``, then ``self.expand_kv(...)``,
which multiplies every cached latent by ``kv_b_proj`` into per-head K/V, then the attention function.
A ``PagedCache`` returns a ``PagedKV`` handle from ``update``; ``register()`` wraps ``expand_kv`` of
the MLA attention classes so that a handle passes through unexpanded (anything else still goes to
the original). The attention function then gets the handle and runs ``latent_attention``:

* the new rows ``[c ; k_pe]`` go into the ``MLAPagedCache`` with ``ops.concat_and_cache_mla``;
* ``q_nope`` is absorbed into latent space per head, ``q_lat = q_nope · W_UK(h)`` (``W_UK(h)``: rows
  ``[h*(dn+dv), h*(dn+dv)+dn)`` of ``kv_b_proj.weight``), since ``q_nope · (W_UK c) = (q_nope · W_UK) · c``;
* ``ops.mla_paged_attention([q_lat ; q_pe])`` attends the latent rows (causal varlen for a prefill,
  one query per row for a decode) and returns a latent ``[T, H, kv_lora_rank]`` per query;
* ``out = out_lat · W_UV(h)ᵀ`` (``W_UV(h)``: the next ``dv`` rows) gives ``[B, q, H, v_head_dim]``,
  the layout every attention function returns.

So per step ``kv_b_proj`` touches the new queries only, never the cached tokens, and the cache holds
``kv_lora_rank + rope`` values per token and layer.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch
from torch import Tensor

from kvkernels import ops
from kvkernels.integrations.transformers_attention import PagedKV

# transformers' MLA attention classes whose forward is update(latent, k_rot) -> expand_kv() -> attention
# function with query = cat(q_nope, q_rope), kv_b_proj laid out per head as [W_UK(h); W_UV(h)],
# scaling=module.scaling and nothing between update and the attention call that changes keys, masks or
# logits (checked against transformers 5.23; each has a tiny model in tests/hf_models.py MLA_MODELS).
# Glm4MoeLite and Youtu copy DeepseekV3's forward; what differs in the others happens before update()
# or after the attention call, on tensors the model computes itself: query LoRA always on (AXK1,
# LongCat-Flash), plain cos/sin RoPE (MiniCPM3), LoRA rescaling of q and the latent (LongCat-Flash, two
# attention sublayers per decoder layer with their own layer_idx), Mistral-4's position-dependent query
# scale (already in the query the attention function receives). Not listed, although they have expand_kv:
# DSA top-k indexers (DeepseekV32, GlmMoeDsa, Glm5NextText, AXK2, HYV4, MistralLarge4Text, Dots3NoteText),
# which also add sinks (HYV4), KV sharing / NoPE layers (MistralLarge4Text) or sliding MLA layers
# (Dots3NoteText); hybrids with linear-attention layers PagedCache does not hold (KimiLinear,
# BailingHybrid). Other classes of the listed shape can be passed to wrap_expand_kv.
MLA_ATTENTION_CLASSES = (
    ("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2Attention"),
    ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Attention"),
    ("transformers.models.axk1.modeling_axk1", "AXK1Attention"),
    ("transformers.models.glm4_moe_lite.modeling_glm4_moe_lite", "Glm4MoeLiteAttention"),
    ("transformers.models.youtu.modeling_youtu", "YoutuAttention"),
    ("transformers.models.minicpm3.modeling_minicpm3", "MiniCPM3Attention"),
    ("transformers.models.mistral4.modeling_mistral4", "Mistral4Attention"),
    ("transformers.models.longcat_flash.modeling_longcat_flash", "LongcatFlashMLA"),
)


def wrap_expand_kv(cls) -> None:
    """Make ``cls.expand_kv`` hand a ``PagedKV`` handle back unexpanded (the latents stay in the
    paged cache; ``latent_attention`` absorbs ``kv_b_proj`` into the query instead). Tensors still
    go to the original ``expand_kv``, so a model without a ``PagedCache`` runs as before.
    Idempotent."""
    original = getattr(cls, "expand_kv", None)
    if original is None:
        raise TypeError(f"kvkernels: {cls.__name__} has no expand_kv method to wrap")
    if getattr(original, "__kvkernels_original__", None) is not None:
        return

    @functools.wraps(original)
    def expand_kv(self, kv_nope, k_rot):
        if isinstance(kv_nope, PagedKV):
            return kv_nope, k_rot
        return original(self, kv_nope, k_rot)

    expand_kv.__kvkernels_original__ = original
    cls.expand_kv = expand_kv


def register_mla() -> None:
    """``wrap_expand_kv`` on every class of ``MLA_ATTENTION_CLASSES`` this transformers has."""
    for module_name, class_name in MLA_ATTENTION_CLASSES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # an older or newer transformers without that model
            continue
        wrap_expand_kv(cls)


def _absorption_weights(module, heads: int, rank: int) -> tuple[Tensor, Tensor, int, int]:
    """``(W_UK [H, dn, R], W_UV [H, dv, R], dn, dv)``: views of ``module.kv_b_proj.weight``."""
    missing = [a for a in ("kv_b_proj", "qk_nope_head_dim", "v_head_dim") if not hasattr(module, a)]
    if missing:
        raise TypeError(f"kvkernels PagedCache: MLA attention module {type(module).__name__} lacks "
                        f"{', '.join(missing)} (needed to absorb kv_b_proj)")
    dn, dv = int(module.qk_nope_head_dim), int(module.v_head_dim)
    weight = module.kv_b_proj.weight
    if tuple(weight.shape) != (heads * (dn + dv), rank):
        raise ValueError(f"kvkernels PagedCache: kv_b_proj.weight: expected [{heads} * ({dn} + {dv}), {rank}] "
                         f"for {heads} heads and kv_lora_rank {rank}, got {list(weight.shape)}")
    w = weight.view(heads, dn + dv, rank)
    return w[:, :dn], w[:, dn:], dn, dv


def latent_attention(store, module, query: Tensor, handle: PagedKV, step, scale: Optional[float]) -> Tensor:
    """Write the layer's new latent rows and attend with absorbed weights (see module docs).

    ``store``: the ``MLAPagedCache``; ``query [B, H, q, dn + rope]``; ``step``: the forward's ``Step``.
    Returns ``[B, q, H, v_head_dim]`` in ``query``'s dtype; padding queries come back as zero rows.
    """
    layer = handle.layer_idx
    cache = store.latent_cache(layer)
    rank, rope = store.kv_lora_rank, store.rope_dim
    batch, heads, q, qdim = query.shape
    w_uk, w_uv, dn, dv = _absorption_weights(module, heads, rank)
    if qdim != dn + rope:
        raise ValueError(f"kvkernels PagedCache: query: expected head dim qk_nope_head_dim + rope = {dn + rope}, "
                         f"got {qdim}")
    if scale is None:
        scale = getattr(module, "scaling", None)
    if scale is None:
        raise ValueError("kvkernels PagedCache: MLA attention needs scaling (the model passes module.scaling)")
    if handle.key is not None:  # every row of the forward (``query`` may hold only the distinct ones)
        latent = handle.key.reshape(-1, rank).to(store.dtype)  # [B, 1, q, R]: one "head"
        k_pe = handle.value.reshape(-1, rope).to(store.dtype)
        ops.concat_and_cache_mla(latent, k_pe, cache, step.slot_mapping)
        handle.key = handle.value = None
    qry = query.transpose(1, 2).reshape(batch * q, heads, qdim)
    if step.real_index is not None:
        qry = qry.index_select(0, step.real_index)
    q_nope, q_pe = qry.split([dn, rope], dim=-1)
    # Per head: [H, T, dn] @ [H, dn, R]; in the weight's dtype, as the model's kv_b_proj would run.
    q_lat = torch.matmul(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1)
    q_abs = torch.cat([q_lat.to(store.dtype), q_pe.to(store.dtype)], dim=-1)
    out, _ = ops.mla_paged_attention(q_abs, cache, step.block_tables, step.seq_lens, kv_lora_rank=rank,
                                     scale=float(scale), query_start_loc=step.query_start_loc)
    # Per head: [H, T, R] @ [H, R, dv] -> [T, H, dv]
    out = torch.matmul(out.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2)).transpose(0, 1)
    if step.real_index is not None:
        full = out.new_zeros((batch * q, heads, dv))
        out = full.index_copy_(0, step.real_index, out)
    return out.reshape(batch, q, heads, dv).to(query.dtype)
