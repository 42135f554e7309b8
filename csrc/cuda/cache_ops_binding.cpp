// CUDA kernels of the cache ops: reshape_and_cache, concat_and_cache_mla, copy_blocks,
// swap_blocks, gather_kv and merge_attention_states. Each op validates with the shared binding
// layer (prepare.h: shapes, dtypes, devices, strides; no device reads), makes the tensors' device
// current, and enqueues its launcher (cache_ops.h) on torch's current stream. Nothing here waits
// for the GPU, except what the caller asks for:
//   - KVKERNELS_DEBUG=1: index ranges are checked on host copies of the index tensors first;
//   - gather_kv without num_tokens: the output length is sum(seq_lens), read from the device;
//   - a block_mapping on the CPU is read by the host directly (validated always); copy_blocks and
//     device-to-device swaps then upload it (an H2D copy; not capturable in a CUDA graph);
//   - swap_blocks with pageable host memory: the CUDA runtime makes those copies synchronous.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>

#include "../index_checks.h"
#include "../prepare.h"
#include "cache_ops.h"
#include "cuda_binding.h"

namespace kvkernels::cuda {
namespace {

// ---- reshape_and_cache / concat_and_cache_mla ------------------------------------------------

void run_writes(const ArgCheck& c, const PreparedCacheWrite& r, const Tensor& cache,
                const char* cache_arg) {
  const DeviceScope scope(c, cache, cache_arg);
  const int64_t num_slots = cache.size(0) * cache.size(1);
  if (debug_mode()) {
    const CacheWriteParams& w = r.writes.front();
    const std::vector<int64_t> slots = to_host(c, w.slot_mapping, w.num_tokens, scope.stream());
    check_slots(c, slots.data(), w.num_tokens, num_slots);
  }
  check_launch(c, cache_write(r.writes.data(), static_cast<int>(r.writes.size()), num_slots,
                              scope.stream()),
               "cache write kernel");
}

void reshape_and_cache_cuda(const Tensor& key, const Tensor& value, Tensor& key_cache,
                            Tensor& value_cache, const Tensor& slot_mapping,
                            std::optional<Tensor> k_scale, std::optional<Tensor> v_scale) {
  const ArgCheck c("reshape_and_cache");
  PreparedCacheWrite r = prepare_reshape_and_cache(c, key, value, key_cache, value_cache,
                                                   slot_mapping, k_scale, v_scale);
  run_writes(c, r, key_cache, "key_cache");
}

void concat_and_cache_mla_cuda(const Tensor& kv_c, const Tensor& k_pe, Tensor& kv_cache,
                               const Tensor& slot_mapping, std::optional<Tensor> scale) {
  const ArgCheck c("concat_and_cache_mla");
  PreparedCacheWrite r = prepare_concat_and_cache_mla(c, kv_c, k_pe, kv_cache, slot_mapping, scale);
  run_writes(c, r, kv_cache, "kv_cache");
}

// ---- copy_blocks / swap_blocks ---------------------------------------------------------------

bool on_cpu(const Tensor& t) { return t.device().type() == torch::headeronly::DeviceType::CPU; }

// The mapping as prepare_block_copy left it (int64 [n, 2], contiguous), wherever it lives.
Tensor contiguous_mapping(const Tensor& block_mapping) {
  return block_mapping.is_contiguous() ? block_mapping : torch::stable::contiguous(block_mapping);
}

// Validates the (src, dst) ids: always when the mapping is host memory (a plain read), and in
// debug mode when it is on the device. Without debug mode the kernel skips out-of-range pairs.
void check_mapping(const ArgCheck& c, const PreparedBlockCopy& r, bool mapping_on_host,
                   bool same_tensor, cudaStream_t stream) {
  const BlockCopyParams& p = r.params;
  if (mapping_on_host) {
    check_block_mapping(c, p.mapping, p.num_pairs, r.src_num_blocks, r.dst_num_blocks, same_tensor);
  } else if (debug_mode()) {
    const std::vector<int64_t> host = to_host(c, p.mapping, 2 * p.num_pairs, stream);
    check_block_mapping(c, host.data(), p.num_pairs, r.src_num_blocks, r.dst_num_blocks,
                        same_tensor);
  }
}

// A host mapping copied to `device` for the kernel (kept alive by `keep` until the call returns;
// the caching allocator orders its reuse after this stream's work).
const int64_t* device_mapping(const Tensor& block_mapping, const Tensor& device_tensor,
                              bool mapping_on_host, std::vector<Tensor>& keep) {
  Tensor m = contiguous_mapping(block_mapping);
  if (mapping_on_host) m = torch::stable::to(m, device_tensor.device(), /*non_blocking=*/true);
  keep.push_back(m);
  return static_cast<const int64_t*>(m.const_data_ptr());
}

void copy_blocks_cuda(Tensor& cache, const Tensor& block_mapping, int64_t block_dim) {
  const ArgCheck c("copy_blocks");
  PreparedBlockCopy r = prepare_block_copy(c, cache, cache, block_mapping, block_dim, true);
  const DeviceScope scope(c, cache, "cache");
  const bool mapping_on_host = on_cpu(block_mapping);
  check_mapping(c, r, mapping_on_host, /*same_tensor=*/true, scope.stream());
  if (r.params.num_pairs == 0 || cache.numel() == 0) return;
  r.params.mapping = device_mapping(block_mapping, cache, mapping_on_host, r.keep_alive);
  check_launch(c, block_copy(r.params, r.src_num_blocks, r.dst_num_blocks, scope.stream()),
               "block copy kernel");
}

// Byte range [first, last) a strided tensor spans.
std::pair<uintptr_t, uintptr_t> byte_extent(const Tensor& t) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  int64_t hi = 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return {base, base};
    hi += (t.size(d) - 1) * t.stride(d);
  }
  return {base, base + static_cast<uintptr_t>(hi * static_cast<int64_t>(t.element_size()))};
}

