// The CPU paged-attention kernel, written once against the Vec interface of vec_<isa>.h and
// compiled once per ISA: attention_<isa>.cpp defines KVK_ISA (the namespace of its Vec), opens its
// target region and includes this file, so every symbol here is distinct per ISA.
//
// In the AVX-512 builds, calls with 16+ rows per kv head (prefill, MLA decode) go to the tile
// kernels instead (attention_tiles.h, plan.tiles); everything else runs here.
//
// One work item (attention_plan.h) walks its visible keys in chunks of kChunk positions:
//   0. when an item has several groups of four rows (prefill), the chunk is first converted to
//      float scratch (stage_chunk), so the conversion is not repeated per row group;
//   1. logits S = Q K^T for all rows of the item: a key row is loaded (converted from bf16 /
//      fp16 / fp8 in registers when not staged) once for four query rows, two keys at a time,
//      and the four dot products are reduced together (Vec::sum4);
//   2. mask (causal, window, chunk edges), soft cap, ALiBi (mask_logits), then the online-softmax
//      update of four rows at once with vector exps (softmax_rows4);
//   3. O = alpha * O + P V with a block of 4 rows x kCw vectors of O held in registers while the
//      chunk's value rows stream through.
// The next chunk's rows are prefetched into L2 from inside the math loops (paged blocks are
// scattered, so the hardware prefetcher cannot guess them). Scales fold into the math: the query
// is pre-multiplied by scale * k_scale, and v_scale joins the final 1/denominator.
//
// The AVX-512 builds (KVK_WORDS) read bf16 rows, and with VBMI fp8 rows (through a lookup table),
// as Words of 32 bf16 and widen them into their even and odd elements (one op per 16 values). The
// queries are stored in the same [even columns, odd columns] order per block of 32, and so is the
// accumulator, until unpair_rows restores the column order at the end of the item.
// (vdpbf16ps was tried for the logits and was no faster: on the benchmark machine it issues at
// 1.08 G/s per core against 4.43 G/s for 16-lane FMAs, i.e. half the multiply-add rate.)
//
// Requires (included before the target region): convert.h, attention_plan.h, kvkernels/softmax.h,
// <cmath>, <cstring>.

namespace kvkernels::cpu::KVK_ISA {

using Mask = Vec::Mask;
constexpr int kCw = Vec::N == 16 ? 4 : 2;  // output vectors per row kept in registers in P V
constexpr int kMaxVecs = 576 / 8;          // widest row (MLA latent) in the narrowest Vec
constexpr int kMaxHeadsPerItem = 16;       // plan.heads never exceeds it

template <typename T>
inline T kmin(T a, T b) { return a < b ? a : b; }
template <typename T>
inline T kmax(T a, T b) { return a > b ? a : b; }

using bf16_bits = uint16_t;

struct Scratch {
  float* q;      // [max_rows, dk] queries * scale * k_scale; padding rows/columns are 0
  float* acc;    // [max_rows, dv] unnormalized output
  float* s;      // [max_rows, kChunk] logits, then probabilities
  float* m;      // [max_rows] running max
  float* d;      // [max_rows] running denominator
  float* alpha;  // [max_rows] rescale of acc for the current chunk
  float* kc;     // [kChunk, dk] this head's key chunk as float (when staged)
  float* vc;     // [kChunk, dv] this head's value chunk as float
  bf16_bits* pb;  // [max_rows, 2 kChunk] probabilities as bf16, then zeros (attention_dp.h)
};

// Scratch of head h of an item (attention_plan.h gives the sizes).
inline Scratch carve(const AttentionPlan& plan, float* base, int h) {
  Scratch s;
  const size_t rows = size_t(plan.max_rows);
  s.q = base + h * attention_head_scratch_floats(plan);
  s.acc = s.q + rows * plan.dk;
  s.s = s.acc + rows * plan.dv;
  s.m = s.s + rows * kChunk;
  s.d = s.m + rows;
  s.alpha = s.d + rows;
  s.kc = s.alpha + rows;
  s.vc = s.kc + size_t(kChunk) * plan.dk;
  s.pb = reinterpret_cast<bf16_bits*>(s.vc + size_t(kChunk) * plan.dv);
  return s;
}

// Lane masks of a row of `width` elements: full vectors, then the tail.
// V is Vec or Words.
template <typename V>
inline int row_masks(int width, typename V::Mask* masks) {
  const int nv = (width + V::N - 1) / V::N;
  for (int i = 0; i < nv; ++i) masks[i] = V::mask(width - i * V::N);
  return nv;
}

// Rows of the next chunk, prefetched into L2 a row at a time from inside the math loops: spread
// out like this the prefetches keep the line-fill buffers busy without ever stalling on them,
// whereas a burst of a whole chunk's lines blocks the core until most of them have arrived.
struct Prefetcher {
  const char* rows[kChunk];
  int n = 0;      // rows [0, n) exist
  int bytes = 0;  // bytes per row
  void at(int j) const {
    if (j >= n) return;
    for (int b = 0; b < bytes; b += 64) prefetch(rows[j] + b);
  }
};

// Lane masks of a key row and of a value row, built once per item (they depend on the widths).
struct RowMasks {
  Mask k[kMaxVecs], v[kMaxVecs];
  int nv, nvv;  // vectors per key / value row
#if defined(KVK_WORDS)
  Words::Mask kw[kMaxVecs], vw[kMaxVecs];
  int nw, nvw;  // Words per key / value row
  explicit RowMasks(const paged_kv_t& kv)
      : nv(row_masks<Vec>(kv.head_dim, k)), nvv(row_masks<Vec>(kv.head_dim_v, v)),
        nw(row_masks<Words>(kv.head_dim, kw)), nvw(row_masks<Words>(kv.head_dim_v, vw)) {}
#else
  explicit RowMasks(const paged_kv_t& kv)
      : nv(row_masks<Vec>(kv.head_dim, k)), nvv(row_masks<Vec>(kv.head_dim_v, v)) {}
#endif
};

// out0[r] = q_r . k0, out1[r] = q_r . k1 for the four query rows at q (row stride dq).
template <typename KT>
inline void dot4x2(const float* q, int dq, const KT* k0, const KT* k1, int nv, const Mask* mk,
                   float* out0, float* out1) {
  Vec a0 = Vec::zero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int i = 0; i < nv; ++i) {
    const Vec x = Vec::load(k0 + i * Vec::N, mk[i]), y = Vec::load(k1 + i * Vec::N, mk[i]);
    const float* qi = q + i * Vec::N;
    const Vec q0 = Vec::load(qi), q1 = Vec::load(qi + dq), q2 = Vec::load(qi + 2 * dq),
              q3 = Vec::load(qi + 3 * dq);
    a0 = fma(q0, x, a0), a1 = fma(q1, x, a1), a2 = fma(q2, x, a2), a3 = fma(q3, x, a3);
    b0 = fma(q0, y, b0), b1 = fma(q1, y, b1), b2 = fma(q2, y, b2), b3 = fma(q3, y, b3);
  }
  Vec::sum4(a0, a1, a2, a3, out0);
  Vec::sum4(b0, b1, b2, b3, out1);
}

