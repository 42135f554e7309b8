// CUDA-core paged attention: the generic path. Every query dtype (float32 / fp16 / bf16) over
// every cache dtype (the query's, or fp8 e4m3 / e5m2 with per-tensor or per-head scales), every
// head dim that is a multiple of 8 up to 256 (run on the padded dim 64 / 128 / 256) and every
// block size; decode and varlen. It is the only path for float32 queries (float32 math end to
// end: no tensor-core rounding) and the cross-check of the tensor-core kernels.
//
// A CTA (128 threads) holds 16 rows (queries x heads of one kv head, see attention_common.cuh) in
// shared memory as float, pre-multiplied by scale * k_scale. Per key tile (32 keys, 16 for head
// dim 256), streamed through a cp.async pipeline (pipeline_stages(): 2 to 4 stages):
//   1. 16-bit / fp8 tiles are converted to float in shared memory (float32 tiles are used as
//      they landed, rows padded by 16 bytes against bank conflicts),
//   2. S = Q K^T: each thread computes 2 rows x (KT / 16) keys, float4 dot products,
//   3. soft cap / ALiBi / mask, then the online softmax of each row by 8 threads (shuffles),
//   4. O = alpha O + P V: each thread owns a float4 column chunk of 2 to 8 rows.
#pragma once

#include "attention_common.cuh"

namespace kvkernels::attn_cuda {

template <typename QT, CacheFormat CF, int DPAD>
struct SimtCfg {
  static constexpr int NT = threads_of(Path::kSimt, DPAD);
  static constexpr int ROWS = rows_of(Path::kSimt);
  static constexpr int KT = key_tile_of(Path::kSimt, DPAD);
  static constexpr int ESZ = cache_esize(CF);
  static constexpr bool F32C = CF == CacheFormat::kFloat32;
  static constexpr bool FP8 = ESZ == 1;
  static constexpr int CPR = DPAD * ESZ / 16;                       // 16-byte chunks per row
  static constexpr int RAW_STRIDE = DPAD * ESZ + (F32C ? 16 : 0);  // bytes per raw row in smem
  static constexpr int RAW_TILE = KT * RAW_STRIDE;
  static constexpr int STAGE_BYTES = 2 * RAW_TILE;
  static constexpr int FSTRIDE = DPAD + 4;  // floats per row of float tiles
  static constexpr int CVT_TILE = KT * FSTRIDE * 4;
  static constexpr int CVT_BYTES = F32C ? 0 : 2 * CVT_TILE;
  static constexpr int STAGES = pipeline_stages(STAGE_BYTES, CVT_BYTES);
  static constexpr int Q_BYTES = ROWS * FSTRIDE * 4;
  static constexpr int S_BYTES = ROWS * KT * 4;
  static constexpr int ROW_BYTES = 5 * ROWS * 4;  // m, d, alpha, slope, pos
  static constexpr int MAIN_BYTES = STAGES * STAGE_BYTES + CVT_BYTES;
  static constexpr int EPI_BYTES = ROWS * FSTRIDE * 4;
  static constexpr int Q_OFF = 0;
  static constexpr int S_OFF = Q_OFF + Q_BYTES;
  static constexpr int ROW_OFF = S_OFF + S_BYTES;
  static constexpr int MAIN_OFF = ROW_OFF + ROW_BYTES;
  static constexpr int SMEM = MAIN_OFF + (MAIN_BYTES > EPI_BYTES ? MAIN_BYTES : EPI_BYTES);
  // S phase: 16 key groups x 8 row pairs; PV phase: DPAD / 4 column chunks x row groups.
  static constexpr int KPT = KT / 16;
  static constexpr int CH = DPAD / 4;
  static constexpr int ORPT = ROWS / (NT / CH);  // rows per thread in P V
  static_assert(NT == 128 && ROWS == 16 && KT % 16 == 0 && NT % CH == 0, "SIMT geometry");
  static_assert(SMEM <= kMaxSmem, "shared memory of the SIMT kernel");
};

// One stage of raw 16-bit / fp8 K and V -> float tiles [KT][FSTRIDE].
template <CacheFormat CF, int KT, int DPAD, int NT>
__device__ __forceinline__ void convert_stage_to_float(const char* raw, float* cvt) {
  constexpr int ESZ = cache_esize(CF), CPR = DPAD * ESZ / 16, RAW_TILE = KT * DPAD * ESZ;
  constexpr int FSTRIDE = DPAD + 4, EPC = 16 / ESZ;  // elements per chunk
  for (int idx = threadIdx.x; idx < 2 * KT * CPR; idx += NT) {
    const int tensor = idx / (KT * CPR), rem = idx - tensor * KT * CPR;
    const int r = rem / CPR, c = rem - r * CPR;
    const uint4 u = *reinterpret_cast<const uint4*>(raw + tensor * RAW_TILE + (r * CPR + c) * 16);
    const uint32_t wd[4] = {u.x, u.y, u.z, u.w};
    float* dst = cvt + tensor * KT * FSTRIDE + r * FSTRIDE + c * EPC;
    float x[EPC];
    if constexpr (CF == CacheFormat::kFloat16 || CF == CacheFormat::kBFloat16) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = CF == CacheFormat::kFloat16 ? unpack2_half(wd[i]) : unpack2_bf16(wd[i]);
        x[2 * i] = f.x, x[2 * i + 1] = f.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t lo, hi;
        fp8x4_to_half2x2<CF>(wd[i], &lo, &hi);
        const float2 a = unpack2_half(lo), b = unpack2_half(hi);
        x[4 * i] = a.x, x[4 * i + 1] = a.y, x[4 * i + 2] = b.x, x[4 * i + 3] = b.y;
      }
    }
#pragma unroll
    for (int i = 0; i < EPC; i += 4)
      *reinterpret_cast<float4*>(dst + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
  }
}

