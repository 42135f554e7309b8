"""reshape_and_cache, copy_blocks, swap_blocks and gather_kv (docs/ops.md), on the CPU and on CUDA.

These ops move bytes (quantizing at most), so results are compared bit for bit: with the reference run
on a clone of the same storage (on the CPU), and with an expectation built independently in the test.
Each test builds its inputs on the CPU and runs the kernel on ``device`` (inputs copied whole, so views
keep their strides and offsets). The ``check_*`` functions take the op as an argument too: the CUDA
emulator tests (test_cuda_emulated.py) run the same checks on the CUDA kernels compiled for the CPU.
"""

import pytest
import torch

from helpers import (DEVICES, FP8_DTYPES, FP8_MAX, alloc_kv_cache, assert_bytes_equal, assert_close,
                     clone_storage, dequantize64, generator, kv_views, make_paged_kv, make_scale,
                     randn, require_kernel)
from kvkernels import ops, reference

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


def random_bytes(shape, dtype, gen):
    """A tensor of ``dtype`` holding random bytes (NaN and inf patterns included)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).clone()


def fill_random_bytes(storage, gen):
    for t in storage:
        t.copy_(random_bytes(t.shape, t.dtype, gen))
    return storage


# ----------------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------------

# id: key dtype, cache (None = key dtype, or fp8 name), per-head scale, layout
WRITE_CASES = {
    "f32-NHD": (f32, None, False, "NHD"),
    "f16-HND": (f16, None, False, "HND"),
    "bf16-stacked": (bf16, None, False, "stacked"),
    "bf16->e4m3-tensor-NHD": (bf16, "e4m3", False, "NHD"),
    "f32->e4m3-head-HND": (f32, "e4m3", True, "HND"),
    "f16->e5m2-head-stacked": (f16, "e5m2", True, "stacked"),
    "f32->e5m2-tensor-NHD": (f32, "e5m2", False, "NHD"),
    "bf16->e4m3-k-head-v-tensor-HND": (bf16, "e4m3", (True, False), "HND"),
}


def check_reshape_and_cache(case, device="cpu", op=ops.reshape_and_cache):
    dtype, fp8, per_head, layout = case
    gen = generator(1)
    n, b, h, d, t = 7, 5, 2, 24, 23
    cache_dtype = FP8_DTYPES[fp8] if fp8 else dtype
    storage = fill_random_bytes(alloc_kv_cache(layout, n, b, h, d, cache_dtype), gen)
    initial = clone_storage(storage)
    ref_storage = clone_storage(storage)

    # key/value are slices of a fused QKV projection output: non-contiguous inputs.
    qkv = randn(t, 4 + 2 * h, d, gen=gen, dtype=dtype, std=3.0)
    key, value = qkv[:, 4:4 + h], qkv[:, 4 + h:]
    if fp8:  # saturation, infinities, subnormals and a NaN
        key[0, 0, :4] = torch.tensor([1e30, -1e30, float("inf"), float("-inf")]).to(dtype)
        key[1, 0, :2] = torch.tensor([1e-6, -3e-7]).to(dtype)
        value[2, 1, 3] = float("nan")
    slots = torch.randperm(n * b, generator=gen)[:t]
    slots[[3, 9, 14]] = torch.tensor([-1, -7, -(2**40)])  # negative: skipped
    k_per_head, v_per_head = per_head if isinstance(per_head, tuple) else (per_head, per_head)
    scales = dict(k_scale=make_scale(h, k_per_head, gen), v_scale=make_scale(h, v_per_head, gen)) if fp8 else {}

    dev_storage = tuple(x.to(device) for x in storage)  # the storage itself on the CPU
    dev_qkv = qkv.to(device)
    op(dev_qkv[:, 4:4 + h], dev_qkv[:, 4 + h:], *kv_views(dev_storage, layout), slots.to(device),
       **{k: v.to(device) for k, v in scales.items()})
    storage = tuple(x.cpu() for x in dev_storage)
    key_cache, value_cache = kv_views(storage, layout)
    ref_k, ref_v = kv_views(ref_storage, layout)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots, **scales)

    written = slots >= 0
    blk, off = slots[written] // b, slots[written] % b
    init_k, init_v = kv_views(initial, layout)
    for name, cache, ref, init, x, scale in (
            ("key_cache", key_cache, ref_k, init_k, key, scales.get("k_scale")),
            ("value_cache", value_cache, ref_v, init_v, value, scales.get("v_scale"))):
        rows = cache[blk, off]
        if fp8:  # independent check of the quantization rule: bounded error, saturation, NaN kept
            m = FP8_MAX[cache_dtype]
            s = scale.double().reshape(-1, 1) if scale.numel() > 1 else scale.double()
            clamped = (x[written].double() / s).clamp(-m, m) * s
            assert_close(dequantize64(rows, scale), clamped, cache_dtype, scale=scale, msg=name)
            # NaN input stays NaN; its encoding may differ from the reference's: zero it on both sides.
            nan = torch.zeros(cache.shape, dtype=torch.bool)
            nan[blk, off] = torch.isnan(x[written].float())
            assert torch.isnan(cache.float())[nan].all(), f"{name}: NaN input not stored as NaN"
            cache, ref, init = (c.view(torch.uint8).clone() for c in (cache, ref, init))
            cache[nan] = 0
            ref[nan] = 0
        else:
            assert_bytes_equal(rows, x[written], msg=f"{name} written rows")
        assert_bytes_equal(cache, ref, msg=f"{name} vs reference")
        untouched = torch.ones(n, b, dtype=torch.bool)
        untouched[blk, off] = False
        assert_bytes_equal(cache[untouched], init[untouched], msg=f"{name} untouched slots")
    if layout == "stacked":  # the other layer of the allocation is untouched too
        assert_bytes_equal(storage[0][0], initial[0][0], msg="layer 0 of the stacked cache")


@pytest.mark.parametrize("case", WRITE_CASES.values(), ids=WRITE_CASES.keys())
@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache(case, device):
    require_kernel("reshape_and_cache", device)
    check_reshape_and_cache(case, device)


def check_mixed_layouts_write(device="cpu", op=ops.reshape_and_cache):
    """key_cache NHD and value_cache HND (separate strides per cache), fp8 with per-head scales."""
    gen = generator(12)
    key, value = randn(11, 2, 16, gen=gen), randn(11, 2, 16, gen=gen)
    k_nhd = torch.zeros(5, 4, 2, 16, dtype=torch.float8_e4m3fn)
    v_hnd = torch.zeros(5, 2, 4, 16, dtype=torch.float8_e4m3fn)
    scales = dict(k_scale=make_scale(2, True, gen), v_scale=make_scale(2, True, gen))
    slots = torch.randperm(20, generator=gen)[:11]
    ref_k, ref_v = k_nhd.clone(), v_hnd.clone()
    dev_k, dev_v = k_nhd.to(device), v_hnd.to(device)
    op(key.to(device), value.to(device), dev_k, dev_v.transpose(1, 2), slots.to(device),
       **{k: v.to(device) for k, v in scales.items()})
    reference.reshape_and_cache(key, value, ref_k, ref_v.transpose(1, 2), slots, **scales)
    assert_bytes_equal(dev_k.cpu(), ref_k, msg="key_cache")
    assert_bytes_equal(dev_v.cpu(), ref_v, msg="value_cache")


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_mixed_layouts(device):
    require_kernel("reshape_and_cache", device)
    check_mixed_layouts_write(device)


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_no_tokens(device):
    require_kernel("reshape_and_cache", device)
    storage = fill_random_bytes(alloc_kv_cache("NHD", 3, 4, 2, 8, bf16), generator(2))
    before = clone_storage(storage)
    storage = tuple(x.to(device) for x in storage)
    empty = torch.empty(0, 2, 8, dtype=bf16, device=device)
    ops.reshape_and_cache(empty, empty, *storage, torch.empty(0, dtype=torch.int64, device=device))
    for now, old in zip(storage, before):
        assert_bytes_equal(now, old)


# ----------------------------------------------------------------------------------------------------
# copy_blocks
# ----------------------------------------------------------------------------------------------------


def mapping(pairs):
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


def expected_copy(cache, pairs, block_dim, src=None):
    """The result of copying each (s, d) from a snapshot of ``src`` (default: ``cache``) into a clone."""
    out, src = cache.clone(), (cache if src is None else src).clone()
    for s, d in pairs:
        out.select(block_dim, d).copy_(src.select(block_dim, s))
    return out


# Sources may repeat (copy-on-write of one block into several forks); destinations are distinct.
COPY_PAIRS = [(0, 1), (3, 2), (3, 7), (5, 8), (6, 4)]


def check_copy_blocks_stacked(dtype, block_dim, device="cpu", op=ops.copy_blocks, mapping_device=None):
    cache = random_bytes((3, 2, 9, 4, 2, 8), dtype, generator(3))
    expected = expected_copy(cache, COPY_PAIRS, block_dim)
    ref = cache.clone()
    dev_cache = cache.to(device)
    op(dev_cache, mapping(COPY_PAIRS).to(mapping_device or device), block_dim=block_dim)
    cache = dev_cache.cpu()
    reference.copy_blocks(ref, mapping(COPY_PAIRS), block_dim=block_dim)
    assert_bytes_equal(cache, expected, msg="vs expected")
    assert_bytes_equal(cache, ref, msg="vs reference")


@pytest.mark.parametrize("block_dim", [2, -4])
@pytest.mark.parametrize("dtype", [f32, bf16, torch.float8_e4m3fn, torch.uint8], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_stacked(dtype, block_dim, device):
    """Every layer and both K and V of a stacked [L, 2, N, B, H, D] cache in one call."""
    require_kernel("copy_blocks", device)
    check_copy_blocks_stacked(dtype, block_dim, device)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_mapping_on_cpu(device):
    """block_mapping may live on the CPU whatever the cache's device (docs/design.md §4)."""
    require_kernel("copy_blocks", device)
    check_copy_blocks_stacked(bf16, 2, device, mapping_device="cpu")