template <typename KT>
inline void dot4(const float* q, int dq, const KT* k, int nv, const Mask* mk, float* out) {
  Vec a0 = Vec::zero(), a1 = a0, a2 = a0, a3 = a0;
  for (int i = 0; i < nv; ++i) {
    const Vec x = Vec::load(k + i * Vec::N, mk[i]);
    const float* qi = q + i * Vec::N;
    a0 = fma(Vec::load(qi), x, a0), a1 = fma(Vec::load(qi + dq), x, a1);
    a2 = fma(Vec::load(qi + 2 * dq), x, a2), a3 = fma(Vec::load(qi + 3 * dq), x, a3);
  }
  Vec::sum4(a0, a1, a2, a3, out);
}

// Logits of keys [j0, j1) for rows [0, rows4): s[r * kChunk + j].
template <typename KT>
inline void chunk_logits(const Scratch& sc, int dk, int rows4, const KT* const* keys, int j0,
                         int j1, int nv, const Mask* mk, const Prefetcher& pf) {
  float t0[4], t1[4];
  for (int r = 0; r < rows4; r += 4) {
    const float* q = sc.q + size_t(r) * dk;
    float* s = sc.s + r * kChunk;
    int j = j0;
    for (; j + 1 < j1; j += 2) {
      if (r == 0) pf.at(j), pf.at(j + 1);
      dot4x2(q, dk, keys[j], keys[j + 1], nv, mk, t0, t1);
      for (int i = 0; i < 4; ++i) s[i * kChunk + j] = t0[i], s[i * kChunk + j + 1] = t1[i];
    }
    if (j < j1) {
      dot4(q, dk, keys[j], nv, mk, t0);
      for (int i = 0; i < 4; ++i) s[i * kChunk + j] = t0[i];
    }
  }
}

// acc[r, cols] = alpha[r] * acc[r, cols] + sum_j P[r, j] * v_j[cols] for four rows and CW vectors
// of columns starting at vector c.
// P has row stride ps.
template <int CW, typename VT>
inline void pv4(float* acc, int dv, const float* P, int ps, const float* alpha,
                const VT* const* vals, int j0, int j1, int c, const Mask* mk, const Prefetcher* pf) {
  // The fixed-size loops are unrolled by pragma: GCC otherwise keeps `a` in memory and stores
  // all 4 x CW accumulators to the stack after every key (seen in the disassembly), which made
  // the store port, not the FMAs, the limit.
  Vec a[4][CW];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const Vec al = Vec::set1(alpha[r]);
#pragma GCC unroll 4
    for (int x = 0; x < CW; ++x) a[r][x] = Vec::load(acc + r * dv + (c + x) * Vec::N) * al;
  }
  for (int j = j0; j < j1; ++j) {
    if (pf) pf->at(j);
    Vec v[CW];
#pragma GCC unroll 4
    for (int x = 0; x < CW; ++x) v[x] = Vec::load(vals[j] + (c + x) * Vec::N, mk[c + x]);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const Vec p = Vec::set1(P[r * ps + j]);
#pragma GCC unroll 4
      for (int x = 0; x < CW; ++x) a[r][x] = fma(p, v[x], a[r][x]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < CW; ++x) a[r][x].store(acc + r * dv + (c + x) * Vec::N);
}

// Row r of an item is query q0 + r / group, head kv_head * group + r % group.
struct RowMap {
  int64_t token0, pos0;
  int group, head0;
  int64_t token(int r) const { return token0 + r / group; }
  int64_t pos(int r) const { return pos0 + r / group; }
  int head(int r) const { return head0 + r % group; }
};

// Keys [a, b) of [j0, j1) in the chunk at position cs that the query at `pos` sees (causal, window).
// Callers keep j1 within the sequence's keys, so without causal masking only the window's lower
// bound cuts the range.
inline void visible_keys(const AttentionParams& p, int64_t pos, int64_t cs, int j0, int j1, int* a,
                         int* b) {
  int64_t lo = j0;
  if (p.window_left >= 0) lo = kmax<int64_t>(lo, pos - p.window_left - cs);
  *a = int(kmin<int64_t>(lo, j1));
  *b = p.causal ? int(kmax<int64_t>(kmin<int64_t>(j1, pos - cs + 1), *a)) : j1;
}

// Whether the query at `pos` of a sequence of seq_len keys sees any key: causal, the key at its
// own position (pos >= 0; leading rows of a sequence with more queries than keys see none);
// otherwise the last key, which every window's lower bound (pos - window_left <= seq_len - 1)
// keeps. Decides "no visible key" (out 0, lse -inf) against "all visible logits -inf" (NaN).
inline bool row_has_keys(const AttentionParams& p, int64_t pos, int64_t seq_len) {
  return p.causal ? pos >= 0 : seq_len > 0;
}

