// Device code shared by the CUDA paged-attention kernels (attention_simt.cuh, attention_mma.cuh,
// attention_merge.cuh). Torch-free: the kernels see only the AttentionParams of
// kvkernels/params.h (raw pointers, element strides, sizes) plus the launch plan below.
//
// Work decomposition (one CTA = one work item, all index math from shapes, never a host read of
// device data):
//   blockIdx.x  query tile: decode (query_start_loc == nullptr) = the sequence; varlen = a tile of
//               up to `q_tile` consecutive queries of one sequence (see make_work),
//   blockIdx.y  kv head * head_chunks + chunk: the CTA's rows are `q_tile` queries x up to
//               `heads_per_cta` query heads of that kv head's GQA group, so each K/V byte a CTA
//               reads serves every query head of its group,
//   blockIdx.z  KV split: the visible keys of the tile are cut into `num_splits` ranges of whole
//               key tiles; with more than one split each CTA writes a normalized partial
//               (out, lse) to the workspace and attention_merge.cuh combines them exactly.
// Rows of a CTA: row r = query r / heads_per_cta, head r % heads_per_cta of the chunk.
//
// Logits are kept in log2 units inside the kernels (x * log2 e, exp2f); lse is converted to the
// natural log only when written to the output. The sink joins the denominator only where the
// full softmax is known: in the finalization of an unsplit CTA or in the merge kernel.
#pragma once

#include <cuda.h>  // CUtensorMap (Sm90KvTma; nothing links libcuda)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kvkernels/params.h"
#include "kvkernels/softmax.h"

namespace kvkernels::attn_cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------------
// Launch plan and kernel geometry (host and device)
// ---------------------------------------------------------------------------------------------

enum class Path : int {
  kSimt = 0,        // CUDA-core kernel: every dtype, the only one for float32 queries
  kMmaDecode = 1,   // tensor cores, 16 rows per CTA, warps split the keys of each tile; "wide"
                    // (the default): 64 keys per stage (32 at head dim 256), room for 2 stages at
                    // head dim 128 / 256
  kMmaPrefill = 2,  // tensor cores, 64 rows per CTA (4 warps x 16 rows), 1 warp per row block;
                    // "wide" (the default): 64 keys per stage (32 at head dim 256): 32 KiB stages,
                    // 2 of them at head dim 128 / 256
  kMmaDecodeDeep = 3,  // the decode kernel's "deep" configuration, kept for A/B runs
                       // (KVKERNELS_CUDA_ATTN_PATH=mma-decode-deep): few keys per stage, 4 stages
                       // in flight at every head dim; 0.82x the wide one on an H100 (bf16,
                       // benchmarks/results/gpu-20261126-h100)
  kMmaPrefillDeep = 4,  // the prefill kernel's "deep" configuration, kept for A/B runs
                        // (KVKERNELS_CUDA_ATTN_PATH=mma-prefill-deep): 16 KiB 16-bit stages (64 /
                        // 32 / 16 keys at head dim 64 / 128 / 256), 4 stages; 0.83x the wide one
  kMmaDecodeFp8Smem = 5,  // fp8 caches only: the wide decode kernel with each fp8 stage dequantized
                          // into a 16-bit shared-memory tile (the method before the decode kernels
                          // converted their fragments in registers), kept for A/B runs
                          // (KVKERNELS_CUDA_ATTN_PATH=mma-decode-fp8-smem)
  kMmaPrefillTall = 6,  // the prefill kernel with 2 row tiles per warp (32 rows, 128 per CTA), so
                        // each K / V fragment read from shared memory feeds two mma instead of one;
                        // 32 keys per stage (4 stages); where has_tall_prefill() only. Not yet run
                        // on a GPU; selectable for A/B runs (KVKERNELS_CUDA_ATTN_PATH=mma-prefill-tall)
  kWgmmaPrefill = 7,  // sm_90a only (attention_sm90.cuh): wgmma, a producer warpgroup gathering K / V
                      // by cp.async into an mbarrier ring, two consumer warpgroups of 64 rows (128 per
                      // CTA), 128-key tiles; 16-bit caches, head dims <= 128, varlen. Opt-in
                      // (KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill), not yet run on a GPU; elsewhere the
                      // planner runs the wide prefill (wgmma_prefill_unsupported, attention.cu)
  kMmaDecodeOcc3 = 8,   // the wide decode kernel held to the registers of 3 CTAs per SM (__launch_bounds__
                        // (NT, 3): the query fragments are read from shared memory at every k-step instead
                        // of held in registers), the planner's splits counting 3 resident CTAs where shared
                        // memory holds them: more warps and tiles in flight per SM. Opt-in
                        // (KVKERNELS_CUDA_ATTN_PATH=mma-decode-occ3), not yet run on a GPU
  kMmaDecodeFused = 9,  // the wide decode kernel that issues its first tiles before it loads the queries and,
                        // with splits, merges a work item's partials in the last of its CTAs to finish (an
                        // arrival counter per item in the workspace, zeroed before the launch) instead of a
                        // merge kernel. Opt-in (KVKERNELS_CUDA_ATTN_PATH=mma-decode-fused), not yet run on a GPU
  kWgmmaPrefillOverlap = 10,  // the same kernel with intra-warpgroup overlap (S of tile j + 1 issued
                             // before the softmax of tile j ends: two S accumulators; attention_sm90.cuh,
                             // OVERLAP); opt-in (KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill-overlap) for the
                             // A/B, where has_wgmma_overlap(); elsewhere kWgmmaPrefill. Not yet run on a GPU
  kMmaDecodePersistent = 11,  // the fused decode kernel made persistent: a grid of the resident CTA slots, each
                              // walking a static contiguous range of (work item, split) units, its cp.async
                              // pipeline running on across work items (the next item's block ids and first
                              // tiles issued before this one's epilogue); the fused kernel's last-arrival merge.
                              // Opt-in (KVKERNELS_CUDA_ATTN_PATH=mma-decode-persistent), not yet run on a GPU
  kWgmmaPrefillPersistent = 12,  // the same kernel, persistent (PERSIST): min(work items, SMs) CTAs, each walking
                                 // work items longest-first (a snake over the grid), the stage ring running on
                                 // across items; its overlapped loop where has_wgmma_overlap(), the plain one at
                                 // 256. Opt-in (KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill-persistent). Not yet run
                                 // on a GPU
};

