// PagedAttention in ONNX Runtime (docs/onnx.md): validation as csrc/prepare.cpp, then the shared
// scheduler (csrc/cpu/attention_run.h) on ORT's thread pool.
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
    c.expect(causal == 0 || causal == 1, "causal", "must be 0 or 1, got ", causal);
    AttentionParams p = dense_attention_params(c, query, key_cache, value_cache, block_tables, seq_lens, qsl, alibi,
                                               sinks, k_scale, v_scale, {scale, soft_cap, window_left, causal == 1},
                                               kMaxHeadDim, /*same_head_dims=*/true);
    check_paged_kv_indices(c, p.kv);
    const int d = p.kv.head_dim;
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
