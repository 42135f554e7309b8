// The Hopper wgmma prefill (attention_sm90.cuh) for __half queries over f16 caches, padded head dims 64 / 128 / 256
// (the overlapped loop, Path::kWgmmaPrefillOverlap, at 64 / 128),
// (fp8 caches: attention_sm90_f16_fp8.cu).
// Its kernel body exists in the sm_90a build only (the other architectures of a multi-arch build compile
// an empty stub, which sm90_prefill_compiled() tells apart); scripts/check_cuda.sh compiles this unit for
// sm_90a alone.
#include "attention_sm90.cuh"

namespace kvkernels::attn_cuda {

bool sm90_prefill_available_f16(int dpad, CacheFormat cf) {
  if (cf != CacheFormat::kFloat16) return sm90_prefill_available_f16_fp8(dpad, cf);
  constexpr CacheFormat CF = CacheFormat::kFloat16;
  return dpad == 64    ? sm90_prefill_compiled<__half, CF, 64>()
         : dpad == 128 ? sm90_prefill_compiled<__half, CF, 128>()
         : dpad == 256 ? sm90_prefill_compiled<__half, CF, 256>()
                       : false;
}

cudaError_t launch_attention_sm90_f16(const AttnArgs& a, const Sm90KvTma& tma, int dpad, bool overlap, dim3 grid,
                                       cudaStream_t stream) {
  if (a.p.kv.format != CacheFormat::kFloat16) return launch_attention_sm90_f16_fp8(a, tma, dpad, overlap, grid, stream);
  constexpr CacheFormat CF = CacheFormat::kFloat16;
  if (dpad == 64) return launch_sm90_prefill<__half, CF, 64>(a, tma, overlap, grid, stream);
  if (dpad == 128) return launch_sm90_prefill<__half, CF, 128>(a, tma, overlap, grid, stream);
  if (dpad == 256) return launch_sm90_prefill<__half, CF, 256>(a, tma, overlap, grid, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kvkernels::attn_cuda
