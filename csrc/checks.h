// Argument checks that name the offending argument: every failure raises RuntimeError with the
// message "kvkernels.<op>: <argument>: <what is wrong>", before any kernel writes anything.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "arg_error.h"

namespace kvkernels {

using torch::stable::Tensor;
using ScalarType = torch::headeronly::ScalarType;

std::string shape_str(const Tensor& t);

// What the memory checks read of a tensor, fetched from torch once (each field is a call through
// the stable ABI; an op checks each tensor against several others). Borrows t's sizes and strides:
// t must outlive it.
struct Layout {
  explicit Layout(const Tensor& t);
  uintptr_t ptr = 0;  // first element's address
  uint64_t elem = 0;  // bytes per element
  int32_t device_type = 0, device_index = 0;
  torch::headeronly::IntHeaderOnlyArrayRef sizes, strides;
  bool empty() const;  // no elements
};

// ArgError (arg_error.h) plus the checks that read torch tensors.
class ArgCheck : public ArgError {
 public:
  using ArgError::ArgError;

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
  // A size or count the kernels hold in an int: fails naming `arg` when v does not fit.
  int to_int(int64_t v, const char* arg, const std::string& what) const;
  // An output the op writes in place: no two of its elements may share memory (a stride-0
  // dimension of an expand()ed tensor, or strides that make distinct indices meet).
  void writable(const Layout& out, const char* arg) const;
  // `t` (another output, or an input the op reads while writing `out`) shares no memory with
  // `out`. Exact enough for strided views of one allocation: K and V interleaved in one
  // [..., 2 * D] tensor, or slices kv[l, 0] / kv[l, 1] of a stacked cache, do not overlap.
  void disjoint(const Layout& t, const char* arg, const Layout& out, const char* out_arg) const;
  void disjoint(const std::optional<Tensor>& t, const char* arg, const Layout& out,
                const char* out_arg) const {
    if (t.has_value()) disjoint(Layout(*t), arg, out, out_arg);
  }
  // A float32 scale tensor of 1 element or `per_head` elements (0: only 1 allowed); returns
  // whether it is per head.
  bool scale(const std::optional<Tensor>& t, const char* arg, const Tensor& ref, const char* ref_arg,
             int64_t per_head) const;
};

bool is_fp8(ScalarType t);
// Whether two distinct indices of t address overlapping memory. A sufficient test (like torch's
// has_internal_overlap, but also for non-contiguous tensors): the dims of size > 1 sorted by
// stride, each stride must reach past everything the smaller ones span. Exotic non-overlapping
// layouts that interleave two dims (sizes [3, 2], strides [2, 3]) count as overlapping.
bool has_internal_overlap(const Layout& t);
// Whether a and b may share a byte of memory; false only when provably disjoint: their byte
// ranges do not meet, or, for some modulus M that divides every stride of their outer dims, the
// bytes the inner dims reach fall into disjoint residue intervals mod M (how interleaved K/V
// views of one allocation are told apart). Tensors on different devices never overlap.
bool may_overlap(const Layout& a, const Layout& b);
bool is_float(ScalarType t);  // float32 / float16 / bfloat16

}  // namespace kvkernels
