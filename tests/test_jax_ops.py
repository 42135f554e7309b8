"""kvkernels.jax (the XLA FFI custom calls of csrc/jax/, docs/jax.md) on the CPU, against kvkernels.reference.

The ops run through tests/jax_ops.py, which calls them like ``kvkernels.ops`` (torch tensors copied into JAX
arrays and back), so the checks of tests/test_attention.py, test_causal.py and test_cache_ops.py apply
unchanged: every option of paged_attention (decode, varlen, GQA/MQA, window, soft cap, ALiBi, sinks, scale,
causal=False, Dv != Dk), fp8 caches (e4m3 / e5m2, per-tensor / per-head scales), every CPU ISA path, the
cache writes, gathers and block copies. Then what is JAX's own: jit, eval_shape, vmap over independent
caches, in-place cache updates under donation, the errors (trace-time ValueError / run-time
JaxRuntimeError naming the argument, nothing written), no host round trip, no torch.

The module skips (with the reason) only when jax is not installed; a library that fails to build fails it.
"""

import os
import re
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (the JAX tests need jax and jaxlib from "
                                        "requirements/lock.txt: pip install -c requirements/lock.txt jax jaxlib)")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import jax_ops  # noqa: E402
import kvkernels.jax as kj  # noqa: E402
from helpers import generator, make_paged_kv, make_query, randn, use_isa  # noqa: E402
from kvkernels import reference  # noqa: E402
from test_attention import make_case, run_paged_attention  # noqa: E402
from test_cache_ops import check_copy_blocks_stacked, check_gather_kv, check_reshape_and_cache  # noqa: E402
from test_causal import BINDING_CASES, check_binding_case  # noqa: E402

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
JaxRuntimeError = jax.errors.JaxRuntimeError


@pytest.fixture(scope="module", autouse=True)
def jax_library(jax_library_path):
    return jax_library_path


# ---- paged_attention against the reference ----------------------------------------------------

# id: mode, dtype, fp8, per-head scales, Hq, Hkv, D, block size, layout, extra kwargs
ATTENTION = {
    "decode-f32-mha": ("decode", f32, None, False, 4, 4, 64, 16, "NHD", {}),
    "decode-f16-gqa4-window": ("decode", f16, None, False, 8, 2, 128, 3, "HND", dict(window_left=5)),
    "decode-bf16-mqa-softcap": ("decode", bf16, None, False, 6, 1, 72, 1, "stacked", dict(soft_cap=7.5)),
    "decode-f32-e4m3-head-sinks": ("decode", f32, "e4m3", True, 8, 2, 32, 16, "NHD",
                                   dict(sinks=torch.linspace(-2, 3, 8))),
    "decode-bf16-e5m2-alibi": ("decode", bf16, "e5m2", False, 4, 2, 64, 5, "NHD",
                               dict(alibi_slopes=torch.linspace(0.05, 0.6, 4))),
    "decode-f16-e4m3-tensor-d256": ("decode", f16, "e4m3", False, 8, 2, 256, 16, "NHD", {}),
    "varlen-f32-gqa2-scale": ("varlen", f32, None, False, 4, 2, 32, 4, "NHD", dict(scale=0.3)),
    "varlen-f16-gqa8-window-softcap": ("varlen", f16, None, False, 16, 2, 64, 16, "stacked",
                                       dict(window_left=3, soft_cap=5.0)),
    "varlen-bf16-e4m3-khead-sinks": ("varlen", bf16, "e4m3", (True, False), 8, 8, 128, 16, "NHD",
                                     dict(sinks=torch.linspace(-1, 1, 8))),
    "varlen-f32-e5m2-head-alibi-window": ("varlen", f32, "e5m2", True, 4, 1, 16, 8, "HND",
                                          dict(alibi_slopes=torch.linspace(0.1, 0.4, 4), window_left=9)),
    "varlen-bf16-d512": ("varlen", bf16, None, False, 2, 1, 512, 16, "NHD", {}),
}
SEQ_LENS = [1, 17, 40, 0, 5, 33]  # partial blocks, an empty sequence (decode), several blocks


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", ATTENTION.values(), ids=ATTENTION.keys())
def test_paged_attention(case, jit, monkeypatch):
    monkeypatch.setattr(jax_ops, "JIT", jit)
    mode, dtype, fp8, per_head, hq, hkv, d, b, layout, extra = case
    seq_lens = SEQ_LENS if mode == "decode" else [n for n in SEQ_LENS if n]
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, seed=sum(map(ord, str(case[:8]))))
    run_paged_attention(kv, query, qsl, op=jax_ops.paged_attention, **extra)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512", "avx512vbmi", "avx512amx"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_paged_attention_isa_paths(isa, mode, monkeypatch):
    """Every SIMD path (KVKERNELS_CPU_ISA is read by the handlers on every call, as by the torch ops):
    bf16 over e4m3 takes the AMX tiles (prefill) where the CPU has them, the VBMI fp8 reads elsewhere."""
    use_isa(monkeypatch, isa)
    assert kj.cpu_isa() == isa
    kv, query, qsl = make_case(mode, [3, 40, 18], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=64,
                               block_size=16, fp8="e4m3", per_head=True, seed=11)
    run_paged_attention(kv, query, qsl, op=jax_ops.paged_attention, soft_cap=9.0)
    kv, query, qsl = make_case(mode, [70, 1], dtype=f32, num_heads=4, num_kv_heads=4, head_dim=32,
                               block_size=5, seed=12)
    run_paged_attention(kv, query, qsl, op=jax_ops.paged_attention, window_left=20)


