"""kvkernels.memory: cache storage in 2 MiB pages (huge pages requested with madvise on Linux)."""

import ctypes
import mmap
import os
import sys

import pytest
import torch

import kvkernels
from kvkernels import memory

LINUX = sys.platform.startswith("linux")
THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(address: int) -> list:
    """VmFlags of the mapping of this process that contains ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32])
def test_empty_is_a_usable_contiguous_tensor(dtype):
    shape = (3, 2, 257, 16, 128)  # 3.2 M elements: over 2 MiB for every dtype here
    t = memory.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    src = torch.randn(shape).to(dtype)
    t.copy_(src)
    assert torch.equal(t.view(torch.uint8), src.view(torch.uint8))
    if LINUX:
        assert t.data_ptr() % memory.HUGE_PAGE == 0
        assert t.untyped_storage().nbytes() <= t.numel() * t.element_size() + memory.HUGE_PAGE


def test_small_and_non_cpu_tensors_are_plain():
    small = memory.empty((4, 1024), torch.float32)  # 16 KiB
    assert small.untyped_storage().nbytes() == 16 * 1024
    meta = memory.empty((1 << 20, 64), torch.float32, "meta")
    assert meta.device.type == "meta" and meta.shape == (1 << 20, 64)


def test_copy_equals_clone():
    x = torch.randn(3, 700, 1024)
    y = memory.copy(x.transpose(0, 1))
    assert y.is_contiguous() and torch.equal(y, x.transpose(0, 1).contiguous())


@pytest.mark.skipif(not (LINUX and THP), reason="needs Linux with transparent huge pages")
def test_huge_pages_are_requested():
    t = memory.empty((16 << 20,), torch.uint8)
    assert "hg" in vm_flags(t.data_ptr()), "MADV_HUGEPAGE was not applied to the storage"
    # A fresh anonymous mapping without the advice has no hg flag, so the check above can fail.
    # (Not a plain torch.empty: malloc may serve it from a region an earlier test advised.)
    plain = mmap.mmap(-1, 16 << 20)
    assert "hg" not in vm_flags(ctypes.addressof(ctypes.c_char.from_buffer(plain)))


def test_cache_pools_use_it():
    cache = kvkernels.PagedKVCache(num_layers=2, num_kv_heads=8, head_dim=128, num_blocks=64, block_size=16,
                                   dtype=torch.bfloat16)
    assert cache.kv.numel() * 2 >= memory.HUGE_PAGE
    if LINUX:
        assert cache.kv.data_ptr() % memory.HUGE_PAGE == 0
    if LINUX and THP:
        assert "hg" in vm_flags(cache.kv.data_ptr())
    mla = kvkernels.MLAPagedCache(num_layers=2, kv_lora_rank=512, rope_dim=64, num_blocks=64, block_size=64)
    if LINUX and THP:
        assert "hg" in vm_flags(mla.kv.data_ptr())


def test_advice_refused_still_gives_a_tensor(monkeypatch):
    """Where madvise is unavailable (no libc symbol, other loaders) the storage is plain but usable."""
    def no_libc(*args, **kwargs):
        raise OSError("no libc here")
    monkeypatch.setattr(memory.ctypes, "CDLL", no_libc)
    assert memory._madvise_huge(0, memory.HUGE_PAGE) is False
    t = memory.empty((4 << 20,), torch.uint8)
    t.fill_(7)
    assert t.shape == (4 << 20,) and int(t[-1]) == 7
