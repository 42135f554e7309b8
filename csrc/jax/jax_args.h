// What the XLA FFI handlers of kvkernels.jax share (csrc/jax/ops_cpu.cpp, ops_cuda.cpp): operands as
// the kernels see them, the leading batch dimensions that jax.vmap adds, argument checks that name
// the argument ("kvkernels.<op>: <argument>: ...", ArgError of csrc/arg_error.h, no torch), and the
// platform-independent filling of the torch-free params structs (kvkernels/params.h) from shapes.
// Nothing here reads the contents of an operand: the index checks (csrc/index_checks.h) are the
// CPU handlers' business (host memory); on CUDA the kernels skip out-of-range ids, as the torch
// binding does without KVKERNELS_DEBUG.
//
// XLA arrays are dense and row-major (the Python side never asks for other layouts), so strides
// follow from the shapes. Python validates every shape and dtype at trace time with the same
// messages; the checks here repeat them so that a handler called some other way (a hand-written
// custom call) cannot index out of bounds.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../arg_error.h"
#include "kvkernels/params.h"
#include "xla/ffi/api/ffi.h"

namespace kvkernels::jaxffi {

namespace ffi = xla::ffi;

// Limits shared with csrc/prepare.cpp (the torch binding).
constexpr int64_t kMaxHeadDimCpu = 512;
constexpr int64_t kMaxHeadDimCuda = 256;
constexpr int64_t kMaxBlockSize = 256;

const char* type_name(ffi::DataType t);
bool is_float(ffi::DataType t);  // float32 / float16 / bfloat16
bool is_fp8(ffi::DataType t);    // float8_e4m3fn / float8_e5m2
bool is_index(ffi::DataType t);  // int32 / int64 (slot_mapping, block_mapping)
FloatFormat float_format(ffi::DataType t);
CacheFormat cache_format(ffi::DataType t);
std::string shape_str(const std::vector<int64_t>& shape);

// One operand of one example (one vmapped call). Dense, row-major.
struct In {
  const char* name = "";
  bool present = false;  // false: an optional argument not given
  ffi::DataType type = ffi::DataType::INVALID;
  std::vector<int64_t> shape;
  void* data = nullptr;

  explicit operator bool() const { return present; }
  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  int64_t size(int64_t d) const { return shape[static_cast<size_t>(d)]; }
  int64_t numel() const;
  int64_t stride(int64_t d) const;  // elements
  size_t bytes() const;
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
};

// An operand with `batch_dims` leading dimensions added by jax.vmap (kvkernels/jax/_primitives.py):
// each is either the batch's size or 1 (broadcast: the same data for every example).
struct Operand {
  const char* name = "";
  bool present = false;
  ffi::DataType type = ffi::DataType::INVALID;
  std::vector<int64_t> batch;  // leading dims
  std::vector<int64_t> shape;  // the example's dims
  char* base = nullptr;
  int64_t example_bytes = 0;

  Operand() = default;
  Operand(const char* name, const ffi::AnyBuffer& b, int64_t batch_dims);
  Operand(const char* name, const ffi::Result<ffi::AnyBuffer>& b, int64_t batch_dims);
  static Operand absent(const char* name) {
    Operand o;
    o.name = name;
    return o;
  }
  // The example at batch index `idx` (one entry per batch dim, within the batch shape).
  In at(const std::vector<int64_t>& idx) const;
};

// The optional inputs of paged_attention (after seq_lens, optional_mask bits 0..4) and of the other
// ops that take fp8 scales (bits 0, 1), in the order kvkernels/jax/ops.py passes them.
enum OptionalInput { kQsl, kAlibi, kSinks, kKScale, kVScale, kNumOptional };
inline const char* const kOptionalNames[kNumOptional] = {"query_start_loc", "alibi_slopes", "sinks",
                                                         "k_scale", "v_scale"};
inline const char* const kScaleNames[2] = {"k_scale", "v_scale"};

// The batch of a call: the shape of the leading dims (each operand's dim is this or 1) and a walk over
// its examples.
struct Batch {
  std::vector<int64_t> shape;
  int64_t count = 1;
  std::vector<int64_t> index(int64_t flat) const;
};

class Check : public ArgError {
 public:
  using ArgError::ArgError;
  void dim(const In& t, int64_t ndim) const;
  void type(const In& t, ffi::DataType expected) const;
  void size(const In& t, int64_t d, int64_t expected, const char* what) const;
  int to_int(int64_t v, const char* arg, const char* what) const;
  // A float32 scale of 1 or `per_head` elements; returns whether it is per head.
  bool scale(const In& t, const char* cache_arg, int64_t per_head) const;
  // The batch shape of `ops` (those present): each leading dim the same or 1 everywhere.
  Batch batch(std::initializer_list<const Operand*> ops, int64_t batch_dims) const;
};

// The optional inputs of a call, passed after the required ones: bit i of `mask` says whether
// optional input i (named names[i]) is among them, in order. Fills out[0..n): absent ones too.
void read_optional(const Check& c, const ffi::RemainingArgs& rest, int64_t mask,
                   const char* const* names, int n, int64_t batch_dims, Operand* out);

// ---- per-op parameter filling (shapes only; pointers as given, host or device) ------------------

struct AttentionAttrs {
  float scale = 0;       // resolved by the Python wrapper (head_dim ** -0.5 when not given)
  float soft_cap = 0;
  int64_t window_left = -1;
  bool causal = true;
};

// paged_kv_t of a (key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale) set; checks
// shapes and dtypes. max_head_dim: 512 on the CPU, 256 on CUDA.
paged_kv_t paged_kv(const Check& c, const In& key_cache, const In& value_cache,
                    const In& block_tables, const In& seq_lens, const In& k_scale,
                    const In& v_scale);

// Everything of paged_attention but the output pointers.
AttentionParams attention_params(const Check& c, const In& query, const In& key_cache,
                                 const In& value_cache, const In& block_tables, const In& seq_lens,
                                 const In& query_start_loc, const In& alibi_slopes,
                                 const In& sinks, const In& k_scale, const In& v_scale,
                                 const AttentionAttrs& attrs, int64_t max_head_dim);

// reshape_and_cache: the two writes (key -> key_cache, value -> value_cache), slot_mapping left
// unset (the handler widens an int32 mapping first).
void cache_write_params(const Check& c, const In& key, const In& value, const In& key_cache,
                        const In& value_cache, const In& slot_mapping, const In& k_scale,
                        const In& v_scale, CacheWriteParams (&writes)[2]);

// copy_blocks over `cache` (src == dst), mapping left unset. Returns the number of blocks along
// block_dim.
int64_t block_copy_params(const Check& c, const In& cache, const In& block_mapping,
                          int64_t block_dim, BlockCopyParams& p);

// gather_kv: the paged half and the output format; num_tokens is the outputs' length.
GatherParams gather_params(const Check& c, const In& key_cache, const In& value_cache,
                           const In& block_tables, const In& seq_lens, const In& k_scale,
                           const In& v_scale, const In& key_out, const In& value_out);

// The handlers' error: an ffi::Error carrying the exception's message (InvalidArgument).
ffi::Error to_error(const std::exception& e);

}  // namespace kvkernels::jaxffi
