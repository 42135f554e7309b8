// Device code shared by the CUDA MLA kernels (mla_attention_{mma,simt}.cuh, mla_merge.cuh,
// mla_decompress.cuh). Torch-free. The PTX wrappers (cp.async, ldmatrix, mma.sync), the work
// decomposition (make_work / row_id) and the fp8 bit conversions come from attention_common.cuh:
// mla_paged_attention is paged attention with one kv head whose key row is the whole latent row
// (kv_lora_rank + rope_dim wide) and whose value is its first kv_lora_rank columns, so a CTA's
// rows are (query, head) pairs of that single group and every latent byte it loads serves all of
// them.
//
// What differs from the head-dim <= 256 kernels: the row width is a runtime value up to 576, so
// shared-memory rows are sized at run time (`dp` = row width rounded up to 64 elements, a whole
// number of 128-byte swizzle groups) and the pipeline depth too (`stages`, chosen by the planner
// from the device's shared memory).
#pragma once

#include <cuda.h>  // CUtensorMap (the wgmma decode's TMA map; nothing links libcuda)

#include <atomic>

#include "attention_common.cuh"

namespace kvkernels::mla_cuda {

namespace ac = kvkernels::attn_cuda;

// Everything an MLA attention kernel needs. `a` is the AttnArgs of attention_common.cuh with
// group = num_heads (one latent "kv head"), so make_work / row_id apply unchanged.
struct MlaArgs {
  ac::AttnArgs a;
  int dp = 0;      // smem row width in elements: head_dim rounded up to a multiple of 64
  int stages = 2;  // cp.async pipeline depth (2..4)
  int seesaw = 0;  // the wgmma decode's consumer schedule: 0 in step, 1 seesaw (mla_attention_sm90.cuh)
  // The wgmma decode's split plan from the metadata pass (KVKERNELS_CUDA_MLA_SCHED=metadata; mla_sched.cuh):
  // the pass's output (int32 workspace) and the CTAs per head chunk it divides the batch's key tiles
  // among. nullptr / 0: the shape-only plan (blockIdx.x a sequence, blockIdx.z its split).
  int* sched = nullptr;
  int parts = 0;
  int pdl = 0;  // (host side) launch the decode and the merge with programmatic dependent launch (sm_90)
};

// ---- geometry (host and device) --------------------------------------------------------------

enum class MlaPath : int {
  kSimt = 0,    // CUDA cores, float32 math: every q dtype (the only path for float32 q)
  kMma16 = 1,   // tensor cores, 16 rows (query x head pairs) per CTA, 4 warps
  kMma64 = 2,   // tensor cores, 64 rows per CTA, 8 warps
  kWgmma = 3,   // sm_90a wgmma decode, 64 rows per CTA, 3 warpgroups (mla_attention_sm90.cuh; opt-in)
};

constexpr int kMmaKeyTile = 32;   // keys per pipeline stage, tensor-core kernels
constexpr int kSimtKeyTile = 8;   // keys per pipeline stage, SIMT kernel
constexpr int kSimtRows = 16;
constexpr int kSimtThreads = 128;
constexpr int kMaxValueWidth = 512;  // kv_lora_rank limit of prepare_mla_attention
constexpr int kPRowBytes = kMmaKeyTile * 2 + 16;  // P tile row: 64 bytes + 16 of padding

__host__ __device__ constexpr int mla_wm(MlaPath path) { return path == MlaPath::kMma64 ? 4 : 1; }
__host__ __device__ constexpr int mla_rows(MlaPath path) {
  return path == MlaPath::kSimt ? kSimtRows : path == MlaPath::kWgmma ? 64 : 16 * mla_wm(path);
}
__host__ __device__ constexpr int mla_threads(MlaPath path) {
  return path == MlaPath::kSimt ? kSimtThreads : path == MlaPath::kMma64 ? 256 : path == MlaPath::kWgmma ? 384 : 128;
}
__host__ __device__ constexpr int mla_key_tile(MlaPath path) {
  return path == MlaPath::kSimt ? kSimtKeyTile : path == MlaPath::kWgmma ? 64 : kMmaKeyTile;
}
__host__ __device__ constexpr int mla_dp(int head_dim) { return (head_dim + 63) / 64 * 64; }

// Shared memory of the tensor-core kernel: Q [rows][dp] 16-bit | stages x raw K tile [KT][dp] |
// fp8 only: converted tile [KT][dp] 16-bit | S [rows][KT] float | P [rows][kPRowBytes] |
// m, d, alpha [rows] float. Every part starts at a multiple of 16 bytes.
struct MmaSmem {
  int q_off, stage_off, stage_bytes, cvt_off, s_off, p_off, stat_off, total;
};
__host__ __device__ inline MmaSmem mma_smem(MlaPath path, int dp, int esz, int stages) {
  const int rows = mla_rows(path), kt = kMmaKeyTile;
  MmaSmem s;
  s.q_off = 0;
  s.stage_off = rows * dp * 2;
  s.stage_bytes = kt * dp * esz;
  s.cvt_off = s.stage_off + stages * s.stage_bytes;
  s.s_off = s.cvt_off + (esz == 1 ? kt * dp * 2 : 0);
  s.p_off = s.s_off + rows * kt * 4;
  s.stat_off = s.p_off + rows * kPRowBytes;
  s.total = s.stat_off + 3 * rows * 4;
  return s;
}

// ---- the sm_90a wgmma decode (mla_attention_sm90.cuh) ----
constexpr int kSm90KeyTile = 64;    // keys per stage
constexpr int kSm90Rows = 64;       // rows (heads) per CTA: one m64 wgmma row block
constexpr int kSm90Threads = 384;   // 2 consumer warpgroups + 1 producer
// setmaxnreg: the producer gives back what the consumers take (the CTA starts with 168 a thread: the
// launch bound of 384 threads); 48 for the producer (its fp8 conversion spilled at 40), so 224 for them.
constexpr int kSm90ProducerRegs = 48, kSm90ConsumerRegs = 224;
static_assert(kSm90ProducerRegs * 128 + kSm90ConsumerRegs * 256 <= 168 * 384, "setmaxnreg pool");

// Tile width of the wgmma kernel in elements: R + P rounded up to 64, and at least R rounded up to 128
// (its P V n128 blocks read whole 128-column slices of the tile; the extra columns are zero-filled).
__host__ __device__ constexpr int mla_sm90_dp(int head_dim, int value_dim) {
  return mla_dp(head_dim) > (value_dim + 127) / 128 * 128 ? mla_dp(head_dim) : (value_dim + 127) / 128 * 128;
}

// Shared memory: 1024 (alignment of the base) | Q [DP/64][64][128 B] | stages x tile [DP/64][64][128 B] |
// P [64][128 B] | row maxima [2][64] float | row sums [2][64] float | non-finite scan flags [2][2][4] int |
// full[stages], empty[stages] mbarriers.
struct Sm90Smem {
  int q_off, stage_off, tile_bytes, p_off, max_off, sum_off, flag_off, bar_off, total;
};
__host__ __device__ inline Sm90Smem mla_sm90_smem(int dp, int stages) {
  Sm90Smem s;
  s.q_off = 0;
  s.tile_bytes = kSm90KeyTile * dp * 2;
  s.stage_off = kSm90Rows * dp * 2;
  s.p_off = s.stage_off + stages * s.tile_bytes;
  s.max_off = s.p_off + kSm90Rows * kSm90KeyTile * 2;
  s.sum_off = s.max_off + 2 * kSm90Rows * 4;
  s.flag_off = s.sum_off + 2 * kSm90Rows * 4;
  s.bar_off = s.flag_off + 2 * 2 * 4 * 4;
  s.total = s.bar_off + 2 * stages * 8 + 1024;
  return s;
}

// Shared memory of the SIMT kernel: Q [16][dp + 4] float (pre-scaled) | stages x raw K tile
// [8][dp * esz + 16 bytes] | P [16][8] float | m, d, alpha [16] float. The 16-byte row padding
// keeps the column reads of 8 different keys on 8 different bank groups.
struct SimtSmem {
  int q_off, stage_off, stage_row, stage_bytes, p_off, stat_off, total;
};
__host__ __device__ inline SimtSmem simt_smem(int dp, int esz, int stages) {
  SimtSmem s;
  s.q_off = 0;
  s.stage_off = kSimtRows * (dp + 4) * 4;
  s.stage_row = dp * esz + 16;
  s.stage_bytes = kSimtKeyTile * s.stage_row;
  s.p_off = s.stage_off + stages * s.stage_bytes;
  s.stat_off = s.p_off + kSimtRows * kSimtKeyTile * 4;
  s.total = s.stat_off + 3 * kSimtRows * 4;
  return s;
}

// ---- device helpers --------------------------------------------------------------------------

// 0, which the compiler cannot see through (an empty asm that may change it): values derived from it inside a
// loop are computed in every iteration, neither hoisted out nor kept live across the loop's back edge.
__device__ __forceinline__ int opaque_zero() {
  int z = 0;
  asm volatile("" : "+r"(z));
  return z;
}

// Byte offset of 16-byte chunk c of row r in a 16-bit tile with `cpr` chunks per row (a multiple
// of 8): the low 3 bits of the chunk index are XORed with the row, so the 8 row addresses of one
// ldmatrix phase fall into 8 different bank groups.
__device__ __forceinline__ int swz_rt(int r, int c, int cpr) { return (r * cpr + (c ^ (r & 7))) * 16; }

__device__ __forceinline__ void ldmatrix_x2(uint32_t addr, uint32_t* r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::ldmatrix_x2(addr, r);
#else
  (void)addr, r[0] = r[1] = 0;
#endif
}

// cp.async.wait_group takes an immediate: the runtime pipeline depth picks one of four.
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  if (pending <= 0) ac::cp_async_wait<0>();
  else if (pending == 1) ac::cp_async_wait<1>();
  else if (pending == 2) ac::cp_async_wait<2>();
  else ac::cp_async_wait<3>();
}

