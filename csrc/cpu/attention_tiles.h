// The tile kernels of prefill and MLA decode (AVX-512 builds): an item is up to kTileRows rows
// (queries x group heads) of one kv head, processed as tiles of 16 rows against chunks of
// kTileChunk = 64 keys. Included by attention_kernel.h after everything it reuses (the logit
// transform, the visibility rule, the chunk ranges of splits, pv4 and the output stage of the
// vector kernel).
//
// Per chunk of 64 keys:
//   1. the chunk is prepared once for all the item's rows. FMA: keys transposed so that a key
//      index runs along a vector ([D, 64] floats), values converted to float rows (float caches
//      are used in place). AMX: keys are read as they lie (S^T = K Q^T takes 16 key rows as a
//      tile; only fp8 rows and groups a block edge cuts are staged), values interleaved in pairs;
//   2. for each tile of 16 rows that sees any key of the chunk, in three passes over the tiles:
//      the logits (FMA: S = Q K^T, 16 x 64; AMX: S^T, 64 x 16); the online softmax step across the
//      16 rows at once; O = alpha O + P V. Separate passes put a whole pass between writing S, P or
//      a rescaled row of O with one unit and reading it with the other: a tile load right after
//      vector stores to the same lines waited for them (the first tdpbf16ps of P V took a quarter
//      of the time).
// Against the vector kernel (horizontal sums per logit, a softmax step per 16 keys and per row)
// this does the logits as an outer product with no reductions and pays the softmax's reductions
// and rescale exps once per 64 keys for 16 rows together.
//
// The FMA form serves every query and cache type on AVX-512; the AMX form (attention_amx.h)
// serves bf16 queries over bf16 / fp8 caches on CPUs with AMX, and the dp form the same calls on
// CPUs with AVX512_BF16 but no AMX (avx512bf16: Zen 4): the FMA form's loops with vdpbf16ps, two
// multiply-adds per lane and instruction, on keys packed as transposed dimension pairs and values
// packed as key pairs (the AMX form's B operands), with probabilities rounded to bf16 as on AMX.

namespace kvkernels::cpu::KVK_ISA {

// The per-thread scratch of a tile item, carved from attention_scratch_floats(plan) floats with
// every region on a 64-byte boundary.
struct TileScratch {
  float* q;              // [max_rows, D] queries: floats (FMA), or bf16 then Q^T (AMX)
  float* acc;            // [max_rows, D] unnormalized output
  float *m, *d, *alpha;  // [max_rows] softmax state
  float* s;              // [max_rows, kTileChunk] logits, then (FMA) probabilities
  bf16_bits* p;          // [max_rows, kTileChunk] probabilities as bf16 (AMX)
  int* vis;              // [max_rows, 2] keys [a, b) of the chunk each row sees
  float* kp;             // the chunk's keys, packed
  float* vp;             // the chunk's values, packed
  TileScratch(const AttentionPlan& plan, float* base) {
    const size_t R = size_t(plan.max_rows), Dk = size_t(plan.dk), Dv = size_t(plan.dv);
    float* at = align64(base);
    auto take = [&](size_t floats) {
      float* r = at;
      at = align64(at + floats);
      return r;
    };
    q = take(R * Dk);
    acc = take(R * Dv);
    m = take(R), d = take(R), alpha = take(R);
    s = take(R * kTileChunk);
    p = reinterpret_cast<bf16_bits*>(take(R * kTileChunk / 2));
    vis = reinterpret_cast<int*>(take(2 * R));
    kp = take(Dk * kTileChunk);
    vp = take(Dv * kTileChunk);
  }
  bf16_bits* q_bf16() const { return reinterpret_cast<bf16_bits*>(q); }
  // AMX: the queries as B operands (amx_pack_queries), in the second half of the query region.
  bf16_bits* qt_bf16(const AttentionPlan& plan) const { return q_bf16() + size_t(plan.max_rows) * plan.dk; }
  bf16_bits* kp_bf16() const { return reinterpret_cast<bf16_bits*>(kp); }
  bf16_bits* vp_bf16() const { return reinterpret_cast<bf16_bits*>(vp); }
  static float* align64(float* x) {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(x) + 63) & ~uintptr_t(63));
  }
};

// Transposes 16 rows of 16 dwords in place: r[i] dword j <- r[j] dword i.
inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows, within 128-bit lanes
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + c], lane k: column 4k + c of rows 4g .. 4g + 3.
  __m512i u[16];
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  // Column 4k + c takes lane k of u[c], u[4 + c], u[8 + c], u[12 + c]: a 4 x 4 transpose of lanes.
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

