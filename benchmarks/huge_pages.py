"""Paired measurement of what 2 MiB pages (kvkernels.memory) buy the CPU decode kernel.

One process builds the same paged caches twice, with torch.empty (4 KiB pages) and with
kvkernels.memory.empty (huge pages requested), and alternates calls between them (ABBA), so the
machine's drift between runs cancels out; reports the median of the per-pair time ratios.

    python benchmarks/huge_pages.py [--threads 2] [--batch 8] [--context 4096] [--layers 4] [--pairs 40]
"""

import argparse
import statistics
import time

import torch

from kvkernels import memory  # (importing kvkernels registers torch.ops.kvkernels)

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--context", type=int, default=4096)
p.add_argument("--layers", type=int, default=4, help="cache copies per variant, rotated (2x LLC or more)")
p.add_argument("--pairs", type=int, default=40)
p.add_argument("--dtypes", default="bfloat16,fp8_e4m3")
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)
HQ, HKV, D, BS = 32, 8, 128, 16
nb = args.batch * args.context // BS
print(f"torch {torch.__version__}, {args.threads} threads, batch {args.batch} x {args.context}, "
      f"32 q / 8 kv heads x 128, block 16, {args.layers} copies per variant")
for name in args.dtypes.split(","):
    dtype = torch.float8_e4m3fn if name == "fp8_e4m3" else getattr(torch, name)
    before = memory.huge_page_kib()
    variants = {}
    for huge in (False, True):
        alloc = memory.empty if huge else (lambda shape, dt: torch.empty(shape, dtype=dt))
        caches = []
        for _ in range(args.layers):
            k, v = alloc((nb, BS, HKV, D), dtype), alloc((nb, BS, HKV, D), dtype)
            k.copy_(torch.randn(nb, BS, HKV, D)), v.copy_(torch.randn(nb, BS, HKV, D))
            caches.append((k, v))
        variants[huge] = caches
    granted = memory.huge_page_kib()
    table = torch.randperm(nb, dtype=torch.int32).view(args.batch, -1)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, HQ, D, dtype=torch.bfloat16 if dtype != torch.float32 else dtype)
    scales = (torch.tensor(0.5), torch.tensor(0.5)) if name == "fp8_e4m3" else (None, None)
    times = {False: [], True: []}
    for i in range(args.pairs):
        for huge in ((False, True) if i % 2 == 0 else (True, False)):
            k, v = variants[huge][i % args.layers]
            t0 = time.perf_counter()
            torch.ops.kvkernels.paged_attention(q, k, v, table, lens, None, None, -1, 0.0, None, None, *scales)
            times[huge].append(time.perf_counter() - t0)
    nbytes = 2 * nb * BS * HKV * D * dtype.itemsize
    small, huge = statistics.median(times[False]), statistics.median(times[True])
    ratio = statistics.median(a / b for a, b in zip(times[False], times[True]))
    pool = args.layers * nbytes // 1024
    print(f"{name}: 4 KiB pages {small * 1e3:.2f} ms ({nbytes / small / 1e9:.1f} GB/s), huge pages "
          f"{huge * 1e3:.2f} ms ({nbytes / huge / 1e9:.1f} GB/s), paired speedup {ratio:.3f}; "
          f"huge pages granted {None if granted is None else granted - (before or 0)} of {pool} KiB")
    variants = caches = k = v = None  # free them before the next dtype counts its huge pages
