// Argument checks that name the offending argument: every failure raises RuntimeError with the
// message "kvkernels.<op>: <argument>: <what is wrong>", before any kernel writes anything.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <initializer_list>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

namespace kvkernels {

using torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

std::string shape_str(const Tensor& t);

class ArgCheck {
 public:
  explicit ArgCheck(const char* op) : op_(op) {}

  template <typename... Args>
  [[noreturn]] void fail(const char* arg, const Args&... what) const {
    std::ostringstream ss;
    ss << "kvkernels." << op_ << ": " << arg << ": ";
    (ss << ... << what);
    throw std::runtime_error(ss.str());
  }

  template <typename... Args>
  void expect(bool ok, const char* arg, const Args&... what) const {
    if (!ok) fail(arg, what...);
  }

  void dtype(const Tensor& t, const char* arg, std::initializer_list<ScalarType> allowed) const;
  void dim(const Tensor& t, const char* arg, int64_t ndim) const;
  // t.size(d) == expected; `what` says where the expected size comes from.
  void size(const Tensor& t, const char* arg, int64_t d, int64_t expected, const char* what) const;
  void same_device(const Tensor& t, const char* arg, const Tensor& ref, const char* ref_arg) const;
  // t has ref's dtype and device (a companion input: value of key, out_b of out_a, ...).
  void like(const Tensor& t, const char* arg, const Tensor& ref, const char* ref_arg) const;
  // A cache stores ref's dtype, or is fp8 (quantized, read through scales).
  void cache_dtype(const Tensor& cache, const char* arg, const Tensor& ref,
                   const char* ref_arg) const;
  void last_dim_contiguous(const Tensor& t, const char* arg) const;
  // A float32 scale tensor of 1 element or `per_head` elements (0: only 1 allowed); returns
  // whether it is per head.
  bool scale(const std::optional<Tensor>& t, const char* arg, const Tensor& ref, const char* ref_arg,
             int64_t per_head) const;

  const char* op() const { return op_; }

 private:
  const char* op_;
};

bool is_fp8(ScalarType t);
bool is_float(ScalarType t);  // float32 / float16 / bfloat16

}  // namespace kvkernels