// One value per vector: lane i of the result is op over the 16 lanes of x[i]. A tree of 256-bit,
// 128-bit, 64-bit and 32-bit folds (45 ops for 16 reductions) leaves the rows in the lane order
// 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15 (an involution), which a final permute undoes.
template <typename Op>
inline __m512 reduce16(const __m512 x[16], Op op) {
  __m512 y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)  // y[i]: lanes 0-7 from x[i], 8-15 from x[i + 8]
    y[i] = op(_mm512_shuffle_f32x4(x[i], x[i + 8], 0x44), _mm512_shuffle_f32x4(x[i], x[i + 8], 0xee));
  for (int i = 0; i < 4; ++i)
    z[i] = op(_mm512_shuffle_f32x4(y[i], y[i + 4], 0x88), _mm512_shuffle_f32x4(y[i], y[i + 4], 0xdd));
  for (int j = 0; j < 2; ++j) {
    const __m512d a = _mm512_castps_pd(z[j]), b = _mm512_castps_pd(z[j + 2]);
    w[j] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 r = op(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xdd));
  const __m512i where = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(where, r);
}

// The base of a tile row's exponents: its running max, or 0 while that is -inf.
inline __m512 tile_exp_base(__m512 m_new) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                              m_new, _mm512_setzero_ps());
}

// The online-softmax step of softmax_rows4 for the 16 rows of a tile at once (FMA form): row i (item
// row r0 + i) sees keys [a[i], b[i]) of its logits s[i * kTileChunk ...]. The per-row max and sum
// reductions and the rescale exp run across the rows in vectors. The probabilities overwrite s. A
// row that sees nothing keeps its state (alpha = 1) and gets probability 0.
inline void softmax_tile(const AttentionParams& p, float* s, float mul, float* m, float* d,
                         float* alpha, const int* a, const int* b, const RowMap& map, int r0,
                         int64_t cs) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const bool transform = p.soft_cap > 0.0f || p.alibi_slopes;
  const __m512 mulv = _mm512_set1_ps(transform ? 1.0f : mul);
  __m512 mx[16];
  __mmask16 live = 0;
  for (int i = 0; i < 16; ++i) {
    float* row = s + i * kTileChunk;
    mx[i] = neg_inf;
    if (a[i] >= b[i]) continue;
    live |= __mmask16(1u << i);
    if (transform) transform_logits(p, row, kTileChunk, mul, map.head(r0 + i), map.pos(r0 + i), cs);
    for (int x = 0; x < kTileChunk / 16; ++x) {  // scale, mask (-inf), row max
      const int lo = kmin(kmax(a[i] - 16 * x, 0), 16), hi = kmin(kmax(b[i] - 16 * x, 0), 16);
      const __mmask16 vis = __mmask16(((1u << hi) - 1) & ~((1u << lo) - 1));
      const __m512 v = _mm512_mask_mul_ps(neg_inf, vis, _mm512_loadu_ps(row + 16 * x), mulv);
      _mm512_storeu_ps(row + 16 * x, v);
      mx[i] = _mm512_max_ps(mx[i], v);
    }
  }
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 row_max = reduce16(mx, [](__m512 u, __m512 v) { return _mm512_max_ps(u, v); });
  const __m512 m_new = _mm512_mask_max_ps(m_old, live, m_old, row_max);
  // Exponents are taken relative to m_new, or to 0 while it is -inf (nothing but -inf logits
  // yet): -inf - -inf would be NaN, and exp propagates NaN (a NaN logit must reach d).
  const __m512 ref = tile_exp_base(m_new);
  alignas(64) float mrow[16];
  _mm512_store_ps(mrow, ref);
  __m512 sum[16];
  for (int i = 0; i < 16; ++i) {
    sum[i] = _mm512_setzero_ps();
    float* row = s + i * kTileChunk;
    const bool is_live = (live >> i) & 1;
    const Vec mv = Vec::set1(mrow[i]);
    for (int x = 0; x < kTileChunk; x += 32) {
      Vec e0 = Vec::zero(), e1 = Vec::zero();
      if (is_live) e0 = (Vec::load(row + x) - mv).exp(), e1 = (Vec::load(row + x + 16) - mv).exp();
      sum[i] = _mm512_add_ps(sum[i], _mm512_add_ps(e0.v, e1.v));
      e0.store(row + x), e1.store(row + x + 16);
    }
  }
  // alpha = e^(m_old - m_new), 1 for rows that saw nothing (whose m_old may be -inf).
  const __m512 al = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.0f),
                                         Vec{_mm512_sub_ps(m_old, ref)}.exp().v);
  const __m512 sums = reduce16(sum, [](__m512 u, __m512 v) { return _mm512_add_ps(u, v); });
  _mm512_storeu_ps(alpha, al);
  _mm512_storeu_ps(d, _mm512_fmadd_ps(_mm512_loadu_ps(d), al, sums));
  _mm512_storeu_ps(m, m_new);
}

