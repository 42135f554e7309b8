"""The Metal implementation of the kvkernels ops: checks, outputs, parameters, dispatch.

One code path for two back ends, chosen by the tensors' device:
  * ``mps``: ``torch.mps.compile_shader`` compiles the kernel source (once per process and variant)
    and dispatches on PyTorch's MPS stream;
  * ``cpu``: ``kvkernels.metal.emulator.compile_shader`` runs the same source, with the same call,
    through the MSL emulator (how the tests check the kernels on Linux).
The functions here are registered as the MPS kernels of ``torch.ops.kvkernels`` (see __init__.py);
called directly with CPU tensors they run on the emulator.

Argument checks follow docs/ops.md and raise ``RuntimeError("kvkernels.<op>: <argument>: ...")``
before any kernel runs. Checks that read index tensors (block ids, slots, sequence lengths) run
on the emulator always and on MPS only with ``KVKERNELS_DEBUG=1`` (they synchronize the device);
the kernels skip ids outside the cache either way instead of reading or writing outside it.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
from torch import Tensor

from kvkernels.metal import source

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# libraries: compiled once per process per (family, variant, back end)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _library(family: str, defines: tuple, backend: str):
    unit = source.compile_unit(family, dict(defines))
    if backend == "mps":
        return torch.mps.compile_shader(unit)
    from kvkernels.metal import emulator

    return emulator.compile_shader(unit)


def library(device: torch.device, family: str, **defines):
    """The compiled library of metal/<family>.metal for ``defines`` on ``device``'s back end."""
    if device.type not in ("mps", "cpu"):
        raise RuntimeError(f"kvkernels Metal kernels run on MPS (or, emulated, on CPU), not on {device}")
    return _library(family, tuple(sorted(defines.items())), device.type)


def _debug_checks(device: torch.device) -> bool:
    return device.type == "cpu" or os.environ.get("KVKERNELS_DEBUG") == "1"


def _params(family: str, name: str, **fields):
    return source.pack(family, name, **fields)


def _fail(op: str, arg: str, msg: str):
    raise RuntimeError(f"kvkernels.{op}: {arg}: {msg}")


def _check(cond, op, arg, msg):
    if not cond:
        _fail(op, arg, msg)


def _check_device(op, device, **tensors):
    for name, t in tensors.items():
        if t is not None and t.device != device:
            _fail(op, name, f"expected a tensor on {device}, got {t.device}")


INT_MAX = 2**31 - 1  # sizes the kernels index with a 32-bit thread position (as csrc/checks.h's to_int)


def _check_int(op, name, what, value):
    _check(value <= INT_MAX, op, name, f"{what + ' = ' if what else ''}{value} exceeds the supported maximum {INT_MAX}")


def _span(t: Tensor):
    """(allocation, first byte, [(byte stride, size) of the dims of size > 1], element size). CPU
    tensors are placed by address (two storages may share memory); an MPS storage is its own
    allocation, placed by offset."""
    elem = t.element_size()
    dims = [(st * elem, n) for n, st in zip(t.shape, t.stride()) if n > 1]
    if t.device.type == "cpu":
        return 0, t.data_ptr(), dims, elem
    return t.untyped_storage().data_ptr(), t.storage_offset() * elem, dims, elem


def _extent(dims, elem, modulus=0):
    """Bytes from the first byte to one past the last, over the dims whose stride `modulus` does not
    divide (0: all)."""
    return elem + sum(st * (n - 1) for st, n in dims if not modulus or st % modulus)


def has_internal_overlap(t: Tensor) -> bool:
    """Whether two indices of ``t`` can address the same element: the dims of size > 1 sorted by
    stride, each stride must reach past what the smaller ones span (csrc/checks.cpp, the same test)."""
    if t.numel() == 0:
        return False
    reach = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st < reach:
            return True
        reach += st * (n - 1)
    return False


