// Host side of the CUDA paged attention: plans a launch from shapes and the device (kernel path,
// padded head dim, GQA packing, KV split count) and enqueues the kernels of
// attention_{f32,f16,bf16}.cu. Torch-free; attention_binding.cpp validates the tensors, allocates
// outputs and workspace through torch and calls in here.
//
// Path choice:
//   float32 queries                          -> SIMT (float32 math end to end)
//   fp16 / bf16, decode, group <= 16         -> tensor-core decode (16 rows, warps split keys;
//                                               the wide configuration: 64-key stages)
//   fp16 / bf16, varlen, or decode group > 16 -> tensor-core prefill (64 rows, warps split rows;
//                                               the wide configuration: 64-key stages)
// KVKERNELS_CUDA_ATTN_PATH (read per call; tests and A/B benchmarks): a comma-separated list of
// `simt` (the SIMT kernel for every dtype; alone), `mma-decode-wide` / `mma-decode-deep` (the
// tensor-core decode in its default wide configuration, 64 keys per stage and 2 stages at head
// dim 128 / 256, or in the deep one, 16 KiB stages and 4 of them) / `mma-decode-fp8-smem` (the wide
// one, over fp8 caches with the stage dequantized in shared memory instead of in registers: the
// A/B of that change; over 16-bit caches the wide kernel), `mma-decode-occ3` (the wide one held to
// the registers of 3 CTAs per SM, its split count counting them) / `mma-decode-fused` (the wide one
// issuing its first tiles before the query load and merging splits in the kernel, no merge launch:
// both opt-in, for the A/B of csrc/cuda/README.md "Decode at the bandwidth limit"), `mma-decode-persistent`
// (the fused one as a persistent grid of the resident CTA slots walking (work item, split) units; opt-in, the
// same A/B; KVKERNELS_CUDA_ATTN_PERSISTENT_CTAS=<n> forces its grid, for tests), `mma-prefill-wide` /
// `mma-prefill-deep` (the same choice for the tensor-core prefill) / `mma-prefill-tall` (2 row
// tiles of 16 per warp, 128 rows per CTA, where has_tall_prefill(); elsewhere the wide one) /
// `wgmma-prefill` (the sm_90a kernel of attention_sm90.cuh where wgmma_prefill_unsupported() finds no
// reason against it, else the wide one; KVKERNELS_CUDA_WGMMA=require makes such a fallback an error
// naming the reason) / `wgmma-prefill-overlap` (the same kernel with intra-warpgroup overlap where
// has_wgmma_overlap(), its non-overlapped loop elsewhere; the same fallbacks) / `wgmma-prefill-persistent` (that
// kernel persistent: min(work items, SMs) CTAs walking the items longest-first; the same fallbacks) and `auto`; empty or `auto`: every default. A value names each kernel at most once; anything else is
// an error, so a misspelt A/B cannot time the same kernel twice.
//
// Split count: a function of the number of work items (from shapes), the longest context a block
// table row can describe (block_tables.shape[1] * block_size), the SM count and the kernel's resident
// CTAs per SM; never of seq_lens, so the launch is the same for every step of a decode loop and
// CUDA-graph safe. Decode: the count with the least wave-quantized time (choose_splits); prefill:
// splits only when the work items alone leave SMs idle.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "attention_api.cuh"
#include "attention_common.cuh"
#include "tma_encode.h"     // cuTensorMapEncodeTiled through the runtime (the wgmma prefill's K / V maps)
#include "attention_mma.cuh"  // MmaCfg: the deep decode kernel's shared memory and CTA guarantee

namespace kvkernels::attn_cuda {
namespace {

constexpr int kMaxSplits = 128;
constexpr int kMinKeysPerSplit = 256;  // a split below this costs more in merging than it saves
constexpr int kCtasPerSm = 2;          // resident CTAs per SM assumed for all but the deep decode

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("kvkernels.paged_attention (CUDA): ") + what + ": " +
                             cudaGetErrorString(err));
}

struct DeviceInfo {
  int sm_count = 0;
  int major = 0, minor = 0;
  int smem_per_sm = 0;  // bytes of shared memory per SM
};

