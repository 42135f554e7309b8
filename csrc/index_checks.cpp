#include "index_checks.h"

#include <algorithm>

namespace kvkernels {

void check_paged_kv_indices(const ArgError& c, const paged_kv_t& kv) {
  const int64_t capacity = kv.max_blocks_per_seq * kv.block_size;
  for (int64_t s = 0; s < kv.num_seqs; ++s) {
    const int64_t len = kv.seq_lens[s];
    c.expect(len >= 0, "seq_lens", "sequence ", s, " has negative length ", len);
    c.expect(len <= capacity, "seq_lens", "sequence ", s, " has ", len,
             " tokens but its block_tables row holds at most ", capacity, " (",
             plural(kv.max_blocks_per_seq, "block"), " of ", kv.block_size, ")");
    const int64_t used = ceil_div(len, kv.block_size);
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = kv.block_id(s, b);
      c.expect(id >= 0 && id < kv.num_blocks, "block_tables", "entry [", s, ", ", b, "] = ", id,
               " is out of range for a cache of ", kv.num_blocks, " blocks");
    }
  }
}

void check_query_start_loc(const ArgError& c, const AttentionParams& p) {
  if (!p.query_start_loc) return;
  const int32_t* q = p.query_start_loc;
  c.expect(q[0] == 0, "query_start_loc", "must start at 0, got ", q[0]);
  for (int64_t s = 0; s < p.kv.num_seqs; ++s) {
    // A sequence may have more queries than keys (docs/ops.md): its leading rows see no key.
    c.expect(q[s + 1] >= q[s], "query_start_loc", "decreases at index ", s + 1, " (", q[s], " -> ",
             q[s + 1], ")");
  }
  c.expect(q[p.kv.num_seqs] == p.num_tokens, "query_start_loc", "must end at num_tokens = ",
           p.num_tokens, ", got ", q[p.kv.num_seqs]);
}

void check_slots(const ArgError& c, const int64_t* slots, int64_t num_tokens, int64_t num_slots) {
  for (int64_t t = 0; t < num_tokens; ++t)
    c.expect(slots[t] < num_slots, "slot_mapping", "slot ", slots[t], " of token ", t,
             " is out of range for a cache of ", num_slots, " slots");
}

void check_block_mapping(const ArgError& c, const int64_t* mapping, int64_t num_pairs,
                         int64_t src_num_blocks, int64_t dst_num_blocks, bool same_tensor) {
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t s = mapping[2 * i], d = mapping[2 * i + 1];
    c.expect(s >= 0 && s < src_num_blocks, "block_mapping", "row ", i, ": source block ", s,
             " is out of range [0, ", src_num_blocks, ")");
    c.expect(d >= 0 && d < dst_num_blocks, "block_mapping", "row ", i, ": destination block ", d,
             " is out of range [0, ", dst_num_blocks, ")");
  }
  // The destinations sorted: memory in the number of pairs, not in the number of blocks.
  std::vector<int64_t> dsts(static_cast<size_t>(num_pairs));
  for (int64_t i = 0; i < num_pairs; ++i) dsts[i] = mapping[2 * i + 1];
  std::sort(dsts.begin(), dsts.end());
  const auto dup = std::adjacent_find(dsts.begin(), dsts.end());
  c.expect(dup == dsts.end(), "block_mapping", "destination block ",
           dup == dsts.end() ? 0 : *dup, " appears more than once");
  if (!same_tensor) return;
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t s = mapping[2 * i];
    c.expect(!std::binary_search(dsts.begin(), dsts.end(), s), "block_mapping", "block ", s,
             " is both a source and a destination in one call");
  }
}

std::vector<int64_t> token_starts(const paged_kv_t& kv) {
  std::vector<int64_t> starts(static_cast<size_t>(kv.num_seqs) + 1, 0);
  for (int64_t s = 0; s < kv.num_seqs; ++s) starts[s + 1] = starts[s] + kv.seq_lens[s];
  return starts;
}

std::vector<int64_t> checked_token_starts(const ArgError& c, const paged_kv_t& kv,
                                          std::optional<int64_t> num_tokens) {
  check_paged_kv_indices(c, kv);
  std::vector<int64_t> starts = token_starts(kv);
  c.expect(!num_tokens.has_value() || starts.back() == *num_tokens, "num_tokens", "is ",
           num_tokens.value_or(0), " but sum(seq_lens) is ", starts.back());
  return starts;
}

}  // namespace kvkernels
