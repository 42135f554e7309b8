"""The ONNX Runtime custom ops of libkvkernels_ort.so (csrc/ort/, docs/onnx.md) against kvkernels.reference.

The library is built by the ``ort_library`` fixture (scripts/build_ort.sh, incremental): a machine where it
cannot be built fails these tests, it does not skip them. The ops run through tests/ort_ops.py, which
calls them like ``kvkernels.ops`` (one-node graphs, torch memory bound through IOBinding, outputs
poisoned with NaN), so the checks of tests/test_attention.py and tests/test_cache_ops.py apply unchanged.
"""

import re

import onnxruntime as ort
import pytest
import torch

import ort_ops
from helpers import generator, make_paged_kv, make_query, poison, randn, use_isa
from kvkernels import reference
from test_attention import make_case, run_paged_attention
from test_causal import BINDING_CASES, check_binding_case, mixed_case
from test_cache_ops import check_gather_kv, check_reshape_and_cache

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(scope="module", autouse=True)
def ort_library(ort_library_path):
    ort_ops.use_library(ort_library_path)


# ---- PagedAttention ---------------------------------------------------------------------------

# id: mode, dtype, fp8, per-head scales, Hq, Hkv, D, block size, layout, extra kwargs
ATTENTION = {
    "decode-f32-mha": ("decode", f32, None, False, 4, 4, 64, 16, "NHD", {}),
    "decode-f16-gqa4-window": ("decode", f16, None, False, 8, 2, 128, 3, "NHD", dict(window_left=5)),
    "decode-bf16-mqa-softcap": ("decode", bf16, None, False, 6, 1, 72, 1, "stacked", dict(soft_cap=7.5)),
    "decode-f32-e4m3-head-sinks": ("decode", f32, "e4m3", True, 8, 2, 32, 16, "NHD",
                                   dict(sinks=torch.linspace(-2, 3, 8))),
    "decode-bf16-e5m2-alibi": ("decode", bf16, "e5m2", False, 4, 2, 64, 5, "NHD",
                               dict(alibi_slopes=torch.linspace(0.05, 0.6, 4))),
    "varlen-f32-gqa2-scale": ("varlen", f32, None, False, 4, 2, 32, 4, "NHD", dict(scale=0.3)),
    "varlen-f16-gqa8-window-softcap": ("varlen", f16, None, False, 16, 2, 64, 16, "stacked",
                                       dict(window_left=3, soft_cap=5.0)),
    "varlen-bf16-e4m3-sinks": ("varlen", bf16, "e4m3", (True, False), 8, 8, 128, 16, "NHD",
                               dict(sinks=torch.linspace(-1, 1, 8))),
}
SEQ_LENS = [1, 17, 40, 0, 5, 33]  # partial blocks, an empty sequence (decode), several blocks


@pytest.mark.parametrize("case", ATTENTION.values(), ids=ATTENTION.keys())
def test_paged_attention(case):
    mode, dtype, fp8, per_head, hq, hkv, d, b, layout, extra = case
    seq_lens = SEQ_LENS if mode == "decode" else [n for n in SEQ_LENS if n]  # varlen: every row has keys
    kv, query, qsl = make_case(mode, seq_lens, dtype=dtype, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                               block_size=b, layout=layout, fp8=fp8, per_head=per_head, seed=hash(case[:4]) % 97)
    run_paged_attention(kv, query, qsl, op=ort_ops.paged_attention, **extra)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512", "avx512vbmi", "avx512bf16", "avx512amx"])
@pytest.mark.parametrize("mode", ["decode", "varlen"])
def test_paged_attention_isa_paths(isa, mode, monkeypatch):
    """Every SIMD path of the library gives the reference's answer (KVKERNELS_CPU_ISA is read by the
    library on every call, as by the torch extension)."""
    use_isa(monkeypatch, isa)
    kv, query, qsl = make_case(mode, [3, 40, 18], dtype=bf16, num_heads=8, num_kv_heads=2, head_dim=64,
                               block_size=16, fp8="e4m3", per_head=True, seed=11)
    run_paged_attention(kv, query, qsl, op=ort_ops.paged_attention, soft_cap=9.0)
    kv, query, qsl = make_case(mode, [70, 1], dtype=f32, num_heads=4, num_kv_heads=4, head_dim=32,
                               block_size=5, seed=12)
    run_paged_attention(kv, query, qsl, op=ort_ops.paged_attention, window_left=20)


