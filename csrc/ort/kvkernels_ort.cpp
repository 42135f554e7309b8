// libkvkernels_ort.so: the kvkernels CPU kernels as ONNX Runtime custom ops, domain "kvkernels",
// version 1 (docs/onnx.md is the op reference). Built by scripts/build_ort.sh from the same
// kernel sources as the torch extension; it links neither libtorch nor libonnxruntime (ORT hands
// its API table to RegisterCustomOps). Loaded with
// SessionOptions.register_custom_ops_library(path).
//
// Ops that update a cache (ReshapeAndCache, CopyBlocks) return it as an output that ORT aliases to
// the cache input (OrtCustomOp::GetAliasMap, the mechanism of ORT's own Reshape / Identity): the
// output *is* the input's buffer, so a step writes a few rows instead of copying the cache. A
// graph keeps a cache persistent by taking it as an input bound to a long-lived OrtValue (IOBinding
// or a numpy-backed OrtValue), feeding the updated output to the ops that read it, and never
// giving the cache input a second consumer (the alias makes the old contents unreadable).
#include <cmath>
#include <cstring>
#include <exception>
#include <vector>

#include "../cpu/block_copy.h"
#include "../cpu/rows.h"
#include "../index_checks.h"
#include "ort_host.h"

namespace kvkernels::ort {
namespace {

constexpr int kMaxHeadDim = 256;  // as csrc/prepare.cpp
constexpr const char* kDomain = "kvkernels";
constexpr auto kAny = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
constexpr auto kI32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr auto kI64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
constexpr auto kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;

template <typename T>
std::optional<T> attribute(const OrtKernelInfo* info, const char* name);
template <>
std::optional<float> attribute<float>(const OrtKernelInfo* info, const char* name) {
  float v = 0;
  OrtStatus* s = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &v);
  if (s != nullptr) return Ort::GetApi().ReleaseStatus(s), std::nullopt;
  return v;
}
template <>
std::optional<int64_t> attribute<int64_t>(const OrtKernelInfo* info, const char* name) {
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

// ---------------------------------------------------------------------------------------------
// PagedAttention(query, key_cache, value_cache, block_tables, seq_lens, [query_start_loc],
//                [alibi_slopes], [sinks], [k_scale], [v_scale]) -> (out, lse)
// attributes: scale (float, default head_dim^-0.5), window_left (int, -1), soft_cap (float, 0)
struct AttentionKernel {
  std::optional<float> scale;
  int64_t window_left = -1;
  float soft_cap = 0;

  OrtStatus* ComputeV2(OrtKernelContext* raw) try {
    Ort::KernelContext ctx(raw);
    const Check c("PagedAttention");
    const In query = input(ctx, 0, "query"), key_cache = input(ctx, 1, "key_cache"),
             value_cache = input(ctx, 2, "value_cache"), block_tables = input(ctx, 3, "block_tables"),
             seq_lens = input(ctx, 4, "seq_lens"), qsl = input(ctx, 5, "query_start_loc"),
             alibi = input(ctx, 6, "alibi_slopes"), sinks = input(ctx, 7, "sinks"),
             k_scale = input(ctx, 8, "k_scale"), v_scale = input(ctx, 9, "v_scale");
    AttentionParams p;
    p.kv = paged_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale);
    const int d = p.kv.head_dim;
    c.expect(d % 8 == 0 && d > 0 && d <= kMaxHeadDim, "key_cache",
             "head_dim must be a positive multiple of 8 up to ", kMaxHeadDim, ", got ", d);
    c.dim(query, 3);
    c.expect(is_float(query.type), "query", "expected float32, float16 or bfloat16, got ",
             type_name(query.type));
    c.expect(is_fp8(key_cache.type) || key_cache.type == query.type, "key_cache",
             "must have the query's type (", type_name(query.type), ") or be fp8, got ",
             type_name(key_cache.type));
    c.size(query, 2, d, "head_dim of key_cache");
    c.expect(p.kv.num_kv_heads > 0, "key_cache", "num_kv_heads (dimension 2) must be positive");
    c.expect(query.size(1) > 0 && query.size(1) % p.kv.num_kv_heads == 0, "query", "num_heads (",
             query.size(1), ") must be a positive multiple of num_kv_heads (", p.kv.num_kv_heads,
             ")");
    p.num_heads = c.to_int(query.size(1), "query", "num_heads (dimension 1)");
    p.q = query.data;
    p.q_stride_token = query.stride(0);
    p.q_stride_head = query.stride(1);
    p.q_format = float_format(query.type);
    p.num_tokens = query.size(0);
    if (qsl) {
      c.dim(qsl, 1);
      c.type(qsl, kI32);
      c.size(qsl, 0, p.kv.num_seqs + 1, "num_seqs + 1");
      p.query_start_loc = qsl.as<int32_t>();
    } else {
      c.expect(p.num_tokens == p.kv.num_seqs, "query", "decode (no query_start_loc) needs one ",
               "query per sequence: got ", p.num_tokens, " queries for ", p.kv.num_seqs,
               " sequences");
    }
    c.expect(!scale || std::isfinite(*scale), "scale", "must be finite");
    c.expect(soft_cap >= 0 && std::isfinite(soft_cap), "soft_cap", "must be >= 0 (0 = off), got ",
             soft_cap);
    c.expect(window_left < (int64_t{1} << 31), "window_left", "too large: ", window_left);
    p.scale = scale.value_or(static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
    p.soft_cap = soft_cap;
    p.window_left = window_left < 0 ? -1 : static_cast<int>(window_left);
    for (const In* v : {&alibi, &sinks}) {
      if (!*v) continue;
      c.dim(*v, 1);
      c.type(*v, kF32);
      c.size(*v, 0, p.num_heads, "num_heads of query");
    }
    p.alibi_slopes = alibi.as<float>();
    p.sinks = sinks.as<float>();
    check_query_start_loc(c, p);

    Ort::UnownedValue out = ctx.GetOutput(0, {p.num_tokens, p.num_heads, d});
    Ort::UnownedValue lse = ctx.GetOutput(1, {p.num_tokens, p.num_heads});
    p.out = out.GetTensorMutableRawData();
    p.lse = lse.GetTensorMutableData<float>();
    if (p.num_tokens > 0) cpu::run_attention_on(p, OrtHost{raw});
    return nullptr;
  } catch (const std::exception& e) {
    return to_status(e);
  }
};

struct AttentionOp : Ort::CustomOpBase<AttentionOp, AttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    auto* k = new AttentionKernel;
    k->scale = attribute<float>(info, "scale");
    k->window_left = attribute<int64_t>(info, "window_left").value_or(-1);
    k->soft_cap = attribute<float>(info, "soft_cap").value_or(0.0f);
    *kernel = k;
    return nullptr;
  }
  const char* GetName() const { return "PagedAttention"; }
  size_t GetInputTypeCount() const { return 10; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    static constexpr ONNXTensorElementDataType types[] = {kAny, kAny, kAny, kI32, kI32,
                                                          kI32, kF32, kF32, kF32, kF32};
    return types[i];
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 5 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return i == 0 ? kAny : kF32; }
  AttentionOp() { install_inference(this); }
  static void infer(OrtShapeInferContext* ctx) {
    ShapeOf out = input_shape(ctx, 0), lse = out;
    lse.type = kF32;
    lse.dims.pop_back();
    lse.syms.pop_back();
    set_output(ctx, 0, out);
    set_output(ctx, 1, lse);
  }
};