def may_overlap(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` may share a byte; False only when provably disjoint: byte ranges apart,
    or disjoint residue intervals modulo a stride that divides every outer stride (so K and V
    interleaved in one [..., 2 * D] allocation are disjoint). csrc/checks.cpp, the same test."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (ka, ba, da, ea), (kb, bb, db, eb) = _span(a), _span(b)
    if ka != kb:
        return False
    if ba >= bb + _extent(db, eb) or bb >= ba + _extent(da, ea):
        return False
    for m in {st for st, _ in da + db if st > 0}:
        ia, ib = _extent(da, ea, m), _extent(db, eb, m)
        if ia < m and ib < m and (bb - ba) % m >= ia and (ba - bb) % m >= ib:
            return False
    return True


def _check_writable(op, name, t):
    _check(not has_internal_overlap(t), op, name,
           f"elements of this output share memory (shape {list(t.shape)}, strides {list(t.stride())}: a "
           "stride-0 dimension from expand(), or overlapping strides); every element an op writes needs its own "
           "memory")


def _check_disjoint(op, name, t, out_name, out):
    if t is not None:
        _check(not may_overlap(t, out), op, name, f"shares memory with {out_name}, which this op writes (an "
               "output must not overlap another output or an input)")


def _empty(op, name, shape, **kwargs):
    """torch.empty for an output sized by the arguments; a failure names ``name``."""
    try:
        return torch.empty(*shape, **kwargs)
    except RuntimeError as e:
        raise RuntimeError(f"kvkernels.{op}: {name}: allocating the output {list(shape)} failed: {e}") from e


def _outputs(op, like_arg, like, shape, out, lse, inputs):
    """The (out, lse) the kernel writes and the copies to make after it. Without ``out``: fresh
    tensors. With it (the *_out ops): the caller's tensors, checked like csrc/prepare.cpp checks them
    (exact shape, dtype, device, own memory, no overlap with each other or any input); a
    non-contiguous one is written through a contiguous temporary; ``out`` without ``lse``: a scratch
    lse. Call after every other check: nothing is allocated before it."""
    lse_shape = tuple(shape[:2])
    if out is None:
        _check(lse is None, op, "lse", "given without out")
        return (_empty(op, like_arg, shape, dtype=like.dtype, device=like.device),
                _empty(op, like_arg, lse_shape, dtype=torch.float32, device=like.device), [])
    given = [("out", out, tuple(shape), like.dtype)] + ([("lse", lse, lse_shape, torch.float32)] if lse is not None
                                                         else [])
    for name, t, want, dtype in given:
        _check(t.device == like.device, op, name, f"must be on the device of {like_arg}")
        _check(t.dtype == dtype, op, name, f"dtype {t.dtype} must be {dtype}")
        _check(tuple(t.shape) == want, op, name, f"shape {list(t.shape)} must be {list(want)} (outputs are not resized)")
        _check_writable(op, name, t)
        for arg, x in inputs.items():
            _check_disjoint(op, arg, x, name, t)
    if lse is not None:
        _check_disjoint(op, "lse", lse, "out", out)
    kernel, copies = [], []
    for name, t, want, dtype in given:
        if t.is_contiguous():
            kernel.append(t)
        else:
            tmp = _empty(op, name, want, dtype=dtype, device=like.device)
            kernel.append(tmp)
            copies.append((tmp, t))
    if lse is None:
        kernel.append(_empty(op, "lse", lse_shape, dtype=torch.float32, device=like.device))
    return kernel[0], kernel[1], copies


def _copy_back(copies):
    for tmp, t in copies:
        t.copy_(tmp)


def _check_float(op, name, t):
    _check(t.dtype in FLOATS, op, name, f"expected float32, float16 or bfloat16, got {t.dtype}")


def _check_scale(op, name, scale, cache, num_heads):
    """fp8 caches need a float32 scale with 1 or num_heads elements; other caches ignore it."""
    if cache.dtype not in FP8:
        return 0
    _check(scale is not None, op, name, f"required for an {cache.dtype} cache")
    _check(scale.dtype == torch.float32, op, name, f"expected float32, got {scale.dtype}")
    _check(scale.numel() in (1, num_heads), op, name,
           f"expected 1 or {num_heads} (num_kv_heads) elements, got {scale.numel()}")
    return int(scale.numel() != 1)


def _check_kv_cache(op, name, cache):
    _check(cache.dim() == 4, op, name, f"expected [num_blocks, block_size, num_kv_heads, head_dim], got "
           f"{tuple(cache.shape)}")
    _check(cache.stride(3) == 1 or cache.shape[3] <= 1, op, name, "the last dimension must have stride 1")


def _scale_or_dummy(scale, dummy):
    # Metal needs a buffer at every index; a kernel variant without fp8 never reads it.
    return scale.contiguous() if scale is not None else dummy


def _group(n: int, cap: int = 32) -> int:
    return max(1, min(n, cap))


# ---------------------------------------------------------------------------------------------
# reshape_and_cache
# ---------------------------------------------------------------------------------------------


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                      k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None) -> None:
    op = "reshape_and_cache"
    dev = key_cache.device
    _check_device(op, dev, key=key, value=value, value_cache=value_cache, slot_mapping=slot_mapping,
                  k_scale=k_scale, v_scale=v_scale)
    _check(key.dim() == 3, op, "key", f"expected [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)}")
    # The value's head dim (dimension 2) may differ from the key's: it is value_cache's.
    _check(value.dim() == 3 and value.shape[:2] == key.shape[:2], op, "value",
           f"[num_tokens, num_kv_heads] of shape {tuple(value.shape)} differ from key's {tuple(key.shape[:2])}")
    _check_float(op, "key", key)
    _check(value.dtype == key.dtype, op, "value", f"dtype {value.dtype} differs from key's {key.dtype}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_kv_cache(op, name, cache)
        _check(cache.dtype in FP8 or cache.dtype == key.dtype, op, name,
               f"dtype {cache.dtype} must equal key's {key.dtype} or be an fp8 type")
    _check(value_cache.shape[:3] == key_cache.shape[:3] and value_cache.dtype == key_cache.dtype, op,
           "value_cache", "[num_blocks, block_size, num_kv_heads] and dtype must equal key_cache's")
    # The caches fix num_kv_heads and the head dims; the new tokens must match them.
    _check(key.shape[1:] == key_cache.shape[2:], op, "key",
           f"[num_kv_heads, head_dim] = {tuple(key.shape[1:])} differ from key_cache's {tuple(key_cache.shape[2:])}")
    _check(value.shape[2] == value_cache.shape[3], op, "value",
           f"head_dim {value.shape[2]} differs from value_cache's {value_cache.shape[3]}")
    _check(slot_mapping.dtype == torch.int64 and slot_mapping.shape == key.shape[:1], op, "slot_mapping",
           f"expected int64 [{key.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    t, h, d = key.shape
    dv = value.shape[2]
    _check_int(op, "key", "num_kv_heads (dimension 1)", h)
    _check_int(op, "key", "head_dim (dimension 2)", d)
    _check_int(op, "value", "head_dim (dimension 2)", dv)
    _check_int(op, "key", "num_tokens (dimension 0)", t)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_writable(op, name, cache)
        for arg, x in (("key", key), ("value", value), ("slot_mapping", slot_mapping), ("k_scale", k_scale),
                       ("v_scale", v_scale)):  # a scale is checked whether it is read or not (docs/ops.md)
            _check_disjoint(op, arg, x, name, cache)
    _check_disjoint(op, "value_cache", value_cache, "key_cache", key_cache)
    ks_head = _check_scale(op, "k_scale", k_scale, key_cache, h)
    vs_head = _check_scale(op, "v_scale", v_scale, value_cache, h)
    n, b = key_cache.shape[:2]
    if _debug_checks(dev) and t:
        _check(int(slot_mapping.max()) < n * b, op, "slot_mapping", f"slot out of range [0, {n * b})")
    width = max(d, dv)  # threads along the head dim: each writes the key and / or value element
    if t == 0 or h == 0 or width == 0:
        return
    fp8 = key_cache.dtype in FP8
    lib = library(dev, "cache_ops", WRITE_SRC_T=source.msl_type(key.dtype),
                  WRITE_CACHE_T=source.msl_type(key_cache.dtype), WRITE_FP8=int(fp8))
    p = _params("cache_ops", "WriteParams", num_tokens=t, num_heads=h, head_dim=d, head_dim_v=dv, num_slots=n * b,
                block_size=b,
                k_stride_t=key.stride(0), k_stride_h=key.stride(1), k_stride_d=key.stride(2),
                v_stride_t=value.stride(0), v_stride_h=value.stride(1), v_stride_d=value.stride(2),
                kc_stride_b=key_cache.stride(0), kc_stride_s=key_cache.stride(1), kc_stride_h=key_cache.stride(2),
                vc_stride_b=value_cache.stride(0), vc_stride_s=value_cache.stride(1),
                vc_stride_h=value_cache.stride(2), k_scale_per_head=ks_head, v_scale_per_head=vs_head)
    slots = slot_mapping.contiguous()
    lib.reshape_and_cache(key, value, key_cache, value_cache, slots, _scale_or_dummy(k_scale, slots),
                          _scale_or_dummy(v_scale, slots), p, threads=[width, h, t],
                          group_size=[_group(width), 1, 1], arg_casts={7: "uint8"})


# ---------------------------------------------------------------------------------------------
# gather_kv
# ---------------------------------------------------------------------------------------------


def _check_paged(op, dev, block_tables, seq_lens, num_blocks, block_size, num_seqs=None):
    _check(block_tables.dtype == torch.int32 and block_tables.dim() == 2, op, "block_tables",
           f"expected int32 [num_seqs, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    _check(block_tables.stride(1) == 1 or block_tables.shape[1] <= 1, op, "block_tables",
           "the last dimension must have stride 1")
    _check(seq_lens.dtype == torch.int32 and seq_lens.dim() == 1 and seq_lens.shape[0] == block_tables.shape[0],
           op, "seq_lens", f"expected int32 [{block_tables.shape[0]}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if num_seqs is not None:
        _check(block_tables.shape[0] == num_seqs, op, "block_tables", f"expected {num_seqs} rows")
    _check_int(op, "block_tables", "num_seqs (dimension 0)", block_tables.shape[0])
    if _debug_checks(dev) and seq_lens.numel():
        lens = seq_lens.cpu()
        _check(int(lens.min()) >= 0, op, "seq_lens", "negative length")
        width = block_tables.shape[1]
        _check(int(lens.max()) <= width * block_size, op, "seq_lens",
               f"a sequence is longer than its block table ({width} block{'' if width == 1 else 's'} of "
               f"{block_size})")
        table = block_tables.cpu()
        for i, n in enumerate(lens.tolist()):
            used = table[i, :(n + block_size - 1) // block_size]
            if used.numel():
                _check(int(used.min()) >= 0 and int(used.max()) < num_blocks, op, "block_tables",
                       f"block id out of range [0, {num_blocks}) in row {i}")


def gather_kv(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
              k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None, num_tokens: Optional[int] = None,
              out_dtype: Optional[torch.dtype] = None):
    op = "gather_kv"
    dev = key_cache.device
    _check_device(op, dev, value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens, k_scale=k_scale,
                  v_scale=v_scale)
    _check_kv_cache(op, "key_cache", key_cache)
    _check_kv_cache(op, "value_cache", value_cache)
    _check(value_cache.shape[:3] == key_cache.shape[:3] and value_cache.dtype == key_cache.dtype, op,
           "value_cache", "[num_blocks, block_size, num_kv_heads] and dtype must equal key_cache's")
    _check(key_cache.dtype in FLOATS + FP8, op, "key_cache", f"unsupported dtype {key_cache.dtype}")
    n, b, h, d = key_cache.shape
    dv = value_cache.shape[3]  # may differ from the key's head dim
    _check_int(op, "key_cache", "num_kv_heads (dimension 2)", h)
    _check_int(op, "key_cache", "head_dim (dimension 3)", d)
    _check_int(op, "value_cache", "head_dim (dimension 3)", dv)
    _check_paged(op, dev, block_tables, seq_lens, n, b)
    ks_head = _check_scale(op, "k_scale", k_scale, key_cache, h)
    vs_head = _check_scale(op, "v_scale", v_scale, value_cache, h)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if key_cache.dtype in FP8 else key_cache.dtype
    _check(out_dtype in FLOATS, op, "out_dtype", f"expected a float dtype, got {out_dtype}")
    _check(num_tokens is None or int(num_tokens) >= 0, op, "num_tokens", f"must be >= 0, got {num_tokens}")
    cu = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int64, device=dev)
    torch.cumsum(seq_lens, 0, out=cu[1:])
    length_arg = "seq_lens" if num_tokens is None else "num_tokens"
    if num_tokens is None:
        num_tokens = int(cu[-1])
    elif _debug_checks(dev):
        _check(int(cu[-1]) == int(num_tokens), op, "num_tokens", f"expected sum(seq_lens) = {int(cu[-1])}")
    t = int(num_tokens)
    _check_int(op, length_arg, "num_tokens", t)
    key = _empty(op, length_arg, (t, h, d), dtype=out_dtype, device=dev)
    value = _empty(op, length_arg, (t, h, dv), dtype=out_dtype, device=dev)
    width = max(d, dv)  # threads along the head dim: each writes the key and / or value element
    if t == 0 or h == 0 or width == 0:
        return key, value
    fp8 = key_cache.dtype in FP8
    lib = library(dev, "cache_ops", GATHER_CACHE_T=source.msl_type(key_cache.dtype),
                  GATHER_OUT_T=source.msl_type(out_dtype), GATHER_FP8=int(fp8))
    p = _params("cache_ops", "GatherParams", num_tokens=t, num_seqs=seq_lens.shape[0], num_heads=h, head_dim=d,
                head_dim_v=dv, block_size=b, num_blocks=n, table_stride=block_tables.stride(0),
                kc_stride_b=key_cache.stride(0), kc_stride_s=key_cache.stride(1), kc_stride_h=key_cache.stride(2),
                vc_stride_b=value_cache.stride(0), vc_stride_s=value_cache.stride(1),
                vc_stride_h=value_cache.stride(2), k_scale_per_head=ks_head, v_scale_per_head=vs_head)
    lib.gather_kv(key_cache, value_cache, block_tables, cu, _scale_or_dummy(k_scale, cu), _scale_or_dummy(v_scale, cu),
                  key, value, p, threads=[width, h, t], group_size=[_group(width), 1, 1], arg_casts={8: "uint8"})
    return key, value


# ---------------------------------------------------------------------------------------------
# copy_blocks
# ---------------------------------------------------------------------------------------------

_ELEM_TYPES = {1: "uchar", 2: "ushort", 4: "uint", 8: "ulong"}


def _merge_dims(sizes, strides):
    """Drop size-1 dims and merge dims that are contiguous with the next one."""
    dims = [(s, st) for s, st in zip(sizes, strides) if s != 1]
    out = []
    for s, st in dims:
        if out and out[-1][1] == st * s:
            out[-1] = (out[-1][0] * s, st)
        else:
            out.append((s, st))
    return out or [(1, 1)]


def copy_blocks(cache: Tensor, block_mapping: Tensor, block_dim: int = 0) -> None:
    op = "copy_blocks"
    dev = cache.device
    _check_device(op, dev, block_mapping=block_mapping)
    _check(cache.dim() >= 1, op, "cache", "expected at least one dimension")
    _check(-cache.dim() <= block_dim < cache.dim(), op, "block_dim", f"{block_dim} out of range for {cache.dim()} dims")
    block_dim %= cache.dim()
    _check(cache.element_size() in _ELEM_TYPES, op, "cache", f"element size {cache.element_size()} not supported")
    _check(block_mapping.dtype == torch.int64 and block_mapping.dim() == 2 and block_mapping.shape[1] == 2, op,
           "block_mapping", f"expected int64 [n, 2], got {block_mapping.dtype} {tuple(block_mapping.shape)}")
    _check_writable(op, "cache", cache)
    _check_disjoint(op, "block_mapping", block_mapping, "cache", cache)
    num_blocks = cache.shape[block_dim]
    pairs = block_mapping.shape[0]
    if _debug_checks(dev) and pairs:
        m = block_mapping.cpu()
        _check(int(m.min()) >= 0 and int(m.max()) < num_blocks, op, "block_mapping",
               f"block id out of range [0, {num_blocks})")
        dst = m[:, 1].tolist()
        _check(len(set(dst)) == len(dst), op, "block_mapping", "destinations must be distinct")
        _check(not set(dst) & set(m[:, 0].tolist()), op, "block_mapping", "a destination is also a source")
    sizes = [s for i, s in enumerate(cache.shape) if i != block_dim]
    strides = [s for i, s in enumerate(cache.stride()) if i != block_dim]
    dims = _merge_dims(sizes, strides)
    _check(len(dims) <= 8, op, "cache", "more than 8 non-contiguous dimensions per block")
    numel = 1
    for s in sizes:
        numel *= s
    if pairs == 0 or numel == 0:
        return
    lib = library(dev, "cache_ops", COPY_ELEM_T=_ELEM_TYPES[cache.element_size()])
    p = _params("cache_ops", "CopyParams", num_pairs=pairs, num_blocks=num_blocks, block_stride=cache.stride(block_dim),
                block_numel=numel, ndim=len(dims), sizes=[s for s, _ in dims], strides=[st for _, st in dims])
    threads_x = min(numel, 1 << 16)
    lib.copy_blocks(cache, block_mapping.contiguous(), p, threads=[threads_x, pairs],
                    group_size=[_group(threads_x, 256), 1], arg_casts={2: "uint8"})


def swap_blocks(src: Tensor, dst: Tensor, block_mapping: Tensor, block_dim: int = 0) -> None:
    """Across devices (MPS <-> CPU) with torch copies, not a Metal kernel: every source block is read
    before any destination is written (src and dst may overlap)."""
    op = "swap_blocks"
    _check(src.dim() == dst.dim(), op, "dst", f"expected {src.dim()} dimensions (src's), got {dst.dim()}")
    _check(src.dtype == dst.dtype, op, "dst", f"dtype {dst.dtype} must equal src's dtype {src.dtype}")
    _check(-src.dim() <= block_dim < src.dim(), op, "block_dim", f"{block_dim} out of range")
    _check(block_mapping.dtype == torch.int64 and block_mapping.dim() == 2 and block_mapping.shape[1] == 2, op,
           "block_mapping", f"expected int64 [n, 2], got {block_mapping.dtype} {tuple(block_mapping.shape)}")
    # dst is written in place; src may share memory with it (every source block is read first).
    _check_writable(op, "dst", dst)
    _check_disjoint(op, "block_mapping", block_mapping, "dst", dst)
    pairs = block_mapping.cpu().tolist()
    for s, d in pairs:
        _check(0 <= s < src.shape[block_dim], op, "block_mapping", f"source id {s} out of range")
        _check(0 <= d < dst.shape[block_dim], op, "block_mapping", f"destination id {d} out of range")
    if not pairs:
        return
    idx_s = torch.tensor([s for s, _ in pairs], device=src.device)
    blocks = src.index_select(block_dim, idx_s).to(dst.device)
    for k, (_, d) in enumerate(pairs):
        dst.select(block_dim, d).copy_(blocks.select(block_dim, k))


# ---------------------------------------------------------------------------------------------
# merge_attention_states
# ---------------------------------------------------------------------------------------------


def merge_attention_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor):
    return _merge_attention_states(out_a, lse_a, out_b, lse_b, None, None)


def merge_attention_states_out(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *, out: Tensor,
                               lse: Optional[Tensor] = None) -> None:
    _merge_attention_states(out_a, lse_a, out_b, lse_b, out, lse)


def _merge_attention_states(out_a, lse_a, out_b, lse_b, given_out, given_lse):
    op = "merge_attention_states"
    dev = out_a.device
    _check_device(op, dev, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    _check(out_a.dim() == 3, op, "out_a", f"expected [num_tokens, num_heads, head_dim], got {tuple(out_a.shape)}")
    _check_float(op, "out_a", out_a)
    _check(out_b.shape == out_a.shape and out_b.dtype == out_a.dtype, op, "out_b", "shape and dtype must equal out_a's")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        _check(lse.dtype == torch.float32 and lse.shape == out_a.shape[:2], op, name,
               f"expected float32 {tuple(out_a.shape[:2])}, got {lse.dtype} {tuple(lse.shape)}")
    t, h, d = out_a.shape
    _check_int(op, "out_a", "num_heads (dimension 1)", h)
    _check_int(op, "out_a", "head_dim (dimension 2)", d)
    _check_int(op, "out_a", "num_tokens (dimension 0)", t)
    out, lse, copies = _outputs(op, "out_a", out_a, (t, h, d), given_out, given_lse,
                                dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b))
    if out.numel() == 0:
        if d == 0 and t * h:
            lse.copy_(torch.logaddexp(lse_a, lse_b))
        _copy_back(copies)
        return out, lse
    lib = library(dev, "merge", OUT_T=source.msl_type(out_a.dtype))
    p = _params("merge", "MergeParams", num_tokens=t, num_heads=h, head_dim=d,
                a_stride_t=out_a.stride(0), a_stride_h=out_a.stride(1), a_stride_d=out_a.stride(2),
                b_stride_t=out_b.stride(0), b_stride_h=out_b.stride(1), b_stride_d=out_b.stride(2),
                la_stride_t=lse_a.stride(0), la_stride_h=lse_a.stride(1),
                lb_stride_t=lse_b.stride(0), lb_stride_h=lse_b.stride(1))
    lib.merge_attention_states(out_a, lse_a, out_b, lse_b, out, lse, p, threads=[d, h, t],
                               group_size=[_group(d), 1, 1], arg_casts={6: "uint8"})
    _copy_back(copies)
    return out, lse


# ---------------------------------------------------------------------------------------------
# paged_attention
# ---------------------------------------------------------------------------------------------

PA_SIMD_GROUPS = 4  # metal/paged_attention.metal: threads per threadgroup = 32 * PA_SIMD_GROUPS
MAX_HEAD_DIM = 512  # key and value head dims; above 256 the PA_MAX_EPL=16 variant


def _check_rows(op, dev, query_start_loc, num_tokens, num_seqs, seq_lens):
    """Varlen rows: int32 [S + 1], first 0, non-decreasing, last = T (q_len > seq_len is allowed:
    the leading rows of such a sequence see no key when causal)."""
    _check(query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,), op,
           "query_start_loc", f"expected int32 [{num_seqs + 1}], got {query_start_loc.dtype} "
           f"{tuple(query_start_loc.shape)}")
    if _debug_checks(dev):
        qsl = query_start_loc.cpu().to(torch.int64)
        _check(int(qsl[0]) == 0 and int(qsl[-1]) == num_tokens, op, "query_start_loc",
               f"must start at 0 and end at num_tokens = {num_tokens}")
        q_lens = qsl[1:] - qsl[:-1]
        _check(bool((q_lens >= 0).all()), op, "query_start_loc", "must be non-decreasing")


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Optional[Tensor] = None, scale: Optional[float] = None, window_left: int = -1,
                    soft_cap: float = 0.0, alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                    k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None, causal: bool = True):
    return _paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window_left,
                            soft_cap, alibi_slopes, sinks, k_scale, v_scale, causal, out=None, lse=None)


def paged_attention_out(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                        seq_lens: Tensor, query_start_loc: Optional[Tensor] = None, scale: Optional[float] = None,
                        window_left: int = -1, soft_cap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                        sinks: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                        v_scale: Optional[Tensor] = None, causal: bool = True, *, out: Tensor,
                        lse: Optional[Tensor] = None) -> None:
    _paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window_left,
                     soft_cap, alibi_slopes, sinks, k_scale, v_scale, causal, out=out, lse=lse)


def _paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window_left,
                     soft_cap, alibi_slopes, sinks, k_scale, v_scale, causal, *, out, lse):
    op = "paged_attention"
    # The schema's `bool? causal` lets None through to here (csrc/ops.cpp): refused, not taken as False.
    _check(isinstance(causal, bool), op, "causal", f"expected a bool, got {causal!r} (the default is True)")
    dev = query.device
    _check_device(op, dev, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                  seq_lens=seq_lens, query_start_loc=query_start_loc, alibi_slopes=alibi_slopes, sinks=sinks,
                  k_scale=k_scale, v_scale=v_scale)
    _check(query.dim() == 3, op, "query", f"expected [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    _check_float(op, "query", query)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_kv_cache(op, name, cache)
        _check(cache.dtype in FP8 or cache.dtype == query.dtype, op, name,
               f"dtype {cache.dtype} must equal query's {query.dtype} or be an fp8 type")
    # The value's head dim (dimension 3) may differ from the key's; blocks, slots and heads may not.
    _check(value_cache.shape[:3] == key_cache.shape[:3] and value_cache.dtype == key_cache.dtype, op,
           "value_cache", "[num_blocks, block_size, num_kv_heads] and dtype must equal key_cache's")
    t, hq, d = query.shape
    n, b, hkv, dk = key_cache.shape
    dv = value_cache.shape[3]
    _check(dk % 8 == 0 and 0 < dk <= MAX_HEAD_DIM, op, "key_cache", f"head_dim must be a positive multiple of 8 "
           f"up to {MAX_HEAD_DIM}, got {dk}")
    _check(dv % 8 == 0 and 0 < dv <= MAX_HEAD_DIM, op, "value_cache", f"head_dim must be a positive multiple of 8 "
           f"up to {MAX_HEAD_DIM}, got {dv}")
    _check(dk == d, op, "query", f"head_dim {d} differs from key_cache's {dk}")
    _check(hkv > 0, op, "key_cache", f"num_kv_heads (dimension 2) must be positive, got shape {list(key_cache.shape)}")
    _check(hq > 0 and hq % hkv == 0, op, "query", f"num_heads {hq} is not a positive multiple of num_kv_heads {hkv}")
    _check_int(op, "query", "num_heads (dimension 1)", hq)
    _check_int(op, "query", "num_tokens (dimension 0)", t)
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check_paged(op, dev, block_tables, seq_lens, n, b)
    if query_start_loc is None:
        _check(t == num_seqs, op, "query", f"decode: expected one query per sequence ({num_seqs}), got {t}")
    else:
        _check_rows(op, dev, query_start_loc, t, num_seqs, seq_lens)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            _check(x.dtype == torch.float32 and x.shape == (hq,), op, name,
                   f"expected float32 [{hq}], got {x.dtype} {tuple(x.shape)}")
    ks_head = _check_scale(op, "k_scale", k_scale, key_cache, hkv)
    vs_head = _check_scale(op, "v_scale", v_scale, value_cache, hkv)
    # Host scalars are checked as on the CPU / CUDA (docs/ops.md, "Non-finite values").
    _check(scale is None or math.isfinite(scale), op, "scale", "must be finite")
    _check(soft_cap >= 0.0 and math.isfinite(soft_cap), op, "soft_cap", f"must be >= 0 (0 = off), got {soft_cap}")
    out, lse, copies = _outputs(op, "query", query, (t, hq, dv), out, lse, dict(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens,
        query_start_loc=query_start_loc, alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale))
    if t == 0 or hq == 0:
        return out, lse
    fp8 = key_cache.dtype in FP8
    wide = {"PA_MAX_EPL": 16} if max(d, dv) > 256 else {}  # paged_attention.metal: elements per lane
    lib = library(dev, "paged_attention", Q_T=source.msl_type(query.dtype), KV_T=source.msl_type(key_cache.dtype),
                  KV_FP8=int(fp8), **wide)
    p = _params("paged_attention", "AttentionParams", num_tokens=t, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                head_dim_v=dv, num_seqs=num_seqs, block_size=b, num_blocks=n, table_stride=block_tables.stride(0),
                q_stride_t=query.stride(0), q_stride_h=query.stride(1), q_stride_d=query.stride(2),
                kc_stride_b=key_cache.stride(0), kc_stride_s=key_cache.stride(1), kc_stride_h=key_cache.stride(2),
                vc_stride_b=value_cache.stride(0), vc_stride_s=value_cache.stride(1),
                vc_stride_h=value_cache.stride(2), varlen=int(query_start_loc is not None),
                window_left=int(window_left), causal=int(bool(causal)), has_alibi=int(alibi_slopes is not None),
                has_sinks=int(sinks is not None), k_scale_per_head=ks_head, v_scale_per_head=vs_head,
                scale=float(d ** -0.5 if scale is None else scale), soft_cap=float(soft_cap))
    dummy = seq_lens
    lib.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                        query_start_loc if query_start_loc is not None else dummy,
                        _scale_or_dummy(alibi_slopes, dummy), _scale_or_dummy(sinks, dummy),
                        _scale_or_dummy(k_scale, dummy), _scale_or_dummy(v_scale, dummy), out, lse, p,
                        threads=[32 * PA_SIMD_GROUPS, hq, t], group_size=[32 * PA_SIMD_GROUPS, 1, 1],
                        arg_casts={12: "uint8"})
    _copy_back(copies)
    return out, lse


# ---------------------------------------------------------------------------------------------
# MLA: concat_and_cache_mla, mla_decompress, mla_paged_attention
# ---------------------------------------------------------------------------------------------

MLA_MAX_RANK, MLA_MAX_ROW, MLA_HEADS = 512, 576, 4  # metal/mla.metal


def _check_mla_cache(op, cache, name="kv_cache"):
    # docs/ops.md: one latent head shared by every query head; several latent heads are not supported.
    _check(cache.dim() != 4, op, name, "latent caches with several kv heads ([num_blocks, block_size, num_kv_heads, "
           "kv_lora_rank + rope_dim]) are not supported: pass one latent head [num_blocks, block_size, kv_lora_rank "
           f"+ rope_dim] (got shape {list(cache.shape)})")
    _check(cache.dim() == 3, op, name, f"expected [num_blocks, block_size, kv_lora_rank + rope_dim], got "
           f"{tuple(cache.shape)}")
    _check(cache.stride(2) == 1 or cache.shape[2] <= 1, op, name, "the last dimension must have stride 1")


def _check_mla_scale(op, name, scale, cache):
    if cache.dtype not in FP8:
        return
    _check(scale is not None, op, name, f"required for an {cache.dtype} cache")
    _check(scale.dtype == torch.float32 and scale.numel() == 1, op, name,
           f"expected a float32 tensor of 1 element, got {scale.dtype} with {scale.numel()}")


def concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                         scale: Optional[Tensor] = None) -> None:
    op = "concat_and_cache_mla"
    dev = kv_cache.device
    _check_device(op, dev, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping, scale=scale)
    _check(kv_c.dim() == 2, op, "kv_c", f"expected [num_tokens, kv_lora_rank], got {tuple(kv_c.shape)}")
    _check(k_pe.dim() == 2 and k_pe.shape[0] == kv_c.shape[0], op, "k_pe",
           f"expected [{kv_c.shape[0]}, rope_dim], got {tuple(k_pe.shape)}")
    _check_float(op, "kv_c", kv_c)
    _check(k_pe.dtype == kv_c.dtype, op, "k_pe", f"dtype {k_pe.dtype} differs from kv_c's {kv_c.dtype}")
    _check_mla_cache(op, kv_cache)
    t, r = kv_c.shape
    p_dim = k_pe.shape[1]
    _check(kv_cache.shape[2] == r + p_dim, op, "kv_cache", f"row width {kv_cache.shape[2]} != kv_lora_rank + rope_dim "
           f"= {r + p_dim}")
    _check(kv_cache.dtype in FP8 or kv_cache.dtype == kv_c.dtype, op, "kv_cache",
           f"dtype {kv_cache.dtype} must equal kv_c's {kv_c.dtype} or be an fp8 type")
    _check(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (t,), op, "slot_mapping",
           f"expected int64 [{t}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    _check_mla_scale(op, "scale", scale, kv_cache)
    _check_int(op, "kv_c", "num_tokens (dimension 0)", t)
    _check_writable(op, "kv_cache", kv_cache)
    for arg, x in (("kv_c", kv_c), ("k_pe", k_pe), ("slot_mapping", slot_mapping), ("scale", scale)):
        _check_disjoint(op, arg, x, "kv_cache", kv_cache)
    n, b = kv_cache.shape[:2]
    if _debug_checks(dev) and t:
        _check(int(slot_mapping.max()) < n * b, op, "slot_mapping", f"slot out of range [0, {n * b})")
    if t == 0 or r + p_dim == 0:
        return
    fp8 = kv_cache.dtype in FP8
    lib = library(dev, "mla", CONCAT_SRC_T=source.msl_type(kv_c.dtype), CONCAT_CACHE_T=source.msl_type(kv_cache.dtype),
                  CONCAT_FP8=int(fp8))
    p = _params("mla", "ConcatParams", num_tokens=t, kv_lora_rank=r, rope_dim=p_dim, num_slots=n * b, block_size=b,
                c_stride_t=kv_c.stride(0), c_stride_d=kv_c.stride(1), pe_stride_t=k_pe.stride(0),
                pe_stride_d=k_pe.stride(1), cache_stride_b=kv_cache.stride(0), cache_stride_s=kv_cache.stride(1))
    slots = slot_mapping.contiguous()
    lib.concat_and_cache_mla(kv_c, k_pe, kv_cache, slots, _scale_or_dummy(scale, slots), p,
                             threads=[r + p_dim, t], group_size=[_group(r + p_dim, 64), 1], arg_casts={5: "uint8"})


def mla_decompress(kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, w_kv_b: Tensor, kv_lora_rank: int,
                   qk_nope_head_dim: int, v_head_dim: int, norm_weight: Optional[Tensor] = None,
                   norm_eps: float = 1e-6, scale: Optional[Tensor] = None, num_tokens: Optional[int] = None):
    op = "mla_decompress"
    dev = kv_cache.device
    _check_device(op, dev, block_tables=block_tables, seq_lens=seq_lens, w_kv_b=w_kv_b, norm_weight=norm_weight,
                  scale=scale)
    _check_mla_cache(op, kv_cache)
    _check_float(op, "w_kv_b", w_kv_b)
    r, dn, dv = int(kv_lora_rank), int(qk_nope_head_dim), int(v_head_dim)
    n, b, width = kv_cache.shape
    _check(0 < r <= MLA_MAX_RANK and r % 8 == 0, op, "kv_lora_rank", f"must be a multiple of 8 in [8, {MLA_MAX_RANK}]")
    _check(r <= width <= MLA_MAX_ROW, op, "kv_cache", f"row width {width} must be in [kv_lora_rank, {MLA_MAX_ROW}]")
    _check(dn > 0, op, "qk_nope_head_dim", f"must be positive, got {dn}")
    _check(dv > 0, op, "v_head_dim", f"must be positive, got {dv}")
    _check_int(op, "qk_nope_head_dim", "", dn)
    _check_int(op, "v_head_dim", "", dv)
    _check_int(op, "v_head_dim", "qk_nope_head_dim + v_head_dim", dn + dv)
    _check(w_kv_b.dim() == 2 and w_kv_b.shape[1] == r and w_kv_b.shape[0] % (dn + dv) == 0, op, "w_kv_b",
           f"expected [num_heads * {dn + dv}, {r}], got {tuple(w_kv_b.shape)}")
    _check(kv_cache.dtype in FP8 or kv_cache.dtype == w_kv_b.dtype, op, "kv_cache",
           f"dtype {kv_cache.dtype} must equal w_kv_b's {w_kv_b.dtype} or be an fp8 type")
    if norm_weight is not None:
        _check(norm_weight.dtype == w_kv_b.dtype and norm_weight.shape == (r,), op, "norm_weight",
               f"expected {w_kv_b.dtype} [{r}], got {norm_weight.dtype} {tuple(norm_weight.shape)}")
    _check_mla_scale(op, "scale", scale, kv_cache)
    _check_paged(op, dev, block_tables, seq_lens, n, b)
    heads = w_kv_b.shape[0] // (dn + dv)
    _check_int(op, "w_kv_b", f"num_heads (dimension 0 / {dn + dv})", heads)
    p_dim = width - r
    _check(num_tokens is None or int(num_tokens) >= 0, op, "num_tokens", f"must be >= 0, got {num_tokens}")
    cu = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int64, device=dev)
    torch.cumsum(seq_lens, 0, out=cu[1:])
    length_arg = "seq_lens" if num_tokens is None else "num_tokens"
    if num_tokens is None:
        num_tokens = int(cu[-1])
    elif _debug_checks(dev):
        _check(int(cu[-1]) == int(num_tokens), op, "num_tokens", f"expected sum(seq_lens) = {int(cu[-1])}")
    t = int(num_tokens)
    _check_int(op, length_arg, "num_tokens", t)
    key = _empty(op, length_arg, (t, heads, dn + p_dim), dtype=w_kv_b.dtype, device=dev)
    value = _empty(op, length_arg, (t, heads, dv), dtype=w_kv_b.dtype, device=dev)
    if t == 0 or heads == 0:
        return key, value
    fp8 = kv_cache.dtype in FP8
    lib = library(dev, "mla", DEC_W_T=source.msl_type(w_kv_b.dtype), DEC_CACHE_T=source.msl_type(kv_cache.dtype),
                  DEC_FP8=int(fp8))
    p = _params("mla", "DecompressParams", num_tokens=t, num_seqs=seq_lens.shape[0], kv_lora_rank=r, rope_dim=p_dim,
                num_heads=heads, qk_nope_head_dim=dn, v_head_dim=dv, block_size=b, num_blocks=n,
                table_stride=block_tables.stride(0), cache_stride_b=kv_cache.stride(0),
                cache_stride_s=kv_cache.stride(1), w_stride_n=w_kv_b.stride(0), w_stride_r=w_kv_b.stride(1),
                has_norm=int(norm_weight is not None), norm_eps=float(norm_eps))
    nw = norm_weight.contiguous() if norm_weight is not None else w_kv_b
    sc = _scale_or_dummy(scale, cu)
    rows = heads * (dn + dv)
    lib.mla_decompress(kv_cache, block_tables, cu, w_kv_b, nw, sc, key, value, p,
                       threads=[16 * -(-rows // 32), 16 * -(-t // 32)], group_size=[16, 16], arg_casts={8: "uint8"})
    if p_dim:
        lib.mla_copy_pe(kv_cache, block_tables, cu, sc, key, p, threads=[p_dim, heads, t],
                        group_size=[_group(p_dim), 1, 1], arg_casts={5: "uint8"})
    return key, value


def mla_paged_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, kv_lora_rank: int,
                        scale: float, query_start_loc: Optional[Tensor] = None, kv_scale: Optional[Tensor] = None):
    return _mla_paged_attention(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, query_start_loc, kv_scale,
                                out=None, lse=None)


def mla_paged_attention_out(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, kv_lora_rank: int,
                            scale: float, query_start_loc: Optional[Tensor] = None, kv_scale: Optional[Tensor] = None,
                            *, out: Tensor, lse: Optional[Tensor] = None) -> None:
    _mla_paged_attention(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, query_start_loc, kv_scale,
                         out=out, lse=lse)


def _mla_paged_attention(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, query_start_loc, kv_scale, *,
                         out, lse):
    op = "mla_paged_attention"
    dev = q.device
    _check_device(op, dev, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens,
                  query_start_loc=query_start_loc, kv_scale=kv_scale)
    _check(q.dim() == 3, op, "q", f"expected [num_tokens, num_heads, kv_lora_rank + rope_dim], got {tuple(q.shape)}")
    _check_float(op, "q", q)
    _check_mla_cache(op, kv_cache)
    t, hq, width = q.shape
    n, b, cw = kv_cache.shape
    r = int(kv_lora_rank)
    _check(cw == width, op, "kv_cache", f"row width {cw} differs from q's {width}")
    _check(0 < r <= MLA_MAX_RANK and r % 8 == 0 and r <= width <= MLA_MAX_ROW, op, "kv_lora_rank",
           f"need a multiple of 8 in [8, {MLA_MAX_RANK}] and kv_lora_rank <= row width <= {MLA_MAX_ROW}")
    _check(kv_cache.dtype in FP8 or kv_cache.dtype == q.dtype, op, "kv_cache",
           f"dtype {kv_cache.dtype} must equal q's {q.dtype} or be an fp8 type")
    _check_mla_scale(op, "kv_scale", kv_scale, kv_cache)
    _check(math.isfinite(scale), op, "scale", "must be finite")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check_paged(op, dev, block_tables, seq_lens, n, b)
    if query_start_loc is None:
        _check(t == num_seqs, op, "q", f"decode: expected one query per sequence ({num_seqs}), got {t}")
    else:
        _check_rows(op, dev, query_start_loc, t, num_seqs, seq_lens)
    _check_int(op, "q", "num_heads (dimension 1)", hq)
    _check_int(op, "q", "num_tokens (dimension 0)", t)
    out, lse, copies = _outputs(op, "q", q, (t, hq, r), out, lse, dict(
        q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
        kv_scale=kv_scale))
    if t == 0 or hq == 0:
        return out, lse
    fp8 = kv_cache.dtype in FP8
    lib = library(dev, "mla", MLA_Q_T=source.msl_type(q.dtype), MLA_KV_T=source.msl_type(kv_cache.dtype),
                  MLA_FP8=int(fp8))
    p = _params("mla", "MlaParams", num_tokens=t, num_heads=hq, kv_lora_rank=r, row_width=width, num_seqs=num_seqs,
                block_size=b, num_blocks=n, table_stride=block_tables.stride(0), q_stride_t=q.stride(0),
                q_stride_h=q.stride(1), q_stride_d=q.stride(2), cache_stride_b=kv_cache.stride(0),
                cache_stride_s=kv_cache.stride(1), varlen=int(query_start_loc is not None), scale=float(scale))
    dummy = seq_lens
    lib.mla_paged_attention(q, kv_cache, block_tables, seq_lens,
                            query_start_loc if query_start_loc is not None else dummy,
                            _scale_or_dummy(kv_scale, dummy), out, lse, p,
                            threads=[32 * MLA_HEADS, -(-hq // MLA_HEADS), t], group_size=[32 * MLA_HEADS, 1, 1],
                            arg_casts={8: "uint8"})
    _copy_back(copies)
    return out, lse
