// Launcher of the CUDA mla_decompress: token starts on the device (token_starts_kernel of
// gather.cuh), then one GEMM launch of one of two kernels, chosen per call by
// KVKERNELS_CUDA_DECOMPRESS (decompress_variant below):
//   - persist (the default; mla_decompress_persist.cuh): fp16 / bf16 weights; a CTA keeps its latent
//     tile (64 or 128 tokens: launch_persist_variant; persist64 / persist128 force one) and streams a
//     run of column tiles; grid sized to the SMs by launch_persist;
//   - tile64 (mla_decompress.cuh): one CTA per 64 x 64 output tile; the only kernel for float32
//     weights (CUDA cores), under either value. fp16 / bf16 weights also have its TMA variant
//     (w_kv_b tiles by the Hopper copy engine), chosen at run time by use_tma() below. The tensor
//     map is encoded on the host for each call (no device work, no allocation: capturable) through
//     cuTensorMapEncodeTiled, looked up once with cudaGetDriverEntryPoint[ByVersion] (libcuda is not
//     linked).
//   - wgmma (opt-in, sm_90a; mla_decompress_sm90.cuh, instances in mla_decompress_sm90_{f16,bf16}.cu):
//     fp16 / bf16 weights; a warp-specialized persistent kernel, w_kv_b by TMA into an mbarrier ring,
//     wgmma from shared memory; launch_wgmma below fails with the reason where it cannot run (not a 9.x
//     device, no sm_90a code in the build, w_kv_b not 16-byte aligned, shared memory). float32
//     weights run tile64 under it too.
// Instances: every weight dtype over its own cache dtype and both fp8 formats. tile64 ran on an
// H200; persist and wgmma are compiled and emulated, not run on a GPU.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "gather.cuh"
#include "mla_api.h"
#include "tma_encode.h"
#include "mla_decompress.cuh"
#include "mla_decompress_persist.cuh"
#include "mla_decompress_sm90.cuh"

