// The driver's cuTensorMapEncodeTiled (CUDA 12.0+ driver API) for the host side of the TMA paths
// (mla_decompress.cu: the w_kv_b map; mla_attention.cu: the latent-cache map of the wgmma decode). It is
// looked up once through the runtime (cudaGetDriverEntryPoint[ByVersion]) because libcuda is not linked;
// the CPU emulator hands out its own encoder the same way (tests/cuda_emu/cuda_emu.h).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

namespace kvkernels::mla_cuda {

// cuTensorMapEncodeTiled's signature, called through a pointer.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// Looked up once (thread-safe static); nullptr when the driver does not have it (then the TMA paths
// are reported as unavailable, never silently skipped).
inline EncodeTiledFn encode_tiled_fn() {
  static const EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();  // not a launch error of the op
      ptr = nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

}  // namespace kvkernels::mla_cuda