// ---------------------------------------------------------------------------------------------
// ReshapeAndCache(key, value, key_cache, value_cache, slot_mapping, [k_scale], [v_scale])
//   -> (key_cache_out, value_cache_out), aliases of key_cache and value_cache.
struct WriteKernel {
  OrtStatus* ComputeV2(OrtKernelContext* raw) try {
    Ort::KernelContext ctx(raw);
    const Check c("ReshapeAndCache");
    const In key = input(ctx, 0, "key"), value = input(ctx, 1, "value"),
             key_cache = input(ctx, 2, "key_cache"), value_cache = input(ctx, 3, "value_cache"),
             slots = input(ctx, 4, "slot_mapping"), k_scale = input(ctx, 5, "k_scale"),
             v_scale = input(ctx, 6, "v_scale");
    c.dim(key, 3);
    c.expect(is_float(key.type), "key", "expected float32, float16 or bfloat16, got ",
             type_name(key.type));
    c.dim(value, 3);
    c.type(value, key.type);
    for (int64_t d = 0; d < 3; ++d) c.size(value, d, key.size(d), "key's shape");
    const In* caches[] = {&key_cache, &value_cache};
    for (const In* cache : caches) {
      c.dim(*cache, 4);
      c.expect(cache->type == key.type || is_fp8(cache->type), cache->name,
               "must have key's type (", type_name(key.type), ") or be fp8, got ",
               type_name(cache->type));
      c.expect(cache->size(1) >= 1 && cache->size(1) <= 256, cache->name,
               "block size (dimension 1) must be in [1, 256], got ", cache->size(1));
      c.size(*cache, 2, key.size(1), "num_heads of key");
      c.size(*cache, 3, key.size(2), "head_dim of key");
    }
    c.type(value_cache, key_cache.type);
    for (int64_t d = 0; d < 2; ++d) c.size(value_cache, d, key_cache.size(d), "key_cache's shape");
    c.dim(slots, 1);
    c.type(slots, kI64);
    c.size(slots, 0, key.size(0), "num_tokens of key");
    const int num_heads = c.to_int(key.size(1), "key", "num_heads (dimension 1)");
    const int width = c.to_int(key.size(2), "key", "head_dim (dimension 2)");
    bool per_head[2] = {false, false};
    if (is_fp8(key_cache.type)) {
      per_head[0] = c.scale(k_scale, "key_cache", num_heads);
      per_head[1] = c.scale(v_scale, "value_cache", num_heads);
    }
    // Inputs bound to the caches' memory would be read while they are written.
    for (const In* t : {&key, &value, &slots, &k_scale, &v_scale, &value_cache})
      c.disjoint(*t, key_cache);
    for (const In* t : {&key, &value, &slots, &k_scale, &v_scale}) c.disjoint(*t, value_cache);
    const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
    check_slots(c, slots.as<int64_t>(), key.size(0), num_slots);
    const cpu::RowKernels& kernels = cpu::row_kernels();  // throws on a bad KVKERNELS_CPU_ISA

    void* dst[2] = {inplace_output(ctx, 0, key_cache), inplace_output(ctx, 1, value_cache)};
    const In* src[2] = {&key, &value};
    const In* scales[2] = {&k_scale, &v_scale};
    if (num_heads == 0 || width == 0) return nullptr;
    for (int i = 0; i < 2; ++i) {
      CacheWriteParams w;
      w.src = src[i]->data;
      w.src_stride_token = src[i]->stride(0);
      w.src_stride_head = src[i]->stride(1);
      w.src_format = float_format(key.type);
      w.cache = dst[i];
      w.cache_stride_block = key_cache.stride(0);
      w.cache_stride_slot = key_cache.stride(1);
      w.cache_stride_head = key_cache.stride(2);
      w.cache_format = cache_format(key_cache.type);
      if (is_fp8(key_cache.type)) w.scale = scales[i]->as<float>(), w.scale_per_head = per_head[i];
      w.slot_mapping = slots.as<int64_t>();
      w.num_tokens = key.size(0);
      w.block_size = static_cast<int>(key_cache.size(1));
      w.num_heads = num_heads;
      w.width = width;
      OrtHost{raw}.parallel_for(ceil_div(w.num_tokens, 16), [&](int64_t b, int64_t e) {
        kernels.write_tokens(w, b * 16, std::min(e * 16, w.num_tokens));
      });
    }
    return nullptr;
  } catch (const std::exception& e) {
    return to_status(e);
  }
};

