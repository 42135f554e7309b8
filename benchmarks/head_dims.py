"""Paired CPU benchmark of paged_attention / gather_kv head dims: a baseline build against this tree.

Issue 25 items 3 and 6 (a value head dim of its own, head dims up to 512) must not slow the default
path (Dk == Dv). Each case runs in fresh worker processes that import kvkernels from one tree, in
ABBA order (baseline, new, new, baseline) per pair, on the same seeded inputs; a pair's ratio is
new / baseline of its two medians, so drift of the machine between pairs cancels. Cases the baseline
cannot run (Dv != Dk, head dim 512) run on the new tree only, next to a Dk == Dv case of the same run.

    python benchmarks/head_dims.py --baseline-tree /tmp/base --pairs 3 --out benchmarks/results
    python benchmarks/head_dims.py --quick    # tiny shapes, one pair: a smoke test, not a measurement

The baseline tree is a checkout of the commit to compare with, built in place
(`setup.py build_ext --inplace`). Results: a JSON and a text table (CPU model, torch, date, the
command) under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)

# name: (op, dtype, batch, context, q_len (0 = decode), Hq, Hkv, Dk, Dv, block); both: baseline runs it too
CASES = {
    "decode-bf16-b8-4k-d128": ("attn", "bfloat16", 8, 4096, 0, 32, 8, 128, 128, 16, True),
    "decode-f32-b8-4k-d64": ("attn", "float32", 8, 4096, 0, 32, 8, 64, 64, 16, True),
    "prefill-bf16-512of4k-d128": ("attn", "bfloat16", 1, 4096, 512, 32, 8, 128, 128, 16, True),
    "gather-bf16-b8-4k-d128": ("gather", "bfloat16", 8, 4096, 0, 0, 8, 128, 128, 16, True),
    "prefill-bf16-512of4k-k192v192-mha16": ("attn", "bfloat16", 1, 4096, 512, 16, 16, 192, 192, 16, True),
    "prefill-bf16-512of4k-k192v128-mha16": ("attn", "bfloat16", 1, 4096, 512, 16, 16, 192, 128, 16, False),
    "decode-bf16-b8-4k-k192v128-mha16": ("attn", "bfloat16", 8, 4096, 0, 16, 16, 192, 128, 16, False),
    "decode-bf16-b8-4k-d256": ("attn", "bfloat16", 8, 4096, 0, 32, 8, 256, 256, 16, True),
    "decode-bf16-b8-4k-d512": ("attn", "bfloat16", 8, 4096, 0, 32, 8, 512, 512, 16, False),
    "gather-bf16-b8-4k-k192v128": ("gather", "bfloat16", 8, 4096, 0, 0, 16, 192, 128, 16, False),
}
QUICK = {name: (op, dt, 2, 256, min(q, 64), hq, hkv, dk, dv, b, both)
         for name, (op, dt, _, _, q, hq, hkv, dk, dv, b, both) in CASES.items()}


def worker(args) -> None:
    """Times one case with the kvkernels of args.tree; prints one JSON line."""
    sys.path.insert(0, args.tree)
    import torch

    import kvkernels
    from kvkernels import ops

    assert os.path.dirname(kvkernels.__file__) == os.path.join(args.tree, "kvkernels"), kvkernels.__file__
    torch.set_num_threads(args.threads)
    op, dtype, batch, ctx, q_len, hq, hkv, dk, dv, b, _ = json.loads(args.case_spec)
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = ctx // b
    num_blocks = batch * blocks_per_seq + 1
    kc = torch.randn(num_blocks, b, hkv, dk, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, b, hkv, dv, generator=gen).to(dtype)
    table = torch.randperm(num_blocks - 1, generator=gen)[:batch * blocks_per_seq].reshape(batch, -1).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    if op == "attn":
        t = batch if q_len == 0 else batch * q_len
        q = torch.randn(t, hq, dk, generator=gen).to(dtype)
        qsl = None if q_len == 0 else torch.arange(0, t + 1, q_len, dtype=torch.int32)
        fn = lambda: ops.paged_attention(q, kc, vc, table, lens, qsl)  # noqa: E731
    else:
        fn = lambda: ops.gather_kv(kc, vc, table, lens, num_tokens=batch * ctx)  # noqa: E731
    for _ in range(2):
        fn()
    # Calls per round: about args.min_time seconds.
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, int(args.min_time / one))
    # Wall time, and the CPU time of the process (with one thread: the time the calls ran on a core;
    # on a machine shared with other jobs it leaves out the time the process waited for a core).
    rounds, cpu_rounds = [], []
    for _ in range(args.rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            fn()
        rounds.append((time.perf_counter() - t0) / reps)
        cpu_rounds.append((time.process_time() - c0) / reps)
    print(json.dumps({"median_s": statistics.median(rounds), "min_s": min(rounds), "rounds": rounds,
                      "cpu_rounds": cpu_rounds, "reps": reps, "isa": kvkernels.cpu_isa()}))


def run_worker(tree: str, spec, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", tree, "--case-spec", json.dumps(spec),
           "--rounds", str(args.rounds), "--min-time", str(args.min_time), "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-tree", help="a built checkout of the commit to compare with")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of calls per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--case-spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    import torch

    # Imported here, not at the top: a worker must import the kvkernels of the tree it measures.
    sys.path.insert(0, TREE)
    from kvkernels.bench.machine import cpu_model

    cases = QUICK if args.quick else CASES
    if args.quick:
        args.pairs, args.rounds, args.min_time = 1, 2, 0.02
    rows = []
    for name in args.cases.split(","):
        spec = cases[name]
        both = spec[-1] and args.baseline_tree
        pairs = []
        for k in range(args.pairs):
            if both:
                a1 = run_worker(args.baseline_tree, spec, args)
                b1 = run_worker(TREE, spec, args)
                b2 = run_worker(TREE, spec, args)
                a2 = run_worker(args.baseline_tree, spec, args)
                base = statistics.median(a1["rounds"] + a2["rounds"])
                new = statistics.median(b1["rounds"] + b2["rounds"])
                # Also the best rounds: on a shared machine the minimum is the least disturbed time.
                base_min, new_min = min(a1["min_s"], a2["min_s"]), min(b1["min_s"], b2["min_s"])
                base_cpu = statistics.median(a1["cpu_rounds"] + a2["cpu_rounds"])
                new_cpu = statistics.median(b1["cpu_rounds"] + b2["cpu_rounds"])
                pairs.append(dict(base_s=base, new_s=new, ratio=new / base, base_min_s=base_min,
                                  new_min_s=new_min, ratio_of_mins=new_min / base_min, base_cpu_s=base_cpu,
                                  new_cpu_s=new_cpu, cpu_ratio=new_cpu / base_cpu, isa=b1["isa"]))
            else:
                b1 = run_worker(TREE, spec, args)
                pairs.append(dict(base_s=None, new_s=statistics.median(b1["rounds"]), ratio=None,
                                  new_min_s=b1["min_s"], isa=b1["isa"]))
            print(f"{name} pair {k}: {pairs[-1]}", file=sys.stderr, flush=True)
        op, dtype, batch, ctx, q_len, hq, hkv, dk, dv, b, _ = spec
        esz = 4 if dtype == "float32" else 2
        kv_bytes = batch * ctx * hkv * (dk + dv) * esz
        new_med = statistics.median(x["new_s"] for x in pairs)
        row = dict(case=name, op=op, dtype=dtype, batch=batch, context=ctx, q_len=q_len, hq=hq, hkv=hkv, dk=dk, dv=dv,
                   block=b, pairs=pairs, new_median_s=new_med, kv_gbps=kv_bytes / new_med / 1e9, isa=pairs[0]["isa"])
        if both:
            ratios = [x["ratio"] for x in pairs]
            row.update(ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                       base_median_s=statistics.median(x["base_s"] for x in pairs),
                       ratio_of_mins_median=statistics.median(x["ratio_of_mins"] for x in pairs),
                       cpu_ratio_median=statistics.median(x["cpu_ratio"] for x in pairs),
                       cpu_ratio_min=min(x["cpu_ratio"] for x in pairs),
                       cpu_ratio_max=max(x["cpu_ratio"] for x in pairs))
        rows.append(row)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(cpu=cpu_model(), torch=torch.__version__, python=platform.python_version(),
                date=stamp.isoformat(timespec="seconds"), command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                baseline_tree=args.baseline_tree, threads=args.threads, pairs=args.pairs, rounds=args.rounds,
                min_time=args.min_time, quick=args.quick,
                load_average=os.getloadavg() if hasattr(os, "getloadavg") else None)
    lines = [f"# head dims, paired ABBA: {meta['cpu']}, torch {meta['torch']}, {meta['date']}, "
             f"{args.threads} thread(s), {args.pairs} pair(s) x 2 x {args.rounds} rounds",
             f"# {meta['command']}",
             "# new/base: median over pairs of (median new / median base); range: its min-max over pairs;",
             "# mins: median over pairs of (best new round / best base round); cpu: the same as new/base on the",
             "# process CPU time (one thread: leaves out waits for a core), and its min-max over pairs",
             f"{'case':40s} {'new ms':>9s} {'base ms':>9s} {'new/base':>9s} {'range':>13s} {'mins':>6s} "
             f"{'cpu':>6s} {'cpu range':>13s} {'K+V GB/s':>9s}"]
    for r in rows:
        base = f"{r['base_median_s'] * 1e3:9.3f}" if "ratio_median" in r else f"{'-':>9s}"
        ratio = f"{r['ratio_median']:9.3f}" if "ratio_median" in r else f"{'-':>9s}"
        rng = f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}" if "ratio_median" in r else "-"
        mins = f"{r['ratio_of_mins_median']:6.3f}" if "ratio_median" in r else f"{'-':>6s}"
        cpu = f"{r['cpu_ratio_median']:6.3f}" if "cpu_ratio_median" in r else f"{'-':>6s}"
        crng = f"{r['cpu_ratio_min']:.3f}-{r['cpu_ratio_max']:.3f}" if "cpu_ratio_median" in r else "-"
        lines.append(f"{r['case']:40s} {r['new_median_s'] * 1e3:9.3f} {base} {ratio} {rng:>13s} {mins} "
                     f"{cpu} {crng:>13s} {r['kv_gbps']:9.2f}")
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        cpu = "".join(c if c.isalnum() else "-" for c in meta["cpu"].lower()).strip("-")
        while "--" in cpu:
            cpu = cpu.replace("--", "-")
        base_name = os.path.join(args.out, f"head-dims-{cpu}-{stamp:%Y%m%d-%H%M%S}")
        with open(base_name + ".json", "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(base_name + ".txt", "w") as f:
            f.write(text + "\n")
        print(f"wrote {base_name}.json / .txt", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
