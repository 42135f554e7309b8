// What the op files of the ONNX Runtime library share (csrc/ort/ops_*.cpp): attribute reads, errors
// as ORT statuses, output type/shape inference and the alias maps of the ops that update a cache in
// place. Header-only, internal linkage: each op file gets its own copy.
#pragma once

#include <exception>
#include <optional>
#include <vector>

#include "ort_host.h"

namespace kvkernels::ort {
namespace {

constexpr int kMaxHeadDim = kDenseMaxHeadDimCpu;  // the CPU kernels, as csrc/prepare.cpp
constexpr auto kAny = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
constexpr auto kI32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr auto kI64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;

template <typename T>
std::optional<T> attribute(const OrtKernelInfo* info, const char* name);
template <>
inline std::optional<float> attribute<float>(const OrtKernelInfo* info, const char* name) {
  float v = 0;
  OrtStatus* s = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &v);
  if (s != nullptr) return Ort::GetApi().ReleaseStatus(s), std::nullopt;
  return v;
}
template <>
inline std::optional<int64_t> attribute<int64_t>(const OrtKernelInfo* info, const char* name) {
  int64_t v = 0;
  OrtStatus* s = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &v);
  if (s != nullptr) return Ort::GetApi().ReleaseStatus(s), std::nullopt;
  return v;
}

OrtStatus* to_status(const std::exception& e) {
  return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, e.what());
}

// Output type and shape inference. ORT's schema of a custom op whose inputs take any element type
// cannot tell the output types; these functions give them (and the shapes, symbolic dims kept).
struct ShapeOf {
  ONNXTensorElementDataType type = kF32;
  std::vector<int64_t> dims;       // -1: symbolic or unknown
  std::vector<const char*> syms;   // the symbol of each dim ("" when none)
};

ShapeOf input_shape(OrtShapeInferContext* ctx, size_t i) {
  const OrtApi& api = Ort::GetApi();
  ShapeOf s;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(ctx, i, &info));
  size_t n = 0;
  Ort::ThrowOnError(api.GetTensorElementType(info, &s.type));
  Ort::ThrowOnError(api.GetDimensionsCount(info, &n));
  s.dims.resize(n);
  s.syms.resize(n);
  Ort::ThrowOnError(api.GetDimensions(info, s.dims.data(), n));
  Ort::ThrowOnError(api.GetSymbolicDimensions(info, s.syms.data(), n));
  return s;  // info (and the symbols it holds) belongs to the context: not released here
}

void set_output(OrtShapeInferContext* ctx, size_t i, const ShapeOf& s) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* info = nullptr;
  Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&info));
  Ort::ThrowOnError(api.SetTensorElementType(info, s.type));
  Ort::ThrowOnError(api.SetDimensions(info, s.dims.data(), s.dims.size()));
  std::vector<const char*> syms(s.syms);
  for (auto& x : syms) x = x ? x : "";
  Ort::ThrowOnError(api.SetSymbolicDimensions(info, syms.data(), syms.size()));
  OrtStatus* st = api.ShapeInferContext_SetOutputTypeShape(ctx, i, info);
  api.ReleaseTensorTypeAndShapeInfo(info);
  Ort::ThrowOnError(st);
}

// Installs `fn(ctx)` as the op's shape inference (instead of CustomOpBase's, whose context wrapper
// hides the input element types).
template <typename Op>
void install_inference(Op* op) {
  op->InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* ctx) -> OrtStatusPtr {
    try {
      Op::infer(ctx);
      return nullptr;
    } catch (const std::exception& e) {
      return Ort::GetApi().CreateStatus(ORT_INVALID_GRAPH, e.what());
    }
  };
}

// Cache ops: output i is input alias[i] updated in place (OrtCustomOp::GetAliasMap).
template <int... Pairs>
struct Aliases {
  static size_t get(int** in, int** out) {
    constexpr int pairs[] = {Pairs...};
    constexpr size_t n = sizeof(pairs) / sizeof(int) / 2;
    *in = new int[n];
    *out = new int[n];
    for (size_t i = 0; i < n; ++i) (*in)[i] = pairs[2 * i], (*out)[i] = pairs[2 * i + 1];
    return n;
  }
  static void release(int* in, int* out) {
    delete[] in;
    delete[] out;
  }
  static void install(OrtCustomOp* op) {
    op->GetAliasMap = &get;
    op->ReleaseAliasMap = &release;
  }
};

}  // namespace
}  // namespace kvkernels::ort
