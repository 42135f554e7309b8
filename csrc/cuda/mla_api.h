// Host interface of the CUDA MLA kernels (mla_attention.cu, mla_decompress.cu), used by
// mla_binding.cpp. Plain C++ (CUDA runtime types only, no torch), so the torch-stable binding can
// include it. Every launcher only enqueues work on `stream`: no allocation, no synchronization,
// no read of device memory (CUDA-graph safe by construction; never run on a GPU yet).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvkernels/params.h"
#include "launch.h"

namespace kvkernels::mla_cuda {

// A launch of mla_paged_attention, decided on the host from shapes and the device only (never
// from seq_lens / block_tables / query_start_loc contents), so one plan serves every step of a
// decode loop and a captured graph stays valid when those tensors change.
struct MlaPlan {
  int path = 0;           // mla_common.cuh MlaPath: 0 SIMT, 1 tensor cores x16 rows, 2 x64 rows, 3 wgmma
  int dp = 0;             // shared-memory row width (head_dim rounded up to 64)
  int stages = 2;         // cp.async pipeline depth
  int smem = 0;           // dynamic shared memory bytes per CTA
  int heads_per_cta = 1;  // query heads per CTA (of the single latent group)
  int head_chunks = 1;    // CTAs along the heads
  int q_tile = 1;         // queries per CTA (varlen)
  int num_splits = 1;     // KV splits per work item (> 1: float32 partials + merge kernel)
  int64_t grid_x = 0;
  int grid_y = 0;
  int64_t workspace_floats = 0;  // float32 scratch the launch needs on the device (0: none)
  int seesaw = 0;         // path 3: the consumers' seesaw schedule (KVKERNELS_CUDA_MLA_PATH=wgmma-seesaw)
  // path 3 with KVKERNELS_CUDA_MLA_SCHED=metadata: the split plan of a metadata pass over seq_lens on the device
  // (mla_sched.cuh), grid_x = parts CTAs per head chunk sharing the batch's key tiles (num_splits 1); 0: the
  // shape-only plan above. pdl: the decode and the merge launched with programmatic dependent launch (sm_90).
  int parts = 0;
  int pdl = 0;
};

// Fills `plan` for validated params (prepare_mla_attention) on CUDA device `device`; a Status
// with a message when the device or the shapes cannot run. Environment overrides (tests and
// benchmarks): KVKERNELS_CUDA_MLA_PATH=simt|mma16|mma64|wgmma|wgmma-seesaw (simt for any dtype; mma16 / mma64
// for fp16 / bf16 q; wgmma: the sm_90a decode where it can run, else the default choice, or a failure with
// the reason under KVKERNELS_CUDA_WGMMA=require; wgmma-seesaw: the same with its consumers' seesaw schedule) and KVKERNELS_CUDA_MLA_SPLITS=<n> (that many KV
// splits, capped to 128; under the metadata plan, that many CTAs per head chunk) and
// KVKERNELS_CUDA_MLA_SCHED=shape|metadata (the wgmma decode's split plan: shape-only, the default, or from the
// metadata pass; the other paths always plan from shapes). KVKERNELS_CUDA_NO_PDL=1: no programmatic dependent
// launch.
cuda::Status plan_mla_attention(const AttentionParams& p, int device, MlaPlan* plan);

// Enqueues the attention kernel (and with splits the merge kernel) on `stream` of the current
// device. `workspace`: plan.workspace_floats floats of device memory (nullptr when 0).
cuda::Status launch_mla_attention(const AttentionParams& p, const MlaPlan& plan, float* workspace,
                                  cudaStream_t stream);

// mla_decompress. p.token_start is ignored: the launcher first fills `token_start_scratch`
// (device, num_seqs + 1 int64) from p.kv.seq_lens, on the same stream. Needs compute capability
// 8.0+ (cp.async, bf16 mma) on `device`. KVKERNELS_CUDA_DECOMPRESS picks the kernel for fp16 / bf16
// weights: persist (unset or empty: the default; its token tile from the device's shared memory),
// persist64 / persist128 (that tile) or tile64; any other value fails. tile64 on a 9.x
// device takes the TMA weight pipeline when eligible (mla_decompress.cu, use_tma); environment
// overrides: KVKERNELS_CUDA_NO_TMA=1 (always cp.async) and KVKERNELS_CUDA_TMA=require (fail, with the
// reason, instead of falling back to cp.async; under persist, which has no TMA path, always).
cuda::Status mla_decompress(const MlaDecompressParams& p, int device, int64_t* token_start_scratch,
                            cudaStream_t stream);

}  // namespace kvkernels::mla_cuda
