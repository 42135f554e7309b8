"""``python -m kvkernels bench``: the CPU benchmark (how to run it and what it measures:
benchmarks/README.md).

Modules: ``cli`` (options, case list, progress, outputs), ``machine`` (CPU, LLC, measured
bandwidth), ``core`` (timing, layer rotation, result records), ``attention`` (decode, prefill,
MLA), ``cache_ops`` (copy_blocks, reshape_and_cache, gather_kv, merge), ``report`` (table, JSON,
PNG).
"""

from kvkernels.bench.cli import main

__all__ = ["main"]
