// Range checks that read the values of index tensors (host pointers); torch-free (arg_error.h). The CPU backend always runs
// them before writing; device backends run them on a host copy in debug mode (KVKERNELS_DEBUG=1).
#pragma once

#include <optional>
#include <vector>

#include "arg_error.h"
#include "kvkernels/params.h"

namespace kvkernels {

// seq_lens within [0, max_blocks_per_seq * block_size]; every block id a sequence uses in range.
void check_paged_kv_indices(const ArgError& c, const paged_kv_t& kv);

// query_start_loc starts at 0, never decreases and ends at num_tokens. (A sequence may have more
// queries than keys: with causal masking its leading rows see no key.)
void check_query_start_loc(const ArgError& c, const AttentionParams& p);

// Every slot < num_blocks * block_size (negative slots mean "skip").
void check_slots(const ArgError& c, const int64_t* slots, int64_t num_tokens, int64_t num_slots);

// Ids in range; destinations distinct; for copy_blocks (same tensor) no destination is a source.
void check_block_mapping(const ArgError& c, const int64_t* mapping, int64_t num_pairs,
                         int64_t src_num_blocks, int64_t dst_num_blocks, bool same_tensor);

// Cumulative seq_lens: [0, l0, l0 + l1, ...] (num_seqs + 1 entries).
std::vector<int64_t> token_starts(const paged_kv_t& kv);

// For ops whose output holds every token of every sequence (gather_kv, mla_decompress): checks the
// paged indices and, when num_tokens is given, that it equals sum(seq_lens); returns the
// cumulative seq_lens (its last entry is sum(seq_lens)).
std::vector<int64_t> checked_token_starts(const ArgError& c, const paged_kv_t& kv,
                                          std::optional<int64_t> num_tokens);

}  // namespace kvkernels
