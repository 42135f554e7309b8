"""Non-finite values (docs/ops.md, "Non-finite values"): every CPU ISA path against the float64 reference.

NaN / +inf / -inf are put into one element of a key or value row at the first, middle and last key of a
chunk (kChunk = 16 keys for the vector kernel, kTileChunk = 64 for the AVX-512 / AMX tile kernels) and
at the last key of a partial block, into each tensor parameter (ALiBi slopes, sinks, fp8 k / v scales,
the MLA kv_scale) and into the query; ``assert_close`` requires NaN and ±inf at exactly the reference's
positions. Keys a row does not see (window, causal diagonal, past seq_len, columns past head_dim) carry
NaN / inf too and must change nothing, with ``causal=False`` too (window lower bound, past seq_len); a
NaN key after a row's position reaches that row only when ``causal=False``. The modes reach every kernel: decode (vector kernel), chunked
prefill with few rows (vector kernel, rows of several query positions), prefill (tile kernels on
AVX-512, AMX for bf16 over bf16 / fp8), split-K decode (partials merged), MLA decode (tiles) and MLA
prefill.

The same cases run on CUDA (backend ``cuda``: inputs copied to the device with their storage, so views,
offsets and the NaN bytes around them stay; results compared on the CPU) where a CUDA device and the CUDA
kernels exist, and on the CUDA kernels built for the CPU emulator of tests/cuda_emu (backend ``cuda_emu``,
opt-in with KVKERNELS_CUDA_EMU=1: `make cuda-emu-test`); elsewhere those cases skip with the reason.
"""

import functools
import os
import sys

import pytest
import torch

from helpers import (FP8_DTYPES, assert_close, generator, make_paged_kv, make_paged_mla, make_query,
                     query_start_loc, require_kernel, token_slots, upcast, use_isa)
from kvkernels import ops, reference

NAN, INF = float("nan"), float("inf")
ISAS = ["avx512amx", "avx512bf16", "avx512vbmi", "avx512", "avx2", "portable"]
BACKENDS = ISAS + ["cuda", "cuda_emu"]
DEVICE = "cpu"  # where the kernels under test run (the `isa` fixture sets it)
KERNELS = ops  # what runs them: kvkernels.ops, or (cuda_emu) EmulatedCuda
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16

# id: query dtype, fp8 cache (None: the query's dtype)
CACHES = {"f32": (f32, None), "bf16": (bf16, None), "f16": (f16, None), "bf16-e4m3": (bf16, "e4m3"),
          "f16-e5m2": (f16, "e5m2")}
# The byte of a non-finite value in each fp8 format (e4m3fn has no inf).
FP8_BYTES = {"e4m3": {"nan": 0x7F}, "e5m2": {"nan": 0x7E, "+inf": 0x7C, "-inf": 0xFC}}
VALUES = {"nan": NAN, "+inf": INF, "-inf": -INF}

# id: seq_lens, q_lens (None: decode), Hq, Hkv, threads, positions (in sequence 0) to poison.
MODES = {
    # chunk [16, 32) of the vector kernel: first, middle, last; 44: last key, in a partial block.
    "decode": ([45, 7], None, 4, 2, 1, [16, 23, 31, 44]),
    # 5 queries x 2 heads (10 rows: vector kernel) at positions 40..44: keys 41..44 are seen by some
    # rows of a group of four and not by others.
    "chunked": ([45, 7], [5, 3], 4, 2, 1, [16, 31, 42, 44]),
    # 150 queries x 2 heads: tile kernels on AVX-512 (chunks [64, 128) and the partial [128, 150)).
    "prefill": ([150, 20], [150, 20], 2, 1, 1, [64, 95, 127, 149]),
    # one sequence, one kv head, decode: split into partials on 3 threads and merged.
    "split": ([600], None, 2, 1, 3, [16, 300, 599]),
}


