// Paged attention on the CPU: decode, varlen (chunked prefill) and the absorbed MLA decode, which
// is the same computation over a single latent "kv head" whose value is a prefix of the key row.
// Also merge_attention_states. Correctness first: SIMD and the split-K schedule come later
// (DESIGN.md §5); this file fixes the math every faster path is tested against.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../index_checks.h"
#include "../prepare.h"
#include "convert.h"
#include "kvkernels/softmax.h"

namespace kvkernels::cpu {
namespace {

// Queries of one sequence handled together, so a key row is loaded once for all of them.
constexpr int64_t kQueryTile = 16;

// One unit of parallel work: query rows [q0, q1) of sequence `seq` against kv head `kv_head`.
struct WorkItem {
  int64_t seq, q0, q1;
  int kv_head;
};

std::vector<WorkItem> make_work(const AttentionParams& p) {
  std::vector<WorkItem> work;
  for (int64_t s = 0; s < p.kv.num_seqs; ++s) {
    const int64_t n = p.q_len(s);
    for (int64_t q0 = 0; q0 < n; q0 += kQueryTile)
      for (int g = 0; g < p.kv.num_kv_heads; ++g)
        work.push_back({s, q0, std::min(n, q0 + kQueryTile), g});
  }
  return work;
}

// Logit transform in the contract's order: scale, soft cap, ALiBi (the mask is applied by the
// caller, which only visits visible keys).
inline float logit(const AttentionParams& p, float dot, int head, int64_t key_pos, int64_t pos) {
  float s = dot * p.scale;
  if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
  if (p.alibi_slopes) s += p.alibi_slopes[head] * static_cast<float>(key_pos - pos);
  return s;
}

template <typename Q, typename C>
void attend(const AttentionParams& p, const WorkItem& w, std::vector<float>& buf) {
  const paged_kv_t& kv = p.kv;
  const int group = p.num_heads / kv.num_kv_heads;
  const int D = kv.head_dim, Dv = kv.head_dim_v;
  const int64_t seq_len = kv.seq_lens[w.seq];
  const int64_t first_pos = seq_len - p.q_len(w.seq);  // position of the sequence's query 0
  const int64_t rows = (w.q1 - w.q0) * group;

  buf.assign(static_cast<size_t>(rows * (D + Dv) + D + Dv), 0.0f);
  float* q = buf.data();          // [rows, D]
  float* acc = q + rows * D;      // [rows, Dv]
  float* k = acc + rows * Dv;     // [D]
  float* v = k + D;               // [Dv]
  std::vector<softmax_state_t> state(static_cast<size_t>(rows));

  const Q* q_base = static_cast<const Q*>(p.q);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = p.q_begin(w.seq) + w.q0 + r / group;
    const int head = w.kv_head * group + static_cast<int>(r % group);
    load_row(q_base + token * p.q_stride_token + head * p.q_stride_head, D, 1.0f, q + r * D);
  }

  // Keys visible to at least one row of the tile.
  const int64_t hi = first_pos + w.q1 - 1;
  const int64_t lo = p.window_left >= 0
                         ? std::max<int64_t>(0, first_pos + w.q0 - p.window_left)
                         : 0;
  const C* k_base = static_cast<const C*>(kv.k);
  const C* v_base = static_cast<const C*>(kv.v);
  const float k_scale = kv.k_scale_of(w.kv_head), v_scale = kv.v_scale_of(w.kv_head);
  for (int64_t j = lo; j <= hi; ++j) {
    const int64_t block = kv.block_id(w.seq, j / kv.block_size), slot = j % kv.block_size;
    load_row(k_base + kv.k_offset(block, slot, w.kv_head), D, k_scale, k);
    load_row(v_base + kv.v_offset(block, slot, w.kv_head), Dv, v_scale, v);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + w.q0 + r / group;
      if (j > pos || (p.window_left >= 0 && j < pos - p.window_left)) continue;
      float dot = 0.0f;
      const float* qr = q + r * D;
      for (int i = 0; i < D; ++i) dot += qr[i] * k[i];
      const int head = w.kv_head * group + static_cast<int>(r % group);
      float weight;
      const float rescale = state[r].add(logit(p, dot, head, j, pos), &weight);
      float* a = acc + r * Dv;
      for (int i = 0; i < Dv; ++i) a[i] = a[i] * rescale + weight * v[i];
    }
  }