// SM count and compute capability per device, queried once (cudaDeviceGetAttribute, no sync).
DeviceInfo device_info(int device) {
  static std::mutex mu;
  static DeviceInfo cache[64];
  auto query = [device](DeviceInfo& info) {
    check(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device),
          "SM count");
    check(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device),
          "compute capability");
    check(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device),
          "compute capability");
    check(cudaDeviceGetAttribute(&info.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                 device),
          "shared memory per SM");
  };
  if (device < 0 || device >= 64) {
    DeviceInfo info;
    query(info);
    return info;
  }
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& info = cache[device];
  if (info.sm_count == 0) query(info);
  return info;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::atoi(v);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// K / V rows 16-byte aligned (cp.async of whole chunks); else the kernels load elements.
bool kv_rows_aligned(const AttentionParams& p) {
  const int64_t es = cache_esize(p.kv.format);
  return aligned16(p.kv.k) && aligned16(p.kv.v) && (p.kv.k_stride_block * es) % 16 == 0 &&
         (p.kv.k_stride_slot * es) % 16 == 0 && (p.kv.k_stride_head * es) % 16 == 0 &&
         (p.kv.v_stride_block * es) % 16 == 0 && (p.kv.v_stride_slot * es) % 16 == 0 &&
         (p.kv.v_stride_head * es) % 16 == 0;
}

