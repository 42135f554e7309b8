#include "prepare.h"

#include <torch/csrc/stable/ops.h>

#include <climits>
#include <cmath>
#include <exception>
#include <vector>

namespace kvkernels {

namespace {

// Head dims of paged_attention (key and value alike): multiples of 8 up to 512 here; the CUDA
// binding allows 256 (its kernels keep a 16-row output tile in registers, docs/ops.md).
constexpr int kMaxHeadDim = 512;
constexpr int kMaxMlaLatent = 512;
constexpr int kMaxMlaRow = 576;
constexpr int kMaxBlockSize = 256;

const std::initializer_list<ScalarType> kFloatTypes = {ScalarType::Float, ScalarType::Half,
                                                       ScalarType::BFloat16};
const std::initializer_list<ScalarType> kCacheTypes = {
    ScalarType::Float, ScalarType::Half, ScalarType::BFloat16, ScalarType::Float8_e4m3fn,
    ScalarType::Float8_e5m2};

// t itself when contiguous, else a contiguous copy kept alive by `keep`. A copy that cannot be
// allocated is an error naming `arg` (torch's own message names no argument).
Tensor contiguous_or_copy(const ArgCheck& c, const Tensor& t, const char* arg, Prepared& keep) {
  if (t.is_contiguous()) return t;
  try {
    Tensor copy = torch::stable::contiguous(t);
    keep.keep_alive.push_back(copy);
    return copy;
  } catch (const std::exception& e) {
    c.fail(arg, "copying its ", t.numel(), " elements to contiguous memory failed: ", e.what());
  }
}

// Index tensors: the right dtype, shape and device, made contiguous so kernels index them
// directly. `size0` (when >= 0) is the required length of dimension 0, checked before the copy: an
// expand()ed tensor of the wrong length is an error, not a copy of billions of elements.
Tensor index_tensor(const ArgCheck& c, const Tensor& t, const char* arg, ScalarType dtype,
                    int64_t ndim, const Tensor& ref, const char* ref_arg, Prepared& keep,
                    int64_t size0 = -1, const char* size0_what = "") {
  c.dtype(t, arg, {dtype});
  c.dim(t, arg, ndim);
  c.same_device(t, arg, ref, ref_arg);
  if (size0 >= 0) c.size(t, arg, 0, size0, size0_what);
  return contiguous_or_copy(c, t, arg, keep);
}

// A [num_heads] float32 vector (alibi slopes, sinks).
const float* per_head_vector(const ArgCheck& c, const std::optional<Tensor>& t, const char* arg,
                             int64_t num_heads, const Tensor& ref, Prepared& keep) {
  if (!t.has_value()) return nullptr;
  Tensor v = index_tensor(c, *t, arg, ScalarType::Float, 1, ref, "query", keep, num_heads,
                          "num_heads of query");
  return static_cast<const float*>(v.const_data_ptr());
}

int64_t element_size(ScalarType t) {
  switch (t) {
    case ScalarType::Half:
    case ScalarType::BFloat16: return 2;
    case ScalarType::Float8_e4m3fn:
    case ScalarType::Float8_e5m2: return 1;
    case ScalarType::Long:
    case ScalarType::Double: return 8;
    default: return 4;
  }
}

// An output whose shape comes from the arguments, allocated like `like`: a size whose bytes do not
// fit in int64, or an allocation that fails, is an error naming `arg` (torch's own error names no
// argument). Called after every check of the op.
Tensor new_output(const ArgCheck& c, const char* arg, const Tensor& like,
                  std::vector<int64_t> shape, std::optional<ScalarType> dtype = std::nullopt) {
  int64_t bytes = element_size(dtype.value_or(like.scalar_type()));
  std::ostringstream ss;
  ss << "[";
  for (size_t i = 0; i < shape.size(); ++i) ss << (i ? ", " : "") << shape[i];
  ss << "]";
  for (int64_t n : shape)
    c.expect(!__builtin_mul_overflow(bytes, n, &bytes), arg, "the output ", ss.str(),
             " would need more than 2^63 bytes");
  try {
    return torch::stable::new_empty(like, shape, dtype);
  } catch (const std::exception& e) {
    c.fail(arg, "allocating the output ", ss.str(), " (", bytes, " bytes) failed: ", e.what());
  }
}

void check_block_size(const ArgCheck& c, const Tensor& cache, const char* arg) {
  const int64_t b = cache.size(1);
  c.expect(b >= 1 && b <= kMaxBlockSize, arg, "block size (dimension 1) must be in [1, ",
           kMaxBlockSize, "], got ", b);
}

// MLA latent caches are [num_blocks, block_size, R + P]: one latent head that every query head
// reads. A cache with several latent heads ([N, B, h_kv, R + P], as FlashMLA's tests allow) is not
// supported (docs/ops.md says why); it gets its own message rather than a bare dimension count.
void check_mla_cache_dims(const ArgCheck& c, const Tensor& kv_cache, const char* arg) {
  c.expect(kv_cache.dim() != 4, arg, "latent caches with several kv heads ([num_blocks, ",
           "block_size, num_kv_heads, kv_lora_rank + rope_dim]) are not supported: pass one latent ",
           "head [num_blocks, block_size, kv_lora_rank + rope_dim] (got shape ", shape_str(kv_cache),
           ")");
  c.dim(kv_cache, arg, 3);
}

// The cache-side half of every paged read: caches, block tables, sequence lengths, fp8 scales.
paged_kv_t make_paged_kv(const ArgCheck& c, const Tensor& key_cache, const char* k_arg,
                         const Tensor& value_cache, const char* v_arg, const Tensor& block_tables,
                         const Tensor& seq_lens, const std::optional<Tensor>& k_scale,
                         const char* k_scale_arg, const std::optional<Tensor>& v_scale,
                         const char* v_scale_arg, Prepared& keep, bool per_head_scales = true) {
  c.dim(key_cache, k_arg, 4);
  c.dtype(key_cache, k_arg, kCacheTypes);
  c.last_dim_contiguous(key_cache, k_arg);
  check_block_size(c, key_cache, k_arg);
  c.dim(value_cache, v_arg, 4);
  c.like(value_cache, v_arg, key_cache, k_arg);
  // The value's head dim (dimension 3) may differ from the key's (DeepSeek-style prefill over
  // decompressed K/V: qk 192, v 128); blocks, slots and heads must match.
  const std::string k_shape = std::string("num_blocks, block_size, num_kv_heads of ") + k_arg;
  for (int64_t d = 0; d < 3; ++d)
    c.size(value_cache, v_arg, d, key_cache.size(d), k_shape.c_str());
  c.last_dim_contiguous(value_cache, v_arg);
  const int num_kv_heads = c.to_int(key_cache.size(2), k_arg, "num_kv_heads (dimension 2)");
  const int head_dim = c.to_int(key_cache.size(3), k_arg, "head_dim (dimension 3)");
  const int head_dim_v = c.to_int(value_cache.size(3), v_arg, "head_dim (dimension 3)");

  // Kernels number sequences with an int; checked before a contiguous copy is made.
  c.dim(block_tables, "block_tables", 2);
  c.to_int(block_tables.size(0), "block_tables", "num_seqs (dimension 0)");
  Tensor bt = index_tensor(c, block_tables, "block_tables", ScalarType::Int, 2, key_cache, k_arg,
                           keep);
  Tensor sl = index_tensor(c, seq_lens, "seq_lens", ScalarType::Int, 1, key_cache, k_arg, keep,
                           bt.size(0), "num_seqs = block_tables.shape[0]");

  paged_kv_t kv;
  kv.set_caches(key_cache.const_data_ptr(), key_cache, value_cache.const_data_ptr(), value_cache);
  kv.num_kv_heads = num_kv_heads;
  kv.head_dim = head_dim;
  kv.head_dim_v = head_dim_v;
  kv.format = cache_format(key_cache.scalar_type());
  if (is_fp8(key_cache.scalar_type())) {
    const int64_t per_head = per_head_scales ? kv.num_kv_heads : 0;
    kv.k_scale_per_head = c.scale(k_scale, k_scale_arg, key_cache, k_arg, per_head);
    kv.v_scale_per_head = c.scale(v_scale, v_scale_arg, key_cache, k_arg, per_head);
    Tensor ks = torch::stable::contiguous(*k_scale), vs = torch::stable::contiguous(*v_scale);
    keep.keep_alive.push_back(ks);
    keep.keep_alive.push_back(vs);
    kv.k_scale = static_cast<const float*>(ks.const_data_ptr());
    kv.v_scale = static_cast<const float*>(vs.const_data_ptr());
  }
  kv.block_tables = static_cast<const int32_t*>(bt.const_data_ptr());
  kv.seq_lens = static_cast<const int32_t*>(sl.const_data_ptr());
  kv.num_seqs = bt.size(0);
  kv.max_blocks_per_seq = bt.size(1);
  return kv;
}

// The query-side half shared by paged_attention and mla_paged_attention.
void fill_query(const ArgCheck& c, PreparedAttention& r, const Tensor& query_in, const char* q_arg,
                const Tensor& cache, const char* cache_arg, int64_t out_dim,
                const std::optional<Tensor>& query_start_loc) {
  c.dim(query_in, q_arg, 3);
  c.dtype(query_in, q_arg, kFloatTypes);
  c.same_device(cache, cache_arg, query_in, q_arg);
  c.cache_dtype(cache, cache_arg, query_in, q_arg);
  AttentionParams& p = r.params;
  p.num_heads = c.to_int(query_in.size(1), q_arg, "num_heads (dimension 1)");
  p.num_tokens = query_in.size(0);  // the query itself is set up by finish_attention, after the checks
  if (query_start_loc.has_value()) {
    Tensor qsl = index_tensor(c, *query_start_loc, "query_start_loc", ScalarType::Int, 1, query_in,
                              q_arg, r, p.kv.num_seqs + 1, "num_seqs + 1");
    p.query_start_loc = static_cast<const int32_t*>(qsl.const_data_ptr());
  } else {
    c.expect(p.num_tokens == p.kv.num_seqs, q_arg, "decode (query_start_loc=None) needs one query ",
             "per sequence: got ", p.num_tokens, " queries for ", p.kv.num_seqs, " sequences");
  }
}

// One tensor argument of a call, for the overlap checks of caller-provided outputs (t is null for
// an optional argument not given).
struct Input {
  const Tensor* t;
  const char* name;
};

const Tensor* opt(const std::optional<Tensor>& t) { return t.has_value() ? &*t : nullptr; }

// A caller-provided output: exactly `shape` (never resized), `dtype`, on `like`'s device.
void check_output(const ArgCheck& c, const Tensor& t, const char* arg,
                  const std::vector<int64_t>& shape, ScalarType dtype, const Tensor& like,
                  const char* like_arg) {
  c.same_device(t, arg, like, like_arg);
  c.expect(t.scalar_type() == dtype, arg, "dtype ", torch::headeronly::toString(t.scalar_type()),
           " must be ", torch::headeronly::toString(dtype));
  bool same = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t d = 0; same && d < shape.size(); ++d) same = t.size(int64_t(d)) == shape[d];
  if (same) return;
  std::ostringstream want;
  want << "[";
  for (size_t d = 0; d < shape.size(); ++d) want << (d ? ", " : "") << shape[d];
  want << "]";
  c.fail(arg, "shape ", shape_str(t), " must be ", want.str(),
         " (outputs are not resized)");
}

// The caller's outputs of an attention or merge call, checked with the inputs (before any index
// check, allocation or write): shapes, dtypes, device, every element its own memory, and no memory
// shared with each other or with any input (the kernels read inputs while writing outputs).
void check_given_outputs(const ArgCheck& c, const GivenOutputs& g, const Tensor& like,
                         const char* like_arg, const std::vector<int64_t>& out_shape,
                         std::initializer_list<Input> inputs) {
  if (!g.out.has_value()) {
    c.expect(!g.lse.has_value(), "lse", "given without out");
    return;
  }
  check_output(c, *g.out, "out", out_shape, like.scalar_type(), like, like_arg);
  const Layout out_l(*g.out);
  c.writable(out_l, "out");
  for (const Input& in : inputs)
    if (in.t != nullptr) c.disjoint(Layout(*in.t), in.name, out_l, "out");
  if (!g.lse.has_value()) return;
  check_output(c, *g.lse, "lse", {out_shape[0], out_shape[1]}, ScalarType::Float, like, like_arg);
  const Layout lse_l(*g.lse);
  c.writable(lse_l, "lse");
  c.disjoint(lse_l, "lse", out_l, "out");
  for (const Input& in : inputs)
    if (in.t != nullptr) c.disjoint(Layout(*in.t), in.name, lse_l, "lse");
}

// What the kernel writes for one output: the caller's tensor when the kernels can index it
// (contiguous), else a contiguous temporary copied into it by Prepared::finish(); without a given
// tensor, a fresh one. Called after every check.
Tensor output_for(const ArgCheck& c, Prepared& r, const std::optional<Tensor>& given,
                  const char* arg, const Tensor& like, std::vector<int64_t> shape,
                  std::optional<ScalarType> dtype = std::nullopt) {
  if (given.has_value() && given->is_contiguous()) return *given;
  Tensor t = new_output(c, arg, like, std::move(shape), dtype);
  if (given.has_value()) r.copy_back.emplace_back(t, *given);
  return t;
}

// The query (copied when its last stride is not 1) and the outputs of an attention call, after every
// check (the index checks included: query_start_loc's last entry must equal the query's length
// before a query of that length is copied). With out= and no lse=, p.lse stays nullptr (the backend
// supplies scratch).
void finish_attention(const ArgCheck& c, PreparedAttention& r, const Tensor& query_in,
                      const char* q_arg, int64_t out_dim, const IndexCheck& check_indices,
                      const GivenOutputs& given) {
  AttentionParams& p = r.params;
  if (check_indices) check_indices(p);
  Tensor query = with_unit_last_stride(c, query_in, q_arg, r);
  p.q = query.const_data_ptr();
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.q_format = float_format(query.scalar_type());
  r.out = output_for(c, r, given.out, q_arg, query, {p.num_tokens, p.num_heads, out_dim});
  p.out = r.out.mutable_data_ptr();
  if (given.out.has_value() && !given.lse.has_value()) return;
  r.lse = output_for(c, r, given.lse, q_arg, query, {p.num_tokens, p.num_heads}, ScalarType::Float);
  p.lse = static_cast<float*>(r.lse.mutable_data_ptr());
}

}  // namespace

