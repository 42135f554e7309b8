// Hopper (sm_90a) MLA decode and varlen prefill on wgmma, warp-specialized (MlaPath::kWgmma; opt-in:
// KVKERNELS_CUDA_MLA_PATH=wgmma; csrc/cuda/README.md, section "MLA decode on wgmma").
//
// The absorbed decode of mla_attention_mma.cuh (q [T, H, R + P] over latent rows [R + P], V = the
// first R columns of the same row, all heads sharing it) with FlashMLA's CTA shape: 64 rows (the heads
// of one decode token; H > 64 takes several head chunks), 64-key tiles, 3 warpgroups (384 threads):
//   warpgroup 2, the producer (setmaxnreg.dec to 48 registers): fills a ring of `stages` 16-bit latent
//     tiles. 16-bit caches: cp.async gathers (one block-table lookup per row, so every block size
//     works; keys outside [w.lo, w.hi], out-of-range block ids and bytes past the row zero-filled),
//     completing the stage's `full` mbarrier through cp.async.mbarrier.arrive.noinc (count 128); with a
//     tensor map (block size 64, pages contiguous: mla_attention.cu), a tile that is one whole, fully
//     visible page is instead dp / 64 TMA boxes issued by one thread (arrive.expect_tx of the tile). fp8
//     caches: cp.async of the raw bytes into the top half of the stage itself, converted in place one
//     tile behind (so the next tile's copies fly meanwhile) into the 16-bit tile with the exact conversion
//     of mla_attention_mma.cuh (values in units of fp8_unit), then fence.proxy.async and a plain arrival:
//     the consumers see one tile format, and no separate fp8 buffer is needed (it would not fit beside two
//     72-KiB stages at R + P = 576). Rows that are not 16-byte aligned (a rare view) are loaded element
//     by element through registers instead. Before refilling a stage the producer waits
//     for the stage's `empty` mbarrier (count 256: every consumer thread, after its P V product).
//   warpgroups 0 and 1, the consumers (setmaxnreg.inc to 224): warpgroup c owns output columns
//     [256 c, 256 c + 256) of all 64 rows (2 x 64 fp32 accumulators of m64n128) and computes the logits
//     of keys [32 c, 32 c + 32) of each tile: S_c = Q K_c^T as ceil((R + P) / 16) wgmma m64n32k16 (A = Q,
//     B = the key rows, both K-major from shared memory). The two halves of the row maximum meet in
//     shared memory (named barrier 1), each consumer writes its half of P (rounded to the q dtype) into
//     a shared 64 x 64 tile (named barrier 2), and O_c = alpha O_c + P V_c runs as 4 k16 steps x 2
//     wgmma m64n128k16 with A = P (K-major) and B = V (N-major, the same tile bytes). The row sums
//     stay per consumer (each over its own keys, with the same maxima) and are added at the end.
//     Splitting S by keys instead of computing all 64 keys in both consumers saves half of the Q K^T
//     product (at R + P = 576 it is 53% of the MACs) for two named barriers per tile.
//     SEESAW (KVKERNELS_CUDA_MLA_PATH=wgmma-seesaw, opt-in): the row maximum as a chain (consumer 0's keys,
//     then consumer 1's) and the two barriers as one-way signals, so that one consumer's softmax runs
//     while the other's (or its own) P V occupies the tensor cores; P V in two k32 halves (the consumer
//     loop below; csrc/cuda/README.md, "MLA decode on wgmma", seesaw).
// Tiles (Q, the latent stages) are [DP / 64 column blocks][rows][128 bytes], 16-byte chunk c of row r
// at (c ^ (r % 8)) * 16: the 128B-swizzle canonical layout (as attention_sm90.cuh), base aligned to
// 1024 bytes at run time. DP = R + P rounded up to 64, and at least R rounded up to 128 (the P V
// n128 blocks read whole 128-column slices of the tile).
//
// Semantics are mla_attention_mma.cuh's: scale, kv_scale (fp8), causal (keys up to each row's position, masked
// per row in S before the softmax), empty sequences and rows before a sequence's first key (out 0, lse -inf),
// KV splits with float32 partials merged by mla_merge.cuh. Decode and varlen prefill (query_start_loc: a CTA
// holds 64 / H tokens x H heads, make_work's query tiles; tiles past the last row's position are never
// loaded). In decode, and in prefill at H >= 64, all rows of a CTA see the same keys, so a NaN / inf latent
// value reaches exactly the rows that see it; with several tokens per CTA the tiles past the first row's
// position take the non-finite fix-up (fix_nonfinite below). Float32 q and other devices stay on the mma.sync /
// SIMT kernels (mla_attention.cu, mla_wgmma_unsupported).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <atomic>
#include <cstring>

#include "mla_common.cuh"
#include "mla_sched.cuh"
#include "sm90_ptx.cuh"

