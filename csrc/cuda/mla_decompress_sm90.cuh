// mla_decompress on Hopper (sm_90a), the "wgmma" kernel (opt-in: KVKERNELS_CUDA_DECOMPRESS=wgmma; the
// launcher, mla_decompress.cu, fails with the reason where it cannot run). The same GEMM
// C[T, N] = latent[T, R] x w_kv_b[N, R]^T and the same epilogue semantics as the persist kernel
// (mla_decompress_persist.cuh); what changes is the instruction set and the schedule. Compiled and
// emulated, not run on a GPU. csrc/cuda/README.md, "mla_decompress on wgmma (sm_90a)", has the
// shared-memory budget, ptxas numbers and the predictions for the first GPU run.
//
// Why: the persist kernel's mma.sync chain (ldmatrix + HMMA from 8 warps) reaches about a quarter of
// torch.matmul on an H200; Hopper's tensor cores are fed at full rate only by wgmma reading its operands
// from shared memory, with the copies issued by the copy engine (TMA) rather than by every thread.
//
// CTA = 3 warpgroups (384 threads), one CTA per SM, persistent: a static schedule gives CTA b the
// contiguous range [b total / grid, (b + 1) total / grid) of the output tiles, numbered token-tile
// major (tile = m * n_tiles + n: BM = 128 tokens x BN = 128 columns), so a CTA keeps one token tile's
// latent rows for a run of column tiles and re-stages them only when its range crosses into the next
// token tile (once or twice per CTA at T 32768 x 16 heads).
//   warpgroup 2, the producer (setmaxnreg.dec to 40 registers; one thread works): for each tile of the
//     range and each K-tile of 64 (one 128-byte swizzle row), waits for the ring stage's `empty`
//     mbarrier, then issues the stage's two 64 x 64 boxes of w_kv_b by TMA (the tile64 kernel's tensor
//     map, 128B swizzle, rows / columns past N / R zero-filled by the copy engine) completing on the
//     stage's `full` mbarrier (arrive.expect_tx of the 16 KiB). It runs ahead of the consumers across
//     tile boundaries, and through their latent staging: the ring is full when they return to it.
//   warpgroups 0 and 1, the consumers (setmaxnreg.inc to 232), "ping-pong": consumer i % 2 computes the
//     CTA's i-th tile, all 128 rows (two wgmma m64 row blocks: 128 fp32 accumulators per thread), so
//     one consumer's epilogue (rounding and scattering 128 x 128 outputs) runs while the other's wgmma
//     use the tensor cores. Tile i's K loop starts once tile i - 1's has waited for all of its stages
//     (named barriers BAR_TURN + consumer): besides the overlap this keeps the CTA's waits on the
//     `full` barriers in step order, which the parity waits need (a wait for a stage's use u + 1 issued
//     before use u completed would return at once). At each new token tile both consumers stage 64 of
//     its latent rows (stage_latent_rows: the persist kernel's gather, fp8 dequantization, RMSNorm and
//     rounding, element for element) into the 128B-swizzle canonical K-major layout, with the k_pe
//     copies of the heads whose first column lies in this CTA's column tiles of the token tile (each
//     head's k_pe written by exactly one CTA), between two named barriers of the 256 consumer threads.
//     Per K-tile: wait for `full`, 8 wgmma m64n128k16 (A = latent rows, B = weight rows, both K-major
//     from shared memory), commit, wait for all but the newest group (one group in flight while the
//     next stage's wait and issue run), and arrive on the `empty` barrier (count 128) of the stage the
//     completed group read. After the last K-tile: wait for all, round the fp32 accumulators once to
//     the weight dtype and store them from registers into key / value (the persist kernel's scatter).
// Shared memory (1024-byte aligned at run time): latent [rpad / 64][128 rows][128 B] (16-byte chunk c
// of row r at (c ^ (r % 8)) * 16: the 128B-swizzle atom of 8 rows x 128 bytes, SBO 1024), then
// `stages` ring buffers of 128 weight rows x 128 bytes (the same layout: the copy engine's 128B
// swizzle on a 1024-byte aligned box), then the mbarriers.
// Per output element the products and the k order (16 at a time, ascending, one fp32 chain) are the
// persist kernel's; on the emulator the results are the same bits (tested); on a GPU wgmma's internal
// summation order may differ from mma.sync's within a k16 step (the emulator cannot show this).
#pragma once

#include <atomic>

#include "mla_decompress_persist.cuh"
#include "sm90_ptx.cuh"

