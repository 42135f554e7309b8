// The vector kernel's vdpbf16ps form (KVK_BF16 builds: avx512bf16, avx512amx), for bf16 queries
// over fp8 caches (plan.dp): decode, and calls with too few rows per kv head for the tile kernels.
// (It reads bf16 rows too, the staged fp8 chunks below; over a bf16 cache the planner keeps the float
// form, which was as fast or faster from DRAM: attention_run.h, make_plan.) Included by attention_kernel.h after everything it reuses (chunk walk, slots,
// prefetchers, masks, softmax, the output stage, and reduce16 of attention_tiles.h).
//
// vdpbf16ps multiplies the 32 bf16 pairs of two registers and adds each pair's two products to one
// float lane: 32 multiply-adds per instruction where an FMA does 16, and at the same issue rate on
// Zen 4 (both 1 per cycle for 512 bits, measured). bf16 x bf16 products are exact in float32, so
// against widening to float and using FMAs only the order of the float32 additions changes (and
// denormal bf16 inputs and float32 results are flushed to zero; no finite fp8 value is a bf16
// denormal, and exp() never returns a denormal probability).
//
// Per chunk of kChunk keys and kv head, against the float form of attention_kernel.h:
//   - logits: the query stays bf16 (its scale * k_scale multiplies the logit after the sum instead
//     of the query before it); four keys at a time for the four rows of a group, the 16 dot
//     products' lanes summed by one reduction tree; a key row is read as bf16 once per group: bf16
//     rows as they are, fp8 rows converted 64 values at a time (dp_fp8_load64: one byte permute
//     and two 128-entry table lookups give the low and high bytes of 64 bf16, which two in-lane
//     unpacks join; the float form converted 32 values per five ops and then widened them);
//   - P V: value rows j and j + 1 are interleaved into (v_j[c], v_j+1[c]) pairs (two unpacks per
//     32 columns) and multiplied by the broadcast bf16 pair (p_j, p_j+1) of each row: the
//     probabilities are rounded to bf16 there, as the AMX kernel and SDPA's flash kernels do (the
//     denominator keeps the float32 sum). The accumulator columns come out in the unpacks' lane
//     order and are put back in order at the end of the item (dp_unpermute_rows);
//   - fp8 chunks of items with more than four rows per kv head are converted once into a bf16
//     copy (dp_stage_chunk) that every row group then reads like a bf16 cache.

namespace kvkernels::cpu::KVK_ISA {

// Lane masks of a row read 64 values at a time: words[2b], words[2b + 1] for the two Words of
// block b (bf16 rows), bytes[b] for block b of an fp8 row.
struct DpSide {
  __mmask32 words[32];
  __mmask64 bytes[16];
  int blocks = 0;  // 64-value blocks per row
  explicit DpSide(int width) {
    blocks = (width + 63) / 64;
    for (int i = 0; i < 2 * blocks; ++i) {
      const int n = kmax(0, width - 32 * i);
      words[i] = n >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << n) - 1);
    }
    for (int b = 0; b < blocks; ++b) {
      const int n = kmax(0, width - 64 * b);
      bytes[b] = n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1;
    }
  }
};

struct DpMasks {
  DpSide k, v;
  explicit DpMasks(const paged_kv_t& kv) : k(kv.head_dim), v(kv.head_dim_v) {}
};

