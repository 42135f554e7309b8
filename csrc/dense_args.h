// What the bindings without torch share: ONNX Runtime (csrc/ort/) and XLA FFI (csrc/jax/) hand the
// kernels dense, row-major arrays described by an element type, a shape and a pointer. Here: that
// operand (DenseIn), its argument checks, which name the argument ("kvkernels.<op>: <argument>: ...",
// ArgError of arg_error.h), and the paged_kv_t of a (key_cache, value_cache, block_tables, seq_lens,
// k_scale, v_scale) set. Shapes and dtypes only: whether the index values are in range is the caller's
// business (index_checks.h on host memory; the CUDA kernels skip out-of-range ids).
//
// Each binding gives a Types policy for its element-type enum:
//   using Type = ...;                                   the enum
//   static const char* name(Type);                      as its users spell it ("float8e4m3fn" / "float8_e4m3fn")
//   static std::string shape(const std::vector<int64_t>&);  "[2, 3]" / "(2, 3)"
//   static bool is_float(Type), is_fp8(Type);
//   static CacheFormat cache_format(Type);
//   static constexpr Type kFloat32, kInt32;
//   static constexpr const char* kCacheTypes;           the cache dtypes, listed for an error message
//   static constexpr const char* kDtype;                 "type" / "dtype", as the binding's docs say it
//   static constexpr const char* kDecode;                how a decode call is spelled ("query_start_loc=None")
//   static FloatFormat float_format(Type);
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "arg_error.h"
#include "kvkernels/params.h"

namespace kvkernels {

// Limits shared with csrc/prepare.cpp (the torch binding).
constexpr int64_t kDenseMaxHeadDimCpu = 512;   // the CPU kernels
constexpr int64_t kDenseMaxHeadDimCuda = 256;  // the CUDA kernels keep a 16-row output tile in registers
constexpr int64_t kDenseMaxBlockSize = 256;

template <class Type>
struct DenseIn {
  const char* name = "";
  bool present = false;  // false: an optional argument not given
  Type type{};
  std::vector<int64_t> shape;
  void* data = nullptr;

  explicit operator bool() const { return present; }
  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  int64_t size(int64_t d) const { return shape[static_cast<size_t>(d)]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  int64_t stride(int64_t d) const {  // in elements
    int64_t s = 1;
    for (size_t i = static_cast<size_t>(d) + 1; i < shape.size(); ++i) s *= shape[i];
    return s;
  }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
};

template <class Types>
class DenseCheck : public ArgError {
 public:
  using Type = typename Types::Type;
  using In = DenseIn<Type>;
  explicit DenseCheck(const char* op) : ArgError(op) {}

