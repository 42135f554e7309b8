// The Hopper wgmma MLA decode (mla_attention_sm90.cuh) for __nv_bfloat16 q over its own and fp8 latent caches.
// Its kernel body exists in the sm_90a build only (the other architectures of a multi-arch build compile
// an empty stub, which mla_sm90_compiled() tells apart); scripts/check_cuda.sh compiles this unit for
// sm_90a alone.
#include "mla_attention_sm90.cuh"

namespace kvkernels::mla_cuda {

bool mla_sm90_available_bf16(CacheFormat format) {
  return MlaSm90ForQ<__nv_bfloat16, CacheFormat::kBFloat16>::compiled(format);
}

cudaError_t launch_mla_sm90_bf16(const MlaArgs& m, const CUtensorMap* map, dim3 grid, int smem,
                              cudaStream_t stream) {
  return MlaSm90ForQ<__nv_bfloat16, CacheFormat::kBFloat16>::launch(m, map, grid, smem, stream);
}

}  // namespace kvkernels::mla_cuda
