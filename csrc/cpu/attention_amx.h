// Prefill attention on AMX tiles, for bf16 queries over bf16 or fp8 caches (fp8 -> bf16 is exact,
// so every input of the tile products is exact). Included by attention_kernel.h in the avx512amx
// build only (attention_amx.cpp, KVK_AMX), after everything it reuses: the softmax step, the
// visibility rule, the chunk ranges of splits and the output stage are those of the vector kernel.
//
// An item is up to kAmxRows rows (queries x group heads) of one kv head. Per chunk of kAmxChunk
// keys:
//   1. the chunk is packed once as bf16 tiles: keys transposed into the pair-interleaved ("VNNI")
//      layout of a B operand of S = Q K^T, values pair-interleaved for O += P V;
//   2. for each tile of 16 rows that sees any key of the chunk: S (16 x 64, float) from 4 tile
//      products per 32 dims, the online softmax step of the vector kernel on each row (scale,
//      soft cap, ALiBi, mask), P rounded to bf16 (as SDPA's flash kernel does), the rows of O
//      rescaled where the running max moved, then O += P V on tiles of 16 x 16 floats loaded
//      from and stored back to the accumulator.
// The tile products cost little next to the softmax (one vector exp per 16 logits against 2 x 128
// multiply-adds per logit on the tiles), which is why the chunk is 64 keys wide: the per-row
// reductions and the rescale of O are paid once per 64 keys.
//
// Tile registers: 0-3 accumulators (S key tiles or O column tiles), 4 the A operand (Q or P),
// 5 and 6 alternate as the B operand.

