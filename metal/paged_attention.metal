// paged_attention (docs/ops.md): decode and varlen (chunked prefill) attention over a paged K/V
// cache: GQA/MQA, sliding window, soft cap, ALiBi, sinks, fp8 caches (decoded in software) with
// per-tensor or per-head scales; returns out and the log-sum-exp.
// Compiled after common.h with Q_T (float, half, bf16_t), KV_T (Q_T or e4m3_t / e5m2_t) and KV_FP8.
//
// One threadgroup per (query token, query head): threads [32 * PA_SIMD_GROUPS, num_heads,
// num_tokens], group [32 * PA_SIMD_GROUPS, 1, 1]. Each lane holds head_dim / 32 elements of the
// query and head_dim_v / 32 of the output accumulator (the value's head dim may differ from the
// key's), at most PA_MAX_EPL each: 8 (head dims up to 256) or 16 (up to 512, a variant of its own,
// so the common case keeps its short loops; 8 KiB of threadgroup memory for part_o). The SIMD groups take the
// visible keys in turn (key j goes to SIMD group (j - first) % PA_SIMD_GROUPS); each runs an
// online softmax with simd_sum for the dot products, starting from a finite maximum so that no
// inf - inf ever happens. The partial states (max, sum, accumulator) meet in threadgroup memory and
// are merged after one barrier; sinks join that merge as one more logit without a value.
// Non-finite values (docs/ops.md): a NaN or +inf logit or sink makes the row NaN (the state's sum
// turns NaN), every visible logit -inf without a sink is 0 / 0 = NaN, a non-finite v_scale makes
// out NaN; the tests are on the bits (fast math may fold isnan away).
// Only visible keys are read: [first, last] with pos = seq_len - q_len + i, first = pos - window_left
// (window) or 0, last = pos (causal) or seq_len - 1 (causal = 0). Leading rows of a sequence with
// more queries than keys (pos < 0) see no key when causal: first > last.
// Not tuned: no query tiling for prefill (each query row reads its keys itself), no split-K for
// very long contexts.

#ifndef Q_T
#define Q_T float
#define KV_T float
#define KV_FP8 0
#endif

#define PA_SIMD_GROUPS 4
#ifndef PA_MAX_EPL
#define PA_MAX_EPL 8  // head dims <= 256 (16: <= 512)
#endif

struct AttentionParams {
  long num_tokens;
  long num_heads;
  long num_kv_heads;
  long head_dim;    // key's (and query's)
  long head_dim_v;  // value's (and out's)
  long num_seqs;
  long block_size;
  long num_blocks;
  long table_stride;
  long q_stride_t, q_stride_h, q_stride_d;
  long kc_stride_b, kc_stride_s, kc_stride_h;
  long vc_stride_b, vc_stride_s, vc_stride_h;
  long varlen;       // 0: decode (token t is sequence t); 1: query_start_loc gives the rows
  long window_left;  // < 0: no window
  long causal;       // 0: every row sees all keys of its sequence (the window's lower bound applies)
  long has_alibi;
  long has_sinks;
  long k_scale_per_head;
  long v_scale_per_head;
  float scale;
  float soft_cap;  // <= 0: none
};

