// The binding layer shared by every backend: validate the tensors of one op call (dtype, shape,
// device, strides, sizes the kernels hold in an int, memory shared between an output and another
// argument), allocate its outputs on the inputs' device and fill the torch-free params struct of
// csrc/include/kvkernels/params.h. Outputs are allocated last, after every check (the backend's
// index checks included, through IndexCheck / TokenCounter). Nothing here reads device data;
// index-range checks that need the values of index tensors live in index_checks.h.
#pragma once

#include <functional>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "checks.h"
#include "kvkernels/params.h"

namespace kvkernels {

// Tensors created while preparing (contiguous copies of inputs, outputs) must outlive the kernel.
struct Prepared {
  std::vector<Tensor> keep_alive;
  // Caller-provided outputs the kernels cannot write directly (not contiguous): the kernel writes
  // a contiguous temporary (first), which finish() copies into the caller's tensor (second).
  std::vector<std::pair<Tensor, Tensor>> copy_back;
  // Call after the kernel (on a device: after its launch, same stream).
  void finish() const;
};

// The outputs a caller passes to an *_out op (docs/ops.md, "Caller-provided outputs"). Neither:
// the op allocates both. `out` without `lse`: lse is computed but not returned (p.lse is nullptr
// after preparing; the backend points it at scratch, see ensure_lse). `lse` needs `out`.
struct GivenOutputs {
  std::optional<Tensor> out, lse;
};

// The two kernels a backend registers for an op with an *_out twin (paged_attention and
// paged_attention_out, ...), both from its one `impl(given, args...)`: `allocating(args...)` (no given
// outputs) and `into(args..., out, lse)`, the schema of the _out op. Register them with
// TORCH_BOX(&OutVariants<impl>::allocating) / TORCH_BOX(&OutVariants<impl>::into).
template <auto Impl>
struct OutVariants;
template <typename... A, std::tuple<Tensor, Tensor> (*Impl)(const GivenOutputs&, A...)>
struct OutVariants<Impl> {
  static std::tuple<Tensor, Tensor> allocating(A... a) { return Impl({}, a...); }
  static void into(A... a, Tensor out, std::optional<Tensor> lse) { Impl({out, lse}, a...); }
};

struct PreparedAttention : Prepared {
  AttentionParams params;
  Tensor out, lse;
};

// Checks of the values of the index tensors (index_checks.h), run by the attention preparers after
// every other check and before the outputs are allocated: the CPU backend always passes one,
// device backends in debug mode (on host copies). Empty: none.
using IndexCheck = std::function<void(const AttentionParams&)>;

PreparedAttention prepare_paged_attention(
    const ArgCheck& check, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables, const Tensor& seq_lens,
    const std::optional<Tensor>& query_start_loc, std::optional<double> scale, int64_t window_left,
    double soft_cap, const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale, std::optional<bool> causal,
    const IndexCheck& check_indices = {}, const GivenOutputs& given = {});

PreparedAttention prepare_mla_attention(
    const ArgCheck& check, const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
    const Tensor& seq_lens, int64_t kv_lora_rank, double scale,
    const std::optional<Tensor>& query_start_loc, const std::optional<Tensor>& kv_scale,
    const IndexCheck& check_indices = {}, const GivenOutputs& given = {});

struct PreparedMerge : Prepared {
  MergeParams params;
  Tensor out, lse;
};

PreparedMerge prepare_merge(const ArgCheck& check, const Tensor& out_a, const Tensor& lse_a,
                            const Tensor& out_b, const Tensor& lse_b,
                            const GivenOutputs& given = {});

// Device backends: allocates the lse an out= call without lse= leaves unset (p.lse == nullptr),
// as scratch the caller never sees. (The CPU backend uses a reused per-thread buffer instead.)
void ensure_lse(const ArgCheck& check, Prepared& r, float*& lse, const Tensor& like,
                int64_t num_tokens, int64_t num_heads);

struct PreparedCacheWrite : Prepared {
  std::vector<CacheWriteParams> writes;  // one per (source, cache) pair
};

PreparedCacheWrite prepare_reshape_and_cache(const ArgCheck& check, const Tensor& key,
                                             const Tensor& value, const Tensor& key_cache,
                                             const Tensor& value_cache, const Tensor& slot_mapping,
                                             const std::optional<Tensor>& k_scale,
                                             const std::optional<Tensor>& v_scale);

PreparedCacheWrite prepare_concat_and_cache_mla(const ArgCheck& check, const Tensor& kv_c,
                                                const Tensor& k_pe, const Tensor& kv_cache,
                                                const Tensor& slot_mapping,
                                                const std::optional<Tensor>& scale);

struct PreparedBlockCopy : Prepared {
  BlockCopyParams params;
  int64_t src_num_blocks = 0, dst_num_blocks = 0;
};

// copy_blocks: src == dst == cache. swap_blocks: any two tensors of matching block shape.
PreparedBlockCopy prepare_block_copy(const ArgCheck& check, const Tensor& src, const Tensor& dst,
                                     const Tensor& block_mapping, int64_t block_dim,
                                     bool same_tensor);

struct PreparedGather : Prepared {
  GatherParams params;
  Tensor key, value;
};

// The output length of gather_kv / mla_decompress, resolved after every other check and before the
// outputs are allocated: given the caller's num_tokens (nullopt: not given), returns the length to
// allocate. It checks the paged indices and num_tokens == sum(seq_lens) wherever it reads seq_lens
// (always on the CPU; on a device when num_tokens is not given, or in debug mode). How it reads
// them (directly, or after a device-to-host copy) is the backend's business.
using TokenCounter =
    std::function<int64_t(const paged_kv_t&, std::optional<int64_t> num_tokens)>;

PreparedGather prepare_gather_kv(const ArgCheck& check, const Tensor& key_cache,
                                 const Tensor& value_cache, const Tensor& block_tables,
                                 const Tensor& seq_lens, const std::optional<Tensor>& k_scale,
                                 const std::optional<Tensor>& v_scale,
                                 std::optional<int64_t> num_tokens,
                                 std::optional<ScalarType> out_dtype, const TokenCounter& count);

struct PreparedDecompress : Prepared {
  MlaDecompressParams params;
  Tensor key, value;
  Tensor w_kv_b;  // contiguous (the input itself when it already is)
};

PreparedDecompress prepare_mla_decompress(
    const ArgCheck& check, const Tensor& kv_cache, const Tensor& block_tables,
    const Tensor& seq_lens, const Tensor& w_kv_b, int64_t kv_lora_rank, int64_t qk_nope_head_dim,
    int64_t v_head_dim, const std::optional<Tensor>& norm_weight, double norm_eps,
    const std::optional<Tensor>& scale, std::optional<int64_t> num_tokens,
    const TokenCounter& count);

// Helpers also used by backends.
FloatFormat float_format(ScalarType t);
CacheFormat cache_format(ScalarType t);
// t itself if its last dimension has stride 1, else a contiguous copy (kept alive by `keep`); a copy
// that cannot be allocated is an error naming `arg`.
Tensor with_unit_last_stride(const ArgCheck& check, const Tensor& t, const char* arg, Prepared& keep);

}  // namespace kvkernels
