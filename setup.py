"""Builds kvkernels._C with torch.utils.cpp_extension against the LibTorch stable ABI.

One build serves torch 2.10 and newer (TORCH_TARGET_VERSION = 2.10). CPU sources always build;
csrc/cuda/*.cu join automatically when the installed torch has CUDA and an nvcc of the same CUDA
major version is found (docs/design.md §10). New source files need no edit here: every backend folder is
globbed.
"""

import glob
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points

import setuptools
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_TARGET = "-DTORCH_TARGET_VERSION=0x020a000000000000"  # 2.10
# pip builds a wheel through these commands (dist_info: the metadata step; editable_wheel: `-e`).
WHEEL_COMMANDS = ("bdist_wheel", "dist_info", "editable_wheel")


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def wheel_support_error(commands, setuptools_version, has_bdist_wheel):
    """The message to stop with when a wheel is asked for and nothing provides bdist_wheel, else None.

    setuptools has bdist_wheel from 70.1 on; older ones take it from the `wheel` package. A Python
    3.10/3.11 venv starts with setuptools 65.5 and no `wheel`, torch < 2.13 does not upgrade it, and
    `pip install --no-build-isolation` installs no build requirement (pyproject.toml's are ignored),
    so setuptools would stop with "invalid command 'bdist_wheel'" without saying what is missing.
    """
    if has_bdist_wheel or not any(c in WHEEL_COMMANDS for c in commands):
        return None
    return (f"kvkernels: setuptools {setuptools_version} cannot build a wheel without the `wheel` "
            "package, and `pip install --no-build-isolation` installs no build requirements. Run "
            "`pip install wheel` (or `pip install 'setuptools>=70.1'`) in this environment, then retry.")


def has_bdist_wheel():
    """Whether setuptools (>= 70.1) or the `wheel` package registers the bdist_wheel command (the entry
    points setuptools looks commands up in)."""
    return any(ep.name == "bdist_wheel" for ep in entry_points(group="distutils.commands"))


def limited_api_tag(hexversion=getattr(cpp_extension, "min_supported_cpython", "0x030A0000")):
    """The wheel's Python tag: the Py_LIMITED_API value torch compiles the extension with
    (-DPy_LIMITED_API=0x030A0000 -> cp310, matching requires-python >= 3.10)."""
    v = int(hexversion, 16)
    return f"cp{v >> 24}{(v >> 16) & 0xFF}"


