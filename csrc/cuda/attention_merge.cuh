// Exact merge of the split-K partials of paged attention (the math of merge_attention_states and
// kvkernels/softmax.h, generalized to num_splits states): for each (token, head) row,
//   lse = log2 sum_s 2^lse_s,  out = sum_s 2^(lse_s - lse) out_s,
// then the sink joins the denominator (once, here, through finish_row) and out is written in the
// query dtype. A split that saw no finite logit has lse_s = -inf and is not read (its out_s may be
// garbage); a NaN lse_s (a NaN or +inf logit in that split) makes the row NaN; every split -inf
// with visible keys (all logits -inf) is 0 / 0, NaN as well (docs/ops.md).
//
// One warp per row, and the row's splits are read in parallel, not one after another (a loop
// that loaded a split's lse, then its row, then the next split's lse, ... made each split two
// dependent round trips to memory: at b1 x 32k, 49 splits took 30 us under ncu against 68 us for
// the attention kernel itself):
//  - lane i loads the lse of splits i, i + 32, i + 64, i + 96 (one round trip for up to 128
//    splits, the planners' cap), and a butterfly of shuffles gives every lane their max M;
//  - the weighted sum walks the splits in batches: each lane gets a split's lse from the lane that
//    holds it (__shfl_sync) and loads its columns of every live split of the batch before it uses
//    any of them, so a batch costs one round trip (49 splits: 7 batches at head_dim_v 128).
//    Every lane computes the same weights e_s = 2^(lse_s - M) in split order, so each has the
//    whole denominator D without a reduction.
#pragma once

#include "attention_common.cuh"

namespace kvkernels::attn_cuda {

constexpr int kMergeThreads = 128;
constexpr unsigned kFullWarp = 0xffffffffu;

// One row, its columns spread over the warp: COLS = 4 when head_dim_v <= 128, so that every lane
// loads (8 columns per lane would leave half the warp idle at 128), else 8 (up to 256). A batch is
// 32 / COLS splits, 32 floats in flight per lane (8 rows of 512 bytes or 4 of 1 KiB: 4 KiB per warp
// either way) without spilling. The caller's whole warp comes here: the shuffles need all 32 lanes.
// L2_ONLY: the partials are read past L1 (ld.global.cg), for the fused decode (merge_if_last), whose
// partials other CTAs wrote during the same kernel (L1 is not coherent between SMs).
template <typename OT, int COLS, bool L2_ONLY = false>
__device__ __forceinline__ void merge_row(const AttnArgs& a, int64_t row, int64_t rows, int lane) {
  constexpr int kBatch = 32 / COLS;
  const AttentionParams& p = a.p;
  const int S = a.num_splits;
  const int d = p.kv.head_dim_v;  // output columns: the value's head dim
  const int c = lane * COLS;
  const int64_t token = row / p.num_heads;
  const int head = static_cast<int>(row - token * p.num_heads);

  // v[k] = lse of split s0 + 32 k + lane of the group of 128 splits at s0; -inf past the last
  // split, which is then skipped like an empty one.
  auto load_lse = [&](int s0, float* v) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int s = s0 + 32 * k + lane;
      const float* at = a.part_lse + int64_t(s) * rows + row;
      v[k] = s >= S ? -INFINITY : L2_ONLY ? __ldcg(at) : *at;
    }
  };

  // fmaxf skips a NaN lse here; its weight below is NaN and makes D and the row NaN.
  float l[4];  // the group being merged: the first one until the sum below moves on
  load_lse(0, l);
  float M = fmaxf(fmaxf(l[0], l[1]), fmaxf(l[2], l[3]));
#pragma unroll 1
  for (int s0 = 128; s0 < S; s0 += 128) {  // past the planners' cap of 128 splits only
    float t[4];
    load_lse(s0, t);
    M = fmaxf(M, fmaxf(fmaxf(t[0], t[1]), fmaxf(t[2], t[3])));
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) M = fmaxf(M, __shfl_xor_sync(kFullWarp, M, m));

  const float* row_o = a.part_o + row * d + c;  // split s: row_o + s * split_stride
  const int64_t split_stride = rows * d;
  float D = 0.0f, acc[COLS];
#pragma unroll
  for (int i = 0; i < COLS; ++i) acc[i] = 0.0f;
