// The attention kernel (attention_kernel.h) built for AVX-512 with VBMI and BF16 (Zen 4 and later,
// Sapphire Rapids and later). It differs from the VBMI build where the query is bf16 and the cache
// bf16 or fp8: there the logits and P V are vdpbf16ps dot products (KVK_BF16; attention_dp.h for
// decode, the dp form of attention_tiles.h for prefill), two multiply-adds per lane and instruction.
// Everything lives in namespace avx512bf16; isa.cpp decides at run time whether it is called.
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
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,avx2,fma,f16c")
#endif

#define KVK_ISA avx512bf16
#define KVK_AVX512_VBMI 1
#define KVK_BF16 1
#include "vec_avx512.h"
#include "attention_kernel.h"
#undef KVK_BF16
#undef KVK_AVX512_VBMI
#undef KVK_ISA

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kvkernels::cpu {
const AttentionKernels kAttentionAvx512Bf16{&avx512bf16::attend, &avx512bf16::merge_splits};
}  // namespace kvkernels::cpu
#endif  // __x86_64__
