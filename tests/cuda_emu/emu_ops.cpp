// The CUDA launchers and kernels of csrc/cuda/cache_ops.cu run on the CPU through cuda_emu.h,
// registered as torch.ops.kvkernels_emu.* for tests/test_cuda_emulated.py. The bindings below
// mirror csrc/cuda/cache_ops_binding.cpp's paths with every tensor in host memory: index tensors
// stand in for device memory (no host-side index checks unless the real binding always does
// them), so the kernels' own range guards are exercised too.
#include "cuda_emu.h"

#include "cache_ops_emu.inc"  // csrc/cuda/cache_ops.cu, launches rewritten to emu::launch (build_emu.py)

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include "attention_api.cuh"  // csrc/cuda/attention.cu (+ attention_{f32,f16,bf16}.cu), built for the emulator
#include "attention_common.cuh"  // AttnArgs and launch_merge_* (merge_splits below)
#include "index_checks.h"
#include "mla_api.h"  // csrc/cuda/mla_attention*.cu and mla_decompress.cu, built for the emulator
#include "mla_sched.cuh"  // MlaArgs and launch_mla_sched (mla_schedule below)
#include "prepare.h"

namespace emu_ops {

using namespace kvkernels;

void check(const ArgCheck& c, const cuda::Status& s) {
  if (s.message) c.fail("CUDA", s.message);
  if (s.error != cudaSuccess) c.fail("CUDA", "error ", int(s.error));
}

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping, std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  const ArgCheck c("reshape_and_cache");
  PreparedCacheWrite r = prepare_reshape_and_cache(c, key, value, key_cache, value_cache, slot_mapping, k_scale,
                                                   v_scale);
  check(c, cuda::cache_write(r.writes.data(), int(r.writes.size()), key_cache.size(0) * key_cache.size(1), nullptr));
}

void concat_and_cache_mla(const Tensor& kv_c, const Tensor& k_pe, Tensor& kv_cache, const Tensor& slot_mapping,
                          std::optional<Tensor> scale) {
  const ArgCheck c("concat_and_cache_mla");
  PreparedCacheWrite r = prepare_concat_and_cache_mla(c, kv_c, k_pe, kv_cache, slot_mapping, scale);
  check(c, cuda::cache_write(r.writes.data(), int(r.writes.size()), kv_cache.size(0) * kv_cache.size(1), nullptr));
}

// The mapping plays device memory: no host check (the kernel skips out-of-range pairs).
void copy_blocks(Tensor& cache, const Tensor& block_mapping, int64_t block_dim) {
  const ArgCheck c("copy_blocks");
  PreparedBlockCopy r = prepare_block_copy(c, cache, cache, block_mapping, block_dim, true);
  check(c, cuda::block_copy(r.params, r.src_num_blocks, r.dst_num_blocks, nullptr));
}

// path 0: the kernel (staged when src and dst share memory, as the binding decides);
// path 1: the cudaMemcpy2DAsync path of a host mapping (checked first, as the binding does).
void swap_blocks(const Tensor& src, Tensor& dst, const Tensor& block_mapping, int64_t block_dim, int64_t path,
                 bool overlapping) {
  const ArgCheck c("swap_blocks");
  PreparedBlockCopy r = prepare_block_copy(c, src, dst, block_mapping, block_dim, false);
  BlockCopyParams& p = r.params;
  if (path == 1) {
    check_block_mapping(c, p.mapping, p.num_pairs, r.src_num_blocks, r.dst_num_blocks, false);
    check(c, cuda::block_copy_memcpy(p, cudaMemcpyDeviceToHost, nullptr));
  } else if (overlapping) {
    Tensor staging = torch::stable::new_empty(src, {cuda::block_copy_block_bytes(p) * p.num_pairs},
                                              ScalarType::Byte);
    check(c, cuda::block_copy_staged(p, r.src_num_blocks, r.dst_num_blocks,
                                            static_cast<char*>(staging.mutable_data_ptr()), nullptr));
  } else {
    check(c, cuda::block_copy(p, r.src_num_blocks, r.dst_num_blocks, nullptr));
  }
}