// 64 fp8 values as two Words of bf16 in column order (columns 0-31 and 32-63; zero past the mask).
// unpacklo / unpackhi of the low and high bytes interleave within 128-bit lanes, so lane l of the
// input must hold columns 8l..8l+7 (for the first Word) and 32+8l..32+8l+7 (for the second): one
// vpermb puts them there. The sign is copied from bit 7 of each input byte (the tables are indexed
// by its low 7 bits).
template <typename F>
inline void dp_fp8_load64(const Fp8WordLoader<F>& ld, const F* p, __mmask64 m, __m512i* w0,
                          __m512i* w1) {
  const __m512i spread = _mm512_set_epi8(
      63, 62, 61, 60, 59, 58, 57, 56, 31, 30, 29, 28, 27, 26, 25, 24,
      55, 54, 53, 52, 51, 50, 49, 48, 23, 22, 21, 20, 19, 18, 17, 16,
      47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12, 11, 10, 9, 8,
      39, 38, 37, 36, 35, 34, 33, 32, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i x = _mm512_permutexvar_epi8(spread, _mm512_maskz_loadu_epi8(m, p));
  const __m512i lo = _mm512_permutex2var_epi8(ld.lo0, x, ld.lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(ld.hi0, x, ld.hi1), x,
                                               _mm512_set1_epi8(char(0x80)), 0xF8);
  *w0 = _mm512_unpacklo_epi8(lo, hi);
  *w1 = _mm512_unpackhi_epi8(lo, hi);
}

// Block b (columns 64b .. 64b + 63) of a row as two Words of bf16 in column order.
template <typename C>
struct DpReader {  // bf16 rows (the cache, or an fp8 chunk staged as bf16)
  void block(const C* row, int b, const DpSide& s, __m512i* w0, __m512i* w1) const {
    *w0 = _mm512_maskz_loadu_epi16(s.words[2 * b], row + 64 * b);
    *w1 = _mm512_maskz_loadu_epi16(s.words[2 * b + 1], row + 64 * b + 32);
  }
};
template <>
struct DpReader<fp8_e4m3> {
  const Fp8WordLoader<fp8_e4m3>& ld = word_loader<fp8_e4m3>();
  void block(const fp8_e4m3* row, int b, const DpSide& s, __m512i* w0, __m512i* w1) const {
    dp_fp8_load64(ld, row + 64 * b, s.bytes[b], w0, w1);
  }
};
template <>
struct DpReader<fp8_e5m2> {
  const Fp8WordLoader<fp8_e5m2>& ld = word_loader<fp8_e5m2>();
  void block(const fp8_e5m2* row, int b, const DpSide& s, __m512i* w0, __m512i* w1) const {
    dp_fp8_load64(ld, row + 64 * b, s.bytes[b], w0, w1);
  }
};

// The logits of keys j and j + 1 (k1 null: j alone) for the four bf16 query rows at q (row stride
// dq values), times mul, into s[r * kChunk + j (+ 1)].
template <typename C>
inline void dp_dot4x2(const bf16_bits* q, int dq, const C* k0, const C* k1, const DpSide& side,
                      const DpReader<C>& rd, float mul, float* s, int j) {
  Vec a0 = Vec::zero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int b = 0; b < side.blocks; ++b) {
    __m512i x0, x1, y0 = _mm512_setzero_si512(), y1 = y0;
    rd.block(k0, b, side, &x0, &x1);
    if (k1) rd.block(k1, b, side, &y0, &y1);
    const bf16_bits* qb = q + 64 * b;
    const __m512i q00 = _mm512_loadu_si512(qb), q01 = _mm512_loadu_si512(qb + 32);
    const __m512i q10 = _mm512_loadu_si512(qb + dq), q11 = _mm512_loadu_si512(qb + dq + 32);
    const __m512i q20 = _mm512_loadu_si512(qb + 2 * dq), q21 = _mm512_loadu_si512(qb + 2 * dq + 32);
    const __m512i q30 = _mm512_loadu_si512(qb + 3 * dq), q31 = _mm512_loadu_si512(qb + 3 * dq + 32);
    a0 = dpbf16(dpbf16(a0, q00, x0), q01, x1), a1 = dpbf16(dpbf16(a1, q10, x0), q11, x1);
    a2 = dpbf16(dpbf16(a2, q20, x0), q21, x1), a3 = dpbf16(dpbf16(a3, q30, x0), q31, x1);
    if (k1) {
      b0 = dpbf16(dpbf16(b0, q00, y0), q01, y1), b1 = dpbf16(dpbf16(b1, q10, y0), q11, y1);
      b2 = dpbf16(dpbf16(b2, q20, y0), q21, y1), b3 = dpbf16(dpbf16(b3, q30, y0), q31, y1);
    }
  }
  float t[4];
  Vec::sum4(a0, a1, a2, a3, t);
  for (int i = 0; i < 4; ++i) s[i * kChunk + j] = t[i] * mul;
  if (k1) {
    Vec::sum4(b0, b1, b2, b3, t);
    for (int i = 0; i < 4; ++i) s[i * kChunk + j + 1] = t[i] * mul;
  }
}

