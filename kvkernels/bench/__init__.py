"""``python -m kvkernels bench``: the CPU benchmark (how to run it and what it measures:
benchmarks/README.md).

Modules: ``cli`` (options, case list, progress, outputs), ``machine`` (CPU, LLC, measured
bandwidth), ``core`` (timing, layer rotation, result records), ``attention`` (decode, prefill,
MLA), ``cache_ops`` (copy_blocks, reshape_and_cache, gather_kv, merge), ``report`` (table, JSON,
PNG), ``cuda`` (the ``--device cuda`` suite: CUDA-event timing, device bandwidth, the cache ops and
the hook for the CUDA attention cases).
"""

from kvkernels.bench.cli import main

__all__ = ["main"]