// Everything a kernel needs: the validated params and the host-side plan.
struct AttnArgs {
  AttentionParams p;
  int group = 1;          // query heads per kv head
  int heads_per_cta = 1;  // hc: query heads of one group handled by one CTA
  int head_chunks = 1;    // ceil(group / hc)
  int q_tile = 1;         // queries per CTA (varlen); 1 for decode
  int num_splits = 1;
  int bs_shift = -1;      // log2(block_size) when it is a power of two, else -1
  int kv_aligned = 0;     // K/V rows 16-byte aligned: cp.async; else plain element loads
  int q_aligned = 0;      // query rows 16-byte aligned: 16-byte loads
  float* part_o = nullptr;    // [num_splits, num_tokens, num_heads, head_dim_v] (num_splits > 1)
  float* part_lse = nullptr;  // [num_splits, num_tokens, num_heads], log2 units
  int work_x = 0, work_y = 0, work_z = 0;  // Path::kWgmmaPrefillPersistent: the work items' grid (x, y, z as a
                                           // CTA per item would have them); the launch grid is min(items, SMs)
  unsigned* arrivals = nullptr;  // Path::kMmaDecodeFused / kMmaDecodePersistent with splits: one counter per
                                 // work item (decode_item), zero at the launch
};

// A decode work item's index (seq = blockIdx.x, y = blockIdx.y of the one-CTA-per-split grid): the fused
// and persistent decodes' arrival counter, and the persistent decode's unit order (unit u = split
// u % num_splits of item u / num_splits). Sequence-major: a sequence's kv heads are neighbours.
__host__ __device__ inline int64_t decode_item(int64_t seq, int y, int grid_y) { return seq * grid_y + y; }

