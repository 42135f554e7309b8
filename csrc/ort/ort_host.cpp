#include "ort_host.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "../index_checks.h"

namespace kvkernels::ort {

In input(Ort::KernelContext& ctx, size_t index, const char* name) {
  In t;
  t.name = name;
  if (index >= ctx.GetInputCount()) return t;
  Ort::ConstValue v = ctx.GetInput(index);
  if (v == nullptr) return t;
  t.present = true;
  auto info = v.GetTensorTypeAndShapeInfo();
  t.type = info.GetElementType();
  t.shape = info.GetShape();
  t.data = const_cast<void*>(v.GetTensorRawData());  // inputs are read, never written
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
  paged_kv_t kv = dense_paged_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale,
                                 /*same_head_dims=*/true);
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
