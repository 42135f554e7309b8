// The row kernels (rows_kernel.h) built for AVX-512 (F, BW, VL), like attention_avx512.cpp:
// everything compiled inside the target region lives in namespace avx512, and rows.cpp decides at
// run time whether it is called.
#if defined(__x86_64__)
#include "x86_intrinsics.h"  // first: <immintrin.h> without GCC 12's false uninitialized warnings

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "kvkernels/softmax.h"
#include "rows.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif

#define KVK_ISA avx512
#include "vec_avx512.h"
#include "row_io_avx512.h"
#include "rows_kernel.h"
#undef KVK_ISA

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kvkernels::cpu {
const RowKernels kRowsAvx512{&avx512::write_tokens, &avx512::gather, &avx512::merge};
}  // namespace kvkernels::cpu
#endif  // __x86_64__
