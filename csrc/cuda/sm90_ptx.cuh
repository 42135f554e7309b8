// Project-owned wrappers of the sm_90a (Hopper) PTX instructions the warp-specialized kernels use:
// wgmma (warpgroup matrix multiply-accumulate from shared-memory descriptors or registers), its
// fence / commit / wait, setmaxnreg, named barriers, mbarriers (arrive, expect_tx, phase waits,
// cp.async arrivals) and the async-proxy fence. Each wrapper is one inline-PTX instruction under
// `__CUDA_ARCH__ >= 900 && __CUDA_ARCH_FEAT_SM90_ALL` (nvcc -arch=sm_90a), and the CPU emulator's
// model of that instruction under KVKERNELS_CUDA_EMU (tests/cuda_emu/cuda_emu.h: operands, fragment
// layouts, descriptor decoding, swizzles, asynchrony and the misuse it can detect). Elsewhere (the
// sm_80 compile of a unit that includes this) they compile to nothing: the kernels that call them
// exist only in the sm_90a build (attention_sm90.cuh guards its kernel body), and the launchers
// never select them on other devices.
//
// Why wrappers of our own rather than CUTLASS / CuTe's wgmma atoms: csrc/cuda/README.md, section
// "Hopper prefill (wgmma)". In short, CuTe's atoms are inline PTX the emulator cannot execute, so a
// CuTe kernel could only be checked on a GPU; one wrapper per instruction, re-implemented by the
// emulator the way mma.sync / ldmatrix already are, lets CI run the kernel's logic without one.
//
// References (PTX ISA 8.x/9.0, NVIDIA): 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"
// (wgmma.mma_async, .fence, .commit_group, .wait_group; 9.7.15.5.1 register fragments and the shared
// memory layouts; "Matrix Descriptor Format"), 9.7.13.4 bar / barrier, 9.7.13.15 mbarrier, 9.7.17.1
// setmaxnreg, 9.7.13.x membar / fence (fence.proxy.async). The fragment layouts were cross-checked
// against CUTLASS's CLayout_64xN / ALayout_64x16 and make_gmma_desc (cute/atom/mma_traits_sm90_gmma.hpp,
// read, not used).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVK_SM90_PTX 1
#else
#define KVK_SM90_PTX 0
#endif
// mbarrier phases with transaction counts, the async-proxy fence and the TMA bulk copies exist on every
// sm_90 target, "a" or not: their wrappers are compiled under this wider condition, so the sm_90
// (non-"a") build of mla_decompress's tile64 TMA weight ring uses them too.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVK_SM90_ASYNC 1
#else
#define KVK_SM90_ASYNC 0
#endif

namespace kvkernels::sm90 {

// ---- shared-memory matrix descriptors ---------------------------------------------------------------
// 64 bits (PTX ISA "Matrix Descriptor Format"): bits 0-13 start address, 16-29 leading dimension byte
// offset (LBO), 32-45 stride dimension byte offset (SBO), each (x & 0x3FFFF) >> 4; 49-51 base offset
// (0 here: every swizzled operand's pattern starts at a 1024 / 512 / 256-byte boundary); 62-63 the
// swizzle. For 16-bit K-major operands with a swizzle, an 8-row group is 8 rows of the swizzle width
// (128 B: 64 elements), groups SBO apart, LBO unused (1); MN-major: 8 K-rows of the swizzle width (64
// M/N elements), groups of 8 K-rows SBO apart, groups of 64 M/N elements LBO apart.
enum class Swizzle : uint32_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo, Swizzle s) {
#if defined(KVKERNELS_CUDA_EMU)
  if (smem_addr % 16 != 0 || lbo % 16 != 0 || sbo % 16 != 0)
    throw std::logic_error("emu: wgmma descriptor start / LBO / SBO not 16-byte aligned (the low 4 bits are dropped)");
  if (smem_addr >= (1u << 18) || lbo >= (1u << 18) || sbo >= (1u << 18))
    throw std::logic_error("emu: wgmma descriptor address / offset past 18 bits");
#endif
  return uint64_t((smem_addr & 0x3FFFFu) >> 4) | (uint64_t((lbo & 0x3FFFFu) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFFu) >> 4) << 32) | (uint64_t(s) << 62);
}

