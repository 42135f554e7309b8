// CUDA-core MLA attention: the generic path. Every q dtype (float32 / fp16 / bf16) over every
// latent cache dtype (the q dtype, or fp8 e4m3 / e5m2 with a per-tensor scale), every row width up
// to 576 and every block size; decode and varlen. It is the only path for float32 q (float32
// math end to end, no tensor-core rounding) and the cross-check of the tensor-core kernels
// (KVKERNELS_CUDA_MLA_PATH=simt).
//
// A CTA (128 threads) holds 16 rows (query x head pairs) as float in shared memory, pre-multiplied
// by scale * kv_scale * log2(e). Per key tile (8 keys through a cp.async ring of `stages` raw
// buffers; elements are converted to float as they are read, no conversion pass):
//   1. S: thread (row = tid / 8, key = tid % 8) computes one dot product over the row width with
//      float4 reads of Q and 4-element reads of the key row,
//   2. the online softmax of each row by its 8 threads (shuffles; the state stays in registers),
//      P and alpha to shared memory,
//   3. O = alpha O + P V: thread t owns columns [4t, 4t + 4) of all 16 rows (R <= 512).
#pragma once

#include "mla_common.cuh"

namespace kvkernels::mla_cuda {

// Elements [c, c + 4) of a raw key row in shared memory, as floats (fp8 values in units of
// fp8_unit, folded back in by the caller).
template <CacheFormat CF>
__device__ __forceinline__ float4 load4_raw(const char* row, int c) {
  if constexpr (CF == CacheFormat::kFloat32) {
    return *reinterpret_cast<const float4*>(row + c * 4);
  } else if constexpr (CF == CacheFormat::kFloat16 || CF == CacheFormat::kBFloat16) {
    const uint2 u = *reinterpret_cast<const uint2*>(row + c * 2);
    const float2 lo = CF == CacheFormat::kFloat16 ? ac::unpack2_half(u.x) : ac::unpack2_bf16(u.x);
    const float2 hi = CF == CacheFormat::kFloat16 ? ac::unpack2_half(u.y) : ac::unpack2_bf16(u.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  } else {
    uint32_t lo, hi;
    ac::fp8x4_to_half2x2<CF>(*reinterpret_cast<const uint32_t*>(row + c), &lo, &hi);
    const float2 a = ac::unpack2_half(lo), b = ac::unpack2_half(hi);
    return make_float4(a.x, a.y, b.x, b.y);
  }
}

template <typename OT>
__device__ __forceinline__ void store4(OT* dst, float x0, float x1, float x2, float x3) {
  if constexpr (std::is_same_v<OT, float>) {
    *reinterpret_cast<float4*>(dst) = make_float4(x0, x1, x2, x3);
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(ac::pack2<OT>(x0, x1), ac::pack2<OT>(x2, x3));
  }
}

template <typename QT, CacheFormat CF>
__global__ void __launch_bounds__(kSimtThreads, 1)
    mla_simt_kernel(const __grid_constant__ MlaArgs m) {
  constexpr int KT = kSimtKeyTile, NT = kSimtThreads, ROWS = kSimtRows;
  constexpr int ESZ = ac::cache_esize(CF);
  constexpr bool FP8 = ESZ == 1 && CF != CacheFormat::kFloat32;
  static_assert(ROWS * KT == NT && NT * 4 >= kMaxValueWidth, "SIMT geometry");
  extern __shared__ __align__(128) unsigned char smem[];

  const ac::AttnArgs& a = m.a;
  ac::Work w;
  if (!ac::make_work<KT>(a, w)) return;
  const AttentionParams& p = a.p;
  const int tid = threadIdx.x;
  const int D = p.kv.head_dim, R = p.kv.head_dim_v, dp = m.dp, qstride = dp + 4;
  const int stages = m.stages;
  const SimtSmem L = simt_smem(dp, ESZ, stages);
  float* sQ = reinterpret_cast<float*>(smem + L.q_off);
  char* sstage = reinterpret_cast<char*>(smem) + L.stage_off;
  float* sP = reinterpret_cast<float*>(smem + L.p_off);
  float* sM = reinterpret_cast<float*>(smem + L.stat_off);
  float* sD = sM + ROWS;
  float* sAlpha = sD + ROWS;

  const int ntiles = w.tile_end - w.tile_begin;
  const int srow_bytes = L.stage_row;
  auto raw_off = [srow_bytes](int r, int c) { return r * srow_bytes + c * 16; };
  // Block ids travel a tile ahead of the copies that use them (fetch_key_ids).
  int key_ids = ntiles > 0 ? fetch_key_ids<KT, NT>(m, w, w.tile_begin) : -1;
  for (int s = 0; s < stages - 1; ++s) {
    if (s < ntiles) {
      issue_key_tile<KT, NT, ESZ>(m, w, w.tile_begin + s, key_ids, sstage + s * L.stage_bytes,
                                  raw_off);
      if (s + 1 < ntiles) key_ids = fetch_key_ids<KT, NT>(m, w, w.tile_begin + s + 1);
    }
    ac::cp_async_commit();
  }

  constexpr float unit = FP8 ? ac::fp8_unit<CF>() : 1.0f;
  const float qk_mul2 = p.scale * p.kv.k_scale_of(0) * unit * ac::kLog2e;
  const float v_mul = p.kv.k_scale_of(0) * unit;
  const int cpr = dp / 8;
  for (int idx = tid; idx < ROWS * cpr; idx += NT) {
    const int r = idx / cpr, c = idx - r * cpr;
    const ac::RowId id = ac::row_id(a, w, r);
    float x[8];
    load_q_chunk<QT>(a, id, c, D, x);
    float* dst = sQ + r * qstride + c * 8;
    *reinterpret_cast<float4*>(dst) =
        make_float4(x[0] * qk_mul2, x[1] * qk_mul2, x[2] * qk_mul2, x[3] * qk_mul2);
    *reinterpret_cast<float4*>(dst + 4) =
        make_float4(x[4] * qk_mul2, x[5] * qk_mul2, x[6] * qk_mul2, x[7] * qk_mul2);
  }

  // S / softmax role of this thread, and its query position for the causal mask.
  const int srow = tid / KT, skey = tid % KT;
  const int spos = ac::row_id(a, w, srow).pos;
  float m_run = -INFINITY, d_run = 0.0f;
  // PV role: columns [c4, c4 + 4) of every row.
  const int c4 = tid * 4;
  float o[ROWS][4];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) o[r][0] = o[r][1] = o[r][2] = o[r][3] = 0.0f;

  const int d4 = (D + 3) / 4 * 4;  // zero padding past D in both Q and the key rows
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait_pending(stages - 2);
    __syncthreads();
    {
      const int nx = it + stages - 1;
      if (nx < ntiles) {
        issue_key_tile<KT, NT, ESZ>(m, w, w.tile_begin + nx, key_ids,
                                    sstage + (nx % stages) * L.stage_bytes, raw_off);
        if (nx + 1 < ntiles) key_ids = fetch_key_ids<KT, NT>(m, w, w.tile_begin + nx + 1);
      }
      ac::cp_async_commit();
    }
    const char* tile = sstage + (it % stages) * L.stage_bytes;

    // 1 + 2. One logit per thread, then the row's online softmax among its 8 threads.
    {
      const float* q = sQ + srow * qstride;
      const char* krow = tile + skey * srow_bytes;
      float acc = 0.0f;
      for (int c = 0; c < d4; c += 4) {
        const float4 qv = *reinterpret_cast<const float4*>(q + c);
        const float4 kv = load4_raw<CF>(krow, c);
        acc = fmaf(qv.x, kv.x, acc);
        acc = fmaf(qv.y, kv.y, acc);
        acc = fmaf(qv.z, kv.z, acc);
        acc = fmaf(qv.w, kv.w, acc);
      }
      const int key = (w.tile_begin + it) * KT + skey;
      const float x = key <= spos ? acc : -INFINITY;
      float mx = x;
#pragma unroll
      for (int off = 1; off < KT; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run, mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(m_run - base);
      const float pr = exp2f(x - base);
      float sum = pr;
#pragma unroll
      for (int off = 1; off < KT; off *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      d_run = d_run * alpha + sum;
      m_run = m_new;
      sP[srow * KT + skey] = pr;
      if (skey == 0) sAlpha[srow] = alpha;
    }
    __syncthreads();
    // 3. O = alpha O + P V for this thread's 4 columns. In a tile past the first query's position
    // (prefill) each row adds only the keys it sees: 0 times an inf or NaN value would be NaN.
    if (c4 < R) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float al = sAlpha[r];
        o[r][0] *= al, o[r][1] *= al, o[r][2] *= al, o[r][3] *= al;
      }
      const int k0 = (w.tile_begin + it) * KT;
      if (w.nq > 1 && k0 + KT - 1 > w.pos0) {
        for (int k = 0; k < KT; ++k) {
          const float4 v = load4_raw<CF>(tile + k * srow_bytes, c4);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            if (k0 + k > ac::row_id(a, w, r).pos) continue;
            const float pr = sP[r * KT + k];
            o[r][0] = fmaf(pr, v.x, o[r][0]);
            o[r][1] = fmaf(pr, v.y, o[r][1]);
            o[r][2] = fmaf(pr, v.z, o[r][2]);
            o[r][3] = fmaf(pr, v.w, o[r][3]);
          }
        }
      } else {
#pragma unroll
        for (int k = 0; k < KT; ++k) {
          const float4 v = load4_raw<CF>(tile + k * srow_bytes, c4);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) {
            const float pr = sP[r * KT + k];
            o[r][0] = fmaf(pr, v.x, o[r][0]);
            o[r][1] = fmaf(pr, v.y, o[r][1]);
            o[r][2] = fmaf(pr, v.z, o[r][2]);
            o[r][3] = fmaf(pr, v.w, o[r][3]);
          }
        }
      }
    }
  }

  ac::cp_async_wait<0>();
  if (skey == 0) sM[srow] = m_run, sD[srow] = d_run;
  __syncthreads();
  const int64_t rows_total = p.num_tokens * p.num_heads;
  const float vm = ac::checked_v_mul(v_mul);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const ac::RowId id = ac::row_id(a, w, r);
    if (!id.valid) continue;
    float mul;
    const float lse2 = finish_mla_row(w, id, a.num_splits == 1, a.p, sM[r], sD[r], vm, &mul);
    const int64_t row = id.token * p.num_heads + id.head;
    const int64_t prow = int64_t(w.split) * rows_total + row;
    if (c4 < R) {
      if (a.num_splits == 1)
        store4(static_cast<QT*>(p.out) + row * R + c4, o[r][0] * mul, o[r][1] * mul, o[r][2] * mul,
               o[r][3] * mul);
      else
        store4(a.part_o + prow * R + c4, o[r][0] * mul, o[r][1] * mul, o[r][2] * mul, o[r][3] * mul);
    }
    if (tid == 0) {
      if (a.num_splits == 1) p.lse[row] = lse2 * ac::kLn2;
      else a.part_lse[prow] = lse2;
    }
  }
}

}  // namespace kvkernels::mla_cuda
