"""An MSL emulator for CPU tensors with the call shape of ``torch.mps.compile_shader``.

``compile_shader(source)`` returns a library whose attributes are the source's kernels;
``lib.name(*args, threads=..., group_size=..., arg_casts=...)`` binds argument i to buffer i exactly
as PyTorch's MPS library does (a tensor binds its storage at its storage offset; a Python float
becomes float32 bytes, an int int64 bytes, a list an array; ``arg_casts`` narrows them) and runs
``dispatchThreads`` semantics: ``threads`` is the grid in threads, the edge threadgroups are partial.

How: the MSL source is compiled as C++ through ``metal/shim/msl_shim.h`` with the runtime in
``metal/shim/emu_runtime.h`` (fibers, barriers, SIMD-group collectives, guarded and poisoned
threadgroup memory; its header comment describes the rules). This module rewrites each
``threadgroup T name[N];`` declaration into a reference to per-group emulator memory (line for
line, so compiler messages and reports point at the .metal lines), generates one launch function
per kernel from its signature, compiles at -O0 and caches the shared library by the hash of
everything that goes into it (``$KVKERNELS_METAL_EMU_CACHE``, default ``~/.cache/kvkernels``).

Emulation finds ordering bugs, divergent barriers, reads of inactive SIMD lanes and out-of-range
threadgroup/buffer accesses, and computes what the kernel computes in IEEE float32 with
round-to-nearest conversions. It says nothing about speed, about fast-math precision on a real GPU,
or about races between threadgroups through device memory beyond what the group order shows.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvkernels.metal.source import METAL_DIR

SHIM_DIR = METAL_DIR / "shim"
LANE_ORDERS = ("forward", "reverse", "random")
_ORDER_CODES = {name: i for i, name in enumerate(LANE_ORDERS)}


class EmulatorError(RuntimeError):
    """A kernel did something a GPU would not do reliably (or the emulator cannot run it)."""


# ---------------------------------------------------------------------------------------------
# lane order (thread-local, set by tests)
# ---------------------------------------------------------------------------------------------

_state = threading.local()


def current_lane_order() -> tuple[str, int]:
    return getattr(_state, "order", "forward"), getattr(_state, "seed", 0)


@contextlib.contextmanager
def lane_order(order: str, seed: int = 0):
    """Run the dispatches inside the block with threads (and threadgroups) started and resumed in
    ``order``: "forward", "reverse" or "random" (a permutation drawn from ``seed`` per round)."""
    if order not in _ORDER_CODES:
        raise ValueError(f"lane order must be one of {LANE_ORDERS}, got {order!r}")
    saved = current_lane_order()
    _state.order, _state.seed = order, seed
    try:
        yield
    finally:
        _state.order, _state.seed = saved


# ---------------------------------------------------------------------------------------------
# parsing and rewriting the MSL source
# ---------------------------------------------------------------------------------------------

# Builtin attribute -> the emulator thread field that holds it.
BUILTINS = {
    "thread_position_in_grid": "pos_grid",
    "thread_position_in_threadgroup": "pos_group",
    "threadgroup_position_in_grid": "group_pos",
    "threads_per_threadgroup": "group_size",
    "dispatch_threads_per_threadgroup": "dispatch_group_size",
    "threads_per_grid": "grid_size",
    "threadgroups_per_grid": "groups_per_grid",
    "thread_index_in_threadgroup": "index_in_group",
    "thread_index_in_simdgroup": "lane",
    "simdgroup_index_in_threadgroup": "simd_index",
    "simdgroups_per_threadgroup": "simds_per_group",
    "threads_per_simdgroup": None,  # always 32
}
_VECTOR_FIELDS = {"pos_grid", "pos_group", "group_pos", "group_size", "dispatch_group_size", "grid_size",
                  "groups_per_grid"}


@dataclass
class Param:
    type: str
    name: str
    attr: str
    index: int | None  # buffer index


@dataclass
class KernelSig:
    name: str
    params: list

    @property
    def num_buffers(self) -> int:
        idx = [p.index for p in self.params if p.attr == "buffer"]
        return max(idx) + 1 if idx else 0


def _strip_comments(src: str) -> str:
    """Comments replaced by spaces (newlines kept, so offsets and lines stay put)."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r"//[^\n]*|/\*.*?\*/", blank, src, flags=re.S)


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


