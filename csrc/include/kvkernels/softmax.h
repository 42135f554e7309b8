// Online-softmax state and the exact merge of two partial attention results.
//
// A partial result over a key set S is (m, d, o): m = max logit, d = sum_j exp(s_j - m),
// o = sum_j exp(s_j - m) v_j / d, and lse = m + log(d). Two disjoint sets merge exactly through
// their lse values, which is what split-K decode, cascade (shared-prefix) attention and the
// public merge_attention_states op all use.
#pragma once

#include <cmath>

#include "kvkernels/common.h"

namespace kvkernels {

struct softmax_state_t {
  float m = -INFINITY;  // running max logit
  float d = 0.0f;       // running denominator, relative to m

  // Adds one logit; returns the factor that rescales the accumulated output (exp(m_old - m_new))
  // and writes the weight of the new value to *p.
  KVK_HOST_DEVICE float add(float s, float* p) {
    if (s == -INFINITY) {  // masked key: contributes nothing (and must not turn m into NaN)
      *p = 0.0f;
      return 1.0f;
    }
    const float m_new = fmaxf(m, s);
    const float rescale = expf(m - m_new);  // m == -inf gives 0
    *p = expf(s - m_new);
    d = d * rescale + *p;
    m = m_new;
    return rescale;
  }

  // log of the denominator; -inf when no key was visible.
  KVK_HOST_DEVICE float lse() const { return d > 0.0f ? m + logf(d) : -INFINITY; }
};

// Weights (w_a, w_b) of two partial outputs whose lse are lse_a, lse_b, and the merged lse.
// Both -inf (neither set saw a key): weights 0, lse -inf, so the merged output is 0, not NaN.
KVK_HOST_DEVICE float merge_weights(float lse_a, float lse_b, float* w_a, float* w_b) {
  const float m = fmaxf(lse_a, lse_b);
  if (m == -INFINITY) {
    *w_a = 0.0f;
    *w_b = 0.0f;
    return -INFINITY;
  }
  const float ea = expf(lse_a - m);
  const float eb = expf(lse_b - m);
  const float sum = ea + eb;
  *w_a = ea / sum;
  *w_b = eb / sum;
  return m + logf(sum);
}

}  // namespace kvkernels