// The lines of the next chunk's key and value rows, prefetched into L2 a slice at a time between
// the softmax steps of the row tiles (FMA form): paged blocks are scattered, so no hardware
// prefetcher finds the next one, and a burst of all the chunk's lines at once stalls the core on
// the fill buffers. The AMX form does not prefetch: it reads its key tiles straight from the
// block, and software prefetches of the next block made MLA decode (b8 x 4096, block 64 or 16)
// 7-10% slower and left bf16 prefill unchanged (measured 2026-11-22; the hardware prefetchers
// presumably follow the strided tile loads within a block).
struct ChunkPrefetch {
  const char* rows[2 * kTileChunk];
  int n = 0;                 // rows: keys, or key and value alternating (!v_in_k)
  int k_bytes = 0, v_bytes = 0;  // bytes of a key row and of a value row (head dims may differ)
  int row = 0, at = 0;       // next line to issue: rows[row] + at
  bool v_in_k = true;
  template <typename C>
  void start(const C* const* keys, const C* const* vals, int j0, int j1, int Dk, int Dv,
             bool v_is_k) {
    n = row = at = 0;
    k_bytes = Dk * int(sizeof(C)), v_bytes = Dv * int(sizeof(C));
    v_in_k = v_is_k;
    for (int j = j0; j < j1; ++j) {
      rows[n++] = reinterpret_cast<const char*>(keys[j]);
      if (!v_in_k) rows[n++] = reinterpret_cast<const char*>(vals[j]);
    }
  }
  int bytes_of(int r) const { return v_in_k || r % 2 == 0 ? k_bytes : v_bytes; }
  void issue(int lines) {
    for (; lines > 0 && row < n; --lines) {
      prefetch(rows[row] + at);
      if ((at += 64) >= bytes_of(row)) at = 0, ++row;
    }
  }
  int total() const {
    const int k_lines = (k_bytes + 63) / 64, v_lines = (v_bytes + 63) / 64;
    return v_in_k ? n * k_lines : n / 2 * (k_lines + v_lines);
  }
};

// ---- FMA form ----

// Keys [j0, j1) of a chunk as floats transposed: kt[dim * kTileChunk + key], zero outside.
template <typename C>
inline void fma_pack_keys(const C* const* rows, int j0, int j1, int D, float* kt) {
  const Mask full = Vec::mask(Vec::N);
  for (int kb = 0; kb < kTileChunk / 16; ++kb) {
    for (int db = 0; db < D / 16; ++db) {
      __m512i r[16];
      for (int n = 0; n < 16; ++n) {
        const int j = kb * 16 + n;
        r[n] = j >= j0 && j < j1 ? _mm512_castps_si512(Vec::load(rows[j] + db * 16, full).v)
                                 : _mm512_setzero_si512();
      }
      transpose16_epi32(r);
      for (int i = 0; i < 16; ++i)
        _mm512_storeu_si512(kt + size_t(db * 16 + i) * kTileChunk + kb * 16, r[i]);
    }
  }
}

// Value rows [j0, j1) as float rows: float caches in place, others converted into vp.
template <typename C>
inline void fma_pack_values(const C* const* rows, int j0, int j1, int D, float* vp,
                            const float** out) {
  for (int j = j0; j < j1; ++j) {
    if constexpr (std::is_same_v<C, float>) {
      out[j] = rows[j];
    } else {
      float* o = vp + size_t(j) * D;
      for (int c = 0; c < D; c += Vec::N) Vec::load(rows[j] + c, Vec::mask(Vec::N)).store(o + c);
      out[j] = o;
    }
  }
}

