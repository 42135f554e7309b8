#include "jax_args.h"

#include <sstream>

namespace kvkernels::jaxffi {

using ffi::DataType;

const char* type_name(DataType t) {
  switch (t) {
    case DataType::F32: return "float32";
    case DataType::F16: return "float16";
    case DataType::BF16: return "bfloat16";
    case DataType::F8E4M3FN: return "float8_e4m3fn";
    case DataType::F8E5M2: return "float8_e5m2";
    case DataType::S32: return "int32";
    case DataType::S64: return "int64";
    case DataType::F64: return "float64";
    case DataType::U8: return "uint8";
    case DataType::S8: return "int8";
    case DataType::PRED: return "bool";
    default: return "an unsupported element type";
  }
}

bool is_float(DataType t) { return t == DataType::F32 || t == DataType::F16 || t == DataType::BF16; }
bool is_fp8(DataType t) { return t == DataType::F8E4M3FN || t == DataType::F8E5M2; }
bool is_index(DataType t) { return t == DataType::S32 || t == DataType::S64; }

FloatFormat float_format(DataType t) {
  if (t == DataType::F16) return FloatFormat::kFloat16;
  if (t == DataType::BF16) return FloatFormat::kBFloat16;
  return FloatFormat::kFloat32;
}

CacheFormat cache_format(DataType t) {
  switch (t) {
    case DataType::F16: return CacheFormat::kFloat16;
    case DataType::BF16: return CacheFormat::kBFloat16;
    case DataType::F8E4M3FN: return CacheFormat::kFp8E4M3;
    case DataType::F8E5M2: return CacheFormat::kFp8E5M2;
    default: return CacheFormat::kFloat32;
  }
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream ss;
  ss << "(";
  for (size_t i = 0; i < shape.size(); ++i) ss << (i ? ", " : "") << shape[i];
  ss << (shape.size() == 1 ? ",)" : ")");
  return ss.str();
}



namespace {

template <typename Buffer>
void split_dims(Operand& o, const Buffer& b, int64_t batch_dims) {
  const auto dims = b.dimensions();
  const int64_t rank = static_cast<int64_t>(dims.size());
  // The Python side always passes batch_dims <= every operand's rank; a hand-written call that does
  // not gets an error from Check::batch (an operand with fewer dims than the batch).
  const int64_t nb = std::min(batch_dims, rank);
  o.batch.assign(dims.begin(), dims.begin() + nb);
  o.shape.assign(dims.begin() + nb, dims.end());
  int64_t n = static_cast<int64_t>(ffi::ByteWidth(b.element_type()));
  for (int64_t s : o.shape) n *= s;
  o.example_bytes = n;
}

}  // namespace

Operand::Operand(const char* n, const ffi::AnyBuffer& b, int64_t batch_dims)
    : name(n), present(true), type(b.element_type()), base(static_cast<char*>(b.untyped_data())) {
  split_dims(*this, b, batch_dims);
}

Operand::Operand(const char* n, const ffi::Result<ffi::AnyBuffer>& r, int64_t batch_dims)
    : name(n), present(true) {
  const ffi::AnyBuffer& b = *const_cast<ffi::Result<ffi::AnyBuffer>&>(r);
  type = b.element_type();
  base = static_cast<char*>(b.untyped_data());
  split_dims(*this, b, batch_dims);
}

In Operand::at(const std::vector<int64_t>& idx) const {
  In t;
  t.name = name;
  t.present = present;
  if (!present) return t;
  t.type = type;
  t.shape = shape;
  // Row-major over the leading dims; a dim of size 1 is broadcast (offset 0 along it).
  int64_t flat = 0;
  for (size_t d = 0; d < batch.size(); ++d) flat = flat * batch[d] + (batch[d] == 1 ? 0 : idx[d]);
  t.data = base + flat * example_bytes;
  return t;
}

std::vector<int64_t> Batch::index(int64_t flat) const {
  std::vector<int64_t> idx(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = flat % shape[d];
    flat /= shape[d];
  }
  return idx;
}

Batch Check::batch(std::initializer_list<const Operand*> ops, int64_t batch_dims) const {
  Batch b;
  b.shape.assign(static_cast<size_t>(batch_dims), 1);
  for (const Operand* o : ops) {
    if (!o->present) continue;
    expect(static_cast<int64_t>(o->batch.size()) == batch_dims, o->name, "has fewer dims than the ",
           batch_dims, " batch dims of the call");
    for (size_t d = 0; d < b.shape.size(); ++d) {
      if (o->batch[d] == 1) continue;
      expect(b.shape[d] == 1 || b.shape[d] == o->batch[d], o->name, "batch dim ", d, " is ",
             o->batch[d], " where another operand has ", b.shape[d]);
      b.shape[d] = o->batch[d];
    }
  }
  for (int64_t s : b.shape) b.count *= s;
  return b;
}

void read_optional(const Check& c, const ffi::RemainingArgs& rest, int64_t mask,
                   const char* const* names, int n, int64_t batch_dims, Operand* out) {
  size_t next = 0;
  for (int i = 0; i < n; ++i) {
    if (!((mask >> i) & 1)) {
      out[i] = Operand::absent(names[i]);
      continue;
    }
    c.expect(next < rest.size(), names[i], "missing (optional_mask says it is given)");
    ffi::ErrorOr<ffi::AnyBuffer> b = rest.get<ffi::AnyBuffer>(next++);
    c.expect(b.has_value(), names[i], "is not an array");
    out[i] = Operand(names[i], *b, batch_dims);
  }
  c.expect(next == rest.size(), "optional_mask", "names ", next, " optional inputs, ", rest.size(),
           " were passed");
}

paged_kv_t paged_kv(const Check& c, const In& key_cache, const In& value_cache,
                    const In& block_tables, const In& seq_lens, const In& k_scale,
                    const In& v_scale) {
  return dense_paged_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale,
                        /*same_head_dims=*/false);
}

