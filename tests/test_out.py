"""Caller-provided outputs (docs/ops.md, "Caller-provided outputs"): ``out=`` / ``lse=`` of
paged_attention, mla_paged_attention and merge_attention_states, i.e. the ``*_out`` ops.

On every backend that runs here (the CPU kernels on each ISA path, the Metal kernels through the MSL
emulator, the float64 reference): the given tensors hold exactly the bytes the allocating call returns,
every element is overwritten (two different poisons give the same bytes), strided outputs are written
in place without touching the memory around them, and a wrong shape / dtype / device, an output whose
elements share memory, or one overlapping an input or the other output is an error naming the argument,
raised before anything is written. A compiled decode step writing into preallocated buffers traces
without graph breaks and does not recompile as the sequences grow.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import kvkernels
from helpers import (assert_bytes_equal, assert_close, generator, make_paged_kv, make_paged_mla, make_query,
                     query_start_loc, randn, upcast, use_isa)
from kvkernels import ops, reference
from kvkernels.metal import dispatch

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
ISAS = ["portable", "avx2", "avx512", "avx512vbmi", "avx512bf16", "avx512amx"]  # avx512amx skips without AMX (make amx-emu-test)


# ---- cases: (op, positional args, keyword args, out shape, out dtype, input tensors) -------------------


def pa_case(dtype=f32, mode="decode", layout="NHD", fp8=None, dv=None, q_lens=None, **opts):
    """``dv``: the value's head dim (16 = the key's when None); ``q_lens``: varlen rows per sequence
    (e.g. more queries than keys)."""
    seq_lens = [5, 0, 9, 17]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype, layout=layout,
                       fp8=fp8, seed=3, head_dim_v=dv)
    q_lens = q_lens or ([1] * 4 if mode == "decode" else [3, 0, 4, 17])
    qsl = None if mode == "decode" else query_start_loc(q_lens)
    q = make_query(sum(q_lens), 4, 16, dtype, generator(4))
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl)
    return "paged_attention", args, dict(opts, **kv.scales), (q.shape[0], 4, dv or 16), dtype


def mla_case(dtype=f32, mode="decode", fp8=None):
    m = make_paged_mla([5, 0, 9], 32, 16, 4, dtype=dtype, fp8=fp8, seed=5)
    q_lens = [1, 1, 1] if mode == "decode" else [3, 0, 9]
    q = make_query(sum(q_lens), 4, 48, dtype, generator(6))
    kwargs = dict(kv_lora_rank=32, scale=0.2, kv_scale=m.scale,
                  query_start_loc=None if mode == "decode" else query_start_loc(q_lens))
    return "mla_paged_attention", (q, m.kv_cache, m.block_tables, m.seq_lens), kwargs, (q.shape[0], 4, 32), dtype


def merge_case(dtype=f32):
    gen = generator(7)
    out_a = randn(6, 3, 16, gen=gen, dtype=dtype)
    out_b = randn(3, 6, 16, gen=gen, dtype=dtype).transpose(0, 1)
    lse_a, lse_b = randn(6, 3, gen=gen), randn(6, 3, gen=gen)
    lse_a[0] = float("-inf")
    lse_b[1, 2] = float("inf")  # FlashAttention-2's empty mark
    return "merge_attention_states", (out_a, lse_a, out_b, lse_b), {}, (6, 3, 16), dtype


CASES = {
    "pa-f32-decode": lambda: pa_case(),
    "pa-bf16-varlen-HND-softcap-alibi": lambda: pa_case(bf16, "varlen", "HND", soft_cap=3.0,
                                                        alibi_slopes=torch.tensor([0.5, 0.25, 0.1, 0.0])),
    "pa-f16-decode-e4m3-sinks-window": lambda: pa_case(f16, "decode", "stacked", "e4m3", window_left=6,
                                                       sinks=torch.tensor([0.1, -0.3, 1.0, 0.0])),
    # causal=False through out= (more queries than keys: 9 over 5, 2 over the empty sequence); with Dv != Dk
    "pa-f32-varlen-noncausal": lambda: pa_case(f32, "varlen", q_lens=[9, 2, 4, 17], causal=False),
    "pa-bf16-varlen-HND-dv32-noncausal-window-alibi": lambda: pa_case(
        bf16, "varlen", "HND", dv=32, q_lens=[9, 2, 4, 17], causal=False, window_left=5,
        alibi_slopes=torch.tensor([0.5, 0.25, 0.1, 0.0])),
    "pa-f16-decode-e4m3-dv48-noncausal-sinks": lambda: pa_case(f16, "decode", "stacked", "e4m3", dv=48, causal=False,
                                                               sinks=torch.tensor([0.1, -0.3, 1.0, 0.0])),
    "mla-f32-decode": lambda: mla_case(),
    "mla-bf16-varlen-e5m2": lambda: mla_case(bf16, "varlen", "e5m2"),
    "merge-f32": lambda: merge_case(),
    "merge-bf16": lambda: merge_case(bf16),
}


def functional(backend, op, args, kwargs):
    if backend == "cpu":
        return getattr(ops, op)(*args, **kwargs)
    if backend == "metal":
        return getattr(dispatch, op)(*args, **kwargs)
    return getattr(reference, op)(*args, **kwargs)


def with_outputs(backend, op, args, kwargs, out, lse):
    """The call with caller-provided outputs; returns what the call returns ((out, lse) for the wrappers)."""
    if backend == "cpu":
        return getattr(ops, op)(*args, **kwargs, out=out, lse=lse)
    if backend == "metal":  # the functions registered as the MPS kernels of the *_out ops, on CPU tensors
        assert getattr(dispatch, op + "_out")(*args, **kwargs, out=out, lse=lse) is None
        return out, lse
    return getattr(reference, op)(*args, **kwargs, out=out, lse=lse)


def filled(shape, dtype, value):
    return torch.full(shape, value, dtype=dtype)


BACKENDS = ["cpu", "metal", "reference"]


# ---- results -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_out_is_the_allocating_result(backend, case):
    """Bit-identical to the allocating call, every element of out and lse overwritten (NaN and a finite
    poison give the same bytes), the given tensors returned; out= alone returns (out, None)."""
    op, args, kwargs, shape, dtype = CASES[case]()
    want_out, want_lse = functional(backend, op, args, kwargs)
    for value in (float("nan"), 1234.0):
        out, lse = filled(shape, dtype, value), filled(shape[:2], f32, value)
        got = with_outputs(backend, op, args, kwargs, out, lse)
        assert got[0] is out and got[1] is lse
        assert_bytes_equal(out, want_out, f"{case} out, poison {value}")
        assert_bytes_equal(lse, want_lse, f"{case} lse, poison {value}")
        out = filled(shape, dtype, value)
        got = with_outputs(backend, op, args, kwargs, out, None)
        assert got[0] is out and got[1] is None
        assert_bytes_equal(out, want_out, f"{case} out without lse, poison {value}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["rows-of-a-bigger-buffer", "padded-heads", "transposed"])
@pytest.mark.parametrize("case", ["pa-bf16-varlen-HND-softcap-alibi", "pa-bf16-varlen-HND-dv32-noncausal-window-alibi",
                                  "mla-f32-decode", "merge-bf16"])
def test_strided_outputs(backend, layout, case):
    """Views of larger buffers (vLLM passes rows of its output buffer): written in place, and not one byte
    around them."""
    op, args, kwargs, (t, h, d), dtype = CASES[case]()
    want_out, want_lse = functional(backend, op, args, kwargs)
    if layout == "rows-of-a-bigger-buffer":  # contiguous: the kernels write it directly
        buf, lbuf = filled((t + 3, h * d), dtype, float("nan")), filled((t + 3, h), f32, float("nan"))
        out, lse = buf[:t].view(t, h, d), lbuf[:t]
    elif layout == "padded-heads":
        buf, lbuf = filled((t, h + 1, d + 8), dtype, float("nan")), filled((t, h + 2), f32, float("nan"))
        out, lse = buf[:, 1:, 4:4 + d], lbuf[:, 1:1 + h]
    else:
        buf, lbuf = filled((h, t, d), dtype, float("nan")), filled((h, t), f32, float("nan"))
        out, lse = buf.transpose(0, 1), lbuf.t()
    expect_buf, expect_lbuf = buf.clone(), lbuf.clone()
    if layout == "rows-of-a-bigger-buffer":
        expect_buf[:t].view(t, h, d).copy_(want_out)
        expect_lbuf[:t].copy_(want_lse)
    elif layout == "padded-heads":
        expect_buf[:, 1:, 4:4 + d].copy_(want_out)
        expect_lbuf[:, 1:1 + h].copy_(want_lse)
    else:
        expect_buf.transpose(0, 1).copy_(want_out)
        expect_lbuf.t().copy_(want_lse)
    with_outputs(backend, op, args, kwargs, out, lse)
    assert_bytes_equal(buf, expect_buf, f"{case} {layout}: out's buffer")
    assert_bytes_equal(lbuf, expect_lbuf, f"{case} {layout}: lse's buffer")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", ["pa-f32-decode", "pa-bf16-varlen-HND-softcap-alibi",
                                  "pa-f16-decode-e4m3-sinks-window", "pa-f32-varlen-noncausal",
                                  "pa-bf16-varlen-HND-dv32-noncausal-window-alibi", "mla-bf16-varlen-e5m2",
                                  "merge-bf16"])
def test_every_isa(isa, case, monkeypatch):
    """Each CPU SIMD path: out= gives that path's allocating result bit for bit, and the reference's answer."""
    use_isa(monkeypatch, isa)
    op, args, kwargs, shape, dtype = CASES[case]()
    want_out, want_lse = functional("cpu", op, args, kwargs)
    out, lse = filled(shape, dtype, float("nan")), filled(shape[:2], f32, float("nan"))
    ops_fn = getattr(ops, op)
    ops_fn(*args, **kwargs, out=out, lse=lse)
    assert_bytes_equal(out, want_out, "out")
    assert_bytes_equal(lse, want_lse, "lse")
    ref_args = [upcast(a) if isinstance(a, torch.Tensor) and a.dtype in (f16, bf16, f32) and a.dim() == 3 and
                i == 0 else a for i, a in enumerate(args)]
    if op == "merge_attention_states":
        ref_args[2] = upcast(args[2])
    ref_out, ref_lse = getattr(reference, op)(*ref_args, **kwargs)
    assert_close(out, ref_out, dtype, msg="out vs reference")
    assert_close(lse, ref_lse, f32, msg="lse vs reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["pa-f32-varlen-noncausal", "pa-bf16-varlen-HND-dv32-noncausal-window-alibi"])
def test_out_passes_causal(backend, case):
    """causal=False reaches the kernels through out= (paged_attention_out): the bytes of the allocating
    causal=False call, different from what causal=True writes into the same buffers."""
    op, args, kwargs, shape, dtype = CASES[case]()
    assert kwargs["causal"] is False
    want_out, want_lse = functional(backend, op, args, kwargs)
    causal_out, _ = functional(backend, op, args, dict(kwargs, causal=True))
    out, lse = filled(shape, dtype, float("nan")), filled(shape[:2], f32, float("nan"))
    with_outputs(backend, op, args, kwargs, out, lse)
    assert_bytes_equal(out, want_out, f"{case} out")
    assert_bytes_equal(lse, want_lse, f"{case} lse")
    assert not torch.equal(out, causal_out), "causal=False must change this case's result"
    with_outputs(backend, op, args, dict(kwargs, causal=True), out, lse)
    assert_bytes_equal(out, causal_out, f"{case} out, causal=True")


def test_out_noncausal_compiles():
    """The fake of paged_attention_out takes causal: a compiled causal=False call into given buffers
    (Dv != Dk) matches eager."""
    op, args, kwargs, shape, dtype = CASES["pa-bf16-varlen-HND-dv32-noncausal-window-alibi"]()
    want_out, want_lse = ops.paged_attention(*args, **kwargs)

    def step(*a, out, lse):
        return ops.paged_attention(*a, **kwargs, out=out, lse=lse)

    out, lse = filled(shape, dtype, float("nan")), filled(shape[:2], f32, float("nan"))
    torch.compile(step, backend="aot_eager", fullgraph=True)(*args, out=out, lse=lse)
    assert_bytes_equal(out, want_out, "compiled out")
    assert_bytes_equal(lse, want_lse, "compiled lse")


# ---- bad outputs: errors naming the argument, nothing written -------------------------------------------


def _bad(kind, op, args, shape, dtype):
    """(out, lse, argument the error names) for one kind of bad output."""
    t, h, d = shape
    out, lse = filled(shape, dtype, float("nan")), filled((t, h), f32, float("nan"))
    if kind == "shape":
        return filled((t + 1, h, d), dtype, float("nan")), lse, "out"
    if kind == "empty-out":  # torch would resize it; these ops do not
        return torch.empty(0, dtype=dtype), lse, "out"
    if kind == "lse-shape":
        return out, filled((t, h + 1), f32, float("nan")), "lse"
    if kind == "dtype":
        return filled(shape, torch.float64, float("nan")), lse, "out"
    if kind == "lse-dtype":
        return out, filled((t, h), f16, float("nan")), "lse"
    if kind == "device":
        return torch.empty(shape, dtype=dtype, device="meta"), lse, "out"
    if kind == "expanded":
        return filled((1, h, d), dtype, float("nan")).expand(t, h, d), lse, "out"
    if kind == "lse-expanded":
        return out, filled((t, 1), f32, float("nan")).expand(t, h), "lse"
    if kind == "out-is-an-input":  # the query (same shape), a slice of q (MLA), out_a (an in-place merge)
        first = args[0]
        return (first[..., :d] if op == "mla_paged_attention" else first), lse, \
            {"paged_attention": "query", "mla_paged_attention": "q", "merge_attention_states": "out_a"}[op]
    if kind == "lse-in-a-cache-or-input":
        if op == "merge_attention_states":
            return out, args[3], "lse_b"
        cache = args[1]
        inside = torch.empty(0, dtype=f32).set_(cache.untyped_storage(), cache.storage_offset() *
                                                cache.element_size() // 4, (t, h))  # its first bytes
        return out, inside, "key_cache" if op == "paged_attention" else "kv_cache"
    if kind == "lse-inside-out":  # lse over out's first bytes (any out dtype: D >= 2 makes them enough)
        return out, torch.empty(0, dtype=f32).set_(out.untyped_storage(), 0, (t, h)), "lse"
    raise ValueError(kind)


BAD_KINDS = ["shape", "empty-out", "lse-shape", "dtype", "lse-dtype", "device", "expanded", "lse-expanded",
             "out-is-an-input", "lse-in-a-cache-or-input", "lse-inside-out"]
REFERENCE_CHECKS = {"shape", "empty-out", "lse-shape", "dtype", "lse-dtype", "device"}  # values, not memory


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("case", ["pa-f32-decode", "pa-bf16-varlen-HND-softcap-alibi", "mla-f32-decode",
                                  "merge-f32"])
def test_bad_outputs(backend, kind, case):
    if backend == "reference" and kind not in REFERENCE_CHECKS:
        pytest.skip("the reference checks what it computes with (shapes, dtypes, devices), not memory layouts")
    op, args, kwargs, shape, dtype = CASES[case]()
    out, lse, arg = _bad(kind, op, args, shape, dtype)
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    before = [x.clone() for x in (*inputs, out, lse) if x.device.type != "meta"]
    with pytest.raises(RuntimeError, match=rf"^kvkernels\.{op}: {arg}: "):
        if backend == "cpu" and kind == "device":
            # A meta argument sends the call to the fake kernel (which raises the same error); the CPU
            # kernel's own check is reached by dispatching to it directly.
            cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
            getattr(torch.ops.kvkernels, op + "_out").default.redispatch(cpu, *args, **kwargs, out=out, lse=lse)
        else:
            with_outputs(backend, op, args, kwargs, out, lse)
    after = [x for x in (*inputs, out, lse) if x.device.type != "meta"]
    for b, a in zip(before, after):
        assert_bytes_equal(a, b, "written before the error")


@pytest.mark.parametrize("case", ["pa-f32-decode", "mla-f32-decode", "merge-f32"])
def test_fake_kernels_check_given_outputs(case):
    """The fakes of the *_out ops (what torch.compile traces) reject what the kernels reject first."""
    op, args, kwargs, shape, dtype = CASES[case]()
    for kind in ("shape", "dtype", "device", "lse-shape", "lse-dtype"):
        out, lse, arg = _bad(kind, op, args, shape, dtype)
        with pytest.raises(RuntimeError, match=rf"kvkernels\.{op}: {arg}: "):
            with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
                with_outputs("cpu", op, args, kwargs, out, lse)


@pytest.mark.parametrize("op", ["paged_attention", "mla_paged_attention", "merge_attention_states"])
def test_lse_without_out(op):
    case = {"paged_attention": "pa-f32-decode", "mla_paged_attention": "mla-f32-decode",
            "merge_attention_states": "merge-f32"}[op]
    _, args, kwargs, shape, dtype = CASES[case]()
    for module in (ops, reference):
        with pytest.raises(RuntimeError, match=rf"^kvkernels\.{op}: lse: given without out"):
            getattr(module, op)(*args, **kwargs, lse=filled(shape[:2], f32, 0.0))


def test_empty_batch():
    """No tokens: a [0, H, D] out is valid and nothing is written."""
    kv = make_paged_kv(seq_lens=[], num_kv_heads=2, head_dim=16, block_size=4, seed=1)
    q = torch.empty(0, 4, 16)
    out, lse = torch.empty(0, 4, 16), torch.empty(0, 4)
    assert ops.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, out=out,
                               lse=lse) == (out, lse)


# ---- torch.compile ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_decode_step_into_buffers(backend):
    """A decode step that writes K/V, attends into a preallocated output buffer (no lse) and merges a second
    state into another buffer, as a CUDA-graph-captured step must: one graph, no graph break, no recompile
    while the sequences grow over several blocks, the buffers holding the eager results."""
    torch._dynamo.reset()
    counters.clear()
    s, hq, hkv, d, b, steps = 3, 4, 2, 16, 4, 12
    gen = generator(11)
    width = (3 + steps) // b + 1  # blocks per sequence: room for every step
    key_cache, value_cache = torch.zeros(s * width, b, hkv, d), torch.zeros(s * width, b, hkv, d)
    tables = torch.arange(s * width, dtype=torch.int32).view(s, width).flip(1).contiguous()  # not in order
    lens0 = torch.tensor([1, 2, 3], dtype=torch.int32)
    out_buf, merged, merged_lse = torch.empty(s, hq, d), torch.empty(s, hq, d), torch.empty(s, hq)

    def step(q, k, v, slots, key_cache, value_cache, tables, lens, prev, prev_lse):
        ops.reshape_and_cache(k, v, key_cache, value_cache, slots)
        ops.paged_attention(q, key_cache, value_cache, tables, lens, out=out_buf)  # vLLM's way: no lse
        _, lse = ops.paged_attention(q, key_cache, value_cache, tables, lens)
        ops.merge_attention_states(out_buf, lse, prev, prev_lse, out=merged, lse=merged_lse)
        return merged.sum()

    compiler = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=compiler, fullgraph=True)
    eager_kv = (key_cache.clone(), value_cache.clone())
    try:
        for i in range(steps):
            lens = lens0 + i + 1
            pos = (lens - 1).long()
            slots = tables.long().gather(1, (pos // b)[:, None])[:, 0] * b + pos % b
            q, k, v = (randn(s, h, d, gen=gen) for h in (hq, hkv, hkv))
            prev, prev_lse = randn(s, hq, d, gen=gen), randn(s, hq, gen=gen)
            step(q, k, v, slots, *eager_kv, tables, lens, prev, prev_lse)
            want, want_lse = merged.clone(), merged_lse.clone()
            for t in (out_buf, merged, merged_lse):
                t.fill_(float("nan"))
            compiled(q, k, v, slots, key_cache, value_cache, tables, lens, prev, prev_lse)
            assert_bytes_equal(merged, want, f"step {i}: merged out")
            assert_bytes_equal(merged_lse, want_lse, f"step {i}: merged lse")
            if i == 0:
                torch.compiler.set_stance("fail_on_recompile")
    finally:
        torch.compiler.set_stance("default")
    assert compiler.frame_count == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_bytes_equal(key_cache, eager_kv[0], "key cache")


def test_inductor_writes_into_the_callers_buffer():
    """Inductor re-inplaces the functionalized *_out call: the generated code passes a view of the graph input
    (the caller's buffer) as out, with no clone of it and no copy back."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    kv = make_paged_kv(seq_lens=[5, 9], num_kv_heads=2, head_dim=16, block_size=4, seed=12)
    buf = torch.full((4, 4, 16), float("nan"))

    def step(q, lens):
        ops.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, lens, out=buf[:2])
        return buf[:2].sum()

    q = make_query(2, 4, 16, f32, generator(13))
    _, code = run_and_get_code(torch.compile(step, fullgraph=True), q, kv.seq_lens)
    calls = [line for line in "\n".join(code).splitlines() if "kvkernels.paged_attention_out.default(" in line]
    assert len(calls) == 1 and "out=reinterpret_tensor(arg" in calls[0], calls
    src = "\n".join(code)
    assert ".clone(" not in src and "copy_(" not in src
    want, _ = ops.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    assert_bytes_equal(buf[:2], want, "buffer after the compiled call")