// Decode KV splits (the paged-attention and MLA planners): CTAs of equal work run in waves of `slots`
// (SMs x resident CTAs), so the time of s splits of `items` work items over `tiles` key tiles is about
// waves(s) x (tiles / s + kCtaOverheadTiles) + (s > 1 ? kMergeTiles : 0) key-tile times, with
// waves(s) = ceil(items x s / slots): a CTA's fixed work (query load, pipeline fill, epilogue) and the
// merge pass, in tile times. Returns the count in [1, most] with the least such time, the smallest on
// ties. Example (H200, 132 SMs, deep decode at head dim 128: 3 CTAs per SM, 396 slots): 64 sequences x 8
// kv heads over 4096 keys (128 tiles) run as 3 splits, 4 waves of 1536 CTAs, not 2 waves of 512 whose
// second is 29% full; 1 sequence x 8 heads over 32768 keys as 49 splits (392 CTAs, one wave).
constexpr int64_t kCtaOverheadTiles = 2;
constexpr int64_t kMergeTiles = 1;
inline int64_t choose_splits(int64_t items, int64_t tiles, int64_t slots, int64_t most) {
  int64_t best = 1, best_cost = -1;
  for (int64_t s = 1; s <= most; ++s) {
    const int64_t waves = (items * s + slots - 1) / slots;
    const int64_t cost = waves * ((tiles + s - 1) / s + kCtaOverheadTiles) + (s > 1 ? kMergeTiles : 0);
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// The persistent decode's splits (Path::kMmaDecodePersistent): `slots` CTAs walk the items x s units in
// static contiguous ranges, the units of one item in a range as one run (one state, one partial), and a
// run's prologue overlaps the previous run's last tiles; so a CTA costs about its units' tiles, ceil(items x
// s / slots) x ceil(tiles / s), with no per-CTA fixed cost, plus the merge with s > 1. Returns the count in
// [1, most] with the least such time, the smallest on ties (H200, 264 slots: 1 at b64 x 4k, 2 items of 64
// tiles per CTA as the wide decode's 2 waves; 32 at b1 x 32k, 16 tiles per CTA as the wide decode).
inline int64_t choose_persistent_splits(int64_t items, int64_t tiles, int64_t slots, int64_t most) {
  int64_t best = 1, best_cost = -1;
  for (int64_t s = 1; s <= most; ++s) {
    const int64_t cost = (items * s + slots - 1) / slots * ((tiles + s - 1) / s) + (s > 1 ? kMergeTiles : 0);
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// Block ids from a block table are checked where the copy that uses them is issued (a tile after
// they are loaded: a check right after the load would stall the warp for its latency): valid ids
// are in [0, num_blocks), and as unsigned, negative ones wrap to >= 2^31, so one compare against
// block_id_limit() = min(num_blocks, 2^31) decides.
__host__ __device__ inline uint32_t block_id_limit(const paged_kv_t& kv) {
  return kv.num_blocks > (int64_t(1) << 31) ? (1u << 31) : uint32_t(kv.num_blocks);
}
__host__ __device__ inline bool block_id_ok(int id, uint32_t limit) {
  return uint32_t(id) < limit;
}

// log2(block_size) when it is a power of two, else -1 (AttnArgs::bs_shift: shifts instead of
// divisions when locating a key's block and slot).
__host__ __device__ constexpr int block_shift(int bs) {
  if (bs <= 0 || (bs & (bs - 1)) != 0) return -1;
  int s = 0;
  while ((1 << s) != bs) ++s;
  return s;
}

// Padded head dim the kernels are instantiated for: every head dim that is a multiple of 8 runs on
// the smallest of 64 / 128 / 256 that holds it (columns past head_dim are zero-filled). With a
// value head dim different from the key's, both run on the padding of the larger one.
__host__ __device__ constexpr int dpad_of(int head_dim) { return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }

__host__ __device__ constexpr int cache_esize(CacheFormat f) {
  return f == CacheFormat::kFloat32 ? 4
         : (f == CacheFormat::kFloat16 || f == CacheFormat::kBFloat16) ? 2
                                                                        : 1;
}

__host__ __device__ constexpr bool is_mma_decode(Path path) {
  return path == Path::kMmaDecode || path == Path::kMmaDecodeDeep || path == Path::kMmaDecodeFp8Smem ||
         path == Path::kMmaDecodeOcc3 || path == Path::kMmaDecodeFused || path == Path::kMmaDecodePersistent;
}

__host__ __device__ constexpr bool is_mma_prefill(Path path) {
  return path == Path::kMmaPrefill || path == Path::kMmaPrefillDeep || path == Path::kMmaPrefillTall;
}

// The sm_90a wgmma prefill, with or without intra-warpgroup overlap (one kernel, attention_sm90.cuh).
__host__ __device__ constexpr bool is_wgmma_prefill(Path path) {
  return path == Path::kWgmmaPrefill || path == Path::kWgmmaPrefillOverlap || path == Path::kWgmmaPrefillPersistent;
}

// Does the wgmma prefill's overlapped loop exist at this padded head dim? 64 / 128 (every cache format).
// At 256 the consumers would hold O (128 floats), S (32) and P in flight (16) at once; the planner runs
// the non-overlapped loop there (csrc/cuda/README.md, "Intra-warpgroup overlap").
__host__ __device__ constexpr bool has_wgmma_overlap(int dpad) { return dpad <= 128; }

// Rows (query x head pairs) per CTA.
__host__ __device__ constexpr int rows_of(Path path) {
  return path == Path::kMmaPrefillTall || is_wgmma_prefill(path) ? 128 : is_mma_prefill(path) ? 64 : 16;
}

// Does the tall prefill exist for this cache format and padded head dim? 16-bit caches at head dims
// 64 / 128: at 128 the kernel is at 250-255 registers, and with the fp8 conversion in its loop it
// spilled on sm_80. The planner runs the wide prefill elsewhere; the launcher instantiates it here only.
__host__ __device__ constexpr bool has_tall_prefill(CacheFormat f, int dpad) {
  return cache_esize(f) == 2 && dpad <= 128;
}

// Row tiles of 16 per warp of the tensor-core kernels: 2 in the tall prefill, else 1.
// Padded head dims with a persistent decode (Path::kMmaDecodePersistent): 64 and 128. At 256 its loader's
// state across work items took the kernel to 255 registers with a spill (ptxas, sm_90a, bf16), where the
// wide kernel is at 251: the planner runs the wide decode there (docs/ops.md).
__host__ __device__ constexpr bool has_persistent_decode(int dpad) { return dpad <= 128; }

__host__ __device__ constexpr int mma_mt(Path path) { return path == Path::kMmaPrefillTall ? 2 : 1; }

// Warps of the tensor-core kernels: (WM row blocks of 16) x (WN key slices of 16 keys each).
// Decode: a stage holds 16 * WN keys of K and V. The wide configuration (the default) keeps 4 slices
// (2 at head dim 256): 32 KiB stages in 16 bits at head dim 128 / 256, so only 2 fit the 64 KiB
// pipeline budget and the loop waits for every copy in flight before it issues the next tile. The
// deep one keeps the stage at 16 KiB in 16 bits (8 KiB raw fp8) at every head dim, 64 x 64, 32 x 128
// or 16 x 256, so 4 stages fit: 3 tiles in flight while one is computed. Each warp's work per tile
// (16 keys of the full row) is the same in both, only the CTA is narrower. Measured on an H100
// (bf16, head dim 128), the wide one is the faster: 1.22x at b64 x 4k and b1 x 32k.
// Prefill: 4 row blocks (64 rows), each warp walks every key of the tile. The wide configuration
// (the default) has 64 keys per stage (32 at head dim 256): 32 KiB 16-bit stages at head dim 128 /
// 256, 2 stages, and a wait for every copy before the next issue. The deep one keeps the stage at
// 16 KiB (64 x 64, 32 x 128, 16 x 256 keys x dims), 4 stages; 0.83x the wide one on the H100.
__host__ __device__ constexpr int mma_wm(Path path) { return is_mma_prefill(path) ? 4 : 1; }
__host__ __device__ constexpr int mma_wn(Path path, int dpad) {
  return is_mma_prefill(path)            ? 1
         : path == Path::kMmaDecodeDeep ? (dpad == 64 ? 4 : dpad == 128 ? 2 : 1)
                                         : (dpad == 256 ? 2 : 4);
}

// Keys per pipeline stage.
// The sm_90a wgmma prefill's key tile (the n of S = Q K^T): 128 keys at padded head dims 64 / 128, 64
// at 256 (shared memory: csrc/cuda/README.md, "Head dim 256 on the wgmma prefill").
__host__ __device__ constexpr int sm90_key_tile(int dpad) { return dpad == 256 ? 64 : 128; }

__host__ __device__ constexpr int key_tile_of(Path path, int dpad) {
  return is_wgmma_prefill(path)           ? sm90_key_tile(dpad)
         : path == Path::kSimt            ? (dpad == 256 ? 16 : 32)
         : is_mma_decode(path)            ? 16 * mma_wn(path, dpad)
         : path == Path::kMmaPrefillDeep ? 64 * 64 / dpad  // 16 KiB of 16-bit K + V
         : path == Path::kMmaPrefillTall ? 32  // 2 x 16 S registers per row tile pair
                                          : (dpad == 256 ? 32 : 64);
}

__host__ __device__ constexpr int threads_of(Path path, int dpad) {
  return is_wgmma_prefill(path) ? 384 : path == Path::kSimt ? 128 : 32 * mma_wm(path) * mma_wn(path, dpad);
}

// Pipeline depth: as many stages as fit in 64 KiB next to the conversion buffer, 2 to 4.
__host__ __device__ constexpr int pipeline_stages(int stage_bytes, int cvt_bytes) {
  return (65536 - cvt_bytes) / stage_bytes < 2   ? 2
         : (65536 - cvt_bytes) / stage_bytes > 4 ? 4
                                                 : (65536 - cvt_bytes) / stage_bytes;
}

// Every kernel fits the smallest opt-in shared memory of sm_80+ parts (99 KiB on sm_86 / sm_89).
constexpr int kMaxSmem = 99 * 1024;

// Dynamic shared memory of the sm_90a wgmma prefill (Sm90Cfg::SMEM, attention_sm90.cuh, asserts the
// layout adds up to it): Q 128 rows, 4 / 2 / 2 stages (padded head dim 64 / 128 / 256) of K and V
// tiles of sm90_key_tile keys (16-bit), the non-finite fix-up's 16-bit P of 2 x 64 rows, 3 mbarriers
// per stage, 1 KiB to align the base to 1024 bytes; over an fp8 cache also one raw fp8 K and V tile
// (key tile x dpad bytes each) that the producer gathers into and dequantizes from. 177 / 193 / 209
// KiB (16-bit caches), 193 / 225 / 241 KiB (fp8: too much at 256, which the planner does not take):
// sm_90 parts only (227 KiB opt-in).
__host__ __device__ constexpr int sm90_prefill_stages(int dpad) { return dpad == 64 ? 4 : 2; }
__host__ __device__ constexpr int sm90_prefill_smem(int dpad, bool fp8) {
  return 128 * dpad * 2 + sm90_prefill_stages(dpad) * 2 * sm90_key_tile(dpad) * dpad * 2 +
         2 * 64 * sm90_key_tile(dpad) * 2 + (fp8 ? 2 * sm90_key_tile(dpad) * dpad : 0) +
         3 * sm90_prefill_stages(dpad) * 8 + 1024;
}

// ---------------------------------------------------------------------------------------------
// Small device helpers
// ---------------------------------------------------------------------------------------------

template <FloatFormat F>
struct QType;
template <>
struct QType<FloatFormat::kFloat32> { using type = float; };
template <>
struct QType<FloatFormat::kFloat16> { using type = __half; };
template <>
struct QType<FloatFormat::kBFloat16> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two floats packed as one 32-bit register of two 16-bit values (x in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float x, float y);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Two 16-bit values of one register as floats.
__device__ __forceinline__ float2 unpack2_half(uint32_t u) {
  __half2 h = *reinterpret_cast<__half2*>(&u);
  return __half22float2(h);
}
__device__ __forceinline__ float2 unpack2_bf16(uint32_t u) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}

// ---- fp8 -> fp16 conversion (exact) ------------------------------------------------------------
// e5m2 is the top byte of an fp16. e4m3: sm_89 and newer convert a pair in one instruction
// (cvt.rn.f16x2.e4m3x2: exact, NaN kept NaN); the CPU emulator of these kernels models that
// instruction (::emu::cvt_f16x2_e4m3x2). Older GPUs use bits: an e4m3 byte b maps to the fp16 whose
// bits are sign | (b & 0x7f) << 7, which is the e4m3 value times 2^-8 (normals and subnormals
// alike, and every e4m3 value is exactly representable that way); NaN (0x7f / 0xff) is kept NaN.
// There the factor 256 is folded into the k/v multipliers (fp8_unit below). The hardware
// conversion is one instruction per pair where the bits take about eight (the e4m3 decode's
// shared-memory tile conversion was its largest cost in the H100 profile, scripts/probe/ncu_hot.py).
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890) || defined(KVKERNELS_CUDA_EMU)
#define KVK_E4M3_CVT 1
#else
#define KVK_E4M3_CVT 0
#endif

// Bytes 0,1 (sel 0x1404) or 2,3 (sel 0x3424) of w, each as the high byte of a 16-bit lane.
__device__ __forceinline__ uint32_t fp8_pair_hi(uint32_t w, uint32_t sel) {
  return __byte_perm(w, 0u, sel);
}

template <CacheFormat CF>
__device__ __forceinline__ uint32_t fp8x2_to_half2_bits(uint32_t hi_bytes) {
  if constexpr (CF == CacheFormat::kFp8E5M2) {
    return hi_bytes;
  } else {
    const uint32_t sign = hi_bytes & 0x80008000u;
    const uint32_t mag = (hi_bytes & 0x7f007f00u) >> 1;
    const uint32_t nan = __vcmpeq2(mag, 0x3f803f80u) & 0x7c007c00u;
    return sign | mag | nan;
  }
}

#if KVK_E4M3_CVT
// Two e4m3 values (the low 16 bits of `pair`, element 0 in the low byte) -> half2 bits, exact.
__device__ __forceinline__ uint32_t cvt_e4m3x2(uint32_t pair) {
#if defined(KVKERNELS_CUDA_EMU)
  return ::emu::cvt_f16x2_e4m3x2(pair & 0xffffu);
#else
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(static_cast<unsigned short>(pair)));
  return h;
#endif
}
#endif

// 4 fp8 values (one 32-bit word, element 0 in the low byte) -> 2 registers of half2, in units of
// fp8_unit<CF>().
template <CacheFormat CF>
__device__ __forceinline__ void fp8x4_to_half2x2(uint32_t w, uint32_t* lo, uint32_t* hi) {
#if KVK_E4M3_CVT
  if constexpr (CF == CacheFormat::kFp8E4M3) {
    *lo = cvt_e4m3x2(w);
    *hi = cvt_e4m3x2(w >> 16);
    return;
  }
#endif
  *lo = fp8x2_to_half2_bits<CF>(fp8_pair_hi(w, 0x1404u));
  *hi = fp8x2_to_half2_bits<CF>(fp8_pair_hi(w, 0x3424u));
}

// 4 fp8 values -> 2 registers of T pairs (elements 0, 1 and 2, 3), in units of fp8_unit<CF>();
// exact (every fp8 value is a bf16 value).
template <typename T, CacheFormat CF>
__device__ __forceinline__ void fp8x4_to_pairs(uint32_t w, uint32_t* lo, uint32_t* hi) {
  fp8x4_to_half2x2<CF>(w, lo, hi);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const float2 a = unpack2_half(*lo), b = unpack2_half(*hi);
    *lo = pack2<__nv_bfloat16>(a.x, a.y), *hi = pack2<__nv_bfloat16>(b.x, b.y);
  }
}

