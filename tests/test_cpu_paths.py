"""The CPU attention kernel's ISA paths and work schedules, each against the float64 reference.

One build carries an AVX-512 + VBMI + AMX, an AVX-512 + VBMI + BF16 (vdpbf16ps), an AVX-512 + VBMI, an AVX-512,
an AVX2 and a portable kernel;
KVKERNELS_CPU_ISA (read on every call) forces one. Every path runs the same cases here. Split-K is forced by shapes (one kv head, one
sequence, long context) and by the thread count the split decision reads.
"""

import re
import shutil
import subprocess

import pytest
import torch

import kvkernels
from helpers import (assert_close, generator, make_paged_kv, make_paged_mla, make_query, query_start_loc,
                     upcast, use_isa)
from test_attention import CONFIGS, FEATURE_CONFIGS, features, make_case, run_paged_attention
from kvkernels import ops, reference

ISAS = ["avx512amx", "avx512bf16", "avx512vbmi", "avx512", "avx2", "portable"]


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    return use_isa(monkeypatch, request.param)


@pytest.fixture
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def test_default_isa_is_the_best_supported(monkeypatch):
    monkeypatch.delenv("KVKERNELS_CPU_ISA", raising=False)
    flags = set(re.search(r"^flags\s*:(.*)$", open("/proc/cpuinfo").read(), re.M).group(1).split())
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl"} <= flags
    # An AMX-emulator build (make amx-emu-test) supplies the tile unit itself.
    tiles = {"amx_tile", "amx_bf16"} <= flags or kvkernels._C.amx_emulated_dot_products() is not None
    bf16 = avx512 and {"avx512vbmi", "avx512_bf16"} <= flags
    amx = bf16 and tiles
    expected = ("avx512amx" if amx else "avx512bf16" if bf16 else "avx512vbmi" if avx512 and "avx512vbmi" in flags
                else "avx512" if avx512 else "avx2" if avx2 else "portable")
    assert kvkernels.cpu_isa() == expected


def test_bad_isa_value_is_an_error(monkeypatch):
    kv, query, _ = make_case("decode", [5], dtype=torch.float32, num_heads=2, num_kv_heads=1, head_dim=16,
                             block_size=16)
    monkeypatch.setenv("KVKERNELS_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError, match="KVKERNELS_CPU_ISA=sse9"):
        ops.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    with pytest.raises(RuntimeError, match="KVKERNELS_CPU_ISA"):
        kvkernels.cpu_isa()


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_every_isa(isa, config, mode):
    dtype, fp8, per_head, layout, hq, hkv, d, b, strided = config
    seq_lens = [b + 1, 0, max(3 * b - 1, 37), 1, b]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, strided=strided)
    run_paged_attention(kv, query, qsl)


@pytest.mark.parametrize("feature", ["window=B", "softcap", "alibi", "sinks", "all"])
def test_every_isa_features(isa, feature):
    dtype, fp8, per_head, layout, hkv, d, b = FEATURE_CONFIGS["e4m3-f16-stacked-b16"]
    seq_lens = [2 * b, 2 * b + 1, 3 * b - 1, 1, 0, b, 40]
    for mode in ("decode", "varlen"):
        kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=8, num_kv_heads=hkv, head_dim=d,
                                   block_size=b, layout=layout, fp8=fp8, per_head=per_head, seed=3)
        run_paged_attention(kv, query, qsl, **features(b, d)[feature])


# Soft caps far above the logits: s / cap is tiny, where tanh's (1 - e^-2x) / (1 + e^-2x) cancels. The
# SIMD paths returned tanh = 0 for caps >= ~1e8 (every logit 0) and ~1e-4 relative errors at 1e4;
# found by tests/test_fuzz.py (issue 22). The capped result must equal the reference, i.e. ~no cap.
@pytest.mark.parametrize("soft_cap", [1e4, 1e8, 1e30])
def test_large_soft_cap(isa, soft_cap):
    kv, query, qsl = make_case("varlen", [40, 3, 17], dtype=torch.float32, num_heads=4, num_kv_heads=2,
                               head_dim=16, block_size=16, seed=31)
    run_paged_attention(kv, query * 4, qsl, soft_cap=soft_cap, alibi_slopes=torch.linspace(0.1, 1, 4))


# Split-K: one sequence and one kv head give a single item, fewer than two per thread, so the
# keys are split (at most len / 128 ways) and merged; 1 thread -> 2 splits, 3 threads -> 6.
@pytest.mark.parametrize("threads", [1, 3], indirect=True)
@pytest.mark.parametrize("opts", [{}, dict(window_left=700, sinks=torch.linspace(-1, 1, 8)),
                                  dict(soft_cap=3.0, alibi_slopes=torch.linspace(0.01, 0.1, 8))],
                         ids=["plain", "window-sinks", "softcap-alibi"])