# kind: (allocation shape, dtype, the [N, ...] view of the allocation that copy_blocks gets)
BLOCK_DIM0_CASES = {
    "NHD": ((9, 4, 2, 8), bf16, lambda x: x),
    "HND": ((9, 2, 4, 8), f16, lambda x: x.transpose(1, 2)),
    "mla": ((9, 16, 72), f32, lambda x: x),
    "layer-slice": ((2, 2, 9, 4, 2, 8), f32, lambda x: x[1, 0]),
    "fp8-strided-rows": ((9, 16, 80), torch.float8_e4m3fn, lambda x: x[..., :72]),
}


def check_copy_blocks_block_dim0(kind, pairs, device="cpu", op=ops.copy_blocks):
    shape, dtype, view = BLOCK_DIM0_CASES[kind]
    whole = random_bytes(shape, dtype, generator(4))
    expected = whole.clone()
    view(expected).copy_(expected_copy(view(whole), pairs, 0))
    dev_whole = whole.to(device)
    op(view(dev_whole), mapping(pairs).to(device), block_dim=0)
    assert_bytes_equal(dev_whole.cpu(), expected, msg="whole allocation")


@pytest.mark.parametrize("pairs", [COPY_PAIRS, []], ids=["pairs", "empty-mapping"])
@pytest.mark.parametrize("kind", BLOCK_DIM0_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_block_dim0(kind, pairs, device):
    require_kernel("copy_blocks", device)
    check_copy_blocks_block_dim0(kind, pairs, device)


# ----------------------------------------------------------------------------------------------------
# swap_blocks
# ----------------------------------------------------------------------------------------------------


# (src device, dst device, mapping device): "cuda-pinned" is pinned host memory.
SWAP_DEVICES = {
    "cpu": ("cpu", "cpu", "cpu"),
    "cuda->cuda": ("cuda", "cuda", "cuda"),
    "cuda->cuda-map-cpu": ("cuda", "cuda", "cpu"),
    "cuda->pinned": ("cuda", "cuda-pinned", "cpu"),
    "cuda->pinned-map-cuda": ("cuda", "cuda-pinned", "cuda"),  # the zero-copy kernel
    "pinned->cuda": ("cuda-pinned", "cuda", "cpu"),
    "pageable->cuda": ("cpu", "cuda", "cpu"),
    "cuda->pageable": ("cuda", "cpu", "cpu"),
}
SWAP_PARAMS = [pytest.param(name, marks=() if name == "cpu" else DEVICES[1].marks) for name in SWAP_DEVICES]


def place(t, where):
    """``t`` on "cpu", "cuda" or in pinned host memory ("cuda-pinned")."""
    return t.pin_memory() if where == "cuda-pinned" else t.to(where)


def check_swap_blocks(dtype, shape, block_dim, devices=("cpu", "cpu", "cpu"), op=ops.swap_blocks):
    gen = generator(5)
    src = random_bytes(shape, dtype, gen)
    dst_shape = list(shape)
    dst_shape[block_dim] = 11
    dst = random_bytes(tuple(dst_shape), dtype, gen)
    pairs = [(5, 10), (0, 3), (2, 0), (5, 4)]
    src_before = src.clone()
    expected = expected_copy(dst, pairs, block_dim, src=src)
    ref = dst.clone()
    dev_src, dev_dst = place(src, devices[0]), place(dst, devices[1])
    op(dev_src, dev_dst, mapping(pairs).to(devices[2].replace("-pinned", "")), block_dim=block_dim)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # device -> host copies are asynchronous
    dst, src = dev_dst.cpu(), dev_src.cpu()
    reference.swap_blocks(src, ref, mapping(pairs), block_dim=block_dim)
    assert_bytes_equal(dst, expected, msg="dst vs expected")
    assert_bytes_equal(dst, ref, msg="dst vs reference")
    assert_bytes_equal(src, src_before, msg="src unchanged")


@pytest.mark.parametrize("dtype", [f32, bf16, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("shape,block_dim", [((6, 4, 2, 8), 0), ((2, 2, 6, 4, 2, 8), 2), ((2, 2, 6, 4, 2, 8), -4)],
                         ids=["NHD", "stacked", "stacked-negdim"])
@pytest.mark.parametrize("devices", SWAP_PARAMS)
def test_swap_blocks(dtype, shape, block_dim, devices):
    """Between tensors of different num_blocks (an offload pool smaller than the device pool), on the
    CPU and across CUDA / pinned / pageable memory with the mapping on either side."""
    if devices != "cpu":
        require_kernel("swap_blocks", "cuda")
    check_swap_blocks(dtype, shape, block_dim, SWAP_DEVICES[devices])


@pytest.mark.parametrize("views,pairs", [
    ("same", [(0, 1), (1, 2), (2, 0), (3, 5)]),  # a cycle: no copy order works without reading first
    ("shifted", [(0, 2), (1, 0), (4, 1)]),  # src block s is x[s + 1]: x[2] is written and read
], ids=["same-storage-cycle", "shifted-views"])
@pytest.mark.parametrize("device", DEVICES)
def test_swap_blocks_overlapping(views, pairs, device):
    """src and dst are views of one storage: every source block is read before any destination is
    written (docs/ops.md; also what torch.compile may produce, pytorch#198031)."""
    require_kernel("swap_blocks", device)
    check_swap_blocks_overlapping(views, pairs, device)


def check_swap_blocks_overlapping(views, pairs, device="cpu", op=ops.swap_blocks):
    def make_views(x):
        return (x[:], x) if views == "same" else (x[1:], x[:-1])

    x = random_bytes((7, 4, 2, 8), f32, generator(6))
    src, dst = make_views(x)
    expected = expected_copy(dst, pairs, 0, src=src)
    x_ref = x.clone()
    dev_x = x.to(device)
    op(*make_views(dev_x), mapping(pairs).to(device))
    x = dev_x.cpu()
    reference.swap_blocks(*make_views(x_ref), mapping(pairs))
    assert_bytes_equal(make_views(x)[1], expected, msg="dst vs expected")
    assert_bytes_equal(x, x_ref, msg="vs reference")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", ["cpu->cuda", "cuda->cpu"])
@pytest.mark.parametrize("mapping_device", ["cpu", "src"])
def test_swap_blocks_cuda(direction, mapping_device):
    gen = generator(7)
    src, dst = random_bytes((6, 4, 2, 8), bf16, gen), random_bytes((9, 4, 2, 8), bf16, gen)
    pairs = [(5, 8), (0, 3), (2, 0)]
    expected = expected_copy(dst, pairs, 0, src=src)
    if direction == "cpu->cuda":
        src, dst = src.pin_memory(), dst.cuda()
    else:
        src, dst = src.cuda(), dst.pin_memory()
    m = mapping(pairs).to(src.device if mapping_device == "src" else "cpu")
    ops.swap_blocks(src, dst, m)
    torch.cuda.synchronize()
    assert_bytes_equal(dst.cpu(), expected)


# ----------------------------------------------------------------------------------------------------
# gather_kv
# ----------------------------------------------------------------------------------------------------

# id: data dtype, fp8, per-head, layout, block size, out_dtype, pass num_tokens
GATHER_CASES = {
    "f32-NHD": (f32, None, False, "NHD", 16, None, False),
    "bf16-HND-num_tokens": (bf16, None, False, "HND", 3, None, True),
    "f16-stacked-to-f32": (f16, None, False, "stacked", 16, f32, False),
    "e4m3-tensor-default-bf16": (bf16, "e4m3", False, "NHD", 16, None, False),
    "e5m2-head-HND-to-f32": (f32, "e5m2", True, "HND", 3, f32, True),
    "e4m3-head-stacked-to-f16": (f16, "e4m3", True, "stacked", 1, f16, False),
    "e4m3-k-tensor-v-head": (bf16, "e4m3", (False, True), "NHD", 16, None, False),
}


def check_gather_kv(case, device="cpu", op=ops.gather_kv):
    dtype, fp8, per_head, layout, b, out_dtype, with_num_tokens = case
    seq_lens = [5, 0, 33, b, 1]
    kv = make_paged_kv(seq_lens=seq_lens, num_kv_heads=2, head_dim=16, block_size=b, dtype=dtype, layout=layout,
                       fp8=fp8, per_head_scale=per_head, seed=8)
    extra = dict(out_dtype=out_dtype, num_tokens=sum(seq_lens) if with_num_tokens else None)
    dev = kv.to(device)
    key, value = op(dev.key_cache, dev.value_cache, dev.block_tables, dev.seq_lens, **extra, **dev.scales)
    assert key.device.type == value.device.type == torch.device(device).type
    key, value = key.cpu(), value.cpu()
    extra.update(kv.scales)
    ref_key, ref_value = reference.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **extra)
    want_dtype = out_dtype or (bf16 if fp8 else dtype)
    for name, got, ref, truth in (("key", key, ref_key, kv.keys), ("value", value, ref_value, kv.values)):
        assert got.dtype == want_dtype and got.shape == (sum(seq_lens), 2, 16) and got.is_contiguous(), name
        assert_bytes_equal(got, ref, msg=f"{name} vs reference")
        # Dequantized values are exact in float64, so this cast rounds exactly as the kernel must.
        assert_bytes_equal(got, torch.cat(truth).to(want_dtype), msg=f"{name} vs expected")


@pytest.mark.parametrize("case", GATHER_CASES.values(), ids=GATHER_CASES.keys())
@pytest.mark.parametrize("device", DEVICES)
def test_gather_kv(case, device):
    require_kernel("gather_kv", device)
    check_gather_kv(case, device)


def check_gather_kv_mixed_layouts(device="cpu", op=ops.gather_kv):
    """key_cache NHD, value_cache the HND view of another allocation: separate strides per cache."""
    kv = make_paged_kv(seq_lens=[7, 20, 1], num_kv_heads=2, head_dim=16, block_size=4, dtype=bf16, fp8="e5m2",
                       per_head_scale=(False, True), seed=15)
    n = kv.num_blocks
    v_hnd = torch.empty(n, 2, 4, 16, dtype=kv.value_cache.dtype)
    v_hnd.transpose(1, 2).copy_(kv.value_cache)
    dev = kv.to(device)
    key, value = op(dev.key_cache, v_hnd.to(device).transpose(1, 2), dev.block_tables, dev.seq_lens,
                    num_tokens=28, out_dtype=f32, **dev.scales)
    assert_bytes_equal(key.cpu(), torch.cat(kv.keys).float(), msg="key")
    assert_bytes_equal(value.cpu(), torch.cat(kv.values).float(), msg="value")


@pytest.mark.parametrize("device", DEVICES)
def test_gather_kv_mixed_layouts(device):
    require_kernel("gather_kv", device)
    check_gather_kv_mixed_layouts(device)


@pytest.mark.parametrize("num_tokens", [0, None])
@pytest.mark.parametrize("device", DEVICES)
def test_gather_kv_empty(device, num_tokens):
    require_kernel("gather_kv", device)
    kv = make_paged_kv(seq_lens=[0, 0], num_kv_heads=2, head_dim=8, block_size=4, seed=9).to(device)
    key, value = ops.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, num_tokens=num_tokens)
    assert key.shape == value.shape == (0, 2, 8)
    assert key.dtype == value.dtype == f32