  void required(const In& t) const { expect(t.present, t.name, "is required"); }
  void dim(const In& t, int64_t ndim) const {
    required(t);
    expect(t.dim() == ndim, t.name, "expected ", ndim, " dims, got shape ", Types::shape(t.shape));
  }
  void type(const In& t, Type expected) const {
    expect(t.type == expected, t.name, "expected ", Types::name(expected), ", got ", Types::name(t.type));
  }
  void size(const In& t, int64_t d, int64_t expected, const char* what) const {
    expect(t.size(d) == expected, t.name, "dimension ", d, " must be ", expected, " (", what,
           "), got shape ", Types::shape(t.shape));
  }
  int to_int(int64_t v, const char* arg, const char* what) const {
    expect(v >= 0 && v <= INT32_MAX, arg, what, " = ", v, " does not fit in an int");
    return static_cast<int>(v);
  }
  // A float32 scale of 1 or `per_head` elements; returns whether it is per head.
  bool scale(const In& t, const char* cache_arg, int64_t per_head) const {
    expect(t.present, t.name, "is required when ", cache_arg, " is fp8");
    type(t, Types::kFloat32);
    const int64_t n = t.numel();
    expect(n == 1 || n == per_head, t.name, "must have 1 element or one per kv head (", per_head,
           "), got shape ", Types::shape(t.shape));
    return n != 1;
  }
};

// The paged half of an op (attention, gather): shapes and dtypes checked, paged_kv_t filled with the
// pointers as given (host or device). same_head_dims: the value cache's head_dim must be the key
// cache's (ONNX Runtime's ops), else it may differ (Dv != Dk).
template <class Types>
paged_kv_t dense_paged_kv(const DenseCheck<Types>& c, const DenseIn<typename Types::Type>& key_cache,
                          const DenseIn<typename Types::Type>& value_cache,
                          const DenseIn<typename Types::Type>& block_tables,
                          const DenseIn<typename Types::Type>& seq_lens,
                          const DenseIn<typename Types::Type>& k_scale,
                          const DenseIn<typename Types::Type>& v_scale, bool same_head_dims) {
  c.dim(key_cache, 4);
  c.expect(Types::is_float(key_cache.type) || Types::is_fp8(key_cache.type), key_cache.name, "expected ",
           Types::kCacheTypes, ", got ", Types::name(key_cache.type));
  c.expect(key_cache.size(1) >= 1 && key_cache.size(1) <= kDenseMaxBlockSize, key_cache.name,
           "block size (dimension 1) must be in [1, ", kDenseMaxBlockSize, "], got ", key_cache.size(1));
  c.dim(value_cache, 4);
  c.expect(value_cache.type == key_cache.type, value_cache.name, "dtype ", Types::name(value_cache.type),
           " must equal key_cache's ", Types::name(key_cache.type));
  for (int64_t d = 0; d < (same_head_dims ? 4 : 3); ++d)
    c.size(value_cache, d, key_cache.size(d),
           same_head_dims ? "num_blocks, block_size, num_kv_heads, head_dim of key_cache"
                          : "num_blocks, block_size, num_kv_heads of key_cache");
  c.dim(block_tables, 2);
  c.type(block_tables, Types::kInt32);
  c.dim(seq_lens, 1);
  c.type(seq_lens, Types::kInt32);
  c.size(seq_lens, 0, block_tables.size(0), "num_seqs = block_tables.shape[0]");

  paged_kv_t kv;
  kv.set_caches(key_cache.data, key_cache, value_cache.data, value_cache);
  kv.num_kv_heads = c.to_int(key_cache.size(2), key_cache.name, "num_kv_heads (dimension 2)");
  kv.head_dim = c.to_int(key_cache.size(3), key_cache.name, "head_dim (dimension 3)");
  kv.head_dim_v = c.to_int(value_cache.size(3), value_cache.name, "head_dim (dimension 3)");
  kv.format = Types::cache_format(key_cache.type);
  if (Types::is_fp8(key_cache.type)) {
    kv.k_scale_per_head = c.scale(k_scale, key_cache.name, kv.num_kv_heads);
    kv.v_scale_per_head = c.scale(v_scale, value_cache.name, kv.num_kv_heads);
    kv.k_scale = k_scale.template as<const float>();
    kv.v_scale = v_scale.template as<const float>();
  }
  kv.block_tables = block_tables.template as<const int32_t>();
  kv.seq_lens = seq_lens.template as<const int32_t>();
  kv.num_seqs = c.to_int(block_tables.size(0), block_tables.name, "num_seqs (dimension 0)");
  kv.max_blocks_per_seq = block_tables.size(1);
  return kv;
}

// The options of paged_attention that are not arrays. scale: none = head_dim ** -0.5.
struct DenseAttentionAttrs {
  std::optional<float> scale;
  float soft_cap = 0;
  int64_t window_left = -1;
  bool causal = true;
};

// Everything of paged_attention but the output pointers, shapes and dtypes checked (the index values: the
// caller's, as for dense_paged_kv).
template <class Types>
AttentionParams dense_attention_params(
    const DenseCheck<Types>& c, const DenseIn<typename Types::Type>& query,
    const DenseIn<typename Types::Type>& key_cache, const DenseIn<typename Types::Type>& value_cache,
    const DenseIn<typename Types::Type>& block_tables, const DenseIn<typename Types::Type>& seq_lens,
    const DenseIn<typename Types::Type>& qsl, const DenseIn<typename Types::Type>& alibi,
    const DenseIn<typename Types::Type>& sinks, const DenseIn<typename Types::Type>& k_scale,
    const DenseIn<typename Types::Type>& v_scale, const DenseAttentionAttrs& attrs, int64_t max_head_dim,
    bool same_head_dims) {
  AttentionParams p;
  p.kv = dense_paged_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, same_head_dims);
  const int d = p.kv.head_dim, dv = p.kv.head_dim_v;
  c.expect(d % 8 == 0 && d > 0 && d <= max_head_dim, key_cache.name,
           "head_dim must be a positive multiple of 8 up to ", max_head_dim, ", got ", d);
  c.expect(dv % 8 == 0 && dv > 0 && dv <= max_head_dim, value_cache.name,
           "head_dim must be a positive multiple of 8 up to ", max_head_dim, ", got ", dv);
  c.dim(query, 3);
  c.expect(Types::is_float(query.type), query.name, "expected float32, float16 or bfloat16, got ",
           Types::name(query.type));
  c.expect(Types::is_fp8(key_cache.type) || key_cache.type == query.type, key_cache.name, "must have the query's ",
           Types::kDtype, " (", Types::name(query.type), ") or be fp8, got ", Types::name(key_cache.type));
  c.size(query, 2, d, "head_dim of key_cache");
  c.expect(p.kv.num_kv_heads > 0, key_cache.name, "num_kv_heads (dimension 2) must be positive");
  c.expect(query.size(1) > 0 && query.size(1) % p.kv.num_kv_heads == 0, query.name, "num_heads (",
           query.size(1), ") must be a positive multiple of num_kv_heads (", p.kv.num_kv_heads, ")");
  p.num_heads = c.to_int(query.size(1), query.name, "num_heads (dimension 1)");
  p.q = query.data;
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.q_format = Types::float_format(query.type);
  p.num_tokens = query.size(0);
  if (qsl) {
    c.dim(qsl, 1);
    c.type(qsl, Types::kInt32);
    c.size(qsl, 0, p.kv.num_seqs + 1, "num_seqs + 1");
    p.query_start_loc = qsl.template as<const int32_t>();
  } else {
    c.expect(p.num_tokens == p.kv.num_seqs, query.name, "decode (", Types::kDecode, ") needs one ",
             "query per sequence: got ", p.num_tokens, " queries for ", p.kv.num_seqs, " sequences");
  }
  c.expect(!attrs.scale || std::isfinite(*attrs.scale), "scale", "must be finite");
  c.expect(attrs.soft_cap >= 0 && std::isfinite(attrs.soft_cap), "soft_cap", "must be >= 0 (0 = off), got ",
           attrs.soft_cap);
  c.expect(attrs.window_left < (int64_t{1} << 31), "window_left", "too large: ", attrs.window_left);
  // float32(1 / sqrt(Dk)) from float64, as the torch op computes its default.
  p.scale = attrs.scale.value_or(static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
  p.soft_cap = attrs.soft_cap;
  p.window_left = attrs.window_left < 0 ? -1 : static_cast<int>(attrs.window_left);
  p.causal = attrs.causal;
  for (const DenseIn<typename Types::Type>* v : {&alibi, &sinks}) {
    if (!*v) continue;
    c.dim(*v, 1);
    c.type(*v, Types::kFloat32);
    c.size(*v, 0, p.num_heads, "num_heads of query");
  }
  p.alibi_slopes = alibi ? alibi.template as<const float>() : nullptr;
  p.sinks = sinks ? sinks.template as<const float>() : nullptr;
  return p;
}

}  // namespace kvkernels
