"""Memory-movement cases: copy_blocks on a stacked cache, reshape_and_cache, gather_kv and
merge_attention_states, each against the plain-torch way of doing the same thing."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvkernels import memory, ops
from kvkernels.bench.attention import BLOCK, FP8_SCALE, HEAD_DIM, HEADS, KV_HEADS
from kvkernels.bench.core import (GIB, TOLERANCE, CaseResult, Settings, fill_random, is_fp8, max_abs_diff,
                                  num_layers, run_impl, skip)
from kvkernels.reference import quantize_fp8


CPU = torch.device("cpu")


def poison(t: Tensor) -> Tensor:
    """Fill with bytes a correct write never leaves (0x7F: NaN in fp8, ~3e38 in bf16), so the
    output check cannot pass on what an earlier implementation wrote."""
    t.view(torch.uint8).fill_(0x7F)
    return t


def fits(case: CaseResult, names: tuple, need: int, settings: Settings) -> bool:
    """Whether ``need`` bytes fit the memory budget; else the implementations are skipped, saying so."""
    if need <= settings.memory_budget:
        return True
    skip(case, names, f"needs ~{need / GIB:.1f} GiB > the memory budget of {settings.memory_budget / GIB:.1f} GiB")
    return False


# Every case takes the device its tensors live on: the CPU suite (cli.py) and the CUDA suite (cuda.py)
# run the same cases, timed by whatever `settings` carries.


def copy_blocks_case(dtype_name: str, dtype: torch.dtype, layers: int, num_blocks: int, pairs: int,
                     settings: Settings, gen: torch.Generator, *, device: torch.device = CPU) -> CaseResult:
    """``pairs`` (src, dst) block copies across every layer of one stacked [L, 2, N, B, H, D] cache."""
    block_bytes = BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    moved = 2 * pairs * layers * 2 * block_bytes  # read + write, K and V, every layer
    shape = (layers, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    case = CaseResult(f"copy_blocks {dtype_name} L{layers} x{pairs}", "copy_blocks", dtype_name, None, None,
                      bytes=moved, bandwidth_ref="copy",
                      check_reference="every destination block equals its source (exact)",
                      note=f"stacked cache {list(shape)}, block_dim=2, {pairs} pairs of distinct random blocks, "
                           f"mapping on the {device.type}; baseline: cache[:, :, dst] = cache[:, :, src]")
    cache_bytes = math.prod(shape) * dtype.itemsize
    if not fits(case, ("kvkernels", "torch-index"), cache_bytes + moved // 2, settings):  # the baseline
        return case                                                                        # gathers first
    cache = fill_random(memory.empty(shape, dtype, device), gen)
    # Rotated mappings use disjoint blocks, so after any number of calls every destination equals
    # its source and one check after timing covers them all.
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


def reshape_and_cache_case(dtype_name: str, dtype: torch.dtype, tokens: int, settings: Settings,
                           gen: torch.Generator, *, device: torch.device = CPU) -> CaseResult:
    """Write ``tokens`` bfloat16 K/V rows into shuffled slots of a cache (fp8: quantizing)."""
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
    key = fill_random(memory.empty((tokens, KV_HEADS, HEAD_DIM), torch.bfloat16, device), gen)
    value = fill_random(memory.empty(key.shape, torch.bfloat16, device), gen)
    keys = [key] + [memory.copy(key) for _ in range(layers - 1)]
    values = [value] + [memory.copy(value) for _ in range(layers - 1)]
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_caches = [memory.empty(shape, dtype, device) for _ in range(layers)]
    v_caches = [memory.empty(shape, dtype, device) for _ in range(layers)]
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


def gather_kv_case(batch: int, context: int, settings: Settings, gen: torch.Generator, *,
                   device: torch.device = CPU) -> CaseResult:
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
    table = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(device)  # shuffled blocks
    tables32 = table.to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k0 = fill_random(memory.empty(shape, torch.bfloat16, device), gen)
    v0 = fill_random(memory.empty(shape, torch.bfloat16, device), gen)
    k_caches = [k0] + [memory.copy(k0) for _ in range(layers - 1)]
    v_caches = [v0] + [memory.copy(v0) for _ in range(layers - 1)]
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


def merge_f32(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    lse = torch.logaddexp(lse_a, lse_b)
    return (torch.exp(lse_a - lse)[..., None] * out_a.float() + torch.exp(lse_b - lse)[..., None] * out_b.float())


def merge_case(tokens: int, settings: Settings, gen: torch.Generator, *, device: torch.device = CPU) -> CaseResult:
    """merge_attention_states of two bfloat16 partial results [tokens, 32, 128] with their lse."""
    out_bytes, lse_bytes = tokens * HEADS * HEAD_DIM * 2, tokens * HEADS * 4
    case = CaseResult(f"merge bfloat16 t{tokens}", "merge", "bfloat16", None, None,
                      bytes=3 * (out_bytes + lse_bytes), bandwidth_ref="copy",
                      check_reference="float32 merge formula",
                      note="bytes: two (out, lse) read + one written; baseline: torch float32 math")
    layers = num_layers(2 * (out_bytes + lse_bytes), settings)
    # Partial outputs are averages of value rows, so smaller than N(0, 1) draws; 0.25 also keeps
    # bfloat16 rounding of the result (half an ulp grows with magnitude) well inside the tolerance.
    def partial_out() -> Tensor:
        return fill_random(memory.empty((tokens, HEADS, HEAD_DIM), torch.bfloat16, device), gen).mul_(0.25)

    def lse() -> Tensor:
        return (2 * torch.randn(tokens, HEADS, generator=gen)).to(device)

    inputs = [partial_out(), lse(), partial_out(), lse()]
    copies = [inputs] + [[memory.copy(t) for t in inputs] for _ in range(layers - 1)]
    expected = merge_f32(*inputs)

    def kernel(i: int) -> Tensor:
        return ops.merge_attention_states(*copies[i % layers])[0]

    def torch_math(i: int) -> Tensor:
        return merge_f32(*copies[i % layers]).to(torch.bfloat16)

    tolerance = TOLERANCE[torch.bfloat16]
    run_impl(case, "kvkernels", kernel, layers, settings, baseline=False,
             verify=lambda out: max_abs_diff(out, expected), tolerance=tolerance)
    if settings.baselines:
        run_impl(case, "torch-math", torch_math, layers, settings, baseline=True,
                 verify=lambda out: max_abs_diff(out, expected), tolerance=tolerance)
    else:
        skip(case, ("torch-math",), "--no-baselines")
    return case
