"""torch.compile(fullgraph=True) of a decode step that writes the new token's K/V into the paged cache and
attends over it: no graph breaks, one compile for the whole loop as sequences grow across block
boundaries, outputs equal to eager, and the cache written under compile equal to the eager-written cache
(a write dropped or reordered by functionalization shows up here)."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from helpers import FP8_DTYPES, assert_bytes_equal, assert_close, generator, make_scale, poison, upcast
from kvkernels import ops, reference

f32, bf16 = torch.float32, torch.bfloat16
LAYERS, HQ, HKV, D, B = 2, 4, 2, 16, 4
INIT_LENS = [3, 5, 7]  # not 1: a length-1 start would specialize shapes
NUM_BLOCKS, MAX_BLOCKS = 64, 16


class PagedState:
    """A stacked cache [L, 2, N, B, H, D], a fixed-size block table filled as sequences grow."""

    def __init__(self, dtype, fp8, seed=0):
        self.gen = generator(seed)
        self.dtype = dtype
        cache_dtype = FP8_DTYPES[fp8] if fp8 else dtype
        self.kv = poison(torch.empty(LAYERS, 2, NUM_BLOCKS, B, HKV, D, dtype=cache_dtype))
        self.free = torch.randperm(NUM_BLOCKS, generator=self.gen).tolist()
        self.block_tables = torch.full((len(INIT_LENS), MAX_BLOCKS), -1, dtype=torch.int32)
        self.seq_lens = torch.zeros(len(INIT_LENS), dtype=torch.int32)
        self.scales = (dict(k_scale=make_scale(HKV, True, self.gen), v_scale=make_scale(HKV, False, self.gen))
                       if fp8 else dict(k_scale=None, v_scale=None))

    def append(self, counts):
        """Grow each sequence by counts[i] tokens (allocating blocks); returns the new tokens' slots."""
        slots = []
        for i, n in enumerate(counts):
            for pos in range(int(self.seq_lens[i]), int(self.seq_lens[i]) + n):
                if pos % B == 0:
                    self.block_tables[i, pos // B] = self.free.pop()
                slots.append(int(self.block_tables[i, pos // B]) * B + pos % B)
            self.seq_lens[i] += n  # in place: the compiled step sees the same tensor
        return torch.tensor(slots, dtype=torch.int64)

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)


def step(q, k_new, v_new, kv, block_tables, seq_lens, slot_mapping, query_start_loc, k_scale, v_scale):
    """One forward step over all layers: write the new K/V, then attend (decode or chunked prefill)."""
    outs, lses = [], []
    for layer in range(kv.shape[0]):
        key_cache, value_cache = kv[layer, 0], kv[layer, 1]
        ops.reshape_and_cache(k_new[layer], v_new[layer], key_cache, value_cache, slot_mapping,
                              k_scale=k_scale, v_scale=v_scale)
        out, lse = ops.paged_attention(q[layer], key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                       k_scale=k_scale, v_scale=v_scale)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def chunk_sizes(i):
    return [2 + (i * (s + 1)) % 3 for s in range(len(INIT_LENS))]


@pytest.mark.parametrize("mode,backend,dtype,fp8", [
    ("decode", "inductor", f32, None),
    ("decode", "inductor", bf16, "e4m3"),
    ("decode", "aot_eager", f32, None),
    ("chunked", "inductor", f32, None),
])
def test_compiled_step(mode, backend, dtype, fp8):
    torch._dynamo.reset()
    counters.clear()
    compile_counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=compile_counter, fullgraph=True)
    state = PagedState(dtype, fp8)

    # Prefill (eager), then the compiled and the eager loop each own a copy of the cache.
    slots = state.append(INIT_LENS)
    k0, v0 = state.rand(LAYERS, len(slots), HKV, D), state.rand(LAYERS, len(slots), HKV, D)
    for layer in range(LAYERS):
        ops.reshape_and_cache(k0[layer], v0[layer], state.kv[layer, 0], state.kv[layer, 1], slots, **state.scales)
    kv_compiled, kv_eager = state.kv, state.kv.clone()

    def run_step(i):
        counts = [1] * len(INIT_LENS) if mode == "decode" else chunk_sizes(i)
        slots = state.append(counts)
        t = len(slots)
        q, k, v = state.rand(LAYERS, t, HQ, D), state.rand(LAYERS, t, HKV, D), state.rand(LAYERS, t, HKV, D)
        qsl = None
        if mode == "chunked":  # the token count changes every step
            qsl = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
            for x, dim in ((q, 1), (k, 1), (v, 1), (slots, 0)):
                torch._dynamo.mark_dynamic(x, dim)
        args = (state.block_tables, state.seq_lens, slots, qsl, state.scales["k_scale"], state.scales["v_scale"])
        out_c, lse_c = compiled(q, k, v, kv_compiled, *args)
        out_e, lse_e = step(q, k, v, kv_eager, *args)
        assert_close(out_c, out_e, f32, rtol=1e-6, atol=1e-6, msg=f"out at step {i}")
        assert_close(lse_c, lse_e, f32, rtol=1e-6, atol=1e-6, msg=f"lse at step {i}")
        assert_bytes_equal(kv_compiled, kv_eager, msg=f"cache after step {i}")
        return q, qsl, out_c, lse_c

    num_steps = 32 if mode == "decode" else 10
    for i in range(2):  # warm-up
        run_step(i)
    with torch.compiler.set_stance("fail_on_recompile"):
        for i in range(2, num_steps):
            q, qsl, out_c, lse_c = run_step(i)

    assert dict(counters["graph_break"]) == {}, f"graph breaks: {dict(counters['graph_break'])}"
    assert compile_counter.frame_count == 1, f"compiled {compile_counter.frame_count} times"
    assert max(state.seq_lens.tolist()) > 4 * B, "the loop crossed several block boundaries"

    # The last step's output is right, not just consistent (layer 1, against the reference).
    key_cache, value_cache = upcast(kv_compiled[1, 0]), upcast(kv_compiled[1, 1])
    ref_out, ref_lse = reference.paged_attention(upcast(q[1]), key_cache, value_cache, state.block_tables,
                                                 state.seq_lens, qsl, **state.scales)
    assert_close(out_c[1], ref_out, dtype, msg="last step vs reference")
    assert_close(lse_c[1], ref_lse, f32, msg="last step lse vs reference")
