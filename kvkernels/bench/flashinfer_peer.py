"""FlashInfer as a peer of the CUDA attention benchmark (kvkernels.bench.cuda_attention): its paged decode
and prefill wrappers over the *same* tensors kvkernels reads, the [blocks, 16, kv_heads, dim] K and V caches
(FlashInfer's "NHD" layout, passed as a (K, V) tuple, no copy) and the same shuffled block table (FlashInfer's
page indices and indptr), with the same bfloat16 queries and per-tensor fp8 scales.

FlashInfer is not a dependency of kvkernels: it is imported here when present. The GPU machine has no
registry, so ``scripts/flashinfer_bundle.sh`` prepares, on a development machine, a bundle of a pinned
FlashInfer with the kernel modules these cases use compiled ahead of time for sm_90a, and
``scripts/gpu_validate.sh`` puts it on the path (with ``FLASHINFER_DISABLE_JIT=1``: a module missing from the
bundle is a skipped row naming it, never minutes of compilation inside the GPU budget). Where FlashInfer
cannot be imported, every FlashInfer row is a skipped row with the reason.

Rows (``impl``):
- ``flashinfer-paged``: BatchDecodeWithPagedKVCacheWrapper with ``use_tensor_cores=True`` (FlashInfer's
  recommendation at GQA group sizes >= 4; it runs its prefill kernel for decode);
- ``flashinfer-paged-cuda-cores``: the same wrapper with its CUDA-core decode kernel;
- ``flashinfer-fa3-paged`` (prefill): BatchPrefillWithPagedKVCacheWrapper with ``backend="fa3"`` (the
  FlashAttention-3 template, sm_90a), causal, queries aligned to the end of the keys as ``paged_attention``
  does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's own examples allocate 128 MiB of float workspace
DECODE_IMPLS = {"flashinfer-paged": True, "flashinfer-paged-cuda-cores": False}  # impl -> use_tensor_cores
PREFILL_IMPL = "flashinfer-fa3-paged"


def import_error() -> Optional[str]:
    """None when FlashInfer imports; otherwise why not (what a skipped row says)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure to import makes the peer absent
        return f"FlashInfer not importable ({type(error).__name__}: {str(error).splitlines()[0][:200]}); " \
               f"scripts/flashinfer_bundle.sh prepares it for the GPU machine"
    return None


def version() -> str:
    import flashinfer
    return str(flashinfer.__version__)


class _PagedIndex:
    """FlashInfer's view of a benchmark's block table: page indices of each sequence in order (the shuffled
    table, flattened), indptr, and the entries used in each sequence's last page."""

    def __init__(self, block_tables: torch.Tensor, context: int, block: int):
        batch, per_seq = block_tables.shape
        dev = block_tables.device
        self.indices = block_tables.reshape(-1).to(torch.int32).contiguous()
        self.indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * per_seq
        self.last_page_len = torch.full((batch,), context - (per_seq - 1) * block, dtype=torch.int32, device=dev)


def _runner(wrapper, data) -> Callable[[int], torch.Tensor]:
    """call(i): the planned wrapper's run over rotated cache copy i % copies of ``data``, with its per-tensor
    fp8 scales (None for 16-bit caches)."""
    scale = None if data.scale is None else float(data.scale.item())
    copies = len(data.keys)

    def call(i: int) -> torch.Tensor:
        j = i % copies
        return wrapper.run(data.query, (data.keys[j], data.values[j]), k_scale=scale, v_scale=scale)

    return call


def _workspace() -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


def decode_call(data, tensor_cores: bool, heads: int, kv_heads: int, head_dim: int,
                block: int) -> Callable[[int], torch.Tensor]:
    """call(i): FlashInfer's batch decode of ``data.query`` over rotated cache copy i % copies of ``data``
    (kvkernels.bench.cuda_attention.Paged). Planned once, outside the timing, as a server plans once per step."""
    import flashinfer

    index = _PagedIndex(data.block_tables, data.context, block)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(index.indptr, index.indices, index.last_page_len, heads, kv_heads, head_dim, block,
                 q_data_type=data.query.dtype, kv_data_type=data.dtype)
    return _runner(wrapper, data)


def prefill_call(data, q_len: int, heads: int, kv_heads: int, head_dim: int,
                 block: int) -> Callable[[int], torch.Tensor]:
    """call(i): FlashInfer's FA3-template paged prefill (causal) of ``data.query`` ([q_len, heads, dim], the
    last q_len positions of one sequence) over rotated cache copy i % copies."""
    import flashinfer

    index = _PagedIndex(data.block_tables, data.context, block)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(), "NHD", backend="fa3")
    qo_indptr = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    wrapper.plan(qo_indptr, index.indptr, index.indices, index.last_page_len, heads, kv_heads, head_dim, block,
                 causal=True, q_data_type=data.query.dtype, kv_data_type=data.dtype)
    return _runner(wrapper, data)
