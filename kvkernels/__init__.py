"""kvkernels: paged KV-cache kernels as torch.ops.kvkernels custom ops.

Importing the package loads the compiled extension (which registers every op and its CPU/CUDA
kernels) and then kvkernels.ops (typed wrappers and fake kernels for torch.compile).
"""

import torch  # noqa: F401  (loads libtorch before the extension that links to it)

from kvkernels import _C  # noqa: F401  (registers torch.ops.kvkernels.*)
from kvkernels import ops, reference  # noqa: F401

__all__ = ["ops", "reference"]
__version__ = "0.1.0"
