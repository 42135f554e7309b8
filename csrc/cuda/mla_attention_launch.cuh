// Launch helpers of the MLA attention kernel instances, included by mla_attention_{f16,bf16,simt}.cu
// (one group of instances per translation unit keeps each nvcc run small); each defines entry
// points declared in mla_common.cuh, which the planner in mla_attention.cu calls.
#pragma once

#include <atomic>
#include <cstdint>

#include "mla_attention_mma.cuh"
#include "mla_merge.cuh"

namespace kvkernels::mla_cuda {

// Launches `kernel` with `smem` bytes of dynamic shared memory (raise_smem_limit, mla_common.cuh).
template <typename Kernel>
cudaError_t launch_with_smem(Kernel kernel, std::atomic<int>* configured, int smem, int threads,
                             dim3 grid, cudaStream_t stream, const MlaArgs& m) {
  const cudaError_t err = raise_smem_limit(kernel, configured, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, threads, smem, stream>>>(m);
  return cudaGetLastError();
}

template <typename T, CacheFormat CF, MlaPath PATH>
cudaError_t launch_mma_instance(const MlaArgs& m, dim3 grid, int smem, cudaStream_t stream) {
  static std::atomic<int> configured[64] = {};
  return launch_with_smem(mla_mma_kernel<T, CF, PATH>, configured, smem, mla_threads(PATH), grid,
                          stream, m);
}

// The cache formats a 16-bit q can read: its own and both fp8 formats; both tensor-core shapes.
template <typename T, CacheFormat SELF>
cudaError_t launch_mma_for_q(const MlaArgs& m, MlaPath path, dim3 grid, int smem,
                             cudaStream_t stream) {
  auto by_path = [&](auto cf) -> cudaError_t {
    constexpr CacheFormat CF = decltype(cf)::value;
    if (path == MlaPath::kMma16) return launch_mma_instance<T, CF, MlaPath::kMma16>(m, grid, smem, stream);
    if (path == MlaPath::kMma64) return launch_mma_instance<T, CF, MlaPath::kMma64>(m, grid, smem, stream);
    return cudaErrorInvalidValue;
  };
  switch (m.a.p.kv.format) {
    case SELF: return by_path(std::integral_constant<CacheFormat, SELF>{});
    case CacheFormat::kFp8E4M3:
      return by_path(std::integral_constant<CacheFormat, CacheFormat::kFp8E4M3>{});
    case CacheFormat::kFp8E5M2:
      return by_path(std::integral_constant<CacheFormat, CacheFormat::kFp8E5M2>{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvkernels::mla_cuda
