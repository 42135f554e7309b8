// Tensor-core MLA attention instances for __nv_bfloat16 q (mla_attention_mma.cuh): bf16 and fp8
// latent caches, 16 and 64 rows per CTA.
#include "mla_attention_launch.cuh"

namespace kvkernels::mla_cuda {

cudaError_t launch_mla_mma_bf16(const MlaArgs& m, MlaPath path, dim3 grid, int smem,
                                cudaStream_t stream) {
  return launch_mma_for_q<__nv_bfloat16, CacheFormat::kBFloat16>(m, path, grid, smem, stream);
}

}  // namespace kvkernels::mla_cuda