struct WriteOp : Ort::CustomOpBase<WriteOp, WriteKernel, true> {
  WriteOp() {
    install_inference(this);
    Aliases<2, 0, 3, 1>::install(this);
  }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo*, void** kernel) const {
    *kernel = new WriteKernel;
    return nullptr;
  }
  const char* GetName() const { return "ReshapeAndCache"; }
  size_t GetInputTypeCount() const { return 7; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    static constexpr ONNXTensorElementDataType types[] = {kAny, kAny, kAny, kAny, kI64, kF32, kF32};
    return types[i];
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 5 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return kAny; }
  static void infer(OrtShapeInferContext* ctx) {
    set_output(ctx, 0, input_shape(ctx, 2));
    set_output(ctx, 1, input_shape(ctx, 3));
  }
};

// ---------------------------------------------------------------------------------------------
// CopyBlocks(cache, block_mapping) -> cache_out (alias of cache); attribute block_dim (int, 0).
struct CopyKernel {
  int64_t block_dim = 0;

  OrtStatus* ComputeV2(OrtKernelContext* raw) try {
    Ort::KernelContext ctx(raw);
    const Check c("CopyBlocks");
    const In cache = input(ctx, 0, "cache"), mapping = input(ctx, 1, "block_mapping");
    c.required(cache);
    c.expect(cache.dim() >= 1 && cache.dim() <= 8, "cache", "needs 1 to 8 dims, got shape ",
             shape_str(cache.shape));
    const int64_t bd = block_dim < 0 ? block_dim + cache.dim() : block_dim;
    c.expect(bd >= 0 && bd < cache.dim(), "block_dim", block_dim, " is out of range for a cache ",
             "of ", cache.dim(), " dims");
    c.dim(mapping, 2);
    c.type(mapping, kI64);
    c.size(mapping, 1, 2, "(source, destination) pairs");
    c.disjoint(mapping, cache);
    const int64_t num_blocks = cache.size(bd);
    check_block_mapping(c, mapping.as<int64_t>(), mapping.size(0), num_blocks, num_blocks, true);

    char* dst = static_cast<char*>(inplace_output(ctx, 0, cache));
    if (cache.numel() == 0 || mapping.size(0) == 0) return nullptr;
    // The block sub-tensor cache.select(bd, i) as outer dims x a contiguous innermost run.
    const int64_t elem = static_cast<int64_t>(element_size(cache.type));
    BlockCopyParams p;
    p.src = dst;
    p.dst = dst;
    p.mapping = mapping.as<int64_t>();
    p.num_pairs = mapping.size(0);
    p.src_block_stride = p.dst_block_stride = cache.stride(bd) * elem;
    int64_t run = elem;  // the dims after bd are contiguous: one run
    for (int64_t d = bd + 1; d < cache.dim(); ++d) run *= cache.size(d);
    p.run_bytes = run;
    for (int64_t d = 0; d < bd; ++d) {
      p.sizes[p.num_dims] = cache.size(d);
      p.src_strides[p.num_dims] = p.dst_strides[p.num_dims] = cache.stride(d) * elem;
      ++p.num_dims;
    }
    OrtHost{raw}.parallel_for(p.num_pairs, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        cpu::copy_block(p, p.src + p.mapping[2 * i] * p.src_block_stride, p.src_strides,
                        dst + p.mapping[2 * i + 1] * p.dst_block_stride, p.dst_strides);
    });
    return nullptr;
  } catch (const std::exception& e) {
    return to_status(e);
  }
};

