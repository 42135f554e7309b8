// Row loads and stores for the row kernels (rows_kernel.h) on AVX-512 (F, BW, VL): every element
// format to and from the float32 lanes of vec_avx512.h's Vec, including partial vectors (masked),
// bit-identical to the scalar conversions of convert.h / fp8.h for every input:
//   - bf16 / fp16 stores round to nearest even; NaN becomes the canonical NaN that c10's scalar
//     constructors produce (bf16 0x7fc0, fp16 sign | 0x7e00);
//   - fp8 stores compute x / scale with a real division (x * (1 / scale) rounds differently), then
//     encode exactly like float_to_e4m3 / float_to_e5m2 after the clamp of quantize_e4m3 / _e5m2;
//   - fp8 loads return the NaN that e4m3_to_float / e5m2_to_float return (sign | 0x7fc00000); the
//     attention loads of vec_avx512.h, which need no particular NaN, drop the e4m3 NaN's sign and
//     keep the e5m2 payload, so the NaN lanes are patched here.
// Include only inside the AVX-512 target region, after vec_avx512.h.
#pragma once

namespace kvkernels::cpu::avx512 {

struct RowIo {
  static constexpr int N = Vec::N;
  using Mask = __mmask16;

  static __m512i i32(int x) { return _mm512_set1_epi32(x); }

  // ---- loads: N elements, or n < N elements with the other lanes 0 ----
  template <typename T>
  static Vec load(const T* p, int n = N) {
    return load_masked(p, Vec::mask(n));
  }
  static Vec load_masked(const float* p, Mask m) { return Vec::load(p, m); }
  static Vec load_masked(const c10::BFloat16* p, Mask m) { return Vec::load(p, m); }
  static Vec load_masked(const c10::Half* p, Mask m) { return Vec::load(p, m); }
  // e4m3: 0x7f / 0xff is the only NaN; e5m2: exponent all ones and a nonzero mantissa.
  static Vec load_masked(const fp8_e4m3* p, Mask m) { return with_fp8_nan(Vec::load(p, m), p, m, 0x7e); }
  static Vec load_masked(const fp8_e5m2* p, Mask m) { return with_fp8_nan(Vec::load(p, m), p, m, 0x7c); }

  // Lanes whose code has a magnitude above `last_non_nan` become sign | 0x7fc00000.
  template <typename F8>
  static Vec with_fp8_nan(Vec v, const F8* p, Mask m, int last_non_nan) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
    const Mask is_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(b, i32(0x7f)), i32(last_non_nan));
    const __m512i nan = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, i32(0x80)), 24),
                                        i32(0x7fc00000));
    return {_mm512_mask_mov_ps(v.v, is_nan, _mm512_castsi512_ps(nan))};
  }

  // ---- stores of float lanes, rounded to nearest even ----
  static void store(float* p, Vec v, int n = N) { _mm512_mask_storeu_ps(p, Vec::mask(n), v.v); }

  static void store(c10::BFloat16* p, Vec v, int n = N) {
    // c10::detail::round_to_nearest_even: add 0x7fff plus the lowest kept bit, keep the top half.
    const __m512i u = _mm512_castps_si512(v.v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), i32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, i32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v.v, v.v, _CMP_UNORD_Q), i32(0x7fc0));
    _mm256_mask_storeu_epi16(p, Vec::mask(n), _mm512_cvtepi32_epi16(r));
  }

  static void store(c10::Half* p, Vec v, int n = N) {
    // The hardware conversion is IEEE round to nearest even, as is c10's software one, except
    // for NaN: c10 gives sign | 0x7e00, the hardware keeps the top payload bits.
    __m256i h = _mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i u = _mm512_castps_si512(v.v);
    const __m512i nan = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), i32(0x8000)),
                                        i32(0x7e00));
    h = _mm256_mask_mov_epi16(h, _mm512_cmp_ps_mask(v.v, v.v, _CMP_UNORD_Q),
                              _mm512_cvtepi32_epi16(nan));
    _mm256_mask_storeu_epi16(p, Vec::mask(n), h);
  }

  // ---- fp8 quantization of x / scale (docs/design.md §3) ----
  static void quantize(fp8_e4m3* p, Vec x, Vec scale, int n = N) {
    // float_to_e4m3: NaN 0x7f; >= 448 (after the clamp: also inf) 0x7e; below 2^-6 subnormal
    // steps of 2^-9; else round the mantissa to 3 bits and rebias the exponent.
    store_bytes(p, encode(_mm512_div_ps(x.v, scale.v), 0x43e00000, 0x7e, 0x3c800000, 512.0f,
                          20, 0x7ffff, 120 << 3), n);
  }
  static void quantize(fp8_e5m2* p, Vec x, Vec scale, int n = N) {
    // float_to_e5m2: NaN 0x7f; >= 57344 0x7b; below 2^-14 steps of 2^-16; else 2 mantissa bits.
    store_bytes(p, encode(_mm512_div_ps(x.v, scale.v), 0x47600000, 0x7b, 0x38800000, 65536.0f,
                          21, 0xfffff, 112 << 2), n);
  }

  // The fp8 encoders of fp8.h on 16 lanes; the clamp of quantize_* is the `sat` branch.
  static __m512i encode(__m512 q, int sat_bits, int sat_code, int min_normal_bits,
                        float inv_subnormal_step, int shift, int half_ulp_minus_1, int rebias) {
    const __m512i u = _mm512_castps_si512(q);
    const __m512i a = _mm512_and_si512(u, i32(0x7fffffff));
    // Normal: (a + half_ulp - 1 + lowest kept bit) >> shift, minus the exponent rebias (a carry
    // out of the mantissa bumps the exponent, as it should).
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, shift), i32(1));
    const __m512i normal = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, i32(half_ulp_minus_1)), lsb), shift),
        i32(rebias));
    // Subnormal: |q| / step is exact (a power of two), then rounded like rintf (MXCSR mode,
    // round to nearest even by default).
    const __m512i sub = _mm512_cvtps_epi32(
        _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(inv_subnormal_step)));
    __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, i32(min_normal_bits)), normal, sub);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epi32_mask(a, i32(sat_bits)), i32(sat_code));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(a, i32(0x7f800000)), i32(0x7f));
    return _mm512_or_si512(r, _mm512_and_si512(_mm512_srli_epi32(u, 24), i32(0x80)));
  }

  template <typename F8>
  static void store_bytes(F8* p, __m512i codes, int n) {
    _mm_mask_storeu_epi8(p, Vec::mask(n), _mm512_cvtepi32_epi8(codes));
  }

  // ---- merge ----
  // read ? w * x : 0 per lane, so a side that is not read never lets an inf/NaN of x through. A
  // masked multiply is also never contracted with the following add into an FMA, which keeps the
  // result bit-identical to the scalar (portable) merge.
  static Vec weighted(float w, bool read, Vec x) {
    return {_mm512_maskz_mul_ps(read ? Mask(0xFFFF) : Mask(0), _mm512_set1_ps(w), x.v)};
  }
};

}  // namespace kvkernels::cpu::avx512
