// CUDA-core MLA attention instances (mla_attention_simt.cuh) for every q dtype over its own cache
// dtype and both fp8 formats, the split merge (mla_merge.cuh) for every output dtype, and the wgmma
// decode's metadata pass (mla_sched.cuh: plain CUDA, built for every architecture of the build).
#include "mla_attention_launch.cuh"

namespace kvkernels::mla_cuda {

namespace {

template <typename QT, CacheFormat CF>
cudaError_t launch_simt_instance(const MlaArgs& m, dim3 grid, int smem, cudaStream_t stream) {
  static std::atomic<int> configured[64] = {};
  return launch_with_smem(mla_simt_kernel<QT, CF>, configured, smem, kSimtThreads, grid, stream, m);
}

template <typename QT, CacheFormat SELF>
cudaError_t launch_simt_for_q(const MlaArgs& m, dim3 grid, int smem, cudaStream_t stream) {
  switch (m.a.p.kv.format) {
    case SELF: return launch_simt_instance<QT, SELF>(m, grid, smem, stream);
    case CacheFormat::kFp8E4M3: return launch_simt_instance<QT, CacheFormat::kFp8E4M3>(m, grid, smem, stream);
    case CacheFormat::kFp8E5M2: return launch_simt_instance<QT, CacheFormat::kFp8E5M2>(m, grid, smem, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename OT>
cudaError_t launch_merge_instance(const MlaArgs& m, cudaStream_t stream) {
  const int64_t rows = m.a.p.num_tokens * m.a.p.num_heads;
  const int64_t blocks = (rows + kMlaMergeThreads / 32 - 1) / (kMlaMergeThreads / 32);
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return launch_kernel_ex(mla_merge_kernel<OT>, dim3(static_cast<unsigned>(blocks)), kMlaMergeThreads, 0, stream,
                          m.pdl != 0, m);
}

}  // namespace

cudaError_t launch_mla_simt(const MlaArgs& m, dim3 grid, int smem, cudaStream_t stream) {
  switch (m.a.p.q_format) {
    case FloatFormat::kFloat16: return launch_simt_for_q<__half, CacheFormat::kFloat16>(m, grid, smem, stream);
    case FloatFormat::kBFloat16:
      return launch_simt_for_q<__nv_bfloat16, CacheFormat::kBFloat16>(m, grid, smem, stream);
    default: return launch_simt_for_q<float, CacheFormat::kFloat32>(m, grid, smem, stream);
  }
}

cudaError_t launch_mla_sched(const MlaArgs& m, cudaStream_t stream) {
  // (a plain launch: the pass follows whatever came before it in the stream, as any kernel does)
  mla_sched_kernel<kSm90KeyTile><<<1, 32, 0, stream>>>(m);
  return cudaGetLastError();
}

cudaError_t launch_mla_merge(const MlaArgs& m, cudaStream_t stream) {
  switch (m.a.p.q_format) {
    case FloatFormat::kFloat16: return launch_merge_instance<__half>(m, stream);
    case FloatFormat::kBFloat16: return launch_merge_instance<__nv_bfloat16>(m, stream);
    default: return launch_merge_instance<float>(m, stream);
  }
}

}  // namespace kvkernels::mla_cuda
