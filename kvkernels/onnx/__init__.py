"""kvkernels in ONNX Runtime: the custom-op library, its ONNX schemas, and export from PyTorch.

``libkvkernels_ort.so`` (built by ``make ort``, docs/onnx.md) runs the CPU kernels of this package
as ONNX Runtime custom ops in the domain ``kvkernels`` (version 1): ``PagedAttention``,
``ReshapeAndCache``, ``CopyBlocks``, ``GatherKV``. This module

* finds (or builds) the library and makes ``onnxruntime.SessionOptions`` that load it
  (``session_options``, ``InferenceSession``);
* registers the ops' ONNX schemas with ``onnx.defs`` (``register_schemas``), which both the ONNX
  checker and ``torch.onnx.export(dynamo=True)`` need;
* exports PyTorch modules that call ``torch.ops.kvkernels.*`` (``export``, ``translation_table``).

Cache writes: ``torch.ops.kvkernels.reshape_and_cache`` / ``copy_blocks`` mutate their cache
arguments, which an ONNX graph cannot express. Code meant for export calls the functional forms
``write_cache`` / ``copy_cache_blocks`` below instead: they return the updated caches, and the
exporter maps them to ``ReshapeAndCache`` / ``CopyBlocks``, whose outputs ONNX Runtime aliases to
the cache inputs (the library declares the alias), so no cache is copied. In eager PyTorch these
functional forms copy the caches (they exist for export; eager code calls the in-place ops).
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Optional

import torch

from kvkernels import ops as _ops  # noqa: F401  (registers torch.ops.kvkernels.*)
from kvkernels.reference import check_bool_arg

DOMAIN = "kvkernels"
VERSION = 1
_ROOT = Path(__file__).resolve().parents[2]
_BUILD_LOCK = threading.Lock()


# ---- the library ------------------------------------------------------------------------------

def library_path() -> Path:
    """Where ``libkvkernels_ort.so`` is: ``$KVKERNELS_ORT_LIB``, else ``build-ort/`` of the checkout."""
    env = os.environ.get("KVKERNELS_ORT_LIB")
    return Path(env) if env else _ROOT / "build-ort" / "libkvkernels_ort.so"


def build_library() -> Path:
    """Runs ``scripts/build_ort.sh`` (incremental; downloads the pinned ORT headers once) and returns
    the library path. Raises ``RuntimeError`` with the build's output when it fails."""
    script = _ROOT / "scripts" / "build_ort.sh"
    if not script.exists():
        raise RuntimeError(f"kvkernels.onnx: {script} not found: build the library from a source checkout")
    with _BUILD_LOCK:
        env = dict(os.environ)
        env.setdefault("PY", _python())
        r = subprocess.run([str(script)], cwd=_ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"kvkernels.onnx: scripts/build_ort.sh failed ({r.returncode}):\n"
                           f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return library_path()


def _python() -> str:
    import sys
    return sys.executable


def session_options(library: Optional[os.PathLike] = None, *, threads: Optional[int] = None):
    """``onnxruntime.SessionOptions`` with the kvkernels ops registered (``library``: default
    ``library_path()``). ``threads`` sets the intra-op pool (the kernels' parallel work)."""
    import onnxruntime as ort
    path = Path(library) if library is not None else library_path()
    if not path.exists():
        raise FileNotFoundError(f"kvkernels.onnx: {path} does not exist; run `make ort` "
                                f"(or kvkernels.onnx.build_library())")
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(path))
    if threads is not None:
        so.intra_op_num_threads = int(threads)
    return so


def InferenceSession(model, library: Optional[os.PathLike] = None, *, threads: Optional[int] = None):
    """An ``onnxruntime.InferenceSession`` (CPU) of ``model`` (path, bytes or ``onnx.ModelProto``) that
    can run the kvkernels ops."""
    import onnxruntime as ort
    if not isinstance(model, (str, bytes, os.PathLike)):
        model = model.SerializeToString()
    if isinstance(model, os.PathLike):
        model = str(model)
    return ort.InferenceSession(model, session_options(library, threads=threads),
                                providers=["CPUExecutionProvider"])


# ---- ONNX schemas -----------------------------------------------------------------------------

_FLOAT = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_CACHE = _FLOAT + ["tensor(float8e4m3fn)", "tensor(float8e5m2)"]


