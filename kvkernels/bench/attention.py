"""Attention cases: paged decode, chunked prefill and MLA decode, each timed for kvkernels and the
PyTorch baselines on the same data, with a one-off output check against float32 math."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from kvkernels import memory, ops
from kvkernels.bench.core import (GIB, TOLERANCE, CaseResult, Settings, copies_that_fit, fill_random, is_fp8,
                                  max_abs_diff, num_layers, run_impl, skip)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_IMPLS = ("kvkernels", "gather+sdpa", "sdpa-contiguous")
FP8_SCALE = 4.0 / 448  # N(0, 1) data then uses most of e4m3's range without clamping
CHECKED_SEQS = 2  # sequences of a decode batch compared with float32 math (cheap at any size)


@dataclass
class PagedLayers:
    """``len(key_caches)`` copies ("layers") of one paged K/V cache; all share one block table, as
    the layers of a model do. The pool holds exactly the batch's blocks, in shuffled order."""

    query: Tensor  # [batch, HEADS, HEAD_DIM] (decode) or [q_len, HEADS, HEAD_DIM] (prefill)
    key_caches: list
    value_caches: list
    block_tables: Tensor  # int32 [batch, blocks per sequence]
    block_ids: Tensor  # the same, int64, for the torch baselines (converted once, outside timing)
    seq_lens: Tensor
    context: int
    k_scale: Optional[Tensor]
    v_scale: Optional[Tensor]


def query_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if is_fp8(cache_dtype) else cache_dtype


def paged_layer_bytes(batch: int, context: int, dtype: torch.dtype) -> int:
    blocks = batch * math.ceil(context / BLOCK)
    return 2 * blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize


def build_paged(batch: int, context: int, num_queries: int, dtype: torch.dtype, layers: int,
                gen: torch.Generator) -> PagedLayers:
    per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * per_seq
    table = torch.randperm(num_blocks, generator=gen).view(batch, per_seq)
    scale = torch.tensor([FP8_SCALE]) if is_fp8(dtype) else None
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key = fill_random(memory.empty(shape, dtype), gen, scale)
    value = fill_random(memory.empty(shape, dtype), gen, scale)
    query = torch.randn(num_queries, HEADS, HEAD_DIM, generator=gen).to(query_dtype(dtype))
    return PagedLayers(query, [key] + [memory.copy(key) for _ in range(layers - 1)],
                       [value] + [memory.copy(value) for _ in range(layers - 1)], table.to(torch.int32), table,
                       torch.full((batch,), context, dtype=torch.int32), context, scale, scale)


def gather_bhld(cache: Tensor, block_ids: Tensor, context: int, scale: Optional[Tensor]) -> Tensor:
    """The torch way to read a paged cache: index whole blocks through the table, view them as
    [batch, heads, context, dim] (a strided view), and dequantize fp8 to bfloat16."""
    batch = block_ids.shape[0]
    x = cache[block_ids].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2)
    return x.to(torch.bfloat16) * scale.reshape(()) if is_fp8(cache.dtype) else x


