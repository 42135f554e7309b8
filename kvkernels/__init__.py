"""kvkernels: paged KV-cache kernels as torch.ops.kvkernels custom ops.

Importing the package loads the compiled extension (which registers every op and its CPU/CUDA
kernels) and then kvkernels.ops (typed wrappers and fake kernels for torch.compile).
"""

try:
    import torch  # noqa: F401  (loads libtorch before the extension that links to it)
except ImportError as _torch_missing:  # a JAX-only environment: kvkernels.jax needs no torch (docs/jax.md)
    torch = None
    _TORCH_ERROR = _torch_missing

if torch is not None:
    from kvkernels import _C  # noqa: F401  (registers torch.ops.kvkernels.*)
    from kvkernels import ops, reference  # noqa: F401
    from kvkernels import metal  # noqa: F401  (registers the MPS kernels: metal/*.metal)
    from kvkernels.cache import BlockPool, MLAPagedCache, OutOfBlocksError, PagedKVCache  # noqa: E402
else:
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"kvkernels.{name} needs torch, which is not installed ({_TORCH_ERROR}); "
                          "kvkernels.jax works without it")


def cpu_isa() -> str:
    """SIMD path the CPU kernels use now: "avx512amx", "avx512bf16", "avx512vbmi", "avx512", "avx2" or
    "portable".

    The best one the CPU supports, unless the environment variable KVKERNELS_CPU_ISA names one
    (it is read on every op call, so it can be changed at run time).
    """
    if torch is None:
        from kvkernels.jax import cpu_isa as jax_cpu_isa
        return jax_cpu_isa()
    return _C.cpu_isa()


__all__ = ["ops", "reference", "cpu_isa", "BlockPool", "MLAPagedCache", "PagedKVCache", "OutOfBlocksError"]
__version__ = "0.1.0"