// 8 query elements (columns c .. c+7) as floats, zero past d. d need not be a multiple of 8 (the
// rope part may have any width), so the last chunk of a row falls back to element loads.
template <typename QT>
__device__ __forceinline__ void load_q8_tail(const QT* src, int c, int d, bool aligned, float* x) {
  if (c + 8 <= d) {
    ac::load_q8(src, c, d, aligned, x);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = c + i < d ? ac::to_float(src[c + i]) : 0.0f;
}

// Query row `id`'s 8 elements of chunk c (columns 8c .. 8c+7) as floats, zero past d; all zeros for a row
// the CTA does not own (id.valid false). Every MLA kernel stages its query tile this way.
template <typename QT>
__device__ __forceinline__ void load_q_chunk(const ac::AttnArgs& a, const ac::RowId& id, int c, int d, float* x) {
  if (id.valid) {
    const QT* src = static_cast<const QT*>(a.p.q) + id.token * a.p.q_stride_token +
                    int64_t(id.head) * a.p.q_stride_head;
    load_q8_tail(src, c * 8, d, a.q_aligned != 0, x);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = 0.0f;
  }
}

// The end of a query row of the MLA kernels, from its running max M and sum Dn (log2 units): returns the
// row's lse (log2) and sets *mul, the factor of its output (times vm, the checked v scale). `whole`: the
// row saw all its keys (one split; a sequence the metadata plan left in one piece): finish_row
// (kvkernels/softmax.h: NaN / +inf logits -> NaN, no key -> 0 / -inf). Else the normalized partial, lse
// -inf when this piece saw no finite logit (the merge then skips it).
__device__ __forceinline__ float finish_mla_row(const ac::Work& w, const ac::RowId& id, bool whole,
                                                const AttentionParams& p, float M, float Dn, float vm, float* mul) {
  float lse2;
  if (whole) {
    lse2 = finish_row<true>(M, Dn, ac::pos_has_keys(p, id.pos, w.seq_len), -INFINITY, mul);
  } else {
    lse2 = Dn == 0.0f ? -INFINITY : M + log2f(Dn);
    *mul = Dn == 0.0f ? 0.0f : 1.0f / Dn;
  }
  *mul *= vm;
  return lse2;
}

// Loads the block ids of key tile `tile`'s rows that this warp copies: lane i (< rows per warp)
// holds row warp + i * NW's id as it is in the table (-1: key outside [w.lo, w.hi]). The kernels
// fetch a tile's ids one tile before they issue its copies, so the load flies while a tile is
// computed; the range check against num_blocks is made in issue_key_tile, where the id is used
// (any use right after the load would stall the warp for its whole latency on every tile).
template <int KT, int NT>
__device__ __forceinline__ int fetch_key_ids(const MlaArgs& m, const ac::Work& w, int tile) {
  constexpr int NW = NT / 32, RPW = KT / NW;  // rows per warp
  static_assert(NT % 32 == 0 && KT % NW == 0 && RPW <= 32, "whole rows per warp, a lane each");
  const ac::AttnArgs& a = m.a;
  const paged_kv_t& kv = a.p.kv;
  const int lane = threadIdx.x % 32;
  const int key = tile * KT + threadIdx.x / 32 + lane * NW;
  int id = -1;
  if (lane < RPW && key >= w.lo && key <= w.hi) {
    const int32_t* bt = kv.block_tables + int64_t(w.seq) * kv.max_blocks_per_seq;
    id = __ldg(bt + (a.bs_shift >= 0 ? key >> a.bs_shift : key / kv.block_size));
  }
  return id;
}

// Issues the copies of key tile `tile` (keys [tile * KT, tile * KT + KT)) of the CTA's sequence
// into `dst`: raw cache bytes, 16 per chunk, row r / chunk c at off(r, c); `ids`: this lane's
// fetch_key_ids of the tile. Keys outside [w.lo, w.hi], rows whose block id is out of range and
// bytes past head_dim are zero-filled without being read (so NaN in unused cache slots never
// reaches the math). With `aligned` (cache base and row strides multiples of 16 bytes) the copies
// are cp.async; otherwise plain element loads (odd views).
// A warp takes whole rows, its lanes the row's chunks: the block id (shuffled from the lane that
// loaded it) and the row's source address are found once per row, not per 16-byte chunk.
template <int KT, int NT, int ESZ, typename Off>
__device__ __forceinline__ void issue_key_tile(const MlaArgs& m, const ac::Work& w, int tile,
                                               int ids, char* dst, Off off) {
  constexpr int NW = NT / 32, RPW = KT / NW;  // rows per warp
  const ac::AttnArgs& a = m.a;
  const paged_kv_t& kv = a.p.kv;
  const int cpr = m.dp * ESZ / 16;
  const int row_bytes = kv.head_dim * ESZ;
  const char* base = static_cast<const char*>(kv.k);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k0 = tile * KT + warp;
  const uint32_t nblk = ac::block_id_limit(kv);
  const uint64_t sb = uint64_t(kv.k_stride_block) * ESZ, ss = uint64_t(kv.k_stride_slot) * ESZ;
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int r = warp + i * NW, key = k0 + i * NW;
    const int id = __shfl_sync(0xffffffffu, ids, i);
    const bool ok = ac::block_id_ok(id, nblk);
    const int slot = !ok ? 0 : a.bs_shift >= 0 ? key & ((1 << a.bs_shift) - 1) : key % kv.block_size;
    const char* row = base + (uint64_t(ok ? id : 0) * sb + uint64_t(slot) * ss);
    for (int c = lane; c < cpr; c += 32) {
      const int b = ok ? row_bytes - c * 16 : 0;
      const int bytes = b < 0 ? 0 : (b > 16 ? 16 : b);
      const char* src = bytes > 0 ? row + c * 16 : base;
      char* d = dst + off(r, c);
      if (a.kv_aligned) ac::cp_async16(d, src, bytes);
      else ac::TileLoader<1, 1, 1, ESZ>::copy_chunk(d, src, bytes);  // element loads, zero-filled
    }
  }
}