class EmulatedCuda:
    """The CUDA kernels on the CPU emulator (torch.ops.kvkernels_emu, positional schemas) with the
    signatures of kvkernels.ops; paged_attention is test_cuda_emulated's adapter."""

    def __init__(self, emu):
        import test_cuda_emulated

        self.emu = emu
        self.paged_attention = functools.partial(test_cuda_emulated.emulated_paged_attention, emu)

    def mla_paged_attention(self, q, kv_cache, block_tables, seq_lens, *, kv_lora_rank, scale,
                            query_start_loc=None, kv_scale=None):
        return self.emu.mla_paged_attention(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale,
                                            query_start_loc, kv_scale)

    def merge_attention_states(self, out_a, lse_a, out_b, lse_b):
        return self.emu.merge_attention_states(out_a, lse_a, out_b, lse_b)


@functools.lru_cache(maxsize=None)
def emulated_cuda():
    import test_cuda_emulated  # puts tests/cuda_emu on sys.path

    ok, why = test_cuda_emulated.build_emu.available()
    if not ok:
        pytest.skip(why)
    return EmulatedCuda(test_cuda_emulated.build_emu.build())


@pytest.fixture(params=BACKENDS)
def isa(request, monkeypatch):
    """A CPU SIMD path; "cuda": the kernels run on the CUDA device (skipped without one); "cuda_emu": the
    CUDA kernels on the CPU emulator (opt-in)."""
    module = sys.modules[__name__]
    if request.param == "cuda":
        for op in ("paged_attention", "mla_paged_attention", "merge_attention_states"):
            require_kernel(op, "cuda")
        monkeypatch.setattr(module, "DEVICE", "cuda")
        return "cuda"
    if request.param == "cuda_emu":
        if os.environ.get("KVKERNELS_CUDA_EMU") != "1":
            pytest.skip("opt-in: set KVKERNELS_CUDA_EMU=1 to run the CUDA kernels on the CPU emulator")
        monkeypatch.setattr(module, "KERNELS", emulated_cuda())
        return "cuda_emu"
    return use_isa(monkeypatch, request.param)


def on_device(t):
    """``t`` on DEVICE with its whole storage copied (same strides and offset; the bytes around a view,
    NaN padding included, come along); None and non-tensors unchanged."""
    if not isinstance(t, torch.Tensor) or t.device == torch.device(DEVICE):
        return t
    storage = t.untyped_storage()
    whole = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),))
    return whole.to(DEVICE).as_strided(t.shape, t.stride(), t.storage_offset())


def run(op, *args, **kwargs):
    """``<op>`` of KERNELS on DEVICE, its outputs back on the CPU."""
    out = getattr(KERNELS, op)(*map(on_device, args), **{k: on_device(v) for k, v in kwargs.items()})
    return tuple(o.cpu() for o in out)


def attend(kv, query, qsl, **kwargs):
    return run("paged_attention", query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
               **kwargs, **kv.scales)


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(old)


def build(mode, cache, seed=0, head_dim=64):
    seq_lens, q_lens, hq, hkv, _, _ = MODES[mode]
    dtype, fp8 = CACHES[cache]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=head_dim, block_size=16, dtype=dtype,
                       fp8=fp8, per_head_scale=True, seed=seed)
    qsl = None if q_lens is None else query_start_loc(q_lens)
    query = make_query(len(seq_lens) if q_lens is None else sum(q_lens), hq, head_dim, dtype,
                       generator(seed + 1))
    return kv, query, qsl


def poke(cache, fp8, block_ids, seq_len, pos, head, col, value):
    """cache[slot of `pos`, head, col] = value (``value`` a key of VALUES; fp8: its byte)."""
    slot = int(token_slots(block_ids, seq_len, cache.shape[1])[pos])
    b, o = slot // cache.shape[1], slot % cache.shape[1]
    if fp8:
        cache.view(torch.uint8)[b, o, head, col] = FP8_BYTES[fp8][value]
    else:
        cache[b, o, head, col] = VALUES[value]


