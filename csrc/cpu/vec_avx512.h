// 16 x float32 in a zmm register: loads that convert every cache format in registers, and the few
// reductions the attention kernels need. Include only inside an AVX-512 target region (see
// attention_avx512.cpp); the types live in the namespace KVK_ISA names, so no symbol is shared with
// the other builds of the same templates. It also provides Words (KVK_WORDS), 32 bf16 values per
// register: the form in which bf16 rows, and with KVK_AVX512_VBMI fp8 rows, are read.
#pragma once

#include "x86_intrinsics.h"

#include <cstdint>

#include "convert.h"

namespace kvkernels::cpu::KVK_ISA {

struct Vec {
  static constexpr int N = 16;
  using Mask = __mmask16;  // lanes to load; the rest read as 0
  __m512 v;

  static Mask mask(int n) { return n >= N ? Mask(0xFFFF) : Mask((1u << n) - 1); }
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }

  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const float* p, Mask m) { return {_mm512_maskz_loadu_ps(m, p)}; }
  static Vec load(const c10::BFloat16* p, Mask m) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  static Vec load(const c10::Half* p, Mask m) {
    return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p))};
  }
  // e4m3 -> fp16 is a shift: the fp16 number with the same sign/exponent/mantissa bits is the
  // e4m3 value times 2^-8 (subnormals included), so scale by 256 after the exact fp16 -> fp32.
  // 0x7f/0xff (the only NaN) would land on a finite fp16 and is patched.
  static Vec load(const fp8_e4m3* p, Mask m) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
    const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                                      _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
    const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
    return {_mm512_mask_mov_ps(f, nan, _mm512_set1_ps(__builtin_nanf("")))};
  }
  // e5m2 is the top byte of an fp16.
  static Vec load(const fp8_e5m2* p, Mask m) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
    return {_mm512_cvtph_ps(_mm256_slli_epi16(w, 8))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }

  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }

  // out[i] = sum of the lanes of vector i: one shuffle tree for four dot products.
  static void sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
    // Fold 512 -> 128-bit quarters, two vectors per register: [a0+a2, a1+a3, b0+b2, b1+b3].
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x44),
                                    _mm512_shuffle_f32x4(a.v, b.v, 0xee));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c.v, d.v, 0x44),
                                    _mm512_shuffle_f32x4(c.v, d.v, 0xee));
    // One quarter per vector: [a, b, c, d], then sum the four lanes of each quarter.
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4e));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));
    const __m512i lane0 = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(lane0, t)));
  }

  // e^x to ~2 ulp: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor polynomial, times 2^n
  // with scalef. Results below FLT_MIN (x < -87.33, -inf included) are exactly 0: denormal weights
  // would add nothing to a softmax and, as FMA inputs, slowed the attention kernels 4-5x (measured
  // by the generate() benchmark without flush-to-zero). NaN gives NaN: vmaxps returns its second
  // operand when either is NaN, so x is the clamp of v with v second, and the "normal" mask is
  // "not below -87.33" (true for NaN). (e^+inf is NaN, never asked for: arguments are <= 0.)
  Vec exp() const {
    const __m512 x = _mm512_max_ps(_mm512_set1_ps(-104.0f), v);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __mmask16 normal = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.33f), _CMP_NLT_UQ);
    return {_mm512_maskz_scalef_ps(normal, p, n)};
  }
  // tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|) for |x| >= 1/4. Below that 1 - e^-2|x| cancels
  // (relative error ~ ulp / |x|: 0 for |x| < 6e-8, which a soft cap of 1e8 reaches), so small |x| take
  // the odd Taylor polynomial to x^9, whose first omitted term is < 1e-8 relative at |x| = 1/4.
  // NaN fails the |x| < 1/4 test and stays NaN through exp(); +-inf give +-1.
  Vec tanh() const {
    const __m512 sign = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(int(0x80000000u))));
    const __m512 a = _mm512_abs_ps(v);
    const __m512 e = Vec{_mm512_mul_ps(a, _mm512_set1_ps(-2.0f))}.exp().v;
    __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    const __m512 a2 = _mm512_mul_ps(a, a);
    __m512 p = _mm512_set1_ps(62.0f / 2835);
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-17.0f / 315));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(2.0f / 15));
    p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-1.0f / 3));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(a, a2), p, a);
    t = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_LT_OQ), small);
    return {_mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(t), _mm512_castps_si512(sign)))};
  }
};

