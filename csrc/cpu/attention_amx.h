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

// O[16, 16N] += P[16, 64] V[64, 16N] for N column tiles: acc points at the first column of the
// row tile (row stride D), vp at the values of those columns packed by pack_value_pairs (w = 16N).
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

// O += P V for the live row tiles (rescaled before by amx_rescale) on the tile unit.
template <typename C>
inline void amx_values(const TileScratch& sc, const C* const* vals, int j0, int j1, int D,
                       const bool* live, int tiles, int rows) {
  paired_values(sc, vals, j0, j1, D, live, tiles, rows,
                [D](float* acc, const bf16_bits* P, const bf16_bits* vp, int w) {
                  if (w == 64) amx_pv<4>(acc, D, P, vp);
                  else amx_pv<2>(acc, D, P, vp);
                });
}

}  // namespace kvkernels::cpu::KVK_ISA