struct CopyOp : Ort::CustomOpBase<CopyOp, CopyKernel, true> {
  CopyOp() {
    install_inference(this);
    Aliases<0, 0>::install(this);
  }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    auto* k = new CopyKernel;
    k->block_dim = attribute<int64_t>(info, "block_dim").value_or(0);
    *kernel = k;
    return nullptr;
  }
  const char* GetName() const { return "CopyBlocks"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t i) const { return i == 0 ? kAny : kI64; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return kAny; }
  static void infer(OrtShapeInferContext* ctx) { set_output(ctx, 0, input_shape(ctx, 0)); }
};

// ---------------------------------------------------------------------------------------------
// GatherKV(key_cache, value_cache, block_tables, seq_lens, [k_scale], [v_scale]) -> (key, value)
// [sum(seq_lens), H, D]; attribute out_dtype (an ONNX element type: float, float16 or bfloat16;
// default: the cache's type, bfloat16 for fp8 caches, as kvkernels.gather_kv).
ONNXTensorElementDataType gather_type(ONNXTensorElementDataType cache, int64_t out_dtype) {
  if (out_dtype != 0) return static_cast<ONNXTensorElementDataType>(out_dtype);
  return is_fp8(cache) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 : cache;
}

struct GatherKernel {
  int64_t out_dtype = 0;  // 0: default
  OrtStatus* ComputeV2(OrtKernelContext* raw) try {
    Ort::KernelContext ctx(raw);
    const Check c("GatherKV");
    const In key_cache = input(ctx, 0, "key_cache"), value_cache = input(ctx, 1, "value_cache"),
             block_tables = input(ctx, 2, "block_tables"), seq_lens = input(ctx, 3, "seq_lens"),
             k_scale = input(ctx, 4, "k_scale"), v_scale = input(ctx, 5, "v_scale");
    GatherParams p;
    p.kv = paged_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale);
    const ONNXTensorElementDataType out_type = gather_type(key_cache.type, out_dtype);
    c.expect(is_float(out_type), "out_dtype", "must be float32, float16 or bfloat16, got ",
             type_name(out_type));
    const std::vector<int64_t> starts = token_starts(p.kv);
    const cpu::RowKernels& kernels = cpu::row_kernels();
    p.num_tokens = starts.back();
    p.token_start = starts.data();
    p.out_format = float_format(out_type);
    const std::vector<int64_t> shape = {p.num_tokens, p.kv.num_kv_heads, p.kv.head_dim};
    p.key = ctx.GetOutput(0, shape).GetTensorMutableRawData();
    p.value = ctx.GetOutput(1, shape).GetTensorMutableRawData();
    if (p.num_tokens == 0 || p.kv.num_kv_heads == 0 || p.kv.head_dim == 0) return nullptr;
    std::vector<cpu::GatherItem> items;
    for (int64_t s = 0; s < p.kv.num_seqs; ++s)
      for (int64_t b = 0; b < ceil_div(p.kv.seq_lens[s], p.kv.block_size); ++b)
        items.push_back({s, b});
    OrtHost{raw}.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t b, int64_t e) {
      kernels.gather(p, items.data(), b, e);
    });
    return nullptr;
  } catch (const std::exception& e) {
    return to_status(e);
  }
};