@pytest.mark.parametrize("dtype, fp8", [(torch.float32, None), (torch.bfloat16, "e4m3"), (torch.float16, None)])
def test_split_k(isa, threads, opts, dtype, fp8):
    kv, query, _ = make_case("decode", [1500], dtype=dtype, num_heads=8, num_kv_heads=1, head_dim=72,
                             block_size=16, fp8=fp8, seed=8)
    run_paged_attention(kv, query, None, **opts)
    # Several kv heads in one item (NHD decode groups them) plus splits of a short second sequence.
    kv, query, _ = make_case("decode", [1300, 130], dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=128,
                             block_size=5, fp8=fp8, seed=9)
    run_paged_attention(kv, query, None, **opts)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_prefill_tiles(isa, threads):
    """Query tiles of 16 x group rows over a long context, the last tile partial, GQA 4 and 8."""
    for hq, hkv in ((8, 2), (8, 1)):
        kv, _, _ = make_case("decode", [600, 37], dtype=torch.bfloat16, num_heads=hq, num_kv_heads=hkv,
                             head_dim=64, block_size=16, seed=12)
        q_lens = [53, 37]
        query = make_query(sum(q_lens), hq, 64, torch.bfloat16, generator(13))
        run_paged_attention(kv, query, query_start_loc(q_lens), window_left=300)


# The AMX prefill kernel (bf16 queries over bf16 / fp8 caches, prefill calls): row tiles of 16 with
# padding rows (group 3, odd query counts), head dims that leave 2 column tiles (96) or need 8
# (128, 256), chunks of 64 keys across blocks of 1, 3, 16 and 64 slots, every layout, a decode-length
# and an empty sequence in the same call, items of several row tiles (256 rows) and split items.
# id: cache fp8, per-head scale, layout, Hq, Hkv, D, B
AMX_CONFIGS = {
    "bf16-NHD-gqa4-d128-b16": (None, False, "NHD", 8, 2, 128, 16),
    "bf16-HND-gqa3-d96-b3": (None, False, "HND", 6, 2, 96, 3),
    "bf16-stacked-mha-d64-b1": (None, False, "stacked", 2, 2, 64, 1),
    "e4m3-head-NHD-gqa8-d256-b64": ("e4m3", True, "NHD", 8, 1, 256, 64),
    "e5m2-tensor-HND-gqa4-d32-b16": ("e5m2", False, "HND", 4, 1, 32, 16),
}


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("opts", [{}, dict(window_left=70, sinks=torch.linspace(-1, 1, 8)),
                                  dict(soft_cap=3.0, alibi_slopes=torch.linspace(0.01, 0.1, 8))],
                         ids=["plain", "window-sinks", "softcap-alibi"])
@pytest.mark.parametrize("config", AMX_CONFIGS.values(), ids=AMX_CONFIGS.keys())
@pytest.mark.parametrize("pair_isa", ["avx512amx", "avx512bf16"])
def test_amx_prefill(monkeypatch, threads, opts, config, pair_isa):
    """The tile kernels that multiply bf16 pairs: on AMX, and as vdpbf16ps (the dp form, avx512bf16)."""
    use_isa(monkeypatch, pair_isa)
    fp8, per_head, layout, hq, hkv, d, b = config
    opts = {k: v[:hq] if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    seq_lens, q_lens = [300, 1, 0, 131, 70], [90, 1, 0, 131, 17]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=torch.bfloat16,
                       layout=layout, fp8=fp8, per_head_scale=per_head, seed=21)
    # Rows of very different logit ranges in one row tile: a row softmaxed against another row's max
    # overflows or underflows.
    magnitude = torch.logspace(-1, 1.5, sum(q_lens), dtype=torch.float64)[torch.randperm(sum(q_lens), generator=generator(25))]
    query = (make_query(sum(q_lens), hq, d, torch.float64, generator(22)) * magnitude[:, None, None]).to(torch.bfloat16)
    out, _ = run_paged_attention(kv, query, query_start_loc(q_lens), **opts)
    # The vector kernel keeps the probabilities in float32, the tiles round them to bf16: a result
    # identical to the AVX-512 path's would mean the AMX (dp) kernel never ran.
    monkeypatch.setenv("KVKERNELS_CPU_ISA", "avx512vbmi")
    vec, _ = ops.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                 query_start_loc(q_lens), **opts, **kv.scales)
    assert not torch.equal(out, vec)


# The vdpbf16ps form of the vector kernel (attention_dp.h: bf16 queries over fp8 caches on avx512bf16
# and avx512amx): decode and chunked prefill with few rows, GQA 4 (four rows: fp8 rows converted in
# registers) and 8 (eight rows: fp8 chunks staged as bf16 once), MQA, head dims that leave a partial
# 64-value block (72, 200) or whole ones (128, 256), blocks of 1 / 5 / 16 slots, odd and even key counts
# per chunk (pairs of value rows with a zero partner), every scale kind.
# id: cache fp8, per-head scale, layout, Hq, Hkv, D, B
DP_CONFIGS = {
    "e5m2-tensor-NHD-gqa4-d128-b16": ("e5m2", False, "NHD", 8, 2, 128, 16),
    "e4m3-tensor-HND-gqa8-d72-b5": ("e4m3", False, "HND", 8, 1, 72, 5),
    "e4m3-tensor-NHD-gqa4-d128-b16": ("e4m3", False, "NHD", 16, 4, 128, 16),
    "e4m3-head-stacked-gqa8-d256-b1": ("e4m3", True, "stacked", 16, 2, 256, 1),
    "e5m2-head-NHD-gqa4-d200-b16": ("e5m2", True, "NHD", 8, 2, 200, 16),
    "e5m2-tensor-HND-mqa-d64-b5": ("e5m2", False, "HND", 3, 1, 64, 5),
}


