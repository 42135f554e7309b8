// Exact merge of the split-KV partials of mla_paged_attention (the math of
// merge_attention_states, over num_splits states): for each (token, head) row,
//   lse = log2 sum_s 2^lse_s,  out = sum_s 2^(lse_s - lse) out_s.
// A split that saw no finite logit has lse_s = -inf and is not read (its partial may be stale
// memory); NaN partials and all-(-inf) rows follow docs/ops.md through finish_row.
// One warp per row; R <= 512 columns, 4 per lane per pass. Partials are float32, normalized per
// split; lse_s in log2 units (attention kernels' convention), written out in natural log.
// Under the metadata plan (m.sched, mla_sched.cuh) a decode row's sequence has its own piece count: rows of
// a sequence in one piece were written by the decode and are skipped, the others merge their pieces'
// partials (rows part_off x H + head, H apart). Launched after the decode by programmatic dependent launch
// where the device has it: griddepcontrol.wait before any read of the decode's (or the pass's) output.
#pragma once

#include "mla_attention_simt.cuh"
#include "mla_sched.cuh"

namespace kvkernels::mla_cuda {

constexpr int kMlaMergeThreads = 128;

template <typename OT>
__global__ void __launch_bounds__(kMlaMergeThreads)
    mla_merge_kernel(const __grid_constant__ MlaArgs m) {
  const ac::AttnArgs& a = m.a;
  const AttentionParams& p = a.p;
  sm90::griddep_wait();  // the decode's partials (a no-op without programmatic dependent launch)
  const int64_t rows = p.num_tokens * p.num_heads;
  const int64_t row = int64_t(blockIdx.x) * (kMlaMergeThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const int R = p.kv.head_dim_v;
  // Partial s of the row: row first + s x stride, of n.
  int n = a.num_splits;
  int64_t first = row, stride = rows;
  if (m.sched != nullptr) {
    const MlaSchedView v(m.sched, p.kv.num_seqs, m.parts);
    const int64_t seq = row / p.num_heads;  // decode: token = sequence
    n = sm90::griddep_read(v.pieces + seq);
    if (n <= 1) return;  // one piece: written by the decode
    first = int64_t(sm90::griddep_read(v.part_off + seq)) * p.num_heads + row % p.num_heads;
    stride = p.num_heads;
  }

  // A split with lse -inf saw no finite logit and is not read; a NaN lse (M skips it) gives NaN
  // weights and a NaN row; all splits -inf with visible keys is 0 / 0 (finish_row: NaN).
  float M = -INFINITY;
  for (int s = 0; s < n; ++s) M = fmaxf(M, sm90::griddep_read(a.part_lse + first + s * stride));
  float D = 0.0f;
  for (int s = 0; s < n; ++s) {
    const float l = sm90::griddep_read(a.part_lse + first + s * stride);
    if (l != -INFINITY) D += exp2f(l - M);
  }
  float inv;
  const float lse2 = finish_row<true>(M, D, ac::row_has_keys(p, row / p.num_heads), -INFINITY, &inv);
  if (!(fabsf(p.kv.v_scale_of(0)) < INFINITY)) inv = NAN;  // also for rows without keys
  for (int c = lane * 4; c < R; c += 128) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < n; ++s) {
      const float l = sm90::griddep_read(a.part_lse + first + s * stride);
      if (l == -INFINITY) continue;
      const float e = exp2f(l - M);
      const float4 x = sm90::griddep_read(reinterpret_cast<const float4*>(a.part_o + (first + s * stride) * R + c));
      acc.x = fmaf(e, x.x, acc.x), acc.y = fmaf(e, x.y, acc.y);
      acc.z = fmaf(e, x.z, acc.z), acc.w = fmaf(e, x.w, acc.w);
    }
    store4(static_cast<OT*>(p.out) + row * R + c, acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  }
  if (lane == 0) p.lse[row] = lse2 * ac::kLn2;
}

}  // namespace kvkernels::mla_cuda