namespace kvkernels::mla_cuda {

struct Sm90DecCfg {
  static constexpr int WG_ROWS = 64;  // wgmma m64; each consumer warpgroup stages this many latent rows
  static constexpr int CONSUMERS = 2;
  static constexpr int BM = WG_ROWS * CONSUMERS;  // tokens per tile
  static constexpr int BN = 128;                  // columns per tile (wgmma n128: 64 fp32 per row block)
  static constexpr int BK = 64;                   // k per ring stage: one 128-byte swizzle row
  static constexpr int NT = 128 * (CONSUMERS + 1);
  static constexpr int BOX_ROWS = 64;             // rows of the tile64 kernel's TMA box (DecCfg<T>::BN)
  static constexpr int W_STAGE = BN * BK * 2;     // 16 KiB: two boxes
  static constexpr int MIN_STAGES = 2, MAX_STAGES = 6;
  static constexpr int ROW_BLOCKS = BM / WG_ROWS;  // m64 row blocks per consumer tile (all of its rows)
  static constexpr int BAR_STAGE = 1, BAR_TURN = 2;  // named barriers: latent staged; consumer wg's turn (+ wg)
  static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= 65536, "setmaxnreg pool");
  // + 1024: the run-time alignment of the base; 2 mbarriers per stage.
  static int smem(int rpad, int stages) { return 1024 + BM * rpad * 2 + stages * W_STAGE + 16 * stages; }
};

// Byte offset of 16-byte chunk c8 of latent row `row` (0..BM-1) in the [rpad / 64][BM][128 B] tile.
struct Sm90LatentLayout {
  int row0;  // the warpgroup's first row
  __device__ __forceinline__ int operator()(int r, int c8) const {
    const int row = row0 + r;
    return (c8 >> 3) * Sm90DecCfg::BM * 128 + row * 128 + (((c8 & 7) ^ (row & 7)) << 4);
  }
};

