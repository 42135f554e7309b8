// Hopper (sm_90a) paged-attention prefill on wgmma, warp-specialized (Path::kWgmmaPrefill; opt-in:
// KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill; csrc/cuda/README.md, section "Hopper prefill (wgmma)").
//
// CTA = 3 warpgroups (384 threads) over 128 rows (q_tile queries x the GQA group's heads, make_work /
// row_id of attention_common.cuh) of one kv head, key tiles of 128 keys (64 at padded head dim 256):
//   warpgroup 2, the producer (setmaxnreg.dec to 40 registers): gathers each key tile's K and V rows
//     from the paged cache with cp.async (any block size: one block-table lookup per row; rows outside
//     the CTA's visible range [w.lo, w.hi], out-of-range block ids and columns past the head dims are
//     zero-filled) into a ring of STAGES stages; the K rows of a stage complete its full_k mbarrier
//     and the V rows its full_v one through cp.async.mbarrier.arrive.noinc (count 128: every producer
//     thread); before refilling a stage it waits for the stage's empty mbarrier (count 256: every
//     consumer thread arrives when its P V product of the stage has completed). 16-bit caches whose
//     block size divides the tile (>= 8) or is a multiple of it: a tile of whole pages (or of a part of
//     one) of keys all visible, with valid block ids, is loaded by TMA instead (boxes of 64 columns x
//     box_rows keys of the rank-4 maps encoded on the host, attention.cu encode_kv_tma; each issuing lane
//     arrives with expect_tx of its box, the others plainly: the same count of 128), every other tile
//     gathered.
//   warpgroups 0 and 1, the consumers (setmaxnreg.inc to 232): 64 rows each (one m64 wgmma row
//     block), the query tile in shared memory. Per key tile: S = Q K^T (DPAD / 16 wgmma m64n128k16, A
//     and B from shared memory, K-major, 128-byte swizzle), the logits scaled / capped / biased / masked
//     and the online softmax in registers (log2 units, fp32), P rounded to the query dtype into A
//     fragments, O += P V (KT / 16 wgmma m64nDPADk16 with A = P from registers and B = V from shared
//     memory, N-major), fp32 accumulators. The two consumers issue their S products in turns (named
//     barriers 1 and 2, "ping-pong"): one's softmax runs while the other's product occupies the
//     tensor cores. OVERLAP = true (Path::kWgmmaPrefillOverlap, padded head dims 64 / 128): the same
//     steps in FlashAttention-3's intra-warpgroup overlap, the turn of tile j issuing S_j and then
//     P_{j-1} V_{j-1}, the softmax of tile j running while that P V is in flight (the loops below).
// Shared memory tiles (Q, K, V) are [DPAD / 64 column blocks][rows][128 bytes], 16-byte chunk c of row
// r at (c ^ (r % 8)) * 16 in its row: the 128B-swizzle canonical layout, 1024-byte aligned (the base
// is aligned at run time: nothing guarantees where dynamic shared memory starts). K-major for Q and K
// (8-row groups SBO = 1024 bytes apart, a k16 step 32 bytes into the row, column block 64 elements
// further on), N-major for V (the same bytes: 8 keys x 64 values per 1024-byte atom, atoms of the next
// 64 values LBO = KT * 128 bytes apart, of the next 8 keys SBO = 1024 apart).
//
// Semantics are the other kernels': causal or not, sliding window, soft cap, ALiBi, sinks, value head
// dim != key head dim (both <= DPAD), KV splits with float32 partials for the merge kernel, key tiles
// wholly outside every row's range never loaded, the non-finite rules of docs/ops.md (a key tile with
// keys some rows see and others do not, whose V holds inf / NaN, runs its P V in scalar code over the
// keys each row sees: 0 * inf never reaches a row that does not see the key). Caches of the query's
// 16-bit dtype, or fp8 (e4m3 / e5m2, per-tensor or per-head k / v scales): the producer gathers the raw
// bytes into a raw tile and dequantizes them into the 16-bit stage (the producer section below), the
// consumers apply k_scale to the logits and v_scale to the output. Padded head dims 64 / 128 / 256 (at
// 256 64-key tiles: shared memory, csrc/cuda/README.md "Head dim 256 on the wgmma prefill"). fp8 caches
// at 256, decode and unaligned K/V rows: the planner runs the mma.sync kernels (docs/ops.md lists the
// fallbacks).
#pragma once

#include <atomic>

#include "attention_common.cuh"
#include "sm90_ptx.cuh"

namespace kvkernels::attn_cuda {

template <typename T, CacheFormat CF, int DPAD>
struct Sm90Cfg {
  static_assert(DPAD == 64 || DPAD == 128 || DPAD == 256, "padded head dims 64 / 128 / 256");
  // An fp8 cache (e4m3 / e5m2): the producer gathers raw bytes and dequantizes them into the 16-bit
  // stages the consumers read (the consumers' code is the 16-bit one).
  static constexpr bool FP8 = CF == CacheFormat::kFp8E4M3 || CF == CacheFormat::kFp8E5M2;
  static constexpr int KT = sm90_key_tile(DPAD);  // keys per tile (the n of S = Q K^T): 128, 64 at 256
  static constexpr int WG_ROWS = 64;      // rows of one consumer warpgroup (wgmma m64)
  static constexpr int CONSUMERS = 2;
  static constexpr int ROWS = WG_ROWS * CONSUMERS;
  static constexpr int NT = 128 * (CONSUMERS + 1);
  static constexpr int CPR = DPAD / 8;            // 16-byte chunks per row
  static constexpr int TILE_BYTES = KT * DPAD * 2;  // K or V of one stage
  static constexpr int Q_BYTES = ROWS * DPAD * 2;
  static constexpr int STAGES = sm90_prefill_stages(DPAD);
  static constexpr int Q_OFF = 0;
  static constexpr int KV_OFF = Q_BYTES;  // stage s: K at KV_OFF + 2 s TILE_BYTES, V right after
  static constexpr int P_OFF = KV_OFF + STAGES * 2 * TILE_BYTES;  // [2][64][KT] 16-bit P (non-finite fix-up)
  // fp8: one raw K and one raw V tile ([KT][DPAD / 16] 16-byte chunks each, 1 byte per element); each
  // producer thread gathers and converts the same chunks of every tile, so no other thread touches its
  // bytes and one buffer (not one per stage) is enough: the copies of tile j + 1 fly while the stage
  // of tile j is converted and while the consumers work.
  static constexpr int RAW_TILE = FP8 ? KT * DPAD : 0;
  static constexpr int RAW_OFF = P_OFF + CONSUMERS * WG_ROWS * KT * 2;
  static constexpr int BAR_OFF = RAW_OFF + 2 * RAW_TILE;  // full_k, full_v, empty per stage
  static constexpr int SMEM = BAR_OFF + 3 * STAGES * 8 + 1024;         // + the alignment of the base
  static_assert(SMEM == sm90_prefill_smem(DPAD, FP8), "the planner's size (attention_common.cuh)");
  static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 256 <= 65536, "setmaxnreg pool");
  static_assert(SMEM <= 227 * 1024, "sm_90 opt-in shared memory (no fp8 at head dim 256)");
};

