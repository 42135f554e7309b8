// The cache ops in ONNX Runtime (docs/onnx.md): ReshapeAndCache and CopyBlocks (in place, through
// their alias maps) and GatherKV, on the row kernels of the active ISA (csrc/cpu/rows.h).
#include <algorithm>
#include <vector>

#include "../cpu/block_copy.h"
#include "../cpu/rows.h"
#include "../index_checks.h"
#include "op_common.h"
#include "ops.h"

namespace kvkernels::ort {
namespace {

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

OrtCustomOp* write_op() {
  static WriteOp op;
  return &op;
}

OrtCustomOp* copy_op() {
  static CopyOp op;
  return &op;
}

OrtCustomOp* gather_op() {
  static GatherOp op;
  return &op;
}

}  // namespace kvkernels::ort
