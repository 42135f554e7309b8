// Host entry points of the CUDA cache-op kernels (cache_ops.cu), shared with the binding layer
// (cache_ops_binding.cpp). Torch-free: params structs in, a stream, a status out.
//
// Every launcher only enqueues work on `stream`: no allocation, no synchronization, no read of
// device memory, so each one is safe inside CUDA-graph capture (block_copy_memcpy captures as
// memcpy nodes when its host memory is pinned). Scratch memory comes from the caller.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvkernels/params.h"
#include "launch.h"

namespace kvkernels::cuda {

// reshape_and_cache (2 writes) / concat_and_cache_mla (1-2 writes) into one cache of num_slots
// slots. All writes share slot_mapping and num_tokens.
Status cache_write(const CacheWriteParams* writes, int num_writes, int64_t num_slots,
                   cudaStream_t stream);

// gather_kv. p.token_start is ignored: the launcher fills `token_start_scratch` (device,
// num_seqs + 1 int64) from p.kv.seq_lens first, on the same stream.
Status gather_kv(const GatherParams& p, int64_t* token_start_scratch, cudaStream_t stream);

Status merge_attention_states(const MergeParams& p, cudaStream_t stream);

// Bytes of one block sub-tensor (what a staging buffer needs per pair).
int64_t block_copy_block_bytes(const BlockCopyParams& p);

// One kernel for every pair (and every layer of a stacked cache). p.mapping is device memory;
// p.src / p.dst are device memory or mapped pinned host memory (device-usable addresses).
Status block_copy(const BlockCopyParams& p, int64_t src_num_blocks, int64_t dst_num_blocks,
                  cudaStream_t stream);

// The same when src and dst share memory: every source block is first copied into `staging`
// (device, num_pairs * block_copy_block_bytes(p) bytes), then from there to its destination.
Status block_copy_staged(const BlockCopyParams& p, int64_t src_num_blocks, int64_t dst_num_blocks,
                         char* staging, cudaStream_t stream);

// cudaMemcpy(2D)Async per contiguous run; p.mapping is host memory (read here, so already
// validated). Asynchronous with pinned host memory; with pageable host memory the CUDA runtime
// itself makes each copy synchronous.
Status block_copy_memcpy(const BlockCopyParams& p, cudaMemcpyKind kind, cudaStream_t stream);

}  // namespace kvkernels::cuda
