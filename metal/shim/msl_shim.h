// MSL-as-C++17 shim: lets g++ / clang parse kvkernels' Metal Shading Language kernels on Linux.
//
// Two users:
//   * the type-check (scripts/check_metal.py): every metal/*.metal file, in every variant the
//     dispatch code can request, compiled with -fsyntax-only through this header;
//   * the emulator (kvkernels/metal/emulator.py): the same sources compiled into a shared library
//     with MSL_EMULATOR defined, where metal/shim/emu_runtime.h supplies barriers, SIMD-group
//     collectives and threadgroup memory.
//
// What it provides: the address-space keywords (device, thread, threadgroup -> nothing; constant ->
// const, so a write through a constant pointer is a compile error), `kernel`, MSL scalar names
// (uint, ushort, uchar, half, bfloat), vector types vec<T, N> with MSL constructors, elementwise
// operators and swizzles (.xy, .zyx, .rgba: union proxies generated into msl_swizzles.inc), the
// math functions the kernels use (also in the fast:: and precise:: namespaces), as_type<T>, and
// the SIMD-group / barrier declarations.
//
// What it cannot check (see metal/README.md): address-space mismatches (a threadgroup pointer
// passed where a device pointer is expected), MSL's ban on double and recursion, attributes.
#pragma once

// Standard headers first: the address-space macros below would break them.
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#ifdef MSL_EMULATOR  // the runtime's headers, also before the macros
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>
#endif

