// CUDA registration of paged_attention (torch stable ABI): the same validation and output
// allocation as every backend (prepare_paged_attention), then a launch planned from shapes only
// (attention.cu) on the current CUDA stream of the query's device (DeviceScope, cuda_binding.h).
// No host synchronization: the split workspace comes from torch's caching allocator (stream-ordered; inside a CUDA-graph
// capture it comes from the graph's pool), and no device data is read on the host, except in
// debug mode (KVKERNELS_DEBUG=1), which copies the index tensors to the CPU and runs the range
// checks of index_checks.h before launching.
//
// Several STABLE_TORCH_LIBRARY_IMPL(kvkernels, CUDA, m) blocks coexist across translation units
// (the macro names each block after __COUNTER__ and registers it at static-init time, like the
// CPU files do), so the cache ops' binding registers its own ops independently.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <optional>
#include <tuple>
#include <utility>

#include "../index_checks.h"
#include "../prepare.h"
#include "attention_api.cuh"
#include "cuda_binding.h"

namespace kvkernels::attn_cuda {
namespace {

using kvkernels::cuda::DeviceScope;

constexpr int64_t kMaxCudaHeadDim = 256;

// Debug mode: the host-side range checks of the CPU backend, on host copies of the index tensors
// (this synchronizes the device; it is off by default).
void check_indices_on_host(const ArgCheck& c, const AttentionParams& params, cudaStream_t stream) {
  const kvkernels::cuda::HostPagedKV kv = kvkernels::cuda::host_paged_kv(c, params.kv, stream);
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

// paged_attention and paged_attention_out: one path (registered through OutVariants, prepare.h).
std::tuple<Tensor, Tensor> paged_attention_impl(
    const GivenOutputs& given, const Tensor& query, const Tensor& key_cache,
    const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
    std::optional<Tensor> query_start_loc, std::optional<double> scale, int64_t window_left,
    double soft_cap, std::optional<Tensor> alibi_slopes, std::optional<Tensor> sinks,
    std::optional<Tensor> k_scale, std::optional<Tensor> v_scale, std::optional<bool> causal) {
  const ArgCheck c("paged_attention");
  const DeviceScope scope(c, query, "query");
  // Head dims above 256 (prepare allows 512, the CPU and Metal kernels run it) are not supported
  // here: the tensor-core kernels keep a 16-row output tile of the padded head dim in registers
  // (128 floats per thread at 256; 512 would spill), and the K/V stages outgrow shared memory.
  // Checked before prepare allocates anything.
  for (auto [cache, arg] : {std::pair{&key_cache, "key_cache"}, std::pair{&value_cache, "value_cache"}})
    c.expect(cache->dim() != 4 || cache->size(3) <= kMaxCudaHeadDim, arg, "head_dim ",
             cache->dim() == 4 ? cache->size(3) : 0, " is not supported on CUDA (at most ",
             kMaxCudaHeadDim, "; docs/ops.md)");
  // Debug mode: the index checks on host copies, before the outputs are allocated.
  IndexCheck host_checks;
  if (kvkernels::cuda::debug_mode())
    host_checks = [&](const AttentionParams& p) { check_indices_on_host(c, p, scope.stream()); };
  PreparedAttention r = prepare_paged_attention(c, query, key_cache, value_cache, block_tables,
                                                seq_lens, query_start_loc, scale, window_left,
                                                soft_cap, alibi_slopes, sinks, k_scale, v_scale,
                                                causal, host_checks, given);
  if (r.params.num_tokens == 0 || r.params.kv.num_seqs == 0) return {r.out, r.lse};
  // out= without lse=: the kernels write lse anyway; scratch from the caching allocator.
  ensure_lse(c, r, r.params.lse, query, r.params.num_tokens, r.params.num_heads);

  const LaunchPlan plan = plan_paged_attention(r.params, scope.device());
  Tensor workspace;
  float* ws = nullptr;
  if (plan.workspace_floats > 0) {
    workspace = torch::stable::new_empty(query, {plan.workspace_floats}, ScalarType::Float);
    ws = static_cast<float*>(workspace.mutable_data_ptr());
  }
  launch_paged_attention(r.params, plan, ws, scope.stream());
  r.finish();  // non-contiguous given outputs: copied from their temporaries on this stream
  // The workspace tensor goes back to the caching allocator when this function returns; the
  // allocator reuses it only for work ordered after the kernels on this stream.
  return {r.out, r.lse};
}

}  // namespace
}  // namespace kvkernels::attn_cuda

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CUDA, m) {
  m.impl("paged_attention",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::attn_cuda::paged_attention_impl>::allocating));
  m.impl("paged_attention_out",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::attn_cuda::paged_attention_impl>::into));
}