def check(kv, query, qsl, **kwargs):  # kwargs may hold causal
    out, lse = attend(kv, query, qsl, **kwargs)
    kr, vr = kv.ref_caches()
    ref_out, ref_lse = reference.paged_attention(upcast(query), kr, vr, kv.block_tables, kv.seq_lens, qsl,
                                                 **kwargs, **kv.scales)
    assert_close(out, ref_out, query.dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    return out, lse, ref_out, ref_lse


def nonfinite_cases():
    for cache, (_, fp8) in CACHES.items():
        for what in ("k:nan", "k:+inf", "k:-inf", "v:nan", "v:+inf"):
            if fp8 and what.split(":")[1] not in FP8_BYTES[fp8]:
                continue  # e4m3 cannot hold inf
            yield cache, what


@pytest.mark.parametrize("mode", MODES.keys())
@pytest.mark.parametrize("cache, what", list(nonfinite_cases()))
def test_nonfinite_in_key_or_value(isa, threads, mode, cache, what):
    """One non-finite element in a visible key or value row of kv head 0, at each chunk position."""
    threads(MODES[mode][4])
    side, value = what.split(":")
    for pos in MODES[mode][5]:
        kv, query, qsl = build(mode, cache, seed=pos)
        target = kv.key_cache if side == "k" else kv.value_cache
        poke(target, CACHES[cache][1], kv.blocks[0], int(kv.seq_lens[0]), pos, 0, 5, value)
        out, lse, ref_out, ref_lse = check(kv, query, qsl)
        # The reference itself: a NaN or +inf key logit makes rows NaN, a value only its column.
        heads0 = query.shape[1] // kv.key_cache.shape[2]  # query heads of kv head 0
        if side == "v":
            assert not ref_lse.isnan().any()
            assert ref_out[..., :heads0, 5].isfinite().sum() < ref_out[..., :heads0, 5].numel()
        if value == "nan" and side == "k":
            assert ref_lse[..., :heads0].isnan().any() and not ref_lse[..., heads0:].isnan().any()


@pytest.mark.parametrize("mode", MODES.keys())
def test_nonfinite_query(isa, threads, mode):
    threads(MODES[mode][4])
    for cache in CACHES:
        kv, query, qsl = build(mode, cache)
        query[0, 1, 7] = NAN
        if query.shape[0] > 1:
            query[-1, 0, 3] = INF
        _, lse, _, ref_lse = check(kv, query, qsl)
        assert lse[0, 1].isnan() and not lse[0, 0].isnan()


# A NaN or inf in a tensor parameter of one head (ALiBi slope, sink) or one kv head (fp8 scales).
PARAMS = ["alibi:nan", "alibi:+inf", "alibi:-inf", "sinks:nan", "sinks:+inf", "sinks:-inf",
          "k_scale:nan", "k_scale:+inf", "v_scale:nan", "v_scale:+inf"]


@pytest.mark.parametrize("mode", MODES.keys())
@pytest.mark.parametrize("param", PARAMS)
def test_nonfinite_parameter(isa, threads, mode, param):
    threads(MODES[mode][4])
    name, value = param.split(":")
    caches = ["bf16-e4m3", "f16-e5m2"] if name.endswith("scale") else ["f32", "bf16", "bf16-e4m3"]
    for cache in caches:
        kv, query, qsl = build(mode, cache)
        hq = query.shape[1]
        kwargs = {}
        if name == "alibi":
            kwargs["alibi_slopes"] = torch.linspace(0.01, 0.2, hq)
            kwargs["alibi_slopes"][1] = VALUES[value]
        elif name == "sinks":
            kwargs["sinks"] = torch.linspace(-1.0, 1.0, hq)
            kwargs["sinks"][1] = VALUES[value]
        else:
            getattr(kv, name)[0] = VALUES[value]
        out, lse, _, _ = check(kv, query, qsl, **kwargs)
        if name in ("alibi", "sinks") and value != "-inf":
            assert lse[:, 1].isnan().all() and out[:, 1].isnan().all() and not lse[:, 0].isnan().any()
        if name == "v_scale":  # rows of kv head 0 NaN, their lse as the keys give it
            assert out[:, :hq // kv.key_cache.shape[2]].isnan().all() and not lse.isnan().any()


# A +-inf k_scale is NaN for the logits: under a soft cap the +-inf logits would otherwise become
# +-soft_cap, finite (found by tests/test_fuzz.py: the kernels returned finite rows, the reference NaN).
@pytest.mark.parametrize("mode", MODES.keys())
@pytest.mark.parametrize("value", ["+inf", "-inf", "nan"])
def test_nonfinite_k_scale_under_soft_cap(isa, threads, mode, value):
    threads(MODES[mode][4])
    for cache in ["bf16-e4m3", "f16-e5m2"]:
        kv, query, qsl = build(mode, cache)
        group = query.shape[1] // kv.key_cache.shape[2]
        kv.k_scale[0] = VALUES[value]
        out, lse, _, _ = check(kv, query, qsl, soft_cap=5.0, alibi_slopes=torch.linspace(0.01, 0.2, query.shape[1]))
        # Every row of these modes sees a key: kv head 0's rows are NaN, the other kv head's are not.
        assert lse[:, :group].isnan().all() and out[:, :group].isnan().all()
        assert not lse[:, group:].isnan().any() and not out[:, group:].isnan().any()


@pytest.mark.parametrize("arg, value", [("scale", NAN), ("scale", INF), ("soft_cap", NAN), ("soft_cap", INF),
                                        ("soft_cap", -1.0)])
def test_nonfinite_scalar_parameter_is_an_error(arg, value):
    """scale and soft_cap are host scalars: checked, not propagated."""
    kv, query, qsl = build("decode", "f32")
    with pytest.raises(RuntimeError, match=f"kvkernels.paged_attention: {arg}:"):
        ops.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                            **{arg: value})


@pytest.mark.parametrize("mode", MODES.keys())
def test_all_visible_logits_neg_inf(isa, threads, mode):
    """-inf logits everywhere a row looks (inf keys against the query's sign) are 0 / 0: NaN, not
    'no key'; with a finite sink the sink takes the whole weight (out 0, lse = sink)."""
    threads(MODES[mode][4])
    kv, query, qsl = build(mode, "f32")
    query[:, 0] = 0.0
    query[:, 0, 0] = 1.0  # head 0 (kv head 0): logit = scale * k[0]
    kv.key_cache[:, :, 0, 0] = -INF  # every slot, used or not
    out, lse, _, _ = check(kv, query, qsl)
    assert lse[:, 0].isnan().all() and out[:, 0].isnan().all()
    sinks = torch.linspace(-1.0, 1.0, query.shape[1])
    out, lse, _, _ = check(kv, query, qsl, sinks=sinks)
    assert (out[:, 0] == 0).all() and torch.equal(lse[:, 0], sinks[0].expand(lse.shape[0]))


def test_no_visible_key_is_neg_inf(isa):
    """Decode with seq_len 0: out 0, lse -inf (the only -inf); with a NaN sink: NaN."""
    kv, query, _ = build("decode", "bf16")
    kv.seq_lens[1] = 0
    out, lse, _, _ = check(kv, query, None)
    assert (lse[1] == -INF).all() and (out[1] == 0).all() and lse[0].isfinite().all()
    sinks = torch.tensor([0.5, NAN, -INF, 1.0])
    out, lse, _, _ = check(kv, query, None, sinks=sinks)
    assert lse[1, 1].isnan() and out[1, 1].isnan().all() and lse[1, 2] == -INF and lse[1, 0] == 0.5


# ---------------------------------------------------------------------------------------------------
# keys a row does not see
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("mode", MODES.keys())
@pytest.mark.parametrize("cache", CACHES.keys())
def test_invisible_nonfinite_is_ignored(isa, threads, mode, cache, causal):
    """NaN / inf in keys and values a row does not see (before its window, after its position when causal;
    slots past seq_len hold NaN in every test) change nothing for that row: it equals the clean cache's
    result."""
    threads(MODES[mode][4])
    kv, query, qsl = build(mode, cache, seed=4)
    window = 9
    clean, clean_lse = attend(kv, query, qsl, window_left=window, causal=causal)
    assert clean.isfinite().all()
    fp8 = CACHES[cache][1]
    seq_len = int(kv.seq_lens[0])
    q_len = 1 if qsl is None else int(qsl[1] - qsl[0])
    # Not causal, every row sees up to the last key: only keys before windows can be invisible.
    dirty = [0, 20] if not causal else [0, 20, seq_len - 12] + ([seq_len - 1] if q_len > 1 else [])
    for pos in dirty:
        for head in range(kv.key_cache.shape[2]):
            for target in (kv.key_cache, kv.value_cache):
                poke(target, fp8, kv.blocks[0], seq_len, pos, head, 3, "nan")
                if fp8 != "e4m3":
                    poke(target, fp8, kv.blocks[0], seq_len, pos, head, 4, "+inf")
    out, lse, _, _ = check(kv, query, qsl, window_left=window, causal=causal)
    # Rows of sequence 0 whose window [pos - window, pos] (not causal: [pos - window, seq_len)) holds no
    # dirty key, and every other sequence.
    positions = torch.arange(seq_len - q_len, seq_len)
    blind = torch.ones(query.shape[0], dtype=torch.bool)
    blind[:q_len] = torch.tensor([not any(p - window <= d and (d <= p or not causal) for d in dirty)
                                  for p in positions.tolist()])
    assert blind[:q_len].any(), "no row of sequence 0 to check"
    assert_close(out[blind], clean[blind].double(), query.dtype, msg="invisible keys changed the result")
    assert_close(lse[blind], clean_lse[blind].double(), f32, msg="lse")
    assert out[~blind].isnan().any() or not (~blind).any()


@pytest.mark.parametrize("mode", ["chunked", "prefill"])
@pytest.mark.parametrize("cache", CACHES.keys())
def test_nonfinite_after_position_only_without_causal(isa, threads, mode, cache):
    """A NaN key (and an inf value) at sequence 0's last position: causal, only its last row sees them
    (every other row equals the clean result); causal=False, every row of kv head 0's query heads does (NaN
    rows) and the other kv head and sequence stay finite."""
    threads(MODES[mode][4])
    kv, query, qsl = build(mode, cache, seed=6)
    fp8 = CACHES[cache][1]
    seq_len, q_len = int(kv.seq_lens[0]), int(qsl[1] - qsl[0])
    clean, clean_lse = attend(kv, query, qsl)
    poke(kv.key_cache, fp8, kv.blocks[0], seq_len, seq_len - 1, 0, 2, "nan")
    if fp8 != "e4m3":
        poke(kv.value_cache, fp8, kv.blocks[0], seq_len, seq_len - 1, 0, 3, "+inf")
    heads0 = query.shape[1] // kv.key_cache.shape[2]
    out, lse, _, _ = check(kv, query, qsl)
    assert lse[q_len - 1, :heads0].isnan().all()
    assert_close(out[:q_len - 1], clean[:q_len - 1].double(), query.dtype, msg="rows before the NaN key")
    assert_close(lse[:q_len - 1], clean_lse[:q_len - 1].double(), f32, msg="lse before the NaN key")
    out, lse, _, _ = check(kv, query, qsl, causal=False)
    assert lse[:q_len, :heads0].isnan().all() and out[:q_len, :heads0].isnan().all()
    assert lse[:, heads0:].isfinite().all() and lse[q_len:].isfinite().all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_rows_before_the_first_key(isa, causal):
    """More queries than keys: causal rows at pos < 0 see no key (out 0, lse -inf, or the sink; a NaN sink
    gives NaN) even when every key holds NaN; causal=False they see every key. seq_len 0 with queries:
    no key either way."""
    kv = make_paged_kv(seq_lens=[3, 0, 20], num_kv_heads=2, head_dim=64, block_size=16, seed=8)
    query = make_query(6 + 2 + 20, 4, 64, f32, generator(9))
    qsl = query_start_loc([6, 2, 20])
    for h in range(2):  # every key of sequence 0 NaN
        for pos in range(3):
            poke(kv.key_cache, None, kv.blocks[0], 3, pos, h, 0, "nan")
    out, lse, _, _ = check(kv, query, qsl, causal=causal)
    empty = [0, 1, 2, 6, 7] if causal else [6, 7]
    assert (lse[empty] == -INF).all() and (out[empty] == 0).all()
    seen = [3, 4, 5] if causal else [0, 1, 2, 3, 4, 5]
    assert lse[seen].isnan().all() and lse[8:].isfinite().all()
    sinks = torch.tensor([0.5, NAN, -INF, 1.0])
    out, lse, _, _ = check(kv, query, qsl, sinks=sinks, causal=causal)
    assert (lse[empty][:, 0] == 0.5).all() and lse[empty][:, 1].isnan().all() and (lse[empty][:, 2] == -INF).all()
    assert (out[empty][:, [0, 2, 3]] == 0).all() and out[empty][:, 1].isnan().all()


@pytest.mark.parametrize("cache", ["f32", "bf16-e4m3"])
def test_columns_past_head_dim_are_not_read(isa, cache):
    """A cache that is a slice [..., :40] of rows 48 wide holding NaN / inf past column 40."""
    dtype, fp8 = CACHES[cache]
    kv = make_paged_kv(seq_lens=[45, 20], num_kv_heads=2, head_dim=40, block_size=16, dtype=dtype, fp8=fp8,
                       seed=3)
    wide = []
    for c in (kv.key_cache, kv.value_cache):
        w = torch.empty(*c.shape[:-1], 48, dtype=c.dtype)
        if fp8:
            w.view(torch.uint8).fill_(0x7F)
        else:
            w.fill_(INF)
            w[..., 44:] = NAN
        w[..., :40] = c
        wide.append(w[..., :40])
    kv.key_cache, kv.value_cache = wide
    for mode_qsl, q_lens in ((None, None), (query_start_loc([30, 20]), [30, 20])):
        query = make_query(2 if q_lens is None else 50, 4, 40, dtype, generator(5))
        out, lse, _, _ = check(kv, query, mode_qsl)
        assert out.isfinite().all() and lse.isfinite().all()


# ---------------------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------------------

# id: seq_lens, q_lens (None: decode), heads. 16 heads: the tile kernel on AVX-512; 4: the vector kernel.
MLA_MODES = {"decode16": ([70, 5], None, 16), "decode4": ([70, 5], None, 4), "prefill": ([70, 5], [20, 5], 4)}


def mla_cases():
    for cache in ("bf16", "f32", "e4m3", "e5m2"):
        fp8 = cache if cache in FP8_BYTES else None
        for what in ("latent:nan", "latent:+inf", "rope:nan", "rope:-inf", "kv_scale:nan", "kv_scale:+inf",
                     "query:nan"):
            name, value = what.split(":")
            if fp8 and name in ("latent", "rope") and value not in FP8_BYTES[fp8]:
                continue  # float8_e4m3fn cannot hold inf
            if name == "kv_scale" and not fp8:
                continue  # kv_scale is read only for fp8 caches
            yield cache, what


@pytest.mark.parametrize("mode", MLA_MODES.keys())
@pytest.mark.parametrize("cache, what", list(mla_cases()))
def test_mla_nonfinite(isa, mode, cache, what):
    seq_lens, q_lens, heads = MLA_MODES[mode]
    fp8 = cache if cache in FP8_BYTES else None
    dtype = bf16 if fp8 else {"bf16": bf16, "f32": f32}[cache]
    name, value = what.split(":")
    r, p = 64, 16
    mla = make_paged_mla(seq_lens, r, p, 16, dtype=dtype, fp8=fp8, seed=6)
    qsl = None if q_lens is None else query_start_loc(q_lens)
    q = make_query(len(seq_lens) if q_lens is None else sum(q_lens), heads, r + p, dtype, generator(7))
    # Positions 16 (first of a vector chunk), 63 (last of a tile chunk), 69 (last key, partial block).
    for pos in (16, 63, 69):
        cache_t = mla.kv_cache.clone()
        scale = None if mla.scale is None else mla.scale.clone()
        qq = q.clone()
        col = 3 if name == "latent" else r + 2
        if name in ("latent", "rope"):
            slot = int(token_slots(mla.blocks[0], seq_lens[0], 16)[pos])
            if fp8:
                cache_t.view(torch.uint8)[slot // 16, slot % 16, col] = FP8_BYTES[fp8][value]
            else:
                cache_t[slot // 16, slot % 16, col] = VALUES[value]
        elif name == "kv_scale":
            scale[0] = VALUES[value]
        else:
            qq[0, 1, pos % (r + p)] = NAN
        kwargs = dict(kv_lora_rank=r, scale=0.1, query_start_loc=qsl, kv_scale=scale)
        out, lse = run("mla_paged_attention", qq, cache_t, mla.block_tables, mla.seq_lens, **kwargs)
        ref_out, ref_lse = reference.mla_paged_attention(upcast(qq), upcast(cache_t), mla.block_tables,
                                                         mla.seq_lens, **kwargs)
        assert_close(out, ref_out, dtype, msg=f"out, key {pos}")
        assert_close(lse, ref_lse, f32, msg=f"lse, key {pos}")
        assert not out[-1].isnan().any() or name == "kv_scale"  # sequence 1 does not read sequence 0


# ---------------------------------------------------------------------------------------------------
# merge_attention_states
# ---------------------------------------------------------------------------------------------------

LSES = {"finite": 0.7, "finite-far": -150.0, "-inf": -INF, "+inf": INF, "nan": NAN}


@pytest.mark.parametrize("dtype", [f32, bf16, f16])
def test_merge_nonfinite(isa, dtype):
    """Every pair of lse kinds, with outputs holding NaN / inf; an empty side (±inf) is not read, a NaN
    lse makes the row NaN, and a finite side is read even when its weight underflows to 0."""
    names = list(LSES)
    pairs = [(a, b) for a in names for b in names]
    t, h, d = len(pairs), 2, 40  # 40: two full 16-lane vectors and a partial one
    gen = generator(9)
    out_a = torch.randn(t, h, d, generator=gen).to(dtype)
    out_b = torch.randn(t, h, d, generator=gen).to(dtype)
    lse_a = torch.empty(t, h)
    lse_b = torch.empty(t, h)
    for i, (a, b) in enumerate(pairs):
        lse_a[i], lse_b[i] = LSES[a], LSES[b]
        if LSES[a] != LSES[a] or abs(LSES[a]) == INF:
            out_a[i, :, ::3] = NAN  # an empty side's garbage
        if LSES[b] != LSES[b] or abs(LSES[b]) == INF:
            out_b[i, :, 1::3] = INF
    out_a[:, 1, 17] = NAN  # head 1 of every finite side carries a NaN value: read -> NaN
    out, lse = run("merge_attention_states", out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.merge_attention_states(upcast(out_a), lse_a, upcast(out_b), lse_b)
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    for i, (a, b) in enumerate(pairs):
        ea, eb = a in ("-inf", "+inf"), b in ("-inf", "+inf")
        if "nan" in (a, b):
            assert lse[i].isnan().all() and out[i].isnan().all(), (a, b)
        elif ea and eb:
            assert (lse[i] == -INF).all() and (out[i] == 0).all(), (a, b)
        else:
            assert lse[i].isfinite().all(), (a, b)
            assert out[i, 0].isfinite().all(), (a, b)
            # b = "finite-far" next to a = "finite": weight exp(-150.7) underflows in float32, read anyway
            assert out[i, 1, 17].isnan() == (not ea), (a, b)


def test_reference_nonfinite_rules():
    """The reference encodes docs/ops.md directly (independent of any kernel)."""
    k = torch.zeros(3, 1, 4, dtype=torch.float64)
    v = torch.arange(12, dtype=torch.float64).reshape(3, 1, 4)
    q = torch.ones(1, 1, 4, dtype=torch.float64)
    from kvkernels.reference import _attend_one_sequence as attend
    k1 = k.clone()
    k1[1, 0, 0] = INF  # +inf logit: NaN row
    out, lse = attend(q, k1, v, 1.0)
    assert lse.isnan().all() and out.isnan().all()
    k1[1, 0, 0] = -INF  # -inf logit: weight 0
    out, lse = attend(q, k1, v, 1.0)
    torch.testing.assert_close(out[0, 0], (v[0, 0] + v[2, 0]) / 2)
    out, lse = attend(q, k, v, 1.0, sinks=torch.tensor([INF]))  # +inf sink: NaN, not (0, +inf)
    assert lse.isnan().all() and out.isnan().all()
    v1 = v.clone()
    v1[2, 0, 1] = NAN  # a later key's NaN value does not reach an earlier query (causal)
    out, _ = attend(torch.ones(2, 1, 4, dtype=torch.float64), k, v1, 1.0)
    assert out[0].isfinite().all() and out[1, 0, 1].isnan() and out[1, 0, 0].isfinite()
    out, lse = reference.merge_attention_states(v[:1], torch.tensor([[INF]]), v[1:2], torch.tensor([[0.5]]))
    assert torch.equal(out, v[1:2]) and lse.item() == 0.5
