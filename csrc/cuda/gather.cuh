// gather_kv on CUDA: paged cache -> contiguous [num_tokens, H, D] keys and values, dequantizing
// fp8 (float(x) * scale, then rounded to the output dtype: the reference's arithmetic, so results
// are bit-identical). Torch-free; launched by cache_ops.cu in two steps:
//
// 1. token_starts_kernel: one CTA turns seq_lens into cumulative starts [num_seqs + 1] (int64) in
//    a scratch buffer, so the host never reads seq_lens (no sync; CUDA-graph safe).
// 2. gather_kernel: each CTA owns a tile of output tokens. Its first threads find each token's
//    sequence (binary search over the starts), block and slot once, into shared memory; then every
//    thread copies vectors of N elements of the tile's rows, K and V.
//
// Tokens that map to no valid cache row (num_tokens larger than sum(seq_lens), a block id out of
// range, a length beyond the block table) are written as zeros instead of reading out of bounds;
// the binding reports such input as an error when it can (num_tokens not given, or
// KVKERNELS_DEBUG=1).
#pragma once

#include "common.cuh"

namespace kvkernels::cuda {

constexpr int kScanThreads = 1024;
constexpr int kMaxTileTokens = 64;

// starts[0] = 0, starts[s + 1] = starts[s] + max(seq_lens[s], 0); one CTA of kScanThreads.
static __global__ void __launch_bounds__(kScanThreads)
    token_starts_kernel(const int32_t* __restrict__ seq_lens, int64_t num_seqs,
                        int64_t* __restrict__ starts) {
  __shared__ int64_t warp_sums[kScanThreads / 32];
  __shared__ int64_t carry;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    carry = 0;
    starts[0] = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < num_seqs; base += kScanThreads) {
    const int64_t s = base + threadIdx.x;
    int64_t x = s < num_seqs ? max(seq_lens[s], 0) : 0;
    // Inclusive scan within the warp, then across the warp totals.
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int64_t y = __shfl_up_sync(0xffffffffu, x, d);
      if (lane >= d) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int64_t w = warp_sums[lane];
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int64_t y = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w += y;
      }
      warp_sums[lane] = w;  // inclusive totals of warps 0..lane
    }
    __syncthreads();
    const int64_t total = carry + x + (warp > 0 ? warp_sums[warp - 1] : 0);
    if (s < num_seqs) starts[s + 1] = total;
    __syncthreads();  // everyone has read carry and warp_sums
    if (threadIdx.x == kScanThreads - 1) carry = total;
    __syncthreads();
  }
}

struct GatherLaunch {
  GatherParams p;                // p.token_start: device [num_seqs + 1], from token_starts_kernel
  FastDiv vecs_per_token;        // num_kv_heads * head_dim / N
  FastDiv vecs_per_head;         // head_dim / N
  int tile_tokens = 1;           // output tokens per CTA (<= kMaxTileTokens)
  int64_t token_begin = 0;       // first output token of this launch
  int64_t num_tokens = 0;        // output tokens of this launch
};

// Where output token `t` lives: cache offsets (elements) of its row at head 0, or -1 (zeros).
__device__ __forceinline__ void locate_token(const GatherParams& p, int64_t t, int64_t* k_off,
                                             int64_t* v_off) {
  const paged_kv_t& kv = p.kv;
  *k_off = *v_off = -1;
  if (kv.num_seqs == 0 || t >= p.token_start[kv.num_seqs]) return;
  // Largest s with token_start[s] <= t: skips empty sequences (equal starts).
  int64_t lo = 0, hi = kv.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.token_start[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  const int64_t pos = t - p.token_start[lo];
  const int64_t logical = pos / kv.block_size;
  if (logical >= kv.max_blocks_per_seq) return;
  const int32_t block = kv.block_id(lo, logical);
  if (block < 0 || block >= kv.num_blocks) return;
  const int64_t slot = pos - logical * kv.block_size;
  *k_off = kv.k_offset(block, slot, 0);
  *v_off = kv.v_offset(block, slot, 0);
}

template <typename C, typename O, int N>
__device__ __forceinline__ void gather_vector(const C* src, O* dst, const float* scale, bool per_head,
                                              uint32_t head) {
  if (src == nullptr) {  // no valid cache row: zeros
    Pack<O, N> zero;
#pragma unroll
    for (int k = 0; k < N; ++k) zero.v[k] = from_float<O>(0.0f);
    zero.store(dst);
    return;
  }
  const auto in = Pack<C, N>::load(src);
  if constexpr (std::is_same_v<C, O>) {
    in.store(dst);
  } else {
    Pack<O, N> out;
    if constexpr (is_fp8_type<C>) {
      const float s = scale[per_head ? head : 0];
#pragma unroll
      for (int k = 0; k < N; ++k) out.v[k] = from_float<O>(__fmul_rn(to_float(in.v[k]), s));
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) out.v[k] = from_float<O>(to_float(in.v[k]));
    }
    out.store(dst);
  }
}

template <typename C, typename O, int N>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ GatherLaunch g) {
  __shared__ int64_t k_rows[kMaxTileTokens], v_rows[kMaxTileTokens];
  const GatherParams& p = g.p;
  const int64_t first = g.token_begin + int64_t(blockIdx.x) * g.tile_tokens;
  const int64_t last = g.token_begin + g.num_tokens;
  const int tile = static_cast<int>(last - first < g.tile_tokens ? last - first : g.tile_tokens);
  if (threadIdx.x < tile) locate_token(p, first + threadIdx.x, &k_rows[threadIdx.x], &v_rows[threadIdx.x]);
  __syncthreads();

  const int D = p.kv.head_dim;
  const uint32_t tile_vecs = uint32_t(tile) * g.vecs_per_token.d;
  for (uint32_t i = threadIdx.x; i < tile_vecs; i += kThreads) {
    uint32_t rem, col;
    const uint32_t j = g.vecs_per_token.divmod(i, &rem);
    const uint32_t h = g.vecs_per_head.divmod(rem, &col);
    const int64_t out = ((first + j) * p.kv.num_kv_heads + h) * D + col * N;
    const C* k = k_rows[j] < 0 ? nullptr
                               : static_cast<const C*>(p.kv.k) + k_rows[j] + h * p.kv.k_stride_head + col * N;
    const C* v = v_rows[j] < 0 ? nullptr
                               : static_cast<const C*>(p.kv.v) + v_rows[j] + h * p.kv.v_stride_head + col * N;
    // A null output is skipped: gather_kv's launcher runs K and V as two launches when their head
    // dims differ (cache_ops.cu).
    if (p.key != nullptr)
      gather_vector<C, O, N>(k, static_cast<O*>(p.key) + out, p.kv.k_scale, p.kv.k_scale_per_head, h);
    if (p.value != nullptr)
      gather_vector<C, O, N>(v, static_cast<O*>(p.value) + out, p.kv.v_scale, p.kv.v_scale_per_head, h);
  }
}

}  // namespace kvkernels::cuda
