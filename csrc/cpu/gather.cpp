// gather_kv on the CPU: paged -> contiguous K/V, dequantizing fp8 caches, one work item per
// (sequence, logical block) through the row kernels of the active ISA (rows.h).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <vector>

#include "../index_checks.h"
#include "../prepare.h"
#include "rows.h"

namespace kvkernels::cpu {
namespace {

void gather(const GatherParams& p) {
  const paged_kv_t& kv = p.kv;
  const RowKernels& kernels = row_kernels();
  // At most block_size tokens per item; the rows are converted in registers, so a chunk needs no
  // scratch.
  std::vector<GatherItem> items;
  for (int64_t s = 0; s < kv.num_seqs; ++s)
    for (int64_t b = 0; b < ceil_div(kv.seq_lens[s], kv.block_size); ++b) items.push_back({s, b});
  torch::stable::parallel_for(0, static_cast<int64_t>(items.size()), 1,
                              [&](int64_t begin, int64_t end) {
                                kernels.gather(p, items.data(), begin, end);
                              });
}

std::tuple<Tensor, Tensor> gather_kv_cpu(const Tensor& key_cache, const Tensor& value_cache,
                                         const Tensor& block_tables, const Tensor& seq_lens,
                                         std::optional<Tensor> k_scale,
                                         std::optional<Tensor> v_scale,
                                         std::optional<int64_t> num_tokens,
                                         std::optional<ScalarType> out_dtype) {
  const ArgCheck c("gather_kv");
  // Indices and num_tokens are checked before the outputs are allocated.
  std::vector<int64_t> starts;
  auto count = [&](const paged_kv_t& kv, std::optional<int64_t> n) {
    starts = checked_token_starts(c, kv, n);
    return starts.back();
  };
  PreparedGather r = prepare_gather_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale,
                                       v_scale, num_tokens, out_dtype, count);
  GatherParams& p = r.params;
  p.token_start = starts.data();
  if (p.num_tokens == 0 || p.kv.num_kv_heads == 0 || (p.kv.head_dim == 0 && p.kv.head_dim_v == 0))
    return {r.key, r.value};
  gather(p);
  return {r.key, r.value};
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("gather_kv", TORCH_BOX(&kvkernels::cpu::gather_kv_cpu));
}