// S[16, 64] = Q[16, D] K^T as outer products: 4 rows x 64 keys of S held in 16 registers while
// the dims stream through (per dim: 4 key vectors, 4 broadcast queries, 16 FMAs).
inline void fma_logits(const float* q, int D, const float* kt, float* s) {
  for (int r = 0; r < 16; r += 4) {
    Vec a[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) a[i][x] = Vec::zero();
    const float* qr = q + size_t(r) * D;
    for (int dd = 0; dd < D; ++dd) {
      const float* k = kt + size_t(dd) * kTileChunk;
      const Vec k0 = Vec::load(k), k1 = Vec::load(k + 16), k2 = Vec::load(k + 32),
                k3 = Vec::load(k + 48);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const Vec qb = Vec::set1(qr[i * D + dd]);
        a[i][0] = fma(qb, k0, a[i][0]), a[i][1] = fma(qb, k1, a[i][1]);
        a[i][2] = fma(qb, k2, a[i][2]), a[i][3] = fma(qb, k3, a[i][3]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) a[i][x].store(s + (r + i) * kTileChunk + x * 16);
  }
}

// Which keys of the chunk rows r .. r + 3 see (sc.vis; rows past `rows` are padding).
inline Vis4 tile_vis4(const TileScratch& sc, int r, int rows, int j0, int j1) {
  return Vis4(j0, j1, rows - r, [&](int i, int* a, int* b) {
    *a = sc.vis[2 * (r + i)], *b = sc.vis[2 * (r + i) + 1];
  });
}

// O = alpha O + P V for one row tile, through pv4 (4 rows x 64 columns in registers) over the keys
// all four rows see and pv4_edges for the rest (attention_kernel.h, Vis4).
inline void fma_values(const TileScratch& sc, int r0, int rows, int D, const float* const* vals,
                       int j0, int j1, const Mask* mk) {
  for (int r = r0; r < r0 + 16; r += 4) {
    float* acc = sc.acc + size_t(r) * D;
    const float* P = sc.s + size_t(r) * kTileChunk;
    const Vis4 v = tile_vis4(sc, r, rows, j0, j1);
    int c = 0;
    for (; c + 4 <= D / 16; c += 4)
      pv4<4>(acc, D, P, kTileChunk, sc.alpha + r, vals, v.lo, v.hi, c, mk, nullptr);
    for (; c < D / 16; ++c)
      pv4<1>(acc, D, P, kTileChunk, sc.alpha + r, vals, v.lo, v.hi, c, mk, nullptr);
    pv4_edges(acc, D, P, kTileChunk, vals, j0, j1, v, D / 16, mk);
  }
}

#if defined(KVK_BF16)
// acc + a . b over the 16 bf16 pairs of each float lane (vdpbf16ps).
inline Vec dpbf16(Vec acc, __m512i a, __m512i b) {
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)a, (__m512bh)b)};
}

// ---- bf16 pairs: what the AMX and the dp (vdpbf16ps) forms share ----
// Both multiply bf16 pairs along the reduction dimension: for P V, (v_2kp[c], v_2kp+1[c]) by
// (p_2kp, p_2kp+1), with the probabilities rounded to bf16 as SDPA's flash kernels do.

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

// Packs columns [c0, c0 + w) of values [j0, j1) of a chunk as bf16 pairs for O += P V (AMX B operands, vdpbf16ps operands): row kp
// holds, for each of the w columns, the pair (v[2kp][c], v[2kp + 1][c]). Values outside [j0, j1)
// are zero: their probability is 0, and 0 times a stale non-finite value would be NaN.
template <typename C>
inline void pack_value_pairs(const C* const* rows, int j0, int j1, int c0, int w, bf16_bits* vp) {
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

// Rows that do not all see the same keys of a chunk (the causal diagonal or a window's edge in
// prefill): a key a row does not see has probability 0 for it, but the pair product (tile or
// vdpbf16ps) still multiplies that 0 by the key's value, and 0 times an inf or NaN value is NaN (docs/ops.md: keys
// a row does not see never influence it). For such chunks the non-finite values are zeroed in the
// packed operands (zero_nonfinite_pairs) and added back afterwards by the rows that see them
// (add_nonfinite_pairs). A chunk every row sees whole (decode, MLA decode, all but the diagonal
// chunks of prefill) skips both.

// bf16 bits with an all-ones exponent: inf or NaN.
inline __mmask32 nonfinite_words(__m512i x) {
  const __m512i expo = _mm512_set1_epi16(0x7F80);
  return _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, expo), expo);
}

