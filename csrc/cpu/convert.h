// CPU element types and conversions to/from float32, plus lambda-based dispatch on the formats of
// csrc/include/kvkernels/params.h. Kernels are templates on element types; these helpers pick the
// instantiation once per call, never per element.
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <stdexcept>
#include <type_traits>

#include "kvkernels/fp8.h"
#include "kvkernels/params.h"

namespace kvkernels::cpu {

struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};

template <typename T>
struct type_tag {
  using type = T;
};

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(fp8_e4m3 x) { return e4m3_to_float(x.bits); }
inline float to_float(fp8_e5m2 x) { return e5m2_to_float(x.bits); }

template <typename T>
constexpr bool is_fp8_type = std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>;

// Rounds to nearest even (the conversion PyTorch's .to() uses for half / bfloat16).
template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T(x);
}

// Stores x into a cache element; fp8 quantizes with `scale` (docs/design.md §3).
template <typename T>
inline T to_cache(float x, float scale) {
  if constexpr (std::is_same_v<T, fp8_e4m3>) return fp8_e4m3{quantize_e4m3(x, scale)};
  else if constexpr (std::is_same_v<T, fp8_e5m2>) return fp8_e5m2{quantize_e5m2(x, scale)};
  else return from_float<T>(x);
}

// Reads n cache elements as float32, dequantizing fp8 with `scale`.
template <typename T>
inline void load_row(const T* src, int n, float scale, float* dst) {
  if constexpr (is_fp8_type<T>) {
    for (int i = 0; i < n; ++i) dst[i] = to_float(src[i]) * scale;
  } else {
    for (int i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  }
}

template <typename F>
void dispatch_float(FloatFormat f, F&& fn) {
  switch (f) {
    case FloatFormat::kFloat32: return fn(type_tag<float>{});
    case FloatFormat::kFloat16: return fn(type_tag<c10::Half>{});
    case FloatFormat::kBFloat16: return fn(type_tag<c10::BFloat16>{});
  }
  throw std::logic_error("kvkernels: unknown float format");
}

template <typename F>
void dispatch_cache(CacheFormat f, F&& fn) {
  switch (f) {
    case CacheFormat::kFloat32: return fn(type_tag<float>{});
    case CacheFormat::kFloat16: return fn(type_tag<c10::Half>{});
    case CacheFormat::kBFloat16: return fn(type_tag<c10::BFloat16>{});
    case CacheFormat::kFp8E4M3: return fn(type_tag<fp8_e4m3>{});
    case CacheFormat::kFp8E5M2: return fn(type_tag<fp8_e5m2>{});
  }
  throw std::logic_error("kvkernels: unknown cache format");
}

// A cache whose dtype is not fp8 always has the dtype of the float tensors it is used with, so
// only (T, T) and (T, fp8) pairs are instantiated.
template <typename F>
void dispatch_float_and_cache(FloatFormat ff, CacheFormat cf, F&& fn) {
  dispatch_float(ff, [&](auto ft) {
    using T = typename decltype(ft)::type;
    switch (cf) {
      case CacheFormat::kFp8E4M3: return fn(ft, type_tag<fp8_e4m3>{});
      case CacheFormat::kFp8E5M2: return fn(ft, type_tag<fp8_e5m2>{});
      default: return fn(ft, type_tag<T>{});
    }
  });
}

}  // namespace kvkernels::cpu