// The logits of keys j .. j + 3 for the four query rows at q, times mul: 16 dot products whose
// lane sums one reduction tree (reduce16, attention_tiles.h) gives as one vector, lane 4r + k =
// (row r, key j + k), stored as four 128-bit pieces (two sum4 trees and 8 scalar stores per two
// keys before: most of the logits' time in the profile).
template <typename C>
inline __m512 dp_logits4x4(const bf16_bits* q, int dq, const C* const* keys, int j,
                           const DpSide& side, const DpReader<C>& rd, float mul) {
  Vec a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = Vec::zero();
  for (int b = 0; b < side.blocks; ++b) {
    __m512i k[4][2];
#pragma GCC unroll 4
    for (int x = 0; x < 4; ++x) rd.block(keys[j + x], b, side, &k[x][0], &k[x][1]);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const bf16_bits* qr = q + size_t(r) * dq + 64 * b;
      const __m512i q0 = _mm512_loadu_si512(qr), q1 = _mm512_loadu_si512(qr + 32);
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) a[4 * r + x] = dpbf16(dpbf16(a[4 * r + x], q0, k[x][0]), q1, k[x][1]);
    }
  }
  __m512 v[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) v[i] = a[i].v;
  return _mm512_mul_ps(reduce16(v, [](__m512 u, __m512 w) { return _mm512_add_ps(u, w); }),
                       _mm512_set1_ps(mul));
}

template <typename C>
inline void dp_chunk_logits(const Scratch& sc, const bf16_bits* q, int dq, int rows4,
                            const C* const* keys, int j0, int j1, const DpSide& side,
                            const DpReader<C>& rd, float mul, const Prefetcher& pf) {
  for (int r = 0; r < rows4; r += 4) {
    const bf16_bits* qr = q + size_t(r) * dq;
    float* s = sc.s + r * kChunk;
    int j = j0;
    if (j0 == 0 && j1 == kChunk) {  // a whole chunk: four groups of four keys, rows stored whole
      __m512 t[4];
      for (int g = 0; g < 4; ++g) {
        if (r == 0) pf.at(4 * g), pf.at(4 * g + 1), pf.at(4 * g + 2), pf.at(4 * g + 3);
        t[g] = dp_logits4x4(qr, dq, keys, 4 * g, side, rd, mul);
      }
      // t[g] lanes 4r .. 4r + 3: row r, keys 4g .. 4g + 3. A 4 x 4 transpose of 128-bit lanes gives
      // each row's 16 logits in one vector (four 16-byte stores then a 64-byte load of the row would
      // wait for the stores: no forwarding across them).
      const __m512 u0 = _mm512_shuffle_f32x4(t[0], t[1], 0x44), u1 = _mm512_shuffle_f32x4(t[0], t[1], 0xEE);
      const __m512 u2 = _mm512_shuffle_f32x4(t[2], t[3], 0x44), u3 = _mm512_shuffle_f32x4(t[2], t[3], 0xEE);
      _mm512_storeu_ps(s, _mm512_shuffle_f32x4(u0, u2, 0x88));
      _mm512_storeu_ps(s + kChunk, _mm512_shuffle_f32x4(u0, u2, 0xDD));
      _mm512_storeu_ps(s + 2 * kChunk, _mm512_shuffle_f32x4(u1, u3, 0x88));
      _mm512_storeu_ps(s + 3 * kChunk, _mm512_shuffle_f32x4(u1, u3, 0xDD));
      continue;
    }
    for (; j + 3 < j1; j += 4) {
      if (r == 0) pf.at(j), pf.at(j + 1), pf.at(j + 2), pf.at(j + 3);
      const __m512 t = dp_logits4x4(qr, dq, keys, j, side, rd, mul);
      _mm_storeu_ps(s + j, _mm512_castps512_ps128(t));
      _mm_storeu_ps(s + kChunk + j, _mm512_extractf32x4_ps(t, 1));
      _mm_storeu_ps(s + 2 * kChunk + j, _mm512_extractf32x4_ps(t, 2));
      _mm_storeu_ps(s + 3 * kChunk + j, _mm512_extractf32x4_ps(t, 3));
    }
    for (; j + 1 < j1; j += 2) {
      if (r == 0) pf.at(j), pf.at(j + 1);
      dp_dot4x2(qr, dq, keys[j], keys[j + 1], side, rd, mul, s, j);
    }
    if (j < j1) dp_dot4x2<C>(qr, dq, keys[j], nullptr, side, rd, mul, s, j);
  }
}