FloatFormat float_format(ScalarType t) {
  switch (t) {
    case ScalarType::Half: return FloatFormat::kFloat16;
    case ScalarType::BFloat16: return FloatFormat::kBFloat16;
    default: return FloatFormat::kFloat32;
  }
}

CacheFormat cache_format(ScalarType t) {
  switch (t) {
    case ScalarType::Half: return CacheFormat::kFloat16;
    case ScalarType::BFloat16: return CacheFormat::kBFloat16;
    case ScalarType::Float8_e4m3fn: return CacheFormat::kFp8E4M3;
    case ScalarType::Float8_e5m2: return CacheFormat::kFp8E5M2;
    default: return CacheFormat::kFloat32;
  }
}

Tensor with_unit_last_stride(const ArgCheck& c, const Tensor& t, const char* arg, Prepared& keep) {
  if (t.dim() == 0 || t.size(t.dim() - 1) <= 1 || t.stride(t.dim() - 1) == 1) return t;
  return contiguous_or_copy(c, t, arg, keep);
}

void Prepared::finish() const {
  for (const auto& [from, to] : copy_back) {
    Tensor dst = to;
    torch::stable::copy_(dst, from);
  }
}

void ensure_lse(const ArgCheck& c, Prepared& r, float*& lse, const Tensor& like,
                int64_t num_tokens, int64_t num_heads) {
  if (lse != nullptr) return;
  Tensor t = new_output(c, "lse", like, {num_tokens, num_heads}, ScalarType::Float);
  r.keep_alive.push_back(t);
  lse = static_cast<float*>(t.mutable_data_ptr());
}

