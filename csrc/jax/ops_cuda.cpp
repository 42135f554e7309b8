// The CUDA XLA FFI handlers of kvkernels.jax: paged_attention, reshape_and_cache, copy_blocks and
// gather_kv on the CUDA kernels of csrc/cuda/ (torch-free launchers: attention_api.cuh, cache_ops.h),
// enqueued on XLA's stream (ffi::PlatformStream). Nothing here synchronizes, allocates or reads
// device memory on the host: every scratch buffer (the attention's split partials, the int32 -> int64
// copy of an index array, gather_kv's token offsets) is the call's last result, a byte buffer that
// kvkernels/jax/_primitives.py adds in the CUDA lowering and sizes from shapes, so it comes from
// XLA's buffer assignment. The handlers are therefore declared command-buffer compatible: XLA may
// capture them into CUDA graphs.
//
// As in the torch CUDA binding without KVKERNELS_DEBUG, index values (block ids, lengths, slots,
// mappings) are not checked on the host (that needs a device-to-host copy): the kernels skip
// out-of-range ids instead of reading or writing outside an array. Shapes and dtypes are checked
// (jax_args.cpp) and a bad one fails the call with the argument's name.
//
// Compiled, not run: the project's CI machines have no GPU (scripts/gpu_validate.sh runs
// tests/test_jax_cuda.py on the GPU machine).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cuda/attention_api.cuh"
#include "../cuda/cache_ops.h"
#include "jax_args.h"
#include "widen.h"

