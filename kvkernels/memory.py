"""Host buffers for KV caches in 2 MiB pages (Linux transparent huge pages), where the OS allows.

A paged cache is read a block at a time at scattered addresses, so with 4 KiB pages nearly every
block of a long context costs TLB misses (a bfloat16 block of 16 slots x 8 kv heads x 128 is 32 KiB,
8 pages, for K alone), and in a virtual machine each miss is a two-level page walk. Asking for
huge pages (``madvise(MADV_HUGEPAGE)`` on a 2 MiB-aligned range, before the memory is touched) lets
one TLB entry cover 64 such blocks. Measured on the development machine (2 threads, decode batch 8
x 4096 tokens, the same kernel over caches allocated both ways in one process, alternating calls):
bfloat16 1.035-1.092x, fp8 1.045-1.091x (benchmarks/huge_pages.py; results under benchmarks/results).

It is advice, not a requirement: where THP is off (``/sys/kernel/mm/transparent_hugepage/enabled``
= never), on other systems and for small or non-CPU tensors, :func:`empty` is ``torch.empty``.
PyTorch can do the same for every CPU allocation of 2 MiB or more with ``THP_MEM_ALLOC_ENABLE=1``
set before it starts; this module does it for the cache storage only.
"""

from __future__ import annotations

import ctypes
import math
import sys
from typing import Optional, Sequence, Union

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise_huge(address: int, length: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(address, length, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def empty(shape: Sequence[int], dtype: torch.dtype,
          device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """An uninitialized contiguous tensor like ``torch.empty(shape, dtype=dtype, device=device)``;
    on Linux CPU, one of 2 MiB or more starts on a 2 MiB boundary with huge pages requested for
    its whole 2 MiB pages (the storage is up to 2 MiB larger than the tensor)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    buf = raw[offset:offset + nbytes]
    _madvise_huge(buf.data_ptr(), nbytes // HUGE_PAGE * HUGE_PAGE)
    return buf.view(dtype).view(tuple(shape))


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in storage from :func:`empty` (``t.clone()`` in huge pages)."""
    return empty(t.shape, t.dtype, t.device).copy_(t)


def huge_page_kib() -> Optional[int]:
    """KiB of this process's memory in transparent huge pages now (None where not reported)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
