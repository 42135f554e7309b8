"""``python -m kvkernels info``: what this build of kvkernels can run on, and with what."""

from __future__ import annotations

import argparse
import platform

import torch

import kvkernels

OPS = ("reshape_and_cache", "paged_attention", "merge_attention_states", "copy_blocks",
       "swap_blocks", "gather_kv", "concat_and_cache_mla", "mla_decompress", "mla_paged_attention",
       "paged_attention_out", "merge_attention_states_out", "mla_paged_attention_out")


def backends() -> dict[str, list[str]]:
    """Dispatch keys -> ops that have a compiled kernel for them."""
    found: dict[str, list[str]] = {}
    for key in ("CPU", "CUDA", "MPS"):
        for op in OPS:
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"kvkernels::{op}", key):
                found.setdefault(key, []).append(op)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvkernels info", description=__doc__.split("``: ")[1].strip())
    parser.parse_args([] if argv is None else argv)  # no options: --help, or an error for anything else
    print(f"kvkernels {kvkernels.__version__}  ({kvkernels._C.__file__})")
    print(f"torch {torch.__version__}  (CUDA {torch.version.cuda})  python {platform.python_version()}")
    print(f"machine: {platform.machine()}  CPU ISA (torch): {torch.backends.cpu.get_cpu_capability()}"
          f"  threads: {torch.get_num_threads()}")
    print(f"kvkernels CPU kernels: {kvkernels.cpu_isa()} path"
          "  (KVKERNELS_CPU_ISA=avx512amx|avx512bf16|avx512vbmi|avx512|avx2|portable forces one)")
    for key, ops in backends().items():
        print(f"backend {key}: {len(ops)}/{len(OPS)} ops" + ("" if len(ops) == len(OPS) else f" {ops}"))
    if torch.cuda.is_available():
        print(f"CUDA device: {torch.cuda.get_device_name()}")
    print(f"MPS available: {torch.backends.mps.is_available()}")
    return 0