std::tuple<Tensor, Tensor> gather_kv(const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
                                     const Tensor& seq_lens, std::optional<Tensor> k_scale,
                                     std::optional<Tensor> v_scale, int64_t num_tokens,
                                     std::optional<ScalarType> out_dtype) {
  const ArgCheck c("gather_kv");
  auto never = [&](const paged_kv_t&, std::optional<int64_t> n) -> int64_t {
    if (!n.has_value()) c.fail("num_tokens", "required here");
    return *n;
  };
  PreparedGather r = prepare_gather_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale,
                                       num_tokens, out_dtype, never);
  Tensor starts = torch::stable::new_empty(key_cache, {r.params.kv.num_seqs + 1}, ScalarType::Long);
  check(c, cuda::gather_kv(r.params, static_cast<int64_t*>(starts.mutable_data_ptr()), nullptr));
  return {r.key, r.value};
}

// Outputs poisoned before a launch (NaN in every float format): an element the kernels leave unwritten
// shows. Given outputs are poisoned too (the temporaries of non-contiguous ones, or the tensors), and the
// scratch lse of an out= call without lse= (ensure_lse, as the binding does).
void poison(void* p, int64_t n, size_t elem) { std::memset(p, 0xff, size_t(n) * elem); }

std::tuple<Tensor, Tensor> merge_impl(const Tensor& out_a, const Tensor& lse_a, const Tensor& out_b,
                                      const Tensor& lse_b, const GivenOutputs& given) {
  const ArgCheck c("merge_attention_states");
  PreparedMerge r = prepare_merge(c, out_a, lse_a, out_b, lse_b, given);
  ensure_lse(c, r, r.params.lse, out_a, r.params.num_tokens, r.params.num_heads);
  poison(r.out.mutable_data_ptr(), r.out.numel(), r.out.element_size());
  poison(r.params.lse, r.params.num_tokens * r.params.num_heads, sizeof(float));
  check(c, cuda::merge_attention_states(r.params, nullptr));
  r.finish();
  return {r.out, r.lse};
}

std::tuple<Tensor, Tensor> merge_attention_states(const Tensor& out_a, const Tensor& lse_a, const Tensor& out_b,
                                                  const Tensor& lse_b) {
  return merge_impl(out_a, lse_a, out_b, lse_b, {});
}

// csrc/cuda/cache_ops_binding.cpp's merge_attention_states_out path (ensure_lse, finish) on host tensors.
void merge_attention_states_out(const Tensor& out_a, const Tensor& lse_a, const Tensor& out_b, const Tensor& lse_b,
                                Tensor out, std::optional<Tensor> lse) {
  merge_impl(out_a, lse_a, out_b, lse_b, {out, lse});
}

