// The Hopper wgmma prefill (attention_sm90.cuh) for __nv_bfloat16 queries over bf16 caches, padded head dims 64 / 128 / 256
// (the overlapped loop, Path::kWgmmaPrefillOverlap, at 64 / 128),
// (fp8 caches: attention_sm90_bf16_fp8.cu).
// Its kernel body exists in the sm_90a build only (the other architectures of a multi-arch build compile
// an empty stub, which sm90_prefill_compiled() tells apart); scripts/check_cuda.sh compiles this unit for
// sm_90a alone.
#include "attention_sm90.cuh"

namespace kvkernels::attn_cuda {

bool sm90_prefill_available_bf16(int dpad, CacheFormat cf) {
  if (cf != CacheFormat::kBFloat16) return sm90_prefill_available_bf16_fp8(dpad, cf);
  constexpr CacheFormat CF = CacheFormat::kBFloat16;
  return dpad == 64    ? sm90_prefill_compiled<__nv_bfloat16, CF, 64>()
         : dpad == 128 ? sm90_prefill_compiled<__nv_bfloat16, CF, 128>()
         : dpad == 256 ? sm90_prefill_compiled<__nv_bfloat16, CF, 256>()
                       : false;
}

cudaError_t launch_attention_sm90_bf16(const AttnArgs& a, const Sm90KvTma& tma, int dpad, bool overlap, dim3 grid,
                                       cudaStream_t stream) {
  if (a.p.kv.format != CacheFormat::kBFloat16) return launch_attention_sm90_bf16_fp8(a, tma, dpad, overlap, grid, stream);
  constexpr CacheFormat CF = CacheFormat::kBFloat16;
  if (dpad == 64) return launch_sm90_prefill<__nv_bfloat16, CF, 64>(a, tma, overlap, grid, stream);
  if (dpad == 128) return launch_sm90_prefill<__nv_bfloat16, CF, 128>(a, tma, overlap, grid, stream);
  if (dpad == 256) return launch_sm90_prefill<__nv_bfloat16, CF, 256>(a, tma, overlap, grid, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kvkernels::attn_cuda