def attention_f32(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Bottom-right causal attention in float32: q [Tq, Hq, Dk], k [S, Hkv, Dk], v [S, Hkv, Dv]."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    tq, s = q.shape[0], k.shape[0]
    visible = torch.arange(s)[None, :] <= torch.arange(tq)[:, None] + (s - tq)
    weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def sequence_f32(cache: Tensor, table_row: Tensor, context: int, scale: Optional[Tensor]) -> Tensor:
    """One sequence's rows of layer-0 cache as float32 [context, ...], dequantized."""
    rows = cache[table_row].flatten(0, 1)[:context].float()
    return rows * scale if scale is not None else rows


def decode_reference(data: PagedLayers) -> Tensor:
    """float32 attention of the first CHECKED_SEQS sequences: [n, HEADS, HEAD_DIM]."""
    out = []
    for i in range(min(CHECKED_SEQS, data.query.shape[0])):
        k = sequence_f32(data.key_caches[0], data.block_ids[i], data.context, data.k_scale)
        v = sequence_f32(data.value_caches[0], data.block_ids[i], data.context, data.v_scale)
        out.append(attention_f32(data.query[i:i + 1], k, v, HEAD_DIM ** -0.5)[0])
    return torch.stack(out)


def contiguous_copies(data: PagedLayers, count: int) -> tuple[list, list]:
    """``count`` copies of K/V as contiguous [batch, KV_HEADS, context, HEAD_DIM] (fp8 caches:
    dequantized bfloat16, since SDPA has no fp8 path), built from the paged layers."""
    keys, values = [], []
    for i in range(count):
        keys.append(memory.copy(gather_bhld(data.key_caches[i], data.block_ids, data.context, data.k_scale)))
        values.append(memory.copy(gather_bhld(data.value_caches[i], data.block_ids, data.context,
                                              data.v_scale)))
    return keys, values


def decode_case(dtype_name: str, dtype: torch.dtype, batch: int, context: int, settings: Settings,
                gen: torch.Generator) -> CaseResult:
    layer_bytes = paged_layer_bytes(batch, context, dtype)
    case = CaseResult(f"decode {dtype_name} b{batch} ctx{context}", "decode", dtype_name, batch, context,
                      bytes=2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize, bandwidth_ref="read",
                      check_reference=f"float32 attention of the first {CHECKED_SEQS} sequences")
    if is_fp8(dtype):
        case.note = ("fp8: query bfloat16, per-tensor scales; sdpa-contiguous reads pre-dequantized bfloat16 "
                     "K/V (2x the bytes); GB/s counts the fp8 cache bytes for every implementation")
    layers = copies_that_fit(num_layers(layer_bytes, settings), layer_bytes, settings.memory_budget)
    if layers == 0:
        skip(case, DECODE_IMPLS, f"one cache copy ({layer_bytes / GIB:.1f} GiB) exceeds the memory budget")
        return case
    data = build_paged(batch, context, batch, dtype, layers, gen)
    expected = decode_reference(data)
    tolerance = TOLERANCE[dtype]

    def check(out: Tensor) -> float:
        return max_abs_diff(out[:expected.shape[0]], expected)

    def kernel(i: int) -> Tensor:
        j = i % layers
        return ops.paged_attention(data.query, data.key_caches[j], data.value_caches[j], data.block_tables,
                                   data.seq_lens, k_scale=data.k_scale, v_scale=data.v_scale)[0]

    run_impl(case, "kvkernels", kernel, layers, settings, baseline=False, verify=check, tolerance=tolerance)
    if not settings.baselines:
        skip(case, DECODE_IMPLS[1:], "--no-baselines")
        return case
    q4 = data.query.unsqueeze(2)  # [batch, HEADS, 1, HEAD_DIM]

    def gather_sdpa(i: int) -> Tensor:
        j = i % layers
        k = gather_bhld(data.key_caches[j], data.block_ids, context, data.k_scale)
        v = gather_bhld(data.value_caches[j], data.block_ids, context, data.v_scale)
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True).squeeze(2)

    # Gathered K/V in the cache dtype, plus two bfloat16 copies when dequantizing fp8.
    transient = int(layer_bytes * (3.5 if is_fp8(dtype) else 1.0))
    if layers * layer_bytes + transient <= settings.memory_budget:
        run_impl(case, "gather+sdpa", gather_sdpa, layers, settings, baseline=True, verify=check,
                 tolerance=tolerance)
    else:
        skip(case, ("gather+sdpa",), f"needs ~{(layers * layer_bytes + transient) / GIB:.1f} GiB "
                                     f"> memory budget", layers)
    run_contiguous_sdpa(case, data, q4, layer_bytes, layers, settings, check, tolerance)
    return case


def run_contiguous_sdpa(case: CaseResult, data: PagedLayers, q4: Tensor, layer_bytes: int, layers: int,
                        settings: Settings, check: Callable[[Tensor], float], tolerance: float) -> None:
    """SDPA alone over K/V that are already contiguous: its own copies, as many as rotation needs
    and memory allows next to the paged layers (recorded in its ``layers``)."""
    contig_bytes = layer_bytes * (2 if is_fp8(data.key_caches[0].dtype) else 1)
    count = copies_that_fit(min(layers, num_layers(contig_bytes, settings)), contig_bytes,
                            settings.memory_budget - layers * layer_bytes - contig_bytes)
    if count == 0:
        skip(case, ("sdpa-contiguous",), "no room for a contiguous copy next to the paged cache")
        return
    keys, values = contiguous_copies(data, count)

    def sdpa(i: int) -> Tensor:
        j = i % count
        return F.scaled_dot_product_attention(q4, keys[j], values[j], enable_gqa=True).squeeze(2)

    run_impl(case, "sdpa-contiguous", sdpa, count, settings, baseline=True, verify=check, tolerance=tolerance)


