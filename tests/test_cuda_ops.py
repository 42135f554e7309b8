"""What only a CUDA device can show, beyond the device-parametrized correctness tests of
test_cache_ops.py / test_mla.py: merge_attention_states on CUDA, opcheck on CUDA tensors, bad input on
CUDA (debug mode and not), the vector-width fallbacks, swap_blocks' paths and their errors, work on a
side stream, CUDA-graph capture (by hand and through torch.compile(mode="reduce-overhead")), and the
compiled decode step.

Every test skips without a CUDA device, and an op without a CUDA kernel in this build skips with that
reason (paged_attention and the MLA attention ops get theirs in other files: their tests here start
running as soon as they exist).
"""

import os

import pytest
import torch

import kvkernels  # noqa: F401
import test_opcheck
import test_validation
from helpers import (FP8_DTYPES, assert_bytes_equal, assert_close, assert_within_ulps, generator, has_kernel,
                     make_scale, randn, require_kernel, to_device, upcast)
from kvkernels import ops, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")
f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
CUDA = "cuda"


def moved(value):
    """Tensors copied to CUDA with their strides; everything else as it is (also inside tuples/lists)."""
    if isinstance(value, (tuple, list)):
        return type(value)(moved(v) for v in value)
    if isinstance(value, dict):
        return {k: moved(v) for k, v in value.items()}
    return to_device(value, CUDA)


@pytest.fixture
def debug(monkeypatch):
    """KVKERNELS_DEBUG=1 for one test: index ranges are checked on host copies before any launch."""
    monkeypatch.setenv("KVKERNELS_DEBUG", "1")


# ----------------------------------------------------------------------------------------------------
# merge_attention_states
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 6], ids=["vector", "scalar"])
@pytest.mark.parametrize("dtype", [f32, f16, bf16])
def test_merge_attention_states(dtype, head_dim):
    require_kernel("merge_attention_states", CUDA)
    gen = generator(21)
    t, h, d = 9, 4, head_dim
    out_a = randn(t, h, d, gen=gen, dtype=dtype)
    out_b = randn(h, t, d, gen=gen, dtype=dtype).transpose(0, 1)  # non-contiguous input
    lse_a = randn(t, h, gen=gen, std=3.0)
    lse_b = randn(h, t, gen=gen, std=3.0).t()  # non-contiguous lse
    lse_a[0] = float("-inf")  # only b saw keys
    lse_b[1] = float("-inf")  # only a saw keys
    lse_a[2, :2] = lse_b[2, :2] = float("-inf")  # neither: out = 0, lse = -inf
    lse_a[3], lse_b[3] = 1000.0, 999.0  # exp would overflow without the max shift
    lse_a[4], lse_b[4] = -1000.0, 30.0
    out_a[0, 1, 0] = float("nan")  # weight 0: must not leak into the output
    out, lse = ops.merge_attention_states(*moved((out_a, lse_a, out_b, lse_b)))
    assert out.is_cuda and out.dtype == dtype and out.shape == (t, h, d) and out.is_contiguous()
    assert lse.dtype == f32 and lse.shape == (t, h)
    ref_out, ref_lse = reference.merge_attention_states(upcast(out_a), lse_a, upcast(out_b), lse_b)
    assert_close(out, ref_out, dtype, msg="out")
    assert_close(lse, ref_lse, f32, msg="lse")
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(out[2, :2], torch.zeros(2, d, dtype=dtype)) and torch.isneginf(lse[2, :2]).all()
    assert torch.equal(out[0], out_b[0]) and torch.equal(out[1], out_a[1])  # weights exactly 1 and 0
    # Against the CPU kernel: the same merge_weights and one rounding, but CUDA's expf is specified to
    # 2 ulp (glibc's to < 1), so a weight may differ by an ulp, which flips the rounding of an element
    # now and then (1-2 per case on this data in fp16 / bf16): 1 ulp of the output dtype.
    cpu_out, _ = ops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    if dtype == f32:
        torch.testing.assert_close(out.double(), cpu_out.double(), rtol=2e-6, atol=2e-6, equal_nan=True)
    else:
        assert_within_ulps(out, cpu_out, 1, msg="out vs the CPU kernel")


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_merge_attention_states_out(dtype):
    """out= / lse= on CUDA: bit-identical to the allocating call, every element written (NaN-poisoned), a
    transposed out and a row slice of a bigger lse written in place with the rows around untouched."""
    require_kernel("merge_attention_states", CUDA)
    gen = generator(23)
    t, h, d = 7, 3, 40
    args = moved((randn(t, h, d, gen=gen, dtype=dtype), randn(t, h, gen=gen, std=3.0),
                  randn(t, h, d, gen=gen, dtype=dtype), randn(t, h, gen=gen, std=3.0)))
    args[1][0] = float("-inf")  # one side empty
    want_out, want_lse = ops.merge_attention_states(*args)
    out = torch.full((h, t, d), float("nan"), dtype=dtype, device=CUDA).transpose(0, 1)
    lbuf = torch.full((t + 3, h), float("nan"), dtype=f32, device=CUDA)
    got_out, got_lse = ops.merge_attention_states(*args, out=out, lse=lbuf[1:1 + t])
    torch.cuda.synchronize()
    assert got_out is out and got_lse.data_ptr() == lbuf[1:1 + t].data_ptr()
    assert_bytes_equal(out, want_out, "out")
    assert_bytes_equal(lbuf[1:1 + t], want_lse, "lse")
    assert lbuf[0].isnan().all() and lbuf[1 + t:].isnan().all()
    out_only = torch.full_like(want_out, float("nan"))
    got_out, got_lse = ops.merge_attention_states(*args, out=out_only)
    assert got_lse is None
    assert_bytes_equal(out_only, want_out, "out without lse")


