// The row kernels (rows_kernel.h) built for AVX2 + FMA + F16C, like attention_avx2.cpp:
// everything compiled inside the target region lives in namespace avx2, and rows.cpp decides at
// run time whether it is called.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "kvkernels/softmax.h"
#include "rows.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define KVK_ISA avx2
#include "vec_avx2.h"
#include "row_io_avx2.h"
#include "rows_kernel.h"
#undef KVK_ISA

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kvkernels::cpu {
const RowKernels kRowsAvx2{&avx2::write_tokens, &avx2::gather, &avx2::merge};
}  // namespace kvkernels::cpu
#endif  // __x86_64__
