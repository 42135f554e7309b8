// Launcher of the CUDA mla_decompress (mla_decompress.cuh): token starts on the device
// (token_starts_kernel of gather.cuh), then one GEMM launch over (token tiles, column tiles).
// Instances: every weight dtype over its own cache dtype and both fp8 formats.
#include <algorithm>
#include <atomic>

#include "gather.cuh"
#include "mla_api.h"
#include "mla_decompress.cuh"

namespace kvkernels::mla_cuda {
namespace {

cuda::Status failed(const char* message) { return cuda::Status{cudaSuccess, message}; }

bool aligned(const void* ptr, int64_t a) { return reinterpret_cast<uintptr_t>(ptr) % a == 0; }

template <typename T, typename C>
cuda::Status launch(DecompressArgs d, cudaStream_t stream) {
  using Cfg = DecCfg<T>;
  const MlaDecompressParams& p = d.p;
  d.rpad = (p.kv_lora_rank + Cfg::BK - 1) / Cfg::BK * Cfg::BK;
  const int64_t vec_bytes = std::min<int64_t>(16, 8 * int64_t(sizeof(C)));
  d.row_vec = aligned(p.kv.k, vec_bytes) && (p.kv.k_stride_block * int64_t(sizeof(C))) % vec_bytes == 0 &&
              (p.kv.k_stride_slot * int64_t(sizeof(C))) % vec_bytes == 0;
  d.w_async = aligned(p.w_kv_b, 16);
  const int64_t grid_x = (p.num_tokens + Cfg::BM - 1) / Cfg::BM;
  const int64_t grid_y = (int64_t(d.n_total) + Cfg::BN - 1) / Cfg::BN;
  if (grid_x > 0x7fffffff || grid_y > 65535) return failed("too many tokens / heads for one launch");
  const int smem = Cfg::smem(d.rpad);
  // Raise the opt-in limit once per device and size (a function attribute: legal during capture).
  static std::atomic<int> configured[64] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  std::atomic<int>& done = configured[dev < 64 ? dev : 63];
  int have = done.load(std::memory_order_acquire);
  if (dev >= 64 || smem > have) {
    err = cudaFuncSetAttribute(mla_decompress_kernel<T, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cuda::Status{err, nullptr};
    while (have < smem && !done.compare_exchange_weak(have, smem, std::memory_order_acq_rel)) {
    }
  }
  mla_decompress_kernel<T, C><<<dim3(unsigned(grid_x), unsigned(grid_y)), Cfg::NT, smem, stream>>>(d);
  return cuda::Status{cudaGetLastError(), nullptr};
}

}  // namespace

cuda::Status mla_decompress(const MlaDecompressParams& p, int device, int64_t* token_start_scratch,
                            cudaStream_t stream) {
  if (p.num_tokens == 0) return cuda::Status{};
  if (p.kv_lora_rank <= 0 || p.kv_lora_rank % 8 != 0 || p.kv_lora_rank > kMaxValueWidth)
    return failed("kv_lora_rank must be a positive multiple of 8 up to 512");
  int major = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  if (major < 8) return failed("needs compute capability 8.0 or newer (cp.async, bf16 mma)");
  DecompressArgs d;
  d.p = p;
  d.p.token_start = token_start_scratch;
  const int64_t n_total = int64_t(p.num_heads) * (p.qk_nope_head_dim + p.v_head_dim);
  if (n_total > 0x7fffffff) return failed("num_heads * (qk_nope_head_dim + v_head_dim) too large");
  d.n_total = static_cast<int>(n_total);
  // starts[0] = 0 even without sequences: the kernel reads starts[num_seqs].
  kc::token_starts_kernel<<<1, kc::kScanThreads, 0, stream>>>(p.kv.seq_lens, p.kv.num_seqs,
                                                              token_start_scratch);
  err = cudaGetLastError();
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  return kc::dispatch_float_and_cache(p.w_format, p.kv.format, [&](auto wt, auto ct) {
    return launch<typename decltype(wt)::type, typename decltype(ct)::type>(d, stream);
  });
}

}  // namespace kvkernels::mla_cuda