template <typename QT, CacheFormat CF, int DPAD>
__global__ void __launch_bounds__(128, 1)
    simt_attention_kernel(const __grid_constant__ AttnArgs a) {
  using C = SimtCfg<QT, CF, DPAD>;
  constexpr int KT = C::KT, NT = C::NT, ROWS = C::ROWS, STAGES = C::STAGES;
  constexpr int FSTRIDE = C::FSTRIDE;
  extern __shared__ __align__(128) unsigned char smem[];

  Work w;
  if (!make_work<KT>(a, w)) return;
  const AttentionParams& p = a.p;
  const int tid = threadIdx.x;
  const int d = p.kv.head_dim, dv = p.kv.head_dim_v;  // K columns, V (output) columns

  float* sQ = reinterpret_cast<float*>(smem + C::Q_OFF);
  float* sS = reinterpret_cast<float*>(smem + C::S_OFF);
  float* sM = reinterpret_cast<float*>(smem + C::ROW_OFF);
  float* sD = sM + ROWS;
  float* sA = sD + ROWS;
  float* sSlope = sA + ROWS;
  int* sPos = reinterpret_cast<int*>(sSlope + ROWS);
  char* smain = reinterpret_cast<char*>(smem + C::MAIN_OFF);

  constexpr float unit = C::FP8 ? fp8_unit<CF>() : 1.0f;
  const float qk_mul = p.scale * p.kv.logit_k_scale_of(w.kv_head) * unit;
  const float v_mul = p.kv.v_scale_of(w.kv_head) * unit;
  const LogitOps ops = logit_ops(p, w);

  if (tid < ROWS) {
    const RowId id = row_id(a, w, tid);
    sM[tid] = -INFINITY;
    sD[tid] = 0.0f;
    sSlope[tid] = (p.alibi_slopes && id.valid) ? p.alibi_slopes[id.head] : 0.0f;
    sPos[tid] = id.pos;
  }
  for (int idx = tid; idx < ROWS * (DPAD / 8); idx += NT) {
    const int r = idx / (DPAD / 8), c = (idx - r * (DPAD / 8)) * 8;
    const RowId id = row_id(a, w, r);
    float x[8];
    if (id.valid) {
      const QT* src = static_cast<const QT*>(p.q) + id.token * p.q_stride_token +
                      int64_t(id.head) * p.q_stride_head;
      load_q8(src, c, d, a.q_aligned != 0, x);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.0f;
    }
    float* dst = sQ + r * FSTRIDE + c;
    *reinterpret_cast<float4*>(dst) =
        make_float4(x[0] * qk_mul, x[1] * qk_mul, x[2] * qk_mul, x[3] * qk_mul);
    *reinterpret_cast<float4*>(dst + 4) =
        make_float4(x[4] * qk_mul, x[5] * qk_mul, x[6] * qk_mul, x[7] * qk_mul);
  }

  TileLoader<KT, NT, C::CPR, C::ESZ> ld;
  ld.init(p, w);
  auto stage_k = [&](int s) { return smain + s * C::STAGE_BYTES; };
  auto off = [](int r, int c) { return r * C::RAW_STRIDE + c * 16; };
  const int ntiles = w.tile_end - w.tile_begin;
  if (ntiles > 0) ld.fetch(a, w, w.tile_begin);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) {
      ld.issue(a, w.tile_begin + s, stage_k(s), stage_k(s) + C::RAW_TILE, off);
      if (s + 1 < ntiles) ld.fetch(a, w, w.tile_begin + s + 1);
    }
    cp_async_commit();
  }

  // P V ownership: column chunk cc (4 floats), rows orow0 + i * (NT / CH).
  const int cc = tid % C::CH, orow0 = tid / C::CH;
  constexpr int OSTEP = NT / C::CH;
  float o[C::ORPT][4];
