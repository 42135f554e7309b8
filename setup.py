"""Builds kvkernels._C with torch.utils.cpp_extension against the LibTorch stable ABI.

One build serves torch 2.10 and newer (TORCH_TARGET_VERSION = 2.10). CPU sources always build;
csrc/cuda/*.cu join automatically when the installed torch has CUDA and nvcc is found
(DESIGN.md §5). New source files need no edit here: every backend folder is globbed.
"""

import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_TARGET = "-DTORCH_TARGET_VERSION=0x020a000000000000"  # 2.10


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def build_cuda():
    import torch

    if os.environ.get("KVKERNELS_NO_CUDA") == "1":
        return False
    # Never torch.cuda.is_available(): build hosts often have no GPU.
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def extension():
    debug = os.environ.get("KVKERNELS_DEBUG_BUILD") == "1"
    # KVKERNELS_DEBUG_INFO=1: the optimized code plus DWARF (-g changes no instruction), for
    # profiles by source line and inlined function (benchmarks/decode_profile.py).
    debug_info = os.environ.get("KVKERNELS_DEBUG_INFO") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3", "-g" if debug_info else "-g0"]
    cxx = ["-std=c++17", *opt, TORCH_TARGET, "-fvisibility=hidden"]
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    srcs = sources("csrc/*.cpp") + sources("csrc/cpu/*.cpp")
    if build_cuda():
        srcs += sources("csrc/cuda/*.cu") + sources("csrc/cuda/*.cpp")
        # nvcc has no -g0 (it stops with "Unknown option"); -lineinfo keeps debug builds profilable.
        nvcc_opt = ["-O0", "-g", "-lineinfo"] if debug else ["-O3"]
        # -Xptxas=-v: the build log reports registers and spills of every kernel (gpu_validate.sh).
        nvcc = [*nvcc_opt, TORCH_TARGET, "-DUSE_CUDA", "-std=c++17", "-Xptxas=-v"]
        return cpp_extension.CUDAExtension(
            "kvkernels._C", srcs, include_dirs=include_dirs, py_limited_api=True,
            extra_compile_args={"cxx": cxx + ["-DUSE_CUDA"], "nvcc": nvcc},
        )
    return cpp_extension.CppExtension(
        "kvkernels._C", srcs, include_dirs=include_dirs, py_limited_api=True,
        extra_compile_args={"cxx": cxx},
    )


# KVKERNELS_NO_EXTENSION=1: package metadata only (an editable install whose extension is built in
# place by `setup.py build_ext --inplace`, incrementally; the Makefile's test-vllm venv uses it).
setup(
    ext_modules=[] if os.environ.get("KVKERNELS_NO_EXTENSION") == "1" else [extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