// Value block b of rows j and j + 1 (v1 null: zeros) as four vectors of bf16 pairs
// (v_j[c], v_j+1[c]): vector k, lane 4l + i holds column 64b + 32 (k >> 1) + 8l + 4 (k & 1) + i
// (dp_col_of_slot).
template <typename C>
inline void dp_value_pairs(const C* v0, const C* v1, int b, const DpSide& side,
                           const DpReader<C>& rd, __m512i* r) {
  __m512i a0, a1, c0 = _mm512_setzero_si512(), c1 = c0;
  rd.block(v0, b, side, &a0, &a1);
  if (v1) rd.block(v1, b, side, &c0, &c1);
  r[0] = _mm512_unpacklo_epi16(a0, c0), r[1] = _mm512_unpackhi_epi16(a0, c0);
  r[2] = _mm512_unpacklo_epi16(a1, c1), r[3] = _mm512_unpackhi_epi16(a1, c1);
}

inline int dp_col_of_slot(int s) {
  const int k = s / 16, lane = s % 16;
  return 32 * (k >> 1) + 8 * (lane / 4) + 4 * (k & 1) + lane % 4;
}

// The bf16 pair (P[j], P[j + 1]) of a probability row as a 32-bit broadcast.
inline __m512i dp_prob_pair(const bf16_bits* P, int j) {
  uint32_t u;
  std::memcpy(&u, P + j, sizeof u);
  return _mm512_set1_epi32(int(u));
}

// acc = alpha acc + P V over keys [j0, j1) (all seen by the four rows) for value block b: 4 rows x
// 64 columns in registers, keys two at a time. P: bf16 rows of stride ps (zero past kChunk).
template <typename C>
inline void dp_pv4(float* acc, int dv, const bf16_bits* P, int ps, const float* alpha,
                   const C* const* vals, int j0, int j1, int b, const DpSide& side,
                   const DpReader<C>& rd, const Prefetcher* pf) {
  Vec a[4][4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const Vec al = Vec::set1(alpha[r]);
#pragma GCC unroll 4
    for (int x = 0; x < 4; ++x) a[r][x] = Vec::load(acc + r * dv + 64 * b + 16 * x) * al;
  }
  for (int j = j0; j < j1; j += 2) {
    const bool two = j + 1 < j1;
    if (pf) pf->at(j), pf->at(j + 1);
    __m512i v[4];
    dp_value_pairs(vals[j], two ? vals[j + 1] : nullptr, b, side, rd, v);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      // With one key the pair's second probability meets zeros (P has no inf; a NaN makes its row
      // NaN anyway).
      const __m512i pp = dp_prob_pair(P + r * ps, j);
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) a[r][x] = dpbf16(a[r][x], pp, v[x]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < 4; ++x) a[r][x].store(acc + r * dv + 64 * b + 16 * x);
}

// The keys of [j0, j1) outside [v.lo, v.hi), each added by the rows that see it (pv4_edges).
template <typename C>
inline void dp_pv4_edges(float* acc, int dv, const bf16_bits* P, int ps, const C* const* vals,
                         int j0, int j1, const Vis4& vis, const DpSide& side,
                         const DpReader<C>& rd) {
  for (int j = j0; j < j1; ++j) {
    if (j == vis.lo) j = vis.hi;
    if (j >= j1) break;
    for (int r = 0; r < 4; ++r) {
      if (!vis.sees(r, j)) continue;
      const __m512i pp = _mm512_set1_epi32(int(P[r * ps + j]));  // (p_j, 0)
      float* o = acc + size_t(r) * dv;
      for (int b = 0; b < side.blocks; ++b) {
        __m512i v[4];
        dp_value_pairs<C>(vals[j], nullptr, b, side, rd, v);
        for (int x = 0; x < 4; ++x)
          dpbf16(Vec::load(o + 64 * b + 16 * x), pp, v[x]).store(o + 64 * b + 16 * x);
      }
    }
  }
}