AttentionCall::AttentionCall(const Check& c, const ffi::AnyBuffer& query, const ffi::AnyBuffer& key_cache,
                             const ffi::AnyBuffer& value_cache, const ffi::AnyBuffer& block_tables,
                             const ffi::AnyBuffer& seq_lens, const ffi::RemainingArgs& optional,
                             const ffi::Result<ffi::AnyBuffer>& out_buf,
                             const ffi::Result<ffi::AnyBuffer>& lse_buf, int64_t optional_mask,
                             int64_t batch_dims)
    : q("query", query, batch_dims),
      kc("key_cache", key_cache, batch_dims),
      vc("value_cache", value_cache, batch_dims),
      bt("block_tables", block_tables, batch_dims),
      sl("seq_lens", seq_lens, batch_dims),
      out("out", out_buf, batch_dims),
      lse("lse", lse_buf, batch_dims) {
  read_optional(c, optional, optional_mask, kOptionalNames, kNumOptional, batch_dims, opt);
  batch = c.batch({&q, &kc, &vc, &bt, &sl, &out, &lse, &opt[0], &opt[1], &opt[2], &opt[3], &opt[4]},
                  batch_dims);
}

AttentionParams attention_example(const Check& c, const AttentionCall& call, const std::vector<int64_t>& idx,
                                  const AttentionAttrs& attrs, int64_t max_head_dim) {
  const In out_b = call.out.at(idx), lse_b = call.lse.at(idx);
  AttentionParams p = dense_attention_params(
      c, call.q.at(idx), call.kc.at(idx), call.vc.at(idx), call.bt.at(idx), call.sl.at(idx), call.opt[kQsl].at(idx),
      call.opt[kAlibi].at(idx), call.opt[kSinks].at(idx), call.opt[kKScale].at(idx), call.opt[kVScale].at(idx),
      attrs, max_head_dim, /*same_head_dims=*/false);
  c.dim(out_b, 3);
  c.expect(out_b.type == call.q.type && out_b.size(0) == p.num_tokens && out_b.size(1) == p.num_heads &&
               out_b.size(2) == p.kv.head_dim_v,
           "out", "must be [num_tokens, num_heads, head_dim_v] in the query's dtype, got ",
           type_name(out_b.type), " ", shape_str(out_b.shape));
  c.dim(lse_b, 2);
  c.expect(lse_b.type == DataType::F32 && lse_b.size(0) == p.num_tokens && lse_b.size(1) == p.num_heads,
           "lse", "must be float32 [num_tokens, num_heads], got ", type_name(lse_b.type), " ",
           shape_str(lse_b.shape));
  p.out = out_b.data;
  p.lse = lse_b.as<float>();
  return p;
}

void check_updated_cache_batch(const Check& c, const Operand& out, const Batch& batch) {
  for (size_t d = 0; d < batch.shape.size(); ++d)
    c.expect(out.batch[d] == batch.shape[d], out.name, "the updated cache must have the batch's shape");
}

void check_updated_cache(const Check& c, const In& out, const In& in) {
  c.expect(out.type == in.type && out.shape == in.shape, out.name,
           "the updated cache must have the input cache's dtype and shape");
}

