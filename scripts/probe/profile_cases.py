"""One kernel case per process, for Nsight Compute (scripts/probe/gpu_profile.sh): builds the data of one
issue-24 target shape, runs the op a few times (warm-up; ncu profiles the launch it is told to), then
exits; the data are the benchmarks' own (kvkernels.bench.cuda_attention.Paged, cuda_mla.LatentCache).
``python profile_cases.py CASE`` — CASE in CASES; on a machine without CUDA it builds nothing and
says so (exit 0), so the script can be dry-run."""
import os
import sys

import torch

from kvkernels import ops
from kvkernels.bench.cuda_attention import Paged
from kvkernels.bench.cuda_mla import NOPE, RANK, ROPE, VDIM, LatentCache


def gen():
    return torch.Generator(device="cuda").manual_seed(0)


def decode(batch, context, dtype, path=None):
    """``path``: KVKERNELS_CUDA_ATTN_PATH for the run (``mma-decode-deep``: the decode kernel's deep
    configuration; ``mma-decode-fp8-smem``: the wide one converting fp8 stages in shared memory;
    ``mma-decode-occ3``: the wide one held to 3 CTAs per SM; None: the
    default, wide)."""
    if path is not None:
        os.environ["KVKERNELS_CUDA_ATTN_PATH"] = path
    data = Paged(batch, context, batch, dtype, 1, gen())  # the benchmark's cache and queries
    return lambda: ops.paged_attention(data.query, data.keys[0], data.values[0], data.block_tables,
                                       data.seq_lens, k_scale=data.scale, v_scale=data.scale)


def prefill(tokens, path=None):
    """``path``: KVKERNELS_CUDA_ATTN_PATH for the run (``mma-prefill-deep`` / ``mma-prefill-tall``: the
    prefill kernel's deep / tall configuration; None: the default, wide)."""
    if path is not None:
        os.environ["KVKERNELS_CUDA_ATTN_PATH"] = path
    data = Paged(1, tokens, tokens, torch.bfloat16, 1, gen())
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    return lambda: ops.paged_attention(data.query, data.keys[0], data.values[0], data.block_tables,
                                       data.seq_lens, qsl)


def decompress(tokens, heads=16):
    data = LatentCache(1, tokens, torch.bfloat16, 1, gen())
    w = (torch.randn(heads * (NOPE + VDIM), RANK, device="cuda") * RANK ** -0.5).to(torch.bfloat16)
    return lambda: ops.mla_decompress(data.caches[0], data.block_tables, data.seq_lens, w, kv_lora_rank=RANK,
                                      qk_nope_head_dim=NOPE, v_head_dim=VDIM, num_tokens=tokens)


def mla_decode(batch, context, heads=128):
    data = LatentCache(batch, context, torch.bfloat16, 1, gen())
    q = torch.randn(batch, heads, RANK + ROPE, device="cuda").to(torch.bfloat16)
    return lambda: ops.mla_paged_attention(q, data.caches[0], data.block_tables, data.seq_lens,
                                           kv_lora_rank=RANK, scale=(RANK + ROPE) ** -0.5)


CASES = {
    "decode-bf16-b64-4k": lambda: decode(64, 4096, torch.bfloat16),
    "decode-bf16-b64-4k-deep": lambda: decode(64, 4096, torch.bfloat16, "mma-decode-deep"),
    "decode-e4m3-b64-4k": lambda: decode(64, 4096, torch.float8_e4m3fn),
    "decode-e4m3-b64-4k-fp8smem": lambda: decode(64, 4096, torch.float8_e4m3fn, "mma-decode-fp8-smem"),
    "decode-bf16-b1-32k": lambda: decode(1, 32768, torch.bfloat16),
    "decode-e4m3-b1-32k": lambda: decode(1, 32768, torch.float8_e4m3fn),
    "decode-e4m3-b1-32k-occ3": lambda: decode(1, 32768, torch.float8_e4m3fn, "mma-decode-occ3"),
    "prefill-bf16-4k": lambda: prefill(4096),
    "prefill-bf16-4k-deep": lambda: prefill(4096, "mma-prefill-deep"),
    "prefill-bf16-4k-tall": lambda: prefill(4096, "mma-prefill-tall"),
    "mla-decompress-2k": lambda: decompress(2048),
    "mla-decode-b64-4k": lambda: mla_decode(64, 4096),
}

if __name__ == "__main__":
    case = sys.argv[1]
    if case not in CASES:
        raise SystemExit(f"unknown case {case}; known: {', '.join(CASES)}")
    if not torch.cuda.is_available():
        print(f"{case}: no CUDA device")
        raise SystemExit(0)
    call = CASES[case]()
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print(f"{case}: ran")