// csrc/cuda/attention_binding.cpp's path with host tensors: the shared validation and output
// allocation, the launch plan (device 0 of the emulator: 4 SMs, sm_90) and the launches, with the
// split workspace poisoned (NaN) so that a partial the merge reads before it is written shows.
// The outputs are poisoned first (the real binding leaves them uninitialized). The binding's
// debug-mode host index checks are not run (the index tensors play device memory).
std::tuple<Tensor, Tensor> paged_attention_impl(const Tensor& query, const Tensor& key_cache,
                                                const Tensor& value_cache, const Tensor& block_tables,
                                                const Tensor& seq_lens, std::optional<Tensor> query_start_loc,
                                                std::optional<double> scale, int64_t window_left, double soft_cap,
                                                std::optional<Tensor> alibi_slopes, std::optional<Tensor> sinks,
                                                std::optional<Tensor> k_scale, std::optional<Tensor> v_scale,
                                                std::optional<bool> causal, const GivenOutputs& given) {
  const ArgCheck c("paged_attention");
  PreparedAttention r = prepare_paged_attention(c, query, key_cache, value_cache, block_tables, seq_lens,
                                                query_start_loc, scale, window_left, soft_cap, alibi_slopes, sinks,
                                                k_scale, v_scale, causal, {}, given);
  if (r.params.num_tokens == 0 || r.params.kv.num_seqs == 0) return {r.out, r.lse};
  ensure_lse(c, r, r.params.lse, query, r.params.num_tokens, r.params.num_heads);
  // Outputs poisoned (NaN in every float format) before the launch: a row the kernels leave
  // unwritten shows as NaN.
  poison(r.out.mutable_data_ptr(), r.out.numel(), r.out.element_size());
  poison(r.params.lse, r.params.num_tokens * r.params.num_heads, sizeof(float));
  const attn_cuda::LaunchPlan plan = attn_cuda::plan_paged_attention(r.params, 0);
  Tensor workspace;
  float* ws = nullptr;
  if (plan.workspace_floats > 0) {
    workspace = torch::stable::new_empty(query, {plan.workspace_floats}, ScalarType::Float);
    ws = static_cast<float*>(workspace.mutable_data_ptr());
    std::memset(ws, 0xff, size_t(plan.workspace_floats) * sizeof(float));
  }
  attn_cuda::launch_paged_attention(r.params, plan, ws, nullptr);
  r.finish();
  return {r.out, r.lse};
}

std::tuple<Tensor, Tensor> paged_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                                           const Tensor& block_tables, const Tensor& seq_lens,
                                           std::optional<Tensor> query_start_loc, std::optional<double> scale,
                                           int64_t window_left, double soft_cap, std::optional<Tensor> alibi_slopes,
                                           std::optional<Tensor> sinks, std::optional<Tensor> k_scale,
                                           std::optional<Tensor> v_scale, std::optional<bool> causal) {
  return paged_attention_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                              window_left, soft_cap, alibi_slopes, sinks, k_scale, v_scale, causal, {});
}

// csrc/cuda/attention_binding.cpp's paged_attention_out path (ensure_lse, finish) on host tensors.
void paged_attention_out(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                         const Tensor& block_tables, const Tensor& seq_lens, std::optional<Tensor> query_start_loc,
                         std::optional<double> scale, int64_t window_left, double soft_cap,
                         std::optional<Tensor> alibi_slopes, std::optional<Tensor> sinks,
                         std::optional<Tensor> k_scale, std::optional<Tensor> v_scale, std::optional<bool> causal, Tensor out,
                         std::optional<Tensor> lse) {
  paged_attention_impl(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window_left,
                       soft_cap, alibi_slopes, sinks, k_scale, v_scale, causal, {out, lse});
}