// Which keys of [j0, j1) four consecutive rows see: row i sees [a[i], b[i]), and all four see
// [lo, hi) (lo = hi = j1 when no key is seen by all). P V runs the common range through pv4 and
// the rest through pv4_edges, row by row: a key a row does not see has probability 0 for it, but
// 0 times an inf or NaN value would still be NaN (docs/ops.md: keys a row does not see never
// influence it). Rows that differ only in prefill (the causal diagonal, a window's edge): in
// decode every row sees the whole range and the edges are empty.
struct Vis4 {
  int a[4], b[4];
  int lo, hi;
  // ab(i, &a, &b) fills row i's range; padding rows (i not real) see everything (no output).
  template <typename F>
  Vis4(int j0, int j1, int real, F ab) : lo(j0), hi(j1) {
    for (int i = 0; i < 4; ++i) {
      if (i < real) ab(i, &a[i], &b[i]);
      else a[i] = j0, b[i] = j1;
      lo = kmax(lo, a[i]), hi = kmin(hi, b[i]);
    }
    if (lo >= hi) lo = hi = j1;
  }
  bool sees(int i, int j) const { return j >= a[i] && j < b[i]; }
};

// The keys of [j0, j1) outside [v.lo, v.hi), each added by the rows that see it, to accumulator
// rows already rescaled (by pv4 over the common range). P has row stride ps.
template <typename VT>
inline void pv4_edges(float* acc, int dv, const float* P, int ps, const VT* const* vals, int j0,
                      int j1, const Vis4& v, int nvv, const Mask* mk) {
  for (int j = j0; j < j1; ++j) {
    if (j == v.lo) j = v.hi;
    if (j >= j1) break;
    for (int r = 0; r < 4; ++r) {
      if (!v.sees(r, j)) continue;
      const Vec pr = Vec::set1(P[r * ps + j]);
      float* o = acc + size_t(r) * dv;
      for (int i = 0; i < nvv; ++i)
        fma(pr, Vec::load(vals[j] + i * Vec::N, mk[i]), Vec::load(o + i * Vec::N)).store(o + i * Vec::N);
    }
  }
}

// The rows of an item as seen from one chunk: their visible keys (visible_keys) in groups of four.
struct ChunkRows {
  const AttentionParams& p;
  const RowMap& map;
  int rows;  // real rows; the rest up to a multiple of 4 are padding
  int64_t cs;
  int j0, j1;
  Vis4 group(int r) const {
    return Vis4(j0, j1, rows - r, [&](int i, int* a, int* b) {
      visible_keys(p, map.pos(r + i), cs, j0, j1, a, b);
    });
  }
};

template <typename VT>
inline void chunk_values(const Scratch& sc, int dv, int rows4, const VT* const* vals, int j0,
                         int j1, int nvv, const Mask* mk, const Prefetcher& pf,
                         const ChunkRows& cr) {
  for (int r = 0; r < rows4; r += 4) {
    float* acc = sc.acc + size_t(r) * dv;
    const float* P = sc.s + r * kChunk;
    const float* alpha = sc.alpha + r;
    const Vis4 v = cr.group(r);
    int c = 0;
    for (; c + kCw <= nvv; c += kCw)
      pv4<kCw>(acc, dv, P, kChunk, alpha, vals, v.lo, v.hi, c, mk, r == 0 && c == 0 ? &pf : nullptr);
    for (; c < nvv; ++c) pv4<1>(acc, dv, P, kChunk, alpha, vals, v.lo, v.hi, c, mk, nullptr);
    pv4_edges(acc, dv, P, kChunk, vals, j0, j1, v, nvv, mk);
  }
}

#if defined(KVK_WORDS)
// The Words forms of dot4x2 / dot4 / chunk_logits: key rows read by `ld` and split into even and
// odd columns, against query rows stored in the same paired order (load_queries).
template <typename C>
inline void dot4x2_words(const float* q, int dq, const C* k0, const C* k1, int nw,
                         const Words::Mask* mw, const WordLoader<C>& ld, float* out0, float* out1) {
  Vec a0 = Vec::zero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int i = 0; i < nw; ++i) {
    Vec xe, xo, ye, yo;
    ld.load(k0 + i * Words::N, mw[i]).split(&xe, &xo);
    ld.load(k1 + i * Words::N, mw[i]).split(&ye, &yo);
    const float* qi = q + i * Words::N;
    Vec qe = Vec::load(qi), qo = Vec::load(qi + Vec::N);
    a0 = fma(qo, xo, fma(qe, xe, a0)), b0 = fma(qo, yo, fma(qe, ye, b0));
    qe = Vec::load(qi + dq), qo = Vec::load(qi + dq + Vec::N);
    a1 = fma(qo, xo, fma(qe, xe, a1)), b1 = fma(qo, yo, fma(qe, ye, b1));
    qe = Vec::load(qi + 2 * dq), qo = Vec::load(qi + 2 * dq + Vec::N);
    a2 = fma(qo, xo, fma(qe, xe, a2)), b2 = fma(qo, yo, fma(qe, ye, b2));
    qe = Vec::load(qi + 3 * dq), qo = Vec::load(qi + 3 * dq + Vec::N);
    a3 = fma(qo, xo, fma(qe, xe, a3)), b3 = fma(qo, yo, fma(qe, ye, b3));
  }
  Vec::sum4(a0, a1, a2, a3, out0);
  Vec::sum4(b0, b1, b2, b3, out1);
}

template <typename C>
inline void dot4_words(const float* q, int dq, const C* k, int nw, const Words::Mask* mw,
                       const WordLoader<C>& ld, float* out) {
  Vec a[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
  for (int i = 0; i < nw; ++i) {
    Vec xe, xo;
    ld.load(k + i * Words::N, mw[i]).split(&xe, &xo);
    const float* qi = q + i * Words::N;
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r)
      a[r] = fma(Vec::load(qi + r * dq + Vec::N), xo, fma(Vec::load(qi + r * dq), xe, a[r]));
  }
  Vec::sum4(a[0], a[1], a[2], a[3], out);
}

