// merge_attention_states on CUDA: out = w_a * out_a + w_b * out_b with the weights and merged lse
// of kvkernels/softmax.h (merge_weights and lse_empty, the functions the CPU kernel uses: a side
// whose lse is -inf or +inf is empty and contributes exactly 0 even if its row holds inf or NaN;
// both empty give out = 0 and lse = -inf; a NaN lse gives a NaN row). Each thread merges one
// vector of N elements of one (token, head) row; the thread of the row's first vector also writes
// its lse. Torch-free; launched by cache_ops.cu.
#pragma once

#include "common.cuh"
#include "kvkernels/softmax.h"

namespace kvkernels::cuda {

struct MergeLaunch {
  MergeParams p;
  FastDiv vecs_per_row;  // head_dim / N
  FastDiv num_heads;
  int64_t row_begin = 0; // first (token * num_heads + head) row of this launch
  int64_t num_rows = 0;
};

// read ? w * x : 0 (a side that is not read never lets an inf or NaN of x through; a finite-lse
// side is read even when its weight underflowed to 0).
__device__ __forceinline__ float weighted(float w, bool read, float x) { return read ? __fmul_rn(w, x) : 0.0f; }

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) merge_kernel(const __grid_constant__ MergeLaunch m) {
  const MergeParams& p = m.p;
  const uint32_t i = blockIdx.x * kThreads + threadIdx.x;
  uint32_t col, h;
  const uint32_t r = m.vecs_per_row.divmod(i, &col);
  if (r >= m.num_rows) return;
  const int64_t row = m.row_begin + r;
  const uint32_t t32 = m.num_heads.divmod(static_cast<uint32_t>(row), &h);
  const int64_t t = t32;
  const float la = p.lse_a[t * p.lse_a_stride_token + h * p.lse_a_stride_head];
  const float lb = p.lse_b[t * p.lse_b_stride_token + h * p.lse_b_stride_head];
  const bool ra = !lse_empty(la), rb = !lse_empty(lb);
  float wa, wb;
  const float lse = merge_weights(la, lb, &wa, &wb);
  if (col == 0) p.lse[row] = lse;
  const auto a = Pack<T, N>::load(static_cast<const T*>(p.out_a) + t * p.a_stride_token +
                                  h * p.a_stride_head + col * N);
  const auto b = Pack<T, N>::load(static_cast<const T*>(p.out_b) + t * p.b_stride_token +
                                  h * p.b_stride_head + col * N);
  Pack<T, N> out;
#pragma unroll
  for (int k = 0; k < N; ++k)
    out.v[k] = from_float<T>(__fadd_rn(weighted(wa, ra, to_float(a.v[k])), weighted(wb, rb, to_float(b.v[k]))));
  out.store(static_cast<T*>(p.out) + row * p.head_dim + col * N);
}

}  // namespace kvkernels::cuda