// attention_merge.cuh's split merge alone (launch_merge_* of attention_{f32,f16,bf16}.cu) on partials the
// test writes: the attention kernels write zeros to the out row of a split that saw no finite logit, so
// only here does that row hold garbage (NaN, inf) that the merge must skip, not weight by 0.
// part_o [S, T, H, Dv] (Dv a multiple of 8 up to 256) and part_lse [S, T, H] (log2 units), float32 and
// contiguous; decode rows (token t has seq_lens[t] keys, which tells "no key" from "every logit -inf");
// sinks [H] and v_scale [1] optional; out in `dtype`, poisoned before the launch like lse.
std::tuple<Tensor, Tensor> merge_splits(const Tensor& part_o, const Tensor& part_lse, const Tensor& seq_lens,
                                        ScalarType dtype, std::optional<Tensor> sinks,
                                        std::optional<Tensor> v_scale) {
  const ArgCheck c("merge_splits");
  c.dim(part_o, "part_o", 4);
  c.dtype(part_o, "part_o", {ScalarType::Float});
  c.dtype(part_lse, "part_lse", {ScalarType::Float});
  c.dtype(seq_lens, "seq_lens", {ScalarType::Int});
  c.dtype(sinks.value_or(part_o), "sinks", {ScalarType::Float});
  c.dtype(v_scale.value_or(part_o), "v_scale", {ScalarType::Float});
  const int64_t S = part_o.size(0), T = part_o.size(1), H = part_o.size(2), Dv = part_o.size(3);
  c.dim(part_lse, "part_lse", 3);
  c.size(part_lse, "part_lse", 0, S, "part_o");
  c.size(part_lse, "part_lse", 1, T, "part_o");
  c.size(part_lse, "part_lse", 2, H, "part_o");
  c.size(seq_lens, "seq_lens", 0, T, "part_o");
  if (sinks) c.size(*sinks, "sinks", 0, H, "part_o");
  if (v_scale) c.size(*v_scale, "v_scale", 0, 1, "one scale");
  c.expect(Dv > 0 && Dv <= 256 && Dv % 8 == 0, "part_o", "head_dim_v a multiple of 8 up to 256");
  c.expect(part_o.is_contiguous() && part_lse.is_contiguous() && seq_lens.is_contiguous(), "part_o",
           "contiguous inputs only");
  Tensor out = torch::stable::new_empty(part_o, {T, H, Dv}, dtype);
  Tensor lse = torch::stable::new_empty(part_o, {T, H}, ScalarType::Float);
  poison(out.mutable_data_ptr(), out.numel(), out.element_size());
  poison(lse.mutable_data_ptr(), lse.numel(), sizeof(float));
  attn_cuda::AttnArgs a;
  AttentionParams& p = a.p;
  p.num_tokens = T;
  p.num_heads = static_cast<int>(H);
  p.kv.head_dim_v = static_cast<int>(Dv);
  p.kv.num_seqs = T;
  p.kv.seq_lens = static_cast<const int32_t*>(seq_lens.const_data_ptr());
  p.kv.v_scale = v_scale ? static_cast<const float*>(v_scale->const_data_ptr()) : nullptr;
  p.sinks = sinks ? static_cast<const float*>(sinks->const_data_ptr()) : nullptr;
  p.out = out.mutable_data_ptr();
  p.lse = static_cast<float*>(lse.mutable_data_ptr());
  a.num_splits = static_cast<int>(S);
  a.part_o = const_cast<float*>(static_cast<const float*>(part_o.const_data_ptr()));
  a.part_lse = const_cast<float*>(static_cast<const float*>(part_lse.const_data_ptr()));
  cudaError_t err = dtype == ScalarType::Half       ? attn_cuda::launch_merge_f16(a, nullptr)
                    : dtype == ScalarType::BFloat16 ? attn_cuda::launch_merge_bf16(a, nullptr)
                                                    : attn_cuda::launch_merge_f32(a, nullptr);
  check(c, cuda::Status{err, nullptr});
  return {out, lse};
}

// The plan the launch above would use: (path, dpad, num_splits, heads_per_cta, q_tile, grid_x, grid_y).
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> attention_plan(
    const Tensor& query, const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
    const Tensor& seq_lens, std::optional<Tensor> query_start_loc, std::optional<Tensor> k_scale,
    std::optional<Tensor> v_scale) {
  const ArgCheck c("paged_attention");
  PreparedAttention r = prepare_paged_attention(c, query, key_cache, value_cache, block_tables, seq_lens,
                                                query_start_loc, std::nullopt, -1, 0.0, std::nullopt, std::nullopt,
                                                k_scale, v_scale, /*causal=*/true);
  const attn_cuda::LaunchPlan p = attn_cuda::plan_paged_attention(r.params, 0);
  return {p.path, p.dpad, p.num_splits, p.heads_per_cta, p.q_tile, p.grid_x, p.grid_y, p.persistent_ctas};
}