@pytest.mark.parametrize("head_dim", [264, 512])
def test_paged_attention_large_head_dims(head_dim):
    """Head dims up to 512, as the CPU kernels (and the torch CPU op) take them."""
    kv, query, qsl = make_case("varlen", [9, 20], dtype=bf16, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                               block_size=8, seed=21)
    run_paged_attention(kv, query, qsl, op=ort_ops.paged_attention)


def test_paged_attention_fresh_inputs_each_call():
    """Several calls of one session on fresh random inputs (the session and its thread-local scratch are
    reused across calls)."""
    for seed in range(4):
        kv, query, qsl = make_case("decode", [seed * 7 + 1, 30, 2], dtype=f32, num_heads=4, num_kv_heads=2,
                                   head_dim=32, block_size=8, seed=100 + seed)
        run_paged_attention(kv, query, qsl, op=ort_ops.paged_attention)


# ---- causal attribute (torch's causal=False) and sequences with more queries than keys -----------

@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("case", BINDING_CASES.values(), ids=BINDING_CASES.keys())
def test_paged_attention_causal_attribute(case, causal):
    """The ``causal`` attribute against kvkernels.reference, varlen rows with q_len <, = and > seq_len
    (test_causal.check_binding_case)."""
    check_binding_case(ort_ops.paged_attention, case, causal)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512", "avx512vbmi", "avx512bf16", "avx512amx"])
def test_paged_attention_noncausal_isa_paths(isa, monkeypatch):
    """causal=0 on every SIMD path of the library (decode and varlen; bf16 over e4m3 takes the AMX tiles
    where the CPU has them)."""
    use_isa(monkeypatch, isa)
    kv, query, qsl, _, _ = mixed_case((bf16, "e4m3", True, "NHD", 8, 2, 64, 16, None), seed=7)
    run_paged_attention(kv, query, qsl, op=ort_ops.paged_attention, causal=False, window_left=9)
    kv, query, qsl = make_case("decode", [3, 40, 0, 18], dtype=f32, num_heads=4, num_kv_heads=4, head_dim=32,
                               block_size=5, seed=13)
    run_paged_attention(kv, query, qsl, op=ort_ops.paged_attention, causal=False, soft_cap=9.0)


# ---- cache ops --------------------------------------------------------------------------------

WRITE = {
    "f32-NHD": (f32, None, False, "NHD"),
    "bf16-stacked": (bf16, None, False, "stacked"),
    "f16-NHD": (f16, None, False, "NHD"),
    "bf16->e4m3-tensor-NHD": (bf16, "e4m3", False, "NHD"),
    "f16->e5m2-head-stacked": (f16, "e5m2", True, "stacked"),
    "f32->e4m3-k-head-v-tensor-NHD": (f32, "e4m3", (True, False), "NHD"),
}


@pytest.mark.parametrize("case", WRITE.values(), ids=WRITE.keys())
def test_reshape_and_cache(case):
    check_reshape_and_cache(case, op=ort_ops.reshape_and_cache)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_cache_ops_isa_paths(isa, monkeypatch):
    """The row kernels (cache writes with fp8 quantization, gathers with dequantization) of every ISA."""
    use_isa(monkeypatch, isa)
    check_reshape_and_cache((bf16, "e4m3", True, "NHD"), op=ort_ops.reshape_and_cache)
    check_reshape_and_cache((f32, None, False, "stacked"), op=ort_ops.reshape_and_cache)
    check_gather_kv((f16, "e5m2", True, "NHD", 3, f32, False), op=ort_ops.gather_kv)


def test_reshape_and_cache_in_place():
    """The updated caches are the input buffers (the op's alias map): nothing is copied."""
    kc, vc = poison(torch.empty(6, 4, 2, 16)), poison(torch.empty(6, 4, 2, 16))
    key, value = randn(3, 2, 16, gen=generator(0)), randn(3, 2, 16, gen=generator(1))
    ort_ops.reshape_and_cache(key, value, kc, vc, torch.tensor([0, 9, 23]))
    assert ort_ops.last_output_ptrs == [kc.data_ptr(), vc.data_ptr()]
    assert torch.equal(kc[2, 1], key[1]) and torch.equal(vc[5, 3], value[2])


GATHER = {
    "f32-NHD": (f32, None, False, "NHD", 16, None, False),
    "f16-stacked-to-f32": (f16, None, False, "stacked", 16, f32, False),
    "e4m3-tensor-default-bf16": (bf16, "e4m3", False, "NHD", 16, None, False),
    "e5m2-head-to-f32": (f32, "e5m2", True, "NHD", 3, f32, True),
    "e4m3-head-stacked-to-f16": (f16, "e4m3", True, "stacked", 1, f16, False),
}


