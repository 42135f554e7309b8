// CUDA registration of mla_decompress and mla_paged_attention (torch stable ABI): the same
// validation and output allocation as the CPU backend (prepare_mla_decompress /
// prepare_mla_attention of csrc/prepare.h), then launchers planned from shapes only
// (mla_decompress.cu, mla_attention.cu) on the current CUDA stream of the inputs' device
// (DeviceScope, cuda_binding.h). Compiled, not run on a GPU.
//
// No host synchronization, except: mla_decompress without num_tokens reads sum(seq_lens) from the
// device (the output length; like gather_kv), and debug mode (KVKERNELS_DEBUG=1) copies the index
// tensors to the host for the range checks of index_checks.h. Scratch (token starts, split
// partials) comes from torch's caching allocator, stream-ordered (inside a CUDA-graph capture,
// from the graph's pool).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <optional>
#include <tuple>

#include "../index_checks.h"
#include "../prepare.h"
#include "cuda_binding.h"
#include "mla_api.h"

namespace kvkernels::mla_cuda {
namespace {

using kvkernels::cuda::DeviceScope;
using kvkernels::cuda::check_launch;
using kvkernels::cuda::debug_mode;
using kvkernels::cuda::host_paged_kv;

std::tuple<Tensor, Tensor> mla_decompress_cuda(
    const Tensor& kv_cache, const Tensor& block_tables, const Tensor& seq_lens,
    const Tensor& w_kv_b, int64_t kv_lora_rank, int64_t qk_nope_head_dim, int64_t v_head_dim,
    std::optional<Tensor> norm_weight, double norm_eps, std::optional<Tensor> scale,
    std::optional<int64_t> num_tokens) {
  const ArgCheck c("mla_decompress");
  const DeviceScope scope(c, kv_cache, "kv_cache");
  // Without num_tokens the output length is sum(seq_lens): read (and check) it on the host; with
  // it, debug mode checks it there. Either way before the outputs are allocated.
  auto count = [&](const paged_kv_t& kv, std::optional<int64_t> n) {
    if (n.has_value() && !debug_mode()) return *n;
    return checked_token_starts(c, host_paged_kv(c, kv, scope.stream()).kv, n).back();
  };
  PreparedDecompress r = prepare_mla_decompress(c, kv_cache, block_tables, seq_lens, w_kv_b,
                                                kv_lora_rank, qk_nope_head_dim, v_head_dim,
                                                norm_weight, norm_eps, scale, num_tokens, count);
  MlaDecompressParams& p = r.params;
  // Called with no tokens too: the launcher rejects an unknown KVKERNELS_CUDA_DECOMPRESS first, then
  // returns without a launch.
  Tensor starts = torch::stable::new_empty(kv_cache, {p.kv.num_seqs + 1}, ScalarType::Long);
  check_launch(c,
               mla_decompress(p, scope.device(), static_cast<int64_t*>(starts.mutable_data_ptr()),
                              scope.stream()),
               "mla_decompress kernel");
  // `starts` returns to the caching allocator here; it is reused only by work ordered after the
  // kernels on this stream.
  return {r.key, r.value};
}

// Debug mode: the host-side range checks of the CPU backend, on host copies of the index tensors.
void check_indices_on_host(const ArgCheck& c, const AttentionParams& params, cudaStream_t stream) {
  const kvkernels::cuda::HostPagedKV kv = host_paged_kv(c, params.kv, stream);
  AttentionParams host = params;
  host.kv = kv.kv;
  check_paged_kv_indices(c, host.kv);
  if (params.query_start_loc != nullptr) {
    const std::vector<int32_t> qsl =
        kvkernels::cuda::to_host(c, params.query_start_loc, params.kv.num_seqs + 1, stream);
    host.query_start_loc = qsl.data();
    check_query_start_loc(c, host);
  }
}

// mla_paged_attention and mla_paged_attention_out: one path (OutVariants, prepare.h).
std::tuple<Tensor, Tensor> mla_paged_attention_impl(
    const GivenOutputs& given, const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
    const Tensor& seq_lens, int64_t kv_lora_rank, double scale,
    std::optional<Tensor> query_start_loc, std::optional<Tensor> kv_scale) {
  const ArgCheck c("mla_paged_attention");
  const DeviceScope scope(c, q, "q");
  // Debug mode: the index checks on host copies, before the outputs are allocated.
  IndexCheck host_checks;
  if (debug_mode())
    host_checks = [&](const AttentionParams& p) { check_indices_on_host(c, p, scope.stream()); };
  PreparedAttention r = prepare_mla_attention(c, q, kv_cache, block_tables, seq_lens, kv_lora_rank,
                                              scale, query_start_loc, kv_scale, host_checks, given);
  if (r.params.num_tokens == 0 || r.params.kv.num_seqs == 0) return {r.out, r.lse};
  // out= without lse=: the kernels write lse anyway; scratch from the caching allocator.
  ensure_lse(c, r, r.params.lse, q, r.params.num_tokens, r.params.num_heads);

  MlaPlan plan;
  check_launch(c, plan_mla_attention(r.params, scope.device(), &plan), "mla_paged_attention plan");
  Tensor workspace;
  float* ws = nullptr;
  if (plan.workspace_floats > 0) {
    workspace = torch::stable::new_empty(q, {plan.workspace_floats}, ScalarType::Float);
    ws = static_cast<float*>(workspace.mutable_data_ptr());
  }
  check_launch(c, launch_mla_attention(r.params, plan, ws, scope.stream()),
               "mla_paged_attention kernel");
  r.finish();  // non-contiguous given outputs: copied from their temporaries on this stream
  return {r.out, r.lse};
}

}  // namespace
}  // namespace kvkernels::mla_cuda

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CUDA, m) {
  m.impl("mla_decompress", TORCH_BOX(&kvkernels::mla_cuda::mla_decompress_cuda));
  m.impl("mla_paged_attention",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::mla_cuda::mla_paged_attention_impl>::allocating));
  m.impl("mla_paged_attention_out",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::mla_cuda::mla_paged_attention_impl>::into));
}
