"""paged_attention's ``causal`` argument and sequences with more queries than keys (docs/ops.md).

``causal=False``: every query of a sequence sees all of its keys (encoder self-attention,
cross-attention over a paged cache); a window keeps its lower bound ``j >= pos - window_left`` with the
bottom-right aligned ``pos = seq_len - q_len + i``, and ALiBi keeps ``j - pos``. ``q_len > seq_len``
(causal): the first ``q_len - seq_len`` rows see no key (out 0, lse -inf or the sink). Every case runs
against the float64 reference with the outputs of the kernel freshly allocated (scratch poisoned by
conftest), and the reference itself is checked against explicit per-query loops. Every CPU ISA path runs
the non-causal cases; MLA gets the q_len > seq_len rows (it has no ``causal`` argument).
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import (assert_close, generator, make_paged_kv, make_paged_mla, make_query, query_start_loc,
                     randn, upcast, use_isa)
from test_attention import CONFIGS, FEATURE_CONFIGS, features, run_paged_attention
from kvkernels import ops, reference

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
ISAS = ["avx512amx", "avx512bf16", "avx512vbmi", "avx512", "avx2", "portable"]
NEG_INF = float("-inf")


def mixed_case(config, *, seed=0, q_lens=None, seq_lens=None):
    """A varlen batch of ``config`` (test_attention.CONFIGS) whose sequences have fewer, as many and
    more queries than keys, an empty sequence with queries, and a sequence without queries; partial
    and full last blocks, shuffled block ids, NaN in every unused slot (make_paged_kv)."""
    dtype, fp8, per_head, layout, hq, hkv, d, b, strided = config
    seq_lens = seq_lens or [b + 1, 0, max(3 * b - 1, 37), 3, b, 20, 7]
    q_lens = q_lens or [b + 1, 4, 9, 7, 0, 1, 40]  # 40 > 7 queries: a prefill of 40 rows over 7 keys
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype,
                       layout=layout, fp8=fp8, per_head_scale=per_head, seed=seed)
    query = make_query(sum(q_lens), hq, d, dtype, generator(seed + 1), strided=strided)
    return kv, query, query_start_loc(q_lens), q_lens, seq_lens


def no_key_rows(q_lens, seq_lens, causal):
    """Row indices that see no key: seq_len 0, and (causal) the rows at pos < 0."""
    rows, start = [], 0
    for q, s in zip(q_lens, seq_lens):
        for i in range(q):
            if s == 0 or (causal and s - q + i < 0):
                rows.append(start + i)
        start += q
    return rows


# The cases the other bindings' paged_attention runs (ONNX Runtime, JAX on CPU and CUDA: their tests call
# check_binding_case). id: (test_attention.CONFIGS-style config, extra keyword arguments).
BINDING_CASES = {
    "f32-gqa2-d32-b4": ((torch.float32, None, False, "NHD", 4, 2, 32, 4, None), {}),
    "bf16-e4m3-head-gqa4-d64-b16-window-alibi": ((torch.bfloat16, "e4m3", True, "NHD", 8, 2, 64, 16, None),
                                                 dict(window_left=5, alibi_slopes=torch.linspace(0.05, 0.6, 8))),
    "f16-mqa-d128-b5-sinks-softcap": ((torch.float16, None, False, "stacked", 4, 1, 128, 5, None),
                                      dict(sinks=torch.linspace(-1, 2, 4), soft_cap=6.0)),
}


def check_binding_case(op, case, causal):
    """``op`` (a binding's paged_attention, called like kvkernels.ops.paged_attention) on a mixed_case of
    BINDING_CASES: against the reference, varlen rows with q_len <, = and > seq_len (an empty sequence with
    queries, 40 rows over 7 keys); rows that see no key are 0 (and their lse -inf, unless sinks give them
    weight)."""
    config, extra = case
    kv, query, qsl, q_lens, seq_lens = mixed_case(config, seed=5)
    out, lse = run_paged_attention(kv, query, qsl, op=op, causal=causal, **extra)
    empty = no_key_rows(q_lens, seq_lens, causal)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    if "sinks" not in extra:
        assert torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_mixed_q_lens(config, causal):
    """Every dtype / fp8 / layout / GQA configuration, varlen rows with q_len <, = and > seq_len."""
    kv, query, qsl, q_lens, seq_lens = mixed_case(config)
    out, lse = run_paged_attention(kv, query, qsl, causal=causal)
    empty = no_key_rows(q_lens, seq_lens, causal)
    assert empty, "the case has rows without keys"
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[empty]).all()
    seen = [r for r in range(query.shape[0]) if r not in empty]
    assert lse[seen].isfinite().all()


@pytest.mark.parametrize("mode", ["decode", "varlen"])
@pytest.mark.parametrize("feature", list(features(16, 64)))
@pytest.mark.parametrize("config", FEATURE_CONFIGS.values(), ids=FEATURE_CONFIGS.keys())
def test_noncausal_features(config, feature, mode):
    """Window, soft cap, ALiBi, sinks, scale and all of them together, without the causal mask."""
    dtype, fp8, per_head, layout, hkv, d, b = config
    seq_lens = [2 * b, 2 * b + 1, 3 * b - 1, 1, 0, b, 40]
    q_lens = [1] * len(seq_lens) if mode == "decode" else [2 * b, 3, 3 * b + 4, 1, 2, b, 17]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype,
                       layout=layout, fp8=fp8, per_head_scale=per_head, seed=3)
    query = make_query(sum(q_lens), 8, d, dtype, generator(4))
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    kwargs = features(b, d)[feature]
    out, lse = run_paged_attention(kv, query, qsl, causal=False, **kwargs)
    if mode == "decode":  # decode sees every key either way: causal=True gives the same numbers
        out_c, lse_c = ops.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                           None, **kwargs, **kv.scales)
        assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


def per_query_loop(query, k, v, seq_len, *, causal, window_left=-1, alibi=None, sinks=None, scale):
    """One sequence, one kv head, query heads [Hq]: an explicit loop over queries in float64,
    independent of the reference (docs/ops.md's definition written out row by row)."""
    q_len = query.shape[0]
    outs, lses = [], []
    for i in range(q_len):
        pos = seq_len - q_len + i
        lo = max(pos - window_left, 0) if window_left >= 0 else 0
        hi = min(pos, seq_len - 1) if causal else seq_len - 1
        keys = torch.arange(lo, hi + 1) if hi >= lo else torch.arange(0)
        s = query[i].double() @ k[keys].T * scale  # [Hq, keys]
        if alibi is not None:
            s = s + alibi.double()[:, None] * (keys.double() - pos)[None, :]
        if sinks is not None:
            s_all = torch.cat([s, sinks.double()[:, None]], dim=1)
        else:
            s_all = s
        if s_all.shape[1] == 0:
            lses.append(torch.full((query.shape[1],), NEG_INF, dtype=torch.float64))
            outs.append(torch.zeros(query.shape[1], v.shape[1], dtype=torch.float64))
            continue
        lse = torch.logsumexp(s_all, dim=-1)
        lses.append(lse)
        outs.append(torch.exp(s - lse[:, None]) @ v[keys])
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("opts", [{}, dict(window_left=0), dict(window_left=5), dict(window_left=16),
                                  dict(alibi=True), dict(sinks=True), dict(window_left=7, alibi=True, sinks=True)],
                         ids=["plain", "window0", "window5", "window16", "alibi", "sinks", "window-alibi-sinks"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("q_len", [1, 20, 50, 64], ids=lambda n: f"q{n}")
def test_against_per_query_loop(q_len, causal, opts):
    """Kernel and reference against an explicit loop over queries, q_len below, equal to and above
    seq_len = 50 (bottom-right alignment: pos < 0 for the first 14 rows of q_len 64)."""
    b, d, seq_len, hq = 16, 16, 50, 3
    kv = make_paged_kv(seq_lens=[seq_len], num_kv_heads=1, head_dim=d, block_size=b, seed=11)
    query = make_query(q_len, hq, d, f32, generator(12))
    alibi = torch.tensor([0.3, 0.05, -0.1]) if opts.get("alibi") else None
    sinks = torch.tensor([0.5, -1.0, 2.0]) if opts.get("sinks") else None
    window = opts.get("window_left", -1)
    kwargs = dict(window_left=window, alibi_slopes=alibi, sinks=sinks, causal=causal)
    out, lse = ops.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                   query_start_loc([q_len]), **kwargs)
    kr, vr = kv.ref_caches()
    ref_out, ref_lse = reference.paged_attention(upcast(query), kr, vr, kv.block_tables, kv.seq_lens,
                                                 query_start_loc([q_len]), **kwargs)
    exp_out, exp_lse = per_query_loop(query, kv.keys[0][:, 0], kv.values[0][:, 0], seq_len, causal=causal,
                                      window_left=window, alibi=alibi, sinks=sinks, scale=d ** -0.5)
    assert_close(ref_out, exp_out, torch.float64, msg="reference out")
    assert_close(ref_lse, exp_lse, f32, msg="reference lse")  # the reference returns lse as float32
    assert_close(out, exp_out, f32, msg="out")
    assert_close(lse, exp_lse, f32, msg="lse")


def test_more_queries_than_keys_rows_without_key_take_the_sink():
    """Causal rows at pos < 0: out 0 and lse = sink (or -inf without one); the rows at pos >= 0 equal
    the same queries run as a sequence of exactly seq_len queries."""
    kv = make_paged_kv(seq_lens=[5], num_kv_heads=2, head_dim=32, block_size=4, seed=21)
    query = make_query(9, 4, 32, f32, generator(22))
    sinks = torch.tensor([0.25, NEG_INF, -2.0, 1.0])
    out, lse = ops.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                   query_start_loc([9]), sinks=sinks)
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    assert torch.equal(lse[:4], sinks.expand(4, 4))
    tail, tail_lse = ops.paged_attention(query[4:], kv.key_cache, kv.value_cache, kv.block_tables,
                                         kv.seq_lens, query_start_loc([5]), sinks=sinks)
    # (Not bit for bit: the two calls tile their rows differently.)
    assert_close(out[4:], tail.double(), f32, msg="out of the rows with keys")
    assert_close(lse[4:], tail_lse.double(), f32, msg="lse of the rows with keys")


def test_encoder_self_attention_equals_dense_softmax():
    """A whole non-causal prefill (q_len = seq_len, keys written by reshape_and_cache in shuffled blocks)
    equals torch's unmasked scaled-dot-product attention per sequence."""
    gen = generator(31)
    lens, h, d, b = [37, 64, 1], 4, 64, 16
    total = sum(lens)
    key, value, q = (randn(total, h, d, gen=gen) for _ in range(3))
    blocks_per = [math.ceil(n / b) for n in lens]
    perm = torch.randperm(sum(blocks_per) + 2, generator=gen)
    k_cache = torch.full((len(perm), b, h, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.int32)
    slots, used = [], 0
    for s, n in enumerate(lens):
        ids = perm[used:used + blocks_per[s]]
        used += blocks_per[s]
        table[s, :len(ids)] = ids.to(torch.int32)
        slots += [int(ids[t // b]) * b + t % b for t in range(n)]
    ops.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor(slots))
    qsl = query_start_loc(lens)
    out, _ = ops.paged_attention(q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), qsl,
                                 causal=False)
    for s in range(len(lens)):
        a, e = int(qsl[s]), int(qsl[s + 1])
        want = torch.nn.functional.scaled_dot_product_attention(
            q[a:e].double().transpose(0, 1), key[a:e].double().transpose(0, 1), value[a:e].double().transpose(0, 1))
        assert_close(out[a:e], want.transpose(0, 1), f32, msg=f"sequence {s}")


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    return use_isa(monkeypatch, request.param)


# id: dtype, fp8, Hq, Hkv, D, B, q_lens, seq_lens: the vector kernel (few rows), the tile kernels
# (AVX-512: 16+ rows per kv head; AMX: bf16 over bf16 / fp8) and mixed.
ISA_CASES = {
    "f32-vector": (f32, None, 4, 2, 64, 16, [3, 1, 9], [45, 7, 5]),
    "f16-tiles": (f16, None, 4, 1, 64, 16, [70, 20, 3], [150, 20, 0]),
    "bf16-tiles": (bf16, None, 8, 2, 128, 16, [40, 66, 5], [130, 50, 33]),
    "bf16-e4m3-tiles": (bf16, "e4m3", 4, 1, 64, 5, [100, 8], [90, 17]),
}


@pytest.mark.parametrize("opts", [{}, dict(window_left=20), dict(window_left=3, alibi=True, sinks=True)],
                         ids=["plain", "window20", "window3-alibi-sinks"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("case", ISA_CASES.values(), ids=ISA_CASES.keys())
def test_every_isa_path(isa, case, causal, opts):
    dtype, fp8, hq, hkv, d, b, q_lens, seq_lens = case
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=hkv, head_dim=d, block_size=b, dtype=dtype, fp8=fp8,
                       per_head_scale=True, seed=51)
    query = make_query(sum(q_lens), hq, d, dtype, generator(52))
    kwargs = {"window_left": opts.get("window_left", -1), "causal": causal}
    if opts.get("alibi"):
        kwargs["alibi_slopes"] = torch.linspace(0.01, 0.3, hq)
    if opts.get("sinks"):
        kwargs["sinks"] = torch.linspace(-1.0, 1.0, hq)
    run_paged_attention(kv, query, query_start_loc(q_lens), **kwargs)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_split_k(isa, causal):
    """One sequence, one kv head, long context on 3 threads: the keys are split into partials and merged
    (the chunked rows of q_len 3, and 70 rows over 60 keys where 10 rows see none when causal)."""
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for q_len, seq_len in ((3, 900), (70, 60)):
            kv = make_paged_kv(seq_lens=[seq_len], num_kv_heads=1, head_dim=64, block_size=16, seed=61)
            query = make_query(q_len, 2, 64, f32, generator(62))
            run_paged_attention(kv, query, query_start_loc([q_len]), causal=causal,
                                sinks=torch.tensor([0.5, -0.5]))
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------------------------------
# MLA: q_len > seq_len (always causal)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_mla_more_queries_than_keys(dtype):
    """FlashMLA's empty-context prefill: s_q > seq_len, seq_len 0 included; leading rows out 0, lse -inf."""
    seq_lens, q_lens = [3, 0, 40, 17], [7, 2, 40, 20]
    mla = make_paged_mla(seq_lens, kv_lora_rank=64, rope_dim=16, block_size=16, dtype=dtype, seed=71)
    q = make_query(sum(q_lens), 16, 80, dtype, generator(72))
    qsl = query_start_loc(q_lens)
    out, lse = ops.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, kv_lora_rank=64,
                                       scale=0.1, query_start_loc=qsl)
    ref_out, ref_lse = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables, mla.seq_lens,
                                                     kv_lora_rank=64, scale=0.1, query_start_loc=qsl)
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    empty = no_key_rows(q_lens, seq_lens, causal=True)
    assert len(empty) == 4 + 2 + 3
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and torch.isneginf(lse[empty]).all()


# ----------------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------------


def test_bad_query_start_loc_still_rejected_without_causal():
    """causal=False relaxes the mask only: the index rules of query_start_loc stay (checked before any
    output is allocated), in the kernel and in the reference alike."""
    kv = make_paged_kv(seq_lens=[5, 3], num_kv_heads=1, head_dim=16, block_size=4, seed=81)
    query = make_query(6, 2, 16, f32, generator(82))
    for qsl, msg in ((torch.tensor([0, 4, 3], dtype=torch.int32), "decreases"),
                     (torch.tensor([1, 3, 6], dtype=torch.int32), "must start at 0"),
                     (torch.tensor([0, 3, 5], dtype=torch.int32), "must end at num_tokens")):
        for fn in (ops.paged_attention, reference.paged_attention):
            with pytest.raises(RuntimeError, match=f"kvkernels.paged_attention: query_start_loc: .*{msg}"):
                fn(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, causal=False)


@pytest.mark.parametrize("value", [1, 0, None, 1.0, "no", torch.tensor(True)], ids=repr)
@pytest.mark.parametrize("fn", [ops.paged_attention, reference.paged_attention], ids=["ops", "reference"])
def test_causal_must_be_a_bool(fn, value):
    """kvkernels.ops and the reference take a Python bool only (torch.ops' schema conversion would turn 1, 0
    or a one-element tensor into a bool); the error names the argument."""
    kv = make_paged_kv(seq_lens=[5], num_kv_heads=1, head_dim=16, block_size=4, seed=83)
    query = make_query(1, 2, 16, f32, generator(84))
    with pytest.raises(RuntimeError, match=r"^kvkernels\.paged_attention: causal: expected a bool, got "):
        fn(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, causal=value)
    with pytest.raises((RuntimeError, TypeError)):  # torch's own schema check
        torch.ops.kvkernels.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                            causal="no")


def _none_case():
    kv = make_paged_kv(seq_lens=[5, 9], num_kv_heads=1, head_dim=16, block_size=4, seed=85)
    query = make_query(6, 2, 16, f32, generator(86))
    return kv, query, query_start_loc([2, 4])


def test_torch_ops_refuse_causal_none():
    """``torch.ops.kvkernels.paged_attention(..., causal=None)``: through a plain ``bool`` in the schema the
    dispatcher turned None into False, and a caller forwarding an unset option got non-causal attention
    silently. The schema says ``bool? causal=True`` and the shared preparation of every kernel refuses None by
    name, before any SIMD path is chosen or anything written (the out= variant leaves its poisoned out / lse
    as they were). The CUDA binding's twin: test_cuda_emulated.py::test_causal_none_refused."""
    kv, query, qsl = _none_case()
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl)
    message = r"^kvkernels\.paged_attention: causal: expected a bool, got None"
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvkernels.paged_attention(*args, causal=None)
    out = torch.full((6, 2, 16), float("nan"))
    lse = torch.full((6, 2), float("nan"))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvkernels.paged_attention_out(*args, causal=None, out=out, lse=lse)
    assert out.isnan().all() and lse.isnan().all()
    # Omitted, the schema's default still applies: the causal answer, not the non-causal one.
    default = torch.ops.kvkernels.paged_attention(*args)[0]
    assert torch.equal(default, torch.ops.kvkernels.paged_attention(*args, causal=True)[0])
    assert not torch.equal(default, torch.ops.kvkernels.paged_attention(*args, causal=False)[0])


def test_fake_and_compiled_refuse_causal_none():
    """The fake kernels (what torch.compile traces and torch.export runs) refuse None as the kernels do, so a
    compiled or exported call fails at trace time instead of baking in a non-causal attention."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kv, query, qsl = _none_case()
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match=r"kvkernels\.paged_attention: causal: expected a bool"):
            torch.ops.kvkernels.paged_attention(*args, causal=None)
        with pytest.raises(RuntimeError, match=r"kvkernels\.paged_attention: causal: expected a bool"):
            torch.ops.kvkernels.paged_attention_out(*args, causal=None, out=torch.empty(6, 2, 16))

    @torch.compile(backend="eager", fullgraph=True)
    def step(q):
        return torch.ops.kvkernels.paged_attention(q, *args[1:], causal=None)

    with pytest.raises(Exception, match=r"kvkernels\.paged_attention: causal: expected a bool"):
        step(query)


def test_metal_and_onnx_refuse_causal_none():
    """The MPS implementation (kvkernels.metal.dispatch, run here through the MSL emulator on CPU tensors)
    and the ONNX export's translation of the op refuse None too."""
    from kvkernels.metal import dispatch

    kv, query, qsl = _none_case()
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl)
    with pytest.raises(RuntimeError, match=r"^kvkernels\.paged_attention: causal: expected a bool, got None"):
        dispatch.paged_attention(*args, causal=None)
    assert torch.equal(dispatch.paged_attention(*args, causal=True)[0].isnan(),
                       torch.zeros(6, 2, 16, dtype=torch.bool))
    pytest.importorskip("onnxscript", reason="kvkernels.onnx needs onnxscript (requirements/dev.txt)")
    from kvkernels import onnx as kv_onnx

    translate = kv_onnx.translation_table()[torch.ops.kvkernels.paged_attention.default]
    with pytest.raises(RuntimeError, match=r"^kvkernels\.paged_attention: causal: expected a bool, got NoneType"):
        translate(*args, causal=None)


