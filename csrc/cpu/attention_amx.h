// The AMX half of the tile kernels (attention_tiles.h): bf16 queries over bf16 or fp8 caches
// (fp8 -> bf16 is exact, so every tile operand is exact), S^T = K Q^T and O += P V as tdpbf16ps
// products, P rounded to bf16 as SDPA's flash kernel does. Included by attention_tiles.h in the
// avx512amx build only (attention_amx.cpp, KVK_AMX).
//
// Tile registers: 0-3 accumulators (S^T key groups or O column tiles), 4 a shared operand (Q^T
// or P), 5 and 6 alternate as the streamed one (keys or packed values). The tile products cost
// little next to the rest: one tdpbf16ps is 8192 multiply-adds in about 16 cycles.

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

inline float bf16_bits_to_float(bf16_bits b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---- S^T = K Q^T ----
// The keys are the A operand: 16 key rows x 32 dims, which is how a cache stores them, so a group of
// 16 keys in consecutive slots of a bf16 block is loaded straight from the block (the tile load
// takes the slot stride). The queries, fixed for the item, are the B operands, packed once.
// This replaced a transpose of every chunk's keys into B tiles, 0.8 of 7 ms of MLA decode.

// Q^T of an item's rows16 rows: the B tile of row tile i and dim tile t, at qt + (i * D/32 + t) *
// 512, holds in its row kp dim pair kp of each of the 16 rows (a 16 x 16 transpose of words).
inline void amx_pack_queries(const bf16_bits* q, int rows16, int D, bf16_bits* qt) {
  for (int r0 = 0; r0 < rows16; r0 += 16) {
    for (int t = 0; t < D / 32; ++t) {
      __m512i r[16];
      for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(q + size_t(r0 + n) * D + t * 32);
      transpose16_epi32(r);
      bf16_bits* out = qt + (size_t(r0 / 16) * (D / 32) + t) * 512;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + i * 32, r[i]);
    }
  }
}

// The A operands of a chunk's keys: group g (keys [16g, 16g + 16)) at base[g], rows stride[g]
// bytes apart; null for a group without a key in [j0, j1) (its logits stay 0 and are masked).
struct KeyTiles {
  const bf16_bits* base[kTileChunk / 16];
  int64_t stride[kTileChunk / 16];
};

// Groups of 16 bf16 keys in [j0, j1) at one positive slot stride are read in place; the others
// (partial groups, a block edge inside the group, fp8 rows) are converted into `staging`
// ([kTileChunk, D] bf16), with zeros for keys outside [j0, j1).
template <typename C>
inline KeyTiles amx_key_tiles(const C* const* rows, int j0, int j1, int D, bf16_bits* staging) {
  KeyTiles kt;
  for (int g = 0; g < kTileChunk / 16; ++g) {
    const int k0 = 16 * g;
    kt.base[g] = nullptr;
    kt.stride[g] = 0;
    if (k0 + 16 <= j0 || k0 >= j1) continue;
    if constexpr (std::is_same_v<C, c10::BFloat16>) {
      const ptrdiff_t step = k0 >= j0 && k0 + 16 <= j1 ? rows[k0 + 1] - rows[k0] : 0;
      bool in_place = step > 0;
      for (int n = 2; n < 16 && in_place; ++n) in_place = rows[k0 + n] == rows[k0] + n * step;
      if (in_place) {
        kt.base[g] = reinterpret_cast<const bf16_bits*>(rows[k0]);
        kt.stride[g] = int64_t(step) * int64_t(sizeof(C));
        continue;
      }
    }
    bf16_bits* out = staging + size_t(k0) * D;
    for (int n = 0; n < 16; ++n) {
      const int j = k0 + n;
      const bool vis = j >= j0 && j < j1;
      for (int c = 0; c < D; c += 32)
        _mm512_storeu_si512(out + size_t(n) * D + c, vis ? row_words(rows[j] + c) : _mm512_setzero_si512());
    }
    kt.base[g] = out;
    kt.stride[g] = int64_t(D) * 2;
  }
  return kt;
}

