// mla_decompress on CUDA, the "persist" kernel (the default for fp16 / bf16 weights; the tile64
// kernel of mla_decompress.cuh stays selectable with KVKERNELS_CUDA_DECOMPRESS=tile64 and runs every
// float32 call). The same GEMM C[T, N] = latent[T, R] x w_kv_b[N, R]^T and the same epilogue
// semantics; what changes is the work decomposition. Compiled and emulated, not run on a GPU.
//
// Why: the tile64 kernel gives every 64 x 64 output tile its own CTA, so each of the N / 64 column
// tiles of a token tile gathers, dequantizes and normalises the same 64 latent rows again (64 times
// at N = 4096), and its K loop is only R / 64 = 8 steps long: a 3-stage ring spends a large part of
// it filling and draining.
//
// Here a CTA owns one token tile of BM rows (64: 4 warps; 128: 8 warps) and a run of `tiles_per_cta`
// consecutive column tiles of BN = 128 columns (blockIdx.y picks the run; the launcher picks BM and
// sizes the grid to the SMs' CTA slots, mla_decompress.cu):
//   1. the first stages - 1 weight K-tiles are put in flight (cp.async), then the latent rows are
//      staged once into a swizzled [BM][R] shared tile by stage_latent (the tile64 kernel's gather,
//      fp8 dequant, RMS norm and rounding) together with this run's share of the k_pe copies;
//   2. one continuous stream of weight K-tiles (128 rows x 128 bytes = 16 KiB) runs through a ring
//      of `stages` buffers (2-4, from the device's shared memory) across the column-tile
//      boundaries: step s is K-tile s % ktiles of column tile s / ktiles, so the tiles of the next
//      column tile are already in flight while the last K-steps of the current one are multiplied
//      and its results stored; the ring drains only at the CTA's last tile;
//   3. warps BM / 32 (rows) x 2 (columns) of 32 x 64 outputs (mma.sync m16n8k16 from ldmatrix.x4 of
//      the swizzled tiles: per 16 of k, 2 A and 4 B loads feed 16 mma, against 2 + 2 for 8 in
//      tile64's 32 x 32 warps, so less shared-memory traffic per mma); after the last K-tile of a
//      column tile each thread rounds its accumulators once to the weight dtype and stores them
//      straight from registers into key / value (two adjacent columns per 4-byte store when every
//      pair lies in one head and one of key / value, else element stores), then starts the next
//      tile from zero. No shared-memory epilogue: it would need a barrier and a buffer the ring is
//      still using.
// BM trades weight traffic against occupancy: every token tile streams all of w_kv_b from L2 (T 2048,
// 16 heads: 128 MiB at BM 64, 64 MiB at BM 128, against 2 MiB of latent rows), while BM 64 lets two
// CTAs share an SM (one stages or stalls at a barrier while the other computes).
// Shared memory: stages x 16 KiB + BM x rpad x 2 bytes. R 512: BM 64 with 3 stages 112 KiB (two CTAs
// per H100 / H200 SM; __launch_bounds__(128, 2)), BM 128 with 4 stages 192 KiB (one CTA;
// __launch_bounds__(256, 1)). ptxas: 146-150 registers, no spills.
// Per output element the k order of the mma.sync chain is the tile64 kernel's (K-tile by K-tile, 16
// at a time), so both kernels give the same bits on the same inputs (tested).
//
// No TMA here: the weight ring is filled by cp.async from all threads (1024 chunks of 16 bytes per
// K-step: 8 (BM 64) or 4 (BM 128) per thread, against 64 mma.sync per warp), which keeps one code path
// for sm_80 and sm_90; a TMA ring across column tiles would need per-stage mbarrier phase tracking
// over a runtime number of steps and stages for a copy-issue cost that is already small next to the
// math.
#pragma once

#include "mla_decompress.cuh"