template <typename C>
inline void chunk_logits_words(const Scratch& sc, int dk, int rows4, const C* const* keys, int j0,
                               int j1, const RowMasks& mk, const WordLoader<C>& ld,
                               const Prefetcher& pf) {
  float t0[4], t1[4];
  for (int r = 0; r < rows4; r += 4) {
    const float* q = sc.q + size_t(r) * dk;
    float* s = sc.s + r * kChunk;
    int j = j0;
    for (; j + 1 < j1; j += 2) {
      if (r == 0) pf.at(j), pf.at(j + 1);
      dot4x2_words(q, dk, keys[j], keys[j + 1], mk.nw, mk.kw, ld, t0, t1);
      for (int i = 0; i < 4; ++i) s[i * kChunk + j] = t0[i], s[i * kChunk + j + 1] = t1[i];
    }
    if (j < j1) {
      dot4_words(q, dk, keys[j], mk.nw, mk.kw, ld, t0);
      for (int i = 0; i < 4; ++i) s[i * kChunk + j] = t0[i];
    }
  }
}

// pv4 over Words of values: CW Words (2 CW vectors) of columns starting at Words index c, kept
// in the paired column order.
template <int CW, typename C>
inline void pv4_words(float* acc, int dv, const float* P, const float* alpha, const C* const* vals,
                      int j0, int j1, int c, const Words::Mask* mw, const WordLoader<C>& ld,
                      const Prefetcher* pf) {
  Vec a[4][2 * CW];  // unrolled by pragma, as in pv4, so that it stays in registers
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const Vec al = Vec::set1(alpha[r]);
#pragma GCC unroll 8
    for (int x = 0; x < 2 * CW; ++x)
      a[r][x] = Vec::load(acc + r * dv + c * Words::N + x * Vec::N) * al;
  }
  for (int j = j0; j < j1; ++j) {
    if (pf) pf->at(j);
    Vec v[2 * CW];
#pragma GCC unroll 4
    for (int x = 0; x < CW; ++x)
      ld.load(vals[j] + (c + x) * Words::N, mw[c + x]).split(&v[2 * x], &v[2 * x + 1]);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const Vec p = Vec::set1(P[r * kChunk + j]);
#pragma GCC unroll 8
      for (int x = 0; x < 2 * CW; ++x) a[r][x] = fma(p, v[x], a[r][x]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < 2 * CW; ++x) a[r][x].store(acc + r * dv + c * Words::N + x * Vec::N);
}

// pv4_edges over Words of values, accumulator in the paired column order.
template <typename C>
inline void pv4_edges_words(float* acc, int dv, const float* P, const C* const* vals, int j0,
                            int j1, const Vis4& v, int nvw, const Words::Mask* mw,
                            const WordLoader<C>& ld) {
  for (int j = j0; j < j1; ++j) {
    if (j == v.lo) j = v.hi;
    if (j >= j1) break;
    for (int r = 0; r < 4; ++r) {
      if (!v.sees(r, j)) continue;
      const Vec pr = Vec::set1(P[r * kChunk + j]);
      float* o = acc + size_t(r) * dv;
      for (int i = 0; i < nvw; ++i) {
        Vec e, od;
        ld.load(vals[j] + i * Words::N, mw[i]).split(&e, &od);
        float* x = o + i * Words::N;
        fma(pr, e, Vec::load(x)).store(x);
        fma(pr, od, Vec::load(x + Vec::N)).store(x + Vec::N);
      }
    }
  }
}

template <typename C>
inline void chunk_values_words(const Scratch& sc, int dv, int rows4, const C* const* vals, int j0,
                               int j1, const RowMasks& mk, const WordLoader<C>& ld,
                               const Prefetcher& pf, const ChunkRows& cr) {
  for (int r = 0; r < rows4; r += 4) {
    float* acc = sc.acc + size_t(r) * dv;
    const float* P = sc.s + r * kChunk;
    const float* alpha = sc.alpha + r;
    const Vis4 v = cr.group(r);
    int c = 0;
    for (; c + 2 <= mk.nvw; c += 2)
      pv4_words<2>(acc, dv, P, alpha, vals, v.lo, v.hi, c, mk.vw, ld,
                   r == 0 && c == 0 ? &pf : nullptr);
    for (; c < mk.nvw; ++c) pv4_words<1>(acc, dv, P, alpha, vals, v.lo, v.hi, c, mk.vw, ld, nullptr);
    pv4_edges_words(acc, dv, P, vals, j0, j1, v, mk.nvw, mk.vw, ld);
  }
}
#endif  // KVK_WORDS

// Undoes the paired column order of pv4_words in `rows` accumulator rows: each block of 32 columns
// holds [c0, c2, ..., c30, c1, c3, ..., c31].
inline void unpair_rows(float* acc, int rows, int dv) {
  float t[32];
  for (int r = 0; r < rows; ++r) {
    for (int b = 0; b + 32 <= dv; b += 32) {
      float* x = acc + size_t(r) * dv + b;
      for (int i = 0; i < 16; ++i) t[2 * i] = x[i], t[2 * i + 1] = x[16 + i];
      for (int i = 0; i < 32; ++i) x[i] = t[i];
    }
  }
}

// Output row and lse from the unnormalized state (m, d over the row's visible keys; has_keys: the
// row has any), with the sink and v_scale: kvkernels/softmax.h finish_row gives the documented
// non-finite results. A non-finite v_scale makes the whole output row NaN (docs/ops.md): it is
// applied here, after the sum, where an inf would not give the per-element inf / NaN pattern of
// dequantizing first.
template <typename Q>
inline void finalize_row(const AttentionParams& p, int64_t token, int head, const float* acc,
                         float m, float d, bool has_keys, float v_scale) {
  float mul;
  const float lse = finish_row(m, d, has_keys, p.sinks ? p.sinks[head] : -INFINITY, &mul);
  const float inv = std::isfinite(v_scale) ? mul * v_scale : NAN;
  Q* o = static_cast<Q*>(p.out) + (token * p.num_heads + head) * p.kv.head_dim_v;
  for (int i = 0; i < p.kv.head_dim_v; ++i) o[i] = from_float<Q>(acc[i] * inv);
  p.lse[token * p.num_heads + head] = lse;
}

