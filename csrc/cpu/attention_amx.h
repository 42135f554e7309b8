// The AMX half of the tile kernels (attention_tiles.h): bf16 queries over bf16 or fp8 caches
// (fp8 -> bf16 is exact, so every tile operand is exact), S = Q K^T and O += P V as tdpbf16ps
// products, P rounded to bf16 as SDPA's flash kernel does. Included by attention_tiles.h in the
// avx512amx build only (attention_amx.cpp, KVK_AMX).
//
// Tile registers: 0-3 accumulators (S key tiles or O column tiles), 4 the A operand (Q or P),
// 5 and 6 alternate as the B operand. The tile products cost little next to the softmax: one
// tdpbf16ps is 8192 multiply-adds in about 16 cycles (measured: 0.12 G/s per core).

namespace kvkernels::cpu::KVK_ISA {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile is 16 rows of 64 bytes: 16 x 32 bf16 (A, B operands) or 16 x 16 floats (results).
inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

// 32 values of a cache row as bf16 bits (exact for bf16 and fp8 rows).
template <typename C>
inline __m512i row_words(const C* row) {
  return word_loader<C>().load(row, Words::mask(Words::N)).v;
}

// Packs dims [32t, 32t + 32) of keys [j0, j1) of a chunk as the 4 B tiles of S = Q K^T for that
// dim tile: tile kb holds keys [16kb, 16kb + 16) as 16 rows of dim pairs x 16 keys x 2. A 32-bit
// word of a key row is one dim pair, so this is a 16 x 16 transpose of 32-bit words per tile. Keys
// outside [j0, j1) are zero (their logits are masked; zeros keep them finite).
template <typename C>
inline void amx_pack_key_dims(const C* const* rows, int j0, int j1, int t, bf16_bits* out) {
  for (int kb = 0; kb < kTileChunk / 16; ++kb) {
    __m512i r[16];
    for (int n = 0; n < 16; ++n) {
      const int j = kb * 16 + n;
      r[n] = j >= j0 && j < j1 ? row_words(rows[j] + t * 32) : _mm512_setzero_si512();
    }
    transpose16_epi32(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + kb * 512 + i * 32, r[i]);
  }
}

constexpr int kKeyDimsBf16 = kTileChunk * 32;  // one dim tile of packed keys (4 B tiles)

// Packs values [j0, j1) as B operands of O += P V: row kp of the result holds, for every column c,
// the pair (v[2kp][c], v[2kp + 1][c]). Values outside [j0, j1) are zero: their probability is 0,
// and 0 times a stale non-finite value would be NaN.
template <typename C>
inline void amx_pack_values(const C* const* rows, int j0, int j1, int D, bf16_bits* vp) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int kp = 0; kp < kTileChunk / 2; ++kp) {
    const int j = 2 * kp;
    const bool va = j >= j0 && j < j1, vb = j + 1 >= j0 && j + 1 < j1;
    bf16_bits* out = vp + size_t(kp) * 2 * D;
    for (int c = 0; c < D; c += 32) {
      const __m512i a = va ? row_words(rows[j] + c) : _mm512_setzero_si512();
      const __m512i b = vb ? row_words(rows[j + 1] + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(out + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// The whole chunk packed once for all the row tiles of an item (prefill: many row tiles share
// it), with `lines` of the next chunk prefetched along the way.
template <typename C>
inline void amx_pack_chunk(const C* const* keys, const C* const* vals, int j0, int j1, int Dk,
                           int Dv, bf16_bits* kp, bf16_bits* vp, ChunkPrefetch& pf, int lines) {
  const int per_step = (lines + Dk / 32 - 1) / (Dk / 32);
  for (int t = 0; t < Dk / 32; ++t) {
    pf.issue(per_step);
    amx_pack_key_dims(keys, j0, j1, t, kp + t * kKeyDimsBf16);
  }
  amx_pack_values(vals, j0, j1, Dv, vp);
}

// S[16, 64] = Q[16, D] K^T for one row tile, as floats with row stride kTileChunk; `per_step`
// lines of the next chunk are prefetched per dim tile.
inline void amx_logits(const bf16_bits* q, int D, const bf16_bits* kp, float* s, ChunkPrefetch& pf,
                       int per_step) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int t = 0; t < D / 32; ++t) {
    pf.issue(per_step);
    _tile_loadd(4, q + t * 32, D * 2);
    const bf16_bits* b = kp + size_t(t) * kKeyDimsBf16;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 1024, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 1536, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, s, kTileChunk * 4);
  _tile_stored(1, s + 16, kTileChunk * 4);
  _tile_stored(2, s + 32, kTileChunk * 4);
  _tile_stored(3, s + 48, kTileChunk * 4);
}

// O[16, 16N] += P[16, 64] V[64, 16N] for N column tiles: acc points at the first column of the
// row tile (row stride D), vp at the first column of the packed values.
template <int N>
inline void amx_pv(float* acc, int D, const bf16_bits* P, const bf16_bits* vp) {
  static_assert(N >= 1 && N <= 4, "four accumulator tiles");
  _tile_loadd(0, acc, D * 4);
  if constexpr (N > 1) _tile_loadd(1, acc + 16, D * 4);
  if constexpr (N > 2) _tile_loadd(2, acc + 32, D * 4);
  if constexpr (N > 3) _tile_loadd(3, acc + 48, D * 4);
  for (int ks = 0; ks < kTileChunk / 32; ++ks) {
    _tile_loadd(4, P + ks * 32, kTileChunk * 2);
    const bf16_bits* b = vp + size_t(ks) * 16 * 2 * D;
    _tile_loadd(5, b, D * 4);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (N > 1) {
      _tile_loadd(6, b + 32, D * 4);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (N > 2) {
      _tile_loadd(5, b + 64, D * 4);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (N > 3) {
      _tile_loadd(6, b + 96, D * 4);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, acc, D * 4);
  if constexpr (N > 1) _tile_stored(1, acc + 16, D * 4);
  if constexpr (N > 2) _tile_stored(2, acc + 32, D * 4);
  if constexpr (N > 3) _tile_stored(3, acc + 48, D * 4);
}

// O = alpha O for the rows of one row tile whose running max moved.
inline void amx_rescale(const TileScratch& sc, int r0, int D) {
  for (int i = 0; i < 16; ++i) {
    const float al = sc.alpha[r0 + i];
    if (al == 1.0f) continue;
    float* o = sc.acc + size_t(r0 + i) * D;
    for (int c = 0; c < D; c += Vec::N) (Vec::load(o + c) * Vec::set1(al)).store(o + c);
  }
}

// O[16, D] += P V for one row tile (rescaled before by amx_rescale), 64 columns (4 accumulator
// tiles) at a time; `per_step` lines of the next chunk are prefetched per 64 columns.
inline void amx_values(const TileScratch& sc, int r0, int D, ChunkPrefetch& pf, int per_step) {
  const bf16_bits* P = sc.p + size_t(r0) * kTileChunk;
  float* acc = sc.acc + size_t(r0) * D;
  for (int c = 0; c < D; c += 64) {  // D % 32 == 0: the last group may be 32 wide
    pf.issue(per_step);
    if (D - c >= 64) amx_pv<4>(acc + c, D, P, sc.vp_bf16() + 2 * c);
    else amx_pv<2>(acc + c, D, P, sc.vp_bf16() + 2 * c);
  }
}

}  // namespace kvkernels::cpu::KVK_ISA
