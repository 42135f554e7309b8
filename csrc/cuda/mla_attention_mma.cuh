// Tensor-core MLA decode / prefill for fp16 / bf16 q (the FlashMLA formulation on mma.sync): q
// [tokens, heads, R + P] (W_UK already absorbed) attends the latent rows [R + P] directly and O is
// accumulated in latent space [R]. All heads share the latent row, so one CTA owns a group of
// rows (query x head pairs: 16 with MlaPath::kMma16, 64 with kMma64) and loads each key tile once
// for all of them.
//
// Per key tile (32 keys, streamed through a cp.async ring of `stages` buffers; fp8 tiles are
// converted to the q dtype in shared memory first, exactly):
//   1. S = Q K^T on tensor cores (m16n8k16, fp32 accumulation over the full R + P width). Warps
//      split the [rows x 32] S tile: kMma16 = 4 warps x 8 keys, kMma64 = 8 warps x (16 rows x 16 keys).
//      Q is read with ldmatrix from a swizzled shared tile (576 columns do not fit registers).
//   2. The scaled, masked logits go to shared memory; each row's online softmax (log2 units) is
//      done by 8 (kMma16) or 4 (kMma64) threads; P is rounded to the q dtype into a small shared
//      tile, the rescale factor alpha per row next to it. The denominator uses the unrounded P.
//   3. O = alpha O + P V on tensor cores, V = the first R columns of the same tile (ldmatrix.trans).
//      Warps split O by columns: kMma16 = 128 columns x 16 rows per warp (64 fp32 registers),
//      kMma64 = 64 columns x 64 rows (128 fp32 registers), so V is read once per CTA per tile.
// Three barriers per tile. With several KV splits each CTA writes a normalized fp32 partial and
// its log2 lse; mla_merge.cuh combines them exactly.
#pragma once

#include "mla_common.cuh"

