// Host side of the CUDA mla_paged_attention: plans a launch from shapes and the device (kernel
// path, rows per CTA, pipeline depth, KV split count) and enqueues the kernels of
// mla_attention_{f16,bf16,simt}.cu. Torch-free; mla_binding.cpp validates the tensors, allocates
// outputs and the split workspace through torch and calls in here. Compiled, not run on a GPU.
//
// Path choice:
//   float32 q                                    -> SIMT (float32 math end to end)
//   fp16 / bf16 q, > 16 heads or varlen prefill  -> tensor cores, 64 rows per CTA, when its
//                                                   ~158 KiB of shared memory fit the device
//                                                   (sm_80: 163 KiB, sm_90: 227 KiB; not sm_86/89)
//   otherwise fp16 / bf16                        -> tensor cores, 16 rows per CTA (<= 94 KiB)
//   KVKERNELS_CUDA_MLA_PATH=wgmma (opt-in)       -> the sm_90a wgmma kernel (mla_attention_sm90.cuh;
//                                                   decode and varlen prefill) where
//                                                   mla_wgmma_unsupported finds no reason
//                                                   against it, else the choice above;
//                                                   KVKERNELS_CUDA_WGMMA=require fails instead;
//                                                   =wgmma-seesaw: the same, seesaw consumers
// Pipeline depth: as many 32-key stages as fit so that two CTAs share an SM, else one CTA; 2 to 4.
// Split count: from the number of work items (shapes), the longest context a block-table row can
// describe (block_tables.shape[1] * block_size), the SM count and the CTAs per SM, never from
// seq_lens, so the launch is the same for every step of a decode loop. Decode takes the count with
// the least wave-quantized time (attention_common.cuh choose_splits), prefill splits only when the
// work items alone leave SMs idle.
// KVKERNELS_CUDA_MLA_SCHED=metadata (opt-in, the wgmma decode only; varlen prefill keeps the shape-only plan):
// the split plan comes from a metadata pass over seq_lens on the device instead (mla_sched.cuh): as many CTAs per
// head chunk as make one per SM, each given an equal share of the batch's key tiles; the grid and workspace still
// from shapes (capturable).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "mla_api.h"
#include "tma_encode.h"
#include "mla_common.cuh"
#include "mla_sched.cuh"

namespace kvkernels::mla_cuda {
namespace {

constexpr int kMaxSplits = 128;
constexpr int kMinKeysPerSplit = 256;  // below this a split costs more in merging than it saves

cuda::Status failed(const char* message) { return cuda::Status{cudaSuccess, message}; }

struct DeviceInfo {
  int sm_count = 0, major = 0, minor = 0, smem_optin = 0;
  cudaError_t error = cudaSuccess;
};

// Queried once per device (attribute queries, no sync).
DeviceInfo device_info(int device) {
  static std::mutex mu;
  static DeviceInfo cache[64];
  auto query = [](int dev) {
    DeviceInfo info;
    info.error = cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, dev);
    if (info.error == cudaSuccess)
      info.error = cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, dev);
    if (info.error == cudaSuccess)
      info.error = cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (info.error == cudaSuccess)
      info.error = cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    return info;
  };
  if (device < 0 || device >= 64) return query(device);
  std::lock_guard<std::mutex> lock(mu);
  if (cache[device].sm_count == 0 || cache[device].error != cudaSuccess) cache[device] = query(device);
  return cache[device];
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }
int64_t floats_aligned8(int64_t n) { return (n + 7) / 8 * 8; }

int esize(CacheFormat f) { return ac::cache_esize(f); }

int smem_of(MlaPath path, int dp, int esz, int stages) {
  return path == MlaPath::kSimt ? simt_smem(dp, esz, stages).total : mma_smem(path, dp, esz, stages).total;
}

// Stages that let two CTAs share an SM (per-SM shared memory is about the opt-in limit plus
// 1 KiB per CTA of reserve), else as many as one CTA can have; 0 when even 2 do not fit.
int pick_stages(MlaPath path, int dp, int esz, int optin) {
  for (int budget : {optin / 2 - 1024, optin}) {
    for (int s = 4; s >= 2; --s)
      if (smem_of(path, dp, esz, s) <= budget) return s;
  }
  return 0;
}

// Stages of the wgmma decode: as many 64-key 16-bit tiles (2..4) as fit one CTA; 0 when 2 do not.
int pick_sm90_stages(int dp, int optin) {
  for (int s = 4; s >= 2; --s)
    if (mla_sm90_smem(dp, s).total <= optin) return s;
  return 0;
}