namespace kvkernels::mla_cuda {
namespace {

cuda::Status failed(const char* message) { return cuda::Status{cudaSuccess, message}; }

bool aligned(const void* ptr, int64_t a) { return reinterpret_cast<uintptr_t>(ptr) % a == 0; }

// What both kernels' launches derive alike from the params: kv_lora_rank padded to the K tile `bk`,
// whether the latent rows allow vector loads (8 elements of C, at most 16 bytes), whether w_kv_b
// allows 16-byte cp.async.
template <typename C>
void set_load_args(DecompressArgs& d, int bk) {
  const MlaDecompressParams& p = d.p;
  d.rpad = (p.kv_lora_rank + bk - 1) / bk * bk;
  const int64_t vec_bytes = std::min<int64_t>(16, 8 * int64_t(sizeof(C)));
  d.row_vec = aligned(p.kv.k, vec_bytes) && (p.kv.k_stride_block * int64_t(sizeof(C))) % vec_bytes == 0 &&
              (p.kv.k_stride_slot * int64_t(sizeof(C))) % vec_bytes == 0;
  d.w_async = aligned(p.w_kv_b, 16);
}

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// ---- TMA -----------------------------------------------------------------------------------------

// PTX (virtual) architecture of the device code the runtime picked for `kernel` on the current
// device, cached per device: 90+ means the TMA variant was compiled with TMA (an sm_80-only
// binary JIT-compiled on an H100 reports 80 and holds only the variant's trap).
int kernel_ptx_version(const void* kernel, int dev, std::atomic<int>* cache /* [64] */) {
  std::atomic<int>* slot = dev >= 0 && dev < 64 ? &cache[dev] : nullptr;
  const int known = slot != nullptr ? slot->load(std::memory_order_relaxed) : 0;
  if (known != 0) return known;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;  // not cached: asked again next time
  }
  if (slot != nullptr) slot->store(attr.ptxVersion, std::memory_order_relaxed);
  return attr.ptxVersion;
}

// Whether this launch takes the TMA variant, and why not (*why: static text, nullptr when it is
// simply not applicable: float32 weights, not a 9.x device, KVKERNELS_CUDA_NO_TMA=1).
// Eligibility: fp16 / bf16 weights; compute capability 9.x; the TMA instance compiled for sm_90+
// (PTX version >= 90); w_kv_b's base 16-byte aligned; its row stride (kv_lora_rank elements,
// contiguous) a multiple of 16 bytes (always: kv_lora_rank % 8 == 0); cuTensorMapEncodeTiled
// available from the driver.
template <typename T, typename C>
bool use_tma(const DecompressArgs& d, int cc_major, int dev, const char** why) {
  *why = nullptr;
  if constexpr (sizeof(T) != 2) {
    return false;
  } else {
    if (cc_major != 9 || env_is("KVKERNELS_CUDA_NO_TMA", "1")) return false;
    static std::atomic<int> ptx[64] = {};
    if (kernel_ptx_version(reinterpret_cast<const void*>(mla_decompress_kernel<T, C, true>), dev,
                           ptx) < 90) {
      *why = "the kernels were compiled without sm_90 device code (TORCH_CUDA_ARCH_LIST)";
      return false;
    }
    if (!aligned(d.p.w_kv_b, 16) || (int64_t(d.p.kv_lora_rank) * int64_t(sizeof(T))) % 16 != 0) {
      *why = "w_kv_b is not 16-byte aligned";
      return false;
    }
    return true;
  }
}

// The tensor map of w_kv_b [N rows, R columns] (row-major, contiguous) with the kernel's W box:
// BK columns (128 bytes) x BN rows, 128-byte swizzle, out-of-bounds elements read as zeros.
template <typename T>
bool encode_w_map(const DecompressArgs& d, CUtensorMap* map) {
  using Cfg = DecCfg<T>;
  static_assert(Cfg::BK * sizeof(T) == 128, "the 128B swizzle needs 128-byte box rows");
  const cuuint64_t dims[2] = {cuuint64_t(d.p.kv_lora_rank), cuuint64_t(d.n_total)};
  const cuuint64_t strides[1] = {cuuint64_t(d.p.kv_lora_rank) * sizeof(T)};  // bytes, dim 1
  const cuuint32_t box[2] = {cuuint32_t(Cfg::BK), cuuint32_t(Cfg::BN)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUtensorMapDataType type = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                             : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode_tiled_fn()(
      map, type, 2, const_cast<void*>(d.p.w_kv_b), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

template <typename T, typename C, bool TMA>
cuda::Status launch(DecompressArgs d, const CUtensorMap& wmap, cudaStream_t stream) {
  using Cfg = DecCfg<T>;
  const MlaDecompressParams& p = d.p;
  set_load_args<C>(d, Cfg::BK);
  const int64_t grid_x = (p.num_tokens + Cfg::BM - 1) / Cfg::BM;
  const int64_t grid_y = (int64_t(d.n_total) + Cfg::BN - 1) / Cfg::BN;
  if (grid_x > 0x7fffffff || grid_y > 65535) return failed("too many tokens / heads for one launch");
  const int smem = Cfg::smem(d.rpad) + (TMA ? Cfg::TMA_EXTRA : 0);
  static std::atomic<int> configured[64] = {};
  const cudaError_t err = raise_smem_limit(mla_decompress_kernel<T, C, TMA>, configured, smem);
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  mla_decompress_kernel<T, C, TMA>
      <<<dim3(unsigned(grid_x), unsigned(grid_y)), Cfg::NT, smem, stream>>>(d, wmap);
  return cuda::Status{cudaGetLastError(), nullptr};
}

// ---- persist (mla_decompress_persist.cuh) ----------------------------------------------------------

// Shared memory of the persist kernel with BM-row token tiles: ring depth and CTAs per SM (the most
// stages, 2..4, that let two CTAs share an SM - BM 64 only: BM 128's launch bounds ask for one -
// else the most that fit one), or stages = 0 when not even 2 stages fit.
struct PersistFit {
  int stages = 0, ctas = 0;
};
template <int BM>
PersistFit persist_fit(int rpad, int optin, int per_sm) {
  using Cfg = PersistCfg<BM>;
  PersistFit f;
  for (int want = Cfg::MIN_CTAS; want >= 1 && f.stages == 0; --want)
    for (int st = Cfg::MAX_STAGES; st >= Cfg::MIN_STAGES; --st) {
      const int bytes = Cfg::smem(rpad, st);
      if (bytes <= optin && want * (bytes + 1024) <= per_sm) {  // 1 KiB: the runtime's per-CTA share
        f.stages = st, f.ctas = want;
        break;
      }
    }
  return f;
}

// The persist kernel's launch: `fit` from persist_fit<BM>, then the grid: token tiles x column-tile
// runs, the run length chosen so that the CTAs fill the SMs' slots with the least modelled time
// (waves x (tiles per CTA + 1): the +1 stands for staging the latent rows, about one column tile's
// worth of loads), fewer runs on ties (less re-staging).
template <typename T, typename C, int BM>
cuda::Status launch_persist(DecompressArgs d, PersistFit fit, int sms, cudaStream_t stream) {
  using Cfg = PersistCfg<BM>;
  const MlaDecompressParams& p = d.p;
  set_load_args<C>(d, Cfg::BK);
  d.pair_out = p.qk_nope_head_dim % 2 == 0 && p.v_head_dim % 2 == 0 && p.rope_dim % 2 == 0 &&
               aligned(p.key, 4) && aligned(p.value, 4);
  d.stages = fit.stages;
  const int64_t m_tiles = (p.num_tokens + Cfg::BM - 1) / Cfg::BM;
  d.n_tiles = (d.n_total + Cfg::BN - 1) / Cfg::BN;
  if (m_tiles > 0x7fffffff || d.n_total > 0x7fffffff - Cfg::BN)  // column offsets stay in int
    return failed("too many tokens / heads for one launch");
  const int64_t slots = int64_t(std::max(sms, 1)) * fit.ctas;
  int64_t best_cost = -1;
  for (int64_t runs = 1; runs <= std::min<int64_t>(d.n_tiles, slots); ++runs) {
    const int64_t per = (d.n_tiles + runs - 1) / runs;
    const int64_t used = (d.n_tiles + per - 1) / per;  // runs that get a tile
    const int64_t waves = (m_tiles * used + slots - 1) / slots;
    const int64_t cost = waves * (per + 1);
    if (best_cost < 0 || cost < best_cost) best_cost = cost, d.tiles_per_cta = static_cast<int>(per);
  }
  const int64_t grid_y = (d.n_tiles + d.tiles_per_cta - 1) / d.tiles_per_cta;
  const int smem = Cfg::smem(d.rpad, fit.stages);
  static std::atomic<int> configured[64] = {};
  const cudaError_t err = raise_smem_limit(mla_decompress_persist_kernel<T, C, BM>, configured, smem);
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  mla_decompress_persist_kernel<T, C, BM>
      <<<dim3(unsigned(m_tiles), unsigned(grid_y)), Cfg::NT, smem, stream>>>(d);
  return cuda::Status{cudaGetLastError(), nullptr};
}

// Picks the persist kernel's token tile. `persist` (auto): BM 128 where it gets at least 3 stages
// (H100 / H200 at R 512: 4 stages, 192 KiB), else BM 64 (A100: 4 stages, 1 CTA; 99-KiB parts: 2
// stages) - 128 rows halve the weight bytes each output costs (the heaviest stream: every token tile
// reads all of w_kv_b), at one CTA per SM instead of two. persist64 / persist128 force one (A/B).
template <typename T, typename C>
cuda::Status launch_persist_variant(const DecompressArgs& d, int device, int bm, cudaStream_t stream) {
  int sms = 0, optin = 0, per_sm = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  const int rpad = (d.p.kv_lora_rank + 63) / 64 * 64;
  const PersistFit f128 = persist_fit<128>(rpad, optin, per_sm);
  if (bm == 128 || (bm == 0 && f128.stages >= 3)) {
    if (f128.stages == 0)
      return failed("persist128 does not fit this device's shared memory per block "
                    "(KVKERNELS_CUDA_DECOMPRESS=persist64 or tile64)");
    return launch_persist<T, C, 128>(d, f128, sms, stream);
  }
  const PersistFit f64 = persist_fit<64>(rpad, optin, per_sm);
  if (f64.stages == 0)
    return failed("the persist decompress kernel does not fit this device's shared memory per block "
                  "(KVKERNELS_CUDA_DECOMPRESS=tile64 selects the tile64 kernel)");
  return launch_persist<T, C, 64>(d, f64, sms, stream);
}

// ---- wgmma (mla_decompress_sm90.cuh) -----------------------------------------------------------------

// The wgmma kernel's launch, or why it cannot run (it is opt-in: the caller asked for it, so nothing
// falls back silently). Ring depth: the most stages (2..6) that fit the opt-in shared memory with the
// 128-row latent tile (R 512 on an H100 / H200: 6 stages, 225 KiB). Grid: one persistent CTA per SM,
// or one per tile when there are fewer tiles.
template <typename T, typename C>
cuda::Status launch_wgmma(DecompressArgs d, int cc_major, int dev, cudaStream_t stream) {
  using Cfg = Sm90DecCfg;
  const MlaDecompressParams& p = d.p;
  if (cc_major != 9)
    return failed("KVKERNELS_CUDA_DECOMPRESS=wgmma needs a compute capability 9.x device (wgmma, TMA); "
                  "unset it for the persist kernel");
  if (!sm90_decompress_compiled<T, C>())
    return failed("KVKERNELS_CUDA_DECOMPRESS=wgmma: the kernels were compiled without sm_90a device code "
                  "(TORCH_CUDA_ARCH_LIST must include 9.0a)");
  if (!aligned(p.w_kv_b, 16))
    return failed("KVKERNELS_CUDA_DECOMPRESS=wgmma: w_kv_b is not 16-byte aligned (its TMA tensor map needs "
                  "it); unset it for the persist kernel");
  set_load_args<C>(d, Cfg::BK);
  int sms = 0, optin = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  d.stages = 0;
  // + 128: the kernel's static shared memory (the sm_90a marker, as ptxas rounds it), also out of the limit.
  for (int st = Cfg::MAX_STAGES; st >= Cfg::MIN_STAGES && d.stages == 0; --st)
    if (Cfg::smem(d.rpad, st) + 128 <= optin) d.stages = st;
  if (d.stages == 0)
    return failed("KVKERNELS_CUDA_DECOMPRESS=wgmma does not fit this device's shared memory per block");
  d.pair_out = p.qk_nope_head_dim % 2 == 0 && p.v_head_dim % 2 == 0 && p.rope_dim % 2 == 0 &&
               aligned(p.key, 4) && aligned(p.value, 4);
  const int64_t m_tiles = (p.num_tokens + Cfg::BM - 1) / Cfg::BM;
  if (d.n_total > 0x7fffffff - Cfg::BN) return failed("too many heads for one launch");
  d.n_tiles = (d.n_total + Cfg::BN - 1) / Cfg::BN;
  const int64_t total = m_tiles * d.n_tiles;
  if (total * (d.rpad / Cfg::BK) > 0x7fffffff)  // the kernel's 32-bit tile and K-step numbers
    return failed("too many tokens / heads for one launch");
  const unsigned grid = unsigned(std::min<int64_t>(total, std::max(sms, 1)));
  if (encode_tiled_fn() == nullptr)
    return failed("KVKERNELS_CUDA_DECOMPRESS=wgmma: cudaGetDriverEntryPoint found no cuTensorMapEncodeTiled in "
                  "the CUDA driver");
  CUtensorMap wmap;
  std::memset(&wmap, 0, sizeof(wmap));
  if (!encode_w_map<T>(d, &wmap))
    return failed("KVKERNELS_CUDA_DECOMPRESS=wgmma: cuTensorMapEncodeTiled rejected the w_kv_b tensor map");
  return cuda::Status{launch_sm90_decompress<T, C>(d, wmap, grid, Cfg::smem(d.rpad, d.stages), stream), nullptr};
}

// KVKERNELS_CUDA_DECOMPRESS (read per call): unset, empty or "persist" -> the persist kernel with its
// token tile picked by launch_persist_variant (*bm = 0), "persist64" / "persist128" -> that tile
// (*bm = 64 / 128), "tile64" -> the tile64 kernel (cp.async or TMA; *bm = -1), "wgmma" -> the sm_90a
// kernel (*bm = kWgmma); false for anything else. float32 weights run the tile64 kernel's CUDA-core
// path under every value.
constexpr int kWgmma = -2;
bool decompress_variant(int* bm) {
  const char* v = std::getenv("KVKERNELS_CUDA_DECOMPRESS");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "persist") == 0) *bm = 0;
  else if (std::strcmp(v, "persist64") == 0) *bm = 64;
  else if (std::strcmp(v, "persist128") == 0) *bm = 128;
  else if (std::strcmp(v, "tile64") == 0) *bm = -1;
  else if (std::strcmp(v, "wgmma") == 0) *bm = kWgmma;
  else return false;
  return true;
}

// Picks the variant. KVKERNELS_CUDA_NO_TMA=1 forces cp.async; KVKERNELS_CUDA_TMA=require makes a
// launch that would not take TMA on a 9.x device fail with the reason (tests use it to be sure
// they exercised the TMA path).
template <typename T, typename C>
cuda::Status launch_variant(const DecompressArgs& d, int cc_major, int dev, int persist_bm,
                            cudaStream_t stream) {
  if constexpr (sizeof(T) == 2) {
    if (persist_bm == kWgmma) return launch_wgmma<T, C>(d, cc_major, dev, stream);
    if (persist_bm >= 0) {
      if (env_is("KVKERNELS_CUDA_TMA", "require"))
        return failed("KVKERNELS_CUDA_TMA=require: the persist kernel has no TMA path "
                      "(KVKERNELS_CUDA_DECOMPRESS=tile64 selects the tile64 kernel)");
      return launch_persist_variant<T, C>(d, dev, persist_bm, stream);
    }
  }
  CUtensorMap wmap;
  std::memset(&wmap, 0, sizeof(wmap));
  const char* why = nullptr;
  if constexpr (sizeof(T) == 2) {
    if (use_tma<T, C>(d, cc_major, dev, &why)) {
      if (encode_tiled_fn() == nullptr)
        return failed("TMA path: cudaGetDriverEntryPoint found no cuTensorMapEncodeTiled in the CUDA "
                      "driver (KVKERNELS_CUDA_NO_TMA=1 selects the cp.async path)");
      if (!encode_w_map<T>(d, &wmap))
        return failed("cuTensorMapEncodeTiled rejected the w_kv_b tensor map (KVKERNELS_CUDA_NO_TMA=1 "
                      "selects the cp.async path)");
      return launch<T, C, true>(d, wmap, stream);
    }
  }
  if (env_is("KVKERNELS_CUDA_TMA", "require")) {
    if (why != nullptr) return failed(why);
    if (sizeof(T) != 2) return failed("KVKERNELS_CUDA_TMA=require: float32 weights have no TMA path");
    return failed("KVKERNELS_CUDA_TMA=require: TMA needs a compute capability 9.x device and "
                  "KVKERNELS_CUDA_NO_TMA unset");
  }
  return launch<T, C, false>(d, wmap, stream);
}

}  // namespace

cuda::Status mla_decompress(const MlaDecompressParams& p, int device, int64_t* token_start_scratch,
                            cudaStream_t stream) {
  // The switch is checked before the empty-call return: a misspelt A/B fails on every call, not only
  // on calls with tokens.
  int persist_bm = 0;
  if (!decompress_variant(&persist_bm))
    return failed("KVKERNELS_CUDA_DECOMPRESS must be persist (the default), persist64, persist128, tile64 or "
                  "wgmma");
  if (p.num_tokens == 0) return cuda::Status{};
  if (p.kv_lora_rank <= 0 || p.kv_lora_rank % 8 != 0 || p.kv_lora_rank > kMaxValueWidth)
    return failed("kv_lora_rank must be a positive multiple of 8 up to 512");
  int major = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  if (major < 8) return failed("needs compute capability 8.0 or newer (cp.async, bf16 mma)");
  DecompressArgs d;
  d.p = p;
  d.p.token_start = token_start_scratch;
  const int64_t n_total = int64_t(p.num_heads) * (p.qk_nope_head_dim + p.v_head_dim);
  if (n_total > 0x7fffffff) return failed("num_heads * (qk_nope_head_dim + v_head_dim) too large");
  d.n_total = static_cast<int>(n_total);
  // starts[0] = 0 even without sequences: the kernel reads starts[num_seqs].
  kc::token_starts_kernel<<<1, kc::kScanThreads, 0, stream>>>(p.kv.seq_lens, p.kv.num_seqs,
                                                              token_start_scratch);
  err = cudaGetLastError();
  if (err != cudaSuccess) return cuda::Status{err, nullptr};
  return kc::dispatch_float_and_cache(p.w_format, p.kv.format, [&](auto wt, auto ct) {
    return launch_variant<typename decltype(wt)::type, typename decltype(ct)::type>(d, major, device,
                                                                                    persist_bm, stream);
  });
}

}  // namespace kvkernels::mla_cuda