// Logits s[0, width) of one row (query at `pos`, head `head`) of the chunk at position cs, in the
// order of docs/ops.md: times `mul`, soft cap, ALiBi.
inline void transform_logits(const AttentionParams& p, float* s, int width, float mul, int head,
                             int64_t pos, int64_t cs) {
  const bool cap = p.soft_cap > 0.0f;
  const Vec mulv = Vec::set1(mul);
  const Vec capv = Vec::set1(p.soft_cap), inv_cap = Vec::set1(cap ? 1.0f / p.soft_cap : 0.0f);
  const float slope = p.alibi_slopes ? p.alibi_slopes[head] : 0.0f;
  for (int x = 0; x < width; x += Vec::N) {
    Vec v = Vec::load(s + x) * mulv;
    if (cap) v = capv * (v * inv_cap).tanh();
    if (p.alibi_slopes) {
      // ALiBi bias slope * (key position - query position), key = cs + x + lane.
      float dist[Vec::N];
      for (int l = 0; l < Vec::N; ++l) dist[l] = static_cast<float>(cs + x + l - pos);
      v = fma(Vec::set1(slope), Vec::load(dist), v);
    }
    v.store(s + x);
  }
}

// Makes row logits s[0, kChunk) of the chunk at position cs, of which [a, b) are visible, ready for
// softmax_rows4: soft cap and ALiBi applied (the query was pre-scaled), invisible keys -inf.
inline void mask_logits(const AttentionParams& p, float* s, int head, int64_t pos, int64_t cs, int a,
                        int b) {
  if (a >= b) {  // nothing visible: the whole row gets no weight
    for (int j = 0; j < kChunk; ++j) s[j] = -INFINITY;
    return;
  }
  if (p.soft_cap > 0.0f || p.alibi_slopes) transform_logits(p, s, kChunk, 1.0f, head, pos, cs);
  for (int j = 0; j < a; ++j) s[j] = -INFINITY;
  for (int j = b; j < kChunk; ++j) s[j] = -INFINITY;
}

// Online-softmax step of four rows (row stride kChunk) of masked logits: turns them into
// probabilities relative to each row's new running max m[r], updates the denominators d[r] and
// sets alpha[r], the rescale of the row's accumulator. The four rows are done together so that
// their row sums share one reduction tree and their rescales one vector exp (these were four
// scalar expf calls). While a row has seen no visible key its max stays -inf; its exponents are
// then taken relative to 0, which gives weight 0 and alpha 0 (its accumulator is still empty).
inline void softmax_rows4(float* s, float* m, float* d, float* alpha) {
  Vec sums[4];
  float rescale[Vec::N] = {};  // exponents of the four alphas, then the alphas
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    float* row = s + r * kChunk;
    Vec mx = Vec::load(row);
    for (int x = Vec::N; x < kChunk; x += Vec::N) mx = max(mx, Vec::load(row + x));
    const float m_new = kmax(m[r], mx.max());
    const float ref = m_new == -INFINITY ? 0.0f : m_new;
    const Vec mv = Vec::set1(ref);
    Vec sum = Vec::zero();
    for (int x = 0; x < kChunk; x += Vec::N) {
      const Vec e = (Vec::load(row + x) - mv).exp();
      e.store(row + x);
      sum = sum + e;
    }
    sums[r] = sum;
    rescale[r] = m[r] - ref;  // <= 0; -inf (alpha 0) before the first visible key
    m[r] = m_new;
  }
  float total[4];
  Vec::sum4(sums[0], sums[1], sums[2], sums[3], total);
  Vec::load(rescale).exp().store(rescale);
  for (int r = 0; r < 4; ++r) alpha[r] = rescale[r], d[r] = d[r] * rescale[r] + total[r];
}

// Walks the slots of positions [cs + j0, cs + j1) of a sequence: f(j, physical block, slot). One
// division per chunk (a 64-bit division per key cost about as much as its dot products); a block
// table entry is read only when a position in that block is visited.
template <typename F>
inline void for_chunk_slots(const paged_kv_t& kv, int64_t seq, int64_t cs, int j0, int j1, F f) {
  if (j0 >= j1) return;
  int64_t logical = (cs + j0) / kv.block_size;
  int slot = int((cs + j0) - logical * kv.block_size);
  int64_t block = kv.block_id(seq, logical);
  for (int j = j0; j < j1; ++j) {
    if (slot == kv.block_size) slot = 0, block = kv.block_id(seq, ++logical);
    f(j, block, slot++);
  }
}

// Where the keys of a chunk live: the element offsets of their slots in the key and value caches,
// without the kv-head term. Computed once per chunk for every kv head of an item (the block-table
// reads and offset products were a tenth of the decode time when redone per head), first to
// prefetch the chunk and then, one chunk later, to read it.
struct ChunkSlots {
  int64_t k[kChunk], v[kChunk];
};

inline void chunk_slots(const paged_kv_t& kv, int64_t seq, int64_t cs, int j0, int j1,
                        ChunkSlots* s) {
  for_chunk_slots(kv, seq, cs, j0, j1, [&](int j, int64_t block, int slot) {
    s->k[j] = kv.k_offset(block, slot, 0);
    s->v[j] = kv.v_offset(block, slot, 0);
  });
}

