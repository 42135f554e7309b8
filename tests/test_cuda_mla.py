"""The CUDA MLA kernels (csrc/cuda/mla_*: mla_decompress, mla_paged_attention) against the float64 reference.

mla_paged_attention runs on every kernel the planner can pick, forced through KVKERNELS_CUDA_MLA_PATH
(``auto``: tensor cores for fp16 / bf16 q, CUDA cores for float32; ``simt``; ``mma16`` / ``mma64``: the
16- and 64-row tensor-core kernels) and with forced KV splits (KVKERNELS_CUDA_MLA_SPLITS, which exercises
the float32 partials and the merge kernel on small cases): DeepSeek shapes (R 512 + rope 64, 16 / 128
heads, block 64), block sizes 1 .. 256, rope widths that are not multiples of 8 (unaligned rows), fp8
latent caches with a per-tensor scale, decode and causal varlen prefill, empty sequences, an empty batch,
long contexts that the planner splits, and a CUDA-graph capture replayed with new lengths. mla_decompress
runs the cases of test_mla.py and more (many heads, block size 1, odd head dims, norm on / off, fp8,
num_tokens given or not, zero tokens) and, on sm_90 devices, its TMA weight pipeline against the cp.async
one (KVKERNELS_CUDA_TMA=require / KVKERNELS_CUDA_NO_TMA=1: partial token, row and column tiles, R 512 and
200, fp8, norm on / off; both against the reference and bit-identical to each other). Both decompress
kernels (KVKERNELS_CUDA_DECOMPRESS=persist64 / persist128, the persist kernel's two token tiles, and tile64)
run those cases, and the persist kernel is bit-identical to tile64 on DeepSeek shapes (several column tiles per CTA), odd dims and fp8; tokens past
sum(seq_lens) are zeros; an unknown variant raises. On 9.x devices the opt-in sm_90a wgmma kernel
(KVKERNELS_CUDA_DECOMPRESS=wgmma) runs the 16-bit cases, persist's cases and many tokens against the
reference, and refuses an unaligned w_kv_b with the reason (test_mla_decompress_wgmma*). Then: the absorbed
formulation equals decompress-then-attend on CUDA, opcheck on CUDA tensors, bad input raises an error
naming the argument, debug-mode index checks.

Caches keep their layout on the device (the whole storage is copied, NaN in unused slots included). The
outputs are allocated by the op: before each call the CUDA caching allocator is handed NaN-filled blocks
(best effort), and the comparison requires NaN / inf exactly where the reference has them, so a row the
kernel never wrote shows up as a mismatch.

Every test skips, with the reason, without a CUDA device or without the CUDA kernels in the build. These
tests have not run on a GPU yet (the development machine has none): the kernels are compiled, not run.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (TOLERANCES, assert_bytes_equal, assert_close, cuda_only, dense_attention, force_cuda_plan, generator,
                     make_paged_mla, make_query, query_start_loc, randn, unaligned_copy, upcast)
from kvkernels import ops, reference
from test_cuda_attention import like_on, opt_on, poison_allocator
from test_mla import DECOMPRESS_CASES, make_mla_case, random_weight, varlen_q_lens

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


pytestmark = cuda_only("mla_decompress", "mla_paged_attention")

DEV = "cuda"
# (path, splits) for KVKERNELS_CUDA_MLA_PATH / KVKERNELS_CUDA_MLA_SPLITS.
PATHS = {"auto": (None, None), "simt": ("simt", None), "mma16": ("mma16", None), "mma64": ("mma64", None),
         "auto-split5": (None, 5), "simt-split5": ("simt", 5), "mma64-split3": ("mma64", 3)}


def _smem_optin() -> int:
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "shared_memory_per_block_optin", 0))


@pytest.fixture(params=list(PATHS), ids=list(PATHS))
def path(request, monkeypatch):
    kind, splits = PATHS[request.param]
    if kind == "mma64" and 0 < _smem_optin() < 160 * 1024:
        pytest.skip(f"the 64-row tensor-core MLA kernel needs ~158 KiB of shared memory per block; this device "
                    f"allows {_smem_optin()} bytes")
    force_cuda_plan(monkeypatch, "MLA", kind, splits)
    return request.param


def run_attention(mla, q, qsl, scale):
    """The CUDA kernel vs the float64 reference (on the CPU copies); returns (out, lse) on the CPU."""
    t, h, _ = q.shape
    r = mla.kv_lora_rank
    poison_allocator(8 * t * h * r * 4)
    out, lse = ops.mla_paged_attention(like_on(q), like_on(mla.kv_cache), mla.block_tables.to(DEV),
                                       mla.seq_lens.to(DEV), kv_lora_rank=r, scale=scale,
                                       query_start_loc=opt_on(qsl), kv_scale=opt_on(mla.scale))
    torch.cuda.synchronize()
    assert out.device.type == DEV and lse.device.type == DEV
    assert out.dtype == q.dtype and out.shape == (t, h, r) and out.is_contiguous()
    assert lse.dtype == f32 and lse.shape == (t, h) and lse.is_contiguous()
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables, mla.seq_lens,
                                                     kv_lora_rank=r, scale=scale, query_start_loc=qsl,
                                                     kv_scale=mla.scale)
    out, lse = out.cpu(), lse.cpu()
    assert_close(out, ref_out, q.dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    return out, lse


# ----------------------------------------------------------------------------------------------------
# mla_paged_attention
# ----------------------------------------------------------------------------------------------------

# id: q dtype, cache fp8, R, P, heads, block size, strided q
ATTN_CASES = {
    "bf16-R512-P64-H16-b64": (bf16, None, 512, 64, 16, 64, None),
    "bf16-R512-P64-H128-b64": (bf16, None, 512, 64, 128, 64, None),
    "f16-R512-P64-H64-b16-transposed": (f16, None, 512, 64, 64, 16, "transposed"),
    "f32-R512-P64-H8-b16-fused": (f32, None, 512, 64, 8, 16, "fused"),
    "e4m3-bf16-R512-P64-H16-b64": (bf16, "e4m3", 512, 64, 16, 64, None),
    "e5m2-f16-R64-P16-H4-b1": (f16, "e5m2", 64, 16, 4, 1, None),
    "e4m3-f32-R64-P16-H4-b3": (f32, "e4m3", 64, 16, 4, 3, None),
    "bf16-R128-P3-H20-b7": (bf16, None, 128, 3, 20, 7, None),
    "f32-R64-P0-H2-b128": (f32, None, 64, 0, 2, 128, None),
    "f16-R72-P8-H5-b256": (f16, None, 72, 8, 5, 256, "fused"),
}


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("case", ATTN_CASES.values(), ids=ATTN_CASES.keys())
def test_mla_paged_attention(case, mode, path):
    dtype, fp8, r, p, h, b, strided = case
    seq_lens = [b + 1, 0, 2 * b + 5, 1, b, 300]
    mla, q, qsl = make_mla_case(mode, seq_lens, dtype, fp8, r, p, h, b, strided)
    out, lse = run_attention(mla, q, qsl, (128 + p) ** -0.5)
    if mode == "decode":  # the empty sequence: out = 0, lse = -inf
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


# Both consumer schedules of the wgmma decode, in step (wgmma) and the seesaw (wgmma-seesaw), each with the
# shape-only split plan and with the metadata pass's (+metadata: KVKERNELS_CUDA_MLA_SCHED=metadata, the decode and
# the merge by programmatic dependent launch).
@pytest.fixture(params=["wgmma", "wgmma-seesaw", "wgmma+metadata", "wgmma-seesaw+metadata"])
def wgmma_path(request):
    return request.param


def use_mla_wgmma(monkeypatch, path, splits=None):
    """The sm_90a wgmma decode (csrc/cuda/mla_attention_sm90.cuh; `path`: KVKERNELS_CUDA_MLA_PATH, wgmma or
    wgmma-seesaw, +metadata for KVKERNELS_CUDA_MLA_SCHED=metadata, where `splits` is the CTAs per head chunk) with
    KVKERNELS_CUDA_WGMMA=require: a planner fallback fails the test instead of running the mma.sync kernels;
    skipped off sm_90 devices."""
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip(f"the wgmma MLA decode is sm_90a only; this device is sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}")
    path, _, sched = path.partition("+")
    force_cuda_plan(monkeypatch, "MLA", path, splits)
    monkeypatch.setenv("KVKERNELS_CUDA_WGMMA", "require")
    if sched:
        monkeypatch.setenv("KVKERNELS_CUDA_MLA_SCHED", sched)
    else:
        monkeypatch.delenv("KVKERNELS_CUDA_MLA_SCHED", raising=False)


WGMMA_CASES = {name: case for name, case in ATTN_CASES.items() if case[0] != f32}


@pytest.mark.parametrize("splits", [None, 3], ids=["planned", "split3"])
@pytest.mark.parametrize("case", WGMMA_CASES.values(), ids=WGMMA_CASES.keys())
def test_mla_wgmma_decode(case, splits, wgmma_path, monkeypatch):
    """The ATTN_CASES with 16-bit q, decode, on the wgmma kernel: every block size, fp8, head chunks, the
    stage ring wrapping many times (4097 keys), an empty sequence."""
    use_mla_wgmma(monkeypatch, wgmma_path, splits)
    dtype, fp8, r, p, h, b, strided = case
    seq_lens = [b + 1, 0, 2 * b + 5, 1, b, 300, 4097]
    mla, q, _ = make_mla_case("decode", seq_lens, dtype, fp8, r, p, h, b, strided)
    out, lse = run_attention(mla, q, None, (128 + p) ** -0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("splits", [None, 128], ids=["planned", "128"])
@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_mla_wgmma_long_context(fp8, splits, wgmma_path, monkeypatch):
    use_mla_wgmma(monkeypatch, wgmma_path, splits)
    mla = make_paged_mla([5000, 1, 2049], 512, 64, 64, dtype=bf16, fp8=fp8, seed=41)
    run_attention(mla, make_query(3, 128, 576, bf16, generator(42)), None, 192 ** -0.5)


def test_mla_wgmma_nonfinite(wgmma_path, monkeypatch):
    """inf in a value column, NaN in a rope column (their rows NaN / inf as the reference), NaN in unused slots."""
    use_mla_wgmma(monkeypatch, wgmma_path)
    seq_lens, b = [70, 5, 200], 16
    mla, q, _ = make_mla_case("decode", seq_lens, bf16, None, 512, 64, 16, b, seed=65)
    from helpers import token_slots
    s = int(token_slots(mla.blocks[0], seq_lens[0], b)[45])
    mla.kv_cache[s // b, s % b, 7] = float("inf")
    s = int(token_slots(mla.blocks[2], seq_lens[2], b)[150])
    mla.kv_cache[s // b, s % b, 512 + 3] = float("nan")
    run_attention(mla, q, None, 0.1)


@pytest.mark.parametrize("splits", [None, 3], ids=["planned", "split3"])
@pytest.mark.parametrize("schedule", ["wgmma", "wgmma-seesaw"])
@pytest.mark.parametrize("case", WGMMA_CASES.values(), ids=WGMMA_CASES.keys())
def test_mla_wgmma_prefill(case, schedule, splits, monkeypatch):
    """Varlen prefill on the wgmma kernel (the shape-only plan; the metadata one is decode only): full and chunked
    prefill (at most 64 queries each), one query, none; at fewer than 64 heads a CTA holds several tokens whose
    causal limits differ."""
    use_mla_wgmma(monkeypatch, schedule, splits)
    dtype, fp8, r, p, h, b, strided = case
    seq_lens = [b + 1, 0, 2 * b + 5, 1, b, 300]
    q_lens = [min(n, 64) for n in varlen_q_lens(seq_lens)]
    mla, q, qsl = make_mla_case("varlen", seq_lens, dtype, fp8, r, p, h, b, strided, q_lens=q_lens)
    run_attention(mla, q, qsl, (128 + p) ** -0.5)


@pytest.mark.parametrize("schedule", ["wgmma", "wgmma-seesaw"])
def test_mla_wgmma_prefill_nonfinite(schedule, monkeypatch):
    """inf in a value column on the prefill diagonal (16 heads: 4 tokens per CTA; the rows before key 45 must not
    see it: the non-finite fix-up), NaN in a rope column, NaN in unused slots."""
    use_mla_wgmma(monkeypatch, schedule)
    seq_lens, b = [70, 5, 200], 16
    mla, q, qsl = make_mla_case("varlen", seq_lens, bf16, None, 512, 64, 16, b, seed=65, q_lens=[40, 5, 64])
    from helpers import token_slots
    s = int(token_slots(mla.blocks[0], seq_lens[0], b)[45])
    mla.kv_cache[s // b, s % b, 7] = float("inf")
    s = int(token_slots(mla.blocks[2], seq_lens[2], b)[150])
    mla.kv_cache[s // b, s % b, 512 + 3] = float("nan")
    out, _ = run_attention(mla, q, qsl, 0.1)
    assert out[:15, :, 7].isfinite().all()  # queries at positions 30..44 do not see key 45


@pytest.mark.parametrize("parts", [None, 3, 200], ids=["planned", "3", "200"])
@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_mla_wgmma_metadata_mixed_lengths(fp8, parts, monkeypatch):
    """The metadata plan on a batch mixing a 32k sequence with one-key, 1k and empty ones (shuffled blocks): the long
    one split over many CTAs, short ones sharing a CTA, empty ones out 0 / lse -inf; the planned CTA count (SMs /
    head chunks), 3, and 200 (more CTAs than work)."""
    seq_lens = [32768, 1, 0, 1024, 1, 0, 1024, 65, 1024, 1]
    use_mla_wgmma(monkeypatch, "wgmma+metadata", parts)
    mla, q, _ = make_mla_case("decode", seq_lens, bf16, fp8, 512, 64, 16, 64, seed=74)
    out, lse = run_attention(mla, q, None, 0.05)
    for s in (2, 5):
        assert torch.equal(out[s], torch.zeros_like(out[s])) and torch.isneginf(lse[s]).all()


@pytest.mark.parametrize("splits", [None, 1, 16, 128], ids=["planned", "1", "16", "128"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f32, None), (bf16, "e4m3")], ids=["bf16", "f32", "e4m3"])
def test_long_context(dtype, fp8, mode, splits, monkeypatch):
    """Thousands of keys over few sequences: the planner splits them (3 sequences x 1 head chunk leave any
    GPU idle); forced counts cover no split, many, and more splits than the short sequence has tiles."""
    monkeypatch.delenv("KVKERNELS_CUDA_MLA_PATH", raising=False)
    monkeypatch.delenv("KVKERNELS_CUDA_MLA_SPLITS", raising=False)
    if splits:
        monkeypatch.setenv("KVKERNELS_CUDA_MLA_SPLITS", str(splits))
    seq_lens = [5000, 1, 2049]
    mla = make_paged_mla(seq_lens, 512, 64, 64, dtype=dtype, fp8=fp8, seed=41)
    q_lens = [1, 1, 1] if mode == "decode" else [min(n, 40) for n in seq_lens]
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    q = make_query(sum(q_lens), 16, 576, dtype, generator(42))
    run_attention(mla, q, qsl, 192 ** -0.5)


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_empty_sequences_and_batch(mode, dtype, path):
    seq_lens = [0, 5, 0, 33]
    mla, q, qsl = make_mla_case(mode, seq_lens, dtype, None, 64, 16, 4, 16, seed=5)
    out, lse = run_attention(mla, q, qsl, 0.1)
    if mode == "decode":
        for row in (0, 2):
            assert torch.equal(out[row], torch.zeros(4, 64, dtype=dtype))
            assert torch.isneginf(lse[row]).all()
    # An empty batch, and a varlen batch whose sequences have no queries: nothing to launch.
    table = torch.zeros(0, 3, dtype=torch.int32, device=DEV)
    lens = torch.zeros(0, dtype=torch.int32, device=DEV)
    q0 = torch.randn(0, 4, 80, device=DEV).to(dtype)
    qsl0 = None if mode == "decode" else torch.zeros(1, dtype=torch.int32, device=DEV)
    out, lse = ops.mla_paged_attention(q0, like_on(mla.kv_cache), table, lens, kv_lora_rank=64, scale=0.1,
                                       query_start_loc=qsl0)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f16, None), (bf16, "e4m3"), (f16, "e5m2")])
def test_tensor_core_and_simt_agree(dtype, fp8, mode, monkeypatch):
    """The tensor-core (16- and 64-row) and CUDA-core kernels on the same inputs agree to the q dtype's
    tolerance."""
    mla, q, qsl = make_mla_case(mode, [300, 64, 1, 129], dtype, fp8, 512, 64, 32, 64, seed=37)
    args = (like_on(q), like_on(mla.kv_cache), mla.block_tables.to(DEV), mla.seq_lens.to(DEV))
    kw = dict(kv_lora_rank=512, scale=0.07, query_start_loc=opt_on(qsl), kv_scale=opt_on(mla.scale))
    monkeypatch.setenv("KVKERNELS_CUDA_MLA_PATH", "simt")
    out_s, lse_s = ops.mla_paged_attention(*args, **kw)
    rtol, atol = TOLERANCES[dtype]
    kinds = ["mma16"] + (["mma64"] if _smem_optin() >= 160 * 1024 else [])
    for kind in kinds:
        monkeypatch.setenv("KVKERNELS_CUDA_MLA_PATH", kind)
        out_tc, lse_tc = ops.mla_paged_attention(*args, **kw)
        assert_close(out_tc.cpu(), out_s.cpu().double(), dtype, rtol=2 * rtol, atol=2 * atol, msg=f"{kind} out")
        assert_close(lse_tc.cpu(), lse_s.cpu().double(), f32, rtol=1e-4, atol=1e-4, msg=f"{kind} lse")


def test_splits_are_exact(monkeypatch):
    """float32 (CUDA cores, float32 math): 1 split vs many splits differ only by float32 rounding."""
    mla = make_paged_mla([5000, 3000, 17], 512, 64, 64, dtype=f32, seed=43)
    q = make_query(3, 8, 576, f32, generator(44))
    args = (like_on(q), like_on(mla.kv_cache), mla.block_tables.to(DEV), mla.seq_lens.to(DEV))
    results = []
    for splits in (1, 3, 64):
        monkeypatch.setenv("KVKERNELS_CUDA_MLA_SPLITS", str(splits))
        results.append([x.cpu() for x in ops.mla_paged_attention(*args, kv_lora_rank=512, scale=0.05)])
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f32, "e4m3")], ids=["bf16", "e4m3-f32"])
def test_unaligned_cache_rows(dtype, fp8, path):
    """A latent cache whose rows are not 16-byte aligned (a [..., 2:2+W] slice of wider rows) takes the
    plain-load fallback instead of cp.async."""
    r, p = 64, 16
    mla, q, qsl = make_mla_case("decode", [40, 9, 0, 16], dtype, fp8, r, p, 8, 16, seed=29)
    mla.kv_cache = unaligned_copy(mla.kv_cache)
    run_attention(mla, q, qsl, 0.1)


# ----------------------------------------------------------------------------------------------------
# mla_decompress
# ----------------------------------------------------------------------------------------------------

# id: w dtype, cache fp8, R, P, heads, dn, dv, RMSNorm, block size, pass num_tokens (test_mla.py's + more)
DECOMPRESS_CUDA_CASES = dict(DECOMPRESS_CASES, **{
    "bf16-R512-P64-H16-d128-norm-b64": (bf16, None, 512, 64, 16, 128, 128, True, 64, False),
    "f16-R64-P3-H3-dn5-dv7-b1": (f16, None, 64, 3, 3, 5, 7, False, 1, True),
    "e4m3-bf16-R512-P64-H8-norm-b64-num_tokens": (bf16, "e4m3", 512, 64, 8, 128, 128, True, 64, True),
    "f32-R72-P8-H2-b5": (f32, None, 72, 8, 2, 16, 16, False, 5, False),
    "f32-R512-P64-H40-norm-b128": (f32, None, 512, 64, 40, 24, 40, True, 128, True),
})


DECOMPRESS_VARIANTS = ("persist64", "persist128", "tile64")


@pytest.fixture(params=DECOMPRESS_VARIANTS)
def variant(request, monkeypatch):
    """KVKERNELS_CUDA_DECOMPRESS=<variant>: the persist kernel with 64- or 128-row token tiles (the default,
    "persist", picks one by the device's shared memory; float32 weights run tile64's CUDA-core kernel under
    every value) or the tile64 kernel with its default weight pipeline (TMA on sm_90 where
    eligible, else cp.async; the TMA tests below force each)."""
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", request.param)
    return request.param


def run_decompress(case, seq_lens, seed=2):
    dtype, fp8, r, p, h, dn, dv, norm, b, with_num_tokens = case
    gen = generator(seed)
    mla = make_paged_mla(seq_lens, r, p, b, dtype=dtype, fp8=fp8, seed=seed + 1, strided=(b == 3))
    w = random_weight(h * (dn + dv), r, dtype, gen)
    norm_weight = (1 + 0.5 * randn(r, gen=gen)).to(dtype) if norm else None
    kwargs = dict(kv_lora_rank=r, qk_nope_head_dim=dn, v_head_dim=dv, norm_eps=1e-5)
    t = sum(seq_lens)
    poison_allocator(4 * t * h * (dn + p + dv) * 4)
    key, value = ops.mla_decompress(like_on(mla.kv_cache), mla.block_tables.to(DEV), mla.seq_lens.to(DEV),
                                    w.to(DEV), norm_weight=opt_on(norm_weight), scale=opt_on(mla.scale),
                                    num_tokens=t if with_num_tokens else None, **kwargs)
    torch.cuda.synchronize()
    assert key.device.type == DEV and value.device.type == DEV
    assert key.dtype == value.dtype == dtype
    assert key.shape == (t, h, dn + p) and value.shape == (t, h, dv)
    assert key.is_contiguous() and value.is_contiguous()
    key, value = key.cpu(), value.cpu()
    ref_key, ref_value = reference.mla_decompress(mla.ref_cache(), mla.block_tables, mla.seq_lens, w,
                                                  norm_weight=upcast(norm_weight), scale=mla.scale, **kwargs)
    assert_close(key, ref_key, dtype, msg="key")
    assert_close(value, ref_value, dtype, msg="value")
    if t:
        # k_pe is copied into every head unchanged (dequantized and rounded once for fp8 caches).
        k_pe = torch.cat(mla.rows)[:, None, r:].expand(-1, h, -1).to(dtype)
        assert_bytes_equal(key[..., dn:], k_pe, msg="k_pe part of key")
    return key, value


@pytest.mark.parametrize("case", DECOMPRESS_CUDA_CASES.values(), ids=DECOMPRESS_CUDA_CASES.keys())
def test_mla_decompress(case, variant):
    run_decompress(case, [5, 0, 70, 1, case[8], 200])


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_mla_decompress_many_tokens(dtype, variant):
    """More token tiles than one wave, sequences spanning many blocks, a partial last tile."""
    run_decompress((dtype, None, 512, 64, 4, 64, 64, True, 64, True), [3001, 17, 1000, 0, 64], seed=9)


@pytest.mark.parametrize("with_num_tokens", [False, True])
def test_mla_decompress_no_tokens(with_num_tokens, variant):
    run_decompress((bf16, None, 64, 16, 2, 16, 16, True, 16, with_num_tokens), [0, 0, 0])
    # An empty batch.
    mla = make_paged_mla([5], 64, 16, 16, dtype=bf16, seed=3)
    key, value = ops.mla_decompress(like_on(mla.kv_cache), torch.zeros(0, 2, dtype=torch.int32, device=DEV),
                                    torch.zeros(0, dtype=torch.int32, device=DEV),
                                    torch.randn(2 * 32, 64, device=DEV).to(bf16), kv_lora_rank=64,
                                    qk_nope_head_dim=16, v_head_dim=16, num_tokens=0 if with_num_tokens else None)
    assert key.shape == (0, 2, 32) and value.shape == (0, 2, 16)


# ----------------------------------------------------------------------------------------------------
# mla_decompress: the TMA weight pipeline (sm_90) against the cp.async one
# ----------------------------------------------------------------------------------------------------

# id: w dtype, cache fp8, R, P, heads, dn, dv, RMSNorm, block size, pass num_tokens. Every case has a
# partial last token tile (243 tokens) and, but for the first, N = heads * (dn + dv) not a multiple of 64
# (partial TMA boxes along the rows); R = 200 leaves the last 64-column box partial.
TMA_CASES = {
    "bf16-R512-P64-H16-d128-norm": (bf16, None, 512, 64, 16, 128, 128, True, 64, False),
    "f16-R512-P64-H3-dn48-dv40": (f16, None, 512, 64, 3, 48, 40, False, 16, True),
    "bf16-R200-P8-H5-dn24-dv16-norm": (bf16, None, 200, 8, 5, 24, 16, True, 16, False),
    "f16-R200-P16-H2-dn40-dv28": (f16, None, 200, 16, 2, 40, 28, False, 64, True),
    "e4m3-bf16-R512-P64-H3-dn48-dv40-norm": (bf16, "e4m3", 512, 64, 3, 48, 40, True, 64, True),
    "e5m2-f16-R200-P8-H5-dn24-dv16": (f16, "e5m2", 200, 8, 5, 24, 16, False, 16, False),
    "e4m3-f16-R200-P16-H2-dn40-dv28-norm": (f16, "e4m3", 200, 16, 2, 40, 28, True, 64, False),
}
TMA_SEQ_LENS = [5, 0, 70, 1, 130, 37]  # 243 tokens: 3 full tiles of 64 + 51


def _require_sm90():
    major, minor = torch.cuda.get_device_capability(0)
    if major != 9:
        pytest.skip(f"the TMA path of mla_decompress is for compute capability 9.x (sm_90); this device is "
                    f"{major}.{minor}, where only the cp.async path exists")


def _tma_env(monkeypatch, tma: bool):
    """The tile64 kernel (KVKERNELS_CUDA_DECOMPRESS=tile64: the one with a TMA pipeline) with
    KVKERNELS_CUDA_TMA=require (the launch fails, with the reason, unless it takes TMA) or
    KVKERNELS_CUDA_NO_TMA=1 (the cp.async path)."""
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "tile64")
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA", raising=False)
    if tma:
        monkeypatch.setenv("KVKERNELS_CUDA_TMA", "require")
    else:
        monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "1")


def _skip_without_sm90_code(error: RuntimeError):
    if "without sm_90 device code" in str(error):
        pytest.skip(f"this build of kvkernels has no sm_90 device code, so no TMA path: {error}")


@pytest.mark.parametrize("case", TMA_CASES.values(), ids=TMA_CASES.keys())
def test_mla_decompress_tma_and_cp_async(case, monkeypatch):
    """On an sm_90 device, the TMA path (forced: KVKERNELS_CUDA_TMA=require) and the cp.async path
    (KVKERNELS_CUDA_NO_TMA=1) both match the float64 reference (run_decompress checks it), and they agree
    bit for bit: the same shared tiles (TMA's 128B swizzle = the kernel's XOR swizzle) feed the same
    mma.sync sequence."""
    _require_sm90()
    results = {}
    for tma in (True, False):
        _tma_env(monkeypatch, tma)
        try:
            results[tma] = run_decompress(case, TMA_SEQ_LENS, seed=61)
        except RuntimeError as e:
            if tma:
                _skip_without_sm90_code(e)
            raise
    for i, name in enumerate(("key", "value")):
        assert_bytes_equal(results[True][i], results[False][i], msg=f"{name}: TMA vs cp.async")


@pytest.mark.parametrize("dtype", [f16, bf16])
def test_mla_decompress_tma_unaligned_weight(dtype, monkeypatch):
    """A w_kv_b whose base is not 16-byte aligned (a contiguous view at a 1-element offset) is not eligible
    for TMA: KVKERNELS_CUDA_TMA=require reports why; without it the launch takes the element-load path and
    still matches the reference."""
    _require_sm90()
    r, p, h, dn, dv = 64, 16, 2, 16, 24
    mla = make_paged_mla([9, 40, 3], r, p, 16, dtype=dtype, seed=63)
    w = random_weight(h * (dn + dv), r, dtype, generator(64)).to(DEV)
    storage = torch.empty(w.numel() + 8, dtype=dtype, device=DEV)
    w_odd = storage[1:1 + w.numel()].view_as(w)
    w_odd.copy_(w)
    assert w_odd.is_contiguous() and w_odd.data_ptr() % 16 != 0
    args = (like_on(mla.kv_cache), mla.block_tables.to(DEV), mla.seq_lens.to(DEV), w_odd)
    kwargs = dict(kv_lora_rank=r, qk_nope_head_dim=dn, v_head_dim=dv)
    _tma_env(monkeypatch, True)
    with pytest.raises(RuntimeError, match=r"kvkernels\.mla_decompress: .*(not 16-byte aligned|without sm_90)"):
        ops.mla_decompress(*args, **kwargs)
    monkeypatch.delenv("KVKERNELS_CUDA_TMA")
    key, value = ops.mla_decompress(*args, **kwargs)
    ref_key, ref_value = reference.mla_decompress(mla.ref_cache(), mla.block_tables, mla.seq_lens, w.cpu(),
                                                  **kwargs)
    assert_close(key.cpu(), ref_key, dtype, msg="key")
    assert_close(value.cpu(), ref_value, dtype, msg="value")


# ----------------------------------------------------------------------------------------------------
# mla_decompress: the persist kernel against the tile64 kernel
# ----------------------------------------------------------------------------------------------------

# id: w dtype, cache fp8, R, P, heads, dn, dv, RMSNorm, block size, pass num_tokens; token counts. DeepSeek
# shapes (N = 4096 and 32768 columns: 32 / 256 column tiles, several per CTA on any GPU), a short batch
# (one token tile: the column tiles split into runs over many CTAs), N not a multiple of 128, odd dims
# (element stores), R 200 (a partial last K-tile), fp8 caches.
PERSIST_CASES = {
    "bf16-R512-P64-H16-d128-norm-b64": ((bf16, None, 512, 64, 16, 128, 128, True, 64, False), [1500, 0, 70, 555]),
    "e4m3-bf16-R512-P64-H128-d128-norm-b64": ((bf16, "e4m3", 512, 64, 128, 128, 128, True, 64, True), [300, 37]),
    "f16-R512-P64-H16-d128-b64-short": ((f16, None, 512, 64, 16, 128, 128, False, 64, True), [20, 3, 17]),
    "e5m2-bf16-R200-P8-H5-dn24-dv16-b16": ((bf16, "e5m2", 200, 8, 5, 24, 16, False, 16, False), [5, 0, 70, 1, 130, 37]),
    "f16-R64-P3-H11-dn5-dv7-norm-b1": ((f16, None, 64, 3, 11, 5, 7, True, 1, True), [5, 0, 70, 1, 130, 37]),
}


@pytest.mark.parametrize("case,seq_lens", PERSIST_CASES.values(), ids=PERSIST_CASES.keys())
def test_mla_decompress_persist_equals_tile64(case, seq_lens, monkeypatch):
    """The persist kernel (KVKERNELS_CUDA_DECOMPRESS=persist64 / persist128) matches the float64 reference and
    the tile64 kernel on cp.async bit for bit: the same mma.sync chain (K-tile by K-tile) per output element."""
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_NO_TMA", "1")
    results = {}
    for variant in DECOMPRESS_VARIANTS:
        monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", variant)
        results[variant] = run_decompress(case, seq_lens, seed=81)
    for variant in ("persist64", "persist128"):
        for i, name in enumerate(("key", "value")):
            assert_bytes_equal(results[variant][i], results["tile64"][i], msg=f"{name}: {variant} vs tile64")


def test_mla_decompress_tokens_past_the_sequences_are_zero(variant, monkeypatch):
    """num_tokens > sum(seq_lens) without KVKERNELS_DEBUG (the output is allocated as num_tokens says):
    the extra rows are zeros, the others what num_tokens = sum(seq_lens) gives."""
    monkeypatch.delenv("KVKERNELS_DEBUG", raising=False)
    r, p, h, dn, dv = 512, 64, 16, 128, 128
    seq_lens = [100, 0, 41]
    mla = make_paged_mla(seq_lens, r, p, 64, dtype=bf16, seed=5)
    w = random_weight(h * (dn + dv), r, bf16, generator(6)).to(DEV)
    args = (like_on(mla.kv_cache), mla.block_tables.to(DEV), mla.seq_lens.to(DEV), w)
    kwargs = dict(kv_lora_rank=r, qk_nope_head_dim=dn, v_head_dim=dv)
    t = sum(seq_lens)
    exact = [x.cpu() for x in ops.mla_decompress(*args, num_tokens=t, **kwargs)]
    poison_allocator(4 * (t + 90) * h * (dn + p + dv) * 2)
    longer = [x.cpu() for x in ops.mla_decompress(*args, num_tokens=t + 90, **kwargs)]
    for i, name in enumerate(("key", "value")):
        assert_bytes_equal(longer[i][:t], exact[i], msg=f"{name}: the tokens of the sequences")
        assert torch.equal(longer[i][t:], torch.zeros_like(longer[i][t:])), f"{name}: rows past sum(seq_lens)"


def test_mla_decompress_variant_errors(monkeypatch):
    """An unknown KVKERNELS_CUDA_DECOMPRESS raises naming the variable (on a call with no tokens too); KVKERNELS_CUDA_TMA=require with the
    persist kernel (no TMA path) raises saying so."""
    monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA", raising=False)
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "tile128")
    with pytest.raises(RuntimeError, match=r"kvkernels\.mla_decompress: .*KVKERNELS_CUDA_DECOMPRESS must be persist"):
        run_decompress((bf16, None, 64, 16, 2, 16, 24, False, 16, False), [9, 3])
    with pytest.raises(RuntimeError, match=r"KVKERNELS_CUDA_DECOMPRESS must be persist"):
        run_decompress((bf16, None, 64, 16, 2, 16, 24, False, 16, False), [0, 0])  # no tokens: checked all the same
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "persist")
    monkeypatch.setenv("KVKERNELS_CUDA_TMA", "require")
    with pytest.raises(RuntimeError, match=r"the persist kernel has no TMA path"):
        run_decompress((bf16, None, 64, 16, 2, 16, 24, False, 16, False), [9, 3])


# ----------------------------------------------------------------------------------------------------
# mla_decompress: the sm_90a wgmma kernel (KVKERNELS_CUDA_DECOMPRESS=wgmma, opt-in; csrc/cuda/mla_decompress_sm90.cuh)
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def wgmma(monkeypatch):
    """KVKERNELS_CUDA_DECOMPRESS=wgmma on a 9.x device (elsewhere the launch fails by design: skipped); a build
    without sm_90a code fails saying so (skipped with that reason)."""
    major, minor = torch.cuda.get_device_capability(0)
    if major != 9:
        pytest.skip(f"the wgmma mla_decompress is for compute capability 9.x (sm_90a); this device is {major}.{minor}")
    monkeypatch.delenv("KVKERNELS_CUDA_TMA", raising=False)
    monkeypatch.delenv("KVKERNELS_CUDA_NO_TMA", raising=False)
    monkeypatch.setenv("KVKERNELS_CUDA_DECOMPRESS", "wgmma")


def _run_wgmma(case, seq_lens, seed=2):
    try:
        return run_decompress(case, seq_lens, seed=seed)
    except RuntimeError as error:
        if "without sm_90a device code" in str(error):
            pytest.skip(f"this build of kvkernels has no sm_90a device code: {error}")
        raise


@pytest.mark.parametrize("case", {k: v for k, v in DECOMPRESS_CUDA_CASES.items() if v[0] != f32}.values(),
                         ids=[k for k, v in DECOMPRESS_CUDA_CASES.items() if v[0] != f32])
def test_mla_decompress_wgmma(case, wgmma):
    _run_wgmma(case, [5, 0, 70, 1, case[8], 200])


@pytest.mark.parametrize("case,seq_lens", PERSIST_CASES.values(), ids=PERSIST_CASES.keys())
def test_mla_decompress_wgmma_persist_cases(case, seq_lens, wgmma):
    """persist's DeepSeek / odd-dim / fp8 cases (several column tiles per CTA) on the wgmma kernel, against the
    float64 reference (not bit for bit against persist: wgmma's summation order within a k16 step is the
    hardware's)."""
    _run_wgmma(case, seq_lens, seed=81)


def test_mla_decompress_wgmma_many_tokens(wgmma):
    """More tiles than SMs (each CTA's range crosses token tiles: the latent re-staged mid-range)."""
    _run_wgmma((bf16, None, 512, 64, 16, 128, 128, True, 64, True), [3001, 17, 1000, 0, 64], seed=9)


def test_mla_decompress_wgmma_unaligned_weight(wgmma):
    """w_kv_b not 16-byte aligned: the wgmma kernel (TMA only) refuses, naming w_kv_b."""
    w = random_weight(2 * 40, 64, bf16, generator(63)).to(DEV)
    storage = torch.empty(w.numel() + 8, dtype=bf16, device=DEV)
    w_view = storage[1:1 + w.numel()].view_as(w)
    w_view.copy_(w)
    mla = make_paged_mla([9, 3], 64, 16, 16, dtype=bf16, seed=64)
    with pytest.raises(RuntimeError, match=r"wgmma: w_kv_b is not 16-byte aligned"):
        ops.mla_decompress(like_on(mla.kv_cache), mla.block_tables.to(DEV), mla.seq_lens.to(DEV), w_view,
                           kv_lora_rank=64, qk_nope_head_dim=16, v_head_dim=24)


# ----------------------------------------------------------------------------------------------------
# the two formulations, on CUDA
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [None, "e4m3"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_absorbed_equals_decompress_then_attend(mode, fp8):
    """W_UV(absorbed attention over the latent cache) == attention over the keys / values that
    mla_decompress produces, both computed by the CUDA kernels (float32: CUDA-core paths)."""
    gen = generator(6)
    r, p, h, dn, dv, b = 64, 16, 4, 32, 24, 16
    seq_lens = [37, 1, 16, 0, 50]
    mla = make_paged_mla(seq_lens, r, p, b, dtype=f32, fp8=fp8, seed=7)
    w = random_weight(h * (dn + dv), r, f32, gen)
    w_k, w_v = w.double().reshape(h, dn + dv, r).split([dn, dv], dim=1)
    q_lens = [1] * len(seq_lens) if mode == "decode" else varlen_q_lens(seq_lens)
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    q_nope = randn(sum(q_lens), h, dn, gen=gen)
    q_pe = randn(sum(q_lens), h, p, gen=gen)
    scale = (dn + p) ** -0.5
    cache, table, lens = like_on(mla.kv_cache), mla.block_tables.to(DEV), mla.seq_lens.to(DEV)

    q_absorbed = torch.cat([torch.einsum("thd,hdr->thr", q_nope.double(), w_k).float(), q_pe], dim=-1)
    out_latent, lse = ops.mla_paged_attention(q_absorbed.to(DEV), cache, table, lens, kv_lora_rank=r, scale=scale,
                                              query_start_loc=opt_on(qsl), kv_scale=opt_on(mla.scale))
    out = torch.einsum("thr,hvr->thv", out_latent.cpu().double(), w_v)

    key, value = ops.mla_decompress(cache, table, lens, w.to(DEV), kv_lora_rank=r, qk_nope_head_dim=dn,
                                    v_head_dim=dv, scale=opt_on(mla.scale))
    key, value = key.cpu(), value.cpu()
    q_full = torch.cat([q_nope, q_pe], dim=-1)
    expected_out = torch.full((sum(q_lens), h, dv), float("nan"), dtype=torch.float64)
    expected_lse = torch.full((sum(q_lens), h), float("nan"), dtype=torch.float64)
    q_start = k_start = 0
    for q_len, seq_len in zip(q_lens, seq_lens):
        qs, ks = slice(q_start, q_start + q_len), slice(k_start, k_start + seq_len)
        expected_out[qs], expected_lse[qs] = dense_attention(q_full[qs], key[ks], value[ks], scale)
        q_start, k_start = q_start + q_len, k_start + seq_len
    assert_close(out, expected_out, f32, rtol=2e-5, atol=2e-5, msg="W_UV(absorbed out) vs attention over decompressed")
    assert_close(lse.cpu(), expected_lse, f32, rtol=2e-5, atol=2e-5, msg="lse")


# ----------------------------------------------------------------------------------------------------
# opcheck, bad input, debug checks, streams, CUDA graphs
# ----------------------------------------------------------------------------------------------------


def _on_cuda(x):
    return like_on(x) if isinstance(x, torch.Tensor) else x


def _opcheck_cases():
    from test_opcheck import SAMPLES
    return [pytest.param(op, build, id=f"{op}-{name}") for op in ("mla_decompress", "mla_paged_attention")
            for name, build in SAMPLES[op].items()]


@pytest.mark.parametrize("op,build", _opcheck_cases())
def test_opcheck(op, build):
    """test_opcheck.py's MLA samples (non-contiguous included), moved to CUDA with their strides."""
    args, kwargs = build()
    args = tuple(_on_cuda(a) for a in args)
    kwargs = {k: _on_cuda(v) for k, v in kwargs.items()}
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(t, torch.Tensor) and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
           for t in (*args, *kwargs.values())):
        utils = utils[1:]  # SchemaCheckMode compares fp8 tensors with allclose, which has no fp8 kernel
    torch.library.opcheck(getattr(torch.ops.kvkernels, op).default, args, kwargs, test_utils=utils)


def _attn_base(fp8=None):
    mla, q, qsl = make_mla_case("decode", [5, 9, 12], bf16, fp8, 64, 16, 4, 4, seed=53)
    return dict(q=like_on(q), kv_cache=like_on(mla.kv_cache), block_tables=mla.block_tables.to(DEV),
                seq_lens=mla.seq_lens.to(DEV), kv_lora_rank=64, scale=0.1, kv_scale=opt_on(mla.scale))


ATTN_BAD = [
    ("q-float64", "q", lambda a: a.update(q=a["q"].double())),
    ("cache-dtype", "q|kv_cache", lambda a: a.update(q=a["q"].float())),
    ("block_tables-on-cpu", "block_tables", lambda a: a.update(block_tables=a["block_tables"].cpu())),
    ("seq_lens-on-cpu", "seq_lens", lambda a: a.update(seq_lens=a["seq_lens"].cpu())),
    ("kv_cache-on-cpu", "block_tables", lambda a: a.update(kv_cache=a["kv_cache"].cpu())),
    ("block_tables-int64", "block_tables", lambda a: a.update(block_tables=a["block_tables"].long())),
    ("q-width", "q", lambda a: a.update(q=a["q"][..., :72])),
    ("rank-not-multiple-of-8", "kv_lora_rank", lambda a: a.update(kv_lora_rank=60)),
    ("rank-wider-than-row", "kv_cache", lambda a: a.update(kv_lora_rank=96)),
    ("decode-tokens-ne-seqs", "q", lambda a: a.update(q=a["q"][:2])),
]


@pytest.mark.parametrize("name,arg,mutate", ATTN_BAD, ids=[b[0] for b in ATTN_BAD])
def test_attention_bad_input(name, arg, mutate):
    a = _attn_base()
    mutate(a)
    with pytest.raises(RuntimeError, match=rf"kvkernels\.mla_paged_attention: ({arg}):"):
        ops.mla_paged_attention(**a)
    torch.cuda.synchronize()  # and the device is still fine


def _dec_base(fp8=None):
    mla = make_paged_mla([5, 9, 12], 64, 16, 4, dtype=bf16, fp8=fp8, seed=54)
    w = random_weight(2 * 40, 64, bf16, generator(55))
    return dict(kv_cache=like_on(mla.kv_cache), block_tables=mla.block_tables.to(DEV),
                seq_lens=mla.seq_lens.to(DEV), w_kv_b=w.to(DEV), kv_lora_rank=64, qk_nope_head_dim=16,
                v_head_dim=24, norm_weight=torch.ones(64, dtype=bf16, device=DEV), scale=opt_on(mla.scale))


DEC_BAD = [
    ("w-dtype", "kv_cache|w_kv_b", lambda a: a.update(w_kv_b=a["w_kv_b"].float())),
    ("w-on-cpu", "w_kv_b", lambda a: a.update(w_kv_b=a["w_kv_b"].cpu())),
    ("w-rows", "w_kv_b", lambda a: a.update(w_kv_b=a["w_kv_b"][:70])),
    ("w-cols", "w_kv_b", lambda a: a.update(w_kv_b=a["w_kv_b"][:, :56])),
    ("norm-size", "norm_weight", lambda a: a.update(norm_weight=a["norm_weight"][:32])),
    ("norm-dtype", "norm_weight", lambda a: a.update(norm_weight=a["norm_weight"].float())),
    ("block_tables-int64", "block_tables", lambda a: a.update(block_tables=a["block_tables"].long())),
    ("negative-eps", "norm_eps", lambda a: a.update(norm_eps=-1.0)),
    ("negative-num_tokens", "num_tokens", lambda a: a.update(num_tokens=-3)),
]


@pytest.mark.parametrize("name,arg,mutate", DEC_BAD, ids=[b[0] for b in DEC_BAD])
def test_decompress_bad_input(name, arg, mutate):
    a = _dec_base()
    mutate(a)
    with pytest.raises(RuntimeError, match=rf"kvkernels\.mla_decompress: ({arg}):"):
        ops.mla_decompress(**a)
    torch.cuda.synchronize()


def test_fp8_without_scale():
    a = _attn_base(fp8="e4m3")
    a["kv_scale"] = None
    with pytest.raises(RuntimeError, match=r"kvkernels\.mla_paged_attention: kv_scale:"):
        ops.mla_paged_attention(**a)
    d = _dec_base(fp8="e4m3")
    d["scale"] = None
    with pytest.raises(RuntimeError, match=r"kvkernels\.mla_decompress: scale:"):
        ops.mla_decompress(**d)


@pytest.mark.parametrize("op", ["mla_paged_attention", "mla_decompress"])
def test_debug_index_checks(op, monkeypatch):
    """KVKERNELS_DEBUG=1 runs the host range checks on copies of the index tensors; without it a bad block
    id gives wrong numbers at worst, never a device fault (the kernels zero-fill)."""
    a = _attn_base() if op == "mla_paged_attention" else _dec_base()
    a["block_tables"][1, 1] = 10 ** 6
    call = getattr(ops, op)
    monkeypatch.setenv("KVKERNELS_DEBUG", "1")
    if op == "mla_decompress":
        a["num_tokens"] = 26  # given: the debug path checks the indices itself
    with pytest.raises(RuntimeError, match=rf"kvkernels\.{op}: block_tables:"):
        call(**a)
    monkeypatch.delenv("KVKERNELS_DEBUG")
    call(**a)
    torch.cuda.synchronize()  # no illegal address: the context is still usable
    torch.ones(1, device=DEV).add_(1)
    torch.cuda.synchronize()


def test_current_stream():
    """The kernels run on the current stream: work queued on a side stream, read after a sync of it."""
    mla, q, _ = make_mla_case("decode", [700, 5], bf16, None, 512, 64, 16, 64, seed=47)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out, lse = ops.mla_paged_attention(like_on(q), like_on(mla.kv_cache), mla.block_tables.to(DEV),
                                           mla.seq_lens.to(DEV), kv_lora_rank=512, scale=0.07)
    side.synchronize()
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables, mla.seq_lens,
                                                     kv_lora_rank=512, scale=0.07)
    assert_close(out.cpu(), ref_out, bf16, msg="out")
    assert_close(lse.cpu(), ref_lse, f32, msg="lse")


