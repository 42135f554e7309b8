"""kvkernels behind transformers' flash-attention interface: continuous batching and ``transformers serve``.

transformers' continuous batching (``model.generate_batch``, ``init_continuous_batching``, and
``transformers serve --continuous-batching``) accepts only three kinds of attention implementation:
``"paged|eager"``, ``"sdpa"``, or a name containing ``"flash"`` (``switch_to_cb_friendly_attn``). A
flash name is resolved by ``transformers.modeling_flash_attention_utils.lazy_import_flash_attention``:
the ``flash_attn`` packages for ``flash_attention_2/3/4``, and for a Hub-style ``"org/name"`` a kernel
module loaded by ``transformers.integrations.hub_kernels.load_and_register_attn_kernel`` with the
``kernels`` package. A kernel module provides ``flash_attn_varlen_func`` (and optionally
``flash_attn_func`` and ``flash_attn_with_kvcache``) with FlashAttention-2's call signatures, and
transformers' own flash wrapper (``integrations.flash_attention.flash_attention_forward``) calls them.

This module is such a kernel module, on ``ops.paged_attention`` / ``ops.reshape_and_cache``:

- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)``: packed queries and packed
  keys/values (``[total, heads, head_dim]``, sequence i at rows ``cu_seqlens[i]:cu_seqlens[i + 1]``).
  The packed K/V are handed to ``paged_attention`` as they are, as a cache of block size 1
  (``k.unsqueeze(1)``: token t is block t) with a block table of token indices (row i =
  ``cu_seqlens_k[i] + arange(max_seqlen_k)``): no copy. This is what continuous batching calls on the
  CPU (and on CUDA for prefill and mixed batches): transformers writes the new K/V into its paged cache
  and gathers each sequence's K/V with ``index_copy_`` / ``index_select`` before the call.
- ``flash_attn_func(q, k, v, ...)``: dense ``[batch, seq, heads, head_dim]`` tensors (``generate()``
  with a stock cache, ``transformers serve`` without continuous batching): ``k`` is a cache of
  ``batch`` blocks of ``seq`` tokens (block b = row b), again without a copy.
- ``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=, block_table=, ...)``: the
  decode fast path, which transformers takes only on CUDA (and XPU) and only for names matching
  ``.*flash.*[23]``: the new K/V are written into transformers' own paged cache with
  ``ops.reshape_and_cache`` and the queries attend it in place with ``ops.paged_attention`` (no
  gather). transformers' page views of one layer overlap: its cache interleaves pages as
  ``K0 V0 K1 V1 ...`` per block and hands out ``k_cache`` / ``v_cache`` as two views of the same
  pages shifted by one page (V page j is K page j + 1), with block-table entries that are always
  even. ``reshape_and_cache`` rightly refuses to write through overlapping views; here the write and
  the read use ``k_cache[0::2]`` / ``v_cache[0::2]`` (the same memory as the pages the table reaches,
  now provably disjoint) and the table halved. Rows with ``cache_seqlens < 0`` (transformers' padding
  rows when it pads the batch for CUDA graphs) write nothing and return zeros.

The kernel name is ``KERNEL_NAME`` = ``"kvkernels/flash-attn2-api"``: a Hub-style name, so that
``transformers serve`` accepts it (its ``--attn-implementation`` takes ``flash_attention_*``, ``sdpa``,
``eager`` or a Hub kernel), containing ``flash`` so that continuous batching accepts it, and ending in
``2`` because the module implements FlashAttention-2's API (``block_table`` / ``cache_seqlens``
keywords), which is what transformers keys its block-table decode path on.

How transformers finds it. The ``kernels`` package would load a kernel from a local directory
(``LOCAL_KERNELS=repo=path``), but transformers 5.23 and 5.24 accept only ``kernels>=0.18.2,<0.19``,
and no such release is on PyPI (the newest is 0.17.2), so on those versions a Hub-style name cannot
be loaded through ``kernels`` at all (5.20-5.22 want ``kernels`` 0.17.2 and 5.16 0.16.x, each with its own
local-kernel layout; the resolver below serves the name the same way on all of them). ``register_flash_kernel()`` therefore puts a resolver in front of
``hub_kernels.load_and_register_attn_kernel`` (which ``lazy_import_flash_attention`` looks up on its
module at each load): for ``KERNEL_NAME`` it registers transformers' own flash wrapper and flash mask
function under the name, as that loader does for a kernel it fetched, and returns this module; every
other name goes to the original loader unchanged. Nothing is downloaded and ``kernels`` is not needed.
transformers has no public registry for flash kernel modules; this loader is the single function between
an attention name and its module, so the resolver wraps it rather than patching the lazy-import cache or
the continuous-batching checks. Installing it is checked (``KernelHookError`` if transformers no longer
resolves the name through it).

Use (``continuous_batching_kernel()`` registers and returns the name; call it before loading a model)::

    from kvkernels.integrations.transformers import continuous_batching_kernel
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=continuous_batching_kernel())
    outputs = model.generate_batch(prompts, generation_config=config)   # continuous batching

and ``python -m kvkernels transformers serve MODEL --continuous-batching --attn-implementation
kvkernels/flash-attn2-api`` runs transformers' CLI (``transformers serve``, any of its commands) with
the kernel registered (``cli_main``).

``KVKERNELS_FLASH_CALL_LOG=DIR``: each process appends one line per call of the three functions to
``DIR/calls-<pid>.txt`` (``<function> <sequences> <query rows>``), so a test or a user can see that the
kernel ran inside a server process. Off (one environment look-up per call) when unset.

Supported options (what transformers passes): ``softmax_scale``, ``causal`` (bottom-right aligned
when query and key lengths differ, as FlashAttention >= 2.1), ``window_size=(left, right)`` (the left
bound; with ``causal=False`` only ``right = -1``), ``softcap``, ``s_aux`` (attention sinks), any float
dtype the ops take (float32 included). ``dropout_p`` must be 0 (inference only). Head dims: multiples
of 8, at most 512 on the CPU (256 on CUDA), as ``paged_attention``.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from kvkernels import ops

KERNEL_NAME = "kvkernels/flash-attn2-api"

__all__ = ["KERNEL_NAME", "KernelHookError", "cli_main", "continuous_batching_kernel", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache", "register_flash_kernel"]


class KernelHookError(RuntimeError):
    """The installed transformers does not resolve attention names the way ``register_flash_kernel``
    relies on (``hub_kernels.load_and_register_attn_kernel`` looked up by ``lazy_import_flash_attention``)."""


# ---- option conversion ------------------------------------------------------------------------------


def _window_left(window_size: Optional[Sequence[int]], causal: bool, where: str) -> int:
    """FlashAttention's ``window_size=(left, right)`` (-1: unbounded) as ``paged_attention``'s ``window_left``.
    With ``causal`` the right bound is implied (0); without it only an unbounded right side exists here."""
    if window_size is None:
        return -1
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"kvkernels {where}: window_size must be a pair (left, right), got {window_size!r}") from None
    if not causal and right >= 0:
        raise ValueError(f"kvkernels {where}: window_size={tuple(window_size)} with causal=False bounds keys on the "
                         f"right; paged_attention keeps only a left bound (use right = -1)")
    return left if left >= 0 else -1


def _options(where: str, dropout_p: float, softmax_scale: Optional[float], causal: bool,
             window_size, softcap: Optional[float], s_aux: Optional[Tensor]) -> dict:
    if dropout_p:
        raise ValueError(f"kvkernels {where}: dropout_p={dropout_p}: the kernels are inference-only (dropout must be 0)")
    if not isinstance(causal, bool):
        raise TypeError(f"kvkernels {where}: causal must be a bool, got {type(causal).__name__}")
    return dict(scale=None if softmax_scale is None else float(softmax_scale),
                window_left=_window_left(window_size, causal, where), soft_cap=float(softcap or 0.0),
                sinks=None if s_aux is None else s_aux.float(), causal=causal)


def _check_rank(where: str, **tensors: Tensor) -> None:
    for name, (t, dim) in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"kvkernels {where}: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != dim:
            raise ValueError(f"kvkernels {where}: {name} must have {dim} dimensions, got shape {tuple(t.shape)}")


def _unit_last_stride(t: Tensor) -> Tensor:
    """The ops read caches with a unit last stride; a K/V tensor without one is copied."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _int32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _log_call(function: str, sequences: int, rows: int) -> None:
    """``KVKERNELS_FLASH_CALL_LOG=DIR``: one line per call in ``DIR/calls-<pid>.txt`` (module docstring)."""
    directory = os.environ.get("KVKERNELS_FLASH_CALL_LOG")
    if directory:
        with open(os.path.join(directory, f"calls-{os.getpid()}.txt"), "a") as f:
            f.write(f"{function} {sequences} {rows}\n")


