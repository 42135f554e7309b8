"""kvkernels for JAX: the paged-attention and cache kernels as XLA FFI custom calls, a functional paged cache
and a small Llama with a prefill / decode loop on it (docs/jax.md).

* ``kvkernels.jax.paged_attention``, ``reshape_and_cache``, ``copy_blocks``, ``gather_kv``
  (kvkernels/jax/ops.py): the ops of docs/ops.md on the CPU kernels (run-time ISA dispatch) and the CUDA
  kernels, jit / vmap / eval_shape-able, cache writes functional and in place under donation;
* ``PagedKVCache`` / ``PageManager`` (kvkernels/jax/cache.py): a pytree of per-layer K/V pages, block
  tables and lengths, with host-side page allocation between steps;
* ``kvkernels.jax.llama``: a Llama for the two-phase (prefill, then jitted decode) loop.

The library (build-jax/libkvkernels_jax.so, ``make jax``) is loaded when the first op is traced. This
package does not import torch itself; ``import kvkernels.jax`` runs ``kvkernels/__init__.py``, which loads
torch and the torch extension when torch is installed and skips them when it is not.
"""

from kvkernels.jax._library import build_library, cpu_isa, cuda_library_path, library_path
from kvkernels.jax.cache import PagedKVCache, PageManager
from kvkernels.jax.ops import copy_blocks, gather_kv, paged_attention, reshape_and_cache

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "gather_kv", "PagedKVCache", "PageManager",
           "cpu_isa", "build_library", "library_path", "cuda_library_path"]
