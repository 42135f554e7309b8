"""vLLM's OpenAI server under concurrent streaming load, on kvkernels and on vLLM's own CPU attention
(CPU_ATTN), in one run.

Run from the vLLM venv (``make bench-vllm-serve``, or ``build-vllm/venv/bin/python
benchmarks/vllm_serve_bench.py``). The driver is ``tests/vllm/serve_load.py``, the one
``tests/vllm/test_vllm_serve_load.py`` runs at a small size in ``make test-vllm``; here:

- the model: a random-weight Llama (vLLM's ``load_format="dummy"``; only a config.json is written, as
  in ``vllm_bench.py``: 8 layers of width 1024, 32 query / 8 kv heads x 128, intermediate 2048) with the
  tests' word-level chat tokenizer (vocabulary 256, so the model's is 256 too), bfloat16;
- each configuration (``--configs``, backend:block size; CPU_ATTN takes multiples of 32 only) is a fresh
  server (tensor parallel 2, one core per rank, ``--enforce-eager``, prefix caching, a KV pool of
  ``--pool-tokens`` tokens: smaller than the load needs at once, so vLLM preempts), in the order
  A B .. B A (``--reps 2``) so a drift of the shared machine hits all alike;
- per server: a short warm-up load, then the measured load (``make_workload``: ``--requests`` streaming
  requests, all at once unless ``--concurrency``, completions and chat completions alternately, prompts
  sharing one of ``--prefixes`` prefixes, mixed prompt and output lengths, every ``--cancel-every``-th
  request cancelled by the client after a few tokens; greedy, ``ignore_eos``), the engine drained, the
  memory of the server's process tree before and after (RSS, /proc), vLLM's counters (preemptions,
  prefix-cache hits), the checks of the test (``serve_load.problems``: every request completed with its
  tokens or cancelled cleanly, the server answers afterwards, the abort path);
- reported per server: output tokens/s and requests/s over the load's wall time, time to first token and
  end-to-end latency (p50 / p99; end to end over completed requests), and per kvkernels configuration its
  ratios to CPU_ATTN's medians (throughput: > 1 is faster; latency: < 1 is faster); the requests whose
  greedy tokens equal CPU_ATTN's (bfloat16 random weights: near-ties may differ; not a check here).

Writes ``benchmarks/results/vllm-serve-<cpu>-<date>.json`` and ``.txt``. Exit code 1 when a check failed.
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
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))  # serve_load, vllm_models (not tests/: it holds "vllm")
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_load as sl  # noqa: E402


def write_model(dest: Path, args) -> str:
    from vllm_bench import write_config
    from vllm_models import VOCAB, save_chat_tokenizer

    cfg = SimpleNamespace(hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                          layers=args.layers, intermediate=args.intermediate, vocab=VOCAB, dtype=args.dtype)
    write_config(dest, cfg)
    save_chat_tokenizer(str(dest))
    return str(dest)


def lscpu() -> dict:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "L2 cache",
            "L3 cache", "Hypervisor vendor", "NUMA node(s)")
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines()) if k.strip() in keep}


def run_one(backend: str, block: int, model: str, specs, warmup, args, log_dir: Path) -> dict:
    server = sl.Server(model, backend, str(log_dir / f"{backend}-{block}-{time.time():.0f}.log"), block_size=block,
                       num_blocks=args.pool_tokens // block, max_model_len=args.max_model_len, dtype=args.dtype,
                       extra_args=("--load-format", "dummy"))
    print(f"[serve] {backend} block {block}: starting ...", file=sys.stderr, flush=True)
    server.start(timeout=900)
    try:
        sess = sl.session(server, specs, warmup=warmup, settle_s=args.settle, concurrency=args.concurrency,
                          timeout=3600)
    finally:
        left = server.stop()
    sess["block_size"] = block
    sess["log_errors"] = server.log_errors()
    sess["shutdown_log_errors"] = server.log_errors(shutdown=True)
    sess["processes_left"] = left
    sess["problems"] = sl.problems(sess, specs, warmup) + [f"log: {e}" for e in sess["log_errors"][:20]] + \
        ([f"processes left after shutdown: {left}"] if left else [])
    sess["summary"] = sl.summarize(sess)
    sess["memory_growth"] = sl.memory_growth(sess)
    s = sess["summary"]
    print(f"[serve] {backend} block {block}: {s['output_tokens_per_s']:.1f} tok/s, TTFT p50 {s['ttft_p50_s']:.2f} "
          f"s, e2e p50 {s['e2e_p50_s']:.2f} s, preemptions {sess['metrics_delta']['vllm:num_preemptions_total']:.0f}"
          + (f", PROBLEMS: {sess['problems'][:3]}" if sess["problems"] else ""), file=sys.stderr, flush=True)
    return sess


def slim(sess: dict) -> dict:
    """A session without token lists (they are compared in this run; the JSON keeps counts and timings)."""
    out = {k: v for k, v in sess.items() if k not in ("results", "warmup")}
    out["requests"] = [{k: r[k] for k in ("index", "kind", "max_tokens", "cancelled", "finish_reason", "ttft_s",
                                          "e2e_s", "start_s", "chunks")} | {"tokens": len(r["tokens"])}
                       for r in sess["results"]]
    out["after"] = {k: (v if k in ("health", "abort") else {"index": v["index"], "tokens": len(v["tokens"])})
                    for k, v in sess["after"].items()}
    return out


def table(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [f"vLLM OpenAI server under load: kvkernels vs vLLM CPU_ATTN — {m['cpu_model']}, {result['date']}, "
             f"torch {result['versions']['torch']}, vllm {result['versions']['vllm']}, load average "
             f"{m['load_average_at_start'][0]:.1f} at start, {m['load_average_at_end'][0]:.1f} at end "
             f"({m['cores']} CPUs)", "",
             f"Model: random-weight Llama, {s['layers']} layers of width {s['hidden']}, {s['heads']} q / "
             f"{s['kv_heads']} kv heads x {s['head_dim']}, {s['dtype']}, tensor parallel 2 (one core per rank), "
             "enforce_eager, "
             f"prefix caching, KV pool {s['pool_tokens']} tokens.",
             f"Load: {s['requests']} streaming requests (concurrency {s['concurrency'] or s['requests']}), completions "
             f"and chats alternately, {s['prefixes']} shared prefixes of {s['prefix_len']} tokens, tails "
             f"{s['tail_len']}, {s['out_len']} new tokens, every {s['cancel_every']}th cancelled after "
             f"{s['cancel_after']} tokens; greedy, ignore_eos.", "",
             f"{'backend':<10}{'block':>6}{'out tok/s':>11}{'req/s':>8}{'TTFT p50':>10}{'p99':>8}{'e2e p50':>9}"
             f"{'p99':>8}{'preempt':>9}{'hit %':>7}{'aborted':>9}{'RSS MiB':>9}{'+after':>8}{'startup':>9}"
             f"{'CPU s':>7}{'ms/tok':>8}{'load':>11}"]
    for r in result["runs"]:
        x, d = r["summary"], r["metrics_delta"]
        hit = 100 * d["vllm:prefix_cache_hits_total"] / max(d["vllm:prefix_cache_queries_total"], 1)
        aborted = f"{x['requests'] - sum(d['finished'].values()):.0f}/{x['cancelled']}"
        lines.append(f"{r['backend']:<10}{r['block_size']:>6}{x['output_tokens_per_s']:>11.1f}"
                     f"{x['requests_per_s']:>8.2f}"
                     f"{x['ttft_p50_s']:>10.2f}{x['ttft_p99_s']:>8.2f}{x['e2e_p50_s']:>9.2f}{x['e2e_p99_s']:>8.2f}"
                     f"{d['vllm:num_preemptions_total']:>9.0f}{hit:>7.1f}{aborted:>9}"
                     f"{r['mem_before']['rss'] / 2**20:>9.0f}"
                     f"{r['memory_growth']['total'] / 2**20:>+8.0f}{r['startup_s']:>9.0f}"
                     + (f"{r['cpu_s']['total']:>7.0f}{x['cpu_ms_per_token']:>8.1f}"
                        f"{r['load_average']['start'][0]:>6.1f}-{r['load_average']['end'][0]:<4.1f}"
                        if "cpu_s" in r else ""))
    lines.append("(aborted: cancelled requests the engine stopped before their last token / cancelled by the client; "
                 "RSS: the server's process tree before the load, +after: its growth once drained and settled;\n"
                 " CPU s: CPU time of the server's processes during the load, ms/tok: per output token; load: the "
                 "machine's 1-minute load average at the load's start and end)")
    lines.append("")
    lines.append("Medians per configuration; ratios to CPU_ATTN (throughput > 1 and latency < 1: kvkernels faster):")
    for name, c in result["comparison"].items():
        lines.append(f"{name}: {c['output_tokens_per_s']:.1f} tok/s, {c['requests_per_s']:.2f} req/s, TTFT p50/p99 "
                     f"{c['ttft_p50_s']:.2f}/{c['ttft_p99_s']:.2f} s, e2e p50/p99 {c['e2e_p50_s']:.2f}/"
                     f"{c['e2e_p99_s']:.2f} s"
                     + ("" if "ratios" not in c else
                        "; ratios: throughput {output_tokens_per_s:.2f}x tok/s, {requests_per_s:.2f}x req/s, TTFT p50 "
                        "{ttft_p50_s:.2f} p99 {ttft_p99_s:.2f}, e2e p50 {e2e_p50_s:.2f} p99 {e2e_p99_s:.2f}"
                        .format(**c["ratios"]) + (f", CPU per token {c['ratios']['cpu_ms_per_token']:.2f}"
                                                   if c["ratios"].get("cpu_ms_per_token") else ""))
                     + (f", CPU {c['cpu_ms_per_token']:.1f} ms/token" if c.get("cpu_ms_per_token") else "")
                     + ("" if "tokens_equal" not in c else f"; greedy tokens equal to CPU_ATTN's: {c['tokens_equal']}"))
        if "paired" in c:
            lines.append("  each server / the CPU_ATTN server next to it in the order: throughput "
                         + ", ".join(f"{v:.2f}x" for v in c["paired"]["output_tokens_per_s"]) + "; CPU per token "
                         + ", ".join(f"{v:.2f}" for v in c["paired"]["cpu_ms_per_token"]))
    problems = [p for r in result["runs"] for p in r["problems"]]
    lines.append("")
    lines.append(f"Checks (serve_load.problems, log errors, shutdown): "
                 + ("all passed" if not problems else f"{len(problems)} FAILED: {problems[:5]}"))
    return "\n".join(lines) + "\n"


KEYS = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s",
        "cpu_ms_per_token")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="KVKERNELS:16,KVKERNELS:32,CPU_ATTN:32",
                   help="backend:block size, comma-separated; ratios are to the CPU_ATTN one")
    p.add_argument("--reps", type=int, default=2, help="servers per configuration, in the order A B .. B A")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at once (default: all)")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", default="256,512")
    p.add_argument("--tail-len", default="16,256")
    p.add_argument("--out-len", default="32,128")
    p.add_argument("--cancel-every", type=int, default=8)
    p.add_argument("--cancel-len", default="256,320")
    p.add_argument("--cancel-after", default="2,16")
    p.add_argument("--max-model-len", type=int, default=1152)
    p.add_argument("--pool-tokens", type=int, default=8192, help="KV pool (the load needs ~25,000 at once)")
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model and load (a smoke test, not a measurement)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--table", type=Path, help="print the table of a result JSON of this script and exit")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())), end="")
        return 0
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate = 2, 256, 4, 2, 64, 256
        args.requests, args.prefix_len, args.tail_len, args.out_len = 32, "16,64", "4,64", "8,24"
        args.cancel_len, args.pool_tokens, args.reps, args.max_model_len = "96,128", 1024, 1, 512
    rng = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    wl = dict(prefixes=args.prefixes, prefix_len=rng(args.prefix_len), tail_len=rng(args.tail_len),
              out_len=rng(args.out_len), cancel_every=args.cancel_every, cancel_len=rng(args.cancel_len),
              cancel_after=rng(args.cancel_after), max_model_len=args.max_model_len)
    specs = sl.make_workload(args.requests, seed=args.seed, **wl)
    warmup = sl.make_workload(args.warmup_requests, seed=args.seed + 1000, **{**wl, "out_len": (4, 8)})
    configs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs.split(",")]
    order = (configs + configs[::-1]) * (args.reps // 2) + (configs if args.reps % 2 else [])

    import torch
    import vllm

    import kvkernels
    from kvkernels.bench import machine

    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": {"cpu_model": machine.cpu_model(), "lscpu": lscpu(), "cores": os.cpu_count(),
                    "kvkernels_cpu_isa": kvkernels.cpu_isa(), "platform": platform.platform(),
                    "load_average_at_start": os.getloadavg()},
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "kvkernels": kvkernels.__version__,
                     "python": platform.python_version()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": {"prompt_tokens": sum(len(s.prompt_ids) for s in specs),
                     "max_tokens": sum(s.max_tokens for s in specs),
                     "cancelled": sum(s.cancel_after is not None for s in specs)},
    }
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model", args)
        for backend, block in order:
            runs.append(run_one(backend, block, model, specs, warmup, args, Path(tmp)))
    result["machine"]["load_average_at_end"] = os.getloadavg()

    comparison = {}
    stock = [r for r in runs if r["backend"] == "CPU_ATTN"]
    for backend, block in configs:
        mine = [r for r in runs if r["backend"] == backend and r["block_size"] == block]
        c = {k: statistics.median(r["summary"][k] for r in mine) for k in KEYS}
        c["runs"] = len(mine)
        if backend != "CPU_ATTN" and stock:
            base = {k: statistics.median(r["summary"][k] for r in stock) for k in KEYS}
            c["ratios"] = {k: c[k] / base[k] for k in KEYS}
            # Each of its servers against the CPU_ATTN server nearest in the order (A B C C B A: the
            # neighbours in time), so a drift of the machine's load between the halves cancels out.
            pos = {id(r): i for i, r in enumerate(runs)}
            c["paired"] = {k: sorted(r["summary"][k] / min(stock, key=lambda x: abs(pos[id(x)] - pos[id(r)]))
                                     ["summary"][k] for r in mine) for k in ("output_tokens_per_s", "cpu_ms_per_token")}
            per_request = [sum(not sl.compare(_one(r, i), _one(s_, i)) for i in range(len(specs)))
                           for r in mine for s_ in stock]
            c["tokens_equal"] = f"{min(per_request)}-{max(per_request)} of {len(specs)} requests"
        comparison[f"{backend}:{block}"] = c
    result["comparison"] = comparison
    result["runs"] = [slim(r) for r in runs]
    text = table(result)
    print(text)
    if not args.quick:
        stem = machine.write_result(args.out, "vllm-serve", result, text)
        print(f"wrote {stem}.json and .txt", file=sys.stderr)
    return 1 if any(r["problems"] for r in result["runs"]) else 0


def _one(sess: dict, i: int) -> dict:
    """The session restricted to request i (for a per-request comparison)."""
    return {"backend": sess["backend"], "results": [sess["results"][i]]}


if __name__ == "__main__":
    sys.exit(main())
