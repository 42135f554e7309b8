// reshape_and_cache / concat_and_cache_mla on CUDA: scatter token rows into their cache slots,
// converting or quantizing to fp8 on the way (torch-free; launched by cache_ops.cu).
//
// One launch handles every write of the call (key and value, or latent and rotary part):
// blockIdx.y picks the write, and each thread moves one vector of N elements of one (token, head)
// row. N = 16 bytes of the source type when every address, stride and width allows it (the
// launcher checks), else 1. Tokens whose slot is negative are padding and skipped; a slot beyond
// the cache is skipped too (the binding reports it only in debug mode, KVKERNELS_DEBUG=1, since
// checking it on the host needs a device sync), so no launch ever writes outside the cache.
#pragma once

#include "common.cuh"

namespace kvkernels::cuda {

constexpr int kMaxWrites = 2;

struct CacheWriteLaunch {
  CacheWriteParams w[kMaxWrites];
  FastDiv vecs_per_token[kMaxWrites];  // num_heads * width / N of each write
  FastDiv vecs_per_head[kMaxWrites];   // width / N
  FastDiv block_size;
  int64_t num_slots = 0;   // num_blocks * block_size (< 2^31, checked by the launcher)
  int64_t token_begin = 0; // first token of this launch (launches are split below 2^31 vectors)
  int64_t num_tokens = 0;  // tokens of this launch
};

template <typename S, typename C, int N>
__global__ void __launch_bounds__(kThreads)
    cache_write_kernel(const __grid_constant__ CacheWriteLaunch p) {
  const CacheWriteParams& w = p.w[blockIdx.y];
  const uint32_t i = blockIdx.x * kThreads + threadIdx.x;  // vector index within this launch
  uint32_t rem, col;
  const uint32_t t = p.vecs_per_token[blockIdx.y].divmod(i, &rem);
  if (t >= p.num_tokens) return;
  const uint32_t h = p.vecs_per_head[blockIdx.y].divmod(rem, &col);
  const int64_t token = p.token_begin + t;
  const int64_t slot = w.slot_mapping[token];
  if (slot < 0 || slot >= p.num_slots) return;  // padding, or out of range (see above)
  uint32_t offset;
  const uint32_t block = p.block_size.divmod(static_cast<uint32_t>(slot), &offset);

  const S* src = static_cast<const S*>(w.src) + token * w.src_stride_token + h * w.src_stride_head +
                 col * N;
  C* dst = static_cast<C*>(w.cache) + block * w.cache_stride_block + offset * w.cache_stride_slot +
           h * w.cache_stride_head + w.col_offset + col * N;
  const auto in = Pack<S, N>::load(src);
  if constexpr (std::is_same_v<S, C>) {
    in.store(dst);  // same dtype: the bytes as they are (NaN payloads included)
  } else {
    const float scale = w.scale ? w.scale[w.scale_per_head ? h : 0] : 1.0f;
    Pack<C, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) out.v[k] = to_cache<C>(to_float(in.v[k]), scale);
    out.store(dst);
  }
}

}  // namespace kvkernels::cuda
