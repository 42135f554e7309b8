// Exact merge of the split-K partials of paged attention (the math of merge_attention_states and
// kvkernels/softmax.h, generalized to num_splits states): for each (token, head) row,
//   lse = log2 sum_s 2^lse_s,  out = sum_s 2^(lse_s - lse) out_s,
// then the sink joins the denominator (once, here, through finish_row) and out is written in the
// query dtype. A split that saw no finite logit has lse_s = -inf and is not read (its out_s may be
// garbage); a NaN lse_s (a NaN or +inf logit in that split) makes the row NaN; every split -inf
// with visible keys (all logits -inf) is 0 / 0, NaN as well (docs/ops.md).
// One warp per row, 8 columns per lane (head_dim_v <= 256).
#pragma once

#include "attention_common.cuh"

namespace kvkernels::attn_cuda {

constexpr int kMergeThreads = 128;

template <typename OT>
__global__ void __launch_bounds__(kMergeThreads)
    merge_splits_kernel(const __grid_constant__ AttnArgs a) {
  const AttentionParams& p = a.p;
  const int64_t rows = p.num_tokens * p.num_heads;
  const int64_t row = int64_t(blockIdx.x) * (kMergeThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const int d = p.kv.head_dim_v;  // output columns: the value's head dim
  const int c = lane * 8;
  const int head = static_cast<int>(row % p.num_heads);

  float M = -INFINITY;
  for (int s = 0; s < a.num_splits; ++s) M = fmaxf(M, a.part_lse[int64_t(s) * rows + row]);
  float D = 0.0f, acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  for (int s = 0; s < a.num_splits; ++s) {
    const float l = a.part_lse[int64_t(s) * rows + row];
    if (l == -INFINITY) continue;
    const float e = exp2f(l - M);  // NaN for a NaN l (M skips it), which makes D and the row NaN
    D += e;
    if (c < d) {
      const float* src = a.part_o + (int64_t(s) * rows + row) * d + c;
      const float4 x0 = *reinterpret_cast<const float4*>(src);
      const float4 x1 = *reinterpret_cast<const float4*>(src + 4);
      acc[0] += e * x0.x, acc[1] += e * x0.y, acc[2] += e * x0.z, acc[3] += e * x0.w;
      acc[4] += e * x1.x, acc[5] += e * x1.y, acc[6] += e * x1.z, acc[7] += e * x1.w;
    }
  }
  float mul;
  const float lse_out = finish_row<true>(M, D, row_has_keys(p, row / p.num_heads),
                                         p.sinks ? p.sinks[head] * kLog2e : -INFINITY, &mul);
  // The partials hold v_scale already; a non-finite one must also reach rows without keys.
  if (!(fabsf(p.kv.v_scale_of(head / a.group)) < INFINITY)) mul = NAN;
  if (c < d) {
    float x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = acc[i] * mul;
    store8(static_cast<OT*>(p.out) + row * d + c, x);
  }
  if (lane == 0) p.lse[row] = lse_out * kLn2;
}

}  // namespace kvkernels::attn_cuda
