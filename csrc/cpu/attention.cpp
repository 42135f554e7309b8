// Paged attention on the CPU: decode, varlen (chunked prefill) and the absorbed MLA decode, which
// is the same computation over a single latent "kv head" whose value is a prefix of the key row.
// This file plans the parallel work (attention_plan.h) and runs it
// through the kernel of the active ISA (isa.h, attention_<isa>.cpp).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "../index_checks.h"
#include "../prepare.h"
#include "attention_plan.h"
#include "convert.h"
#include "isa.h"

namespace kvkernels::cpu {
namespace {

const AttentionKernels& kernels_for(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512Amx) return kAttentionAvx512Amx;
  if (isa == Isa::kAvx512Vbmi) return kAttentionAvx512Vbmi;
  if (isa == Isa::kAvx512) return kAttentionAvx512;
  if (isa == Isa::kAvx2) return kAttentionAvx2;
#endif
  return kAttentionPortable;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The tile kernels (attention_tiles.h) run on AVX-512 builds for calls with at least one tile of
// 16 rows per kv head: prefill, and MLA decode (16+ query heads over one latent head). GQA decode
// stays on the vector kernel, which reads each block once for several kv heads. Key and value rows
// must be whole vectors (multiples of 16 wide) and of one width, or for MLA the value a prefix of
// the key row. The AMX form further needs bf16 queries over bf16 or fp8 caches (both exact as bf16
// tile operands) and widths that are multiples of 32 (tile rows).
TileKernel tile_kernel(const AttentionParams& p, Isa isa, int64_t max_q_len, int group) {
  const int Dk = p.kv.head_dim, Dv = p.kv.head_dim_v;
  const bool same_width = p.kv.k == p.kv.v ? Dv <= Dk : Dv == Dk;
  if (isa < Isa::kAvx512 || max_q_len * group < 16 || group > kTileRows || !same_width ||
      Dk % 16 != 0 || Dv % 16 != 0 || Dk > 1024)
    return TileKernel::kNone;
  const CacheFormat f = p.kv.format;
  const bool amx = isa == Isa::kAvx512Amx && p.q_format == FloatFormat::kBFloat16 &&
                   Dk % 32 == 0 && Dv % 32 == 0 &&
                   (f == CacheFormat::kBFloat16 || f == CacheFormat::kFp8E4M3 ||
                    f == CacheFormat::kFp8E5M2);
  return amx ? TileKernel::kAmx : TileKernel::kFma;
}

// Query tiles hold up to 64 rows (queries x group heads) so a chunk of keys is reused by many
// queries in prefill without the per-thread scratch outgrowing the L2 cache; tile items hold up to
// kTileRows, to spread the packing of each key chunk over more rows.
AttentionPlan make_plan(const AttentionParams& p, Isa isa, int64_t max_q_len) {
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
  plan.dk = int(round_up(p.kv.head_dim, 32));  // whole Words (32 bf16) and Vecs
  plan.dv = int(round_up(p.kv.head_dim_v, 32));
  return plan;
}

// Splits the keys of each (sequence, query tile, kv head) when there are fewer such items than
// two per thread, keeping at least 8 chunks (128 keys) per split: batch 1 with one kv head and a
// long context then still uses every core. The split count comes from shapes and lengths only.
int choose_splits(int64_t base_items, int64_t max_seq_len) {
  const int64_t threads = torch::stable::get_num_threads();
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
float* thread_scratch(int slot, size_t n) {
  thread_local std::vector<float> buffers[2];
  std::vector<float>& b = buffers[slot];
  if (b.size() < n) b.resize(n);
  const char* poison = std::getenv("KVKERNELS_CPU_POISON_SCRATCH");
  if (poison != nullptr && std::strcmp(poison, "1") == 0)
    std::fill(b.begin(), b.begin() + n, std::numeric_limits<float>::quiet_NaN());
  return b.data();
}

// The index checks, run by the preparer before it allocates the outputs.
IndexCheck index_checks(const ArgCheck& c) {
  return [&c](const AttentionParams& p) {
    check_paged_kv_indices(c, p.kv);
    check_query_start_loc(c, p);
  };
}

void run_attention(const AttentionParams& p) {
  const Isa isa = active_isa();
  const AttentionKernels& kernels = kernels_for(isa);

  int64_t max_q_len = 0, max_seq_len = 0;
  for (int64_t s = 0; s < p.kv.num_seqs; ++s) {
    max_q_len = std::max(max_q_len, p.q_len(s));
    max_seq_len = std::max<int64_t>(max_seq_len, p.kv.seq_lens[s]);
  }
  AttentionPlan plan = make_plan(p, isa, max_q_len);
  std::vector<AttentionItem> items;
  for (int64_t s = 0; s < p.kv.num_seqs; ++s)
    for (int64_t q0 = 0; q0 < p.q_len(s); q0 += plan.q_tile)
      for (int h = 0; h < p.kv.num_kv_heads; h += plan.heads)
        items.push_back({s, q0, std::min(p.q_len(s), q0 + plan.q_tile), h,
                         std::min(plan.heads, p.kv.num_kv_heads - h), 0});
  plan.splits = choose_splits(static_cast<int64_t>(items.size()), max_seq_len);
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
    float* acc = thread_scratch(1, rows * (plan.dv + 2));
    partials = {acc, acc + rows * plan.dv, acc + rows * (plan.dv + 1)};
  }
  // Items differ in cost (causal prefill tiles see more keys the later they are), so each worker
  // takes the next item from a shared counter instead of a fixed contiguous range.
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, torch::stable::get_num_threads());
  torch::stable::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    float* scratch = thread_scratch(0, attention_scratch_floats(plan));
    for (int64_t i = next++; i < n; i = next++)
      kernels.attend(p, plan, items.data(), i, i + 1, scratch, partials);
  });
  if (plan.splits > 1) {
    torch::stable::parallel_for(0, n / plan.splits, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g)
        kernels.merge_splits(p, plan, items.data(), g * plan.splits, partials);
    });
  }
}