PreparedAttention prepare_paged_attention(
    const ArgCheck& c, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables, const Tensor& seq_lens,
    const std::optional<Tensor>& query_start_loc, std::optional<double> scale, int64_t window_left,
    double soft_cap, const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale, std::optional<bool> causal,
    const IndexCheck& check_indices, const GivenOutputs& given) {
  // First, so that nothing is allocated or written: None is not the default True (ops.cpp).
  c.expect(causal.has_value(), "causal", "expected a bool, got None (the default is True)");
  PreparedAttention r;
  AttentionParams& p = r.params;
  p.kv = make_paged_kv(c, key_cache, "key_cache", value_cache, "value_cache", block_tables,
                       seq_lens, k_scale, "k_scale", v_scale, "v_scale", r);
  const int d = p.kv.head_dim, dv = p.kv.head_dim_v;
  c.expect(d % 8 == 0 && d > 0 && d <= kMaxHeadDim, "key_cache",
           "head_dim must be a positive multiple of 8 up to ", kMaxHeadDim, ", got ", d);
  c.expect(dv % 8 == 0 && dv > 0 && dv <= kMaxHeadDim, "value_cache",
           "head_dim must be a positive multiple of 8 up to ", kMaxHeadDim, ", got ", dv);
  c.dim(query, "query", 3);
  c.size(query, "query", 2, d, "head_dim of key_cache");
  // num_kv_heads divides the query heads: 0 would be a division by zero.
  c.expect(p.kv.num_kv_heads > 0, "key_cache", "num_kv_heads (dimension 2) must be positive, got ",
           "shape ", shape_str(key_cache));
  c.expect(query.size(1) > 0 && query.size(1) % p.kv.num_kv_heads == 0, "query",
           "num_heads (", query.size(1), ") must be a positive multiple of num_kv_heads (",
           p.kv.num_kv_heads, ")");
  fill_query(c, r, query, "query", key_cache, "key_cache", d, query_start_loc);
  c.expect(!scale.has_value() || std::isfinite(*scale), "scale", "must be finite");
  c.expect(soft_cap >= 0.0 && std::isfinite(soft_cap), "soft_cap", "must be >= 0 (0 = off), got ",
           soft_cap);
  p.scale = static_cast<float>(scale.value_or(1.0 / std::sqrt(static_cast<double>(d))));
  p.soft_cap = static_cast<float>(soft_cap);
  c.expect(window_left < (int64_t{1} << 31), "window_left", "too large: ", window_left);
  p.window_left = window_left < 0 ? -1 : static_cast<int>(window_left);
  p.causal = *causal;
  p.alibi_slopes = per_head_vector(c, alibi_slopes, "alibi_slopes", p.num_heads, query, r);
  p.sinks = per_head_vector(c, sinks, "sinks", p.num_heads, query, r);
  check_given_outputs(c, given, query, "query", {p.num_tokens, p.num_heads, dv},
                      {{&query, "query"}, {&key_cache, "key_cache"}, {&value_cache, "value_cache"},
                       {&block_tables, "block_tables"}, {&seq_lens, "seq_lens"},
                       {opt(query_start_loc), "query_start_loc"},
                       {opt(alibi_slopes), "alibi_slopes"}, {opt(sinks), "sinks"},
                       {opt(k_scale), "k_scale"}, {opt(v_scale), "v_scale"}});
  finish_attention(c, r, query, "query", dv, check_indices, given);
  return r;
}