namespace kvkernels::mla_cuda {

// Geometry (kSm90KeyTile, kSm90Rows, mla_sm90_dp, mla_sm90_smem): mla_common.cuh, shared with the planner.

// Byte offset of 16-byte chunk c of row r in a [DP / 64][ROWS][128 B] swizzled tile.
__device__ __forceinline__ uint32_t sm90_off(int rows, int r, int c) {
  return uint32_t((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// `map`: with `tma`, the 2-D tensor map of the latent cache as [num_blocks x 64 rows, R + P columns] (block size
// 64, pages contiguous), boxes of 64 x 64 with the 128B swizzle (mla_attention.cu, encode_latent_map).
// SEESAW: the consumers' schedule (KVKERNELS_CUDA_MLA_PATH=wgmma-seesaw; the consumer loop below).
template <typename T, CacheFormat CF, bool SEESAW>
__global__ void __launch_bounds__(kSm90Threads, 1)
    mla_sm90_kernel(const __grid_constant__ MlaArgs m, const __grid_constant__ CUtensorMap map, int tma) {
#if KVK_SM90_PTX || defined(KVKERNELS_CUDA_EMU)
  namespace s9 = ::kvkernels::sm90;
  constexpr bool FP8 = CF == CacheFormat::kFp8E4M3 || CF == CacheFormat::kFp8E5M2;
  constexpr int KT = kSm90KeyTile, ROWS = kSm90Rows;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // Static shared memory marks the sm_90a build's kernel (mla_sm90_compiled: the stub has none).
  __shared__ int built_marker[4];

  const ac::AttnArgs& a = m.a;
  const AttentionParams& p = a.p;
  const int tid = threadIdx.x, wg = tid / 128;
  const int dp = m.dp, stages = m.stages, cpr = dp / 8;
  const Sm90Smem L = mla_sm90_smem(dp, stages);
  const uint32_t raw = ac::smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const uint32_t sQ = base + uint32_t(L.q_off), sP = base + uint32_t(L.p_off);
  auto sK = [&](int s) { return base + uint32_t(L.stage_off + s * L.tile_bytes); };
  auto full = [&](int s) { return base + uint32_t(L.bar_off + 8 * s); };
  auto empty = [&](int s) { return base + uint32_t(L.bar_off + 8 * (stages + s)); };
  float* const s_max = reinterpret_cast<float*>(smem + L.max_off);  // [2][64]
  float* const s_sum = reinterpret_cast<float*>(smem + L.sum_off);  // [2][64]

  if (tid == 0) {
    built_marker[0] = 1;
    for (int s = 0; s < stages; ++s) {
      s9::mbar_init(full(s), 128);
      s9::mbar_init(empty(s), 256);
    }
    s9::mbar_init_fence();
  }
  __syncthreads();
  // Launched by programmatic dependent launch after the metadata pass (mla_sched.cuh), the CTA may have started
  // before the pass finished: everything above overlapped it, its output is read only after this wait. (A no-op
  // in a grid launched without the attribute.)
  s9::griddep_wait();
  // The CTA's pieces of work (one under the shape-only plan; a range of sequences under the metadata plan). The
  // ring's stage and phase carry over from piece to piece: `done` counts the tiles of the earlier pieces.
  MlaWalk walk;
  ac::Work w;
  int done = 0;

  if (wg == 2) {
    // ---- producer: latent rows of each key tile -> the stage ring ------------------------------
    s9::setmaxnreg_dec<kSm90ProducerRegs>();
    const paged_kv_t& kv = p.kv;
    const int pt = tid - 256, warp = pt >> 5, lane = pt & 31;
    constexpr int ESZ = FP8 ? 1 : 2;
    const int row_bytes = kv.head_dim * ESZ;
    const int chunks = FP8 ? dp / 16 : cpr;  // 16-byte source chunks per row
    // cp.async straight into the tile: 16-bit rows with 16-byte aligned chunks (uniform per launch)
    const bool direct = !FP8 && a.kv_aligned;
    // fp8 rows with 16-byte aligned chunks: cp.async of the raw bytes into the top of the stage, converted
    // in place one tile behind (staged); otherwise loads through registers (unaligned rows, a rare view).
    const bool staged = FP8 && a.kv_aligned;
    const char* const cache = static_cast<const char*>(kv.k);
    const uint64_t sb = uint64_t(kv.k_stride_block) * ESZ, ss = uint64_t(kv.k_stride_slot) * ESZ;
    const uint32_t nblk = ac::block_id_limit(kv);
    // The staged fp8 layout: raw block b (fp8 columns [128 b, 128 b + 128): 64 rows x 128 bytes, plain) at
    // raw_off + b * KT * 128 of the stage, the nb blocks ending where the stage ends. Block b converts into
    // 16-bit column blocks 2 b and 2 b + 1 ([16 KiB b, 16 KiB b + 16 KiB) of the stage), which overlap only
    // raw blocks <= b (raw_off >= 8 KiB (nb - 1)): converted in order, each block read into registers
    // before any thread writes (named barrier 4), nothing is overwritten before it is read.
    const int nb = (dp + 127) / 128;
    const uint32_t raw_off = uint32_t(L.tile_bytes - nb * KT * 128);
    auto convert = [&](int t) {  // tile t's raw bytes (landed) -> its 16-bit tile; then `full`
      const int s = t % stages;
      unsigned char* const tile = smem + (sK(s) - base);
      s9::named_bar_sync(4, 128);  // every producer thread's copies of the tile have landed
      for (int b = 0; b < nb; ++b) {
        const unsigned char* const raw = tile + raw_off + b * KT * 128;
        uint4 u[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) u[k] = *reinterpret_cast<const uint4*>(raw + (pt + 128 * k) * 16);
        s9::named_bar_sync(4, 128);  // block b read by all before its 16-bit columns are written
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int idx = pt + 128 * k, r = idx >> 3, c16 = 16 * b + 2 * (idx & 7);
          if (c16 >= cpr) continue;  // the half block past dp (dp / 64 odd)
          const uint32_t wd[4] = {u[k].x, u[k].y, u[k].z, u[k].w};
          uint32_t h[8];
#pragma unroll
          for (int j = 0; j < 4; ++j) ac::fp8x4_to_pairs<T, CF>(wd[j], &h[2 * j], &h[2 * j + 1]);
          *reinterpret_cast<uint4*>(tile + sm90_off(KT, r, c16)) = make_uint4(h[0], h[1], h[2], h[3]);
          *reinterpret_cast<uint4*>(tile + sm90_off(KT, r, c16 + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
        }
      }
      s9::fence_proxy_async();  // the generic-proxy stores, before the consumers' wgmma reads
      s9::mbar_arrive(full(s));
    };
    while (next_piece<KT>(m, walk, w)) {
      const int32_t* bt = kv.block_tables + int64_t(w.seq) * kv.max_blocks_per_seq;
      const int ntiles = w.tile_end - w.tile_begin;
      for (int ti = 0; ti < ntiles; ++ti) {
        const int it = done + ti;  // the tile's place in the ring's sequence
        const int s = it % stages, use = it / stages;
        const int k0 = (w.tile_begin + ti) * KT;
        // Lane i < 16 looks up the block of row warp + 4 i (a warp copies rows warp, warp + 4, ..).
        int my_id = -1;
        {
          const int key = k0 + warp + 4 * lane;
          if (lane < KT / 4 && key >= w.lo && key <= w.hi)
            my_id = __ldg(bt + (a.bs_shift >= 0 ? key >> a.bs_shift : key / kv.block_size));
        }
        if (use > 0) s9::mbar_wait(empty(s), uint32_t(use - 1) & 1u);
        const uint32_t dst = sK(s);
        // TMA: a tile that is one whole page (block size 64), every key visible, its block id valid: one
        // thread loads its dp / 64 boxes (columns past R + P zero-filled by the engine), the others arrive.
        // Partial or masked tiles take the gathers below (they zero-fill keys that must not be read).
        if (!FP8 && tma && k0 >= w.lo && k0 + KT - 1 <= w.hi) {
          const int id0 = __shfl_sync(0xffffffffu, my_id, 0);  // rows warp, warp + 4, ..: one page, one id
          if (ac::block_id_ok(id0, nblk)) {
            if (pt == 0) {
              s9::mbar_arrive_expect_tx(full(s), uint32_t(L.tile_bytes));
              for (int j = 0; j < dp / 64; ++j)
                s9::tma_load_2d(dst + uint32_t(j * KT * 128), &map, 64 * j, id0 * KT, full(s));
            } else {
              s9::mbar_arrive(full(s));
            }
            continue;
          }
        }
#pragma unroll 2
        for (int i = 0; i < KT / 4; ++i) {
          const int r = warp + 4 * i, key = k0 + r;
          const int id = __shfl_sync(0xffffffffu, my_id, i);
          const bool ok = ac::block_id_ok(id, nblk);
          const int slot = !ok ? 0 : a.bs_shift >= 0 ? key & ((1 << a.bs_shift) - 1) : key % kv.block_size;
          const char* row = cache + (ok ? uint64_t(uint32_t(id)) * sb + uint64_t(slot) * ss : 0);
          for (int c = lane; c < chunks; c += 32) {
            const int b = ok ? row_bytes - c * 16 : 0;
            const int bytes = b < 0 ? 0 : (b > 16 ? 16 : b);
            const char* src = bytes > 0 ? row + c * 16 : cache;
            if (direct) {
              ac::cp_async16_at(dst + sm90_off(KT, r, c), src, bytes);
              continue;
            }
            if (staged) {  // raw chunk c of row r: block c / 8, chunk c % 8 of the row's 128 bytes there
              ac::cp_async16_at(dst + raw_off + uint32_t((c >> 3) * KT * 128 + r * 128 + (c & 7) * 16), src, bytes);
              continue;
            }
            // Through registers: element loads (rows not 16-byte aligned), fp8 converted.
            using Loader = ac::TileLoader<1, 1, 1, ESZ>;
            uint32_t wd[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) wd[j] = Loader::word_at(src, 4 * j, bytes);
            unsigned char* d = smem + (dst - base);
            if constexpr (FP8) {
              uint32_t h[8];
#pragma unroll
              for (int j = 0; j < 4; ++j) ac::fp8x4_to_pairs<T, CF>(wd[j], &h[2 * j], &h[2 * j + 1]);
              *reinterpret_cast<uint4*>(d + sm90_off(KT, r, 2 * c)) = make_uint4(h[0], h[1], h[2], h[3]);
              *reinterpret_cast<uint4*>(d + sm90_off(KT, r, 2 * c + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
            } else {
              *reinterpret_cast<uint4*>(d + sm90_off(KT, r, c)) = make_uint4(wd[0], wd[1], wd[2], wd[3]);
            }
          }
        }
        if (direct) {
          s9::cp_async_mbar_arrive(full(s));
        } else if (staged) {
          // The copies of this tile fly while the previous tile is converted (its group: all but the newest).
          ac::cp_async_commit();
          if (it > 0) {
            ac::cp_async_wait<1>();
            convert(it - 1);
          }
        } else {
          s9::fence_proxy_async();  // the generic-proxy stores, before the consumers' wgmma reads
          s9::mbar_arrive(full(s));
        }
      }
      done += ntiles;
    }
    if (staged && done > 0) {
      ac::cp_async_wait<0>();
      convert(done - 1);
    }
    ac::cp_async_commit();  // every copy complete (and so every arrival made) before the thread exits
    ac::cp_async_wait<0>();
    // Every load issued: the merge after this grid (programmatic dependent launch) may be scheduled; it waits
    // for this grid's completion before reading the partials.
    s9::griddep_launch_dependents();
    return;
  }

  // ---- consumers --------------------------------------------------------------------------------
  s9::setmaxnreg_inc<kSm90ConsumerRegs>();
  while (next_piece<KT>(m, walk, w)) {
    // Everything the piece needs is derived afresh in each piece from `z`, a zero the compiler cannot see
    // through: values kept from one piece to the next would stay live through the epilogue beside the 128
    // accumulators, and ptxas spilled them (the metadata plan runs several pieces per CTA).
    const int z = opaque_zero();
    const int tid = int(threadIdx.x) + z, wg = tid / 128;
    const int dp = m.dp + z, stages = m.stages + z, cpr = dp / 8;
    const Sm90Smem L = mla_sm90_smem(dp, stages);
    const uint32_t base = ((raw + 1023u) & ~1023u) + uint32_t(z);
    unsigned char* const smem = smem_raw + (base - raw);
    const uint32_t sQ = base + uint32_t(L.q_off), sP = base + uint32_t(L.p_off);
    auto sK = [&](int s) { return base + uint32_t(L.stage_off + s * L.tile_bytes); };
    auto full = [&](int s) { return base + uint32_t(L.bar_off + 8 * s); };
    auto empty = [&](int s) { return base + uint32_t(L.bar_off + 8 * (stages + s)); };
    float* const s_max = reinterpret_cast<float*>(smem + L.max_off);  // [2][64]
    float* const s_sum = reinterpret_cast<float*>(smem + L.sum_off);  // [2][64]
    const int wt = tid % 128, lane = tid & 31, wq = wt >> 5, g = lane >> 2, t4 = lane & 3;
    const int D = p.kv.head_dim, R = p.kv.head_dim_v;

    constexpr float unit = FP8 ? ac::fp8_unit<CF>() : 1.0f;
    const float qk_mul2 = p.scale * p.kv.k_scale_of(0) * unit * ac::kLog2e;  // logits in log2 units
    const float v_mul = p.kv.k_scale_of(0) * unit;  // V is the same bytes as K: the same scale
    int pos[2];  // this thread's rows' positions (the accumulator layout: rows 16 wq + g + 8 h of the 64)
    float o0[64], o1[64];  // columns 256 wg + [0, 128) and + [128, 256)
    // The 128-column slices of V this consumer multiplies: column blocks 4 wg and 4 wg + 2 of the tile.
    // A slice past R (R < 512) is never stored; its wgmma still runs, on the first two column blocks of the
    // Q tile (as 64 x 128 bytes per block, the layout of a V slice), because a wgmma under a
    // warpgroup-dependent branch makes ptxas serialize every wgmma of the kernel (C7520). (Q, not a block of
    // the key tile: Q does not change during the piece, while the other consumer's non-finite fix-up may be
    // zeroing the tile's columns under it.)
    const bool v_real0 = 256 * wg < R, v_real1 = 256 * wg + 128 < R;
    float m_run[2], d_run[2];
    const int ksteps = (D + 15) / 16;
    const uint64_t dq0 = s9::make_desc(sQ, 16, 1024, s9::Swizzle::k128B);
    const uint64_t dp0 = s9::make_desc(sP, 16, 1024, s9::Swizzle::k128B);

    float sacc[16];  // S_c of the tile in hand: sacc[4 i + 2 h + e] is row 16 wq + g + 8 h, key 32 wg + 8 i + 2 t4 + e
    // S_c = Q K_c^T of tile `it` (its place in the ring's sequence, across pieces): 64 rows x this consumer's
    // 32 keys (rows 32 wg .. of the tile: 4 whole 8-row groups), issued and committed as one group, not waited
    // for. (No register fence on sacc inside: the
    // seesaw issues it behind a P V in flight, where a fence would make ptxas serialize the wgmma, C7515; the
    // wgmma's own register operands order it after the softmax's last use of sacc.)
    auto issue_s = [&](int it) {
      const int s = it % stages;
      s9::mbar_wait(full(s), uint32_t(it / stages) & 1u);
      s9::fence_proxy_async();
      const uint64_t dk0 = s9::make_desc(sK(s) + uint32_t(32 * wg * 128), 16, 1024, s9::Swizzle::k128B);
      s9::wgmma_fence();
      for (int kk = 0; kk < ksteps; ++kk) {
        // k16 step kk: column block kk / 4 (rows x 128 bytes further on), 32 bytes per step inside it
        s9::wgmma_ss_n32<T, 0, 0>(sacc, s9::desc_add(dq0, uint32_t((kk >> 2) * ROWS * 128 + (kk & 3) * 32)),
                                  s9::desc_add(dk0, uint32_t((kk >> 2) * KT * 128 + (kk & 3) * 32)), kk > 0 ? 1 : 0);
      }
      s9::wgmma_commit();
    };
    // Logits in log2 units, keys past the token's position masked; mx: this thread's rows' maxima over the
    // consumer's 32 keys (the quad's).
    auto logits = [&](int k0, float (&mx)[2]) {
      mx[0] = mx[1] = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + 32 * wg + 8 * i + 2 * t4 + (e & 1);
          const float x = key <= pos[e >> 1] ? sacc[4 * i + e] * qk_mul2 : -INFINITY;
          sacc[4 * i + e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      }
    };
    // The weights of the tile in hand, pw = exp2(sacc - max) for row half h (0 when nothing is visible yet: max
    // -inf); returns their sum. (Into registers of their own: the seesaw computes them in warpgroup-dependent
    // code, where writing the wgmma accumulator sacc made ptxas serialize every wgmma, C7515.)
    float pw[16];
    auto exp_row = [&](int h, float m) {
      const float base_m = m == -INFINITY ? 0.0f : m;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pw[4 * i + 2 * h] = exp2f(sacc[4 * i + 2 * h] - base_m);
        pw[4 * i + 2 * h + 1] = exp2f(sacc[4 * i + 2 * h + 1] - base_m);
        sum += pw[4 * i + 2 * h] + pw[4 * i + 2 * h + 1];
      }
      return sum;
    };
    // The factor that takes values under max `from` to max `to` (to >= from; -inf `from`: 0).
    auto rescale_factor = [](float from, float to) { return exp2f(from - (to == -INFINITY ? 0.0f : to)); };
    // This consumer's half of P (rounded to T; the denominator uses the unrounded values, as the mma.sync
    // kernels): row r, keys 32 wg + 8 i + 2 t4 .. -> chunk 4 wg + i of the swizzled P row; then the async-proxy
    // fence for the wgmma that read it.
    auto write_p = [&]() {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * wq + g + 8 * h;
          *reinterpret_cast<uint32_t*>(smem + L.p_off + r * 128 + (((4 * wg + i) ^ (r & 7)) << 4) + 4 * t4) =
              ac::pack2<T>(pw[4 * i + 2 * h], pw[4 * i + 2 * h + 1]);
        }
      }
      s9::fence_proxy_async();
    };
    // O_c *= alpha (row halves 0 / 1), skipped when the warp's factors are all 1.
    auto rescale_o = [&](const float (&alpha)[2]) {
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          o0[4 * i] *= alpha[0], o0[4 * i + 1] *= alpha[0], o0[4 * i + 2] *= alpha[1], o0[4 * i + 3] *= alpha[1];
          o1[4 * i] *= alpha[0], o1[4 * i + 1] *= alpha[0], o1[4 * i + 2] *= alpha[1], o1[4 * i + 3] *= alpha[1];
        }
      }
    };
    // O_c += P V_c over keys [16 kb, 16 ke) of stage s, committed as one group: V N-major from the tile (64-value
    // column blocks LBO = KT x 128 bytes apart, 8-key groups SBO = 1024 apart, a k16 step 16 keys = 2048 bytes).
    auto issue_pv = [&](int s, int kb, int ke) {
      const uint32_t v0 = v_real0 ? sK(s) + uint32_t(4 * wg * KT * 128) : sQ;
      const uint32_t v1 = v_real1 ? sK(s) + uint32_t((4 * wg + 2) * KT * 128) : sQ;
      const uint64_t dv0 = s9::make_desc(v0, uint32_t(KT * 128), 1024, s9::Swizzle::k128B);
      const uint64_t dv1 = s9::make_desc(v1, uint32_t(KT * 128), 1024, s9::Swizzle::k128B);
      s9::fence_regs(o0);
      s9::fence_regs(o1);
      s9::wgmma_fence();
#pragma unroll
      for (int kk = kb; kk < ke; ++kk) {
        s9::wgmma_ss<128, T, 0, 1>(o0, s9::desc_add(dp0, kk * 32), s9::desc_add(dv0, kk * 2048), 1);
        s9::wgmma_ss<128, T, 0, 1>(o1, s9::desc_add(dp0, kk * 32), s9::desc_add(dv1, kk * 2048), 1);
      }
      s9::wgmma_commit();
    };
    // The non-finite fix-up (attention_common.cuh, "keys some rows of a CTA see"; mla_attention_mma.cuh's, per
    // consumer). In varlen prefill with several tokens per CTA (fewer than 64 heads) the rows of a tile past the
    // first row's position see different keys: P is 0 where a row does not see a key, but the P V wgmma would
    // still multiply that 0 by the key's value, and 0 x inf or 0 x NaN would reach the row. So on such a tile the
    // consumer scans its value columns [256 wg, min(R, 256 wg + 256)) of keys [kb, ke) of stage s; if one is not
    // finite, each thread adds those values of the keys its rows see times P (as rounded in the P tile) to its
    // own accumulators, then they are zeroed before the wgmma reads them. No wgmma in here (the wgmma sequence
    // stays the same on every path: a wgmma under a branch serializes them all, C7515 / C7520), none in flight
    // when it is called; P of keys [kb, ke) written, the S of every consumer that reads those rows completed.
    // The decision is the warpgroup's: the warps' results through shared memory (double-buffered by nscan).
    int nscan = 0;
    // Named barrier 5 (consumer 0) / 6 (consumer 1), 128 threads. (Constant ids: a computed one made ptxas
    // reserve all 16 hardware barriers.)
    auto consumer_bar = [&]() {
      if (wg == 0) s9::named_bar_sync(5, 128);
      else s9::named_bar_sync(6, 128);
    };
    auto fix_nonfinite = [&](int s, int k0, int kb, int ke) {
      unsigned char* const tile = smem + (sK(s) - base);
      const int c_lo = 32 * wg, c_n = max(0, min(R / 8, 32 * wg + 32) - c_lo);  // 16-byte column chunks
      const int n = (ke - kb) * c_n;
      uint32_t any = 0u;
      for (int i = wt; i < n; i += 128) {
        const int kl = kb + i / c_n, c = c_lo + i % c_n;
        const uint4 u = *reinterpret_cast<const uint4*>(tile + sm90_off(KT, kl, c));
        any |= ac::nonfinite2<T>(u.x) | ac::nonfinite2<T>(u.y) | ac::nonfinite2<T>(u.z) | ac::nonfinite2<T>(u.w);
      }
      int* const flags = reinterpret_cast<int*>(smem + L.flag_off) + 8 * wg + 4 * (nscan & 1);
      ++nscan;
      const int warp_any = __any_sync(0xffffffffu, any != 0u);
      if (lane == 0) flags[wq] = warp_any;
      consumer_bar();  // (also: P of keys [kb, ke) written by this consumer's threads)
      if ((flags[0] | flags[1] | flags[2] | flags[3]) == 0) return;
      // Key by key, the non-finite values only, each thread its own output elements (a key a row does not see
      // is skipped, not multiplied by 0). (A lambda per accumulator array, as the epilogue's store.)
      auto add = [&](float (&o)[64], int c0, int kl, float p0, float p1, bool see0, bool see1) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int col = c0 + 8 * i + 2 * t4;
          if (col >= R) continue;  // (a slice past R: never stored)
          const uint32_t v2 = *reinterpret_cast<const uint32_t*>(tile + sm90_off(KT, kl, col >> 3) + 2 * (col & 7));
          const uint32_t bad = ac::nonfinite2<T>(v2);
          if (bad == 0u) continue;
          const float v0 = ac::bits16_to_float<T>(v2 & 0xffffu), v1 = ac::bits16_to_float<T>(v2 >> 16);
          if (bad & 0xffffu) {
            if (see0) o[4 * i] += p0 * v0;
            if (see1) o[4 * i + 2] += p1 * v0;
          }
          if (bad >> 16) {
            if (see0) o[4 * i + 1] += p0 * v1;
            if (see1) o[4 * i + 3] += p1 * v1;
          }
        }
      };
      const int r0 = 16 * wq + g, r1 = r0 + 8;
#pragma unroll 1
      for (int kl = kb; kl < ke; ++kl) {
        const bool see0 = k0 + kl <= pos[0], see1 = k0 + kl <= pos[1];
        if (!see0 && !see1) continue;
        const int pc = (kl >> 3) << 4, pb = 2 * (kl & 7);
        const float p0 = ac::bits16_to_float<T>(
            *reinterpret_cast<const uint16_t*>(smem + L.p_off + r0 * 128 + (pc ^ ((r0 & 7) << 4)) + pb));
        const float p1 = ac::bits16_to_float<T>(
            *reinterpret_cast<const uint16_t*>(smem + L.p_off + r1 * 128 + (pc ^ ((r1 & 7) << 4)) + pb));
        add(o0, 256 * wg, kl, p0, p1, see0, see1);
        add(o1, 256 * wg + 128, kl, p0, p1, see0, see1);
      }
      consumer_bar();  // every thread has read the values it adds
      for (int i = wt; i < n; i += 128) {
        const int kl = kb + i / c_n, c = c_lo + i % c_n;
        uint4* const q = reinterpret_cast<uint4*>(tile + sm90_off(KT, kl, c));
        uint4 u = *q;
        u.x &= ~ac::nonfinite2<T>(u.x), u.y &= ~ac::nonfinite2<T>(u.y);
        u.z &= ~ac::nonfinite2<T>(u.z), u.w &= ~ac::nonfinite2<T>(u.w);
        *q = u;
      }
      s9::fence_proxy_async();          // the generic-proxy stores, before the wgmma reads the tile
      consumer_bar();  // the whole warpgroup's part zeroed
    };

    const int ntiles = w.tile_end - w.tile_begin;
    // Queries of the CTA's 64 rows -> the swizzled 16-bit Q tile (both consumers, 256 threads); zeros as
    // padding (rows of absent heads, columns past R + P).
    for (int idx = tid; idx < ROWS * cpr; idx += 256) {
      const int r = idx / cpr, c = idx - r * cpr;
      const ac::RowId id = ac::row_id(a, w, r);
      float x[8];
      load_q_chunk<T>(a, id, c, D, x);
      *reinterpret_cast<uint4*>(smem + L.q_off + sm90_off(ROWS, r, c)) =
          make_uint4(ac::pack2<T>(x[0], x[1]), ac::pack2<T>(x[2], x[3]), ac::pack2<T>(x[4], x[5]),
                     ac::pack2<T>(x[6], x[7]));
    }
    s9::fence_proxy_async();  // the generic-proxy stores, before wgmma reads them
    // (Q is free: both consumers' last wgmma of the previous piece completed before its epilogue's barrier 3.)
    s9::named_bar_sync(3, 256);

#pragma unroll
    for (int h = 0; h < 2; ++h) pos[h] = ac::row_id(a, w, 16 * wq + g + 8 * h).pos;
#pragma unroll
    for (int i = 0; i < 64; ++i) o0[i] = o1[i] = 0.0f;
    m_run[0] = m_run[1] = -INFINITY, d_run[0] = d_run[1] = 0.0f;

    if constexpr (!SEESAW) {
      // Both consumers in step: S, the maxima exchanged (barrier 1), P written (barrier 2), P V over all 64 keys.
      for (int it = 0; it < ntiles; ++it) {
        const int s = (done + it) % stages;
        const int k0 = (w.tile_begin + it) * KT;
        issue_s(done + it);
        s9::wgmma_wait<0>();
        s9::fence_regs(sacc);
        float mx[2];
        logits(k0, mx);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (t4 == 0) s_max[wg * ROWS + 16 * wq + g + 8 * h] = mx[h];
        // Both halves of the maxima (and, the previous tile's P V of both consumers having completed
        // before either arrives here, the P tile free to overwrite).
        s9::named_bar_sync(1, 256);
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * wq + g + 8 * h;
          // The same expression in both consumers (same operands, same order): identical maxima.
          const float m_new = fmaxf(m_run[h], fmaxf(s_max[r], s_max[ROWS + r]));
          alpha[h] = rescale_factor(m_run[h], m_new);
          m_run[h] = m_new;
          d_run[h] = d_run[h] * alpha[h] + exp_row(h, m_new);  // per-thread partial; quads, consumers summed at the end
        }
        write_p();
        rescale_o(alpha);
        s9::named_bar_sync(2, 256);  // both halves of P written
        if (w.nq > 1 && k0 + KT - 1 > w.pos0) fix_nonfinite(s, k0, 0, KT);  // rows see different keys
        issue_pv(s, 0, KT / 16);
        s9::wgmma_wait<0>();
        s9::fence_regs(o0);
        s9::fence_regs(o1);
        s9::mbar_arrive(empty(s));  // this thread is done with the stage
      }
    } else {
      // The seesaw (csrc/cuda/README.md, "MLA decode on wgmma", seesaw): the row maximum runs as a chain, consumer
      // 0's keys first. Per tile, with m the running maximum both hold:
      //   consumer 0: m0 = max(m, its keys); P0 under m0 -> shared, m0 -> s_max[0]; arrive on barrier 1; O_L
      //               *= 2^(m - m0), O_L += P0 V_L (tensor cores busy while consumer 1 does its softmax)
      //   consumer 1: sync on barrier 1; O_R *= 2^(m - m0), O_R += P0 V_R issued, then (overlapping it) m1 =
      //               max(m0, its keys), P1 under m1 -> shared, m1 -> s_max[1]; after its P0 V: arrive on 2
      //   both:       (consumer 0 syncs on 2) O *= 2^(m0 - m1), O += P1 V over the second 32 keys, m = m1;
      //               then S of the next tile is issued before this P V is waited for.
      // Barrier 1 also says P1 of the previous tile is free (consumer 0 waited for its P1 V first), barrier
      // 2 that P0 is (consumer 1 waited for its P0 V). The wgmma sequence is the same in both consumers
      // (only barriers and softmax differ by warpgroup: a wgmma under a warpgroup branch serializes, C7520).
      const bool early_s = !(FP8 && stages == 2);
      if (ntiles > 0) {
        issue_s(done);
        s9::wgmma_wait<0>();
      }
      for (int it = 0; it < ntiles; ++it) {
        const int s = (done + it) % stages;
        const int k0 = (w.tile_begin + it) * KT;
        s9::fence_regs(sacc);  // S of this tile: waited for (above, or with the previous tile's P1 V)
        float mx[2], m0[2], m1[2], alpha[2];
        logits(k0, mx);
        if (wg == 0) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            m0[h] = fmaxf(m_run[h], mx[h]);
            alpha[h] = rescale_factor(m_run[h], m0[h]);
            d_run[h] = d_run[h] * alpha[h] + exp_row(h, m0[h]);
            if (t4 == 0) s_max[16 * wq + g + 8 * h] = m0[h];
          }
          write_p();
          s9::named_bar_arrive(1, 256);  // P0 and m0 written
        } else {
          s9::named_bar_sync(1, 256);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            m0[h] = s_max[16 * wq + g + 8 * h];
            alpha[h] = rescale_factor(m_run[h], m0[h]);
            d_run[h] *= alpha[h];
          }
        }
        rescale_o(alpha);
        const bool partly = w.nq > 1 && k0 + KT - 1 > w.pos0;  // rows see different keys of the tile
        if (partly) fix_nonfinite(s, k0, 0, KT / 2);
        issue_pv(s, 0, KT / 32);  // P0 V: the first 32 keys
        if (wg == 1) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            m1[h] = fmaxf(m0[h], mx[h]);
            alpha[h] = rescale_factor(m0[h], m1[h]);
            d_run[h] = d_run[h] * alpha[h] + exp_row(h, m1[h]);
            if (t4 == 0) s_max[ROWS + 16 * wq + g + 8 * h] = m1[h];
          }
          write_p();
        }
        s9::wgmma_wait<0>();  // P0 V
        s9::fence_regs(o0);
        s9::fence_regs(o1);
        if (wg == 1) {
          s9::named_bar_arrive(2, 256);  // P1 and m1 written, P0 read
        } else {
          s9::named_bar_sync(2, 256);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            m1[h] = s_max[ROWS + 16 * wq + g + 8 * h];
            alpha[h] = rescale_factor(m0[h], m1[h]);
            d_run[h] *= alpha[h];
          }
        }
        m_run[0] = m1[0], m_run[1] = m1[1];
        rescale_o(alpha);
        if (partly) fix_nonfinite(s, k0, KT / 2, KT);
        issue_pv(s, KT / 32, KT / 16);  // P1 V: the second 32 keys
        // S of the next tile queued behind P1 V (no tensor-core bubble between the two); one wait for both. (A
        // wait<1> that left S in flight across the loop made ptxas serialize every wgmma, C7515: it gained
        // nothing, the next thing this warpgroup does being the softmax that needs S.) Not with fp8 latents in
        // 2 stages: the producer completes tile j + 1 (converted one tile behind) only after issuing the copies
        // of tile j + 2, into this stage, so S of j + 1 must wait for this stage's release (else a deadlock).
        if (early_s && it + 1 < ntiles) issue_s(done + it + 1);
        s9::wgmma_wait<0>();
        s9::fence_regs(o0);
        s9::fence_regs(o1);
        s9::mbar_arrive(empty(s));  // this thread is done with the stage
        if (!early_s && it + 1 < ntiles) {
          issue_s(done + it + 1);
          s9::wgmma_wait<0>();
        }
      }
    }

    // ---- epilogue: quad sums, the two consumers' sums, then rows to out / lse or the piece's partial --
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      d_run[h] += __shfl_xor_sync(0xffffffffu, d_run[h], 1);
      d_run[h] += __shfl_xor_sync(0xffffffffu, d_run[h], 2);
      if (t4 == 0) s_sum[wg * ROWS + 16 * wq + g + 8 * h] = d_run[h];
    }
    s9::named_bar_sync(3, 256);
    int64_t part_row0;
    const bool whole = !piece_partials(m, w, &part_row0);  // the sequence's only piece: rows to out / lse
    const float vm = ac::checked_v_mul(v_mul);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * wq + g + 8 * h;
      const ac::RowId id = ac::row_id(a, w, r);
      if (!id.valid) continue;
      float mul;
      const float lse2 = finish_mla_row(w, id, whole, p, m_run[h], s_sum[r] + s_sum[ROWS + r], vm, &mul);
      const int64_t row = id.token * p.num_heads + id.head;
      const int64_t prow = part_row0 + row;
      // (a lambda per accumulator array rather than a pointer that selects one: registers cannot be
      // addressed, and a pointer could put the arrays in local memory)
      auto store = [&](const float (&o)[64], int c0) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int col = c0 + 8 * i + 2 * t4;
          if (col >= R) continue;  // R is a multiple of 8: col + 1 < R too
          const float x0 = o[4 * i + 2 * h] * mul, x1 = o[4 * i + 2 * h + 1] * mul;
          if (whole)
            *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + row * R + col) = ac::pack2<T>(x0, x1);
          else
            *reinterpret_cast<float2*>(a.part_o + prow * R + col) = make_float2(x0, x1);
        }
      };
      store(o0, 256 * wg);
      store(o1, 256 * wg + 128);
      if (wg == 0 && t4 == 0) {
        if (whole) p.lse[row] = lse2 * ac::kLn2;
        else a.part_lse[prow] = lse2;
      }
    }
    done += ntiles;
  }