// Byte offset of 16-byte chunk c of row r in a [DPAD / 64][ROWS_][128 B] swizzled tile.
template <int ROWS_>
__device__ __forceinline__ uint32_t sw128_off(int r, int c) {
  return uint32_t((c >> 3) * ROWS_ * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Element (r, col) of such a tile (16-bit).
template <int ROWS_>
__device__ __forceinline__ uint32_t sw128_elem(int r, int col) {
  return sw128_off<ROWS_>(r, col >> 3) + uint32_t((col & 7) * 2);
}

// OVERLAP: the consumers' loop with intra-warpgroup overlap (Path::kWgmmaPrefillOverlap; the loops below).
// tma: the K / V tensor maps (16-bit caches; box_rows 0 for fp8 caches and wherever the maps do not apply).
// PERSIST (Path::kWgmmaPrefillPersistent): the grid is min(work items, SMs) CTAs and each walks the items of the
// grid a.work_x x a.work_y x a.work_z (the CTAs of the non-persistent launch) in a longest-first order with a
// stride of the grid (sm90_item below); the producer and the consumers walk the same items, and the stage
// ring, its mbarrier phases included, runs on from one item to the next, so the producer loads the next
// item's first K / V tiles while the consumers finish the current one (its last tiles, epilogue and the
// next item's query load). Each consumer's query rows are read only by its own S products, all complete
// (wgmma_wait) before its epilogue, so it rewrites them for the next item with no handoff and one Q buffer.
template <typename T, CacheFormat CF, int DPAD, bool OVERLAP, bool PERSIST = false>
__global__ void __launch_bounds__(384, 1)
    sm90_prefill_kernel(const __grid_constant__ AttnArgs a, const __grid_constant__ Sm90KvTma tma) {
#if KVK_SM90_PTX || defined(KVKERNELS_CUDA_EMU)
  using C = Sm90Cfg<T, CF, DPAD>;
  static_assert(!OVERLAP || has_wgmma_overlap(DPAD), "the overlapped loop's head dims");
  namespace s9 = ::kvkernels::sm90;
  constexpr int KT = C::KT, STAGES = C::STAGES;
  // The persistent kernel's producer holds its item loop beside the tile loop: under 40 registers it
  // spilled 20 bytes (ptxas, every head dim), so it gets 48 and the consumers 224 (no spill at either).
  constexpr int PRODUCER_REGS = PERSIST ? 48 : C::PRODUCER_REGS, CONSUMER_REGS = PERSIST ? 224 : C::CONSUMER_REGS;
  static_assert(PRODUCER_REGS * 128 + CONSUMER_REGS * 256 <= 168 * 384, "setmaxnreg pool (168 at launch)");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // Flags of the non-finite V scan (per consumer, double-buffered, per warp); static shared memory
  // also marks the kernel as the sm_90a build's (sm90_prefill_compiled: the stub has none).
  __shared__ int nf_flags[C::CONSUMERS][2][4];

  if constexpr (!PERSIST) {
    Work w;
    if (!make_work<KT>(a, w)) return;  // (a padding tile: the whole CTA leaves)
  }
  // The items of this CTA. The order is longest-first: x (query tiles; reversed for varlen as make_work does,
  // the last and, causal, longest tiles of a sequence first) outermost, then splits, then kv heads / chunks,
  // so every head's longest tiles come before any head's shorter ones. Round r of the walk gives the G CTAs
  // items r G .. r G + G - 1, in a snake: CTA b takes r G + b in even rounds and r G + G - 1 - b in odd ones,
  // so the CTA with the longest item of one round gets the shortest of the next. (A plain stride, r G + b
  // every round, hands CTA 0 the longest item of every round: at 4096 x 4096 causal, 32 / 8 heads, 1024
  // items over 132 CTAs, 144 key tiles for CTA 0 against 128 on average; the snake gives 128 to every
  // CTA.) Static, not an atomic counter: the order is fixed by shapes (the same items per CTA on every
  // run), needs no memset before the launch, and the producer and the consumers find their next item
  // without a handoff through shared memory. rounds x G >= items; an item index past the end is skipped.
  const int items = PERSIST ? a.work_x * a.work_y * a.work_z : 1;
  const int G = PERSIST ? int(gridDim.x) : 1, rounds = (items + G - 1) / G;
  const int b = PERSIST ? int(blockIdx.x) : 0;
  auto item_of = [&](int r) { return r * G + ((r & 1) ? G - 1 - b : b); };
  auto sm90_item = [&](int item, Work& w) -> bool {
    if constexpr (!PERSIST) return make_work<KT>(a, w);
    if (item >= items) return false;
    const int yz = a.work_y * a.work_z, bx = item / yz, rest = item - bx * yz, bz = rest / a.work_y;
    const int tile = a.p.query_start_loc ? a.work_x - 1 - bx : bx;  // (varlen: as make_work reverses blockIdx.x)
    return make_work_tile<KT>(a, w, tile, rest % a.work_y, bz, bz + 1);
  };
  const AttentionParams& p = a.p;
  const int tid = threadIdx.x, wg = tid / 128;
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const uint32_t sQ = base + C::Q_OFF;
  auto sK = [&](int s) { return base + uint32_t(C::KV_OFF + s * 2 * C::TILE_BYTES); };
  auto sV = [&](int s) { return sK(s) + uint32_t(C::TILE_BYTES); };
  auto full_k = [&](int s) { return base + uint32_t(C::BAR_OFF + 8 * s); };
  auto full_v = [&](int s) { return base + uint32_t(C::BAR_OFF + 8 * (STAGES + s)); };
  auto empty = [&](int s) { return base + uint32_t(C::BAR_OFF + 8 * (2 * STAGES + s)); };

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      s9::mbar_init(full_k(s), 128);
      s9::mbar_init(full_v(s), 128);
      s9::mbar_init(empty(s), 256);
    }
    s9::mbar_init_fence();
  }
  __syncthreads();

  if (wg == C::CONSUMERS) {
    // ---- producer: paged K / V rows -> the stage ring, by cp.async -----------------------------
    s9::setmaxnreg_dec<PRODUCER_REGS>();
    const paged_kv_t& kv = p.kv;
    const int pt = tid - 128 * C::CONSUMERS;
    int ring = 0;  // tiles of earlier items: tile it of this item is the ring's tile ring + it
    for (int r = 0; r < rounds; ++r) {
    Work w;
    if (!sm90_item(item_of(r), w)) continue;
    const int ntiles = w.tile_end - w.tile_begin;
    const int32_t* bt = kv.block_tables + int64_t(w.seq) * kv.max_blocks_per_seq;
    const uint32_t nblk = block_id_limit(kv);
    const int bs = kv.block_size, shift = a.bs_shift;
    // The address of key `key`'s row in a cache (src_base: at this kv head and chunk column; blk / slt: block
    // and slot strides in bytes) and, in `ok`, whether it may be read: keys outside [w.lo, w.hi] and block ids
    // out of range give ok = false (the copy zero-fills). Both gathers below, 16-bit and fp8, take rows so.
    auto row_src = [&](int key, const char* src_base, uint64_t blk, uint64_t slt, bool& ok) {
      int id = -1, slot = 0;
      if (key >= w.lo && key <= w.hi) {
        id = __ldg(bt + (shift >= 0 ? key >> shift : key / bs));
        slot = shift >= 0 ? key & ((1 << shift) - 1) : key % bs;
      }
      ok = block_id_ok(id, nblk);
      return src_base + (ok ? uint64_t(uint32_t(id)) * blk + uint64_t(slot) * slt : 0);
    };
    if constexpr (!C::FP8) {
      const int col = pt % C::CPR, row0 = pt / C::CPR;
      constexpr int RPP = 128 / C::CPR;  // rows per pass
      const int kb = kv.head_dim * 2 - col * 16, vb = kv.head_dim_v * 2 - col * 16;
      const int k_bytes = kb < 0 ? 0 : (kb > 16 ? 16 : kb), v_bytes = vb < 0 ? 0 : (vb > 16 ? 16 : vb);
      const char* k_base = static_cast<const char*>(kv.k) + (int64_t(w.kv_head) * kv.k_stride_head + col * 8) * 2;
      const char* v_base = static_cast<const char*>(kv.v) + (int64_t(w.kv_head) * kv.v_stride_head + col * 8) * 2;
      const uint64_t k_block = uint64_t(kv.k_stride_block) * 2, k_slot = uint64_t(kv.k_stride_slot) * 2;
      const uint64_t v_block = uint64_t(kv.v_stride_block) * 2, v_slot = uint64_t(kv.v_stride_slot) * 2;
      // One K or V tile: each thread its chunk column of rows row0, row0 + RPP, ...
      auto rows = [&](int tile, uint32_t dst, const char* src_base, uint64_t blk, uint64_t slt, int bytes) {
#pragma unroll 4
        for (int r = row0; r < KT; r += RPP) {
          bool ok;
          const char* src = row_src(tile * KT + r, src_base, blk, slt, ok);
          cp_async16_at(dst + sw128_off<KT>(r, col), src, ok ? bytes : 0);
        }
      };
      // TMA (tma.box_rows > 0: block sizes that divide the key tile, at least 8, or are multiples of it):
      // a tile whose keys are all in [w.lo, w.hi] and whose pages' ids are all valid is loaded as boxes of
      // 64 columns x box_rows keys (one page, or the tile's part of one page), box b of a K / V tile by lane
      // b of warp 0: column block b / per_col, keys (b % per_col) x box_rows on, at most 32 boxes (KT /
      // 8 x DPAD / 64). Each issuing lane arrives with expect_tx of its box's bytes before issuing it
      // (the phase cannot complete before its arrival, nor before its bytes land after it), the other
      // threads plainly: 128 arrivals, the count the gathers' cp.async arrivals also make, so both kinds
      // of tile share the ring. Every box starts on a 1024-byte swizzle atom (box_rows x 128 bytes apart), so the engine's
      // 128B swizzle writes the layout the gathers write; columns past the head dim are outside the map
      // (zeros). A tile with keys outside the range (the sequence's end: the last page's unused slots may
      // hold anything; a window's or the causal diagonal's edge) or an out-of-range id is gathered: the
      // same bytes either way. All producer warps look up the same ids, so they decide alike.
      auto tma_tile = [&](int tile, int s) -> bool {
        const int k0 = tile * KT, br = tma.box_rows;
        if (br == 0 || k0 < w.lo || k0 + KT - 1 > w.hi) return false;
        const int lane = pt & 31, per_col = KT / br;
        const int bi = lane % per_col, cb = lane / per_col;
        const int key = k0 + bi * br;
        const int id = __ldg(bt + (shift >= 0 ? key >> shift : key / bs));
        if (__any_sync(0xffffffffu, !block_id_ok(id, nblk))) return false;
        const int slot = shift >= 0 ? key & ((1 << shift) - 1) : key % bs;
        const bool issue = pt < 32 && cb < DPAD / 64;
        const uint32_t off = uint32_t(cb * KT * 128 + bi * br * 128), box_bytes = uint32_t(br * 128);
        if (issue) {
          s9::mbar_arrive_expect_tx(full_k(s), box_bytes);
          s9::tma_load_4d(sK(s) + off, &tma.k, 64 * cb, tma.k_head_dim1 ? w.kv_head : slot,
                          tma.k_head_dim1 ? slot : w.kv_head, id, full_k(s));
          s9::mbar_arrive_expect_tx(full_v(s), box_bytes);
          s9::tma_load_4d(sV(s) + off, &tma.v, 64 * cb, tma.v_head_dim1 ? w.kv_head : slot,
                          tma.v_head_dim1 ? slot : w.kv_head, id, full_v(s));
        } else {
          s9::mbar_arrive(full_k(s));
          s9::mbar_arrive(full_v(s));
        }
        return true;
      };
      if (pt == 0 && tma.box_rows > 0) {
        s9::tma_prefetch_map(&tma.k);
        s9::tma_prefetch_map(&tma.v);
      }
      for (int it = 0; it < ntiles; ++it) {
        const int s = (ring + it) % STAGES, use = (ring + it) / STAGES;
        if (use > 0) s9::mbar_wait(empty(s), uint32_t(use - 1) & 1u);
        if (tma_tile(w.tile_begin + it, s)) continue;
        rows(w.tile_begin + it, sK(s), k_base, k_block, k_slot, k_bytes);
        s9::cp_async_mbar_arrive(full_k(s));
        rows(w.tile_begin + it, sV(s), v_base, v_block, v_slot, v_bytes);
        s9::cp_async_mbar_arrive(full_v(s));
      }
    } else {
      // fp8: raw 16-byte chunks (16 elements) of each K / V row by cp.async into the raw tiles, then,
      // once landed, dequantized by the same thread into the stage: two 16-bit chunks in the swizzled
      // layout the consumers read (exact: every fp8 value is an fp16 / bf16 value, in units of
      // fp8_unit; k_scale and v_scale are applied by the consumers, as in the mma.sync kernels). A
      // thread converts only chunks it copied itself, so its own cp.async.wait_group is the only
      // synchronization on the raw tiles. Groups in flight: the K and the V copies of one tile, in
      // that order (one group each); waiting for all but the newest group completes the older one.
      constexpr int RCPR = DPAD / 16;  // raw 16-byte chunks per row
      constexpr int RPP = 128 / RCPR;  // rows per pass
      const int col = pt % RCPR, row0 = pt / RCPR;
      const uint32_t raw_k = base + uint32_t(C::RAW_OFF), raw_v = raw_k + uint32_t(C::RAW_TILE);
      // (The strides and pointers are read from the kernel parameters where they are used, not held in
      // registers: the producer runs under PRODUCER_REGS, and a copy of each would spill.)
      auto gather = [&](int tile, bool v) {
        const int left = (v ? kv.head_dim_v : kv.head_dim) - col * 16;
        const int bytes = left < 0 ? 0 : (left > 16 ? 16 : left);
        const char* src_base = static_cast<const char*>(v ? kv.v : kv.k) +
                               int64_t(w.kv_head) * (v ? kv.v_stride_head : kv.k_stride_head) + col * 16;
        const uint64_t blk = uint64_t(v ? kv.v_stride_block : kv.k_stride_block);
        const uint64_t slt = uint64_t(v ? kv.v_stride_slot : kv.k_stride_slot);
        const uint32_t raw = v ? raw_v : raw_k;
#pragma unroll 2
        for (int r = row0; r < KT; r += RPP) {
          bool ok;
          const char* src = row_src(tile * KT + r, src_base, blk, slt, ok);
          cp_async16_at(raw + uint32_t((r * RCPR + col) * 16), src, ok ? bytes : 0);
        }
        cp_async_commit();
      };
      auto convert = [&](uint32_t raw, uint32_t dst) {
        const unsigned char* rp = smem + (raw - base);
        unsigned char* dp = smem + (dst - base);
#pragma unroll 1
        for (int r = row0; r < KT; r += RPP) {
          const uint4 u = *reinterpret_cast<const uint4*>(rp + (r * RCPR + col) * 16);
          uint32_t h[8];
          fp8x4_to_pairs<T, CF>(u.x, &h[0], &h[1]);
          fp8x4_to_pairs<T, CF>(u.y, &h[2], &h[3]);
          fp8x4_to_pairs<T, CF>(u.z, &h[4], &h[5]);
          fp8x4_to_pairs<T, CF>(u.w, &h[6], &h[7]);
          *reinterpret_cast<uint4*>(dp + sw128_off<KT>(r, 2 * col)) = make_uint4(h[0], h[1], h[2], h[3]);
          *reinterpret_cast<uint4*>(dp + sw128_off<KT>(r, 2 * col + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
        }
        s9::fence_proxy_async();  // the generic-proxy stores, before the consumers' wgmma read them
      };
      if (ntiles > 0) {
        gather(w.tile_begin, false);
        gather(w.tile_begin, true);
      }
      for (int it = 0; it < ntiles; ++it) {
        const int s = (ring + it) % STAGES, use = (ring + it) / STAGES;
        const bool next = it + 1 < ntiles;
        if (use > 0) s9::mbar_wait(empty(s), uint32_t(use - 1) & 1u);
        cp_async_wait<1>();  // this thread's K chunks of tile it (its V chunks may still fly)
        convert(raw_k, sK(s));
        s9::mbar_arrive(full_k(s));
        if (next) gather(w.tile_begin + it + 1, false);
        else cp_async_commit();  // (an empty group keeps the count of groups in flight)
        cp_async_wait<1>();  // its V chunks of tile it
        convert(raw_v, sV(s));
        s9::mbar_arrive(full_v(s));
        if (next) gather(w.tile_begin + it + 1, true);
      }
      cp_async_wait<0>();
    }
    ring += ntiles;
    }
    cp_async_commit();  // every copy complete (and so every arrival made) before the thread exits
    cp_async_wait<0>();
    return;
  }

  // ---- consumers ------------------------------------------------------------------------------
  s9::setmaxnreg_inc<CONSUMER_REGS>();
  const int wt = tid % 128, lane = tid & 31, wq = wt >> 5, g = lane >> 2, t4 = lane & 3;
  const int row_base = wg * C::WG_ROWS;
  const int dv = p.kv.head_dim_v;
  int nscan = 0;
  int ring = 0;  // tiles of earlier items (the producer's count)
  for (int r = 0; r < rounds; ++r) {
  Work w;
  if (!sm90_item(item_of(r), w)) continue;
  const int ntiles = w.tile_end - w.tile_begin;

  // Queries of this warpgroup's 64 rows -> shared memory (16-bit, swizzled); zeros as padding.
  for (int idx = wt; idx < C::WG_ROWS * C::CPR; idx += 128) {
    const int r = row_base + idx / C::CPR, c = idx % C::CPR;
    const RowId id = row_id(a, w, r);
    float x[8];
    if (id.valid) {
      const T* src = static_cast<const T*>(p.q) + id.token * p.q_stride_token + int64_t(id.head) * p.q_stride_head;
      load_q8(src, c * 8, p.kv.head_dim, a.q_aligned != 0, x);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = 0.0f;
    }
    *reinterpret_cast<uint4*>(smem + C::Q_OFF + sw128_off<C::ROWS>(r, c)) =
        make_uint4(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]), pack2<T>(x[4], x[5]), pack2<T>(x[6], x[7]));
  }
  s9::fence_proxy_async();  // the generic-proxy stores, before wgmma reads them
  s9::named_bar_sync(3 + wg, 128);

  // This thread's rows: 16 wq + g + 8 h of the warpgroup's 64 (the accumulator layout). The loop keeps
  // only their positions and validity (the epilogue recomputes the rest: fewer registers held across
  // the loop, which the overlapped loop needs).
  auto my_row = [&](int h) { return row_id(a, w, row_base + 16 * wq + g + 8 * h); };
  int rpos[2];
  bool rvalid[2];
  float slope[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const RowId id = my_row(h);
    rpos[h] = id.pos;
    rvalid[h] = id.valid;
    slope[h] = (p.alibi_slopes && id.valid) ? p.alibi_slopes[id.head] : 0.0f;
  }
  // k_scale on the logits, v_scale on the output (the mma.sync kernels' order); fp8_unit: what one unit
  // of a dequantized value is worth (1 on sm_90a, whose e4m3 conversion is the cvt instruction).
  constexpr float unit = C::FP8 ? fp8_unit<CF>() : 1.0f;
  const float qk_mul = p.scale * p.kv.logit_k_scale_of(w.kv_head) * unit;
  const float plain_mul = qk_mul * kLog2e;
  const float v_mul = p.kv.v_scale_of(w.kv_head) * unit;
  const LogitOps ops = logit_ops(p, w);

  float o[DPAD / 2];
#pragma unroll
  for (int i = 0; i < DPAD / 2; ++i) o[i] = 0.0f;
  float m2[2] = {-INFINITY, -INFINITY}, dsum[2] = {0.0f, 0.0f};
  const uint64_t dq0 = s9::make_desc(sQ + uint32_t(row_base * 128), 16, 1024, s9::Swizzle::k128B);

  // ---- the steps of one key tile, shared by the two loops below -------------------------------
  using SAcc = float[KT / 2];            // S of one tile (64 x KT per warpgroup)
  using PFrag = uint32_t[KT / 16][4];    // P of one tile as the A fragments of P V's KT / 16 k-steps
  auto phase_of = [&](int it) { return uint32_t((ring + it) / STAGES) & 1u; };
  auto stage_of = [&](int it) { return (ring + it) % STAGES; };
  auto key0_of = [&](int it) { return (w.tile_begin + it) * KT; };

  // S = Q K^T of tile `it` into sacc: issued and committed, not waited for. The caller has waited for
  // the stage's K (full_k) and holds the ping-pong turn.
  auto issue_s = [&](int it, SAcc& sacc) {
    const uint64_t dk0 = s9::make_desc(sK(stage_of(it)), 16, 1024, s9::Swizzle::k128B);
    s9::fence_regs(sacc);
    s9::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DPAD / 16; ++kk) {
      // k16 step kk: column block kk / 4 (64 columns: rows x 128 bytes further on), 32 bytes per step in it
      s9::wgmma_ss<KT, T, 0, 0>(sacc, s9::desc_add(dq0, uint32_t((kk >> 2) * C::ROWS * 128 + (kk & 3) * 32)),
                                s9::desc_add(dk0, uint32_t((kk >> 2) * KT * 128 + (kk & 3) * 32)), kk > 0 ? 1 : 0);
    }
    s9::wgmma_commit();
  };
  auto wait_k = [&](int it) {
    s9::mbar_wait(full_k(stage_of(it)), phase_of(it));
    s9::fence_proxy_async();
  };

  // Logits of tile `it` (log2 units, masked) and the online softmax of both rows (as the mma.sync
  // kernels: the accumulator of row h, column 8 i + 2 t4 + e is sacc[4 i + 2 h + e]): sacc becomes the
  // unnormalized weights, m2 / dsum move on; alpha[h] is what O must be multiplied by before this
  // tile's P V is added, and the result says whether any row of the warp needs it (alpha != 1).
  auto softmax = [&](int it, SAcc& sacc, float (&alpha)[2]) -> bool {
    const int k0 = key0_of(it);
    const bool need_mask = tile_needs_mask(w, k0, KT, ops);
    if (ops.plain && !need_mask) {
#pragma unroll
      for (int i = 0; i < KT / 2; ++i) sacc[i] *= plain_mul;
    } else {
#pragma unroll
      for (int i = 0; i < KT / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + i * 8 + 2 * t4 + (e & 1);
          const int pos = rpos[e >> 1];
          float x = sacc[4 * i + e];
          if (ops.plain) {
            x *= plain_mul;
            if (need_mask && !key_visible(key, pos, ops)) x = -INFINITY;
          } else {
            x = transform_logit(x * qk_mul, ops, slope[e >> 1], key, pos, need_mask);
          }
          sacc[4 * i + e] = x;
        }
      }
    }
    bool rescale = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < KT / 8; ++i) mx = fmaxf(mx, fmaxf(sacc[4 * i + 2 * h], sacc[4 * i + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m2[h], mx);
      const float base_m = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: all weights 0
      alpha[h] = exp2f(m2[h] - base_m);                          // m2 = -inf gives 0
      m2[h] = m_new;
      rescale = rescale || alpha[h] != 1.0f;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < KT / 8; ++i) {
        sacc[4 * i + 2 * h] = exp2f(sacc[4 * i + 2 * h] - base_m);
        sacc[4 * i + 2 * h + 1] = exp2f(sacc[4 * i + 2 * h + 1] - base_m);
        sum += sacc[4 * i + 2 * h] + sacc[4 * i + 2 * h + 1];
      }
      dsum[h] = dsum[h] * alpha[h] + sum;  // per-thread partial; the quad sums at the end
    }
    return __any_sync(0xffffffffu, rescale) != 0;
  };
  auto rescale_o = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < DPAD / 8; ++i) {
      o[4 * i] *= alpha[0], o[4 * i + 1] *= alpha[0];
      o[4 * i + 2] *= alpha[1], o[4 * i + 3] *= alpha[1];
    }
  };
  // P (rounded to T) as the A fragments of P V: the S accumulators of n8 blocks 2 kk and 2 kk + 1 (the
  // mma.sync A layout per warp, rows 16 wq ..).
  auto pack_p = [&](const SAcc& sacc, PFrag& pa) {
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
      pa[kk][0] = pack2<T>(sacc[8 * kk + 0], sacc[8 * kk + 1]);
      pa[kk][1] = pack2<T>(sacc[8 * kk + 2], sacc[8 * kk + 3]);
      pa[kk][2] = pack2<T>(sacc[8 * kk + 4], sacc[8 * kk + 5]);
      pa[kk][3] = pack2<T>(sacc[8 * kk + 6], sacc[8 * kk + 7]);
    }
  };

  // Waits for the V of tile `it` and says whether its P V must take the scalar path. A tile whose keys
  // some rows see and others do not (the causal diagonal, a window's edge) with an inf / NaN value:
  // 0 * inf in the tensor product would reach rows that do not see the key, so such a tile (rare: V
  // must hold a non-finite value) takes the scalar product instead. The decision is the warpgroup's
  // (the wgmma is a warpgroup instruction): a scan of the V tile, the warps' results through shared
  // memory (double-buffered by scan).
  auto wait_v_needs_fixup = [&](int it) -> bool {
    const int s = stage_of(it);
    s9::mbar_wait(full_v(s), phase_of(it));
    s9::fence_proxy_async();
    if (!(tile_needs_mask(w, key0_of(it), KT, ops) && w.nq > 1)) return false;
    const unsigned char* tv = smem + (sV(s) - base);
    uint32_t any = 0u;
    for (int i = wt; i < KT * C::CPR; i += 128) {
      const uint4 u = reinterpret_cast<const uint4*>(tv)[i];
      any |= nonfinite2<T>(u.x) | nonfinite2<T>(u.y) | nonfinite2<T>(u.z) | nonfinite2<T>(u.w);
    }
    const int warp_any = __any_sync(0xffffffffu, any != 0u);
    if (lane == 0) nf_flags[wg][nscan & 1][wq] = warp_any;
    s9::named_bar_sync(3 + wg, 128);
    const bool fix = (nf_flags[wg][nscan & 1][0] | nf_flags[wg][nscan & 1][1] | nf_flags[wg][nscan & 1][2] |
                      nf_flags[wg][nscan & 1][3]) != 0;
    ++nscan;
    return fix;
  };

  // O += P B by wgmma, B from the N-major descriptor dv0 (k16 step kk at kk x step, 64-value column
  // blocks lbo apart): V of a stage (step 2048, lbo KT x 128), or the overlapped loop's zeros (step 0).
  // Issued and committed, not waited for (wgmma_wait, then pv_done).
  auto issue_pv_desc = [&](uint64_t dv0, uint32_t step, uint32_t lbo, PFrag& pa) {
    s9::fence_regs(o);
    s9::wgmma_fence();
    if constexpr (DPAD <= 128) {
#pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk) s9::wgmma_rs<DPAD, T, 1>(o, pa[kk], s9::desc_add(dv0, kk * step), 1);
    } else {
      // 256 output columns as two m64n128k16 products per k-step (the wrappers stop at n128): half h
      // reads B's column blocks 2 h, 2 h + 1 (2 lbo on) into o[64 h ..], which in the accumulator
      // layout are exactly the n256 fragment's columns 128 h .. (o[4 i + ..] is column 8 i + ..), so
      // the softmax rescale and the epilogue index o as at the other head dims.
      float(&o_lo)[64] = *reinterpret_cast<float(*)[64]>(&o[0]);
      float(&o_hi)[64] = *reinterpret_cast<float(*)[64]>(&o[64]);
#pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk) {
        s9::wgmma_rs<128, T, 1>(o_lo, pa[kk], s9::desc_add(dv0, kk * step), 1);
        s9::wgmma_rs<128, T, 1>(o_hi, pa[kk], s9::desc_add(dv0, kk * step + 2 * lbo), 1);
      }
    }
    s9::wgmma_commit();
  };
  constexpr uint32_t kVLbo = KT * 128;
  auto v_desc = [&](int it) { return s9::make_desc(sV(stage_of(it)), kVLbo, 1024, s9::Swizzle::k128B); };
  auto issue_pv = [&](int it, PFrag& pa) { issue_pv_desc(v_desc(it), 2048u, kVLbo, pa); };
  // After the wgmma_wait that completed a P V: its accumulators readable, its A registers reusable.
  auto pv_done = [&](PFrag& pa) {
    s9::fence_regs(o);
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) s9::fence_regs(pa[kk]);
  };
  // The non-finite fix-up's P V of tile `it` in scalar code over the keys each row sees: P (already
  // rounded) through shared memory, V read from the stage; every thread its own output elements.
  auto scalar_pv = [&](int it, const PFrag& pa) {
    const int k0 = key0_of(it);
    unsigned char* sp = smem + C::P_OFF + wg * C::WG_ROWS * KT * 2;
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = 16 * wq + g + 8 * (j & 1), key = 16 * kk + 8 * (j >> 1) + 2 * t4;
        *reinterpret_cast<uint32_t*>(sp + (r * KT + key) * 2) = pa[kk][j];
      }
    }
    s9::named_bar_sync(3 + wg, 128);
    const unsigned char* tv = smem + (sV(stage_of(it)) - base);
    // Key by key, straight into O (few registers beyond O: the overlapped loop runs this with P of the
    // tile live); a key a row does not see is skipped, not multiplied by 0. (Columns past Dv: zeros,
    // never written out.)
    const unsigned char* p0 = sp + (16 * wq + g) * KT * 2;
    const unsigned char* p1 = p0 + 8 * KT * 2;