@pytest.mark.parametrize("case", GATHER.values(), ids=GATHER.keys())
def test_gather_kv(case):
    check_gather_kv(case, op=ort_ops.gather_kv)


@pytest.mark.parametrize("dtype", [f32, bf16, e4m3])
def test_copy_blocks(dtype):
    gen = generator(3)
    cache = randn(9, 4, 2, 8, gen=gen).to(dtype)
    pairs = torch.tensor([[1, 7], [4, 0], [1, 3]])
    expected = cache.clone()
    reference.copy_blocks(expected, pairs)
    ort_ops.copy_blocks(cache, pairs)
    assert ort_ops.last_output_ptrs == [cache.data_ptr()]
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_copy_blocks_stacked_block_dim():
    """A stacked [L, 2, N, B, H, D] allocation: block_dim=2 copies the block in every layer, K and V."""
    cache = randn(3, 2, 6, 4, 2, 8, gen=generator(4))
    pairs = torch.tensor([[5, 1], [0, 2]])
    expected = cache.clone()
    reference.copy_blocks(expected, pairs, block_dim=2)
    ort_ops.copy_blocks(cache, pairs, block_dim=-4)
    assert torch.equal(cache, expected)


# ---- errors: an ORT status naming the input, nothing written ------------------------------------

def _attention_args():
    kv = make_paged_kv(seq_lens=[5, 20], num_kv_heads=2, head_dim=32, block_size=8, seed=5)
    query = make_query(2, 4, 32, f32, generator(6))
    return dict(query=query, key_cache=kv.key_cache, value_cache=kv.value_cache, block_tables=kv.block_tables,
                seq_lens=kv.seq_lens)


# ORT raises InvalidArgument from run(), RuntimeError("Error in execution: ...") from run_with_iobinding();
# the message carries the op's status either way.
ORT_ERRORS = (RuntimeError, ort.capi.onnxruntime_pybind11_state.InvalidArgument)


def _expect_error(fn, op, arg, match):
    with pytest.raises(ORT_ERRORS, match=re.escape(f"kvkernels.{op}: {arg}: ") + match):
        fn()


ATTENTION_ERRORS = {
    "block id out of range": (lambda a: a["block_tables"].__setitem__((1, 1), 99), "block_tables", "entry"),
    "seq_len past the table": (lambda a: a["seq_lens"].__setitem__(0, 1000), "seq_lens", "sequence 0 has 1000"),
    "negative seq_len": (lambda a: a["seq_lens"].__setitem__(1, -1), "seq_lens", "sequence 1 has negative"),
    "query head_dim": (lambda a: a.__setitem__("query", a["query"][..., :16].contiguous()), "query",
                       "dimension 2 must be 32"),
    "heads not a multiple": (lambda a: a.__setitem__("query", make_query(2, 3, 32, f32, generator(1))), "query",
                             r"num_heads \(3\)"),
    "decode query count": (lambda a: a.__setitem__("query", make_query(3, 4, 32, f32, generator(1))), "query",
                           "decode"),
    "cache dtype": (lambda a: a.__setitem__("key_cache", a["key_cache"].to(f16)), "value_cache",
                    "dtype float32 must equal key_cache's float16"),
    "query vs cache dtype": (lambda a: a.__setitem__("query", a["query"].to(bf16)), "key_cache",
                             "must have the query's type"),
    "value cache shape": (lambda a: a.__setitem__("value_cache", a["value_cache"][:-1].clone()), "value_cache",
                          "dimension 0"),
    "fp8 without scales": (lambda a: (a.__setitem__("key_cache", a["key_cache"].to(e4m3)),
                                      a.__setitem__("value_cache", a["value_cache"].to(e4m3))), "k_scale",
                           "is required"),
    "sinks length": (lambda a: a.__setitem__("sinks", torch.zeros(3)), "sinks", "dimension 0 must be 4"),
    "soft_cap": (lambda a: a.__setitem__("soft_cap", -1.0), "soft_cap", "must be >= 0"),
    "query_start_loc end": (lambda a: a.__setitem__("query_start_loc", torch.tensor([0, 1, 1], dtype=torch.int32)),
                            "query_start_loc", "must end at"),
    "causal not 0 or 1": (lambda a: a.__setitem__("causal", 2), "causal", "must be 0 or 1, got 2"),
}


