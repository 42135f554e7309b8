// Torch-free helpers shared by the CPU, CUDA and (as reference math) Metal backends.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVK_HOST_DEVICE inline
#endif

namespace kvkernels {

// Cache element formats. fp8 formats are stored as raw bytes; the kernels convert in registers.
enum class CacheFormat : int { kFloat32, kFloat16, kBFloat16, kFp8E4M3, kFp8E5M2 };

KVK_HOST_DEVICE bool is_fp8(CacheFormat f) {
  return f == CacheFormat::kFp8E4M3 || f == CacheFormat::kFp8E5M2;
}

KVK_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace kvkernels
