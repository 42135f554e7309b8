"""Typed wrappers and fake (meta) kernels of every ``torch.ops.kvkernels`` op.

Each wrapper calls the registered op, so it works on every backend the op has a kernel for and
inside ``torch.compile``. Each op also has a fake kernel (``register_fake``) that computes output
shapes and dtypes without data, which is what ``torch.compile`` and ``opcheck`` trace through.
Semantics, layouts and error rules: ``docs/ops.md``. All ops are inference-only (no autograd).
``kvkernels.reference`` holds a plain-PyTorch twin of each function with the same signature.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kvkernels.reference import check_bool_arg

_ops = torch.ops.kvkernels
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                      slot_mapping: Tensor, *, k_scale: Optional[Tensor] = None,
                      v_scale: Optional[Tensor] = None) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` at ``slot_mapping`` (int64; slot =
    block * block_size + offset; negative = skip). The value's head dim may differ from the key's
    (each matches its own cache). fp8 caches quantize with ``k_scale``/``v_scale`` (float32, 1 or
    num_kv_heads elements)."""
    _ops.reshape_and_cache.default(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                   v_scale)


def _out_call(op: str, out: Optional[Tensor], lse: Optional[Tensor]) -> bool:
    """Whether a wrapper call passes caller-provided outputs (then the *_out op runs)."""
    if out is None and lse is not None:
        raise RuntimeError(f"kvkernels.{op}: lse: given without out (pass out= too, or neither)")
    return out is not None


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, query_start_loc: Optional[Tensor] = None, *,
                    scale: Optional[float] = None, window_left: int = -1, soft_cap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                    k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
                    causal: bool = True, out: Optional[Tensor] = None,
                    lse: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over each sequence's paged
    keys/values. ``query_start_loc=None``: decode, one query per sequence; else int32
    ``[num_seqs + 1]`` cumulative query counts (chunked prefill, bottom-right causal; a sequence
    may have more queries than keys, its leading rows then see none). ``causal=False``: every
    query of a sequence sees all of its keys (encoder self-attention, cross-attention).
    ``value_cache`` may have its own head dim ``head_dim_v`` (e.g. qk 192 / v 128).
    Returns ``(out [num_tokens, num_heads, head_dim_v] in the query dtype, lse float32
    [num_tokens, num_heads])``. Options: GQA/MQA, ``window_left``, ``soft_cap``, ALiBi, sinks,
    fp8 caches with scales. Logit order: ``scale * <q, k>``, then the soft cap, then ALiBi
    (FlashInfer adds ALiBi before the cap; docs/ops.md, "Conventions").

    ``out=`` / ``lse=``: write into these tensors instead of allocating (``paged_attention_out``):
    exactly the shapes and dtypes above, on the query's device, any strides (non-contiguous ones
    through a temporary), sharing no memory with an input or each other; errors, not resizes.
    Returns ``(out, lse)``, the given tensors; ``out=`` without ``lse=`` returns ``(out, None)``
    and allocates no lse on the CPU."""
    check_bool_arg("paged_attention", "causal", causal)
    if _out_call("paged_attention", out, lse):
        _ops.paged_attention_out.default(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale, window_left, soft_cap,
                                         alibi_slopes, sinks, k_scale, v_scale, causal, out=out,
                                         lse=lse)
        return out, lse
    return _ops.paged_attention.default(query, key_cache, value_cache, block_tables, seq_lens,
                                        query_start_loc, scale, window_left, soft_cap,
                                        alibi_slopes, sinks, k_scale, v_scale, causal)


def merge_attention_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *,
                           out: Optional[Tensor] = None,
                           lse: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Exact merge of attention over two disjoint key sets: ``lse = logaddexp(lse_a, lse_b)``,
    ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``. A side whose lse is -inf or +inf
    (FlashAttention-2's mark) saw no key and is not read; a NaN lse gives a NaN row (docs/ops.md).
    ``out=`` / ``lse=`` as in ``paged_attention`` (``merge_attention_states_out``); ``out`` may
    not be ``out_a`` or ``out_b`` (no in-place merge)."""
    if _out_call("merge_attention_states", out, lse):
        _ops.merge_attention_states_out.default(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
        return out, lse
    return _ops.merge_attention_states.default(out_a, lse_a, out_b, lse_b)


def copy_blocks(cache: Tensor, block_mapping: Tensor, *, block_dim: int = 0) -> None:
    """For each row ``(src, dst)`` of int64 ``block_mapping [n, 2]`` copy
    ``cache.select(block_dim, src)`` to ``cache.select(block_dim, dst)`` — every layer of a
    stacked cache in one call. Destinations are distinct and never sources.

    ``block_dim`` is the dimension that indexes blocks: 0 (the default) for one layer's
    ``[num_blocks, block_size, H, D]`` cache, **2 for a stacked ``[layers, 2, num_blocks, ...]``
    allocation** such as ``PagedKVCache.kv`` (1 for ``MLAPagedCache.kv``). On a stacked tensor the
    default indexes layers, so ``copy_blocks(kv, mapping)`` with ids below the number of layers
    copies whole layers."""
    _ops.copy_blocks.default(cache, block_mapping, block_dim)


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor, *, block_dim: int = 0) -> None:
    """Copy blocks ``src.select(block_dim, i)`` to ``dst.select(block_dim, j)`` for each row
    ``(i, j)`` of ``block_mapping`` (CPU or ``src``'s device), e.g. GPU <-> pinned CPU offload.
    ``block_dim`` as in ``copy_blocks``: 2 for stacked ``[layers, 2, num_blocks, ...]`` tensors."""
    _ops.swap_blocks.default(src, dst, block_mapping, block_dim)