// Keys [j0, j1) of a chunk for one kv head: logits, softmax, probabilities to bf16, P V.
template <typename C>
inline void dp_attend_chunk(const AttentionParams& p, const AttentionPlan& plan, const Head& h,
                            int rows, int rows4, int64_t cs, int j0, int j1, const C* const* keys,
                            const C* const* vals, const DpMasks& mk, float mul,
                            const Prefetcher& pf_k, const Prefetcher& pf_v) {
  const Scratch& sc = h.sc;
  const DpReader<C> rd;
  const bf16_bits* q = reinterpret_cast<const bf16_bits*>(sc.q);
  dp_chunk_logits(sc, q, plan.dk, rows4, keys, j0, j1, mk.k, rd, mul, pf_k);
  mask_chunk_rows(p, h, rows, rows4, cs, j0, j1);
  constexpr int ps = 2 * kChunk;  // bf16 probabilities per row: kChunk, then zeros
  static_assert(kChunk == 16, "one __m256bh of probabilities per row");
  for (int r = 0; r < rows4; r += 4) {
    softmax_rows4(sc.s + r * kChunk, sc.m + r, sc.d + r, sc.alpha + r);
    for (int i = 0; i < 4; ++i) {
      const __m256bh pb = _mm512_cvtneps_pbh(_mm512_loadu_ps(sc.s + (r + i) * kChunk));
      _mm512_storeu_si512(sc.pb + (r + i) * ps, _mm512_zextsi256_si512((__m256i)pb));
    }
  }
  const ChunkRows cr{p, h.map, rows, cs, j0, j1};
  for (int r = 0; r < rows4; r += 4) {
    float* acc = sc.acc + size_t(r) * plan.dv;
    const bf16_bits* P = sc.pb + r * ps;
    const Vis4 v = cr.group(r);
    for (int b = 0; b < mk.v.blocks; ++b)
      dp_pv4(acc, plan.dv, P, ps, sc.alpha + r, vals, v.lo, v.hi, b, mk.v, rd,
             r == 0 && b == 0 ? &pf_v : nullptr);
    dp_pv4_edges(acc, plan.dv, P, ps, vals, j0, j1, v, mk.v, rd);
  }
}

// An fp8 chunk's key and value rows of one kv head converted once to bf16 rows (zeros past the
// head dims) in the head's kc / vc scratch, for items whose row groups would each convert them.
template <typename F>
inline void dp_stage_chunk(const AttentionPlan& plan, const Head& h, const F* const* keys,
                           const F* const* vals, bool v_is_k, int j0, int j1, const DpMasks& mk,
                           const c10::BFloat16** skeys, const c10::BFloat16** svals) {
  const DpReader<F> rd;
  auto* kst = reinterpret_cast<c10::BFloat16*>(h.sc.kc);
  auto* vst = reinterpret_cast<c10::BFloat16*>(h.sc.vc);
  for (int j = j0; j < j1; ++j) {
    c10::BFloat16* k = kst + size_t(j) * plan.dk;
    for (int b = 0; b < mk.k.blocks; ++b) {
      __m512i w0, w1;
      rd.block(keys[j], b, mk.k, &w0, &w1);
      _mm512_storeu_si512(k + 64 * b, w0), _mm512_storeu_si512(k + 64 * b + 32, w1);
    }
    skeys[j] = k;
    if (v_is_k) {  // MLA: the value is a prefix of the key row
      svals[j] = k;
      continue;
    }
    c10::BFloat16* v = vst + size_t(j) * plan.dv;
    for (int b = 0; b < mk.v.blocks; ++b) {
      __m512i w0, w1;
      rd.block(vals[j], b, mk.v, &w0, &w1);
      _mm512_storeu_si512(v + 64 * b, w0), _mm512_storeu_si512(v + 64 * b + 32, w1);
    }
    svals[j] = v;
  }
}

// Puts the accumulator columns of `rows` rows (dp_value_pairs' lane order per 64) back in order:
// column c of a block comes from slot slot_of_col(c), gathered by two-table permutes.
inline void dp_unpermute_rows(float* acc, int rows, int dv) {
  alignas(64) int32_t slot[64];
  for (int s = 0; s < 64; ++s) slot[dp_col_of_slot(s)] = s;
  __m512i idx[4];
  for (int x = 0; x < 4; ++x) idx[x] = _mm512_sub_epi32(_mm512_load_si512(slot + 16 * x), _mm512_set1_epi32(x < 2 ? 0 : 32));
  for (int r = 0; r < rows; ++r) {
    for (int b = 0; b + 64 <= dv; b += 64) {
      float* x = acc + size_t(r) * dv + b;
      const __m512 s0 = _mm512_loadu_ps(x), s1 = _mm512_loadu_ps(x + 16), s2 = _mm512_loadu_ps(x + 32),
                   s3 = _mm512_loadu_ps(x + 48);
      // Columns 0-31 come from slots 0-31 (vectors 0, 1), columns 32-63 from slots 32-63.
      _mm512_storeu_ps(x, _mm512_permutex2var_ps(s0, idx[0], s1));
      _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(s0, idx[1], s1));
      _mm512_storeu_ps(x + 32, _mm512_permutex2var_ps(s2, idx[2], s3));
      _mm512_storeu_ps(x + 48, _mm512_permutex2var_ps(s2, idx[3], s3));
    }
  }
}