def _schemas():
    from onnx.defs import OpSchema
    Opt = OpSchema.FormalParameterOption.Optional

    def inp(name, ty, doc, optional=False):
        if optional:
            return OpSchema.FormalParameter(name, ty, doc, param_option=Opt)
        return OpSchema.FormalParameter(name, ty, doc)

    def attr(name, kind, doc):
        return OpSchema.Attribute(name, kind, doc, required=False)

    f32 = "tensor(float)"
    attention = OpSchema(
        "PagedAttention", DOMAIN, VERSION,
        doc="Paged attention (decode, or varlen with query_start_loc), as kvkernels.paged_attention.",
        inputs=[inp("query", "T", "[T, Hq, D]"), inp("key_cache", "C", "[N, B, Hkv, D]"),
                inp("value_cache", "C", "[N, B, Hkv, D]"), inp("block_tables", "tensor(int32)", "[S, M]"),
                inp("seq_lens", "tensor(int32)", "[S]"),
                inp("query_start_loc", "tensor(int32)", "[S + 1]", True),
                inp("alibi_slopes", f32, "[Hq]", True), inp("sinks", f32, "[Hq]", True),
                inp("k_scale", f32, "[1] or [Hkv] (fp8 caches)", True),
                inp("v_scale", f32, "[1] or [Hkv] (fp8 caches)", True)],
        outputs=[inp("out", "T", "[T, Hq, D]"), inp("lse", f32, "[T, Hq]")],
        type_constraints=[("T", _FLOAT, "query/output"), ("C", _CACHE, "caches")],
        attributes=[attr("scale", OpSchema.AttrType.FLOAT, "default D ** -0.5"),
                    attr("window_left", OpSchema.AttrType.INT, "-1: off"),
                    attr("soft_cap", OpSchema.AttrType.FLOAT, "0: off"),
                    attr("causal", OpSchema.AttrType.INT,
                         "1 (default): bottom-right causal; 0: every query sees all of its sequence's keys")])
    write = OpSchema(
        "ReshapeAndCache", DOMAIN, VERSION,
        doc="Writes key/value rows into their slots; outputs are the caches, updated in place "
            "(ONNX Runtime aliases each output to its cache input).",
        inputs=[inp("key", "T", "[T, H, D]"), inp("value", "T", "[T, H, D]"),
                inp("key_cache", "C", "[N, B, H, D]"), inp("value_cache", "C", "[N, B, H, D]"),
                inp("slot_mapping", "tensor(int64)", "[T]"), inp("k_scale", f32, "fp8", True),
                inp("v_scale", f32, "fp8", True)],
        outputs=[inp("key_cache_out", "C", "key_cache"), inp("value_cache_out", "C", "value_cache")],
        type_constraints=[("T", _FLOAT, "new rows"), ("C", _CACHE, "caches")])
    copy = OpSchema(
        "CopyBlocks", DOMAIN, VERSION,
        doc="Copies blocks (src, dst) of a cache in place; the output aliases the cache input.",
        inputs=[inp("cache", "C", "any shape"), inp("block_mapping", "tensor(int64)", "[n, 2]")],
        outputs=[inp("cache_out", "C", "cache")],
        type_constraints=[("C", _CACHE + ["tensor(int8)", "tensor(uint8)"], "cache")],
        attributes=[attr("block_dim", OpSchema.AttrType.INT, "dimension that indexes blocks (0)")])
    gather = OpSchema(
        "GatherKV", DOMAIN, VERSION,
        doc="Paged -> contiguous K/V [sum(seq_lens), H, D], as kvkernels.gather_kv.",
        inputs=[inp("key_cache", "C", "[N, B, H, D]"), inp("value_cache", "C", "[N, B, H, D]"),
                inp("block_tables", "tensor(int32)", "[S, M]"), inp("seq_lens", "tensor(int32)", "[S]"),
                inp("k_scale", f32, "fp8", True), inp("v_scale", f32, "fp8", True)],
        outputs=[inp("key", "T", "[sum(seq_lens), H, D]"), inp("value", "T", "[sum(seq_lens), H, D]")],
        type_constraints=[("C", _CACHE, "caches"), ("T", _FLOAT, "outputs")],
        attributes=[attr("out_dtype", OpSchema.AttrType.INT,
                         "ONNX element type of the outputs (default: the cache's, bfloat16 for fp8)")])
    return [attention, write, copy, gather]


def register_schemas() -> None:
    """Registers the kvkernels op schemas with ``onnx.defs`` (idempotent). Needed before
    ``torch.onnx.export(dynamo=True)`` of a model that calls the ops, and by ``onnx.checker``."""
    import onnx.defs
    for schema in _schemas():
        if not onnx.defs.has(schema.name, schema.domain):
            onnx.defs.register_schema(schema)


# ---- functional cache writes (for export) ------------------------------------------------------

