// 8 x float32 in a ymm register (AVX2 + FMA + F16C); the same interface as vec_avx512.h. Head
// dims are multiples of 8, so a row is always whole vectors and the lane mask is unused.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "convert.h"

namespace kvkernels::cpu::avx2 {

struct Vec {
  static constexpr int N = 8;
  using Mask = int;
  __m256 v;

  static Mask mask(int) { return 0; }
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }

  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const float* p, Mask) { return load(p); }
  static Vec load(const c10::BFloat16* p, Mask) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
  static Vec load(const c10::Half* p, Mask) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // See vec_avx512.h for the e4m3 -> fp16 shift.
  static Vec load(const fp8_e4m3* p, Mask) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7),
                                   _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
    const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
    const __m256 nan = _mm256_castsi256_ps(
        _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
    return {_mm256_blendv_ps(f, _mm256_set1_ps(__builtin_nanf("")), nan)};
  }
  static Vec load(const fp8_e5m2* p, Mask) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_cvtph_ps(_mm_slli_epi16(w, 8))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }

  static float first(__m128 x) { return _mm_cvtss_f32(x); }
  float sum() const {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return first(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  float max() const {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return first(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static void sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
    // hadd(hadd(a, b), hadd(c, d)) = [a, b, c, d] partial sums in each 128-bit half.
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a.v, b.v), _mm256_hadd_ps(c.v, d.v));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }

  // e^x as in vec_avx512.h; 2^n is built in the exponent field, so x is clamped to the normal
  // range and anything below it (including -inf) is forced to exactly 0. NaN stays NaN (the clamp
  // returns its second operand, v, for NaN; the final mask keeps lanes "not <= -87", NaN included).
  Vec exp() const {
    const __m256 x = _mm256_max_ps(_mm256_set1_ps(-87.0f), v);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i pow2n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
    return {_mm256_and_ps(e, _mm256_cmp_ps(v, _mm256_set1_ps(-87.0f), _CMP_NLE_UQ))};
  }
  // tanh as in vec_avx512.h: (1 - e^-2|x|) / (1 + e^-2|x|) for |x| >= 1/4, the odd Taylor polynomial
  // to x^9 below (where the subtraction cancels: a soft cap of 1e8 gave tanh = 0).
  Vec tanh() const {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign_bit, v);
    const __m256 e = Vec{_mm256_mul_ps(a, _mm256_set1_ps(-2.0f))}.exp().v;
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e),
                                   _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    const __m256 a2 = _mm256_mul_ps(a, a);
    __m256 p = _mm256_set1_ps(62.0f / 2835);
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-17.0f / 315));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(2.0f / 15));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-1.0f / 3));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(a, a2), p, a);
    const __m256 r = _mm256_blendv_ps(t, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_LT_OQ));
    return {_mm256_or_ps(r, _mm256_and_ps(sign_bit, v))};
  }
};

// Free functions, not in-class friends: GCC does not apply `#pragma GCC target` to friends.
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

}  // namespace kvkernels::cpu::avx2