struct GatherOp : Ort::CustomOpBase<GatherOp, GatherKernel, true> {
  GatherOp() { install_inference(this); }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    auto* k = new GatherKernel;
    k->out_dtype = attribute<int64_t>(info, "out_dtype").value_or(0);
    *kernel = k;
    return nullptr;
  }
  const char* GetName() const { return "GatherKV"; }
  size_t GetInputTypeCount() const { return 6; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    static constexpr ONNXTensorElementDataType types[] = {kAny, kAny, kI32, kI32, kF32, kF32};
    return types[i];
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 4 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return kAny; }
  static void infer(OrtShapeInferContext* ctx) {
    ShapeOf s = input_shape(ctx, 0);
    int64_t out_dtype = 0;
    const OrtOpAttr* attr = nullptr;
    const OrtApi& api = Ort::GetApi();
    if (OrtStatus* st = api.ShapeInferContext_GetAttribute(ctx, "out_dtype", &attr)) {
      api.ReleaseStatus(st);
    } else if (attr != nullptr) {
      size_t len = 0;
      Ort::ThrowOnError(api.ReadOpAttr(attr, ORT_OP_ATTR_INT, &out_dtype, sizeof(out_dtype), &len));
    }
    s.type = gather_type(s.type, out_dtype);
    s.dims.erase(s.dims.begin());  // [N, B, H, D] -> [num_tokens, H, D]
    s.syms.erase(s.syms.begin());
    s.dims[0] = -1;
    s.syms[0] = "";
    set_output(ctx, 0, s);
    set_output(ctx, 1, s);
  }
};

}  // namespace
}  // namespace kvkernels::ort

// The entry point ORT calls (SessionOptions.register_custom_ops_library): the ops live as long as
// the process (ORT keeps pointers to them), the domain too.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {  // an ORT older than the headers (API 21): report it through API 1
    const OrtApi* v1 = api_base->GetApi(1);
    return v1 == nullptr ? nullptr
                         : v1->CreateStatus(ORT_FAIL, "libkvkernels_ort.so needs ONNX Runtime 1.21 or "
                                                      "newer (ORT API 21)");
  }
  Ort::InitApi(api);
  static kvkernels::ort::AttentionOp attention;
  static kvkernels::ort::WriteOp write;
  static kvkernels::ort::CopyOp copy;
  static kvkernels::ort::GatherOp gather;
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* s = api->CreateCustomOpDomain(kvkernels::ort::kDomain, &domain)) return s;
  for (OrtCustomOp* op : std::initializer_list<OrtCustomOp*>{&attention, &write, &copy, &gather})
    if (OrtStatus* s = api->CustomOpDomain_Add(domain, op)) return s;
  return api->AddCustomOpDomain(options, domain);
}