// TMA for the wgmma prefill's K / V tiles (attention_sm90.cuh, the producer): rank-4 maps over each cache,
// (columns, slot, head, block) or, where the head stride is the smaller (NHD), (columns, head, slot, block),
// so that the strides grow outward in the usual layouts, and boxes of 64 columns (128 bytes: the 128B
// swizzle's width) x box_rows keys x 1 x 1. box_rows: the key tile where the block size is a multiple of it
// (a tile is a contiguous part of one page), the block size where it divides the tile and is at least 8 (a
// tile is whole pages; 8 rows of 128 B = one 1024-byte swizzle atom, so every box lands on an atom).
// Needs 16-bit caches (fp8 tiles are gathered raw and converted), 16-byte aligned bases and strides below
// 2^40 bytes, cuTensorMapEncodeTiled in the driver, and KVKERNELS_CUDA_NO_TMA not 1 (KVKERNELS_CUDA_TMA=require
// turns a launch without TMA into an error naming the reason: tests). Host work only (no
// device call: capturable). Otherwise box_rows = 0: every tile is gathered, as before, and `why` says why.
Sm90KvTma encode_kv_tma(const AttentionParams& p, int dpad, const char** why) {
  Sm90KvTma t;
  t.box_rows = 0;
  const paged_kv_t& kv = p.kv;
  const int kt = sm90_key_tile(dpad), bs = kv.block_size;
  const int rows = bs % kt == 0 ? kt : (kt % bs == 0 && bs >= 8 ? bs : 0);
  const char* no_tma = std::getenv("KVKERNELS_CUDA_NO_TMA");
  *why = no_tma != nullptr && std::strcmp(no_tma, "1") == 0 ? "KVKERNELS_CUDA_NO_TMA=1"
         : rows == 0 ? "the block size neither divides the key tile (at least 8 keys) nor is a multiple of it"
         : kv.format != CacheFormat::kFloat16 && kv.format != CacheFormat::kBFloat16
             ? "fp8 caches (their raw tiles are gathered and converted by the producer)"
         : mla_cuda::encode_tiled_fn() == nullptr ? "the driver has no cuTensorMapEncodeTiled"
                                                  : nullptr;
  if (*why != nullptr) return t;
  const CUtensorMapDataType type =
      kv.format == CacheFormat::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  auto encode = [&](CUtensorMap* map, const void* base, int d, int64_t s_block, int64_t s_slot, int64_t s_head,
                    int* head_dim1) {
    const uint64_t sb = uint64_t(s_block) * 2, ss = uint64_t(s_slot) * 2, sh = uint64_t(s_head) * 2;
    // (a single kv head: its stride is never stepped, so the slots take dimension 1)
    *head_dim1 = kv.num_kv_heads > 1 && sh < ss ? 1 : 0;
    const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(*head_dim1 ? kv.num_kv_heads : bs),
                                cuuint64_t(*head_dim1 ? bs : kv.num_kv_heads), cuuint64_t(kv.num_blocks)};
    const cuuint64_t strides[3] = {*head_dim1 ? sh : ss, *head_dim1 ? ss : (kv.num_kv_heads > 1 ? sh : sb), sb};
    const cuuint32_t box[4] = {64, cuuint32_t(*head_dim1 ? 1 : rows), cuuint32_t(*head_dim1 ? rows : 1), 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    if (s_block <= 0 || s_slot <= 0 || (kv.num_kv_heads > 1 && s_head <= 0)) return false;
    return mla_cuda::encode_tiled_fn()(map, type, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
           CUDA_SUCCESS;
  };
  if (encode(&t.k, kv.k, kv.head_dim, kv.k_stride_block, kv.k_stride_slot, kv.k_stride_head, &t.k_head_dim1) &&
      encode(&t.v, kv.v, kv.head_dim_v, kv.v_stride_block, kv.v_stride_slot, kv.v_stride_head, &t.v_head_dim1))
    t.box_rows = rows;
  else
    *why = "cuTensorMapEncodeTiled rejected the K / V map (strides not multiples of 16 bytes or from 2^40)";
  return t;
}

// KVKERNELS_CUDA_ATTN_PATH, parsed (see the top of this file).
struct PathChoice {
  bool simt = false, decode_deep = false, decode_fp8_smem = false, decode_occ3 = false, decode_fused = false,
       decode_persistent = false, prefill_deep = false, prefill_tall = false, prefill_wgmma = false,
       wgmma_overlap = false, wgmma_persistent = false;
};

PathChoice path_choice() {
  const char* env = std::getenv("KVKERNELS_CUDA_ATTN_PATH");
  const std::string value = env == nullptr ? "" : env;
  PathChoice c;
  int simt = 0, decode = 0, prefill = 0, items = 0;
  bool ok = true;
  size_t at = 0;
  while (ok && !value.empty()) {
    const size_t comma = value.find(',', at);
    const std::string item = value.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    ++items;
    if (item == "simt") c.simt = true, ++simt;
    else if (item == "mma-decode-wide") ++decode;
    else if (item == "mma-decode-deep") c.decode_deep = true, ++decode;
    else if (item == "mma-decode-fp8-smem") c.decode_fp8_smem = true, ++decode;
    else if (item == "mma-decode-occ3") c.decode_occ3 = true, ++decode;
    else if (item == "mma-decode-fused") c.decode_fused = true, ++decode;
    else if (item == "mma-decode-persistent") c.decode_persistent = true, ++decode;
    else if (item == "mma-prefill-wide") ++prefill;
    else if (item == "mma-prefill-deep") c.prefill_deep = true, ++prefill;
    else if (item == "mma-prefill-tall") c.prefill_tall = true, ++prefill;
    else if (item == "wgmma-prefill") c.prefill_wgmma = true, ++prefill;
    else if (item == "wgmma-prefill-overlap") c.prefill_wgmma = c.wgmma_overlap = true, ++prefill;
    else if (item == "wgmma-prefill-persistent") c.prefill_wgmma = c.wgmma_persistent = true, ++prefill;
    else if (item != "auto") ok = false;
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  // Each kernel named at most once, and `simt` (every dtype on the SIMT kernel) alone.
  ok = ok && decode <= 1 && prefill <= 1 && (simt == 0 || items == 1);
  if (!ok)
    throw std::runtime_error("kvkernels.paged_attention (CUDA): KVKERNELS_CUDA_ATTN_PATH=" + value +
                             " is not one of simt, auto, or a comma-separated list of at most one of "
                             "mma-decode-wide / mma-decode-deep / mma-decode-fp8-smem / mma-decode-occ3 / "
                             "mma-decode-fused / mma-decode-persistent and one of "
                             "mma-prefill-wide / mma-prefill-tall / "
                             "mma-prefill-deep / wgmma-prefill / wgmma-prefill-overlap / wgmma-prefill-persistent");
  return c;
}

int64_t floats_aligned8(int64_t n) { return (n + 7) / 8 * 8; }

// Resident CTAs per SM of a kernel, for the split heuristic. The deep and occ3 decode kernels'
// __launch_bounds__ reserve registers for as many CTAs as sm_90's shared memory holds, up to 4 / 3
// (MmaCfg::MIN_BLOCKS), so their residency is what this device's shared memory per SM holds (1 KiB
// reserved per CTA), up to that guarantee: deep 3 at head dim 64 / 128 / 256 with 16-bit caches on an
// H100 / H200, 4 with fp8 at head dim 64 / 128; occ3 3 everywhere there. The other kernels: kCtasPerSm.
template <Path P, CacheFormat CF, int D>
int decode_ctas(int smem_per_sm) {
  using C = MmaCfg<__nv_bfloat16, CF, D, P>;  // the query type changes no size
  const int fit = smem_per_sm / (C::SMEM + 1024);
  return std::max(1, std::min(fit, P == Path::kMmaDecodePersistent ? kCtasPerSm : C::MIN_BLOCKS));
}

template <Path P>
int decode_ctas(int dpad, bool fp8, int smem_per_sm) {
  switch (dpad) {
    case 64: return fp8 ? decode_ctas<P, CacheFormat::kFp8E4M3, 64>(smem_per_sm)
                        : decode_ctas<P, CacheFormat::kBFloat16, 64>(smem_per_sm);
    case 128: return fp8 ? decode_ctas<P, CacheFormat::kFp8E4M3, 128>(smem_per_sm)
                         : decode_ctas<P, CacheFormat::kBFloat16, 128>(smem_per_sm);
    default: return fp8 ? decode_ctas<P, CacheFormat::kFp8E4M3, 256>(smem_per_sm)
                        : decode_ctas<P, CacheFormat::kBFloat16, 256>(smem_per_sm);
  }
}

int resident_ctas(Path path, int dpad, CacheFormat format, int smem_per_sm) {
  if (path == Path::kMmaDecodeDeep) return decode_ctas<Path::kMmaDecodeDeep>(dpad, is_fp8(format), smem_per_sm);
  if (path == Path::kMmaDecodeOcc3) return decode_ctas<Path::kMmaDecodeOcc3>(dpad, is_fp8(format), smem_per_sm);
  // The persistent decode's grid is these slots, so they must all be resident at once: the wide decode's 2
  // (registers) where shared memory holds them (H100 / H200 / A100: <= 81 KiB each; 1 on sm_86 / sm_89).
  if (path == Path::kMmaDecodePersistent) return decode_ctas<Path::kMmaDecodePersistent>(dpad, is_fp8(format), smem_per_sm);
  return kCtasPerSm;
}

// Floats of the fused decode's arrival counters (one unsigned per work item) after the partials.
int64_t arrival_floats(const LaunchPlan& plan) {
  const Path path = static_cast<Path>(plan.path);
  return (path == Path::kMmaDecodeFused || path == Path::kMmaDecodePersistent) && plan.num_splits > 1
             ? floats_aligned8(plan.grid_x * plan.grid_y)
             : 0;
}

}  // namespace

// Why the wgmma prefill cannot run this call, or nullptr (docs/ops.md, "CUDA kernels": the planner then
// runs the wide mma.sync prefill). Shapes, pointers and the device only.
const char* wgmma_prefill_unsupported(const AttentionParams& p, int device) {
  if (p.query_start_loc == nullptr) return "decode (no query_start_loc): the mma.sync decode kernels";
  if (p.q_format == FloatFormat::kFloat32) return "float32 queries: the SIMT kernel";
  const int dpad = dpad_of(std::max(p.kv.head_dim, p.kv.head_dim_v));
  if (dpad > 128 && is_fp8(p.kv.format))
    return "fp8 caches at head dims above 128 (the raw fp8 tile does not fit in shared memory next to the stages)";
  const DeviceInfo dev = device_info(device);
  if (dev.major != 9 || dev.minor != 0) return "not an sm_90 (Hopper) device";
  int optin = 0;  // (read per call, not cached with the rest: the emulator's tests vary it)
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      optin < sm90_prefill_smem(dpad, is_fp8(p.kv.format)))
    return "less opt-in shared memory than the kernel needs";
  if (!kv_rows_aligned(p)) return "K / V rows not 16-byte aligned (cp.async gathers whole 16-byte chunks)";
  const bool built = p.q_format == FloatFormat::kFloat16 ? sm90_prefill_available_f16(dpad, p.kv.format)
                                                         : sm90_prefill_available_bf16(dpad, p.kv.format);
  if (!built) return "this build has no sm_90a code (TORCH_CUDA_ARCH_LIST without 9.0a)";
  return nullptr;
}