def test_bad_isa_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("KVKERNELS_CPU_ISA", "sse9")
    kv, query, _ = make_case("decode", [3], dtype=f32, num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    with pytest.raises(JaxRuntimeError, match="KVKERNELS_CPU_ISA=sse9"):
        jax_ops.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("case", BINDING_CASES.values(), ids=BINDING_CASES.keys())
def test_paged_attention_causal_and_more_queries_than_keys(case, causal):
    """``causal`` against the reference, varlen rows with q_len <, = and > seq_len (test_causal.check_binding_case)."""
    check_binding_case(jax_ops.paged_attention, case, causal)


def test_paged_attention_value_head_dim_differs():
    """Dv != Dk (DeepSeek-style prefill over decompressed K/V: 192 / 128)."""
    kv = make_paged_kv(seq_lens=[9, 30], num_kv_heads=2, head_dim=192, head_dim_v=128, block_size=8,
                       dtype=bf16, seed=3)
    query = make_query(2, 4, 192, bf16, generator(4))
    out, _ = run_paged_attention(kv, query, None, op=jax_ops.paged_attention)
    assert out.shape == (2, 4, 128)


# ---- cache ops against the reference -------------------------------------------------------------

WRITE = {
    "f32-NHD": (f32, None, False, "NHD"),
    "bf16-stacked": (bf16, None, False, "stacked"),
    "f16-HND": (f16, None, False, "HND"),
    "bf16->e4m3-tensor-NHD": (bf16, "e4m3", False, "NHD"),
    "f16->e5m2-head-stacked": (f16, "e5m2", True, "stacked"),
    "f32->e4m3-k-head-v-tensor-NHD": (f32, "e4m3", (True, False), "NHD"),
    "bf16->e5m2-tensor-HND": (bf16, "e5m2", False, "HND"),
}


@pytest.mark.parametrize("case", WRITE.values(), ids=WRITE.keys())
def test_reshape_and_cache(case):
    """Quantization (saturation, inf, subnormals, NaN), skipped negative slots, untouched other slots."""
    check_reshape_and_cache(case, op=jax_ops.reshape_and_cache)


GATHER = {
    "f32-NHD": (f32, None, False, "NHD", 16, None, False),
    "f16-stacked-to-f32": (f16, None, False, "stacked", 16, f32, False),
    "e4m3-tensor-default-bf16": (bf16, "e4m3", False, "NHD", 16, None, False),
    "e5m2-head-to-f32": (f32, "e5m2", True, "NHD", 3, f32, True),
    "e4m3-head-stacked-to-f16": (f16, "e4m3", True, "stacked", 1, f16, False),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", GATHER.values(), ids=GATHER.keys())
def test_gather_kv(case, jit, monkeypatch):
    monkeypatch.setattr(jax_ops, "JIT", jit)
    check_gather_kv(case, op=jax_ops.gather_kv)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_cache_ops_isa_paths(isa, monkeypatch):
    """The row kernels (fp8 quantization on write, dequantization on gather) of every ISA."""
    use_isa(monkeypatch, isa)
    check_reshape_and_cache((bf16, "e4m3", True, "NHD"), op=jax_ops.reshape_and_cache)
    check_reshape_and_cache((f32, None, False, "stacked"), op=jax_ops.reshape_and_cache)
    check_gather_kv((f16, "e5m2", True, "NHD", 3, f32, False), op=jax_ops.gather_kv)


@pytest.mark.parametrize("block_dim", [2, -4])
@pytest.mark.parametrize("dtype", [f32, bf16, e4m3, torch.uint8], ids=str)
def test_copy_blocks_stacked(dtype, block_dim):
    """Every layer and both K and V of a stacked [L, 2, N, B, H, D] cache in one call."""
    check_copy_blocks_stacked(dtype, block_dim, op=jax_ops.copy_blocks)


def test_copy_blocks_one_layer():
    cache = randn(9, 4, 2, 8, gen=generator(3)).to(bf16)
    pairs = torch.tensor([[1, 7], [4, 0], [1, 3]])
    expected = cache.clone()
    reference.copy_blocks(expected, pairs)
    jax_ops.copy_blocks(cache, pairs)
    assert torch.equal(cache.view(torch.int16), expected.view(torch.int16))


def test_int64_index_arrays_under_x64():
    """With x64 on, slot_mapping and block_mapping may be int64 (a slot of -2**40 is skipped, not wrapped)."""
    with jax.enable_x64(True):
        check_reshape_and_cache((f32, "e4m3", False, "NHD"), op=jax_ops.reshape_and_cache)
        assert jax_ops.last_results[0].dtype == jnp.float8_e4m3fn
        check_copy_blocks_stacked(f32, 2, op=jax_ops.copy_blocks)


def test_int64_slots_without_x64_are_checked_not_wrapped():
    """A numpy int64 slot mapping without x64: converted when its values fit in int32, an error when they do
    not (jnp.asarray would wrap -2**40 to slot 0 and overwrite a token)."""
    kc = jnp.zeros((4, 4, 1, 8))
    k = jnp.ones((2, 1, 8))
    new, _ = kj.reshape_and_cache(k, k, kc, kc, np.array([3, -1], np.int64))
    assert float(new[0, 3].sum()) == 8 and float(new.sum()) == 8
    with pytest.raises(ValueError, match=re.escape("kvkernels.reshape_and_cache: slot_mapping: int64 values "
                                                   "outside the int32 range need jax_enable_x64")):
        kj.reshape_and_cache(k, k, kc, kc, np.array([3, -(2**40)], np.int64))
    with pytest.raises(ValueError, match=re.escape("kvkernels.paged_attention: block_tables: expected int32, "
                                                   "got int64")):
        kj.paged_attention(jnp.ones((1, 1, 8)), kc, kc, np.zeros((1, 1), np.int64), np.ones(1, np.int32))


# ---- errors: named arguments, nothing written ----------------------------------------------------

def _attention_args():
    kv = make_paged_kv(seq_lens=[5, 20], num_kv_heads=2, head_dim=32, block_size=8, seed=5)
    query = make_query(2, 4, 32, f32, generator(6))
    return dict(query=query, key_cache=kv.key_cache, value_cache=kv.value_cache, block_tables=kv.block_tables,
                seq_lens=kv.seq_lens)


# id: (mutation of the torch arguments, argument named, message, error raised when tracing (True) or by the
# CPU handler when the call runs (False: an index value))
ATTENTION_ERRORS = {
    "block id out of range": (lambda a: a["block_tables"].__setitem__((1, 1), 99), "block_tables",
                              r"entry \[1, 1\] = 99 is out of range", False),
    "seq_len past the table": (lambda a: a["seq_lens"].__setitem__(0, 1000), "seq_lens", "sequence 0 has 1000",
                               False),
    "negative seq_len": (lambda a: a["seq_lens"].__setitem__(1, -1), "seq_lens", "sequence 1 has negative", False),
    "query_start_loc end": (lambda a: a.__setitem__("query_start_loc", torch.tensor([0, 1, 1], dtype=torch.int32)),
                            "query_start_loc", "must end at num_tokens = 2", False),
    "query_start_loc decreasing": (lambda a: a.__setitem__("query_start_loc",
                                                           torch.tensor([0, 2, 1, 2][:3], dtype=torch.int32)),
                                   "query_start_loc", "decreases at index 2", False),
    "query head_dim": (lambda a: a.__setitem__("query", a["query"][..., :16].contiguous()), "query",
                       r"dimension 2 must be 32 \(head_dim of key_cache\)", True),
    "query rank": (lambda a: a.__setitem__("query", a["query"][0]), "query", r"expected 3 dims, got shape \(4, 32\)",
                   True),
    "heads not a multiple": (lambda a: a.__setitem__("query", make_query(2, 3, 32, f32, generator(1))), "query",
                             r"num_heads \(3\) must be a positive multiple of num_kv_heads \(2\)", True),
    "decode query count": (lambda a: a.__setitem__("query", make_query(3, 4, 32, f32, generator(1))), "query",
                           "decode", True),
    "cache dtypes differ": (lambda a: a.__setitem__("key_cache", a["key_cache"].to(f16)), "value_cache",
                            "dtype float32 must equal key_cache's float16", True),
    "query vs cache dtype": (lambda a: a.__setitem__("query", a["query"].to(bf16)), "key_cache",
                             r"dtype float32 must be query's dtype \(bfloat16\) or an fp8 dtype", True),
    "value cache blocks": (lambda a: a.__setitem__("value_cache", a["value_cache"][:-1].clone()), "value_cache",
                           "dimension 0", True),
    "head dim not a multiple of 8": (lambda a: (a.__setitem__("key_cache", a["key_cache"][..., :12]),
                                                a.__setitem__("value_cache", a["value_cache"][..., :12]),
                                                a.__setitem__("query", a["query"][..., :12])),
                                     "key_cache", "head_dim must be a positive multiple of 8", True),
    "block tables dtype": (lambda a: a.__setitem__("block_tables", a["block_tables"].to(torch.int16)),
                           "block_tables", "expected int32, got int16", True),
    "seq_lens length": (lambda a: a.__setitem__("seq_lens", a["seq_lens"][:1]), "seq_lens",
                        "dimension 0 must be 2", True),
    "fp8 without scales": (lambda a: (a.__setitem__("key_cache", a["key_cache"].to(e4m3)),
                                      a.__setitem__("value_cache", a["value_cache"].to(e4m3))), "k_scale",
                           "is required when key_cache is fp8", True),
    "fp8 scale length": (lambda a: (a.__setitem__("key_cache", a["key_cache"].to(e5m2)),
                                    a.__setitem__("value_cache", a["value_cache"].to(e5m2)),
                                    a.__setitem__("k_scale", torch.ones(3)), a.__setitem__("v_scale", torch.ones(1))),
                         "k_scale", r"must have 1 element or one per kv head \(2\)", True),
    "sinks length": (lambda a: a.__setitem__("sinks", torch.zeros(3)), "sinks", "dimension 0 must be 4", True),
    "alibi dtype": (lambda a: a.__setitem__("alibi_slopes", torch.zeros(4, dtype=f16)), "alibi_slopes",
                    "expected float32, got float16", True),
    "soft_cap": (lambda a: a.__setitem__("soft_cap", -1.0), "soft_cap", "must be >= 0", True),
    "scale": (lambda a: a.__setitem__("scale", float("inf")), "scale", "must be finite", True),
    "causal None": (lambda a: a.__setitem__("causal", None), "causal",
                    r"expected a bool, got None \(the default is True\)", True),
    "causal int": (lambda a: a.__setitem__("causal", 1), "causal", "expected a bool, got int", True),
}


@pytest.mark.parametrize("case", ATTENTION_ERRORS.values(), ids=ATTENTION_ERRORS.keys())
def test_paged_attention_errors(case):
    mutate, arg, match, at_trace = case
    args = _attention_args()
    mutate(args)
    # Shapes and dtypes fail when tracing (ValueError); index values fail in the CPU handler when the call
    # runs (JaxRuntimeError), before it writes its outputs.
    error = ValueError if at_trace else JaxRuntimeError
    with pytest.raises(error, match=re.escape(f"kvkernels.paged_attention: {arg}: ") + match):
        jax.block_until_ready(jax_ops.paged_attention(**args))


def _write_args():
    kc, vc = randn(4, 4, 2, 16, gen=generator(0)), randn(4, 4, 2, 16, gen=generator(1))
    key, value = randn(2, 2, 16, gen=generator(2)), randn(2, 2, 16, gen=generator(3))
    return key, value, kc, vc


WRITE_ERRORS = {
    "slot out of range": (lambda k, v, kc, vc: (k, v, kc, vc, torch.tensor([3, 16])), "slot_mapping",
                          "slot 16 of token 1 is out of range for a cache of 16 slots", False),
    "slot count": (lambda k, v, kc, vc: (k, v, kc, vc, torch.tensor([3])), "slot_mapping",
                   r"dimension 0 must be 2 \(num_tokens of key\)", True),
    "value heads": (lambda k, v, kc, vc: (k, v[:, :1].contiguous(), kc, vc, torch.tensor([0, 1])), "value",
                    "dimension 1", True),
    "fp8 without scales": (lambda k, v, kc, vc: (k, v, kc.to(e4m3), vc.to(e4m3), torch.tensor([0, 1])), "k_scale",
                           "is required", True),
    "key vs cache dtype": (lambda k, v, kc, vc: (k.to(f16), v.to(f16), kc, vc, torch.tensor([0, 1])), "key_cache",
                           r"dtype float32 must be key's dtype \(float16\)", True),
    "key head dim": (lambda k, v, kc, vc: (k[..., :8].contiguous(), v, kc, vc, torch.tensor([0, 1])), "key",
                     r"dimension 2 must be 16 \(head_dim of key_cache\)", True),
    "block size": (lambda k, v, kc, vc: (k, v, torch.zeros(1, 300, 2, 16), torch.zeros(1, 300, 2, 16),
                                         torch.tensor([0, 1])), "key_cache", r"block size \(dimension 1\) must be in",
                   True),
}


@pytest.mark.parametrize("case", WRITE_ERRORS.values(), ids=WRITE_ERRORS.keys())
def test_reshape_and_cache_errors(case):
    """The error names the argument; the caches (not donated) are unchanged."""
    make, arg, match, at_trace = case
    key, value, kc, vc, slots = make(*_write_args())
    jkc, jvc = jax_ops.to_jax(kc), jax_ops.to_jax(vc)
    before = np.asarray(jkc).copy(), np.asarray(jvc).copy()
    error = ValueError if at_trace else JaxRuntimeError
    with pytest.raises(error, match=re.escape(f"kvkernels.reshape_and_cache: {arg}: ") + match):
        jax.block_until_ready(kj.reshape_and_cache(jax_ops.to_jax(key), jax_ops.to_jax(value), jkc, jvc,
                                                   jax_ops.slots_to_jax(slots)))
    assert np.array_equal(np.asarray(jkc), before[0], equal_nan=True)
    assert np.array_equal(np.asarray(jvc), before[1], equal_nan=True)


def test_reshape_and_cache_failing_jitted_step_writes_nothing():
    """A jitted write whose slots are out of range fails at run time, before any token is written: the
    other (valid) token of the call does not reach the cache either."""
    kc = jnp.zeros((4, 4, 1, 8))
    k = jnp.ones((2, 1, 8))
    step = jax.jit(kj.reshape_and_cache)
    with pytest.raises(JaxRuntimeError, match="slot_mapping: slot 99 of token 1"):
        jax.block_until_ready(step(k, k, kc, kc, jnp.array([0, 99], jnp.int32)))
    assert float(jnp.abs(kc).sum()) == 0


COPY_ERRORS = [
    ([[0, 5]], 0, "block_mapping", "row 0: destination block 5 is out of range", False),
    ([[0, 1], [2, 1]], 0, "block_mapping", "destination block 1 appears more than once", False),
    ([[0, 1], [1, 2]], 0, "block_mapping", "block 1 is both a source and a destination", False),
    ([[-1, 2]], 0, "block_mapping", "row 0: source block -1 is out of range", False),
    ([[0, 1]], 4, "block_dim", "out of range for a 4-dimensional array", True),
    ([[0, 1, 2]], 0, "block_mapping", r"dimension 1 must be 2", True),
]


@pytest.mark.parametrize("pairs,block_dim,arg,match,at_trace", COPY_ERRORS)
def test_copy_blocks_errors(pairs, block_dim, arg, match, at_trace):
    cache = jnp.asarray(np.arange(5 * 2 * 2 * 8, dtype=np.float32).reshape(5, 2, 2, 8))
    before = np.asarray(cache).copy()
    error = ValueError if at_trace else JaxRuntimeError
    with pytest.raises(error, match=re.escape(f"kvkernels.copy_blocks: {arg}: ") + match):
        jax.block_until_ready(kj.copy_blocks(cache, jnp.asarray(pairs, jnp.int32), block_dim=block_dim))
    assert np.array_equal(np.asarray(cache), before)


def test_gather_kv_errors():
    kv = make_paged_kv(seq_lens=[5, 9], num_kv_heads=2, head_dim=16, block_size=4, seed=2)
    args = [jax_ops.to_jax(t) for t in (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)]
    with pytest.raises(JaxRuntimeError, match=re.escape("kvkernels.gather_kv: num_tokens: is 13 but sum(seq_lens) "
                                                        "is 14")):
        jax.block_until_ready(kj.gather_kv(*args, num_tokens=13))
    with pytest.raises(ValueError, match=re.escape("kvkernels.gather_kv: num_tokens: required when seq_lens is "
                                                   "traced")):
        jax.jit(kj.gather_kv)(*args)
    with pytest.raises(ValueError, match=re.escape("kvkernels.gather_kv: out_dtype: must be float32, float16 or "
                                                   "bfloat16, got int32")):
        kj.gather_kv(*args, out_dtype=jnp.int32)
    bad = np.asarray(args[2]).copy()
    bad[1, 2] = 77
    with pytest.raises(JaxRuntimeError, match=re.escape("kvkernels.gather_kv: block_tables: entry [1, 2] = 77")):
        jax.block_until_ready(kj.gather_kv(args[0], args[1], jnp.asarray(bad), args[3]))


def test_static_options_must_be_python_values():
    kv = make_paged_kv(seq_lens=[3], num_kv_heads=1, head_dim=8, block_size=4)
    args = [jax_ops.to_jax(t) for t in (make_query(1, 1, 8, f32, generator(0)), kv.key_cache, kv.value_cache,
                                        kv.block_tables, kv.seq_lens)]
    with pytest.raises(ValueError, match=re.escape("kvkernels.paged_attention: scale: expected a number (a static "
                                                   "Python value), got")):
        jax.jit(lambda s: kj.paged_attention(*args, scale=s))(0.5)


# ---- JAX transformations ----------------------------------------------------------------------

def _decode_inputs(seed=0, num_seqs=3, dtype=jnp.float32):
    kv = make_paged_kv(seq_lens=[7, 20, 1][:num_seqs], num_kv_heads=2, head_dim=32, block_size=8, seed=seed)
    q = make_query(num_seqs, 4, 32, f32, generator(seed + 1))
    return [jax_ops.to_jax(t) for t in (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)]


def test_eval_shape_and_jaxpr_run_nothing():
    """Abstract evaluation of every op: shapes and dtypes without running a kernel (an out-of-range block id
    would fail a run)."""
    q, kc, vc, bt, sl = _decode_inputs()
    bt = bt.at[0, 0].set(10**6)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    out, lse = jax.eval_shape(kj.paged_attention, *map(spec, (q, kc, vc, bt, sl)))
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((3, 4, 32), jnp.float32, (3, 4), jnp.float32)
    new_kc, new_vc = jax.eval_shape(kj.reshape_and_cache, spec(q[:, :2]), spec(q[:, :2]), spec(kc), spec(vc),
                                    jax.ShapeDtypeStruct((3,), jnp.int32))
    assert new_kc.shape == kc.shape and new_vc.dtype == vc.dtype
    key, value = jax.eval_shape(lambda *a: kj.gather_kv(*a, num_tokens=28, out_dtype=jnp.bfloat16),
                                *map(spec, (kc, vc, bt, sl)))
    assert key.shape == (28, 2, 32) and value.dtype == jnp.bfloat16
    assert jax.eval_shape(lambda c: kj.copy_blocks(c, jnp.zeros((2, 2), jnp.int32)), spec(kc)).shape == kc.shape
    jaxpr = jax.make_jaxpr(kj.paged_attention)(q, kc, vc, bt, sl)
    assert [e.primitive.name for e in jaxpr.eqns] == ["kvkernels_paged_attention"]


def test_vmap_over_independent_caches():
    """vmap over a batch of caches (each its own pages, tables, lengths and queries) equals the calls one by
    one; unmapped arguments (shared scales, a shared query) are broadcast, and two nested vmaps work."""
    batch = [_decode_inputs(seed) for seed in (0, 10, 20)]
    stacked = [jnp.stack(x) for x in zip(*batch)]
    out, lse = jax.jit(jax.vmap(kj.paged_attention))(*stacked)
    for i, args in enumerate(batch):
        o, l = kj.paged_attention(*args)
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(o))
        np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(l))
    # The query shared by every cache (in_axes None), options included.
    f = jax.vmap(lambda kc, vc, bt, sl, q: kj.paged_attention(q, kc, vc, bt, sl, soft_cap=3.0),
                 in_axes=(0, 0, 0, 0, None))
    out, _ = f(*stacked[1:], batch[0][0])
    for i, args in enumerate(batch):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(
            kj.paged_attention(batch[0][0], *args[1:], soft_cap=3.0)[0]))
    # Two levels: [2, 3, ...].
    nested = [jnp.stack([x, x[::-1]]) for x in stacked]
    out2, _ = jax.vmap(jax.vmap(kj.paged_attention))(*nested)
    out, _ = jax.vmap(kj.paged_attention)(*stacked)
    np.testing.assert_array_equal(np.asarray(out2[0]), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(out2[1]),
                                  np.asarray(jax.vmap(kj.paged_attention)(*[x[1] for x in nested])[0]))


