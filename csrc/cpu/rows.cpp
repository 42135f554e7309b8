// Picks the row kernels (rows.h) of the active ISA.
#include "rows.h"

#include "isa.h"

namespace kvkernels::cpu {

const RowKernels& row_kernels() {
  const Isa isa = active_isa();
#if defined(__x86_64__)
  // The VBMI, BF16 and AMX paths only change the attention kernels; the rows use plain AVX-512.
  if (isa >= Isa::kAvx512) return kRowsAvx512;
  if (isa == Isa::kAvx2) return kRowsAvx2;
#endif
  (void)isa;
  return kRowsPortable;
}

}  // namespace kvkernels::cpu
