"""``python -m kvkernels bench --suite cache``: what the Python cache layer costs and saves.

Four measurements (benchmarks/README.md, "Cache manager"):

1. fork: time of ``PagedKVCache.fork`` for sequences of 1K-32K tokens, the KV bytes it copies (none:
   counted by wrapping ``copy_blocks``/``swap_blocks``), the one block the first write then copies,
   and what a private copy of the sequence costs (``copy_blocks`` of all its blocks).
2. beams: memory of 16 beams sharing a 2K-token prompt, each then decoding 64 different tokens,
   against 16 private copies (a cache without sharing), from ``memory_usage()`` of real caches.
3. prefix: a shared-system-prompt workload: hit rate, prefill tokens skipped, and the attention
   part of prefill (``reshape_and_cache`` + varlen ``paged_attention``) timed for the uncached
   suffix against the whole prompt.
4. decode: the manager's own time per decode step for 256 sequences (``append_decode``, which also
   returns the block tables and seq_lens), against the per-sequence ``append`` loop it replaces.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import kvkernels
from kvkernels import ops
from kvkernels.bench import machine, report
from kvkernels.cache import KeepRecentRatio, MLAPagedCache, PagedKVCache


@dataclass(frozen=True)
class Geometry:
    """The KV shape the byte counts are for (Llama-3-8B: 32 layers, 8 KV heads of 128, bf16)."""
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def cache(self, num_blocks: int, **kwargs) -> PagedKVCache:
        return PagedKVCache(self.layers, self.kv_heads, self.head_dim, num_blocks, block_size=self.block_size,
                            dtype=self.dtype, **kwargs)

    def describe(self) -> dict:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "dtype": str(self.dtype).replace("torch.", ""), "block_size": self.block_size,
                "bytes_per_token": self.bytes_per_token}


LLAMA8B = Geometry()
FORK_GEOMETRY = Geometry(layers=4)  # 32K tokens = 512 MiB: a private copy is timed for real


def _timeit(fn: Callable[[], object], reps: int) -> dict:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": reps}


class _CopyCounter:
    """Counts the KV bytes ``copy_blocks`` / ``swap_blocks`` move while it is active."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache, self.bytes, self.calls = cache, 0, 0

    def __enter__(self):
        self.saved = ops.copy_blocks, ops.swap_blocks

        def counted(real):
            def call(*args, **kwargs):
                self.calls += 1
                self.bytes += args[-1 if real is self.saved[0] else 2].shape[0] * self.cache.bytes_per_block
                return real(*args, **kwargs)
            return call
        ops.copy_blocks, ops.swap_blocks = counted(self.saved[0]), counted(self.saved[1])
        return self

    def __exit__(self, *exc) -> None:
        ops.copy_blocks, ops.swap_blocks = self.saved


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, size=n).tolist()


# ---- 1. fork ------------------------------------------------------------------------------------