// csrc/cuda/mla_binding.cpp's mla_paged_attention with host tensors: the shared validation and
// allocation, the real planner (device 0 of the emulator) and launcher; outputs and the split
// workspace poisoned (NaN) before the launch. The debug-mode host index checks are not run.
std::tuple<Tensor, Tensor> mla_paged_attention_impl(const Tensor& q, const Tensor& kv_cache,
                                                    const Tensor& block_tables, const Tensor& seq_lens,
                                                    int64_t kv_lora_rank, double scale,
                                                    std::optional<Tensor> query_start_loc,
                                                    std::optional<Tensor> kv_scale, const GivenOutputs& given) {
  const ArgCheck c("mla_paged_attention");
  PreparedAttention r = prepare_mla_attention(c, q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale,
                                              query_start_loc, kv_scale, {}, given);
  if (r.params.num_tokens == 0 || r.params.kv.num_seqs == 0) return {r.out, r.lse};
  ensure_lse(c, r, r.params.lse, q, r.params.num_tokens, r.params.num_heads);
  poison(r.out.mutable_data_ptr(), r.out.numel(), r.out.element_size());
  poison(r.params.lse, r.params.num_tokens * r.params.num_heads, sizeof(float));
  mla_cuda::MlaPlan plan;
  check(c, mla_cuda::plan_mla_attention(r.params, 0, &plan));
  Tensor workspace;
  float* ws = nullptr;
  if (plan.workspace_floats > 0) {
    workspace = torch::stable::new_empty(q, {plan.workspace_floats}, ScalarType::Float);
    ws = static_cast<float*>(workspace.mutable_data_ptr());
    std::memset(ws, 0xff, size_t(plan.workspace_floats) * sizeof(float));
  }
  check(c, mla_cuda::launch_mla_attention(r.params, plan, ws, nullptr));
  r.finish();
  return {r.out, r.lse};
}

std::tuple<Tensor, Tensor> mla_paged_attention(const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
                                               const Tensor& seq_lens, int64_t kv_lora_rank, double scale,
                                               std::optional<Tensor> query_start_loc,
                                               std::optional<Tensor> kv_scale) {
  return mla_paged_attention_impl(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, query_start_loc,
                                  kv_scale, {});
}

// csrc/cuda/mla_binding.cpp's mla_paged_attention_out path (ensure_lse, finish) on host tensors.
void mla_paged_attention_out(const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
                             const Tensor& seq_lens, int64_t kv_lora_rank, double scale,
                             std::optional<Tensor> query_start_loc, std::optional<Tensor> kv_scale, Tensor out,
                             std::optional<Tensor> lse) {
  mla_paged_attention_impl(q, kv_cache, block_tables, seq_lens, kv_lora_rank, scale, query_start_loc, kv_scale,
                           {out, lse});
}

// The plan of the launch above: (path, dp, stages, smem, heads_per_cta, q_tile, num_splits, grid_x, grid_y,
// seesaw, parts, pdl).
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>
mla_attention_plan(
    const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables, const Tensor& seq_lens, int64_t kv_lora_rank,
    std::optional<Tensor> query_start_loc, std::optional<Tensor> kv_scale) {
  const ArgCheck c("mla_paged_attention");
  PreparedAttention r = prepare_mla_attention(c, q, kv_cache, block_tables, seq_lens, kv_lora_rank, 1.0,
                                              query_start_loc, kv_scale);
  mla_cuda::MlaPlan p;
  check(c, mla_cuda::plan_mla_attention(r.params, 0, &p));
  return {p.path, p.dp, p.stages, p.smem, p.heads_per_cta, p.q_tile, p.num_splits, p.grid_x, p.grid_y, p.seesaw,
          p.parts, p.pdl};
}