@pytest.mark.parametrize("case", ATTENTION_ERRORS.values(), ids=ATTENTION_ERRORS.keys())
def test_paged_attention_errors(case, monkeypatch):
    mutate, arg, match = case
    args = _attention_args()
    mutate(args)
    written = []
    real_run = ort_ops.run

    def spy(op, inputs, outputs, **attrs):  # keeps the poisoned outputs to check after the failure
        written.extend(t for _, t, _ in outputs)
        return real_run(op, inputs, outputs, **attrs)

    monkeypatch.setattr(ort_ops, "run", spy)
    _expect_error(lambda: ort_ops.paged_attention(**args), "PagedAttention", arg, match)
    assert written and all(torch.isnan(t).all() for t in written), "an output was written before the error"


def test_reshape_and_cache_errors():
    kc, vc = randn(4, 4, 2, 16, gen=generator(0)), randn(4, 4, 2, 16, gen=generator(1))
    before = kc.clone(), vc.clone()
    key, value = randn(2, 2, 16, gen=generator(2)), randn(2, 2, 16, gen=generator(3))
    cases = [
        (lambda: ort_ops.reshape_and_cache(key, value, kc, vc, torch.tensor([3, 16])), "slot_mapping",
         "slot 16 of token 1 is out of range"),
        (lambda: ort_ops.reshape_and_cache(key, value, kc, vc, torch.tensor([3])), "slot_mapping", "dimension 0"),
        (lambda: ort_ops.reshape_and_cache(key, value[:, :1].contiguous(), kc, vc, torch.tensor([0, 1])), "value",
         "dimension 1"),
        (lambda: ort_ops.reshape_and_cache(key, value, kc.to(e4m3), vc.to(e4m3), torch.tensor([0, 1])), "k_scale",
         "is required"),
        (lambda: ort_ops.reshape_and_cache(key.to(f16), value.to(f16), kc, vc, torch.tensor([0, 1])), "key_cache",
         "must have key's type"),
    ]
    for fn, arg, match in cases:
        _expect_error(fn, "ReshapeAndCache", arg, match)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), f"{arg}: a cache was written"


def test_reshape_and_cache_rejects_one_buffer_for_both_caches():
    """key_cache and value_cache bound to one buffer: the op would write K over V."""
    kc = randn(4, 4, 2, 16, gen=generator(0))
    before = kc.clone()
    key = randn(1, 2, 16, gen=generator(2))
    ins = [("key", key), ("value", key.clone()), ("key_cache", kc), ("value_cache", kc),
           ("slot_mapping", torch.tensor([0])), ("k_scale", None), ("v_scale", None)]
    sess_inputs = [(n, t) for n, t in ins]
    _expect_error(lambda: ort_ops.run("ReshapeAndCache", sess_inputs,
                                      [("key_cache_out", kc, "key_cache"), ("value_cache_out", kc, "value_cache")]),
                  "ReshapeAndCache", "value_cache", "shares memory with key_cache")
    assert torch.equal(kc, before)


def test_copy_blocks_errors():
    cache = randn(5, 2, 2, 8, gen=generator(0))
    before = cache.clone()
    for pairs, arg, match in [([[0, 5]], "block_mapping", "row 0: destination block 5 is out of range"),
                              ([[0, 1], [2, 1]], "block_mapping", "destination block 1 appears more than once"),
                              ([[0, 1], [1, 2]], "block_mapping", "block 1 is both a source and a destination")]:
        _expect_error(lambda: ort_ops.copy_blocks(cache, torch.tensor(pairs)), "CopyBlocks", arg, match)
    _expect_error(lambda: ort_ops.copy_blocks(cache, torch.tensor([[0, 1]]), block_dim=4), "CopyBlocks",
                  "block_dim", "4 is out of range")
    assert torch.equal(cache, before)


def test_gather_kv_errors():
    kv = make_paged_kv(seq_lens=[5, 9], num_kv_heads=2, head_dim=16, block_size=4, seed=2)
    kv.block_tables[1, 2] = 77
    _expect_error(lambda: ort_ops.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens),
                  "GatherKV", "block_tables", r"entry \[1, 2\] = 77")


def test_library_links_neither_torch_nor_onnxruntime(ort_library_path):
    """ORT passes its API table at load time; the kernels need no libtorch: the library's only
    dependencies are the C/C++ runtime, and it exports one symbol, RegisterCustomOps."""
    import subprocess
    dynamic = subprocess.run(["readelf", "-d", str(ort_library_path)], capture_output=True, text=True,
                             check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert needed and not [n for n in needed if "torch" in n or "onnxruntime" in n or "c10" in n], needed
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(ort_library_path)], capture_output=True,
                             text=True, check=True).stdout.split()
    assert "RegisterCustomOps" in symbols
    assert not [s for s in symbols if "kvkernels" in s], "kernel symbols must stay hidden"
