// The attention kernel (attention_kernel.h) built for AVX-512 (F, BW, VL). Everything compiled inside the
// target region lives in namespace avx512, so nothing it emits can be picked by the linker for code
// that runs on a CPU without these instructions; isa.cpp decides at run time whether it is called.
#if defined(__x86_64__)
#include "x86_intrinsics.h"  // first: <immintrin.h> without GCC 12's false uninitialized warnings

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_plan.h"
#include "convert.h"
#include "kvkernels/softmax.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif

#define KVK_ISA avx512
#include "vec_avx512.h"
#include "attention_kernel.h"
#undef KVK_ISA

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kvkernels::cpu {
const AttentionKernels kAttentionAvx512{&avx512::attend, &avx512::merge_splits};
}  // namespace kvkernels::cpu
#endif  // __x86_64__