#pragma unroll
  for (int i = 0; i < C::ORPT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  // S ownership: key group kg (keys kg + 16 j), rows 2 rg and 2 rg + 1.
  const int kg = tid % 16, rg = tid / 16;

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nx = it + STAGES - 1;
      if (nx < ntiles) {
        ld.issue(a, w.tile_begin + nx, stage_k(nx % STAGES), stage_k(nx % STAGES) + C::RAW_TILE,
                 off);
        if (nx + 1 < ntiles) ld.fetch(a, w, w.tile_begin + nx + 1);
      }
      cp_async_commit();
    }
    const float* K;
    if constexpr (C::F32C) {
      K = reinterpret_cast<const float*>(stage_k(it % STAGES));
    } else {
      float* cvt = reinterpret_cast<float*>(smain + STAGES * C::STAGE_BYTES);
      convert_stage_to_float<CF, KT, DPAD, NT>(stage_k(it % STAGES), cvt);
      __syncthreads();
      K = cvt;
    }
    const float* V = K + KT * FSTRIDE;  // F32C: RAW_TILE == KT * FSTRIDE * 4

    // 2. logits of rows 2 rg, 2 rg + 1 for keys kg + 16 j.
    const int k0 = (w.tile_begin + it) * KT;
    {
      float acc[2][C::KPT];
#pragma unroll
      for (int j = 0; j < C::KPT; ++j) acc[0][j] = acc[1][j] = 0.0f;
      const float* q0 = sQ + (2 * rg) * FSTRIDE;
      const float* q1 = q0 + FSTRIDE;
#pragma unroll 4
      for (int c = 0; c < d; c += 4) {
        const float4 a0 = *reinterpret_cast<const float4*>(q0 + c);
        const float4 a1 = *reinterpret_cast<const float4*>(q1 + c);
#pragma unroll
        for (int j = 0; j < C::KPT; ++j) {
          const float4 k = *reinterpret_cast<const float4*>(K + (kg + 16 * j) * FSTRIDE + c);
          acc[0][j] = fmaf(a0.x, k.x, fmaf(a0.y, k.y, fmaf(a0.z, k.z, fmaf(a0.w, k.w, acc[0][j]))));
          acc[1][j] = fmaf(a1.x, k.x, fmaf(a1.y, k.y, fmaf(a1.z, k.z, fmaf(a1.w, k.w, acc[1][j]))));
        }
      }
      const bool need_mask = tile_needs_mask(w, k0, KT, ops);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 2 * rg + h;
        const int pos = sPos[r];
        const float slope = sSlope[r];
#pragma unroll
        for (int j = 0; j < C::KPT; ++j) {
          const int jj = kg + 16 * j;
          sS[r * KT + jj] = transform_logit(acc[h][j], ops, slope, k0 + jj, pos, need_mask);
        }
      }
    }
    __syncthreads();

    // 3. online softmax: row tid / 8, keys (tid % 8) + 8 i.
    {
      const int r = tid >> 3, l8 = tid & 7;
      float* srow = sS + r * KT;
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < KT / 8; ++i) mx = fmaxf(mx, srow[l8 + 8 * i]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      const float m_old = sM[r];
      const float m_new = fmaxf(m_old, mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < KT / 8; ++i) {
        const float e = exp2f(srow[l8 + 8 * i] - base);
        srow[l8 + 8 * i] = e;
        sum += e;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      __syncwarp();
      if (l8 == 0) {
        const float alpha = exp2f(m_old - base);
        sM[r] = m_new;
        sD[r] = sD[r] * alpha + sum;
        sA[r] = alpha;
      }
    }
    __syncthreads();

    // 4. O = alpha O + P V on this thread's column chunk. In a tile whose keys some rows see and
    // others do not (prefill: the causal diagonal, a window's edge), each row adds only the keys
    // it sees: its probability of the others is 0, but 0 times an inf or NaN value would be NaN.
    if (cc * 4 < dv) {
#pragma unroll
      for (int i = 0; i < C::ORPT; ++i) {
        const float al = sA[orow0 + i * OSTEP];
        o[i][0] *= al, o[i][1] *= al, o[i][2] *= al, o[i][3] *= al;
      }
      if (w.nq > 1 && tile_needs_mask(w, k0, KT, ops)) {
        for (int j = 0; j < KT; ++j) {
          const float4 v = *reinterpret_cast<const float4*>(V + j * FSTRIDE + cc * 4);
#pragma unroll
          for (int i = 0; i < C::ORPT; ++i) {
            if (!key_visible(k0 + j, sPos[orow0 + i * OSTEP], ops)) continue;
            const float pr = sS[(orow0 + i * OSTEP) * KT + j];
            o[i][0] = fmaf(pr, v.x, o[i][0]);
            o[i][1] = fmaf(pr, v.y, o[i][1]);
            o[i][2] = fmaf(pr, v.z, o[i][2]);
            o[i][3] = fmaf(pr, v.w, o[i][3]);
          }
        }
      } else {
#pragma unroll 4
        for (int j = 0; j < KT; ++j) {
          const float4 v = *reinterpret_cast<const float4*>(V + j * FSTRIDE + cc * 4);
#pragma unroll
          for (int i = 0; i < C::ORPT; ++i) {
            const float pr = sS[(orow0 + i * OSTEP) * KT + j];
            o[i][0] = fmaf(pr, v.x, o[i][0]);
            o[i][1] = fmaf(pr, v.y, o[i][1]);
            o[i][2] = fmaf(pr, v.z, o[i][2]);
            o[i][3] = fmaf(pr, v.w, o[i][3]);
          }
        }
      }
    }
  }

  cp_async_wait<0>();
  __syncthreads();
  float* eo = reinterpret_cast<float*>(smain);
#pragma unroll
  for (int i = 0; i < C::ORPT; ++i)
    *reinterpret_cast<float4*>(eo + (orow0 + i * OSTEP) * FSTRIDE + cc * 4) =
        make_float4(o[i][0], o[i][1], o[i][2], o[i][3]);
  __syncthreads();
  finalize_rows<QT, ROWS, DPAD, 1, NT>(a, w, eo, sM, sD, v_mul);
}

}  // namespace kvkernels::attn_cuda
