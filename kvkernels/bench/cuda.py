"""``python -m kvkernels bench --device cuda``: the CUDA benchmark (benchmarks/README.md).

One run measures the device's bandwidth (a large device-to-device copy; a read; pinned host <-> device
copies), then times the cache ops for kvkernels and for the plain-torch way of doing the same thing,
on the same data, with CUDA events:

- copy_blocks: 1024 (src, dst) pairs x 32 layers of a stacked bfloat16 / float32 cache
  ``[32, 2, N, 16, 8, 128]`` in one call (the issue's target: >= 80% of the measured copy bandwidth);
- reshape_and_cache (decode- and prefill-sized token counts, bfloat16 and fp8 caches), gather_kv,
  merge_attention_states (against the copy bandwidth);
- swap_blocks between the device cache and pinned host memory, both ways (against the measured
  pinned copy bandwidth of each direction);
- decode and prefill attention: the hook for ``kvkernels/bench/cuda_attention.py`` (see
  ``attention_jobs``); until that module exists the cases are listed as skipped with the reason.

Results: a table on stdout and ``cuda-<device>-<date>.json`` / ``.txt`` in ``--out`` (device name and
properties, torch and CUDA versions, date, command line, bandwidth, every case).
"""

from __future__ import annotations

import datetime
import functools
import math
import platform
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

import kvkernels
from kvkernels import ops
from kvkernels.bench import machine, report
from kvkernels.bench.core import (GIB, TOLERANCE, CaseResult, Settings, Timing, fill_random, finalize, is_fp8,
                                  max_abs_diff, num_layers, run_impl, skip)
from kvkernels.reference import quantize_fp8

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
FP8_SCALE = 4.0 / 448
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
          "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class CudaShapes:
    copy: tuple  # (layers, blocks in the pool, pairs per call)
    copy_dtypes: tuple
    reshape_tokens: tuple  # token counts: a decode batch, a prefill chunk
    gather: tuple  # ((batch, context), ...)
    merge_tokens: int
    swap: tuple  # (layers, blocks per call)
    # Attention cases (kvkernels/bench/cuda_attention.py): decode batch x context, prefill (chunk, context).
    decode_batches: tuple
    decode_contexts: tuple
    prefill: tuple
    bandwidth_bytes: int
    min_time: float


FULL = CudaShapes(copy=(32, 4096, 1024), copy_dtypes=("bfloat16", "float32"), reshape_tokens=(256, 16384),
                  gather=((8, 4096), (64, 4096)), merge_tokens=8192, swap=(32, 256),
                  decode_batches=(1, 16, 64, 256), decode_contexts=(1024, 4096, 32768), prefill=(4096, 4096),
                  bandwidth_bytes=2 * GIB, min_time=0.3)
QUICK = CudaShapes(copy=(4, 64, 16), copy_dtypes=("bfloat16",), reshape_tokens=(64,), gather=((2, 256),),
                   merge_tokens=256, swap=(4, 16), decode_batches=(1, 2), decode_contexts=(256,), prefill=(64, 256),
                   bandwidth_bytes=64 << 20, min_time=0.01)

Job = tuple[str, Callable[[Settings, torch.Generator], CaseResult]]


# ---- timing ---------------------------------------------------------------------------------------


def make_timer(device: torch.device) -> Callable:
    """A ``Settings.timer`` for ``device``: CUDA events around back-to-back batches of calls (each
    batch long enough that launch gaps do not dominate), per-call time = batch time / calls; the
    host clock with a synchronize on other devices (used only to dry-run this module on a CPU)."""
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def timer(call: Callable[[int], Any], min_time: float, limit_s: Optional[float] = None,
              max_batches: int = 30) -> tuple[Timing, Any]:
        import time
        start = time.perf_counter()
        first = call(0)
        sync()
        first_s = time.perf_counter() - start
        if limit_s is not None and first_s > limit_s:
            return Timing(first_s, first_s, 1, f"1 call only: it took {first_s:.1f} s "
                                               f"> --max-baseline-seconds {limit_s:g}"), first
        call(1)  # warm-up (allocator, caches)
        sync()
        start = time.perf_counter()
        call(2)
        sync()
        one = max(time.perf_counter() - start, 1e-6)
        per_batch = max(1, min(1000, int(2e-3 / one)))  # ~2 ms of back-to-back calls per batch
        index, times = 3, []
        while len(times) < max_batches and (len(times) < 5 or sum(times) * per_batch < min_time):
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(per_batch):
                    call(index)
                    index += 1
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) / 1e3 / per_batch)
            else:
                t0 = time.perf_counter()
                for _ in range(per_batch):
                    call(index)
                    index += 1
                times.append((time.perf_counter() - t0) / per_batch)
        return Timing(statistics.median(times), min(times), len(times) * per_batch,
                      f"{len(times)} batches of {per_batch} calls"), first

    return timer


