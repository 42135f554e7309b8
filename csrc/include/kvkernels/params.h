// Torch-free parameter structs: what a kernel needs, as raw pointers, sizes and strides.
// The binding layer (csrc/bind/) fills them from validated tensors; CPU and CUDA kernels read them.
// Strides are in elements, not bytes. Index tensors (block tables, slot mappings, ...) are made
// contiguous by the binding layer, so they carry no strides.
#pragma once

#include <cstdint>

#include "kvkernels/common.h"

namespace kvkernels {

// One layer of a paged cache, read through the tensors' real strides: NHD, HND
// (`.transpose(1, 2)`) and slices of a stacked allocation differ only in these numbers.
// MLA latent caches are the case num_kv_heads = 1 with V being the first head_dim_v columns of K.
struct paged_kv_t {
  const void* k = nullptr;  // [num_blocks, block_size, num_kv_heads, head_dim] (last stride 1)
  const void* v = nullptr;  // same shape as k, or k itself for MLA
  int64_t k_stride_block = 0, k_stride_slot = 0, k_stride_head = 0;
  int64_t v_stride_block = 0, v_stride_slot = 0, v_stride_head = 0;
  int64_t num_blocks = 0;
  int block_size = 0;
  int num_kv_heads = 0;
  int head_dim = 0;    // width of a key row
  int head_dim_v = 0;  // width of a value row (== head_dim, or kv_lora_rank for MLA)
  CacheFormat format = CacheFormat::kFloat32;
  const float* k_scale = nullptr;  // fp8 only: [1] or [num_kv_heads]; nullptr otherwise
  const float* v_scale = nullptr;
  bool k_scale_per_head = false;
  bool v_scale_per_head = false;

  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;      // [num_seqs]
  int64_t num_seqs = 0;
  int64_t max_blocks_per_seq = 0;

  KVK_HOST_DEVICE int32_t block_id(int64_t seq, int64_t logical_block) const {
    return block_tables[seq * max_blocks_per_seq + logical_block];
  }
  KVK_HOST_DEVICE int64_t k_offset(int64_t block, int64_t slot, int64_t head) const {
    return block * k_stride_block + slot * k_stride_slot + head * k_stride_head;
  }
  KVK_HOST_DEVICE int64_t v_offset(int64_t block, int64_t slot, int64_t head) const {
    return block * v_stride_block + slot * v_stride_slot + head * v_stride_head;
  }
  KVK_HOST_DEVICE float k_scale_of(int head) const {
    return k_scale ? k_scale[k_scale_per_head ? head : 0] : 1.0f;
  }
  KVK_HOST_DEVICE float v_scale_of(int head) const {
    return v_scale ? v_scale[v_scale_per_head ? head : 0] : 1.0f;
  }
  // The k_scale that multiplies attention logits: a non-finite one (inf or NaN) is NaN, so every
  // visible logit of that kv head is NaN and so are its rows (docs/ops.md "Non-finite values"). An inf
  // alone could come out finite: the soft cap's tanh maps +-inf logits to +-soft_cap. (s * 0 is 0 for
  // a finite s and NaN otherwise; no NaN constant needed on the host or the device.)
  KVK_HOST_DEVICE float logit_k_scale_of(int head) const {
    const float s = k_scale_of(head), z = s * 0.0f;
    return z == 0.0f ? s : z;
  }

  // The cache pointers and layout (strides in elements, num_blocks, block_size) from the two caches, any
  // type with size(d) / stride(d) (torch tensors, the bindings' dense operands): the bindings' one place
  // for these fields.
  template <class Cache>
  void set_caches(const void* key, const Cache& key_cache, const void* value, const Cache& value_cache) {
    k = key;
    v = value;
    k_stride_block = key_cache.stride(0);
    k_stride_slot = key_cache.stride(1);
    k_stride_head = key_cache.stride(2);
    v_stride_block = value_cache.stride(0);
    v_stride_slot = value_cache.stride(1);
    v_stride_head = value_cache.stride(2);
    num_blocks = key_cache.size(0);
    block_size = static_cast<int>(key_cache.size(1));
  }
};

// Element format of query / output / weight tensors (never fp8).
enum class FloatFormat : int { kFloat32, kFloat16, kBFloat16 };

struct AttentionParams {
  paged_kv_t kv;
  const void* q = nullptr;  // [num_tokens, num_heads, head_dim], last stride 1
  int64_t q_stride_token = 0, q_stride_head = 0;
  FloatFormat q_format = FloatFormat::kFloat32;  // also the format of out
  void* out = nullptr;     // [num_tokens, num_heads, head_dim_v], contiguous
  float* lse = nullptr;    // [num_tokens, num_heads], contiguous
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]; nullptr = decode (1 query per seq)
  int64_t num_tokens = 0;
  int num_heads = 0;
  float scale = 1.0f;
  float soft_cap = 0.0f;   // <= 0: off
  int window_left = -1;    // < 0: off
  // false: every query of a sequence sees all of its keys (only the window's lower bound applies);
  // true: query i at pos = seq_len - q_len + i sees keys j <= pos (docs/ops.md).
  bool causal = true;
  const float* alibi_slopes = nullptr;  // [num_heads] or nullptr
  const float* sinks = nullptr;         // [num_heads] or nullptr

