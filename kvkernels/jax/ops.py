"""kvkernels' paged-attention and cache ops for JAX, on the same CPU and CUDA kernels as the torch ops.

The functions take and return ``jax.Array`` s and follow docs/ops.md (the torch ops' contract), with the
differences a functional, statically shaped framework imposes (docs/jax.md):

* Cache writes return the updated caches instead of writing their arguments: ``key_cache, value_cache =
  reshape_and_cache(...)``, ``cache = copy_blocks(...)``. The results alias the inputs
  (``input_output_aliases`` of the custom call): under ``jax.jit`` with the caches donated
  (``donate_argnums``) the kernel writes the caller's buffers in place, and no cache is copied.
* Options (``scale``, ``window_left``, ``soft_cap``, ``causal``, ``block_dim``, ``num_tokens``,
  ``out_dtype``) are static Python values; the arrays may be traced.
* ``gather_kv`` needs ``num_tokens`` (= ``sum(seq_lens)``) when ``seq_lens`` is traced: a JAX result has a
  static shape. On the CPU a call whose ``num_tokens`` differs from ``sum(seq_lens)`` fails.
* Index arrays: ``block_tables``, ``seq_lens``, ``query_start_loc`` int32 (as the torch ops);
  ``slot_mapping`` and ``block_mapping`` int32 or int64 (JAX makes integer arrays int32 unless x64 is on).
  Arrays are dense (NHD caches ``[num_blocks, block_size, num_kv_heads, head_dim]``).

Every shape and dtype is checked when the call is traced, and a bad one raises ``ValueError`` naming the
argument: ``kvkernels.paged_attention: query: ...``, as the torch ops do. Checks that read index values
(block ids, lengths, slots, mappings) run in the CPU handlers before anything is written and fail the
call with a ``jax.errors.JaxRuntimeError`` carrying the same message; the CUDA kernels skip out-of-range
ids (as the torch CUDA ops do outside ``KVKERNELS_DEBUG``).

``jax.vmap`` maps every op over a batch of independent caches (each example its own block tables,
lengths, ...): one custom call whose handler loops over the examples; cache writes stay in place.
No op has a derivative (inference only).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from kvkernels.jax import _library
from kvkernels.jax._primitives import copy_blocks_p, gather_kv_p, paged_attention_p, reshape_and_cache_p

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "gather_kv"]

FLOAT_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.float16, jnp.bfloat16))
FP8_DTYPES = tuple(np.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2))
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
INT32, INT64 = np.dtype(np.int32), np.dtype(np.int64)
MAX_HEAD_DIM = 512  # CPU (docs/ops.md); the CUDA handlers allow 256
MAX_BLOCK_SIZE = 256


class _Check:
    """Argument checks of one op call; every failure is ``ValueError("kvkernels.<op>: <arg>: ...")``."""

    def __init__(self, op: str):
        self.op = op

    def fail(self, arg: str, msg: str):
        raise ValueError(f"kvkernels.{self.op}: {arg}: {msg}")

    def array(self, x, arg: str, allowed=None):
        """``x`` as a JAX array (or tracer). With ``allowed``, its dtype is checked *before* any
        conversion: ``jnp.asarray`` of a numpy int64 / float64 array without x64 would narrow it silently
        (a slot of -2**40 would become 0). A numpy int64 array whose dtype is allowed is converted to
        int32 when its values fit, else it needs x64 (an error)."""
        if x is None:
            self.fail(arg, "is required")
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            self.fail(arg, f"expected an array, got {type(x).__name__}")
        if allowed is not None:
            self.dtype(x, arg, allowed)
        if isinstance(x, (jax.Array, jax.core.Tracer)):
            return x
        dtype = np.dtype(x.dtype)
        if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
            v = np.asarray(x)
            if dtype != INT64:
                self.fail(arg, f"{dtype.name} needs jax_enable_x64 (without it JAX would narrow the array "
                               "to 32 bits)")
            if v.size and (v.min() < np.iinfo(np.int32).min or v.max() > np.iinfo(np.int32).max):
                self.fail(arg, "int64 values outside the int32 range need jax_enable_x64 (without it JAX "
                               "arrays are int32)")
            return jnp.asarray(v.astype(np.int32))
        return jnp.asarray(x)

    def dim(self, x, arg: str, ndim: int):
        if len(x.shape) != ndim:
            self.fail(arg, f"expected {ndim} dims, got shape {tuple(x.shape)}")

    def dtype(self, x, arg: str, allowed, what: str | None = None):
        if np.dtype(x.dtype) not in allowed:
            names = what or " or ".join(np.dtype(d).name for d in allowed)
            self.fail(arg, f"expected {names}, got {np.dtype(x.dtype).name}")

    def size(self, x, arg: str, d: int, expected: int, what: str):
        if x.shape[d] != expected:
            self.fail(arg, f"dimension {d} must be {expected} ({what}), got shape {tuple(x.shape)}")

    def static_number(self, v, arg: str, kind=numbers.Real):
        if isinstance(v, bool) or not isinstance(v, kind) or isinstance(v, jax.core.Tracer):
            want = "an int" if kind is numbers.Integral else "a number"
            self.fail(arg, f"expected {want} (a static Python value), got {type(v).__name__}")
        return v

    def scale(self, s, arg: str, cache_arg: str, per_head: int):
        if s is None:
            self.fail(arg, f"is required when {cache_arg} is fp8")
        s = self.array(s, arg, (np.dtype(np.float32),))
        n = math.prod(s.shape)
        if n not in (1, per_head):
            self.fail(arg, f"must have 1 element or one per kv head ({per_head}), got shape {tuple(s.shape)}")
        return s.reshape(n)


def _optional(pairs):
    """(arrays given, optional_mask) of [(array or None)] in the handler's order."""
    given = [a for a in pairs if a is not None]
    mask = sum(1 << i for i, a in enumerate(pairs) if a is not None)
    return given, mask


