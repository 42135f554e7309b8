// fp8 (OCP e4m3fn and e5m2) <-> float32 conversion, bit-exact with PyTorch's `.to(float8_*)` for
// finite values inside the format's range. Quantization clamps first (docs/design.md §3: values beyond
// the finite range saturate to ±448 / ±57344), so the encoders never produce inf.
//
// Rounding trick used by both encoders: for a normal result, keep the top mantissa bits of the
// float32 pattern and round to nearest even by adding (half ulp - 1 + lowest kept bit) before the
// shift; a carry out of the mantissa correctly bumps the exponent. Results below the smallest normal
// are subnormal multiples of 2^-9 (e4m3) / 2^-16 (e5m2): scale by the inverse step (exact) and
// round to nearest even with rint.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvkernels/common.h"

namespace kvkernels {

constexpr float kFp8E4M3Max = 448.0f;
constexpr float kFp8E5M2Max = 57344.0f;

KVK_HOST_DEVICE uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

KVK_HOST_DEVICE float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Encodes x, already clamped to [-448, 448] (or NaN), as e4m3fn.
KVK_HOST_DEVICE uint8_t float_to_e4m3(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;  // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448: saturate (callers clamp; keeps inf out)
  if (a < 0x3c800000u) {                     // < 2^-6: subnormal, step 2^-9
    return sign | static_cast<uint8_t>(rintf(bits_float(a) * 512.0f));
  }
  const uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return sign | static_cast<uint8_t>(rounded - (120u << 3));  // rebias 127 -> 7
}

// Encodes x, already clamped to [-57344, 57344] (or NaN), as e5m2.
KVK_HOST_DEVICE uint8_t float_to_e5m2(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;  // NaN
  if (a >= 0x47600000u) return sign | 0x7b;  // >= 57344: saturate
  if (a < 0x38800000u) {                     // < 2^-14: subnormal, step 2^-16
    return sign | static_cast<uint8_t>(rintf(bits_float(a) * 65536.0f));
  }
  const uint32_t rounded = (a + 0xfffffu + ((a >> 21) & 1u)) >> 21;
  return sign | static_cast<uint8_t>(rounded - (112u << 2));  // rebias 127 -> 15
}

KVK_HOST_DEVICE float e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t man = b & 0x7u;
  if (exp == 0) {
    const float mag = static_cast<float>(man) * (1.0f / 512.0f);
    return bits_float(float_bits(mag) | sign);
  }
  if (exp == 0xf && man == 0x7) return bits_float(sign | 0x7fc00000u);  // NaN
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

KVK_HOST_DEVICE float e5m2_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 2) & 0x1fu;
  const uint32_t man = b & 0x3u;
  if (exp == 0) {
    const float mag = static_cast<float>(man) * (1.0f / 65536.0f);
    return bits_float(float_bits(mag) | sign);
  }
  if (exp == 0x1f) return bits_float(sign | (man == 0 ? 0x7f800000u : 0x7fc00000u));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 21));
}

// The quantization rule of docs/design.md §3: divide in float32, clamp, round to nearest even.
KVK_HOST_DEVICE uint8_t quantize_e4m3(float x, float scale) {
  const float q = x / scale;
  return float_to_e4m3(q != q ? q : fminf(fmaxf(q, -kFp8E4M3Max), kFp8E4M3Max));
}

KVK_HOST_DEVICE uint8_t quantize_e5m2(float x, float scale) {
  const float q = x / scale;
  return float_to_e5m2(q != q ? q : fminf(fmaxf(q, -kFp8E5M2Max), kFp8E5M2Max));
}

}  // namespace kvkernels