#define device
#define thread
#define threadgroup
#define constant const
#define kernel
#define METAL_FUNC inline

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;  // MSL long/ulong are 64-bit, as on LP64 Linux
#if defined(__FLT16_MAX__)
typedef _Float16 half;  // g++ >= 12 and recent clang on x86-64; conversions round to nearest even
#else
// Compilers without _Float16 on this target (clang 14 on x86-64): IEEE half in software, converted
// to and from float with round to nearest even; arithmetic goes through float.
struct half {
  unsigned short bits = 0;
  half() = default;
  half(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    const unsigned sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) { bits = (unsigned short)(sign | 0x7E00u); return; }
    if (a >= 0x477FF000u) { bits = (unsigned short)(sign | 0x7C00u); return; }  // rounds to inf
    if (a < 0x38800000u) {  // below 2^-14: subnormal half, steps of 2^-24
      const unsigned e = a >> 23;
      if (e < 102u) { bits = (unsigned short)sign; return; }
      const unsigned m = (a & 0x7FFFFFu) | 0x800000u, sh = 126u - e;
      unsigned q = m >> sh;
      const unsigned rem = m & ((1u << sh) - 1u), hlf = 1u << (sh - 1u);
      q += (rem > hlf || (rem == hlf && (q & 1u))) ? 1u : 0u;
      bits = (unsigned short)(sign | q);
      return;
    }
    const unsigned r = a + 0xFFFu + ((a >> 13) & 1u);
    bits = (unsigned short)(sign | (((r >> 23) - 112u) << 10) | ((r >> 13) & 0x3FFu));
  }
  operator float() const {
    const unsigned sign = (bits & 0x8000u) << 16, e = (bits >> 10) & 0x1Fu, m = bits & 0x3FFu;
    unsigned u;
    if (e == 0x1Fu) {
      u = sign | 0x7F800000u | (m << 13);
    } else if (e == 0) {
      float f = float(m) * 5.9604644775390625e-8f;  // m * 2^-24
      std::memcpy(&u, &f, 4);
      u |= sign;
    } else {
      u = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
#endif

#ifndef HALF_MAX
#define HALF_MAX 65504.0f
#endif
#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif

// bfloat (MSL 3.1): software type, round to nearest even from float.
struct bfloat {
  ushort bits = 0;
  bfloat() = default;
  bfloat(float f) {
    uint u;
    std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? ushort(0x7FC0 | ((u >> 16) & 0x8000)) : ushort((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
  operator float() const {
    uint u = uint(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// ---------------------------------------------------------------------------------------------
// vectors
// ---------------------------------------------------------------------------------------------

namespace metal {

template <typename T, int N>
struct vec;

// Operators live as hidden friends of vec_ops<T, N>, a base of both vec<T, N> and the swizzle
// proxies, so `a.xy + b.zw` and `v * 2.0f` find them with implicit conversions.
template <typename T, int N>
struct vec_ops {
#define MSL_VEC_BINOP(op)                                                                       \
  friend vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {                       \
    vec<T, N> r;                                                                                \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] op b[i]);                                         \
    return r;                                                                                   \
  }                                                                                             \
  friend vec<T, N> operator op(const vec<T, N>& a, T b) { return a op vec<T, N>(b); }           \
  friend vec<T, N> operator op(T a, const vec<T, N>& b) { return vec<T, N>(a) op b; }
  MSL_VEC_BINOP(+)
  MSL_VEC_BINOP(-)
  MSL_VEC_BINOP(*)
  MSL_VEC_BINOP(/)
#undef MSL_VEC_BINOP
#define MSL_VEC_CMP(op)                                                                         \
  friend vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {                    \
    vec<bool, N> r;                                                                             \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                                            \
    return r;                                                                                   \
  }
  MSL_VEC_CMP(==)
  MSL_VEC_CMP(!=)
  MSL_VEC_CMP(<)
  MSL_VEC_CMP(<=)
  MSL_VEC_CMP(>)
  MSL_VEC_CMP(>=)
#undef MSL_VEC_CMP
  // Vector functions as hidden friends too, so that swizzles convert (dot(v.xy, v.zw)).
  friend T dot(const vec<T, N>& a, const vec<T, N>& b) {
    T s = T(0);
    for (int i = 0; i < N; ++i) s += a[i] * b[i];
    return s;
  }
  friend vec<T, N> operator-(const vec<T, N>& a) {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = T(-a[i]);
    return r;
  }
};

// A swizzle: a view of elements I... of the N elements it overlays in the vector's union.
template <typename T, int N, int... I>
struct swz : vec_ops<T, int(sizeof...(I))> {
  T e[N];
  static constexpr int K = int(sizeof...(I));
  operator vec<T, K>() const { return vec<T, K>(e[I]...); }
  swz& operator=(const vec<T, K>& o) {
    const int idx[K] = {I...};
    for (int k = 0; k < K; ++k) e[idx[k]] = o[k];
    return *this;
  }
};

template <typename T, int N>
struct vec_base;

template <typename T>
struct vec_base<T, 2> : vec_ops<T, 2> {
  union {
    T e[2];
    struct { T x, y; };
    struct { T r, g; };
#define MSL_SWZ_N 2
#include "msl_swizzles.inc"
#undef MSL_SWZ_N
  };
};
template <typename T>
struct vec_base<T, 3> : vec_ops<T, 3> {
  union {
    T e[4];  // a 3-vector has the size and alignment of a 4-vector, as in MSL
    struct { T x, y, z; };
    struct { T r, g, b; };
#define MSL_SWZ_N 3
#include "msl_swizzles.inc"
#undef MSL_SWZ_N
  };
};
template <typename T>
struct vec_base<T, 4> : vec_ops<T, 4> {
  union {
    T e[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
#define MSL_SWZ_N 4
#include "msl_swizzles.inc"
#undef MSL_SWZ_N
  };
};

template <int N>
constexpr int vec_align(int size) { return N == 3 ? 4 * size : N * size; }

template <typename T, int N>
struct alignas(vec_align<N>(sizeof(T))) vec : vec_base<T, N> {
  using vec_base<T, N>::e;
  vec() { for (int i = 0; i < N; ++i) e[i] = T(0); }
  vec(T s) { for (int i = 0; i < N; ++i) e[i] = s; }  // splat
  template <typename... A, typename = std::enable_if_t<(sizeof...(A) >= 2)>>
  vec(const A&... parts) {
    int k = 0;
    (put(k, parts), ...);
  }
  // float4(half4): explicit element conversion between vector types of the same length.
  template <typename U, typename = std::enable_if_t<!std::is_same<U, T>::value>>
  explicit vec(const vec<U, N>& o) { for (int i = 0; i < N; ++i) e[i] = T(o[i]); }
  vec(const vec& o) { for (int i = 0; i < N; ++i) e[i] = o.e[i]; }
  vec& operator=(const vec& o) {
    for (int i = 0; i < N; ++i) e[i] = o.e[i];
    return *this;
  }
  T& operator[](int i) { return e[i]; }
  const T& operator[](int i) const { return e[i]; }
#define MSL_VEC_CASSIGN(op)                                                                     \
  vec& operator op##=(const vec& o) { return *this = *this op o; }                               \
  vec& operator op##=(T s) { return *this = *this op vec(s); }
  MSL_VEC_CASSIGN(+)
  MSL_VEC_CASSIGN(-)
  MSL_VEC_CASSIGN(*)
  MSL_VEC_CASSIGN(/)
#undef MSL_VEC_CASSIGN

 private:
  template <typename S>
  void put(int& k, const S& s) {
    if constexpr (std::is_arithmetic<S>::value || std::is_same<S, half>::value) {
      e[k++] = T(s);
    } else {
      const auto v = static_cast<vec<T, std::remove_reference_t<decltype(s)>::K>>(s);
      for (int i = 0; i < std::remove_reference_t<decltype(s)>::K; ++i) e[k++] = v[i];
    }
  }

 public:
  static constexpr int K = N;
};

}  // namespace metal

#define MSL_VEC_TYPES(T, name)               \
  typedef metal::vec<T, 2> name##2;          \
  typedef metal::vec<T, 3> name##3;          \
  typedef metal::vec<T, 4> name##4;
MSL_VEC_TYPES(float, float)
MSL_VEC_TYPES(half, half)
MSL_VEC_TYPES(int, int)
MSL_VEC_TYPES(uint, uint)
MSL_VEC_TYPES(short, short)
MSL_VEC_TYPES(ushort, ushort)
MSL_VEC_TYPES(char, char)
MSL_VEC_TYPES(uchar, uchar)
MSL_VEC_TYPES(bool, bool)
MSL_VEC_TYPES(long, long)
MSL_VEC_TYPES(ulong, ulong)
#undef MSL_VEC_TYPES

// ---------------------------------------------------------------------------------------------
// math (scalars; the kernels do their arithmetic in float)
// ---------------------------------------------------------------------------------------------

namespace metal {

template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To r;
  std::memcpy(&r, &x, sizeof(To));
  return r;
}

#define MSL_MATH1(name, impl)                                 \
  inline float name(float x) { return impl(x); }             \
  inline half name(half x) { return half(impl(float(x))); }
MSL_MATH1(exp, std::exp)
MSL_MATH1(exp2, std::exp2)
MSL_MATH1(log, std::log)
MSL_MATH1(log2, std::log2)
MSL_MATH1(tanh, std::tanh)
MSL_MATH1(sqrt, std::sqrt)
MSL_MATH1(floor, std::floor)
MSL_MATH1(ceil, std::ceil)
MSL_MATH1(rint, std::nearbyint)
MSL_MATH1(round, std::round)
MSL_MATH1(trunc, std::trunc)
MSL_MATH1(fabs, std::fabs)
#undef MSL_MATH1
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float pow(float a, float b) { return std::pow(a, b); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
inline bool signbit(float x) { return std::signbit(x); }

template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }
inline int abs(int x) { return x < 0 ? -x : x; }
inline long abs(long x) { return x < 0 ? -x : x; }
inline float abs(float x) { return std::fabs(x); }
inline half abs(half x) { return half(std::fabs(float(x))); }

namespace fast {
using metal::exp;
using metal::exp2;
using metal::log;
using metal::rsqrt;
using metal::tanh;
using metal::sqrt;
using metal::max;
using metal::min;
inline float divide(float a, float b) { return a / b; }
}  // namespace fast
namespace precise {
using metal::exp;
using metal::exp2;
using metal::log;
using metal::rsqrt;
using metal::tanh;
using metal::sqrt;
using metal::max;
using metal::min;
inline float divide(float a, float b) { return a / b; }
}  // namespace precise

// ---------------------------------------------------------------------------------------------
// barriers and SIMD-group functions (Apple GPUs: 32 lanes per SIMD group)
// ---------------------------------------------------------------------------------------------

enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }

struct simd_vote {
  ulong v = 0;
  explicit operator ulong() const { return v; }
  bool all() const;
  bool any() const { return v != 0; }
};

}  // namespace metal

// The call site (line, column) identifies a barrier or collective for the emulator; the default
// arguments are evaluated where the kernel calls the function.
#if defined(__clang__)
#define MSL_COLUMN __builtin_COLUMN()
#else
#define MSL_COLUMN 0u  // g++ 12 has no __builtin_COLUMN: sites are (file, line)
#endif
#define MSL_SITE unsigned msl_line = __builtin_LINE(), unsigned msl_col = MSL_COLUMN

#ifdef MSL_EMULATOR
#include "emu_runtime.h"
#else
namespace metal {
inline void threadgroup_barrier(mem_flags, MSL_SITE) {}
inline void simdgroup_barrier(mem_flags, MSL_SITE) {}
template <typename T> inline T simd_sum(T x, MSL_SITE) { return x; }
template <typename T> inline T simd_product(T x, MSL_SITE) { return x; }
template <typename T> inline T simd_max(T x, MSL_SITE) { return x; }
template <typename T> inline T simd_min(T x, MSL_SITE) { return x; }
template <typename T> inline T simd_and(T x, MSL_SITE) { return x; }
template <typename T> inline T simd_or(T x, MSL_SITE) { return x; }
template <typename T> inline T simd_xor(T x, MSL_SITE) { return x; }
template <typename T> inline T simd_prefix_exclusive_sum(T x, MSL_SITE) { return x; }
template <typename T> inline T simd_prefix_inclusive_sum(T x, MSL_SITE) { return x; }
template <typename T> inline T simd_shuffle(T x, ushort lane, MSL_SITE) { return x; }
template <typename T> inline T simd_shuffle_xor(T x, ushort mask, MSL_SITE) { return x; }
template <typename T> inline T simd_shuffle_down(T x, ushort delta, MSL_SITE) { return x; }
template <typename T> inline T simd_shuffle_up(T x, ushort delta, MSL_SITE) { return x; }
template <typename T> inline T simd_broadcast(T x, ushort lane, MSL_SITE) { return x; }
template <typename T> inline T simd_broadcast_first(T x, MSL_SITE) { return x; }
inline bool simd_all(bool x, MSL_SITE) { return x; }
inline bool simd_any(bool x, MSL_SITE) { return x; }
inline simd_vote simd_ballot(bool x, MSL_SITE) { return simd_vote{ulong(x)}; }
inline bool simd_is_first(MSL_SITE) { return true; }
inline bool simd_vote::all() const { return v != 0; }
}  // namespace metal
#endif

using namespace metal;