# ----------------------------------------------------------------------------------------------------
# opcheck on CUDA tensors (the samples of test_opcheck.py, moved with their strides)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op,build", test_opcheck.CASES)
def test_opcheck_cuda(op, build):
    require_kernel(op, CUDA)
    args, kwargs = build()
    args, kwargs = moved(args), moved(kwargs)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if test_opcheck.has_fp8(args, kwargs):
        utils = utils[1:]  # see test_opcheck.test_opcheck: allclose has no fp8 kernel
    torch.library.opcheck(getattr(torch.ops.kvkernels, op).default, args, kwargs, test_utils=utils)


def test_opcheck_swap_blocks_to_pinned_host():
    require_kernel("swap_blocks", CUDA)
    gen = generator(6)
    src = randn(4, 4, 2, 8, gen=gen, dtype=bf16).cuda()
    dst = randn(7, 4, 2, 8, gen=gen, dtype=bf16).pin_memory()
    torch.library.opcheck(torch.ops.kvkernels.swap_blocks.default, (src, dst, torch.tensor([[0, 6], [3, 1]])),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ----------------------------------------------------------------------------------------------------
# bad input on CUDA (the cases of test_validation.py)
# ----------------------------------------------------------------------------------------------------

# Cases whose fault is in the *values* of an index tensor: on CUDA the host sees them only in debug mode
# (reading device data is a sync). Without it the kernels skip what is out of range instead of
# touching memory outside the tensors (or, for attention, do whatever their binding documents).
VALUE_FAULTS = ("out-of-range", "negative-id", "duplicate-dst", "dst-is-", "id-beyond", "block-id-",
                "seq_len-over", "seq_len-negative", "num_tokens-wrong", "qsl-first", "qsl-decreasing",
                "qsl-last", "qsl-more")
BAD_CASES = [pytest.param(*p.values, id=p.id) for p in test_validation.CASES]


def run_bad_case(op, base, mutate, arg, api):
    require_kernel(op, CUDA)
    kwargs = test_validation.BUILDERS[op](**base)
    mutate(kwargs)
    kwargs = moved(kwargs)
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError, match=rf"kvkernels\.{op}: ({arg}):"):
        test_validation.call(api, op, kwargs)
    torch.cuda.synchronize()
    for name, old in before.items():  # nothing written, not even partly
        assert_bytes_equal(kwargs[name], old, msg=f"{name} changed")


@pytest.mark.parametrize("api", test_validation.APIS)
@pytest.mark.parametrize("op,base,mutate,arg", BAD_CASES)
def test_bad_input_debug(op, base, mutate, arg, api, debug):
    """KVKERNELS_DEBUG=1: every case of test_validation raises before anything is written."""
    run_bad_case(op, base, mutate, arg, api)


@pytest.mark.parametrize("op,base,mutate,arg", BAD_CASES)
def test_bad_input_no_debug(request, op, base, mutate, arg):
    """Without debug mode: every case but the index-value ones still raises first; those run without
    touching memory outside the tensors (the device stays healthy)."""
    if any(fault in request.node.callspec.id for fault in VALUE_FAULTS):
        require_kernel(op, CUDA)
        kwargs = test_validation.BUILDERS[op](**base)
        mutate(kwargs)
        kwargs = moved(kwargs)
        try:
            test_validation.call("torch.ops", op, kwargs)
        except RuntimeError as e:  # an op may still see it without a sync (e.g. gather_kv's count)
            assert f"kvkernels.{op}:" in str(e)
        torch.cuda.synchronize()  # an out-of-bounds access would surface here
        return
    run_bad_case(op, base, mutate, arg, "torch.ops")


