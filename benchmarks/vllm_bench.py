"""vLLM on kvkernels against vLLM's own CPU attention, end to end and op by op, in one run.

Run from the vLLM venv (``make bench-vllm``, or ``build-vllm/venv/bin/python benchmarks/vllm_bench.py``).

1. End to end: offline ``LLM.generate`` on a random-weight Llama (vLLM's ``load_format="dummy"``; only a
   config.json is written) with ``attention_backend="KVKERNELS"`` and with vLLM's stock CPU_ATTN, each
   engine in a process of its own, in the order kvkernels, stock, stock, kvkernels (``--reps 2``, the
   default) so a drift of the shared machine hits both alike. Per engine, after a short warm-up:
   *prefill*: the ``--requests`` prompts of ``--prompt-len`` random tokens with ``max_tokens=1``
   (uncached; tokens/s = prompt tokens / time); *decode*: the same prompts again with
   ``max_tokens=1 + --new-tokens`` (prefix cache warm), minus a ``max_tokens=1`` run on the warm cache
   (what the first token costs there), so decode tokens/s = requests x new tokens / the difference, at
   a context of prompt-len .. prompt-len + new tokens.
2. Op level, in this process, on the same queries, keys and values: ``kvkernels.ops.paged_attention``
   over its cache (laid out as the backend gets it inside vLLM: ``[blocks, kv heads, block, 2 x D]``, K
   and V strided views) against vLLM's ``cpu_attention_with_kv_cache`` over vLLM's (each cache written
   by its own reshape_and_cache; the same block tables), decode and a prefill chunk, ABBA order, rotating over
   enough cache copies that every call reads from DRAM; vLLM's per-step scheduler metadata is built
   outside the timing (it is shared by all layers of a step). Output difference reported.

Writes ``benchmarks/results/vllm-<cpu>-<date>.json`` and ``.txt``.
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

import torch

ROOT = Path(__file__).resolve().parent.parent


# ---- end to end -------------------------------------------------------------------------------------


def write_config(dest: Path, args) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.hidden, "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "num_hidden_layers": args.layers,
        "intermediate_size": args.intermediate, "vocab_size": args.vocab, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": args.dtype,
    }
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


class AttentionTimer:
    """Seconds spent inside the attention ops (kvkernels' or vLLM's CPU ones) of an in-process engine:
    the functions are looked up on their modules per call, so wrapping the module attributes sees every
    call. Costs two perf_counter reads per call."""

    def __init__(self) -> None:
        import kvkernels
        from vllm import _custom_ops as vops

        self.seconds = {"attention": 0.0, "cache_write": 0.0}
        for module, name, key in ((kvkernels.ops, "paged_attention", "attention"),
                                  (kvkernels.ops, "reshape_and_cache", "cache_write"),
                                  (vops, "cpu_attention_with_kv_cache", "attention"),
                                  (vops, "cpu_attn_reshape_and_cache", "cache_write")):
            setattr(module, name, self._wrap(getattr(module, name), key))

    def _wrap(self, fn, key):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[key] += time.perf_counter() - t0
        return timed

    def take(self) -> dict:
        out = dict(self.seconds)
        for k in self.seconds:
            self.seconds[k] = 0.0
        return out


def e2e_child(args) -> dict:
    """One engine: warm-up, prefill, first token on a warm cache, decode. Prints a JSON line."""
    from vllm import LLM, SamplingParams

    timer = AttentionTimer()

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    backend = None if args.backend == "CPU_ATTN" else args.backend
    t = time.perf_counter()
    llm = LLM(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
              block_size=args.block_size, attention_backend=backend, enforce_eager=True, seed=0,
              max_model_len=args.prompt_len + args.new_tokens + 64, max_num_seqs=args.requests,
              enable_prefix_caching=True)
    startup = time.perf_counter() - t

    def run(ps, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        return time.perf_counter() - t0, outs

    warm = [torch.randint(3, args.vocab, (64,), generator=g).tolist() for _ in range(2)]
    run(warm, 4)
    timer.take()
    t_prefill, _ = run(prompts, 1)
    ops_prefill = timer.take()
    t_first, outs = run(prompts, 1)
    ops_first = timer.take()
    cached = min(o.num_cached_tokens or 0 for o in outs)
    t_decode_total, outs = run(prompts, 1 + args.new_tokens)
    ops_decode = {k: v - ops_first[k] for k, v in timer.take().items()}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    decode_s = t_decode_total - t_first
    return {
        "backend": args.backend, "startup_s": startup,
        "prefill_s": t_prefill, "prefill_tokens_per_s": args.requests * args.prompt_len / t_prefill,
        "first_token_warm_cache_s": t_first, "cached_prompt_tokens_min": cached,
        "decode_run_s": t_decode_total, "decode_s": decode_s,
        "decode_tokens_per_s": args.requests * args.new_tokens / decode_s,
        "prefill_attention_s": ops_prefill["attention"], "prefill_cache_write_s": ops_prefill["cache_write"],
        "decode_attention_s": ops_decode["attention"], "decode_cache_write_s": ops_decode["cache_write"],
        "first_tokens": [t[:8] for t in tokens[:2]],
    }


def e2e(args) -> list[dict]:
    order = ["KVKERNELS", "CPU_ATTN", "CPU_ATTN", "KVKERNELS"][: 2 * args.reps] if args.reps <= 2 else \
        (["KVKERNELS", "CPU_ATTN", "CPU_ATTN", "KVKERNELS"] * args.reps)[: 2 * args.reps]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", args)
        for backend in order:
            cmd = [sys.executable, __file__, "--child", "--backend", backend, "--model-dir", str(model_dir)]
            cmd += child_args(args)
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                       VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
            print(f"[e2e] {backend} ...", file=sys.stderr, flush=True)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not line:
                raise RuntimeError(f"{backend} engine failed:\n{p.stderr[-4000:]}")
            r = json.loads(line[-1])
            print(f"[e2e] {backend}: prefill {r['prefill_tokens_per_s']:.1f} tok/s, "
                  f"decode {r['decode_tokens_per_s']:.2f} tok/s", file=sys.stderr, flush=True)
            results.append(r)
    return results


def child_args(args) -> list[str]:
    out = []
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "prompt_len", "requests",
                 "new_tokens", "dtype", "block_size"):
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


# ---- op level ---------------------------------------------------------------------------------------


def _time_calls(fns, calls: int) -> float:
    """Median seconds of one call, rotating over fns (one per cache copy)."""
    times = []
    for i in range(calls):
        fn = fns[i % len(fns)]
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def op_case(name: str, dtype: torch.dtype, batch: int, context: int, q_len: int, args) -> dict:
    import kvkernels
    from vllm import _custom_ops as vops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    H, KVH, D, B = args.heads, args.kv_heads, args.head_dim, args.op_block_size
    g = torch.Generator().manual_seed(1)
    blocks_per_seq = -(-context // B)
    num_blocks = batch * blocks_per_seq + 1
    bytes_per_copy = 2 * num_blocks * B * KVH * D * dtype.itemsize
    copies = max(2, -(-args.dram_bytes // bytes_per_copy))  # the rotation must not fit in the caches
    isa = _get_attn_isa(dtype, B, D)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    tables = torch.randperm(num_blocks - 1, generator=g)[: batch * blocks_per_seq].add_(1)
    tables = tables.reshape(batch, blocks_per_seq).to(torch.int32)
    slots = (tables.to(torch.int64)[:, :, None] * B + torch.arange(B)).reshape(batch, -1)[:, :context].reshape(-1)
    scale = D ** -0.5
    ours, theirs = [], []
    q = (torch.randn(batch * q_len, H, D, generator=g)).to(dtype)
    out_v = torch.empty_like(q)
    meta = vops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=H, num_kv_heads=KVH, head_dim=D, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype="auto")
    for c in range(copies):
        k = torch.randn(batch * context, KVH, D, generator=g).to(dtype)
        v = torch.randn(batch * context, KVH, D, generator=g).to(dtype)
        # kvkernels' cache as the backend sees it inside vLLM: the head-major layout it asks vLLM for,
        # a token's key and value side by side in one row, K and V strided views.
        kv = torch.zeros(num_blocks, KVH, B, 2 * D, dtype=dtype)
        kc, vc = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)
        kvkernels.ops.reshape_and_cache(k, v, kc, vc, slots)
        vkv = torch.zeros(num_blocks, KVH, B, 2 * D, dtype=dtype).view(num_blocks, KVH, 2 * B, D)
        vk, vv = vkv.chunk(2, dim=2)
        vops.cpu_attn_reshape_and_cache(k, v, vk, vv, slots, isa)
        del k, v
        ours.append(lambda kc=kc, vc=vc: kvkernels.ops.paged_attention(
            q, kc, vc, tables, seq_lens, None if q_len == 1 else qsl, scale=scale))
        theirs.append(lambda vk=vk, vv=vv: vops.cpu_attention_with_kv_cache(
            q, vk, vv, out_v, qsl, seq_lens, scale, True, None, -1, tables, 0.0, meta, None))
    # Same answer?
    out_k, _ = ours[0]()
    theirs[0]()
    diff = (out_k.float() - out_v.float()).abs().max().item()
    for fn in ours + theirs:  # warm-up
        fn()
    t_ours, t_theirs = [], []
    for _ in range(args.op_reps):  # ABBA
        t_ours.append(_time_calls(ours, args.op_calls))
        t_theirs.append(_time_calls(theirs, args.op_calls))
        t_theirs.append(_time_calls(theirs, args.op_calls))
        t_ours.append(_time_calls(ours, args.op_calls))
    a, b = statistics.median(t_ours), statistics.median(t_theirs)
    # Bytes a call must move: every visible key and value once, the query read and the output written.
    moved = 2 * batch * context * KVH * D * dtype.itemsize + 2 * q.numel() * q.element_size()
    return {"case": name, "bytes_per_call": moved, "kvkernels_gb_s": moved / a / 1e9, "vllm_gb_s": moved / b / 1e9, "dtype": str(dtype).replace("torch.", ""), "batch": batch, "context": context,
            "q_len": q_len, "block_size": B, "vllm_isa": isa, "cache_copies": copies,
            "kvkernels_s": a, "vllm_cpu_attn_s": b, "time_ratio": a / b, "max_abs_diff": diff}


def ops_bench(args) -> list[dict]:
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, batch, context, q_len in (("decode", 8, 4096, 1), ("decode", 1, 16384, 1),
                                            ("decode", args.requests, args.prompt_len, 1),
                                            ("prefill", 1, 4096, 512)):
            if args.quick:
                batch, context, q_len = min(batch, 2), min(context, 512), min(q_len, 64)
            print(f"[ops] {name} {dtype} b{batch} x {context} q{q_len} ...", file=sys.stderr, flush=True)
            r = op_case(name, dtype, batch, context, q_len, args)
            print(f"[ops]   kvkernels/vLLM time {r['time_ratio']:.2f} (diff {r['max_abs_diff']:.2e})",
                  file=sys.stderr, flush=True)
            cases.append(r)
    return cases


# ---- report -----------------------------------------------------------------------------------------


def table(result: dict) -> str:
    lines = [f"vLLM on kvkernels vs vLLM CPU_ATTN — {result['machine']['cpu_model']}, "
             f"{result['date']}, torch {result['versions']['torch']}, vllm {result['versions']['vllm']}, "
             f"load average {result['machine']['load_average_at_start'][0]:.1f} at start, "
             f"{result['machine'].get('load_average_at_end', [float('nan')])[0]:.1f} at end "
             f"({result['machine']['cores']} CPUs)", ""]
    e = result.get("e2e")
    if e:
        s = result["settings"]
        lines.append(f"End to end (LLM.generate, {s['layers']} layers of width {s['hidden']}, {s['heads']} q / "
                     f"{s['kv_heads']} kv heads x "
                     f"{s['head_dim']}, intermediate {s['intermediate']}, {s['dtype']}, block {s['block_size']}, "
                     f"{s['requests']} requests x {s['prompt_len']} prompt tokens, {s['new_tokens']} new tokens, "
                     "enforce_eager, random weights):")
        lines.append(f"{'backend':<11}{'prefill tok/s':>15}{'(attn s / s)':>14}{'decode tok/s':>14}"
                     f"{'(attn s / s)':>14}{'startup s':>11}")
        for r in e:
            pa = f"{r['prefill_attention_s']:.0f}/{r['prefill_s']:.0f}" if "prefill_attention_s" in r else "-"
            da = f"{r['decode_attention_s']:.1f}/{r['decode_s']:.1f}" if "decode_attention_s" in r else "-"
            lines.append(f"{r['backend']:<11}{r['prefill_tokens_per_s']:>15.1f}{pa:>14}{r['decode_tokens_per_s']:>14.2f}"
                         f"{da:>14}{r['startup_s']:>11.1f}")
        sm = result["e2e_summary"]
        lines.append(f"kvkernels / stock (medians): prefill {sm['prefill_speedup']:.3f}x, decode "
                     f"{sm['decode_speedup']:.3f}x")
        lines.append("")
    ops = result.get("ops")
    if ops:
        lines.append("Op level (same data, one process, ABBA, caches rotated from DRAM): kvkernels time / vLLM time")
        bw = result.get("bandwidth_gb_s")
        if bw:
            lines.append(f"memory read bandwidth in this run: {bw['read_before']:.1f} GB/s before the ops, "
                         f"{bw['read_after']:.1f} after (GB/s below: K/V bytes a call must read, per second)")
        lines.append(f"{'case':<9}{'dtype':<10}{'batch x ctx':>14}{'q':>5}{'kvkernels ms':>14}{'vLLM ms':>10}"
                     f"{'ratio':>8}{'ours GB/s':>11}{'vLLM GB/s':>11}{'max diff':>11}")
        for r in ops:
            gbs = (f"{r['kvkernels_gb_s']:>11.1f}{r['vllm_gb_s']:>11.1f}" if "kvkernels_gb_s" in r
                   else f"{'-':>11}{'-':>11}")
            lines.append(f"{r['case']:<9}{r['dtype']:<10}{str(r['batch']) + ' x ' + str(r['context']):>14}"
                         f"{r['q_len']:>5}{r['kvkernels_s'] * 1e3:>14.3f}{r['vllm_cpu_attn_s'] * 1e3:>10.3f}"
                         f"{r['time_ratio']:>8.2f}{gbs}{r['max_abs_diff']:>11.2e}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024,
                   help="model width; the attention is heads x head-dim wide whatever it is (Llama's head_dim), "
                        "so a narrow model keeps the projections' cost, which is not attention, small")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--block-size", type=int, default=128, help="vLLM block size end to end (CPU default 128)")
    p.add_argument("--reps", type=int, default=2, help="engines per backend, ABBA order")
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--op-block-size", type=int, default=128)
    p.add_argument("--op-calls", type=int, default=20)
    p.add_argument("--op-reps", type=int, default=3)
    p.add_argument("--dram-bytes", type=int, default=512 << 20, help="cache bytes one op rotation covers")
    p.add_argument("--threads", type=int, default=None, help="op level: torch threads (default all)")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-ops", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test, not a measurement)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(e2e_child(args)), flush=True)
        return 0
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate = 2, 256, 8, 2, 256
        args.prompt_len, args.requests, args.new_tokens, args.reps = 128, 4, 8, 1
        args.op_calls, args.op_reps, args.dram_bytes = 3, 1, 8 << 20
    if args.threads:
        torch.set_num_threads(args.threads)

    import kvkernels
    import vllm
    from kvkernels.bench import machine

    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": {"cpu_model": machine.cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                    "kvkernels_cpu_isa": kvkernels.cpu_isa(), "platform": platform.platform(),
                    "load_average_at_start": os.getloadavg()},
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "kvkernels": kvkernels.__version__,
                     "python": platform.python_version()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "backend", "model_dir", "out")},
    }
    if not args.skip_e2e:
        result["e2e"] = e2e(args)

        def med(backend, key):
            return statistics.median(r[key] for r in result["e2e"] if r["backend"] == backend)
        result["e2e_summary"] = {
            "prefill_speedup": med("KVKERNELS", "prefill_tokens_per_s") / med("CPU_ATTN", "prefill_tokens_per_s"),
            "decode_speedup": med("KVKERNELS", "decode_tokens_per_s") / med("CPU_ATTN", "decode_tokens_per_s"),
        }
    if not args.skip_ops:
        # The machine's read bandwidth in this run (same threads as the ops), before and after: the
        # ops' GB/s are read against it, and a noisy neighbour shows as a gap between the two.
        bw = lambda: machine.measure_bandwidth(args.dram_bytes, 0.5 if not args.quick else 0.01)["read"]
        before = bw()
        result["ops"] = ops_bench(args)
        result["bandwidth_gb_s"] = {"read_before": before, "read_after": bw()}
    result["machine"]["load_average_at_end"] = os.getloadavg()
    text = table(result)
    print(text)
    if not args.quick:
        stem = machine.write_result(args.out, "vllm", result, text)
        print(f"wrote {stem}.json and .txt", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
