// gather_kv on the CPU: paged -> contiguous K/V, dequantizing fp8 caches.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <vector>

#include "../index_checks.h"
#include "../prepare.h"
#include "convert.h"

namespace kvkernels::cpu {
namespace {

template <typename C, typename O>
void gather(const GatherParams& p) {
  const paged_kv_t& kv = p.kv;
  // One work item per (sequence, logical block): at most block_size tokens each.
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t s = 0; s < kv.num_seqs; ++s)
    for (int64_t b = 0; b < ceil_div(kv.seq_lens[s], kv.block_size); ++b) items.push_back({s, b});
  const int H = kv.num_kv_heads, D = kv.head_dim;
  torch::stable::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(static_cast<size_t>(D));
    for (int64_t i = lo; i < hi; ++i) {
      const auto [s, b] = items[i];
      const int64_t block = kv.block_id(s, b);
      const int64_t first = b * kv.block_size;
      const int64_t last = std::min<int64_t>(first + kv.block_size, kv.seq_lens[s]);
      for (int64_t j = first; j < last; ++j) {
        const int64_t t = p.token_start[s] + j;
        for (int h = 0; h < H; ++h) {
          const int64_t o = (t * H + h) * D;
          load_row(static_cast<const C*>(kv.k) + kv.k_offset(block, j - first, h), D,
                   kv.k_scale_of(h), row.data());
          for (int d = 0; d < D; ++d) static_cast<O*>(p.key)[o + d] = from_float<O>(row[d]);
          load_row(static_cast<const C*>(kv.v) + kv.v_offset(block, j - first, h), D,
                   kv.v_scale_of(h), row.data());
          for (int d = 0; d < D; ++d) static_cast<O*>(p.value)[o + d] = from_float<O>(row[d]);
        }
      }
    }
  });
}

std::tuple<Tensor, Tensor> gather_kv_cpu(const Tensor& key_cache, const Tensor& value_cache,
                                         const Tensor& block_tables, const Tensor& seq_lens,
                                         std::optional<Tensor> k_scale,
                                         std::optional<Tensor> v_scale,
                                         std::optional<int64_t> num_tokens,
                                         std::optional<ScalarType> out_dtype) {
  const ArgCheck c("gather_kv");
  auto count = [&](const paged_kv_t& kv) { return checked_token_count(c, kv); };
  PreparedGather r = prepare_gather_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale,
                                       v_scale, num_tokens, out_dtype, count);
  GatherParams& p = r.params;
  const std::vector<int64_t> starts = checked_token_starts(c, p.kv, p.num_tokens);
  p.token_start = starts.data();
  dispatch_cache(p.kv.format, [&](auto ct) {
    dispatch_float(p.out_format, [&](auto ot) {
      gather<typename decltype(ct)::type, typename decltype(ot)::type>(p);
    });
  });
  return {r.key, r.value};
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("gather_kv", TORCH_BOX(&kvkernels::cpu::gather_kv_cpu));
}
