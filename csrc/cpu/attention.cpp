// Paged attention on the CPU: decode, varlen (chunked prefill) and the absorbed MLA decode, which
// is the same computation over a single latent "kv head" whose value is a prefix of the key row.
// This file runs the scheduler of attention_run.h (which plans the parallel work, attention_plan.h,
// for the kernel of the active ISA, attention_<isa>.cpp) on torch's threads.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "../index_checks.h"
#include "../prepare.h"
#include "discarded_lse.h"
#include "attention_plan.h"
#include "convert.h"
#include "isa.h"
#include "attention_run.h"

namespace kvkernels::cpu {
namespace {

// The index checks, run by the preparer before it allocates the outputs.
IndexCheck index_checks(const ArgCheck& c) {
  return [&c](const AttentionParams& p) {
    check_paged_kv_indices(c, p.kv);
    check_query_start_loc(c, p);
  };
}

// The scheduler (attention_run.h) on torch's intra-op threads.
struct TorchHost {
  int64_t threads() const { return torch::stable::get_num_threads(); }
  template <typename F>
  void parallel_for(int64_t n, F f) const { torch::stable::parallel_for(0, n, 1, f); }
  float* scratch(int slot, size_t n) const { return thread_scratch(slot, n); }
};

void run_attention(const AttentionParams& p) { run_attention_on(p, TorchHost{}); }

// Runs a prepared call: out= without lse= gets the per-thread lse buffer; given outputs the kernels
// could not write directly are filled from their temporaries.
void run_prepared(PreparedAttention& r) {
  AttentionParams& p = r.params;
  if (p.lse == nullptr) p.lse = discarded_lse(p.num_tokens * p.num_heads);
  run_attention(p);
  r.finish();
}

// paged_attention and paged_attention_out: one path (registered through OutVariants, prepare.h).
std::tuple<Tensor, Tensor> paged_attention_impl(
    const GivenOutputs& given, const Tensor& query, const Tensor& key_cache,
    const Tensor& value_cache, const Tensor& block_tables, const Tensor& seq_lens,
    std::optional<Tensor> query_start_loc, std::optional<double> scale, int64_t window_left,
    double soft_cap, std::optional<Tensor> alibi_slopes, std::optional<Tensor> sinks,
    std::optional<Tensor> k_scale, std::optional<Tensor> v_scale, std::optional<bool> causal) {
  const ArgCheck c("paged_attention");
  PreparedAttention r = prepare_paged_attention(c, query, key_cache, value_cache, block_tables,
                                                seq_lens, query_start_loc, scale, window_left,
                                                soft_cap, alibi_slopes, sinks, k_scale, v_scale,
                                                causal, index_checks(c), given);
  run_prepared(r);
  return {r.out, r.lse};
}

std::tuple<Tensor, Tensor> mla_paged_attention_impl(
    const GivenOutputs& given, const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
    const Tensor& seq_lens, int64_t kv_lora_rank, double scale,
    std::optional<Tensor> query_start_loc, std::optional<Tensor> kv_scale) {
  const ArgCheck c("mla_paged_attention");
  PreparedAttention r = prepare_mla_attention(c, q, kv_cache, block_tables, seq_lens, kv_lora_rank,
                                              scale, query_start_loc, kv_scale, index_checks(c),
                                              given);
  run_prepared(r);
  return {r.out, r.lse};
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("paged_attention",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::cpu::paged_attention_impl>::allocating));
  m.impl("mla_paged_attention",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::cpu::mla_paged_attention_impl>::allocating));
  m.impl("paged_attention_out",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::cpu::paged_attention_impl>::into));
  m.impl("mla_paged_attention_out",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::cpu::mla_paged_attention_impl>::into));
}
