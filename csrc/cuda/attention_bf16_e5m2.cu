// Paged-attention kernel instances for __nv_bfloat16 queries over e5m2 caches
// (attention_launch.cuh): the SIMT kernel and the tensor-core decode / prefill kernels,
// each for padded head dims 64 / 128 / 256; called by attention_bf16.cu. A unit of their
// own: with every cache format in one unit per query dtype, nvcc took ~40 CPU-s on it for
// sm_90a, the longest compile of a parallel build.
#include "attention_launch.cuh"

namespace kvkernels::attn_cuda {

cudaError_t launch_attention_bf16_e5m2(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                       cudaStream_t stream) {
  return launch_for_cache<__nv_bfloat16, CacheFormat::kFp8E5M2>(a, path, dpad, grid, stream);
}

}  // namespace kvkernels::attn_cuda
