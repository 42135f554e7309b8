// Self-test of the AMX emulator (amx_emu.h), built and run by tests/test_amx_emu.py with the host
// compiler alone (no torch). `selftest arith` checks the arithmetic and data movement of the
// emulated instructions and prints "ok"; `selftest <fault>` makes the named misuse, which must
// abort the process with the emulator's message (the test checks the signal and the message).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "amx_emu.h"

namespace {

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

double from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int failures = 0;
void check(bool ok, const char* what) {
  if (!ok) std::printf("FAIL: %s\n", what), ++failures;
}

// C[M, N] += A[M, 2K] B[K, 2N] (pairs) for a random case against float64; columns past N and rows
// past M of C come back zero; the stored tile honours the row stride.
void arith(int M, int K, int N, std::mt19937& rng) {
  std::normal_distribution<float> g;
  Config cfg;
  cfg.rows[0] = M, cfg.colsb[0] = 4 * N;  // C
  cfg.rows[1] = M, cfg.colsb[1] = 4 * K;  // A
  cfg.rows[2] = K, cfg.colsb[2] = 4 * N;  // B
  _tile_loadconfig(&cfg);
  const int lda = 40, ldb = 36, ldc = 20;  // strides wider than the rows
  std::vector<uint16_t> A(16 * lda, 0xFFFF), B(16 * ldb, 0xFFFF);
  std::vector<float> C(16 * ldc, NAN), out(16 * ldc, -7.0f);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < 2 * K; ++k) A[m * lda + k] = to_bf16(g(rng));
  for (int k = 0; k < K; ++k)
    for (int n = 0; n < 2 * N; ++n) B[k * ldb + n] = to_bf16(g(rng));
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) C[m * ldc + n] = g(rng);
  _tile_loadd(1, A.data(), lda * 2);
  _tile_loadd(2, B.data(), ldb * 2);
  _tile_loadd(0, C.data(), ldc * 4);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, out.data(), ldc * 4);
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) {
      double want = C[m * ldc + n];
      for (int k = 0; k < K; ++k)
        want += from_bf16(A[m * lda + 2 * k]) * from_bf16(B[k * ldb + 2 * n]) +
                from_bf16(A[m * lda + 2 * k + 1]) * from_bf16(B[k * ldb + 2 * n + 1]);
      check(std::fabs(out[m * ldc + n] - want) <= 1e-5 * (1 + std::fabs(want)) * K, "dot product");
    }
    for (int n = N; n < ldc; ++n) check(out[m * ldc + n] == -7.0f, "store wrote past colsb");
  }
  for (int m = M; m < 16; ++m) check(out[m * ldc] == -7.0f, "store wrote past rows");
  _tile_release();
}

// Exact cases: bf16 denormal inputs count as zero; an inf times a finite is inf, NaN propagates; a
// tile past C's shape is zero after tdpbf16ps even if it was loaded with data.
void exact() {
  Config cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  uint16_t A[16][32] = {}, B[16][32] = {};
  float out[16][16];
  A[0][0] = 0x0001;  // the smallest positive bf16 denormal
  B[0][0] = 0x7F00;  // 2^127: a denormal taken as such would give a normal product
  A[1][0] = 0x7F80;  // +inf
  B[0][2] = 0x3F80;  // 1.0 (pair 0 of column 1)
  A[2][0] = 0x7FC0;  // NaN
  _tile_loadd(1, A, 64);
  _tile_loadd(2, B, 64);
  _tile_zero(0);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, out, 64);
  check(out[0][0] == 0.0f && !std::signbit(out[0][0]), "denormal input treated as zero");
  check(std::isinf(out[1][0]) && out[1][0] > 0, "inf x 2^127 = inf");
  check(std::isinf(out[1][1]) && out[1][1] > 0, "inf x 1 = inf");
  check(std::isnan(out[1][2]), "inf x 0 = NaN");
  check(std::isnan(out[2][1]), "NaN propagates");
  check(out[3][3] == 0.0f, "untouched element stays zero");
  _tile_release();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "arith";
  Config cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16;
  cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[2] = 64;
  float buf[256] = {};
  if (mode == "arith") {
    std::mt19937 rng(7);
    arith(16, 16, 16, rng);
    arith(5, 3, 7, rng);
    arith(16, 1, 4, rng);
    exact();
    if (failures == 0) std::printf("ok\n");
    return failures ? 1 : 0;
  }
  if (mode == "unconfigured") _tile_zero(0);
  if (mode == "released") _tile_loadconfig(&cfg), _tile_release(), _tile_loadd(0, buf, 64);
  if (mode == "unset_tile") _tile_loadconfig(&cfg), _tile_zero(5);
  if (mode == "palette") cfg.palette = 2, _tile_loadconfig(&cfg);
  if (mode == "too_wide") cfg.colsb[3] = 68, cfg.rows[3] = 1, _tile_loadconfig(&cfg);
  if (mode == "same_operand") _tile_loadconfig(&cfg), _tile_dpbf16ps(0, 1, 1);
  if (mode == "shape") cfg.rows[2] = 8, _tile_loadconfig(&cfg), _tile_dpbf16ps(0, 1, 2);
  std::printf("no fault for %s\n", mode.c_str());
  return 2;
}
