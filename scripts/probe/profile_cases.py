"""One kernel case per process, for Nsight Compute (scripts/probe/gpu_profile.sh): builds the data of one
issue-24 target shape, runs the op a few times (warm-up; ncu profiles the launch it is told to), then
exits. ``python profile_cases.py CASE`` — CASE in CASES; on a machine without CUDA it builds nothing and
says so (exit 0), so the script can be dry-run."""
import math
import sys

import torch

import kvkernels  # noqa: F401  (the ops)
from kvkernels import ops

BLOCK, KV_HEADS, HEADS, D = 16, 8, 32, 128


def paged(batch, context, dtype):
    per_seq = math.ceil(context / BLOCK)
    n = batch * per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = torch.randperm(n, device="cuda", generator=gen).view(batch, per_seq).to(torch.int32)
    k = torch.randn(n, BLOCK, KV_HEADS, D, device="cuda", generator=gen).to(dtype)
    v = torch.randn(n, BLOCK, KV_HEADS, D, device="cuda", generator=gen).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return k, v, table, lens


def decode(batch, context, dtype):
    k, v, table, lens = paged(batch, context, dtype)
    q = torch.randn(batch, HEADS, D, device="cuda", dtype=torch.bfloat16)
    scales = {} if dtype == torch.bfloat16 else dict(k_scale=torch.ones(1, device="cuda"),
                                                     v_scale=torch.ones(1, device="cuda"))
    return lambda: ops.paged_attention(q, k, v, table, lens, **scales)


def prefill(tokens):
    k, v, table, lens = paged(1, tokens, torch.bfloat16)
    q = torch.randn(tokens, HEADS, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    return lambda: ops.paged_attention(q, k, v, table, lens, qsl)


def decompress(tokens, heads=16, r=512, p=64, dn=128, dv=128):
    blocks = math.ceil(tokens / 64)
    cache = torch.randn(blocks, 64, r + p, device="cuda").to(torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(1, blocks)
    lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    w = (torch.randn(heads * (dn + dv), r, device="cuda") * r ** -0.5).to(torch.bfloat16)
    return lambda: ops.mla_decompress(cache, table, lens, w, kv_lora_rank=r, qk_nope_head_dim=dn,
                                      v_head_dim=dv, num_tokens=tokens)


def mla_decode(batch, context, heads=128, r=512, p=64):
    per_seq = math.ceil(context / 64)
    cache = torch.randn(batch * per_seq, 64, r + p, device="cuda").to(torch.bfloat16)
    table = torch.arange(batch * per_seq, dtype=torch.int32, device="cuda").view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, r + p, device="cuda").to(torch.bfloat16)
    return lambda: ops.mla_paged_attention(q, cache, table, lens, kv_lora_rank=r, scale=(r + p) ** -0.5)


CASES = {
    "decode-bf16-b64-4k": lambda: decode(64, 4096, torch.bfloat16),
    "decode-e4m3-b64-4k": lambda: decode(64, 4096, torch.float8_e4m3fn),
    "decode-bf16-b1-32k": lambda: decode(1, 32768, torch.bfloat16),
    "prefill-bf16-4k": lambda: prefill(4096),
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
