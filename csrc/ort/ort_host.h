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
#include "../cpu/attention_run.h"
#include "kvkernels/params.h"

namespace kvkernels::ort {

// An input of the op, as the kernels see it. ORT tensors are dense and row-major.
struct In {
  const OrtValue* value = nullptr;  // nullptr: an optional input that is absent
  const char* name = "";
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> shape;
  const void* data = nullptr;

  explicit operator bool() const { return value != nullptr; }
  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  int64_t size(int64_t d) const { return shape[static_cast<size_t>(d)]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  int64_t stride(int64_t d) const {  // in elements, row-major
    int64_t s = 1;
    for (size_t i = static_cast<size_t>(d) + 1; i < shape.size(); ++i) s *= shape[i];
    return s;
  }
  template <typename T>
  const T* as() const { return static_cast<const T*>(data); }
};

In input(Ort::KernelContext& ctx, size_t index, const char* name);

const char* type_name(ONNXTensorElementDataType t);
size_t element_size(ONNXTensorElementDataType t);
bool is_float(ONNXTensorElementDataType t);  // float32 / float16 / bfloat16
bool is_fp8(ONNXTensorElementDataType t);    // float8e4m3fn / float8e5m2
FloatFormat float_format(ONNXTensorElementDataType t);
CacheFormat cache_format(ONNXTensorElementDataType t);
std::string shape_str(const std::vector<int64_t>& shape);

// ArgError plus the checks of ORT tensors.
class Check : public ArgError {
 public:
  using ArgError::ArgError;
  void required(const In& t) const;
  void dim(const In& t, int64_t ndim) const;
  void type(const In& t, ONNXTensorElementDataType expected) const;
  void size(const In& t, int64_t d, int64_t expected, const char* what) const;
  int to_int(int64_t v, const char* arg, const char* what) const;
  // A float32 scale of 1 or `per_head` elements (0: only 1); returns whether it is per head.
  bool scale(const In& t, const char* cache_arg, int64_t per_head) const;
  // `t` shares no byte with `out` (an input bound to the very buffer an op writes in place).
  void disjoint(const In& t, const In& out) const;
};

// The paged half of PagedAttention / GatherKV: caches, block tables, sequence lengths, fp8 scales
// (the index checks of index_checks.h included: everything is valid when it returns).
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