# ---- docs/ops.md, "Conventions": ALiBi after the soft cap ------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_alibi_is_added_after_the_soft_cap(backend):
    """Our order is scale, soft cap, ALiBi (FlashInfer: scale, ALiBi, soft cap). With a tight cap and steep
    slopes the two orders differ by far more than the tolerance: the kernels and the reference match ours."""
    kv = make_paged_kv(seq_lens=[40, 23], num_kv_heads=1, head_dim=16, block_size=8, seed=9)
    q = make_query(2, 2, 16, f32, generator(10), std=3.0)
    slopes, cap, scale = torch.tensor([0.5, 0.125]), 1.5, 0.5
    kwargs = dict(scale=scale, soft_cap=cap, alibi_slopes=slopes)
    out, lse = functional(backend, "paged_attention", (q, kv.key_cache, kv.value_cache, kv.block_tables,
                                                       kv.seq_lens), kwargs)
    want = {}
    for order in ("ours", "flashinfer"):
        rows = []
        for i, n in enumerate(kv.seq_lens.tolist()):
            s = q[i].double() @ kv.keys[i][:, 0].T * scale  # [Hq, n]; one kv head
            alibi = slopes.double()[:, None] * (torch.arange(n, dtype=torch.float64) - (n - 1))
            s = cap * torch.tanh(s / cap) + alibi if order == "ours" else cap * torch.tanh((s + alibi) / cap)
            rows.append(torch.logsumexp(s, -1))
        want[order] = torch.stack(rows).float()
    kr, vr = kv.ref_caches()
    ref_out, ref_lse = reference.paged_attention(upcast(q), kr, vr, kv.block_tables, kv.seq_lens, **kwargs)
    torch.testing.assert_close(ref_lse, want["ours"], rtol=0, atol=1e-5)
    assert (ref_lse - want["flashinfer"]).abs().max() > 0.1, "the two orders must be told apart by this case"
    assert_close(lse, want["ours"], f32, msg="lse (ours)")
    assert (lse - want["flashinfer"]).abs().max() > 0.1, "the two orders must be told apart by this case"
    assert_close(out, ref_out, f32, msg="out")


def test_schema_of_the_out_ops_mirrors_the_allocating_ops():
    """*_out = the allocating op's arguments, then kwarg-only `Tensor(a!) out, Tensor(b!)? lse=None`, -> ()."""
    for op in ("paged_attention", "mla_paged_attention", "merge_attention_states"):
        base = getattr(torch.ops.kvkernels, op).default._schema
        out = getattr(torch.ops.kvkernels, op + "_out").default._schema
        def spelled(args):
            return [(a.name, str(a.type), a.default_value, a.kwarg_only, a.alias_info) for a in args]
        assert spelled(out.arguments[:-2]) == spelled(base.arguments)
        assert [a.name for a in out.arguments[-2:]] == ["out", "lse"]
        assert all(a.kwarg_only and a.alias_info.is_write for a in out.arguments[-2:])
        assert out.arguments[-1].alias_info.before_set != out.arguments[-2].alias_info.before_set
        assert len(out.returns) == 0
    assert kvkernels.ops.paged_attention.__doc__.count("soft cap") >= 1