_PARAM_RE = re.compile(r"^(?P<type>.*?)\b(?P<name>[A-Za-z_]\w*)\s*\[\[\s*(?P<attr>\w+)\s*(?:\(\s*(?P<idx>\d+)\s*\))?"
                       r"\s*\]\]$")


def parse_kernels(source: str) -> list[KernelSig]:
    """Every ``kernel void name(...)`` of the source with its parameters (each needs an attribute:
    ``[[buffer(i)]]`` or a builtin such as ``[[thread_position_in_grid]]``)."""
    code = _strip_comments(source)
    kernels = []
    for m in re.finditer(r"\bkernel\s+void\s+([A-Za-z_]\w*)\s*\(", code):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        params = []
        for raw in _split_top(code[m.end():i - 1]):
            text = " ".join(raw.split())
            pm = _PARAM_RE.match(text)
            if not pm:
                raise EmulatorError(f"kernel {m.group(1)}: cannot parse parameter {text!r} (every parameter needs "
                                    "an attribute such as [[buffer(0)]])")
            attr = pm.group("attr")
            if attr != "buffer" and attr not in BUILTINS:
                raise EmulatorError(f"kernel {m.group(1)}: attribute [[{attr}]] is not emulated")
            params.append(Param(pm.group("type").strip(), pm.group("name"), attr,
                                int(pm.group("idx")) if pm.group("idx") is not None else None))
        kernels.append(KernelSig(m.group(1), params))
    return kernels


_TG_DECL = re.compile(r"^(?P<indent>\s*)threadgroup\s+(?P<type>[A-Za-z_][\w:<>, ]*?)\s+(?P<name>[A-Za-z_]\w*)\s*"
                      r"(?P<dims>(?:\[[^\]]+\]\s*)*);\s*$")
_TG_POINTER = re.compile(r"\bthreadgroup\s+[\w:<>, ]+?\s*[*&]")


def rewrite_threadgroup(source: str) -> str:
    """``threadgroup T a[N][M];`` -> a reference to emulator memory shared by the group (one line
    each); any other use of ``threadgroup`` must be a pointer or reference type."""
    code_lines = _strip_comments(source).split("\n")
    out = []
    next_id = 0
    for line, code in zip(source.split("\n"), code_lines):
        m = _TG_DECL.match(code)
        if m and not m.group("type").rstrip().endswith(("*", "&")):
            t, name, dims = m.group("type").strip(), m.group("name"), m.group("dims").replace(" ", "")
            alloc = f'::emu::tg_alloc({next_id}, sizeof({t}{dims}), alignof({t}), "{name}")'
            if dims:
                line = f"{m.group('indent')}{t} (&{name}){dims} = *reinterpret_cast<{t} (*){dims}>({alloc});"
            else:
                line = f"{m.group('indent')}{t}& {name} = *reinterpret_cast<{t}*>({alloc});"
            next_id += 1
        else:
            for hit in re.finditer(r"\bthreadgroup\b", code):
                if not _TG_POINTER.match(code, hit.start()):
                    raise EmulatorError(f"unsupported threadgroup declaration (use `threadgroup T name[N];` on "
                                        f"one line, or a pointer/reference): {line.strip()!r}")
        out.append(line)
    return "\n".join(out)


def _arg_expr(p: Param) -> str:
    if p.attr == "buffer":
        t = p.type
        if t.endswith("&"):
            return f"*(std::remove_reference_t<{t}>*)(b[{p.index}])"
        if t.endswith("*"):
            return f"({t})(b[{p.index}])"
        raise EmulatorError(f"buffer parameter {p.name} must be a pointer or a reference, got {t!r}")
    field = BUILTINS[p.attr]
    if field is None:
        return f"({p.type})(::emu::kSimdWidth)"
    if field in _VECTOR_FIELDS:
        return f"::emu::builtin<{p.type}>(t.{field})"
    return f"({p.type})(t.{field})"


def launch_functions(kernels: list[KernelSig]) -> str:
    out = ["", "// ---- emulator launch functions (generated by kvkernels/metal/emulator.py) ----"]
    for k in kernels:
        args = ",\n      ".join(_arg_expr(p) for p in k.params)
        out.append(f"static void emu_invoke_{k.name}(::emu::Thread& t) {{\n"
                   f"  void** b = ::emu::L().bufs.data();\n  (void)b;\n  (void)t;\n"
                   f"  {k.name}(\n      {args});\n}}\n"
                   f'extern "C" int emu_launch_{k.name}(const ::emu::LaunchDesc* d, char* err, int n) {{\n'
                   f'  return ::emu::launch(d, emu_invoke_{k.name}, "{k.name}", err, n);\n}}')
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# compiling (cached by content hash)
# ---------------------------------------------------------------------------------------------