// The wgmma MLA decode's metadata pass (csrc/cuda/mla_sched.cuh) alone, for `parts` CTAs per head chunk: its
// int32 output, poisoned (-1) before the launch: per CTA kSchedCtaInts (begin seq, begin item, end seq, end item,
// first piece, unused), then per sequence items, first unit, pieces, first partial.
Tensor mla_schedule(const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables, const Tensor& seq_lens,
                    int64_t kv_lora_rank, int64_t parts) {
  const ArgCheck c("mla_paged_attention");
  PreparedAttention r = prepare_mla_attention(c, q, kv_cache, block_tables, seq_lens, kv_lora_rank, 1.0,
                                              std::nullopt, std::nullopt);
  mla_cuda::MlaArgs m;
  attn_cuda::AttnArgs& a = m.a;
  a.p = r.params;
  a.group = int(r.params.num_heads);
  a.heads_per_cta = std::min(a.group, mla_cuda::kSm90Rows);
  a.head_chunks = (a.group + a.heads_per_cta - 1) / a.heads_per_cta;
  a.bs_shift = attn_cuda::block_shift(r.params.kv.block_size);
  const int64_t n = parts * mla_cuda::kSchedCtaInts + 4 * r.params.kv.num_seqs;
  Tensor meta = torch::stable::new_empty(seq_lens, {n}, ScalarType::Int);
  std::memset(meta.mutable_data_ptr(), 0xff, size_t(n) * sizeof(int));
  m.sched = static_cast<int*>(meta.mutable_data_ptr());
  m.parts = int(parts);
  check(c, cuda::Status{mla_cuda::launch_mla_sched(m, nullptr), nullptr});
  return meta;
}

// The emulator's programmatic-dependent-launch counters (cuda_emu.h, PDL): grids launched with programmatic
// stream serialization and griddepcontrol.launch_dependents executed, since the process started.
std::tuple<int64_t, int64_t> pdl_counts(const Tensor& /*any: the op needs a tensor to dispatch on*/) {
  return {int64_t(::emu::pdl.pdl_launches), int64_t(::emu::pdl.triggers)};
}

// csrc/cuda/mla_binding.cpp's mla_decompress with host tensors: the output length from seq_lens on
// the host when num_tokens is not given (as the binding does), outputs poisoned before the launch,
// the real launcher (token starts kernel, then the cp.async or TMA GEMM variant it picks).
std::tuple<Tensor, Tensor> mla_decompress(const Tensor& kv_cache, const Tensor& block_tables, const Tensor& seq_lens,
                                          const Tensor& w_kv_b, int64_t kv_lora_rank, int64_t qk_nope_head_dim,
                                          int64_t v_head_dim, std::optional<Tensor> norm_weight, double norm_eps,
                                          std::optional<Tensor> scale, std::optional<int64_t> num_tokens) {
  const ArgCheck c("mla_decompress");
  auto count = [&](const paged_kv_t& kv, std::optional<int64_t> n) {
    return n.has_value() ? *n : checked_token_starts(c, kv, n).back();
  };
  PreparedDecompress r = prepare_mla_decompress(c, kv_cache, block_tables, seq_lens, w_kv_b, kv_lora_rank,
                                                qk_nope_head_dim, v_head_dim, norm_weight, norm_eps, scale,
                                                num_tokens, count);
  MlaDecompressParams& p = r.params;
  if (p.num_tokens > 0) {  // (no memset of an empty tensor's null pointer)
    std::memset(r.key.mutable_data_ptr(), 0xff, size_t(r.key.numel()) * r.key.element_size());
    std::memset(r.value.mutable_data_ptr(), 0xff, size_t(r.value.numel()) * r.value.element_size());
  }
  Tensor starts = torch::stable::new_empty(kv_cache, {p.kv.num_seqs + 1}, ScalarType::Long);
  std::memset(starts.mutable_data_ptr(), 0xff, size_t(p.kv.num_seqs + 1) * sizeof(int64_t));
  check(c, mla_cuda::mla_decompress(p, 0, static_cast<int64_t*>(starts.mutable_data_ptr()), nullptr));
  return {r.key, r.value};
}

}  // namespace emu_ops

