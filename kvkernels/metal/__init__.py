"""Metal back end of kvkernels: metal/*.metal kernels dispatched on the MPS device.

Importing this package registers ``kvkernels.metal.dispatch``'s functions as the MPS kernels of the
``torch.ops.kvkernels`` ops (Python ``torch.library`` registration: no Objective-C++ and no macOS build
step; see metal/README.md for why). Nothing is compiled at import: each kernel variant is compiled
by ``torch.mps.compile_shader`` on its first call and kept for the life of the process.

On Linux the same dispatch functions run the same sources through ``kvkernels.metal.emulator`` when
given CPU tensors (the tests do that); the CPU kernels of the ops are unaffected.
"""

import torch

from kvkernels.metal import dispatch

# Every op with a Metal implementation (swap_blocks: torch copies, since it crosses devices).
OPS = ("reshape_and_cache", "paged_attention", "paged_attention_out", "merge_attention_states",
       "merge_attention_states_out", "copy_blocks", "swap_blocks", "gather_kv", "concat_and_cache_mla", "mla_decompress",
       "mla_paged_attention", "mla_paged_attention_out")

_library = torch.library.Library("kvkernels", "IMPL")
for _name in OPS:
    _library.impl(_name, getattr(dispatch, _name), "MPS")

__all__ = ["dispatch", "OPS"]