namespace kvkernels::jaxffi {
namespace {

void check_cuda(const Check& c, cudaError_t err, const char* what) {
  c.expect(err == cudaSuccess, "CUDA", what, ": ", cudaGetErrorString(err));
}

void check_status(const Check& c, const cuda::Status& s, const char* what) {
  if (s.message != nullptr) c.fail("CUDA", what, ": ", s.message);
  check_cuda(c, s.error, what);
}

// The device the stream belongs to (XLA makes it current for the call as well).
int stream_device(const Check& c, cudaStream_t stream) {
  int device = 0;
#if CUDART_VERSION >= 12080
  if (cudaStreamGetDevice(stream, &device) == cudaSuccess) return device;
  (void)cudaGetLastError();
#endif
  check_cuda(c, cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

// The scratch result: its bytes and pointer.
struct Scratch {
  char* data;
  int64_t bytes;
  explicit Scratch(ffi::Result<ffi::AnyBuffer>& r)
      : data(static_cast<char*>(r->untyped_data())), bytes(static_cast<int64_t>(r->size_bytes())) {}
};

// The updated cache is the input cache (XLA aliases them); otherwise it starts as a copy of it.
void alias_or_copy(const Check& c, const In& in, const In& out, cudaStream_t stream) {
  if (out.data == in.data || bytes(in) == 0) return;
  check_cuda(c, cudaMemcpyAsync(out.data, in.data, bytes(in), cudaMemcpyDeviceToDevice, stream),
             "copying the cache into its result");
}

// An int32 or int64 index operand as int64 on the device (widened into `scratch` when int32).
const int64_t* as_int64(const Check& c, const In& t, const Scratch& scratch, cudaStream_t stream) {
  if (t.type == ffi::DataType::S64) return t.as<const int64_t>();
  const int64_t n = t.numel();
  c.expect(scratch.bytes >= 8 * n, t.name, "the call's scratch (", scratch.bytes,
           " bytes) is too small to widen ", n, " int32 indices");
  int64_t* dst = reinterpret_cast<int64_t*>(scratch.data);
  check_cuda(c, widen_int32(t.as<const int32_t>(), dst, n, stream), "int32 -> int64 kernel launch");
  return dst;
}

// ---- paged_attention --------------------------------------------------------------------------

ffi::Error paged_attention_cuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                                ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                                ffi::AnyBuffer seq_lens, ffi::RemainingArgs optional,
                                ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                                ffi::Result<ffi::AnyBuffer> scratch_buf, float scale,
                                float soft_cap, int64_t window_left, bool causal,
                                int64_t optional_mask, int64_t batch_dims) try {
  const Check c("paged_attention");
  const AttentionCall call(c, query, key_cache, value_cache, block_tables, seq_lens, optional, out, lse,
                           optional_mask, batch_dims);
  const Scratch scratch(scratch_buf);
  const AttentionAttrs attrs{scale, soft_cap, window_left, causal};
  const int device = stream_device(c, stream);
  std::vector<AttentionParams> params;
  std::vector<attn_cuda::LaunchPlan> plans;
  for (int64_t b = 0; b < call.batch.count; ++b) {
    AttentionParams p = attention_example(c, call, call.batch.index(b), attrs, kMaxHeadDimCuda);
    attn_cuda::LaunchPlan plan;
    if (p.num_tokens > 0 && p.kv.num_seqs > 0) {
      plan = attn_cuda::plan_paged_attention(p, device);
      // The scratch was sized at lowering time for device 0; a device (or KVKERNELS_CUDA_ATTN_SPLITS)
      // that asks for more splits than fit gets as many as fit (the split count is a heuristic).
      const int64_t rows = p.num_tokens * p.num_heads;
      auto floats_for = [&](int64_t s) {
        return (s * rows * p.kv.head_dim_v + 7) / 8 * 8 + (s * rows + 7) / 8 * 8;
      };
      const int64_t have = scratch.bytes / 4;
      while (plan.num_splits > 1 && floats_for(plan.num_splits) > have) --plan.num_splits;
      plan.grid_z = plan.num_splits;
      plan.workspace_floats = plan.num_splits > 1 ? floats_for(plan.num_splits) : 0;
    }
    params.push_back(p);
    plans.push_back(plan);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].num_tokens == 0 || params[i].kv.num_seqs == 0) continue;
    float* ws = plans[i].workspace_floats > 0 ? reinterpret_cast<float*>(scratch.data) : nullptr;
    attn_cuda::launch_paged_attention(params[i], plans[i], ws, stream);
  }
  return ffi::Error::Success();
} catch (const std::exception& e) {
  return to_error(e);
}

// ---- reshape_and_cache ------------------------------------------------------------------------

ffi::Error reshape_and_cache_cuda(cudaStream_t stream, ffi::AnyBuffer key, ffi::AnyBuffer value,
                                  ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                  ffi::AnyBuffer slot_mapping, ffi::RemainingArgs optional,
                                  ffi::Result<ffi::AnyBuffer> key_cache_out,
                                  ffi::Result<ffi::AnyBuffer> value_cache_out,
                                  ffi::Result<ffi::AnyBuffer> scratch_buf, int64_t optional_mask,
                                  int64_t batch_dims) try {
  const Check c("reshape_and_cache");
  const Operand k("key", key, batch_dims), v("value", value, batch_dims),
      kc("key_cache", key_cache, batch_dims), vc("value_cache", value_cache, batch_dims),
      sm("slot_mapping", slot_mapping, batch_dims), kco("key_cache", key_cache_out, batch_dims),
      vco("value_cache", value_cache_out, batch_dims);
  Operand scales[2];
  read_optional(c, optional, optional_mask, kScaleNames, 2, batch_dims, scales);
  const Batch batch =
      c.batch({&k, &v, &kc, &vc, &sm, &kco, &vco, &scales[0], &scales[1]}, batch_dims);
  for (const Operand* out : {&kco, &vco}) check_updated_cache_batch(c, *out, batch);
  const Scratch scratch(scratch_buf);
  struct Example {
    CacheWriteParams w[2];
    In caches[2], outs[2], slots;
  };
  std::vector<Example> examples(static_cast<size_t>(batch.count));
  for (int64_t b = 0; b < batch.count; ++b) {
    const std::vector<int64_t> idx = batch.index(b);
    Example& ex = examples[static_cast<size_t>(b)];
    ex.slots = sm.at(idx);
    ex.caches[0] = kc.at(idx);
    ex.caches[1] = vc.at(idx);
    ex.outs[0] = kco.at(idx);
    ex.outs[1] = vco.at(idx);
    cache_write_params(c, k.at(idx), v.at(idx), ex.caches[0], ex.caches[1], ex.slots,
                       scales[0].at(idx), scales[1].at(idx), ex.w);
    for (int i = 0; i < 2; ++i) check_updated_cache(c, ex.outs[i], ex.caches[i]);
  }
  // Examples run one after the other on the stream: one widened slot mapping at a time in scratch.
  for (Example& ex : examples) {
    for (int i = 0; i < 2; ++i) {
      alias_or_copy(c, ex.caches[i], ex.outs[i], stream);
      ex.w[i].cache = ex.outs[i].data;
    }
    if (ex.w[0].num_tokens == 0) continue;
    const int64_t* slots = as_int64(c, ex.slots, scratch, stream);
    ex.w[0].slot_mapping = ex.w[1].slot_mapping = slots;
    const int64_t num_slots = ex.caches[0].size(0) * ex.caches[0].size(1);
    check_status(c, cuda::cache_write(ex.w, 2, num_slots, stream), "cache write kernel");
  }
  return ffi::Error::Success();
} catch (const std::exception& e) {
  return to_error(e);
}

// ---- copy_blocks ------------------------------------------------------------------------------

ffi::Error copy_blocks_cuda(cudaStream_t stream, ffi::AnyBuffer cache, ffi::AnyBuffer block_mapping,
                            ffi::Result<ffi::AnyBuffer> cache_out,
                            ffi::Result<ffi::AnyBuffer> scratch_buf, int64_t block_dim,
                            int64_t batch_dims) try {
  const Check c("copy_blocks");
  const Operand ca("cache", cache, batch_dims), bm("block_mapping", block_mapping, batch_dims),
      co("cache", cache_out, batch_dims);
  const Batch batch = c.batch({&ca, &bm, &co}, batch_dims);
  check_updated_cache_batch(c, co, batch);
  const Scratch scratch(scratch_buf);
  struct Example {
    BlockCopyParams p;
    In in, out, mapping;
    int64_t blocks;
  };
  std::vector<Example> examples(static_cast<size_t>(batch.count));
  for (int64_t b = 0; b < batch.count; ++b) {
    const std::vector<int64_t> idx = batch.index(b);
    Example& ex = examples[static_cast<size_t>(b)];
    ex.in = ca.at(idx);
    ex.out = co.at(idx);
    ex.mapping = bm.at(idx);
    ex.blocks = block_copy_params(c, ex.in, ex.mapping, block_dim, ex.p);
    check_updated_cache(c, ex.out, ex.in);
  }
  for (Example& ex : examples) {
    alias_or_copy(c, ex.in, ex.out, stream);
    if (ex.out.numel() == 0 || ex.p.num_pairs == 0) continue;
    ex.p.src = static_cast<const char*>(ex.out.data);
    ex.p.dst = static_cast<char*>(ex.out.data);
    ex.p.mapping = as_int64(c, ex.mapping, scratch, stream);
    check_status(c, cuda::block_copy(ex.p, ex.blocks, ex.blocks, stream), "block copy kernel");
  }
  return ffi::Error::Success();
} catch (const std::exception& e) {
  return to_error(e);
}

// ---- gather_kv --------------------------------------------------------------------------------

ffi::Error gather_kv_cuda(cudaStream_t stream, ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                          ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                          ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> key,
                          ffi::Result<ffi::AnyBuffer> value, ffi::Result<ffi::AnyBuffer> scratch_buf,
                          int64_t optional_mask, int64_t batch_dims) try {
  const Check c("gather_kv");
  const Operand kc("key_cache", key_cache, batch_dims), vc("value_cache", value_cache, batch_dims),
      bt("block_tables", block_tables, batch_dims), sl("seq_lens", seq_lens, batch_dims),
      ko("key", key, batch_dims), vo("value", value, batch_dims);
  Operand scales[2];
  read_optional(c, optional, optional_mask, kScaleNames, 2, batch_dims, scales);
  const Batch batch = c.batch({&kc, &vc, &bt, &sl, &ko, &vo, &scales[0], &scales[1]}, batch_dims);
  const Scratch scratch(scratch_buf);
  std::vector<GatherParams> examples;
  for (int64_t b = 0; b < batch.count; ++b) {
    const std::vector<int64_t> idx = batch.index(b);
    GatherParams p = gather_params(c, kc.at(idx), vc.at(idx), bt.at(idx), sl.at(idx),
                                   scales[0].at(idx), scales[1].at(idx), ko.at(idx), vo.at(idx));
    c.expect(scratch.bytes >= 8 * (p.kv.num_seqs + 1), "seq_lens", "the call's scratch (",
             scratch.bytes, " bytes) is too small for ", p.kv.num_seqs + 1, " token offsets");
    examples.push_back(p);
  }
  // Tokens past sum(seq_lens) (a num_tokens larger than it) are written as zeros (gather.cuh).
  for (const GatherParams& p : examples)
    check_status(c, cuda::gather_kv(p, reinterpret_cast<int64_t*>(scratch.data), stream),
                 "gather kernel");
  return ffi::Error::Success();
} catch (const std::exception& e) {
  return to_error(e);
}

}  // namespace
}  // namespace kvkernels::jaxffi

