// The Hopper wgmma prefill (attention_sm90.cuh) for __nv_bfloat16 queries over fp8 caches (e4m3, e5m2), head
// dims 64 / 128: the producer dequantizes each raw K / V tile into the bfloat16 stages the consumers read.
// A unit of its own so that the sm_90a units stay short to compile (eight kernels here: e4m3 / e5m2 x
// 64 / 128 x the plain and the overlapped loop; five in attention_sm90_bf16.cu). Kernel bodies in the sm_90a
// build only (as there); scripts/check_cuda.sh compiles this unit for sm_90a alone.
#include "attention_sm90.cuh"

namespace kvkernels::attn_cuda {

template <CacheFormat CF>
static bool available(int dpad) {
  return dpad == 64 ? sm90_prefill_compiled<__nv_bfloat16, CF, 64>() : dpad == 128 ? sm90_prefill_compiled<__nv_bfloat16, CF, 128>() : false;
}

template <CacheFormat CF>
static cudaError_t launch(const AttnArgs& a, const Sm90KvTma& tma, int dpad, bool overlap, dim3 grid,
                          cudaStream_t stream) {
  if (dpad == 64) return launch_sm90_prefill<__nv_bfloat16, CF, 64>(a, tma, overlap, grid, stream);
  if (dpad == 128) return launch_sm90_prefill<__nv_bfloat16, CF, 128>(a, tma, overlap, grid, stream);
  return cudaErrorInvalidValue;
}

bool sm90_prefill_available_bf16_fp8(int dpad, CacheFormat cf) {
  return cf == CacheFormat::kFp8E4M3 ? available<CacheFormat::kFp8E4M3>(dpad)
         : cf == CacheFormat::kFp8E5M2 ? available<CacheFormat::kFp8E5M2>(dpad)
                                       : false;
}

cudaError_t launch_attention_sm90_bf16_fp8(const AttnArgs& a, const Sm90KvTma& tma, int dpad, bool overlap, dim3 grid,
                                           cudaStream_t stream) {
  if (a.p.kv.format == CacheFormat::kFp8E4M3) return launch<CacheFormat::kFp8E4M3>(a, tma, dpad, overlap, grid, stream);
  if (a.p.kv.format == CacheFormat::kFp8E5M2) return launch<CacheFormat::kFp8E5M2>(a, tma, dpad, overlap, grid, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kvkernels::attn_cuda
