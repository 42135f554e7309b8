// PagedAttention in ONNX Runtime (docs/onnx.md): validation as csrc/prepare.cpp, then the shared
// scheduler (csrc/cpu/attention_run.h) on ORT's thread pool.
#include <cmath>

#include "../index_checks.h"
#include "op_common.h"
#include "ops.h"

namespace kvkernels::ort {
namespace {

// ---------------------------------------------------------------------------------------------
// PagedAttention(query, key_cache, value_cache, block_tables, seq_lens, [query_start_loc],
//                [alibi_slopes], [sinks], [k_scale], [v_scale]) -> (out, lse)
// attributes: scale (float, default head_dim^-0.5), window_left (int, -1), soft_cap (float, 0),
//             causal (int, 1; 0: every query of a sequence sees all of its keys)
struct AttentionKernel {
  std::optional<float> scale;
  int64_t window_left = -1;
  float soft_cap = 0;
  int64_t causal = 1;

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
    c.expect(causal == 0 || causal == 1, "causal", "must be 0 or 1, got ", causal);
    p.causal = causal == 1;
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
    k->causal = attribute<int64_t>(info, "causal").value_or(1);
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

}  // namespace

OrtCustomOp* attention_op() {
  static AttentionOp op;
  return &op;
}

}  // namespace kvkernels::ort