namespace jf = kvkernels::jaxffi;
namespace xffi = xla::ffi;

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvkernels_jax_paged_attention_cuda, jf::paged_attention_cuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // query
                                  .Arg<xffi::AnyBuffer>()  // key_cache
                                  .Arg<xffi::AnyBuffer>()  // value_cache
                                  .Arg<xffi::AnyBuffer>()  // block_tables
                                  .Arg<xffi::AnyBuffer>()  // seq_lens
                                  .RemainingArgs()         // the optional inputs (optional_mask)
                                  .Ret<xffi::AnyBuffer>()  // out
                                  .Ret<xffi::AnyBuffer>()  // lse
                                  .Ret<xffi::AnyBuffer>()  // scratch (split partials)
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window_left")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("optional_mask")
                                  .Attr<int64_t>("batch_dims"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvkernels_jax_reshape_and_cache_cuda, jf::reshape_and_cache_cuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // key
                                  .Arg<xffi::AnyBuffer>()  // value
                                  .Arg<xffi::AnyBuffer>()  // key_cache
                                  .Arg<xffi::AnyBuffer>()  // value_cache
                                  .Arg<xffi::AnyBuffer>()  // slot_mapping
                                  .RemainingArgs()         // k_scale, v_scale (optional_mask)
                                  .Ret<xffi::AnyBuffer>()  // key_cache (aliased)
                                  .Ret<xffi::AnyBuffer>()  // value_cache (aliased)
                                  .Ret<xffi::AnyBuffer>()  // scratch (int64 slot mapping)
                                  .Attr<int64_t>("optional_mask")
                                  .Attr<int64_t>("batch_dims"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvkernels_jax_copy_blocks_cuda, jf::copy_blocks_cuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // cache
                                  .Arg<xffi::AnyBuffer>()  // block_mapping
                                  .Ret<xffi::AnyBuffer>()  // cache (aliased)
                                  .Ret<xffi::AnyBuffer>()  // scratch (int64 mapping)
                                  .Attr<int64_t>("block_dim")
                                  .Attr<int64_t>("batch_dims"),
                              {xffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvkernels_jax_gather_kv_cuda, jf::gather_kv_cuda,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xffi::AnyBuffer>()  // key_cache
                                  .Arg<xffi::AnyBuffer>()  // value_cache
                                  .Arg<xffi::AnyBuffer>()  // block_tables
                                  .Arg<xffi::AnyBuffer>()  // seq_lens
                                  .RemainingArgs()         // k_scale, v_scale (optional_mask)
                                  .Ret<xffi::AnyBuffer>()  // key
                                  .Ret<xffi::AnyBuffer>()  // value
                                  .Ret<xffi::AnyBuffer>()  // scratch (token offsets)
                                  .Attr<int64_t>("optional_mask")
                                  .Attr<int64_t>("batch_dims"),
                              {xffi::Traits::kCmdBufferCompatible});

// Bytes of scratch paged_attention needs for these shapes on the current CUDA device (the split
// partials of csrc/cuda/attention.cu's launch plan; 0 without splits), or -1 with the error in
// stderr (shapes the CUDA kernels refuse). Called by the CUDA lowering (kvkernels/jax/_primitives.py).
// q_format / cache_format: 0 float32, 1 float16, 2 bfloat16, 3 e4m3, 4 e5m2.
extern "C" int64_t kvkernels_jax_cuda_attention_workspace(
    int64_t num_tokens, int64_t num_heads, int64_t num_seqs, int64_t num_kv_heads, int64_t head_dim,
    int64_t head_dim_v, int64_t block_size, int64_t max_blocks_per_seq, int64_t q_format,
    int64_t cache_format, int64_t decode) {
  try {
    if (num_tokens == 0 || num_seqs == 0) return 0;
    kvkernels::AttentionParams p;
    static const int32_t kNotNull = 0;  // varlen: the planner only tests the pointer
    p.query_start_loc = decode ? nullptr : &kNotNull;
    p.num_tokens = num_tokens;
    p.num_heads = static_cast<int>(num_heads);
    p.q_format = static_cast<kvkernels::FloatFormat>(q_format);
    p.kv.num_seqs = num_seqs;
    p.kv.num_kv_heads = static_cast<int>(num_kv_heads);
    p.kv.head_dim = static_cast<int>(head_dim);
    p.kv.head_dim_v = static_cast<int>(head_dim_v);
    p.kv.block_size = static_cast<int>(block_size);
    p.kv.max_blocks_per_seq = max_blocks_per_seq;
    p.kv.format = static_cast<kvkernels::CacheFormat>(cache_format);
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      device = 0;
    }
    return 4 * kvkernels::attn_cuda::plan_paged_attention(p, device).workspace_floats;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvkernels.jax: %s\n", e.what());
    return -1;
  }
}

#pragma GCC visibility pop
