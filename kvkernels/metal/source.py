"""The Metal sources: where they live, how one compile unit is assembled, the parameter structs.

A compile unit is ``metal/common.h`` + the variant's ``#define`` lines + one ``metal/<family>.metal``
file, with ``#line`` directives so that Metal's, g++'s and the emulator's messages name the real file
and line. ``torch.mps.compile_shader`` compiles one string and resolves ``#include`` only against
torch's own headers, hence the concatenation. The type-check (scripts/check_metal.py) compiles
exactly the units this module builds, for every variant in ``VARIANTS``.

Kernel parameters go in one ``struct XxxParams`` per kernel, defined once in the .metal file; this
module reads its fields from the source and packs a dict of values into the struct's bytes, passed
as a list of uint8 (``arg_casts`` "uint8"), which PyTorch binds with setBytes. Field order and types
therefore live in one place.
"""

from __future__ import annotations

import functools
import itertools
import re
import struct
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _metal_dir() -> Path:
    """metal/ of a source checkout (or an editable install), else the copy a wheel carries."""
    for p in (_HERE.parents[1] / "metal", _HERE / "_sources"):
        if (p / "common.h").exists():
            return p
    return _HERE.parents[1] / "metal"


METAL_DIR = _metal_dir()
FAMILIES = ("cache_ops", "merge", "paged_attention", "mla")

# MSL storage type of each torch dtype (bf16 and fp8 are structs over their bits: common.h).
MSL_TYPES = {
    "torch.float32": "float",
    "torch.float16": "half",
    "torch.bfloat16": "bf16_t",
    "torch.float8_e4m3fn": "e4m3_t",
    "torch.float8_e5m2": "e5m2_t",
}
FLOAT_TYPES = ("float", "half", "bf16_t")
FP8_TYPES = ("e4m3_t", "e5m2_t")


def msl_type(dtype) -> str:
    return MSL_TYPES[str(dtype)]


@functools.lru_cache(maxsize=None)
def read(name: str) -> str:
    return (METAL_DIR / name).read_text()


def compile_unit(family: str, defines: dict | None = None) -> str:
    """common.h + #defines + metal/<family>.metal as one MSL string."""
    lines = ["#include <metal_stdlib>", "using namespace metal;"]
    for k, v in sorted((defines or {}).items()):
        lines.append(f"#define {k} {v}")
    lines.append('#line 1 "metal/common.h"')
    lines.append(read("common.h"))
    lines.append(f'#line 1 "metal/{family}.metal"')
    lines.append(read(f"{family}.metal"))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# parameter structs
# ---------------------------------------------------------------------------------------------

_FIELD_TYPES = {"long": "q", "ulong": "Q", "int": "i", "uint": "I", "float": "f"}


@functools.lru_cache(maxsize=None)
def struct_layout(family: str, name: str) -> tuple:
    """((field, format char, count), ...) of ``struct name`` in metal/<family>.metal."""
    src = re.sub(r"//[^\n]*", "", read(f"{family}.metal"))
    m = re.search(r"\bstruct\s+" + name + r"\s*\{(.*?)\};", src, re.S)
    if not m:
        raise KeyError(f"no struct {name} in metal/{family}.metal")
    fields = []
    for decl in m.group(1).split(";"):
        decl = decl.strip()
        if not decl:
            continue
        tm = re.match(r"(\w+)\s+(.*)$", decl, re.S)
        ctype, names = tm.group(1), tm.group(2)
        if ctype not in _FIELD_TYPES:
            raise TypeError(f"struct {name}: field type {ctype} not supported by the packer")
        for item in names.split(","):
            im = re.match(r"\s*(\w+)\s*(?:\[\s*(\d+)\s*\])?\s*$", item)
            fields.append((im.group(1), _FIELD_TYPES[ctype], int(im.group(2) or 0)))
    return tuple(fields)


def pack(family: str, name: str, **values) -> list[int]:
    """Bytes of ``struct name`` (natural alignment, as MSL lays it out) as a list of ints."""
    layout = struct_layout(family, name)
    names = {f for f, _, _ in layout}
    unknown = set(values) - names
    missing = names - set(values)
    if unknown or missing:
        raise KeyError(f"{name}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
    fmt, args = "<", []
    offset = 0
    for field, ch, count in layout:
        size = struct.calcsize("<" + ch)
        pad = (-offset) % size
        fmt += "x" * pad
        offset += pad
        if count:
            vals = list(values[field]) + [0] * (count - len(values[field]))
            fmt += ch * count
            args += vals
            offset += size * count
        else:
            fmt += ch
            args.append(values[field])
            offset += size
    fmt += "x" * ((-offset) % 8)  # the struct's alignment: its largest member (8 for long)
    return list(struct.pack(fmt, *args))


# ---------------------------------------------------------------------------------------------
# every variant the dispatch code can compile (the type-check compiles all of them)
# ---------------------------------------------------------------------------------------------


def _cache_write_variants():
    for src in FLOAT_TYPES:
        yield dict(SRC_T=src, CACHE_T=src, FP8=0)
        for fp8 in FP8_TYPES:
            yield dict(SRC_T=src, CACHE_T=fp8, FP8=1)


def _variants():
    cache_ops = [{f"WRITE_{k}": v for k, v in d.items()} for d in _cache_write_variants()]
    for cache in FLOAT_TYPES + FP8_TYPES:
        for out in FLOAT_TYPES:
            cache_ops.append(dict(GATHER_CACHE_T=cache, GATHER_OUT_T=out, GATHER_FP8=int(cache in FP8_TYPES)))
    cache_ops += [dict(COPY_ELEM_T=t) for t in ("uchar", "ushort", "uint", "ulong")]
    attention = [dict(Q_T=q, KV_T=kv, KV_FP8=int(kv in FP8_TYPES))
                 for q, kv in itertools.product(FLOAT_TYPES, FLOAT_TYPES + FP8_TYPES)
                 if kv in FP8_TYPES or kv == q]
    # Head dims above 256 (paged_attention.metal: PA_MAX_EPL 16) are variants of their own.
    wide_attention = [dict(d, PA_MAX_EPL=16) for d in attention]
    mla = [{f"CONCAT_{k}": v for k, v in d.items()} for d in _cache_write_variants()]
    mla += [dict(DEC_W_T=d["SRC_T"], DEC_CACHE_T=d["CACHE_T"], DEC_FP8=d["FP8"]) for d in _cache_write_variants()]
    mla += [dict(MLA_Q_T=d["Q_T"], MLA_KV_T=d["KV_T"], MLA_FP8=d["KV_FP8"]) for d in attention]
    return {
        "cache_ops": cache_ops,
        "merge": [dict(OUT_T=t) for t in FLOAT_TYPES],
        "paged_attention": attention + wide_attention,
        "mla": mla,
    }


VARIANTS = _variants()