@pytest.mark.parametrize("dp_isa", ["avx512bf16", "avx512amx"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("opts", [{}, dict(window_left=21, sinks=torch.linspace(-1, 1, 16)),
                                  dict(soft_cap=3.0, alibi_slopes=torch.linspace(0.01, 0.1, 16))],
                         ids=["plain", "window-sinks", "softcap-alibi"])
@pytest.mark.parametrize("config", DP_CONFIGS.values(), ids=DP_CONFIGS.keys())
def test_dp_vector_kernel(monkeypatch, dp_isa, mode, opts, config):
    use_isa(monkeypatch, dp_isa)
    fp8, per_head, layout, hq, hkv, d, b = config
    opts = {k: v[:hq] if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    # varlen: at most 3 queries per sequence: with GQA <= 4 (12 rows) the call stays on the vector kernel
    # (fp8 chunks staged, rows of a group that see different keys); with GQA 8 it takes the dp tiles
    seq_lens, q_lens = [77, 1, 0, 33, 130], [3, 1, 0, 2, 3]
    kv, query, qsl = make_case(mode, seq_lens, dtype=torch.bfloat16, num_heads=hq, num_kv_heads=hkv,
                               head_dim=d, block_size=b, layout=layout, fp8=fp8, per_head=per_head, seed=41)
    if mode == "varlen":
        qsl = query_start_loc(q_lens)
        query = make_query(sum(q_lens), hq, d, torch.bfloat16, generator(42))
    out, _ = run_paged_attention(kv, query, qsl, **opts)
    # The float form keeps the probabilities in float32, the dp form rounds them to bf16 for P V: a
    # result identical to the avx512vbmi path's would mean the dp kernel never ran.
    monkeypatch.setenv("KVKERNELS_CPU_ISA", "avx512vbmi")
    vec, _ = ops.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                                 **opts, **kv.scales)
    assert not torch.equal(out, vec)


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
def test_amx_prefill_split(monkeypatch, threads):
    """One item (one sequence, one kv head, 20 x 4 rows) over 2000 keys: split over the threads and merged."""
    use_isa(monkeypatch, "avx512amx")
    kv = make_paged_kv(seq_lens=[2000], num_kv_heads=1, head_dim=128, block_size=16, dtype=torch.bfloat16,
                       fp8="e4m3", seed=23)
    query = make_query(20, 4, 128, torch.bfloat16, generator(24))
    for opts in ({}, dict(window_left=1000, sinks=torch.linspace(-1, 1, 4))):
        run_paged_attention(kv, query, query_start_loc([20]), **opts)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_mla_every_isa(isa, threads):
    """The absorbed MLA decode: one latent head of width 576, the value its first 512 columns."""
    mla = make_paged_mla([300, 1, 77], kv_lora_rank=512, rope_dim=64, block_size=64, dtype=torch.bfloat16,
                         seed=14)
    q = make_query(3, 16, 576, torch.bfloat16, generator(15))
    kwargs = dict(kv_lora_rank=512, scale=0.04)
    out, lse = ops.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, **kwargs)
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables,
                                                     mla.seq_lens, **kwargs)
    assert_close(out, ref_out, torch.bfloat16, msg="out")
    assert_close(lse, ref_lse, torch.float32, msg="lse")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_wide_registers_only_in_isa_code():
    """Code outside the avx2/avx512/avx512vbmi/avx512bf16/avx512amx namespaces must run on any x86-64 CPU: no ymm/zmm register in it
    (an inline function compiled inside a target region and picked by the linker would break that)."""
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", kvkernels._C.__file__],
                         capture_output=True, text=True, check=True).stdout
    leaks, zmm_in_avx2, fn = set(), set(), ""
    for line in asm.splitlines():
        if line.endswith(">:"):
            fn = line
        elif "%ymm" in line or "%zmm" in line:
            if not any(ns in fn for ns in ("avx512::", "avx512vbmi::", "avx512bf16::", "avx512amx::", "avx2::")):
                leaks.add(fn)
            if "%zmm" in line and "avx2::" in fn:
                zmm_in_avx2.add(fn)
    assert not leaks, f"wide registers outside the ISA namespaces: {sorted(leaks)[:5]}"
    assert not zmm_in_avx2, f"AVX-512 registers in the AVX2 path: {sorted(zmm_in_avx2)[:5]}"
    assert any("avx512::" in line for line in asm.splitlines() if line.endswith(">:"))
