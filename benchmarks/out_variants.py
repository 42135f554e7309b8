"""Paired CPU benchmark of caller-provided outputs (out= / lse=, the *_out ops; issue 25 item 1).

Two comparisons, each on the same data (seeded) and interleaved so that drift on a shared machine hits
every variant alike:

1. In one process, this build: the allocating call against ``out=`` + ``lse=`` and ``out=`` alone, per
   case, in rounds whose order alternates (A B C, C B A, ...).
2. With ``--baseline-tree DIR`` (a directory holding another build's ``kvkernels`` package, e.g. main's):
   the allocating call of that build against this build's, in separate processes run in the order
   A B B A A B B A ... (``--pairs`` pairs of each), to show the default path did not get slower.

    python benchmarks/out_variants.py [--baseline-tree DIR] [--pairs 4] [--rounds 30] [--threads 1]

One thread by default: on a machine shared with other work, a parallel region's barrier waits for a
descheduled thread, which swamps a call of tens of microseconds (2 threads on 2 busy cores measured
milliseconds per decode call). The question here is the per-call overhead, which one thread shows.

Writes ``benchmarks/results/out-variants-<cpu>-<YYYYMMDD-HHMMSS>.json`` and ``.txt``.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Timed calls per sample: about this long. Short samples, many rounds: on a shared machine most short
# samples run undisturbed, so the minimum over rounds is the cost of the call itself and the median shows
# what the neighbours added.
SAMPLE_SECONDS = 0.002


def cases():
    """name -> (op name, args, kwargs, out shape, out dtype). Built from a fixed seed in every process."""
    import torch

    gen = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16

    def paged(batch, context, hkv=8, d=128, b=16):
        blocks = (context + b - 1) // b
        n = batch * blocks + 1
        k = torch.randn(n, b, hkv, d, generator=gen).to(bf16)
        v = torch.randn(n, b, hkv, d, generator=gen).to(bf16)
        tables = torch.randperm(n, generator=gen)[:batch * blocks].view(batch, blocks).int()
        return k, v, tables, torch.full((batch,), context, dtype=torch.int32)

    out = {}
    for batch, context in ((1, 512), (8, 4096)):
        k, v, tables, lens = paged(batch, context)
        q = torch.randn(batch, 32, 128, generator=gen).to(bf16)
        out[f"decode b{batch} ctx{context} 32/8 heads d128 bf16"] = (
            "paged_attention", (q, k, v, tables, lens), {}, (batch, 32, 128), bf16)
    k, v, tables, lens = paged(1, 1024)
    q = torch.randn(64, 32, 128, generator=gen).to(bf16)
    qsl = torch.tensor([0, 64], dtype=torch.int32)
    out["prefill chunk 64 @ ctx1024 32/8 heads d128 bf16"] = (
        "paged_attention", (q, k, v, tables, lens, qsl), {}, (64, 32, 128), bf16)
    blocks = 1024 // 64
    latent = torch.randn(8 * blocks + 1, 64, 576, generator=gen).to(bf16)
    mla_tables = torch.randperm(8 * blocks + 1, generator=gen)[:8 * blocks].view(8, blocks).int()
    mq = torch.randn(8, 16, 576, generator=gen).to(bf16)
    out["mla decode b8 ctx1024 16 heads r512 bf16"] = (
        "mla_paged_attention", (mq, latent, mla_tables, torch.full((8,), 1024, dtype=torch.int32)),
        dict(kv_lora_rank=512, scale=0.1), (8, 16, 512), bf16)
    a, b = torch.randn(64, 32, 128, generator=gen).to(bf16), torch.randn(64, 32, 128, generator=gen).to(bf16)
    la, lb = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    out["merge 64 tokens 32 heads d128 bf16"] = ("merge_attention_states", (a, la, b, lb), {}, (64, 32, 128), bf16)
    return out


def variants(op, args, kwargs, shape, dtype, names):
    """name -> zero-argument callable."""
    import torch
    from kvkernels import ops

    fn = getattr(ops, op)
    given, given_lse = torch.empty(shape, dtype=dtype), torch.empty(shape[:2])
    table = {
        "allocating": lambda: fn(*args, **kwargs),
        "out+lse": lambda: fn(*args, **kwargs, out=given, lse=given_lse),
        "out": lambda: fn(*args, **kwargs, out=given),
    }
    return {n: table[n] for n in names}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = time.perf_counter


def sample(fn, calls):
    t0 = CLOCK()
    for _ in range(calls):
        fn()
    return (CLOCK() - t0) / calls


def measure(names, rounds):
    """case -> variant -> per-round seconds per call; variants interleaved, order alternating by round."""
    results = {}
    for case, spec in cases().items():
        fns = variants(*spec, names)
        for f in fns.values():  # warm-up (first-call allocations, thread pool)
            sample(f, 3)
        t = sample(fns[names[0]], 3)
        calls = max(1, int(SAMPLE_SECONDS / max(t, 1e-7)))
        per = {n: [] for n in names}
        for r in range(rounds):
            for n in (names if r % 2 == 0 else names[::-1]):
                per[n].append(sample(fns[n], calls))
        results[case] = per
    return results


def worker(args) -> None:
    import kvkernels

    print(json.dumps({"kvkernels_file": kvkernels.__file__, "results": measure(["allocating"], args.rounds)}))


def summary(seconds):
    return {"median_us": statistics.median(seconds) * 1e6, "min_us": min(seconds) * 1e6}


def ratio_stats(num, den):
    """Median and quartiles of per-round ratios num[i] / den[i]."""
    r = sorted(a / b for a, b in zip(num, den))
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
    return {"median": statistics.median(r), "q1": q[0], "q3": q[2]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-tree", type=Path, help="directory whose kvkernels package is the baseline build")
    p.add_argument("--pairs", type=int, default=4, help="baseline/this-build process pairs (A B B A order)")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every process")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: time.perf_counter; cpu: time.process_time, the CPU time of this process, which "
                        "leaves out the time it was descheduled (memory traffic of neighbours still counts)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    if args.worker:
        worker(args)
        return 0

    import kvkernels
    from kvkernels.bench import machine

    names = ["allocating", "out+lse", "out"]
    load_before = os.getloadavg()
    in_process = measure(names, args.rounds)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "machine": machine.machine_info(machine.llc_bytes()),
        "torch": torch.__version__,
        "kvkernels_file": kvkernels.__file__,
        "sample_seconds": SAMPLE_SECONDS,
        "clock": args.clock,
        "rounds": args.rounds,
        "in_process": {c: {"per_call": {n: summary(v) for n, v in per.items()},
                           "ratio_vs_allocating": {n: ratio_stats(per[n], per["allocating"]) for n in names[1:]},
                           "min_ratio_vs_allocating": {n: min(per[n]) / min(per["allocating"]) for n in names[1:]}}
                       for c, per in in_process.items()},
    }

    if args.baseline_tree is not None:
        order = ["baseline", "this", "this", "baseline"] * ((args.pairs + 1) // 2)
        order = order[:2 * args.pairs]
        runs = {"baseline": [], "this": []}
        files = {}
        for who in order:
            tree = args.baseline_tree if who == "baseline" else ROOT
            env = dict(os.environ, PYTHONPATH=str(tree))
            out = subprocess.run([sys.executable, __file__, "--worker", "--rounds", str(args.rounds),
                                  "--threads", str(args.threads), "--clock", args.clock], env=env,
                                 cwd=tree, check=True, capture_output=True, text=True).stdout
            data = json.loads(out.strip().splitlines()[-1])
            files[who] = data["kvkernels_file"]
            runs[who].append({c: v["allocating"] for c, v in data["results"].items()})
        report["across_builds"] = {
            "order": order, "kvkernels_files": files,
            # Per process: median and min seconds per call; pairs are adjacent processes (A B, B A, ...).
            "cases": {c: {"baseline": [summary(r[c]) for r in runs["baseline"]],
                          "this": [summary(r[c]) for r in runs["this"]],
                          "min_ratio_this_vs_baseline": [min(t[c]) / min(b[c]) for t, b in
                                                         zip(runs["this"], runs["baseline"])],
                          "median_ratio_this_vs_baseline": [statistics.median(t[c]) / statistics.median(b[c])
                                                            for t, b in zip(runs["this"], runs["baseline"])]}
                      for c in runs["this"][0]},
        }

    report["load_average_1_5_15min"] = {"start": load_before, "end": os.getloadavg()}
    text = render(report)
    print(text)
    stem = machine.write_result(args.out, "out-variants", report, text)
    print(f"wrote {stem}.json and .txt")
    return 0


def render(report) -> str:
    m = report["machine"]
    lines = [f"kvkernels out= / lse= (CPU), {report['date']}: {m['cpu_model']}, {m['usable_cpus']} CPUs, "
             f"{m['threads']} threads, torch {report['torch']}, ISA {m['kvkernels_cpu_isa']}",
             f"command: {report['command']}",
             f"load average (1, 5, 15 min) at start {report['load_average_1_5_15min']['start']}, at end "
             f"{report['load_average_1_5_15min']['end']} (a machine shared with other work: compare within a run)",
             f"{report['rounds']} rounds per case, each a sample of ~{report['sample_seconds'] * 1e3:.0f} ms of calls, "
             f"{report.get('clock', 'wall')} clock. us = microseconds per call, min / median over rounds.", "",
             "1. this build, one process, the three variants interleaved (order alternating by round);",
             "   ratio = median of per-round ratios to the allocating call [quartiles]; min ratio = min / min",
             f"{'case':50s} {'allocating us':>15s} {'out+lse us':>15s} {'out us':>15s}  "
             f"{'out+lse/alloc':>21s} {'min':>5s}  {'out/alloc':>21s} {'min':>5s}"]
    fmt = lambda s: f"{s['median']:.3f} [{s['q1']:.3f}, {s['q3']:.3f}]"  # noqa: E731
    us = lambda s: f"{s['min_us']:.1f} / {s['median_us']:.1f}"  # noqa: E731
    for c, r in report["in_process"].items():
        pc, rat, mr = r["per_call"], r["ratio_vs_allocating"], r["min_ratio_vs_allocating"]
        lines.append(f"{c:50s} {us(pc['allocating']):>15s} {us(pc['out+lse']):>15s} {us(pc['out']):>15s}  "
                     f"{fmt(rat['out+lse']):>21s} {mr['out+lse']:5.3f}  {fmt(rat['out']):>21s} {mr['out']:5.3f}")
    if "across_builds" in report:
        a = report["across_builds"]
        lines += ["", "2. the allocating call (the default path): baseline build vs this build, one process each, in the order",
                  "   " + " ".join(a["order"]) + "; per process min / median us; ratios this / baseline of the",
                  "   adjacent pairs (of mins, and of medians)",
                  f"   baseline: {a['kvkernels_files']['baseline']}", f"   this:     {a['kvkernels_files']['this']}"]
        for c, r in a["cases"].items():
            lines.append(f"{c}")
            lines.append("   baseline " + "  ".join(us(x) for x in r["baseline"]))
            lines.append("   this     " + "  ".join(us(x) for x in r["this"]))
            lines.append("   min ratios " + " ".join(f"{x:.3f}" for x in r["min_ratio_this_vs_baseline"])
                         + f"  (median {statistics.median(r['min_ratio_this_vs_baseline']):.3f});  median ratios "
                         + " ".join(f"{x:.3f}" for x in r["median_ratio_this_vs_baseline"])
                         + f"  (median {statistics.median(r['median_ratio_this_vs_baseline']):.3f})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
