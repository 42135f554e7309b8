// MLA latent-cache kernels (docs/ops.md): concat_and_cache_mla, mla_decompress (+ mla_copy_pe),
// mla_paged_attention. Latent cache rows are [kv_lora_rank R latent ; rope_dim P rotary key].
// Compiled after common.h with each kernel's own macros (the others keep their defaults):
//   concat_and_cache_mla:      CONCAT_SRC_T, CONCAT_CACHE_T, CONCAT_FP8
//   mla_decompress/copy_pe:    DEC_W_T (dtype of w_kv_b and the outputs), DEC_CACHE_T, DEC_FP8
//   mla_paged_attention:       MLA_Q_T, MLA_KV_T, MLA_FP8

#ifndef CONCAT_SRC_T
#define CONCAT_SRC_T float
#define CONCAT_CACHE_T float
#define CONCAT_FP8 0
#endif
#ifndef DEC_W_T
#define DEC_W_T float
#define DEC_CACHE_T float
#define DEC_FP8 0
#endif
#ifndef MLA_Q_T
#define MLA_Q_T float
#define MLA_KV_T float
#define MLA_FP8 0
#endif

// ---- concat_and_cache_mla ----------------------------------------------------------------------

struct ConcatParams {
  long num_tokens;
  long kv_lora_rank;
  long rope_dim;
  long num_slots;
  long block_size;
  long c_stride_t, c_stride_d;  // kv_c [T, R]
  long pe_stride_t, pe_stride_d;  // k_pe [T, P]
  long cache_stride_b, cache_stride_s;  // kv_cache [N, B, R + P], unit stride along the row
};

// One thread per (element of the row, token): threads [R + P, num_tokens].
kernel void concat_and_cache_mla(device const CONCAT_SRC_T* kv_c [[buffer(0)]],
                                 device const CONCAT_SRC_T* k_pe [[buffer(1)]],
                                 device CONCAT_CACHE_T* kv_cache [[buffer(2)]],
                                 device const long* slot_mapping [[buffer(3)]],
                                 device const float* scale [[buffer(4)]],  // fp8: [1]
                                 constant ConcatParams& p [[buffer(5)]],
                                 uint2 gid [[thread_position_in_grid]]) {
  const long c = gid.x, t = gid.y;
  const long slot = slot_mapping[t];
  if (slot < 0 || slot >= p.num_slots) return;
  const CONCAT_SRC_T x = c < p.kv_lora_rank ? kv_c[t * p.c_stride_t + c * p.c_stride_d]
                                            : k_pe[t * p.pe_stride_t + (c - p.kv_lora_rank) * p.pe_stride_d];
  const long dst = (slot / p.block_size) * p.cache_stride_b + (slot % p.block_size) * p.cache_stride_s + c;
#if CONCAT_FP8
  kv_cache[dst] = quantize<CONCAT_CACHE_T>(to_float(x), scale[0]);
#else
  kv_cache[dst] = x;
#endif
}

// ---- mla_decompress ----------------------------------------------------------------------------
// out[t, n] = sum_r c[t, r] * w_kv_b[n, r] for the Hq * (dn + dv) rows n of w_kv_b, with c the
// (optionally RMS-normalised) latent of token t, rounded once to w_kv_b's dtype (docs/ops.md). Tiles: MD_TM tokens x MD_TN rows of w_kv_b per
// threadgroup of 16 x 16 threads (2 x 2 outputs each), MD_TK latent elements per step, both
// operands staged in threadgroup memory (one barrier after the loads, one before the next loads).

#define MD_TM 32
#define MD_TN 32
#define MD_TK 32

struct DecompressParams {
  long num_tokens;
  long num_seqs;
  long kv_lora_rank;
  long rope_dim;
  long num_heads;
  long qk_nope_head_dim;
  long v_head_dim;
  long block_size;
  long num_blocks;
  long table_stride;
  long cache_stride_b, cache_stride_s;
  long w_stride_n, w_stride_r;  // w_kv_b [Hq * (dn + dv), R]
  long has_norm;
  float norm_eps;
};

