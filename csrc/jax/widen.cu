#include "widen.h"

namespace kvkernels::jaxffi {
namespace {

__global__ void widen_kernel(const int32_t* __restrict__ src, int64_t* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

}  // namespace

cudaError_t widen_int32(const int32_t* src, int64_t* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  widen_kernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kThreads, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}

}  // namespace kvkernels::jaxffi
