"""``MLAPagedCache``: the paged cache of multi-head latent attention (DeepSeek-V2/V3 style).

Per token and layer only the compressed latent (``kv_lora_rank`` values; before the latent's
RMSNorm in the usual compressed-cache layout, which ``mla_decompress`` can apply, after it as transformers' DeepSeek
models hand it to ``PagedCache``) and the rotary key (``rope_dim`` values) are stored, as one row of
``kv_lora_rank + rope_dim`` values: 576 for DeepSeek-V2/V3, against ``2 * heads * head_dim`` for a
standard K/V cache. The rows are the layout of ``ops.concat_and_cache_mla`` (writes),
``ops.mla_paged_attention`` (the absorbed decode, straight over the latent rows) and
``ops.mla_decompress`` (K/V rebuilt through ``kv_b_proj``).

Everything about sequences is ``PagedKVCache``'s: the block pool, prefix caching, forks with
copy-on-write, batched decode steps, offload, thread safety, and the block-sparse policies (seed
003's mode is ``KeepRecentRatio(threshold_tokens=8192, keep_ratio=0.5)``: recent blocks first).
Only the storage differs: ``[num_layers, num_blocks, block_size, kv_lora_rank + rope_dim]``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from kvkernels import memory
from kvkernels.cache.paged import PagedKVCache
from kvkernels.cache.tokens import check_count


class MLAPagedCache(PagedKVCache):
    """Latent rows of ``num_layers`` layers with refcounted block sharing.

    ``latent_cache(layer)`` is the ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` view the
    MLA ops take. Other arguments as ``PagedKVCache`` (``block_size`` defaults to 64, FlashMLA's).
    """

    _block_dim = 1

    def __init__(self, num_layers: int, kv_lora_rank: int, rope_dim: int, num_blocks: int,
                 block_size: int = 64, dtype: torch.dtype = torch.bfloat16,
                 device: Union[str, torch.device] = "cpu", enable_prefix_caching: bool = True,
                 **kwargs) -> None:
        self.kv_lora_rank = check_count("MLAPagedCache: kv_lora_rank", kv_lora_rank, 1)
        self.rope_dim = check_count("MLAPagedCache: rope_dim", rope_dim, 0)
        super().__init__(num_layers, 1, kv_lora_rank + rope_dim, num_blocks, block_size, dtype, device,
                         enable_prefix_caching, **kwargs)

    def _allocate_storage(self) -> torch.Tensor:
        return memory.empty((self.num_layers, self.num_blocks, self.block_size, self.head_dim),
                            self.dtype, self.device)

    def latent_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s latent rows, ``[num_blocks, block_size, kv_lora_rank + rope_dim]``."""
        return self.kv[self._layer(layer)]

    def key_cache(self, layer: int) -> torch.Tensor:
        raise TypeError("kvkernels.MLAPagedCache stores latent rows, not keys: use latent_cache(layer)")

    def value_cache(self, layer: int) -> torch.Tensor:
        raise TypeError("kvkernels.MLAPagedCache stores latent rows, not values: use latent_cache(layer)")

    # ---- alternative names (other compressed MLA caches use them) --------------------------------

    def memory_usage_mb(self, seq: Optional[int] = None) -> float:
        """Latent bytes in use, in MiB: of ``seq`` (its tokens, shared ones included), or of the
        whole cache (token slots holding live tokens, each shared block once)."""
        usage = self.memory_usage(seq)
        if seq is not None:
            return (usage["own_bytes"] + usage["shared_bytes"]) / 2**20
        return usage["stored_bytes"] / 2**20

    def block_sparse_stats(self, seq: int) -> dict:
        """``sparse_stats`` as ``get_block_sparse_stats()``, for one sequence (see ``sparse_stats``)."""
        return self.sparse_stats(seq)

    get_block_sparse_stats = block_sparse_stats

    def standard_bytes_per_token(self, num_heads: int, qk_head_dim: int, v_head_dim: int) -> int:
        """What a standard K/V cache of the same model stores per token (all layers), for comparison:
        ``num_heads * (qk_head_dim + v_head_dim)`` values per layer."""
        return self.num_layers * num_heads * (qk_head_dim + v_head_dim) * self.kv.element_size()