PreparedAttention prepare_mla_attention(
    const ArgCheck& c, const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
    const Tensor& seq_lens, int64_t kv_lora_rank, double scale,
    const std::optional<Tensor>& query_start_loc, const std::optional<Tensor>& kv_scale,
    const IndexCheck& check_indices, const GivenOutputs& given) {
  PreparedAttention r;
  AttentionParams& p = r.params;
  check_mla_cache_dims(c, kv_cache, "kv_cache");
  const int64_t row = kv_cache.size(2);
  c.expect(kv_lora_rank > 0 && kv_lora_rank % 8 == 0 && kv_lora_rank <= kMaxMlaLatent,
           "kv_lora_rank", "must be a positive multiple of 8 up to ", kMaxMlaLatent, ", got ",
           kv_lora_rank);
  c.expect(row >= kv_lora_rank && row <= kMaxMlaRow, "kv_cache",
           "row width (dimension 2) must be in [kv_lora_rank, ", kMaxMlaRow, "], got ", row);
  // The latent cache is one kv head whose key row is the whole row and whose value is its prefix.
  Tensor cache4 = torch::stable::unsqueeze(kv_cache, 2);
  r.keep_alive.push_back(cache4);
  p.kv = make_paged_kv(c, cache4, "kv_cache", cache4, "kv_cache", block_tables, seq_lens, kv_scale,
                       "kv_scale", kv_scale, "kv_scale", r, /*per_head_scales=*/false);
  p.kv.head_dim_v = static_cast<int>(kv_lora_rank);
  c.dim(q, "q", 3);
  c.size(q, "q", 2, row, "row width of kv_cache = kv_lora_rank + rope_dim");
  c.expect(q.size(1) > 0, "q", "needs at least one head");
  fill_query(c, r, q, "q", kv_cache, "kv_cache", kv_lora_rank, query_start_loc);
  c.expect(std::isfinite(scale), "scale", "must be finite");
  p.scale = static_cast<float>(scale);
  check_given_outputs(c, given, q, "q", {p.num_tokens, p.num_heads, kv_lora_rank},
                      {{&q, "q"}, {&kv_cache, "kv_cache"}, {&block_tables, "block_tables"},
                       {&seq_lens, "seq_lens"}, {opt(query_start_loc), "query_start_loc"},
                       {opt(kv_scale), "kv_scale"}});
  finish_attention(c, r, q, "q", kv_lora_rank, check_indices, given);
  return r;
}