#pragma unroll 1
    for (int kl = 0; kl < KT; ++kl) {
      const bool see0 = rvalid[0] && key_visible(k0 + kl, rpos[0], ops);
      const bool see1 = rvalid[1] && key_visible(k0 + kl, rpos[1], ops);
      if (!see0 && !see1) continue;
      const float w0 = bits16_to_float<T>(*reinterpret_cast<const uint16_t*>(p0 + kl * 2));
      const float w1 = bits16_to_float<T>(*reinterpret_cast<const uint16_t*>(p1 + kl * 2));
#pragma unroll
      for (int i = 0; i < DPAD / 8; ++i) {
        const uint32_t vv = *reinterpret_cast<const uint32_t*>(tv + sw128_elem<KT>(kl, 8 * i + 2 * t4));
        const float v0 = bits16_to_float<T>(uint16_t(vv & 0xffffu)), v1 = bits16_to_float<T>(uint16_t(vv >> 16));
        if (see0) o[4 * i] += w0 * v0, o[4 * i + 1] += w0 * v1;
        if (see1) o[4 * i + 2] += w1 * v0, o[4 * i + 3] += w1 * v1;
      }
    }
    s9::named_bar_sync(3 + wg, 128);  // the P buffer is read before a later fix-up rewrites it
  };

  // Ping-pong: the consumers issue their tensor-core work in turns (barrier 1 is consumer 0's turn, 2
  // consumer 1's); consumer 0 goes first. Each takes ntiles turns, and each turn but consumer 1's last
  // hands the next one to the other consumer.
  if (wg == 1 && ntiles > 0) s9::named_bar_arrive(1, 256);
  auto turn_begin = [&]() { s9::named_bar_sync(1 + wg, 256); };
  auto turn_end = [&](int it) {
    if (!(wg == 1 && it == ntiles - 1)) s9::named_bar_arrive(2 - wg, 256);
  };

  if constexpr (!OVERLAP) {
    // Per tile: S (in the turn), its softmax, then P V, each product waited for right after its issue.
    for (int it = 0; it < ntiles; ++it) {
      SAcc sacc;
      wait_k(it);
      turn_begin();
      issue_s(it, sacc);
      turn_end(it);
      s9::wgmma_wait<0>();
      s9::fence_regs(sacc);
      float alpha[2];
      if (softmax(it, sacc, alpha)) rescale_o(alpha);
      PFrag pa;
      pack_p(sacc, pa);
      if (!wait_v_needs_fixup(it)) {
        issue_pv(it, pa);
        s9::wgmma_wait<0>();
        pv_done(pa);
      } else {
        scalar_pv(it, pa);
      }
      s9::mbar_arrive(empty(stage_of(it)));  // this thread is done with the stage
    }
  } else {
    // Intra-warpgroup overlap (FlashAttention-3's): the turn of tile it issues S of tile it and then
    // P V of tile it - 1 (two commit groups, in that order); the softmax of tile it runs once S has
    // completed (wgmma_wait<1>: every group but the newest, the P V) while that P V still occupies the
    // tensor cores. Two tiles are live: S of tile it in sacc, P of tile it - 1 in pa (read by the P V
    // in flight). O is rescaled by tile it's alpha only after that P V completed (it adds tile it - 1's
    // weights, in the previous maximum's units), and tile it - 1's stage is released then. Tile 0's S
    // comes before the loop, the last tile's P V after it.
    //
    // Every path issues the same wgmma in the same order: ptxas serializes every wgmma of a kernel
    // whose accumulators might be in flight on one side of a branch and not on the other (C7518). So
    // a tile needing the non-finite fix-up adds its P V in scalar code as soon as its V is scanned
    // (nothing in flight then) and its P V wgmma is still issued, with A = 0 and B a zeroed part of this
    // consumer's fix-up buffer: it adds exactly +0.
    unsigned char* const zero_b = smem + C::P_OFF + wg * C::WG_ROWS * KT * 2;  // 16 keys x DPAD, N-major
    constexpr uint32_t kZeroBytes = DPAD / 64 * 2048;
    static_assert(kZeroBytes <= C::WG_ROWS * KT * 2, "the zeros fit in the consumer's fix-up buffer");
    const uint64_t zero_desc = s9::make_desc(base + uint32_t(zero_b - smem), 2048, 1024, s9::Swizzle::k128B);
    auto zero_fill = [&]() {
      for (uint32_t i = uint32_t(wt) * 16; i < kZeroBytes; i += 128 * 16)
        *reinterpret_cast<uint4*>(zero_b + i) = make_uint4(0u, 0u, 0u, 0u);
      s9::fence_proxy_async();  // generic-proxy stores, before a wgmma reads them
      s9::named_bar_sync(3 + wg, 128);
    };
    zero_fill();
    PFrag pa;  // P of the previous tile (all 0 when its P V was added by the fix-up)
    bool prev_fix = false;
    // After tile it's softmax (nothing in flight): P, its V waited for and scanned; the fix-up.
    auto finish_tile = [&](int it, const SAcc& sacc) {
      pack_p(sacc, pa);
      prev_fix = wait_v_needs_fixup(it);
      if (prev_fix) {
        scalar_pv(it, pa);
        zero_fill();  // (scalar_pv wrote P over the zeros)
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
      }
    };
    // P V of tile it by wgmma: V from its stage, or the zeros after a fix-up.
    auto issue_pv_or_zero = [&](int it) {
      issue_pv_desc(prev_fix ? zero_desc : v_desc(it), prev_fix ? 0u : 2048u, prev_fix ? 2048u : kVLbo, pa);
    };
    if (ntiles > 0) {
      SAcc sacc;
      wait_k(0);
      turn_begin();
      issue_s(0, sacc);
      turn_end(0);
      s9::wgmma_wait<0>();
      s9::fence_regs(sacc);
      float alpha[2];
      softmax(0, sacc, alpha);  // (O is 0: nothing to rescale)
      finish_tile(0, sacc);
    }
    for (int it = 1; it < ntiles; ++it) {
      SAcc sacc;
      wait_k(it);
      turn_begin();
      issue_s(it, sacc);
      issue_pv_or_zero(it - 1);
      turn_end(it);
      s9::wgmma_wait<1>();  // S of tile it
      s9::fence_regs(sacc);
      float alpha[2];
      const bool rescale = softmax(it, sacc, alpha);
      s9::wgmma_wait<0>();  // P V of tile it - 1
      pv_done(pa);
      s9::mbar_arrive(empty(stage_of(it - 1)));  // done with tile it - 1's stage
      if (rescale) rescale_o(alpha);
      finish_tile(it, sacc);
    }
    if (ntiles > 0) {
      issue_pv_or_zero(ntiles - 1);
      s9::wgmma_wait<0>();
      pv_done(pa);
      s9::mbar_arrive(empty(stage_of(ntiles - 1)));
    }
  }

  // ---- epilogue: rows to out / lse, or the split's normalized partial -------------------------
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 1);
    dsum[h] += __shfl_xor_sync(0xffffffffu, dsum[h], 2);
  }
  const float vm = checked_v_mul(v_mul);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const RowId id = my_row(h);
    if (!id.valid) continue;
    const int64_t row = id.token * p.num_heads + id.head;
    if (a.num_splits == 1) {
      float mul;
      const float lse2 = finish_row<true>(m2[h], dsum[h], pos_has_keys(p, id.pos, w.seq_len),
                                          p.sinks ? p.sinks[id.head] * kLog2e : -INFINITY, &mul);
      mul *= vm;
      T* out = static_cast<T*>(p.out) + row * dv;
#pragma unroll
      for (int i = 0; i < DPAD / 8; ++i) {
        const int c = 8 * i + 2 * t4;
        if (c < dv) *reinterpret_cast<uint32_t*>(out + c) = pack2<T>(o[4 * i + 2 * h] * mul, o[4 * i + 2 * h + 1] * mul);
      }
      if (t4 == 0) p.lse[row] = lse2 * kLn2;
    } else {
      const float D = dsum[h], M = m2[h];
      const float lse2 = D == 0.0f ? -INFINITY : M + log2f(D);
      const float mul = D == 0.0f ? 0.0f : vm / D;
      const int64_t prow = int64_t(w.split) * p.num_tokens * p.num_heads + row;
      float* out = a.part_o + prow * dv;
#pragma unroll
      for (int i = 0; i < DPAD / 8; ++i) {
        const int c = 8 * i + 2 * t4;
        if (c < dv) *reinterpret_cast<float2*>(out + c) = make_float2(o[4 * i + 2 * h] * mul, o[4 * i + 2 * h + 1] * mul);
      }
      if (t4 == 0) a.part_lse[prow] = lse2;
    }
  }
  ring += ntiles;
  }
