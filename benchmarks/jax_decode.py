"""kvkernels.jax's decode step against the same kernels through torch and against plain JAX attention.

    python benchmarks/jax_decode.py [--reps 40] [--device cpu|cuda] [--shapes 4x512,8x2048] [--threads 2,1]
                                    [--quick] [--out DIR]
    (needs build-jax/libkvkernels_jax.so: make jax; and the torch extension: make build)

One decode step of one layer on the same data (bf16 queries and caches, 32 query / 8 kv heads, head dim
128, pages of 16 tokens, every sequence at the same length):

* ``jax_kvkernels``: ``jax.jit`` of ``kvkernels.jax.reshape_and_cache`` (the step's new K/V) then
  ``kvkernels.jax.paged_attention``, the caches donated (written in place);
* ``torch_kvkernels``: ``torch.ops.kvkernels.reshape_and_cache`` then ``torch.ops.kvkernels.paged_attention``,
  eager, on torch tensors holding the same values;
* ``jax_dense``: plain JAX on the same pages, jitted and donated: the new K/V scattered into the pages
  (``.at[].set``), every sequence's pages gathered through its block table, then masked softmax attention
  (``einsum``, float32 accumulation) — what a JAX program without these kernels does.

Also the attention alone (``*_attn``, no write), and the ``jax_kvkernels`` step with the page pool 10x larger
(the same sequences; the step must not get slower: the donated pages are written in place, never copied).
Every variant of a row runs interleaved rep by rep, in a new random order each rep and after a 5 ms pause,
so a load change on the shared machine hits all alike and none always follows the same neighbour; each rep's jax/torch ratio is paired (the same moment). Reported: wall-clock median and minimum
per variant and its process CPU time (every thread of the process; it leaves out the time spent waiting
for a core, which dominates the wall-clock spread on an oversubscribed machine), the median of the paired
ratios of both and their interquartile ranges. Writes
benchmarks/results/jax-<device>-<cpu>-<date>.json / .txt with the CPU model, versions, thread counts and the
load average before and after.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvkernels from this checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvkernels  # noqa: F401,E402  (registers torch.ops.kvkernels)
import kvkernels.jax as kj  # noqa: E402
from kvkernels.bench.machine import cpu_model, slug  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
GAP_S = 0.005  # pause before each timed call (see timed)


def make_data(batch, context, num_pages, seed=0):
    """numpy arrays of one decode step: caches holding ``context - 1`` tokens per sequence (random pages),
    the new token's K/V and slot, the query, block tables and lengths (which count the new token)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-context // PAGE)
    assert num_pages > batch * pages_per_seq
    ids = rng.permutation(np.arange(1, num_pages))[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    bf16 = ml_dtypes.bfloat16
    kc = np.zeros((num_pages, PAGE, HKV, D), bf16)
    vc = np.zeros((num_pages, PAGE, HKV, D), bf16)
    used = ids.reshape(-1)
    kc[used] = rng.standard_normal((used.size, PAGE, HKV, D), np.float32).astype(bf16)
    vc[used] = rng.standard_normal((used.size, PAGE, HKV, D), np.float32).astype(bf16)
    pos = context - 1
    slots = (ids[:, pos // PAGE] * PAGE + pos % PAGE).astype(np.int32)
    return dict(q=rng.standard_normal((batch, HQ, D), np.float32).astype(bf16),
                k=rng.standard_normal((batch, HKV, D), np.float32).astype(bf16),
                v=rng.standard_normal((batch, HKV, D), np.float32).astype(bf16),
                kc=kc, vc=vc, bt=ids.astype(np.int32), sl=np.full(batch, context, np.int32), slots=slots)


def to_torch(a, device):
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)


def kvk_step(q, k, v, kc, vc, bt, sl, slots):
    kc, vc = kj.reshape_and_cache(k, v, kc, vc, slots)
    out, _ = kj.paged_attention(q, kc, vc, bt, sl)
    return out, kc, vc


def dense_attention(q, kc, vc, bt, sl):
    s, pages = bt.shape
    k = kc[bt].reshape(s, pages * PAGE, HKV, D)  # gather every sequence's pages: [S, L, Hkv, D]
    v = vc[bt].reshape(s, pages * PAGE, HKV, D)
    qg = q.reshape(s, HKV, HQ // HKV, D)
    logits = jnp.einsum("shgd,slhd->shgl", qg, k, preferred_element_type=jnp.float32) * D ** -0.5
    mask = jnp.arange(pages * PAGE)[None, :] < sl[:, None]
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    w = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("shgl,slhd->shgd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(s, HQ, D).astype(q.dtype)


def dense_step(q, k, v, kc, vc, bt, sl, slots):
    kc = kc.at[slots // PAGE, slots % PAGE].set(k)
    vc = vc.at[slots // PAGE, slots % PAGE].set(v)
    return dense_attention(q, kc, vc, bt, sl), kc, vc


class Stateful:
    """A jitted step with donated caches, timed call after call (each call's caches feed the next)."""

    def __init__(self, fn, data, device):
        put = lambda a: jax.device_put(a, device)  # noqa: E731
        self.args = {n: put(data[n]) for n in ("q", "k", "v", "bt", "sl", "slots")}
        self.kc, self.vc = put(data["kc"]), put(data["vc"])
        self.fn = jax.jit(fn, donate_argnums=(3, 4))

    def __call__(self):
        a = self.args
        out, self.kc, self.vc = self.fn(a["q"], a["k"], a["v"], self.kc, self.vc, a["bt"], a["sl"], a["slots"])
        out.block_until_ready()


def timed(fns: dict, reps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-rep wall-clock and process CPU seconds of each function, the functions interleaved (every function
    once per rep, in a random order) after two warm-up calls. CPU time (every thread of the process) leaves out the time the process waits
    for a core, which on a shared, oversubscribed machine dominates the wall-clock spread."""
    for fn in fns.values():
        fn()
        fn()
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    rng = np.random.default_rng(0)
    names = list(fns)
    for _ in range(reps):
        # A new order each rep, and a pause before each call: no variant always runs in the wake of the same
        # neighbour (whose cache footprint, or thread pool still spinning after it, it would inherit).
        for name in rng.permutation(names):
            fn = fns[name]
            time.sleep(GAP_S)
            c, t = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return wall, cpu


def summary(wall: dict[str, list[float]], cpu: dict[str, list[float]], pairs: list[tuple[str, str]]) -> dict:
    out = {name: {"median_ms": statistics.median(x) * 1e3, "min_ms": min(x) * 1e3,
                  "cpu_median_ms": statistics.median(cpu[name]) * 1e3} for name, x in wall.items()}
    for a, b in pairs:
        entry = {}
        for kind, times in (("", wall), ("cpu_", cpu)):
            ratios = sorted(x / y for x, y in zip(times[a], times[b]) if y > 0)
            q = statistics.quantiles(ratios, n=4)
            entry.update({f"{kind}median": statistics.median(ratios), f"{kind}q1": q[0], f"{kind}q3": q[2]})
        entry["ratio_of_mins"] = min(wall[a]) / min(wall[b])
        out[f"{a}/{b}"] = entry
    return out


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="one small shape, 10 reps (a smoke run)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default="4x512,8x2048", help="comma-separated batch x context, e.g. 8x2048")
    ap.add_argument("--threads", default=None,
                    help="comma-separated thread counts to run every shape with (torch.set_num_threads and "
                         "KVKERNELS_JAX_CPU_THREADS alike; default: all CPUs, then 1 on the CPU)")
    args = ap.parse_args()
    try:
        device = jax.devices(args.device)[0]
    except RuntimeError:
        print(f"no CUDA device for jax ({args.device}): nothing to measure")
        return
    tdev = "cuda" if args.device == "cuda" else "cpu"
    if tdev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device for torch: nothing to measure")
        return
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if not args.quick else [(2, 256)]
    reps = 10 if args.quick else args.reps
    load_before = os.getloadavg()
    if args.threads:
        thread_counts = [int(x) for x in args.threads.split(",")]
    else:
        thread_counts = [os.cpu_count(), 1] if args.device == "cpu" and os.cpu_count() > 1 else [os.cpu_count()]
    rows = []
    for (batch, context), threads in [(s, n) for n in thread_counts for s in shapes]:
        # The same cap for both: torch's intra-op threads and the kvkernels.jax CPU handlers' share of XLA's
        # pool (XLA's own code, jax_dense, keeps its pool).
        torch.set_num_threads(threads)
        os.environ["KVKERNELS_JAX_CPU_THREADS"] = str(threads)
        base_pages = 1 + batch * -(-context // PAGE)
        data = make_data(batch, context, base_pages + 8)
        big = make_data(batch, context, 10 * (base_pages + 8))
        t = {n: to_torch(data[n], tdev) for n in data}
        op = torch.ops.kvkernels

        def torch_step():
            op.reshape_and_cache(t["k"], t["v"], t["kc"], t["vc"], t["slots"].long())
            op.paged_attention(t["q"], t["kc"], t["vc"], t["bt"], t["sl"])
            if tdev == "cuda":
                torch.cuda.synchronize()

        def torch_attn():
            op.paged_attention(t["q"], t["kc"], t["vc"], t["bt"], t["sl"])
            if tdev == "cuda":
                torch.cuda.synchronize()

        jd = {n: jax.device_put(data[n], device) for n in ("q", "kc", "vc", "bt", "sl")}
        kvk_attn_fn = jax.jit(lambda q, kc, vc, bt, sl: kj.paged_attention(q, kc, vc, bt, sl)[0])
        dense_attn_fn = jax.jit(dense_attention)
        fns = {
            "jax_kvkernels": Stateful(kvk_step, data, device),
            "torch_kvkernels": torch_step,
            "jax_dense": Stateful(dense_step, data, device),
            "jax_kvkernels_10x_pages": Stateful(kvk_step, big, device),
            "jax_kvkernels_attn": lambda: kvk_attn_fn(*jd.values()).block_until_ready(),
            "torch_kvkernels_attn": torch_attn,
            "jax_dense_attn": lambda: dense_attn_fn(*jd.values()).block_until_ready(),
        }
        # The three give the same attention (the dense one to bf16 rounding).
        a = np.asarray(kvk_attn_fn(*jd.values()), np.float32)
        b = np.asarray(dense_attn_fn(*jd.values()), np.float32)
        c = op.paged_attention(t["q"], t["kc"], t["vc"], t["bt"], t["sl"])[0].float().cpu().numpy()
        agree = {"kvkernels_jax_vs_torch_max_abs": float(np.abs(a - c).max()),
                 "kvkernels_jax_vs_dense_max_abs": float(np.abs(a - b).max())}
        wall, cpu = timed(fns, reps)
        row = {"batch": batch, "context": context, "threads": threads, "num_pages": base_pages + 8, "cache_bytes": 2 * data["kc"].nbytes,
               "cache_bytes_10x": 2 * big["kc"].nbytes, "agreement": agree,
               **summary(wall, cpu, [("jax_kvkernels", "torch_kvkernels"), ("jax_kvkernels_attn", "torch_kvkernels_attn"),
                                 ("jax_dense", "jax_kvkernels"), ("jax_dense_attn", "jax_kvkernels_attn"),
                                 ("jax_kvkernels_10x_pages", "jax_kvkernels")])}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()}, default=float)[:600], flush=True)

    import ctypes  # the XLA intra-op pool the CPU handlers saw
    lib = kj._library.load()
    lib.kvkernels_jax_cpu_threads.restype = ctypes.c_int64
    now = datetime.datetime.now(datetime.timezone.utc)
    report = {"date": now.isoformat(timespec="seconds"), "device": str(device), "cpu_model": cpu_model(),
              "cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "thread_counts": thread_counts, "xla_cpu_pool_threads_last_call": lib.kvkernels_jax_cpu_threads(),
              "cpu_isa": kj.cpu_isa(), "jax": jax.__version__, "jaxlib": jax.lib.__version__,
              "torch": torch.__version__, "numpy": np.__version__, "kvkernels_git": git_rev(),
              "platform": platform.platform(), "shape": dict(hq=HQ, hkv=HKV, d=D, page=PAGE, dtype="bfloat16"),
              "reps": reps, "rows": rows}
    lines = [f"kvkernels.jax decode step (one layer: reshape_and_cache + paged_attention), bf16, Hq {HQ} / Hkv {HKV} / "
             f"D {D}, pages of {PAGE}; device {device}; {cpu_model()} ({os.cpu_count()} CPUs); jax {jax.__version__}, "
             f"torch {torch.__version__}, kvkernels {git_rev()}, CPU path {kj.cpu_isa()}; threads per row (torch and the "
             f"kvkernels.jax handlers alike; jax_dense: XLA's pool); {report['date']}; load average "
             f"{load_before[0]:.1f} before, {report['load_average_after'][0]:.1f} after; {reps} interleaved reps", ""]
    for r in rows:
        lines.append(f"batch {r['batch']} x context {r['context']} ({r['cache_bytes'] / 2**20:.0f} MiB of K/V pages; "
                     f"10x pool {r['cache_bytes_10x'] / 2**20:.0f} MiB), {r['threads']} thread(s):   wall median / min ms, "
                     f"process CPU median ms")
        for name in ("jax_kvkernels", "torch_kvkernels", "jax_dense", "jax_kvkernels_10x_pages",
                     "jax_kvkernels_attn", "torch_kvkernels_attn", "jax_dense_attn"):
            lines.append(f"  {name:<26} {r[name]['median_ms']:8.3f} / {r[name]['min_ms']:8.3f}   CPU "
                         f"{r[name]['cpu_median_ms']:8.3f}")
        for pair in ("jax_kvkernels/torch_kvkernels", "jax_kvkernels_attn/torch_kvkernels_attn",
                     "jax_dense/jax_kvkernels", "jax_dense_attn/jax_kvkernels_attn",
                     "jax_kvkernels_10x_pages/jax_kvkernels"):
            p = r[pair]
            lines.append(f"  ratio {pair:<42} paired median {p['median']:.3f} (IQR {p['q1']:.3f}-{p['q3']:.3f}), "
                         f"ratio of minimums {p['ratio_of_mins']:.3f}; CPU time: paired median {p['cpu_median']:.3f} "
                         f"(IQR {p['cpu_q1']:.3f}-{p['cpu_q3']:.3f})")
        lines.append(f"  agreement: max |jax - torch| {r['agreement']['kvkernels_jax_vs_torch_max_abs']:.3g}, "
                     f"max |kvkernels - dense| {r['agreement']['kvkernels_jax_vs_dense_max_abs']:.3g}")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"jax-{args.device}-{slug(cpu_model())}-{now.strftime('%Y%m%d-%H%M%S')}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=float))
    (out / f"{stem}.txt").write_text(text + "\n")
    print(f"wrote {out / stem}.json/.txt")


if __name__ == "__main__":
    main()