STABLE_TORCH_LIBRARY(kvkernels_emu, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def("concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor? scale=None) -> ()");
  m.def("copy_blocks(Tensor(a!) cache, Tensor block_mapping, int block_dim=0) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping, int block_dim=0, int path=0, "
        "bool overlapping=False) -> ()");
  m.def("gather_kv(Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor? k_scale, Tensor? v_scale, int num_tokens, ScalarType? out_dtype=None) -> (Tensor, Tensor)");
  m.def("merge_attention_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)");
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor? query_start_loc=None, float? scale=None, int window_left=-1, "
        "float soft_cap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? k_scale=None, "
        "Tensor? v_scale=None, bool? causal=True) -> (Tensor out, Tensor lse)");
  m.def("mla_paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, int kv_lora_rank, "
        "float scale, Tensor? query_start_loc=None, Tensor? kv_scale=None) -> (Tensor out, Tensor lse)");
  m.def("paged_attention_out(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor? query_start_loc=None, float? scale=None, int window_left=-1, "
        "float soft_cap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? k_scale=None, "
        "Tensor? v_scale=None, bool? causal=True, *, Tensor(a!) out, Tensor(b!)? lse=None) -> ()");
  m.def("merge_attention_states_out(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, *, Tensor(a!) out, "
        "Tensor(b!)? lse=None) -> ()");
  m.def("mla_paged_attention_out(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "int kv_lora_rank, float scale, Tensor? query_start_loc=None, Tensor? kv_scale=None, *, Tensor(a!) out, "
        "Tensor(b!)? lse=None) -> ()");
  m.def("mla_attention_plan(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, int kv_lora_rank, "
        "Tensor? query_start_loc=None, Tensor? kv_scale=None) -> (int, int, int, int, int, int, int, int, int, int, int, "
        "int)");
  m.def("pdl_counts(Tensor any) -> (int, int)");
  m.def("mla_schedule(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, int kv_lora_rank, "
        "int parts) -> Tensor");
  m.def("mla_decompress(Tensor kv_cache, Tensor block_tables, Tensor seq_lens, Tensor w_kv_b, int kv_lora_rank, "
        "int qk_nope_head_dim, int v_head_dim, Tensor? norm_weight=None, float norm_eps=1e-6, "
        "Tensor? scale=None, int? num_tokens=None) -> (Tensor key, Tensor value)");
  m.def("merge_splits(Tensor part_o, Tensor part_lse, Tensor seq_lens, ScalarType dtype, Tensor? sinks=None, "
        "Tensor? v_scale=None) -> (Tensor, Tensor)");
  m.def("attention_plan(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor? query_start_loc=None, Tensor? k_scale=None, Tensor? v_scale=None) -> (int, int, int, int, int, int, int, int)");
}

STABLE_TORCH_LIBRARY_IMPL(kvkernels_emu, CPU, m) {
  m.impl("reshape_and_cache", TORCH_BOX(&emu_ops::reshape_and_cache));
  m.impl("concat_and_cache_mla", TORCH_BOX(&emu_ops::concat_and_cache_mla));
  m.impl("copy_blocks", TORCH_BOX(&emu_ops::copy_blocks));
  m.impl("swap_blocks", TORCH_BOX(&emu_ops::swap_blocks));
  m.impl("gather_kv", TORCH_BOX(&emu_ops::gather_kv));
  m.impl("merge_attention_states", TORCH_BOX(&emu_ops::merge_attention_states));
  m.impl("paged_attention", TORCH_BOX(&emu_ops::paged_attention));
  m.impl("mla_paged_attention", TORCH_BOX(&emu_ops::mla_paged_attention));
  m.impl("paged_attention_out", TORCH_BOX(&emu_ops::paged_attention_out));
  m.impl("merge_attention_states_out", TORCH_BOX(&emu_ops::merge_attention_states_out));
  m.impl("mla_paged_attention_out", TORCH_BOX(&emu_ops::mla_paged_attention_out));
  m.impl("mla_attention_plan", TORCH_BOX(&emu_ops::mla_attention_plan));
  m.impl("pdl_counts", TORCH_BOX(&emu_ops::pdl_counts));
  m.impl("mla_schedule", TORCH_BOX(&emu_ops::mla_schedule));
  m.impl("mla_decompress", TORCH_BOX(&emu_ops::mla_decompress));
  m.impl("attention_plan", TORCH_BOX(&emu_ops::attention_plan));
  m.impl("merge_splits", TORCH_BOX(&emu_ops::merge_splits));
}
