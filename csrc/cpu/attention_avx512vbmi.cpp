// The attention kernel (attention_kernel.h) built for AVX-512 with AVX512_VBMI. It differs from the
// plain AVX-512 build in one place: fp8 caches are read as bf16 Words through a vpermi2b lookup
// table (KVK_AVX512_VBMI in vec_avx512.h) instead of the shift-and-patch conversion to float.
// Everything lives in namespace avx512vbmi; isa.cpp decides at run time whether it is called.
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
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")
#endif

#define KVK_ISA avx512vbmi
#define KVK_AVX512_VBMI 1
#include "vec_avx512.h"
#include "attention_kernel.h"
#undef KVK_AVX512_VBMI
#undef KVK_ISA

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kvkernels::cpu {
const AttentionKernels kAttentionAvx512Vbmi{&avx512vbmi::attend, &avx512vbmi::merge_splits};
}  // namespace kvkernels::cpu
#endif  // __x86_64__
