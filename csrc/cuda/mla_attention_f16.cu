// Tensor-core MLA attention instances for __half q (mla_attention_mma.cuh): fp16 and fp8 latent
// caches, 16 and 64 rows per CTA.
#include "mla_attention_launch.cuh"

namespace kvkernels::mla_cuda {

cudaError_t launch_mla_mma_f16(const MlaArgs& m, MlaPath path, dim3 grid, int smem,
                               cudaStream_t stream) {
  return launch_mma_for_q<__half, CacheFormat::kFloat16>(m, path, grid, smem, stream);
}

}  // namespace kvkernels::mla_cuda