template <typename T, typename C>
__global__ void __launch_bounds__(Sm90DecCfg::NT, 1)
    mla_decompress_sm90_kernel(const __grid_constant__ DecompressArgs d,
                               const __grid_constant__ CUtensorMap wmap) {
#if KVK_SM90_PTX || defined(KVKERNELS_CUDA_EMU)
  static_assert(sizeof(T) == 2, "wgmma: fp16 / bf16 weights");
  using Cfg = Sm90DecCfg;
  namespace s9 = ::kvkernels::sm90;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // Static shared memory marks the kernel as the sm_90a build's (sm90_decompress_compiled: the stub
  // compiled for other architectures has none).
  __shared__ int sm90_marker;
  const MlaDecompressParams& p = d.p;
  const int tid = threadIdx.x, wg = tid / 128;
  const uint32_t raw = ac::smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  char* const smem = reinterpret_cast<char*>(smem_raw) + (base - raw);
  const int S = d.stages, ktiles = d.rpad / BK;
  const uint32_t sA = base;
  const uint32_t sW0 = base + uint32_t(BM * d.rpad * 2);  // a multiple of 16 KiB past the base
  auto sW = [&](int s) { return sW0 + uint32_t(s * Cfg::W_STAGE); };
  auto full = [&](int s) { return sW0 + uint32_t(S * Cfg::W_STAGE + 8 * s); };
  auto empty = [&](int s) { return sW0 + uint32_t(S * Cfg::W_STAGE + 8 * (S + s)); };

  // The static schedule: this CTA's range of tiles (token-tile major).
  // 32-bit tile and step numbers (the launcher checks that tiles x K-tiles fit): fewer registers in the
  // consumers, whose 128 accumulators leave little room.
  const int n_tiles = d.n_tiles;
  const int64_t total = (p.num_tokens + BM - 1) / BM * n_tiles;
  const int t_begin = int(total * blockIdx.x / gridDim.x), t_end = int(total * (blockIdx.x + 1) / gridDim.x);

  if (tid == 0) {
    *static_cast<volatile int*>(&sm90_marker) = 1;
    for (int s = 0; s < S; ++s) {
      s9::mbar_init(full(s), 1);                      // the producer's arrive.expect_tx
      s9::mbar_init(empty(s), 128);  // every thread of the consumer that read the stage, once its wgmma completed
    }
    s9::mbar_init_fence();
  }
  __syncthreads();

  if (wg == Cfg::CONSUMERS) {
    // ---- producer: w_kv_b K-tiles -> the ring, by TMA --------------------------------------------
    s9::setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    if (tid == 128 * Cfg::CONSUMERS) {
      s9::tma_prefetch_map(&wmap);
      int step = 0;  // K-tiles issued: stage step % S, that stage's use step / S
      for (int t = t_begin; t < t_end; ++t) {
        const int n0 = int(t % n_tiles) * BN;
        for (int kt = 0; kt < ktiles; ++kt, ++step) {
          const int s = step % S;
          const int use = step / S;
          // Use u of a stage follows the consumers' release of use u - 1 (completion u - 1 of `empty`).
          if (use > 0) s9::mbar_wait(empty(s), uint32_t(use - 1) & 1u);
          s9::mbar_arrive_expect_tx(full(s), Cfg::W_STAGE);  // both boxes, zero-filled parts included
          s9::tma_load_2d(sW(s), &wmap, kt * BK, n0, full(s));
          s9::tma_load_2d(sW(s) + uint32_t(Cfg::W_STAGE / 2), &wmap, kt * BK, n0 + Cfg::BOX_ROWS, full(s));
        }
      }
    }
    return;  // the copies complete on the barriers; the consumers wait for every one of them
  }

  // ---- consumers ----------------------------------------------------------------------------------
  s9::setmaxnreg_inc<Cfg::CONSUMER_REGS>();
  const int wt = tid % 128, lane = tid & 31, wq = wt >> 5, g = lane >> 2, t4 = lane & 3;
  const int H = p.num_heads, per_head = p.qk_nope_head_dim + p.v_head_dim;
  // A: row block b (64 rows) of column block 0 (K-major, 128B swizzle: 8-row groups SBO = 1024 apart,
  // LBO unused); column block kb is kb * BM * 128 bytes further on, k16 step kk 32 bytes.
  const uint64_t da0 = s9::make_desc(sA, 16, 1024, s9::Swizzle::k128B);
  int m_cur = -1;
  // Every consumer walks the whole range (both must stage each token tile) and computes the tiles of
  // its parity: local tile i belongs to consumer i % 2.
  for (int t = t_begin; t < t_end; ++t) {
    const int m = t / n_tiles, i = t - t_begin, n = t % n_tiles;
    if (m != m_cur) {
      // New token tile: each consumer stages 64 of its rows. Both consumers have completed every wgmma
      // on the old rows (their last tile's wgmma_wait<0>) before either overwrites them.
      if (m_cur >= 0) s9::named_bar_sync(Cfg::BAR_STAGE, 256);
      // k_pe of the heads whose first column lies in one of this CTA's column tiles of token tile m
      // ([n, n_last)): the column tiles partition the heads, the CTAs' ranges the column tiles.
      const int64_t n_last = t_end - m * n_tiles < n_tiles ? t_end - m * n_tiles : n_tiles;  // no overflow: <= total
      const int64_t hb = (int64_t(n) * BN + per_head - 1) / per_head, he = (n_last * BN + per_head - 1) / per_head;
      const int h0 = hb < H ? int(hb) : H, h1 = he < H ? int(he) : H;
      stage_latent_rows<T, C, Cfg::WG_ROWS, 4>(d, smem, int64_t(m) * BM + wg * Cfg::WG_ROWS, h0, h1, wq,
                                               Sm90LatentLayout{wg * Cfg::WG_ROWS});
      s9::fence_proxy_async();  // the generic-proxy stores, before wgmma (async proxy) reads them
      s9::named_bar_sync(Cfg::BAR_STAGE, 256);
      m_cur = m;
    }
    if (i % 2 != wg) continue;

    // Ping-pong: tile i's K loop starts once tile i - 1's (the other consumer's) has waited for all its
    // stages; so the other consumer's epilogue runs under this one's wgmma, and the `full` waits of
    // the CTA happen in step order (a parity wait for a stage's next use never precedes the
    // completion of its previous use).
    if (i > 0) s9::named_bar_sync(Cfg::BAR_TURN + wg, 256);
    // The accumulators are this tile's alone, zeros (the first wgmma's scale-d 0 ignores them): so they
    // are dead outside the tile and take no registers during the latent staging (declared for the whole
    // loop, the wgmma's "+f" operands kept all 128 live through it: ptxas spilled 60 bytes).
    float acc[Cfg::ROW_BLOCKS][BN / 2];
#pragma unroll
    for (int b = 0; b < Cfg::ROW_BLOCKS; ++b) {
#pragma unroll
      for (int v = 0; v < BN / 2; ++v) acc[b][v] = 0.0f;
      s9::fence_regs(acc[b]);
    }
    const int step0 = i * ktiles;  // the producer's step numbering
    for (int kt = 0; kt < ktiles; ++kt) {
      const int step = step0 + kt, s = step % S;
      s9::mbar_wait(full(s), uint32_t(step / S) & 1u);
      const uint64_t db = s9::make_desc(sW(s), 16, 1024, s9::Swizzle::k128B);
      s9::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
        for (int b = 0; b < Cfg::ROW_BLOCKS; ++b)
          s9::wgmma_ss<BN, T, 0, 0>(acc[b], s9::desc_add(da0, uint32_t(kt * BM * 128 + b * Cfg::WG_ROWS * 128 + kk * 32)),
                                    s9::desc_add(db, uint32_t(kk * 32)), (kt > 0 || kk > 0) ? 1 : 0);
      s9::wgmma_commit();
      // The group of K-tile kt - 1 has completed: its stage may be refilled.
      s9::wgmma_wait<1>();
      if (kt > 0) s9::mbar_arrive(empty((step - 1) % S));
    }
    if (i + 1 < t_end - t_begin) s9::named_bar_arrive(Cfg::BAR_TURN + (1 - wg), 256);  // the other's turn
    s9::wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < Cfg::ROW_BLOCKS; ++b) s9::fence_regs(acc[b]);
    s9::mbar_arrive(empty((step0 + ktiles - 1) % S));

    // Epilogue: acc[b][4 j + 2 h + e] is row 64 b + 16 wq + g + 8 h of the tile, column 8 j + 2 t4 + e;
    // rounded once to the weight dtype and scattered into key / value (persist's rules).
    const int64_t tok0 = int64_t(m) * BM + 16 * wq + g;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int c = n * BN + 8 * j + 2 * t4;
      if (c >= d.n_total) continue;
      const OutCol<T> o0 = out_col<T>(p, c);
      OutCol<T> o1;
      if (!d.pair_out && c + 1 < d.n_total) o1 = out_col<T>(p, c + 1);
#pragma unroll
      for (int b = 0; b < Cfg::ROW_BLOCKS; ++b)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t tok = tok0 + b * Cfg::WG_ROWS + 8 * h;
          if (tok >= p.num_tokens) continue;
          const float x = acc[b][4 * j + 2 * h], y = acc[b][4 * j + 2 * h + 1];
          if (d.pair_out) {
            *reinterpret_cast<uint32_t*>(o0.base + tok * o0.stride + o0.off) = ac::pack2<T>(x, y);
          } else {
            o0.base[tok * o0.stride + o0.off] = kc::from_float<T>(x);
            if (o1.base != nullptr) o1.base[tok * o1.stride + o1.off] = kc::from_float<T>(y);
          }
        }
    }
  }