def test_vmap_of_cache_writes_is_one_in_place_call():
    """reshape_and_cache under vmap: each example writes its own cache, the result equals the writes one by
    one, and a shared (unmapped) cache gives every example its own updated copy."""
    rng = np.random.default_rng(0)
    kc = jnp.asarray(rng.standard_normal((3, 6, 4, 2, 8), np.float32))
    vc = jnp.asarray(rng.standard_normal((3, 6, 4, 2, 8), np.float32))
    key = jnp.asarray(rng.standard_normal((3, 2, 2, 8), np.float32))
    slots = jnp.asarray([[0, 5], [23, -1], [7, 8]], jnp.int32)
    step = jax.jit(jax.vmap(kj.reshape_and_cache), donate_argnums=(2, 3))
    expected = [kj.reshape_and_cache(key[i], key[i] * 2, kc[i], vc[i], slots[i]) for i in range(3)]
    assert [e.primitive.name for e in jax.make_jaxpr(jax.vmap(kj.reshape_and_cache))(
        key, key, kc, vc, slots).eqns] == ["kvkernels_reshape_and_cache"]
    ptr = kc.unsafe_buffer_pointer()
    new_k, new_v = step(key, key * 2, kc, vc, slots)
    assert new_k.unsafe_buffer_pointer() == ptr, "the donated batch of caches was not written in place"
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(new_k[i]), np.asarray(expected[i][0]))
        np.testing.assert_array_equal(np.asarray(new_v[i]), np.asarray(expected[i][1]))
    shared = jnp.zeros((6, 4, 2, 8))
    out_k, _ = jax.vmap(kj.reshape_and_cache, in_axes=(0, 0, None, None, 0))(key, key, shared, shared, slots)
    assert out_k.shape == (3, 6, 4, 2, 8)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(out_k[i]), np.asarray(
            kj.reshape_and_cache(key[i], key[i], shared, shared, slots[i])[0]))