// What one unit of a converted fp8 value is worth: e4m3 values converted through bits come out
// times 2^-8.
template <CacheFormat CF>
__host__ __device__ constexpr float fp8_unit() {
  return CF == CacheFormat::kFp8E4M3 && !KVK_E4M3_CVT ? 256.0f : 1.0f;
}

// ---- PTX wrappers ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
#if defined(KVKERNELS_CUDA_EMU)
  return ::emu::smem_u32(p);
#else
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
}

// 16-byte global -> shared copy; bytes past src_bytes (0..16) are zero-filled and not read.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::cp_async16(smem, gmem, src_bytes);
#else
  (void)smem, (void)gmem, (void)src_bytes;
#endif
}

// The same with the destination as a shared-window address (smem_u32 of a pointer), for loops
// that convert their stage's pointer once.
__device__ __forceinline__ void cp_async16_at(uint32_t smem_addr, const void* gmem, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes)
               : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::cp_async16(::emu::shared_at(smem_addr, 16), gmem, src_bytes);
#else
  (void)smem_addr, (void)gmem, (void)src_bytes;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::cp_async_commit();
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::cp_async_wait(N);
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t* r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::ldmatrix_x4(addr, r, false);
#else
  (void)addr, r[0] = r[1] = r[2] = r[3] = 0;
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t* r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::ldmatrix_x4(addr, r, true);
#else
  (void)addr, r[0] = r[1] = r[2] = r[3] = 0;
#endif
}

// d += a * b for one m16n8k16 tile, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::mma_16816(d, a, b0, b1, std::is_same_v<T, __half>);
#else
  (void)d, (void)a, (void)b0, (void)b1;
#endif
}

// ---------------------------------------------------------------------------------------------
// Work items
// ---------------------------------------------------------------------------------------------

struct Work {
  int seq = 0;
  int q_len = 0, q0 = 0, nq = 0;  // queries of the sequence, first query and count of this CTA
  int64_t token0 = 0;             // token of query 0 of the sequence
  int seq_len = 0;
  int pos0 = 0;                   // position of query q0 (bottom-right alignment; < 0 for the
                                  // leading rows of a sequence with more queries than keys)
  int lo = 0, hi = -1;            // keys the CTA's rows may see: [lo, hi] (causal: hi is the
                                  // last row's position; else the sequence's last key)
  int kv_head = 0, head0 = 0, nh = 0;  // kv head; first query head and count of this CTA
  int split = 0;
  int tile_begin = 0, tile_end = 0;    // key tiles [tile_begin, tile_end) of this split
};