namespace kvkernels::mla_cuda {

// BM = 64: 4 warps (2 x 2), two CTAs per SM where shared memory allows; BM = 128: 8 warps (4 x 2),
// one CTA per SM, half the weight traffic per output (every token tile streams all of w_kv_b).
template <int BM_>
struct PersistCfg {
  static_assert(BM_ == 64 || BM_ == 128, "token tiles of 64 or 128 rows");
  static constexpr int BM = BM_;            // tokens per CTA (the latent tile): BM / 32 warps x 32
  static constexpr int WARPS_M = BM / 32;
  static constexpr int NW = WARPS_M * 2;    // x 2 warps along the columns
  static constexpr int NT = NW * 32;
  static constexpr int MIN_CTAS = BM == 64 ? 2 : 1;  // __launch_bounds__' blocks per SM
  static constexpr int WN = 64;             // columns per warp
  static constexpr int BN = 128;            // columns per tile: 2 warps x WN
  static constexpr int BK = 64;             // 16-bit elements per K-tile (one 128-byte row segment)
  static constexpr int W_STAGE = BN * 128;  // bytes per ring buffer
  static constexpr int MIN_STAGES = 2, MAX_STAGES = 4;
  static int smem(int rpad, int stages) { return stages * W_STAGE + BM * rpad * 2; }
};

// Stages the BM latent rows of tokens m0.. into the swizzled [BM][rpad] tile `sa` (weight dtype:
// fp8 dequantized, RMS-normalised with norm_weight when given, rounded once: the tile64 kernel's
// arithmetic, element for element), zeros for tokens with no valid row, and writes k_pe of heads
// [h0, h1) of those tokens. Warp w takes rows w, w + NW, ... (BM / NW of them).
// Unlike tile64's inline loop (one row at a time: the token's sequence search, its block id and its
// row are three dependent global loads per row), the warp's rows are located at once (lane i finds
// row i) and read UNROLL at a time, so the loads of several rows are in flight together: with one
// wave of CTAs (T 2048) nothing else hides this latency at the start of the kernel.
// The layout of the staged tile: `off(r, c8)` is the byte offset of 16-byte chunk c8 of row r. Here
// the row-major swizzle of the mma.sync kernels; the wgmma kernel (mla_decompress_sm90.cuh) passes the
// 128B-swizzle canonical layout wgmma reads, and its warpgroup's warp index as `warp`.
struct RowSwizzle {
  int cpr;  // 16-byte chunks per row
  __device__ __forceinline__ int operator()(int r, int c8) const { return swz_rt(r, c8, cpr); }
};
template <typename T, typename C, int BM, int NW, typename Layout>
__device__ __forceinline__ void stage_latent_rows(const DecompressArgs& d, char* sa, int64_t m0, int h0,
                                                  int h1, int warp, Layout off) {
  constexpr int RPW = BM / NW, UNROLL = 4;
  static_assert(RPW <= 32 && RPW % UNROLL == 0, "a lane per row, whole groups of rows");
  const MlaDecompressParams& p = d.p;
  const int lane = threadIdx.x & 31;
  const int R = p.kv_lora_rank, P = p.rope_dim, dn = p.qk_nope_head_dim, H = p.num_heads;
  const float scale = p.kv.k_scale_of(0);
  const T* nw = static_cast<const T*>(p.norm_weight);
  const C* mine = lane < RPW ? locate_latent<C>(p, m0 + warp + int64_t(NW) * lane) : nullptr;
  const auto mine_bits = reinterpret_cast<unsigned long long>(mine);
  for (int i0 = 0; i0 < RPW; i0 += UNROLL) {
    const C* row[UNROLL];
    float x[UNROLL][2][8];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      row[u] = reinterpret_cast<const C*>(__shfl_sync(0xffffffffu, mine_bits, i0 + u));
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c8 = lane + 32 * j;
        if (row[u] != nullptr && c8 * 8 < R) {
          load_latent8(row[u] + c8 * 8, d.row_vec != 0, scale, x[u][j]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) x[u][j][i] = 0.0f;
        }
      }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r = warp + NW * (i0 + u);
      const int64_t t = m0 + r;
      if (nw != nullptr) {
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int i = 0; i < 8; ++i) ss = fmaf(x[u][j][i], x[u][j][i], ss);
#pragma unroll
        for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float inv = 1.0f / sqrtf(ss / static_cast<float>(R) + p.norm_eps);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c8 = lane + 32 * j;
          if (c8 * 8 >= R) continue;
#pragma unroll
          for (int i = 0; i < 8; ++i) x[u][j][i] = x[u][j][i] * inv * kc::to_float(nw[c8 * 8 + i]);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c8 = lane + 32 * j;
        if (c8 * 8 >= d.rpad) continue;
        *reinterpret_cast<uint4*>(sa + off(r, c8)) =
            make_uint4(ac::pack2<T>(x[u][j][0], x[u][j][1]), ac::pack2<T>(x[u][j][2], x[u][j][3]),
                       ac::pack2<T>(x[u][j][4], x[u][j][5]), ac::pack2<T>(x[u][j][6], x[u][j][7]));
      }
      if (t < p.num_tokens) {
        T* key = static_cast<T*>(p.key) + t * H * (dn + P) + dn;
        if (d.pair_out) {  // dn, P even, key 4-byte aligned: two elements per store
          for (int i = 2 * lane; i < P; i += 64) {
            float a = 0.0f, b = 0.0f;
            if (row[u] != nullptr)
              a = latent_to_float(row[u][R + i]) * scale, b = latent_to_float(row[u][R + i + 1]) * scale;
            const uint32_t v = ac::pack2<T>(a, b);
            for (int h = h0; h < h1; ++h) *reinterpret_cast<uint32_t*>(key + int64_t(h) * (dn + P) + i) = v;
          }
        } else {
          for (int i = lane; i < P; i += 32) {
            const T v = kc::from_float<T>(row[u] != nullptr ? latent_to_float(row[u][R + i]) * scale : 0.0f);
            for (int h = h0; h < h1; ++h) key[int64_t(h) * (dn + P) + i] = v;
          }
        }
      }
    }
  }
}

