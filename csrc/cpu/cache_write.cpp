// reshape_and_cache and concat_and_cache_mla on the CPU: scatter new tokens into their slots.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "../index_checks.h"
#include "../prepare.h"
#include "convert.h"

namespace kvkernels::cpu {
namespace {

template <typename S, typename C>
void write_tokens(const CacheWriteParams& p) {
  const S* src = static_cast<const S*>(p.src);
  C* cache = static_cast<C*>(p.cache);
  torch::stable::parallel_for(0, p.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = p.slot_mapping[t];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / p.block_size, offset = slot % p.block_size;
      for (int h = 0; h < p.num_heads; ++h) {
        const S* in = src + t * p.src_stride_token + h * p.src_stride_head;
        C* out = cache + block * p.cache_stride_block + offset * p.cache_stride_slot +
                 h * p.cache_stride_head + p.col_offset;
        const float scale = p.scale ? p.scale[p.scale_per_head ? h : 0] : 1.0f;
        for (int i = 0; i < p.width; ++i) out[i] = to_cache<C>(to_float(in[i]), scale);
      }
    }
  });
}

void run_writes(const ArgCheck& c, const PreparedCacheWrite& r, int64_t num_slots) {
  // Validate every write of the call before the first one starts.
  for (const CacheWriteParams& w : r.writes) check_slots(c, w.slot_mapping, w.num_tokens, num_slots);
  for (const CacheWriteParams& w : r.writes) {
    dispatch_float_and_cache(w.src_format, w.cache_format, [&](auto st, auto ct) {
      write_tokens<typename decltype(st)::type, typename decltype(ct)::type>(w);
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