// Fills the work item of this CTA; false when the CTA has no queries (a padding tile of varlen).
// Varlen tiles: sequence s owns tiles [start(s), start(s + 1)) with
// start(s) = floor((qsl[s] + s * (q_tile - 1)) / q_tile), at least ceil(q_len(s) / q_tile) of
// them; the grid has start(num_seqs) = (num_tokens + num_seqs * (q_tile - 1)) / q_tile tiles, so
// the grid size depends on shapes only. Index tensors are read defensively (clamped), so bad input
// gives wrong numbers at worst, never an out-of-bounds access.
// make_work_tile: the same for query tile `tile` (after the varlen reversal below; decode: sequence `tile`),
// kv head / chunk `y` and the run of splits [s0, s1) of the item, whose key tiles are contiguous (split s0's
// first to split s1 - 1's last) and whose state is written as split s0's partial: the persistent decode
// (Path::kMmaDecodePersistent) and the MLA decode's metadata plan (mla_sched.cuh) name their work items
// themselves, several per CTA.
template <int KT>
__device__ __forceinline__ bool make_work_tile(const AttnArgs& a, Work& w, int tile, int y, int s0, int s1) {
  const AttentionParams& p = a.p;
  const int64_t num_seqs = p.kv.num_seqs;
  if (p.query_start_loc == nullptr) {
    w.seq = tile;
    w.q_len = 1;
    w.q0 = 0;
    w.token0 = tile;
  } else {
    const int32_t* qsl = p.query_start_loc;
    const int64_t T = a.q_tile;
    int lo = 0, hi = static_cast<int>(num_seqs) - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      const int64_t start = (int64_t(qsl[mid]) + int64_t(mid) * (T - 1)) / T;
      if (start <= tile) lo = mid; else hi = mid - 1;
    }
    const int64_t start = (int64_t(qsl[lo]) + int64_t(lo) * (T - 1)) / T;
    w.seq = lo;
    w.token0 = qsl[lo];
    w.q_len = qsl[lo + 1] - qsl[lo];
    const int64_t q0 = (int64_t(tile) - start) * T;
    if (q0 < 0 || q0 >= w.q_len) return false;
    w.q0 = static_cast<int>(q0);
  }
  w.nq = min(a.q_tile, w.q_len - w.q0);

  const int64_t capacity = p.kv.max_blocks_per_seq * p.kv.block_size;
  int64_t len = p.kv.seq_lens[w.seq];
  len = len < 0 ? 0 : (len > capacity ? capacity : len);
  w.seq_len = static_cast<int>(len);
  w.pos0 = w.seq_len - w.q_len + w.q0;
  w.hi = p.causal ? w.pos0 + w.nq - 1 : w.seq_len - 1;
  w.lo = 0;
  if (p.window_left >= 0) {
    const int64_t lo = int64_t(w.pos0) - p.window_left;
    w.lo = lo < 0 ? 0 : static_cast<int>(lo);
  }

  const int chunk = y % a.head_chunks;
  w.kv_head = y / a.head_chunks;
  w.head0 = w.kv_head * a.group + chunk * a.heads_per_cta;
  w.nh = min(a.heads_per_cta, a.group - chunk * a.heads_per_cta);
  w.split = s0;

  w.tile_begin = w.tile_end = 0;
  if (w.hi >= w.lo && w.nq > 0) {
    const int64_t first = w.lo / KT, n = w.hi / KT - first + 1;
    w.tile_begin = static_cast<int>(first + n * s0 / a.num_splits);
    w.tile_end = static_cast<int>(first + n * s1 / a.num_splits);
  }
  return true;
}

// The work item of this CTA (blockIdx): one split. Varlen: the last tiles of a sequence see the most keys
// (causal), so they are scheduled first.
template <int KT>
__device__ __forceinline__ bool make_work(const AttnArgs& a, Work& w) {
  const int tile = a.p.query_start_loc ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : blockIdx.x;
  return make_work_tile<KT>(a, w, tile, blockIdx.y, blockIdx.z, blockIdx.z + 1);
}

// Query tile `tile` (decode: sequence `tile`) with this CTA's head chunk and split.
template <int KT>
__device__ __forceinline__ bool make_work_at(const AttnArgs& a, Work& w, int tile) {
  return make_work_tile<KT>(a, w, tile, blockIdx.y, blockIdx.z, blockIdx.z + 1);
}

struct RowId {
  bool valid;
  int64_t token;
  int head;
  int pos;  // query position; rows that are not valid get the CTA's last position (harmless)
};

__device__ __forceinline__ RowId row_id(const AttnArgs& a, const Work& w, int r) {
  const int qi = r / a.heads_per_cta, hh = r - qi * a.heads_per_cta;
  RowId id;
  id.token = w.token0 + w.q0 + qi;
  id.head = w.head0 + hh;
  id.valid = qi < w.nq && hh < w.nh && id.token >= 0 && id.token < a.p.num_tokens;
  id.pos = id.valid ? w.pos0 + qi : w.hi;
  return id;
}

// Logit of one key for one row, natural units in, log2 units out: soft cap, ALiBi, mask
// (docs/ops.md order: scale first, already applied by the caller through qk_mul).
struct LogitOps {
  float cap, inv_cap;  // cap <= 0: off
  int window;          // < 0: off
  bool causal;         // false: a row sees every key up to `last` (the window's lower bound applies)
  int last;            // the sequence's last key (w.hi when not causal); keys past it are masked
  bool alibi;
  bool plain;          // no cap, no ALiBi
};

__device__ __forceinline__ LogitOps logit_ops(const AttentionParams& p, const Work& w) {
  LogitOps o;
  o.cap = p.soft_cap;
  o.inv_cap = p.soft_cap > 0.0f ? 1.0f / p.soft_cap : 0.0f;
  o.window = p.window_left;
  o.causal = p.causal;
  o.last = w.seq_len - 1;
  o.alibi = p.alibi_slopes != nullptr;
  o.plain = !(p.soft_cap > 0.0f) && !o.alibi;
  return o;
}

__device__ __forceinline__ bool key_visible(int key, int pos, const LogitOps& o) {
  return key <= (o.causal ? pos : o.last) && (o.window < 0 || key >= pos - o.window);
}

// x: raw logit times qk_mul (= scale * k_scale). Returns the log2-unit logit, -inf if masked.
__device__ __forceinline__ float transform_logit(float x, const LogitOps& o, float slope, int key,
                                                 int pos, bool mask) {
  if (!o.plain) {
    if (o.cap > 0.0f) x = o.cap * tanhf(x * o.inv_cap);
    if (o.alibi) x = fmaf(slope, static_cast<float>(key - pos), x);
  }
  x *= kLog2e;
  if (mask && !key_visible(key, pos, o)) x = -INFINITY;
  return x;
}

// Does some key of the tile [k0, k0 + KT) need a mask for some row of the CTA? (Causal: keys
// past the first row's position; otherwise keys past the sequence's end. Window: keys before the
// last row's lower bound.)
__device__ __forceinline__ bool tile_needs_mask(const Work& w, int k0, int kt, const LogitOps& o) {
  const int last_pos = w.pos0 + w.nq - 1;
  return k0 + kt - 1 > (o.causal ? w.pos0 : o.last) || (o.window >= 0 && k0 < last_pos - o.window);
}

// ---------------------------------------------------------------------------------------------
// Paged K/V tile loader
// ---------------------------------------------------------------------------------------------