// Row pointers of keys [j0, j1) of a chunk for one kv head.
template <typename C>
inline void chunk_rows(const paged_kv_t& kv, const ChunkSlots& s, int kv_head, int j0, int j1,
                       const C** keys, const C** vals) {
  const C* kb = static_cast<const C*>(kv.k) + kv.k_offset(0, 0, kv_head);
  const C* vb = static_cast<const C*>(kv.v) + kv.v_offset(0, 0, kv_head);
  for (int j = j0; j < j1; ++j) keys[j] = kb + s.k[j], vals[j] = vb + s.v[j];
}

// One kv head of an item: its rows, scratch and scales.
struct Head {
  int kv_head;
  RowMap map;
  Scratch sc;
};

// The chunk's logits of rows [0, rows4) (keys [j0, j1) at position cs) masked for softmax_rows4: each
// row's visible keys kept (mask_logits), padding rows past `rows` emptied.
inline void mask_chunk_rows(const AttentionParams& p, const Head& h, int rows, int rows4, int64_t cs,
                            int j0, int j1) {
  for (int r = 0; r < rows4; ++r) {
    if (r >= rows) {  // padding row: stays empty
      mask_logits(p, h.sc.s + r * kChunk, 0, 0, cs, 0, 0);
      continue;
    }
    const int64_t pos = h.map.pos(r);
    int a, b;
    visible_keys(p, pos, cs, j0, j1, &a, &b);
    mask_logits(p, h.sc.s + r * kChunk, h.map.head(r), pos, cs, a, b);
  }
}

// Queries of a head into scratch as float times scale * k_scale, zero past head_dim; `paired`
// stores each block of 32 columns as [even columns, odd columns] (for keys read as Words).
template <typename Q>
inline void load_queries(const AttentionParams& p, const AttentionPlan& plan, const Head& h,
                         int rows, int rows4, bool paired) {
  const float qmul = p.scale * p.kv.logit_k_scale_of(h.kv_head);
  for (int r = 0; r < rows4; ++r) {
    float* q = h.sc.q + size_t(r) * plan.dk;
    for (int i = 0; i < plan.dk; ++i) q[i] = 0.0f;
    if (r >= rows) continue;
    const Q* src = static_cast<const Q*>(p.q) + h.map.token(r) * p.q_stride_token +
                   h.map.head(r) * p.q_stride_head;
    for (int i = 0; i < p.kv.head_dim; ++i) {
      const int at = paired ? (i & ~31) + (i & 1) * 16 + (i & 31) / 2 : i;
      q[at] = to_float(src[i]) * qmul;
    }
  }
  for (size_t i = 0; i < size_t(rows4) * plan.dv; ++i) h.sc.acc[i] = 0.0f;
  for (int r = 0; r < rows4; ++r) h.sc.m[r] = -INFINITY, h.sc.d[r] = 0.0f;
}

// Keys [j0, j1) of the chunk starting at position cs, for one kv head: logits, softmax, P V.
// keys[j] / vals[j] point at the rows, in the cache or staged as float.
// With a Loader (not void), key and value rows are read as Words through it.
template <typename KT, typename VT, typename Loader>
inline void attend_chunk(const AttentionParams& p, const AttentionPlan& plan, const Head& h,
                         int rows, int rows4, int64_t cs, int j0, int j1, const KT* const* keys,
                         const VT* const* vals, const RowMasks& mk, const Loader* ld,
                         const Prefetcher& pf_k, const Prefetcher& pf_v) {
  const Scratch& sc = h.sc;
#if defined(KVK_WORDS)
  if constexpr (!std::is_same_v<Loader, void>)
    chunk_logits_words(sc, plan.dk, rows4, keys, j0, j1, mk, *ld, pf_k);
  else
#endif
    chunk_logits(sc, plan.dk, rows4, keys, j0, j1, mk.nv, mk.k, pf_k);
  mask_chunk_rows(p, h, rows, rows4, cs, j0, j1);
  for (int r = 0; r < rows4; r += 4) softmax_rows4(sc.s + r * kChunk, sc.m + r, sc.d + r, sc.alpha + r);
  const ChunkRows cr{p, h.map, rows, cs, j0, j1};
#if defined(KVK_WORDS)
  if constexpr (!std::is_same_v<Loader, void>)
    chunk_values_words(sc, plan.dv, rows4, vals, j0, j1, mk, *ld, pf_v, cr);
  else
#endif
    chunk_values(sc, plan.dv, rows4, vals, j0, j1, mk.nvv, mk.v, pf_v, cr);
}

// Converts keys [j0, j1) of a chunk, for all heads of an item, into each head's float scratch,
// visiting the cache in memory order (slot by slot, every head of a slot).
template <typename C>
inline void stage_chunk(const paged_kv_t& kv, const AttentionPlan& plan, const ChunkSlots& s,
                        const Head* heads, int num_kv, int j0, int j1, const RowMasks& mk) {
  const C* kb = static_cast<const C*>(kv.k);
  const C* vb = static_cast<const C*>(kv.v);
  const bool v_is_k = kv.v == kv.k;  // MLA: the value is a prefix of the key row
  for (int j = j0; j < j1; ++j) {
    for (int h = 0; h < num_kv; ++h) {
      const C* k = kb + s.k[j] + kv.k_offset(0, 0, heads[h].kv_head);
      float* kc = heads[h].sc.kc + size_t(j) * plan.dk;
      for (int i = 0; i < mk.nv; ++i) Vec::load(k + i * Vec::N, mk.k[i]).store(kc + i * Vec::N);
      if (v_is_k) continue;
      const C* v = vb + s.v[j] + kv.v_offset(0, 0, heads[h].kv_head);
      float* vc = heads[h].sc.vc + size_t(j) * plan.dv;
      for (int i = 0; i < mk.nvv; ++i) Vec::load(v + i * Vec::N, mk.v[i]).store(vc + i * Vec::N);
    }
  }
}

