"""Random case builders and comparison helpers shared by the kvkernels tests.

Every builder takes a ``seed`` and uses its own ``torch.Generator``, so a failing case can be rebuilt
exactly from its test id. Paged caches are built the way a real block pool leaves them: block ids
shuffled and non-contiguous, a partial last block per sequence, junk (-1, 2**30) in block-table entries
past each sequence's length, and NaN in every cache slot that holds no token (unused blocks and the tail
of each partial block), so a kernel that reads a wrong block or a slot past ``seq_len`` produces NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

import kvkernels

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Half the relative spacing of the format (rounding to nearest) and half its smallest subnormal.
FP8_REL_ERR = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
FP8_MIN_SUBNORMAL = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}

JUNK_BLOCK_IDS = (-1, 2**30)  # what block-table entries past a sequence's length hold
STACKED_LAYERS = 2  # stacked caches are [L, 2, N, B, H, D]; tests use layer L - 1 (nonzero offset)

# (rtol, atol) of a kernel result against the float64 reference, by the result's dtype.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float64: (1e-10, 1e-10),
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


# ----------------------------------------------------------------------------------------------------
# devices: every correctness test of the cache ops runs on the CPU and, where there is one, on CUDA
# ----------------------------------------------------------------------------------------------------

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def has_kernel(op: str, device: str) -> bool:
    """Whether this build registered a kernel of ``torch.ops.kvkernels.<op>`` for ``device``."""
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}[torch.device(device).type]
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"kvkernels::{op}", key)


def cuda_only(*ops: str) -> list:
    """``pytestmark`` of a CUDA-only test module: skip without a CUDA device, or when this build has
    no CUDA kernel for one of ``ops`` (torch without CUDA, or built without nvcc)."""
    def registered() -> bool:
        try:
            return all(has_kernel(op, "cuda") for op in ops)
        except Exception:  # noqa: BLE001 - an older torch without the helper: let the tests find out
            return True
    cuda = torch.cuda.is_available()
    return [pytest.mark.skipif(not cuda, reason="needs a CUDA device (torch.cuda.is_available() is False)"),
            pytest.mark.skipif(cuda and not registered(),
                               reason="kvkernels was built without its CUDA kernels (torch without CUDA or no nvcc)")]


def force_cuda_plan(monkeypatch, op: str, kind: str | None, splits: int | None) -> None:
    """Force the CUDA planner of ``op`` ("ATTN" or "MLA") through KVKERNELS_CUDA_<op>_PATH / _SPLITS for
    one test; ``None`` leaves that choice to the planner (the variable is unset)."""
    for name, value in ((f"KVKERNELS_CUDA_{op}_PATH", kind), (f"KVKERNELS_CUDA_{op}_SPLITS", splits)):
        monkeypatch.delenv(name, raising=False)
        if value:
            monkeypatch.setenv(name, str(value))


def require_kernel(op: str, device: str) -> None:
    """Skip (with the reason) when ``op`` has no kernel for ``device`` in this build."""
    if not has_kernel(op, device):
        pytest.skip(f"kvkernels.{op} has no {torch.device(device).type.upper()} kernel in this build")


def to_device(t, device):
    """``t`` copied to ``device`` with its shape and strides (a transposed or sliced view stays one);
    the tensor itself when it is already there; anything else unchanged."""
    if not isinstance(t, torch.Tensor) or t.device == torch.device(device):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, gen: torch.Generator, dtype=torch.float32, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype)


# ----------------------------------------------------------------------------------------------------
# poisoning and byte-level comparison
# ----------------------------------------------------------------------------------------------------


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with NaN (float and fp8 dtypes) or -1 (integers); returns ``t``."""
    if t.dtype.is_floating_point:
        if is_fp8(t.dtype):
            t.view(torch.uint8).fill_(0x7F)  # NaN in both fp8 formats
        else:
            t.fill_(float("nan"))
    else:
        t.fill_(-1)
    return t


def unaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into the middle of wider rows (``[..., 2:2 + W]`` of NaN-filled ``W + 6``-wide
    rows): the same values with rows that are not 16-byte aligned, for the kernels' fallback from
    aligned (cp.async / 16-byte) loads. A read outside the view meets NaN."""
    width = t.shape[-1]
    wide = poison(torch.empty(*t.shape[:-1], width + 6, dtype=t.dtype, device=t.device))
    view = wide[..., 2:2 + width]
    if is_fp8(t.dtype):
        view.view(torch.uint8).copy_(t.view(torch.uint8))
    else:
        view.copy_(t)
    return view


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (NaN-safe exact comparison), shape [..., last * itemsize]."""
    t = t.detach().cpu().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = as_bytes(actual), as_bytes(expected)
    if not torch.equal(a, e):
        diff = (a != e).reshape(a.shape[0], -1).any(dim=-1).nonzero().flatten()
        raise AssertionError(
            f"{msg}: bytes differ in {diff.numel()} of {a.shape[0]} rows along dim 0, first: {diff[:8].tolist()}")


# ----------------------------------------------------------------------------------------------------
# numeric comparison
# ----------------------------------------------------------------------------------------------------


def fp8_tolerance(fp8_dtype: torch.dtype, scale: float | torch.Tensor = 1.0) -> tuple[float, float]:
    """(rtol, atol) of a value after one quantize/dequantize round trip with ``scale``."""
    scale = float(torch.as_tensor(scale, dtype=torch.float64).abs().max())
    return FP8_REL_ERR[fp8_dtype] * 1.001, FP8_MIN_SUBNORMAL[fp8_dtype] * scale


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *,
                 rtol: float | None = None, atol: float | None = None, scale=1.0, msg: str = "") -> None:
    """Compare a kernel result with the (float64) expected value.

    First NaN, +inf and -inf must sit at exactly the same positions; then the finite values must agree
    within the tolerance of ``dtype`` (default: ``actual.dtype``; an fp8 dtype means "one quantization
    round trip with ``scale``").
    """
    dtype = dtype or actual.dtype
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().cpu().to(torch.float64)
    e = expected.detach().cpu().to(torch.float64)
    for name, pred in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        pa, pe = pred(a), pred(e)
        if not torch.equal(pa, pe):
            where = (pa != pe).nonzero()[:5].tolist()
            raise AssertionError(f"{msg}: {name} positions differ ({int(pa.sum())} in actual, {int(pe.sum())} "
                                 f"expected), first mismatches at {where}")
    if is_fp8(dtype):
        d_rtol, d_atol = fp8_tolerance(dtype, scale)
    else:
        d_rtol, d_atol = TOLERANCES[dtype]
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    finite = torch.isfinite(e)
    torch.testing.assert_close(torch.where(finite, a, 0.0), torch.where(finite, e, 0.0), rtol=rtol, atol=atol,
                               msg=lambda m: f"{msg}: {m}")


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise distance of two tensors of one floating dtype in units in the last place of that dtype:
    how many representable values lie between them (+0 and -0 count as one value; NaN gives a
    meaningless number, so compare NaN positions first). int64, on the CPU."""
    assert actual.dtype == expected.dtype and actual.dtype.is_floating_point, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    magnitude = (1 << (8 * actual.element_size() - 1)) - 1

    def ordered(t: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits -> integers ordered like the values
        i = t.detach().cpu().contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & magnitude), i)

    return (ordered(actual) - ordered(expected)).abs()


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int, msg: str = "") -> None:
    """NaN at the same positions, every other element at most ``ulps`` units in the last place of the
    (common) dtype apart; infinities count as the value after the largest finite one."""
    a, e = actual.detach().cpu(), expected.detach().cpu()
    assert a.dtype == e.dtype, f"{msg}: dtype {a.dtype} != {e.dtype}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        raise AssertionError(f"{msg}: NaN positions differ, first at {(nan_a != nan_e).nonzero()[:5].tolist()}")
    dist = torch.where(nan_e, 0, ulp_distance(a, e))
    if dist.numel() and int(dist.max()) > ulps:
        where = (dist > ulps).nonzero()
        first = tuple(where[0].tolist())
        raise AssertionError(f"{msg}: {where.shape[0]} of {dist.numel()} elements more than {ulps} ulp apart "
                             f"(largest {int(dist.max())} ulp); first at {first}: {a[first].item()!r} vs "
                             f"{e[first].item()!r}")


def upcast(t):
    """float64 copy of a float tensor (fp8 tensors, integers and None are returned as they are)."""
    if t is None or not t.dtype.is_floating_point or is_fp8(t.dtype):
        return t
    return t.to(torch.float64)


# ----------------------------------------------------------------------------------------------------
# cache storage in the three layouts
# ----------------------------------------------------------------------------------------------------


def alloc_kv_cache(layout: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, head_dim_v: int | None = None) -> tuple[torch.Tensor, ...]:
    """NaN-filled storage for one layer's K/V cache; ``kv_views`` turns it into the kernel's views.

    NHD: two [N, B, H, D] tensors. HND: two [N, H, B, D] tensors (passed as ``.transpose(1, 2)``).
    stacked: one [L, 2, N, B, H, D] tensor (passed as ``kv[L - 1, 0]``, ``kv[L - 1, 1]``).
    ``head_dim_v`` (default ``head_dim``): the value cache's head dim; stacked storage is then
    max(D, Dv) wide and each view a slice ``[..., :D]`` / ``[..., :Dv]`` of it.
    """
    n, b, h, d = num_blocks, block_size, num_kv_heads, head_dim
    dv = head_dim if head_dim_v is None else head_dim_v
    if layout == "NHD":
        storage = (torch.empty(n, b, h, d, dtype=dtype), torch.empty(n, b, h, dv, dtype=dtype))
    elif layout == "HND":
        storage = (torch.empty(n, h, b, d, dtype=dtype), torch.empty(n, h, b, dv, dtype=dtype))
    elif layout == "stacked":
        storage = (torch.empty(STACKED_LAYERS, 2, n, b, h, max(d, dv), dtype=dtype),)
    else:
        raise ValueError(layout)
    for t in storage:
        poison(t)
    return storage


def kv_views(storage: tuple[torch.Tensor, ...], layout: str, head_dims: tuple[int, int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache) views [N, B, H, D] of storage made by ``alloc_kv_cache``; stacked
    storage with ``head_dims`` (D, Dv) gives the views ``[..., :D]`` and ``[..., :Dv]``."""
    if layout == "NHD":
        return storage[0], storage[1]
    if layout == "HND":
        return storage[0].transpose(1, 2), storage[1].transpose(1, 2)
    kv = storage[0]
    d, dv = head_dims or (kv.shape[-1], kv.shape[-1])
    return kv[STACKED_LAYERS - 1, 0, ..., :d], kv[STACKED_LAYERS - 1, 1, ..., :dv]