@torch.library.custom_op("kvkernels_onnx::write_cache", mutates_args=())
def write_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reshape_and_cache`` returning the updated caches (copies in eager mode; in ONNX Runtime the
    outputs are the cache buffers themselves)."""
    kc, vc = key_cache.clone(), value_cache.clone()
    torch.ops.kvkernels.reshape_and_cache(key, value, kc, vc, slot_mapping)
    return kc, vc


@write_cache.register_fake
def _(key, value, key_cache, value_cache, slot_mapping):
    return torch.empty_like(key_cache), torch.empty_like(value_cache)


@torch.library.custom_op("kvkernels_onnx::copy_cache_blocks", mutates_args=())
def copy_cache_blocks(cache: torch.Tensor, block_mapping: torch.Tensor, block_dim: int = 0) -> torch.Tensor:
    """``copy_blocks`` returning the updated cache (a copy in eager mode, in place in ONNX Runtime)."""
    out = cache.clone()
    torch.ops.kvkernels.copy_blocks(out, block_mapping, block_dim)
    return out


@copy_cache_blocks.register_fake
def _(cache, block_mapping, block_dim=0):
    return torch.empty_like(cache)


# ---- export -----------------------------------------------------------------------------------

def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``: the kvkernels torch ops
    (and the functional writes above) to the ONNX ops of the domain ``kvkernels``."""
    from onnxscript import values
    register_schemas()
    kv = values.Opset(DOMAIN, VERSION)

    def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None,
                        scale=None, window_left=-1, soft_cap=0.0, alibi_slopes=None, sinks=None,
                        k_scale=None, v_scale=None, causal=True):
        check_bool_arg("paged_attention", "causal", causal)  # None is not the default True
        attrs = {"window_left": int(window_left), "soft_cap": float(soft_cap), "causal": int(bool(causal))}
        if scale is not None:
            attrs["scale"] = float(scale)
        return kv.PagedAttention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                 alibi_slopes, sinks, k_scale, v_scale, _outputs=2, **attrs)

    def write(key, value, key_cache, value_cache, slot_mapping):
        return kv.ReshapeAndCache(key, value, key_cache, value_cache, slot_mapping, _outputs=2)

    def copy(cache, block_mapping, block_dim=0):
        return kv.CopyBlocks(cache, block_mapping, block_dim=int(block_dim))

    def gather(key_cache, value_cache, block_tables, seq_lens, k_scale=None, v_scale=None, num_tokens=None,
               out_dtype=None):
        attrs = {} if out_dtype is None else {"out_dtype": int(_onnx_type(out_dtype))}
        return kv.GatherKV(key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, _outputs=2, **attrs)

    return {torch.ops.kvkernels.paged_attention.default: paged_attention,
            torch.ops.kvkernels_onnx.write_cache.default: write,
            torch.ops.kvkernels_onnx.copy_cache_blocks.default: copy,
            torch.ops.kvkernels.gather_kv.default: gather}


def _onnx_type(dtype: torch.dtype) -> int:
    import onnx
    return {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
            torch.bfloat16: onnx.TensorProto.BFLOAT16}[dtype]


def _type_outputs(model, exported_program) -> None:
    """Gives untyped graph outputs the element type torch traced for them. The exporter leaves outputs
    whose shape has a data-dependent size (GatherKV's sum(seq_lens)) without a type, which
    onnx.checker rejects (ONNX Runtime would infer it)."""
    import onnx
    out_node = next(n for n in exported_program.graph.nodes if n.op == "output")
    vals = [getattr(a, "meta", {}).get("val") for a in out_node.args[0]]
    if len(vals) != len(model.graph.output):
        return
    types = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
             torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: onnx.TensorProto.INT64,
             torch.int32: onnx.TensorProto.INT32, torch.float8_e4m3fn: onnx.TensorProto.FLOAT8E4M3FN,
             torch.float8_e5m2: onnx.TensorProto.FLOAT8E5M2}
    for out, val in zip(model.graph.output, vals):
        if not out.type.HasField("tensor_type") and val is not None and val.dtype in types:
            out.type.tensor_type.elem_type = types[val.dtype]
            out.type.tensor_type.shape.dim.add().dim_param = "num_tokens"
            for size in val.shape[1:]:
                dim = out.type.tensor_type.shape.dim.add()
                if isinstance(size, int):
                    dim.dim_value = size
                else:
                    dim.dim_param = str(size)
    untyped = [vi for vi in model.graph.value_info if not vi.type.HasField("tensor_type")]
    for vi in untyped:
        model.graph.value_info.remove(vi)


def export(module: torch.nn.Module, args: tuple, path: Optional[os.PathLike] = None, *,
           input_names=None, output_names=None, dynamic_shapes=None, optimize: bool = True):
    """``torch.onnx.export(dynamo=True)`` with the kvkernels translation table and schemas; returns
    the ``onnx.ModelProto`` (also saved to ``path`` when given). Dimensions named in
    ``dynamic_shapes`` stay symbolic in the graph."""
    register_schemas()
    program = torch.onnx.export(module, args, dynamo=True, custom_translation_table=translation_table(),
                                input_names=input_names, output_names=output_names,
                                dynamic_shapes=dynamic_shapes, optimize=optimize, verbose=False,
                                report=False)
    model = program.model_proto
    _type_outputs(model, program.exported_program)
    if path is not None:
        import onnx
        onnx.save(model, str(path))
    return model


__all__ = ["DOMAIN", "VERSION", "library_path", "build_library", "session_options", "InferenceSession",
           "register_schemas", "write_cache", "copy_cache_blocks", "translation_table", "export"]