// The sequence of query row t: qsl[s] <= t < qsl[s + 1] (rows of empty sequences are skipped).
inline long row_sequence(device const int* qsl, long num_seqs, long t) {
  long lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const long mid = (lo + hi + 1) / 2;
    if (long(qsl[mid]) <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

kernel void paged_attention(device const Q_T* query [[buffer(0)]],        // [T, Hq, D], any strides
                            device const KV_T* key_cache [[buffer(1)]],   // [N, B, Hkv, D], unit stride in D
                            device const KV_T* value_cache [[buffer(2)]],
                            device const int* block_tables [[buffer(3)]],  // [S, max_blocks]
                            device const int* seq_lens [[buffer(4)]],      // [S]
                            device const int* query_start_loc [[buffer(5)]],  // [S + 1] (varlen)
                            device const float* alibi_slopes [[buffer(6)]],   // [Hq] (has_alibi)
                            device const float* sinks [[buffer(7)]],          // [Hq] (has_sinks)
                            device const float* k_scale [[buffer(8)]],        // fp8: [1] or [Hkv]
                            device const float* v_scale [[buffer(9)]],
                            device Q_T* out [[buffer(10)]],   // [T, Hq, Dv] contiguous
                            device float* lse [[buffer(11)]],  // [T, Hq] contiguous
                            constant AttentionParams& p [[buffer(12)]],
                            uint3 tg [[threadgroup_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint group_threads [[threads_per_threadgroup]]) {
  threadgroup float part_m[PA_SIMD_GROUPS];
  threadgroup float part_l[PA_SIMD_GROUPS];
  threadgroup float part_o[PA_SIMD_GROUPS][PA_MAX_EPL * 32];

  const long h = tg.y, t = tg.z;
  const long D = p.head_dim, Dv = p.head_dim_v;
  const long epl = (D + 31) / 32, epl_v = (Dv + 31) / 32;
  const long s = p.varlen ? row_sequence(query_start_loc, p.num_seqs, t) : t;
  const long seq_len = seq_lens[s];
  const long q_len = p.varlen ? long(query_start_loc[s + 1] - query_start_loc[s]) : 1;
  const long pos = seq_len - q_len + (p.varlen ? t - long(query_start_loc[s]) : 0);
  const long first = p.window_left >= 0 ? max(pos - p.window_left, 0l) : 0l;
  const long last = p.causal ? pos : seq_len - 1;
  const long kvh = h / (p.num_heads / p.num_kv_heads);
#if KV_FP8
  // A non-finite k_scale is NaN for the logits (docs/ops.md): the soft cap would map +-inf to +-cap.
  const float ks0 = head_scale(k_scale, p.k_scale_per_head, kvh), ks = ks0 * 0.0f == 0.0f ? ks0 : ks0 * 0.0f;
  const float vs = head_scale(v_scale, p.v_scale_per_head, kvh);
#else
  const float ks = 1.0f, vs = 1.0f;
#endif
  const float slope = p.has_alibi ? alibi_slopes[h] : 0.0f;

  float q[PA_MAX_EPL], acc[PA_MAX_EPL];
  for (int e = 0; e < PA_MAX_EPL; ++e) {
    const long d = lane + 32 * e;
    q[e] = (e < epl && d < D) ? to_float(query[t * p.q_stride_t + h * p.q_stride_h + d * p.q_stride_d]) : 0.0f;
    acc[e] = 0.0f;
  }

  float m = -FLT_MAX, l = 0.0f;
  for (long j = first + sg; j <= last; j += PA_SIMD_GROUPS) {
    const long blk = block_tables[s * p.table_stride + j / p.block_size];
    if (blk < 0 || blk >= p.num_blocks) continue;  // invalid table entry: the host check reports it
    const long off = j % p.block_size;
    device const KV_T* krow = key_cache + blk * p.kc_stride_b + off * p.kc_stride_s + kvh * p.kc_stride_h;
    device const KV_T* vrow = value_cache + blk * p.vc_stride_b + off * p.vc_stride_s + kvh * p.vc_stride_h;
    float partial = 0.0f;
    for (int e = 0; e < PA_MAX_EPL; ++e) {
      const long d = lane + 32 * e;
      if (e < epl && d < D) partial += q[e] * (to_float(krow[d]) * ks);
    }
    float x = simd_sum(partial) * p.scale;  // logit order: scale, soft cap, ALiBi
    if (p.soft_cap > 0.0f) x = p.soft_cap * precise::tanh(x / p.soft_cap);
    x += slope * float(j - pos);
    const bool poison = bits_nan(x) || bits_pos_inf(x);  // NaN weight: the row becomes NaN
    const float m_new = poison ? m : max(m, x);
    const float corr = exp(m - m_new), w = poison ? quiet_nan() : exp(x - m_new);
    l = l * corr + w;
    for (int e = 0; e < PA_MAX_EPL; ++e) {
      const long d = lane + 32 * e;
      const float v = (e < epl_v && d < Dv) ? to_float(vrow[d]) * vs : 0.0f;
      acc[e] = acc[e] * corr + w * v;
    }
    m = m_new;
  }

  // Merge the SIMD groups' states.
  if (lane == 0) {
    part_m[sg] = m;
    part_l[sg] = l;
  }
  for (int e = 0; e < PA_MAX_EPL; ++e) {
    const long d = lane + 32 * e;
    if (e < epl_v && d < Dv) part_o[sg][d] = acc[e];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float gm = -FLT_MAX;
  for (int k = 0; k < PA_SIMD_GROUPS; ++k) gm = max(gm, part_m[k]);
  // The sink: -inf is no sink; NaN or +inf makes the row NaN.
  const float sink = p.has_sinks ? sinks[h] : -INFINITY;
  const bool with_sink = !bits_neg_inf(sink);
  const bool sink_poison = bits_nan(sink) || bits_pos_inf(sink);
  if (with_sink && !sink_poison) gm = max(gm, sink);
  float weight[PA_SIMD_GROUPS];
  float total = with_sink ? (sink_poison ? quiet_nan() : exp(sink - gm)) : 0.0f;
  for (int k = 0; k < PA_SIMD_GROUPS; ++k) {
    weight[k] = exp(part_m[k] - gm);
    total += part_l[k] * weight[k];
  }
  // total = 0: no finite logit and no sink; a NaN row when the row has visible keys (all -inf).
  const bool nan_row = bits_nan(total) || (total == 0.0f && last >= first);
  const bool v_ok = bits_finite(vs);
  const long row = t * p.num_heads + h;
  for (long d = tid; d < Dv; d += group_threads) {
    float o = 0.0f;
    if (nan_row || !v_ok) {
      o = quiet_nan();
    } else if (total > 0.0f) {
      for (int k = 0; k < PA_SIMD_GROUPS; ++k) {
        if (part_l[k] > 0.0f) o += part_o[k][d] * weight[k];
      }
      o /= total;
    }
    out[row * Dv + d] = from_float<Q_T>(o);
  }
  if (tid == 0) lse[row] = nan_row ? quiet_nan() : total > 0.0f ? gm + log(total) : -INFINITY;
}
