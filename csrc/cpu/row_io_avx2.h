// Row loads and stores for the row kernels (rows_kernel.h) on AVX2 + FMA + F16C: the same
// interface and the same bit-exactness as row_io_avx512.h (read its header comment). AVX2 has no
// lane masks and vec_avx2.h always reads 8 elements, so a partial vector (the tail of a row whose
// width is not a multiple of 8) goes through a small zeroed copy instead of touching memory past
// the row. Include only inside the AVX2 target region, after vec_avx2.h.
#pragma once

namespace kvkernels::cpu::avx2 {

struct RowIo {
  static constexpr int N = Vec::N;

  static __m256i i32(int x) { return _mm256_set1_epi32(x); }

  // ---- loads: N elements, or n < N elements with the other lanes 0 ----
  template <typename T>
  static Vec load(const T* p, int n = N) {
    if (n == N) return load_full(p);
    T buf[N];
    std::memset(static_cast<void*>(buf), 0, sizeof(buf));
    std::memcpy(static_cast<void*>(buf), p, sizeof(T) * size_t(n));
    return load_full(buf);
  }
  static Vec load_full(const float* p) { return Vec::load(p); }
  static Vec load_full(const c10::BFloat16* p) { return Vec::load(p, 0); }
  static Vec load_full(const c10::Half* p) { return Vec::load(p, 0); }
  // e4m3: 0x7f / 0xff is the only NaN; e5m2: exponent all ones and a nonzero mantissa.
  static Vec load_full(const fp8_e4m3* p) { return with_fp8_nan(Vec::load(p, 0), p, 0x7e); }
  static Vec load_full(const fp8_e5m2* p) { return with_fp8_nan(Vec::load(p, 0), p, 0x7c); }

  // Lanes whose code has a magnitude above `last_non_nan` become sign | 0x7fc00000 (what
  // e4m3_to_float / e5m2_to_float return).
  template <typename F8>
  static Vec with_fp8_nan(Vec v, const F8* p, int last_non_nan) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, i32(0x7f)), i32(last_non_nan));
    const __m256i nan = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(b, i32(0x80)), 24),
                                        i32(0x7fc00000));
    return {_mm256_blendv_ps(v.v, _mm256_castsi256_ps(nan), _mm256_castsi256_ps(is_nan))};
  }

  // ---- stores of float lanes, rounded to nearest even ----
  static void store(float* p, Vec v, int n = N) {
    if (n == N) return _mm256_storeu_ps(p, v.v);
    alignas(32) float buf[N];
    _mm256_store_ps(buf, v.v);
    std::memcpy(p, buf, sizeof(float) * size_t(n));
  }

  static void store(c10::BFloat16* p, Vec v, int n = N) {
    // c10::detail::round_to_nearest_even: add 0x7fff plus the lowest kept bit, keep the top half.
    const __m256i u = _mm256_castps_si256(v.v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), i32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, i32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v.v, v.v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, i32(0x7fc0), nan);
    store16(p, narrow16(r), n);
  }

  static void store(c10::Half* p, Vec v, int n = N) {
    // IEEE round to nearest even like c10's software conversion, except NaN: c10 gives
    // sign | 0x7e00, the hardware keeps the top payload bits.
    const __m128i h = _mm256_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i u = _mm256_castps_si256(v.v);
    const __m256i nan = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), i32(0x8000)),
                                        i32(0x7e00));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v.v, v.v, _CMP_UNORD_Q));
    // The 32-bit lane masks (0 / -1) narrow to 16-bit masks with signed saturation.
    const __m128i is_nan16 = _mm_packs_epi32(_mm256_castsi256_si128(is_nan),
                                             _mm256_extracti128_si256(is_nan, 1));
    store16(p, _mm_blendv_epi8(h, narrow16(nan), is_nan16), n);
  }

  // 8 x int32 in [0, 0xffff] -> 8 x uint16.
  static __m128i narrow16(__m256i x) {
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  }
  template <typename T>
  static void store16(T* p, __m128i x, int n) {
    if (n == N) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
    alignas(16) uint16_t buf[N];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), x);
    std::memcpy(static_cast<void*>(p), buf, 2 * size_t(n));
  }

  // ---- fp8 quantization of x / scale (docs/design.md §3), as in row_io_avx512.h ----
  static void quantize(fp8_e4m3* p, Vec x, Vec scale, int n = N) {
    store8(p, encode(_mm256_div_ps(x.v, scale.v), 0x43e00000, 0x7e, 0x3c800000, 512.0f, 20,
                     0x7ffff, 120 << 3), n);
  }
  static void quantize(fp8_e5m2* p, Vec x, Vec scale, int n = N) {
    store8(p, encode(_mm256_div_ps(x.v, scale.v), 0x47600000, 0x7b, 0x38800000, 65536.0f, 21,
                     0xfffff, 112 << 2), n);
  }

  // float_to_e4m3 / float_to_e5m2 of fp8.h on 8 lanes, the clamp of quantize_* included.
  static __m256i encode(__m256 q, int sat_bits, int sat_code, int min_normal_bits,
                        float inv_subnormal_step, int shift, int half_ulp_minus_1, int rebias) {
    const __m256i u = _mm256_castps_si256(q);
    const __m256i a = _mm256_and_si256(u, i32(0x7fffffff));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, shift), i32(1));
    const __m256i normal = _mm256_sub_epi32(
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, i32(half_ulp_minus_1)), lsb), shift),
        i32(rebias));
    // Exact scaling by a power of two, then rounding in the MXCSR mode, as rintf does.
    const __m256i sub = _mm256_cvtps_epi32(
        _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(inv_subnormal_step)));
    // a is never negative, so signed compares order it correctly.
    __m256i r = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(i32(min_normal_bits), a));
    r = _mm256_blendv_epi8(r, i32(sat_code), _mm256_cmpgt_epi32(a, i32(sat_bits - 1)));
    r = _mm256_blendv_epi8(r, i32(0x7f), _mm256_cmpgt_epi32(a, i32(0x7f800000)));
    return _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(u, 24), i32(0x80)));
  }

  template <typename F8>
  static void store8(F8* p, __m256i codes, int n) {
    const __m128i w = narrow16(codes);
    const __m128i b = _mm_packus_epi16(w, w);  // codes are bytes: no saturation happens
    if (n == N) return _mm_storel_epi64(reinterpret_cast<__m128i*>(p), b);
    alignas(16) uint8_t buf[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), b);
    std::memcpy(static_cast<void*>(p), buf, size_t(n));
  }

  // ---- merge ----
  // read ? w * x : 0 per lane (a side that is not read never lets an inf/NaN of x through).
  // Masking the product also keeps GCC from contracting it with the following add into an FMA, so
  // the result stays bit-identical to the scalar (portable) merge.
  static Vec weighted(float w, bool read, Vec x) {
    const __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(read ? -1 : 0));
    return {_mm256_and_ps(_mm256_mul_ps(_mm256_set1_ps(w), x.v), keep)};
  }
};

}  // namespace kvkernels::cpu::avx2
