"""Builds tests/cuda_emu/emu_ops.cpp (the CUDA cache-op launchers and kernels on the CPU emulator of
cuda_emu.h) as a torch extension and loads it: torch.ops.kvkernels_emu.*. Used by
tests/test_cuda_emulated.py; also runnable directly: python tests/cuda_emu/build_emu.py."""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^;<>]*>)?)<<<(.*?)>>>\((.*?)\);", re.S)


def rewrite_launches(source: str) -> str:
    """kernel<<<grid, block, smem, stream>>>(args); -> ::emu::launch(kernel, grid, block, smem, stream, args);"""
    out, n = LAUNCH.subn(lambda m: f"::emu::launch({m.group(1)}, {m.group(2)}, {m.group(3)});", source)
    assert n > 0 and "<<<" not in out, "a launch was not rewritten"
    return out


def available() -> tuple[bool, str]:
    if not os.path.exists(os.path.join(CUDA_HOME, "include", "cuda_fp16.h")):
        return False, f"needs the CUDA headers ({CUDA_HOME}/include)"
    return True, ""


def build(verbose: bool = False):
    import torch
    from torch.utils import cpp_extension

    build_dir = os.path.join(ROOT, "build", "cuda_emu")
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(ROOT, "csrc", "cuda", "cache_ops.cu")) as f:
        rewritten = rewrite_launches(f.read())
    inc = os.path.join(build_dir, "cache_ops_emu.inc")
    if not os.path.exists(inc) or open(inc).read() != rewritten:
        with open(inc, "w") as f:
            f.write(rewritten)
    flags = ["-std=c++17", "-O1", "-g0", "-ffp-contract=off", "-fvisibility=hidden",
             "-DTORCH_TARGET_VERSION=0x020a000000000000", f"-I{build_dir}",
             f"-I{CUDA_HOME}/include", f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/include", f"-I{ROOT}/csrc/cuda"]
    sources = [os.path.join(HERE, "emu_ops.cpp")] + [os.path.join(ROOT, "csrc", f) for f in
                                                      ("prepare.cpp", "checks.cpp", "index_checks.cpp")]
    cpp_extension.load(name="kvkernels_cuda_emu", sources=sources, extra_cflags=flags, build_directory=build_dir,
                       is_python_module=False, verbose=verbose)
    return torch.ops.kvkernels_emu


if __name__ == "__main__":
    ok, why = available()
    if not ok:
        sys.exit(why)
    print(build(verbose=True))