// The descriptor `bytes` further on (the start address field advanced; bytes a multiple of 16 that
// keeps the start within 18 bits): the next k16 step of a K-major operand (32 bytes), etc.
__device__ __forceinline__ uint64_t desc_add(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// ---- wgmma ----------------------------------------------------------------------------------------

// wgmma.fence.sync.aligned: before the first wgmma, and between register accesses (accumulators,
// A fragments) by other instructions and a wgmma that uses those registers.
__device__ __forceinline__ void wgmma_fence() {
#if KVK_SM90_PTX
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::wgmma_fence();
#endif
}

// wgmma.commit_group.sync.aligned: the wgmma issued since the last commit form a group.
__device__ __forceinline__ void wgmma_commit() {
#if KVK_SM90_PTX
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::wgmma_commit();
#endif
}

// wgmma.wait_group.sync.aligned N: every group but the N most recent has completed; the accumulators
// of those are readable (call fence_regs on them afterwards, so that the compiler neither reads them
// before this point nor reuses A-fragment registers of an in-flight wgmma).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if KVK_SM90_PTX
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::wgmma_wait(N);
#endif
}

// Pins registers at this point of the instruction stream (no instruction): the compiler must assume
// they are read and written here. Accumulators: after a wgmma_wait, before their first read; before
// a wgmma, after their last write. A fragments of a register-A wgmma: after its wgmma_wait, so their
// registers are not reused while it is in flight.
template <int K>
__device__ __forceinline__ void fence_regs(float (&r)[K]) {
#if KVK_SM90_PTX
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+f"(r[i])::"memory");
#else
  (void)r;
#endif
}
template <int K>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[K]) {
#if KVK_SM90_PTX
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+r"(r[i])::"memory");
#else
  (void)r;
#endif
}

#define KVK_WGMMA_SS_64(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
    "%32, %33, p, 1, 1, %35, %36;\n}\n" \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
    : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB))

#define KVK_WGMMA_RS_64(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
    "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB))

#define KVK_WGMMA_SS_128(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
    "%64, %65, p, 1, 1, %67, %68;\n}\n" \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
    : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB))

#define KVK_WGMMA_RS_128(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
    "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB))


template <typename T>
constexpr bool kIsF16 = std::is_same_v<T, __half>;

// D (64 x N, this thread's N / 2 floats: PTX ISA Figure "WGMMA .m64nNk16 register fragment layout for
// accumulator matrix D") = (scale_d ? D : 0) + A B for one k16 step: A 64 x 16 and B 16 x N from shared
// memory (descriptors; TA = 1: A M-major, TB = 1: B N-major), 16-bit T, fp32 accumulation. Asynchronous:
// D is not readable until a wgmma_wait that covers its group.
template <int N, typename T, int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
  static_assert(N == 64 || N == 128, "instantiated shapes: m64n64k16, m64n128k16");
#if KVK_SM90_PTX
  if constexpr (N == 64) {
    if constexpr (kIsF16<T>) KVK_WGMMA_SS_64("f16"); else KVK_WGMMA_SS_64("bf16");
  } else {
    if constexpr (kIsF16<T>) KVK_WGMMA_SS_128("f16"); else KVK_WGMMA_SS_128("bf16");
  }
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::wgmma(N, kIsF16<T>, false, da, nullptr, db, d, scale_d, 1, 1, TA, TB);
#else
  (void)d, (void)da, (void)db, (void)scale_d;
#endif
}

// The same with A from registers: a[0..3] the 4 x 2 16-bit values of the mma.sync m16n8k16 A layout
// of this thread's warp, rows 16 w .. 16 w + 15 for warp w of the warpgroup (PTX ISA Figure "WGMMA
// .m64nNk16 register fragment layout for matrix A"). The registers must keep their values until the
// wgmma_wait of the group (fence_regs(a) after it).
template <int N, typename T, int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int scale_d) {
  static_assert(N == 64 || N == 128, "instantiated shapes: m64n64k16, m64n128k16");
#if KVK_SM90_PTX
  if constexpr (N == 64) {
    if constexpr (kIsF16<T>) KVK_WGMMA_RS_64("f16"); else KVK_WGMMA_RS_64("bf16");
  } else {
    if constexpr (kIsF16<T>) KVK_WGMMA_RS_128("f16"); else KVK_WGMMA_RS_128("bf16");
  }
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::wgmma(N, kIsF16<T>, true, 0, a, db, d, scale_d, 1, 1, 0, TB);
#else
  (void)d, (void)a, (void)db, (void)scale_d;
#endif
}