# ---- the flash-attention API ------------------------------------------------------------------------


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                           dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Optional[Sequence[int]] = (-1, -1), softcap: Optional[float] = 0.0,
                           s_aux: Optional[Tensor] = None) -> Tensor:
    """Attention of packed ``q`` ``[total_q, Hq, D]`` over packed ``k`` / ``v`` ``[total_k, Hkv, D(v)]``:
    sequence i has queries ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` and keys ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``
    (int32 or int64, ``[num_seqs + 1]``). Returns ``[total_q, Hq, Dv]`` in ``q``'s dtype. One
    ``ops.paged_attention`` call over ``k`` / ``v`` viewed as a block-size-1 cache (no copy)."""
    where = "flash_attn_varlen_func"
    _check_rank(where, q=(q, 3), k=(k, 3), v=(v, 3), cu_seqlens_q=(cu_seqlens_q, 1), cu_seqlens_k=(cu_seqlens_k, 1))
    if cu_seqlens_q.numel() != cu_seqlens_k.numel() or cu_seqlens_q.numel() < 1:
        raise ValueError(f"kvkernels {where}: cu_seqlens_q and cu_seqlens_k must both be [num_seqs + 1], got "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    options = _options(where, dropout_p, softmax_scale, causal, window_size, softcap, s_aux)
    cu_k = _int32(cu_seqlens_k)
    seq_lens = cu_k[1:] - cu_k[:-1]
    # Row i of the table lists sequence i's token indices; entries past its length are never read.
    # max_seqlen_k (transformers passes it, possibly padded up) spares a device sync.
    width = int(max_seqlen_k) if max_seqlen_k is not None else int(seq_lens.max()) if seq_lens.numel() else 0
    table = cu_k[:-1, None] + torch.arange(max(width, 1), dtype=torch.int32, device=cu_k.device)[None, :]
    out, _ = ops.paged_attention(q, _unit_last_stride(k).unsqueeze(1), _unit_last_stride(v).unsqueeze(1), table,
                                 seq_lens, _int32(cu_seqlens_q), **options)
    _log_call(where, seq_lens.shape[0], q.shape[0])
    return out


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Optional[Sequence[int]] = (-1, -1),
                    softcap: Optional[float] = 0.0, s_aux: Optional[Tensor] = None) -> Tensor:
    """Attention of ``q`` ``[B, Sq, Hq, D]`` over ``k`` / ``v`` ``[B, Sk, Hkv, D(v)]`` (every row the same
    lengths; queries aligned to the last keys). Returns ``[B, Sq, Hq, Dv]``. ``k`` / ``v`` are a cache of
    ``B`` blocks of ``Sk`` tokens (block b = batch row b), read in place."""
    where = "flash_attn_func"
    _check_rank(where, q=(q, 4), k=(k, 4), v=(v, 4))
    options = _options(where, dropout_p, softmax_scale, causal, window_size, softcap, s_aux)
    batch, q_len = q.shape[:2]
    if k.shape[0] != batch or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"kvkernels {where}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must "
                         f"share the batch size, and k / v the key length")
    device = q.device
    table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
    seq_lens = torch.full((batch,), k.shape[1], dtype=torch.int32, device=device)
    qsl = None if q_len == 1 else torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
    out, _ = ops.paged_attention(q.reshape(batch * q_len, *q.shape[2:]), _unit_last_stride(k), _unit_last_stride(v),
                                 table, seq_lens, qsl, **options)
    _log_call(where, batch, batch * q_len)
    return out.view(batch, q_len, *out.shape[1:])