def nvcc_release(nvcc):
    """(major, minor) from `nvcc --version` ("release 13.0"), or None if it does not say."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m[1]), int(m[2])) if m else None


def cuda_plan(torch_cuda, nvcc, nvcc_version, no_cuda):
    """(build the CUDA sources?, warning or None) from torch.version.cuda, the nvcc path (None: not
    found), its (major, minor) (None: unknown) and KVKERNELS_NO_CUDA=1.

    torch.utils.cpp_extension refuses to compile CUDA sources with an nvcc whose major version
    differs from torch's (a RuntimeError, "The detected CUDA version (13.0) mismatches ...": e.g.
    PyPI's torch 2.10 is CUDA 12.8); a minor difference only warns. The CPU kernels do not depend on
    CUDA, so a mismatch builds them alone, with a warning, instead of failing the install.
    """
    if no_cuda or torch_cuda is None:
        return False, None
    hint = "set KVKERNELS_NO_CUDA=1 to build the CPU kernels without this warning"
    if nvcc is None:
        return False, (f"kvkernels: torch has CUDA {torch_cuda} but no nvcc was found (CUDA_HOME / PATH): "
                       f"building the CPU kernels only; {hint}.")
    torch_major = int(torch_cuda.split(".")[0])
    if nvcc_version is None or nvcc_version[0] == torch_major:
        return True, None
    return False, (f"kvkernels: {nvcc} is CUDA {nvcc_version[0]}.{nvcc_version[1]} but torch was built with "
                   f"CUDA {torch_cuda}; torch.utils.cpp_extension does not compile across CUDA major "
                   f"versions: building the CPU kernels only. To build the CUDA kernels, point "
                   f"CUDA_HOME at a CUDA {torch_major}.x toolkit (or install a torch built for CUDA "
                   f"{nvcc_version[0]}); {hint}.")


# KVKERNELS_SANITIZE=1: the CPU extension under AddressSanitizer and UndefinedBehaviorSanitizer, for
# `make sanitize` (scripts/sanitize.sh builds it into build-asan/, never in place).
SANITIZE = os.environ.get("KVKERNELS_SANITIZE") == "1"
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
# KVKERNELS_AMX_EMU=1: the CPU extension with the AMX tile instructions emulated (tests/amx_emu/amx_emu.h),
# for `make amx-emu-test` on CPUs without AMX (scripts/amx_emu.sh builds it into build-amx-emu/).
AMX_EMU = os.environ.get("KVKERNELS_AMX_EMU") == "1"


# The GPU architectures the CUDA kernels are written, compile-checked (make cuda-check) and tested for:
# sm_80 (A100; its SASS also runs on the other 8.x GPUs: A10, L4, ...) and sm_90a (H100 / H200: the
# Hopper-only instructions need the "a" target, which torch's own default of "9.0" would not give).
DEFAULT_CUDA_ARCHS = "8.0;9.0a"


def cuda_arch_plan(arch_list, visible):
    """(TORCH_CUDA_ARCH_LIST to build with, message or None) from the variable's value (None: unset) and
    the (major, minor) capabilities of the visible GPUs.

    Unset, torch derives the list from the visible GPUs: with none (login nodes, CI boxes, docker
    builds) the list is empty and torch.utils.cpp_extension stops with "IndexError: list index out of
    range" in _get_cuda_arch_flags; with a GPU it builds for that one alone (an H100: sm_90, not the
    sm_90a this project checks and tests). So an unset list means this project's architectures, said
    aloud; a set one is the user's and is kept.
    """
    if arch_list and arch_list.strip():
        return arch_list, None
    message = (f"kvkernels: TORCH_CUDA_ARCH_LIST is not set: building the CUDA kernels for "
               f"TORCH_CUDA_ARCH_LIST=\"{DEFAULT_CUDA_ARCHS}\" (sm_80: A100 and the other 8.x GPUs; sm_90a: "
               f"H100 / H200). Set TORCH_CUDA_ARCH_LIST to choose others, KVKERNELS_NO_CUDA=1 to build the "
               f"CPU kernels only.")
    other = sorted({c for c in visible if c[0] not in (8, 9)})
    if other:
        names = ", ".join(f"sm_{a}{b}" for a, b in other)
        message += (f" The visible GPU ({names}) runs none of these: build for it with "
                    f"TORCH_CUDA_ARCH_LIST=\"8.0+PTX\" (compiled by the driver at load; never tested here).")
    return DEFAULT_CUDA_ARCHS, message


def visible_capabilities():
    """The (major, minor) of each GPU torch sees: none on a machine without one (no error)."""
    import torch

    try:
        return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    except (RuntimeError, AssertionError):
        return []


def nvcc_top(nvcc):
    """The toolkit directory nvcc itself runs from (its `TOP` in `nvcc --dryrun`), or None. A wrapper
    script on PATH (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`) makes torch take its folder's parent
    (/usr/local) for CUDA_HOME, where there is no include/cuda_runtime_api.h and no lib64/libcudart."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ TOP=(.+?)\s*$", out.stdout + out.stderr, re.M)
    return os.path.normpath(m[1]) if m else None


def cuda_toolkit_root(candidates):
    """The first of `candidates` (CUDA_HOME, nvcc's own TOP, /usr/local/cuda; None entries skipped) that
    holds the CUDA runtime headers, or None."""
    for root in candidates:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime_api.h")):
            return root
    return None


def build_cuda():
    import torch

    no_cuda = os.environ.get("KVKERNELS_NO_CUDA") == "1" or SANITIZE or AMX_EMU
    # Never torch.cuda.is_available(): build hosts often have no GPU.
    nvcc = None
    if cpp_extension.CUDA_HOME is not None:
        nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
        nvcc = nvcc if os.path.exists(nvcc) else None
    version = nvcc_release(nvcc) if nvcc and not no_cuda and torch.version.cuda else None
    build, warning = cuda_plan(torch.version.cuda, nvcc, version, no_cuda)
    if build:
        root = cuda_toolkit_root([cpp_extension.CUDA_HOME, nvcc_top(nvcc), "/usr/local/cuda"])
        if root is None:
            build, warning = False, (f"kvkernels: no cuda_runtime_api.h under {cpp_extension.CUDA_HOME}/include "
                                     f"(nor where {nvcc} runs from, nor /usr/local/cuda): building the CPU "
                                     "kernels only; set CUDA_HOME to the CUDA toolkit to build the CUDA kernels, "
                                     "or KVKERNELS_NO_CUDA=1 to build the CPU kernels without this warning.")
        elif root != cpp_extension.CUDA_HOME:
            print(f"kvkernels: CUDA toolkit at {root} (where {nvcc} runs from; {cpp_extension.CUDA_HOME} has no "
                  "CUDA headers)", file=sys.stderr)
            cpp_extension.CUDA_HOME = root  # read when CUDAExtension() lists the include and library dirs
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr)
    if build:
        arch_list, message = cuda_arch_plan(os.environ.get("TORCH_CUDA_ARCH_LIST"), visible_capabilities())
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list  # read by torch.utils.cpp_extension when it compiles
        if message:
            print(message, file=sys.stderr)
    return build


# The C++ runtime is linked as the shared libstdc++.so.6, named explicitly. A compiler set up to link
# it statically (-static-libstdc++, as the GPU machine's CXX=/opt/gcc/bin/g++ does) would otherwise
# put a second copy into _C beside the one torch loads: the two keep separate locale facet ids, so the
# first `ostream << int` of an error message or output size crashed (SIGSEGV in every op that formats
# a number; seen on the H100, 2026-11-26). Listed before the compiler's own libraries, the shared
# library resolves every libstdc++ symbol and the static archive contributes nothing.
# Linux only: macOS (the Metal build) links libc++ through clang, and has no readelf.
SHARED_CXX_RUNTIME = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []


def needed_libraries(readelf_dynamic):
    """The DT_NEEDED names in `readelf -d` output."""
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf_dynamic)


def cxx_runtime_error(path, readelf_dynamic):
    """Why the built extension is unusable, or None: it must load the shared libstdc++ (see above)."""
    if any(n.startswith("libstdc++.so") for n in needed_libraries(readelf_dynamic)):
        return None
    return (f"{path} does not load libstdc++.so: the compiler linked the C++ runtime statically, so it "
            "would crash beside torch's. Build with a compiler that links it shared (CXX=/usr/bin/g++).")


def jax_plan(jax_installed, no_jax, sanitize_or_emu):
    """Whether build_ext also builds kvkernels.jax's XLA FFI libraries (docs/jax.md): when jax is installed
    (its FFI headers come from jaxlib), unless KVKERNELS_NO_JAX=1 or the build is a sanitizer / AMX-emulator
    one (those test the torch extension alone)."""
    return jax_installed and not no_jax and not sanitize_or_emu


def jax_installed():
    try:
        import jax.ffi  # noqa: F401
    except ImportError:
        return False
    return True


def build_jax_libraries(cuda):
    """Runs scripts/build_jax.sh (what `make jax` runs; incremental, into build-jax/) with this python and
    returns the paths of the libraries it built: the CPU one, and the CUDA one when `cuda` (the torch
    extension's CUDA kernels are built, so nvcc is there)."""
    env = dict(os.environ, PY=sys.executable, JAX_CUDA="1" if cuda else "0")
    subprocess.run([os.path.join(ROOT, "scripts", "build_jax.sh")], cwd=ROOT, env=env, check=True)
    names = ["libkvkernels_jax.so"] + (["libkvkernels_jax_cuda.so"] if cuda else [])
    return [os.path.join(ROOT, "build-jax", n) for n in names]


class BuildExtension(cpp_extension.BuildExtension):
    """torch's build_ext, plus a check of the linked C++ runtime of every built extension, plus
    kvkernels.jax's libraries when jax is installed (`jax_plan`). In place (a checkout, `pip install -e`)
    they stay in build-jax/, where kvkernels.jax looks in a checkout; in a wheel / `pip install .` they
    go inside the package (kvkernels/jax/), where it looks first."""

    def run(self):
        super().run()
        if not jax_plan(jax_installed(), os.environ.get("KVKERNELS_NO_JAX") == "1", SANITIZE or AMX_EMU):
            return
        cuda = any(isinstance(e, setuptools.Extension) and any(s.endswith(".cu") for s in e.sources)
                   for e in self.extensions)
        libraries = build_jax_libraries(cuda)
        if not self.inplace:
            target = os.path.join(self.build_lib, "kvkernels", "jax")
            os.makedirs(target, exist_ok=True)
            for path in libraries:
                self.copy_file(path, os.path.join(target, os.path.basename(path)))

    def build_extension(self, ext):
        super().build_extension(ext)
        if not SHARED_CXX_RUNTIME:
            return
        path = self.get_ext_fullpath(ext.name)
        try:
            dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                                     check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"WARNING: the C++ runtime of {path} is not checked (readelf: {e})", file=sys.stderr)
            return
        error = cxx_runtime_error(path, dynamic)
        if error:
            raise RuntimeError(error)


def extension():
    debug = os.environ.get("KVKERNELS_DEBUG_BUILD") == "1"
    # KVKERNELS_DEBUG_INFO=1: the optimized code plus DWARF (-g changes no instruction), for
    # profiles by source line and inlined function (benchmarks/decode_profile.py).
    debug_info = os.environ.get("KVKERNELS_DEBUG_INFO") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3", "-g" if debug_info else "-g0"]
    if SANITIZE:
        opt = ["-O1", "-g", *SANITIZE_FLAGS]
    cxx = ["-std=c++17", *opt, TORCH_TARGET, "-fvisibility=hidden"]
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    if AMX_EMU:
        cxx.append("-DKVKERNELS_AMX_EMU")
        include_dirs.append(os.path.join(ROOT, "tests", "amx_emu"))
    srcs = sources("csrc/*.cpp") + sources("csrc/cpu/*.cpp")
    if build_cuda():
        srcs += sources("csrc/cuda/*.cu") + sources("csrc/cuda/*.cpp")
        # nvcc has no -g0 (it stops with "Unknown option"). -lineinfo adds source-line tables and
        # changes no instruction (the sm_90a SASS of attention_f32.cu is identical with and without
        # it; the cubin is ~2.8x larger): Nsight Compute's source counters then name the lines where
        # warps stall (scripts/probe/gpu_profile.sh), as flash-attention's builds do.
        nvcc_opt = ["-O0", "-g", "-lineinfo"] if debug else ["-O3", "-lineinfo"]
        # -Xptxas=-v: the build log reports registers and spills of every kernel (gpu_validate.sh).
        nvcc = [*nvcc_opt, TORCH_TARGET, "-DUSE_CUDA", "-std=c++17", "-Xptxas=-v"]
        return cpp_extension.CUDAExtension(
            "kvkernels._C", srcs, include_dirs=include_dirs, py_limited_api=True,
            extra_compile_args={"cxx": cxx + ["-DUSE_CUDA"], "nvcc": nvcc},
            extra_link_args=SHARED_CXX_RUNTIME,
        )
    return cpp_extension.CppExtension(
        "kvkernels._C", srcs, include_dirs=include_dirs, py_limited_api=True,
        extra_compile_args={"cxx": cxx},
        extra_link_args=SHARED_CXX_RUNTIME + (SANITIZE_FLAGS if SANITIZE else []),
    )


if __name__ == "__main__":  # also under pip: setuptools.build_meta runs this file as __main__
    error = wheel_support_error(sys.argv[1:], setuptools.__version__, has_bdist_wheel())
    if error:
        sys.exit(error)
    # KVKERNELS_NO_EXTENSION=1: package metadata only (an editable install whose extension is built in
    # place by `setup.py build_ext --inplace`, incrementally; the Makefile's test-vllm venv uses it).
    setup(
        ext_modules=[] if os.environ.get("KVKERNELS_NO_EXTENSION") == "1" else [extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        # abi3 wheel for CPython >= 3.10: the limited API version torch compiles with.
        options={"bdist_wheel": {"py_limited_api": limited_api_tag()}},
    )