// Why the wgmma decode cannot run this call, or nullptr (docs/ops.md, "CUDA kernels"; the planner then
// runs what it would without KVKERNELS_CUDA_MLA_PATH=wgmma). Shapes, pointers and the device only.
const char* mla_wgmma_unsupported(const AttentionParams& p, int device, const DeviceInfo& dev) {
  if (p.q_format == FloatFormat::kFloat32) return "float32 queries: the SIMT kernel";
  if (dev.major != 9 || dev.minor != 0) return "not an sm_90 (Hopper) device";
  int optin = 0;  // (read per call, not cached with the rest: the emulator's tests vary it)
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      pick_sm90_stages(mla_sm90_dp(p.kv.head_dim, p.kv.head_dim_v), optin) == 0)
    return "less opt-in shared memory than the kernel needs (two 64-key stages)";
  const bool built = p.q_format == FloatFormat::kFloat16 ? mla_sm90_available_f16(p.kv.format)
                                                         : mla_sm90_available_bf16(p.kv.format);
  if (!built) return "this build has no sm_90a code for this cache format (TORCH_CUDA_ARCH_LIST without 9.0a)";
  return nullptr;
}

// ---- TMA for the wgmma decode's latent tiles -------------------------------------------------------

// The wgmma decode loads a tile that is one whole page (block size 64) with TMA: the cache viewed as
// [num_blocks x 64 rows, R + P columns] (pages contiguous: block stride = 64 x slot stride), 64 x 64 boxes
// (128 bytes of a row: the 128B swizzle's width, which is the kernel's tile layout), 16-bit caches (fp8
// tiles are converted by the producer), 16-byte aligned rows, R + P a multiple of 8 (whole 16-byte chunks
// at the row's end), KVKERNELS_CUDA_NO_TMA not 1. False (cp.async gathers for every tile) otherwise, or
// when the driver has no cuTensorMapEncodeTiled or rejects the map.
bool encode_latent_map(const AttentionParams& p, bool kv_aligned, CUtensorMap* map) {
  const paged_kv_t& kv = p.kv;
  const char* no_tma = env("KVKERNELS_CUDA_NO_TMA");
  if ((no_tma && std::strcmp(no_tma, "1") == 0) || is_fp8(kv.format) || kv.block_size != kSm90KeyTile ||
      !kv_aligned || kv.k_stride_block != int64_t(kSm90KeyTile) * kv.k_stride_slot || kv.head_dim % 8 != 0 ||
      encode_tiled_fn() == nullptr)
    return false;
  const cuuint64_t dims[2] = {cuuint64_t(kv.head_dim), cuuint64_t(kv.num_blocks) * kSm90KeyTile};
  const cuuint64_t strides[1] = {cuuint64_t(kv.k_stride_slot) * 2};  // bytes between rows
  const cuuint32_t box[2] = {64, cuuint32_t(kSm90KeyTile)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUtensorMapDataType type =
      kv.format == CacheFormat::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode_tiled_fn()(map, type, 2, const_cast<void*>(kv.k), dims, strides, box, elem_strides,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

cuda::Status plan_mla_attention(const AttentionParams& p, int device, MlaPlan* out) {
  const int D = p.kv.head_dim, R = p.kv.head_dim_v;
  if (p.kv.num_kv_heads != 1 || R <= 0 || R % 8 != 0 || R > kMaxValueWidth || D < R || D > 576)
    return failed("latent rows must be kv_lora_rank (a multiple of 8, <= 512) + rope_dim <= 576 wide");
  const DeviceInfo dev = device_info(device);
  if (dev.error != cudaSuccess) return cuda::Status{dev.error, nullptr};
  if (dev.major < 8) return failed("needs compute capability 8.0 or newer (cp.async, bf16 mma)");

  MlaPlan plan;
  plan.dp = mla_dp(D);
  const int esz = esize(p.kv.format);
  const bool decode = p.query_start_loc == nullptr;
  const char* forced = env("KVKERNELS_CUDA_MLA_PATH");
  const bool seesaw_asked = forced && std::strcmp(forced, "wgmma-seesaw") == 0;
  const bool wgmma_asked = forced && (std::strcmp(forced, "wgmma") == 0 || seesaw_asked);
  const char* wgmma_why = wgmma_asked ? mla_wgmma_unsupported(p, device, dev) : nullptr;
  MlaPath path;
  if (p.q_format == FloatFormat::kFloat32 || (forced && std::strcmp(forced, "simt") == 0)) {
    path = MlaPath::kSimt;
  } else if (forced && std::strcmp(forced, "mma16") == 0) {
    path = MlaPath::kMma16;
  } else if (forced && std::strcmp(forced, "mma64") == 0) {
    path = MlaPath::kMma64;
  } else {
    const bool wide = p.num_heads > 16 || !decode;
    path = wide && pick_stages(MlaPath::kMma64, plan.dp, esz, dev.smem_optin) > 0 ? MlaPath::kMma64
                                                                                 : MlaPath::kMma16;
    if (wgmma_asked && wgmma_why == nullptr) path = MlaPath::kWgmma;
  }
  if (wgmma_asked && path != MlaPath::kWgmma) {
    const char* req = env("KVKERNELS_CUDA_WGMMA");
    if (req != nullptr && std::strcmp(req, "require") == 0) {
      // Status carries static text: the message lives in this thread's buffer until its next failed plan.
      static thread_local std::string message;
      message = std::string("KVKERNELS_CUDA_WGMMA=require: the wgmma MLA decode cannot run this call: ") + wgmma_why;
      return failed(message.c_str());
    }
  }
  if (path == MlaPath::kWgmma) {
    plan.dp = mla_sm90_dp(D, R);
    plan.stages = pick_sm90_stages(plan.dp, dev.smem_optin);
    plan.smem = mla_sm90_smem(plan.dp, plan.stages).total;
  } else {
    plan.stages = pick_stages(path, plan.dp, esz, dev.smem_optin);
    if (plan.stages == 0) return failed("not enough shared memory per block on this device for the MLA kernel");
    plan.smem = smem_of(path, plan.dp, esz, plan.stages);
  }
  plan.path = static_cast<int>(path);
  plan.seesaw = path == MlaPath::kWgmma && seesaw_asked ? 1 : 0;

  const int rows = mla_rows(path);
  plan.heads_per_cta = std::min(p.num_heads, rows);
  plan.head_chunks = (p.num_heads + plan.heads_per_cta - 1) / plan.heads_per_cta;
  plan.q_tile = decode ? 1 : rows / plan.heads_per_cta;
  const int64_t T = plan.q_tile;
  plan.grid_x = decode ? p.kv.num_seqs : (p.num_tokens + p.kv.num_seqs * (T - 1)) / T;
  if (plan.grid_x > 0x7fffffff || plan.head_chunks > 65535)
    return failed("too many sequences / tokens / heads for one launch");
  plan.grid_y = plan.head_chunks;

  // Split the keys of each work item: decode by the least wave-quantized time (ac::choose_splits),
  // prefill when the items alone leave SMs idle.
  const int kt = mla_key_tile(path);
  const int64_t max_keys = p.kv.max_blocks_per_seq * p.kv.block_size;
  const int64_t items = plan.grid_x * plan.grid_y;
  // (the wgmma kernel: 384 threads of up to 168 registers fill an SM's register file)
  const int ctas_per_sm = path != MlaPath::kWgmma && 2 * (plan.smem + 1024) <= dev.smem_optin ? 2 : 1;
  const int64_t max_tiles = std::max<int64_t>(1, (max_keys + kt - 1) / kt);
  const int64_t most = std::min<int64_t>(
      {std::max<int64_t>(1, max_keys / kMinKeysPerSplit), kMaxSplits, max_tiles});
  const int64_t slots = int64_t(dev.sm_count) * ctas_per_sm;
  int64_t splits = 1;
  const char* forced_splits = env("KVKERNELS_CUDA_MLA_SPLITS");
  if (forced_splits) {
    splits = std::atoll(forced_splits);
  } else if (items > 0 && decode) {
    splits = ac::choose_splits(items, max_tiles, slots, most);
  } else if (items > 0 && items < slots) {
    splits = std::min((slots + items - 1) / items, most);
  }
  splits = std::max<int64_t>(1, std::min<int64_t>({splits, kMaxSplits, max_tiles}));
  plan.num_splits = static_cast<int>(splits);
  const char* sched = env("KVKERNELS_CUDA_MLA_SCHED");
  if (sched && std::strcmp(sched, "metadata") != 0 && std::strcmp(sched, "shape") != 0)
    return failed("KVKERNELS_CUDA_MLA_SCHED must be shape or metadata");
  // (Varlen prefill keeps the shape-only plan: the pass divides decode sequences, one query each.)
  if (sched && std::strcmp(sched, "metadata") == 0 && path == MlaPath::kWgmma && decode) {
    // One CTA per SM over all head chunks (the wgmma kernel fills an SM), each chunk's CTAs dividing the batch;
    // KVKERNELS_CUDA_MLA_SPLITS forces the count per chunk. The pass's units must fit an int.
    const int64_t parts = forced_splits ? std::max<int64_t>(1, std::min<int64_t>(std::atoll(forced_splits), 4096))
                                        : std::max<int64_t>(1, dev.sm_count / plan.head_chunks);
    if (p.kv.num_seqs * (kSchedFixedCost + max_tiles) >= (int64_t(1) << 31))
      return failed("KVKERNELS_CUDA_MLA_SCHED=metadata: more key tiles in the batch than the pass counts (2^31)");
    plan.parts = static_cast<int>(parts);
    plan.grid_x = parts;
    plan.num_splits = 1;
    plan.workspace_floats = mla_sched_layout(p.kv.num_seqs, plan.parts, p.num_heads, R).floats;
    const char* no_pdl = env("KVKERNELS_CUDA_NO_PDL");
    plan.pdl = dev.major >= 9 && !(no_pdl && std::strcmp(no_pdl, "1") == 0) ? 1 : 0;
  } else if (plan.num_splits > 1) {
    const int64_t rows_total = int64_t(plan.num_splits) * p.num_tokens * p.num_heads;
    plan.workspace_floats = floats_aligned8(rows_total * R) + floats_aligned8(rows_total);
  }
  *out = plan;
  return cuda::Status{};
}

cuda::Status launch_mla_attention(const AttentionParams& p, const MlaPlan& plan, float* workspace,
                                  cudaStream_t stream) {
  if (plan.grid_x == 0 || plan.grid_y == 0 || p.num_tokens == 0) return cuda::Status{};
  MlaArgs m;
  ac::AttnArgs& a = m.a;
  a.p = p;
  a.group = p.num_heads;  // one latent kv head: every query head is in its group
  a.heads_per_cta = plan.heads_per_cta;
  a.head_chunks = plan.head_chunks;
  a.q_tile = plan.q_tile;
  a.num_splits = plan.num_splits;
  a.bs_shift = ac::block_shift(p.kv.block_size);
  const int64_t es = esize(p.kv.format);
  // The head stride of the unsqueezed latent cache is never used (head 0 only).
  a.kv_aligned = aligned16(p.kv.k) && (p.kv.k_stride_block * es) % 16 == 0 &&
                 (p.kv.k_stride_slot * es) % 16 == 0;
  const int64_t qs = p.q_format == FloatFormat::kFloat32 ? 4 : 2;
  a.q_aligned = aligned16(p.q) && (p.q_stride_token * qs) % 16 == 0 && (p.q_stride_head * qs) % 16 == 0;
  if (plan.parts > 0) {
    if (workspace == nullptr) return failed("metadata launch without workspace");
    const MlaSchedLayout l = mla_sched_layout(p.kv.num_seqs, plan.parts, p.num_heads, p.kv.head_dim_v);
    a.part_o = workspace;
    a.part_lse = workspace + l.part_lse;
    m.sched = reinterpret_cast<int*>(workspace + l.meta);
    m.parts = plan.parts;
    m.pdl = plan.pdl;
  } else if (plan.num_splits > 1) {
    if (workspace == nullptr) return failed("split launch without workspace");
    const int64_t rows_total = int64_t(plan.num_splits) * p.num_tokens * p.num_heads;
    a.part_o = workspace;
    a.part_lse = workspace + floats_aligned8(rows_total * p.kv.head_dim_v);
  }
  m.dp = plan.dp;
  m.stages = plan.stages;
  m.seesaw = plan.seesaw;

  const dim3 grid(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(plan.grid_y),
                  static_cast<unsigned>(plan.num_splits));
  const MlaPath path = static_cast<MlaPath>(plan.path);
  cudaError_t err;
  if (plan.parts > 0) {  // the metadata pass first (the decode below waits for it before reading its output)
    err = launch_mla_sched(m, stream);
    if (err != cudaSuccess) return cuda::Status{err, nullptr};
  }
  if (path == MlaPath::kSimt) {
    err = launch_mla_simt(m, grid, plan.smem, stream);
  } else if (path == MlaPath::kWgmma) {
    CUtensorMap map;
    const CUtensorMap* use_map = encode_latent_map(p, a.kv_aligned != 0, &map) ? &map : nullptr;
    err = p.q_format == FloatFormat::kFloat16 ? launch_mla_sm90_f16(m, use_map, grid, plan.smem, stream)
                                              : launch_mla_sm90_bf16(m, use_map, grid, plan.smem, stream);
  } else if (p.q_format == FloatFormat::kFloat16) {
    err = launch_mla_mma_f16(m, path, grid, plan.smem, stream);
  } else if (p.q_format == FloatFormat::kBFloat16) {
    err = launch_mla_mma_bf16(m, path, grid, plan.smem, stream);
  } else {
    return failed("the tensor-core MLA kernel needs float16 / bfloat16 q");
  }
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  if (plan.num_splits > 1 || plan.parts > 1) {  // (metadata: only the sequences it split are merged)
    err = launch_mla_merge(m, stream);
    if (err != cudaSuccess) return cuda::Status{err, nullptr};
  }
  return cuda::Status{};
}

}  // namespace kvkernels::mla_cuda