#pragma unroll 1
  for (int s0 = 0; s0 < S; s0 += 128) {
    if (s0 > 0) load_lse(s0, l);
    const int n = min(128, S - s0);
#pragma unroll 1
    for (int j0 = 0; j0 < n; j0 += kBatch) {
      // The batch's splits s0 + j0 + u are held in l[k] of lanes (j0 + u) % 32 (a batch does not
      // cross a multiple of 32); a select, not l[k] indexed at run time (local memory).
      const int k = j0 >> 5;
      const float lk = k == 0 ? l[0] : k == 1 ? l[1] : k == 2 ? l[2] : l[3];
      float e[kBatch];
      float4 x[kBatch][COLS / 4];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const float ls = __shfl_sync(kFullWarp, lk, (j0 + u) & 31);
        // An empty split (or one past the last) is skipped, not weighted by 0: its out_s may be
        // NaN. A NaN ls is read and gives e NaN (the max skipped it).
        const bool live = ls != -INFINITY;
        e[u] = live ? exp2f(ls - M) : 0.0f;
        D += e[u];
        const float4* src =
            reinterpret_cast<const float4*>(row_o + int64_t(s0 + j0 + u) * split_stride);
#pragma unroll
        for (int q = 0; q < COLS / 4; ++q)
          x[u][q] = !(live && c < d) ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : L2_ONLY ? __ldcg(src + q) : src[q];
      }
      // The sums in a branch of their own: without one, ptxas (CUDA 13) moves each split's FMAs
      // up between the loads, and the warp waits for every load before it issues the next (the
      // serial chain again); it does not move them across the branch, so the batch's loads all
      // go out first (checked in the SASS).
      if (c < d) {
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
#pragma unroll
          for (int q = 0; q < COLS / 4; ++q) {
            acc[4 * q + 0] += e[u] * x[u][q].x, acc[4 * q + 1] += e[u] * x[u][q].y;
            acc[4 * q + 2] += e[u] * x[u][q].z, acc[4 * q + 3] += e[u] * x[u][q].w;
          }
        }
      }
    }
  }

  float mul;
  const float lse_out = finish_row<true>(M, D, row_has_keys(p, token),
                                         p.sinks ? p.sinks[head] * kLog2e : -INFINITY, &mul);
  // The partials hold v_scale already; a non-finite one must also reach rows without keys.
  if (!(fabsf(p.kv.v_scale_of(head / a.group)) < INFINITY)) mul = NAN;
  if (c < d) {
    float x[COLS];
#pragma unroll
    for (int i = 0; i < COLS; ++i) x[i] = acc[i] * mul;
    store_n<OT, COLS>(static_cast<OT*>(p.out) + row * d + c, x);
  }
  if (lane == 0) p.lse[row] = lse_out * kLn2;
}

// The split merge inside the fused decode kernel (Path::kMmaDecodeFused): each CTA of a work item, once
// its partials are written (finalize_rows), counts itself in the item's arrival counter, and the one that
// arrives last (S - 1 others before it) merges the item's rows, a warp per row as the merge kernel does,
// so no merge launch follows the attention kernel. The fences order each CTA's partial stores before its
// arrival, and the last CTA's reads after it (the pattern of a last-block reduction); the counters are
// zeroed by the launch (cudaMemsetAsync on the stream before the kernel: a memset node in a CUDA graph,
// so every replay starts from zero). Called by every thread of the CTA. `item`: the counter (decode_item);
// `count`: the splits this CTA's partials stand for (1; the persistent decode's run of splits, one partial
// and empty ones for the rest, counts them all at once).
template <typename OT, int NT>
__device__ __forceinline__ void merge_if_last(const AttnArgs& a, const Work& w, int64_t item, int count) {
  __threadfence();
  __syncthreads();  // every thread's partials stored and fenced before the CTA arrives
  int last = 0;
  if (threadIdx.x == 0)
    last = atomicAdd(a.arrivals + item, unsigned(count)) + unsigned(count) == unsigned(a.num_splits);
  if (!__syncthreads_or(last)) return;
  __threadfence();
  const int64_t rows = a.p.num_tokens * a.p.num_heads;
  const int lane = threadIdx.x & 31;
  // The decode rows of the item: its query heads (one token); rows past the group or the tokens skipped.
  for (int r = threadIdx.x >> 5; r < a.heads_per_cta; r += NT / 32) {
    const RowId id = row_id(a, w, r);
    if (!id.valid) continue;  // the same for the whole warp (r is per warp)
    const int64_t row = id.token * a.p.num_heads + id.head;
    if (a.p.kv.head_dim_v <= 128)
      merge_row<OT, 4, true>(a, row, rows, lane);
    else
      merge_row<OT, 8, true>(a, row, rows, lane);
  }
}

template <typename OT>
__global__ void __launch_bounds__(kMergeThreads)
    merge_splits_kernel(const __grid_constant__ AttnArgs a) {
  const int64_t rows = a.p.num_tokens * a.p.num_heads;
  const int64_t row = int64_t(blockIdx.x) * (kMergeThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;  // the whole warp: row is per warp
  const int lane = threadIdx.x & 31;
  if (a.p.kv.head_dim_v <= 128)
    merge_row<OT, 4>(a, row, rows, lane);
  else
    merge_row<OT, 8>(a, row, rows, lane);
}

}  // namespace kvkernels::attn_cuda
