// The attention kernel (attention_kernel.h) built for AVX2 + FMA + F16C. Everything compiled inside the
// target region lives in namespace avx2, so nothing it emits can be picked by the linker for code
// that runs on a CPU without these instructions; isa.cpp decides at run time whether it is called.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_plan.h"
#include "convert.h"
#include "kvkernels/softmax.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define KVK_ISA avx2
#include "vec_avx2.h"
#include "attention_kernel.h"
#undef KVK_ISA

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kvkernels::cpu {
const AttentionKernels kAttentionAvx2{&avx2::attend, &avx2::merge_splits};
}  // namespace kvkernels::cpu
#endif  // __x86_64__