def prefill_case(dtype_name: str, dtype: torch.dtype, q_len: int, context: int, settings: Settings,
                 gen: torch.Generator) -> CaseResult:
    """One sequence: a ``q_len``-token chunk appended at the end of a ``context``-token sequence."""
    visible_pairs = sum(context - q_len + i + 1 for i in range(q_len))
    layer_bytes = paged_layer_bytes(1, context, dtype)
    case = CaseResult(f"prefill {dtype_name} q{q_len} ctx{context}", "prefill", dtype_name, 1, context,
                      bytes=layer_bytes, bandwidth_ref=None,
                      flops=4 * HEAD_DIM * HEADS * visible_pairs,
                      check_reference="float32 attention of every query",
                      note=f"sdpa-contiguous: attn_mask=causal_lower_right({q_len}, {context}), enable_gqa; "
                           "flops = 4 * head_dim * heads * (query, key) pairs inside the causal mask")
    layers = num_layers(layer_bytes, settings)
    data = build_paged(1, context, q_len, dtype, layers, gen)
    query_start_loc = torch.tensor([0, q_len], dtype=torch.int32)
    k = sequence_f32(data.key_caches[0], data.block_ids[0], context, None)
    v = sequence_f32(data.value_caches[0], data.block_ids[0], context, None)
    expected = attention_f32(data.query, k, v, HEAD_DIM ** -0.5)
    tolerance = TOLERANCE[dtype]

    def kernel(i: int) -> Tensor:
        j = i % layers
        return ops.paged_attention(data.query, data.key_caches[j], data.value_caches[j], data.block_tables,
                                   data.seq_lens, query_start_loc)[0]

    run_impl(case, "kvkernels", kernel, layers, settings, baseline=False,
             verify=lambda out: max_abs_diff(out, expected), tolerance=tolerance)
    if not settings.baselines:
        skip(case, ("sdpa-contiguous",), "--no-baselines")
        return case
    keys, values = contiguous_copies(data, layers)
    q4 = data.query.transpose(0, 1).unsqueeze(0)  # [1, HEADS, q_len, HEAD_DIM]
    mask = causal_lower_right(q_len, context)

    def sdpa(i: int) -> Tensor:
        j = i % layers
        out = F.scaled_dot_product_attention(q4, keys[j], values[j], attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)

    run_impl(case, "sdpa-contiguous", sdpa, layers, settings, baseline=True,
             verify=lambda out: max_abs_diff(out, expected), tolerance=tolerance)
    return case


MLA_HEADS, MLA_RANK, MLA_ROPE, MLA_BLOCK = 16, 512, 64, 64


def mla_case(batch: int, context: int, settings: Settings, gen: torch.Generator) -> CaseResult:
    """Absorbed-weight MLA decode over a bfloat16 latent cache [blocks, 64, 576]."""
    width = MLA_RANK + MLA_ROPE
    per_seq = math.ceil(context / MLA_BLOCK)
    case = CaseResult(f"mla_decode bfloat16 b{batch} ctx{context}", "mla_decode", "bfloat16", batch, context,
                      bytes=batch * context * width * 2, bandwidth_ref="read",
                      check_reference=f"float32 attention of the first {CHECKED_SEQS} sequences",
                      note=f"{MLA_HEADS} heads, kv_lora_rank {MLA_RANK}, rows of {width}, block {MLA_BLOCK}; "
                           "baseline: gather + bmm/softmax(float32)/bmm")
    layer_bytes = batch * per_seq * MLA_BLOCK * width * 2
    layers = num_layers(layer_bytes, settings)
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    cache = fill_random(memory.empty((batch * per_seq, MLA_BLOCK, width), torch.bfloat16), gen)
    caches = [cache] + [memory.copy(cache) for _ in range(layers - 1)]
    q = torch.randn(batch, MLA_HEADS, width, generator=gen).to(torch.bfloat16)
    block_tables, seq_lens = table.to(torch.int32), torch.full((batch,), context, dtype=torch.int32)
    scale = (128 + MLA_ROPE) ** -0.5  # DeepSeek: qk_nope_head_dim 128 + rope 64

    expected = []
    for i in range(min(CHECKED_SEQS, batch)):
        rows = sequence_f32(cache, table[i], context, None)[:, None, :]
        expected.append(attention_f32(q[i:i + 1], rows, rows[..., :MLA_RANK], scale)[0])
    expected = torch.stack(expected)

    def check(out: Tensor) -> float:
        return max_abs_diff(out[:expected.shape[0]], expected)

    def kernel(i: int) -> Tensor:
        return ops.mla_paged_attention(q, caches[i % layers], block_tables, seq_lens, kv_lora_rank=MLA_RANK,
                                       scale=scale)[0]

    def gather_matmul(i: int) -> Tensor:
        kv = caches[i % layers][table].reshape(batch, -1, width)[:, :context]
        weights = (torch.bmm(q, kv.transpose(1, 2)).float() * scale).softmax(-1).to(q.dtype)
        return torch.bmm(weights, kv[..., :MLA_RANK])

    tolerance = TOLERANCE[torch.bfloat16]
    run_impl(case, "kvkernels", kernel, layers, settings, baseline=False, verify=check, tolerance=tolerance)
    if settings.baselines:
        run_impl(case, "gather+matmul", gather_matmul, layers, settings, baseline=True, verify=check,
                 tolerance=tolerance)
    else:
        skip(case, ("gather+matmul",), "--no-baselines")
    return case


