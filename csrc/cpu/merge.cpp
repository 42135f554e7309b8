// merge_attention_states on the CPU: the exact merge of two attention states over disjoint key
// sets (kvkernels/softmax.h, merge_weights), one (token, head) row at a time through the row
// kernels of the active ISA (rows.h). A side whose lse is -inf or +inf saw no key and contributes
// exactly 0, even when its row holds inf or NaN; a NaN lse makes the row NaN (docs/ops.md).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "../prepare.h"
#include "discarded_lse.h"
#include "rows.h"

namespace kvkernels::cpu {
namespace {

// merge_attention_states and merge_attention_states_out: one path (OutVariants, prepare.h).
std::tuple<Tensor, Tensor> merge_impl(const GivenOutputs& given, const Tensor& out_a,
                                      const Tensor& lse_a, const Tensor& out_b,
                                      const Tensor& lse_b) {
  const ArgCheck c("merge_attention_states");
  PreparedMerge r = prepare_merge(c, out_a, lse_a, out_b, lse_b, given);
  MergeParams& p = r.params;
  if (p.lse == nullptr) p.lse = discarded_lse(p.num_tokens * p.num_heads);
  const RowKernels& kernels = row_kernels();
  torch::stable::parallel_for(0, p.num_tokens * p.num_heads, 64, [&](int64_t begin, int64_t end) {
    kernels.merge(p, begin, end);
  });
  r.finish();
  return {r.out, r.lse};
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("merge_attention_states",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::cpu::merge_impl>::allocating));
  m.impl("merge_attention_states_out",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::cpu::merge_impl>::into));
}
