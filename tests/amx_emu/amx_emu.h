// An emulator of the AMX tile instructions the avx512amx kernels use (ldtilecfg, tilerelease,
// tilezero, tileloadd, tilestored, tdpbf16ps), for CPUs without AMX: `make amx-emu-test` builds
// the CPU extension with -DKVKERNELS_AMX_EMU, which makes csrc/cpu/attention_amx.cpp include this
// header after <immintrin.h>. Every other instruction of that path (AVX-512, VBMI, BF16) runs
// natively, so a CPU with those (AMD Zen 4, Intel Ice Lake and later) runs the whole AMX kernel
// with only the tile unit replaced. The emulated build is for tests only: it is never installed.
//
// What is modelled, from the instruction descriptions of Intel's SDM (vol. 2, AMX):
//   - per-thread tile state: palette, rows / colsb of the 8 tiles, 8 x 1 KiB of data; unconfigured
//     until ldtilecfg with palette 1, and again after tilerelease (or ldtilecfg of palette 0);
//   - ldtilecfg faults (#GP) on a palette other than 0 / 1, non-zero reserved bytes, more than 16
//     rows or 64 bytes a row (and, stricter than the SDM, on a tile with rows but no colsb or the
//     other way round: a kernel bug either way);
//   - every tile instruction faults (#UD) while unconfigured, on an unconfigured tile, and
//     tdpbf16ps on operands that are not distinct, with a colsb that is not a multiple of 4, or
//     whose shapes do not chain (C rows = A rows, A colsb / 4 = B rows, C colsb = B colsb);
//   - tileloadd reads rows x colsb bytes, rows `stride` bytes apart, and zeroes the rest of the
//     tile; tilestored writes rows x colsb bytes; tdpbf16ps zeroes the columns past C's colsb;
//   - tdpbf16ps arithmetic: bf16 inputs widened to fp32 with denormals treated as zero, even and
//     odd pair products each accumulated over k by fp32 fused multiply-adds (round to nearest even,
//     output denormals flushed to zero), the two sums added and then added to C (SDM: "order of
//     additions is an implementation detail", so hardware may differ from this in the last bits;
//     the tests compare against the float64 reference with tolerances, never bit for bit).
// A fault prints what happened and aborts, as the hardware's #UD / #GP kills the process.
// Not modelled: timing, start_row (restart after an interrupt), the tile registers' state across
// context switches (the emulated state is thread_local, which is what the OS keeps per thread).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kvkernels::amx_emu {

struct State {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][1024] = {};
};

inline State& state() {
  static thread_local State s;
  return s;
}

// tdpbf16ps executed by all threads since the library loaded: the tests check that the AMX path
// really ran (a plan falling back to the FMA tiles would otherwise pass unnoticed).
inline std::atomic<int64_t>& dot_products() {
  static std::atomic<int64_t> n{0};
  return n;
}

[[noreturn]] inline void fault(const char* insn, const char* why, int tile = -1) {
  if (tile >= 0) std::fprintf(stderr, "amx_emu: %s: %s (tile %d)\n", insn, why, tile);
  else std::fprintf(stderr, "amx_emu: %s: %s\n", insn, why);
  std::fflush(stderr);
  std::abort();
}

inline void check_tile(const char* insn, int t) {
  const State& s = state();
  if (t < 0 || t > 7) fault(insn, "tile register out of range", t);
  if (!s.configured) fault(insn, "tile state not configured (#UD)", t);
  if (s.rows[t] == 0 || s.colsb[t] == 0) fault(insn, "tile not configured (#UD)", t);
}

inline void release() { state().configured = false; }

inline void load_config(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  const uint8_t palette = c[0];
  State& s = state();
  if (palette == 0) return release();
  if (palette != 1) fault("ldtilecfg", "palette other than 0 / 1 (#GP)");
  for (int i = 2; i < 16; ++i)
    if (c[i] != 0) fault("ldtilecfg", "reserved bytes 2-15 not zero (#GP)");
  for (int i = 16 + 16; i < 48; ++i)  // colsb of tiles 8-15 (palette 1 has 8 tiles)
    if (c[i] != 0) fault("ldtilecfg", "colsb of tiles 8-15 not zero (#GP)");
  for (int i = 48 + 8; i < 64; ++i)
    if (c[i] != 0) fault("ldtilecfg", "rows of tiles 8-15 not zero (#GP)");
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * t, 2);
    const uint8_t rows = c[48 + t];
    if (rows > 16 || colsb > 64) fault("ldtilecfg", "more than 16 rows or 64 bytes a row (#GP)", t);
    if ((rows == 0) != (colsb == 0)) fault("ldtilecfg", "rows and colsb must both be zero or both set (#GP)", t);
    s.rows[t] = rows, s.colsb[t] = colsb;
  }
  std::memset(s.data, 0, sizeof s.data);  // ldtilecfg zeroes the tile data
  s.configured = true;
}

