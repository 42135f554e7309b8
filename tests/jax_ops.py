"""kvkernels.jax's ops called like ``kvkernels.ops`` (torch tensors in, torch tensors out), so the checks of
tests/test_attention.py, tests/test_causal.py and tests/test_cache_ops.py apply to them unchanged.

Each call copies its torch arguments into JAX arrays on ``DEVICE`` (dense copies: strided views such as HND
caches or layer slices of a stacked allocation arrive as dense NHD arrays, which is what a JAX program
holds), runs the op (eagerly, or under ``jax.jit`` when ``JIT`` is set) and copies the results back; the
updated caches of ``reshape_and_cache`` / ``copy_blocks`` are written back through the caller's views. The
last call's JAX results are kept in ``last_results`` (the in-place tests read their buffers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

import kvkernels.jax as kj

DEVICE = None  # a jax.Device, None: jax's default (the CPU here)
JIT = False
last_results: list = []

_AS_NUMPY = {  # torch dtype -> (same-width integer view, numpy dtype of the JAX array)
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
}
_TORCH = {np.dtype(v[1]): (k, v[0]) for k, v in _AS_NUMPY.items()}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype in _AS_NUMPY:
        view, np_dtype = _AS_NUMPY[t.dtype]
        return t.view(view).numpy().view(np_dtype)
    return t.numpy()


def to_jax(t, index_dtype=np.int32):
    """A torch tensor as a JAX array on DEVICE (int64 index tensors as ``index_dtype``); None stays None."""
    if t is None:
        return None
    a = np.array(to_numpy(t), copy=True)  # never the torch tensor's memory (JAX may alias numpy on the CPU)
    if a.dtype == np.int64:
        a = a.astype(index_dtype)
    return jax.device_put(a, DEVICE)


def to_torch(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype in _TORCH:
        dtype, view = _TORCH[a.dtype]
        return torch.from_numpy(a.view({1: np.uint8, 2: np.int16}[a.dtype.itemsize]).copy()).view(dtype)
    return torch.from_numpy(a.copy())


def slots_to_jax(slots: torch.Tensor):
    """int64 slot mappings as int32: negative slots (skipped, whatever their value) become -1, so one below
    -2**31 is not wrapped into a valid slot. Tests of int64 mappings themselves run under x64."""
    if jax.config.jax_enable_x64:
        return to_jax(slots, np.int64)
    return to_jax(torch.where(slots < 0, -1, slots))


def _run(fn, *args, **kwargs):
    if JIT:
        return jax.jit(lambda *a: fn(*a, **kwargs))(*args)
    return fn(*args, **kwargs)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *, scale=None,
                    window_left=-1, soft_cap=0.0, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None,
                    causal=True):
    args = [to_jax(t) for t in (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                alibi_slopes, sinks, k_scale, v_scale)]

    def fn(q, kc, vc, bt, sl, qsl, alibi, sk, ks, vs):
        return kj.paged_attention(q, kc, vc, bt, sl, qsl, scale=scale, window_left=window_left, soft_cap=soft_cap,
                                  alibi_slopes=alibi, sinks=sk, k_scale=ks, v_scale=vs, causal=causal)

    out, lse = _run(fn, *args)
    last_results[:] = [out, lse]
    return to_torch(out), to_torch(lse)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None):
    args = [to_jax(t) for t in (key, value, key_cache, value_cache)] + [slots_to_jax(slot_mapping)]
    scales = dict(k_scale=to_jax(k_scale), v_scale=to_jax(v_scale))
    kc, vc = _run(kj.reshape_and_cache, *args, **scales)
    last_results[:] = [kc, vc]
    key_cache.copy_(to_torch(kc))
    value_cache.copy_(to_torch(vc))


def copy_blocks(cache, block_mapping, *, block_dim=0):
    out = _run(kj.copy_blocks, to_jax(cache), to_jax(block_mapping), block_dim=block_dim)
    last_results[:] = [out]
    cache.copy_(to_torch(out))


def gather_kv(key_cache, value_cache, block_tables, seq_lens, *, k_scale=None, v_scale=None, num_tokens=None,
              out_dtype=None):
    """``num_tokens`` None: computed from the concrete ``seq_lens`` (eagerly by the op itself; under jit
    here, since the op then sees a tracer)."""
    if num_tokens is None and JIT:
        num_tokens = int(seq_lens.sum())
    jdtype = None if out_dtype is None else jnp.dtype(to_numpy(torch.empty(0, dtype=out_dtype)).dtype)
    args = [to_jax(t) for t in (key_cache, value_cache, block_tables, seq_lens)]
    key, value = _run(kj.gather_kv, *args, k_scale=to_jax(k_scale), v_scale=to_jax(v_scale), num_tokens=num_tokens,
                      out_dtype=jdtype)
    last_results[:] = [key, value]
    return to_torch(key), to_torch(value)
