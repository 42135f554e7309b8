// merge_attention_states (docs/ops.md): the exact merge of attention over two disjoint key sets.
// Compiled after common.h with OUT_T (float, half or bf16_t: the dtype of out_a, out_b and out).

#ifndef OUT_T
#define OUT_T float
#endif

struct MergeParams {
  long num_tokens;
  long num_heads;
  long head_dim;
  long a_stride_t, a_stride_h, a_stride_d;  // out_a [T, H, D]
  long b_stride_t, b_stride_h, b_stride_d;
  long la_stride_t, la_stride_h;  // lse_a [T, H]
  long lb_stride_t, lb_stride_h;
};

// One thread per (d, h, token): threads [head_dim, num_heads, num_tokens]. The weights are
// recomputed by every thread of a row (two exp and a log; cheaper than sharing them).
kernel void merge_attention_states(device const OUT_T* out_a [[buffer(0)]],
                                   device const float* lse_a [[buffer(1)]],
                                   device const OUT_T* out_b [[buffer(2)]],
                                   device const float* lse_b [[buffer(3)]],
                                   device OUT_T* out [[buffer(4)]],    // [T, H, D] contiguous
                                   device float* lse [[buffer(5)]],    // [T, H] contiguous
                                   constant MergeParams& p [[buffer(6)]],
                                   uint3 gid [[thread_position_in_grid]]) {
  const long d = gid.x, h = gid.y, t = gid.z;
  const float la = lse_a[t * p.la_stride_t + h * p.la_stride_h];
  const float lb = lse_b[t * p.lb_stride_t + h * p.lb_stride_h];
  // docs/ops.md: an lse of -inf or +inf (FlashAttention-2's mark) is a side that saw no key, not
  // read; a NaN lse makes the row NaN; a finite side is read even if its weight underflows.
  const bool a_empty = bits_neg_inf(la) || bits_pos_inf(la), b_empty = bits_neg_inf(lb) || bits_pos_inf(lb);
  const long o = (t * p.num_heads + h) * p.head_dim + d;
  if (bits_nan(la) || bits_nan(lb)) {
    out[o] = from_float<OUT_T>(quiet_nan());
    if (d == 0) lse[t * p.num_heads + h] = quiet_nan();
    return;
  }
  if (a_empty && b_empty) {
    out[o] = from_float<OUT_T>(0.0f);
    if (d == 0) lse[t * p.num_heads + h] = -INFINITY;
    return;
  }
  float wa = 0.0f, wb = 0.0f, l;
  if (a_empty) {
    wb = 1.0f;
    l = lb;
  } else if (b_empty) {
    wa = 1.0f;
    l = la;
  } else {
    const float m = max(la, lb);
    const float ea = exp(la - m), eb = exp(lb - m);
    const float s = ea + eb;
    wa = ea / s;
    wb = eb / s;
    l = m + log(s);
  }
  float acc = 0.0f;
  if (!a_empty) acc += wa * to_float(out_a[t * p.a_stride_t + h * p.a_stride_h + d * p.a_stride_d]);
  if (!b_empty) acc += wb * to_float(out_b[t * p.b_stride_t + h * p.b_stride_h + d * p.b_stride_d]);
  out[o] = from_float<OUT_T>(acc);
  if (d == 0) lse[t * p.num_heads + h] = l;
}