def clone_storage(storage):
    return tuple(t.clone() for t in storage)


# ----------------------------------------------------------------------------------------------------
# block tables and slots
# ----------------------------------------------------------------------------------------------------


def make_block_tables(seq_lens, block_size: int, gen: torch.Generator, *, extra_blocks: int = 3,
                      extra_cols: int = 2):
    """Shuffled block ids for each sequence, junk past each sequence's blocks.

    Returns (block_tables int32 [S, width], num_blocks, blocks: list of per-sequence id lists). The pool
    has ``extra_blocks`` blocks that no sequence uses.
    """
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need, default=0) + extra_cols
    table = torch.empty(len(seq_lens), width, dtype=torch.int32)
    blocks, start = [], 0
    for i, k in enumerate(need):
        ids = perm[start:start + k]
        start += k
        blocks.append(ids)
        for j in range(width):
            table[i, j] = ids[j] if j < k else JUNK_BLOCK_IDS[(i + j) % 2]
    return table, num_blocks, blocks


def token_slots(blocks: list[int], seq_len: int, block_size: int) -> torch.Tensor:
    """int64 slots of tokens 0..seq_len-1 of a sequence stored in ``blocks``."""
    pos = torch.arange(seq_len)
    ids = torch.tensor(blocks, dtype=torch.int64)[pos // block_size] if seq_len else pos
    return ids * block_size + pos % block_size


def query_start_loc(q_lens) -> torch.Tensor:
    return torch.tensor([0] + list(q_lens), dtype=torch.int64).cumsum(0).to(torch.int32)


# ----------------------------------------------------------------------------------------------------
# fp8 scales and quantization (mirrors docs/ops.md; the tests also check the rule independently)
# ----------------------------------------------------------------------------------------------------


def make_scale(num_kv_heads: int, per_head: bool, gen: torch.Generator) -> torch.Tensor:
    n = num_kv_heads if per_head else 1
    return (0.01 + 0.04 * torch.rand(n, generator=gen)).to(torch.float32)


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(float32(x) / scale, -M, M)); ``scale`` has 1 or x.shape[-2] elements."""
    s = scale.to(torch.float32).reshape(()) if scale.numel() == 1 else scale.to(torch.float32).reshape(-1, 1)
    m = FP8_MAX[fp8_dtype]
    return (x.to(torch.float32) / s).clamp(-m, m).to(fp8_dtype)


def dequantize64(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if not is_fp8(stored.dtype):
        return stored.to(torch.float64)
    s = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)
    return (stored.to(torch.float32) * s).to(torch.float64)


# ----------------------------------------------------------------------------------------------------
# a filled paged K/V cache
# ----------------------------------------------------------------------------------------------------


@dataclass
class PagedKV:
    layout: str
    storage: tuple
    key_cache: torch.Tensor  # [N, B, H, D] view handed to the kernel
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, width]
    seq_lens: torch.Tensor  # int32 [S]
    blocks: list  # per-sequence block ids
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    keys: list = field(default_factory=list)  # per sequence float64 [seq_len, H, D], dequantized stored values
    values: list = field(default_factory=list)

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    def ref_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Caches for the reference: float64 copies, or the fp8 caches themselves."""
        return upcast(self.key_cache), upcast(self.value_cache)

    def to(self, device) -> "PagedKV":
        """The same cache on ``device``: storage copied whole, so the views keep their layout and
        offsets; index tensors and scales moved too. ``keys``/``values`` (the truth) stay on the CPU."""
        if torch.device(device) == self.key_cache.device:
            return self
        storage = tuple(t.to(device) for t in self.storage)
        key_cache, value_cache = kv_views(storage, self.layout,
                                          (self.key_cache.shape[-1], self.value_cache.shape[-1]))
        return PagedKV(self.layout, storage, key_cache, value_cache, self.block_tables.to(device),
                       self.seq_lens.to(device), self.blocks, to_device(self.k_scale, device),
                       to_device(self.v_scale, device), self.keys, self.values)


