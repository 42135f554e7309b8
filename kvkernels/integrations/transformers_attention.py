"""The attention function registered as ``"kvkernels"`` (see ``kvkernels.integrations.transformers``).

A model's attention module calls ``k, v = past_key_values.update(k, v, layer_idx)`` and passes ``k``,
``v`` unchanged to the registered attention function. A ``PagedCache`` returns a ``PagedKV`` handle
in place of both tensors: it carries the cache, the layer and the new tokens' K/V, which the
attention function writes into the paged storage (``ops.reshape_and_cache``) before it attends with
``ops.paged_attention`` (MLA models: ``ops.concat_and_cache_mla`` and ``ops.mla_paged_attention``,
see ``transformers_mla``). Anything else (no cache, a stock cache, an encoder) runs dense
attention: ``transformers``' SDPA function, or a plain-PyTorch twin when the module needs a soft cap
or attention sinks (which SDPA has no argument for).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward


class PagedKV:
    """What ``PagedCache.update`` returns in place of the key and the value tensor.

    ``cache`` is the cache object that owns the layer's paged storage (it implements ``attend``),
    ``layer_idx`` the layer, ``key`` / ``value`` the new tokens' states ``[batch, kv_heads, q, head_dim]``
    still to be written (``None`` for a cross-attention layer read back on a later step).
    """

    __slots__ = ("cache", "layer_idx", "key", "value")

    def __init__(self, cache: Any, layer_idx: int, key: Optional[Tensor], value: Optional[Tensor]) -> None:
        self.cache, self.layer_idx, self.key, self.value = cache, layer_idx, key, value

    def __repr__(self) -> str:
        return f"PagedKV(layer={self.layer_idx}, cache={type(self.cache).__name__})"

    def __getattr__(self, name: str):
        # Only reached for attributes a handle lacks: model code treated it as a tensor (.shape ...),
        # typically an MLA attention class whose expand_kv was not wrapped. Say so instead of a bare
        # AttributeError deep in the model.
        raise AttributeError(f"kvkernels: a PagedKV handle (what PagedCache.update returns) has no attribute "
                             f"{name!r}: the model used it as a tensor. MLA attention classes must let it through "
                             f"expand_kv: register() wraps those of transformers_mla.MLA_ATTENTION_CLASSES; call "
                             f"kvkernels.integrations.transformers.wrap_expand_kv(cls) for another class of "
                             f"that shape")


def window_left(sliding_window: Optional[int]) -> int:
    """transformers' ``sliding_window=W`` (a query sees W keys, itself included) is ``W - 1`` here."""
    return int(sliding_window) - 1 if sliding_window else -1


def paged_attention_forward(module: torch.nn.Module, query: Tensor, key, value, attention_mask: Optional[Tensor],
                            dropout: float = 0.0, scaling: Optional[float] = None,
                            sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                            s_aux: Optional[Tensor] = None, **kwargs) -> tuple[Tensor, None]:
    """The ``"kvkernels"`` attention function: ``query [B, Hq, q, D]`` -> ``(out [B, q, Hq, Dv], None)``.

    ``sliding_window`` (Mistral, Qwen2, Gemma2, GPT-OSS pass it) becomes ``window_left``, ``softcap``
    (Gemma2) ``soft_cap``, ``s_aux`` (GPT-OSS sinks) ``sinks``, ``scaling`` ``scale``. Inference only:
    ``dropout`` must be 0 on the paged path.
    """
    if isinstance(key, PagedKV):
        if dropout:
            raise ValueError("kvkernels attention: the paged path is inference-only (dropout must be 0)")
        if sliding_window is None:
            sliding_window = getattr(module, "sliding_window", None)
        return key.cache.attend(module, query, key, attention_mask, scale=scaling,
                                window_left=window_left(sliding_window), soft_cap=float(softcap or 0.0),
                                sinks=s_aux), None
    if softcap or s_aux is not None:
        return dense_attention(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap,
                               sinks=s_aux, dropout=dropout), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def dense_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Optional[Tensor], *, scaling: Optional[float], softcap: Optional[float],
                    sinks: Optional[Tensor], dropout: float = 0.0) -> Tensor:
    """Plain-PyTorch attention with soft cap and sinks, for the calls that do not hold a ``PagedKV``
    (no cache, a stock cache). Mask: bool (True = attend) or additive; ``None`` means causal,
    aligned bottom-right, when the module is causal."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    q_len, kv_len = logits.shape[-2:]
    if attention_mask is None and q_len > 1 and getattr(module, "is_causal", True):
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # finite: a fully masked (padding) row must not be NaN
            logits = logits.masked_fill(~attention_mask, torch.finfo(logits.dtype).min)
        else:
            logits = logits + attention_mask
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).to(logits.dtype).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2).contiguous()


def new_token_mask(attention_mask, batch: int, q_len: int) -> Optional[np.ndarray]:
    """Which of this forward's ``q_len`` new tokens are real (not padding), ``bool [batch, q_len]``,
    or ``None`` when all are.

    ``attention_mask`` is what the registered mask function (transformers' ``sdpa_mask``) built:
    ``None`` (pure causal: no padding) or ``[batch | 1, 1 | heads, q_len, kv_len]`` with True (or 0
    in an additive mask) where a query may attend. The new tokens are the last ``q_len`` key
    columns, and a token is real exactly when it may attend itself: causality and every sliding
    window keep the diagonal, padding removes it. A 2-D padding mask ``[batch, kv_len]`` is read
    directly.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"kvkernels attention: expected a tensor attention mask (the 'kvkernels' mask "
                        f"function is sdpa_mask), got {type(attention_mask).__name__}")
    mask = attention_mask
    kv_len = mask.shape[-1]
    if mask.dim() == 2:  # a padding mask: 1 / True = real
        diag = mask[:, kv_len - q_len:].bool()
    else:
        if mask.dim() == 4:
            mask = mask[:, 0]
        idx = torch.arange(q_len, device=mask.device)
        diag = mask[:, idx, kv_len - q_len + idx]
        if diag.dtype != torch.bool:  # additive: 0 = attend, a large negative value = masked
            diag = diag == 0
    real = diag.expand(batch, q_len).cpu().numpy()
    return None if real.all() else real
