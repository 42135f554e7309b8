// The row kernels (rows_kernel.h) in plain C++: the path for CPUs without AVX2, for non-x86
// machines, and the one KVKERNELS_CPU_ISA=portable forces. Each lane goes through the scalar
// conversions, so this path is the reference the vector ones are tested against.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "kvkernels/softmax.h"
#include "rows.h"

#define KVK_ISA portable
#include "vec_portable.h"
#include "row_io_portable.h"
#include "rows_kernel.h"
#undef KVK_ISA

namespace kvkernels::cpu {
const RowKernels kRowsPortable{&portable::write_tokens, &portable::gather, &portable::merge};
}  // namespace kvkernels::cpu