LaunchPlan plan_paged_attention(const AttentionParams& p, int device) {
  // K and V are read through their own pointers and strides (even views of one allocation); their
  // head dims may differ, and the kernels run on the padding of the larger (attention_common.cuh:
  // dpad_of). MLA has kernels of its own.
  const int d = p.kv.head_dim, dv = p.kv.head_dim_v;
  if (d <= 0 || d % 8 != 0 || d > 256 || dv <= 0 || dv % 8 != 0 || dv > 256)
    throw std::runtime_error("kvkernels.paged_attention (CUDA): head_dim and head_dim_v must be "
                             "positive multiples of 8 up to 256");
  const DeviceInfo dev = device_info(device);
  if (dev.major < 8)
    throw std::runtime_error("kvkernels.paged_attention (CUDA): needs compute capability 8.0 or "
                             "newer (cp.async, bf16 mma), device " + std::to_string(device) +
                             " has " + std::to_string(dev.major) + ".x");

  LaunchPlan plan;
  plan.dpad = dpad_of(std::max(d, dv));
  plan.group = p.num_heads / p.kv.num_kv_heads;
  const bool decode = p.query_start_loc == nullptr;
  const PathChoice choice = path_choice();
  Path path;
  if (p.q_format == FloatFormat::kFloat32 || choice.simt)
    path = Path::kSimt;
  else if (decode && plan.group <= rows_of(Path::kMmaDecode))
    // (mma-decode-fp8-smem differs from the wide kernel only over fp8 caches)
    path = choice.decode_deep                                   ? Path::kMmaDecodeDeep
           : choice.decode_occ3                                 ? Path::kMmaDecodeOcc3
           : choice.decode_fused                                ? Path::kMmaDecodeFused
           : choice.decode_persistent && has_persistent_decode(plan.dpad) ? Path::kMmaDecodePersistent
           : choice.decode_fp8_smem && is_fp8(p.kv.format) ? Path::kMmaDecodeFp8Smem
                                                                : Path::kMmaDecode;
  else {
    path = choice.prefill_deep                                               ? Path::kMmaPrefillDeep
           : choice.prefill_tall && has_tall_prefill(p.kv.format, plan.dpad) ? Path::kMmaPrefillTall
                                                                             : Path::kMmaPrefill;
    if (choice.prefill_wgmma) {
      const char* why = wgmma_prefill_unsupported(p, device);
      const char* req = std::getenv("KVKERNELS_CUDA_WGMMA");
      if (why == nullptr)
        path = choice.wgmma_persistent                               ? Path::kWgmmaPrefillPersistent
               : choice.wgmma_overlap && has_wgmma_overlap(plan.dpad) ? Path::kWgmmaPrefillOverlap
                                                                      : Path::kWgmmaPrefill;
      else if (req != nullptr && std::string(req) == "require")
        throw std::runtime_error(std::string("kvkernels.paged_attention (CUDA): KVKERNELS_CUDA_WGMMA=require: the "
                                             "wgmma prefill cannot run this call: ") + why);
    }
  }
  plan.path = static_cast<int>(path);

  const int rows = rows_of(path);
  plan.heads_per_cta = std::min(plan.group, rows);
  plan.head_chunks = (plan.group + plan.heads_per_cta - 1) / plan.heads_per_cta;
  plan.q_tile = decode ? 1 : rows / plan.heads_per_cta;
  const int64_t T = plan.q_tile;
  plan.grid_x = decode ? p.kv.num_seqs : (p.num_tokens + p.kv.num_seqs * (T - 1)) / T;
  const int64_t grid_y = int64_t(p.kv.num_kv_heads) * plan.head_chunks;
  if (plan.grid_x > 0x7fffffff || grid_y > 65535)
    throw std::runtime_error("kvkernels.paged_attention (CUDA): too many sequences / tokens / "
                             "heads for one launch");
  plan.grid_y = static_cast<int>(grid_y);

  // Split the keys of each work item when the items alone leave SMs idle.
  const int kt = key_tile_of(path, plan.dpad);
  const int64_t max_keys = p.kv.max_blocks_per_seq * p.kv.block_size;
  const int64_t items = plan.grid_x * plan.grid_y;
  int64_t splits = 1;
  // More splits than key tiles would only add empty CTAs.
  const int64_t max_tiles = std::max<int64_t>(1, (max_keys + kt - 1) / kt);
  const int forced = env_int("KVKERNELS_CUDA_ATTN_SPLITS", 0);
  const int64_t most = std::min<int64_t>(
      {std::max<int64_t>(1, max_keys / kMinKeysPerSplit), kMaxSplits, max_tiles});
  if (forced > 0) {
    splits = forced;
  } else if (items > 0 && decode) {
    const int64_t slots =
        int64_t(dev.sm_count) * resident_ctas(path, plan.dpad, p.kv.format, dev.smem_per_sm);
    splits = path == Path::kMmaDecodePersistent
                 ? choose_persistent_splits(items, max_tiles, std::max<int64_t>(1, slots), most)
                 : choose_splits(items, max_tiles, std::max<int64_t>(1, slots), most);
  } else if (items > 0) {
    // (the wgmma prefill holds one CTA per SM: ~190 KiB of shared memory)
    const int64_t target = int64_t(dev.sm_count) * (is_wgmma_prefill(path) ? 1 : kCtasPerSm);
    if (items < target) splits = std::min((target + items - 1) / items, most);
  }
  splits = std::max<int64_t>(1, std::min<int64_t>({splits, kMaxSplits, max_tiles}));
  plan.num_splits = static_cast<int>(splits);
  plan.grid_z = plan.num_splits;
  if (path == Path::kMmaDecodePersistent) {
    // One CTA per resident slot, none without a unit; KVKERNELS_CUDA_ATTN_PERSISTENT_CTAS=<n> (tests) forces n,
    // so that small cases walk several units per CTA across work items and sequences.
    const int64_t units = items * plan.num_splits;
    const int64_t slots =
        int64_t(dev.sm_count) * resident_ctas(path, plan.dpad, p.kv.format, dev.smem_per_sm);
    const int forced_ctas = env_int("KVKERNELS_CUDA_ATTN_PERSISTENT_CTAS", 0);
    plan.persistent_ctas = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>({units, forced_ctas > 0 ? forced_ctas : slots, 0x7fffffff})));
  }
  if (path == Path::kWgmmaPrefillPersistent) {
    // One CTA per SM (one fits: ~190 KiB of shared memory), each walking the work items (attention_sm90.cuh).
    const int64_t units = items * plan.num_splits;
    if (units > 0x7fffffff)
      throw std::runtime_error("kvkernels.paged_attention (CUDA): too many work items for the persistent prefill");
    plan.persistent_ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(units, dev.sm_count)));
  }
  if (plan.num_splits > 1) {
    const int64_t rows_total = int64_t(plan.num_splits) * p.num_tokens * p.num_heads;
    plan.workspace_floats = floats_aligned8(rows_total * dv) + floats_aligned8(rows_total) + arrival_floats(plan);
  }
  return plan;
}