// Free functions, not in-class friends: GCC does not apply `#pragma GCC target` to friends.
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// 32 bf16 values in a zmm register. Widened by split() they cost one op per 16 values where the
// in-order widening of Vec::load costs two (one of them a shuffle); the kernel keeps its operands
// in the matching [even, odd] order instead (attention_kernel.h).
#define KVK_WORDS 1
struct Words {
  static constexpr int N = 32;
  using Mask = __mmask32;
  __m512i v;

  static Mask mask(int n) { return n >= N ? Mask(0xFFFFFFFFu) : Mask((1u << n) - 1); }
  // Values 0, 2, 4, ... into `even` and 1, 3, 5, ... into `odd` as float32: a bf16 is the top half
  // of a float32, so this is one shift and one mask, where an in-order widening takes a shuffle.
  void split(Vec* even, Vec* odd) const {
    *even = {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
    *odd = {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))))};
  }
};

// Reads cache rows of type C as Words, for the C with kWordRows<C>.
template <typename C>
struct WordLoader;
#if defined(KVK_AVX512_VBMI)
template <typename C>
constexpr bool kWordRows = std::is_same_v<C, c10::BFloat16> || is_fp8_type<C>;
#else
template <typename C>
constexpr bool kWordRows = std::is_same_v<C, c10::BFloat16>;
#endif

template <>
struct WordLoader<c10::BFloat16> {
  Words load(const c10::BFloat16* p, Words::Mask m) const {
    return {_mm512_maskz_loadu_epi16(m, p)};
  }
};

#if defined(KVK_AVX512_VBMI)
// fp8 -> bf16 is exact for every code (NaN and inf included), so it is a table lookup: vpermi2b
// looks up 64 bytes at once in a 128-entry byte table indexed by the low 7 bits (the magnitude).
// Each input byte is first duplicated into both bytes of its word, then one table gives the low
// byte and another the high byte of bf16(|x|), and the sign is copied from bit 7 of the input.
template <typename F>
struct Fp8WordLoader {
  __m512i lo0, lo1, hi0, hi1, dup;
  Fp8WordLoader() {
    alignas(64) uint8_t lo[128], hi[128], d[64];
    for (int mag = 0; mag < 128; ++mag) {
      const float f = to_float(F{uint8_t(mag)});
      const uint32_t bits = f != f ? 0x7fc00000u : float_bits(f);  // keep NaN a NaN in 16 bits
      lo[mag] = uint8_t(bits >> 16), hi[mag] = uint8_t(bits >> 24);
    }
    for (int i = 0; i < 64; ++i) d[i] = uint8_t(i / 2);
    lo0 = _mm512_load_si512(lo), lo1 = _mm512_load_si512(lo + 64);
    hi0 = _mm512_load_si512(hi), hi1 = _mm512_load_si512(hi + 64);
    dup = _mm512_load_si512(d);
  }
  Words load(const F* p, Words::Mask m) const {
    const __m512i b = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(m, p));
    const __m512i x = _mm512_permutexvar_epi8(dup, b);  // byte 2i and 2i+1 = input byte i
    const __m512i w = _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull,
                                             _mm512_permutex2var_epi8(lo0, x, lo1),
                                             _mm512_permutex2var_epi8(hi0, x, hi1));
    // w | (x & 0x8000): the sign bit of the high input byte. 0xF8 is A | (B & C) in ternlog terms.
    return {_mm512_ternarylogic_epi32(w, x, _mm512_set1_epi16(short(0x8000)), 0xF8)};
  }
};
template <>
struct WordLoader<fp8_e4m3> : Fp8WordLoader<fp8_e4m3> {};
template <>
struct WordLoader<fp8_e5m2> : Fp8WordLoader<fp8_e5m2> {};
#endif  // KVK_AVX512_VBMI

}  // namespace kvkernels::cpu::KVK_ISA
