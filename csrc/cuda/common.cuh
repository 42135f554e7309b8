// Device-side helpers shared by the CUDA kernels (torch-free): element types and their float32
// conversions, 16-byte (or narrower) vector loads and stores, fast 32-bit division by a runtime
// divisor, and the format dispatch the launchers use.
//
// Conversions are the ones the CPU kernels and kvkernels.reference use, so results are
// bit-identical where the CPU's are: half/bfloat16 round to nearest even (__float2half_rn,
// __float2bfloat16_rn), fp8 goes through kvkernels/fp8.h (the same encoder and decoder as the CPU
// backend: no hardware cvt, which sm_80 lacks and whose NaN encoding differs). fp8 quantization
// divides in float32 (x / scale, IEEE division): never build these files with --use_fast_math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvkernels/common.h"
#include "kvkernels/fp8.h"
#include "kvkernels/params.h"

namespace kvkernels::cuda {

// ---- element types ---------------------------------------------------------------------------

struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};

template <typename T>
constexpr bool is_fp8_type = std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(fp8_e4m3 x) { return e4m3_to_float(x.bits); }
__device__ __forceinline__ float to_float(fp8_e5m2 x) { return e5m2_to_float(x.bits); }

// float -> float / half / bfloat16, rounding to nearest even (what torch's .to() does).
template <typename T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else return __float2bfloat16_rn(x);
}

// float -> cache element; fp8 stores quantize(x / scale) (docs/design.md §3).
template <typename C>
__device__ __forceinline__ C to_cache(float x, float scale) {
  if constexpr (std::is_same_v<C, fp8_e4m3>) return fp8_e4m3{quantize_e4m3(x, scale)};
  else if constexpr (std::is_same_v<C, fp8_e5m2>) return fp8_e5m2{quantize_e5m2(x, scale)};
  else return from_float<C>(x);
}

// ---- vector loads and stores -----------------------------------------------------------------

// The unsigned type of a BYTES-wide access (one ld/st instruction).
template <int BYTES>
struct raw_type;
template <> struct raw_type<16> { using type = uint4; };
template <> struct raw_type<8> { using type = uint2; };
template <> struct raw_type<4> { using type = uint32_t; };
template <> struct raw_type<2> { using type = uint16_t; };
template <> struct raw_type<1> { using type = uint8_t; };

// N consecutive elements, moved with one access of N * sizeof(T) bytes (a power of two <= 16);
// the address must be aligned to that size (the launchers check it before picking N).
template <typename T, int N>
struct Pack {
  static constexpr int kBytes = N * int(sizeof(T));
  using Raw = typename raw_type<kBytes>::type;
  T v[N];

  __device__ __forceinline__ static Pack load(const T* p) {
    const Raw r = *reinterpret_cast<const Raw*>(p);
    Pack out;
    memcpy(&out.v, &r, sizeof(Raw));  // register moves, no local memory
    return out;
  }
  __device__ __forceinline__ void store(T* p) const {
    Raw r;
    memcpy(&r, &v, sizeof(Raw));
    *reinterpret_cast<Raw*>(p) = r;
  }
};

// Largest power of two <= max_bytes that divides every value (addresses, strides in bytes, row
// widths in bytes): the widest access every row of an operation can use.
KVK_HOST_DEVICE int common_alignment(const int64_t* values, int count, int max_bytes) {
  int align = max_bytes;
  for (int i = 0; i < count; ++i)
    while (align > 1 && values[i] % align != 0) align /= 2;
  return align;
}

// ---- division by a runtime divisor -----------------------------------------------------------

// n / d and n % d for 0 <= n < 2^31 and 1 <= d < 2^31 with a multiply-high, add and shift
// (round-up method): s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1, q = (mulhi(n, m) + n) >> s.
// The launchers keep every index they divide below 2^31 (they split launches that would not).
struct FastDiv {
  uint32_t d = 1, m = 1, s = 0;

  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    while ((uint64_t{1} << s) < d) ++s;
    m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << s) - d)) / d + 1);
  }
  __host__ __device__ __forceinline__ uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, m);
#else
    const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * m) >> 32);
#endif
    return (hi + n) >> s;
  }
  // Quotient and remainder.
  __host__ __device__ __forceinline__ uint32_t divmod(uint32_t n, uint32_t* rem) const {
    const uint32_t q = div(n);
    *rem = n - q * d;
    return q;
  }
};

// ---- format dispatch (host) ------------------------------------------------------------------

template <typename T>
struct type_tag {
  using type = T;
};

// fn(type_tag<T>) for the element type of a float format; returns what fn returns.
template <typename F>
auto dispatch_float(FloatFormat f, F&& fn) {
  switch (f) {
    case FloatFormat::kFloat16: return fn(type_tag<__half>{});
    case FloatFormat::kBFloat16: return fn(type_tag<__nv_bfloat16>{});
    default: return fn(type_tag<float>{});
  }
}

template <typename F>
auto dispatch_cache(CacheFormat f, F&& fn) {
  switch (f) {
    case CacheFormat::kFloat16: return fn(type_tag<__half>{});
    case CacheFormat::kBFloat16: return fn(type_tag<__nv_bfloat16>{});
    case CacheFormat::kFp8E4M3: return fn(type_tag<fp8_e4m3>{});
    case CacheFormat::kFp8E5M2: return fn(type_tag<fp8_e5m2>{});
    default: return fn(type_tag<float>{});
  }
}

// A cache that is not fp8 has the dtype of the float tensors it is used with (validated by the
// binding), so only (T, T) and (T, fp8) pairs are instantiated.
template <typename F>
auto dispatch_float_and_cache(FloatFormat ff, CacheFormat cf, F&& fn) {
  return dispatch_float(ff, [&](auto ft) {
    using T = typename decltype(ft)::type;
    switch (cf) {
      case CacheFormat::kFp8E4M3: return fn(ft, type_tag<fp8_e4m3>{});
      case CacheFormat::kFp8E5M2: return fn(ft, type_tag<fp8_e5m2>{});
      default: return fn(ft, type_tag<T>{});
    }
  });
}

constexpr int kThreads = 256;  // threads per CTA of the cache-op kernels (memory-bound, no smem)

inline unsigned blocks_for(int64_t work_items, int per_block) {
  return static_cast<unsigned>(ceil_div(work_items, per_block));
}

}  // namespace kvkernels::cuda