def _cxx() -> str:
    return os.environ.get("KVKERNELS_METAL_EMU_CXX", "g++")


def _cache_dir() -> Path:
    d = os.environ.get("KVKERNELS_METAL_EMU_CACHE")
    path = Path(d) if d else Path.home() / ".cache" / "kvkernels" / "metal-emu"
    path.mkdir(parents=True, exist_ok=True)
    return path


_compiler_id: dict = {}


def _compiler_version(cxx: str) -> str:
    if cxx not in _compiler_id:
        _compiler_id[cxx] = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return _compiler_id[cxx]


def compile_flags() -> list[str]:
    flags = ["-std=c++17", "-O0", "-g0", "-fPIC", "-shared", "-w", "-DMSL_EMULATOR",
             f"-I{SHIM_DIR / 'include'}", f"-I{SHIM_DIR}", "-include", "msl_shim.h"]
    if os.environ.get("KVKERNELS_METAL_EMU_ASAN") == "1":  # needs libasan preloaded into Python
        flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    return flags


def build(tu: str) -> Path:
    """Compile the translation unit to a shared library (or reuse the cached one)."""
    cxx = _cxx()
    flags = compile_flags()
    h = hashlib.sha256()
    for part in (tu, " ".join(flags), _compiler_version(cxx), (SHIM_DIR / "msl_shim.h").read_text(),
                 (SHIM_DIR / "emu_runtime.h").read_text(), (SHIM_DIR / "msl_swizzles.inc").read_text()):
        h.update(part.encode())
        h.update(b"\0")
    out = _cache_dir() / f"{h.hexdigest()[:32]}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(tu)
        lib = Path(tmp) / "kernel.so"
        res = subprocess.run([cxx, *flags, "-x", "c++", str(src), "-o", str(lib)], capture_output=True, text=True)
        if res.returncode != 0:
            raise EmulatorError(f"the emulator could not compile the kernel source:\n{res.stderr[-6000:]}")
        os.replace(lib, out)
    return out


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------


class _LaunchDesc(ctypes.Structure):
    _fields_ = [("num_args", ctypes.c_int32), ("order", ctypes.c_int32), ("seed", ctypes.c_uint64),
                ("grid", ctypes.c_uint32 * 3), ("group", ctypes.c_uint32 * 3),
                ("base", ctypes.POINTER(ctypes.c_void_p)), ("nbytes", ctypes.POINTER(ctypes.c_int64)),
                ("offset", ctypes.POINTER(ctypes.c_int64)), ("storage_id", ctypes.POINTER(ctypes.c_int32))]


_SCALAR_CASTS = {None: None, "int32": "<i", "int16": "<h", "int8": "<b", "uint8": "<B", "fp16": "<e"}


