// reshape_and_cache and concat_and_cache_mla on the CPU: scatter new tokens into their slots,
// converting (or quantizing to fp8) each row with the row kernels of the active ISA (rows.h).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "../index_checks.h"
#include "../prepare.h"
#include "rows.h"

namespace kvkernels::cpu {
namespace {

void run_writes(const ArgCheck& c, const PreparedCacheWrite& r, int64_t num_slots) {
  // Validate every write of the call before the first one starts.
  for (const CacheWriteParams& w : r.writes) check_slots(c, w.slot_mapping, w.num_tokens, num_slots);
  const RowKernels& kernels = row_kernels();
  for (const CacheWriteParams& w : r.writes) {
    if (w.num_heads == 0 || w.width == 0) continue;  // empty rows: nothing to write
    torch::stable::parallel_for(0, w.num_tokens, 16, [&](int64_t begin, int64_t end) {
      kernels.write_tokens(w, begin, end);
    });
  }
}

void reshape_and_cache_cpu(const Tensor& key, const Tensor& value, Tensor& key_cache,
                           Tensor& value_cache, const Tensor& slot_mapping,
                           std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  const ArgCheck c("reshape_and_cache");
  PreparedCacheWrite r = prepare_reshape_and_cache(c, key, value, key_cache, value_cache,
                                                   slot_mapping, k_scale, v_scale);
  run_writes(c, r, key_cache.size(0) * key_cache.size(1));
}

void concat_and_cache_mla_cpu(const Tensor& kv_c, const Tensor& k_pe, Tensor& kv_cache,
                              const Tensor& slot_mapping, std::optional<Tensor> scale) {
  const ArgCheck c("concat_and_cache_mla");
  PreparedCacheWrite r = prepare_concat_and_cache_mla(c, kv_c, k_pe, kv_cache, slot_mapping, scale);
  run_writes(c, r, kv_cache.size(0) * kv_cache.size(1));
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("reshape_and_cache", TORCH_BOX(&kvkernels::cpu::reshape_and_cache_cpu));
  m.impl("concat_and_cache_mla", TORCH_BOX(&kvkernels::cpu::concat_and_cache_mla_cpu));
}