// attend_item for plan.dp: Q is bf16, C bf16 or fp8.
template <typename C>
void attend_item_dp(const AttentionParams& p, const AttentionPlan& plan, const AttentionItem& it,
                    float* scratch, float* part_acc, float* part_m, float* part_d) {
  const paged_kv_t& kv = p.kv;
  const int G = plan.group;
  const int rows = int(it.q1 - it.q0) * G, rows4 = (rows + 3) & ~3;
  const int64_t seq_len = kv.seq_lens[it.seq];
  const RowMap map0{p.q_begin(it.seq) + it.q0, seq_len - p.q_len(it.seq) + it.q0, G, 0};
  const bool stage = is_fp8_type<C> && rows4 > 4;
  const bool v_is_k = kv.v == kv.k;
  Head heads[kMaxHeadsPerItem];
  float mul[kMaxHeadsPerItem];
  for (int h = 0; h < it.num_kv; ++h) {
    RowMap map = map0;
    map.head0 = (it.kv_head + h) * G;
    heads[h] = {it.kv_head + h, map, carve(plan, scratch, h)};
    mul[h] = p.scale * kv.logit_k_scale_of(it.kv_head + h);
    const Scratch& sc = heads[h].sc;
    bf16_bits* q = reinterpret_cast<bf16_bits*>(sc.q);
    for (int r = 0; r < rows4; ++r) {
      bf16_bits* qr = q + size_t(r) * plan.dk;
      std::memset(qr, 0, size_t(plan.dk) * sizeof(bf16_bits));
      if (r >= rows) continue;
      const auto* src = static_cast<const c10::BFloat16*>(p.q) + map.token(r) * p.q_stride_token +
                        map.head(r) * p.q_stride_head;
      std::memcpy(qr, src, size_t(kv.head_dim) * sizeof(bf16_bits));
    }
    std::memset(sc.acc, 0, size_t(rows4) * plan.dv * sizeof(float));
    for (int r = 0; r < rows4; ++r) sc.m[r] = -INFINITY, sc.d[r] = 0.0f;
  }

  const ChunkRange cr(p, plan, it, map0, rows, kChunk);
  if (cr.c_begin < cr.c_end) {
    const DpMasks mk(kv);
    ChunkSlots slots[2];
    for (int64_t c = cr.c_begin; c < cr.c_end; ++c) {
      const int64_t cs = c * kChunk;
      const int j0 = int(kmax<int64_t>(0, cr.lo - cs)), j1 = int(kmin<int64_t>(kChunk, cr.hi + 1 - cs));
      const int next = c + 1 < cr.c_end ? int(kmin<int64_t>(kChunk, cr.hi + 1 - cs - kChunk)) : 0;
      const ChunkSlots& cur = slots[c & 1];
      if (c == cr.c_begin) chunk_slots(kv, it.seq, cs, j0, j1, &slots[c & 1]);
      if (next > 0) chunk_slots(kv, it.seq, cs + kChunk, 0, next, &slots[(c + 1) & 1]);
      for (int h = 0; h < it.num_kv; ++h) {
        Prefetcher pf_k, pf_v;
        if (next > 0) next_chunk<C>(kv, slots[(c + 1) & 1], heads[h].kv_head, next, &pf_k, &pf_v);
        const C *keys[kChunk], *vals[kChunk];
        chunk_rows(kv, cur, heads[h].kv_head, j0, j1, keys, vals);
        if constexpr (is_fp8_type<C>) {
          if (stage) {
            const c10::BFloat16 *skeys[kChunk], *svals[kChunk];
            dp_stage_chunk(plan, heads[h], keys, vals, v_is_k, j0, j1, mk, skeys, svals);
            dp_attend_chunk(p, plan, heads[h], rows, rows4, cs, j0, j1, skeys, svals, mk, mul[h],
                            pf_k, pf_v);
            continue;
          }
        }
        dp_attend_chunk(p, plan, heads[h], rows, rows4, cs, j0, j1, keys, vals, mk, mul[h], pf_k,
                        pf_v);
      }
    }
  }

  for (int h = 0; h < it.num_kv; ++h) {
    const Scratch& sc = heads[h].sc;
    dp_unpermute_rows(sc.acc, rows, plan.dv);
    store_rows<c10::BFloat16>(p, plan, heads[h].map, it.seq, heads[h].kv_head, h, rows, sc.acc,
                              sc.m, sc.d, part_acc, part_m, part_d);
  }
}

}  // namespace kvkernels::cpu::KVK_ISA
