"""Where the CPU decode kernel spends its time: a sampling profile by stage.

Runs paged_attention decode (the benchmark's shape: 32 query / 8 kv heads of 128, block 16, shuffled
block tables) in a child process, samples it with `perf record -e cpu-clock` (a timer, so it works
in VMs without hardware counters), and gives each sample inside kvkernels._C to a stage of the
kernel in csrc/cpu/attention_kernel.h, through the chain of inlined functions that addr2line reports
for the sampled address:

    logits        Q K^T (dot4x2_words, dot4x2, ..., dp_dot4x2 in the vdpbf16ps form), with the Words split
                  and the 4-way reductions
    softmax       masks, exp, running max / denominator (mask_logits, softmax_rows4)
    P V           alpha-rescale and accumulate of the output rows (pv4_words, pv4)
    fp8 lookup    the fp8 -> bf16 table (Fp8WordLoader, dp_fp8_load64), inside logits or P V
    fp8 staging   fp8 chunks converted once to bf16 for several row groups (dp_stage_chunk)
    prefetch      issuing the next chunk's L2 prefetches (Prefetcher::at), inside logits or P V
    addressing    slot offsets and row pointers (chunk_slots, chunk_rows, next_chunk)
    item          queries in, output rows out (load_queries, store_rows, ...), split merges
Samples outside kvkernels._C (OpenMP waits, torch dispatch, Python) are reported by library.

Needs `perf`, `addr2line` and `readelf` (binutils), and the extension built with debug info, which does not
change the generated code:  KVKERNELS_DEBUG_INFO=1 python setup.py build_ext --inplace

    python benchmarks/decode_profile.py [--dtypes bfloat16,fp8_e4m3] [--batch 8] [--context 4096]
        [--threads 2] [--seconds 8] [--resident dram|cache] [--lines 0]

--resident dram (default) rotates copies of the cache that total 2x the last-level cache, as the
benchmark does, so every call reads from memory; --resident cache calls one cache over and over
(pick a small one, e.g. --batch 1 --context 1024 --threads 1): the compute cost without memory
stalls. A sample lands on the instruction that was waiting, so memory stalls show up in the stage
whose loads waited.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

STAGES = (  # (stage, function names): the innermost inlined frame that matches decides
    ("fp8 lookup", ("Fp8WordLoader", "dp_fp8_load64")),
    ("prefetch", ("Prefetcher::at",)),
    ("logits", ("dot4x2_words", "dot4_words", "chunk_logits_words", "dot4x2", "dot4", "chunk_logits",
                "dp_dot4x2", "dp_chunk_logits", "dp_logits4x4", "reduce16")),
    ("softmax", ("softmax_rows4", "mask_logits", "transform_logits", "dp_probs_bf16")),
    ("P V", ("pv4_words", "pv4", "chunk_values_words", "chunk_values", "dp_pv4", "dp_pv4_edges",
             "dp_value_pairs")),
    ("fp8 staging", ("dp_stage_chunk",)),
    ("addressing", ("chunk_slots", "chunk_rows", "next_chunk", "for_chunk_slots")),
    ("item", ("load_queries", "store_rows", "finalize_row", "unpair_rows", "merge_splits",
              "dp_unpermute_rows")),
)
NESTED = ("fp8 lookup", "prefetch")  # also named by the stage they sit in


def worker(args) -> None:
    """Builds the benchmark's decode data, prints the extension's path, then calls the kernel in a
    loop for args.seconds and prints the calls and seconds per call."""
    import torch

    from kvkernels import _C, ops
    from kvkernels.bench.attention import build_paged, paged_layer_bytes
    from kvkernels.bench.machine import llc_bytes

    torch.set_num_threads(args.threads)
    dtype = torch.float8_e4m3fn if args.dtype == "fp8_e4m3" else getattr(torch, args.dtype)
    layers = 1
    if args.resident == "dram":
        layers = -(-2 * (llc_bytes() or 256 << 20) // paged_layer_bytes(args.batch, args.context, dtype))
    data = build_paged(args.batch, args.context, args.batch, dtype, layers, torch.Generator().manual_seed(0))

    def call(i: int) -> None:
        ops.paged_attention(data.query, data.key_caches[i % layers], data.value_caches[i % layers],
                            data.block_tables, data.seq_lens, k_scale=data.k_scale, v_scale=data.v_scale)

    for i in range(2 * layers):  # warm up: every copy touched once
        call(i)
    print(_C.__file__, layers, flush=True)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        call(n)
        n += 1
    print(n, (time.perf_counter() - t0) / n, flush=True)


def inline_chains(so: str, addrs: list) -> dict:
    """addr -> [function names, innermost first] from `addr2line -i -f -C -a`."""
    out = subprocess.run(["addr2line", "-i", "-f", "-C", "-a", "-e", so], check=True, text=True,
                         input="\n".join(hex(a) for a in addrs), capture_output=True).stdout.splitlines()
    chains, cur, i = {}, None, 0
    while i < len(out):
        if re.fullmatch(r"0x[0-9a-f]+", out[i]):
            cur = int(out[i], 16)
            chains[cur] = []
            i += 1
        else:  # a function line, then its file:line
            # "float __vector(16) ns::f<...>(args)" (a function returning __m512): drop the return type's
            # parenthesis first, or the name would be cut at it
            chains[cur].append(re.sub(r"__vector\(\d+\)\s*", "", out[i]).split("(")[0])
            i += 2
    return chains


def stage_of(chain: list) -> str:
    for name in chain:  # innermost first
        base = re.sub(r"<.*", "", name)
        for stage, funcs in STAGES:
            if any(base == f or base.endswith("::" + f) for f in funcs):
                if stage in NESTED:  # name the stage it was called from as well
                    outer = stage_of(chain[chain.index(name) + 1:])
                    return f"{stage} ({outer})"
                return stage
    return "other kvkernels code"


def samples(data_file: str, so: str):
    """Counts of sampled addresses inside `so` (as file offsets) and of samples per other library."""
    text = subprocess.run(["perf", "script", "-i", data_file, "--show-mmap-events", "-F", "ip,dso"],
                          check=True, text=True, capture_output=True, errors="replace").stdout
    base, ips, other = None, collections.Counter(), collections.Counter()
    name = os.path.basename(so)
    for line in text.splitlines():
        if "MMAP" in line:  # [0xSTART(0xLEN) @ 0xPGOFF ...]: the executable mapping of the extension
            m = re.search(r"\[(0x[0-9a-f]+)\((0x[0-9a-f]+)\) @ (0x[0-9a-f]+) .*r-xp", line)
            if m and line.rstrip().endswith(name):
                base = int(m.group(1), 16) - int(m.group(3), 16)
            continue
        parts = line.split()
        if len(parts) < 2:
            continue
        dso = parts[1].strip("()")
        if dso.endswith(name) and base is not None:
            ips[int(parts[0], 16) - base] += 1
        else:
            other[os.path.basename(dso)] += 1
    if base is None:
        sys.exit(f"no mapping of {name} in the perf data")
    return ips, other


def profile(args, dtype: str) -> None:
    from kvkernels.bench.attention import KV_HEADS

    cmd = [sys.executable, __file__, "--worker", "--dtype", dtype, "--batch", str(args.batch), "--context",
           str(args.context), "--threads", str(args.threads), "--resident", args.resident,
           "--seconds", str(args.seconds + 4)]
    env = dict(os.environ)
    if args.isa:
        env["KVKERNELS_CPU_ISA"] = args.isa
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    so, layers = child.stdout.readline().split()
    if ".debug_info" not in subprocess.run(["readelf", "-S", so], check=True, text=True, capture_output=True).stdout:
        child.kill()  # without DWARF addr2line knows no inlined function, so every stage would be "other"
        sys.exit(f"{so} has no debug info: rebuild with KVKERNELS_DEBUG_INFO=1 (see the docstring)")
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, "perf.data")
        time.sleep(1)
        subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-p", str(child.pid), "-o",
                        data_file, "--", "sleep", str(args.seconds)], check=True, stderr=subprocess.DEVNULL)
        calls, per_call = child.stdout.readline().split()
        child.wait()
        ips, other = samples(data_file, so)
    chains = inline_chains(so, sorted(ips))
    stages, lines = collections.Counter(), collections.Counter()
    for a, n in ips.items():
        stages[stage_of(chains[a])] += n
    total = sum(ips.values()) + sum(other.values())
    # Thread-seconds per call spread over the samples, per (token x kv head).
    units = args.batch * args.context * KV_HEADS
    ns = float(per_call) * args.threads * 1e9 / units
    print(f"\n{dtype}: batch {args.batch} x {args.context}, {args.threads} threads, resident {args.resident} "
          f"({layers} cache copies), {float(per_call) * 1e3:.3f} ms per call over {calls} calls; "
          f"{total} samples")
    print(f"  {'stage':44s} {'samples':>8s} {'ns per token x kv head':>24s}")
    rows = sorted(stages.items(), key=lambda kv: -kv[1]) + [("outside kvkernels: " + k, v) for k, v in other.most_common(4)]
    rest = sum(other.values()) - sum(v for _, v in other.most_common(4))
    if rest:
        rows.append(("outside kvkernels: the rest", rest))
    for stage, n in rows:
        print(f"  {stage:44s} {100 * n / total:7.1f}% {ns * n / total:24.1f}")
    print(f"  {'total (thread time per call)':44s} {'100.0%':>8s} {ns:24.1f}")
    if args.lines:
        for a, n in ips.items():
            lines[(stage_of(chains[a]), chains[a][0] if chains[a] else "?")] += n
        print("  hottest innermost functions:")
        for (stage, fn), n in lines.most_common(args.lines):
            print(f"    {100 * n / total:5.1f}%  {stage:28s} {fn[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,fp8_e4m3", help="float32,bfloat16,float16,fp8_e4m3")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0, help="sampled seconds per dtype")
    p.add_argument("--resident", choices=("dram", "cache"), default="dram")
    p.add_argument("--lines", type=int, default=0, help="also list the N hottest innermost functions")
    p.add_argument("--isa", default=None, help="KVKERNELS_CPU_ISA for the profiled child (default: the best)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    for tool in ("perf", "addr2line", "readelf"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: the profile needs perf and binutils")
    import torch

    import kvkernels
    from kvkernels.bench.machine import cpu_model

    if args.isa:
        os.environ["KVKERNELS_CPU_ISA"] = args.isa
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}, kernel ISA {kvkernels.cpu_isa()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}\n{' '.join(sys.argv)}")
    for dtype in args.dtypes.split(","):
        profile(args, dtype)


if __name__ == "__main__":
    main()