namespace kvkernels::mla_cuda {

template <typename T, CacheFormat CF, MlaPath PATH>
struct MlaMmaCfg {
  static constexpr int WM = mla_wm(PATH);          // m16 row blocks
  static constexpr int ROWS = 16 * WM;
  static constexpr int NT = mla_threads(PATH);
  static constexpr int NW = NT / 32;
  static constexpr int KT = kMmaKeyTile;
  static constexpr bool FP8 = CF == CacheFormat::kFp8E4M3 || CF == CacheFormat::kFp8E5M2;
  static constexpr int ESZ = FP8 ? 1 : 2;
  static constexpr int NPW = (KT / 8) * WM / NW;   // n8 key tiles of S per warp (1 or 2)
  static constexpr int CW = kMaxValueWidth / NW;   // O columns per warp (128 or 64)
  static constexpr int NB = CW / 8;                // n8 column tiles of O per warp
  static constexpr int TPR = NT / ROWS;            // softmax threads per row (8 or 4)
  static constexpr int KPT = KT / TPR;             // keys per softmax thread (4 or 8)
  static_assert(NPW == 1 || NPW == 2, "S split");
  static_assert(KPT % 2 == 0 && TPR <= 32, "softmax split");
};

// One stage of raw fp8 keys [KT][dp] bytes -> swizzled 16-bit tile [KT][dp] of the q dtype.
// Values come out in units of fp8_unit (2^-8 for e4m3 converted through bits; folded back in).
template <typename T, CacheFormat CF, int KT, int NT>
__device__ __forceinline__ void convert_fp8_tile(const char* raw, char* cvt, int dp) {
  const int cpr8 = dp / 16, cpr16 = dp / 8;
  for (int idx = threadIdx.x; idx < KT * cpr8; idx += NT) {
    const int r = idx / cpr8, c = idx - r * cpr8;
    const uint4 u = *reinterpret_cast<const uint4*>(raw + idx * 16);
    const uint32_t wd[4] = {u.x, u.y, u.z, u.w};
    uint32_t h[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) ac::fp8x4_to_pairs<T, CF>(wd[i], &h[2 * i], &h[2 * i + 1]);
    *reinterpret_cast<uint4*>(cvt + swz_rt(r, 2 * c, cpr16)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(cvt + swz_rt(r, 2 * c + 1, cpr16)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
}

template <typename T, CacheFormat CF, MlaPath PATH>
__global__ void __launch_bounds__(mla_threads(PATH), 1)
    mla_mma_kernel(const __grid_constant__ MlaArgs m) {
  using C = MlaMmaCfg<T, CF, PATH>;
  constexpr int KT = C::KT, NT = C::NT, ROWS = C::ROWS, WM = C::WM, NPW = C::NPW;
  constexpr int NB = C::NB, CW = C::CW, TPR = C::TPR, KPT = C::KPT;
  extern __shared__ __align__(128) unsigned char smem[];

  const ac::AttnArgs& a = m.a;
  ac::Work w;
  if (!ac::make_work<KT>(a, w)) return;
  const AttentionParams& p = a.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int D = p.kv.head_dim, R = p.kv.head_dim_v, dp = m.dp, cpr16 = dp / 8;
  const int stages = m.stages;
  const MmaSmem L = mma_smem(PATH, dp, C::ESZ, stages);
  char* sq = reinterpret_cast<char*>(smem) + L.q_off;
  char* sstage = reinterpret_cast<char*>(smem) + L.stage_off;
  float* sS = reinterpret_cast<float*>(smem + L.s_off);
  char* sP = reinterpret_cast<char*>(smem) + L.p_off;
  float* sM = reinterpret_cast<float*>(smem + L.stat_off);
  float* sD = sM + ROWS;
  float* sAlpha = sD + ROWS;

  // Start the key pipeline first: the copies fly while the queries are staged.
  const int ntiles = w.tile_end - w.tile_begin;
  auto raw_off = [cpr16](int r, int c) {
    if constexpr (C::FP8) return (r * (cpr16 / 2) + c) * 16;  // plain rows, converted later
    else return swz_rt(r, c, cpr16);
  };
  // Block ids travel a tile ahead of the copies that use them (fetch_key_ids).
  int key_ids = ntiles > 0 ? fetch_key_ids<KT, NT>(m, w, w.tile_begin) : -1;
  for (int s = 0; s < stages - 1; ++s) {
    if (s < ntiles) {
      issue_key_tile<KT, NT, C::ESZ>(m, w, w.tile_begin + s, key_ids, sstage + s * L.stage_bytes,
                                     raw_off);
      if (s + 1 < ntiles) key_ids = fetch_key_ids<KT, NT>(m, w, w.tile_begin + s + 1);
    }
    ac::cp_async_commit();
  }

  // Queries of the CTA's rows -> swizzled 16-bit tile; zero rows / columns as padding.
  for (int idx = tid; idx < ROWS * cpr16; idx += NT) {
    const int r = idx / cpr16, c = idx - r * cpr16;
    const ac::RowId id = ac::row_id(a, w, r);
    float x[8];
    load_q_chunk<T>(a, id, c, D, x);
    *reinterpret_cast<uint4*>(sq + swz_rt(r, c, cpr16)) =
        make_uint4(ac::pack2<T>(x[0], x[1]), ac::pack2<T>(x[2], x[3]), ac::pack2<T>(x[4], x[5]),
                   ac::pack2<T>(x[6], x[7]));
  }

  constexpr float unit = C::FP8 ? ac::fp8_unit<CF>() : 1.0f;
  const float qk_mul2 = p.scale * p.kv.k_scale_of(0) * unit * ac::kLog2e;  // logits in log2 units
  const float v_mul = p.kv.k_scale_of(0) * unit;  // V is the same bytes as K: same scale

  // S-phase geometry: this warp's m16 block and its NPW n8 key tiles.
  const int wm = warp % WM, key_base = (warp / WM) * NPW * 8;
  const int pos_a = ac::row_id(a, w, wm * 16 + g).pos, pos_b = ac::row_id(a, w, wm * 16 + g + 8).pos;
  // Softmax geometry: row srow, keys [sk, sk + KPT); running max / denominator (log2 units),
  // replicated in the TPR threads of the row.
  const int srow = tid / TPR, sk = (tid % TPR) * KPT;
  float m_run = -INFINITY, d_run = 0.0f;
  // PV geometry: this warp's CW columns of O, for all ROWS rows.
  const int col0 = warp * CW;
  float o[WM][NB][4];
#pragma unroll
  for (int mi = 0; mi < WM; ++mi)
#pragma unroll
    for (int n = 0; n < NB; ++n) o[mi][n][0] = o[mi][n][1] = o[mi][n][2] = o[mi][n][3] = 0.0f;

  const uint32_t sq_u32 = ac::smem_u32(sq), sp_u32 = ac::smem_u32(sP);
  const int ksteps = (D + 15) / 16;
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait_pending(stages - 2);
    __syncthreads();  // tile `it` landed for every thread; the previous tile is fully consumed
    {
      const int nx = it + stages - 1;
      if (nx < ntiles) {
        issue_key_tile<KT, NT, C::ESZ>(m, w, w.tile_begin + nx, key_ids,
                                       sstage + (nx % stages) * L.stage_bytes, raw_off);
        if (nx + 1 < ntiles) key_ids = fetch_key_ids<KT, NT>(m, w, w.tile_begin + nx + 1);
      }
      ac::cp_async_commit();
    }
    char* tile = sstage + (it % stages) * L.stage_bytes;
    if constexpr (C::FP8) {
      char* cvt = reinterpret_cast<char*>(smem) + L.cvt_off;
      convert_fp8_tile<T, CF, KT, NT>(tile, cvt, dp);
      __syncthreads();
      tile = cvt;
    }
    const uint32_t tk_u32 = ac::smem_u32(tile);
    const int k0 = (w.tile_begin + it) * KT;
    // A tile past the first query's position (prefill) with an inf / NaN value: see
    // attention_common.cuh ("keys some rows of a CTA see").
    const bool fix_nonfinite =
        w.nq > 1 && k0 + KT - 1 > w.pos0 && ac::tile_has_nonfinite<T, NT>(tile, KT * dp / 8);

    // 1. S = Q K^T for this warp's 16 rows x NPW * 8 keys.
    // Even and odd k-steps accumulate apart (summed after): at rank 512 + 64 one accumulator was a
    // chain of 36 dependent mma per tile, and with a step's loads just before its mma the warp
    // waited on both (the H100 profile: the S loop's mma samples "wait" and "short_scoreboard").
    // Two steps per iteration let the second step's loads go out before the first step's mma.
    float s[NPW][4], s_odd[NPW][4];
#pragma unroll
    for (int i = 0; i < NPW; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
      s_odd[i][0] = s_odd[i][1] = s_odd[i][2] = s_odd[i][3] = 0.0f;
    }
    auto k_step = [&](int kk, float (*acc)[4]) {
      uint32_t af[4];
      ac::ldmatrix_x4(sq_u32 + swz_rt(wm * 16 + (lane & 15), 2 * kk + (lane >> 4), cpr16), af);
      if constexpr (NPW == 2) {
        uint32_t b[4];
        const int key = key_base + (lane & 7) + ((lane >> 4) << 3);
        ac::ldmatrix_x4(tk_u32 + swz_rt(key, 2 * kk + ((lane >> 3) & 1), cpr16), b);
        ac::mma_16816<T>(acc[0], af, b[0], b[1]);
        ac::mma_16816<T>(acc[NPW - 1], af, b[2], b[3]);
      } else {
        uint32_t b[2];
        ldmatrix_x2(tk_u32 + swz_rt(key_base + (lane & 7), 2 * kk + ((lane >> 3) & 1), cpr16),
                        b);
        ac::mma_16816<T>(acc[0], af, b[0], b[1]);
      }
    };
    int kk = 0;
    for (; kk + 1 < ksteps; kk += 2) {
      k_step(kk, s);
      k_step(kk + 1, s_odd);
    }
    if (kk < ksteps) k_step(kk, s);
#pragma unroll
    for (int i = 0; i < NPW; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] += s_odd[i][e];
    // 2a. Scaled, causally masked logits (log2 units) -> shared memory.
#pragma unroll
    for (int i = 0; i < NPW; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kl = key_base + i * 8 + 2 * t4 + (e & 1);
        const int row = wm * 16 + g + (e >> 1) * 8;
        const bool visible = k0 + kl <= (e < 2 ? pos_a : pos_b);
        sS[row * KT + kl] = visible ? s[i][e] * qk_mul2 : -INFINITY;
      }
    }
    __syncthreads();
    // 2b. Online softmax of row srow over this tile; P (q dtype) and alpha to shared memory.
    {
      float x[KPT];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < KPT; ++j) {
        x[j] = sS[srow * KT + sk + j];
        mx = fmaxf(mx, x[j]);
      }
#pragma unroll
      for (int off = 1; off < TPR; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run, mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet: weights 0
      const float alpha = exp2f(m_run - base);                // m_run = -inf gives 0
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < KPT; j += 2) {
        const float p0 = exp2f(x[j] - base), p1 = exp2f(x[j + 1] - base);
        sum += p0 + p1;
        *reinterpret_cast<uint32_t*>(sP + srow * kPRowBytes + (sk + j) * 2) = ac::pack2<T>(p0, p1);
      }
#pragma unroll
      for (int off = 1; off < TPR; off *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      d_run = d_run * alpha + sum;
      m_run = m_new;
      if (tid % TPR == 0) sAlpha[srow] = alpha;
    }
    __syncthreads();
    // 3. O = alpha O + P V over this warp's columns. A row block is rescaled only when one of its
    // 16 rows has a new maximum (alpha is exactly 1 otherwise; NaN compares unequal and rescales):
    // past the first tiles of a long context most tiles skip the multiplies.
#pragma unroll
    for (int mi = 0; mi < WM; ++mi) {
      const float al = sAlpha[mi * 16 + g], bl = sAlpha[mi * 16 + g + 8];
      if (__any_sync(0xffffffffu, al != 1.0f || bl != 1.0f)) {
#pragma unroll
        for (int n = 0; n < NB; ++n)
          o[mi][n][0] *= al, o[mi][n][1] *= al, o[mi][n][2] *= bl, o[mi][n][3] *= bl;
      }
    }
    if (fix_nonfinite) {
      // Each thread adds, to its output elements, the non-finite values of the keys their rows
      // see times P (as rounded in sP); then those values are zeroed for the tile product.
      for (int kl = 0; kl < KT; ++kl) {
#pragma unroll
        for (int mi = 0; mi < WM; ++mi) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = mi * 16 + g + 8 * h;
            if (k0 + kl > ac::row_id(a, w, r).pos) continue;
            const float pr = ac::bits16_to_float<T>(*reinterpret_cast<const uint16_t*>(sP + r * kPRowBytes + kl * 2));
#pragma unroll
            for (int n = 0; n < NB; ++n) {
              const int col = col0 + n * 8 + 2 * t4;
              if (col >= R) continue;
              const uint32_t v2 = *reinterpret_cast<const uint32_t*>(tile + swz_rt(kl, col / 8, cpr16) + 4 * t4);
              const uint32_t bad = ac::nonfinite2<T>(v2);
              if (bad & 0xffffu) o[mi][n][2 * h] += pr * ac::bits16_to_float<T>(v2 & 0xffffu);
              if (bad >> 16) o[mi][n][2 * h + 1] += pr * ac::bits16_to_float<T>(v2 >> 16);
            }
          }
        }
      }
      __syncthreads();  // every warp has read the values it needed
      ac::zero_nonfinite<T, NT>(tile, KT * dp / 8);
      __syncthreads();
    }
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
      uint32_t pa[WM][4];
#pragma unroll
      for (int mi = 0; mi < WM; ++mi)
        ac::ldmatrix_x4(sp_u32 + (mi * 16 + (lane & 15)) * kPRowBytes + (2 * kk + (lane >> 4)) * 16,
                        pa[mi]);
#pragma unroll
      for (int dn = 0; dn < NB / 2; ++dn) {
        if (col0 + dn * 16 >= R) continue;  // past the value width (uniform per warp)
        uint32_t b[4];
        const int key = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        ac::ldmatrix_x4_trans(tk_u32 + swz_rt(key, col0 / 8 + 2 * dn + (lane >> 4), cpr16), b);
#pragma unroll
        for (int mi = 0; mi < WM; ++mi) {
          ac::mma_16816<T>(o[mi][2 * dn], pa[mi], b[0], b[1]);
          ac::mma_16816<T>(o[mi][2 * dn + 1], pa[mi], b[2], b[3]);
        }
      }
    }
  }

  // Epilogue: the row statistics to shared memory, then every thread writes its O fragments.
  ac::cp_async_wait<0>();
  if (tid % TPR == 0) sM[srow] = m_run, sD[srow] = d_run;
  __syncthreads();
  const int64_t rows_total = p.num_tokens * p.num_heads;
  const float vm = ac::checked_v_mul(v_mul);
