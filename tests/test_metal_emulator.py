"""The MSL emulator itself (kvkernels.metal.emulator): what it computes, and that it catches the bugs it
claims to catch, on small deliberately broken kernels.

Negative tests: a missing barrier gives a lane-order-dependent result (and the op tests run every kernel
in all three orders); a divergent barrier, a read of an inactive SIMD lane, an out-of-range threadgroup
access (past the end, before the start), an out-of-range buffer access and too much threadgroup memory are
reported as errors and leave the output buffers untouched.
"""

import pytest
import torch

from kvkernels.metal import emulator as emu

ORDERS = emu.LANE_ORDERS

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// Rotates x by one inside each threadgroup through threadgroup memory (correct: with a barrier).
kernel void rotate_ok(device float* out [[buffer(0)]], device const float* x [[buffer(1)]],
                      uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                      uint n [[threads_per_threadgroup]]) {
  threadgroup float tile[64];
  tile[tid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = tile[(tid + 1) % n];
}

// The same without the barrier: a thread may read its neighbour's slot before it is written.
kernel void rotate_no_barrier(device float* out [[buffer(0)]], device const float* x [[buffer(1)]],
                              uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                              uint n [[threads_per_threadgroup]]) {
  threadgroup float tile[64];
  tile[tid] = x[gid];
  out[gid] = tile[(tid + 1) % n];
}

// A barrier only half of the threadgroup reaches.
kernel void barrier_in_branch(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = 1.0f;
}

// Two different barriers in the two branches.
kernel void two_barriers(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = 1.0f;
}

// Early return before a barrier (the common real-world form of a divergent barrier).
kernel void return_before_barrier(device float* out [[buffer(0)]], constant int& n [[buffer(1)]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  if (int(tid) >= n) return;
  tile[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tile[0];
}

// Writes one element past the end of a threadgroup array.
kernel void tg_past_end(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  tile[tid + 1] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tile[tid];
}

// Writes one element before the start of a threadgroup array.
kernel void tg_before_start(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  tile[int(tid) - 1] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 2.0f;
}

// More threadgroup memory than an Apple GPU has (32 KiB).
kernel void tg_too_big(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[8200];
  big[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = big[tid];
}

// Reads one element past the end of a device buffer.
kernel void device_past_end(device float* out [[buffer(0)]], device const float* x [[buffer(1)]],
                            uint gid [[thread_position_in_grid]]) {
  out[gid] = x[gid + 1];
}

// simd_shuffle_xor inside a branch taken by lanes 0..15: the partner lane (lane ^ 16) is inactive.
kernel void shuffle_inactive(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float v = float(lane);
  if (lane < 16) {
    v = simd_shuffle_xor(v, ushort(16));
  }
  out[lane] = v;
}

// A butterfly reduction over 32 lanes in a threadgroup of 40: the second SIMD group has 8 lanes.
kernel void butterfly_partial(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  float v = 1.0f;
  for (ushort m = 16; m > 0; m /= 2) v += simd_shuffle_xor(v, m);
  out[tid] = v;
}

// What the collectives compute, over the active lanes only.
kernel void collectives(device float* out [[buffer(0)]], device const float* x [[buffer(1)]],
                        uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const float v = x[tid];
  float r0 = simd_sum(v), r1 = simd_max(v), r2 = simd_prefix_exclusive_sum(v), r3 = 0, r4 = 0;
  if (lane % 2 == 0) {
    r3 = simd_sum(v);                 // even lanes only
  } else {
    r3 = simd_min(v);                 // odd lanes only
  }
  r4 = simd_broadcast_first(v);
  const ulong ballot = ulong(simd_ballot(v > 0.0f));
  device float* o = out + 6 * tid;
  o[0] = r0; o[1] = r1; o[2] = r2; o[3] = r3; o[4] = r4; o[5] = float(ballot & 0xFFFF);
}

// simd_shuffle_down: the top lanes keep their own value.
kernel void shuffle_down3(device float* out [[buffer(0)]], device const float* x [[buffer(1)]],
                          uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = simd_shuffle_down(x[tid], ushort(3));
}

// Builtins of a 2-D dispatch with partial edge threadgroups.
kernel void builtins(device uint* out [[buffer(0)]], uint2 gid [[thread_position_in_grid]],
                     uint2 tg [[threadgroup_position_in_grid]], uint2 tsize [[threads_per_threadgroup]],
                     uint2 dsize [[dispatch_threads_per_threadgroup]], uint2 grid [[threads_per_grid]],
                     uint idx [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
  device uint* o = out + 8 * (gid.y * grid.x + gid.x);
  o[0] = tg.x; o[1] = tg.y; o[2] = tsize.x; o[3] = tsize.y; o[4] = dsize.x; o[5] = dsize.y; o[6] = idx; o[7] = sg;
}
"""


@pytest.fixture(scope="module")
def lib():
    return emu.compile_shader(SOURCE)


def run_orders(fn):
    """fn() -> tensor, run once per lane order; returns {order: result}."""
    out = {}
    for order in ORDERS:
        with emu.lane_order(order, seed=1):
            out[order] = fn()
    return out


# ---- correct kernels -------------------------------------------------------------------------------


def test_barrier_makes_result_order_independent(lib):
    x = torch.randn(100)

    def run():
        out = torch.full((100,), float("nan"))
        lib.rotate_ok(out, x, threads=100, group_size=64)  # groups of 64 and 36
        return out

    expected = torch.cat([torch.roll(x[:64], -1), torch.roll(x[64:], -1)])
    for order, out in run_orders(run).items():
        assert torch.equal(out, expected), order


def test_collectives(lib):
    """40 threads: a full SIMD group and one of 8 lanes; a branch splits even and odd lanes."""
    x = torch.randn(40)
    x[5] = -abs(x[5])

    def run():
        out = torch.zeros(40 * 6)
        lib.collectives(out, x, threads=40, group_size=40)
        return out.reshape(40, 6)

    for order, out in run_orders(run).items():
        for sg, lanes in ((0, range(0, 32)), (1, range(32, 40))):
            v = x[list(lanes)].double()
            for t in lanes:
                lane = t - 32 * sg
                assert out[t, 0] == pytest.approx(float(v.sum()), rel=1e-5, abs=1e-5), order
                assert out[t, 1] == pytest.approx(float(v.max()))
                assert out[t, 2] == pytest.approx(float(v[:lane].sum()), abs=1e-5)
                same = v[lane % 2::2]
                want = float(same.sum()) if lane % 2 == 0 else float(same.min())
                assert out[t, 3] == pytest.approx(want, rel=1e-5, abs=1e-5), (order, t)
                assert out[t, 4] == pytest.approx(float(v[0]))
                assert int(out[t, 5]) == sum(1 << k for k in range(min(16, len(v))) if v[k] > 0)


def test_shuffle_down_full_simdgroup(lib):
    x = torch.randn(32)
    for order in ORDERS:
        with emu.lane_order(order):
            out = torch.zeros(32)
            lib.shuffle_down3(out, x, threads=32, group_size=32)
        assert torch.equal(out, torch.cat([x[3:], x[29:]])), order
    with pytest.raises(emu.EmulatorError, match="simd_shuffle_down .* reads lane 8"):
        lib.shuffle_down3(torch.zeros(8), x[:8].clone(), threads=8, group_size=8)


def test_builtins_partial_threadgroups(lib):
    out = torch.zeros(10 * 7 * 8, dtype=torch.int32)
    lib.builtins(out, threads=[10, 7], group_size=[4, 3])
    out = out.reshape(7, 10, 8)
    for y in range(7):
        for x in range(10):
            o = out[y, x].tolist()
            tsize = (min(4, 10 - 4 * (x // 4)), min(3, 7 - 3 * (y // 3)))
            idx = (y % 3) * tsize[0] + x % 4
            assert o == [x // 4, y // 3, tsize[0], tsize[1], 4, 3, idx, idx // 32]


# ---- bugs the emulator must catch -----------------------------------------------------------------


def test_missing_barrier_changes_with_lane_order(lib):
    x = torch.randn(64)
    expected = torch.roll(x, -1)

    def run():
        out = torch.zeros(64)
        lib.rotate_no_barrier(out, x, threads=64, group_size=64)
        return out

    results = run_orders(run)
    # Forward order: every thread finishes before its neighbour writes -> it reads the poison (NaN).
    assert torch.isnan(results["forward"][:63]).all()
    assert not torch.equal(results["forward"], results["reverse"])
    assert not all(torch.equal(r, expected) for r in results.values())


@pytest.mark.parametrize("kernel, message", [
    ("barrier_in_branch", "divergent barrier"),
    ("two_barriers", "divergent barrier"),
])
def test_divergent_barrier_reported(lib, kernel, message):
    out = torch.zeros(32)
    with pytest.raises(emu.EmulatorError, match=message):
        getattr(lib, kernel)(out, threads=32, group_size=32)
    assert torch.equal(out, torch.zeros(32)), "a failed dispatch writes nothing back"


def test_return_before_barrier_reported(lib):
    out = torch.zeros(64)
    with pytest.raises(emu.EmulatorError, match="waits for threads that have returned"):
        lib.return_before_barrier(out, 40, threads=64, group_size=64, arg_casts={1: "int32"})
    lib.return_before_barrier(out, 64, threads=64, group_size=64, arg_casts={1: "int32"})
    assert torch.equal(out, torch.ones(64))


def test_threadgroup_past_end_reported(lib):
    out = torch.zeros(32)
    with pytest.raises(emu.EmulatorError, match=r"out-of-range threadgroup access: byte 128 of threadgroup array "
                                                 r"'tile' \(128 bytes\)"):
        lib.tg_past_end(out, threads=32, group_size=32)
    assert torch.equal(out, torch.zeros(32))


def test_threadgroup_before_start_reported(lib):
    out = torch.zeros(32)
    with pytest.raises(emu.EmulatorError, match="write before the start of threadgroup array 'tile'"):
        lib.tg_before_start(out, threads=32, group_size=32)


def test_threadgroup_limit_reported(lib):
    with pytest.raises(emu.EmulatorError, match="exceeds the 32 KiB limit"):
        lib.tg_too_big(torch.zeros(32), threads=32, group_size=32)


def test_device_past_end_reported(lib):
    x = torch.randn(1024)  # 4 KiB: the buffer ends exactly at the guard page
    with pytest.raises(emu.EmulatorError, match="out-of-range device access: byte 4096 of the buffer of argument"):
        lib.device_past_end(torch.zeros(1024), x, threads=1024, group_size=256)


@pytest.mark.parametrize("order", ORDERS)
def test_inactive_lane_read_reported(lib, order):
    with emu.lane_order(order):
        with pytest.raises(emu.EmulatorError, match=r"simd_shuffle_xor at .* reads lane 1[6-9]|reads lane 2|reads lane 3"):
            lib.shuffle_inactive(torch.zeros(32), threads=32, group_size=32)


def test_partial_simdgroup_read_reported(lib):
    with pytest.raises(emu.EmulatorError, match="which is not active"):
        lib.butterfly_partial(torch.zeros(40), threads=40, group_size=40)
    out = torch.zeros(64)
    lib.butterfly_partial(out, threads=64, group_size=64)  # two full SIMD groups: fine
    assert torch.equal(out, torch.full((64,), 32.0))


def test_call_shape_errors(lib):
    with pytest.raises(emu.EmulatorError, match="2 arguments given, the kernel binds 1 buffers"):
        lib.barrier_in_branch(torch.zeros(4), torch.zeros(4), threads=4, group_size=4)
    with pytest.raises(AttributeError):
        lib.no_such_kernel
    assert "rotate_ok" in dir(lib)


def test_unsupported_threadgroup_declaration():
    with pytest.raises(emu.EmulatorError, match="unsupported threadgroup declaration"):
        emu.rewrite_threadgroup("kernel void k() {\n  threadgroup float a[4], b[4];\n}")


# ---- the op tests would catch a missing barrier in the real kernels -----------------------------------


@pytest.fixture
def mutate(monkeypatch):
    """mutate(family, n): metal/<family>.metal with its n-th loop-level barrier line removed, for the
    dispatch code's next compile."""
    from kvkernels.metal import dispatch, source

    real = source.read

    def apply(family, n, indent="    "):
        text = real(f"{family}.metal")
        line = f"\n{indent}threadgroup_barrier(mem_flags::mem_threadgroup);\n"
        at = -1
        for _ in range(n):
            at = text.index(line, at + 1)
        broken = text[:at] + f"\n{indent}// barrier removed by the test\n" + text[at + len(line):]
        monkeypatch.setattr(source, "read", lambda name: broken if name == f"{family}.metal" else real(name))
        dispatch._library.cache_clear()

    yield apply
    dispatch._library.cache_clear()


def _fails_in_some_order(run):
    """True when run() raises an emulator error or an assertion in at least one lane order."""
    failures = 0
    for order in ORDERS:
        with emu.lane_order(order, seed=5):
            try:
                run()
            except (AssertionError, emu.EmulatorError):
                failures += 1
    return failures > 0


def test_missing_barrier_in_paged_attention_is_caught(mutate):
    from helpers import assert_close, make_paged_kv, make_query, generator, upcast
    from kvkernels import reference
    from kvkernels.metal import dispatch

    kv = make_paged_kv(seq_lens=[7, 12, 1], num_kv_heads=2, head_dim=40, block_size=3, seed=2)
    q = make_query(3, 4, 40, torch.float32, generator(3))

    def run():
        out, lse = dispatch.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
        ref_out, ref_lse = reference.paged_attention(upcast(q), *kv.ref_caches(), kv.block_tables, kv.seq_lens)
        assert_close(out, ref_out, torch.float32)
        assert_close(lse, ref_lse, torch.float32)

    run()  # the real kernel passes in every order (also tested in test_metal_ops.py)
    mutate("paged_attention", 1, indent="  ")
    assert _fails_in_some_order(run)


@pytest.mark.parametrize("n, op", [(1, "mla_decompress"), (2, "mla_decompress"), (3, "mla_paged_attention"),
                                   (4, "mla_paged_attention")])
def test_missing_barrier_in_mla_tiles_is_caught(mutate, n, op):
    from helpers import assert_close, make_paged_mla, make_query, generator, randn, upcast
    from kvkernels import reference
    from kvkernels.metal import dispatch

    mla = make_paged_mla([9, 30], 40, 8, 4, seed=1)
    if op == "mla_decompress":
        w = randn(2 * 40, 40, gen=generator(2), std=0.2)
        kw = dict(kv_lora_rank=40, qk_nope_head_dim=16, v_head_dim=24)

        def run():
            got = dispatch.mla_decompress(mla.kv_cache, mla.block_tables, mla.seq_lens, w, **kw)
            want = reference.mla_decompress(mla.ref_cache(), mla.block_tables, mla.seq_lens, w, **kw)
            for g, x in zip(got, want):
                assert_close(g, x, torch.float32)
    else:
        q = make_query(2, 5, 48, torch.float32, generator(3))

        def run():
            got = dispatch.mla_paged_attention(q, mla.kv_cache, mla.block_tables, mla.seq_lens, kv_lora_rank=40,
                                               scale=0.2)
            want = reference.mla_paged_attention(upcast(q), mla.ref_cache(), mla.block_tables, mla.seq_lens,
                                                 kv_lora_rank=40, scale=0.2)
            for g, x in zip(got, want):
                assert_close(g, x, torch.float32)

    run()
    mutate("mla", n)
    assert _fails_in_some_order(run)
