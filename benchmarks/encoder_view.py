"""How the vLLM backend's encoder layers hand the step's own K/V to paged_attention (causal=False), op
level: the block-size-1 view it uses (``key.unsqueeze(1)``, a table of token indices), an overlapping
``as_strided`` view with one block of up to 128 tokens starting at every token (needs storage past the
last token, so the backend does not use it), and copying the K/V into a block-16 scratch cache first
(``reshape_and_cache`` + ``paged_attention``, what vLLM's CPU backend does for encoder layers). The three
outputs are checked bit-identical; each case reports the median of ``--reps`` interleaved calls.

    python benchmarks/encoder_view.py [--reps 7] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvkernels import ops

CASES = [(4, 512, 12, 64, torch.float32), (4, 512, 12, 64, torch.bfloat16), (32, 64, 4, 32, torch.float32)]


def case(seqs: int, length: int, heads: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    t = seqs * length
    q = torch.randn(t, heads, d, generator=g).to(dtype)
    # 128 spare rows past the tokens: the strided view's last blocks reach into them (never read).
    k, v = (torch.randn(t + 128, heads, d, generator=g).to(dtype) for _ in range(2))
    qsl = torch.arange(0, t + 1, length, dtype=torch.int32)
    lens = torch.full((seqs,), length, dtype=torch.int32)
    table1 = qsl[:-1, None] + torch.arange(length, dtype=torch.int32)[None]
    bs = min(length, 128)
    strides = (heads * d, heads * d, d, 1)
    ks, vs = k.as_strided((t, bs, heads, d), strides), v.as_strided((t, bs, heads, d), strides)
    table_s = qsl[:-1, None] + bs * torch.arange(-(-length // bs), dtype=torch.int32)[None]
    kc = torch.empty(t // 16, 16, heads, d, dtype=dtype)
    vc = torch.empty_like(kc)
    slots = torch.arange(t, dtype=torch.int64)
    table16 = qsl[:-1, None] // 16 + torch.arange(length // 16, dtype=torch.int32)[None]

    def copy16():
        ops.reshape_and_cache(k[:t], v[:t], kc, vc, slots)
        return ops.paged_attention(q, kc, vc, table16, lens, qsl, causal=False)

    return {
        "block-1 view": lambda: ops.paged_attention(q, k[:t].unsqueeze(1), v[:t].unsqueeze(1), table1, lens, qsl,
                                                    causal=False),
        f"strided block-{bs} view": lambda: ops.paged_attention(q, ks, vs, table_s, lens, qsl, causal=False),
        "copy + block-16 cache": copy16,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for seqs, length, heads, d, dtype in CASES:
        fs = case(seqs, length, heads, d, dtype)
        outs = [f()[0] for f in fs.values()]  # also the warm-up
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        times = {name: [] for name in fs}
        for _ in range(a.reps):
            for name, f in fs.items():
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        cols = ", ".join(f"{name} {statistics.median(ts) * 1e3:.1f} ms" for name, ts in times.items())
        print(f"{seqs} x {length} tokens, {heads} heads x {d}, {str(dtype)[6:]}: {cols}; identical: {same}")


if __name__ == "__main__":
    main()