# ---- bandwidth ------------------------------------------------------------------------------------


def measure_bandwidth(device: torch.device, buffer_bytes: int, min_time: float) -> dict:
    """GB/s (1e9 bytes) of the device: ``copy`` = dst.copy_(src) counting read + write bytes (the
    yardstick of the copy-like ops), ``read`` = the best of torch.sum / torch.amax over one buffer, and
    pinned host <-> device copies (``h2d``, ``d2h``: bytes moved one way)."""
    timer = make_timer(device)
    n = buffer_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)
    copy = 2 * buffer_bytes / timer(lambda i: dst.copy_(src), min_time)[0].median_s / 1e9
    reads = {name: buffer_bytes / timer(fn, min_time)[0].median_s / 1e9
             for name, fn in (("sum", lambda i: torch.sum(src)), ("amax", lambda i: torch.amax(src)))}
    best = max(reads, key=reads.get)
    result = {"read": reads[best], "read_method": best, "read_by_method": reads, "copy": copy,
              "buffer_bytes": buffer_bytes, "threads": torch.get_num_threads()}
    del dst
    if device.type == "cuda":
        host_bytes = min(buffer_bytes, 1 * GIB)
        host = torch.empty(host_bytes // 4, dtype=torch.float32).pin_memory()
        dev = src[:host_bytes // 4]
        result["h2d"] = host_bytes / timer(lambda i: dev.copy_(host, non_blocking=True), min_time)[0].median_s / 1e9
        result["d2h"] = host_bytes / timer(lambda i: host.copy_(dev, non_blocking=True), min_time)[0].median_s / 1e9
        result["pinned_buffer_bytes"] = host_bytes
    return result


# ---- cases ----------------------------------------------------------------------------------------


def poison(t: Tensor) -> Tensor:
    """Bytes a correct write never leaves (0x7F: NaN in fp8, ~3e38 in bf16)."""
    t.view(torch.uint8).fill_(0x7F)
    return t


def fits(case: CaseResult, names: tuple, need: int, settings: Settings) -> bool:
    if need <= settings.memory_budget:
        return True
    skip(case, names, f"needs ~{need / GIB:.1f} GiB > the memory budget of {settings.memory_budget / GIB:.1f} GiB")
    return False


def copy_blocks_case(dtype_name: str, layers: int, num_blocks: int, pairs: int, device: torch.device,
                     settings: Settings, gen: torch.Generator) -> CaseResult:
    """``pairs`` (src, dst) block copies across every layer of one stacked [L, 2, N, B, H, D] cache."""
    dtype = DTYPES[dtype_name]
    block_bytes = BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    moved = 2 * pairs * layers * 2 * block_bytes  # read + write, K and V, every layer
    shape = (layers, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    case = CaseResult(f"copy_blocks {dtype_name} L{layers} x{pairs}", "copy_blocks", dtype_name, None, None,
                      bytes=moved, bandwidth_ref="copy",
                      check_reference="every destination block equals its source (exact)",
                      note=f"stacked cache {list(shape)}, block_dim=2, {pairs} pairs of distinct random blocks, "
                           "mapping on the device; baseline: cache[:, :, dst] = cache[:, :, src]")
    cache_bytes = math.prod(shape) * dtype.itemsize
    if not fits(case, ("kvkernels", "torch-index"), cache_bytes + moved // 2, settings):
        return case
    cache = fill_random(torch.empty(shape, dtype=dtype, device=device), gen)
    rotations = max(1, min(num_layers(moved, settings), num_blocks // (2 * pairs)))
    perm = torch.randperm(num_blocks, generator=gen)[:rotations * 2 * pairs].view(rotations, 2, pairs).to(device)
    mappings = [torch.stack([src, dst], dim=1).contiguous() for src, dst in perm]
    case.note += f"; {rotations} disjoint mapping(s) rotated"

    def reset() -> None:
        cache.index_fill_(2, perm[:, 1].flatten(), 0)

    def check(_: None) -> float:
        return max(max_abs_diff(cache[layer, :, dst], cache[layer, :, src])
                   for src, dst in perm for layer in range(layers))

    def kernel(i: int) -> None:
        ops.copy_blocks(cache, mappings[i % rotations], block_dim=2)

    def torch_index(i: int) -> None:
        src, dst = perm[i % rotations]
        cache[:, :, dst] = cache[:, :, src]

    reset()
    run_impl(case, "kvkernels", kernel, rotations, settings, baseline=False, verify=check)
    if settings.baselines:
        reset()
        run_impl(case, "torch-index", torch_index, rotations, settings, baseline=True, verify=check)
    else:
        skip(case, ("torch-index",), "--no-baselines")
    return case


def reshape_and_cache_case(dtype_name: str, tokens: int, device: torch.device, settings: Settings,
                           gen: torch.Generator) -> CaseResult:
    """Write ``tokens`` bfloat16 K/V rows into shuffled slots (fp8 caches: quantizing)."""
    dtype = DTYPES[dtype_name]
    row = KV_HEADS * HEAD_DIM
    moved = 2 * tokens * row * (2 + dtype.itemsize)  # read bf16 key/value, write the cache rows
    case = CaseResult(f"reshape_and_cache {dtype_name} t{tokens}", "reshape_and_cache", dtype_name, None, None,
                      bytes=moved, bandwidth_ref="copy", check_reference="the written slots (exact)",
                      note="input bfloat16; baseline: index_copy_ into the flat cache"
                           + (" after quantize_fp8" if is_fp8(dtype) else ""))
    layers = num_layers(moved, settings)
    num_blocks = math.ceil(tokens / BLOCK)
    slots = (torch.randperm(num_blocks, generator=gen)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:tokens]
    slots = slots.to(device)
    scale = torch.tensor([FP8_SCALE], device=device) if is_fp8(dtype) else None
    key = fill_random(torch.empty(tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device), gen)
    value = fill_random(torch.empty_like(key), gen)
    keys = [key] + [key.clone() for _ in range(layers - 1)]
    values = [value] + [value.clone() for _ in range(layers - 1)]
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
    v_caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
    case.note += f"; {layers} copies rotated"

    def stored(x: Tensor) -> Tensor:
        return quantize_fp8(x, scale, dtype) if scale is not None else x

    def reset() -> None:
        for t in k_caches + v_caches:
            poison(t)

    def check(_: None) -> float:
        return max(max_abs_diff(k_caches[0].view(-1, KV_HEADS, HEAD_DIM)[slots], stored(key)),
                   max_abs_diff(v_caches[0].view(-1, KV_HEADS, HEAD_DIM)[slots], stored(value)))

    def kernel(i: int) -> None:
        j = i % layers
        ops.reshape_and_cache(keys[j], values[j], k_caches[j], v_caches[j], slots, k_scale=scale, v_scale=scale)

    def write_rows(cache: Tensor, rows: Tensor) -> None:
        flat, rows = cache.view(-1, KV_HEADS, HEAD_DIM), stored(rows)
        if is_fp8(dtype):  # index_copy_ has no fp8 kernel; it only moves bytes, so copy them as uint8
            flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
        flat.index_copy_(0, slots, rows)

    def index_copy(i: int) -> None:
        j = i % layers
        write_rows(k_caches[j], keys[j])
        write_rows(v_caches[j], values[j])

    reset()
    run_impl(case, "kvkernels", kernel, layers, settings, baseline=False, verify=check)
    if settings.baselines:
        reset()
        run_impl(case, "torch-index", index_copy, layers, settings, baseline=True, verify=check)
    else:
        skip(case, ("torch-index",), "--no-baselines")
    return case


def gather_kv_case(batch: int, context: int, device: torch.device, settings: Settings,
                   gen: torch.Generator) -> CaseResult:
    """Paged bfloat16 cache -> contiguous [batch * context, H, D] keys and values."""
    per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * per_seq
    layer_bytes = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * 2
    case = CaseResult(f"gather_kv bfloat16 b{batch} ctx{context}", "gather_kv", "bfloat16", batch, context,
                      bytes=2 * layer_bytes, bandwidth_ref="copy", check_reference="torch indexing (exact)",
                      note="bytes: paged K/V read + contiguous K/V written; baseline: cache[block_table]")
    layers = num_layers(layer_bytes, settings)
    if not fits(case, ("kvkernels", "torch-index"), (layers + 2) * layer_bytes, settings):
        return case
    table = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(device)
    tables32 = table.to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k0 = fill_random(torch.empty(shape, dtype=torch.bfloat16, device=device), gen)
    v0 = fill_random(torch.empty(shape, dtype=torch.bfloat16, device=device), gen)
    k_caches, v_caches = [k0] + [k0.clone() for _ in range(layers - 1)], [v0] + [v0.clone() for _ in range(layers - 1)]
    tokens = batch * context

    def torch_index(i: int) -> tuple[Tensor, Tensor]:
        j = i % layers
        return tuple(c[table].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].reshape(tokens, KV_HEADS, HEAD_DIM)
                     for c in (k_caches[j], v_caches[j]))

    expected = torch_index(0)

    def check(out: tuple[Tensor, Tensor]) -> float:
        return max(max_abs_diff(out[0], expected[0]), max_abs_diff(out[1], expected[1]))

    def kernel(i: int) -> tuple[Tensor, Tensor]:
        j = i % layers
        return ops.gather_kv(k_caches[j], v_caches[j], tables32, seq_lens, num_tokens=tokens)

    run_impl(case, "kvkernels", kernel, layers, settings, baseline=False, verify=check)
    if settings.baselines:
        run_impl(case, "torch-index", torch_index, layers, settings, baseline=True, verify=check)
    else:
        skip(case, ("torch-index",), "--no-baselines")
    return case


def merge_case(tokens: int, device: torch.device, settings: Settings, gen: torch.Generator) -> CaseResult:
    """merge_attention_states of two bfloat16 partial results [tokens, 32, 128] with their lse."""
    out_bytes, lse_bytes = tokens * HEADS * HEAD_DIM * 2, tokens * HEADS * 4
    case = CaseResult(f"merge bfloat16 t{tokens}", "merge", "bfloat16", None, None,
                      bytes=3 * (out_bytes + lse_bytes), bandwidth_ref="copy", check_reference="float32 merge formula",
                      note="bytes: two (out, lse) read + one written; baseline: torch float32 math")
    layers = num_layers(2 * (out_bytes + lse_bytes), settings)

    def make() -> list[Tensor]:
        return [fill_random(torch.empty(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device), gen).mul_(0.25),
                2 * torch.randn(tokens, HEADS, generator=gen).to(device),
                fill_random(torch.empty(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device), gen).mul_(0.25),
                2 * torch.randn(tokens, HEADS, generator=gen).to(device)]

    inputs = make()
    copies = [inputs] + [[t.clone() for t in inputs] for _ in range(layers - 1)]

    def merge_f32(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
        lse = torch.logaddexp(lse_a, lse_b)
        return torch.exp(lse_a - lse)[..., None] * out_a.float() + torch.exp(lse_b - lse)[..., None] * out_b.float()

    expected = merge_f32(*inputs)
    tolerance = TOLERANCE[torch.bfloat16]
    run_impl(case, "kvkernels", lambda i: ops.merge_attention_states(*copies[i % layers])[0], layers, settings,
             baseline=False, verify=lambda out: max_abs_diff(out, expected), tolerance=tolerance)
    if settings.baselines:
        run_impl(case, "torch-math", lambda i: merge_f32(*copies[i % layers]).to(torch.bfloat16), layers, settings,
                 baseline=True, verify=lambda out: max_abs_diff(out, expected), tolerance=tolerance)
    else:
        skip(case, ("torch-math",), "--no-baselines")
    return case


def swap_blocks_case(direction: str, layers: int, pairs: int, device: torch.device, settings: Settings,
                     gen: torch.Generator) -> CaseResult:
    """``pairs`` blocks of every layer of a stacked bfloat16 cache to pinned host memory (offload,
    "d2h") or back (restore, "h2d"), mapping on the CPU: one cudaMemcpy2DAsync per block."""
    block_bytes = BLOCK * KV_HEADS * HEAD_DIM * 2
    moved = pairs * layers * 2 * block_bytes  # one way over the host link
    num_blocks = 2 * pairs
    case = CaseResult(f"swap_blocks {direction} L{layers} x{pairs}", "swap_blocks", "bfloat16", None, None,
                      bytes=moved, bandwidth_ref=direction, check_reference="exact",
                      note="device cache [L, 2, N, 16, 8, 128] <-> pinned host [L, 2, pairs, ...], block_dim=2, "
                           "mapping on the CPU; bytes one way; baseline: host.copy_(cache[:, :, ids]) / "
                           "cache[:, :, ids] = host.to(device)")
    if device.type != "cuda":
        skip(case, ("kvkernels", "torch-index"), "needs pinned host memory and a CUDA device")
        return case
    shape = (layers, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    cache = fill_random(torch.empty(shape, dtype=torch.bfloat16, device=device), gen)
    host = torch.empty((layers, 2, pairs, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16).pin_memory()
    ids = torch.randperm(num_blocks, generator=gen)[:pairs]
    dev_ids = ids.to(device)
    if direction == "d2h":
        mapping = torch.stack([ids, torch.arange(pairs)], dim=1)

        def kernel(i: int) -> None:
            ops.swap_blocks(cache, host, mapping, block_dim=2)

        def baseline(i: int) -> None:
            host.copy_(cache[:, :, dev_ids], non_blocking=True)

        def check(_: None) -> float:
            torch.cuda.synchronize(device)
            return max_abs_diff(host.to(device), cache[:, :, dev_ids])
    else:
        host.copy_(cache[:, :, dev_ids].cpu())
        mapping = torch.stack([torch.arange(pairs), ids], dim=1)

        def kernel(i: int) -> None:
            ops.swap_blocks(host, cache, mapping, block_dim=2)

        def baseline(i: int) -> None:
            cache[:, :, dev_ids] = host.to(device, non_blocking=True)

        def check(_: None) -> float:
            return max_abs_diff(cache[:, :, dev_ids], host.to(device))

    run_impl(case, "kvkernels", kernel, 1, settings, baseline=False, verify=check)
    if settings.baselines:
        run_impl(case, "torch-index", baseline, 1, settings, baseline=True, verify=check)
    else:
        skip(case, ("torch-index",), "--no-baselines")
    return case


# ---- attention: the hook for kvkernels/bench/cuda_attention.py ------------------------------------


def attention_jobs(shapes: CudaShapes, groups: list, device: torch.device) -> list[Job]:
    """Decode (batch x context) and prefill cases of paged_attention on CUDA.

    They live in ``kvkernels/bench/cuda_attention.py``, written with the CUDA attention kernel. That
    module provides ``jobs(shapes, groups, device) -> list[(label, fn(settings, gen) -> CaseResult)]``
    with kinds "decode" (bandwidth_ref "read", implementations "kvkernels", "gather+sdpa-flash",
    "sdpa-flash-contiguous") and "prefill" (flops; baseline SDPA with the flash backend), for
    ``shapes.decode_batches`` x ``shapes.decode_contexts`` and ``shapes.prefill``. Until then every
    such case is recorded as skipped, with the reason, so the table shows what is missing.
    """
    wanted = [g for g in ("decode", "prefill") if g in groups]
    if not wanted:
        return []
    reason = None
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kvkernels::paged_attention", "CUDA"):
        reason = "paged_attention has no CUDA kernel in this build"
    try:
        from kvkernels.bench import cuda_attention
    except ImportError:
        cuda_attention = None
        reason = reason or "kvkernels/bench/cuda_attention.py (the CUDA attention cases) is not in this tree"
    if reason is None and not hasattr(cuda_attention, "jobs"):
        reason = ("the attention cases run through their own entry point, python -m kvkernels.bench.cuda_attention "
                  "(scripts/gpu_validate.sh bench runs both); not yet wired into this suite")
    if reason is None and cuda_attention is not None:
        return cuda_attention.jobs(shapes, wanted, device)

    def placeholder(name: str, kind: str, batch, context, settings: Settings, gen: torch.Generator) -> CaseResult:
        case = CaseResult(name, kind, "bfloat16", batch, context, bytes=1, bandwidth_ref=None)
        skip(case, ("kvkernels", "sdpa-flash"), reason)
        return case

    jobs = []
    if "decode" in wanted:
        for b in shapes.decode_batches:
            for c in shapes.decode_contexts:
                name = f"decode bfloat16 b{b} ctx{c}"
                jobs.append((name, functools.partial(placeholder, name, "decode", b, c)))
    if "prefill" in wanted:
        name = f"prefill bfloat16 {shapes.prefill[0]} of {shapes.prefill[1]}"
        jobs.append((name, functools.partial(placeholder, name, "prefill", 1, shapes.prefill[1])))
    return jobs


# ---- the run --------------------------------------------------------------------------------------


def plan(shapes: CudaShapes, groups: list, device: torch.device) -> list[Job]:
    jobs: list[Job] = []
    if "copy" in groups:
        layers, blocks, pairs = shapes.copy
        for name in shapes.copy_dtypes:
            jobs.append((f"copy_blocks {name}", functools.partial(copy_blocks_case, name, layers, blocks, pairs,
                                                                  device)))
    if "extra" in groups:
        for tokens in shapes.reshape_tokens:
            for name in ("bfloat16", "fp8_e4m3"):
                jobs.append((f"reshape_and_cache {name} t{tokens}",
                             functools.partial(reshape_and_cache_case, name, tokens, device)))
        for batch, context in shapes.gather:
            jobs.append((f"gather_kv b{batch}", functools.partial(gather_kv_case, batch, context, device)))
        jobs.append(("merge_attention_states", functools.partial(merge_case, shapes.merge_tokens, device)))
    if "swap" in groups:
        for direction in ("d2h", "h2d"):
            jobs.append((f"swap_blocks {direction}", functools.partial(swap_blocks_case, direction, *shapes.swap,
                                                                       device)))
    return jobs + attention_jobs(shapes, groups, device)


def device_info(device: torch.device) -> dict:
    info = {"device": str(device), "cpu_model": machine.cpu_model(), "platform": platform.platform()}
    if device.type != "cuda":
        info["name"] = f"{device.type} (dry run of the CUDA benchmark)"
        return info
    p = torch.cuda.get_device_properties(device)
    info.update(name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                memory_bytes=p.total_memory, l2_cache_bytes=getattr(p, "L2_cache_size", None))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                              "--format=csv,noheader", f"--id={device.index or 0}"],
                             capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as error:
        info["nvidia_smi"] = f"unavailable: {error}"
    return info


def run(args, argv: list, device: Optional[torch.device] = None) -> int:
    """The CUDA suite for ``cli.main`` (``device``: another device only to dry-run this module)."""
    device = device or torch.device("cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("kvkernels bench --device cuda: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    started = datetime.datetime.now().astimezone()
    shapes = QUICK if args.quick else FULL
    l2 = (getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if device.type == "cuda" else 0)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 64 * GIB
    budget = int(0.85 * free) if args.max_memory_gib is None else int(args.max_memory_gib * GIB)
    settings = Settings(min_time=shapes.min_time if args.min_time is None else args.min_time,
                        rotate_bytes=0 if args.quick else 4 * max(l2, 64 << 20), memory_budget=budget,
                        baselines=not args.no_baselines, max_baseline_seconds=args.max_baseline_seconds,
                        timer=make_timer(device))
    print(f"[cuda bench] device {device_info(device).get('name')}, memory budget {budget / GIB:.1f} GiB",
          file=sys.stderr, flush=True)
    bandwidth = measure_bandwidth(device, shapes.bandwidth_bytes, settings.min_time)
    cases = []
    jobs = plan(shapes, args.cases, device)
    for n, (label, job) in enumerate(jobs, 1):
        print(f"[{n}/{len(jobs)}] {label}", file=sys.stderr, flush=True)
        case = job(settings, torch.Generator().manual_seed(0))
        finalize(case, bandwidth)
        cases.append(case)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next case may need the whole budget
    header = {
        "machine": device_info(device), "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "kvkernels_version": kvkernels.__version__, "python_version": platform.python_version(),
        "date": started.isoformat(timespec="seconds"), "command_line": shlex.join([sys.executable, *sys.argv]),
        "bench_args": argv,
        "settings": {"quick": args.quick, "min_time_s": settings.min_time, "rotate_bytes": settings.rotate_bytes,
                     "memory_budget_bytes": settings.memory_budget, "baselines": settings.baselines,
                     "timing": "CUDA events around batches of back-to-back calls; median per-call time"},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cuda-{machine.slug(header['machine']['name'])}-{started:%Y%m%d-%H%M%S}"
    json_path, txt_path = stem.with_suffix(".json"), stem.with_suffix(".txt")
    report.write_json(json_path, header, bandwidth, cases)
    extra = ""
    if "h2d" in bandwidth:
        extra = (f"pinned host link: h2d {bandwidth['h2d']:.1f} GB/s, d2h {bandwidth['d2h']:.1f} GB/s "
                 f"({bandwidth['pinned_buffer_bytes'] / 2**20:.0f} MiB copies)\n")
    table = report.format_table(cases, bandwidth, f"{extra}JSON: {json_path}\ntext: {txt_path}")
    title = (f"kvkernels {kvkernels.__version__} on {header['machine']['name']}, torch {torch.__version__}, "
             f"CUDA {torch.version.cuda}, {header['date']}")
    txt_path.write_text(title + "\n\n" + table + "\n")
    print(title + "\n\n" + table)
    failed = any(r.checked is False for case in cases for r in case.impls.values())
    return 1 if failed else 0