#else
  (void)m;
#endif
}

// Whether this build has the kernel's sm_90a code (its static shared memory: the stub compiled for other
// architectures has none). Asked only on an sm_90 device, once per process and instance.
template <typename T, CacheFormat CF, bool SEESAW>
bool mla_sm90_compiled() {
#if defined(KVKERNELS_CUDA_EMU)
  return true;
#else
  static const bool compiled = [] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, mla_sm90_kernel<T, CF, SEESAW>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.sharedSizeBytes >= sizeof(int) * 4;
  }();
  return compiled;
#endif
}

template <typename T, CacheFormat CF, bool SEESAW>
cudaError_t launch_mla_sm90_schedule(const MlaArgs& m, const CUtensorMap* map, dim3 grid, int smem,
                                     cudaStream_t stream) {
  static std::atomic<int> configured[64] = {};
  const cudaError_t err = raise_smem_limit(mla_sm90_kernel<T, CF, SEESAW>, configured, smem);
  if (err != cudaSuccess) return err;
  CUtensorMap none;
  if (map == nullptr) std::memset(&none, 0, sizeof(none));
  return launch_kernel_ex(mla_sm90_kernel<T, CF, SEESAW>, grid, kSm90Threads, smem, stream, m.pdl != 0, m,
                          map ? *map : none, map ? 1 : 0);
}

