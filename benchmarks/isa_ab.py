"""Paired A/B of the CPU attention kernel's ISA paths in one process (KVKERNELS_CPU_ISA is read on
every call), on the benchmark's shapes, rotating cache copies from DRAM.

    python benchmarks/isa_ab.py --isas avx512vbmi,avx512bf16 --rounds 6
    python benchmarks/isa_ab.py --cases decode-bf16-b8x4096,decode-e4m3-b8x4096 --isas avx512bf16

Cases (--cases, comma-separated; default: every one): decode-<dtype>-b<batch>x<context> for dtype in
bf16, f32, e4m3, e5m2, e4m3h, e5m2h (h: per-kv-head scales) and prefill-<dtype>-<queries>x<context>
(bf16, e4m3; one sequence, a causal chunk at the end of the context). 32 query / 8 kv heads of 128,
block 16, shuffled block tables, queries bf16 (f32 for the f32 cache). Each round times every
(case, ISA) as the median of --calls calls, in the order A B .. B A (ABBA for two ISAs), so a drift
of the shared machine hits both sides alike; reported: the median over rounds of each side, the
median and range of the per-round ratios against the first ISA, GB/s of the cache bytes (decode)
or GFLOP/s (prefill; 4 x head_dim x heads x visible (query, key) pairs), and the read bandwidth
measured before and after with the same threads. Prefill also times torch.matmul of two square
bfloat16 2048 matrices (oneDNN) in the same rounds: the yardstick for the bf16 multiply-add rate.
Outputs of the ISAs are compared (max abs difference) and the first ISA's against float32 math.
Writes benchmarks/results/isa-ab-<cpu>-<date>.json and .txt.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kvkernels  # noqa: E402
from kvkernels import ops  # noqa: E402
from kvkernels.bench import machine  # noqa: E402
from kvkernels.bench.attention import (FP8_SCALE, HEAD_DIM, HEADS, KV_HEADS, attention_f32,  # noqa: E402
                                       build_paged, paged_layer_bytes, sequence_f32)

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
          "e4m3h": torch.float8_e4m3fn, "e5m2h": torch.float8_e5m2}
DEFAULT_CASES = ("decode-bf16-b8x4096,decode-e4m3-b8x4096,decode-e5m2-b8x4096,decode-e4m3h-b8x4096,"
                 "decode-bf16-b1x16384,decode-e4m3-b1x16384,decode-e5m2h-b1x16384,decode-f32-b8x4096,"
                 "prefill-bf16-512x4096,prefill-e4m3-512x4096")


def parse_case(name: str):
    kind, dt, shape = name.split("-")
    a, b = shape.lstrip("b").split("x")
    return kind, dt, int(a), int(b)


def build(name: str, rotate_bytes: int, gen: torch.Generator):
    kind, dt, a, context = parse_case(name)
    dtype = DTYPES[dt]
    batch, queries = (a, a) if kind == "decode" else (1, a)
    layers = max(1, math.ceil(rotate_bytes / paged_layer_bytes(batch, context, dtype)))  # 0: one resident copy
    data = build_paged(batch, context, queries, dtype, layers, gen)
    if dt.endswith("h"):  # per-kv-head scales around the per-tensor one
        data.k_scale = torch.linspace(0.75, 1.25, KV_HEADS) * FP8_SCALE
        data.v_scale = torch.linspace(1.25, 0.75, KV_HEADS) * FP8_SCALE
    qsl = None if kind == "decode" else torch.tensor([0, queries], dtype=torch.int32)
    if kind == "decode":
        work = 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize  # cache bytes
    else:
        pairs = sum(context - queries + i + 1 for i in range(queries))
        work = 4 * HEAD_DIM * HEADS * pairs  # flops
    return kind, data, qsl, layers, work


def call_fn(data, qsl, layers):
    state = {"i": 0}

    def call():
        i = state["i"] % layers
        state["i"] += 1
        return ops.paged_attention(data.query, data.key_caches[i], data.value_caches[i], data.block_tables,
                                   data.seq_lens, qsl, k_scale=data.k_scale, v_scale=data.v_scale)
    return call


CLOCK = time.perf_counter


def timed(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def with_isa(isa: str, fn):
    os.environ["KVKERNELS_CPU_ISA"] = isa
    try:
        return fn()
    finally:
        os.environ.pop("KVKERNELS_CPU_ISA", None)


def reference_check(kind, data, qsl, out) -> float:
    """max |out - float32 attention| over the first sequence (decode) or every query of the chunk."""
    def sc(s):  # per-kv-head scales broadcast over [context, kv heads, dim]
        return s.view(-1, 1) if s is not None and s.numel() > 1 else s
    k = sequence_f32(data.key_caches[0], data.block_ids[0], data.context, sc(data.k_scale))
    v = sequence_f32(data.value_caches[0], data.block_ids[0], data.context, sc(data.v_scale))
    q = data.query[:1] if kind == "decode" else data.query
    ref = attention_f32(q, k, v, HEAD_DIM ** -0.5)
    return (out[:q.shape[0]].float() - ref).abs().max().item()


def matmul_fn():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(2048, 2048, generator=g).to(torch.bfloat16)
    b = torch.randn(2048, 2048, generator=g).to(torch.bfloat16)
    return lambda: torch.matmul(a, b), 2 * 2048 ** 3


def supported_isas() -> list:
    out = []
    for isa in ("avx512vbmi", "avx512bf16", "avx512amx"):
        try:
            with_isa(isa, kvkernels.cpu_isa)
            out.append(isa)
        except RuntimeError:
            pass
    return out or [kvkernels.cpu_isa()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--isas", default="avx512vbmi,avx512bf16",
                   help="first = the baseline of the ratios; 'auto': those of avx512vbmi, avx512bf16, avx512amx this "
                        "CPU supports (else its best path alone)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, one round: a smoke test, not a measurement")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=15, help="calls per (round, case, ISA); the median is kept")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rotate-mib", type=int, default=512, help="cache copies per case cover this much memory")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the process's CPU seconds per call (time.process_time: all threads; leaves out the "
                        "time the process waited for a core on a shared machine)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    isas = supported_isas() if args.isas == "auto" else args.isas.split(",")
    if args.quick:
        args.cases = "decode-bf16-b2x512,decode-e4m3-b2x512,prefill-bf16-64x512"
        args.rounds, args.calls, args.rotate_mib = 1, 3, 0
    names = args.cases.split(",")
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "machine": {"cpu_model": machine.cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                    "default_isa": kvkernels.cpu_isa(), "platform": platform.platform(),
                    "load_average_at_start": os.getloadavg()},
        "versions": {"torch": torch.__version__, "kvkernels": kvkernels.__version__,
                     "python": platform.python_version()},
        "isas": isas, "rounds": args.rounds, "calls": args.calls, "clock": args.clock,
        "rotate_mib": args.rotate_mib,
    }
    bw = lambda: machine.measure_bandwidth(512 << 20, 0.5)  # noqa: E731
    before = bw()
    result["bandwidth_before"] = before
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name in names:
        print(f"[isa-ab] {name} ...", file=sys.stderr, flush=True)
        kind, data, qsl, layers, work = build(name, args.rotate_mib << 20, gen)
        fn = call_fn(data, qsl, layers)
        outs = {isa: with_isa(isa, fn)[0] for isa in isas}
        for isa in isas:  # warm-up over every copy
            with_isa(isa, lambda: [fn() for _ in range(layers)])
        per = {isa: [] for isa in isas}
        mm = []
        if kind == "prefill":
            mfn, mflops = matmul_fn()
            mfn()
        order = isas + isas[::-1]
        for _ in range(args.rounds):
            for isa in order:
                per[isa].append(with_isa(isa, lambda: timed(fn, args.calls)))
            if kind == "prefill":
                mm.append(timed(mfn, 5))
        c = {"case": name, "kind": kind, "layers": layers, "work": work,
             "unit": "cache bytes" if kind == "decode" else "flops",
             "median_s": {isa: statistics.median(v) for isa, v in per.items()},
             "min_s": {isa: min(v) for isa, v in per.items()}, "samples_s": per,
             "max_abs_diff_vs_first": {isa: (outs[isa].float() - outs[isas[0]].float()).abs().max().item()
                                       for isa in isas},
             "max_abs_diff_f32_math": {isa: reference_check(kind, data, qsl, outs[isa]) for isa in isas}}
        base = per[isas[0]]
        pairs = len(base) // 2
        c["ratio_vs_first"] = {}
        for isa in isas[1:]:
            # per round: the mean of B's two samples over the mean of A's two samples
            r = [(per[isa][2 * i] + per[isa][2 * i + 1]) / (base[2 * i] + base[2 * i + 1]) for i in range(pairs)]
            c["ratio_vs_first"][isa] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
        rate = {isa: work / t / 1e9 for isa, t in c["median_s"].items()}
        c["gb_s" if kind == "decode" else "gflop_s"] = rate
        if mm:
            c["matmul_bf16_2048_gflop_s"] = {"median": mflops / statistics.median(mm) / 1e9,
                                             "best": mflops / min(mm) / 1e9}
        cases.append(c)
        del data, fn, outs
    result["cases"] = cases
    result["bandwidth_after"] = bw()
    result["machine"]["load_average_at_end"] = os.getloadavg()
    text = report(result)
    print(text)
    # One line per case for scripts/gpu_validate.sh's summary (its b_cpu step keeps "variant:" lines).
    print(f"variant: cpu {result['machine']['cpu_model']}, {result['machine']['threads']} threads, isas {','.join(isas)}, "
          f"read {result['bandwidth_before']['read']:.0f}/{result['bandwidth_after']['read']:.0f} GB/s")
    for c in cases:
        rates = c.get("gb_s") or c.get("gflop_s")
        unit = "GB/s" if c["kind"] == "decode" else "GFLOP/s"
        line = f"variant: cpu {c['case']} " + ", ".join(
            f"{isa} {c['median_s'][isa] * 1e3:.2f} ms {rates[isa]:.0f} {unit}" for isa in isas)
        if "matmul_bf16_2048_gflop_s" in c:
            line += f"; matmul bf16 {c['matmul_bf16_2048_gflop_s']['median']:.0f} GFLOP/s"
        print(line)
    if not args.no_write and not args.quick:
        stem = machine.write_result(args.out, "isa-ab", result, text)
        print(f"wrote {stem}.json and .txt", file=sys.stderr)
    return 0


def report(r: dict) -> str:
    m = r["machine"]
    isas = r["isas"]
    lines = [f"ISA A/B — {m['cpu_model']}, {r['date']}, torch {r['versions']['torch']}, {m['threads']} threads, "
             f"load average {m['load_average_at_start'][0]:.1f} at start, {m['load_average_at_end'][0]:.1f} at end",
             f"command: {r['command']}",
             f"read bandwidth {r['bandwidth_before']['read']:.1f} GB/s before, {r['bandwidth_after']['read']:.1f} after "
             f"(copy {r['bandwidth_before']['copy']:.1f} / {r['bandwidth_after']['copy']:.1f}); "
             f"{r['rounds']} rounds x {r['calls']} calls, ABBA, {r['clock']} clock, cache copies over "
             f"{r['rotate_mib']} MiB", ""]
    head = f"{'case':<24}" + "".join(f"{isa + ' ms':>16}" for isa in isas) + \
        "".join(f"{isa + '/' + isas[0]:>28}" for isa in isas[1:]) + f"{'rate':>24}"
    lines.append(head)
    for c in r["cases"]:
        row = f"{c['case']:<24}" + "".join(f"{c['median_s'][isa] * 1e3:>16.3f}" for isa in isas)
        for isa in isas[1:]:
            q = c["ratio_vs_first"][isa]
            row += f"{q['median']:>12.3f} [{q['min']:.3f}, {q['max']:.3f}]"
        unit = "GB/s" if c["kind"] == "decode" else "GFLOP/s"
        rates = c.get("gb_s") or c.get("gflop_s")
        row += "   " + " / ".join(f"{rates[isa]:.1f}" for isa in isas) + f" {unit}"
        if "matmul_bf16_2048_gflop_s" in c:
            mm = c["matmul_bf16_2048_gflop_s"]
            row += f" (matmul bf16 {mm['median']:.0f}, best {mm['best']:.0f}; " + \
                   " / ".join(f"{rates[isa] / mm['median']:.2f}" for isa in isas) + " of it)"
        lines.append(row)
        lines.append(f"{'':<24}max |diff| vs {isas[0]}: " +
                     ", ".join(f"{isa} {c['max_abs_diff_vs_first'][isa]:.2e}" for isa in isas[1:]) +
                     "; vs float32 math: " + ", ".join(f"{isa} {c['max_abs_diff_f32_math'][isa]:.2e}" for isa in isas))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
