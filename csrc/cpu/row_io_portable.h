// Row loads and stores for the row kernels (rows_kernel.h) in plain C++: the interface of
// row_io_avx512.h, each lane through the scalar conversions of convert.h / fp8.h. These are the
// definition the vector versions must match bit for bit (tests/test_cpu_rows.py compares them).
#pragma once

namespace kvkernels::cpu::portable {

struct RowIo {
  static constexpr int N = Vec::N;

  // N elements, or n < N elements with the other lanes 0.
  template <typename T>
  static Vec load(const T* p, int n = N) {
    Vec r = Vec::zero();
    for (int i = 0; i < n; ++i) r.v[i] = to_float(p[i]);
    return r;
  }

  // float, fp16, bf16: round to nearest even.
  template <typename T>
  static void store(T* p, Vec v, int n = N) {
    for (int i = 0; i < n; ++i) p[i] = from_float<T>(v.v[i]);
  }

  // fp8: quantize x / scale (docs/design.md §3).
  template <typename C>
  static void quantize(C* p, Vec x, Vec scale, int n = N) {
    for (int i = 0; i < n; ++i) p[i] = to_cache<C>(x.v[i], scale.v[i]);
  }

  // read ? w * x : 0 per lane: a side that is not read never lets an inf/NaN of x through.
  static Vec weighted(float w, bool read, Vec x) {
    Vec r = Vec::zero();
    if (read)
      for (int i = 0; i < N; ++i) r.v[i] = w * x.v[i];
    return r;
  }
};

}  // namespace kvkernels::cpu::portable