// Zeroes the non-finite values of a packed group (pack_value_pairs, w columns); returns the keys
// (bit j: key j of the chunk) that had one.
inline uint64_t zero_nonfinite_pairs(bf16_bits* vp, int w) {
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
inline void add_nonfinite_pairs(const TileScratch& sc, const C* const* vals, uint64_t keys, int c0,
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

// O += P V for the live row tiles, 64 value columns at a time: each group of columns is packed
// (pack_value_pairs) and then multiplied, by mult(acc, P, packed, w) for each live row tile (acc:
// its first row at the group's first column, P: its bf16 probabilities), while it is still in L1
// (packing all 64 x 512 values of an MLA chunk at once, 64 KB, went through L2). Groups alternate
// between two buffers, so the tile loads of a group never follow right after the vector stores of
// its own lines.
template <typename C, typename Mult>
inline void paired_values(const TileScratch& sc, const C* const* vals, int j0, int j1, int D,
                          const bool* live, int tiles, int rows, Mult mult) {
  // One group: kTileChunk / 2 pair rows of 2 x 64 bf16 (8 KB). Both buffers fit the value region
  // (Dv x kTileChunk floats) whenever there is a second group (Dv > 64).
  constexpr size_t kGroupBf16 = (kTileChunk / 2) * 2 * 64;
  bf16_bits* const buf[2] = {sc.vp_bf16(), sc.vp_bf16() + kGroupBf16};
  const int groups = (D + 63) / 64;  // D % 32 == 0: the last group may be 32 wide
  bool uniform = true;  // every real row of a live tile sees exactly [j0, j1)
  for (int r = 0; r < kmin(rows, 16 * tiles) && uniform; ++r)
    uniform = !live[r / 16] || (sc.vis[2 * r] == j0 && sc.vis[2 * r + 1] == j1);
  uint64_t bad[2] = {0, 0};  // keys with non-finite values in each buffer's group (not uniform)
  pack_value_pairs(vals, j0, j1, 0, kmin(64, D), buf[0]);
  if (!uniform) bad[0] = zero_nonfinite_pairs(buf[0], kmin(64, D));
  for (int g = 0; g < groups; ++g) {
    const int c = 64 * g;
    if (g + 1 < groups) {
      pack_value_pairs(vals, j0, j1, c + 64, kmin(64, D - c - 64), buf[(g + 1) & 1]);
      if (!uniform) bad[(g + 1) & 1] = zero_nonfinite_pairs(buf[(g + 1) & 1], kmin(64, D - c - 64));
    }
    for (int t = 0; t < tiles; ++t) {
      if (!live[t]) continue;
      mult(sc.acc + size_t(16 * t) * D + c, sc.p + size_t(16 * t) * kTileChunk, buf[g & 1], kmin(64, D - c));
    }
    if (bad[g & 1]) add_nonfinite_pairs(sc, vals, bad[g & 1], c, kmin(64, D - c), D, live, tiles, rows);
  }
}

// ---- dp form: vdpbf16ps tiles (avx512bf16; the FMA form's loops at two multiply-adds per lane) ----

// Keys [j0, j1) of a chunk as bf16 dimension pairs transposed: kt[dp * kTileChunk + key] holds
// dims 2dp and 2dp + 1 of the key (32 bits), zero outside [j0, j1). Per 16 keys x 32 dims one
// 16 x 16 transpose of dwords.
template <typename C>
inline void dp_pack_keys(const C* const* rows, int j0, int j1, int D, uint32_t* kt) {
  for (int kb = 0; kb < kTileChunk / 16; ++kb) {
    if (kb * 16 + 16 <= j0 || kb * 16 >= j1) {  // no key of this group: zeros
      for (int dp = 0; dp < D / 2; ++dp)
        _mm512_storeu_si512(kt + size_t(dp) * kTileChunk + kb * 16, _mm512_setzero_si512());
      continue;
    }
    for (int db = 0; db < D / 32; ++db) {
      __m512i r[16];
      for (int n = 0; n < 16; ++n) {
        const int j = kb * 16 + n;
        r[n] = j >= j0 && j < j1 ? row_words(rows[j] + db * 32) : _mm512_setzero_si512();
      }
      transpose16_epi32(r);
      for (int i = 0; i < 16; ++i)
        _mm512_storeu_si512(kt + size_t(db * 16 + i) * kTileChunk + kb * 16, r[i]);
    }
  }
}

// S[16, 64] = Q[16, D] K^T (unscaled): 4 rows x 64 keys in 16 registers while the dim pairs
// stream through (per pair: 4 key vectors, 4 broadcast query pairs, 16 vdpbf16ps).
inline void dp_logits(const bf16_bits* q, int D, const uint32_t* kt, float* s) {
  for (int r = 0; r < 16; r += 4) {
    Vec a[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) a[i][x] = Vec::zero();
    const bf16_bits* qr = q + size_t(r) * D;
    for (int dp = 0; dp < D / 2; ++dp) {
      const uint32_t* k = kt + size_t(dp) * kTileChunk;
      const __m512i k0 = _mm512_loadu_si512(k), k1 = _mm512_loadu_si512(k + 16),
                    k2 = _mm512_loadu_si512(k + 32), k3 = _mm512_loadu_si512(k + 48);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        uint32_t u;
        std::memcpy(&u, qr + size_t(i) * D + 2 * dp, sizeof u);
        const __m512i qb = _mm512_set1_epi32(int(u));
        a[i][0] = dpbf16(a[i][0], qb, k0), a[i][1] = dpbf16(a[i][1], qb, k1);
        a[i][2] = dpbf16(a[i][2], qb, k2), a[i][3] = dpbf16(a[i][3], qb, k3);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) a[i][x].store(s + (r + i) * kTileChunk + x * 16);
  }
}

// The probabilities of a row tile (softmax_tile's float rows) as bf16 rows for P V.
inline void dp_probs_bf16(const float* s, bf16_bits* P) {
  for (int i = 0; i < 16; ++i)
    for (int x = 0; x < kTileChunk; x += 32) {
      const __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + i * kTileChunk + x + 16),
                                              _mm512_loadu_ps(s + i * kTileChunk + x));
      _mm512_storeu_si512(P + i * kTileChunk + x, (__m512i)pb);
    }
}