#else
  (void)a;
#endif
}

// Whether this build has the kernel's sm_90a code (its static shared memory: the stub compiled for
// other architectures has none); the planner falls back to the mma.sync prefill otherwise. Asked only
// on an sm_90 device (the planner checks that first), once per process. (The overlapped instance is
// compiled with it, in the same unit for the same architectures.)
template <typename T, CacheFormat CF, int DPAD>
bool sm90_prefill_compiled() {
#if defined(KVKERNELS_CUDA_EMU)
  return true;
#else
  static const bool compiled = [] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, sm90_prefill_kernel<T, CF, DPAD, false>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.sharedSizeBytes >= sizeof(int) * 2 * 2 * 4;
  }();
  return compiled;
#endif
}

template <typename T, CacheFormat CF, int DPAD, bool OVERLAP, bool PERSIST>
cudaError_t launch_sm90_kernel(const AttnArgs& a, const Sm90KvTma& tma, dim3 grid, cudaStream_t stream) {
  using C = Sm90Cfg<T, CF, DPAD>;
  static std::atomic<uint64_t> configured{0};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit == 0 || !(configured.load(std::memory_order_acquire) & bit)) {
    err = cudaFuncSetAttribute(sm90_prefill_kernel<T, CF, DPAD, OVERLAP, PERSIST>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               C::SMEM);
    if (err != cudaSuccess) return err;
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  if (C::FP8 && tma.box_rows != 0) return cudaErrorInvalidValue;  // (the raw fp8 tiles are gathered)
  if (PERSIST != (a.work_x > 0)) return cudaErrorInvalidValue;
  sm90_prefill_kernel<T, CF, DPAD, OVERLAP, PERSIST><<<grid, C::NT, C::SMEM, stream>>>(a, tma);
  return cudaGetLastError();
}

// The kernel with the overlapped loop or without (the planner asks for overlap only where
// has_wgmma_overlap(DPAD); anything else is a planner bug, not a silent fallback); a.work_x > 0: the
// persistent kernel (`grid`: its CTAs), on the overlapped loop where it exists, else the plain one.
template <typename T, CacheFormat CF, int DPAD>
cudaError_t launch_sm90_prefill(const AttnArgs& a, const Sm90KvTma& tma, bool overlap, dim3 grid, cudaStream_t stream) {
  if (a.work_x > 0) {
    if (overlap != has_wgmma_overlap(DPAD)) return cudaErrorInvalidValue;
    return launch_sm90_kernel<T, CF, DPAD, has_wgmma_overlap(DPAD), true>(a, tma, grid, stream);
  }
  if (!overlap) return launch_sm90_kernel<T, CF, DPAD, false, false>(a, tma, grid, stream);
  if constexpr (has_wgmma_overlap(DPAD)) return launch_sm90_kernel<T, CF, DPAD, true, false>(a, tma, grid, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kvkernels::attn_cuda
