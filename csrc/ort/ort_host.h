// What the ONNX Runtime ops (kvkernels_ort.cpp) share: reading ORT tensors into the torch-free
// parameter structs of csrc/include/kvkernels/params.h, argument checks that name the ONNX input
// (ArgError, arg_error.h: "kvkernels.<Op>: <input>: ..."), and the host of the attention scheduler
// (attention_run.h) on ORT's intra-op thread pool.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../arg_error.h"
#include "../dense_args.h"
#include "../cpu/attention_run.h"
#include "kvkernels/params.h"

namespace kvkernels::ort {

const char* type_name(ONNXTensorElementDataType t);
size_t element_size(ONNXTensorElementDataType t);
bool is_float(ONNXTensorElementDataType t);  // float32 / float16 / bfloat16
bool is_fp8(ONNXTensorElementDataType t);    // float8e4m3fn / float8e5m2
FloatFormat float_format(ONNXTensorElementDataType t);
CacheFormat cache_format(ONNXTensorElementDataType t);
std::string shape_str(const std::vector<int64_t>& shape);

// ONNX element types for the checks shared with the XLA binding (dense_args.h).
struct OrtTypes {
  using Type = ONNXTensorElementDataType;
  static const char* name(Type t) { return type_name(t); }
  static std::string shape(const std::vector<int64_t>& s) { return shape_str(s); }
  static bool is_float(Type t) { return ort::is_float(t); }
  static bool is_fp8(Type t) { return ort::is_fp8(t); }
  static CacheFormat cache_format(Type t) { return ort::cache_format(t); }
  static constexpr Type kFloat32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  static constexpr Type kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  static constexpr const char* kCacheTypes = "float32, float16, bfloat16, float8e4m3fn or float8e5m2";
  static constexpr const char* kDtype = "type";
  static constexpr const char* kDecode = "no query_start_loc";
  static FloatFormat float_format(Type t) { return ort::float_format(t); }
};

// An input of the op, as the kernels see it (ORT tensors are dense and row-major); absent optional
// inputs are not `present`.
using In = DenseIn<ONNXTensorElementDataType>;

In input(Ort::KernelContext& ctx, size_t index, const char* name);

// The shared checks, plus one of ORT's own.
class Check : public DenseCheck<OrtTypes> {
 public:
  explicit Check(const char* op) : DenseCheck<OrtTypes>(op) {}
  // `t` shares no byte with `out` (an input bound to the very buffer an op writes in place).
  void disjoint(const In& t, const In& out) const;
};

// The paged half of PagedAttention / GatherKV: caches (head_dim of value_cache = key_cache's), block
// tables, sequence lengths, fp8 scales (the index checks of index_checks.h included: everything is
// valid when it returns).
paged_kv_t paged_kv(const Check& c, const In& key_cache, const In& value_cache,
                    const In& block_tables, const In& seq_lens, const In& k_scale,
                    const In& v_scale);

// Where the op writes a cache it updates in place: the output that ORT aliases to the cache input
// (the op's alias map), or, when ORT gave the output a buffer of its own, that buffer after a copy
// of the input (correct, but a copy of the whole cache: the tests check the alias holds).
void* inplace_output(Ort::KernelContext& ctx, size_t output, const In& cache);

// The scheduler's host on ORT's thread pool (KernelContext_ParallelFor). threads() sizes the
// split heuristic only; ORT does not tell a kernel its pool size, so it is the hardware's.
struct OrtHost {
  const OrtKernelContext* ctx;
  int64_t threads() const {
    const unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : static_cast<int64_t>(n);
  }
  template <typename F>
  void parallel_for(int64_t n, F f) const {
    if (n <= 0) return;
    auto call = [](void* user, size_t i) {
      (*static_cast<F*>(user))(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
    };
    Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(ctx, call, static_cast<size_t>(n), 0,
                                                              &f));
  }
  float* scratch(int slot, size_t n) const { return cpu::thread_scratch(slot, n); }
};

}  // namespace kvkernels::ort