// O[16, W] = alpha O + P[16, 64] V[64, W] for one row tile and W = 16 N columns (N <= 4) packed by
// pack_value_pairs: 4 rows x W columns in registers while the 32 key pairs stream through.
template <int N>
inline void dp_pv_tile(float* acc, int D, const bf16_bits* P, const float* alpha, const bf16_bits* vp) {
  constexpr int row = 32 * N;  // bf16 per packed pair row
  for (int r = 0; r < 16; r += 4) {
    Vec a[4][N];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const Vec al = Vec::set1(alpha[r + i]);
#pragma GCC unroll 4
      for (int x = 0; x < N; ++x) a[i][x] = Vec::load(acc + size_t(r + i) * D + 16 * x) * al;
    }
    for (int kp = 0; kp < kTileChunk / 2; ++kp) {
      __m512i v[N];
#pragma GCC unroll 4
      for (int x = 0; x < N; ++x) v[x] = _mm512_loadu_si512(vp + size_t(kp) * row + 32 * x);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        uint32_t u;
        std::memcpy(&u, P + size_t(r + i) * kTileChunk + 2 * kp, sizeof u);
        const __m512i pp = _mm512_set1_epi32(int(u));
#pragma GCC unroll 4
        for (int x = 0; x < N; ++x) a[i][x] = dpbf16(a[i][x], pp, v[x]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int x = 0; x < N; ++x) a[i][x].store(acc + size_t(r + i) * D + 16 * x);
  }
}
#endif  // KVK_BF16

}  // namespace kvkernels::cpu::KVK_ISA

#if defined(KVK_AMX)
#include "attention_amx.h"
#endif