void launch_paged_attention(const AttentionParams& p, const LaunchPlan& plan, float* workspace,
                            void* stream_ptr) {
  if (plan.grid_x == 0 || plan.grid_y == 0 || p.num_tokens == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  AttnArgs a;
  a.p = p;
  a.group = plan.group;
  a.heads_per_cta = plan.heads_per_cta;
  a.head_chunks = plan.head_chunks;
  a.q_tile = plan.q_tile;
  a.num_splits = plan.num_splits;
  a.bs_shift = block_shift(p.kv.block_size);
  a.kv_aligned = kv_rows_aligned(p);
  const int64_t qs = p.q_format == FloatFormat::kFloat32 ? 4 : 2;
  a.q_aligned = aligned16(p.q) && (p.q_stride_token * qs) % 16 == 0 &&
                (p.q_stride_head * qs) % 16 == 0;
  if (plan.num_splits > 1) {
    if (workspace == nullptr)
      throw std::runtime_error("kvkernels.paged_attention (CUDA): split launch without workspace");
    const int64_t rows_total = int64_t(plan.num_splits) * p.num_tokens * p.num_heads;
    a.part_o = workspace;
    a.part_lse = workspace + floats_aligned8(rows_total * p.kv.head_dim_v);
    if (arrival_floats(plan) > 0) {
      // The fused / persistent decode's arrival counters, zeroed on the stream before the kernel (a memset node in a
      // CUDA graph: every replay starts from zero; the workspace itself comes uninitialized).
      a.arrivals = reinterpret_cast<unsigned*>(a.part_lse + floats_aligned8(rows_total));
      check(cudaMemsetAsync(a.arrivals, 0, size_t(plan.grid_x) * plan.grid_y * sizeof(unsigned), stream),
            "arrival counters");
    }
  }

  const Path path = static_cast<Path>(plan.path);
  const dim3 grid = plan.persistent_ctas > 0
                        ? dim3(static_cast<unsigned>(plan.persistent_ctas))
                        : dim3(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(plan.grid_y),
                               static_cast<unsigned>(plan.grid_z));
  cudaError_t err;
  if (is_wgmma_prefill(path)) {
    const bool persistent = path == Path::kWgmmaPrefillPersistent;
    const bool overlap = path == Path::kWgmmaPrefillOverlap || (persistent && has_wgmma_overlap(plan.dpad));
    if (persistent)  // (its grid is the plan's persistent_ctas; the items' grid goes to the kernel)
      a.work_x = static_cast<int>(plan.grid_x), a.work_y = plan.grid_y, a.work_z = plan.grid_z;
    const char* no_tma_why = nullptr;
    const Sm90KvTma tma = encode_kv_tma(p, plan.dpad, &no_tma_why);
    // KVKERNELS_CUDA_TMA=require (tests): a launch whose K / V tiles would all be gathered fails, naming why
    const char* req = std::getenv("KVKERNELS_CUDA_TMA");
    if (tma.box_rows == 0 && req != nullptr && std::strcmp(req, "require") == 0)
      throw std::runtime_error(std::string("kvkernels.paged_attention (CUDA): KVKERNELS_CUDA_TMA=require: the wgmma "
                                           "prefill gathers every K / V tile: ") + no_tma_why);
    err = p.q_format == FloatFormat::kFloat16 ? launch_attention_sm90_f16(a, tma, plan.dpad, overlap, grid, stream)
                                              : launch_attention_sm90_bf16(a, tma, plan.dpad, overlap, grid, stream);
  } else switch (p.q_format) {
    case FloatFormat::kFloat16: err = launch_attention_f16(a, path, plan.dpad, grid, stream); break;
    case FloatFormat::kBFloat16: err = launch_attention_bf16(a, path, plan.dpad, grid, stream); break;
    default: err = launch_attention_f32(a, path, plan.dpad, grid, stream); break;
  }
  check(err, "attention kernel launch");
  if (plan.num_splits > 1 && a.arrivals == nullptr) {  // (the fused / persistent decode merged in the kernel)
    switch (p.q_format) {
      case FloatFormat::kFloat16: err = launch_merge_f16(a, stream); break;
      case FloatFormat::kBFloat16: err = launch_merge_bf16(a, stream); break;
      default: err = launch_merge_f32(a, stream); break;
    }
    check(err, "split merge launch");
  }
}

}  // namespace kvkernels::attn_cuda
