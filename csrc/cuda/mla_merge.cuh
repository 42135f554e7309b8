// Exact merge of the split-KV partials of mla_paged_attention (the math of
// merge_attention_states, over num_splits states): for each (token, head) row,
//   lse = log2 sum_s 2^lse_s,  out = sum_s 2^(lse_s - lse) out_s.
// A split that saw no finite logit has lse_s = -inf and is not read (its partial may be stale
// memory); NaN partials and all-(-inf) rows follow docs/ops.md through finish_row.
// One warp per row; R <= 512 columns, 4 per lane per pass. Partials are float32, normalized per
// split; lse_s in log2 units (attention kernels' convention), written out in natural log.
#pragma once

#include "mla_attention_simt.cuh"

namespace kvkernels::mla_cuda {

constexpr int kMlaMergeThreads = 128;

template <typename OT>
__global__ void __launch_bounds__(kMlaMergeThreads)
    mla_merge_kernel(const __grid_constant__ MlaArgs m) {
  const ac::AttnArgs& a = m.a;
  const AttentionParams& p = a.p;
  const int64_t rows = p.num_tokens * p.num_heads;
  const int64_t row = int64_t(blockIdx.x) * (kMlaMergeThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const int R = p.kv.head_dim_v;

  // A split with lse -inf saw no finite logit and is not read; a NaN lse (M skips it) gives NaN
  // weights and a NaN row; all splits -inf with visible keys is 0 / 0 (finish_row: NaN).
  float M = -INFINITY;
  for (int s = 0; s < a.num_splits; ++s) M = fmaxf(M, a.part_lse[int64_t(s) * rows + row]);
  float D = 0.0f;
  for (int s = 0; s < a.num_splits; ++s) {
    const float l = a.part_lse[int64_t(s) * rows + row];
    if (l != -INFINITY) D += exp2f(l - M);
  }
  float inv;
  const float lse2 = finish_row<true>(M, D, ac::row_has_keys(p, row / p.num_heads), -INFINITY, &inv);
  if (!(fabsf(p.kv.v_scale_of(0)) < INFINITY)) inv = NAN;  // also for rows without keys
  for (int c = lane * 4; c < R; c += 128) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < a.num_splits; ++s) {
      const float l = a.part_lse[int64_t(s) * rows + row];
      if (l == -INFINITY) continue;
      const float e = exp2f(l - M);
      const float4 x = *reinterpret_cast<const float4*>(a.part_o + (int64_t(s) * rows + row) * R + c);
      acc.x = fmaf(e, x.x, acc.x), acc.y = fmaf(e, x.y, acc.y);
      acc.z = fmaf(e, x.z, acc.z), acc.w = fmaf(e, x.w, acc.w);
    }
    store4(static_cast<OT*>(p.out) + row * R + c, acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  }
  if (lane == 0) p.lse[row] = lse2 * ac::kLn2;
}

}  // namespace kvkernels::mla_cuda