namespace kvkernels::cpu::KVK_ISA {

using bf16_bits = uint16_t;

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

// The per-thread scratch of an AMX item, carved from attention_scratch_floats(plan) floats with
// every region on a 64-byte boundary.
struct AmxScratch {
  bf16_bits* q;    // [max_rows, D] the item's queries
  float* acc;      // [max_rows, D] unnormalized output
  float *m, *d, *alpha;  // [max_rows] softmax state
  float* s;        // [16, kAmxChunk] logits, then probabilities, of one row tile
  bf16_bits* p;    // [16, kAmxChunk] probabilities as bf16
  bf16_bits* kp;   // [D / 32][kAmxChunk / 16] tiles of 16 dim pairs x 16 keys x 2
  bf16_bits* vp;   // [kAmxChunk / 2][D][2] value rows interleaved in pairs
  AmxScratch(const AttentionPlan& plan, float* base) {
    const size_t R = size_t(plan.max_rows), D = size_t(plan.dk);
    float* at = align64(base);
    auto take = [&](size_t floats) {
      float* r = at;
      at = align64(at + floats);
      return r;
    };
    q = reinterpret_cast<bf16_bits*>(take(R * D / 2));
    acc = take(R * D);
    m = take(R), d = take(R), alpha = take(R);
    s = take(16 * kAmxChunk);
    p = reinterpret_cast<bf16_bits*>(take(8 * kAmxChunk));
    kp = reinterpret_cast<bf16_bits*>(take(D * kAmxChunk / 2));
    vp = reinterpret_cast<bf16_bits*>(take(D * kAmxChunk / 2));
  }
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

// 32 values of a cache row as bf16 bits (exact for bf16 and fp8 rows).
template <typename C>
inline __m512i row_words(const C* row) {
  return word_loader<C>().load(row, Words::mask(Words::N)).v;
}

// Packs keys [j0, j1) of a chunk (rows[j]) as B tiles of S = Q K^T: tile (t, kb) holds dims
// [32t, 32t + 32) of keys [16kb, 16kb + 16) as 16 rows of dim pairs x 16 keys x 2. A 32-bit word
// of a key row is one dim pair, so this is a 16 x 16 transpose of 32-bit words per tile. Keys
// outside [j0, j1) are zero (their logits are masked; zeros keep them finite).
template <typename C>
inline void pack_keys(const C* const* rows, int j0, int j1, int D, bf16_bits* kp) {
  for (int kb = 0; kb < kAmxChunk / 16; ++kb) {
    for (int t = 0; t < D / 32; ++t) {
      __m512i r[16];
      for (int n = 0; n < 16; ++n) {
        const int j = kb * 16 + n;
        r[n] = j >= j0 && j < j1 ? row_words(rows[j] + t * 32) : _mm512_setzero_si512();
      }
      transpose16_epi32(r);
      bf16_bits* tile = kp + size_t(t * (kAmxChunk / 16) + kb) * 512;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tile + i * 32, r[i]);
    }
  }
}

// Packs values [j0, j1) as B operands of O += P V: row kp of the result holds, for every column c,
// the pair (v[2kp][c], v[2kp + 1][c]). Values outside [j0, j1) are zero: their probability is 0,
// and 0 times a stale non-finite value would be NaN.
template <typename C>
inline void pack_values(const C* const* rows, int j0, int j1, int D, bf16_bits* vp) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                  11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int kp = 0; kp < kAmxChunk / 2; ++kp) {
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

// S[16, 64] = Q[16, D] K^T for one row tile, as floats with row stride kAmxChunk.
inline void amx_logits(const bf16_bits* q, int D, const bf16_bits* kp, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int t = 0; t < D / 32; ++t) {
    _tile_loadd(4, q + t * 32, D * 2);
    const bf16_bits* b = kp + size_t(t) * 4 * 512;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 512, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 1024, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 1536, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, s, kAmxChunk * 4);
  _tile_stored(1, s + 16, kAmxChunk * 4);
  _tile_stored(2, s + 32, kAmxChunk * 4);
  _tile_stored(3, s + 48, kAmxChunk * 4);
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
  for (int ks = 0; ks < kAmxChunk / 32; ++ks) {
    _tile_loadd(4, P + ks * 32, kAmxChunk * 2);
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

// One value per vector: lane i of the result is op over the 16 lanes of x[i]. A tree of 256-bit,
// 128-bit, 64-bit and 32-bit folds (45 ops for 16 reductions) leaves the rows in the lane order
// 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15 (an involution), which a final permute undoes.
template <typename Op>
inline __m512 reduce16(const __m512 x[16], Op op) {
  __m512 y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)  // y[i]: lanes 0-7 from x[i], 8-15 from x[i + 8]
    y[i] = op(_mm512_shuffle_f32x4(x[i], x[i + 8], 0x44), _mm512_shuffle_f32x4(x[i], x[i + 8], 0xee));
  for (int i = 0; i < 4; ++i)  // z[i], 128-bit lanes from x[i], x[i + 8], x[i + 4], x[i + 12]
    z[i] = op(_mm512_shuffle_f32x4(y[i], y[i + 4], 0x88), _mm512_shuffle_f32x4(y[i], y[i + 4], 0xdd));
  for (int j = 0; j < 2; ++j) {  // w[j], per 128-bit lane: 2 floats from z[j], 2 from z[j + 2]
    const __m512d a = _mm512_castps_pd(z[j]), b = _mm512_castps_pd(z[j + 2]);
    w[j] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 r = op(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xdd));
  const __m512i where = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(where, r);
}

// The online-softmax step of softmax_row for the 16 rows of a tile at once: row i sees keys
// [a[i], b[i]) of its logits s[i * kAmxChunk ...]. The per-row max and sum reductions and the
// rescale exp run across the rows in vectors, and the probabilities go straight to bf16 in P.
// A row that sees nothing keeps its state (alpha = 1) and gets P = 0.
inline void softmax_tile(const AttentionParams& p, float* s, float mul, float* m, float* d,
                         float* alpha, const int* a, const int* b, const RowMap& map, int r0,
                         int64_t cs, bf16_bits* P) {
  constexpr int NV = kAmxChunk / 16;
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const bool transform = p.soft_cap > 0.0f || p.alibi_slopes;
  const __m512 mulv = _mm512_set1_ps(transform ? 1.0f : mul);
  __m512 mx[16];
  __mmask16 live = 0;
  for (int i = 0; i < 16; ++i) {
    float* row = s + i * kAmxChunk;
    mx[i] = neg_inf;
    if (a[i] >= b[i]) continue;
    live |= __mmask16(1u << i);
    if (transform) transform_logits(p, row, kAmxChunk, mul, map.head(r0 + i), map.pos(r0 + i), cs);
    for (int x = 0; x < NV; ++x) {  // scale and mask (invisible lanes -inf), then the row max
      const int lo = kmin(kmax(a[i] - 16 * x, 0), 16), hi = kmin(kmax(b[i] - 16 * x, 0), 16);
      const __mmask16 vis = __mmask16(((1u << hi) - 1) & ~((1u << lo) - 1));
      const __m512 v = _mm512_mask_mul_ps(neg_inf, vis, _mm512_loadu_ps(row + 16 * x), mulv);
      _mm512_storeu_ps(row + 16 * x, v);
      mx[i] = _mm512_max_ps(mx[i], v);
    }
  }
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 m_new = _mm512_mask_max_ps(m_old, live, m_old,
                                          reduce16(mx, [](__m512 u, __m512 v) { return _mm512_max_ps(u, v); }));
  alignas(64) float mrow[16];
  _mm512_store_ps(mrow, m_new);
  __m512 sum[16];
  for (int i = 0; i < 16; ++i) {
    sum[i] = _mm512_setzero_ps();
    const float* row = s + i * kAmxChunk;
    bf16_bits* prow = P + i * kAmxChunk;
    if (!((live >> i) & 1)) {
      for (int x = 0; x < kAmxChunk; x += 32) _mm512_storeu_si512(prow + x, _mm512_setzero_si512());
      continue;
    }
    const Vec mv = Vec::set1(mrow[i]);
    for (int x = 0; x < kAmxChunk; x += 32) {
      const Vec e0 = (Vec::load(row + x) - mv).exp(), e1 = (Vec::load(row + x + 16) - mv).exp();
      sum[i] = _mm512_add_ps(sum[i], _mm512_add_ps(e0.v, e1.v));
      const __m512bh pb = _mm512_cvtne2ps_pbh(e1.v, e0.v);  // e0 in the low half
      _mm512_storeu_si512(prow + x, reinterpret_cast<const __m512i&>(pb));
    }
  }
  // alpha = e^(m_old - m_new), 1 for rows that saw nothing (whose m_old may be -inf).
  const __m512 al = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.0f),
                                         Vec{_mm512_sub_ps(m_old, m_new)}.exp().v);
  const __m512 sums = reduce16(sum, [](__m512 u, __m512 v) { return _mm512_add_ps(u, v); });
  _mm512_storeu_ps(alpha, al);
  _mm512_storeu_ps(d, _mm512_fmadd_ps(_mm512_loadu_ps(d), al, sums));
  _mm512_storeu_ps(m, m_new);
}

