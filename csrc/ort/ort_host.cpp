#include "ort_host.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "../index_checks.h"

namespace kvkernels::ort {

constexpr int64_t kMaxBlockSize = 256;  // as csrc/prepare.cpp

In input(Ort::KernelContext& ctx, size_t index, const char* name) {
  In t;
  t.name = name;
  if (index >= ctx.GetInputCount()) return t;
  Ort::ConstValue v = ctx.GetInput(index);
  if (v == nullptr) return t;
  t.value = v;
  auto info = v.GetTensorTypeAndShapeInfo();
  t.type = info.GetElementType();
  t.shape = info.GetShape();
  t.data = v.GetTensorRawData();
  return t;
}

const char* type_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN: return "float8e4m3fn";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2: return "float8e5m2";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    default: return "an unsupported element type";
  }
}

size_t element_size(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return 1;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return 2;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return 8;
    default: return 4;
  }
}

bool is_float(ONNXTensorElementDataType t) {
  return t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
         t == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
}

bool is_fp8(ONNXTensorElementDataType t) {
  return t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN ||
         t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2;
}

FloatFormat float_format(ONNXTensorElementDataType t) {
  if (t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) return FloatFormat::kFloat16;
  if (t == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) return FloatFormat::kBFloat16;
  return FloatFormat::kFloat32;
}

CacheFormat cache_format(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return CacheFormat::kFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return CacheFormat::kBFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN: return CacheFormat::kFp8E4M3;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2: return CacheFormat::kFp8E5M2;
    default: return CacheFormat::kFloat32;
  }
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream ss;
  ss << "[";
  for (size_t i = 0; i < shape.size(); ++i) ss << (i ? ", " : "") << shape[i];
  ss << "]";
  return ss.str();
}

void Check::required(const In& t) const { expect(bool(t), t.name, "is required"); }

void Check::dim(const In& t, int64_t ndim) const {
  required(t);
  expect(t.dim() == ndim, t.name, "expected ", ndim, " dims, got shape ", shape_str(t.shape));
}

void Check::type(const In& t, ONNXTensorElementDataType expected) const {
  expect(t.type == expected, t.name, "expected ", type_name(expected), ", got ", type_name(t.type));
}

void Check::size(const In& t, int64_t d, int64_t expected, const char* what) const {
  expect(t.size(d) == expected, t.name, "dimension ", d, " must be ", expected, " (", what,
         "), got shape ", shape_str(t.shape));
}

int Check::to_int(int64_t v, const char* arg, const char* what) const {
  expect(v >= 0 && v <= INT32_MAX, arg, what, " = ", v, " does not fit in an int");
  return static_cast<int>(v);
}

bool Check::scale(const In& t, const char* cache_arg, int64_t per_head) const {
  expect(bool(t), t.name, "is required when ", cache_arg, " is fp8");
  type(t, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  const int64_t n = t.numel();
  expect(n == 1 || (per_head > 0 && n == per_head), t.name, "must have 1 element",
         per_head > 0 ? " or one per kv head (" : "", per_head > 0 ? std::to_string(per_head) : "",
         per_head > 0 ? ")" : "", ", got shape ", shape_str(t.shape));
  return n != 1;
}

void Check::disjoint(const In& t, const In& out) const {
  if (!t || !out || t.numel() == 0 || out.numel() == 0) return;
  const char* a = static_cast<const char*>(t.data);
  const char* b = static_cast<const char*>(out.data);
  const bool apart = a + t.numel() * element_size(t.type) <= b ||
                     b + out.numel() * element_size(out.type) <= a;
  expect(apart, t.name, "shares memory with ", out.name, ", which this op writes");
}

paged_kv_t paged_kv(const Check& c, const In& key_cache, const In& value_cache,
                    const In& block_tables, const In& seq_lens, const In& k_scale,
                    const In& v_scale) {
  c.dim(key_cache, 4);
  c.expect(is_float(key_cache.type) || is_fp8(key_cache.type), key_cache.name,
           "expected float32, float16, bfloat16, float8e4m3fn or float8e5m2, got ",
           type_name(key_cache.type));
  c.expect(key_cache.size(1) >= 1 && key_cache.size(1) <= kMaxBlockSize, key_cache.name,
           "block size (dimension 1) must be in [1, ", kMaxBlockSize, "], got ",
           key_cache.size(1));
  c.dim(value_cache, 4);
  c.type(value_cache, key_cache.type);
  for (int64_t d = 0; d < 4; ++d) c.size(value_cache, d, key_cache.size(d), key_cache.name);
  c.dim(block_tables, 2);
  c.type(block_tables, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
  c.dim(seq_lens, 1);
  c.type(seq_lens, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
  c.size(seq_lens, 0, block_tables.size(0), "num_seqs = block_tables.shape[0]");

  paged_kv_t kv;
  kv.k = key_cache.data;
  kv.v = value_cache.data;
  kv.k_stride_block = key_cache.stride(0);
  kv.k_stride_slot = key_cache.stride(1);
  kv.k_stride_head = key_cache.stride(2);
  kv.v_stride_block = value_cache.stride(0);
  kv.v_stride_slot = value_cache.stride(1);
  kv.v_stride_head = value_cache.stride(2);
  kv.num_blocks = key_cache.size(0);
  kv.block_size = static_cast<int>(key_cache.size(1));
  kv.num_kv_heads = c.to_int(key_cache.size(2), key_cache.name, "num_kv_heads (dimension 2)");
  kv.head_dim = c.to_int(key_cache.size(3), key_cache.name, "head_dim (dimension 3)");
  kv.head_dim_v = kv.head_dim;
  kv.format = cache_format(key_cache.type);
  if (is_fp8(key_cache.type)) {
    kv.k_scale_per_head = c.scale(k_scale, key_cache.name, kv.num_kv_heads);
    kv.v_scale_per_head = c.scale(v_scale, key_cache.name, kv.num_kv_heads);
    kv.k_scale = k_scale.as<float>();
    kv.v_scale = v_scale.as<float>();
  }
  kv.block_tables = block_tables.as<int32_t>();
  kv.seq_lens = seq_lens.as<int32_t>();
  kv.num_seqs = c.to_int(block_tables.size(0), block_tables.name, "num_seqs (dimension 0)");
  kv.max_blocks_per_seq = block_tables.size(1);
  check_paged_kv_indices(c, kv);
  return kv;
}

void* inplace_output(Ort::KernelContext& ctx, size_t output, const In& cache) {
  Ort::UnownedValue out = ctx.GetOutput(output, cache.shape);
  void* dst = out.GetTensorMutableRawData();
  const size_t bytes = static_cast<size_t>(cache.numel()) * element_size(cache.type);
  if (dst != cache.data && bytes > 0) std::memcpy(dst, cache.data, bytes);
  return dst;
}

}  // namespace kvkernels::ort
