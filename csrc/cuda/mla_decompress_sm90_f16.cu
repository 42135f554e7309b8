// The Hopper wgmma mla_decompress (mla_decompress_sm90.cuh) for __half weights over __half, fp8 e4m3 and
// fp8 e5m2 latent caches. Its kernel body exists in the sm_90a build only (the other architectures of a
// multi-arch build compile an empty stub, which sm90_decompress_compiled() tells apart);
// scripts/check_cuda.sh compiles this unit for sm_90a alone.
#define KVK_DECOMPRESS_SM90_INSTANCES 1
#include "mla_decompress_sm90.cuh"

namespace kvkernels::mla_cuda {

#define KVK_INSTANCE(C)                                                                             \
  template bool sm90_decompress_compiled<__half, C>();                                         \
  template cudaError_t launch_sm90_decompress<__half, C>(const DecompressArgs&, const CUtensorMap&, \
                                                              unsigned, int, cudaStream_t);
KVK_INSTANCE(__half)
KVK_INSTANCE(kc::fp8_e4m3)
KVK_INSTANCE(kc::fp8_e5m2)
#undef KVK_INSTANCE

}  // namespace kvkernels::mla_cuda