// ---- entry points of the per-q-dtype translation units (mla_attention_*.cu) ---------------------

cudaError_t launch_mla_mma_f16(const MlaArgs& m, MlaPath path, dim3 grid, int smem,
                               cudaStream_t stream);
cudaError_t launch_mla_mma_bf16(const MlaArgs& m, MlaPath path, dim3 grid, int smem,
                                cudaStream_t stream);
cudaError_t launch_mla_simt(const MlaArgs& m, dim3 grid, int smem, cudaStream_t stream);
// The sm_90a wgmma decode (mla_attention_sm90_{f16,bf16}.cu): whether this build has its code for a
// cache format, and its launch.
bool mla_sm90_available_f16(CacheFormat format);
bool mla_sm90_available_bf16(CacheFormat format);
// `map`: the latent cache's tensor map for TMA (16-bit caches, block size 64; mla_attention.cu), or nullptr.
cudaError_t launch_mla_sm90_f16(const MlaArgs& m, const CUtensorMap* map, dim3 grid, int smem, cudaStream_t stream);
cudaError_t launch_mla_sm90_bf16(const MlaArgs& m, const CUtensorMap* map, dim3 grid, int smem, cudaStream_t stream);
cudaError_t launch_mla_merge(const MlaArgs& m, cudaStream_t stream);
// The wgmma decode's metadata pass (mla_sched.cuh; m.sched, m.parts set), one warp, on `stream`.
cudaError_t launch_mla_sched(const MlaArgs& m, cudaStream_t stream);