def fork_case(lengths: list[int], geometry: Geometry, reps: int) -> list[dict]:
    rows = []
    for length in lengths:
        n = length + 5  # a partly filled last block: the first write after the fork copies it
        blocks = -(-n // geometry.block_size)
        cache = geometry.cache(2 * blocks + 4)
        cache.kv.fill_(1.0)  # touch every page: the private copy below moves real memory
        seq, _ = cache.add_sequence(_tokens(n, length))
        cache.append(seq, _tokens(n, length))
        with _CopyCounter(cache) as counter:
            children = []
            fork = _timeit(lambda: children.append(cache.fork(seq)), reps)
            free = _timeit(lambda: cache.free(children.pop()), reps)
        fork_bytes, fork_calls = counter.bytes, counter.calls
        child = cache.fork(seq)
        with _CopyCounter(cache) as counter:
            start = time.perf_counter()
            cache.append_decode([child], [1])
            first_write_s = time.perf_counter() - start
        cow_bytes = counter.bytes
        cache.free(child)
        # A private copy of the whole sequence: every block, every layer, one copy_blocks call.
        table = cache.block_tables([seq])[0, :blocks]
        targets = cache.pool.allocate(blocks)
        mapping = torch.stack([table.long(), torch.tensor(targets)], dim=1)
        deep = _timeit(lambda: ops.copy_blocks(cache.kv, mapping, block_dim=2), 3)
        rows.append({
            "tokens": n, "blocks": blocks, "fork_us": fork["median_s"] * 1e6, "fork_min_us": fork["min_s"] * 1e6,
            "free_us": free["median_s"] * 1e6, "reps": reps,
            "fork_kv_bytes_copied": fork_bytes, "fork_copy_calls": fork_calls,
            "fork_table_bytes": blocks * 4,
            "first_write_copy_bytes": cow_bytes, "first_write_us": first_write_s * 1e6,
            "private_copy_ms": deep["median_s"] * 1e3, "private_copy_bytes": blocks * cache.bytes_per_block,
            "private_copy_bytes_llama8b": blocks * geometry.block_size * LLAMA8B.bytes_per_token,
        })
        del cache
    return rows


# ---- 2. beams -----------------------------------------------------------------------------------


def beams_case(prompt_len: int, beams: int, new_tokens: int, geometry: Geometry) -> dict:
    prompt = _tokens(prompt_len, 1)
    bs = geometry.block_size
    # torch.empty does not touch memory: the private cache reserves GiBs it never writes.
    shared = geometry.cache(-(-prompt_len // bs) + beams * (-(-new_tokens // bs) + 1) + 4)
    blocks = beams * (-(-(prompt_len + new_tokens) // bs)) + 4
    root, _ = shared.add_sequence(prompt)
    shared.append(root, prompt)
    seqs = [shared.fork(root) for _ in range(beams)]
    shared.free(root)
    start = time.perf_counter()
    for step in range(new_tokens):
        shared.append_decode(seqs, [(step * beams + i) % 32000 for i in range(beams)])
    decode_s = time.perf_counter() - start
    private = geometry.cache(blocks, enable_prefix_caching=False)
    for i in range(beams):
        s, _ = private.add_sequence(prompt)
        private.append(s, prompt + [(i * new_tokens + t) % 32000 for t in range(new_tokens)])
    ms, mp = shared.memory_usage(), private.memory_usage()
    per_beam = shared.memory_usage(seqs[0])
    return {
        "prompt_tokens": prompt_len, "beams": beams, "new_tokens_per_beam": new_tokens,
        "shared_allocated_bytes": ms["allocated_bytes"], "shared_stored_bytes": ms["stored_bytes"],
        "private_allocated_bytes": mp["allocated_bytes"], "private_stored_bytes": mp["stored_bytes"],
        "ratio_allocated": ms["allocated_bytes"] / mp["allocated_bytes"],
        "ratio_stored": ms["stored_bytes"] / mp["stored_bytes"],
        "cow_copies": shared.stats().cow_copies, "beam0": per_beam,
        "decode_steps_ms": decode_s * 1e3,
    }


# ---- 3. shared system prompt --------------------------------------------------------------------


def prefix_case(system_len: int, requests: int, suffix_range: tuple, timed: int, heads: int) -> dict:
    """Requests = one system prompt + a distinct user suffix. Hit rate over all requests; the
    attention prefill (one layer, ``heads`` query heads over 8 KV heads of 128, float32) timed for
    ``timed`` requests both ways: only the uncached tokens as queries, and every prompt token."""
    geometry = Geometry(layers=1, dtype=torch.float32)
    rng = np.random.default_rng(3)
    system = _tokens(system_len, 2)
    prompts = [system + rng.integers(0, 32000, size=int(rng.integers(*suffix_range))).tolist()
               for _ in range(requests)]
    total = sum(len(p) for p in prompts)
    bs = geometry.block_size
    cache = geometry.cache(-(-system_len // bs) + requests * (-(-suffix_range[1] // bs) + 1) + 8)
    cache.kv.normal_()
    gen = torch.Generator().manual_seed(0)
    rows, cached_total, manager_s = [], 0, 0.0
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        seq, cached = cache.add_sequence(prompt)
        slots = cache.append(seq, prompt[cached:])
        manager_s += time.perf_counter() - start
        cached_total += cached
        if 1 <= i <= timed:  # request 0 fills the cache; time the next `timed` ones
            table, lens = cache.block_tables([seq]), cache.seq_lens([seq])
            q_all = torch.randn(len(prompt), heads, geometry.head_dim, generator=gen)
            kv_all = torch.randn(len(prompt), geometry.kv_heads, geometry.head_dim, generator=gen)
            times = {}
            # "uncached" rewrites the prefix's slots too (same bytes as writing fresh blocks).
            for name, start_tok in (("cached", cached), ("uncached", 0)):
                q = q_all[start_tok:]
                kv = kv_all[start_tok:]
                write = cache.slot_mapping(seq, start_tok, len(prompt))
                loc = torch.tensor([0, len(q)], dtype=torch.int32)

                def prefill():
                    ops.reshape_and_cache(kv, kv, cache.key_cache(0), cache.value_cache(0), write)
                    ops.paged_attention(q, cache.key_cache(0), cache.value_cache(0), table, lens, loc)
                prefill()  # warm
                times[name] = _timeit(prefill, 2)["median_s"]
            rows.append({"prompt_tokens": len(prompt), "cached_tokens": cached,
                         "prefill_cached_ms": times["cached"] * 1e3, "prefill_uncached_ms": times["uncached"] * 1e3})
        del slots
    s = cache.stats()
    return {
        "system_prompt_tokens": system_len, "requests": requests, "suffix_tokens": list(suffix_range),
        "query_tokens": s.prefix_query_tokens, "hit_tokens": s.prefix_hit_tokens, "hit_rate": s.prefix_hit_rate,
        "prefill_tokens_skipped": cached_total, "prefill_tokens_needed": total - cached_total,
        "manager_ms_per_request": manager_s / requests * 1e3,
        "attention": {"layer": "1 layer, float32", "query_heads": heads, "kv_heads": geometry.kv_heads,
                      "head_dim": geometry.head_dim, "timed_requests": rows,
                      "cached_ms_mean": statistics.mean(r["prefill_cached_ms"] for r in rows),
                      "uncached_ms_mean": statistics.mean(r["prefill_uncached_ms"] for r in rows)},
    }


# ---- 4. decode-step overhead --------------------------------------------------------------------


def decode_case(num_seqs: int, steps: int, prompt_range: tuple) -> dict:
    """256 sequences: a quarter share a system prompt (prefix hits), a quarter are forks (the first
    step copies their shared partial block), prompt lengths spread so blocks fill on different
    steps. The manager is timed alone; no kernel runs."""
    geometry = Geometry(layers=1, kv_heads=1, head_dim=8, dtype=torch.float32)  # storage is irrelevant here
    rng = np.random.default_rng(4)
    system = _tokens(256, 5)
    lengths = rng.integers(*prompt_range, size=num_seqs)
    runs = 3  # every run below adds `steps` tokens to every sequence
    cache = geometry.cache(int(lengths.sum() // 16 + num_seqs * (runs * steps // 16 + 4) + 64),
                           max_sequences=num_seqs)
    seqs = []
    for i, n in enumerate(lengths.tolist()):
        if i % 4 == 3:
            seqs.append(cache.fork(seqs[-1]))
            continue
        prompt = (system if i % 4 == 1 else []) + _tokens(n, 100 + i)
        seq, cached = cache.add_sequence(prompt)
        cache.append(seq, prompt[cached:])
        seqs.append(seq)
    tokens = torch.from_numpy(rng.integers(0, 32000, size=(steps, num_seqs)))
    token_lists = tokens.tolist()

    def run(step_fn, label):
        times = []
        for step in range(steps):
            start = time.perf_counter()
            step_fn(step)
            times.append(time.perf_counter() - start)
        return {"label": label, "median_step_us": statistics.median(times) * 1e6,
                "mean_step_us": statistics.mean(times) * 1e6, "min_step_us": min(times) * 1e6,
                "median_us_per_seq": statistics.median(times) * 1e6 / num_seqs,
                "mean_us_per_seq": statistics.mean(times) * 1e6 / num_seqs}

    before = cache.stats()
    batched = run(lambda s: cache.append_decode(seqs, token_lists[s]), "append_decode, token ids as a list")
    after = cache.stats()
    as_tensor = run(lambda s: cache.append_decode(seqs, tokens[s]), "append_decode, token ids as an int64 tensor")

    def loop(step):
        for seq, tok in zip(seqs, token_lists[step]):
            cache.append(seq, [tok])
        cache.block_tables(seqs)
        cache.seq_lens(seqs)
    per_seq = run(loop, "append(seq, [tok]) per sequence + block_tables + seq_lens")
    return {"sequences": num_seqs, "steps": steps, "prompt_tokens": list(prompt_range), "block_size": 16,
            "first_run_cow_copies": after.cow_copies - before.cow_copies,
            "first_run_blocks_hashed": after.num_cached_blocks - before.num_cached_blocks,
            "runs": [batched, as_tensor, per_seq], "target_us_per_seq": 2.0}


def mla_memory_case(tokens: int, layers: int = 27, heads: int = 16, kv_lora_rank: int = 512, rope_dim: int = 64,
                    qk_nope: int = 128, v_head: int = 128, block_size: int = 64, threshold: int = 8192,
                    keep_ratio: float = 0.5) -> dict:
    """The memory of one ``tokens``-long sequence of a DeepSeek-V2-Lite-like model
    (defaults) in a standard K/V cache, a latent cache, and a latent cache in block-sparse mode, all
    taken from the caches' own accounting (the standard one from its bytes per token)."""
    ids = _tokens(tokens, 0)

    def fill(cache: MLAPagedCache, step: int) -> int:
        seq, _ = cache.add_sequence(ids)
        for start in range(0, tokens, step):  # block by block: the sparse policy runs as blocks open
            cache.append(seq, ids[start:start + step])
        return seq

    num_blocks = tokens // block_size + 2
    dense = MLAPagedCache(layers, kv_lora_rank, rope_dim, num_blocks, block_size, enable_prefix_caching=False)
    seq = fill(dense, tokens)
    sparse = MLAPagedCache(layers, kv_lora_rank, rope_dim, num_blocks, block_size, enable_prefix_caching=False,
                           sparse_policy=KeepRecentRatio(threshold, keep_ratio))
    sseq = fill(sparse, block_size)
    standard_bpt = dense.standard_bytes_per_token(heads, qk_nope + rope_dim, v_head)
    stats = sparse.block_sparse_stats(sseq)
    return {"tokens": tokens, "layers": layers, "heads": heads, "kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim,
            "qk_head_dim": qk_nope + rope_dim, "v_head_dim": v_head, "block_size": block_size,
            "standard_bytes_per_token": standard_bpt, "latent_bytes_per_token": dense.bytes_per_token,
            "standard_bytes": standard_bpt * tokens,
            "latent_bytes": round(dense.memory_usage_mb(seq) * 2**20),
            "sparse_bytes": round(sparse.memory_usage_mb(sseq) * 2**20),
            "sparse_policy": repr(sparse.sparse_policy), "sparse_stats": stats}


# ---- driver -------------------------------------------------------------------------------------


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB" if x < 2**30 else f"{x / 2**30:,.2f} GiB"


def format_text(record: dict) -> str:
    lines = [f"kvkernels {record['kvkernels_version']} cache manager benchmark, {record['date']}",
             f"machine: {record['machine']['cpu_model']}, {record['machine']['usable_cpus']} usable CPUs, "
             f"torch {record['torch_version']}, python {record['python_version']}, "
             f"load average at start {record['load_average']}", ""]
    fork = record["fork"]
    g = fork["geometry"]
    lines.append(f"1. fork ({g['layers']} layers x {g['kv_heads']} KV heads x {g['head_dim']} {g['dtype']}, "
                 f"block {g['block_size']}; private copy = copy_blocks of every block)")
    lines.append(f"{'tokens':>8} {'blocks':>7} {'fork':>10} {'KV copied':>10} {'table':>9} "
                 f"{'1st write copies':>17} {'private copy':>13} {'(bytes)':>11} {'(Llama-3-8B)':>13}")
    for r in fork["rows"]:
        lines.append(f"{r['tokens']:>8} {r['blocks']:>7} {r['fork_us']:>8.1f}us {r['fork_kv_bytes_copied']:>9}B "
                     f"{r['fork_table_bytes']:>8}B {_mib(r['first_write_copy_bytes']):>17} "
                     f"{r['private_copy_ms']:>11.1f}ms {_mib(r['private_copy_bytes']):>11} "
                     f"{_mib(r['private_copy_bytes_llama8b']):>13}")
    b = record["beams"]
    lines += ["", f"2. {b['beams']} beams sharing a {b['prompt_tokens']}-token prompt, {b['new_tokens_per_beam']} "
                  f"new tokens each ({b['geometry']['layers']} layers x {b['geometry']['kv_heads']} KV heads x "
                  f"{b['geometry']['head_dim']} {b['geometry']['dtype']})",
              f"   shared: {_mib(b['shared_allocated_bytes'])} allocated ({_mib(b['shared_stored_bytes'])} in "
              f"token slots), private copies: {_mib(b['private_allocated_bytes'])} -> ratio "
              f"{b['ratio_allocated']:.4f} (target <= 0.1); copy-on-write copies: {b['cow_copies']}"]
    if "beams_unaligned" in record:
        u = record["beams_unaligned"]
        lines.append(f"   prompt of {u['prompt_tokens']} tokens (last block partial): ratio {u['ratio_allocated']:.4f}, "
                     f"{u['cow_copies']} copy-on-write copies")
    p = record["prefix"]
    a = p["attention"]
    lines += ["", f"3. shared system prompt: {p['requests']} requests = {p['system_prompt_tokens']}-token system prompt "
                  f"+ {p['suffix_tokens'][0]}-{p['suffix_tokens'][1]} user tokens",
              f"   hit rate {p['hit_rate']:.1%} of {p['query_tokens']} prompt tokens; prefill tokens skipped "
              f"{p['prefill_tokens_skipped']}, still computed {p['prefill_tokens_needed']}; manager "
              f"{p['manager_ms_per_request']:.2f} ms per request (lookup + append)",
              f"   attention prefill per request ({a['layer']}, {a['query_heads']} q heads / {a['kv_heads']} KV heads "
              f"x {a['head_dim']}): {a['cached_ms_mean']:.1f} ms with the cached prefix vs "
              f"{a['uncached_ms_mean']:.1f} ms without ({a['uncached_ms_mean'] / a['cached_ms_mean']:.1f}x), "
              f"mean of {len(a['timed_requests'])} requests"]
    d = record["decode"]
    m = record.get("mla_memory")
    mla_lines = [] if m is None else [
        "", f"5. MLA latent cache, one {m['tokens']}-token sequence, {m['layers']} layers x {m['heads']} heads "
            f"(DeepSeek-V2-Lite-like: kv_lora_rank {m['kv_lora_rank']}, rope {m['rope_dim']}, qk head "
            f"{m['qk_head_dim']}, v head {m['v_head_dim']}, block {m['block_size']})",
        f"   bytes per token: standard K/V {m['standard_bytes_per_token']:,}, latent {m['latent_bytes_per_token']:,} "
        f"({m['standard_bytes_per_token'] / m['latent_bytes_per_token']:.1f}x less)",
        f"   memory: standard K/V {_mib(m['standard_bytes'])}, latent {_mib(m['latent_bytes'])}, latent + "
        f"{m['sparse_policy']} {_mib(m['sparse_bytes'])} ({m['sparse_stats']['active_blocks']} of "
        f"{m['sparse_stats']['total_logical_blocks']} blocks kept; "
        f"{m['standard_bytes'] / max(m['sparse_bytes'], 1):.1f}x less than standard)"]
    lines += ["", f"4. decode-step overhead of the manager, {d['sequences']} sequences, {d['steps']} steps "
                  f"(target <= {d['target_us_per_seq']} us per sequence)"]
    for r in d["runs"]:
        lines.append(f"   {r['label']:<60} {r['median_step_us']:>9.1f} us/step  {r['median_us_per_seq']:.2f} us/seq "
                     f"(mean {r['mean_us_per_seq']:.2f})")
    lines.append(f"   first run: {d['first_run_cow_copies']} copy-on-write copies, "
                 f"{d['first_run_blocks_hashed']} blocks hashed and registered")
    return "\n".join(lines + mla_lines)


def run(args: argparse.Namespace, argv: list) -> int:
    started = datetime.datetime.now().astimezone()
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    info = machine.machine_info(machine.llc_bytes())
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    steps = []

    def stage(label: str) -> None:
        steps.append(label)
        print(f"[{len(steps)}/5] {label}", file=sys.stderr, flush=True)

    stage("fork")
    lengths = [256, 1024] if quick else [1024, 4096, 16384, 32768]
    fork_geometry = Geometry(layers=1, kv_heads=1, head_dim=8) if quick else FORK_GEOMETRY
    fork = {"geometry": fork_geometry.describe(), "rows": fork_case(lengths, fork_geometry, 20 if quick else 200)}
    stage("beams")
    beam_geometry = Geometry(layers=1, kv_heads=1, head_dim=8) if quick else LLAMA8B
    beams = beams_case(256 if quick else 2048, 16, 16 if quick else 64, beam_geometry)
    # A prompt ending inside a block: each beam but the last copies that block on its first write.
    unaligned = beams_case(247 if quick else 2039, 16, 16 if quick else 64, beam_geometry)
    stage("prefix")
    prefix = prefix_case(128 if quick else 1024, 8 if quick else 64, (8, 32) if quick else (32, 128),
                         2 if quick else 8, 8 if quick else 32)
    stage("decode")
    decode = decode_case(32 if quick else 256, 32 if quick else 400, (20, 100) if quick else (200, 1000))
    stage("mla memory")
    mla_memory = (mla_memory_case(512, layers=2, threshold=256) if quick else mla_memory_case(16384))
    record = {
        "suite": "cache", "machine": info, "torch_version": torch.__version__,
        "kvkernels_version": kvkernels.__version__, "python_version": platform.python_version(),
        "numpy_version": np.__version__, "date": started.isoformat(timespec="seconds"),
        "command_line": shlex.join([sys.executable, *sys.argv]), "bench_args": argv, "quick": quick,
        "load_average": [round(x, 2) for x in load] if load else None,
        "fork": fork, "beams": dict(beams, geometry=beam_geometry.describe()),
        "beams_unaligned": unaligned, "prefix": prefix, "decode": decode, "mla_memory": mla_memory,
    }
    if args.quick:
        record["note"] = report.SMOKE_NOTE
    text = format_text(record)
    if args.quick:
        text = f"{report.SMOKE_BANNER}\n{text}"
    stem = machine.write_result(report.output_dir(args), "cache", record, text, cpu=info["cpu_model"],
                                when=started)
    print(text)
    print(f"JSON: {stem.with_suffix('.json')}\nTXT: {stem.with_suffix('.txt')}")
    worst = max(r["median_us_per_seq"] for r in decode["runs"][:2])
    return 0 if quick or worst <= decode["target_us_per_seq"] else 1
