// mla_decompress on the CPU: rebuild per-head K/V from the latent cache (DeepSeek-V2 MLA):
// optional RMSNorm of the latent, then k_nope = W_k(h) c, v = W_v(h) c, key = [k_nope ; k_pe].
// Tokens are processed in tiles so each weight row is converted and read once per tile.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../index_checks.h"
#include "../prepare.h"
#include "convert.h"

namespace kvkernels::cpu {
namespace {

constexpr int64_t kTokenTile = 16;

template <typename W, typename C>
void decompress(const MlaDecompressParams& p) {
  const paged_kv_t& kv = p.kv;
  const int R = p.kv_lora_rank, P = p.rope_dim, dn = p.qk_nope_head_dim, dv = p.v_head_dim;
  const int per_head = dn + dv;
  const int64_t w_rows = static_cast<int64_t>(p.num_heads) * per_head;

  // The weight in float32, converted once per call.
  std::vector<float> w(static_cast<size_t>(w_rows * R));
  torch::stable::parallel_for(0, w_rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      load_row(static_cast<const W*>(p.w_kv_b) + i * R, R, 1.0f, w.data() + i * R);
  });
  std::vector<float> norm_w;
  if (p.norm_weight) {
    norm_w.resize(static_cast<size_t>(R));
    load_row(static_cast<const W*>(p.norm_weight), R, 1.0f, norm_w.data());
  }

  // Token t of the output belongs to the sequence s with token_start[s] <= t < token_start[s+1].
  const int64_t num_tiles = ceil_div(p.num_tokens, kTokenTile);
  torch::stable::parallel_for(0, num_tiles, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> rows(static_cast<size_t>(kTokenTile * (R + P)));
    for (int64_t tile = lo; tile < hi; ++tile) {
      const int64_t t0 = tile * kTokenTile, t1 = std::min(p.num_tokens, t0 + kTokenTile);
      // Gather and normalize the latent rows of the tile.
      int64_t s = std::upper_bound(p.token_start, p.token_start + kv.num_seqs + 1, t0) -
                  p.token_start - 1;
      for (int64_t t = t0; t < t1; ++t) {
        while (t >= p.token_start[s + 1]) ++s;
        const int64_t j = t - p.token_start[s];
        const int64_t block = kv.block_id(s, j / kv.block_size);
        float* row = rows.data() + (t - t0) * (R + P);
        load_row(static_cast<const C*>(kv.k) + kv.k_offset(block, j % kv.block_size, 0), R + P,
                 kv.k_scale_of(0), row);
        if (p.norm_weight) {
          float ss = 0.0f;
          for (int i = 0; i < R; ++i) ss += row[i] * row[i];
          const float inv = 1.0f / std::sqrt(ss / static_cast<float>(R) + p.norm_eps);
          for (int i = 0; i < R; ++i) row[i] = row[i] * inv * norm_w[i];
        }
      }
      W* key = static_cast<W*>(p.key);
      W* value = static_cast<W*>(p.value);
      for (int h = 0; h < p.num_heads; ++h) {
        for (int o = 0; o < per_head; ++o) {
          const float* wr = w.data() + (static_cast<int64_t>(h) * per_head + o) * R;
          for (int64_t t = t0; t < t1; ++t) {
            const float* c = rows.data() + (t - t0) * (R + P);
            float dot = 0.0f;
            for (int i = 0; i < R; ++i) dot += wr[i] * c[i];
            if (o < dn) key[(t * p.num_heads + h) * (dn + P) + o] = from_float<W>(dot);
            else value[(t * p.num_heads + h) * dv + (o - dn)] = from_float<W>(dot);
          }
        }
        for (int64_t t = t0; t < t1; ++t) {
          const float* pe = rows.data() + (t - t0) * (R + P) + R;
          W* k = key + (t * p.num_heads + h) * (dn + P) + dn;
          for (int i = 0; i < P; ++i) k[i] = from_float<W>(pe[i]);
        }
      }
    }
  });
}

std::tuple<Tensor, Tensor> mla_decompress_cpu(
    const Tensor& kv_cache, const Tensor& block_tables, const Tensor& seq_lens,
    const Tensor& w_kv_b, int64_t kv_lora_rank, int64_t qk_nope_head_dim, int64_t v_head_dim,
    std::optional<Tensor> norm_weight, double norm_eps, std::optional<Tensor> scale,
    std::optional<int64_t> num_tokens) {
  const ArgCheck c("mla_decompress");
  auto count = [&](const paged_kv_t& kv) { return checked_token_count(c, kv); };
  PreparedDecompress r = prepare_mla_decompress(c, kv_cache, block_tables, seq_lens, w_kv_b,
                                                kv_lora_rank, qk_nope_head_dim, v_head_dim,
                                                norm_weight, norm_eps, scale, num_tokens, count);
  MlaDecompressParams& p = r.params;
  const std::vector<int64_t> starts = checked_token_starts(c, p.kv, p.num_tokens);
  p.token_start = starts.data();
  dispatch_float_and_cache(p.w_format, p.kv.format, [&](auto wt, auto ct) {
    decompress<typename decltype(wt)::type, typename decltype(ct)::type>(p);
  });
  return {r.key, r.value};
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("mla_decompress", TORCH_BOX(&kvkernels::cpu::mla_decompress_cpu));
}
