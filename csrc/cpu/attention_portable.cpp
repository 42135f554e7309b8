// The attention kernel (attention_kernel.h) in plain C++: the path for CPUs without AVX2, for
// non-x86 machines, and the one KVKERNELS_CPU_ISA=portable forces.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_plan.h"
#include "convert.h"
#include "kvkernels/softmax.h"

#define KVK_ISA portable
#include "vec_portable.h"
#include "attention_kernel.h"
#undef KVK_ISA

namespace kvkernels::cpu {
const AttentionKernels kAttentionPortable{&portable::attend, &portable::merge_splits};
}  // namespace kvkernels::cpu