def test_mapping_on_cpu_is_always_checked():
    """A block_mapping on the CPU is read by the host anyway: checked without debug mode."""
    require_kernel("copy_blocks", CUDA)
    cache = torch.zeros(6, 4, 2, 8, device=CUDA)
    with pytest.raises(RuntimeError, match=r"kvkernels\.copy_blocks: block_mapping: .*out of range"):
        ops.copy_blocks(cache, torch.tensor([[0, 3], [1, 6]]))
    with pytest.raises(RuntimeError, match=r"kvkernels\.copy_blocks: block_mapping: .*both a source"):
        ops.copy_blocks(cache, torch.tensor([[0, 3], [3, 4]]))


def test_out_of_range_slot_is_skipped_without_debug():
    require_kernel("reshape_and_cache", CUDA)
    key = torch.ones(3, 2, 8, device=CUDA)
    kc, vc = torch.zeros(2, 4, 2, 8, device=CUDA), torch.zeros(2, 4, 2, 8, device=CUDA)
    ops.reshape_and_cache(key, key, kc, vc, torch.tensor([1, 8, 2**40], device=CUDA))
    assert kc.view(8, 16).sum(1).tolist() == [0, 16, 0, 0, 0, 0, 0, 0]


def test_swap_pageable_host_with_device_mapping_fails():
    require_kernel("swap_blocks", CUDA)
    src, dst = torch.ones(4, 8, device=CUDA), torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match=r"kvkernels\.swap_blocks: dst: host memory must be pinned"):
        ops.swap_blocks(src, dst, torch.tensor([[0, 1]], device=CUDA))
    assert dst.eq(0).all()


def test_swap_across_cuda_devices_fails():
    require_kernel("swap_blocks", CUDA)
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    with pytest.raises(RuntimeError, match=r"kvkernels\.swap_blocks: dst: .*different CUDA devices"):
        ops.swap_blocks(torch.ones(4, 8, device="cuda:0"), torch.zeros(4, 8, device="cuda:1"),
                        torch.tensor([[0, 1]]))


# ----------------------------------------------------------------------------------------------------
# vector-width fallbacks: rows, strides or addresses that a 16-byte access does not fit
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
def test_reshape_and_cache_scalar_path(cache):
    """head_dim 12 in bfloat16: 24-byte rows, no 16-byte vector; the scalar kernel runs."""
    require_kernel("reshape_and_cache", CUDA)
    gen = generator(3)
    key, value = randn(9, 2, 12, gen=gen, dtype=bf16), randn(9, 2, 12, gen=gen, dtype=bf16)
    cache_dtype = FP8_DTYPES.get(cache, bf16)
    scales = dict(k_scale=make_scale(2, True, gen), v_scale=make_scale(2, False, gen)) if cache != "bf16" else {}
    caches = [torch.zeros(4, 3, 2, 12, dtype=cache_dtype) for _ in range(2)]
    slots = torch.tensor([0, 5, -1, 11, 2, 7, 1, 3, 4])
    dev = moved(caches)
    ops.reshape_and_cache(key.cuda(), value.cuda(), *dev, slots.cuda(), **moved(scales))
    reference.reshape_and_cache(key, value, *caches, slots, **scales)
    assert_bytes_equal(dev[0], caches[0])
    assert_bytes_equal(dev[1], caches[1])


def test_copy_blocks_odd_alignment():
    """A view 3 bytes into its storage with 5-byte rows: 1-byte accesses."""
    require_kernel("copy_blocks", CUDA)
    whole = torch.randint(0, 255, (9 * 4 * 8 + 3,), dtype=torch.uint8, generator=generator(4))
    expected = whole.clone()
    ev = expected[3:].view(9, 4, 8)[..., :5]
    pairs = [(0, 1), (3, 2), (3, 7), (5, 8), (6, 4)]
    for s, d in pairs:
        ev[d] = ev[s].clone()
    dev = whole.cuda()
    ops.copy_blocks(dev[3:].view(9, 4, 8)[..., :5], torch.tensor(pairs, device=CUDA))
    assert_bytes_equal(dev, expected)


# ----------------------------------------------------------------------------------------------------
# streams and CUDA graphs
# ----------------------------------------------------------------------------------------------------


