// 8 floats in plain C++: the same interface as vec_avx512.h for CPUs (or builds) without AVX2.
// Loops over lanes that the compiler may vectorize with the baseline ISA; exp/tanh from libm.
#pragma once

#include <cmath>
#include <cstdint>

#include "convert.h"

namespace kvkernels::cpu::portable {

struct Vec {
  static constexpr int N = 8;
  using Mask = int;
  float v[N];

  static Mask mask(int) { return 0; }
  static Vec zero() { return set1(0.0f); }
  static Vec set1(float x) {
    Vec r;
    for (int i = 0; i < N; ++i) r.v[i] = x;
    return r;
  }
  template <typename T>
  static Vec load(const T* p, Mask = 0) {
    Vec r;
    for (int i = 0; i < N; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  void store(float* p) const {
    for (int i = 0; i < N; ++i) p[i] = v[i];
  }

  template <typename F>
  static Vec map(Vec a, Vec b, F f) {
    Vec r;
    for (int i = 0; i < N; ++i) r.v[i] = f(a.v[i], b.v[i]);
    return r;
  }
  float sum() const {
    float s = 0.0f;
    for (int i = 0; i < N; ++i) s += v[i];
    return s;
  }
  float max() const {
    float m = v[0];
    for (int i = 1; i < N; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }
  static void sum4(Vec a, Vec b, Vec c, Vec d, float* out) {
    out[0] = a.sum();
    out[1] = b.sum();
    out[2] = c.sum();
    out[3] = d.sum();
  }
  Vec exp() const {
    Vec r;
    for (int i = 0; i < N; ++i) r.v[i] = std::exp(v[i]);
    return r;
  }
  Vec tanh() const {
    Vec r;
    for (int i = 0; i < N; ++i) r.v[i] = std::tanh(v[i]);
    return r;
  }
};

inline Vec operator+(Vec a, Vec b) { return Vec::map(a, b, [](float x, float y) { return x + y; }); }
inline Vec operator-(Vec a, Vec b) { return Vec::map(a, b, [](float x, float y) { return x - y; }); }
inline Vec operator*(Vec a, Vec b) { return Vec::map(a, b, [](float x, float y) { return x * y; }); }
inline Vec fma(Vec a, Vec b, Vec c) {
  Vec r;
  for (int i = 0; i < Vec::N; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
  return r;
}
inline Vec max(Vec a, Vec b) { return Vec::map(a, b, [](float x, float y) { return x > y ? x : y; }); }

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 2); }

}  // namespace kvkernels::cpu::portable