// Prefetchers for keys [0, n) of the next chunk of one kv head: a paged block is scattered in
// memory, so the hardware prefetcher cannot find the next one by itself.
template <typename C>
inline void next_chunk(const paged_kv_t& kv, const ChunkSlots& s, int kv_head, int n,
                       Prefetcher* pf_k, Prefetcher* pf_v) {
  const C *keys[kChunk], *vals[kChunk];
  chunk_rows(kv, s, kv_head, 0, n, keys, vals);
  pf_k->n = n, pf_k->bytes = kv.head_dim * int(sizeof(C));
  pf_v->n = kv.v == kv.k ? 0 : n, pf_v->bytes = kv.head_dim_v * int(sizeof(C));
  for (int j = 0; j < n; ++j) {
    pf_k->rows[j] = reinterpret_cast<const char*>(keys[j]);
    pf_v->rows[j] = reinterpret_cast<const char*>(vals[j]);
  }
}

#if defined(KVK_WORDS)
// One table per fp8 format, built on first use and shared by all threads.
template <typename C>
const WordLoader<C>& word_loader() {
  static const WordLoader<C> ld;
  return ld;
}
#endif

// The chunks of `chunk` positions this split of an item visits: the keys visible to at least one
// of its rows, [lo, hi], cut into chunks and shared out between the item's splits.
struct ChunkRange {
  int64_t lo = 0, hi = -1, c_begin = 0, c_end = 0;
  ChunkRange(const AttentionParams& p, const AttentionPlan& plan, const AttentionItem& it,
             const RowMap& map0, int rows, int chunk) {
    // Causal: the last row has the largest position; otherwise every row sees up to the last key.
    hi = p.causal ? map0.pos(rows - 1) : int64_t(p.kv.seq_lens[it.seq]) - 1;
    lo = p.window_left >= 0 ? kmax<int64_t>(0, map0.pos0 - p.window_left) : 0;
    if (hi < lo) return;
    const int64_t c_first = lo / chunk, n_chunks = hi / chunk - c_first + 1;
    c_begin = c_first + n_chunks * it.split / plan.splits;
    c_end = c_first + n_chunks * (it.split + 1) / plan.splits;
  }
};

// The end of an item for one kv head (index h within the item): out and lse of its rows, or,
// when the item is one split of several, its unnormalized partial result.
template <typename Q>
inline void store_rows(const AttentionParams& p, const AttentionPlan& plan, const RowMap& map,
                       int64_t seq, int kv_head, int h, int rows, const float* acc, const float* m,
                       const float* d, float* part_acc, float* part_m, float* part_d) {
  if (part_acc == nullptr) {
    const float v_scale = p.kv.v_scale_of(kv_head);
    for (int r = 0; r < rows; ++r)
      finalize_row<Q>(p, map.token(r), map.head(r), acc + size_t(r) * plan.dv, m[r], d[r],
                      row_has_keys(p, map.pos(r), p.kv.seq_lens[seq]), v_scale);
    return;
  }
  const size_t row0 = size_t(h) * plan.max_rows;
  for (size_t i = 0; i < size_t(rows) * plan.dv; ++i) part_acc[row0 * plan.dv + i] = acc[i];
  for (int r = 0; r < rows; ++r) part_m[row0 + r] = m[r], part_d[row0 + r] = d[r];
}

template <typename Q, typename C>
void attend_item(const AttentionParams& p, const AttentionPlan& plan, const AttentionItem& it,
                 float* scratch, float* part_acc, float* part_m, float* part_d) {
  const paged_kv_t& kv = p.kv;
  const int G = plan.group;
  const int rows = int(it.q1 - it.q0) * G, rows4 = (rows + 3) & ~3;
  const int64_t seq_len = kv.seq_lens[it.seq];
  const RowMap map0{p.q_begin(it.seq) + it.q0, seq_len - p.q_len(it.seq) + it.q0, G, 0};
  // Rows read as Words (bf16, and fp8 with VBMI) are cheap to widen, so they are never staged.
  // Other non-float rows are staged (converted to float scratch) when several row groups would
  // otherwise convert the same rows again; decode (one group per head) converts in registers:
  // staging there costs more than the memory order it buys (measured: bf16 0.35 -> 0.56 of read
  // bandwidth without it). Words leave the query and accumulator columns paired.
#if defined(KVK_WORDS)
  constexpr bool words = kWordRows<C>;
#else
  constexpr bool words = false;
#endif
  const bool stage = rows4 > 4 && !std::is_same_v<C, float> && !words;
  Head heads[kMaxHeadsPerItem];
  for (int h = 0; h < it.num_kv; ++h) {
    RowMap map = map0;
    map.head0 = (it.kv_head + h) * G;
    heads[h] = {it.kv_head + h, map, carve(plan, scratch, h)};
    load_queries<Q>(p, plan, heads[h], rows, rows4, words);
  }

  const ChunkRange cr(p, plan, it, map0, rows, kChunk);
  if (cr.c_begin < cr.c_end) {
    const int64_t lo = cr.lo, hi = cr.hi, c_begin = cr.c_begin, c_end = cr.c_end;
    const RowMasks mk(kv);
    // slots[c & 1]: chunk c, filled while chunk c - 1 is computed (for its prefetches).
    ChunkSlots slots[2];
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t cs = c * kChunk;
      const int j0 = int(kmax<int64_t>(0, lo - cs)), j1 = int(kmin<int64_t>(kChunk, hi + 1 - cs));
      // Later chunks start at key 0 (lo <= their start) and end at `next`.
      const int next = c + 1 < c_end ? int(kmin<int64_t>(kChunk, hi + 1 - cs - kChunk)) : 0;
      const ChunkSlots& cur = slots[c & 1];
      if (c == c_begin) chunk_slots(kv, it.seq, cs, j0, j1, &slots[c & 1]);
      if (next > 0) chunk_slots(kv, it.seq, cs + kChunk, 0, next, &slots[(c + 1) & 1]);
      if (stage) stage_chunk<C>(kv, plan, cur, heads, it.num_kv, j0, j1, mk);
      for (int h = 0; h < it.num_kv; ++h) {
        Prefetcher pf_k, pf_v;
        if (next > 0) next_chunk<C>(kv, slots[(c + 1) & 1], heads[h].kv_head, next, &pf_k, &pf_v);
        if (stage) {
          const float *keys[kChunk], *vals[kChunk];
          const Scratch& sc = heads[h].sc;
          const bool v_is_k = kv.v == kv.k;
          for (int j = j0; j < j1; ++j) {
            keys[j] = sc.kc + size_t(j) * plan.dk;
            vals[j] = v_is_k ? keys[j] : sc.vc + size_t(j) * plan.dv;
          }
          attend_chunk<float, float, void>(p, plan, heads[h], rows, rows4, cs, j0, j1, keys,
                                                  vals, mk, nullptr, pf_k, pf_v);
        } else {
          const C *keys[kChunk], *vals[kChunk];
          chunk_rows(kv, cur, heads[h].kv_head, j0, j1, keys, vals);
#if defined(KVK_WORDS)
          if constexpr (words) {
            attend_chunk(p, plan, heads[h], rows, rows4, cs, j0, j1, keys, vals, mk,
                         &word_loader<C>(), pf_k, pf_v);
            continue;
          }
#endif
          attend_chunk<C, C, void>(p, plan, heads[h], rows, rows4, cs, j0, j1, keys, vals,
                                          mk, nullptr, pf_k, pf_v);
        }
      }
    }
  }

  for (int h = 0; h < it.num_kv; ++h) {
    const Scratch& sc = heads[h].sc;
    if (words) unpair_rows(sc.acc, rows, plan.dv);
    store_rows<Q>(p, plan, heads[h].map, it.seq, heads[h].kv_head, h, rows, sc.acc, sc.m, sc.d,
                  part_acc, part_m, part_d);
  }
}

}  // namespace kvkernels::cpu::KVK_ISA

