"""The machine: CPU model, last-level cache, the kernels' ISA, and memory bandwidth measured with
torch in the same run (the yardstick every GB/s figure is compared with)."""

from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

import kvkernels
from kvkernels import memory

LLC_FALLBACK = 256 << 20


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def slug(text: str) -> str:
    """'Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.0GHz' -> 'intel-xeon-platinum-8480'."""
    text = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", " ", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "cpu"


def write_result(directory, kind: str, record: dict, text: str, cpu: Optional[str] = None,
                 when: Optional[datetime.datetime] = None) -> Path:
    """A run's result files, named after the CPU and the time: ``<directory>/<kind>-<cpu slug>-<YYYYmmdd-HHMMSS>``
    ``.json`` (the record) and ``.txt`` (the text, as printed). Returns the stem (the path without a suffix)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"{kind}-{slug(cpu or cpu_model())}-{(when or datetime.datetime.now()):%Y%m%d-%H%M%S}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    stem.with_suffix(".txt").write_text(text.rstrip("\n") + "\n")
    return stem


def _parse_size(text: str) -> int:
    """sysfs cache sizes: '307200K', '32M', or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def llc_bytes() -> Optional[int]:
    """Size of the level-3 cache seen by CPU 0 (sysfs), None when the kernel does not say."""
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(os.path.join(index, "level")) as f:
                if f.read().strip() != "3":
                    continue
            with open(os.path.join(index, "size")) as f:
                return _parse_size(f.read())
        except (OSError, ValueError, IndexError):
            continue
    return None


def kernel_isa() -> str:
    """The ISA the kvkernels CPU kernels dispatch to ("avx512" | "avx2" | "portable")."""
    cpu_isa = getattr(kvkernels, "cpu_isa", None)  # newer builds only
    return cpu_isa() if cpu_isa is not None else "unknown"


def machine_info(llc: Optional[int]) -> dict:
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),  # logical CPUs
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": torch.get_num_threads(),
        "llc_bytes": llc if llc is not None else LLC_FALLBACK,
        "llc_source": "sysfs" if llc is not None else "fallback (not found in sysfs)",
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kvkernels_cpu_isa": kernel_isa(),
        "isa_requested": os.environ.get("KVKERNELS_CPU_ISA"),
        "platform": platform.platform(),
        "transparent_hugepage": thp_mode(),
    }


def thp_mode() -> Optional[str]:
    """The kernel's transparent huge page mode (always / madvise / never), None if not reported.
    kvkernels.memory asks for huge pages, which "madvise" and "always" grant."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            m = re.search(r"\[(\w+)\]", f.read())
        return m.group(1) if m else None
    except OSError:
        return None


def _median_seconds(fn: Callable[[], object], min_time: float, min_reps: int = 5) -> float:
    fn()  # warmup: first touch, thread pool start
    times: list[float] = []
    while len(times) < min_reps or sum(times) < min_time:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(buffer_bytes: int, min_time: float) -> dict:
    """Read and copy bandwidth in GB/s (1e9 bytes) on float32 buffers of ``buffer_bytes``.

    Read: the best median of a few reductions (each streams the buffer once; which one runs
    closest to the memory limit depends on the build). Copy: ``dst.copy_(src)``, counting the
    bytes read plus the bytes written (the write-allocate traffic of the destination is not
    counted, as for the kernels' writes).
    """
    n = buffer_bytes // 4
    # In 2 MiB pages where the OS allows, like the benchmarked caches (kvkernels.memory).
    src = memory.empty((n,), torch.float32).fill_(1.0)  # written, so no page is the zero page
    read_methods = {"sum": lambda: torch.sum(src), "dot": lambda: torch.dot(src, src)}
    reads = {name: buffer_bytes / _median_seconds(fn, min_time) / 1e9 for name, fn in read_methods.items()}
    dst = memory.empty((n,), torch.float32).fill_(0.0)
    copy = 2 * buffer_bytes / _median_seconds(lambda: dst.copy_(src), min_time) / 1e9
    best = max(reads, key=reads.get)
    return {"read": reads[best], "read_method": best, "read_by_method": reads, "copy": copy,
            "buffer_bytes": buffer_bytes, "threads": torch.get_num_threads(),
            "huge_page_kib": memory.huge_page_kib()}  # of the process, with both buffers live