// Loads keys [tile * KT, tile * KT + KT) of one kv head into shared memory, K and V, as 16-byte
// chunks of raw cache elements: chunk c (0 <= c < CPR) of tile row r goes to `off(r, c)` bytes
// past the K / V destination. Rows whose key lies outside [w.lo, w.hi] or whose block id is out of
// range, and bytes past head_dim (K) / head_dim_v (V), are zero-filled (never read from global
// memory), so the padded columns add 0 to the logits and to the output, and NaN in
// unused cache slots never reaches the math. Each thread owns one chunk column and RPT rows; the
// block ids of the next tile are fetched one iteration ahead (fetch) so the cp.async issue (issue)
// does not wait on the block table.
template <int KT, int NT, int CPR, int ESZ>
struct TileLoader {
  static_assert(NT % CPR == 0, "threads must cover whole rows");
  static constexpr int RPP = NT / CPR;                // rows per pass
  static constexpr int RPT = (KT + RPP - 1) / RPP;    // rows per thread
  int col;
  int row0;
  int ids[RPT];                // raw block ids of the fetched tile's rows (-1: key not in range)
  uint32_t nblk;               // block_id_limit of the cache
  int col_bytes, col_bytes_v;  // valid bytes of this thread's chunk column (0..16) in K / in V
  // This thread's chunk column of the work item's kv head in block 0, slot 0 (K / V), and the
  // block / slot strides in bytes: a row's source is base + id * block + slot * slot_bytes, two
  // 32 x 64-bit multiply-adds (the ids and slots are non-negative ints, the strides int64).
  const char* k_base;
  const char* v_base;
  uint64_t k_block, k_slot, v_block, v_slot;

  __device__ __forceinline__ void init(const AttentionParams& p, const Work& w) {
    const paged_kv_t& kv = p.kv;
    col = threadIdx.x % CPR;
    row0 = threadIdx.x / CPR;
    const int b = kv.head_dim * ESZ - col * 16, bv = kv.head_dim_v * ESZ - col * 16;
    col_bytes = b < 0 ? 0 : (b > 16 ? 16 : b);
    col_bytes_v = bv < 0 ? 0 : (bv > 16 ? 16 : bv);
    nblk = block_id_limit(kv);
    const int64_t kh = int64_t(w.kv_head) * kv.k_stride_head + col * (16 / ESZ);
    const int64_t vh = int64_t(w.kv_head) * kv.v_stride_head + col * (16 / ESZ);
    k_base = static_cast<const char*>(kv.k) + kh * ESZ;
    v_base = static_cast<const char*>(kv.v) + vh * ESZ;
    k_block = uint64_t(kv.k_stride_block) * ESZ, k_slot = uint64_t(kv.k_stride_slot) * ESZ;
    v_block = uint64_t(kv.v_stride_block) * ESZ, v_slot = uint64_t(kv.v_stride_slot) * ESZ;
  }

  // Loads the block ids of this thread's rows of `tile` (-1: key outside [w.lo, w.hi]) as they are
  // in the table. The kernels fetch a tile's ids one tile before they issue its copies, so the
  // loads fly while a tile is computed; the range check against num_blocks (valid()) is made at
  // issue, since any use right after the load would stall the warp for its whole latency (the
  // check sat here once, and the SASS waited for the block table on every tile). The
  // power-of-two test is uniform, so it is taken once, outside the row loop.
  __device__ __forceinline__ void fetch(const AttnArgs& a, const Work& w, int tile) {
    const paged_kv_t& kv = a.p.kv;
    const int32_t* bt = kv.block_tables + int64_t(w.seq) * kv.max_blocks_per_seq;
    auto rows = [&](auto block_of) {
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const int r = row0 + i * RPP;
        const int key = tile * KT + r;
        int id = -1;
        if (r < KT && key >= w.lo && key <= w.hi) id = __ldg(bt + block_of(key));
        ids[i] = id;
      }
    };
    if (a.bs_shift >= 0) {
      const int shift = a.bs_shift;
      rows([shift](int key) { return key >> shift; });
    } else {
      const int bs = kv.block_size;
      rows([bs](int key) { return key / bs; });
    }
  }

  // Row i's block id is one to read (block_id_ok).
  __device__ __forceinline__ bool valid(int i) const { return block_id_ok(ids[i], nblk); }

  // dst_k / dst_v: shared memory of the stage; off(r, c): byte offset of chunk c of row r. Rows of
  // a cache with 16-byte aligned rows go through cp.async with the addresses above and the
  // destinations as shared-window offsets (one conversion per call, not per row); other caches
  // through the synchronous element loads below.
  template <typename Off>
  __device__ __forceinline__ void issue(const AttnArgs& a, int tile, char* dst_k, char* dst_v,
                                        Off off) const {
    if (!a.kv_aligned) {
      issue_unaligned(a, tile, dst_k, dst_v, off);
      return;
    }
    const uint32_t sk = smem_u32(dst_k), sv = smem_u32(dst_v);
    auto rows = [&](auto slot_of) {
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const int r = row0 + i * RPP;
        if (RPT * RPP > KT && r >= KT) continue;
        const bool ok = valid(i);
        const uint32_t id = ok ? uint32_t(ids[i]) : 0u;
        const uint32_t slot = ok ? uint32_t(slot_of(tile * KT + r)) : 0u;
        const char* gk = k_base + (uint64_t(id) * k_block + uint64_t(slot) * k_slot);
        const char* gv = v_base + (uint64_t(id) * v_block + uint64_t(slot) * v_slot);
        const uint32_t o = uint32_t(off(r, col));
        cp_async16_at(sk + o, gk, ok ? col_bytes : 0);
        cp_async16_at(sv + o, gv, ok ? col_bytes_v : 0);
      }
    };
    if (a.bs_shift >= 0) {
      const int mask = (1 << a.bs_shift) - 1;
      rows([mask](int key) { return key & mask; });
    } else {
      const int bs = a.p.kv.block_size;
      rows([bs](int key) { return key % bs; });
    }
  }

  template <typename Off>
  __device__ __forceinline__ void issue_unaligned(const AttnArgs& a, int tile, char* dst_k,
                                                  char* dst_v, Off off) const {
    const int bs = a.p.kv.block_size;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = row0 + i * RPP;
      if (r >= KT) continue;
      const bool ok = valid(i);
      const int slot = ok ? (tile * KT + r) % bs : 0;
      const char* gk = k_base + (uint64_t(ok ? ids[i] : 0) * k_block + uint64_t(slot) * k_slot);
      const char* gv = v_base + (uint64_t(ok ? ids[i] : 0) * v_block + uint64_t(slot) * v_slot);
      copy_chunk(dst_k + off(r, col), gk, ok ? col_bytes : 0);
      copy_chunk(dst_v + off(r, col), gv, ok ? col_bytes_v : 0);
    }
  }

  // Synchronous fallback for caches whose rows are not 16-byte aligned (odd views): element loads.
  // Written without local arrays (a dynamically indexed array would live in local memory).
  __device__ __forceinline__ static uint32_t word_at(const char* g, int at, int bytes) {
    uint32_t w = 0u;
    if constexpr (ESZ == 4) {
      if (at < bytes) w = *reinterpret_cast<const uint32_t*>(g + at);
    } else if constexpr (ESZ == 2) {
      if (at < bytes) w = *reinterpret_cast<const uint16_t*>(g + at);
      if (at + 2 < bytes) w |= uint32_t(*reinterpret_cast<const uint16_t*>(g + at + 2)) << 16;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (at + e < bytes) w |= uint32_t(static_cast<uint8_t>(g[at + e])) << (8 * e);
    }
    return w;
  }
  __device__ __forceinline__ static void copy_chunk(char* s, const char* g, int bytes) {
    *reinterpret_cast<uint4*>(s) = make_uint4(word_at(g, 0, bytes), word_at(g, 4, bytes),
                                              word_at(g, 8, bytes), word_at(g, 12, bytes));
  }
};