#pragma unroll
  for (int mi = 0; mi < WM; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mi * 16 + g + 8 * h;
      const ac::RowId id = ac::row_id(a, w, r);
      if (!id.valid) continue;
      float mul;
      const float lse2 = finish_mla_row(w, id, a.num_splits == 1, a.p, sM[r], sD[r], vm, &mul);
      const int64_t row = id.token * p.num_heads + id.head;
#pragma unroll
      for (int n = 0; n < NB; ++n) {
        const int col = col0 + n * 8 + 2 * t4;
        if (col >= R) continue;  // R is a multiple of 8: col + 1 < R too
        const float x0 = o[mi][n][2 * h] * mul, x1 = o[mi][n][2 * h + 1] * mul;
        if (a.num_splits == 1) {
          *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + row * R + col) = ac::pack2<T>(x0, x1);
        } else {
          const int64_t prow = int64_t(w.split) * rows_total + row;
          *reinterpret_cast<float2*>(a.part_o + prow * R + col) = make_float2(x0, x1);
        }
      }
      if (warp == 0 && t4 == 0) {
        if (a.num_splits == 1) p.lse[row] = lse2 * ac::kLn2;
        else a.part_lse[int64_t(w.split) * rows_total + row] = lse2;
      }
    }
  }
}

}  // namespace kvkernels::mla_cuda