#if defined(KVK_WORDS)
#include "attention_tiles.h"
#endif
#if defined(KVK_BF16)
#include "attention_dp.h"
#endif

namespace kvkernels::cpu::KVK_ISA {

void attend(const AttentionParams& p, const AttentionPlan& plan, const AttentionItem* items,
            int64_t begin, int64_t end, float* scratch, const AttentionPartials& part) {
  const size_t item_rows = size_t(plan.heads) * plan.max_rows;
  dispatch_float_and_cache(p.q_format, p.kv.format, [&](auto qt, auto ct) {
    using Q = typename decltype(qt)::type;
    using C = typename decltype(ct)::type;
#if defined(KVK_WORDS)
    if (plan.tiles != TileKernel::kNone) {
      attend_tiles<Q, C>(p, plan, items, begin, end, scratch, part);
      return;
    }
#endif
#if defined(KVK_BF16)
    if constexpr (std::is_same_v<Q, c10::BFloat16> && kWordRows<C>) {
      if (plan.dp) {
        for (int64_t i = begin; i < end; ++i) {
          const size_t row0 = size_t(i) * item_rows;
          const bool split = plan.splits > 1;
          attend_item_dp<C>(p, plan, items[i], scratch, split ? part.acc + row0 * plan.dv : nullptr,
                            split ? part.m + row0 : nullptr, split ? part.d + row0 : nullptr);
        }
        return;
      }
    }
#endif
    for (int64_t i = begin; i < end; ++i) {
      if (plan.splits == 1) {
        attend_item<Q, C>(p, plan, items[i], scratch, nullptr, nullptr, nullptr);
      } else {
        const size_t row0 = size_t(i) * item_rows;
        attend_item<Q, C>(p, plan, items[i], scratch, part.acc + row0 * plan.dv, part.m + row0,
                          part.d + row0);
      }
    }
  });
}

// Exact merge of the splits of one (sequence, query tile, kv heads) item, in place into the first
// split's partial, then the same finalization as an unsplit item.
void merge_splits(const AttentionParams& p, const AttentionPlan& plan, const AttentionItem* items,
                  int64_t first, const AttentionPartials& part) {
  const AttentionItem& it = items[first];
  const int G = plan.group, dv = plan.dv, Dv = p.kv.head_dim_v;
  const int rows = int(it.q1 - it.q0) * G;
  const size_t item_rows = size_t(plan.heads) * plan.max_rows;
  dispatch_float(p.q_format, [&](auto qt) {
    using Q = typename decltype(qt)::type;
    for (int h = 0; h < it.num_kv; ++h) {
      const int64_t seq_len = p.kv.seq_lens[it.seq];
      const RowMap map{p.q_begin(it.seq) + it.q0, seq_len - p.q_len(it.seq) + it.q0, G,
                       (it.kv_head + h) * G};
      const float v_scale = p.kv.v_scale_of(it.kv_head + h);
      const size_t row0 = size_t(first) * item_rows + size_t(h) * plan.max_rows;
      for (int r = 0; r < rows; ++r) {
        // m: the largest split max (a NaN one is skipped here and turns d NaN below). Every split
        // is read, an empty one (m = -inf, d = 0, acc 0) with weight 0; while no split saw a
        // finite logit (m = -inf) the weights are 1, so a NaN d or acc still comes through.
        float m = -INFINITY;
        for (int s = 0; s < plan.splits; ++s) m = std::fmax(m, part.m[row0 + s * item_rows + r]);
        float* acc = part.acc + (row0 + r) * dv;
        float d = 0.0f;
        for (int s = 0; s < plan.splits; ++s) {
          const size_t row = row0 + s * item_rows + r;
          const float w = m == -INFINITY ? 1.0f : std::exp(part.m[row] - m);
          d += part.d[row] * w;
          const float* a = part.acc + row * dv;
          if (s == 0) {
            for (int i = 0; i < Dv; ++i) acc[i] = a[i] * w;
          } else {
            for (int i = 0; i < Dv; ++i) acc[i] += a[i] * w;
          }
        }
        finalize_row<Q>(p, map.token(r), map.head(r), acc, m, d,
                        row_has_keys(p, map.pos(r), seq_len), v_scale);
      }
    }
  });
}

}  // namespace kvkernels::cpu::KVK_ISA