// m.seesaw picks the consumers' schedule (both instances are compiled in the same unit).
template <typename T, CacheFormat CF>
cudaError_t launch_mla_sm90_instance(const MlaArgs& m, const CUtensorMap* map, dim3 grid, int smem,
                                     cudaStream_t stream) {
  return m.seesaw ? launch_mla_sm90_schedule<T, CF, true>(m, map, grid, smem, stream)
                  : launch_mla_sm90_schedule<T, CF, false>(m, map, grid, smem, stream);
}

// The cache formats a 16-bit q reads: its own and both fp8 formats.
template <typename T, CacheFormat SELF>
struct MlaSm90ForQ {
  static bool compiled(CacheFormat f) {
    switch (f) {
      case SELF: return mla_sm90_compiled<T, SELF, false>();
      case CacheFormat::kFp8E4M3: return mla_sm90_compiled<T, CacheFormat::kFp8E4M3, false>();
      case CacheFormat::kFp8E5M2: return mla_sm90_compiled<T, CacheFormat::kFp8E5M2, false>();
      default: return false;
    }
  }
  static cudaError_t launch(const MlaArgs& m, const CUtensorMap* map, dim3 grid, int smem, cudaStream_t stream) {
    switch (m.a.p.kv.format) {
      case SELF: return launch_mla_sm90_instance<T, SELF>(m, map, grid, smem, stream);
      case CacheFormat::kFp8E4M3:
        return launch_mla_sm90_instance<T, CacheFormat::kFp8E4M3>(m, nullptr, grid, smem, stream);
      case CacheFormat::kFp8E5M2:
        return launch_mla_sm90_instance<T, CacheFormat::kFp8E5M2>(m, nullptr, grid, smem, stream);
      default: return cudaErrorInvalidValue;
    }
  }
};

}  // namespace kvkernels::mla_cuda
