// Launchers of the kernel instances, included by the instance units: attention_f32.cu (float queries,
// every cache format), attention_f16.cu / attention_bf16.cu (16-bit queries over their own cache
// format) and attention_{f16,bf16}_{e4m3,e5m2}.cu (16-bit queries over fp8 caches): one (query dtype,
// cache format) pair or fewer per translation unit keeps each compile short for a parallel build.
// attention_{f32,f16,bf16}.cu define the launch_attention_<q> / launch_merge_<q> entry points declared
// in attention_common.cuh, which attention.cu calls; the fp8 units define the ones declared below.
#pragma once

#include <atomic>
#include <cstdint>

#include "attention_merge.cuh"
#include "attention_mma.cuh"
#include "attention_simt.cuh"

namespace kvkernels::attn_cuda {

// Launches `kernel` with SMEM bytes of dynamic shared memory, raising the kernel's opt-in limit on
// first use per device (a function attribute, not a stream operation: legal during capture).
template <typename Kernel>
cudaError_t launch_with_smem(Kernel kernel, std::atomic<uint64_t>& configured, int smem, int threads,
                             dim3 grid, cudaStream_t stream, const AttnArgs& a) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit == 0 || !(configured.load(std::memory_order_acquire) & bit)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  kernel<<<grid, threads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <typename QT, CacheFormat CF, int DPAD>
cudaError_t launch_simt(const AttnArgs& a, dim3 grid, cudaStream_t stream) {
  using C = SimtCfg<QT, CF, DPAD>;
  static std::atomic<uint64_t> configured{0};
  return launch_with_smem(simt_attention_kernel<QT, CF, DPAD>, configured, C::SMEM, C::NT, grid,
                          stream, a);
}

template <typename QT, CacheFormat CF, int DPAD, Path PATH>
cudaError_t launch_mma(const AttnArgs& a, dim3 grid, cudaStream_t stream) {
  using C = MmaCfg<QT, CF, DPAD, PATH>;
  static std::atomic<uint64_t> configured{0};
  return launch_with_smem(mma_attention_kernel<QT, CF, DPAD, PATH>, configured, C::SMEM, C::NT, grid,
                          stream, a);
}

template <typename QT, CacheFormat CF>
cudaError_t launch_for_cache(const AttnArgs& a, Path path, int dpad, dim3 grid,
                             cudaStream_t stream) {
  constexpr bool kMma = !std::is_same_v<QT, float> &&
                        (cache_esize(CF) == 1 || cache_esize(CF) == 2);
#define KVK_ATTN_DPAD(D)                                                              \
  if (dpad == D) {                                                                    \
    if (path == Path::kSimt) return launch_simt<QT, CF, D>(a, grid, stream);          \
    if constexpr (kMma) {                                                             \
      if (path == Path::kMmaDecode)                                                   \
        return launch_mma<QT, CF, D, Path::kMmaDecode>(a, grid, stream);              \
      if (path == Path::kMmaDecodeDeep)                                               \
        return launch_mma<QT, CF, D, Path::kMmaDecodeDeep>(a, grid, stream);          \
      if (path == Path::kMmaDecodeOcc3)                                               \
        return launch_mma<QT, CF, D, Path::kMmaDecodeOcc3>(a, grid, stream);          \
      if (path == Path::kMmaDecodeFused)                                              \
        return launch_mma<QT, CF, D, Path::kMmaDecodeFused>(a, grid, stream);         \
      if constexpr (has_persistent_decode(D)) {                                       \
        if (path == Path::kMmaDecodePersistent)                                       \
          return launch_mma<QT, CF, D, Path::kMmaDecodePersistent>(a, grid, stream);  \
      }                                                                               \
      if (path == Path::kMmaPrefill)                                                  \
        return launch_mma<QT, CF, D, Path::kMmaPrefill>(a, grid, stream);             \
      if (path == Path::kMmaPrefillDeep)                                              \
        return launch_mma<QT, CF, D, Path::kMmaPrefillDeep>(a, grid, stream);         \
      if constexpr (has_tall_prefill(CF, D)) {                                        \
        if (path == Path::kMmaPrefillTall)                                            \
          return launch_mma<QT, CF, D, Path::kMmaPrefillTall>(a, grid, stream);       \
      }                                                                               \
      if constexpr (cache_esize(CF) == 1) {                                           \
        if (path == Path::kMmaDecodeFp8Smem)                                          \
          return launch_mma<QT, CF, D, Path::kMmaDecodeFp8Smem>(a, grid, stream);     \
      }                                                                               \
    }                                                                                 \
    return cudaErrorInvalidValue;                                                     \
  }
  KVK_ATTN_DPAD(64)
  KVK_ATTN_DPAD(128)
  KVK_ATTN_DPAD(256)
#undef KVK_ATTN_DPAD
  return cudaErrorInvalidValue;
}

// The fp8 cache instances of the 16-bit query dtypes (attention_{f16,bf16}_{e4m3,e5m2}.cu), called by
// launch_attention_f16 / launch_attention_bf16.
cudaError_t launch_attention_f16_e4m3(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                      cudaStream_t stream);
cudaError_t launch_attention_f16_e5m2(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                      cudaStream_t stream);
cudaError_t launch_attention_bf16_e4m3(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                       cudaStream_t stream);
cudaError_t launch_attention_bf16_e5m2(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                       cudaStream_t stream);

// The cache formats a query dtype can read: its own, and both fp8 formats (float queries: one unit).
template <typename QT, CacheFormat SELF>
cudaError_t launch_for_query(const AttnArgs& a, Path path, int dpad, dim3 grid,
                             cudaStream_t stream) {
  switch (a.p.kv.format) {
    case SELF: return launch_for_cache<QT, SELF>(a, path, dpad, grid, stream);
    case CacheFormat::kFp8E4M3:
      return launch_for_cache<QT, CacheFormat::kFp8E4M3>(a, path, dpad, grid, stream);
    case CacheFormat::kFp8E5M2:
      return launch_for_cache<QT, CacheFormat::kFp8E5M2>(a, path, dpad, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename QT>
cudaError_t launch_merge(const AttnArgs& a, cudaStream_t stream) {
  const int64_t rows = a.p.num_tokens * a.p.num_heads;
  const int64_t blocks = (rows + kMergeThreads / 32 - 1) / (kMergeThreads / 32);
  if (blocks == 0) return cudaSuccess;
  merge_splits_kernel<QT><<<dim3(static_cast<unsigned>(blocks)), kMergeThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kvkernels::attn_cuda