std::tuple<Tensor, Tensor> paged_attention_cpu(
    const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables, const Tensor& seq_lens, std::optional<Tensor> query_start_loc,
    std::optional<double> scale, int64_t window_left, double soft_cap,
    std::optional<Tensor> alibi_slopes, std::optional<Tensor> sinks, std::optional<Tensor> k_scale,
    std::optional<Tensor> v_scale, bool causal) {
  const ArgCheck c("paged_attention");
  PreparedAttention r = prepare_paged_attention(c, query, key_cache, value_cache, block_tables,
                                                seq_lens, query_start_loc, scale, window_left,
                                                soft_cap, alibi_slopes, sinks, k_scale, v_scale,
                                                causal, index_checks(c));
  run_attention(r.params);
  return {r.out, r.lse};
}

std::tuple<Tensor, Tensor> mla_paged_attention_cpu(const Tensor& q, const Tensor& kv_cache,
                                                   const Tensor& block_tables,
                                                   const Tensor& seq_lens, int64_t kv_lora_rank,
                                                   double scale,
                                                   std::optional<Tensor> query_start_loc,
                                                   std::optional<Tensor> kv_scale) {
  const ArgCheck c("mla_paged_attention");
  PreparedAttention r = prepare_mla_attention(c, q, kv_cache, block_tables, seq_lens, kv_lora_rank,
                                              scale, query_start_loc, kv_scale, index_checks(c));
  run_attention(r.params);
  return {r.out, r.lse};
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("paged_attention", TORCH_BOX(&kvkernels::cpu::paged_attention_cpu));
  m.impl("mla_paged_attention", TORCH_BOX(&kvkernels::cpu::mla_paged_attention_cpu));
}