PreparedMerge prepare_merge(const ArgCheck& c, const Tensor& out_a_in, const Tensor& lse_a,
                            const Tensor& out_b_in, const Tensor& lse_b,
                            const GivenOutputs& given) {
  PreparedMerge r;
  MergeParams& p = r.params;
  c.dim(out_a_in, "out_a", 3);
  c.dtype(out_a_in, "out_a", kFloatTypes);
  c.dim(out_b_in, "out_b", 3);
  c.like(out_b_in, "out_b", out_a_in, "out_a");
  for (int64_t d = 0; d < 3; ++d) c.size(out_b_in, "out_b", d, out_a_in.size(d), "out_a's shape");
  for (auto [t, arg] : {std::pair{&lse_a, "lse_a"}, std::pair{&lse_b, "lse_b"}}) {
    c.dim(*t, arg, 2);
    c.dtype(*t, arg, {ScalarType::Float});
    c.same_device(*t, arg, out_a_in, "out_a");
    c.size(*t, arg, 0, out_a_in.size(0), "num_tokens of out_a");
    c.size(*t, arg, 1, out_a_in.size(1), "num_heads of out_a");
  }
  p.num_heads = c.to_int(out_a_in.size(1), "out_a", "num_heads (dimension 1)");
  p.head_dim = c.to_int(out_a_in.size(2), "out_a", "head_dim (dimension 2)");
  // out = out_a (merging in place) is an overlap too: rejected like every other.
  check_given_outputs(c, given, out_a_in, "out_a",
                      {out_a_in.size(0), out_a_in.size(1), out_a_in.size(2)},
                      {{&out_a_in, "out_a"}, {&lse_a, "lse_a"}, {&out_b_in, "out_b"},
                       {&lse_b, "lse_b"}});
  Tensor out_a = with_unit_last_stride(c, out_a_in, "out_a", r);
  Tensor out_b = with_unit_last_stride(c, out_b_in, "out_b", r);
  p.out_a = out_a.const_data_ptr();
  p.out_b = out_b.const_data_ptr();
  p.a_stride_token = out_a.stride(0);
  p.a_stride_head = out_a.stride(1);
  p.b_stride_token = out_b.stride(0);
  p.b_stride_head = out_b.stride(1);
  p.lse_a = static_cast<const float*>(lse_a.const_data_ptr());
  p.lse_b = static_cast<const float*>(lse_b.const_data_ptr());
  p.lse_a_stride_token = lse_a.stride(0);
  p.lse_a_stride_head = lse_a.stride(1);
  p.lse_b_stride_token = lse_b.stride(0);
  p.lse_b_stride_head = lse_b.stride(1);
  p.format = float_format(out_a.scalar_type());
  p.num_tokens = out_a.size(0);
  r.out = output_for(c, r, given.out, "out_a", out_a, {p.num_tokens, p.num_heads, p.head_dim});
  p.out = r.out.mutable_data_ptr();
  if (given.out.has_value() && !given.lse.has_value()) return r;  // p.lse: the backend's scratch
  r.lse = output_for(c, r, given.lse, "out_a", out_a, {p.num_tokens, p.num_heads},
                     ScalarType::Float);
  p.lse = static_cast<float*>(r.lse.mutable_data_ptr());
  return r;
}

namespace {

// One source [T, H, W] written into columns [col, col + W) of a cache [N, B, H, >= col + W].
CacheWriteParams make_write(const ArgCheck& c, PreparedCacheWrite& r, const Tensor& src_in,
                            const char* src_arg, const Tensor& cache, const char* cache_arg,
                            int64_t col, const Tensor& slots, const std::optional<Tensor>& scale,
                            const char* scale_arg, bool per_head_scale_allowed) {
  Tensor src = with_unit_last_stride(c, src_in, src_arg, r);
  CacheWriteParams w;
  w.src = src.const_data_ptr();
  w.src_stride_token = src.stride(0);
  w.src_stride_head = src.stride(1);
  w.src_format = float_format(src.scalar_type());
  w.cache = cache.mutable_data_ptr();
  w.cache_stride_block = cache.stride(0);
  w.cache_stride_slot = cache.stride(1);
  w.cache_stride_head = cache.stride(2);
  w.col_offset = col;
  w.cache_format = cache_format(cache.scalar_type());
  w.num_tokens = src.size(0);
  w.num_heads = c.to_int(src.size(1), src_arg, "num_heads (dimension 1)");
  w.width = c.to_int(src.size(2), src_arg, "width (last dimension)");
  w.block_size = static_cast<int>(cache.size(1));
  w.slot_mapping = static_cast<const int64_t*>(slots.const_data_ptr());
  if (is_fp8(cache.scalar_type())) {
    w.scale_per_head =
        c.scale(scale, scale_arg, cache, cache_arg, per_head_scale_allowed ? w.num_heads : 0);
    Tensor s = torch::stable::contiguous(*scale);
    r.keep_alive.push_back(s);
    w.scale = static_cast<const float*>(s.const_data_ptr());
  }
  return w;
}

}  // namespace

