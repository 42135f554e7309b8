// Host interface of the CUDA paged attention (attention.cu), used by attention_binding.cpp.
// Plain C++ (no CUDA, no torch types), so the torch-stable binding can include it.
#pragma once

#include <cstdint>

#include "kvkernels/params.h"

namespace kvkernels::attn_cuda {

// A launch, decided on the host from shapes and the device only (never from device data), so the
// same call is valid for any contents of seq_lens / block_tables / query_start_loc and can be
// captured in a CUDA graph.
struct LaunchPlan {
  int path = 0;           // attention_common.cuh Path: 0 SIMT, 1 tensor-core decode, 2 prefill,
                          // 3 / 4 tensor-core decode / prefill in the deep configuration
  int dpad = 0;           // padded head dim of the kernel instance (64 / 128 / 256)
  int num_splits = 1;     // KV splits per work item (> 1: partials + merge kernel)
  int group = 1;          // query heads per kv head
  int heads_per_cta = 1;  // query heads of a group per CTA
  int head_chunks = 1;    // CTAs per kv head along the group
  int q_tile = 1;         // queries per CTA (varlen)
  int64_t grid_x = 0;
  int grid_y = 0, grid_z = 0;
  int64_t workspace_floats = 0;  // float32 scratch the launch needs on the device (0: none)
  int persistent_ctas = 0;       // the persistent decode's / wgmma prefill's grid (its CTAs walk the grid_x x
                                 // grid_y x num_splits units); 0 for the other paths
};

// Throws std::runtime_error when the device or the shapes cannot run (compute capability < 8.0,
// head dims outside [8, 256], grid limits, an unknown KVKERNELS_CUDA_ATTN_PATH). `device`: CUDA
// device index of the tensors. Environment overrides, for tests and benchmarks:
// KVKERNELS_CUDA_ATTN_PATH=simt (the CUDA-core kernel for every dtype), =mma-decode-deep (the
// tensor-core decode kernel's deep configuration instead of the wide default, =mma-decode-wide;
// =mma-decode-fp8-smem: the wide one with fp8 stages dequantized in shared memory),
// =mma-prefill-deep (the same for the tensor-core prefill, =mma-prefill-wide; =mma-prefill-tall: two
// row tiles per warp, 16-bit caches at head dims 64 / 128), or a comma-separated
// list of one decode and one prefill choice (attention.cu), and KVKERNELS_CUDA_ATTN_SPLITS=<n> (that
// many KV splits, capped to 128); KVKERNELS_CUDA_ATTN_PERSISTENT_CTAS=<n>: the persistent decode's grid
// (=mma-decode-persistent; at most its units).
LaunchPlan plan_paged_attention(const AttentionParams& p, int device);

// Why the sm_90a wgmma prefill (KVKERNELS_CUDA_ATTN_PATH=wgmma-prefill) cannot run a call, or nullptr
// when it can (then the plan takes it where asked for); the planner runs the wide mma.sync prefill
// otherwise. The reasons are listed in docs/ops.md.
const char* wgmma_prefill_unsupported(const AttentionParams& p, int device);

// Enqueues the attention (and, with splits, the merge) kernels on `stream` (a cudaStream_t of
// `device`, which must be current). `workspace`: device memory of plan.workspace_floats floats
// (nullptr when that is 0). No host synchronization. Throws std::runtime_error on launch errors.
void launch_paged_attention(const AttentionParams& p, const LaunchPlan& plan, float* workspace,
                            void* stream);

}  // namespace kvkernels::attn_cuda
