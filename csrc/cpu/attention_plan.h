// How paged attention is cut into parallel work on the CPU, and the interface between the
// ISA-neutral scheduler (attention.cpp) and the per-ISA kernels (attention_<isa>.cpp).
//
// A work item is (sequence, tile of queries, range of kv heads, KV split). For each kv head its
// rows are the tile's queries times the `group` query heads that share the kv head, so each
// key/value row is read once for all of them. Decode items take several kv heads so that a chunk
// of a paged block (all heads of 16 slots: one contiguous run in the NHD layout) is consumed at
// once, instead of eight passes that each touch every page of the block for 1/8 of its bytes.
// Keys are visited in chunks of kChunk consecutive positions (a chunk may span paged blocks of
// any size). When there are too few items to keep every thread busy (batch 1, long context, few
// kv heads), the visible keys are split into `splits` ranges whose partial results
// (unnormalized output, running max, denominator) are merged exactly afterwards.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvkernels/params.h"

namespace kvkernels::cpu {

constexpr int kChunk = 16;  // keys per softmax step (a multiple of every ISA's vector width)
// The tile kernels of prefill (attention_tiles.h): keys per softmax step, and rows per item, enough
// that packing a chunk once is cheap next to the rows that use it.
constexpr int kTileChunk = 64;
constexpr int kTileRows = 256;

// How an item is computed: the vector kernel (attention_kernel.h), or tiles of 16 rows x 64 keys
// (attention_tiles.h) multiplied with AVX-512 FMAs, with vdpbf16ps (AVX512_BF16) or on AMX.
enum class TileKernel : int { kNone, kFma, kDp, kAmx };

struct AttentionPlan {
  int group = 1;       // query heads per kv head
  int q_tile = 1;      // queries per item
  int heads = 1;       // kv heads per item
  int max_rows = 0;    // q_tile * group rounded up to a multiple of 4
  int dk = 0, dv = 0;  // head_dim, head_dim_v rounded up to 32 (scratch row widths)
  int splits = 1;      // KV ranges per (sequence, query tile, kv head)
  TileKernel tiles = TileKernel::kNone;  // not kNone: heads == 1, max_rows % 16 == 0
  // The vector kernel's vdpbf16ps form (attention_dp.h: bf16 queries over fp8 caches on avx512bf16
  // and avx512amx); dk and dv are then multiples of 64.
  bool dp = false;
};

// Per-thread scratch (floats): for each kv head of an item, queries, accumulators, logits and
// softmax state of max_rows rows, its key and value chunk converted to float32, and the
// probabilities as bf16 (2 kChunk per row, the dp form).
inline size_t attention_head_scratch_floats(const AttentionPlan& plan) {
  return size_t(plan.max_rows) * (plan.dk + plan.dv + 2 * kChunk + 3) +
         size_t(kChunk) * (plan.dk + plan.dv);
}
inline size_t attention_scratch_floats(const AttentionPlan& plan) {
  if (plan.tiles != TileKernel::kNone) {  // TileScratch: 10 regions, each aligned to 64 bytes
    const size_t R = size_t(plan.max_rows), Dk = size_t(plan.dk), Dv = size_t(plan.dv);
    return R * (Dk + Dv) + 3 * R + R * kTileChunk * 3 / 2 + 2 * R + (Dk + Dv) * kTileChunk +
           10 * 16;
  }
  return plan.heads * attention_head_scratch_floats(plan);
}

struct AttentionItem {
  int64_t seq = 0;
  int64_t q0 = 0, q1 = 0;  // query tile: [q0, q1) within the sequence
  int kv_head = 0;  // first kv head
  int num_kv = 1;   // kv heads [kv_head, kv_head + num_kv)
  int split = 0;
};

// Partial results of split items: item i owns rows [i * R, (i + 1) * R), R = heads * max_rows
// (head h of the item at rows h * max_rows + r).
struct AttentionPartials {
  float* acc = nullptr;  // [items * max_rows, dv]
  float* m = nullptr;    // [items * max_rows]
  float* d = nullptr;
};

struct AttentionKernels {
  // Runs items[begin, end); writes out/lse directly when plan.splits == 1, else the partials.
  void (*attend)(const AttentionParams&, const AttentionPlan&, const AttentionItem* items,
                 int64_t begin, int64_t end, float* scratch, const AttentionPartials& partials);
  // Merges the plan.splits consecutive partials that start at item `first`, writes out/lse.
  void (*merge_splits)(const AttentionParams&, const AttentionPlan&, const AttentionItem* items,
                       int64_t first, const AttentionPartials& partials);
};

extern const AttentionKernels kAttentionPortable;
#if defined(__x86_64__)
extern const AttentionKernels kAttentionAvx2;
extern const AttentionKernels kAttentionAvx512;
extern const AttentionKernels kAttentionAvx512Vbmi;
extern const AttentionKernels kAttentionAvx512Bf16;
extern const AttentionKernels kAttentionAvx512Amx;
#endif

}  // namespace kvkernels::cpu