def _paged_kv(c: _Check, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale):
    """The checks shared by paged_attention and gather_kv (csrc/prepare.cpp make_paged_kv)."""
    key_cache = c.array(key_cache, "key_cache", CACHE_DTYPES)
    value_cache = c.array(value_cache, "value_cache", CACHE_DTYPES)
    c.dim(key_cache, "key_cache", 4)
    b = key_cache.shape[1]
    if not 1 <= b <= MAX_BLOCK_SIZE:
        c.fail("key_cache", f"block size (dimension 1) must be in [1, {MAX_BLOCK_SIZE}], got {b}")
    c.dim(value_cache, "value_cache", 4)
    if value_cache.dtype != key_cache.dtype:
        c.fail("value_cache", f"dtype {np.dtype(value_cache.dtype).name} must equal key_cache's "
                              f"{np.dtype(key_cache.dtype).name}")
    for d in range(3):
        c.size(value_cache, "value_cache", d, key_cache.shape[d], "num_blocks, block_size, num_kv_heads of key_cache")
    block_tables = c.array(block_tables, "block_tables", (INT32,))
    seq_lens = c.array(seq_lens, "seq_lens", (INT32,))
    c.dim(block_tables, "block_tables", 2)
    c.dim(seq_lens, "seq_lens", 1)
    c.size(seq_lens, "seq_lens", 0, block_tables.shape[0], "num_seqs = block_tables.shape[0]")
    hkv = key_cache.shape[2]
    if np.dtype(key_cache.dtype) in FP8_DTYPES:
        k_scale = c.scale(k_scale, "k_scale", "key_cache", hkv)
        v_scale = c.scale(v_scale, "v_scale", "key_cache", hkv)
    else:
        k_scale = v_scale = None  # ignored (not read) for caches that are not fp8, as by the torch ops
    return key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *,
                    scale=None, window_left=-1, soft_cap=0.0, alibi_slopes=None, sinks=None, k_scale=None,
                    v_scale=None, causal=True):
    """Paged attention of ``query`` [T, Hq, Dk] over each sequence's cached keys and values: decode
    (``query_start_loc=None``, one query per sequence) or varlen prefill (``query_start_loc`` int32
    [num_seqs + 1]). Returns ``(out [T, Hq, Dv] in the query's dtype, lse float32 [T, Hq])``.

    Every option of ``kvkernels.ops.paged_attention`` (docs/ops.md): ``scale`` (default ``Dk ** -0.5``),
    ``window_left``, ``soft_cap``, ``alibi_slopes`` / ``sinks`` (float32 [Hq]), fp8 caches with ``k_scale`` /
    ``v_scale`` (float32, 1 or Hkv elements), ``causal``."""
    c = _Check("paged_attention")
    if not isinstance(causal, bool):
        c.fail("causal", "expected a bool, got None (the default is True)" if causal is None
               else f"expected a bool, got {type(causal).__name__}")
    key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale = _paged_kv(
        c, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale)
    n, b, hkv, d = key_cache.shape
    dv = value_cache.shape[3]
    for arg, hd in (("key_cache", d), ("value_cache", dv)):
        if not (hd > 0 and hd % 8 == 0 and hd <= MAX_HEAD_DIM):
            c.fail(arg, f"head_dim must be a positive multiple of 8 up to {MAX_HEAD_DIM}, got {hd}")
    query = c.array(query, "query", FLOAT_DTYPES)
    c.dim(query, "query", 3)
    c.size(query, "query", 2, d, "head_dim of key_cache")
    if hkv <= 0:
        c.fail("key_cache", f"num_kv_heads (dimension 2) must be positive, got shape {tuple(key_cache.shape)}")
    t, hq, _ = query.shape
    if not (hq > 0 and hq % hkv == 0):
        c.fail("query", f"num_heads ({hq}) must be a positive multiple of num_kv_heads ({hkv})")
    c.dtype(query, "query", FLOAT_DTYPES)
    if np.dtype(key_cache.dtype) not in FP8_DTYPES and key_cache.dtype != query.dtype:
        c.fail("key_cache", f"dtype {np.dtype(key_cache.dtype).name} must be query's dtype "
                            f"({np.dtype(query.dtype).name}) or an fp8 dtype")
    num_seqs = block_tables.shape[0]
    if query_start_loc is not None:
        query_start_loc = c.array(query_start_loc, "query_start_loc", (INT32,))
        c.dim(query_start_loc, "query_start_loc", 1)
        c.size(query_start_loc, "query_start_loc", 0, num_seqs + 1, "num_seqs + 1")
    elif t != num_seqs:
        c.fail("query", f"decode (query_start_loc=None) needs one query per sequence: got {t} queries for "
                        f"{num_seqs} sequences")
    if scale is not None:
        c.static_number(scale, "scale")
        if not math.isfinite(scale):
            c.fail("scale", "must be finite")
    c.static_number(soft_cap, "soft_cap")
    if not (soft_cap >= 0 and math.isfinite(soft_cap)):
        c.fail("soft_cap", f"must be >= 0 (0 = off), got {soft_cap}")
    c.static_number(window_left, "window_left", numbers.Integral)
    if window_left >= 2**31:
        c.fail("window_left", f"too large: {window_left}")
    vectors = []
    for v, arg in ((alibi_slopes, "alibi_slopes"), (sinks, "sinks")):
        if v is not None:
            v = c.array(v, arg, (np.dtype(np.float32),))
            c.dim(v, arg, 1)
            c.size(v, arg, 0, hq, "num_heads of query")
        vectors.append(v)
    # float32(1 / sqrt(Dk)) from float64, as the torch op computes its default.
    scale = float(np.float32(1.0 / math.sqrt(d) if scale is None else scale))
    given, mask = _optional([query_start_loc, *vectors, k_scale, v_scale])
    _library.load()
    out, lse = paged_attention_p.bind(
        query, key_cache, value_cache, block_tables, seq_lens, *given, scale=scale,
        soft_cap=float(np.float32(soft_cap)), window_left=int(max(window_left, -1)), causal=causal,
        optional_mask=mask, batch_dims=0)
    return out, lse


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Writes ``key`` [T, H, Dk] / ``value`` [T, H, Dv] into their slots (``slot = block * block_size +
    offset``; negative: skipped) of ``key_cache`` / ``value_cache`` [N, B, H, D] (fp8 caches: quantized
    with ``k_scale`` / ``v_scale``, docs/ops.md) and returns the updated ``(key_cache, value_cache)``, which
    alias the inputs (in place under ``jax.jit`` with the caches donated)."""
    c = _Check("reshape_and_cache")
    key, value = c.array(key, "key", FLOAT_DTYPES), c.array(value, "value", FLOAT_DTYPES)
    c.dim(key, "key", 3)
    c.dim(value, "value", 3)
    if value.dtype != key.dtype:
        c.fail("value", f"dtype {np.dtype(value.dtype).name} must equal key's {np.dtype(key.dtype).name}")
    for d in range(2):
        c.size(value, "value", d, key.shape[d], "num_tokens, num_kv_heads of key")
    key_cache = c.array(key_cache, "key_cache", CACHE_DTYPES)
    value_cache = c.array(value_cache, "value_cache", CACHE_DTYPES)
    for cache, arg in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        c.dim(cache, arg, 4)
        c.dtype(cache, arg, CACHE_DTYPES)
        if not 1 <= cache.shape[1] <= MAX_BLOCK_SIZE:
            c.fail(arg, f"block size (dimension 1) must be in [1, {MAX_BLOCK_SIZE}], got {cache.shape[1]}")
    if value_cache.dtype != key_cache.dtype:
        c.fail("value_cache", f"dtype {np.dtype(value_cache.dtype).name} must equal key_cache's "
                              f"{np.dtype(key_cache.dtype).name}")
    for d in range(3):
        c.size(value_cache, "value_cache", d, key_cache.shape[d], "num_blocks, block_size, num_kv_heads of key_cache")
    c.size(key, "key", 1, key_cache.shape[2], "num_kv_heads of key_cache")
    c.size(key, "key", 2, key_cache.shape[3], "head_dim of key_cache")
    c.size(value, "value", 2, value_cache.shape[3], "head_dim of value_cache")
    if np.dtype(key_cache.dtype) not in FP8_DTYPES and key_cache.dtype != key.dtype:
        c.fail("key_cache", f"dtype {np.dtype(key_cache.dtype).name} must be key's dtype "
                            f"({np.dtype(key.dtype).name}) or an fp8 dtype")
    slot_mapping = c.array(slot_mapping, "slot_mapping", (INT32, INT64))
    c.dim(slot_mapping, "slot_mapping", 1)
    c.size(slot_mapping, "slot_mapping", 0, key.shape[0], "num_tokens of key")
    if np.dtype(key_cache.dtype) in FP8_DTYPES:
        k_scale = c.scale(k_scale, "k_scale", "key_cache", key.shape[1])
        v_scale = c.scale(v_scale, "v_scale", "key_cache", key.shape[1])
    else:
        k_scale = v_scale = None
    given, mask = _optional([k_scale, v_scale])
    _library.load()
    kc, vc = reshape_and_cache_p.bind(key, value, key_cache, value_cache, slot_mapping, *given,
                                      optional_mask=mask, batch_dims=0)
    return kc, vc


def copy_blocks(cache, block_mapping, *, block_dim=0):
    """Copies ``cache``'s block ``src`` to block ``dst`` for each row ``(src, dst)`` of ``block_mapping``
    (int32 or int64 [n, 2]; destinations distinct and never a source) and returns the updated cache
    (aliasing the input). ``block_dim``: the dimension that indexes blocks (0 for one layer's
    [N, B, H, D]; 1 for a stacked [L, N, B, H, D] of kvkernels.jax.PagedKVCache)."""
    c = _Check("copy_blocks")
    cache = c.array(cache, "cache")
    if not 1 <= len(cache.shape) <= 8:
        c.fail("cache", f"needs 1 to 8 dims, got shape {tuple(cache.shape)}")
    c.static_number(block_dim, "block_dim", numbers.Integral)
    ndim = len(cache.shape)
    if not -ndim <= block_dim < ndim:
        c.fail("block_dim", f"out of range for a {ndim}-dimensional array: {block_dim}")
    block_mapping = c.array(block_mapping, "block_mapping", (INT32, INT64))
    c.dim(block_mapping, "block_mapping", 2)
    c.size(block_mapping, "block_mapping", 1, 2, "(src, dst) pairs")
    bd = block_dim % ndim
    if block_mapping.shape[0] > cache.shape[bd]:
        c.fail("block_mapping", f"{block_mapping.shape[0]} pairs for {cache.shape[bd]} destination blocks: a "
                                "destination block appears more than once")
    _library.load()
    (out,) = copy_blocks_p.bind(cache, block_mapping, block_dim=int(bd), batch_dims=0)
    return out


def gather_kv(key_cache, value_cache, block_tables, seq_lens, *, k_scale=None, v_scale=None, num_tokens=None,
              out_dtype=None):
    """Paged -> contiguous: ``(key [num_tokens, H, Dk], value [num_tokens, H, Dv])``, the tokens of every
    sequence in order (fp8 caches dequantized). ``num_tokens`` must be ``sum(seq_lens)``; it may be left out
    only when ``seq_lens`` is a concrete array (it is then computed). ``out_dtype``: float32, float16 or
    bfloat16 (default: the cache's dtype, bfloat16 for fp8 caches)."""
    c = _Check("gather_kv")
    key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale = _paged_kv(
        c, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale)
    fp8 = np.dtype(key_cache.dtype) in FP8_DTYPES
    dtype = np.dtype(jnp.bfloat16 if fp8 else key_cache.dtype)
    if out_dtype is not None:
        try:
            dtype = np.dtype(jnp.dtype(out_dtype))
        except TypeError:
            c.fail("out_dtype", f"expected a float dtype, got {out_dtype!r}")
        if dtype not in FLOAT_DTYPES:
            c.fail("out_dtype", f"must be float32, float16 or bfloat16, got {dtype.name}")
    if num_tokens is None:
        if isinstance(seq_lens, jax.core.Tracer):
            c.fail("num_tokens", "required when seq_lens is traced (a JAX result has a static shape): pass "
                                 "sum(seq_lens)")
        num_tokens = int(np.asarray(seq_lens, dtype=np.int64).sum())
    c.static_number(num_tokens, "num_tokens", numbers.Integral)
    if num_tokens < 0:
        c.fail("num_tokens", f"must be >= 0, got {num_tokens}")
    given, mask = _optional([k_scale, v_scale])
    _library.load()
    key, value = gather_kv_p.bind(key_cache, value_cache, block_tables, seq_lens, *given,
                                  num_tokens=int(num_tokens), out_dtype=dtype.name, optional_mask=mask,
                                  batch_dims=0)
    return key, value