def test_compiled_noncausal_prefill_has_no_graph_break():
    """causal is a plain bool argument: torch.compile(fullgraph=True) traces it through the fake kernel, and
    switching it recompiles at most once per value."""
    kv = make_paged_kv(seq_lens=[30, 9], num_kv_heads=2, head_dim=32, block_size=8, seed=91)
    query = make_query(25, 4, 32, f32, generator(92))
    qsl = query_start_loc([12, 13])

    def step(q, causal):
        return ops.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                                   causal=causal)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for causal in (False, True):
        out, lse = compiled(query, causal)
        want_out, want_lse = step(query, causal)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


# The vLLM backend's encoder layers (kvkernels/integrations/vllm_backend.py) attend the step's own
# contiguous key/value [T, Hkv, D] without copying them into a cache: key.unsqueeze(1) is a cache of block
# size 1 (token t is block t) and row i of the block table lists sequence i's token indices.
def own_kv_call(q, key, value, lens, **kw):
    qsl = query_start_loc(lens)
    width = max(max(lens), 1)
    table = qsl[:-1, None] + torch.arange(width, dtype=torch.int32)[None, :]  # past a length: never read
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return ops.paged_attention(q, key.unsqueeze(1), value.unsqueeze(1), table, seq_lens, qsl, causal=False,
                               **kw), qsl


