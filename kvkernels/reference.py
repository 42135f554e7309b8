"""Pure-PyTorch reference implementation of every kvkernels op (the test oracle).

Each function here has exactly the signature of its twin in ``kvkernels.ops`` (see docs/api.md)
and implements the semantics of docs/ops.md. The code is written to be obviously right, not
fast: per-sequence Python loops, dense masks, and all arithmetic in float64 (outputs are cast
to the dtypes docs/ops.md prescribes). The index arguments are validated as the ops validate them
(dtype, shape, every id and length in range; ``RuntimeError("kvkernels.<op>: <argument>: ...")``
before anything is written), so the oracle never gives a plausible answer where the op raises;
other bad input gives whatever error PyTorch raises.

Float inputs may themselves be float64 (the tests upcast query/key/value/caches/weights to
compute the oracle); fp8 caches are quantized and dequantized in float32 exactly as the
kernels must do it, so the oracle stays bit-compatible with them on the quantized values.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_MAX",
    "quantize_fp8",
    "dequantize",
    "reshape_and_cache",
    "paged_attention",
    "merge_attention_states",
    "copy_blocks",
    "swap_blocks",
    "gather_kv",
    "concat_and_cache_mla",
    "mla_decompress",
    "mla_paged_attention",
]

# Largest finite magnitude of each fp8 cache dtype; quantization saturates to it.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


# ---------------------------------------------------------------------------------------------
# fp8 helpers
# ---------------------------------------------------------------------------------------------


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def _broadcast_scale(scale: torch.Tensor) -> torch.Tensor:
    """A float32 scale shaped to broadcast over [..., H, D] (per head) or anything (per tensor)."""
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(())
    # One scale per kv head: broadcast along the trailing head_dim.
    return scale.reshape(-1, 1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """stored = fp8(clamp(float32(x) / scale, -M, M)), round to nearest even; NaN stays NaN.

    ``scale`` has 1 element or one per kv head (``x`` is then [..., H, D]).
    """
    limit = FP8_MAX[fp8_dtype]
    # The division must happen in float32 (not in x's dtype) to match the kernels bit for bit.
    return (x.to(torch.float32) / _broadcast_scale(scale)).clamp(-limit, limit).to(fp8_dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32(stored) * scale for fp8 tensors; any other tensor is returned unchanged."""
    if not _is_fp8(stored.dtype):
        return stored
    return stored.to(torch.float32) * _broadcast_scale(scale)


def _to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, scale) -> torch.Tensor:
    if _is_fp8(cache_dtype):
        return quantize_fp8(x, scale, cache_dtype)
    return x.to(cache_dtype)


def _load64(stored: torch.Tensor, scale) -> torch.Tensor:
    """Cache contents as float64 (dequantized in float32 first when fp8)."""
    return dequantize(stored, scale).to(torch.float64)


# ---------------------------------------------------------------------------------------------
# index checks (docs/ops.md; the ops raise the same errors, naming the same argument)
# ---------------------------------------------------------------------------------------------


def _fail(op: str, arg: str, msg: str):
    raise RuntimeError(f"kvkernels.{op}: {arg}: {msg}")


def check_bool_arg(op: str, arg: str, value) -> None:
    """A flag argument (``causal``) must be a Python bool: 1, 0, None or a tensor are errors here and in
    kvkernels.ops, whose wrappers call this (torch.ops' own schema check would convert some of them)."""
    if not isinstance(value, bool):
        _fail(op, arg, f"expected a bool, got {type(value).__name__}")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _check_index(op: str, arg: str, t, dtype: torch.dtype, shape: tuple) -> None:
    """``t`` has ``dtype`` and ``shape`` (None: any size along that dimension)."""
    ok = t.dtype == dtype and t.dim() == len(shape) and all(
        want is None or have == want for have, want in zip(t.shape, shape))
    if not ok:
        want = ", ".join("*" if w is None else str(w) for w in shape)
        _fail(op, arg, f"expected {dtype} [{want}], got {t.dtype} {list(t.shape)}")