#undef KVK_WGMMA_SS_64
#undef KVK_WGMMA_RS_64
#undef KVK_WGMMA_SS_128
#undef KVK_WGMMA_RS_128

// ---- setmaxnreg -----------------------------------------------------------------------------------
// setmaxnreg.{inc,dec}.sync.aligned.u32 R: the per-thread register limit of every warp of the calling
// warpgroup becomes R (a multiple of 8 in 24..256; all 128 threads the same); .dec gives registers
// back to the CTA's pool, .inc waits until the pool has them.
template <uint32_t R>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: a multiple of 8 in 24..256");
#if KVK_SM90_PTX
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::setmaxnreg(true, R);
#endif
}
template <uint32_t R>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: a multiple of 8 in 24..256");
#if KVK_SM90_PTX
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::setmaxnreg(false, R);
#endif
}

// ---- named barriers -------------------------------------------------------------------------------
// bar.sync id, count: waits until `count` threads (a multiple of 32, whole warps) arrived at barrier
// `id` (1..15; 0 is __syncthreads'); bar.arrive id, count: arrives without waiting.
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t count) {
#if KVK_SM90_PTX
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::named_bar_sync(id, count);
#else
  (void)id, (void)count;
#endif
}
__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t count) {
#if KVK_SM90_PTX
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::named_bar_arrive(id, count);
#else
  (void)id, (void)count;
#endif
}

// ---- mbarriers (shared::cta, 64-bit objects, addressed by their shared-window address) ---------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if KVK_SM90_ASYNC
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::mbarrier_init(bar, count);
#else
  (void)bar, (void)count;
#endif
}

// After the inits, before other threads (or the async proxy) use the barriers (then a __syncthreads).
__device__ __forceinline__ void mbar_init_fence() {
#if KVK_SM90_ASYNC
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival (release semantics: this thread's prior shared-memory reads and writes are ordered before
// the phase completes for a waiter).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if KVK_SM90_ASYNC
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::mbarrier_arrive(bar);
#else
  (void)bar;
#endif
}

// An arrival once every cp.async this thread issued so far has completed (the copies' data visible
// to the barrier's waiters); .noinc: it counts against the barrier's expected arrivals.
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
#if KVK_SM90_ASYNC
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::cp_async_mbarrier_arrive_noinc(bar);
#else
  (void)bar;
#endif
}

// Waits until the phase of parity `parity` has completed (acquire: the arrivals' writes are visible).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if KVK_SM90_ASYNC
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::mbarrier_wait_parity(bar, parity);
#else
  (void)bar, (void)parity;
#endif
}

// fence.proxy.async.shared::cta: orders this thread's generic-proxy shared-memory accesses (st.shared,
// the data of completed cp.async) with later async-proxy ones (wgmma operand reads). The emulator has
// no proxies: a no-op there (csrc/cuda/README.md lists it among what the emulator cannot show).
__device__ __forceinline__ void fence_proxy_async() {
#if KVK_SM90_ASYNC
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

}  // namespace kvkernels::sm90

// =====================================================================================================
// wgmma m64n32k16, mbarrier expect_tx arrivals and TMA 2D loads (first used by the MLA decode,
// mla_attention_sm90.cuh; the TMA paths of mla_decompress use them too).
// =====================================================================================================
namespace kvkernels::sm90 {

#define KVK_WGMMA_SS_32(TY) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " " \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
    "%16, %17, p, 1, 1, %19, %20;\n}\n" \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
    : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB))