def test_vmap_gather_and_copy_blocks():
    kc = jnp.asarray(np.random.default_rng(1).standard_normal((2, 6, 4, 1, 8), np.float32))
    bt = jnp.asarray([[[3, 1]], [[0, 5]]], jnp.int32)
    sl = jnp.asarray([[6], [5]], jnp.int32)
    key, _ = jax.vmap(lambda a, b, c: kj.gather_kv(a, a, b, c, num_tokens=5))(kc, bt, sl.at[0, 0].set(5))
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(key[i]), np.asarray(
            kj.gather_kv(kc[i], kc[i], bt[i], jnp.asarray([5], jnp.int32), num_tokens=5)[0]))
    mapping = jnp.asarray([[[0, 1]], [[2, 3]]], jnp.int32)
    out = jax.vmap(kj.copy_blocks)(kc, mapping)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(kj.copy_blocks(kc[i], mapping[i])))


def test_no_derivative():
    q, kc, vc, bt, sl = _decode_inputs()
    with pytest.raises(NotImplementedError, match="kvkernels_paged_attention"):
        jax.grad(lambda q: kj.paged_attention(q, kc, vc, bt, sl)[0].sum())(q)


# ---- in place under donation, no host round trip ---------------------------------------------

def _decode_step(q, k, v, kc, vc, bt, sl, slots):
    """One layer of a decode step: write the new tokens' K/V, attend."""
    kc, vc = kj.reshape_and_cache(k, v, kc, vc, slots)
    out, _ = kj.paged_attention(q, kc, vc, bt, sl)
    return out, kc, vc


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_donated_step_writes_caches_in_place(cache_dtype):
    """The jitted step's cache results are the donated input buffers (same pointer), XLA's memory plan for
    the step does not grow with the cache (no copy: temporaries independent of the cache size), and the
    compiled module has no copy of a cache."""
    def run(num_pages):
        kc = jnp.zeros((num_pages, 16, 2, 64), cache_dtype)
        vc = jnp.zeros((num_pages, 16, 2, 64), cache_dtype)
        q = jnp.ones((2, 8, 64), jnp.bfloat16)
        k = jnp.ones((2, 2, 64), jnp.bfloat16)
        bt = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
        sl = jnp.asarray([5, 17], jnp.int32)
        slots = jnp.asarray([16 + 4, 64 + 16], jnp.int32)
        fp8 = cache_dtype == jnp.float8_e4m3fn
        scales = dict(k_scale=jnp.full((1,), 0.5), v_scale=jnp.full((2,), 0.25)) if fp8 else {}

        def step(q, k, kc, vc, bt, sl, slots):
            kc, vc = kj.reshape_and_cache(k, k, kc, vc, slots, **scales)
            out, _ = kj.paged_attention(q, kc, vc, bt, sl, **scales)
            return out, kc, vc

        f = jax.jit(step, donate_argnums=(2, 3))
        compiled = f.lower(q, k, kc, vc, bt, sl, slots).compile()
        ptrs = kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()
        out, kc2, vc2 = f(q, k, kc, vc, bt, sl, slots)
        assert (kc2.unsafe_buffer_pointer(), vc2.unsafe_buffer_pointer()) == ptrs
        assert kc.is_deleted(), "the donated cache is consumed"
        out, kc3, vc3 = f(q, k, kc2, vc2, bt, sl, slots)  # and again: still the same buffers
        assert (kc3.unsafe_buffer_pointer(), vc3.unsafe_buffer_pointer()) == ptrs
        assert float(jnp.abs(kc3[1, 4].astype(jnp.float32)).sum()) > 0
        hlo = compiled.as_text()
        assert " copy(" not in hlo and "copy-start" not in hlo, hlo
        return compiled.memory_analysis()

    small, large = run(64), run(640)
    assert small.temp_size_in_bytes == large.temp_size_in_bytes
    assert large.alias_size_in_bytes >= 2 * 640 * 16 * 2 * 64 * jnp.dtype(cache_dtype).itemsize


