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
#include "../dense_args.h"
#include "kvkernels/params.h"
#include "xla/ffi/api/ffi.h"

namespace kvkernels::jaxffi {

namespace ffi = xla::ffi;

constexpr int64_t kMaxHeadDimCpu = kDenseMaxHeadDimCpu;
constexpr int64_t kMaxHeadDimCuda = kDenseMaxHeadDimCuda;
constexpr int64_t kMaxBlockSize = kDenseMaxBlockSize;

const char* type_name(ffi::DataType t);
bool is_float(ffi::DataType t);  // float32 / float16 / bfloat16
bool is_fp8(ffi::DataType t);    // float8_e4m3fn / float8_e5m2
bool is_index(ffi::DataType t);  // int32 / int64 (slot_mapping, block_mapping)
FloatFormat float_format(ffi::DataType t);
CacheFormat cache_format(ffi::DataType t);
std::string shape_str(const std::vector<int64_t>& shape);

// XLA element types for the checks shared with the ONNX Runtime binding (dense_args.h).
struct XlaTypes {
  using Type = ffi::DataType;
  static const char* name(Type t) { return type_name(t); }
  static std::string shape(const std::vector<int64_t>& s) { return shape_str(s); }
  static bool is_float(Type t) { return jaxffi::is_float(t); }
  static bool is_fp8(Type t) { return jaxffi::is_fp8(t); }
  static CacheFormat cache_format(Type t) { return jaxffi::cache_format(t); }
  static constexpr Type kFloat32 = ffi::DataType::F32;
  static constexpr Type kInt32 = ffi::DataType::S32;
  static constexpr const char* kCacheTypes = "float32, float16, bfloat16, float8_e4m3fn or float8_e5m2";
  static constexpr const char* kDtype = "dtype";
  static constexpr const char* kDecode = "query_start_loc=None";
  static FloatFormat float_format(Type t) { return jaxffi::float_format(t); }
};

// One operand of one example (one vmapped call). Dense, row-major.
using In = DenseIn<ffi::DataType>;
inline size_t bytes(const In& t) { return static_cast<size_t>(t.numel()) * ffi::ByteWidth(t.type); }

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

// The shared checks, plus the batch of a vmapped call.
class Check : public DenseCheck<XlaTypes> {
 public:
  explicit Check(const char* op) : DenseCheck<XlaTypes>(op) {}
  // The batch shape of `ops` (those present): each leading dim the same or 1 everywhere.
  Batch batch(std::initializer_list<const Operand*> ops, int64_t batch_dims) const;
};

// The optional inputs of a call, passed after the required ones: bit i of `mask` says whether
// optional input i (named names[i]) is among them, in order. Fills out[0..n): absent ones too.
void read_optional(const Check& c, const ffi::RemainingArgs& rest, int64_t mask,
                   const char* const* names, int n, int64_t batch_dims, Operand* out);

// ---- per-op parameter filling (shapes only; pointers as given, host or device) ------------------

// paged_attention's options (dense_args.h); the Python wrapper always resolves `scale`.
using AttentionAttrs = DenseAttentionAttrs;

// paged_kv_t of a (key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale) set; checks
// shapes and dtypes. max_head_dim: 512 on the CPU, 256 on CUDA.
paged_kv_t paged_kv(const Check& c, const In& key_cache, const In& value_cache,
                    const In& block_tables, const In& seq_lens, const In& k_scale,
                    const In& v_scale);

// The operands of one paged_attention call (its FFI arguments split into examples by the batch dims).
struct AttentionCall {
  Operand q, kc, vc, bt, sl, out, lse, opt[kNumOptional];
  Batch batch;
  AttentionCall(const Check& c, const ffi::AnyBuffer& query, const ffi::AnyBuffer& key_cache,
                const ffi::AnyBuffer& value_cache, const ffi::AnyBuffer& block_tables,
                const ffi::AnyBuffer& seq_lens, const ffi::RemainingArgs& optional,
                const ffi::Result<ffi::AnyBuffer>& out, const ffi::Result<ffi::AnyBuffer>& lse,
                int64_t optional_mask, int64_t batch_dims);
};

// The params of example `idx` of `call`, out and lse included and checked (shapes and dtypes only: the
// index values are the CPU handler's to check).
AttentionParams attention_example(const Check& c, const AttentionCall& call, const std::vector<int64_t>& idx,
                                  const AttentionAttrs& attrs, int64_t max_head_dim);

// A cache an op updates: its output holds one example per batch entry (never broadcast) ...
void check_updated_cache_batch(const Check& c, const Operand& out, const Batch& batch);
// ... and each example has the input cache's dtype and shape.
void check_updated_cache(const Check& c, const In& out, const In& in);

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