def _pack_value(value, cast: str | None) -> bytes:
    """Bytes of a Python scalar or list argument, as PyTorch's MPS library encodes them."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise EmulatorError("Empty list/tuple can not be an argument to metal kernel")
    is_float = isinstance(values[0], float)
    if cast == "bf16":
        t = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
        return t.view(torch.int16).numpy().tobytes()
    if cast is not None and cast not in _SCALAR_CASTS:
        raise EmulatorError(f"Unsupported cast instruction {cast}")
    fmt = _SCALAR_CASTS[cast] or ("<f" if is_float else "<q")
    return b"".join(struct.pack(fmt, int(v) if fmt not in ("<f", "<e") else float(v)) for v in values)


def _dims(v, name) -> list[int]:
    dims = [int(v)] if isinstance(v, int) else [int(x) for x in v]
    if not 1 <= len(dims) <= 3:
        raise EmulatorError(f"{name} must have 1 to 3 dimensions")
    return dims + [1] * (3 - len(dims))


class EmuKernel:
    def __init__(self, library: "EmuLibrary", sig: KernelSig):
        self._lib = library
        self.sig = sig
        self._fn = library._dll[f"emu_launch_{sig.name}"]
        self._fn.argtypes = [ctypes.POINTER(_LaunchDesc), ctypes.c_char_p, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    # What torch's MetalKernelFunction reports; the emulator has no register limit of its own.
    max_threads_per_threadgroup = 1024
    thread_execution_width = 32

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None):
        name = self.sig.name
        if len(args) != self.sig.num_buffers:
            raise EmulatorError(f"{name}: {len(args)} arguments given, the kernel binds {self.sig.num_buffers} buffers")
        casts = {}
        if isinstance(arg_casts, str):
            casts = {i: arg_casts for i in range(len(args))}
        elif isinstance(arg_casts, dict):
            casts = dict(arg_casts)
        elif arg_casts is not None:
            raise EmulatorError(f"Unexpected caster arg type {type(arg_casts).__name__}")
        n = len(args)
        base = (ctypes.c_void_p * n)()
        nbytes = (ctypes.c_int64 * n)()
        offset = (ctypes.c_int64 * n)()
        storage_id = (ctypes.c_int32 * n)()
        keep = []  # bytes objects alive during the call
        storages: dict[int, int] = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if a.device.type != "cpu":
                    raise EmulatorError(f"{name}: argument {i}: the emulator runs on CPU tensors, got {a.device}")
                st = a.untyped_storage()
                ptr = st.data_ptr()
                base[i] = ptr
                nbytes[i] = st.nbytes()
                offset[i] = a.storage_offset() * a.element_size()
                storage_id[i] = storages.setdefault(ptr, len(storages))
                if threads is None:
                    threads = a.numel()
            else:
                data = ctypes.create_string_buffer(_pack_value(a, casts.get(i)))
                keep.append(data)
                base[i] = ctypes.addressof(data)
                nbytes[i] = len(data.raw) - 1 or 1
                offset[i] = 0
                storage_id[i] = len(storages) + 1_000_000 + i  # never shared
        # renumber storage ids densely
        ids = {v: k for k, v in enumerate(sorted(set(storage_id[i] for i in range(n)), key=lambda x: x))}
        for i in range(n):
            storage_id[i] = ids[storage_id[i]]
        if threads is None:
            raise EmulatorError("Number of threads is undefined or has wrong dimension")
        grid = _dims(threads, "threads")
        if group_size is None:
            if not isinstance(threads, int) and len(list(threads)) > 1:
                raise EmulatorError(f"{name}: give group_size for a multi-dimensional dispatch")
            group_size = min(grid[0], self.max_threads_per_threadgroup)
        group = _dims(group_size, "group_size")
        if any(g == 0 for g in grid):
            return  # nothing to run (PyTorch's dispatch of an empty grid is a no-op too)
        order, seed = current_lane_order()
        desc = _LaunchDesc(n, _ORDER_CODES[order], seed, (ctypes.c_uint32 * 3)(*grid), (ctypes.c_uint32 * 3)(*group),
                           base, nbytes, offset, storage_id)
        err = ctypes.create_string_buffer(16384)
        if self._fn(ctypes.byref(desc), err, len(err)) != 0:
            raise EmulatorError(f"{name} (lane order {order}):\n{err.value.decode(errors='replace')}")


class EmuLibrary:
    """What ``compile_shader`` returns: kernels as attributes."""

    def __init__(self, source: str):
        self.source = source
        self.kernels = {k.name: k for k in parse_kernels(source)}
        tu = rewrite_threadgroup(source) + launch_functions(list(self.kernels.values()))
        self.path = build(tu)
        self._dll = ctypes.CDLL(str(self.path))
        self._cache: dict = {}

    def __getattr__(self, name: str) -> EmuKernel:
        kernels = self.__dict__.get("kernels", {})
        if name not in kernels:
            raise AttributeError(f"no kernel named {name!r} in this library")
        if name not in self._cache:
            self._cache[name] = EmuKernel(self, kernels[name])
        return self._cache[name]

    def __dir__(self):
        return list(self.kernels)


_libraries: dict[str, EmuLibrary] = {}
_lock = threading.Lock()


def compile_shader(source: str) -> EmuLibrary:
    """Emulator twin of ``torch.mps.compile_shader`` (cached per source text)."""
    with _lock:
        lib = _libraries.get(source)
        if lib is None:
            lib = _libraries[source] = EmuLibrary(source)
        return lib
