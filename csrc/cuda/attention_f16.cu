// Paged-attention kernel instances for __half queries (attention_launch.cuh): the SIMT kernel over
// f16 and fp8 caches, and the tensor-core decode / prefill kernels over them,
// each for padded head dims 64 / 128 / 256, plus the split merge.
#include "attention_launch.cuh"

namespace kvkernels::attn_cuda {

cudaError_t launch_attention_f16(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                 cudaStream_t stream) {
  return launch_for_query<__half, CacheFormat::kFloat16>(a, path, dpad, grid, stream);
}

cudaError_t launch_merge_f16(const AttnArgs& a, cudaStream_t stream) {
  return launch_merge<__half>(a, stream);
}

}  // namespace kvkernels::attn_cuda
