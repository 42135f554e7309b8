"""The JAX primitives behind kvkernels.jax.ops: abstract evaluation, vmap, and the lowering to the XLA FFI
custom calls of csrc/jax/ (one target per op, a CPU and a CUDA handler).

Each primitive takes the op's arrays (optional ones only when given; ``optional_mask`` says which) and
static parameters, and has

* an abstract evaluation (shapes and dtypes of the results), so ``jax.jit``, ``jax.eval_shape`` and
  ``jax.make_jaxpr`` work without running anything;
* a batching rule for ``jax.vmap``: the mapped axis becomes a leading *batch dim* of every operand
  (``batch_dims`` counts them; an operand that is not mapped gets a size-1 dim, which the handlers
  broadcast, except a cache that is updated in place, which is broadcast to the batch: every example
  updates its own copy). The handlers loop over the batch's examples; a cache write under ``vmap``
  is still one aliased custom call, in place.
* a lowering per platform through ``jax.ffi.ffi_lowering`` (the custom call ``jax.ffi.ffi_call`` emits),
  with ``operand_output_aliases`` for the caches. On CUDA the call gets one more result that the JAX
  level never sees: a byte buffer the handler uses as scratch (the attention's split partials, an
  int32 -> int64 copy of ``slot_mapping`` / ``block_mapping``, gather_kv's token offsets). It is part
  of XLA's buffer assignment, so the handler allocates nothing and the call is CUDA-graph safe.

No primitive has a JVP or transpose (the ops are inference-only, like the torch ops).
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax._src import core, dispatch
from jax._src.interpreters import batching, mlir
from jax import lax

from kvkernels.jax import _library


def _bcast_batch(avals, nb: int, name: str) -> tuple[int, ...]:
    """The batch shape of the leading ``nb`` dims of ``avals`` (each dim equal or 1)."""
    shape = [1] * nb
    for a in avals:
        for d in range(nb):
            s = a.shape[d]
            if s == 1:
                continue
            if shape[d] not in (1, s):
                raise ValueError(f"kvkernels.{name}: batch dim {d} is {s} in one operand and {shape[d]} in another")
            shape[d] = s
    return tuple(shape)


def _make(name: str, abstract, aliases: dict[int, int], cuda_scratch=None):
    """A primitive named ``kvkernels_<name>`` with the given abstract evaluation
    (``abstract(*avals, batch_dims, **params) -> list of ShapedArray``), in-place aliases
    ``{input index: output index}`` and CUDA scratch size (``cuda_scratch(avals_in, **params) -> bytes``)."""
    prim = core.Primitive(f"kvkernels_{name}")
    prim.multiple_results = True

    # Eager calls compile the call once per (params, shapes) and reuse it, as for jax's own primitives.
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(lambda *avals, **params: abstract(*avals, **params))

    def batch_rule(args, dims, *, batch_dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        moved = []
        for i, (a, d) in enumerate(zip(args, dims)):
            if d is not None:
                moved.append(batching.moveaxis(a, d, 0))
            elif i in aliases:
                # A cache the call updates: every example updates a copy of its own.
                moved.append(lax.broadcast(a, (size,)))
            else:
                moved.append(lax.expand_dims(a, (0,)))
        out = prim.bind(*moved, batch_dims=batch_dims + 1, **params)
        return out, [0] * len(out)

    batching.primitive_batchers[prim] = batch_rule

    def attrs_of(params):
        out = {}
        for k, v in params.items():
            if k in ("num_tokens", "out_dtype"):
                continue  # abstract-evaluation parameters: the result shapes carry them
            if isinstance(v, bool):
                out[k] = np.bool_(v)
            elif isinstance(v, int):
                out[k] = np.int64(v)
            elif isinstance(v, float):
                out[k] = np.float32(v)
            else:
                raise TypeError(f"kvkernels.{name}: attribute {k}={v!r}")
        return out

    target = _library.target_name(name)

    def lower_cpu(ctx, *args, **params):
        _library.load()  # the handlers are registered before XLA compiles the call
        rule = jax.ffi.ffi_lowering(target, operand_output_aliases=dict(aliases))
        return rule(ctx, *args, **attrs_of(params))

    def lower_cuda(ctx, *args, **params):
        if _library.cuda_library() is None:
            raise RuntimeError(f"kvkernels.{name}: the CUDA library {_library.cuda_library_path()} is not built "
                               "(make jax on a machine with nvcc) or jax has no CUDA backend")
        nbytes = int(cuda_scratch(ctx.avals_in, **params)) if cuda_scratch else 0
        scratch = core.ShapedArray((max(nbytes, 1),), np.uint8)
        ctx2 = ctx.replace(avals_out=[*ctx.avals_out, scratch])
        rule = jax.ffi.ffi_lowering(target, operand_output_aliases=dict(aliases))
        results = rule(ctx2, *args, **attrs_of(params))
        return results[:-1]

    mlir.register_lowering(prim, lower_cpu, platform="cpu")
    mlir.register_lowering(prim, lower_cuda, platform="cuda")
    return prim


# ---- paged_attention --------------------------------------------------------------------------
# inputs: query, key_cache, value_cache, block_tables, seq_lens, then the optional ones given
# (query_start_loc, alibi_slopes, sinks, k_scale, v_scale: optional_mask bits 0..4)

def _attention_abstract(*avals, scale, soft_cap, window_left, causal, optional_mask, batch_dims):
    q, vc = avals[0], avals[2]
    b = _bcast_batch(avals, batch_dims, "paged_attention")
    t, hq = q.shape[batch_dims:batch_dims + 2]
    dv = vc.shape[-1]
    return [core.ShapedArray(b + (t, hq, dv), q.dtype), core.ShapedArray(b + (t, hq), np.float32)]


CUDA_MAX_HEAD_DIM = 256  # csrc/cuda/attention_binding.cpp (docs/ops.md)


def _attention_scratch(avals, *, optional_mask, batch_dims, **_):
    """The split partials the CUDA kernels need (kvkernels_jax_cuda_attention_workspace: the launch plan
    of csrc/cuda/attention.cu for these shapes on CUDA device 0); the handler plans again on the call's
    device and lowers its split count if that one needed more."""
    lib = _library.cuda_library()
    if lib is None:
        return 0
    q, kc, vc, bt = avals[0], avals[1], avals[2], avals[3]
    nb = batch_dims
    t, hq, d = q.shape[nb:]
    n, bs, hkv, _ = kc.shape[nb:]
    for arg, hd in (("key_cache", d), ("value_cache", vc.shape[-1])):
        if hd > CUDA_MAX_HEAD_DIM:
            raise ValueError(f"kvkernels.paged_attention: {arg}: head_dim {hd} is not supported on CUDA (at most "
                             f"{CUDA_MAX_HEAD_DIM}; docs/ops.md)")
    formats = {np.dtype(np.float32): 0, np.dtype(jax.numpy.float16): 1, np.dtype(jax.numpy.bfloat16): 2,
               np.dtype(jax.numpy.float8_e4m3fn): 3, np.dtype(jax.numpy.float8_e5m2): 4}
    decode = 0 if optional_mask & 1 else 1
    nbytes = lib.kvkernels_jax_cuda_attention_workspace(
        t, hq, bt.shape[nb], hkv, d, vc.shape[-1], bs, bt.shape[nb + 1],
        formats[np.dtype(q.dtype)], formats[np.dtype(kc.dtype)], decode)
    if nbytes < 0:
        raise RuntimeError("kvkernels.paged_attention: the CUDA launch plan refused these shapes (see stderr)")
    return nbytes


paged_attention_p = _make("paged_attention", _attention_abstract, {}, _attention_scratch)


# ---- reshape_and_cache ------------------------------------------------------------------------
# inputs: key, value, key_cache, value_cache, slot_mapping, [k_scale], [v_scale]; outputs alias 2, 3

def _write_abstract(*avals, optional_mask, batch_dims):
    return [avals[2], avals[3]]


def _write_scratch(avals, *, batch_dims, **_):
    slots = avals[4]
    return 8 * math.prod(slots.shape[batch_dims:]) if slots.dtype == np.int32 else 0


reshape_and_cache_p = _make("reshape_and_cache", _write_abstract, {2: 0, 3: 1}, _write_scratch)


# ---- copy_blocks ------------------------------------------------------------------------------

def _copy_abstract(cache, mapping, *, block_dim, batch_dims):
    return [cache]


def _copy_scratch(avals, *, batch_dims, **_):
    mapping = avals[1]
    return 8 * math.prod(mapping.shape[batch_dims:]) if mapping.dtype == np.int32 else 0


copy_blocks_p = _make("copy_blocks", _copy_abstract, {0: 0}, _copy_scratch)


# ---- gather_kv --------------------------------------------------------------------------------
# inputs: key_cache, value_cache, block_tables, seq_lens, [k_scale], [v_scale]

def _gather_abstract(*avals, num_tokens, out_dtype, optional_mask, batch_dims):
    kc, vc = avals[0], avals[1]
    b = _bcast_batch(avals, batch_dims, "gather_kv")
    h = kc.shape[-2]
    dtype = jax.numpy.dtype(out_dtype)
    return [core.ShapedArray(b + (num_tokens, h, kc.shape[-1]), dtype),
            core.ShapedArray(b + (num_tokens, h, vc.shape[-1]), dtype)]


def _gather_scratch(avals, *, batch_dims, **_):
    return 8 * (avals[2].shape[batch_dims] + 1)  # token starts: int64 [num_seqs + 1]


gather_kv_p = _make("gather_kv", _gather_abstract, {}, _gather_scratch)
