"""Finding, building and loading the kvkernels XLA FFI libraries, and registering their handlers.

* ``libkvkernels_jax.so`` (CPU) and ``libkvkernels_jax_cuda.so`` (CUDA, when it was built): the files named by
  ``$KVKERNELS_JAX_LIB`` / ``$KVKERNELS_JAX_CUDA_LIB``, else those inside the installed package (setup.py's
  build_ext puts them there in a wheel when jax is installed), else ``build-jax/`` of the checkout;
  ``build_library()`` runs ``scripts/build_jax.sh`` (what ``make jax`` runs).
* The libraries are loaded with ctypes and their handlers registered with
  ``jax.ffi.register_ffi_target`` the first time an op is traced (``load()``), not at import.

Neither the libraries nor this module import torch.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax

_ROOT = Path(__file__).resolve().parents[2]
_LOCK = threading.Lock()
_STATE: dict = {}

# op name -> symbol stem of its handlers (<stem>_cpu / <stem>_cuda) and FFI target (kvkernels_<op>)
OPS = ("paged_attention", "reshape_and_cache", "copy_blocks", "gather_kv")


def target_name(op: str) -> str:
    """The XLA custom-call target of ``op`` (the same name on every platform)."""
    return f"kvkernels_{op}"


def _find(name: str, env_var: str) -> Path:
    """``$<env_var>``; else the package's own copy (a wheel / ``pip install .``: setup.py puts the libraries
    beside this file); else ``build-jax/<name>`` of the checkout."""
    env = os.environ.get(env_var)
    if env:
        return Path(env)
    packaged = Path(__file__).resolve().parent / name
    return packaged if packaged.exists() else _ROOT / "build-jax" / name


def library_path() -> Path:
    """``$KVKERNELS_JAX_LIB``, else the installed package's ``libkvkernels_jax.so``, else
    ``build-jax/libkvkernels_jax.so`` of the checkout."""
    return _find("libkvkernels_jax.so", "KVKERNELS_JAX_LIB")


def cuda_library_path() -> Path:
    """``$KVKERNELS_JAX_CUDA_LIB``, else the installed package's ``libkvkernels_jax_cuda.so``, else
    ``build-jax/libkvkernels_jax_cuda.so`` of the checkout."""
    return _find("libkvkernels_jax_cuda.so", "KVKERNELS_JAX_CUDA_LIB")


def build_library(cuda: bool | None = None) -> Path:
    """Runs ``scripts/build_jax.sh`` (incremental) and returns the CPU library's path. ``cuda``: None builds
    the CUDA library when nvcc is found, True requires it, False skips it. Raises ``RuntimeError`` with
    the build's output when it fails."""
    script = _ROOT / "scripts" / "build_jax.sh"
    if not script.exists():
        raise RuntimeError(f"kvkernels.jax: {script} not found: build the library from a source checkout")
    env = dict(os.environ)
    env.setdefault("PY", sys.executable)
    if cuda is not None:
        env["JAX_CUDA"] = "1" if cuda else "0"
    with _LOCK:
        r = subprocess.run([str(script)], cwd=_ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"kvkernels.jax: scripts/build_jax.sh failed ({r.returncode}):\n"
                           f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return library_path()


def _register(lib: ctypes.CDLL, platform: str, suffix: str) -> None:
    for op in OPS:
        fn = getattr(lib, f"kvkernels_jax_{op}_{suffix}")
        jax.ffi.register_ffi_target(target_name(op), jax.ffi.pycapsule(fn), platform=platform)


def load() -> ctypes.CDLL:
    """The CPU library, loaded and registered once; the CUDA one too, as soon as it exists and jax has a CUDA
    backend (checked again on every call until it is loaded, so a library built after the first op call
    is picked up). Raises ``RuntimeError`` saying how to build the CPU library when it is missing."""
    with _LOCK:
        if "cpu" not in _STATE:
            path = library_path()
            if not path.exists():
                raise RuntimeError(f"kvkernels.jax: {path} does not exist: build it with `make jax` (or "
                                   f"kvkernels.jax.build_library()), or point KVKERNELS_JAX_LIB at it")
            lib = ctypes.CDLL(str(path))
            lib.kvkernels_jax_cpu_isa.restype = ctypes.c_char_p
            lib.kvkernels_jax_cpu_isa.argtypes = [ctypes.c_char_p, ctypes.c_int]
            _register(lib, "cpu", "cpu")
            _STATE["cpu"] = lib
        if "cuda" not in _STATE and cuda_library_path().exists() and _has_cuda_backend():
            culib = ctypes.CDLL(str(cuda_library_path()))
            culib.kvkernels_jax_cuda_attention_workspace.restype = ctypes.c_int64
            culib.kvkernels_jax_cuda_attention_workspace.argtypes = [ctypes.c_int64] * 11
            _register(culib, "CUDA", "cuda")
            _STATE["cuda"] = culib
        return _STATE["cpu"]


def cuda_library():
    """The loaded CUDA library, or None (not built, or jax has no CUDA backend)."""
    load()
    return _STATE.get("cuda")


def _has_cuda_backend() -> bool:
    if "has_cuda" not in _STATE:
        try:
            _STATE["has_cuda"] = bool(jax.devices("cuda"))
        except RuntimeError:
            _STATE["has_cuda"] = False
    return _STATE["has_cuda"]


def cpu_isa() -> str:
    """The SIMD path the CPU handlers use now ("avx512amx", "avx512vbmi", "avx512", "avx2" or
    "portable"): the CPU's best, or ``$KVKERNELS_CPU_ISA`` (read on every call, as by the torch ops)."""
    lib = load()
    err = ctypes.create_string_buffer(512)
    name = lib.kvkernels_jax_cpu_isa(err, len(err))
    if name is None:
        raise RuntimeError(err.value.decode())
    return name.decode()
