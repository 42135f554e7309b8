"""Paired CPU comparison for paged_attention's `causal` argument (issue 25): the default (causal) path
of two builds, A (a baseline tree: main's sources and .so) and B (this tree), on the same data, plus
causal=False prefill timings of B.

Two builds of the extension register the same op names, so they cannot share a process: the driver
alternates worker processes in ABBA order (`--rounds` times), each worker building the same inputs
from fixed seeds and timing every case (median and minimum of repeated calls after warm-up). Reported per case: the
median over rounds of each side's median, and the ratios B / A of the paired rounds' medians and of
their minimums (the minimum is the estimate least disturbed by other jobs on a shared machine), as
the median over rounds with the range, and "best": B's fastest call over all rounds / A's.

    python benchmarks/causal_ab.py --base /tmp/base_tree --rounds 3 --threads 1 --out benchmarks/results

`--base` is a directory holding a `kvkernels` package (sources and a built _C.abi3.so) of the
baseline, e.g. `git archive <main> kvkernels | tar -x -C DIR` plus main's .so copied in.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)

# name: (kind, dtype, batch, q_len, context, Hq, Hkv, D, causal). The causal=True cases run on both
# builds (the default path); causal=False only on B (A has no such argument).
CASES = {
    "decode-bf16-b8-ctx4096": ("decode", "bfloat16", 8, 1, 4096, 32, 8, 128, True),
    "decode-f32-b1-ctx16384": ("decode", "float32", 1, 1, 16384, 32, 8, 128, True),
    "prefill-bf16-chunk256-ctx2048": ("varlen", "bfloat16", 1, 256, 2048, 32, 8, 128, True),
    "prefill-f32-chunk256-ctx2048": ("varlen", "float32", 1, 256, 2048, 32, 8, 128, True),
    "prefill-bf16-4x128-ctx512-gqa4": ("varlen", "bfloat16", 4, 128, 512, 16, 4, 64, True),
    "encoder-bf16-512-causal": ("varlen", "bfloat16", 2, 512, 512, 16, 16, 64, True),
    "encoder-bf16-512-noncausal": ("varlen", "bfloat16", 2, 512, 512, 16, 16, 64, False),
    "encoder-f32-512-noncausal": ("varlen", "float32", 2, 512, 512, 16, 16, 64, False),
    "cross-bf16-q64-src1024-noncausal": ("varlen", "bfloat16", 4, 64, 1024, 16, 16, 64, False),
    "cross-bf16-q64-src1024-causal": ("varlen", "bfloat16", 4, 64, 1024, 16, 16, 64, True),
}


def worker(args) -> None:
    sys.path.insert(0, args.tree)
    import torch

    import kvkernels
    from kvkernels import ops

    assert os.path.dirname(kvkernels.__file__) == os.path.join(args.tree, "kvkernels"), kvkernels.__file__
    torch.set_num_threads(args.threads)
    results = {}
    for name, (kind, dtype, batch, q_len, ctx, hq, hkv, d, causal) in selected(args).items():
        if not causal and not args.noncausal:
            continue
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(1234)
        b = 16
        blocks_per = ctx // b
        n = batch * blocks_per + 1
        k = torch.randn(n, b, hkv, d, generator=g).to(dt)
        v = torch.randn(n, b, hkv, d, generator=g).to(dt)
        table = (torch.randperm(n - 1, generator=g)[:batch * blocks_per] + 1).to(torch.int32).view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        t = batch * q_len
        q = torch.randn(t, hq, d, generator=g).to(dt)
        qsl = None if kind == "decode" else torch.arange(0, t + 1, q_len, dtype=torch.int32)
        kw = {} if causal else {"causal": False}

        def call():
            return ops.paged_attention(q, k, v, table, lens, qsl, **kw)

        for _ in range(2):
            call()
        times, start = [], time.perf_counter()
        while len(times) < 5 or time.perf_counter() - start < args.min_time:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        results[name] = {"median_s": statistics.median(times), "min_s": min(times), "calls": len(times)}
    json.dump({"isa": kvkernels.cpu_isa(), "results": results}, sys.stdout)


def selected(args) -> dict:
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = set(names) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    return {n: CASES[n] for n in names}


def run_worker(tree: str, args, noncausal: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree, "--threads", str(args.threads),
           "--min-time", str(args.min_time)] + (["--noncausal"] if noncausal else [])
    if args.cases:
        cmd += ["--cases", args.cases]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=""))
    return json.loads(out.stdout)


def driver(args) -> None:
    import torch

    # Imported here, not at the top: a worker must import the kvkernels of the tree it measures.
    sys.path.insert(0, TREE)
    from kvkernels.bench.machine import cpu_model, slug

    runs = {"A": [], "B": []}
    loads = []
    for r in range(args.rounds):
        for side in "ABBA":
            tree = args.base if side == "A" else TREE
            loads.append(os.getloadavg()[0])
            res = run_worker(tree, args, noncausal=side == "B")
            runs[side].append(res)
            print(f"round {r} {side} isa={res['isa']} " + " ".join(
                f"{k}={v['median_s'] * 1e3:.2f}ms" for k, v in res["results"].items()), file=sys.stderr)
    lines = [f"paged_attention causal argument: paired ABBA CPU comparison ({args.rounds} rounds, "
             f"{args.threads} thread(s), min {args.min_time}s of calls per measurement)",
             f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; CPU {cpu_model()}; "
             f"torch {torch.__version__}; ISA {runs['B'][0]['isa']}; 1-min load average during the runs "
             f"{min(loads):.1f}..{max(loads):.1f} (2 cores shared with other jobs)",
             f"A = {args.base_label}; B = this tree (causal=True default path; causal=False rows B only)", "",
             f"{'case':34s} {'A med ms':>9s} {'B med ms':>9s} {'A min ms':>9s} {'B min ms':>9s} "
             f"{'B/A med':>8s} {'range':>13s} {'B/A min':>8s} {'range':>13s} {'B/A best':>8s}"]
    summary = {}
    for name, case in selected(args).items():
        b_times = [run["results"][name]["median_s"] for run in runs["B"]]
        b_mins = [run["results"][name]["min_s"] for run in runs["B"]]
        if case[-1]:
            a_times = [run["results"][name]["median_s"] for run in runs["A"]]
            a_mins = [run["results"][name]["min_s"] for run in runs["A"]]
            # Pair the i-th A with the i-th B: ABBA puts them next to each other in time.
            ratios = [bt / at for at, bt in zip(a_times, b_times)]
            min_ratios = [bt / at for at, bt in zip(a_mins, b_mins)]
            summary[name] = {"A_median_s": a_times, "B_median_s": b_times, "A_min_s": a_mins, "B_min_s": b_mins,
                             "median_ratios": ratios, "min_ratios": min_ratios}
            lines.append(f"{name:34s} {statistics.median(a_times) * 1e3:9.2f} {statistics.median(b_times) * 1e3:9.2f} "
                         f"{statistics.median(a_mins) * 1e3:9.2f} {statistics.median(b_mins) * 1e3:9.2f} "
                         f"{statistics.median(ratios):8.3f} {min(ratios):6.3f}..{max(ratios):.3f} "
                         f"{statistics.median(min_ratios):8.3f} {min(min_ratios):6.3f}..{max(min_ratios):.3f} "
                         f"{min(b_mins) / min(a_mins):8.3f}")
        else:
            summary[name] = {"B_median_s": b_times, "B_min_s": b_mins}
            lines.append(f"{name:34s} {'-':>9s} {statistics.median(b_times) * 1e3:9.2f} {'-':>9s} "
                         f"{statistics.median(b_mins) * 1e3:9.2f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        model = slug(cpu_model())
        base = os.path.join(args.out, f"causal-ab-{model}-{stamp}")
        with open(base + ".txt", "w") as f:
            f.write(text + "\n")
        with open(base + ".json", "w") as f:
            json.dump({"cpu": cpu_model(), "torch": torch.__version__, "date": stamp, "rounds": args.rounds,
                       "threads": args.threads, "min_time": args.min_time, "base": args.base_label,
                       "cases": {k: dict(zip(("kind", "dtype", "batch", "q_len", "context", "Hq", "Hkv", "D",
                                                 "causal"), v)) for k, v in selected(args).items()},
                       "summary": summary, "load_average": loads}, f, indent=1)
        print(f"wrote {base}.txt / .json", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--noncausal", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", default=TREE, help=argparse.SUPPRESS)
    p.add_argument("--base", help="directory holding the baseline kvkernels package (with its built .so)")
    p.add_argument("--base-label", default="baseline", help="what the baseline is (recorded)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--out", help="directory for the .txt / .json results (default: print only)")
    p.add_argument("--cases", help="comma-separated case names (default: all)")
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        if not args.base:
            p.error("--base is required")
        driver(args)


if __name__ == "__main__":
    main()