PreparedCacheWrite prepare_reshape_and_cache(const ArgCheck& c, const Tensor& key,
                                             const Tensor& value, const Tensor& key_cache,
                                             const Tensor& value_cache, const Tensor& slot_mapping,
                                             const std::optional<Tensor>& k_scale,
                                             const std::optional<Tensor>& v_scale) {
  PreparedCacheWrite r;
  c.dim(key, "key", 3);
  c.dtype(key, "key", kFloatTypes);
  c.dim(value, "value", 3);
  c.like(value, "value", key, "key");
  // value's head dim (dimension 2) may differ from key's: it is value_cache's.
  for (int64_t d = 0; d < 2; ++d)
    c.size(value, "value", d, key.size(d), "num_tokens, num_kv_heads of key");
  // The caches among themselves first: they fix num_kv_heads and head_dim, which the new tokens
  // must match.
  for (auto [cache, arg] :
       {std::pair{&key_cache, "key_cache"}, std::pair{&value_cache, "value_cache"}}) {
    c.dim(*cache, arg, 4);
    c.dtype(*cache, arg, kCacheTypes);
    c.same_device(*cache, arg, key, "key");
    c.last_dim_contiguous(*cache, arg);
    check_block_size(c, *cache, arg);
  }
  c.like(value_cache, "value_cache", key_cache, "key_cache");
  for (int64_t d = 0; d < 3; ++d)
    c.size(value_cache, "value_cache", d, key_cache.size(d),
           "num_blocks, block_size, num_kv_heads of key_cache");
  c.size(key, "key", 1, key_cache.size(2), "num_kv_heads of key_cache");
  c.size(key, "key", 2, key_cache.size(3), "head_dim of key_cache");
  c.size(value, "value", 2, value_cache.size(3), "head_dim of value_cache");
  c.cache_dtype(key_cache, "key_cache", key, "key");
  c.to_int(key.size(1), "key", "num_kv_heads (dimension 1)");
  c.to_int(key.size(2), "key", "head_dim (dimension 2)");
  c.to_int(value.size(2), "value", "head_dim (dimension 2)");
  c.dtype(slot_mapping, "slot_mapping", {ScalarType::Long});
  c.dim(slot_mapping, "slot_mapping", 1);
  c.size(slot_mapping, "slot_mapping", 0, key.size(0), "num_tokens of key");
  // Written in place: each cache element has its own memory, and no other argument shares memory
  // with a cache (K and V interleaved in one allocation are fine). A scale next to a non-fp8 cache
  // is never read, but it is checked all the same: one rule for every argument (docs/ops.md).
  const Layout key_l(key), value_l(value), slots_l(slot_mapping), kc_l(key_cache),
      vc_l(value_cache);
  for (auto [cache, arg] : {std::pair{&kc_l, "key_cache"}, std::pair{&vc_l, "value_cache"}}) {
    c.writable(*cache, arg);
    c.disjoint(key_l, "key", *cache, arg);
    c.disjoint(value_l, "value", *cache, arg);
    c.disjoint(slots_l, "slot_mapping", *cache, arg);
    c.disjoint(k_scale, "k_scale", *cache, arg);
    c.disjoint(v_scale, "v_scale", *cache, arg);
  }
  c.disjoint(vc_l, "value_cache", kc_l, "key_cache");
  Tensor slots = index_tensor(c, slot_mapping, "slot_mapping", ScalarType::Long, 1, key, "key", r);
  r.writes.push_back(make_write(c, r, key, "key", key_cache, "key_cache", 0, slots, k_scale,
                                "k_scale", true));
  r.writes.push_back(make_write(c, r, value, "value", value_cache, "value_cache", 0, slots,
                                v_scale, "v_scale", true));
  return r;
}

PreparedCacheWrite prepare_concat_and_cache_mla(const ArgCheck& c, const Tensor& kv_c,
                                                const Tensor& k_pe, const Tensor& kv_cache,
                                                const Tensor& slot_mapping,
                                                const std::optional<Tensor>& scale) {
  PreparedCacheWrite r;
  c.dim(kv_c, "kv_c", 2);
  c.dtype(kv_c, "kv_c", kFloatTypes);
  c.dim(k_pe, "k_pe", 2);
  c.like(k_pe, "k_pe", kv_c, "kv_c");
  c.size(k_pe, "k_pe", 0, kv_c.size(0), "num_tokens of kv_c");
  check_mla_cache_dims(c, kv_cache, "kv_cache");
  c.dtype(kv_cache, "kv_cache", kCacheTypes);
  c.same_device(kv_cache, "kv_cache", kv_c, "kv_c");
  c.last_dim_contiguous(kv_cache, "kv_cache");
  check_block_size(c, kv_cache, "kv_cache");
  const int64_t rank = kv_c.size(1), rope = k_pe.size(1);
  c.expect(kv_cache.size(2) <= kMaxMlaRow, "kv_cache", "row width must be at most ", kMaxMlaRow);
  // Each part is at most a row wide before they are added (no overflow).
  c.expect(rank <= kMaxMlaRow, "kv_c", "kv_lora_rank (dimension 1) must be at most ", kMaxMlaRow,
           ", got ", rank);
  c.expect(rope <= kMaxMlaRow, "k_pe", "rope_dim (dimension 1) must be at most ", kMaxMlaRow,
           ", got ", rope);
  c.size(kv_cache, "kv_cache", 2, rank + rope, "kv_lora_rank + rope_dim of kv_c and k_pe");
  c.cache_dtype(kv_cache, "kv_cache", kv_c, "kv_c");
  c.dtype(slot_mapping, "slot_mapping", {ScalarType::Long});
  c.dim(slot_mapping, "slot_mapping", 1);
  c.size(slot_mapping, "slot_mapping", 0, kv_c.size(0), "num_tokens of kv_c");
  const Layout cache_l(kv_cache);
  c.writable(cache_l, "kv_cache");
  c.disjoint(Layout(kv_c), "kv_c", cache_l, "kv_cache");
  c.disjoint(Layout(k_pe), "k_pe", cache_l, "kv_cache");
  c.disjoint(Layout(slot_mapping), "slot_mapping", cache_l, "kv_cache");
  c.disjoint(scale, "scale", cache_l, "kv_cache");  // read or not (docs/ops.md)
  Tensor slots = index_tensor(c, slot_mapping, "slot_mapping", ScalarType::Long, 1, kv_c, "kv_c",
                              r);
  // Both sources are viewed as one head: [T, 1, width].
  Tensor cache4 = torch::stable::unsqueeze(kv_cache, 2);
  Tensor kv_c3 = torch::stable::unsqueeze(kv_c, 1);
  Tensor k_pe3 = torch::stable::unsqueeze(k_pe, 1);
  r.keep_alive.insert(r.keep_alive.end(), {cache4, kv_c3, k_pe3});
  r.writes.push_back(
      make_write(c, r, kv_c3, "kv_c", cache4, "kv_cache", 0, slots, scale, "scale", false));
  if (rope > 0)
    r.writes.push_back(
        make_write(c, r, k_pe3, "k_pe", cache4, "kv_cache", rank, slots, scale, "scale", false));
  return r;
}