namespace kvkernels::cpu::KVK_ISA {

// One item on tiles (plan.tiles: one kv head per item; head_dim and head_dim_v multiples of 16, of
// 32 on AMX, whose tile configuration the caller loads; equal, or for MLA the value is a prefix of
// the key row).
template <typename Q, typename C, TileKernel kMode>
void attend_item_tiles(const AttentionParams& p, const AttentionPlan& plan, const AttentionItem& it,
                       float* scratch, float* part_acc, float* part_m, float* part_d) {
  const paged_kv_t& kv = p.kv;
  const int G = plan.group, Dk = plan.dk, Dv = plan.dv;
  const bool v_in_k = kv.v == kv.k;  // MLA: the value is the first Dv columns of the key row
  const int rows = int(it.q1 - it.q0) * G, rows16 = (rows + 15) & ~15;
  const int64_t seq_len = kv.seq_lens[it.seq];
  const RowMap map{p.q_begin(it.seq) + it.q0, seq_len - p.q_len(it.seq) + it.q0, G,
                   it.kv_head * G};
  const TileScratch sc(plan, scratch);
  constexpr bool kAmx = kMode == TileKernel::kAmx, kDp = kMode == TileKernel::kDp;
  constexpr bool kBf16 = kAmx || kDp;  // bf16 queries and pairs

  for (int r = 0; r < rows16; ++r) {
    const Q* src = r < rows ? static_cast<const Q*>(p.q) + map.token(r) * p.q_stride_token +
                                  map.head(r) * p.q_stride_head
                            : nullptr;
    if constexpr (kBf16) {  // bf16 as it is
      bf16_bits* q = sc.q_bf16() + size_t(r) * Dk;
      if (src) std::memcpy(q, src, size_t(Dk) * sizeof(bf16_bits));
      else std::memset(q, 0, size_t(Dk) * sizeof(bf16_bits));
    } else {
      float* q = sc.q + size_t(r) * Dk;
      for (int i = 0; i < Dk; ++i) q[i] = src ? to_float(src[i]) : 0.0f;
    }
    sc.m[r] = -INFINITY, sc.d[r] = 0.0f, sc.alpha[r] = 1.0f;
  }
  std::memset(sc.acc, 0, size_t(rows16) * Dv * sizeof(float));
#if defined(KVK_AMX)
  if constexpr (kAmx) amx_pack_queries(sc.q_bf16(), rows16, Dk, sc.qt_bf16(plan));
#endif

  const float mul = p.scale * kv.logit_k_scale_of(it.kv_head);
  const ChunkRange cr(p, plan, it, map, rows, kTileChunk);
  const RowMasks mk(kv);
  const C* kb = static_cast<const C*>(kv.k);
  const C* vb = static_cast<const C*>(kv.v);
  // Row pointers of the chunk and of the next one (prefetched while this one is computed).
  const C *rows_k[2][kTileChunk], *rows_v[2][kTileChunk];
  const float* fvals[kTileChunk];
  auto chunk_keys = [&](int64_t c, int* j0, int* j1, const C** keys, const C** vals) {
    const int64_t cs = c * kTileChunk;
    *j0 = int(kmax<int64_t>(0, cr.lo - cs));
    *j1 = int(kmin<int64_t>(kTileChunk, cr.hi + 1 - cs));
    for_chunk_slots(kv, it.seq, cs, *j0, *j1, [&](int j, int64_t block, int slot) {
      keys[j] = kb + kv.k_offset(block, slot, it.kv_head);
      vals[j] = vb + kv.v_offset(block, slot, it.kv_head);
    });
  };
  ChunkPrefetch pf;
  int j0 = 0, j1 = 0, nj0 = 0, nj1 = 0;
  if (cr.c_begin < cr.c_end) chunk_keys(cr.c_begin, &nj0, &nj1, rows_k[0], rows_v[0]);
  for (int64_t c = cr.c_begin; c < cr.c_end; ++c) {
    const int64_t cs = c * kTileChunk;
    const C* const* keys = rows_k[(c - cr.c_begin) & 1];
    const C* const* vals = rows_v[(c - cr.c_begin) & 1];
    j0 = nj0, j1 = nj1;
    pf.issue(pf.total());  // whatever the last chunk's tiles left
    pf.n = 0;
    if (c + 1 < cr.c_end) {
      const int nxt = (c + 1 - cr.c_begin) & 1;
      chunk_keys(c + 1, &nj0, &nj1, rows_k[nxt], rows_v[nxt]);
      if constexpr (!kAmx) pf.start(rows_k[nxt], rows_v[nxt], nj0, nj1, Dk, Dv, v_in_k);
    }
    const int tiles = rows16 / 16;
#if defined(KVK_AMX)
    KeyTiles kt;
    if constexpr (kAmx) kt = amx_key_tiles(keys, j0, j1, Dk, sc.kp_bf16());
#endif
#if defined(KVK_BF16)
    if constexpr (kDp) dp_pack_keys(keys, j0, j1, Dk, reinterpret_cast<uint32_t*>(sc.kp));
#endif
    if constexpr (!kBf16) {
      fma_pack_keys(keys, j0, j1, Dk, sc.kp);
      fma_pack_values(vals, j0, j1, Dv, sc.vp, fvals);
    }
    // Which rows see which keys; tiles that see none are skipped (e.g. causal rows before the
    // chunk), their state unchanged.
    bool live[kTileRows / 16] = {};  // the planner keeps max_rows <= kTileRows
    for (int t = 0; t < tiles; ++t) {
      for (int i = 0; i < 16; ++i) {
        const int r = t * 16 + i;
        int* v = sc.vis + 2 * r;
        v[0] = v[1] = 0;
        if (r < rows) visible_keys(p, map.pos(r), cs, j0, j1, &v[0], &v[1]);
        live[t] |= v[0] < v[1];
      }
    }
    auto each_live_tile = [&](auto f) {
      for (int t = 0; t < tiles; ++t)
        if (live[t]) f(t * 16);
    };
    int live_tiles = 0;
    for (int t = 0; t < tiles; ++t) live_tiles += live[t];
    each_live_tile([&](int r0) {
      float* s = sc.s + size_t(r0) * kTileChunk;
#if defined(KVK_AMX)
      if constexpr (kAmx) {
        return amx_logits(kt, sc.qt_bf16(plan) + size_t(r0 / 16) * (Dk / 32) * 512, Dk, s);
      }
#endif
#if defined(KVK_BF16)
      if constexpr (kDp) {
        return dp_logits(sc.q_bf16() + size_t(r0) * Dk, Dk, reinterpret_cast<const uint32_t*>(sc.kp), s);
      }
#endif
      fma_logits(sc.q + size_t(r0) * Dk, Dk, sc.kp, s);
    });
    const int per_tile = (pf.total() + live_tiles - 1) / kmax(live_tiles, 1);
    each_live_tile([&](int r0) {
      pf.issue(per_tile);
      float* s = sc.s + size_t(r0) * kTileChunk;
      int a[16], b[16];
      for (int i = 0; i < 16; ++i) a[i] = sc.vis[2 * (r0 + i)], b[i] = sc.vis[2 * (r0 + i) + 1];
      float *m = sc.m + r0, *d = sc.d + r0, *alpha = sc.alpha + r0;
#if defined(KVK_AMX)
      if constexpr (kAmx) {
        softmax_tile_t(p, s, mul, m, d, alpha, a, b, map, r0, cs, sc.p + size_t(r0) * kTileChunk);
        return amx_rescale(sc, r0, Dv);
      }
#endif
      softmax_tile(p, s, mul, m, d, alpha, a, b, map, r0, cs);
#if defined(KVK_BF16)
      if constexpr (kDp) dp_probs_bf16(s, sc.p + size_t(r0) * kTileChunk);
#endif
    });
#if defined(KVK_AMX)
    if constexpr (kAmx) amx_values(sc, vals, j0, j1, Dv, live, tiles, rows);
#endif
#if defined(KVK_BF16)
    if constexpr (kDp) {
      const float* alpha = sc.alpha;
      paired_values(sc, vals, j0, j1, Dv, live, tiles, rows,
                    [&](float* acc, const bf16_bits* P, const bf16_bits* vp, int w) {
                      const int r0 = int((P - sc.p) / kTileChunk);
                      if (w == 64) dp_pv_tile<4>(acc, Dv, P, alpha + r0, vp);
                      else dp_pv_tile<2>(acc, Dv, P, alpha + r0, vp);
                    });
    }
#endif
    if constexpr (!kBf16)
      each_live_tile([&](int r0) { fma_values(sc, r0, rows, Dv, fvals, j0, j1, mk.v); });
  }
  store_rows<Q>(p, plan, map, it.seq, it.kv_head, 0, rows, sc.acc, sc.m, sc.d, part_acc, part_m, part_d);
}

template <typename Q, typename C>
void attend_tiles(const AttentionParams& p, const AttentionPlan& plan, const AttentionItem* items,
                  int64_t begin, int64_t end, float* scratch, const AttentionPartials& part) {
  const size_t item_rows = size_t(plan.heads) * plan.max_rows;
  auto run = [&](auto mode) {
    for (int64_t i = begin; i < end; ++i) {
      const size_t row0 = size_t(i) * item_rows;
      const bool split = plan.splits > 1;
      attend_item_tiles<Q, C, decltype(mode)::value>(
          p, plan, items[i], scratch, split ? part.acc + row0 * plan.dv : nullptr,
          split ? part.m + row0 : nullptr, split ? part.d + row0 : nullptr);
    }
  };
#if defined(KVK_BF16)
  if constexpr (std::is_same_v<Q, c10::BFloat16> && kWordRows<C>) {
#if defined(KVK_AMX)
    if (plan.tiles == TileKernel::kAmx) {
      amx_configure();
      run(std::integral_constant<TileKernel, TileKernel::kAmx>{});
      _tile_release();
      return;
    }
#endif
    if (plan.tiles == TileKernel::kDp) return run(std::integral_constant<TileKernel, TileKernel::kDp>{});
  }
#endif
  run(std::integral_constant<TileKernel, TileKernel::kFma>{});
}

}  // namespace kvkernels::cpu::KVK_ISA