def _check_paged(op: str, cache, block_tables, seq_lens, num_tokens=None) -> list[int]:
    """int32 block_tables [S, W] and seq_lens [S]; every seq_len in [0, W * block_size]; every
    block id a sequence uses in [0, num_blocks); num_tokens (if given) == sum(seq_lens).
    Returns seq_lens as a list."""
    _check_index(op, "block_tables", block_tables, torch.int32, (None, None))
    _check_index(op, "seq_lens", seq_lens, torch.int32, (block_tables.shape[0],))
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    width = block_tables.shape[1]
    table = block_tables.cpu()
    lens = [int(x) for x in seq_lens.tolist()]
    for i, n in enumerate(lens):
        if n < 0:
            _fail(op, "seq_lens", f"sequence {i} has negative length {n}")
        if n > width * block_size:
            _fail(op, "seq_lens", f"sequence {i} has {n} tokens but its block_tables row holds at most "
                  f"{width * block_size} ({_plural(width, 'block')} of {block_size})")
        for j, block in enumerate(table[i, :-(-n // block_size)].tolist()):
            if not 0 <= block < num_blocks:
                _fail(op, "block_tables", f"entry [{i}, {j}] = {block} is out of range for a cache of "
                      f"{num_blocks} blocks")
    if num_tokens is not None and int(num_tokens) != sum(lens):
        _fail(op, "num_tokens", f"is {int(num_tokens)} but sum(seq_lens) is {sum(lens)}")
    return lens


def _check_queries(op: str, q_arg: str, num_tokens: int, query_start_loc, seq_lens: list[int]) -> None:
    """Decode: one query per sequence. Varlen: int32 [S + 1], from 0, non-decreasing, to
    num_tokens. A sequence may have more queries than keys (its leading rows see no key when
    causal)."""
    if query_start_loc is None:
        if num_tokens != len(seq_lens):
            _fail(op, q_arg, f"decode (query_start_loc=None) needs one query per sequence: got {num_tokens} "
                  f"queries for {len(seq_lens)} sequences")
        return
    _check_index(op, "query_start_loc", query_start_loc, torch.int32, (len(seq_lens) + 1,))
    qsl = [int(x) for x in query_start_loc.tolist()]
    if qsl[0] != 0:
        _fail(op, "query_start_loc", f"must start at 0, got {qsl[0]}")
    for s, n in enumerate(seq_lens):
        if qsl[s + 1] < qsl[s]:
            _fail(op, "query_start_loc", f"decreases at index {s + 1} ({qsl[s]} -> {qsl[s + 1]})")
    if qsl[-1] != num_tokens:
        _fail(op, "query_start_loc", f"must end at num_tokens = {num_tokens}, got {qsl[-1]}")


def _check_slots(op: str, slot_mapping, num_tokens: int, cache) -> None:
    _check_index(op, "slot_mapping", slot_mapping, torch.int64, (num_tokens,))
    num_slots = cache.shape[0] * cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= num_slots:
            _fail(op, "slot_mapping", f"slot {slot} of token {t} is out of range for a cache of {num_slots} slots")


def _check_block_mapping(op: str, block_mapping, src_blocks: int, dst_blocks: int, same_tensor: bool) -> list:
    _check_index(op, "block_mapping", block_mapping, torch.int64, (None, 2))
    pairs = block_mapping.tolist()
    for i, (s, d) in enumerate(pairs):
        if not 0 <= s < src_blocks:
            _fail(op, "block_mapping", f"row {i}: source block {s} is out of range [0, {src_blocks})")
        if not 0 <= d < dst_blocks:
            _fail(op, "block_mapping", f"row {i}: destination block {d} is out of range [0, {dst_blocks})")
    dsts = [d for _, d in pairs]
    if len(set(dsts)) != len(dsts):
        _fail(op, "block_mapping", "a destination block appears more than once")
    if same_tensor and set(dsts) & {s for s, _ in pairs}:
        _fail(op, "block_mapping", "a block is both a source and a destination in one call")
    return pairs


# ---------------------------------------------------------------------------------------------
# paged-cache addressing
# ---------------------------------------------------------------------------------------------


def _write_slots(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache[slot // B, slot % B] = rows[t] for every token whose slot is >= 0 (in place)."""
    block_size = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(device=cache.device, dtype=torch.int64)
    # Advanced-index assignment is index_put_ on the view itself, so strided views
    # (HND transposes, slices of a stacked allocation) are written through, not replaced.
    cache[slots // block_size, slots % block_size] = rows[keep.to(rows.device)].to(cache.device)


def _sequence_tokens(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, raw (not dequantized): [seq_len, *cache.shape[2:]]."""
    block_size = cache.shape[1]
    # Only the blocks that hold tokens are read: later table entries may be junk (-1, huge ids).
    num_blocks = -(-seq_len // block_size)
    block_ids = block_table_row[:num_blocks].to(device=cache.device, dtype=torch.int64)
    tokens = cache[block_ids].reshape(num_blocks * block_size, *cache.shape[2:])
    return tokens[:seq_len]


def _query_ranges(query_start_loc, num_seqs: int) -> list[tuple[int, int]]:
    """(start, end) query rows of each sequence; decode = one query per sequence."""
    if query_start_loc is None:
        return [(i, i + 1) for i in range(num_seqs)]
    starts = [int(x) for x in query_start_loc.tolist()]
    return list(zip(starts[:-1], starts[1:]))


# ---------------------------------------------------------------------------------------------
# attention core (float64, one sequence)
# ---------------------------------------------------------------------------------------------


def _attend_one_sequence(q, k, v, scale, window_left=-1, soft_cap=0.0, alibi_slopes=None, sinks=None,
                         causal=True):
    """Attention of q [q_len, H, Dk] over k [S, H, Dk], v [S, H, Dv] (all float64, heads already
    matched), with the last query at key position S - 1 (bottom-right alignment: query i sits at
    pos = S - q_len + i, negative for the leading rows when q_len > S). Causal: query i sees keys
    j <= pos; not causal: every key. The window (j >= pos - window_left) and ALiBi (j - pos) use
    the same pos either way.

    Returns out [q_len, H, Dv] and lse [q_len, H], both float64. Non-finite inputs follow
    docs/ops.md ("Non-finite values"): the softmax of each row is evaluated as
    top = max(visible logits, sink), d = sum_visible exp(s - top) + exp(sink - top),
    lse = top + log(d), so a NaN or +inf logit or sink makes the row NaN; keys a row does not see
    are never read (not even as 0 * value).
    """
    q_len, num_heads = q.shape[0], q.shape[1]
    seq_len = k.shape[0]
    device = q.device

    # Logit order fixed by docs/ops.md: scale, soft cap, ALiBi, mask.
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap > 0:
        logits = soft_cap * torch.tanh(logits / soft_cap)

    pos = torch.arange(q_len, device=device, dtype=torch.float64) + (seq_len - q_len)  # [q_len]
    key_pos = torch.arange(seq_len, device=device, dtype=torch.float64)  # [S]
    if alibi_slopes is not None:
        distance = key_pos[None, :] - pos[:, None]  # [q_len, S], <= 0 for visible keys
        logits = logits + alibi_slopes.to(device, torch.float64)[:, None, None] * distance

    if causal:
        visible = key_pos[None, :] <= pos[:, None]  # [q_len, S]
    else:
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= key_pos[None, :] >= pos[:, None] - window_left
    logits = logits.masked_fill(~visible, float("-inf"))

    # top: the largest visible logit (NaN if any is NaN: amax propagates it), with the sink.
    if seq_len > 0:
        top = logits.amax(dim=-1)  # [H, q_len]
    else:
        top = torch.full((num_heads, q_len), float("-inf"), dtype=torch.float64, device=device)
    sink = has_sink = None
    if sinks is not None:
        # The sink is one more logit in the denominator only: it enters the lse, not the values.
        # A -inf sink is no sink; a NaN one counts (and makes the row NaN).
        sink = sinks.to(device, torch.float64)[:, None].expand(num_heads, q_len)
        has_sink = sink != float("-inf")
        top = torch.where(has_sink, torch.maximum(top, sink), top)  # maximum propagates NaN
    # No visible key and no sink: out = 0, lse = -inf. Visible keys whose logits are all -inf and
    # no sink: top = -inf is kept, so every exp is exp(-inf - -inf) = NaN (0 / 0): a NaN row.
    has_keys = visible.any(dim=-1)[None, :]  # [1, q_len]
    empty = (top == float("-inf")) & ~has_keys
    base = torch.where(empty, torch.zeros_like(top), top)
    e = torch.exp(logits - base[..., None])  # [H, q_len, S]; exactly 0 for invisible keys
    d = e.sum(dim=-1)
    if sinks is not None:
        d = d + torch.where(has_sink, torch.exp(sink - base), torch.zeros_like(d))
    lse = base + torch.log(d)  # -inf for empty rows
    weights = e / torch.where(empty, torch.ones_like(d), d)[..., None]

    # Keys a row does not see contribute nothing, even when their value is inf or NaN (0 * NaN
    # would be NaN): the product is masked by visibility, not by weight.
    weights = weights.masked_fill(~visible[None], 0.0)
    if bool(torch.isfinite(v).all()):
        out = torch.einsum("hqk,khd->qhd", weights, v)
    else:
        prod = weights[..., None] * v.permute(1, 0, 2)[:, None]  # [H, q_len, S, Dv]
        out = prod.masked_fill(~visible[None, :, :, None], 0.0).sum(dim=2).permute(1, 0, 2)
    # A NaN lse (a NaN or +inf logit or sink, or 0 / 0) makes every element of the row NaN.
    out = out.masked_fill(torch.isnan(lse).transpose(0, 1)[..., None], float("nan"))
    return out, lse.transpose(0, 1)


def _nan_rows_of_bad_scale(out, scale, stored_dtype, group):
    """docs/ops.md: a non-finite v_scale (kv_scale for MLA) makes the output rows of the query heads
    it applies to NaN (the kernels apply it after the sum, where inf would not give the elementwise
    inf / NaN pattern of dequantizing first). Only fp8 caches read their scales."""
    if scale is None or not _is_fp8(stored_dtype):
        return out
    bad = ~torch.isfinite(scale.to(torch.float64).reshape(-1))
    if not bool(bad.any()):
        return out
    heads = out.shape[1]
    bad = bad.expand(heads // group) if bad.numel() == 1 else bad
    bad = bad.repeat_interleave(group).to(out.device)
    return out.masked_fill(bad[None, :, None], float("nan"))


# ---------------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------------


def _check_given(op: str, out, lse, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """Caller-provided outputs (out= / lse=): the exact shape (never resized), dtype and device."""
    if out is None:
        if lse is not None:
            _fail(op, "lse", "given without out")
        return
    for arg, t, want, want_dtype in (("out", out, shape, dtype), ("lse", lse, shape[:2], torch.float32)):
        if t is None:
            continue
        if t.device != device:
            _fail(op, arg, f"must be on {device}, got {t.device}")
        if t.dtype != want_dtype:
            _fail(op, arg, f"dtype {t.dtype} must be {want_dtype}")
        if tuple(t.shape) != tuple(want):
            _fail(op, arg, f"shape {list(t.shape)} must be {list(want)} (outputs are not resized)")


def _returned(out, lse, given_out, given_lse):
    """(out, lse) of an op call: the fresh results, or the given tensors holding them (out= without
    lse=: (out, None))."""
    if given_out is None:
        return out, lse
    given_out.copy_(out)
    if given_lse is not None:
        given_lse.copy_(lse)
    return given_out, given_lse


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """Write key/value [T, H, D] into their slots of the paged caches (quantizing for fp8)."""
    _check_slots("reshape_and_cache", slot_mapping, key.shape[0], key_cache)
    _write_slots(key_cache, _to_cache_dtype(key, key_cache.dtype, k_scale), slot_mapping)
    _write_slots(value_cache, _to_cache_dtype(value, value_cache.dtype, v_scale), slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *, scale=None,
                    window_left=-1, soft_cap=0.0, alibi_slopes=None, sinks=None, k_scale=None, v_scale=None,
                    causal=True, out=None, lse=None):
    """Attention of query [T, Hq, D] over each sequence's paged keys/values -> (out, lse); causal
    (bottom-right aligned) unless causal=False (written into out= / lse= when given)."""
    check_bool_arg("paged_attention", "causal", causal)
    num_tokens, num_heads, head_dim = query.shape
    given_out, given_lse = out, lse
    _check_given("paged_attention", out, lse, (num_tokens, num_heads, value_cache.shape[-1]), query.dtype,
                 query.device)
    num_kv_heads = key_cache.shape[2]
    if num_kv_heads == 0:
        _fail("paged_attention", "key_cache", "num_kv_heads (dimension 2) must be positive")
    if num_heads == 0 or num_heads % num_kv_heads:
        _fail("paged_attention", "query", f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
              f"({num_kv_heads})")
    group = num_heads // num_kv_heads  # query head h reads kv head h // group
    seq_lens_list = _check_paged("paged_attention", key_cache, block_tables, seq_lens)
    _check_queries("paged_attention", "query", num_tokens, query_start_loc, seq_lens_list)
    if scale is None:
        scale = head_dim ** -0.5

    if k_scale is not None and _is_fp8(key_cache.dtype):
        # A non-finite k_scale is NaN for the logits (docs/ops.md): every key it scales is NaN, so every
        # row that sees one is NaN, also under a soft cap (which maps +-inf logits to +-soft_cap).
        k_scale = torch.where(torch.isfinite(k_scale), k_scale, float("nan"))
    out = torch.zeros(num_tokens, num_heads, value_cache.shape[-1], dtype=torch.float64, device=query.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float64, device=query.device)
    for i, (start, end) in enumerate(_query_ranges(query_start_loc, len(seq_lens_list))):
        seq_len = seq_lens_list[i]
        k = _load64(_sequence_tokens(key_cache, block_tables[i], seq_len), k_scale)
        v = _load64(_sequence_tokens(value_cache, block_tables[i], seq_len), v_scale)
        k = k.repeat_interleave(group, dim=1).to(query.device)
        v = v.repeat_interleave(group, dim=1).to(query.device)
        q = query[start:end].to(torch.float64)
        out[start:end], lse[start:end] = _attend_one_sequence(
            q, k, v, scale, window_left, soft_cap, alibi_slopes, sinks, causal)
    out = _nan_rows_of_bad_scale(out, v_scale, value_cache.dtype, group)
    return _returned(out.to(query.dtype), lse.to(torch.float32), given_out, given_lse)


def merge_attention_states(out_a, lse_a, out_b, lse_b, *, out=None, lse=None):
    """Exact merge of two attention states over disjoint key sets -> (out, lse) (written into out= /
    lse= when given).

    A side whose lse is -inf or +inf saw no key (+inf: FlashAttention-2's mark of an empty row) and
    is not read, even if its out holds NaN; a NaN lse on either side makes the row NaN."""
    given_out, given_lse = out, lse
    _check_given("merge_attention_states", out, lse, tuple(out_a.shape), out_a.dtype, out_a.device)
    la, lb = lse_a.to(torch.float64), lse_b.to(torch.float64)
    read_a, read_b = ~torch.isinf(la), ~torch.isinf(lb)
    la = torch.where(read_a, la, float("-inf"))
    lb = torch.where(read_b, lb, float("-inf"))
    lse = torch.logaddexp(la, lb)
    # Both empty: use 0 so the weights are exp(-inf) = 0, never NaN.
    safe_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(la - safe_lse)[..., None]
    wb = torch.exp(lb - safe_lse)[..., None]
    # Masked by emptiness, not by weight: a finite-lse side whose weight underflows is still read.
    out = (torch.where(read_a[..., None], wa * out_a.to(torch.float64), 0.0)
           + torch.where(read_b[..., None], wb * out_b.to(torch.float64), 0.0))
    return _returned(out.to(out_a.dtype), lse.to(torch.float32), given_out, given_lse)


def copy_blocks(cache, block_mapping, *, block_dim=0) -> None:
    """cache.select(block_dim, dst) = cache.select(block_dim, src) for each (src, dst) row."""
    blocks = cache.shape[block_dim]
    pairs = _check_block_mapping("copy_blocks", block_mapping, blocks, blocks, same_tensor=True)
    # Destinations are never sources, so copying one pair at a time is order-independent.
    for src, dst in pairs:
        cache.select(block_dim, dst).copy_(cache.select(block_dim, src))


def swap_blocks(src, dst, block_mapping, *, block_dim=0) -> None:
    """dst.select(block_dim, d) = src.select(block_dim, s) for each (s, d) row, across devices."""
    # .tolist() works whether the mapping lives on the CPU or the GPU.
    pairs = _check_block_mapping("swap_blocks", block_mapping, src.shape[block_dim], dst.shape[block_dim],
                                 same_tensor=False)
    # src and dst may be the same memory: read every source block before writing any.
    blocks = [src.select(block_dim, s).clone() for s, _ in pairs]
    for (_, d), block in zip(pairs, blocks):
        dst.select(block_dim, d).copy_(block.to(dst.device))


def _gather_rows(cache, block_tables, seq_lens_list, scale, out_dtype):
    """Concatenate every sequence's cache rows (dequantized, cast to out_dtype), in order."""
    out = torch.empty(sum(seq_lens_list), *cache.shape[2:], dtype=out_dtype, device=cache.device)
    offset = 0
    for i, seq_len in enumerate(seq_lens_list):
        rows = _sequence_tokens(cache, block_tables[i], seq_len)
        out[offset:offset + seq_len] = dequantize(rows, scale).to(out_dtype)
        offset += seq_len
    return out


def gather_kv(key_cache, value_cache, block_tables, seq_lens, *, k_scale=None, v_scale=None, num_tokens=None,
              out_dtype=None):
    """Paged -> contiguous key/value [sum(seq_lens), H, D], sequences in order."""
    lens = _check_paged("gather_kv", key_cache, block_tables, seq_lens, num_tokens)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if _is_fp8(key_cache.dtype) else key_cache.dtype
    key = _gather_rows(key_cache, block_tables, lens, k_scale, out_dtype)
    value = _gather_rows(value_cache, block_tables, lens, v_scale, out_dtype)
    return key, value


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, *, scale=None) -> None:
    """Write rows [kv_c ; k_pe] into the MLA latent cache [N, B, R + P] (quantizing for fp8)."""
    _check_slots("concat_and_cache_mla", slot_mapping, kv_c.shape[0], kv_cache)
    rows = torch.cat([kv_c, k_pe], dim=-1)
    _write_slots(kv_cache, _to_cache_dtype(rows, kv_cache.dtype, scale), slot_mapping)


def _split_w_kv_b(w_kv_b, qk_nope_head_dim, v_head_dim):
    """w_kv_b [Hq*(dn+dv), R] -> W_k [Hq, dn, R], W_v [Hq, dv, R] (float64)."""
    per_head = qk_nope_head_dim + v_head_dim
    w = w_kv_b.to(torch.float64).reshape(-1, per_head, w_kv_b.shape[-1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def mla_decompress(kv_cache, block_tables, seq_lens, w_kv_b, *, kv_lora_rank, qk_nope_head_dim, v_head_dim,
                   norm_weight=None, norm_eps=1e-6, scale=None, num_tokens=None):
    """Latent cache -> per-head key [T, Hq, dn + P] and value [T, Hq, dv] (DeepSeek-V2 kv_b_proj)."""
    lens = _check_paged("mla_decompress", kv_cache, block_tables, seq_lens, num_tokens)
    rows = _gather_rows(kv_cache, block_tables, lens, scale, torch.float64)  # [T, R + P]
    latent, k_pe = rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
    if norm_weight is not None:
        # RMSNorm applies to the latent only; the rotary part is stored already final.
        rms = torch.rsqrt(latent.pow(2).mean(dim=-1, keepdim=True) + norm_eps)
        latent = latent * rms * norm_weight.to(latent.device, torch.float64)
    # docs/ops.md: the projection's input is the latent rounded to w_kv_b's dtype (as a model's
    # RMSNorm output is, and as a bf16 / fp16 GEMM takes it); products accumulate in float64 here.
    latent = latent.to(w_kv_b.dtype).to(torch.float64)

    w_k, w_v = _split_w_kv_b(w_kv_b.to(latent.device), qk_nope_head_dim, v_head_dim)
    k_nope = torch.einsum("hdr,tr->thd", w_k, latent)
    value = torch.einsum("hdr,tr->thd", w_v, latent)
    num_heads = w_k.shape[0]
    # k_pe is shared by all heads (a single rotary key per token).
    k_pe = k_pe[:, None, :].expand(-1, num_heads, -1)
    key = torch.cat([k_nope, k_pe], dim=-1)
    return key.to(w_kv_b.dtype), value.to(w_kv_b.dtype)


def mla_paged_attention(q, kv_cache, block_tables, seq_lens, *, kv_lora_rank, scale, query_start_loc=None,
                        kv_scale=None, out=None, lse=None):
    """Absorbed-weight MLA attention of q [T, Hq, R + P] over the latent cache -> (out [T, Hq, R], lse)
    (written into out= / lse= when given)."""
    num_tokens, num_heads, _ = q.shape
    given_out, given_lse = out, lse
    _check_given("mla_paged_attention", out, lse, (num_tokens, num_heads, kv_lora_rank), q.dtype, q.device)
    seq_lens_list = _check_paged("mla_paged_attention", kv_cache, block_tables, seq_lens)
    _check_queries("mla_paged_attention", "q", num_tokens, query_start_loc, seq_lens_list)
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=torch.float64, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float64, device=q.device)
    for i, (start, end) in enumerate(_query_ranges(query_start_loc, len(seq_lens_list))):
        seq_len = seq_lens_list[i]
        rows = _load64(_sequence_tokens(kv_cache, block_tables[i], seq_len), kv_scale).to(q.device)
        # One latent "kv head" shared by every query head: keys are full rows, values the latent.
        k = rows[:, None, :].expand(-1, num_heads, -1)
        v = rows[:, None, :kv_lora_rank].expand(-1, num_heads, -1)
        out[start:end], lse[start:end] = _attend_one_sequence(q[start:end].to(torch.float64), k, v, scale)
    out = _nan_rows_of_bad_scale(out, kv_scale, kv_cache.dtype, num_heads)
    return _returned(out.to(q.dtype), lse.to(torch.float32), given_out, given_lse)