@pytest.mark.parametrize("dtype,hq,hkv,d", [(f32, 4, 2, 64), (bf16, 8, 2, 128), (f16, 4, 4, 32)],
                         ids=["f32-gqa", "bf16-gqa", "f16-mha"])
def test_encoder_over_own_kv_as_block_size_1_cache(isa, dtype, hq, hkv, d):
    """Bidirectional self-attention over the step's own K/V presented as a block-size-1 cache equals
    unmasked softmax attention per sequence in float64 (GQA, a one-token and a 70-token sequence: the
    tile kernels), on every CPU ISA path; key/value are strided slices of one qkv buffer, as in vLLM."""
    gen = generator(61)
    lens = [37, 1, 70, 5]
    total = sum(lens)
    qkv = randn(total, (hq + 2 * hkv) * d, gen=gen, dtype=dtype)
    q, key, value = (t.view(total, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    assert not key.is_contiguous()
    (out, lse), qsl = own_kv_call(q, key, value, lens, soft_cap=0.0)
    group = hq // hkv
    for s in range(len(lens)):
        a, e = int(qsl[s]), int(qsl[s + 1])
        k = upcast(key[a:e]).repeat_interleave(group, dim=1).transpose(0, 1)
        v = upcast(value[a:e]).repeat_interleave(group, dim=1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(upcast(q[a:e]).transpose(0, 1), k, v)
        assert_close(out[a:e], want.transpose(0, 1), dtype, msg=f"sequence {s}")
        logits = upcast(q[a:e]).transpose(0, 1) @ k.transpose(1, 2) * d ** -0.5
        assert_close(lse[a:e], torch.logsumexp(logits, -1).transpose(0, 1), f32, msg=f"lse of sequence {s}")


def test_compiled_encoder_over_own_kv_has_no_graph_break():
    """The block-size-1 view, the token table and causal=False trace with fullgraph=True and dynamic
    shapes: a second batch of other lengths runs the same graph (no recompile)."""
    from torch._dynamo.testing import CompileCounter

    def step(q, key, value, qsl, seq_lens, width):
        table = qsl[:-1, None] + torch.arange(width, dtype=torch.int32)[None, :]
        return ops.paged_attention(q, key.unsqueeze(1), value.unsqueeze(1), table, seq_lens, qsl, causal=False)

    counter = CompileCounter()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    gen = generator(62)
    for lens in ([9, 30, 4], [17, 2, 40, 6]):
        total = sum(lens)
        # 8 query heads: no size of the first batch equals another's (duck sizing would tie them).
        q, key, value = randn(total, 8, 32, gen=gen), randn(total, 2, 32, gen=gen), randn(total, 2, 32, gen=gen)
        args = (q, key, value, query_start_loc(lens), torch.tensor(lens, dtype=torch.int32), max(lens))
        got, want = compiled(*args), step(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