template <typename T, typename C, int BM, int NW>
__device__ __forceinline__ void stage_latent(const DecompressArgs& d, char* sa, int64_t m0, int h0,
                                             int h1) {
  stage_latent_rows<T, C, BM, NW>(d, sa, m0, h0, h1, int(threadIdx.x >> 5),
                                  RowSwizzle{d.rpad * int(sizeof(T)) / 16});
}

// The tile64 kernel's warp K loop as a function (the tile64 kernel keeps its inline copy, and its
// own inline latent staging: calling functions from it changed its code generation - ptxas, sm_80:
// a 16-byte stack frame with spills - and it is the A/B baseline).
// One K-tile (64 elements of k) of a warp's 32 x (16 NJ) output block on mma.sync m16n8k16: rows
// m_off.. of the swizzled latent tile (chunk row cpr_a, K-tile kt) times rows n_off.. of the
// swizzled weight stage at ws_u32 (128 bytes a row). acc[m16 block][n8 tile][4] (PTX C layout).
// Per 16 of k: 2 ldmatrix.x4 of A, NJ of B, 4 NJ mma.sync.
template <typename T, int NJ>
__device__ __forceinline__ void mma_warp(float (*acc)[2 * NJ][4], uint32_t sa_u32, uint32_t ws_u32,
                                         int cpr_a, int kt, int m_off, int n_off) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t af[2][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
      ac::ldmatrix_x4(sa_u32 + swz_rt(m_off + mi * 16 + (lane & 15), kt * 8 + 2 * kk + (lane >> 4), cpr_a),
                      af[mi]);
#pragma unroll
    for (int nj = 0; nj < NJ; ++nj) {
      uint32_t b[4];
      const int n = n_off + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
      ac::ldmatrix_x4(ws_u32 + swz_rt(n, 2 * kk + ((lane >> 3) & 1), 8), b);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        ac::mma_16816<T>(acc[mi][2 * nj], af[mi], b[0], b[1]);
        ac::mma_16816<T>(acc[mi][2 * nj + 1], af[mi], b[2], b[3]);
      }
    }
  }
}

// Where output column n (of N = H (qk_nope + v)) goes: element `off` of row t is base[t * stride + off].
template <typename T>
struct OutCol {
  T* base = nullptr;
  int64_t stride = 0;
  int64_t off = 0;
};

template <typename T>
__device__ __forceinline__ OutCol<T> out_col(const MlaDecompressParams& p, int n) {
  const int dn = p.qk_nope_head_dim, dv = p.v_head_dim, H = p.num_heads;
  const int h = n / (dn + dv), j = n - h * (dn + dv);
  OutCol<T> o;
  if (j < dn) {
    const int key_w = dn + p.rope_dim;
    o.base = static_cast<T*>(p.key), o.stride = int64_t(H) * key_w, o.off = int64_t(h) * key_w + j;
  } else {
    o.base = static_cast<T*>(p.value), o.stride = int64_t(H) * dv, o.off = int64_t(h) * dv + (j - dn);
  }
  return o;
}

