// Tensor-core paged attention for fp16 / bf16 queries (caches of the query dtype, or fp8 e4m3 /
// e5m2: by the decode kernels at head dims 64 / 128 dequantized to fp16 in registers, fragment by
// fragment, with bf16 query rows scaled into fp16's range (MmaCfg::FP8_REGS, Q_RESCALE); otherwise to
// the query dtype in shared memory, one stage at a time). One template, six configurations:
//
//   Path::kMmaDecode   (WM = 1, WN = 4, or 2 for head dim 256): a CTA holds 16 rows (the query
//                      heads of one GQA group for one decode query) and its warps split the keys
//                      of each tile, 16 keys per warp, each with its own online-softmax state; the
//                      warp states are merged exactly in the epilogue. 64 / 64 / 32 keys per stage
//                      at head dim 64 / 128 / 256; 2 stages at head dim 128 / 256 ("wide", the
//                      default: the faster on an H100, benchmarks/results/gpu-20261126-h100).
//   Path::kMmaDecodeDeep  the same kernel with WN = 4 / 2 / 1: 64 / 32 / 16 keys per stage, 16 KiB
//                      of 16-bit K and V (8 KiB raw fp8), so 4 stages fit at every head dim and
//                      cache format; selectable (KVKERNELS_CUDA_ATTN_PATH=mma-decode-deep) for A/B
//                      runs (0.82x the wide one at bf16 head dim 128 on the H100, 1.02x with e4m3).
//   Path::kMmaPrefill  (WM = 4, WN = 1): 64 rows per CTA (q_tile queries x the group's heads),
//                      each warp owns 16 rows and walks every key of the tile. "Wide", the
//                      default: 64 keys per stage, 32 at head dim 256 (32 KiB stages, 2 of them at
//                      head dim 128 / 256). Key tiles wholly past the causal diagonal or before the
//                      sliding window are never loaded; tiles wholly visible skip the mask.
//   Path::kMmaDecodeFp8Smem  fp8 caches only: the wide decode kernel with each stage dequantized in
//                      shared memory (the method before FP8_REGS), selectable
//                      (KVKERNELS_CUDA_ATTN_PATH=mma-decode-fp8-smem) for the A/B of that change.
//   Path::kMmaPrefillDeep  the same kernel with 64 / 32 / 16 keys per stage at head dim 64 / 128 /
//                      256, 16 KiB of 16-bit K and V (8 KiB raw fp8), 4 stages at every head dim
//                      and cache format; selectable (KVKERNELS_CUDA_ATTN_PATH=mma-prefill-deep)
//                      for A/B runs (0.83x the wide one on the H100).
//   Path::kMmaPrefillTall  16-bit caches, head dims 64 / 128: the prefill kernel with 2 row tiles of
//                      16 per warp (MT = 2, 128 rows per CTA), 32 keys per stage; each K / V fragment
//                      feeds two mma. Selectable (KVKERNELS_CUDA_ATTN_PATH=mma-prefill-tall), not run
//                      on a GPU yet.
//   Path::kMmaDecodeOcc3  the wide decode kernel with the query fragments read from shared memory at
//                      every k-step (not held in registers) and __launch_bounds__(NT, 3): 3 CTAs per SM
//                      on sm_90 (shared memory holds 3 x ~71 KiB), 12 warps instead of 8. Selectable
//                      (KVKERNELS_CUDA_ATTN_PATH=mma-decode-occ3), not run on a GPU yet.
//   Path::kMmaDecodeFused  the wide decode kernel that issues its first tiles before loading the
//                      queries and, with splits, merges its work item's partials in the last CTA of the
//                      item to finish (merge_if_last, attention_merge.cuh) instead of a merge kernel.
//                      Selectable (KVKERNELS_CUDA_ATTN_PATH=mma-decode-fused), not run on a GPU yet.
//   Path::kMmaDecodePersistent  the fused decode kernel (PERSIST) launched as a grid of the resident CTA
//                      slots, each CTA walking a static contiguous range of (work item, split) units as
//                      runs (a run: its units of one item, one state, one partial); the loader runs ahead
//                      across runs, so the next item's block ids and first tiles are issued before this
//                      item's epilogue, which has a buffer of its own. Head dims 64 / 128. Selectable
//                      (KVKERNELS_CUDA_ATTN_PATH=mma-decode-persistent), not run on a GPU yet.
//
// Per tile and warp: S = Q K^T with mma.sync.m16n8k16 (A = Q from registers or ldmatrix, B = K
// via ldmatrix from a swizzled [key][dim] tile), logits scaled / capped / biased / masked in fp32,
// online softmax in log2 units, P rounded to the query dtype and O += P V with B = V via
// ldmatrix.trans. fp32 accumulation throughout; the denominator uses the unrounded P.
// K/V tiles stream through a cp.async pipeline of pipeline_stages() stages (2 to 4, at most 64 KiB
// of stages and fp8 conversion buffer): the loop waits for the oldest tile only, so STAGES - 1
// tiles are in flight while one is computed (with 2 stages: one, and a wait for every copy).
#pragma once

#include "attention_common.cuh"
#include "attention_merge.cuh"  // merge_if_last (Path::kMmaDecodeFused / kMmaDecodePersistent)