// Loads 8 consecutive query elements (columns c .. c+7 of row `src`) as floats; zero past head_dim.
template <typename QT>
__device__ __forceinline__ void load_q8(const QT* src, int c, int d, bool aligned, float* x) {
  if (c >= d) {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = 0.0f;
    return;
  }
  if constexpr (std::is_same_v<QT, float>) {
    if (aligned) {
      const float4 u = *reinterpret_cast<const float4*>(src + c);
      const float4 v = *reinterpret_cast<const float4*>(src + c + 4);
      x[0] = u.x, x[1] = u.y, x[2] = u.z, x[3] = u.w, x[4] = v.x, x[5] = v.y, x[6] = v.z, x[7] = v.w;
      return;
    }
  } else {
    if (aligned) {
      const uint4 u = *reinterpret_cast<const uint4*>(src + c);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = std::is_same_v<QT, __half> ? unpack2_half(w[i]) : unpack2_bf16(w[i]);
        x[2 * i] = f.x, x[2 * i + 1] = f.y;
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = to_float(src[c + i]);
}

// ---------------------------------------------------------------------------------------------
// Epilogue: combine the per-warp states of each row, then write out/lse or the split partial
// ---------------------------------------------------------------------------------------------

// A v_scale that is NaN or inf makes every output of the rows it applies to NaN (docs/ops.md): the
// kernels apply it after the sum, where inf would not give the per-element result of dequantizing
// first.
__device__ __forceinline__ float checked_v_mul(float v_mul) { return fabsf(v_mul) < INFINITY ? v_mul : NAN; }

// Whether the query at `pos` of a sequence of seq_len keys sees any key (docs/ops.md): causal, the
// key at its own position (pos >= 0; the leading rows of a sequence with more queries than keys
// see none); otherwise the last key, which every window keeps (pos - window_left <= seq_len - 1).
__device__ __forceinline__ bool pos_has_keys(const AttentionParams& p, int64_t pos, int64_t seq_len) {
  return p.causal ? pos >= 0 : seq_len > 0;
}

// The same for the rows of a token (the split merges, which see tokens, not work items): decode
// (token = sequence) iff the sequence is not empty; varlen through the token's sequence, found by
// a binary search of query_start_loc and read clamped as make_work reads it.
__device__ __forceinline__ bool row_has_keys(const AttentionParams& p, int64_t token) {
  if (p.query_start_loc == nullptr) return p.kv.seq_lens[token] > 0;
  const int32_t* qsl = p.query_start_loc;
  int lo = 0, hi = static_cast<int>(p.kv.num_seqs) - 1;
  while (lo < hi) {  // the last sequence that starts at or before the token (skips empty ones)
    const int mid = (lo + hi + 1) >> 1;
    if (qsl[mid] <= token) lo = mid; else hi = mid - 1;
  }
  const int64_t capacity = p.kv.max_blocks_per_seq * p.kv.block_size;
  int64_t len = p.kv.seq_lens[lo];
  len = len < 0 ? 0 : (len > capacity ? capacity : len);
  const int64_t pos = len - (int64_t(qsl[lo + 1]) - qsl[lo]) + (token - qsl[lo]);
  return pos_has_keys(p, pos, len);
}

// ---- keys some rows of a CTA see and others do not ------------------------------------------------
// In prefill a key tile may hold keys that some rows of the CTA see and others do not (the causal
// diagonal, a window's edge). Their probability is 0 for the rows that do not see them, but a tensor-
// core P V still multiplies that 0 by the key's value, and 0 times an inf or NaN value is NaN
// (docs/ops.md: keys a row does not see never influence it). Such tiles are scanned for non-finite
// values (16-bit tiles in shared memory); when there is one, each row adds the non-finite values of
// the keys it sees itself (a few scalar products) and they are zeroed before the tile product.

// Mask of the 16-bit lanes of w (two halves / bfloat16s) that are inf or NaN: 0xffff per lane.
template <typename T>
__device__ __forceinline__ uint32_t nonfinite2(uint32_t w) {
  const uint32_t e = std::is_same_v<T, __half> ? 0x7C007C00u : 0x7F807F80u;
  return __vcmpeq2(w & e, e);
}

// Whether any of `n16` 16-byte chunks at `tile` (shared memory, 16-bit elements of type T) holds an
// inf or NaN; the whole CTA calls it (a barrier).
template <typename T, int NT>
__device__ __forceinline__ bool tile_has_nonfinite(const char* tile, int n16) {
  uint32_t any = 0u;
  for (int i = threadIdx.x; i < n16; i += NT) {
    const uint4 u = reinterpret_cast<const uint4*>(tile)[i];
    any |= nonfinite2<T>(u.x) | nonfinite2<T>(u.y) | nonfinite2<T>(u.z) | nonfinite2<T>(u.w);
  }
  return __syncthreads_or(any != 0u) != 0;
}

// Zeroes the inf / NaN elements of `n16` 16-byte chunks at `tile` (16-bit elements of type T).
template <typename T, int NT>
__device__ __forceinline__ void zero_nonfinite(char* tile, int n16) {
  for (int i = threadIdx.x; i < n16; i += NT) {
    uint4 u = reinterpret_cast<uint4*>(tile)[i];
    u.x &= ~nonfinite2<T>(u.x), u.y &= ~nonfinite2<T>(u.y);
    u.z &= ~nonfinite2<T>(u.z), u.w &= ~nonfinite2<T>(u.w);
    reinterpret_cast<uint4*>(tile)[i] = u;
  }
}

// A 16-bit element (bits in the low half) as float.
template <typename T>
__device__ __forceinline__ float bits16_to_float(uint32_t h) {
  return std::is_same_v<T, __half> ? unpack2_half(h).x : __uint_as_float(h << 16);
}

// The value of a probability p after the rounding to T that the tensor-core P V applies.
template <typename T>
__device__ __forceinline__ float round_p(float p) {
  return std::is_same_v<T, __half> ? __half2float(__float2half_rn(p)) : __bfloat162float(__float2bfloat16_rn(p));
}

// N (4 or 8) floats to N consecutive output elements: float4 stores, or one 8- / 16-byte store
// of packed 16-bit values. `dst` aligned to the store.
template <typename OT, int N>
__device__ __forceinline__ void store_n(OT* dst, const float* x) {
  static_assert(N == 4 || N == 8, "one or two float4 / one uint2 or uint4");
  if constexpr (std::is_same_v<OT, float>) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
      reinterpret_cast<float4*>(dst)[i] = make_float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(pack2<OT>(x[0], x[1]), pack2<OT>(x[2], x[3]),
                                                pack2<OT>(x[4], x[5]), pack2<OT>(x[6], x[7]));
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<OT>(x[0], x[1]), pack2<OT>(x[2], x[3]));
  }
}