  KVK_HOST_DEVICE int64_t q_begin(int64_t seq) const {
    return query_start_loc ? query_start_loc[seq] : seq;
  }
  KVK_HOST_DEVICE int64_t q_len(int64_t seq) const {
    return query_start_loc ? query_start_loc[seq + 1] - query_start_loc[seq] : 1;
  }
};

struct MergeParams {
  const void* out_a = nullptr;  // [num_tokens, num_heads, head_dim], last stride 1
  const void* out_b = nullptr;
  int64_t a_stride_token = 0, a_stride_head = 0;
  int64_t b_stride_token = 0, b_stride_head = 0;
  const float* lse_a = nullptr;  // [num_tokens, num_heads]
  const float* lse_b = nullptr;
  int64_t lse_a_stride_token = 0, lse_a_stride_head = 0;
  int64_t lse_b_stride_token = 0, lse_b_stride_head = 0;
  FloatFormat format = FloatFormat::kFloat32;
  void* out = nullptr;  // [num_tokens, num_heads, head_dim], contiguous
  float* lse = nullptr; // [num_tokens, num_heads], contiguous
  int64_t num_tokens = 0;
  int num_heads = 0;
  int head_dim = 0;
};

// Writes of new tokens into a paged cache (reshape_and_cache; concat_and_cache_mla uses one
// "head" whose row is the concatenation of two sources).
struct CacheWriteParams {
  const void* src = nullptr;  // [num_tokens, num_heads, width], last stride 1
  int64_t src_stride_token = 0, src_stride_head = 0;
  FloatFormat src_format = FloatFormat::kFloat32;
  void* cache = nullptr;      // [num_blocks, block_size, num_heads, >= col_offset + width]
  int64_t cache_stride_block = 0, cache_stride_slot = 0, cache_stride_head = 0;
  int64_t col_offset = 0;     // first cache column written
  CacheFormat cache_format = CacheFormat::kFloat32;
  const float* scale = nullptr;  // fp8 only: [1] or [num_heads]
  bool scale_per_head = false;
  const int64_t* slot_mapping = nullptr;  // [num_tokens], negative = skip
  int64_t num_tokens = 0;
  int block_size = 0;
  int num_heads = 0;
  int width = 0;
};

// A block copy described by the bytes of one "block" sub-tensor (cache.select(block_dim, i)).
// The block sub-tensor is walked as outer rows x a contiguous run of inner bytes.
struct BlockCopyParams {
  const char* src = nullptr;
  char* dst = nullptr;
  const int64_t* mapping = nullptr;   // [num_pairs, 2] (src id, dst id)
  int64_t num_pairs = 0;
  int64_t src_block_stride = 0;  // bytes between consecutive blocks
  int64_t dst_block_stride = 0;
  // The sub-tensor: up to 7 dims of (size, src stride, dst stride) in bytes, innermost last;
  // `run_bytes` is the contiguous innermost run copied with one memcpy.
  int num_dims = 0;
  int64_t sizes[7] = {};
  int64_t src_strides[7] = {};
  int64_t dst_strides[7] = {};
  int64_t run_bytes = 0;
};

struct GatherParams {
  paged_kv_t kv;
  void* key = nullptr;    // [num_tokens, num_kv_heads, head_dim], contiguous
  void* value = nullptr;
  FloatFormat out_format = FloatFormat::kFloat32;
  const int64_t* token_start = nullptr;  // [num_seqs + 1] cumulative seq_lens
  int64_t num_tokens = 0;
};

struct MlaDecompressParams {
  paged_kv_t kv;  // latent cache as one head of width kv_lora_rank + rope_dim
  const void* w_kv_b = nullptr;  // [num_heads * (qk_nope + v_head), kv_lora_rank], contiguous
  FloatFormat w_format = FloatFormat::kFloat32;  // also the output format
  const void* norm_weight = nullptr;  // [kv_lora_rank] or nullptr
  float norm_eps = 1e-6f;
  void* key = nullptr;    // [num_tokens, num_heads, qk_nope + rope_dim], contiguous
  void* value = nullptr;  // [num_tokens, num_heads, v_head_dim], contiguous
  const int64_t* token_start = nullptr;  // [num_seqs + 1]
  int64_t num_tokens = 0;
  int num_heads = 0;
  int kv_lora_rank = 0;
  int rope_dim = 0;
  int qk_nope_head_dim = 0;
  int v_head_dim = 0;
};

}  // namespace kvkernels