bool overlap(const Tensor& a, const Tensor& b) {
  const auto [a0, a1] = byte_extent(a);
  const auto [b0, b1] = byte_extent(b);
  return a0 < b1 && b0 < a1;
}

// The device address of pinned host memory (cudaHostAlloc / cudaHostRegister), so a kernel can
// write it directly; nullptr for pageable memory.
void* mapped_host_pointer(void* host) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, host) != cudaSuccess) {
    (void)cudaGetLastError();  // clear: not an error of any launch
    return nullptr;
  }
  return attr.type == cudaMemoryTypeHost ? attr.devicePointer : nullptr;
}

// swap_blocks on CUDA. Which path runs depends on where the tensors and the mapping live:
//   device <-> device (one device): the copy kernel (through a staging buffer when src and dst
//     share memory: every source block is read before any destination is written);
//   device <-> host, mapping on the CPU: cudaMemcpy2DAsync per block (all layers of a stacked
//     block in one 2D copy), merged across pairs with consecutive ids;
//   device -> pinned host, mapping on the device: the copy kernel writes the host memory through
//     its mapped address (zero-copy), since reading the mapping on the host would need a sync.
//     Pageable destinations cannot be reached that way: the call fails and says to pass the
//     mapping on the CPU.
// (host -> device with the mapping on the device cannot occur: the mapping must be on the CPU or
// on src's device, and src is the host tensor.)
void swap_blocks_cuda(const Tensor& src, Tensor& dst, const Tensor& block_mapping,
                      int64_t block_dim) {
  const ArgCheck c("swap_blocks");
  PreparedBlockCopy r = prepare_block_copy(c, src, dst, block_mapping, block_dim, false);
  const bool src_cuda = src.is_cuda(), dst_cuda = dst.is_cuda();
  c.expect(src_cuda || dst_cuda, "src|dst", "one of them must be a CUDA tensor");
  c.expect(src_cuda || on_cpu(src), "src", "must be a CUDA or a CPU tensor");
  c.expect(dst_cuda || on_cpu(dst), "dst", "must be a CUDA or a CPU tensor");
  c.expect(!(src_cuda && dst_cuda) || src.device().index() == dst.device().index(), "dst",
           "src and dst on two different CUDA devices are not supported");
  const DeviceScope scope(c, src_cuda ? src : dst, src_cuda ? "src" : "dst");
  const bool mapping_on_host = on_cpu(block_mapping);
  check_mapping(c, r, mapping_on_host, /*same_tensor=*/false, scope.stream());
  BlockCopyParams& p = r.params;
  if (p.num_pairs == 0 || src.numel() == 0) return;

  if (src_cuda && dst_cuda) {
    p.mapping = device_mapping(block_mapping, src, mapping_on_host, r.keep_alive);
    if (!overlap(src, dst)) {
      check_launch(c, block_copy(p, r.src_num_blocks, r.dst_num_blocks, scope.stream()),
                   "block copy kernel");
      return;
    }
    const int64_t bytes = block_copy_block_bytes(p) * p.num_pairs;
    Tensor staging = torch::stable::new_empty(src, {bytes}, ScalarType::Byte);
    r.keep_alive.push_back(staging);
    char* staged = static_cast<char*>(staging.mutable_data_ptr());
    check_launch(c, block_copy_staged(p, r.src_num_blocks, r.dst_num_blocks, staged, scope.stream()),
                 "staged block copy kernel");
    return;
  }
  if (mapping_on_host) {
    check_launch(c, block_copy_memcpy(p, src_cuda ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                                      scope.stream()),
                 "block copies (cudaMemcpy2DAsync)");
    return;
  }
  // Device -> host with the mapping on the device.
  void* mapped = mapped_host_pointer(dst.mutable_data_ptr());
  c.expect(mapped != nullptr, "dst",
           "host memory must be pinned (tensor.pin_memory()) when block_mapping is on the GPU; "
           "for pageable memory pass block_mapping on the CPU");
  p.dst = static_cast<char*>(mapped);
  check_launch(c, block_copy(p, r.src_num_blocks, r.dst_num_blocks, scope.stream()),
               "block copy kernel (to mapped host memory)");
}