def gather_kv(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
              k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
              num_tokens: Optional[int] = None,
              out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """Paged -> contiguous ``[sum(seq_lens), num_kv_heads, head_dim]`` keys and values (each the
    head dim of its own cache), sequences in order. fp8 caches are dequantized to ``out_dtype`` (default bfloat16). Passing
    ``num_tokens`` (= sum of seq_lens) spares a device sync and a dynamic shape."""
    return _ops.gather_kv.default(key_cache, value_cache, block_tables, seq_lens, k_scale,
                                  v_scale, num_tokens, out_dtype)


def concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor, *,
                         scale: Optional[Tensor] = None) -> None:
    """Write the MLA latent ``kv_c [num_tokens, kv_lora_rank]`` and rotary key
    ``k_pe [num_tokens, rope_dim]`` as one row into ``kv_cache [num_blocks, block_size,
    kv_lora_rank + rope_dim]`` (fp8 caches: per-tensor ``scale``)."""
    _ops.concat_and_cache_mla.default(kv_c, k_pe, kv_cache, slot_mapping, scale)


def mla_decompress(kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, w_kv_b: Tensor, *,
                   kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int,
                   norm_weight: Optional[Tensor] = None, norm_eps: float = 1e-6,
                   scale: Optional[Tensor] = None,
                   num_tokens: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Rebuild per-head keys ``[T, num_heads, qk_nope_head_dim + rope_dim]`` and values
    ``[T, num_heads, v_head_dim]`` from the latent cache: optional RMSNorm of the latent, then
    ``w_kv_b`` (DeepSeek's ``kv_b_proj.weight`` layout); the rotary key is shared by all heads."""
    return _ops.mla_decompress.default(kv_cache, block_tables, seq_lens, w_kv_b, kv_lora_rank,
                                       qk_nope_head_dim, v_head_dim, norm_weight, norm_eps, scale,
                                       num_tokens)


def mla_paged_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                        kv_lora_rank: int, scale: float, query_start_loc: Optional[Tensor] = None,
                        kv_scale: Optional[Tensor] = None, out: Optional[Tensor] = None,
                        lse: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Absorbed-weight MLA attention: ``q [T, num_heads, kv_lora_rank + rope_dim]`` (q_nope
    already multiplied by W_UK) attends the latent rows directly. Returns
    ``(out [T, num_heads, kv_lora_rank], lse float32 [T, num_heads])``; the caller applies W_UV.
    ``out=`` / ``lse=`` as in ``paged_attention`` (``mla_paged_attention_out``)."""
    if _out_call("mla_paged_attention", out, lse):
        _ops.mla_paged_attention_out.default(q, kv_cache, block_tables, seq_lens, kv_lora_rank,
                                             scale, query_start_loc, kv_scale, out=out, lse=lse)
        return out, lse
    return _ops.mla_paged_attention.default(q, kv_cache, block_tables, seq_lens, kv_lora_rank,
                                            scale, query_start_loc, kv_scale)


# ---- fake kernels: shapes and dtypes only ---------------------------------------------------


def _num_tokens(num_tokens):
    # Without num_tokens the output length is data-dependent (sum of seq_lens).
    if num_tokens is not None:
        return num_tokens
    return torch.library.get_ctx().new_dynamic_size()


@torch.library.register_fake("kvkernels::reshape_and_cache")
def _(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    torch._check(key.dim() == 3 and value.dim() == 3 and key.shape[:2] == value.shape[:2],
                 lambda: "kvkernels.reshape_and_cache: value: key/value must be [T, H, D] with the "
                         "same T and H")
    torch._check(slot_mapping.shape[0] == key.shape[0],
                 lambda: "kvkernels.reshape_and_cache: slot_mapping: one slot per token")


@torch.library.register_fake("kvkernels::paged_attention")
def _(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, scale=None,
      window_left=-1, soft_cap=0.0, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None,
      causal=True):
    check_bool_arg("paged_attention", "causal", causal)  # `bool?` in the schema: None refused, not False
    torch._check(query.dim() == 3, lambda: "kvkernels.paged_attention: query: expected 3 dims")
    torch._check(query.shape[2] == key_cache.shape[3],
                 lambda: "kvkernels.paged_attention: query: head_dim differs from key_cache's")
    torch._check(key_cache.shape[2] > 0,
                 lambda: "kvkernels.paged_attention: key_cache: num_kv_heads must be positive")
    t, h, _ = query.shape
    # out takes the value's head dim, which may differ from the key's.
    return (query.new_empty((t, h, value_cache.shape[3])),
            query.new_empty((t, h), dtype=torch.float32))


@torch.library.register_fake("kvkernels::merge_attention_states")
def _(out_a, lse_a, out_b, lse_b):
    torch._check(out_a.shape == out_b.shape,
                 lambda: "kvkernels.merge_attention_states: out_b: shape differs from out_a's")
    t, h, d = out_a.shape
    return out_a.new_empty((t, h, d)), out_a.new_empty((t, h), dtype=torch.float32)


@torch.library.register_fake("kvkernels::copy_blocks")
def _(cache, block_mapping, block_dim=0):
    return None


@torch.library.register_fake("kvkernels::swap_blocks")
def _(src, dst, block_mapping, block_dim=0):
    return None


@torch.library.register_fake("kvkernels::gather_kv")
def _(key_cache, value_cache, block_tables, seq_lens, k_scale=None, v_scale=None,
      num_tokens=None, out_dtype=None):
    if out_dtype is None:
        out_dtype = torch.bfloat16 if key_cache.dtype in _FP8 else key_cache.dtype
    t = _num_tokens(num_tokens)
    return (key_cache.new_empty((t, key_cache.shape[2], key_cache.shape[3]), dtype=out_dtype),
            key_cache.new_empty((t, key_cache.shape[2], value_cache.shape[3]), dtype=out_dtype))


@torch.library.register_fake("kvkernels::concat_and_cache_mla")
def _(kv_c, k_pe, kv_cache, slot_mapping, scale=None):
    return None


@torch.library.register_fake("kvkernels::mla_decompress")
def _(kv_cache, block_tables, seq_lens, w_kv_b, kv_lora_rank, qk_nope_head_dim, v_head_dim,
      norm_weight=None, norm_eps=1e-6, scale=None, num_tokens=None):
    torch._check(qk_nope_head_dim > 0 and v_head_dim > 0,
                 lambda: "kvkernels.mla_decompress: qk_nope_head_dim: it and v_head_dim must be positive")
    per_head = qk_nope_head_dim + v_head_dim
    torch._check(w_kv_b.shape[0] % per_head == 0,
                 lambda: "kvkernels.mla_decompress: w_kv_b: rows not a multiple of num_heads")
    heads = w_kv_b.shape[0] // per_head
    rope = kv_cache.shape[2] - kv_lora_rank
    t = _num_tokens(num_tokens)
    return (w_kv_b.new_empty((t, heads, qk_nope_head_dim + rope)),
            w_kv_b.new_empty((t, heads, v_head_dim)))


@torch.library.register_fake("kvkernels::mla_paged_attention")
def _(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, query_start_loc=None,
      kv_scale=None):
    t, h, _ = q.shape
    return q.new_empty((t, h, kv_lora_rank)), q.new_empty((t, h), dtype=torch.float32)


# The *_out ops write the caller's tensors and return (); their fakes check what the kernels check
# first (shapes, dtypes), so a traced call with a wrong out fails at trace time as it would eagerly.


def _check_given(op, like_arg, like, out, lse, shape):
    # One torch._check per size: with symbolic sizes each becomes a runtime assert, not a guard.
    for name, t, want, want_dtype in (("out", out, tuple(shape), like.dtype),
                                      ("lse", lse, tuple(shape[:2]), torch.float32)):
        if t is None:
            continue
        torch._check(t.device == like.device, lambda: f"kvkernels.{op}: {name}: must be on the device of {like_arg}")
        torch._check(t.dtype == want_dtype, lambda: f"kvkernels.{op}: {name}: dtype {t.dtype} must be {want_dtype}")
        torch._check(t.dim() == len(want), lambda: f"kvkernels.{op}: {name}: shape {tuple(t.shape)} must be {want} "
                                                   "(outputs are not resized)")
        for have, size in zip(t.shape, want):
            torch._check(have == size, lambda: f"kvkernels.{op}: {name}: shape {tuple(t.shape)} must be "
                                               f"{want} (outputs are not resized)")


@torch.library.register_fake("kvkernels::paged_attention_out")
def _(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, scale=None,
      window_left=-1, soft_cap=0.0, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None,
      causal=True, *, out, lse=None):
    check_bool_arg("paged_attention", "causal", causal)
    t, h, _ = query.shape
    _check_given("paged_attention", "query", query, out, lse, (t, h, value_cache.shape[3]))


@torch.library.register_fake("kvkernels::merge_attention_states_out")
def _(out_a, lse_a, out_b, lse_b, *, out, lse=None):
    _check_given("merge_attention_states", "out_a", out_a, out, lse, out_a.shape)


@torch.library.register_fake("kvkernels::mla_paged_attention_out")
def _(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, query_start_loc=None,
      kv_scale=None, *, out, lse=None):
    t, h, _ = q.shape
    _check_given("mla_paged_attention", "q", q, out, lse, (t, h, kv_lora_rank))