inline long mla_find_sequence(device const long* cu, long num_seqs, long t) {
  long lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const long mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Element offset of token t's latent row (tokens of all sequences in order), -1 if its block id is invalid.
inline long latent_row(device const int* block_tables, device const long* cu, constant DecompressParams& p, long t) {
  const long s = mla_find_sequence(cu, p.num_seqs, t);
  const long pos = t - cu[s];
  const long blk = block_tables[s * p.table_stride + pos / p.block_size];
  if (blk < 0 || blk >= p.num_blocks) return -1;
  return blk * p.cache_stride_b + (pos % p.block_size) * p.cache_stride_s;
}

// threads [16 * ceil(N / MD_TN), 16 * ceil(T / MD_TM)], group [16, 16].
kernel void mla_decompress(device const DEC_CACHE_T* kv_cache [[buffer(0)]],
                           device const int* block_tables [[buffer(1)]],
                           device const long* cu_seq_lens [[buffer(2)]],  // [S + 1]
                           device const DEC_W_T* w_kv_b [[buffer(3)]],
                           device const DEC_W_T* norm_weight [[buffer(4)]],  // [R] (has_norm)
                           device const float* scale [[buffer(5)]],          // fp8: [1]
                           device DEC_W_T* key_out [[buffer(6)]],    // [T, Hq, dn + P] contiguous
                           device DEC_W_T* value_out [[buffer(7)]],  // [T, Hq, dv] contiguous
                           constant DecompressParams& p [[buffer(8)]],
                           uint2 tg [[threadgroup_position_in_grid]],
                           uint2 tp [[thread_position_in_threadgroup]],
                           uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float c_tile[MD_TM][MD_TK + 1];
  threadgroup float w_tile[MD_TN][MD_TK + 1];
  threadgroup float row_norm[MD_TM];
  threadgroup long row_base[MD_TM];

  const long R = p.kv_lora_rank;
  const long per_head = p.qk_nope_head_dim + p.v_head_dim;
  const long N = p.num_heads * per_head;
  const long m0 = long(tg.y) * MD_TM, n0 = long(tg.x) * MD_TN;
#if DEC_FP8
  const float sc = scale[0];
#else
  const float sc = 1.0f;
#endif

  if (tid < MD_TM) row_base[tid] = m0 + tid < p.num_tokens ? latent_row(block_tables, cu_seq_lens, p, m0 + tid) : -1;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // RMS of each row: 8 consecutive lanes per row, reduced with shuffles inside the 8-lane segment.
  {
    const uint r = tid / 8, part = tid % 8;
    float ss = 0.0f;
    if (p.has_norm && row_base[r] >= 0) {
      for (long k = part; k < R; k += 8) {
        const float x = to_float(kv_cache[row_base[r] + k]) * sc;
        ss += x * x;
      }
    }
    ss += simd_shuffle_xor(ss, ushort(4));
    ss += simd_shuffle_xor(ss, ushort(2));
    ss += simd_shuffle_xor(ss, ushort(1));
    if (part == 0) row_norm[r] = p.has_norm ? rsqrt(ss / float(R) + p.norm_eps) : 1.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  for (long k0 = 0; k0 < R; k0 += MD_TK) {
    for (uint i = tid; i < MD_TM * MD_TK; i += 256) {
      const uint r = i / MD_TK, kk = i % MD_TK;
      const long k = k0 + kk;
      float c = 0.0f;
      if (row_base[r] >= 0 && k < R) {
        c = to_float(kv_cache[row_base[r] + k]) * sc * row_norm[r];
        if (p.has_norm) c *= to_float(norm_weight[k]);
        c = to_float(from_float<DEC_W_T>(c));  // docs/ops.md: the latent is rounded to w_kv_b's dtype
      }
      c_tile[r][kk] = c;
      const long n = n0 + r;
      w_tile[r][kk] = (n < N && k < R) ? to_float(w_kv_b[n * p.w_stride_n + k * p.w_stride_r]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int kk = 0; kk < MD_TK; ++kk) {
      const float a0 = c_tile[tp.y][kk], a1 = c_tile[tp.y + 16][kk];
      const float b0 = w_tile[tp.x][kk], b1 = w_tile[tp.x + 16][kk];
      acc[0][0] += a0 * b0;
      acc[0][1] += a0 * b1;
      acc[1][0] += a1 * b0;
      acc[1][1] += a1 * b1;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const long key_width = p.qk_nope_head_dim + p.rope_dim;
  for (int i = 0; i < 2; ++i) {
    const long m = m0 + tp.y + 16 * i;
    if (m >= p.num_tokens) continue;
    for (int j = 0; j < 2; ++j) {
      const long n = n0 + tp.x + 16 * j;
      if (n >= N) continue;
      const long h = n / per_head, c = n % per_head;
      if (c < p.qk_nope_head_dim) {
        key_out[(m * p.num_heads + h) * key_width + c] = from_float<DEC_W_T>(acc[i][j]);
      } else {
        value_out[(m * p.num_heads + h) * p.v_head_dim + (c - p.qk_nope_head_dim)] = from_float<DEC_W_T>(acc[i][j]);
      }
    }
  }
}

// The rotary part of every head's key: key[t, h, dn + i] = k_pe[t, i]. threads [P, Hq, T].
kernel void mla_copy_pe(device const DEC_CACHE_T* kv_cache [[buffer(0)]],
                        device const int* block_tables [[buffer(1)]],
                        device const long* cu_seq_lens [[buffer(2)]],
                        device const float* scale [[buffer(3)]],
                        device DEC_W_T* key_out [[buffer(4)]],
                        constant DecompressParams& p [[buffer(5)]],
                        uint3 gid [[thread_position_in_grid]]) {
  const long i = gid.x, h = gid.y, t = gid.z;
  const long base = latent_row(block_tables, cu_seq_lens, p, t);
  const long key_width = p.qk_nope_head_dim + p.rope_dim;
  float x = 0.0f;
  if (base >= 0) {
    x = to_float(kv_cache[base + p.kv_lora_rank + i]);
#if DEC_FP8
    x *= scale[0];
#endif
  }
  key_out[(t * p.num_heads + h) * key_width + p.qk_nope_head_dim + i] = from_float<DEC_W_T>(x);
}

// ---- mla_paged_attention -----------------------------------------------------------------------
// Absorbed MLA: every query head attends the one latent "kv head"; logits over the full R + P row,
// values the first R elements. One threadgroup per (query token, MLA_HEADS query heads), one SIMD
// group per head: threads [32 * MLA_HEADS, ceil(Hq / MLA_HEADS), T]. The group stages MLA_KT latent
// rows at a time in threadgroup memory (dequantized once for all its heads); each SIMD group then
// runs its online softmax over the staged rows.

#define MLA_HEADS 4
#define MLA_KT 8
#define MLA_MAX_ROW 576  // R + P
#define MLA_EPL_K 18     // MLA_MAX_ROW / 32
#define MLA_EPL_V 16     // 512 / 32: R <= 512

struct MlaParams {
  long num_tokens;
  long num_heads;
  long kv_lora_rank;
  long row_width;  // R + P
  long num_seqs;
  long block_size;
  long num_blocks;
  long table_stride;
  long q_stride_t, q_stride_h, q_stride_d;
  long cache_stride_b, cache_stride_s;
  long varlen;
  float scale;
};

inline long mla_row_sequence(device const int* qsl, long num_seqs, long t) {
  long lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const long mid = (lo + hi + 1) / 2;
    if (long(qsl[mid]) <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

kernel void mla_paged_attention(device const MLA_Q_T* q [[buffer(0)]],        // [T, Hq, R + P]
                                device const MLA_KV_T* kv_cache [[buffer(1)]],  // [N, B, R + P]
                                device const int* block_tables [[buffer(2)]],
                                device const int* seq_lens [[buffer(3)]],
                                device const int* query_start_loc [[buffer(4)]],
                                device const float* kv_scale [[buffer(5)]],  // fp8: [1]
                                device MLA_Q_T* out [[buffer(6)]],   // [T, Hq, R] contiguous
                                device float* lse [[buffer(7)]],      // [T, Hq] contiguous
                                constant MlaParams& p [[buffer(8)]],
                                uint3 tg [[threadgroup_position_in_grid]],
                                uint lane [[thread_index_in_simdgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float rows[MLA_KT][MLA_MAX_ROW];

  const long t = tg.z;
  const long h = long(tg.y) * MLA_HEADS + sg;
  const bool head_active = h < p.num_heads;  // the last group may have fewer heads (uniform per SIMD group)
  const long W = p.row_width, R = p.kv_lora_rank;
  const long s = p.varlen ? mla_row_sequence(query_start_loc, p.num_seqs, t) : t;
  const long seq_len = seq_lens[s];
  const long q_len = p.varlen ? long(query_start_loc[s + 1] - query_start_loc[s]) : 1;
  const long pos = seq_len - q_len + (p.varlen ? t - long(query_start_loc[s]) : 0);
#if MLA_FP8
  const float sc = kv_scale[0];
#else
  const float sc = 1.0f;
#endif

  float qv[MLA_EPL_K], acc[MLA_EPL_V];
  for (int e = 0; e < MLA_EPL_K; ++e) {
    const long d = lane + 32 * e;
    qv[e] = (head_active && d < W) ? to_float(q[t * p.q_stride_t + h * p.q_stride_h + d * p.q_stride_d]) : 0.0f;
  }
  for (int e = 0; e < MLA_EPL_V; ++e) acc[e] = 0.0f;

  float m = -FLT_MAX, l = 0.0f;
  for (long j0 = 0; j0 <= pos; j0 += MLA_KT) {
    for (long i = tid; i < MLA_KT * W; i += 32 * MLA_HEADS) {
      const long r = i / W, c = i % W, j = j0 + r;
      float x = 0.0f;
      if (j <= pos) {
        const long blk = block_tables[s * p.table_stride + j / p.block_size];
        if (blk >= 0 && blk < p.num_blocks) {
          x = to_float(kv_cache[blk * p.cache_stride_b + (j % p.block_size) * p.cache_stride_s + c]) * sc;
        }
      }
      rows[r][c] = x;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (head_active) {
      for (long r = 0; r < MLA_KT && j0 + r <= pos; ++r) {
        float partial = 0.0f;
        for (int e = 0; e < MLA_EPL_K; ++e) {
          const long d = lane + 32 * e;
          if (d < W) partial += qv[e] * rows[r][d];
        }
        const float x = simd_sum(partial) * p.scale;
        const bool poison = bits_nan(x) || bits_pos_inf(x);  // docs/ops.md: a NaN row
        const float m_new = poison ? m : max(m, x);
        const float corr = exp(m - m_new), w = poison ? quiet_nan() : exp(x - m_new);
        l = l * corr + w;
        for (int e = 0; e < MLA_EPL_V; ++e) {
          const long d = lane + 32 * e;
          acc[e] = acc[e] * corr + (d < R ? w * rows[r][d] : 0.0f);
        }
        m = m_new;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (!head_active) return;  // after the last barrier
  // docs/ops.md: l NaN (a NaN or +inf logit) or l = 0 with visible keys (all logits -inf): NaN row;
  // a non-finite kv_scale makes out NaN.
  const bool nan_row = bits_nan(l) || (l == 0.0f && pos >= 0);
  const bool v_ok = bits_finite(sc);
  const long row = t * p.num_heads + h;
  for (int e = 0; e < MLA_EPL_V; ++e) {
    const long d = lane + 32 * e;
    const float o = (nan_row || !v_ok) ? quiet_nan() : l > 0.0f ? acc[e] / l : 0.0f;
    if (d < R) out[row * R + d] = from_float<MLA_Q_T>(o);
  }
  if (lane == 0) lse[row] = nan_row ? quiet_nan() : l > 0.0f ? m + log(l) : -INFINITY;
}
