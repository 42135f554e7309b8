// Paged-attention kernel instances for float queries (attention_launch.cuh): the SIMT kernel over
// float32 and fp8 caches,
// each for padded head dims 64 / 128 / 256, plus the split merge.
#include "attention_launch.cuh"

namespace kvkernels::attn_cuda {

cudaError_t launch_attention_f32(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                 cudaStream_t stream) {
  return launch_for_query<float, CacheFormat::kFloat32>(a, path, dpad, grid, stream);
}

cudaError_t launch_merge_f32(const AttnArgs& a, cudaStream_t stream) {
  return launch_merge<float>(a, stream);
}

}  // namespace kvkernels::attn_cuda
