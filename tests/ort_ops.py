"""The kvkernels ONNX Runtime ops (libkvkernels_ort.so) called like ``kvkernels.ops``: each call builds a
one-node ONNX graph, binds torch tensors' memory to it (IOBinding, no copies), and runs it, so the tests
can hold ORT's results against ``kvkernels.reference`` exactly as they hold the torch ops.

Outputs are bound to preallocated, NaN-poisoned tensors (a value the op does not write stays NaN); caches
an op updates are bound as both the cache input and its aliased output, so the update lands in the
caller's tensor. ``last_output_ptrs`` records where ORT put each output (the in-place tests read it).
"""

from __future__ import annotations

import functools

import onnx
import onnxruntime as ort
import torch
from onnx import helper

import kvkernels.onnx as konnx

ONNX_TYPE = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
             torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.float8_e4m3fn: onnx.TensorProto.FLOAT8E4M3FN,
             torch.float8_e5m2: onnx.TensorProto.FLOAT8E5M2, torch.int32: onnx.TensorProto.INT32,
             torch.int64: onnx.TensorProto.INT64, torch.uint8: onnx.TensorProto.UINT8,
             torch.float64: onnx.TensorProto.DOUBLE}
_AS_NUMPY = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}

last_output_ptrs: list[int] = []
_library = None


def use_library(path) -> None:
    global _library
    _library = str(path)
    _session.cache_clear()


def ortvalue(t: torch.Tensor) -> ort.OrtValue:
    """An OrtValue over ``t``'s memory (``t`` must be contiguous: ORT tensors are dense)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    raw = t.view(_AS_NUMPY[t.dtype]) if t.dtype in _AS_NUMPY else t
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw.numpy(), ONNX_TYPE[t.dtype])


def _info(name, t):
    return helper.make_tensor_value_info(name, ONNX_TYPE[t.dtype], list(t.shape))


@functools.lru_cache(maxsize=64)
def _session(model_bytes: bytes):
    return ort.InferenceSession(model_bytes, konnx.session_options(_library, threads=2),
                                providers=["CPUExecutionProvider"])


def run(op: str, inputs: list, outputs: list, **attrs):
    """Runs ``op`` with ``inputs`` [(name, tensor or None)] into ``outputs`` [(name, tensor, input name it
    aliases or None)]; returns the output tensors."""
    in_names = [name if t is not None else "" for name, t in inputs]
    node = helper.make_node(op, in_names, [name for name, _, _ in outputs], domain=konnx.DOMAIN,
                            **{k: v for k, v in attrs.items() if v is not None})
    graph = helper.make_graph([node], op, [_info(n, t) for n, t in inputs if t is not None],
                              [_info(n, t) for n, t, _ in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(konnx.DOMAIN, konnx.VERSION)])
    sess = _session(model.SerializeToString())
    io = sess.io_binding()
    values = {}
    for name, t in inputs:
        if t is not None:
            values[name] = ortvalue(t)
            io.bind_ortvalue_input(name, values[name])
    for name, t, alias in outputs:
        io.bind_ortvalue_output(name, values[alias] if alias else ortvalue(t))
    sess.run_with_iobinding(io)
    last_output_ptrs[:] = [v.data_ptr() for v in io.get_outputs()]
    return [t for _, t, _ in outputs]


def _dense(t):
    return None if t is None else t.contiguous()


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *, scale=None,
                    window_left=-1, soft_cap=0.0, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None,
                    causal=True):
    t, hq, d = query.shape
    out = torch.full((t, hq, d), float("nan"), dtype=query.dtype)
    lse = torch.full((t, hq), float("nan"), dtype=torch.float32)
    ins = [("query", _dense(query)), ("key_cache", key_cache), ("value_cache", value_cache),
           ("block_tables", _dense(block_tables)), ("seq_lens", _dense(seq_lens)),
           ("query_start_loc", _dense(query_start_loc)), ("alibi_slopes", _dense(alibi_slopes)),
           ("sinks", _dense(sinks)), ("k_scale", _dense(k_scale)), ("v_scale", _dense(v_scale))]
    return tuple(run("PagedAttention", ins, [("out", out, None), ("lse", lse, None)],
                     scale=None if scale is None else float(scale), window_left=int(window_left),
                     soft_cap=float(soft_cap), causal=int(causal)))


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None):
    ins = [("key", _dense(key)), ("value", _dense(value)), ("key_cache", key_cache),
           ("value_cache", value_cache), ("slot_mapping", _dense(slot_mapping)), ("k_scale", _dense(k_scale)),
           ("v_scale", _dense(v_scale))]
    run("ReshapeAndCache", ins, [("key_cache_out", key_cache, "key_cache"),
                                 ("value_cache_out", value_cache, "value_cache")])


def copy_blocks(cache, block_mapping, *, block_dim=0):
    run("CopyBlocks", [("cache", cache), ("block_mapping", _dense(block_mapping))],
        [("cache_out", cache, "cache")], block_dim=int(block_dim))


def gather_kv(key_cache, value_cache, block_tables, seq_lens, *, k_scale=None, v_scale=None, num_tokens=None,
              out_dtype=None):
    """``num_tokens`` is not an input of GatherKV (ORT sizes outputs at run time): ignored."""
    n = int(seq_lens.sum())
    fp8 = key_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    dtype = out_dtype or (torch.bfloat16 if fp8 else key_cache.dtype)
    shape = (n, key_cache.shape[2], key_cache.shape[3])
    key = torch.full(shape, float("nan"), dtype=dtype)
    value = torch.full(shape, float("nan"), dtype=dtype)
    ins = [("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", _dense(block_tables)),
           ("seq_lens", _dense(seq_lens)), ("k_scale", _dense(k_scale)), ("v_scale", _dense(v_scale))]
    return tuple(run("GatherKV", ins, [("key", key, None), ("value", value, None)],
                     out_dtype=None if out_dtype is None else ONNX_TYPE[out_dtype]))