// ---- gather_kv -------------------------------------------------------------------------------

std::tuple<Tensor, Tensor> gather_kv_cuda(const Tensor& key_cache, const Tensor& value_cache,
                                          const Tensor& block_tables, const Tensor& seq_lens,
                                          std::optional<Tensor> k_scale,
                                          std::optional<Tensor> v_scale,
                                          std::optional<int64_t> num_tokens,
                                          std::optional<ScalarType> out_dtype) {
  const ArgCheck c("gather_kv");
  // Without num_tokens the output length is sum(seq_lens): read (and check) it on the host; with
  // it, debug mode checks it there. Either way before the outputs are allocated.
  auto count = [&](const paged_kv_t& kv, std::optional<int64_t> n) {
    if (n.has_value() && !debug_mode()) return *n;
    const DeviceScope scope(c, key_cache, "key_cache");
    return checked_token_starts(c, host_paged_kv(c, kv, scope.stream()).kv, n).back();
  };
  PreparedGather r = prepare_gather_kv(c, key_cache, value_cache, block_tables, seq_lens, k_scale,
                                       v_scale, num_tokens, out_dtype, count);
  const DeviceScope scope(c, key_cache, "key_cache");
  GatherParams& p = r.params;
  if (p.num_tokens == 0) return {r.key, r.value};
  Tensor starts = torch::stable::new_empty(key_cache, {p.kv.num_seqs + 1}, ScalarType::Long);
  check_launch(c, gather_kv(p, static_cast<int64_t*>(starts.mutable_data_ptr()), scope.stream()),
               "gather kernel");
  return {r.key, r.value};
}

// ---- merge_attention_states ------------------------------------------------------------------

// merge_attention_states and merge_attention_states_out: one path (OutVariants, prepare.h).
std::tuple<Tensor, Tensor> merge_impl(const GivenOutputs& given, const Tensor& out_a,
                                      const Tensor& lse_a, const Tensor& out_b,
                                      const Tensor& lse_b) {
  const ArgCheck c("merge_attention_states");
  PreparedMerge r = prepare_merge(c, out_a, lse_a, out_b, lse_b, given);
  const DeviceScope scope(c, out_a, "out_a");
  // out= without lse=: the kernel writes lse anyway; scratch from the caching allocator.
  ensure_lse(c, r, r.params.lse, out_a, r.params.num_tokens, r.params.num_heads);
  check_launch(c, merge_attention_states(r.params, scope.stream()), "merge kernel");
  r.finish();  // non-contiguous given outputs: copied from their temporaries on this stream
  return {r.out, r.lse};
}

}  // namespace
}  // namespace kvkernels::cuda

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CUDA, m) {
  m.impl("reshape_and_cache", TORCH_BOX(&kvkernels::cuda::reshape_and_cache_cuda));
  m.impl("concat_and_cache_mla", TORCH_BOX(&kvkernels::cuda::concat_and_cache_mla_cuda));
  m.impl("copy_blocks", TORCH_BOX(&kvkernels::cuda::copy_blocks_cuda));
  m.impl("swap_blocks", TORCH_BOX(&kvkernels::cuda::swap_blocks_cuda));
  m.impl("gather_kv", TORCH_BOX(&kvkernels::cuda::gather_kv_cuda));
  m.impl("merge_attention_states",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::cuda::merge_impl>::allocating));
  m.impl("merge_attention_states_out",
         TORCH_BOX(&kvkernels::OutVariants<&kvkernels::cuda::merge_impl>::into));
}
