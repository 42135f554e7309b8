"""Builds tests/cuda_emu/emu_ops.cpp (the CUDA cache-op launchers and kernels on the CPU emulator of
cuda_emu.h), the paged-attention sources of csrc/cuda (attention.cu and the per-dtype instance files)
and the MLA sources (mla_attention*.cu, mla_decompress.cu and their headers) as one torch extension,
every launch rewritten to ::emu::launch and every `extern __shared__` array to the emulator's per-CTA
buffer, and loads it: torch.ops.kvkernels_emu.*. Used by tests/test_cuda_emulated.py; also runnable
directly: python tests/cuda_emu/build_emu.py."""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\[\];")
# The attention sources: compiled translation units and the headers they include.
ATTN_UNITS = ("attention.cu", "attention_f32.cu", "attention_f16.cu", "attention_bf16.cu", "attention_f16_e4m3.cu",
              "attention_f16_e5m2.cu", "attention_bf16_e4m3.cu", "attention_bf16_e5m2.cu", "attention_sm90_bf16.cu",
              "attention_sm90_f16.cu", "attention_sm90_bf16_fp8.cu", "attention_sm90_f16_fp8.cu")
ATTN_HEADERS = ("attention_api.cuh", "attention_common.cuh", "attention_launch.cuh", "attention_merge.cuh",
                "attention_mma.cuh", "attention_simt.cuh", "attention_sm90.cuh", "sm90_ptx.cuh")
# The MLA sources (attention: planner, per-q-dtype instances, merge; decompress: launcher and GEMM).
MLA_UNITS = ("mla_attention.cu", "mla_attention_f16.cu", "mla_attention_bf16.cu", "mla_attention_simt.cu",
             "mla_attention_sm90_f16.cu", "mla_attention_sm90_bf16.cu",
             "mla_decompress.cu", "mla_decompress_sm90_f16.cu", "mla_decompress_sm90_bf16.cu")
MLA_HEADERS = ("mla_api.h", "mla_common.cuh", "mla_attention_launch.cuh", "mla_attention_mma.cuh",
               "mla_attention_simt.cuh", "mla_merge.cuh", "mla_sched.cuh", "mla_decompress.cuh",
               "mla_decompress_persist.cuh", "mla_decompress_sm90.cuh", "mla_attention_sm90.cuh", "tma_encode.h")
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^;<>]*>)?)\s*<<<(.*?)>>>\((.*?)\);", re.S)


def rewrite_launches(source: str) -> str:
    """kernel<<<grid, block, smem, stream>>>(args); -> ::emu::launch(kernel, grid, block, smem, stream, args);"""
    out, n = LAUNCH.subn(lambda m: f"::emu::launch({m.group(1)}, {m.group(2)}, {m.group(3)});", source)
    assert n > 0 and "<<<" not in out, "a launch was not rewritten"
    return out


def rewrite_extern_shared(source: str) -> str:
    """extern __shared__ __align__(A) T name[]; -> T* const name = (T*)::emu::dynamic_smem();"""
    out = EXTERN_SHARED.sub(lambda m: f"{m.group(1)}* const {m.group(2)} = "
                            f"reinterpret_cast<{m.group(1)}*>(::emu::dynamic_smem());", source)
    assert "extern __shared__" not in out, "an extern __shared__ array was not rewritten"
    return out


def write_if_changed(path: str, text: str) -> None:
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def attention_sources(build_dir: str) -> list[str]:
    """Rewritten copies of the attention sources in build_dir/attn (they include one another by
    quoted name, so the copies find each other) and one .cpp per unit that includes the emulator
    first; returns the .cpp files."""
    attn_dir = os.path.join(build_dir, "attn")
    os.makedirs(attn_dir, exist_ok=True)
    sources = []
    for name in ATTN_UNITS + ATTN_HEADERS + MLA_UNITS + MLA_HEADERS:
        with open(os.path.join(ROOT, "csrc", "cuda", name)) as f:
            text = f.read()
        if "<<<" in text:
            text = rewrite_launches(text)
        if "extern __shared__" in text:
            text = rewrite_extern_shared(text)
        write_if_changed(os.path.join(attn_dir, name), text)
        if name in ATTN_UNITS + MLA_UNITS:
            unit = os.path.join(attn_dir, name.replace(".cu", "_emu.cpp"))
            write_if_changed(unit, f'#include "cuda_emu.h"\n\n#include "{name}"\n')
            sources.append(unit)
    return sources


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
    write_if_changed(os.path.join(build_dir, "cache_ops_emu.inc"), rewritten)
    # KVKERNELS_CUDA_EMU selects the emulator branch of the PTX wrappers (attention_common.cuh).
    flags = ["-std=c++17", "-O1", "-g0", "-ffp-contract=off", "-fvisibility=hidden", "-DKVKERNELS_CUDA_EMU=1",
             "-Wno-unknown-pragmas", "-DTORCH_TARGET_VERSION=0x020a000000000000", f"-I{HERE}", f"-I{build_dir}",
             f"-I{CUDA_HOME}/include", f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/include", f"-I{ROOT}/csrc/cuda"]
    sources = [os.path.join(HERE, "emu_ops.cpp"), os.path.join(HERE, "sm90_selftest.cpp")] + [os.path.join(ROOT, "csrc", f) for f in
                                                      ("prepare.cpp", "checks.cpp", "index_checks.cpp")]
    sources += attention_sources(build_dir)
    cpp_extension.load(name="kvkernels_cuda_emu", sources=sources, extra_cflags=flags, build_directory=build_dir,
                       is_python_module=False, verbose=verbose)
    return torch.ops.kvkernels_emu


if __name__ == "__main__":
    ok, why = available()
    if not ok:
        sys.exit(why)
    print(build(verbose=True))