  Q* out = static_cast<Q*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = p.q_begin(w.seq) + w.q0 + r / group;
    const int head = w.kv_head * group + static_cast<int>(r % group);
    // The sink is one more logit in the denominator that carries no value: rescale the running
    // state to the common max of (m, sink).
    const softmax_state_t& st = state[r];
    float denom = st.d, lse = st.lse(), fix = 1.0f;
    if (p.sinks && p.sinks[head] > -INFINITY) {  // a -inf sink is no sink
      const float sink = p.sinks[head];
      const float mx = std::max(st.m, sink);
      fix = st.d > 0.0f ? std::exp(st.m - mx) : 0.0f;
      denom = st.d * fix + std::exp(sink - mx);
      lse = mx + std::log(denom);
    }
    const float inv = denom > 0.0f ? fix / denom : 0.0f;
    Q* o = out + (token * p.num_heads + head) * Dv;
    for (int i = 0; i < Dv; ++i) o[i] = from_float<Q>(acc[r * Dv + i] * inv);
    p.lse[token * p.num_heads + head] = lse;
  }
}

void run_attention(const ArgCheck& c, const AttentionParams& p) {
  check_paged_kv_indices(c, p.kv);
  check_query_start_loc(c, p);
  const std::vector<WorkItem> work = make_work(p);
  dispatch_float_and_cache(p.q_format, p.kv.format, [&](auto qt, auto ct) {
    using Q = typename decltype(qt)::type;
    using C = typename decltype(ct)::type;
    torch::stable::parallel_for(0, static_cast<int64_t>(work.size()), 1,
                                [&](int64_t begin, int64_t end) {
                                  std::vector<float> buf;
                                  for (int64_t i = begin; i < end; ++i) attend<Q, C>(p, work[i], buf);
                                });
  });
}

std::tuple<Tensor, Tensor> paged_attention_cpu(
    const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables, const Tensor& seq_lens, std::optional<Tensor> query_start_loc,
    std::optional<double> scale, int64_t window_left, double soft_cap,
    std::optional<Tensor> alibi_slopes, std::optional<Tensor> sinks, std::optional<Tensor> k_scale,
    std::optional<Tensor> v_scale) {
  const ArgCheck c("paged_attention");
  PreparedAttention r = prepare_paged_attention(c, query, key_cache, value_cache, block_tables,
                                                seq_lens, query_start_loc, scale, window_left,
                                                soft_cap, alibi_slopes, sinks, k_scale, v_scale);
  run_attention(c, r.params);
  return {r.out, r.lse};
}

std::tuple<Tensor, Tensor> mla_paged_attention_cpu(const Tensor& q, const Tensor& kv_cache,
                                                   const Tensor& block_tables,
                                                   const Tensor& seq_lens, int64_t kv_lora_rank,
                                                   double scale,
                                                   std::optional<Tensor> query_start_loc,
                                                   std::optional<Tensor> kv_scale) {
  const ArgCheck c("mla_paged_attention");
  PreparedAttention r = prepare_mla_attention(c, q, kv_cache, block_tables, seq_lens, kv_lora_rank,
                                              scale, query_start_loc, kv_scale);
  run_attention(c, r.params);
  return {r.out, r.lse};
}

template <typename T>
void merge(const MergeParams& p) {
  const int64_t rows = p.num_tokens * p.num_heads;
  torch::stable::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / p.num_heads, h = r % p.num_heads;
      float wa, wb;
      p.lse[r] = merge_weights(p.lse_a[t * p.lse_a_stride_token + h * p.lse_a_stride_head],
                               p.lse_b[t * p.lse_b_stride_token + h * p.lse_b_stride_head], &wa,
                               &wb);
      const T* a = static_cast<const T*>(p.out_a) + t * p.a_stride_token + h * p.a_stride_head;
      const T* b = static_cast<const T*>(p.out_b) + t * p.b_stride_token + h * p.b_stride_head;
      T* o = static_cast<T*>(p.out) + r * p.head_dim;
      for (int i = 0; i < p.head_dim; ++i) {
        // A zero weight must not let an inf/NaN of the other state leak in (0 * inf = NaN).
        const float xa = wa != 0.0f ? wa * to_float(a[i]) : 0.0f;
        const float xb = wb != 0.0f ? wb * to_float(b[i]) : 0.0f;
        o[i] = from_float<T>(xa + xb);
      }
    }
  });
}

std::tuple<Tensor, Tensor> merge_attention_states_cpu(const Tensor& out_a, const Tensor& lse_a,
                                                      const Tensor& out_b, const Tensor& lse_b) {
  const ArgCheck c("merge_attention_states");
  PreparedMerge r = prepare_merge(c, out_a, lse_a, out_b, lse_b);
  dispatch_float(r.params.format, [&](auto tag) { merge<typename decltype(tag)::type>(r.params); });
  return {r.out, r.lse};
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("paged_attention", TORCH_BOX(&kvkernels::cpu::paged_attention_cpu));
  m.impl("mla_paged_attention", TORCH_BOX(&kvkernels::cpu::mla_paged_attention_cpu));
  m.impl("merge_attention_states", TORCH_BOX(&kvkernels::cpu::merge_attention_states_cpu));
}
