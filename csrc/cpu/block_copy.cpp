// copy_blocks (copy-on-write inside one cache, every layer of a stacked cache in one call) and
// swap_blocks (between two caches, e.g. a device cache and its host offload) on the CPU.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <vector>

#include "../index_checks.h"
#include "../prepare.h"
#include "block_copy.h"

namespace kvkernels::cpu {
namespace {

void copy_pairs(const BlockCopyParams& p) {
  torch::stable::parallel_for(0, p.num_pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      copy_block(p, p.src + p.mapping[2 * i] * p.src_block_stride, p.src_strides,
                 p.dst + p.mapping[2 * i + 1] * p.dst_block_stride, p.dst_strides);
    }
  });
}

// Byte range [first, last) spanned by a strided tensor.
std::pair<const char*, const char*> byte_extent(const Tensor& t) {
  const char* base = static_cast<const char*>(t.const_data_ptr());
  int64_t hi = 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return {base, base};
    hi += (t.size(d) - 1) * t.stride(d);
  }
  return {base, base + hi * static_cast<int64_t>(t.element_size())};
}

void copy_blocks_cpu(Tensor& cache, const Tensor& block_mapping, int64_t block_dim) {
  const ArgCheck c("copy_blocks");
  PreparedBlockCopy r = prepare_block_copy(c, cache, cache, block_mapping, block_dim, true);
  check_block_mapping(c, r.params.mapping, r.params.num_pairs, r.src_num_blocks, r.dst_num_blocks,
                      true);
  if (cache.numel() == 0) return;  // empty blocks (the mapping is in range, so blocks exist)
  copy_pairs(r.params);
}

void swap_blocks_cpu(const Tensor& src, Tensor& dst, const Tensor& block_mapping,
                     int64_t block_dim) {
  const ArgCheck c("swap_blocks");
  PreparedBlockCopy r = prepare_block_copy(c, src, dst, block_mapping, block_dim, false);
  const BlockCopyParams& p = r.params;
  check_block_mapping(c, p.mapping, p.num_pairs, r.src_num_blocks, r.dst_num_blocks, false);
  if (p.num_pairs == 0 || src.numel() == 0 || dst.numel() == 0) return;  // nothing to copy
  const auto [s0, s1] = byte_extent(src);
  const auto [d0, d1] = byte_extent(dst);
  if (s0 >= d1 || d0 >= s1) return copy_pairs(p);
  // src and dst share memory: read every source block into a packed staging buffer first.
  int64_t block_bytes = p.run_bytes;
  int64_t packed[7] = {};
  for (int d = p.num_dims - 1; d >= 0; --d) {
    packed[d] = block_bytes;
    block_bytes *= p.sizes[d];
  }
  std::vector<char> staged(static_cast<size_t>(block_bytes * p.num_pairs));
  for (int64_t i = 0; i < p.num_pairs; ++i)
    copy_block(p, p.src + p.mapping[2 * i] * p.src_block_stride, p.src_strides,
               staged.data() + i * block_bytes, packed);
  for (int64_t i = 0; i < p.num_pairs; ++i)
    copy_block(p, staged.data() + i * block_bytes, packed,
               p.dst + p.mapping[2 * i + 1] * p.dst_block_stride, p.dst_strides);
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("copy_blocks", TORCH_BOX(&kvkernels::cpu::copy_blocks_cpu));
  m.impl("swap_blocks", TORCH_BOX(&kvkernels::cpu::swap_blocks_cpu));
}
