// int32 -> int64 copy of an index array on the device (csrc/jax/widen.cu), for the CUDA handlers of
// kvkernels.jax: JAX makes integer arrays int32 unless x64 is on, and the cache-op kernels read int64
// slot mappings and block mappings. Enqueued on `stream`, no synchronization.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvkernels::jaxffi {

cudaError_t widen_int32(const int32_t* src, int64_t* dst, int64_t n, cudaStream_t stream);

}  // namespace kvkernels::jaxffi