def make_paged_kv(num_seqs: int | None = None, seq_lens=(), num_kv_heads: int = 2, head_dim: int = 64,
                  block_size: int = 16, dtype: torch.dtype = torch.float32, layout: str = "NHD",
                  fp8: str | None = None, per_head_scale: bool | tuple = False, seed: int = 0,
                  extra_blocks: int = 3, extra_cols: int = 2, head_dim_v: int | None = None) -> PagedKV:
    """A paged K/V cache holding ``seq_lens[i]`` random tokens for each sequence.

    ``head_dim_v`` (default ``head_dim``): the value cache's own head dim.

    ``dtype`` is the float dtype of the data; with ``fp8`` ('e4m3' | 'e5m2') the cache stores it
    quantized with random per-tensor or per-head scales (``per_head_scale``: one flag for both, or a
    (k, v) pair of flags). Slots holding no token are NaN.
    """
    seq_lens = list(seq_lens)
    assert num_seqs is None or num_seqs == len(seq_lens)
    gen = generator(seed)
    table, num_blocks, blocks = make_block_tables(seq_lens, block_size, gen, extra_blocks=extra_blocks,
                                                  extra_cols=extra_cols)
    cache_dtype = FP8_DTYPES[fp8] if fp8 else dtype
    dv = head_dim if head_dim_v is None else head_dim_v
    storage = alloc_kv_cache(layout, num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, dv)
    key_cache, value_cache = kv_views(storage, layout, (head_dim, dv))
    k_per_head, v_per_head = per_head_scale if isinstance(per_head_scale, tuple) else (per_head_scale,) * 2
    k_scale = make_scale(num_kv_heads, k_per_head, gen) if fp8 else None
    v_scale = make_scale(num_kv_heads, v_per_head, gen) if fp8 else None
    kv = PagedKV(layout, storage, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32),
                 blocks, k_scale, v_scale)
    for i, n in enumerate(seq_lens):
        slots = token_slots(blocks[i], n, block_size)
        for cache, scale, truth in ((key_cache, k_scale, kv.keys), (value_cache, v_scale, kv.values)):
            x = randn(n, num_kv_heads, cache.shape[-1], gen=gen, dtype=dtype)
            stored = quantize(x, scale, cache_dtype) if fp8 else x
            cache[slots // block_size, slots % block_size] = stored  # writes through the view
            truth.append(dequantize64(stored, scale))
    return kv


# ----------------------------------------------------------------------------------------------------
# queries
# ----------------------------------------------------------------------------------------------------


def make_query(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator, *,
               strided: str | None = None, std: float = 1.0) -> torch.Tensor:
    """Random query [T, Hq, D]; ``strided``: None (contiguous), 'fused' (a slice of a fused QKV
    projection output [T, 3*Hq, D + 8]) or 'transposed' (an [Hq, T, D] allocation transposed)."""
    x = randn(num_tokens, num_heads, head_dim, gen=gen, dtype=torch.float64, std=std).to(dtype)
    if strided is None:
        return x
    if strided == "fused":
        base = poison(torch.empty(num_tokens, 3 * num_heads, head_dim + 8, dtype=dtype))
        view = base[:, num_heads:2 * num_heads, 4:4 + head_dim]
    elif strided == "transposed":
        view = poison(torch.empty(num_heads, num_tokens, head_dim, dtype=dtype)).transpose(0, 1)
    else:
        raise ValueError(strided)
    view.copy_(x)
    return view


# ----------------------------------------------------------------------------------------------------
# MLA latent caches
# ----------------------------------------------------------------------------------------------------


@dataclass
class PagedMLA:
    kv_cache: torch.Tensor  # [N, B, R + P]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    blocks: list
    kv_lora_rank: int
    scale: torch.Tensor | None = None
    rows: list = field(default_factory=list)  # per sequence float64 [seq_len, R + P], dequantized

    def ref_cache(self) -> torch.Tensor:
        return upcast(self.kv_cache)


def make_paged_mla(seq_lens, kv_lora_rank: int, rope_dim: int, block_size: int = 16,
                   dtype: torch.dtype = torch.float32, fp8: str | None = None, seed: int = 0,
                   strided: bool = False) -> PagedMLA:
    """A latent cache [N, B, R + P] with ``seq_lens[i]`` random rows per sequence (NaN elsewhere).

    ``strided``: the cache is a slice [..., :R + P] of a wider allocation (row stride > R + P).
    """
    seq_lens = list(seq_lens)
    gen = generator(seed)
    table, num_blocks, blocks = make_block_tables(seq_lens, block_size, gen)
    width = kv_lora_rank + rope_dim
    cache_dtype = FP8_DTYPES[fp8] if fp8 else dtype
    alloc = poison(torch.empty(num_blocks, block_size, width + (16 if strided else 0), dtype=cache_dtype))
    cache = alloc[..., :width]
    scale = make_scale(1, False, gen) if fp8 else None
    mla = PagedMLA(cache, table, torch.tensor(seq_lens, dtype=torch.int32), blocks, kv_lora_rank, scale)
    for i, n in enumerate(seq_lens):
        slots = token_slots(blocks[i], n, block_size)
        x = randn(n, width, gen=gen, dtype=dtype)
        stored = quantize(x, scale, cache_dtype) if fp8 else x
        cache[slots // block_size, slots % block_size] = stored
        mla.rows.append(dequantize64(stored, scale))
    return mla


# ----------------------------------------------------------------------------------------------------
# float64 attention over dense keys (an oracle independent of the paged addressing)
# ----------------------------------------------------------------------------------------------------


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Bottom-right causal attention of q [q_len, H, Dk] over k [S, H, Dk], v [S, H, Dv] in float64.

    Returns out [q_len, H, Dv] (0 where no key is visible) and lse [q_len, H] (-inf there).
    """
    q, k, v = q.double(), k.double(), v.double()
    q_len, s = q.shape[0], k.shape[0]
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos = torch.arange(q_len)[:, None] + (s - q_len)
    logits = logits.masked_fill(torch.arange(s)[None, :] > pos, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.einsum("hqk,khd->qhd", weights, v), lse.transpose(0, 1)


def use_isa(monkeypatch, name):
    """Forces the CPU SIMD path ``name`` (KVKERNELS_CPU_ISA, read on every op call) for one test; a CPU
    without its instructions skips the test with the reason instead of silently passing it."""
    monkeypatch.setenv("KVKERNELS_CPU_ISA", name)
    try:
        assert kvkernels.cpu_isa() == name
    except RuntimeError as e:
        pytest.skip(f"this CPU cannot run the {name} path: {e}")
    return name