def test_decode_step_has_no_host_round_trip():
    """The step is one XLA program: our two custom calls, no Python callback, no host transfer."""
    q, kc, vc, bt, sl = _decode_inputs()
    k = q[:, :2]
    slots = jnp.asarray([7, 30, 40], jnp.int32)
    jaxpr = jax.make_jaxpr(_decode_step)(q, k, k, kc, vc, bt, sl, slots)
    assert [e.primitive.name for e in jaxpr.eqns] == ["kvkernels_reshape_and_cache", "kvkernels_paged_attention"]
    hlo = jax.jit(_decode_step).lower(q, k, k, kc, vc, bt, sl, slots).compile().as_text()
    targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    assert targets == {"kvkernels_reshape_and_cache", "kvkernels_paged_attention"}, targets
    assert "callback" not in hlo and "infeed" not in hlo and "outfeed" not in hlo


# ---- packaging: no torch, the library's symbols --------------------------------------------------

def test_kvkernels_jax_runs_without_torch(jax_library_path):
    """With torch unimportable, `import kvkernels.jax` and an op work (kvkernels/__init__.py skips the torch
    parts); kvkernels.ops then says it needs torch."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import jax.numpy as jnp, kvkernels.jax as kj\n"
        "kc = jnp.ones((2, 4, 1, 8))\n"
        "out, lse = kj.paged_attention(jnp.ones((1, 1, 8)), kc, kc, jnp.zeros((1, 1), jnp.int32),"
        " jnp.full((1,), 3, jnp.int32))\n"
        "assert float(out.sum()) == 8.0, out\n"
        "import kvkernels\n"
        "try:\n    kvkernels.ops\nexcept ImportError as e:\n    print('ImportError:', e)\n"
        "print('torch modules:', sorted(m for m, v in sys.modules.items() if m.startswith('torch') and v))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(jax_library_path.parents[1]))
    assert r.returncode == 0, r.stderr
    assert "ImportError: kvkernels.ops needs torch" in r.stdout and "torch modules: []" in r.stdout, r.stdout


def test_library_links_neither_torch_nor_jaxlib(jax_library_path):
    """XLA passes its API to the handlers at call time, and the kernels need no libtorch: the library needs
    only the C/C++ runtime and exports the four handlers and two helpers, nothing of the kernels."""
    dynamic = subprocess.run(["readelf", "-d", str(jax_library_path)], capture_output=True, text=True,
                             check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert needed and not [n for n in needed if "torch" in n or "c10" in n or "xla" in n or "jax" in n], needed
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(jax_library_path)], capture_output=True,
                             text=True, check=True).stdout
    exported = sorted(s for s in re.findall(r" T (\S+)", symbols) if "kvkernels" in s)
    assert exported == ["kvkernels_jax_copy_blocks_cpu", "kvkernels_jax_cpu_isa", "kvkernels_jax_cpu_threads",
                        "kvkernels_jax_gather_kv_cpu", "kvkernels_jax_paged_attention_cpu",
                        "kvkernels_jax_reshape_and_cache_cpu"], exported


def test_cpu_threads_come_from_xla_pool_and_the_cap(monkeypatch):
    """The handlers run on XLA's intra-op pool (its size as the call saw it), capped by
    KVKERNELS_JAX_CPU_THREADS (read on every call); the reference's answer at any thread count (the KV split
    count follows the threads, so the bytes may differ, as for the torch ops)."""
    import ctypes
    from kvkernels.jax import _library
    lib = _library.load()
    lib.kvkernels_jax_cpu_threads.restype = ctypes.c_int64
    kv, query, _ = make_case("decode", [300, 41, 7], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=16, seed=4)
    monkeypatch.delenv("KVKERNELS_JAX_CPU_THREADS", raising=False)
    run_paged_attention(kv, query, None, op=jax_ops.paged_attention)
    pool = lib.kvkernels_jax_cpu_threads()
    assert pool >= 1 and (pool > 1) == (os.cpu_count() > 1), pool
    monkeypatch.setenv("KVKERNELS_JAX_CPU_THREADS", "1")
    run_paged_attention(kv, query, None, op=jax_ops.paged_attention)
    assert lib.kvkernels_jax_cpu_threads() == 1


def test_cuda_lowering_adds_the_scratch_result(monkeypatch):
    """The CUDA lowering, checked without a GPU (jax.export for platform cuda, the launch planner replaced by a
    recorder): each custom call gets one more result, a uint8 scratch sized from the shapes (the planner's
    split partials for attention, an int64 copy of int32 slots / mappings, gather's token offsets); the cache
    aliases and attributes are those of the CPU lowering. Head dims above 256 are refused for CUDA."""
    from kvkernels.jax import _library

    class Planner:
        calls = []

        def kvkernels_jax_cuda_attention_workspace(self, *args):
            self.calls.append(args)
            return 4096

    _library.load()
    monkeypatch.setitem(_library._STATE, "cuda", Planner())

    def cuda_mlir(fn, *args):
        checks = [jax.export.DisabledSafetyCheck.custom_call(_library.target_name(op)) for op in _library.OPS]
        return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()

    def calls(text, op):
        return re.findall(rf"stablehlo.custom_call @kvkernels_{op}\((.*?)\) \{{(.*?)\}} : \((.*?)\) -> \((.*?)\)",
                          text)

    q, k = jnp.ones((3, 8, 64), jnp.bfloat16), jnp.ones((3, 2, 64), jnp.bfloat16)
    kc = jnp.zeros((9, 16, 2, 64), jnp.float8_e4m3fn)
    bt, sl = jnp.zeros((3, 5), jnp.int32), jnp.ones((3,), jnp.int32)
    s = jnp.ones((1,), jnp.float32)
    text = cuda_mlir(lambda *a: kj.paged_attention(*a, k_scale=s, v_scale=s, soft_cap=2.0), q, kc, kc, bt, sl)
    [(_, attrs, _, results)] = calls(text, "paged_attention")
    assert results.split(", ")[-1] == "tensor<4096xui8>" and results.count("tensor<") == 3, results
    assert "soft_cap = 2.000000e+00 : f32" in attrs and "optional_mask = 24 : i64" in attrs, attrs
    # (num_tokens, num_heads, num_seqs, num_kv_heads, head_dim, head_dim_v, block_size, max_blocks, q format
    #  bf16 = 2, cache format e4m3 = 3, decode)
    assert Planner.calls[-1] == (3, 8, 3, 2, 64, 64, 16, 5, 2, 3, 1)

    kc16 = jnp.zeros((9, 16, 2, 64), jnp.bfloat16)
    text = cuda_mlir(kj.reshape_and_cache, k, k, kc16, kc16, jnp.asarray([0, 5, -1], jnp.int32))
    [(_, attrs, _, results)] = calls(text, "reshape_and_cache")
    assert results.split(", ")[-1] == "tensor<24xui8>", results  # 3 int64 slots
    assert "output_operand_aliases" in attrs and attrs.count("output_operand_alias<") == 2, attrs
    text = cuda_mlir(lambda c: kj.copy_blocks(c, jnp.asarray([[1, 2], [3, 4]], jnp.int32)), kc16)
    [(_, attrs, _, results)] = calls(text, "copy_blocks")
    assert results.split(", ")[-1] == "tensor<32xui8>" and "operand_index = 0" in attrs, (results, attrs)
    text = cuda_mlir(lambda *a: kj.gather_kv(*a, num_tokens=7), kc16, kc16, bt, sl)
    [(_, _, _, results)] = calls(text, "gather_kv")
    assert results.split(", ")[-1] == "tensor<32xui8>", results  # 4 int64 token offsets

    big = jnp.zeros((2, 16, 1, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match=re.escape("kvkernels.paged_attention: key_cache: head_dim 512 is not "
                                                   "supported on CUDA")):
        cuda_mlir(kj.paged_attention, jnp.ones((1, 1, 512), jnp.bfloat16), big, big, bt[:1], sl[:1])


def test_handlers_check_what_they_write():
    """The handlers' own checks of their outputs, reached only by a custom call that kvkernels.jax did not build
    (its wrappers give XLA the right result shapes): out / lse of paged_attention, the updated caches of
    reshape_and_cache and copy_blocks. A wrong one is an error naming it, raised before anything is written."""
    from kvkernels.jax import _library

    _library.load()
    i32, fp = jnp.int32, jnp.float32
    q, kc = jnp.ones((1, 2, 8), fp), jnp.zeros((2, 4, 1, 8), fp)
    bt, sl = jnp.zeros((1, 2), i32), jnp.ones((1,), i32)
    attn = dict(scale=np.float32(0.3), soft_cap=np.float32(0), window_left=np.int64(-1), causal=True,
                optional_mask=np.int64(0), batch_dims=np.int64(0))

    def run(op, results, *args, **attrs):
        call = jax.ffi.ffi_call(_library.target_name(op), results)
        return jax.block_until_ready(call(*args, **attrs))

    good_out, good_lse = jax.ShapeDtypeStruct((1, 2, 8), fp), jax.ShapeDtypeStruct((1, 2), fp)
    out, lse = run("paged_attention", (good_out, good_lse), q, kc, kc, bt, sl, **attn)  # the call itself works
    assert out.shape == (1, 2, 8) and np.isfinite(np.asarray(lse)).all()
    with pytest.raises(JaxRuntimeError, match=re.escape("kvkernels.paged_attention: out: must be [num_tokens, "
                                                        "num_heads, head_dim_v] in the query's dtype, got float32 (1, 2, 16)")):
        run("paged_attention", (jax.ShapeDtypeStruct((1, 2, 16), fp), good_lse), q, kc, kc, bt, sl, **attn)
    with pytest.raises(JaxRuntimeError, match=re.escape("kvkernels.paged_attention: lse: must be float32 "
                                                        "[num_tokens, num_heads], got float16 (1, 2)")):
        run("paged_attention", (good_out, jax.ShapeDtypeStruct((1, 2), jnp.float16)), q, kc, kc, bt, sl, **attn)

    k, slots = jnp.ones((1, 1, 8), fp), jnp.asarray([3], i32)
    wrong_cache = jax.ShapeDtypeStruct((2, 4, 1, 16), fp)
    with pytest.raises(JaxRuntimeError, match=re.escape("kvkernels.reshape_and_cache: key_cache: the updated "
                                                        "cache must have the input cache's dtype and shape")):
        run("reshape_and_cache", (wrong_cache, jax.ShapeDtypeStruct(kc.shape, fp)), k, k, kc, kc, slots,
            optional_mask=np.int64(0), batch_dims=np.int64(0))
    with pytest.raises(JaxRuntimeError, match=re.escape("kvkernels.copy_blocks: cache: the updated cache must "
                                                        "have the input cache's dtype and shape")):
        run("copy_blocks", (wrong_cache,), kc, jnp.asarray([[0, 1]], i32), block_dim=np.int64(0),
            batch_dims=np.int64(0))
    # batch dims: the updated cache is never broadcast (batch 2 over inputs of batch 2, an output of batch 1)
    kc2 = jnp.zeros((2,) + kc.shape, fp)
    with pytest.raises(JaxRuntimeError, match=re.escape("kvkernels.copy_blocks: cache: the updated cache must "
                                                        "have the batch's shape")):
        run("copy_blocks", (jax.ShapeDtypeStruct((1,) + kc.shape, fp),), kc2, jnp.asarray([[[0, 1]], [[1, 0]]], i32),
            block_dim=np.int64(0), batch_dims=np.int64(1))