class CacheStep:
    """Static buffers for one cache-op step: write new K/V into a stacked cache, copy-on-write two
    blocks (every layer in one copy_blocks), gather one layer back, merge two attention states."""

    L, N, B, H, D, T = 2, 12, 4, 2, 16, 5

    def __init__(self):
        t, h, d = self.T, self.H, self.D
        self.kv = torch.zeros(self.L, 2, self.N, self.B, h, d, device=CUDA)
        self.key, self.value = torch.zeros(t, h, d, device=CUDA), torch.zeros(t, h, d, device=CUDA)
        self.slots = torch.zeros(t, dtype=torch.int64, device=CUDA)
        self.mapping = torch.zeros(2, 2, dtype=torch.int64, device=CUDA)
        self.table = torch.zeros(1, 3, dtype=torch.int32, device=CUDA)
        self.lens = torch.zeros(1, dtype=torch.int32, device=CUDA)
        self.out_a, self.out_b = torch.zeros(t, h, d, device=CUDA), torch.zeros(t, h, d, device=CUDA)
        self.lse_a, self.lse_b = torch.zeros(t, h, device=CUDA), torch.zeros(t, h, device=CUDA)

    def buffers(self):
        return (self.key, self.value, self.slots, self.mapping, self.table, self.lens, self.out_a, self.lse_a,
                self.out_b, self.lse_b)

    def run(self):
        return step_fn(*self.buffers()[:2], self.kv, *self.buffers()[2:])

    def prepare(self, seed):
        """New inputs (CUDA tensors, in buffers() order) and what run() must then produce: the cache
        and the outputs, computed with the reference on the CPU from the cache as it is now."""
        gen = generator(seed)
        perm = torch.randperm(self.N, generator=gen).tolist()
        blocks, src, dst = perm[:3], perm[3:5], perm[5:7]  # the gathered sequence; copy-on-write pairs
        key, value, out_a, out_b = (randn(self.T, self.H, self.D, gen=gen) for _ in range(4))
        lse_a, lse_b = randn(self.T, self.H, gen=gen), randn(self.T, self.H, gen=gen)
        slots = torch.randperm(self.N * self.B, generator=gen)[:self.T]
        mapping = torch.tensor([src, dst]).t().contiguous()
        table, lens = torch.tensor([blocks], dtype=torch.int32), torch.tensor([self.B * 3], dtype=torch.int32)
        kv = self.kv.cpu()
        for layer in range(self.L):
            reference.reshape_and_cache(key, value, kv[layer, 0], kv[layer, 1], slots)
        reference.copy_blocks(kv, mapping, block_dim=2)
        k, v = reference.gather_kv(kv[1, 0], kv[1, 1], table, lens)
        out, lse = reference.merge_attention_states(out_a.double(), lse_a, out_b.double(), lse_b)
        inputs = tuple(x.cuda() for x in (key, value, slots, mapping, table, lens, out_a, lse_a, out_b, lse_b))
        return inputs, kv, (k, v, out, lse)

    def load(self, inputs):
        for buf, x in zip(self.buffers(), inputs):
            buf.copy_(x)

    def check(self, results, kv, expected):
        assert_bytes_equal(self.kv, kv, msg="cache")
        for got, want, name in zip(results, expected, ("key", "value", "out", "lse")):
            assert_close(got, want, f32, msg=name)


def step_fn(key, value, kv, slots, mapping, table, lens, out_a, lse_a, out_b, lse_b):
    for layer in range(CacheStep.L):
        ops.reshape_and_cache(key, value, kv[layer, 0], kv[layer, 1], slots)
    ops.copy_blocks(kv, mapping, block_dim=2)
    k, v = ops.gather_kv(kv[1, 0], kv[1, 1], table, lens, num_tokens=CacheStep.B * 3)
    out, lse = ops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    return k, v, out, lse


def cache_ops_available():
    for op in ("reshape_and_cache", "copy_blocks", "gather_kv", "merge_attention_states"):
        require_kernel(op, CUDA)


def test_side_stream():
    """Kernels follow torch's current stream: on a side stream held back by a sleep, the inputs are
    copied in after the sleep; a kernel launched on any other stream would run before them."""
    cache_ops_available()
    step = CacheStep()
    inputs, kv, expected = step.prepare(1)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        step.load(inputs)
        results = step.run()
    side.synchronize()
    step.check(results, kv, expected)