// Launches `kernel` (grid, threads, smem bytes, stream) on `args` through cudaLaunchKernelEx, with programmatic stream
// serialization when `pdl` (the kernel may start before the one ahead of it in the stream has finished; it
// must griddepcontrol.wait before reading that one's output: sm90_ptx.cuh).
template <typename... KArgs, typename... Args>
cudaError_t launch_kernel_ex(void (*kernel)(KArgs...), dim3 grid, int threads, int smem, cudaStream_t stream,
                             bool pdl, const Args&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  // (gridDim, blockDim, dynamicSmemBytes, stream, attrs, numAttrs; by position: the emulator defines gridDim)
  cudaLaunchConfig_t cfg = {grid, dim3(static_cast<unsigned>(threads)), static_cast<size_t>(smem), stream, attr,
                            pdl ? 1u : 0u};
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// Raises `kernel`'s opt-in limit of dynamic shared memory to `smem` bytes unless this process already
// set at least that much on the current device (a function attribute, not a stream operation, so
// legal during graph capture). `configured`: the kernel's own record (a static array of 64 per kernel
// instance), the largest size set per device; smem varies with the row width and stage count.
template <typename Kernel>
cudaError_t raise_smem_limit(Kernel kernel, std::atomic<int>* configured, int smem) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::atomic<int>& done = configured[dev < 64 ? dev : 63];
  int have = done.load(std::memory_order_acquire);
  if (dev >= 64 || smem > have) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    while (have < smem && !done.compare_exchange_weak(have, smem, std::memory_order_acq_rel)) {
    }
  }
  return cudaSuccess;
}

}  // namespace kvkernels::mla_cuda
