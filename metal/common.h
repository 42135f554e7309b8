// Shared by every kvkernels Metal kernel. kvkernels/metal/source.py puts this file in front of each
// metal/*.metal file (compile_shader compiles one source string, so there is no #include of it),
// followed by the variant's #defines.
//
// Storage types: float and half are MSL's own; bfloat16 and the two fp8 cache formats are structs
// over their bits and are converted in software, so the kernels need no Metal 3.1 `bfloat` and no
// fp8 support from the GPU. Every conversion that feeds a bit-exact test (fp8 quantization, float ->
// bfloat16) is integer arithmetic on the float bits: fast-math cannot change it.
#include <metal_stdlib>
using namespace metal;

struct bf16_t {
  ushort bits;
};
struct e4m3_t {  // float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf; S.1111.111 is NaN
  uchar bits;
};
struct e5m2_t {  // float8_e5m2: the top byte of an IEEE half
  uchar bits;
};

// NaN test on the bits (fast-math may fold isnan away).
inline bool bits_nan(float x) { return (as_type<uint>(x) & 0x7FFFFFFFu) > 0x7F800000u; }
inline bool bits_neg_inf(float x) { return as_type<uint>(x) == 0xFF800000u; }
inline bool bits_pos_inf(float x) { return as_type<uint>(x) == 0x7F800000u; }
inline bool bits_finite(float x) { return (as_type<uint>(x) & 0x7F800000u) != 0x7F800000u; }
inline float quiet_nan() { return as_type<float>(0x7FC00000u); }

// ---- to float ------------------------------------------------------------------------------------
inline float to_float(float x) { return x; }
inline float to_float(half x) { return float(x); }
inline float to_float(bf16_t x) { return as_type<float>(uint(x.bits) << 16); }
inline float to_float(e5m2_t x) { return float(as_type<half>(ushort(ushort(x.bits) << 8))); }
inline float to_float(e4m3_t x) {
  const uint sign = uint(x.bits & 0x80) << 24;
  const uint e = (x.bits >> 3) & 0xF, m = x.bits & 0x7;
  if (e == 0xF && m == 0x7) return as_type<float>(sign | 0x7FC00000u);
  if (e == 0) {  // subnormal: m * 2^-9 (exact in float)
    const float v = float(m) * 0.001953125f;
    return as_type<float>(sign | as_type<uint>(v));
  }
  return as_type<float>(sign | ((e + 120u) << 23) | (m << 20));
}

// ---- from float, round to nearest even --------------------------------------------------------
// m >> s rounded to nearest even (s >= 1).
inline uint rne_shift(uint m, uint s) {
  if (s >= 32u) return 0u;
  const uint q = m >> s, rem = m & ((1u << s) - 1u), half_ulp = 1u << (s - 1u);
  return q + ((rem > half_ulp || (rem == half_ulp && (q & 1u))) ? 1u : 0u);
}

// |x| (bits a, finite, below the smallest normal 2^(1-bias)) as a multiple of the subnormal step
// 2^-shift_exp, rounded to nearest even; reaching the smallest normal is fine (its encoding follows).
inline uint fp8_subnormal(uint a, uint shift_base) {
  const uint e = a >> 23;
  if (e == 0u) return 0u;
  return rne_shift((a & 0x7FFFFFu) | 0x800000u, shift_base - e);
}

inline uchar encode_e4m3(float q) {
  uint a = as_type<uint>(q);
  const uchar sign = uchar((a >> 24) & 0x80u);
  a &= 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7Fu;
  a = min(a, 0x43E00000u);                                   // saturate at 448 (inf too)
  if (a < 0x3C800000u) return sign | uchar(fp8_subnormal(a, 141u));  // < 2^-6: steps of 2^-9
  const uint r = a + 0x7FFFFu + ((a >> 20) & 1u);
  return sign | uchar((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u));
}

inline uchar encode_e5m2(float q) {
  uint a = as_type<uint>(q);
  const uchar sign = uchar((a >> 24) & 0x80u);
  a &= 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7Fu;
  a = min(a, 0x47600000u);                                   // saturate at 57344 (inf too)
  if (a < 0x38800000u) return sign | uchar(fp8_subnormal(a, 134u));  // < 2^-14: steps of 2^-16
  const uint r = a + 0xFFFFFu + ((a >> 21) & 1u);
  return sign | uchar((((r >> 23) - 112u) << 2) | ((r >> 21) & 3u));
}

inline ushort encode_bf16(float x) {
  const uint u = as_type<uint>(x);
  if (bits_nan(x)) return ushort(0x7FC0u | ((u >> 16) & 0x8000u));
  return ushort((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Float -> storage type (float, half, bf16_t; fp8 types quantize: see quantize()).
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline half from_float<half>(float x) { return half(x); }
template <>
inline bf16_t from_float<bf16_t>(float x) {
  bf16_t r;
  r.bits = encode_bf16(x);
  return r;
}
template <>
inline e4m3_t from_float<e4m3_t>(float x) {
  e4m3_t r;
  r.bits = encode_e4m3(x);
  return r;
}
template <>
inline e5m2_t from_float<e5m2_t>(float x) {
  e5m2_t r;
  r.bits = encode_e5m2(x);
  return r;
}

// fp8 quantization (docs/ops.md): stored = fp8(clamp(float32(x) / scale, -M, M)), NaN stays NaN.
template <typename T>
inline T quantize(float x, float scale) { return from_float<T>(x / scale); }

// The scale of kv head h: one per tensor (per_head == 0) or one per head.
inline float head_scale(device const float* scale, long per_head, long h) { return scale[per_head ? h : 0]; }
