// Paged-attention kernel instances for __nv_bfloat16 queries over bf16 caches (attention_launch.cuh):
// the SIMT kernel and the tensor-core decode / prefill kernels, each for padded head dims
// 64 / 128 / 256; the split merge; and the dispatch by cache format (the fp8 cache instances
// are in attention_bf16_e4m3.cu and attention_bf16_e5m2.cu).
#include "attention_launch.cuh"

namespace kvkernels::attn_cuda {

cudaError_t launch_attention_bf16(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                  cudaStream_t stream) {
  switch (a.p.kv.format) {
    case CacheFormat::kBFloat16:
      return launch_for_cache<__nv_bfloat16, CacheFormat::kBFloat16>(a, path, dpad, grid, stream);
    case CacheFormat::kFp8E4M3: return launch_attention_bf16_e4m3(a, path, dpad, grid, stream);
    case CacheFormat::kFp8E5M2: return launch_attention_bf16_e5m2(a, path, dpad, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_merge_bf16(const AttnArgs& a, cudaStream_t stream) {
  return launch_merge<__nv_bfloat16>(a, stream);
}

}  // namespace kvkernels::attn_cuda