// wgmma_ss for m64n32k16 (16 accumulators a thread, the same D layout: acc[4 i + 2 h + e] is row
// 16 w + g + 8 h, column 8 i + 2 t + e): the MLA decode's per-consumer logits, 32 keys of a 64-key tile.
// The emulator's wgmma model takes any n (a multiple of 8 up to 256), so it needs no new model.
template <typename T, int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n32(float (&d)[16], uint64_t da, uint64_t db, int scale_d) {
#if KVK_SM90_PTX
  if constexpr (kIsF16<T>) KVK_WGMMA_SS_32("f16"); else KVK_WGMMA_SS_32("bf16");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::wgmma(32, kIsF16<T>, false, da, nullptr, db, d, scale_d, 1, 1, TA, TB);
#else
  (void)d, (void)da, (void)db, (void)scale_d;
#endif
}

#undef KVK_WGMMA_SS_32

// mbarrier.arrive.expect_tx: one arrival that also expects `bytes` of transactions (bulk copies
// completing on the barrier) in the current phase; the phase completes when both are done.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if KVK_SM90_ASYNC
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::mbarrier_arrive_expect_tx(bar, bytes);
#else
  (void)bar, (void)bytes;
#endif
}

// cp.async.bulk.tensor.2d (TMA): the box of the tensor map `map` (a __grid_constant__ kernel parameter)
// at (column c0, row c1) into shared `dst` (128-byte aligned; 1024 with the 128B swizzle), its bytes
// completing on `bar`. Elements outside the tensor are zero-filled by the copy engine.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar) {
#if KVK_SM90_ASYNC
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::bulk_tensor_load_2d(dst, map, c0, c1, bar);
#else
  (void)dst, (void)map, (void)c0, (void)c1, (void)bar;
#endif
}

// cp.async.bulk.tensor.4d (TMA): as tma_load_2d, the box at coordinates (c0 innermost, c1, c2, c3) of a
// rank-4 map (the wgmma prefill's paged K / V: columns, two of slot / head, block).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
#if KVK_SM90_ASYNC
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  const int c[4] = {c0, c1, c2, c3};
  ::emu::bulk_tensor_load(dst, map, c, 4, bar);
#else
  (void)dst, (void)map, (void)c0, (void)c1, (void)c2, (void)c3, (void)bar;
#endif
}

// prefetch.tensormap: brings the tensor map (a __grid_constant__ kernel parameter) into the cache
// before its first TMA copy.
__device__ __forceinline__ void tma_prefetch_map(const void* map) {
#if KVK_SM90_ASYNC
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#else
  (void)map;
#endif
}

}  // namespace kvkernels::sm90

// =====================================================================================================
// Programmatic dependent launch (PTX ISA 9.7.13.x griddepcontrol; first used by the MLA decode's metadata
// pass and split merge, mla_sched.cuh). A grid launched with cudaLaunchAttributeProgrammaticStreamSerialization
// may start before the grid ahead of it in the stream has finished (once every CTA of that one executed
// griddepcontrol.launch_dependents or exited); griddepcontrol.wait then blocks until that grid has completed
// and its memory is visible. Both are no-ops in a grid launched without the attribute. On every sm_90 target.
// The emulator runs grids one after another, so it models the rule, not the overlap: in a grid launched with
// the attribute, a read of the predecessor's output through griddep_read before the thread's
// griddepcontrol.wait, or a CTA none of whose threads waited, is reported (tests/cuda_emu/cuda_emu.h, PDL).
// =====================================================================================================
namespace kvkernels::sm90 {

// griddepcontrol.wait: the grid this one depends on has completed, its writes visible.
__device__ __forceinline__ void griddep_wait() {
#if KVK_SM90_ASYNC
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::griddep_wait();
#endif
}

// griddepcontrol.launch_dependents: this CTA lets the dependent grid be scheduled (a hint: the dependent
// still waits for this grid's completion at its griddepcontrol.wait).
__device__ __forceinline__ void griddep_launch_dependents() {
#if KVK_SM90_ASYNC
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#elif defined(KVKERNELS_CUDA_EMU)
  ::emu::griddep_launch_dependents();
#endif
}

// A plain load of data the predecessor grid wrote (legal only after griddep_wait; the emulator checks).
template <typename T>
__device__ __forceinline__ T griddep_read(const T* p) {
#if defined(KVKERNELS_CUDA_EMU) && !defined(__CUDA_ARCH__)
  ::emu::griddep_check_read();
#endif
  return *p;
}

}  // namespace kvkernels::sm90