// One row tile [r0, r0 + 16) against the packed chunk at position cs, keys [j0, j1).
inline void amx_row_tile(const AttentionParams& p, const AmxScratch& sc, const RowMap& map,
                         int rows, int r0, int D, float mul, int64_t cs, int j0, int j1) {
  int a[16], b[16];
  bool any = false;
  for (int i = 0; i < 16; ++i) {
    a[i] = b[i] = 0;
    if (r0 + i < rows) visible_keys(p, map.pos(r0 + i), cs, j0, j1, &a[i], &b[i]);
    any |= a[i] < b[i];
  }
  if (!any) return;  // e.g. causal rows before this chunk: state unchanged
  amx_logits(sc.q + size_t(r0) * D, D, sc.kp, sc.s);
  softmax_tile(p, sc.s, mul, sc.m + r0, sc.d + r0, sc.alpha + r0, a, b, map, r0, cs, sc.p);
  for (int i = 0; i < 16; ++i) {
    const float al = sc.alpha[r0 + i];
    if (al == 1.0f) continue;
    float* o = sc.acc + size_t(r0 + i) * D;
    for (int c = 0; c < D; c += Vec::N) (Vec::load(o + c) * Vec::set1(al)).store(o + c);
  }
  float* acc = sc.acc + size_t(r0) * D;
  int cb = 0;  // column tile of 16
  for (; cb + 4 <= D / 16; cb += 4) amx_pv<4>(acc + cb * 16, D, sc.p, sc.vp + cb * 32);
  switch (D / 16 - cb) {  // D is a multiple of 32: 0 or 2 tiles left
    case 2: amx_pv<2>(acc + cb * 16, D, sc.p, sc.vp + cb * 32); break;
    default: break;
  }
}

