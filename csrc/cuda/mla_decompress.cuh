// mla_decompress on CUDA: key = [W_k(h) c ; k_pe], value = W_v(h) c for every cached token, as one
// tiled GEMM  C[T, N] = latent[T, R] x w_kv_b[N, R]^T  with N = num_heads * (qk_nope + v_head)
// (DeepSeek's kv_b_proj layout), whose columns are scattered into key / value by the epilogue.
// Torch-free; launched by mla_decompress.cu after token_starts_kernel (gather.cuh) has turned
// seq_lens into cumulative token starts on the device (no host read). This is the "tile64" kernel
// (KVKERNELS_CUDA_DECOMPRESS=tile64; ran on an H200): since then fp16 / bf16 weights default to the
// persist kernel of mla_decompress_persist.cuh, which reuses the helpers above its kernel here.
//
// One CTA (128 threads) owns an output tile of BM tokens x 64 columns:
//   1. prologue: the first STAGES - 1 K-tiles of w_kv_b (64 rows x 128 bytes each) are put in
//      flight (cp.async, or TMA on sm_90: see below); meanwhile each warp stages latent rows: it
//      finds the token's sequence / block / slot (binary search over the starts), reads the row
//      (fp8 dequantized with the per-tensor scale), computes the row's inverse RMS in registers
//      (warp shuffle) when norm_weight is given, and writes row * inv_rms * norm_weight rounded to
//      the weight dtype (the CPU backend's arithmetic and rounding) into a swizzled [BM][R] shared
//      tile that stays for the whole K loop. The same pass writes the rotary part k_pe of the
//      CTA's share of heads.
//   2. K loop over R in tiles of BK (64 for 16-bit, 32 for float32 = one 128-byte row segment):
//      wait for tile k, issue tile k + STAGES - 1 into the freed buffer, multiply tile k:
//        fp16 / bf16: mma.sync m16n8k16 (ldmatrix from swizzled tiles), 4 warps x 32 x 32, BM = 64;
//        float32: float32 FMA on CUDA cores (no TF32: the float32 contract is ~1e-5), 4 x 4
//        outputs per thread, BM = 32.
//   3. epilogue: the fp32 tile goes through shared memory (reusing the W buffers) so that rows of
//      key and value are written with consecutive addresses; one rounding to the weight dtype.
// Tokens with no valid cache row (num_tokens larger than sum(seq_lens), block ids out of range)
// produce zeros instead of reading out of bounds.
//
// Weight tiles, two ways (template flag TMA; the launcher picks, mla_decompress.cu):
//   - cp.async (default; every arch, every dtype): all 128 threads copy 16-byte chunks into the
//     swizzled slot swz_rt(n, c, 8); chunks past N or R are zero-filled; a 3-stage cp.async ring.
//   - TMA (fp16 / bf16 on compute capability 9.x, device code compiled for sm_90+): one thread
//     issues cp.async.bulk.tensor.2d for the 64 x 64 box of a CUtensorMap over w_kv_b [N, R]
//     (SWIZZLE_128B, out-of-bounds rows / columns zero-filled by the copy engine) completing on
//     one mbarrier per stage (expect_tx of the full box, 8192 bytes, also for partial boxes).
//     The stage buffers are 1024-byte aligned, so the engine's 128B swizzle (16-byte chunk
//     address bits [4:6] XOR row bits [7:9] of the shared address) is the same permutation as
//     swz_rt(n, c, 8) = (n * 8 + (c ^ (n & 7))) * 16 within a 128-byte-row tile: the MMA loop
//     reads both layouts with the same ldmatrix addresses. Tile k lives in stage k % STAGES and
//     is that barrier's (k / STAGES)-th completion, so its wait parity is (k / STAGES) & 1; a
//     __syncthreads at the top of each K step (every warp done with tile k - 1) comes before the
//     copy that overwrites tile k - 1's stage.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing links libcuda)

#include "common.cuh"
#include "mla_common.cuh"
#include "sm90_ptx.cuh"

