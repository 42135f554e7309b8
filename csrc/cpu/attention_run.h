// The ISA-neutral scheduler of CPU paged attention (attention_plan.h describes the work items),
// torch-free so that every host of the kernels shares it: the torch extension (attention.cpp,
// torch::stable threads) and the ONNX Runtime op library (csrc/ort/, ORT's intra-op thread pool).
// A host supplies its thread count, a parallel-for and per-thread scratch (Host below).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_plan.h"
#include "isa.h"

namespace kvkernels::cpu {

// The avx512bf16 build differs from the avx512vbmi one only in its dp forms; a call that uses neither
// runs the avx512vbmi build's code (the same source compiled under other target flags was measured
// slower there: float32 decode 1.18-1.31x the CPU time, benchmarks/results/isa-ab-*-20261128-202651).
inline const AttentionKernels& kernels_for(Isa isa, const AttentionPlan& plan) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512Amx) return kAttentionAvx512Amx;
  if (isa == Isa::kAvx512Bf16)
    return plan.dp || plan.tiles == TileKernel::kDp ? kAttentionAvx512Bf16 : kAttentionAvx512Vbmi;
  if (isa == Isa::kAvx512Vbmi) return kAttentionAvx512Vbmi;
  if (isa == Isa::kAvx512) return kAttentionAvx512;
  if (isa == Isa::kAvx2) return kAttentionAvx2;
#endif
  return kAttentionPortable;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// bf16 queries over bf16 or fp8 caches on a CPU with AVX512_BF16: the logits and P V run as
// vdpbf16ps dot products (bf16 x bf16 products are exact in float32; fp8 -> bf16 is exact).
inline bool dp_formats(const AttentionParams& p, Isa isa) {
  const CacheFormat f = p.kv.format;
  return isa >= Isa::kAvx512Bf16 && p.q_format == FloatFormat::kBFloat16 &&
         (f == CacheFormat::kBFloat16 || f == CacheFormat::kFp8E4M3 || f == CacheFormat::kFp8E5M2);
}

// The tile kernels (attention_tiles.h) run on AVX-512 builds for calls with at least one tile of
// 16 rows per kv head: prefill, and MLA decode (16+ query heads over one latent head). GQA decode
// stays on the vector kernel, which reads each block once for several kv heads. Key and value rows
// must be whole vectors (multiples of 16 wide); their widths may differ (the kernels size keys and
// values separately), except that for MLA the value is a prefix of the key row. The dp (vdpbf16ps)
// and AMX forms further need bf16 queries over bf16 or fp8 caches (both exact as bf16 operands)
// and widths that are multiples of 32 (tile rows, bf16 pairs); AMX where the CPU has it.
inline TileKernel tile_kernel(const AttentionParams& p, Isa isa, int64_t max_q_len, int group) {
  const int Dk = p.kv.head_dim, Dv = p.kv.head_dim_v;
  const bool v_fits = p.kv.k != p.kv.v || Dv <= Dk;
  if (isa < Isa::kAvx512 || max_q_len * group < 16 || group > kTileRows || !v_fits ||
      Dk % 16 != 0 || Dv % 16 != 0 || Dk > 1024)
    return TileKernel::kNone;
  if (!dp_formats(p, isa) || Dk % 32 != 0 || Dv % 32 != 0) return TileKernel::kFma;
  return isa == Isa::kAvx512Amx ? TileKernel::kAmx : TileKernel::kDp;
}

// Query tiles hold up to 64 rows (queries x group heads) so a chunk of keys is reused by many
// queries in prefill without the per-thread scratch outgrowing the L2 cache; tile items hold up to
// kTileRows, to spread the packing of each key chunk over more rows.
inline AttentionPlan make_plan(const AttentionParams& p, Isa isa, int64_t max_q_len) {
  AttentionPlan plan;
  plan.group = p.num_heads / p.kv.num_kv_heads;
  plan.tiles = tile_kernel(p, isa, max_q_len, plan.group);
  if (plan.tiles != TileKernel::kNone) {
    plan.q_tile = int(std::clamp<int64_t>(kTileRows / plan.group, 1, max_q_len));
    plan.max_rows = int(round_up(int64_t(plan.q_tile) * plan.group, 16));
    plan.dk = p.kv.head_dim;
    plan.dv = p.kv.head_dim_v;
    return plan;
  }
  plan.q_tile = int(std::clamp<int64_t>(std::min<int64_t>(64 / plan.group, max_q_len), 1, 16));
  plan.max_rows = int(round_up(int64_t(plan.q_tile) * plan.group, 4));
  plan.heads = std::clamp(64 / plan.max_rows, 1, std::min(p.kv.num_kv_heads, 16));
  // In HND-like layouts a head's rows of a block are already one contiguous run: no grouping.
  if (p.kv.k_stride_head > p.kv.k_stride_slot) plan.heads = 1;
  // The vector kernel's dp form for fp8 caches only: over bf16 caches it computes in 0.69x the CPU
  // time of the float form when the cache is resident, but took 1.04-1.10x at b8 x 4096 / b1 x 16384
  // from DRAM (one thread, CPU clock: benchmarks/results/isa-ab-*-20261128-202651), where both are
  // bound by the read bandwidth; fp8 rows were compute-bound there (0.65x).
  plan.dp = dp_formats(p, isa) && p.kv.format != CacheFormat::kBFloat16;
  // Whole Words (32 bf16) and Vecs; the dp form reads rows 64 values at a time.
  plan.dk = int(round_up(p.kv.head_dim, plan.dp ? 64 : 32));
  plan.dv = int(round_up(p.kv.head_dim_v, plan.dp ? 64 : 32));
  return plan;
}