// S^T[64, 16] = K Q^T for one row tile (qt: its Q^T tiles), as floats st[key * 16 + row].
inline void amx_logits(const KeyTiles& kt, const bf16_bits* qt, int D, float* st) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const bool g0 = kt.base[0], g1 = kt.base[1], g2 = kt.base[2], g3 = kt.base[3];
  for (int t = 0; t < D / 32; ++t) {
    _tile_loadd(4, qt + t * 512, 64);
    if (g0) {
      _tile_loadd(5, kt.base[0] + t * 32, kt.stride[0]);
      _tile_dpbf16ps(0, 5, 4);
    }
    if (g1) {
      _tile_loadd(6, kt.base[1] + t * 32, kt.stride[1]);
      _tile_dpbf16ps(1, 6, 4);
    }
    if (g2) {
      _tile_loadd(5, kt.base[2] + t * 32, kt.stride[2]);
      _tile_dpbf16ps(2, 5, 4);
    }
    if (g3) {
      _tile_loadd(6, kt.base[3] + t * 32, kt.stride[3]);
      _tile_dpbf16ps(3, 6, 4);
    }
  }
  _tile_stored(0, st, 64);
  _tile_stored(1, st + 256, 64);
  _tile_stored(2, st + 512, 64);
  _tile_stored(3, st + 768, 64);
}

// The online-softmax step of one row tile on S^T (rows in the lanes of each key's vector): the
// math of softmax_rows4, where the per-row max and sum are plain vector max and add over the keys.
// Row i (item row r0 + i) sees keys [a[i], b[i]); a row that sees nothing keeps its state
// (alpha = 1) and gets probability 0. P goes out as bf16 rows [16, kTileChunk] for P V.
inline void softmax_tile_t(const AttentionParams& p, float* st, float mul, float* m, float* d,
                           float* alpha, const int* a, const int* b, const RowMap& map, int r0,
                           int64_t cs, bf16_bits* P) {
  const __m512i av = _mm512_loadu_si512(a), bv = _mm512_loadu_si512(b);
  const __mmask16 live = _mm512_cmplt_epi32_mask(av, bv);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), mulv = _mm512_set1_ps(mul);
  const bool cap = p.soft_cap > 0.0f;
  const __m512 capv = _mm512_set1_ps(p.soft_cap), inv_cap = _mm512_set1_ps(cap ? 1.0f / p.soft_cap : 0.0f);
  alignas(64) float slope[16] = {};
  alignas(64) int32_t dist0[16] = {};  // ALiBi: key position - query position at key 0 of the chunk
  if (p.alibi_slopes) {
    for (int i = 0; i < 16; ++i) slope[i] = p.alibi_slopes[map.head(r0 + i)], dist0[i] = int32_t(cs - map.pos(r0 + i));
  }
  __m512 mx = neg_inf;
  for (int k = 0; k < kTileChunk; ++k) {
    const __m512i kv = _mm512_set1_epi32(k);
    const __mmask16 vis = _mm512_mask_cmpgt_epi32_mask(_mm512_cmple_epi32_mask(av, kv), bv, kv);
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(st + 16 * k), mulv);
    if (cap) v = _mm512_mul_ps(capv, Vec{_mm512_mul_ps(v, inv_cap)}.tanh().v);
    if (p.alibi_slopes) {
      const __m512 dist = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_load_si512(dist0), kv));
      v = _mm512_fmadd_ps(_mm512_load_ps(slope), dist, v);
    }
    v = _mm512_mask_mov_ps(neg_inf, vis, v);
    _mm512_storeu_ps(st + 16 * k, v);
    mx = _mm512_max_ps(mx, v);
  }
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 m_new = _mm512_mask_max_ps(m_old, live, m_old, mx);
  const __m512 ref = tile_exp_base(m_new);  // 0 while m_new is -inf (attention_tiles.h)
  // Word lane i of pair kp: (P[i][2kp], P[i][2kp + 1]); 16 pairs transposed give 32 keys of P's rows.
  alignas(64) static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                    21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                    11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(pair_idx);
  __m512 sum = _mm512_setzero_ps();
  for (int h = 0; h < kTileChunk / 32; ++h) {
    __m512i w[16];
    for (int kp = 0; kp < 16; ++kp) {
      const int k = 32 * h + 2 * kp;
      // exp gives 0 for -inf (masked keys) and NaN for a NaN logit (which must reach d).
      const __m512 e0 = Vec{_mm512_sub_ps(_mm512_loadu_ps(st + 16 * k), ref)}.exp().v;
      const __m512 e1 = Vec{_mm512_sub_ps(_mm512_loadu_ps(st + 16 * k + 16), ref)}.exp().v;
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      const __m512bh pb = _mm512_cvtne2ps_pbh(e1, e0);  // e0 in the low half
      w[kp] = _mm512_permutexvar_epi16(pairs, reinterpret_cast<const __m512i&>(pb));
    }
    transpose16_epi32(w);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(P + i * kTileChunk + 32 * h, w[i]);
  }
  // alpha = e^(m_old - m_new), 1 for rows that saw nothing (whose m_old may be -inf).
  const __m512 al = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.0f),
                                         Vec{_mm512_sub_ps(m_old, ref)}.exp().v);
  _mm512_storeu_ps(alpha, al);
  _mm512_storeu_ps(d, _mm512_fmadd_ps(_mm512_loadu_ps(d), al, sum));
  _mm512_storeu_ps(m, m_new);
}

