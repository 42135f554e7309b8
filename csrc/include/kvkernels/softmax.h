// The end of an online softmax, and the exact merge of two partial attention results.
//
// A partial result over a key set S is (m, d, o): m = max logit, d = sum_j exp(s_j - m),
// o = sum_j exp(s_j - m) v_j / d, and lse = m + log(d). Two disjoint sets merge exactly through
// their lse values, which is what split-K decode, cascade (shared-prefix) attention and the
// public merge_attention_states op all use.
//
// Non-finite values follow docs/ops.md ("Non-finite values"): a NaN or +inf logit makes the row
// NaN (out and lse); lse = -inf means only "no visible key". The kernels keep d = NaN once such a
// logit was seen (exp(NaN) and exp(inf - inf) are NaN), and these helpers turn the state into the
// documented result.
#pragma once

#include <cmath>

#include "kvkernels/common.h"

namespace kvkernels {

// The lse of one attention row and the factor of its unnormalized output (out = acc * *mul), from
// its online-softmax state over the visible keys: m = the largest logit, d = sum_j exp(s_j - m)
// (0 when the row saw no key or every visible logit was -inf; NaN once a NaN or +inf logit was
// seen); has_keys = the row has at least one visible key; sink = the sink logit, -inf for none.
// It evaluates m' = max(m, sink), lse = m' + log(d exp(m - m') + exp(sink - m')), so that:
//   no visible key, no sink        -> lse -inf, *mul 0 (out = 0)
//   visible keys, all logits -inf  -> NaN (0 / 0), unless a finite sink takes the whole weight
//   NaN / +inf logit, NaN / +inf sink -> NaN
// Log2 = true: logits and results in log2 units (the CUDA kernels), else natural log.
template <bool Log2 = false>
KVK_HOST_DEVICE float finish_row(float m, float d, bool has_keys, float sink, float* mul) {
  auto ex = [](float x) { return Log2 ? exp2f(x) : expf(x); };
  auto lg = [](float x) { return Log2 ? log2f(x) : logf(x); };
  const bool with_sink = !(sink == -INFINITY);  // a NaN sink counts (and makes the row NaN)
  float top = m;
  if (with_sink) top = (sink != sink || m != m) ? NAN : fmaxf(m, sink);
  if (top == -INFINITY) {  // no sink; d is 0 (no key, or every logit -inf) or NaN
    if (has_keys || d != 0.0f) {
      *mul = NAN;
      return NAN;
    }
    *mul = 0.0f;
    return -INFINITY;
  }
  const float fix = d == 0.0f ? 0.0f : ex(m - top);  // weight of the keys' part (1 without a sink)
  const float denom = d * fix + (with_sink ? ex(sink - top) : 0.0f);
  *mul = fix / denom;
  return top + lg(denom);
}

// An lse of either sign of infinity marks a side that saw no key (-inf: this library, FlashAttention
// 3; +inf: FlashAttention-2's non-split kernels, which vLLM's merge also reads as empty): that
// side's output is not read.
KVK_HOST_DEVICE bool lse_empty(float lse) { return lse == INFINITY || lse == -INFINITY; }

// Weights (w_a, w_b) of two partial outputs whose lse are lse_a, lse_b, and the merged lse
// (merge_attention_states). An empty side (lse_empty) gets weight 0 and must not be read (callers
// skip it by lse_empty, not by its weight: a finite-lse side whose weight underflows to 0 is still
// read, so a NaN in its output is not lost). Both empty: weights 0, lse -inf, merged output 0. A
// NaN lse on either side: both weights and the merged lse are NaN (the merged output is NaN).
KVK_HOST_DEVICE float merge_weights(float lse_a, float lse_b, float* w_a, float* w_b) {
  if (lse_a != lse_a || lse_b != lse_b) {
    *w_a = *w_b = NAN;
    return NAN;
  }
  const float a = lse_empty(lse_a) ? -INFINITY : lse_a;
  const float b = lse_empty(lse_b) ? -INFINITY : lse_b;
  const float m = fmaxf(a, b);
  if (m == -INFINITY) {
    *w_a = 0.0f;
    *w_b = 0.0f;
    return -INFINITY;
  }
  const float ea = expf(a - m);
  const float eb = expf(b - m);
  const float sum = ea + eb;
  *w_a = ea / sum;
  *w_b = eb / sum;
  return m + logf(sum);
}

}  // namespace kvkernels