// Splits the keys of each (sequence, query tile, kv head) when there are fewer such items than
// two per thread, keeping at least 8 chunks (128 keys) per split: batch 1 with one kv head and a
// long context then still uses every core. The split count comes from shapes and lengths only.
inline int choose_splits(int64_t base_items, int64_t max_seq_len, int64_t threads) {
  if (base_items == 0 || base_items >= 2 * threads) return 1;
  const int64_t wanted = (2 * threads + base_items - 1) / base_items;
  const int64_t most = std::max<int64_t>(1, max_seq_len / (8 * kChunk));
  return int(std::min(wanted, most));
}

// Float scratch of this thread, reused across calls (grow-only; two slots: a worker's scratch and
// the split partials of the calling thread, which is also a worker). A zeroed vector per call
// cost a memset and page faults of a few hundred KiB, most of a small decode call. The kernels
// write everything they read; with KVKERNELS_CPU_POISON_SCRATCH=1 (set by the tests) the buffer is
// filled with NaN on every call, so a read of a stale value shows in the output.
inline float* thread_scratch(int slot, size_t n) {
  thread_local std::vector<float> buffers[2];
  std::vector<float>& b = buffers[slot];
  if (b.size() < n) b.resize(n);
  const char* poison = std::getenv("KVKERNELS_CPU_POISON_SCRATCH");
  if (poison != nullptr && std::strcmp(poison, "1") == 0)
    std::fill(b.begin(), b.begin() + n, std::numeric_limits<float>::quiet_NaN());
  return b.data();
}

// What a host provides:
//   int64_t threads() const;                          threads its parallel-for may use
//   void parallel_for(int64_t n, F f) const;          calls f(begin, end) over ranges covering [0, n)
//   float* scratch(int slot, size_t n) const;         this thread's floats; slot 0 is a worker's
//                                                     scratch, slot 1 the calling thread's partials
template <typename Host>
void run_attention_on(const AttentionParams& p, const Host& host) {
  const Isa isa = active_isa();

  int64_t max_q_len = 0, max_seq_len = 0;
  for (int64_t s = 0; s < p.kv.num_seqs; ++s) {
    max_q_len = std::max(max_q_len, p.q_len(s));
    max_seq_len = std::max<int64_t>(max_seq_len, p.kv.seq_lens[s]);
  }
  AttentionPlan plan = make_plan(p, isa, max_q_len);
  const AttentionKernels& kernels = kernels_for(isa, plan);
  std::vector<AttentionItem> items;
  for (int64_t s = 0; s < p.kv.num_seqs; ++s)
    for (int64_t q0 = 0; q0 < p.q_len(s); q0 += plan.q_tile)
      for (int h = 0; h < p.kv.num_kv_heads; h += plan.heads)
        items.push_back({s, q0, std::min(p.q_len(s), q0 + plan.q_tile), h,
                         std::min(plan.heads, p.kv.num_kv_heads - h), 0});
  plan.splits = choose_splits(static_cast<int64_t>(items.size()), max_seq_len, host.threads());
  if (plan.splits > 1) {
    std::vector<AttentionItem> split_items;
    for (const AttentionItem& it : items)
      for (int k = 0; k < plan.splits; ++k) {
        split_items.push_back(it);
        split_items.back().split = k;
      }
    items.swap(split_items);
  }
  const int64_t n = static_cast<int64_t>(items.size());

  AttentionPartials partials;
  if (plan.splits > 1) {
    const size_t rows = size_t(n) * plan.heads * plan.max_rows;
    float* acc = host.scratch(1, rows * (plan.dv + 2));
    partials = {acc, acc + rows * plan.dv, acc + rows * (plan.dv + 1)};
  }
  // Items differ in cost (causal prefill tiles see more keys the later they are), so each worker
  // takes the next item from a shared counter instead of a fixed contiguous range.
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, host.threads());
  host.parallel_for(workers, [&](int64_t, int64_t) {
    float* scratch = host.scratch(0, attention_scratch_floats(plan));
    for (int64_t i = next++; i < n; i = next++)
      kernels.attend(p, plan, items.data(), i, i + 1, scratch, partials);
  });
  if (plan.splits > 1) {
    host.parallel_for(n / plan.splits, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        kernels.merge_splits(p, plan, items.data(), g * plan.splits, partials);
    });
  }
}

}  // namespace kvkernels::cpu