inline void zero(int t) {
  check_tile("tilezero", t);
  std::memset(state().data[t], 0, 1024);
}

inline void load(int t, const void* base, int64_t stride) {
  check_tile("tileloadd", t);
  State& s = state();
  uint8_t* dst = s.data[t];
  std::memset(dst, 0, 1024);
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(dst + 64 * r, static_cast<const uint8_t*>(base) + r * stride, s.colsb[t]);
}

inline void store(int t, void* base, int64_t stride) {
  check_tile("tilestored", t);
  const State& s = state();
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t] + 64 * r, s.colsb[t]);
}

// A bf16 as fp32, denormals treated as zero.
inline float bf16_daz(uint16_t b) {
  if ((b & 0x7F80) == 0) b &= 0x8000;
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }

inline void dpbf16ps(int c, int a, int b) {
  check_tile("tdpbf16ps", c);
  check_tile("tdpbf16ps", a);
  check_tile("tdpbf16ps", b);
  State& s = state();
  if (c == a || c == b || a == b) fault("tdpbf16ps", "operands not distinct (#UD)");
  if (s.colsb[a] % 4 || s.colsb[b] % 4 || s.colsb[c] % 4) fault("tdpbf16ps", "colsb not a multiple of 4 (#UD)");
  if (s.rows[c] != s.rows[a]) fault("tdpbf16ps", "C rows != A rows (#UD)");
  if (s.colsb[a] / 4 != s.rows[b]) fault("tdpbf16ps", "A colsb / 4 != B rows (#UD)");
  if (s.colsb[c] != s.colsb[b]) fault("tdpbf16ps", "C colsb != B colsb (#UD)");
  const int M = s.rows[c], K = s.colsb[a] / 4, N = s.colsb[c] / 4;
  uint16_t A[16][32], B[16][32];
  float C[16][16];
  std::memcpy(A, s.data[a], sizeof A);
  std::memcpy(B, s.data[b], sizeof B);
  std::memcpy(C, s.data[c], sizeof C);
  for (int m = 0; m < M; ++m) {
    float even[16] = {}, odd[16] = {};
    for (int k = 0; k < K; ++k) {
      const float a0 = bf16_daz(A[m][2 * k]), a1 = bf16_daz(A[m][2 * k + 1]);
      for (int n = 0; n < N; ++n) {
        even[n] = ftz(std::fma(a0, bf16_daz(B[k][2 * n]), even[n]));
        odd[n] = ftz(std::fma(a1, bf16_daz(B[k][2 * n + 1]), odd[n]));
      }
    }
    for (int n = 0; n < N; ++n) C[m][n] = ftz(C[m][n] + ftz(even[n] + odd[n]));
    for (int n = N; n < 16; ++n) C[m][n] = 0.0f;
  }
  for (int m = M; m < 16; ++m)
    for (int n = 0; n < 16; ++n) C[m][n] = 0.0f;
  std::memcpy(s.data[c], C, sizeof C);
  dot_products().fetch_add(1, std::memory_order_relaxed);
}

}  // namespace kvkernels::amx_emu

// The intrinsics of <immintrin.h> (GCC: macros for the tile operations, inline functions for
// ldtilecfg / tilerelease; a function-like macro defined now shadows both from here on).
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) ::kvkernels::amx_emu::load_config(config)
#define _tile_release() ::kvkernels::amx_emu::release()
#define _tile_zero(t) ::kvkernels::amx_emu::zero(t)
#define _tile_loadd(t, base, stride) ::kvkernels::amx_emu::load(t, base, stride)
#define _tile_stream_loadd(t, base, stride) ::kvkernels::amx_emu::load(t, base, stride)
#define _tile_stored(t, base, stride) ::kvkernels::amx_emu::store(t, base, stride)
#define _tile_dpbf16ps(c, a, b) ::kvkernels::amx_emu::dpbf16ps(c, a, b)