namespace kvkernels::attn_cuda {

template <typename T, CacheFormat CF, int DPAD, Path PATH>
struct MmaCfg {
  static constexpr int WM = mma_wm(PATH), WN = mma_wn(PATH, DPAD);
  static constexpr int NT = 32 * WM * WN;
  static constexpr int MT = mma_mt(PATH);  // m16 row tiles per warp
  static constexpr int ROWS = 16 * WM * MT;
  static constexpr int KT = key_tile_of(PATH, DPAD);
  static constexpr int KW = KT / WN;  // keys per warp per tile
  static_assert(KW % 16 == 0, "each warp needs whole k16 steps of keys");
  static constexpr bool FP8 = CF == CacheFormat::kFp8E4M3 || CF == CacheFormat::kFp8E5M2;
  static constexpr int ESZ = FP8 ? 1 : 2;
  static constexpr int CPR = DPAD * ESZ / 16;  // 16-byte chunks per raw cache row in smem
  static constexpr int CPR16 = DPAD / 8;       // 16-byte chunks per 16-bit row
  static constexpr int Q_BYTES = ROWS * DPAD * 2;
  static constexpr int RAW_TILE = KT * DPAD * ESZ;  // K or V of one stage
  static constexpr int STAGE_BYTES = 2 * RAW_TILE;
  // fp8 caches, decode, head dim 64 / 128: the K / V fragments are ldmatrix'd from the raw fp8 tile
  // and converted in registers (each warp reads only its own 16 keys, so every element is converted
  // once, and no conversion buffer or barrier sits between the copy and the mma). Prefill (every warp
  // reads every key of the tile), the kMmaDecodeFp8Smem A/B instance and head dim 256 convert each
  // stage once into a 16-bit tile in shared memory: at 256 the 128 output accumulators leave too few
  // registers (sm_80 ptxas spilled the register-level version at 255).
  static constexpr bool FP8_REGS =
      FP8 && DPAD <= 128 && is_mma_decode(PATH) && PATH != Path::kMmaDecodeFp8Smem;
  // The mma operand type. With fragments converted in registers, fp16 for bf16 queries too: an fp8
  // value is one cvt from fp16 (exact) but three more instructions from there to bf16, which made
  // the conversion 8 instructions per 4 values (4x the fp16 cost). The bf16 query rows are scaled by
  // a power of two each into fp16's range (Q_RESCALE: exact for every value within 2^32 of the
  // row's largest; smaller ones keep fp16's subnormal precision), the scale folded back into the
  // row's logit multiplier; P is rounded to fp16 (finer than bf16 over [0, 1]).
  using MmaT = std::conditional_t<FP8_REGS, __half, T>;
  static constexpr bool Q_RESCALE = FP8_REGS && std::is_same_v<T, __nv_bfloat16>;
  static constexpr int CVT_TILE = KT * DPAD * 2;
  static constexpr int CVT_BYTES = FP8 && !FP8_REGS ? 2 * CVT_TILE : 0;
  static constexpr int STAGES = pipeline_stages(STAGE_BYTES, CVT_BYTES);
  static constexpr int MAIN_BYTES = STAGES * STAGE_BYTES + CVT_BYTES;
  // The persistent decode (PERSIST) keeps its stages busy with the next work item's tiles while it writes
  // this one's rows, so its epilogue buffer cannot overlay them: a buffer of its own, EPI_CW columns wide,
  // that the epilogue passes DPAD / EPI_CW column chunks through (32 columns: 9 KiB at head dim 128, so
  // the kernel stays at ~77 KiB and 2 CTAs per SM also fit an A100's 164 KiB).
  static constexpr bool PERSIST = PATH == Path::kMmaDecodePersistent;
  static constexpr int EPI_CW = PERSIST ? 32 : DPAD;
  static constexpr int EPI_BYTES = WN * ROWS * (EPI_CW + 4) * 4;
  static constexpr int MD_BYTES = 2 * WN * ROWS * 4;
  static constexpr int Q_OFF = 0;
  static constexpr int MAIN_OFF = Q_BYTES;
  // The epilogue's buffer overlays the stages; in the tall prefill also the query tile, which is
  // read no more by then (its 128 x (DPAD + 4) floats would not fit beside it at head dim 128).
  static constexpr int EPI_OFF = PERSIST ? MAIN_OFF + MAIN_BYTES : MT > 1 ? 0 : MAIN_OFF;
  static constexpr int BODY_END = MAIN_OFF + MAIN_BYTES, EPI_END = EPI_OFF + EPI_BYTES;
  static constexpr int MD_OFF = BODY_END > EPI_END ? BODY_END : EPI_END;
  static constexpr int QX_OFF = MD_OFF + MD_BYTES;  // Q_RESCALE: each row's scale exponent
  static constexpr int SMEM = QX_OFF + (Q_RESCALE ? ROWS * 4 : 0);
  // The query fragments of every k-step in registers (one row tile at head dims 64 / 128; the tall
  // prefill reloads them from shared memory: its accumulators take the registers; so does the occ3
  // decode, whose 32 registers of query fragments are what stands between ~200 registers and the 168
  // of 3 CTAs per SM).
  static constexpr bool Q_IN_REGS = MT == 1 && DPAD <= 128 && PATH != Path::kMmaDecodeOcc3;
  // The fused decode: the first tiles' copies go out before the query load (the query's DRAM round
  // trip overlaps theirs instead of preceding them), and the split merge runs in the kernel.
  // The persistent decode does both too (its first work item's tiles before its first query load; the next
  // item's before this item's epilogue).
  static constexpr bool EARLY_ISSUE = PATH == Path::kMmaDecodeFused || PERSIST;
  static constexpr bool FUSED_MERGE = PATH == Path::kMmaDecodeFused || PERSIST;
  static_assert(MT == 1 || !FP8_REGS, "fragments converted in registers: one row tile per warp");
  static_assert(SMEM <= kMaxSmem, "shared memory of the tensor-core kernel");
  static_assert(PATH != Path::kMmaDecodeDeep || STAGES >= 4, "the deep decode pipeline keeps 4 stages");
  static_assert(PATH != Path::kMmaPrefillDeep || STAGES >= 4, "the deep prefill pipeline keeps 4 stages");
  // __launch_bounds__ minimum CTAs per SM: for the deep decode kernel, as many as sm_90's 228 KiB of
  // shared memory per SM hold (1 KiB reserved per CTA), so ptxas keeps the registers low enough for
  // them (a cap only at 128 threads: 64 or 32 threads never run out of registers first). The wide
  // decode and both prefill kernels keep 1 (the first configuration, unchanged). The deep
  // prefill gets 3 CTAs per SM at head dim 64 and 2 at 128 / 256 without a cap; only with an fp8
  // cache at head dim 128 would shared memory allow 3, which a cap would buy by squeezing a
  // ~190-register kernel into 168.
  // The occ3 decode asks for 3 where shared memory holds them (every head dim and cache format on sm_90:
  // at most 72.3 KiB each): at 128 threads that caps registers at 168.
  // Built for sm_80 / sm_86 / sm_89 (164 / 100 / 100 KiB of shared memory per SM: at most 2 of these
  // CTAs) it asks for 2: a bound for 3 would only squeeze the registers there (the e4m3 bit conversion
  // spilled at 168). The planner counts what the device's shared memory holds (attention.cu).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  static constexpr int OCC3_CTAS = 2;
#else
  static constexpr int OCC3_CTAS = 3;
#endif
  static constexpr int SM90_CTAS = (228 * 1024) / (SMEM + 1024);
  static constexpr int MAX_CTAS = PATH == Path::kMmaDecodeDeep ? 4 : PATH == Path::kMmaDecodeOcc3 ? OCC3_CTAS : 1;
  static constexpr int MIN_BLOCKS = SM90_CTAS < 1 ? 1 : SM90_CTAS > MAX_CTAS ? MAX_CTAS : SM90_CTAS;
};

// Byte offset of 16-byte chunk c of row r in a [rows][DPAD] 16-bit tile: chunks are XOR-swizzled
// with the row (mod 8), so the 8 row addresses of one ldmatrix hit 8 different bank groups.
template <int CPR16>
__device__ __forceinline__ int swz(int r, int c) {
  return (r * CPR16 + (c ^ (r & 7))) * 16;
}

// Byte offset of 16-byte chunk c of row r in a [rows][CPR chunks] raw fp8 tile that ldmatrix reads
// (the register-level conversion): swizzled so the 8 rows of one 8 x 8 matrix hit 8 different bank
// groups. With 8 or more chunks per row as swz; with 4 (head dim 64) two rows share a 128-byte line,
// so the chunk is XORed with the row pair instead.
template <int CPR>
__device__ __forceinline__ int swz8(int r, int c) {
  if constexpr (CPR >= 8) return (r * CPR + (c ^ (r & 7))) * 16;
  else return (r * CPR + (c ^ ((r >> 1) & (CPR - 1)))) * 16;
}

// Dequantizes one stage of raw fp8 K and V (plain [KT][DPAD] bytes) into swizzled 16-bit tiles.
template <typename T, CacheFormat CF, int KT, int DPAD, int NT>
__device__ __forceinline__ void convert_fp8_stage(const char* raw, char* cvt) {
  constexpr int CPR = DPAD / 16, RAW_TILE = KT * DPAD, CVT_TILE = KT * DPAD * 2;
  for (int idx = threadIdx.x; idx < 2 * KT * CPR; idx += NT) {
    const int tensor = idx / (KT * CPR), rem = idx - tensor * KT * CPR;
    const int r = rem / CPR, c = rem - r * CPR;
    const uint4 u = *reinterpret_cast<const uint4*>(raw + tensor * RAW_TILE + (r * CPR + c) * 16);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    uint32_t h[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) fp8x4_to_pairs<T, CF>(w[i], &h[2 * i], &h[2 * i + 1]);
    char* dst = cvt + tensor * CVT_TILE;
    *reinterpret_cast<uint4*>(dst + swz<DPAD / 8>(r, 2 * c)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(dst + swz<DPAD / 8>(r, 2 * c + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
}

template <typename T, CacheFormat CF, int DPAD, Path PATH>
__global__ void __launch_bounds__(MmaCfg<T, CF, DPAD, PATH>::NT, MmaCfg<T, CF, DPAD, PATH>::MIN_BLOCKS)
    mma_attention_kernel(const __grid_constant__ AttnArgs a) {
  using C = MmaCfg<T, CF, DPAD, PATH>;
  constexpr int KT = C::KT, KW = C::KW, NT = C::NT, ROWS = C::ROWS, STAGES = C::STAGES, MT = C::MT;
  constexpr int CPR16 = C::CPR16;
  using MmaT = typename C::MmaT;
  extern __shared__ __align__(128) unsigned char smem[];

  const AttentionParams& p = a.p;
  Work w;
  // The persistent decode: this CTA's units [u_run, u_end) of the items x num_splits (item-major, so a
  // CTA's units of one item are neighbours, their key tiles contiguous), walked as runs: the units of one
  // item, one softmax state and one partial (split s0's; the others marked empty). make_run fills a run's
  // Work from its first unit and returns its unit count.
  const int S = a.num_splits;
  const int grid_y = p.kv.num_kv_heads * a.head_chunks;
  int64_t u_run = 0, u_end = 0;
  auto make_run = [&](int64_t u, Work& r) {
    const int64_t item = u / S, x = item / grid_y;
    const int s0 = static_cast<int>(u - item * S);
    const int s1 = static_cast<int>(min(int64_t(S), s0 + (u_end - u)));
    make_work_tile<KT>(a, r, static_cast<int>(x), static_cast<int>(item - x * grid_y), s0, s1);  // decode: true
    return s1 - s0;
  };
  int run_units = 1;
  if constexpr (C::PERSIST) {
    const int64_t units = int64_t(p.kv.num_seqs) * grid_y * S;
    u_run = units * blockIdx.x / gridDim.x;
    u_end = units * (blockIdx.x + 1) / gridDim.x;
    if (u_run >= u_end) return;
    run_units = make_run(u_run, w);
  } else if (!make_work<KT>(a, w)) {
    return;
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp % C::WM, wn = warp / C::WM;
  const int g = lane >> 2, t4 = lane & 3;
  const int d = p.kv.head_dim, dv = p.kv.head_dim_v;  // K columns, V (output) columns

  char* sq = reinterpret_cast<char*>(smem) + C::Q_OFF;
  char* smain = reinterpret_cast<char*>(smem) + C::MAIN_OFF;
  float* em = reinterpret_cast<float*>(smem + C::MD_OFF);
  float* ed = em + C::WN * ROWS;

  // The K / V pipeline: the first tile's block ids, then the first STAGES - 1 tiles' copies. Started
  // after the query load (below), or before it in the fused decode (EARLY_ISSUE): a CTA then waits for
  // the block table, issues its copies and loads the queries while they fly, one DRAM round trip
  // fewer before its first tile than block ids after queries (the stages and the query tile are
  // disjoint in shared memory).
  TileLoader<KT, NT, C::CPR, C::ESZ> ld;
  auto stage_k = [&](int s) { return smain + s * C::STAGE_BYTES; };
  auto off = [](int r, int c) {
    if constexpr (C::FP8_REGS) return swz8<C::CPR>(r, c);
    else if constexpr (C::FP8) return (r * C::CPR + c) * 16;  // read row-wise by the conversion
    else return swz<CPR16>(r, c);
  };
  // The tiles of the CTA's work item (the persistent decode: of its current run, set again per run).
  int ntiles = w.tile_end - w.tile_begin;
  auto prime = [&](int s) {  // the first STAGES - 1 tiles, before the loop
    if (s < ntiles) {
      ld.issue(a, w.tile_begin + s, stage_k(s), stage_k(s) + C::RAW_TILE, off);
      if (s + 1 < ntiles) ld.fetch(a, w, w.tile_begin + s + 1);
    }
    cp_async_commit();
  };
  // The persistent decode's loader runs ahead of the compute over the same runs: wl is the run it loads,
  // tl the tile of wl whose block ids it holds (the next to issue), ul the unit after wl. Runs without
  // tiles (empty sequences, splits past the end) are skipped here; the compute still writes their rows.
  Work wl = w;
  int tl = w.tile_begin;
  int64_t ul = u_run + run_units;
  auto load_enter = [&]() {  // on to the first run from wl on with a tile left; its block ids fetched
    if (tl >= wl.tile_end) {
      while (tl >= wl.tile_end && ul < u_end) {
        ul += make_run(ul, wl);
        tl = wl.tile_begin;
      }
      if (tl < wl.tile_end) ld.init(p, wl);  // its kv head (the last issue has read the old bases)
    }
    if (tl < wl.tile_end) ld.fetch(a, wl, tl);
  };
  auto issue_next = [&](int stage) {  // the loader's next tile into `stage`, and the ids of the one after
    if (tl < wl.tile_end) {
      ld.issue(a, tl, stage_k(stage), stage_k(stage) + C::RAW_TILE, off);
      ++tl;
      load_enter();
    }
  };
  auto start_pipeline = [&]() {
    if constexpr (C::PERSIST) {
      ld.init(p, wl);
      load_enter();
      // (rolled, as in the deep / occ3 kernels: unrolled, the head-dim-256 instance spilled at 255 registers)
#pragma unroll 1
      for (int s = 0; s < STAGES - 1; ++s) {
        issue_next(s);
        cp_async_commit();
      }
      return;
    }
    ld.init(p, w);
    if (ntiles > 0) ld.fetch(a, w, w.tile_begin);
    if constexpr (PATH == Path::kMmaDecodeDeep || PATH == Path::kMmaDecodeOcc3) {
      // Not unrolled in the deep decode kernel: unrolled, its 3 issues kept their addresses live side
      // by side and the head-dim-256 instance ran out of registers (ptxas: 255 and spills); nor in the
      // occ3 one, held to 168 registers. The other configurations keep the unrolled loop (and their
      // code, for the A/B).
#pragma unroll 1
      for (int s = 0; s < STAGES - 1; ++s) prime(s);
    } else {
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) prime(s);
    }
  };
  if constexpr (C::EARLY_ISSUE) start_pipeline();

  // One pass per run (the persistent decode; the others have one run, this CTA's work item): g0 counts the
  // tiles of the runs before it, so the stages go round across runs as the loader fills them.
  int g0 = 0;
  for (;;) {
  if constexpr (C::PERSIST) ntiles = w.tile_end - w.tile_begin;
  // Queries of the CTA's rows -> shared memory (16-bit, swizzled); zero rows / columns as padding.
  int* qexp = reinterpret_cast<int*>(smem + C::QX_OFF);
  static_assert(!C::Q_RESCALE || (ROWS * CPR16) % NT == 0, "every thread in every pass (shuffles)");
  for (int idx = tid; idx < ROWS * CPR16; idx += NT) {
    const int r = idx / CPR16, c = idx - r * CPR16;
    const RowId id = row_id(a, w, r);
    float x[8];
    if (id.valid) {
      const T* src = static_cast<const T*>(p.q) + id.token * p.q_stride_token +
                     int64_t(id.head) * p.q_stride_head;
      load_q8(src, c * 8, d, a.q_aligned != 0, x);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.0f;
    }
    if constexpr (C::Q_RESCALE) {
      // The row's largest finite |q| over the CPR16 consecutive lanes that hold its chunks; the row
      // is scaled by 2^-e so that it lands in [2^14, 2^15) (e = 0 for a row of zeros or non-finite
      // values only: NaN / inf stay what they are).
      float mx = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) mx = fmaxf(mx, isfinite(x[i]) ? fabsf(x[i]) : 0.0f);
#pragma unroll
      for (int o = CPR16 / 2; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const int e = mx > 0.0f ? ilogbf(mx) - 14 : 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = ldexpf(x[i], -e);
      if (c == 0) qexp[r] = e;
    }
    *reinterpret_cast<uint4*>(sq + swz<CPR16>(r, c)) =
        make_uint4(pack2<MmaT>(x[0], x[1]), pack2<MmaT>(x[2], x[3]), pack2<MmaT>(x[4], x[5]),
                   pack2<MmaT>(x[6], x[7]));
  }

  // This thread's rows: g and g + 8 of each of its warp's MT row tiles of 16 (h = 0 / 1).
  RowId rid[MT][2];
  float slope[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rid[mt][h] = row_id(a, w, (wm * MT + mt) * 16 + g + 8 * h);
      slope[mt][h] = (p.alibi_slopes && rid[mt][h].valid) ? p.alibi_slopes[rid[mt][h].head] : 0.0f;
    }
  }
  constexpr float unit = C::FP8 ? fp8_unit<CF>() : 1.0f;
  const float qk_mul = p.scale * p.kv.logit_k_scale_of(w.kv_head) * unit;
  // (read after the loop in the occ3 decode: one register fewer through it, in a kernel at 168)
  constexpr bool kLateVMul = PATH == Path::kMmaDecodeOcc3;
  const float v_mul = kLateVMul ? 0.0f : p.kv.v_scale_of(w.kv_head) * unit;
  const float plain_mul = qk_mul * kLog2e;
  const LogitOps ops = logit_ops(p, w);
  // Logit multipliers of this thread's rows (the query scale folded back in with Q_RESCALE; read
  // after the barrier below).
  float row_qk[MT][2], row_plain[MT][2];

  if constexpr (!C::EARLY_ISSUE) start_pipeline();

  float o[MT][DPAD / 8][4];
  float m2[MT][2], dsum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < DPAD / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
    m2[mt][0] = m2[mt][1] = -INFINITY;
    dsum[mt][0] = dsum[mt][1] = 0.0f;
  }
  uint32_t qf[C::Q_IN_REGS ? MT : 1][C::Q_IN_REGS ? DPAD / 16 : 1][4];
  const uint32_t sq_u32 = smem_u32(sq);
  // The A fragment (query) of k-step kk. The K fragments read from raw fp8 (FP8_REGS) hold columns
  // 16 kk + 4 t4 + {0, 1} (b0) and + {2, 3} (b1), not 2 t4 + {0, 1} and + 8: a 32-bit lane of
  // ldmatrix is 4 fp8 values. The sum over a k-step does not care which 16 columns pair up, as long
  // as the query's match, so the query fragment takes the same columns: 8 bytes per row.
  auto load_qfrag = [&](int mt, int kk, uint32_t* af) {
    const int r16 = (wm * MT + mt) * 16;  // the row tile's first row
    if constexpr (C::FP8_REGS) {
      const int r = r16 + g, c = 2 * kk + (t4 >> 1), byte = (t4 & 1) * 8;
      const uint2 x = *reinterpret_cast<const uint2*>(sq + swz<CPR16>(r, c) + byte);
      const uint2 y = *reinterpret_cast<const uint2*>(sq + swz<CPR16>(r + 8, c) + byte);
      af[0] = x.x, af[1] = y.x, af[2] = x.y, af[3] = y.y;
    } else {
      ldmatrix_x4(sq_u32 + swz<CPR16>(r16 + (lane & 15), 2 * kk + (lane >> 4)), af);
    }
  };
  __syncthreads();  // queries in shared memory
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float f = C::Q_RESCALE ? ldexpf(1.0f, qexp[(wm * MT + mt) * 16 + g + 8 * h]) : 1.0f;
      row_qk[mt][h] = qk_mul * f, row_plain[mt][h] = plain_mul * f;
    }
  }
  if constexpr (C::Q_IN_REGS) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int kk = 0; kk < DPAD / 16; ++kk) {
        qf[mt][kk][0] = qf[mt][kk][1] = qf[mt][kk][2] = qf[mt][kk][3] = 0u;
        if (kk * 16 < d) load_qfrag(mt, kk, qf[mt][kk]);
      }
    }
  }
  // Query fragment of row tile mt, k-step kk, from registers or shared memory.
  auto qfrag = [&](int mt, int kk, uint32_t* af) {
    if constexpr (C::Q_IN_REGS) {
      af[0] = qf[mt][kk][0], af[1] = qf[mt][kk][1], af[2] = qf[mt][kk][2], af[3] = qf[mt][kk][3];
    } else {
      load_qfrag(mt, kk, af);
    }
  };

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nx = it + STAGES - 1;
      if constexpr (C::PERSIST) {
        issue_next((g0 + nx) % STAGES);  // this run's tile nx, or the next runs' first ones
      } else if (nx < ntiles) {
        ld.issue(a, w.tile_begin + nx, stage_k(nx % STAGES), stage_k(nx % STAGES) + C::RAW_TILE,
                 off);
        if (nx + 1 < ntiles) ld.fetch(a, w, w.tile_begin + nx + 1);
      }
      cp_async_commit();
    }
    char* tk = stage_k((g0 + it) % STAGES);
    if constexpr (C::FP8 && !C::FP8_REGS) {
      char* cvt = smain + STAGES * C::STAGE_BYTES;
      convert_fp8_stage<T, CF, KT, DPAD, NT>(tk, cvt);
      __syncthreads();
      tk = cvt;
    }
    const uint32_t tk_u32 = smem_u32(tk);
    // V tile: 16-bit and swizzled, or raw fp8 (FP8_REGS)
    char* const tv = tk + (C::FP8 && !C::FP8_REGS ? C::CVT_TILE : C::RAW_TILE);
    const uint32_t tv_u32 = smem_u32(tv);
    const int k0 = (w.tile_begin + it) * KT;
    const bool need_mask = tile_needs_mask(w, k0, KT, ops);
    // A tile whose keys some rows see and others do not (prefill: diagonal, window edge) with an
    // inf / NaN value: see attention_common.cuh ("keys some rows of a CTA see"). The decode kernel's
    // rows are the heads of one query, which all see the same keys: compiled out there.
    constexpr bool kMultiQuery = is_mma_prefill(PATH);
    static_assert(!(kMultiQuery && C::FP8_REGS), "the fix-up reads 16-bit values");
    const bool fix_nonfinite =
        kMultiQuery && w.nq > 1 && need_mask && tile_has_nonfinite<T, NT>(tv, KT * DPAD / 8);

    // S = Q K^T for this warp's 16 rows x KW keys. At head dims 128 / 256 every k-step of the
    // padding runs, also past head_dim: the Q and K columns there are zeros (zero-filled, never
    // read), so they add exact zeros. A `kk * 16 >= d` test cost more than those steps at the
    // common head dims: it split the loop into one block per k-step, so ptxas could not load the
    // next step's K fragments before this step's mma (the H100 profile's mma stalls waiting on
    // ldmatrix). At 64 the test stays: without it the prefill kernels need 9 more registers, which
    // costs them their third CTA per SM (a __launch_bounds__ cap to keep it spills with fp8).
    constexpr bool kSkipPadding = DPAD == 64;
    float s[MT][KW / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < KW / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.0f;
    if constexpr (C::FP8_REGS) {
      // Raw fp8: one ldmatrix_x4 reads 16 keys x 2 chunks of 16 columns (two k-steps), matrix j =
      // keys 8 (j & 1) .. + 7 of chunk kk + j / 2; lane (g, t4) gets key g's columns 4 t4 .. 4 t4 + 3
      // of its chunk, converted to the b0 / b1 pair (see load_qfrag). The second k-step's
      // query fragment is loaded after the first step's mma (fewer live registers).
#pragma unroll
      for (int kk = 0; kk < DPAD / 16; kk += 2) {
        if (kSkipPadding && kk * 16 >= d) continue;
        uint32_t b[KW / 16][4], af[4], lo, hi;
        qfrag(0, kk, af);
#pragma unroll
        for (int nn = 0; nn < KW / 16; ++nn) {
          const int key = wn * KW + nn * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
          ldmatrix_x4(tk_u32 + swz8<C::CPR>(key, kk + (lane >> 4)), b[nn]);
          fp8x4_to_pairs<MmaT, CF>(b[nn][0], &lo, &hi);
          mma_16816<MmaT>(s[0][2 * nn], af, lo, hi);
          fp8x4_to_pairs<MmaT, CF>(b[nn][1], &lo, &hi);
          mma_16816<MmaT>(s[0][2 * nn + 1], af, lo, hi);
        }
        qfrag(0, kk + 1, af);
#pragma unroll
        for (int nn = 0; nn < KW / 16; ++nn) {
          fp8x4_to_pairs<MmaT, CF>(b[nn][2], &lo, &hi);
          mma_16816<MmaT>(s[0][2 * nn], af, lo, hi);
          fp8x4_to_pairs<MmaT, CF>(b[nn][3], &lo, &hi);
          mma_16816<MmaT>(s[0][2 * nn + 1], af, lo, hi);
        }
      }
    } else {
      auto s_step = [&](int kk) {
        uint32_t af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) qfrag(mt, kk, af[mt]);
#pragma unroll
        for (int nn = 0; nn < KW / 16; ++nn) {
          uint32_t b[4];
          const int key = wn * KW + nn * 16 + (lane & 7) + ((lane >> 4) << 3);
          ldmatrix_x4(tk_u32 + swz<CPR16>(key, 2 * kk + ((lane >> 3) & 1)), b);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {  // one K fragment for every row tile of the warp
            mma_16816<MmaT>(s[mt][2 * nn], af[mt], b[0], b[1]);
            mma_16816<MmaT>(s[mt][2 * nn + 1], af[mt], b[2], b[3]);
          }
        }
      };
      if constexpr (MT == 1) {
#pragma unroll
        for (int kk = 0; kk < DPAD / 16; ++kk) {
          if (kSkipPadding && kk * 16 >= d) continue;
          s_step(kk);
        }
      } else {
        // Two k-steps per iteration: fully unrolled, ptxas loaded fragments of many k-steps ahead
        // next to the 2 x DPAD / 2 accumulators and spilled (head dim 128); rolled, no load of the
        // next step overlaps this one's mma.
#pragma unroll 2
        for (int kk = 0; kk < DPAD / 16; ++kk) {
          if (kSkipPadding && kk * 16 >= d) continue;
          s_step(kk);
        }
      }
    }

    // Logits (log2 units, masked) and the online-softmax update of both rows of each row tile. The
    // uniform tests sit outside the element loops, so a plain tile without a mask (most tiles of a
    // decode) is one multiply per logit, with no branch between them.
    if (ops.plain && !need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < KW / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][i][e] *= row_plain[mt][e >> 1];
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < KW / 8; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + wn * KW + i * 8 + 2 * t4 + (e & 1);
            const int pos = rid[mt][e >> 1].pos;
            float x = s[mt][i][e];
            if (ops.plain) {
              x *= row_plain[mt][e >> 1];
              if (need_mask && !key_visible(key, pos, ops)) x = -INFINITY;
            } else {
              x = transform_logit(x * row_qk[mt][e >> 1], ops, slope[mt][e >> 1], key, pos, need_mask);
            }
            s[mt][i][e] = x;
          }
        }
      }
    }
    float alpha[MT][2];
    bool rescale = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < KW / 8; ++i) mx = fmaxf(mx, fmaxf(s[mt][i][2 * h], s[mt][i][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m2[mt][h], mx);
        const float base = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: all weights 0
        alpha[mt][h] = exp2f(m2[mt][h] - base);                 // m2 = -inf gives 0
        m2[mt][h] = m_new;
        rescale = rescale || alpha[mt][h] != 1.0f;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < KW / 8; ++i) {
          s[mt][i][2 * h] = exp2f(s[mt][i][2 * h] - base);
          s[mt][i][2 * h + 1] = exp2f(s[mt][i][2 * h + 1] - base);
          sum += s[mt][i][2 * h] + s[mt][i][2 * h + 1];
        }
        dsum[mt][h] = dsum[mt][h] * alpha[mt][h] + sum;  // per-thread partial; the quad sums at the end
      }
    }
    // The output is rescaled only when some row of the warp has a new maximum: alpha is exactly 1
    // otherwise (exp2f(0)), and past the first tiles of a long context the maximum rarely moves, so
    // most tiles skip DPAD / 2 multiplies per thread and row tile. NaN compares unequal and still
    // rescales.
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < DPAD / 8; ++i) {
          o[mt][i][0] *= alpha[mt][0], o[mt][i][1] *= alpha[mt][0];
          o[mt][i][2] *= alpha[mt][1], o[mt][i][3] *= alpha[mt][1];
        }
      }
    }

    if (fix_nonfinite) {
      // Each thread adds, to its output elements (rows rid[mt][0] / [1], columns i * 8 + 2 t4 +
      // {0, 1}), the non-finite values of the keys its rows see, times their probability rounded as
      // the tile product rounds it; then the non-finite values are zeroed for the tile product. P of
      // key i2 * 8 + 2 tq + b of this warp's slice sits in lane (g, tq), s[mt][i2][b] (row
      // rid[mt][0]) and s[mt][i2][2 + b] (row rid[mt][1]).
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const RowId ra = rid[mt][0], rb = rid[mt][1];
#pragma unroll
        for (int i2 = 0; i2 < KW / 8; ++i2) {
          for (int tq = 0; tq < 4; ++tq) {
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              const int src = (lane & ~3) | tq;
              const float pa = round_p<T>(__shfl_sync(0xffffffffu, s[mt][i2][b], src));
              const float pb = round_p<T>(__shfl_sync(0xffffffffu, s[mt][i2][2 + b], src));
              const int kl = wn * KW + i2 * 8 + 2 * tq + b;
              const bool va = ra.valid && key_visible(k0 + kl, ra.pos, ops);
              const bool vb = rb.valid && key_visible(k0 + kl, rb.pos, ops);
              if (!va && !vb) continue;
#pragma unroll
              for (int i = 0; i < DPAD / 8; ++i) {
                if (i * 8 >= dv) continue;
                const uint32_t v2 = *reinterpret_cast<const uint32_t*>(tv + swz<CPR16>(kl, i) + 4 * t4);
                const uint32_t bad = nonfinite2<T>(v2);
                if (bad == 0u) continue;
                const float v0 = bits16_to_float<T>(v2 & 0xffffu), v1 = bits16_to_float<T>(v2 >> 16);
                if (bad & 0xffffu) {
                  if (va) o[mt][i][0] += pa * v0;
                  if (vb) o[mt][i][2] += pb * v0;
                }
                if (bad >> 16) {
                  if (va) o[mt][i][1] += pa * v1;
                  if (vb) o[mt][i][3] += pb * v1;
                }
              }
            }
          }
        }
      }
      __syncthreads();  // every warp has read the values it needed
      zero_nonfinite<T, NT>(tv, KT * DPAD / 8);
      __syncthreads();
    }

    // O += P V: the S accumulators of two adjacent n8 tiles are the A fragment of one k16 step.