// Epilogue shared memory: eo [WN][ROWS][CW + 4] unnormalized outputs of columns [c0, c0 + CW) (CW =
// DPAD, c0 = 0: all of them; the persistent decode passes DPAD / CW column chunks through a smaller
// buffer), em / ed [WN][ROWS] running max (log2 units) and denominator of each warp slice. Every row
// of the CTA ends here: the final out / lse (one split) or the normalized partial (several splits).
template <typename OT, int ROWS, int DPAD, int WN, int NT, int CW = DPAD>
__device__ __forceinline__ void finalize_rows(const AttnArgs& a, const Work& w, const float* eo,
                                              const float* em, const float* ed, float v_mul, int c0 = 0) {
  constexpr int C8 = CW / 8;
  constexpr int STRIDE = CW + 4;
  const AttentionParams& p = a.p;
  const int d = p.kv.head_dim_v;  // output columns: the value's head dim
  v_mul = checked_v_mul(v_mul);
  for (int idx = threadIdx.x; idx < ROWS * C8; idx += NT) {
    const int r = idx / C8, c = c0 + (idx - r * C8) * 8;
    if (c >= d) continue;
    const RowId id = row_id(a, w, r);
    if (!id.valid) continue;
    // Every warp slice is read with weight 2^(m_s - M) (1 while every slice's max is -inf): a NaN
    // denominator or output of a slice (a NaN logit) reaches the row; an empty slice has d = 0 and
    // o = 0.
    float M = -INFINITY;
#pragma unroll
    for (int s = 0; s < WN; ++s) M = fmaxf(M, em[s * ROWS + r]);
    float D = 0.0f, acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < WN; ++s) {
      const float e = M == -INFINITY ? 1.0f : exp2f(em[s * ROWS + r] - M);
      D += ed[s * ROWS + r] * e;
      const float* o = eo + (s * ROWS + r) * STRIDE + (c - c0);
      const float4 o0 = *reinterpret_cast<const float4*>(o);
      const float4 o1 = *reinterpret_cast<const float4*>(o + 4);
      acc[0] += e * o0.x, acc[1] += e * o0.y, acc[2] += e * o0.z, acc[3] += e * o0.w;
      acc[4] += e * o1.x, acc[5] += e * o1.y, acc[6] += e * o1.z, acc[7] += e * o1.w;
    }
    const int64_t row = id.token * p.num_heads + id.head;
    if (a.num_splits == 1) {
      // kvkernels/softmax.h: NaN / +inf logits or sink -> NaN row; no key -> 0 / -inf.
      float mul;
      const float lse2 = finish_row<true>(M, D, pos_has_keys(p, id.pos, w.seq_len),
                                          p.sinks ? p.sinks[id.head] * kLog2e : -INFINITY, &mul);
      mul *= v_mul;
      float x[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = acc[i] * mul;
      store_n<OT, 8>(static_cast<OT*>(p.out) + row * d + c, x);
      if (c == 0) p.lse[row] = lse2 * kLn2;
    } else {
      // The normalized partial of this split: D = 0 (no finite logit here) gives lse -inf and is
      // not read by the merge; a NaN D gives a NaN lse and output.
      const float lse2 = D == 0.0f ? -INFINITY : M + log2f(D);
      const float mul = D == 0.0f ? 0.0f : v_mul / D;
      const int64_t prow = int64_t(w.split) * p.num_tokens * p.num_heads + row;
      float x[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = acc[i] * mul;
      store_n<float, 8>(a.part_o + prow * d + c, x);
      if (c == 0) a.part_lse[prow] = lse2;
    }
  }
}

// Entry points of the per-query-dtype translation units (attention_{f32,f16,bf16}.cu), called by
// the planner in attention.cu: the attention kernel of `path` for the cache format in a.p and the
// padded head dim `dpad`, and the split merge.
cudaError_t launch_attention_f32(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                 cudaStream_t stream);
cudaError_t launch_attention_f16(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                 cudaStream_t stream);
cudaError_t launch_attention_bf16(const AttnArgs& a, Path path, int dpad, dim3 grid,
                                  cudaStream_t stream);
// The Hopper wgmma prefill (attention_sm90_{bf16,f16}.cu: 16-bit caches of the query dtype;
// attention_sm90_{bf16,f16}_fp8.cu: e4m3 / e5m2 caches; padded head dims 64 / 128 / 256, fp8 at 64 /
// 128 only): whether this build
// has its sm_90a code for the cache format `cf`, and its launch (the format is a.p.kv.format; `overlap`:
// the intra-warpgroup overlapped loop, Path::kWgmmaPrefillOverlap, where has_wgmma_overlap(dpad); a.work_x > 0:
// the persistent kernel, Path::kWgmmaPrefillPersistent, `grid` then its min(items, SMs) CTAs).
// TMA for the wgmma prefill's 16-bit K / V tiles (attention.cu, encode_kv_tma; the producer of
// attention_sm90.cuh): rank-4 maps over the paged caches, dims (columns, slot or head, head or slot,
// block), boxes of 64 columns x box_rows keys (128B swizzle). box_rows 0: every tile is gathered.
struct Sm90KvTma {
  CUtensorMap k, v;
  int box_rows = 0;      // keys per box: the key tile, or the block size where it divides the tile (>= 8)
  int k_head_dim1 = 0;   // 1: K's map is (columns, head, slot, block), 0: (columns, slot, head, block)
  int v_head_dim1 = 0;   // the same for V
};
bool sm90_prefill_available_bf16(int dpad, CacheFormat cf);
bool sm90_prefill_available_f16(int dpad, CacheFormat cf);
bool sm90_prefill_available_bf16_fp8(int dpad, CacheFormat cf);
bool sm90_prefill_available_f16_fp8(int dpad, CacheFormat cf);
cudaError_t launch_attention_sm90_bf16(const AttnArgs& a, const Sm90KvTma& tma, int dpad, bool overlap, dim3 grid,
                                       cudaStream_t stream);
cudaError_t launch_attention_sm90_f16(const AttnArgs& a, const Sm90KvTma& tma, int dpad, bool overlap, dim3 grid,
                                       cudaStream_t stream);
cudaError_t launch_attention_sm90_bf16_fp8(const AttnArgs& a, const Sm90KvTma& tma, int dpad, bool overlap, dim3 grid,
                                       cudaStream_t stream);
cudaError_t launch_attention_sm90_f16_fp8(const AttnArgs& a, const Sm90KvTma& tma, int dpad, bool overlap, dim3 grid,
                                       cudaStream_t stream);
cudaError_t launch_merge_f32(const AttnArgs& a, cudaStream_t stream);
cudaError_t launch_merge_f16(const AttnArgs& a, cudaStream_t stream);
cudaError_t launch_merge_bf16(const AttnArgs& a, cudaStream_t stream);

}  // namespace kvkernels::attn_cuda