void cache_write_params(const Check& c, const In& key, const In& value, const In& key_cache,
                        const In& value_cache, const In& slots, const In& k_scale,
                        const In& v_scale, CacheWriteParams (&writes)[2]) {
  c.dim(key, 3);
  c.expect(is_float(key.type), key.name, "expected float32, float16 or bfloat16, got ",
           type_name(key.type));
  c.dim(value, 3);
  c.type(value, key.type);
  for (int64_t d = 0; d < 2; ++d) c.size(value, d, key.size(d), "num_tokens, num_kv_heads of key");
  for (const In* cache : {&key_cache, &value_cache}) {
    c.dim(*cache, 4);
    c.expect(cache->type == key.type || is_fp8(cache->type), cache->name,
             "must have key's dtype (", type_name(key.type), ") or be fp8, got ",
             type_name(cache->type));
    c.expect(cache->size(1) >= 1 && cache->size(1) <= kMaxBlockSize, cache->name,
             "block size (dimension 1) must be in [1, ", kMaxBlockSize, "], got ", cache->size(1));
  }
  c.type(value_cache, key_cache.type);
  for (int64_t d = 0; d < 3; ++d)
    c.size(value_cache, d, key_cache.size(d), "num_blocks, block_size, num_kv_heads of key_cache");
  c.size(key, 1, key_cache.size(2), "num_kv_heads of key_cache");
  c.size(key, 2, key_cache.size(3), "head_dim of key_cache");
  c.size(value, 2, value_cache.size(3), "head_dim of value_cache");
  c.dim(slots, 1);
  c.expect(is_index(slots.type), slots.name, "expected int32 or int64, got ", type_name(slots.type));
  c.size(slots, 0, key.size(0), "num_tokens of key");
  const int num_heads = c.to_int(key.size(1), key.name, "num_kv_heads (dimension 1)");
  bool per_head[2] = {false, false};
  if (is_fp8(key_cache.type)) {
    per_head[0] = c.scale(k_scale, key_cache.name, num_heads);
    per_head[1] = c.scale(v_scale, value_cache.name, num_heads);
  }
  const In* src[2] = {&key, &value};
  const In* dst[2] = {&key_cache, &value_cache};
  const In* scales[2] = {&k_scale, &v_scale};
  for (int i = 0; i < 2; ++i) {
    CacheWriteParams& w = writes[i];
    w = CacheWriteParams{};
    w.src = src[i]->data;
    w.src_stride_token = src[i]->stride(0);
    w.src_stride_head = src[i]->stride(1);
    w.src_format = float_format(key.type);
    w.cache = dst[i]->data;
    w.cache_stride_block = dst[i]->stride(0);
    w.cache_stride_slot = dst[i]->stride(1);
    w.cache_stride_head = dst[i]->stride(2);
    w.cache_format = cache_format(key_cache.type);
    if (is_fp8(key_cache.type)) {
      w.scale = scales[i]->as<const float>();
      w.scale_per_head = per_head[i];
    }
    w.num_tokens = key.size(0);
    w.block_size = static_cast<int>(key_cache.size(1));
    w.num_heads = num_heads;
    w.width = c.to_int(src[i]->size(2), src[i]->name, "head_dim (dimension 2)");
  }
}

int64_t block_copy_params(const Check& c, const In& cache, const In& mapping, int64_t block_dim,
                          BlockCopyParams& p) {
  c.expect(cache.present, cache.name, "is required");
  c.expect(cache.dim() >= 1 && cache.dim() <= 8, cache.name, "needs 1 to 8 dims, got shape ",
           shape_str(cache.shape));
  const int64_t bd = block_dim < 0 ? block_dim + cache.dim() : block_dim;
  c.expect(bd >= 0 && bd < cache.dim(), "block_dim", block_dim, " is out of range for a cache of ",
           cache.dim(), " dims");
  c.dim(mapping, 2);
  c.expect(is_index(mapping.type), mapping.name, "expected int32 or int64, got ",
           type_name(mapping.type));
  c.size(mapping, 1, 2, "(source, destination) pairs");
  const int64_t elem = static_cast<int64_t>(ffi::ByteWidth(cache.type));
  p = BlockCopyParams{};
  p.src = static_cast<const char*>(cache.data);
  p.dst = static_cast<char*>(cache.data);
  p.num_pairs = mapping.size(0);
  p.src_block_stride = p.dst_block_stride = cache.stride(bd) * elem;
  int64_t run = elem;  // the dims after bd are one contiguous run
  for (int64_t d = bd + 1; d < cache.dim(); ++d) run *= cache.size(d);
  p.run_bytes = run;
  for (int64_t d = 0; d < bd; ++d) {
    p.sizes[p.num_dims] = cache.size(d);
    p.src_strides[p.num_dims] = p.dst_strides[p.num_dims] = cache.stride(d) * elem;
    ++p.num_dims;
  }
  return cache.size(bd);
}

GatherParams gather_params(const Check& c, const In& key_cache, const In& value_cache,
                           const In& block_tables, const In& seq_lens, const In& k_scale,
                           const In& v_scale, const In& key_out, const In& value_out) {
  GatherParams p;
  p.kv = paged_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale);
  c.expect(is_float(key_out.type), "out_dtype", "must be float32, float16 or bfloat16, got ",
           type_name(key_out.type));
  c.dim(key_out, 3);
  c.dim(value_out, 3);
  c.type(value_out, key_out.type);
  c.size(key_out, 1, p.kv.num_kv_heads, "num_kv_heads");
  c.size(key_out, 2, p.kv.head_dim, "head_dim of key_cache");
  c.size(value_out, 0, key_out.size(0), "num_tokens");
  c.size(value_out, 1, p.kv.num_kv_heads, "num_kv_heads");
  c.size(value_out, 2, p.kv.head_dim_v, "head_dim of value_cache");
  p.out_format = float_format(key_out.type);
  p.num_tokens = key_out.size(0);
  p.key = key_out.data;
  p.value = value_out.data;
  return p;
}

ffi::Error to_error(const std::exception& e) { return ffi::Error::InvalidArgument(e.what()); }

}  // namespace kvkernels::jaxffi