// Stores a warp's 32 x (8 NI) accumulator block (rows m0.., columns n0..), rounded once.
template <typename T, int NI>
__device__ __forceinline__ void store_warp(const DecompressArgs& d, float (*acc)[NI][4], int64_t m0,
                                           int n0) {
  const MlaDecompressParams& p = d.p;
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int ni = 0; ni < NI; ++ni) {
    const int c = n0 + ni * 8 + 2 * t4;  // this thread's columns c, c + 1
    if (c >= d.n_total) continue;
    const OutCol<T> o0 = out_col<T>(p, c);
    OutCol<T> o1;
    if (!d.pair_out && c + 1 < d.n_total) o1 = out_col<T>(p, c + 1);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t t = m0 + mi * 16 + half * 8 + g;
        if (t >= p.num_tokens) continue;
        const float x = acc[mi][ni][2 * half], y = acc[mi][ni][2 * half + 1];
        if (d.pair_out) {
          // c even, qk_nope / v / rope even: c and c + 1 are neighbours in one row, 4-byte aligned.
          *reinterpret_cast<uint32_t*>(o0.base + t * o0.stride + o0.off) = ac::pack2<T>(x, y);
        } else {
          o0.base[t * o0.stride + o0.off] = kc::from_float<T>(x);
          if (o1.base != nullptr) o1.base[t * o1.stride + o1.off] = kc::from_float<T>(y);
        }
      }
  }
}

template <typename T, typename C, int BM_>
__global__ void __launch_bounds__(PersistCfg<BM_>::NT, PersistCfg<BM_>::MIN_CTAS)
    mla_decompress_persist_kernel(const __grid_constant__ DecompressArgs d) {
  static_assert(sizeof(T) == 2, "the persist kernel is for fp16 / bf16 weights (tensor cores)");
  using Cfg = PersistCfg<BM_>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, NT = Cfg::NT, NW = Cfg::NW;
  extern __shared__ __align__(128) unsigned char smem[];
  const MlaDecompressParams& p = d.p;
  const int warp = threadIdx.x >> 5;
  const int H = p.num_heads;
  const int64_t m0 = int64_t(blockIdx.x) * BM;
  const int tile0 = blockIdx.y * d.tiles_per_cta;
  const int ntiles = max(0, min(d.n_tiles, tile0 + d.tiles_per_cta) - tile0);
  const int ktiles = d.rpad / Cfg::BK;
  const int steps = ntiles * ktiles;
  const int S = d.stages;
  const int cpr_a = d.rpad / 8;  // 16-byte chunks per latent row
  char* sw = reinterpret_cast<char*>(smem);
  char* sa = sw + S * Cfg::W_STAGE;

  // 1. The ring's first S - 1 K-tiles (one commit group each, empty past the end), then the latent.
  // Step s: column tile tile0 + s / ktiles, K-tile s % ktiles, ring buffer s % S.
  int is_tile = 0, is_kt = 0, is_buf = 0;  // the next step to issue
  auto issue_next = [&]() {
    if (is_tile < ntiles) {
      issue_w_tile<T, BN, NT>(d, (tile0 + is_tile) * BN, is_kt, sw + is_buf * Cfg::W_STAGE);
      if (++is_kt == ktiles) is_kt = 0, ++is_tile;
      if (++is_buf == S) is_buf = 0;
    }
    ac::cp_async_commit();
  };
  for (int s = 0; s < S - 1; ++s) issue_next();
  {
    const int hs = (H + gridDim.y - 1) / gridDim.y;
    const int h0 = blockIdx.y * hs;
    stage_latent<T, C, BM, NW>(d, sa, m0, h0, min(H, h0 + hs));
  }

  // 2. The stream of K-steps over this CTA's column tiles.
  const uint32_t sa_u32 = ac::smem_u32(sa);
  constexpr int NJ = Cfg::WN / 16, NI = 2 * NJ;  // n16 groups / n8 tiles per warp
  const int wm = warp % Cfg::WARPS_M, wn = warp / Cfg::WARPS_M;  // WARPS_M x 2 warps of 32 x WN
  float acc[2][NI][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
  int tile = 0, kt = 0, buf = 0;
  for (int s = 0; s < steps; ++s) {
    // Groups committed so far: S - 1 + s; step s's is complete when at most S - 2 are pending.
    cp_async_wait_pending(S - 2);
    // Step s's tile landed for every thread; every warp is done with step s - 1, whose buffer
    // ((s - 1) % S = (s + S - 1) % S) the next issue overwrites; first pass: the latent is complete.
    __syncthreads();
    issue_next();
    mma_warp<T, NJ>(acc, sa_u32, ac::smem_u32(sw + buf * Cfg::W_STAGE), cpr_a, kt, wm * 32, wn * Cfg::WN);
    if (++buf == S) buf = 0;
    if (++kt == ktiles) {
      // 3. The column tile is complete: store it and start the next one from zero.
      store_warp<T, NI>(d, acc, m0 + wm * 32, (tile0 + tile) * BN + wn * Cfg::WN);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
      kt = 0, ++tile;
    }
  }
  ac::cp_async_wait<0>();  // only empty groups remain; nothing may be in flight at exit
}

}  // namespace kvkernels::mla_cuda