def test_cuda_graph_capture_and_replay():
    """reshape_and_cache, copy_blocks, gather_kv (num_tokens given) and merge inside one captured
    graph: capture fails if anything synchronizes or launches outside the capturing stream; replays
    with new inputs in the same buffers give the reference results."""
    cache_ops_available()
    step = CacheStep()
    inputs, kv, expected = step.prepare(2)
    step.load(inputs)
    side = torch.cuda.Stream()  # warm-up outside the capture, as torch.cuda.graph's docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        results = step.run()
    torch.cuda.current_stream().wait_stream(side)
    step.check(results, kv, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step.run()
    for seed in (3, 4, 5):
        inputs, kv, expected = step.prepare(seed)
        step.load(inputs)
        graph.replay()
        torch.cuda.synchronize()
        step.check(results, kv, expected)


def test_compile_reduce_overhead():
    """torch.compile(mode="reduce-overhead", fullgraph=True): the cache (a static address, like a
    module buffer) is written in place by the graph-replayed step; results match the reference and
    no cudagraph was skipped."""
    cache_ops_available()
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    step = CacheStep()
    torch._dynamo.mark_static_address(step.kv)

    def fn(*args):
        return tuple(x.clone() for x in step_fn(*args))  # replay overwrites graph outputs: keep copies

    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for seed in range(6, 11):
        inputs, kv, expected = step.prepare(seed)
        results = compiled(*inputs[:2], step.kv, *inputs[2:])
        torch.cuda.synchronize()
        step.check(results, kv, expected)
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    assert skips == 0, f"cudagraphs were skipped: {dict(counters['inductor'])}"
    assert dict(counters["graph_break"]) == {}


# ----------------------------------------------------------------------------------------------------
# the compiled decode step of test_compile.py on CUDA (needs paged_attention's CUDA kernel)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,fp8", [(f32, None), (bf16, "e4m3")], ids=["f32", "bf16-e4m3"])
def test_compiled_decode_step(dtype, fp8):
    for op in ("reshape_and_cache", "paged_attention"):
        require_kernel(op, CUDA)
    import test_compile
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(test_compile.step, backend=counter, fullgraph=True)
    state = test_compile.PagedState(dtype, fp8)  # host bookkeeping; device mirrors below
    slots = state.append(test_compile.INIT_LENS)
    k0, v0 = state.rand(test_compile.LAYERS, len(slots), test_compile.HKV, test_compile.D), \
        state.rand(test_compile.LAYERS, len(slots), test_compile.HKV, test_compile.D)
    for layer in range(test_compile.LAYERS):
        ops.reshape_and_cache(k0[layer], v0[layer], state.kv[layer, 0], state.kv[layer, 1], slots, **state.scales)
    kv_c, kv_e = state.kv.cuda(), state.kv.cuda()
    tables, lens = state.block_tables.cuda(), state.seq_lens.cuda()
    scales = moved(state.scales)
    for i in range(24):
        slots = state.append([1] * len(test_compile.INIT_LENS))
        tables.copy_(state.block_tables)  # in place: the compiled step keeps seeing the same tensors
        lens.copy_(state.seq_lens)
        t = len(slots)
        q, k, v = (state.rand(test_compile.LAYERS, t, h, test_compile.D).cuda()
                   for h in (test_compile.HQ, test_compile.HKV, test_compile.HKV))
        args = (tables, lens, slots.cuda(), None, scales["k_scale"], scales["v_scale"])
        if i == 2:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            out_c, lse_c = compiled(q, k, v, kv_c, *args)
        finally:
            torch.compiler.set_stance("default")
        out_e, lse_e = test_compile.step(q, k, v, kv_e, *args)
        assert_close(out_c, out_e.cpu().double(), f32, rtol=1e-5, atol=1e-5, msg=f"out at step {i}")
        assert_bytes_equal(kv_c, kv_e, msg=f"cache after step {i}")
    assert dict(counters["graph_break"]) == {}
    assert counter.frame_count == 1
    ref_out, _ = reference.paged_attention(upcast(q[1].cpu()), upcast(kv_c[1, 0].cpu()), upcast(kv_c[1, 1].cpu()),
                                           state.block_tables, state.seq_lens, **state.scales)
    assert_close(out_c[1], ref_out, dtype, msg="last step vs reference")


def test_every_cache_op_has_a_cuda_kernel():
    """The build on a CUDA machine registers the cache ops of this file's scope for CUDA."""
    missing = [op for op in ("reshape_and_cache", "concat_and_cache_mla", "copy_blocks", "swap_blocks",
                             "gather_kv", "merge_attention_states") if not has_kernel(op, CUDA)]
    assert not missing, f"no CUDA kernel for {missing}: was the extension built with CUDA? " \
                        f"(torch.version.cuda={torch.version.cuda}, KVKERNELS_NO_CUDA={os.environ.get('KVKERNELS_NO_CUDA')})"