PreparedBlockCopy prepare_block_copy(const ArgCheck& c, const Tensor& src, const Tensor& dst,
                                     const Tensor& block_mapping, int64_t block_dim,
                                     bool same_tensor) {
  PreparedBlockCopy r;
  const char* src_arg = same_tensor ? "cache" : "src";
  const char* dst_arg = same_tensor ? "cache" : "dst";
  const int64_t ndim = src.dim();
  c.expect(ndim >= 1, src_arg, "must have at least one dimension");
  c.expect(block_dim >= -ndim && block_dim < ndim, "block_dim", "out of range for a ", ndim,
           "-dimensional tensor: ", block_dim);
  const int64_t bd = block_dim < 0 ? block_dim + ndim : block_dim;
  c.expect(ndim - 1 <= 7, src_arg, "at most 8 dimensions are supported");
  if (!same_tensor) {
    c.dim(dst, dst_arg, ndim);
    c.expect(dst.scalar_type() == src.scalar_type(), dst_arg, "dtype ",
             torch::headeronly::toString(dst.scalar_type()), " must equal src's dtype ",
             torch::headeronly::toString(src.scalar_type()));  // devices may differ
    for (int64_t d = 0; d < ndim; ++d)
      if (d != bd) c.size(dst, dst_arg, d, src.size(d), "src's shape outside block_dim");
  }
  // The mapping may live on the CPU or on src's device.
  c.dtype(block_mapping, "block_mapping", {ScalarType::Long});
  c.dim(block_mapping, "block_mapping", 2);
  c.size(block_mapping, "block_mapping", 1, 2, "(src, dst) pairs");
  const auto md = block_mapping.device();
  c.expect(md.type() == torch::headeronly::DeviceType::CPU ||
               (md.type() == src.device().type() && md.index() == src.device().index()),
           "block_mapping", "must be on the CPU or on the device of ", src_arg);
  // Written in place: every element of the destination has its own memory, and the mapping is
  // not part of it. (swap_blocks' src may share memory with dst: every source block is read
  // before any destination is written.)
  const Layout dst_l(dst);
  c.writable(dst_l, dst_arg);
  c.disjoint(Layout(block_mapping), "block_mapping", dst_l, dst_arg);
  // Destinations are distinct blocks of dst: more pairs than dst has blocks repeat one. Checked
  // before the copy below (an expand()ed mapping of 2^30 pairs would be copied and sorted first).
  c.expect(block_mapping.size(0) <= dst.size(bd), "block_mapping", block_mapping.size(0),
           " pairs for ", plural(dst.size(bd), "destination block"),
           ": a destination block appears more than once");
  Tensor mapping = contiguous_or_copy(c, block_mapping, "block_mapping", r);

  BlockCopyParams& p = r.params;
  const int64_t elem = static_cast<int64_t>(src.element_size());
  p.src = static_cast<const char*>(src.const_data_ptr());
  p.dst = static_cast<char*>(dst.mutable_data_ptr());
  p.mapping = static_cast<const int64_t*>(mapping.const_data_ptr());
  p.num_pairs = mapping.size(0);
  p.src_block_stride = src.stride(bd) * elem;
  p.dst_block_stride = dst.stride(bd) * elem;
  r.src_num_blocks = src.size(bd);
  r.dst_num_blocks = dst.size(bd);
  // Walk the block sub-tensor; fold the innermost dims that are contiguous in both tensors into
  // one memcpy run.
  int64_t run = elem;
  int64_t inner = ndim - 1;
  for (; inner >= 0; --inner) {
    if (inner == bd) continue;
    const int64_t size = src.size(inner);
    if (size != 1 && (src.stride(inner) * elem != run || dst.stride(inner) * elem != run)) break;
    run *= size;
  }
  p.run_bytes = run;
  for (int64_t d = 0; d <= inner; ++d) {
    if (d == bd) continue;
    p.sizes[p.num_dims] = src.size(d);
    p.src_strides[p.num_dims] = src.stride(d) * elem;
    p.dst_strides[p.num_dims] = dst.stride(d) * elem;
    ++p.num_dims;
  }
  return r;
}

PreparedGather prepare_gather_kv(const ArgCheck& c, const Tensor& key_cache,
                                 const Tensor& value_cache, const Tensor& block_tables,
                                 const Tensor& seq_lens, const std::optional<Tensor>& k_scale,
                                 const std::optional<Tensor>& v_scale,
                                 std::optional<int64_t> num_tokens_arg,
                                 std::optional<ScalarType> out_dtype, const TokenCounter& count) {
  PreparedGather r;
  GatherParams& p = r.params;
  p.kv = make_paged_kv(c, key_cache, "key_cache", value_cache, "value_cache", block_tables,
                       seq_lens, k_scale, "k_scale", v_scale, "v_scale", r);
  ScalarType out = is_fp8(key_cache.scalar_type()) ? ScalarType::BFloat16 : key_cache.scalar_type();
  if (out_dtype.has_value()) {
    c.expect(is_float(*out_dtype), "out_dtype", "must be float32, float16 or bfloat16, got ",
             torch::headeronly::toString(*out_dtype));
    out = *out_dtype;
  }
  c.expect(num_tokens_arg.value_or(0) >= 0, "num_tokens", "must be >= 0, got ",
           num_tokens_arg.value_or(0));
  // The output length is known (and checked against seq_lens where they are readable) before the
  // outputs are allocated.
  const int64_t num_tokens = count(p.kv, num_tokens_arg);
  const char* length_arg = num_tokens_arg.has_value() ? "num_tokens" : "seq_lens";
  p.out_format = float_format(out);
  p.num_tokens = num_tokens;
  r.key = new_output(c, length_arg, key_cache, {num_tokens, p.kv.num_kv_heads, p.kv.head_dim}, out);
  r.value =
      new_output(c, length_arg, key_cache, {num_tokens, p.kv.num_kv_heads, p.kv.head_dim_v}, out);
  p.key = r.key.mutable_data_ptr();
  p.value = r.value.mutable_data_ptr();
  return r;
}