def _shifted_page_views(k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether ``v_cache`` is ``k_cache`` moved by exactly one block (transformers' continuous-batching
    page views, where V page j is K page j + 1): same storage, dtype, shape and strides."""
    return (k_cache.device == v_cache.device and k_cache.dtype == v_cache.dtype and k_cache.shape == v_cache.shape
            and k_cache.stride() == v_cache.stride() and k_cache.shape[0] > 1
            and k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
            and v_cache.data_ptr() - k_cache.data_ptr() == k_cache.stride(0) * k_cache.element_size())


def _checks_index_data(t: Tensor) -> bool:
    """Whether to validate index data here: always on the CPU, on devices only with KVKERNELS_DEBUG=1
    (a host sync, as the ops' own index checks; docs/design.md section 6)."""
    return t.device.type == "cpu" or os.environ.get("KVKERNELS_DEBUG") == "1"


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, cache_seqlens: Union[int, Tensor, None] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Optional[Sequence[int]] = (-1, -1),
                            softcap: Optional[float] = 0.0, s_aux: Optional[Tensor] = None) -> Tensor:
    """Decode / append attention on a KV cache, FlashAttention-2's ``flash_attn_with_kvcache``.

    ``q`` ``[B, Sq, Hq, D]``; ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, Hkv, D(v)]`` with
    ``block_table`` int32 ``[B, max_blocks]`` (paged), or ``[B, max_len, Hkv, D(v)]`` without one (row b
    is sequence b). ``cache_seqlens`` (int or int ``[B]``): tokens already in each sequence's cache. ``k`` /
    ``v`` ``[B, Sk, Hkv, D(v)]``, if given, are written at positions ``cache_seqlens .. cache_seqlens + Sk - 1``
    (``ops.reshape_and_cache``) before the queries attend the ``cache_seqlens + Sk`` tokens
    (``ops.paged_attention``; the queries sit at the last positions). A row with ``cache_seqlens < 0``
    is padding: nothing is written and its output is zero. Returns ``[B, Sq, Hq, Dv]``.

    Overlapping ``k_cache`` / ``v_cache`` views of the form transformers' continuous batching passes
    (``v_cache`` = ``k_cache`` moved by one block, even table entries) are used as the disjoint
    ``k_cache[0::2]`` / ``v_cache[0::2]`` with the table halved; other overlapping views are refused
    by ``reshape_and_cache``."""
    where = "flash_attn_with_kvcache"
    _check_rank(where, q=(q, 4), k_cache=(k_cache, 4), v_cache=(v_cache, 4))
    if (k is None) != (v is None):
        raise ValueError(f"kvkernels {where}: pass both k and v (new tokens to append) or neither")
    if cache_seqlens is None:
        raise ValueError(f"kvkernels {where}: cache_seqlens is required (the number of tokens already cached per row)")
    options = _options(where, 0.0, softmax_scale, causal, window_size, softcap, s_aux)
    batch, q_len = q.shape[:2]
    device = q.device
    if k is not None:
        _check_rank(where, k=(k, 4), v=(v, 4))
        if k.shape[0] != batch or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"kvkernels {where}: k {tuple(k.shape)} and v {tuple(v.shape)} must be [B={batch}, "
                             f"new tokens, kv heads, head dim] with the same B and token count")
    new = 0 if k is None else k.shape[1]
    if isinstance(cache_seqlens, int):
        before = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    else:
        _check_rank(where, cache_seqlens=(cache_seqlens, 1))
        if cache_seqlens.shape[0] != batch or cache_seqlens.dtype.is_floating_point:
            raise ValueError(f"kvkernels {where}: cache_seqlens must be an integer tensor [B={batch}], got "
                             f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
        before = _int32(cache_seqlens)

    if block_table is None:  # a dense cache: row b is block b
        if k_cache.shape[0] < batch:
            raise ValueError(f"kvkernels {where}: without block_table the cache needs one row per sequence: "
                             f"{k_cache.shape[0]} rows for B={batch}")
        table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
    else:
        _check_rank(where, block_table=(block_table, 2))
        if block_table.shape[0] != batch:
            raise ValueError(f"kvkernels {where}: block_table has {block_table.shape[0]} rows for B={batch}")
        table = _int32(block_table)
    block_size = k_cache.shape[1]
    real = before >= 0
    seq_lens = torch.where(real, before + new, 0).to(torch.int32)

    key_cache, value_cache = k_cache, v_cache
    if _shifted_page_views(k_cache, v_cache):
        # transformers' K/V page views of one layer: the pages this table reaches are K at even page
        # indices, V at the odd index after each (the same page of v_cache). Every other page of each
        # view is exactly those pages, and the two are disjoint, so writes are safe through them.
        used = torch.arange(table.shape[1], device=device)[None, :] * block_size < seq_lens[:, None]
        if _checks_index_data(table) and bool(((table % 2 != 0) & used).any()):
            raise ValueError(f"kvkernels {where}: v_cache is k_cache moved by one block (overlapping views), which "
                             f"is only consistent when every block-table entry in use is even (K pages at even "
                             f"indices, V pages after them), got an odd entry")
        key_cache, value_cache, table = k_cache[0::2], v_cache[0::2], torch.div(table, 2, rounding_mode="floor")

    if new:
        if _checks_index_data(table) and bool((seq_lens > table.shape[1] * block_size).any()):
            raise ValueError(f"kvkernels {where}: cache_seqlens + {new} new tokens exceed a block_table row "
                             f"({table.shape[1]} blocks of {block_size})")
        pos = before[:, None] + torch.arange(new, dtype=torch.int32, device=device)[None, :]  # [B, new]
        page = torch.clamp(torch.div(pos, block_size, rounding_mode="floor"), 0, table.shape[1] - 1).long()
        slots = table.gather(1, page).long() * block_size + (pos % block_size).long()
        slots = torch.where(real[:, None], slots, -1).reshape(-1)
        ops.reshape_and_cache(k.reshape(batch * new, *k.shape[2:]), v.reshape(batch * new, *v.shape[2:]),
                              key_cache, value_cache, slots)
    qsl = None if q_len == 1 else torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
    out, _ = ops.paged_attention(q.reshape(batch * q_len, *q.shape[2:]), key_cache, value_cache, table, seq_lens, qsl,
                                 **options)
    _log_call(where, batch, batch * q_len)
    return out.view(batch, q_len, *out.shape[1:])


# ---- registration with transformers ----------------------------------------------------------------


def _register_with_transformers(attn_implementation: str, attention_wrapper=None):
    """What transformers' loader does with a kernel module it fetched: its flash wrapper (or the given
    wrapper) as the attention function and the flash mask function, both under the name."""
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(attn_implementation, attention_wrapper or flash_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(attn_implementation, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return sys.modules[__name__]


def _resolving_loader(original):
    @functools.wraps(original)
    def load_and_register_attn_kernel(attn_implementation: str, attention_wrapper=None, *args, **kwargs):
        name = attn_implementation.split("|", 1)[1] if "|" in attn_implementation else attn_implementation
        if name.strip() == KERNEL_NAME:
            return _register_with_transformers(attn_implementation, attention_wrapper)
        return original(attn_implementation, attention_wrapper, *args, **kwargs)

    load_and_register_attn_kernel.kvkernels_original = original
    return load_and_register_attn_kernel


def register_flash_kernel() -> str:
    """Make ``KERNEL_NAME`` a flash attention implementation transformers can load (see the module
    docstring); returns the name. Idempotent. Call it before loading the model. Raises
    ``KernelHookError`` when the installed transformers does not resolve the name through the hook."""
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.integrations import hub_kernels

    loader = getattr(hub_kernels, "load_and_register_attn_kernel", None)
    if loader is None or not hasattr(fa_utils, "lazy_import_flash_attention"):
        raise KernelHookError("kvkernels: this transformers has no hub_kernels.load_and_register_attn_kernel / "
                              "lazy_import_flash_attention: the flash kernel cannot be registered")
    if not hasattr(loader, "kvkernels_original"):
        hub_kernels.load_and_register_attn_kernel = _resolving_loader(loader)
    functions = fa_utils.lazy_import_flash_attention(KERNEL_NAME)[0]
    if functions[1] is not flash_attn_varlen_func:
        raise KernelHookError(f"kvkernels: transformers did not resolve {KERNEL_NAME!r} to kvkernels' kernel module "
                              f"(got {functions[1]!r})")
    return KERNEL_NAME


def continuous_batching_kernel() -> str:
    """The attention implementation to load a model with for transformers' continuous batching on
    kvkernels: ``from_pretrained(path, attn_implementation=continuous_batching_kernel())``. Registers
    the kernel (``register_flash_kernel``) and returns ``KERNEL_NAME``."""
    return register_flash_kernel()


def cli_main(argv: Optional[list[str]] = None) -> int:
    """``python -m kvkernels transformers ARGS``: transformers' command line (``transformers ARGS``, e.g.
    ``serve MODEL --continuous-batching --attn-implementation kvkernels/flash-attn2-api``) in a process
    where ``KERNEL_NAME`` is registered. (transformers' ``main()`` also checks PyPI for a newer
    release first; this runs its command table directly and does not.)"""
    register_flash_kernel()
    from transformers.cli.transformers import app

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        app(args=argv, prog_name="python -m kvkernels transformers")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0