// Packs columns [c0, c0 + w) of values [j0, j1) of a chunk as the B operands of O += P V: row kp
// holds, for each of the w columns, the pair (v[2kp][c], v[2kp + 1][c]). Values outside [j0, j1)
// are zero: their probability is 0, and 0 times a stale non-finite value would be NaN.
template <typename C>
inline void amx_pack_values(const C* const* rows, int j0, int j1, int c0, int w, bf16_bits* vp) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int kp = 0; kp < kTileChunk / 2; ++kp) {
    const int j = 2 * kp;
    const bool va = j >= j0 && j < j1, vb = j + 1 >= j0 && j + 1 < j1;
    bf16_bits* out = vp + size_t(kp) * 2 * w;
    for (int c = 0; c < w; c += 32) {
      const __m512i a = va ? row_words(rows[j] + c0 + c) : _mm512_setzero_si512();
      const __m512i b = vb ? row_words(rows[j + 1] + c0 + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(out + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// O[16, 16N] += P[16, 64] V[64, 16N] for N column tiles: acc points at the first column of the
// row tile (row stride D), vp at the values of those columns packed by amx_pack_values (w = 16N).
template <int N>
inline void amx_pv(float* acc, int D, const bf16_bits* P, const bf16_bits* vp) {
  static_assert(N >= 1 && N <= 4, "four accumulator tiles");
  constexpr int row = 32 * N;  // bf16 per packed row
  _tile_loadd(0, acc, D * 4);
  if constexpr (N > 1) _tile_loadd(1, acc + 16, D * 4);
  if constexpr (N > 2) _tile_loadd(2, acc + 32, D * 4);
  if constexpr (N > 3) _tile_loadd(3, acc + 48, D * 4);
  for (int ks = 0; ks < kTileChunk / 32; ++ks) {
    _tile_loadd(4, P + ks * 32, kTileChunk * 2);
    const bf16_bits* b = vp + size_t(ks) * 16 * row;
    _tile_loadd(5, b, row * 2);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (N > 1) {
      _tile_loadd(6, b + 32, row * 2);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (N > 2) {
      _tile_loadd(5, b + 64, row * 2);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (N > 3) {
      _tile_loadd(6, b + 96, row * 2);
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

// Rows that do not all see the same keys of a chunk (the causal diagonal or a window's edge in
// prefill): a key a row does not see has probability 0 for it, but the tile product still
// multiplies that 0 by the key's value, and 0 times an inf or NaN value is NaN (docs/ops.md: keys
// a row does not see never influence it). For such chunks the non-finite values are zeroed in the
// packed operands (amx_zero_nonfinite) and added back afterwards by the rows that see them
// (amx_add_nonfinite). A chunk every row sees whole (decode, MLA decode, all but the diagonal
// chunks of prefill) skips both.

// bf16 bits with an all-ones exponent: inf or NaN.
inline __mmask32 nonfinite_words(__m512i x) {
  const __m512i expo = _mm512_set1_epi16(0x7F80);
  return _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, expo), expo);
}

// Zeroes the non-finite values of a packed group (amx_pack_values, w columns); returns the keys
// (bit j: key j of the chunk) that had one.
inline uint64_t amx_zero_nonfinite(bf16_bits* vp, int w) {
  uint64_t keys = 0;
  for (int kp = 0; kp < kTileChunk / 2; ++kp) {
    bf16_bits* row = vp + size_t(kp) * 2 * w;
    for (int c = 0; c < 2 * w; c += 32) {
      const __m512i x = _mm512_loadu_si512(row + c);
      const __mmask32 bad = nonfinite_words(x);
      if (!bad) continue;
      _mm512_storeu_si512(row + c, _mm512_maskz_mov_epi16(__mmask32(~bad), x));
      // Words alternate between key 2 kp (even words) and key 2 kp + 1 (odd words).
      if (bad & 0x55555555u) keys |= uint64_t(1) << (2 * kp);
      if (bad & 0xAAAAAAAAu) keys |= uint64_t(1) << (2 * kp + 1);
    }
  }
  return keys;
}

// acc[r][c] += P[r][j] v[j][c] for the non-finite values v[j][c] of the keys in `keys`, columns
// [c0, c0 + w), for every real row r of a live tile that sees key j (sc.vis).
template <typename C>
inline void amx_add_nonfinite(const TileScratch& sc, const C* const* vals, uint64_t keys, int c0,
                              int w, int D, const bool* live, int tiles, int rows) {
  for (int j = 0; j < kTileChunk; ++j) {
    if (!((keys >> j) & 1)) continue;
    for (int c = 0; c < w; c += 32) {
      const __m512i x = row_words(vals[j] + c0 + c);
      uint32_t bad = nonfinite_words(x);
      if (!bad) continue;
      alignas(64) uint16_t words[32];
      _mm512_store_si512(words, x);
      for (; bad; bad &= bad - 1) {
        const int l = __builtin_ctz(bad);
        const float v = bf16_bits_to_float(words[l]);
        for (int r = 0; r < kmin(rows, 16 * tiles); ++r) {
          if (!live[r / 16] || j < sc.vis[2 * r] || j >= sc.vis[2 * r + 1]) continue;
          sc.acc[size_t(r) * D + c0 + c + l] += bf16_bits_to_float(sc.p[size_t(r) * kTileChunk + j]) * v;
        }
      }
    }
  }
}

// O += P V for the live row tiles (rescaled before by amx_rescale), 64 value columns at a time:
// each group of columns is packed and then multiplied while it is still in L1 (packing all 64 x
// 512 values of an MLA chunk at once, 64 KB, went through L2). Groups alternate between two
// buffers, so the tile loads of a group never follow right after the vector stores of its own
// lines.
template <typename C>
inline void amx_values(const TileScratch& sc, const C* const* vals, int j0, int j1, int D,
                       const bool* live, int tiles, int rows) {
  // One group: kTileChunk / 2 pair rows of 2 x 64 bf16 (8 KB). Both buffers fit the value region
  // (Dv x kTileChunk floats) whenever there is a second group (Dv > 64).
  constexpr size_t kGroupBf16 = (kTileChunk / 2) * 2 * 64;
  bf16_bits* const buf[2] = {sc.vp_bf16(), sc.vp_bf16() + kGroupBf16};
  const int groups = (D + 63) / 64;  // D % 32 == 0: the last group may be 32 wide
  bool uniform = true;  // every real row of a live tile sees exactly [j0, j1)
  for (int r = 0; r < kmin(rows, 16 * tiles) && uniform; ++r)
    uniform = !live[r / 16] || (sc.vis[2 * r] == j0 && sc.vis[2 * r + 1] == j1);
  uint64_t bad[2] = {0, 0};  // keys with non-finite values in each buffer's group (not uniform)
  amx_pack_values(vals, j0, j1, 0, kmin(64, D), buf[0]);
  if (!uniform) bad[0] = amx_zero_nonfinite(buf[0], kmin(64, D));
  for (int g = 0; g < groups; ++g) {
    const int c = 64 * g;
    if (g + 1 < groups) {
      amx_pack_values(vals, j0, j1, c + 64, kmin(64, D - c - 64), buf[(g + 1) & 1]);
      if (!uniform) bad[(g + 1) & 1] = amx_zero_nonfinite(buf[(g + 1) & 1], kmin(64, D - c - 64));
    }
    for (int t = 0; t < tiles; ++t) {
      if (!live[t]) continue;
      float* acc = sc.acc + size_t(16 * t) * D + c;
      const bf16_bits* P = sc.p + size_t(16 * t) * kTileChunk;
      if (D - c >= 64) amx_pv<4>(acc, D, P, buf[g & 1]);
      else amx_pv<2>(acc, D, P, buf[g & 1]);
    }
    if (bad[g & 1]) amx_add_nonfinite(sc, vals, bad[g & 1], c, kmin(64, D - c), D, live, tiles, rows);
  }
}

}  // namespace kvkernels::cpu::KVK_ISA