namespace kvkernels::mla_cuda {

namespace kc = kvkernels::cuda;

struct DecompressArgs {
  MlaDecompressParams p;  // p.token_start: device [num_seqs + 1]
  int rpad = 0;           // kv_lora_rank rounded up to BK
  int n_total = 0;        // num_heads * (qk_nope_head_dim + v_head_dim)
  int row_vec = 0;        // latent rows allow 8-element vector loads
  int w_async = 0;        // w_kv_b base 16-byte aligned: cp.async (rows always are: R % 8 == 0)
  // The persist kernel only (mla_decompress_persist.cuh):
  int stages = 0;         // weight-ring depth (2..4), from the device's shared memory
  int n_tiles = 0;        // column tiles of PersistCfg::BN columns
  int tiles_per_cta = 0;  // consecutive column tiles per CTA (blockIdx.y picks the run)
  int pair_out = 0;       // qk_nope, v, rope even and key / value 4-byte aligned: paired stores
};

template <typename T>
struct DecCfg {
  static constexpr bool MMA = !std::is_same_v<T, float>;
  static constexpr int NT = 128;
  static constexpr int NW = NT / 32;
  static constexpr int BM = MMA ? 64 : 32;
  static constexpr int BN = 64;
  static constexpr int BK = 128 / int(sizeof(T));  // one 128-byte swizzle group per W row
  static constexpr int STAGES = 3;
  static constexpr int W_STAGE = BN * 128;
  static constexpr int C_STRIDE = BN + 4;  // epilogue floats per row
  static_assert(BM * C_STRIDE * 4 <= STAGES * W_STAGE, "epilogue tile fits the W buffers");
  static int smem(int rpad) { return STAGES * W_STAGE + BM * rpad * int(sizeof(T)); }
  // TMA variant: up to 1023 bytes to align the W stages to 1024 (128B swizzle), + the mbarriers.
  static constexpr int TMA_EXTRA = 1024 + STAGES * 8;
};

// The cache row of output token t, or nullptr (t past the sequences, bad block id).
template <typename C>
__device__ __forceinline__ const C* locate_latent(const MlaDecompressParams& p, int64_t t) {
  const paged_kv_t& kv = p.kv;
  if (t >= p.num_tokens || kv.num_seqs == 0 || t >= p.token_start[kv.num_seqs]) return nullptr;
  // Largest s with token_start[s] <= t: skips empty sequences (equal starts).
  int64_t lo = 0, hi = kv.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (p.token_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int64_t j = t - p.token_start[lo];
  const int64_t lb = j / kv.block_size;
  if (lb >= kv.max_blocks_per_seq) return nullptr;
  const int32_t id = kv.block_id(lo, lb);
  if (id < 0 || id >= kv.num_blocks) return nullptr;
  return static_cast<const C*>(kv.k) + kv.k_offset(id, j % kv.block_size, 0);
}

// One cache element as float32 (fp8 through the exact fp8 -> fp16 conversion of
// attention_common.cuh: the same value as kvkernels/fp8.h's decoder, without its branches).
template <typename C>
__device__ __forceinline__ float latent_to_float(C x) {
  if constexpr (kc::is_fp8_type<C>) {
    constexpr CacheFormat CF =
        std::is_same_v<C, kc::fp8_e4m3> ? CacheFormat::kFp8E4M3 : CacheFormat::kFp8E5M2;
    uint32_t lo, hi;
    ac::fp8x4_to_half2x2<CF>(x.bits, &lo, &hi);
    return ac::unpack2_half(lo).x * ac::fp8_unit<CF>();  // times 2^8 where the unit is 2^-8: exact
  } else {
    return kc::to_float(x);
  }
}

// 8 latent elements as float32, times the fp8 scale (1 otherwise: exact).
template <typename C>
__device__ __forceinline__ void load_latent8(const C* src, bool vec, float scale, float* x) {
  if (vec) {
    if constexpr (sizeof(C) == 4) {
      const auto a = kc::Pack<C, 4>::load(src), b = kc::Pack<C, 4>::load(src + 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = a.v[i] * scale, x[4 + i] = b.v[i] * scale;
    } else if constexpr (sizeof(C) == 2) {
      const auto a = kc::Pack<C, 8>::load(src);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = kc::to_float(a.v[i]) * scale;
    } else {
      // fp8: one 8-byte load and the exact fp8 -> fp16 conversion of attention_common.cuh (in units
      // of fp8_unit: multiplying by fp8_unit * scale gives float(x) * scale exactly).
      constexpr CacheFormat CF =
          std::is_same_v<C, kc::fp8_e4m3> ? CacheFormat::kFp8E4M3 : CacheFormat::kFp8E5M2;
      const float mul = ac::fp8_unit<CF>() * scale;
      const uint2 u = *reinterpret_cast<const uint2*>(src);
      uint32_t h[4];
      ac::fp8x4_to_half2x2<CF>(u.x, &h[0], &h[1]);
      ac::fp8x4_to_half2x2<CF>(u.y, &h[2], &h[3]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = ac::unpack2_half(h[i]);
        x[2 * i] = f.x * mul, x[2 * i + 1] = f.y * mul;
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = latent_to_float(src[i]) * scale;
}

// Issues K-tile kt (128 bytes of each row) of the BN weight rows from n0, by NT threads: row n,
// 16-byte chunk c -> swizzled slot. Rows past N and chunks past R are zero-filled.
template <typename T, int BN = DecCfg<T>::BN, int NT = DecCfg<T>::NT>
__device__ __forceinline__ void issue_w_tile(const DecompressArgs& d, int n0, int kt, char* dst) {
  constexpr int EPC = 16 / int(sizeof(T));  // elements per chunk
  constexpr int BK = 128 / int(sizeof(T));
  const int R = d.p.kv_lora_rank;
  const T* w = static_cast<const T*>(d.p.w_kv_b);
  for (int idx = threadIdx.x; idx < BN * 8; idx += NT) {
    const int n = idx >> 3, c = idx & 7;
    const int64_t row = int64_t(n0) + n;
    const int k = kt * BK + c * EPC;
    const bool valid = row < d.n_total && k < R;  // R % 8 == 0: a chunk is all in or all out
    const char* src = reinterpret_cast<const char*>(valid ? w + row * R + k : w);
    char* s = dst + (n * 8 + (c ^ (n & 7))) * 16;
    if (d.w_async) ac::cp_async16(s, src, valid ? 16 : 0);
    else ac::TileLoader<1, 1, 1, int(sizeof(T))>::copy_chunk(s, src, valid ? 16 : 0);
  }
}

// ---- TMA (sm_90+) ----------------------------------------------------------------------------
// The mbarrier and TMA wrappers are sm90_ptx.cuh's (compiled for every sm_90 target; nothing on sm_80,
// where the TMA kernel variant traps and the launcher never selects it).

// K-tile kt of the CTA's 64 weight rows by TMA into stage `stage` (one thread calls this).
template <typename T>
__device__ __forceinline__ void issue_w_tile_tma(const CUtensorMap* map, int n0, int kt,
                                                 uint32_t sw_u32, uint32_t bar0, int stage) {
  using Cfg = DecCfg<T>;
  const uint32_t bar = bar0 + 8u * uint32_t(stage);
  sm90::mbar_arrive_expect_tx(bar, Cfg::W_STAGE);  // the whole box, zero-filled parts included
  sm90::tma_load_2d(sw_u32 + uint32_t(stage * Cfg::W_STAGE), map, kt * Cfg::BK, n0, bar);
}

template <typename T, typename C, bool TMA>
__global__ void __launch_bounds__(128)
    mla_decompress_kernel(const __grid_constant__ DecompressArgs d,
                          const __grid_constant__ CUtensorMap wmap) {
  using Cfg = DecCfg<T>;
  static_assert(!TMA || sizeof(T) == 2, "the TMA variant is for fp16 / bf16 weights");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (TMA) {
    __trap();  // no TMA before sm_90; the launcher checks the kernel's PTX version first
    return;
  }
#endif
  constexpr int BM = Cfg::BM, BN = Cfg::BN, NT = Cfg::NT, NW = Cfg::NW, STAGES = Cfg::STAGES;
  extern __shared__ __align__(128) unsigned char smem[];
  const MlaDecompressParams& p = d.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int R = p.kv_lora_rank, P = p.rope_dim, dn = p.qk_nope_head_dim, dv = p.v_head_dim;
  const int H = p.num_heads;
  const int64_t m0 = int64_t(blockIdx.x) * BM;
  const int n0 = blockIdx.y * BN;
  const int ktiles = d.rpad / Cfg::BK;
  const int cpr_a = d.rpad * int(sizeof(T)) / 16;
  char* sw = reinterpret_cast<char*>(smem);
  // TMA: the stages start at a 1024-byte boundary of the shared window (the 128B swizzle pattern
  // repeats every 8 rows of 128 bytes and is taken from the address bits).
  if constexpr (TMA) sw += (1024u - (ac::smem_u32(smem) & 1023u)) & 1023u;
  char* sa = sw + STAGES * Cfg::W_STAGE;
  // TMA: one mbarrier per stage, after the latent tile (an 8-byte aligned offset).
  [[maybe_unused]] const uint32_t bar0 = ac::smem_u32(sa + BM * d.rpad * int(sizeof(T)));
  [[maybe_unused]] const uint32_t sw_u32 = ac::smem_u32(sw);

  if constexpr (TMA) {
    if (tid == 0) {
      sm90::tma_prefetch_map(&wmap);
      for (int s = 0; s < STAGES; ++s) sm90::mbar_init(bar0 + 8u * uint32_t(s), 1);
      sm90::mbar_init_fence();  // before the copy engine may complete a transaction on the barriers
      sm90::fence_proxy_async();
      for (int s = 0; s < STAGES - 1 && s < ktiles; ++s)
        issue_w_tile_tma<T>(&wmap, n0, s, sw_u32, bar0, s);
    }
    // The other threads first touch the barriers after the __syncthreads of the first K step.
  } else {
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ktiles) issue_w_tile<T>(d, n0, s, sw + s * Cfg::W_STAGE);
      ac::cp_async_commit();
    }
  }

  // 1. Latent rows -> shared (normalized, weight dtype); k_pe of this CTA's heads.
  {
    const float scale = p.kv.k_scale_of(0);
    const int hs = (H + gridDim.y - 1) / gridDim.y;
    const int h0 = blockIdx.y * hs, h1 = min(H, h0 + hs);
    const T* nw = static_cast<const T*>(p.norm_weight);
    for (int r = warp; r < BM; r += NW) {
      const int64_t t = m0 + r;
      const C* row = locate_latent<C>(p, t);
      float x[2][8];
      float ss = 0.0f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c8 = lane + 32 * j;
        if (row != nullptr && c8 * 8 < R) {
          load_latent8(row + c8 * 8, d.row_vec != 0, scale, x[j]);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) x[j][i] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = fmaf(x[j][i], x[j][i], ss);
      }
      if (nw != nullptr) {
#pragma unroll
        for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float inv = 1.0f / sqrtf(ss / static_cast<float>(R) + p.norm_eps);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int c8 = lane + 32 * j;
          if (c8 * 8 >= R) continue;
#pragma unroll
          for (int i = 0; i < 8; ++i) x[j][i] = x[j][i] * inv * kc::to_float(nw[c8 * 8 + i]);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c8 = lane + 32 * j;
        if (c8 * 8 >= d.rpad) continue;
        if constexpr (sizeof(T) == 2) {
          *reinterpret_cast<uint4*>(sa + swz_rt(r, c8, cpr_a)) =
              make_uint4(ac::pack2<T>(x[j][0], x[j][1]), ac::pack2<T>(x[j][2], x[j][3]),
                         ac::pack2<T>(x[j][4], x[j][5]), ac::pack2<T>(x[j][6], x[j][7]));
        } else {
          *reinterpret_cast<float4*>(sa + swz_rt(r, 2 * c8, cpr_a)) =
              make_float4(x[j][0], x[j][1], x[j][2], x[j][3]);
          *reinterpret_cast<float4*>(sa + swz_rt(r, 2 * c8 + 1, cpr_a)) =
              make_float4(x[j][4], x[j][5], x[j][6], x[j][7]);
        }
      }
      if (t < p.num_tokens) {
        T* key = static_cast<T*>(p.key) + t * H * (dn + P) + dn;
        for (int i = lane; i < P; i += 32) {
          const T v = kc::from_float<T>(row != nullptr ? latent_to_float(row[R + i]) * scale : 0.0f);
          for (int h = h0; h < h1; ++h) key[int64_t(h) * (dn + P) + i] = v;
        }
      }
    }
  }

  // 2. K loop.
  const uint32_t sa_u32 = ac::smem_u32(sa);
  [[maybe_unused]] const int g = lane >> 2, t4 = lane & 3;
  [[maybe_unused]] const int wm = warp & 1, wn = warp >> 1;      // tensor cores: 2 x 2 warps
  [[maybe_unused]] const int tr = tid >> 4, tc = tid & 15;       // float32: 8 x 16 threads
  float acc[4][4][4];  // MMA: [m16 block (2)][n8 tile (4)][4]; SIMT: [row (4)][col (4)][0]
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

  for (int kt = 0; kt < ktiles; ++kt) {
    if constexpr (TMA) {
      // First pass: the barriers are initialized and the latent tile is complete. Every pass:
      // every warp is done reading tile kt - 1, whose stage ((kt - 1) % STAGES = nx % STAGES)
      // the copy below overwrites.
      __syncthreads();
      const int nx = kt + STAGES - 1;
      if (tid == 0 && nx < ktiles) issue_w_tile_tma<T>(&wmap, n0, nx, sw_u32, bar0, nx % STAGES);
      // Tile kt is completion number kt / STAGES of its stage's barrier (phases 0, 1, 0, ...).
      sm90::mbar_wait(bar0 + 8u * uint32_t(kt % STAGES), uint32_t(kt / STAGES) & 1u);
    } else {
      ac::cp_async_wait<STAGES - 2>();
      __syncthreads();  // W tile kt landed; the latent tile is complete (first pass)
      const int nx = kt + STAGES - 1;
      if (nx < ktiles) issue_w_tile<T>(d, n0, nx, sw + (nx % STAGES) * Cfg::W_STAGE);
      ac::cp_async_commit();
    }
    const char* ws = sw + (kt % STAGES) * Cfg::W_STAGE;
    if constexpr (Cfg::MMA) {
      const uint32_t ws_u32 = ac::smem_u32(ws);
#pragma unroll
      for (int kk = 0; kk < Cfg::BK / 16; ++kk) {
        uint32_t af[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
          ac::ldmatrix_x4(sa_u32 + swz_rt(wm * 32 + mi * 16 + (lane & 15), kt * 8 + 2 * kk + (lane >> 4), cpr_a),
                          af[mi]);
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
          uint32_t b[4];
          const int n = wn * 32 + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
          ac::ldmatrix_x4(ws_u32 + swz_rt(n, 2 * kk + ((lane >> 3) & 1), 8), b);
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            ac::mma_16816<T>(acc[mi][2 * nj], af[mi], b[0], b[1]);
            ac::mma_16816<T>(acc[mi][2 * nj + 1], af[mi], b[2], b[3]);
          }
        }
      }
    } else {
#pragma unroll
      for (int kc4 = 0; kc4 < Cfg::BK / 4; ++kc4) {
        float4 av[4], wv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          av[i] = *reinterpret_cast<const float4*>(sa + swz_rt(tr * 4 + i, kt * 8 + kc4, cpr_a));
#pragma unroll
        for (int j = 0; j < 4; ++j)
          wv[j] = *reinterpret_cast<const float4*>(ws + swz_rt(tc + 16 * j, kc4, 8));
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            float s = acc[i][j][0];
            s = fmaf(av[i].x, wv[j].x, s);
            s = fmaf(av[i].y, wv[j].y, s);
            s = fmaf(av[i].z, wv[j].z, s);
            s = fmaf(av[i].w, wv[j].w, s);
            acc[i][j][0] = s;
          }
      }
    }
  }

  // 3. Epilogue through shared memory, then key / value rows. TMA: every copy issued was waited
  // for in the K loop (tile kt at step kt), so nothing is still writing the W buffers.
  if constexpr (!TMA) ac::cp_async_wait<0>();
  __syncthreads();  // every warp is done with the W buffers
  float* sc = reinterpret_cast<float*>(sw);
  constexpr int CS = Cfg::C_STRIDE;
  if constexpr (Cfg::MMA) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int r = wm * 32 + mi * 16 + g, c = wn * 32 + ni * 8 + 2 * t4;
        *reinterpret_cast<float2*>(sc + r * CS + c) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
        *reinterpret_cast<float2*>(sc + (r + 8) * CS + c) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
      }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[(tr * 4 + i) * CS + tc + 16 * j] = acc[i][j][0];
  }
  __syncthreads();
  const int per_head = dn + dv, key_w = dn + P;
  T* key = static_cast<T*>(p.key);
  T* value = static_cast<T*>(p.value);
  for (int idx = tid; idx < BM * BN; idx += NT) {
    const int r = idx / BN, c = idx - r * BN;
    const int64_t t = m0 + r;
    const int n = n0 + c;
    if (t >= p.num_tokens || n >= d.n_total) continue;
    const int h = n / per_head, j = n - h * per_head;
    const T v = kc::from_float<T>(sc[r * CS + c]);
    if (j < dn) key[(t * H + h) * key_w + j] = v;
    else value[(t * H + h) * dv + (j - dn)] = v;
  }
}

}  // namespace kvkernels::mla_cuda