@pytest.mark.parametrize("dtype,fp8", [(bf16, None), (f32, None), (bf16, "e4m3")], ids=["bf16", "f32", "e4m3"])
def test_cuda_graph_decode_step(dtype, fp8):
    """Capture one MLA decode step (contexts long enough that the plan splits: workspace allocated inside
    the capture), then change seq_lens and the block tables' contents in place and replay: the replays
    match the reference for the new contents."""
    b, h = 64, 16
    lens_a, lens_b = [1500, 33, 900], [1700, 1, 2047]
    mla = make_paged_mla([2048, 2048, 2048], 512, 64, b, dtype=dtype, fp8=fp8, seed=59)
    cache, kv_scale = like_on(mla.kv_cache), opt_on(mla.scale)
    block_tables = mla.block_tables.to(DEV)
    seq_lens = torch.tensor(lens_a, dtype=torch.int32, device=DEV)
    q = make_query(3, h, 576, dtype, generator(60)).to(DEV)

    def step():
        return ops.mla_paged_attention(q, cache, block_tables, seq_lens, kv_lora_rank=512, scale=0.07,
                                       kv_scale=kv_scale)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture (first-use kernel attributes, allocator pools)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()

    def check(lens, table):
        ref_out, ref_lse = reference.mla_paged_attention(upcast(q.cpu()), mla.ref_cache(), table,
                                                         torch.tensor(lens, dtype=torch.int32), kv_lora_rank=512,
                                                         scale=0.07, kv_scale=mla.scale)
        assert_close(out.cpu(), ref_out, dtype, msg="graph out")
        assert_close(lse.cpu(), ref_lse, f32, msg="graph lse")

    graph.replay()
    torch.cuda.synchronize()
    check(lens_a, mla.block_tables)
    table_b = mla.block_tables.clone()
    table_b[[0, 2]] = mla.block_tables[[2, 0]]
    block_tables.copy_(table_b)
    seq_lens.copy_(torch.tensor(lens_b, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    check(lens_b, table_b)


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("case", ["bf16-R512-P64-H16-b64", "e4m3-f32-R64-P16-H4-b3", "f16-R72-P8-H5-b256"])
def test_out_variant(case, mode, path):
    """mla_paged_attention out= / lse= on CUDA: bit-identical to the allocating call, every element written
    (NaN-poisoned buffers), a row slice of a bigger buffer written in place with the rows around untouched,
    and out= alone (lse not returned)."""
    dtype, fp8, r, p, h, b, strided = ATTN_CASES[case]
    mla, q, qsl = make_mla_case(mode, [b + 1, 0, 2 * b + 5, 300], dtype, fp8, r, p, h, b, strided)
    args = (like_on(q), like_on(mla.kv_cache), mla.block_tables.to(DEV), mla.seq_lens.to(DEV))
    kwargs = dict(kv_lora_rank=r, scale=(128 + p) ** -0.5, query_start_loc=opt_on(qsl), kv_scale=opt_on(mla.scale))
    want_out, want_lse = ops.mla_paged_attention(*args, **kwargs)
    t = q.shape[0]
    buf = torch.full((t + 4, h, r), float("nan"), dtype=dtype, device=DEV)
    lse = torch.full((t, h), float("nan"), dtype=f32, device=DEV)
    got_out, got_lse = ops.mla_paged_attention(*args, **kwargs, out=buf[2:2 + t], lse=lse)
    torch.cuda.synchronize()
    assert got_out.data_ptr() == buf[2:2 + t].data_ptr() and got_lse is lse
    assert_bytes_equal(buf[2:2 + t], want_out, "out")
    assert_bytes_equal(lse, want_lse, "lse")
    assert buf[:2].isnan().all() and buf[2 + t:].isnan().all()
    out_only = torch.full_like(want_out, float("nan"))
    got_out, got_lse = ops.mla_paged_attention(*args, **kwargs, out=out_only)
    assert got_lse is None
    assert_bytes_equal(out_only, want_out, "out without lse")