// One item on AMX tiles (plan.amx: bf16 queries, one kv head per item, head_dim == head_dim_v,
// a multiple of 32). The tile configuration is loaded by the caller.
template <typename C>
void attend_item_amx(const AttentionParams& p, const AttentionPlan& plan, const AttentionItem& it,
                     float* scratch, float* part_acc, float* part_m, float* part_d) {
  const paged_kv_t& kv = p.kv;
  const int G = plan.group, D = plan.dk;
  const int rows = int(it.q1 - it.q0) * G, rows16 = (rows + 15) & ~15;
  const int64_t seq_len = kv.seq_lens[it.seq];
  const RowMap map{p.q_begin(it.seq) + it.q0, seq_len - p.q_len(it.seq) + it.q0, G,
                   it.kv_head * G};
  const AmxScratch sc(plan, scratch);

  for (int r = 0; r < rows16; ++r) {
    bf16_bits* q = sc.q + size_t(r) * D;
    if (r < rows) {
      const c10::BFloat16* src = static_cast<const c10::BFloat16*>(p.q) +
                                 map.token(r) * p.q_stride_token + map.head(r) * p.q_stride_head;
      std::memcpy(q, src, size_t(D) * sizeof(bf16_bits));
    } else {
      std::memset(q, 0, size_t(D) * sizeof(bf16_bits));
    }
    sc.m[r] = -INFINITY, sc.d[r] = 0.0f, sc.alpha[r] = 1.0f;
  }
  std::memset(sc.acc, 0, size_t(rows16) * D * sizeof(float));

  const float mul = p.scale * kv.k_scale_of(it.kv_head);
  const ChunkRange cr(p, plan, it, map, rows, kAmxChunk);
  const C* kb = static_cast<const C*>(kv.k);
  const C* vb = static_cast<const C*>(kv.v);
  const C *keys[kAmxChunk], *vals[kAmxChunk];
  for (int64_t c = cr.c_begin; c < cr.c_end; ++c) {
    const int64_t cs = c * kAmxChunk;
    const int j0 = int(kmax<int64_t>(0, cr.lo - cs));
    const int j1 = int(kmin<int64_t>(kAmxChunk, cr.hi + 1 - cs));
    for_chunk_slots(kv, it.seq, cs, j0, j1, [&](int j, int64_t block, int slot) {
      keys[j] = kb + kv.k_offset(block, slot, it.kv_head);
      vals[j] = vb + kv.v_offset(block, slot, it.kv_head);
    });
    pack_keys(keys, j0, j1, D, sc.kp);
    pack_values(vals, j0, j1, D, sc.vp);
    for (int r0 = 0; r0 < rows16; r0 += 16) amx_row_tile(p, sc, map, rows, r0, D, mul, cs, j0, j1);
  }
  store_rows<c10::BFloat16>(p, plan, map, it.kv_head, 0, rows, sc.acc, sc.m, sc.d, part_acc,
                            part_m, part_d);
}

}  // namespace kvkernels::cpu::KVK_ISA