#pragma unroll
    for (int kk = 0; kk < KW / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = pack2<MmaT>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = pack2<MmaT>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = pack2<MmaT>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = pack2<MmaT>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
      if constexpr (C::FP8_REGS) {
        // Raw fp8, transposed: matrix j = keys 8 (j & 1) .. + 7 of chunk dn + j / 2, its 16-bit
        // elements value pairs; lane (g, t4) gets keys 2 t4, 2 t4 + 1 (+ 8) of values 2g, 2g + 1 as
        // bytes k0v0 k0v1 k1v0 k1v1, regrouped (byte_perm 0x3120) to (k0v0 k1v0) (k0v1 k1v1): the B
        // fragments of two n8 tiles, the even values of the chunk (o[2 ch], columns 16 ch + 2 n) and
        // the odd ones (o[2 ch + 1]); the epilogue puts the columns back in order. (MT is 1 here.)
#pragma unroll
        for (int dn = 0; dn < DPAD / 16; dn += 2) {
          if (kSkipPadding && dn * 16 >= dv) continue;
          uint32_t b[4];
          const int key = wn * KW + kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
          ldmatrix_x4_trans(tv_u32 + swz8<C::CPR>(key, dn + (lane >> 4)), b);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint32_t e0, o0, e1, o1;
            fp8x4_to_pairs<MmaT, CF>(__byte_perm(b[2 * h], 0u, 0x3120u), &e0, &o0);
            fp8x4_to_pairs<MmaT, CF>(__byte_perm(b[2 * h + 1], 0u, 0x3120u), &e1, &o1);
            mma_16816<MmaT>(o[0][2 * (dn + h)], pa[0], e0, e1);
            mma_16816<MmaT>(o[0][2 * (dn + h) + 1], pa[0], o0, o1);
          }
        }
      } else {
#pragma unroll
        for (int dn = 0; dn < DPAD / 16; ++dn) {  // V is zero past head_dim_v (see S above)
          if (kSkipPadding && dn * 16 >= dv) continue;
          uint32_t b[4];
          const int key = wn * KW + kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
          ldmatrix_x4_trans(tv_u32 + swz<CPR16>(key, 2 * dn + (lane >> 4)), b);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {  // one V fragment for every row tile of the warp
            mma_16816<MmaT>(o[mt][2 * dn], pa[mt], b[0], b[1]);
            mma_16816<MmaT>(o[mt][2 * dn + 1], pa[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // Epilogue: per-warp states to shared memory, then passes over the rows. The other kernels overlay the
  // stages with the buffer (free once every copy has landed and every warp is past its last tile) and make
  // one pass; the persistent one leaves its next run's copies in flight and passes its own EPI_CW-column
  // buffer over the columns (only those below head_dim_v past the first).
  if constexpr (!C::PERSIST) cp_async_wait<0>();
  __syncthreads();
  float* eo = reinterpret_cast<float*>(smem + C::EPI_OFF);
  constexpr int CW = C::EPI_CW, STRIDE = CW + 4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      dsum[mt][h] += __shfl_xor_sync(0xffffffffu, dsum[mt][h], 1);
      dsum[mt][h] += __shfl_xor_sync(0xffffffffu, dsum[mt][h], 2);
    }
  }
#pragma unroll
  for (int c0 = 0; c0 < DPAD; c0 += CW) {
    if (c0 > 0) {
      if (c0 >= dv) break;
      __syncthreads();  // every thread has read the last pass's columns
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int r0 = wn * ROWS + (wm * MT + mt) * 16 + g;
      if constexpr (C::FP8_REGS) {
        // o[2 ch] holds columns 16 ch + 4 t4 + {0, 2}, o[2 ch + 1] columns 16 ch + 4 t4 + {1, 3} (PV).
#pragma unroll
        for (int ch = 0; ch < DPAD / 16; ++ch) {
          if (ch * 16 < c0 || ch * 16 >= c0 + CW) continue;
          const float* e = o[mt][2 * ch];
          const float* x = o[mt][2 * ch + 1];
          float* at = eo + r0 * STRIDE + ch * 16 - c0 + 4 * t4;
          *reinterpret_cast<float4*>(at) = make_float4(e[0], x[0], e[1], x[1]);
          *reinterpret_cast<float4*>(at + 8 * STRIDE) = make_float4(e[2], x[2], e[3], x[3]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < DPAD / 8; ++i) {
          if (i * 8 < c0 || i * 8 >= c0 + CW) continue;
          float* at = eo + r0 * STRIDE + i * 8 - c0 + 2 * t4;
          *reinterpret_cast<float2*>(at) = make_float2(o[mt][i][0], o[mt][i][1]);
          *reinterpret_cast<float2*>(at + 8 * STRIDE) = make_float2(o[mt][i][2], o[mt][i][3]);
        }
      }
      if (c0 == 0 && t4 == 0) {
        em[r0] = m2[mt][0], ed[r0] = dsum[mt][0];
        em[r0 + 8] = m2[mt][1], ed[r0 + 8] = dsum[mt][1];
      }
    }
    __syncthreads();
    finalize_rows<T, ROWS, DPAD, C::WN, NT, CW>(a, w, eo, em, ed,
                                                kLateVMul ? p.kv.v_scale_of(w.kv_head) * unit : v_mul, c0);
  }
  if constexpr (C::PERSIST) {
    if (S > 1) {
      // The run's other splits: empty partials (lse -inf), which the merge skips; then the run arrives as
      // all of its splits at once.
      for (int idx = tid; idx < ROWS * (run_units - 1); idx += NT) {
        const RowId id = row_id(a, w, idx % ROWS);
        const int64_t split = w.split + 1 + idx / ROWS;
        if (id.valid) a.part_lse[(split * p.num_tokens + id.token) * p.num_heads + id.head] = -INFINITY;
      }
      merge_if_last<T, NT>(a, w, u_run / S, run_units);
    }
    g0 += ntiles;
    u_run += run_units;
    if (u_run >= u_end) break;
    run_units = make_run(u_run, w);
  } else {
    if constexpr (C::FUSED_MERGE) {
      if (S > 1) merge_if_last<T, NT>(a, w, decode_item(blockIdx.x, blockIdx.y, gridDim.y), 1);
    }
    break;
  }
  }  // runs
}

}  // namespace kvkernels::attn_cuda