def cascade_case(name: str, dtype: torch.dtype, beams: int, prefix: int, own: int, settings: Settings,
                 gen: torch.Generator) -> CaseResult:
    """Decode of ``beams`` rows that share a ``prefix``-token prompt and hold ``own`` tokens each
    (beam search / parallel samples), 32 query / 8 kv heads of 128: ``cascade_attention`` (the
    prompt's blocks read once for all rows, then each row's own, merged) against one plain
    ``paged_attention`` call over the same block tables. Bytes: the distinct K/V bytes."""
    from kvkernels.cache.cascade import cascade_attention, plan_cascade
    shared, mine = prefix // BLOCK, -(-own // BLOCK)
    num_blocks = shared + beams * mine
    case = CaseResult(f"cascade_decode {name} {beams} beams {prefix}+{own}", "cascade_decode", name, beams,
                      prefix + own, bytes=2 * (prefix + beams * own) * KV_HEADS * HEAD_DIM * dtype.itemsize,
                      bandwidth_ref="read", check_reference=f"float32 attention of the first {CHECKED_SEQS} rows",
                      note=f"{beams} rows share {prefix} prompt tokens (whole blocks) and hold {own} own tokens "
                           f"each; bytes: the distinct K/V; baseline: one paged_attention call over the same "
                           f"tables (reads the prompt once per row); the plan is built once per step in use, "
                           f"outside the timing")
    layer_bytes = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    layers = num_layers(layer_bytes, settings)
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.cat([ids[:shared].expand(beams, shared), ids[shared:].view(beams, mine)], 1)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key, value = fill_random(memory.empty(shape, dtype), gen), fill_random(memory.empty(shape, dtype), gen)
    keys = [key] + [memory.copy(key) for _ in range(layers - 1)]
    values = [value] + [memory.copy(value) for _ in range(layers - 1)]
    query = torch.randn(beams, HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens = torch.full((beams,), prefix + own, dtype=torch.int32)
    tables = table.to(torch.int32)
    plan = plan_cascade(tables.numpy(), seq_lens.numpy(), BLOCK, "cpu", min_shared_tokens=1)
    expected = torch.stack([attention_f32(query[i:i + 1], sequence_f32(keys[0], table[i], prefix + own, None),
                                          sequence_f32(values[0], table[i], prefix + own, None),
                                          HEAD_DIM ** -0.5)[0] for i in range(CHECKED_SEQS)])

    def check(out: Tensor) -> float:
        return max_abs_diff(out[:CHECKED_SEQS], expected)

    def kernel(i: int) -> Tensor:
        return cascade_attention(query, keys[i % layers], values[i % layers], plan)[0]

    def plain(i: int) -> Tensor:
        return ops.paged_attention(query, keys[i % layers], values[i % layers], tables, seq_lens)[0]

    tolerance = TOLERANCE[dtype]
    run_impl(case, "kvkernels", kernel, layers, settings, baseline=False, verify=check, tolerance=tolerance)
    run_impl(case, "paged_attention", plain, layers, settings, baseline=True, verify=check, tolerance=tolerance)
    return case