PreparedDecompress prepare_mla_decompress(
    const ArgCheck& c, const Tensor& kv_cache, const Tensor& block_tables,
    const Tensor& seq_lens, const Tensor& w_kv_b_in, int64_t kv_lora_rank,
    int64_t qk_nope_head_dim, int64_t v_head_dim, const std::optional<Tensor>& norm_weight,
    double norm_eps, const std::optional<Tensor>& scale, std::optional<int64_t> num_tokens_arg,
    const TokenCounter& count) {
  PreparedDecompress r;
  MlaDecompressParams& p = r.params;
  check_mla_cache_dims(c, kv_cache, "kv_cache");
  c.expect(kv_lora_rank > 0 && kv_lora_rank % 8 == 0 && kv_lora_rank <= kMaxMlaLatent,
           "kv_lora_rank", "must be a positive multiple of 8 up to ", kMaxMlaLatent, ", got ",
           kv_lora_rank);
  const int64_t row = kv_cache.size(2);
  c.expect(row >= kv_lora_rank && row <= kMaxMlaRow, "kv_cache",
           "row width (dimension 2) must be in [kv_lora_rank, ", kMaxMlaRow, "], got ", row);
  c.expect(qk_nope_head_dim > 0, "qk_nope_head_dim", "must be positive, got ", qk_nope_head_dim);
  c.expect(v_head_dim > 0, "v_head_dim", "must be positive, got ", v_head_dim);
  // Kernels hold both, their sum (rows per head of w_kv_b) and the key width in an int.
  const int dn = c.to_int(qk_nope_head_dim, "qk_nope_head_dim", "");
  const int dv = c.to_int(v_head_dim, "v_head_dim", "");
  const int64_t per_head = int64_t(dn) + dv;
  c.expect(per_head <= INT_MAX, "v_head_dim", "qk_nope_head_dim + v_head_dim = ", per_head,
           " exceeds the supported maximum ", INT_MAX);
  c.expect(int64_t(dn) + (row - kv_lora_rank) <= INT_MAX, "qk_nope_head_dim",
           "qk_nope_head_dim + rope_dim = ", int64_t(dn) + (row - kv_lora_rank),
           " exceeds the supported maximum ", INT_MAX);
  Tensor cache4 = torch::stable::unsqueeze(kv_cache, 2);
  r.keep_alive.push_back(cache4);
  p.kv = make_paged_kv(c, cache4, "kv_cache", cache4, "kv_cache", block_tables, seq_lens, scale,
                       "scale", scale, "scale", r, /*per_head_scales=*/false);
  c.dim(w_kv_b_in, "w_kv_b", 2);
  c.dtype(w_kv_b_in, "w_kv_b", kFloatTypes);
  c.same_device(w_kv_b_in, "w_kv_b", kv_cache, "kv_cache");
  c.size(w_kv_b_in, "w_kv_b", 1, kv_lora_rank, "kv_lora_rank");
  c.expect(w_kv_b_in.size(0) > 0 && w_kv_b_in.size(0) % per_head == 0, "w_kv_b",
           "dimension 0 (", w_kv_b_in.size(0), ") must be num_heads * (qk_nope_head_dim + ",
           "v_head_dim) = num_heads * ", per_head);
  const int num_heads =
      c.to_int(w_kv_b_in.size(0) / per_head, "w_kv_b", "num_heads (dimension 0 / " +
                                                           std::to_string(per_head) + ")");
  c.cache_dtype(kv_cache, "kv_cache", w_kv_b_in, "w_kv_b");
  if (norm_weight.has_value()) {
    c.dim(*norm_weight, "norm_weight", 1);
    c.size(*norm_weight, "norm_weight", 0, kv_lora_rank, "kv_lora_rank");
    c.like(*norm_weight, "norm_weight", w_kv_b_in, "w_kv_b");
  }
  c.expect(norm_eps >= 0.0, "norm_eps", "must be >= 0, got ", norm_eps);
  c.expect(num_tokens_arg.value_or(0) >= 0, "num_tokens", "must be >= 0, got ",
           num_tokens_arg.value_or(0));
  // The output length is known (and checked against seq_lens where they are readable) before
  // anything is allocated or copied.
  const int64_t num_tokens = count(p.kv, num_tokens_arg);
  const char* length_arg = num_tokens_arg.has_value() ? "num_tokens" : "seq_lens";
  Tensor w = w_kv_b_in.is_contiguous() ? w_kv_b_in : torch::stable::contiguous(w_kv_b_in);
  r.w_kv_b = w;
  if (norm_weight.has_value()) {
    Tensor nw = torch::stable::contiguous(*norm_weight);
    r.keep_alive.push_back(nw);
    p.norm_weight = nw.const_data_ptr();
  }
  p.w_kv_b = w.const_data_ptr();
  p.w_format = float_format(w.scalar_type());
  p.norm_eps = static_cast<float>(norm_eps);
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.kv_lora_rank = static_cast<int>(kv_lora_rank);
  p.rope_dim = static_cast<int>(row - kv_lora_rank);
  p.qk_nope_head_dim = dn;
  p.v_head_dim = dv;
  p.kv.head_dim_v = static_cast<int>(kv_lora_rank);
  r.key = new_output(c, length_arg, w, {num_tokens, num_heads, int64_t(dn) + p.rope_dim});
  r.value = new_output(c, length_arg, w, {num_tokens, num_heads, int64_t(dv)});
  p.key = r.key.mutable_data_ptr();
  p.value = r.value.mutable_data_ptr();
  return r;
}

}  // namespace kvkernels
