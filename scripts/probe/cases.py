"""One small call per case, for scripts/probe/gpu_probe.sh: `python cases.py CASE DEVICE`.

Prints "ok CASE" on success, "raised CASE: <message>" for an expected exception; a crash shows up as
the process's signal (with the native backtrace of segv_backtrace.c when preloaded)."""
import sys

import torch

import kvkernels  # noqa: F401  (loads the ops)
from kvkernels import ops

case, dev = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(dev)


def paged(num_blocks=4, block=16, heads=2, d=64, dtype=torch.float16):
    kc, vc = randn(num_blocks, block, heads, d, dtype=dtype), randn(num_blocks, block, heads, d, dtype=dtype)
    bt = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=dev)
    sl = torch.tensor([20, 9], dtype=torch.int32, device=dev)
    return kc, vc, bt, sl


def run():
    if case == "empty_like":  # torch alone: allocation and a kernel of torch's own
        x = randn(8, 8)
        return (x @ x).sum().item()
    if case == "merge":
        oa, la = randn(3, 4, 8), randn(3, 4)
        return ops.merge_attention_states(oa, la, randn(3, 4, 8), randn(3, 4))
    if case == "merge_out":  # the void-returning variant
        oa, la = randn(3, 4, 8), randn(3, 4)
        out = torch.empty_like(oa)
        return ops.merge_attention_states(oa, la, oa, la, out=out)
    if case == "merge_err":  # a shape error raised by the shared checks
        return ops.merge_attention_states(randn(3, 4, 8), randn(4, 3), randn(3, 4, 8), randn(3, 4))
    if case == "reshape_err":  # an error out of a void op
        kc, vc, _, _ = paged()
        return ops.reshape_and_cache(randn(2, 2, 64, dtype=torch.float16), randn(2, 2, 64, dtype=torch.float16),
                                     kc, vc, torch.tensor([0, 99999], device=dev))
    if case == "reshape":
        kc, vc, _, _ = paged()
        return ops.reshape_and_cache(randn(2, 2, 64, dtype=torch.float16), randn(2, 2, 64, dtype=torch.float16),
                                     kc, vc, torch.tensor([0, 5], device=dev))
    if case == "gather":
        kc, vc, bt, sl = paged()
        return ops.gather_kv(kc, vc, bt, sl, num_tokens=29)
    if case == "attn":
        kc, vc, bt, sl = paged()
        return ops.paged_attention(randn(2, 4, 64, dtype=torch.float16), kc, vc, bt, sl)
    if case == "attn_out":
        kc, vc, bt, sl = paged()
        q = randn(2, 4, 64, dtype=torch.float16)
        return ops.paged_attention(q, kc, vc, bt, sl, out=torch.empty_like(q))
    raise SystemExit(f"unknown case {case}")


try:
    r = run()
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"ok {case} {dev}", flush=True)
except Exception as e:  # noqa: BLE001 - the point is to report it
    print(f"raised {case} {dev}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
