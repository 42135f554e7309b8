// copy_blocks and the kernel half of swap_blocks on CUDA (torch-free; launched by cache_ops.cu).
//
// A "block" is the sub-tensor cache.select(block_dim, id): for a stacked cache
// [L, 2, N, B, H, D] with block_dim = 2 that is every layer's K and V rows of block `id`, so one
// launch copies all layers. The launcher reduces the block to its canonical form (BlockCopyPlan):
// up to 7 outer dims (size, src stride, dst stride in bytes) around one contiguous run of bytes,
// with dims that are contiguous in both tensors folded together ([L, 2] of a contiguous stacked
// cache becomes one dim; an HND block becomes one run).
//
// Work split: each block's bytes are cut into tiles of kThreads * kUnroll accesses of V bytes
// (V = 16 where every address and stride allows it); a CTA copies one (pair, tile) at a time,
// issuing all kUnroll loads before the stores so each thread keeps several requests in flight.
// Pairs whose ids are out of range are skipped (the host reports them only in debug mode when the
// mapping lives on the device), so the kernel never touches memory outside the two tensors.
#pragma once

#include "common.cuh"

namespace kvkernels::cuda {

constexpr int kMaxCopyDims = 7;
constexpr int kCopyUnroll = 4;
constexpr int kCopyTileAccesses = kThreads * kCopyUnroll;

struct BlockCopyPlan {
  const char* src = nullptr;  // device memory, or mapped (pinned) host memory
  char* dst = nullptr;
  const int64_t* mapping = nullptr;  // device [num_pairs, 2] (src id, dst id)
  int64_t num_pairs = 0;
  int64_t src_block_stride = 0, dst_block_stride = 0;  // bytes
  int64_t src_num_blocks = 0, dst_num_blocks = 0;      // id range guard
  // Staging copies (overlapping src and dst): that side's id is the pair index, not the mapping.
  bool src_id_is_pair = false, dst_id_is_pair = false;
  int num_dims = 0;  // outer dims of a block, innermost last
  int64_t sizes[kMaxCopyDims] = {};
  int64_t src_strides[kMaxCopyDims] = {};
  int64_t dst_strides[kMaxCopyDims] = {};
  int64_t run_bytes = 0;  // the contiguous innermost run
};

struct BlockCopyLaunch {
  BlockCopyPlan plan;
  FastDiv sizes[kMaxCopyDims];
  FastDiv run_accesses;       // run_bytes / V
  uint32_t block_accesses = 0;  // accesses per block (< 2^31)
  uint32_t tiles_per_block = 0;
};

// Byte offsets, in src and dst, of access `a` of a block.
template <int V>
__device__ __forceinline__ void block_offsets(const BlockCopyLaunch& l, uint32_t a, int64_t* src_off,
                                              int64_t* dst_off) {
  uint32_t col;
  uint32_t row = l.run_accesses.divmod(a, &col);
  int64_t s = int64_t(col) * V, d = int64_t(col) * V;
#pragma unroll
  for (int dim = kMaxCopyDims - 1; dim >= 0; --dim) {
    if (dim < l.plan.num_dims) {
      uint32_t idx;
      row = l.sizes[dim].divmod(row, &idx);
      s += idx * l.plan.src_strides[dim];
      d += idx * l.plan.dst_strides[dim];
    }
  }
  *src_off = s;
  *dst_off = d;
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    block_copy_kernel(const __grid_constant__ BlockCopyLaunch l) {
  using Raw = typename raw_type<V>::type;
  const BlockCopyPlan& p = l.plan;
  const int64_t items = p.num_pairs * l.tiles_per_block;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t pair = item / l.tiles_per_block;
    const uint32_t tile = static_cast<uint32_t>(item - pair * l.tiles_per_block);
    const int64_t src_id = p.src_id_is_pair ? pair : p.mapping[2 * pair];
    const int64_t dst_id = p.dst_id_is_pair ? pair : p.mapping[2 * pair + 1];
    if (src_id < 0 || src_id >= p.src_num_blocks || dst_id < 0 || dst_id >= p.dst_num_blocks)
      continue;  // uniform across the CTA
    const char* src = p.src + src_id * p.src_block_stride;
    char* dst = p.dst + dst_id * p.dst_block_stride;

    Raw data[kCopyUnroll];
    int64_t dst_off[kCopyUnroll];
    const uint32_t first = tile * kCopyTileAccesses + threadIdx.x;
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const uint32_t a = first + u * kThreads;
      if (a < l.block_accesses) {
        int64_t src_off;
        block_offsets<V>(l, a, &src_off, &dst_off[u]);
        data[u] = *reinterpret_cast<const Raw*>(src + src_off);
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (first + u * kThreads < l.block_accesses) *reinterpret_cast<Raw*>(dst + dst_off[u]) = data[u];
    }
  }
}

}  // namespace kvkernels::cuda