#else
  (void)d, (void)wmap;
#endif
}

// Whether this build has the kernel's sm_90a code (its static shared memory: the stub compiled for
// other architectures has none). The emulator: KVKERNELS_EMU_PTX_VERSION below 90 models a build
// without sm_90a code. Asked on a 9.x device only, cached per process.
template <typename T, typename C>
bool sm90_decompress_compiled() {
  auto ask = [] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, mla_decompress_sm90_kernel<T, C>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
#if defined(KVKERNELS_CUDA_EMU)
    return attr.ptxVersion >= 90;
#else
    return attr.sharedSizeBytes >= sizeof(int);
#endif
  };
#if defined(KVKERNELS_CUDA_EMU)
  return ask();  // per call: the tests change KVKERNELS_EMU_PTX_VERSION between calls
#else
  static const bool compiled = ask();
  return compiled;
#endif
}

// One launch: `grid` persistent CTAs (at most one per SM: __launch_bounds__(384, 1), ~200 KiB of shared
// memory), d.stages ring stages, d.n_tiles column tiles.
template <typename T, typename C>
cudaError_t launch_sm90_decompress(const DecompressArgs& d, const CUtensorMap& wmap, unsigned grid, int smem,
                                   cudaStream_t stream) {
  static std::atomic<int> configured[64] = {};
  const cudaError_t err = raise_smem_limit(mla_decompress_sm90_kernel<T, C>, configured, smem);
  if (err != cudaSuccess) return err;
  mla_decompress_sm90_kernel<T, C><<<grid, Sm90DecCfg::NT, smem, stream>>>(d, wmap);
  return cudaGetLastError();
}

// The instances live in mla_decompress_sm90_{f16,bf16}.cu (compiled for sm_90a alone by
// scripts/check_cuda.sh; a stub elsewhere): the launcher (mla_decompress.cu) includes this header for the
// declarations and the configuration only.
#ifndef KVK_DECOMPRESS_SM90_INSTANCES
#define KVK_DECOMPRESS_SM90_EXTERN(T, C)                                                               \
  extern template bool sm90_decompress_compiled<T, C>();                                                \
  extern template cudaError_t launch_sm90_decompress<T, C>(const DecompressArgs&, const CUtensorMap&, \
                                                           unsigned, int, cudaStream_t);
KVK_DECOMPRESS_SM90_EXTERN(__half, __half)
KVK_DECOMPRESS_SM90_EXTERN(__half, kc::fp8_e4m3)
KVK_DECOMPRESS_SM90_EXTERN(__half, kc::fp8_e5m2)
KVK_DECOMPRESS_SM90_EXTERN(__nv_bfloat16, __nv_bfloat16)
KVK_DECOMPRESS_SM90_EXTERN(__nv_bfloat16, kc::fp8_e4m3)
KVK_DECOMPRESS_SM90_EXTERN(__nv_bfloat16, kc::fp8_e5m2)
#undef KVK_DECOMPRESS_SM90_EXTERN
#endif

}  // namespace kvkernels::mla_cuda
