// mla_decompress on the CPU: rebuild per-head K/V from the latent cache (DeepSeek-V2 MLA):
// optional RMSNorm of the latent, then k_nope = W_k(h) c, v = W_v(h) c, key = [k_nope ; k_pe].
//
// The latent rows are gathered from their pages (dequantized and normalized in float32, in parallel)
// into one contiguous [tokens, kv_lora_rank] matrix in the weight's dtype, and the products for
// every head are one GEMM through torch's matmul (oneDNN: AMX tiles for bf16 where the CPU has
// them, AVX-512 otherwise): the weight is read once per call at GEMM speed, where a per-token dot
// loop re-read it per tile of tokens. Paging costs one gather of 1-2 KB per token.
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

// Gathers token t's latent row into lat[t] (kv_lora_rank values, RMSNorm applied) and its rotary
// key into key[t, h, qk_nope:] for every head.
template <typename W, typename C>
void gather_latents(const MlaDecompressParams& p, W* lat) {
  const paged_kv_t& kv = p.kv;
  const int R = p.kv_lora_rank, P = p.rope_dim, dn = p.qk_nope_head_dim;
  std::vector<float> norm_w;
  if (p.norm_weight) {
    norm_w.resize(static_cast<size_t>(R));
    load_row(static_cast<const W*>(p.norm_weight), R, 1.0f, norm_w.data());
  }
  // Token t belongs to the sequence s with token_start[s] <= t < token_start[s + 1].
  torch::stable::parallel_for(0, p.num_tokens, 64, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(static_cast<size_t>(R + P));
    int64_t s = std::upper_bound(p.token_start, p.token_start + kv.num_seqs + 1, t0) -
                p.token_start - 1;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= p.token_start[s + 1]) ++s;
      const int64_t j = t - p.token_start[s];
      const int64_t block = kv.block_id(s, j / kv.block_size);
      load_row(static_cast<const C*>(kv.k) + kv.k_offset(block, j % kv.block_size, 0), R + P,
               kv.k_scale_of(0), row.data());
      float inv = 1.0f;
      if (p.norm_weight) {
        float ss = 0.0f;
        for (int i = 0; i < R; ++i) ss += row[i] * row[i];
        inv = 1.0f / std::sqrt(ss / static_cast<float>(R) + p.norm_eps);
      }
      W* out = lat + t * R;
      for (int i = 0; i < R; ++i) out[i] = from_float<W>(p.norm_weight ? row[i] * inv * norm_w[i] : row[i]);
      W* key = static_cast<W*>(p.key) + t * p.num_heads * (dn + P);
      for (int h = 0; h < p.num_heads; ++h)
        for (int i = 0; i < P; ++i) key[h * (dn + P) + dn + i] = from_float<W>(row[R + i]);
    }
  });
}

std::tuple<Tensor, Tensor> mla_decompress_cpu(
    const Tensor& kv_cache, const Tensor& block_tables, const Tensor& seq_lens,
    const Tensor& w_kv_b, int64_t kv_lora_rank, int64_t qk_nope_head_dim, int64_t v_head_dim,
    std::optional<Tensor> norm_weight, double norm_eps, std::optional<Tensor> scale,
    std::optional<int64_t> num_tokens) {
  const ArgCheck c("mla_decompress");
  // Indices and num_tokens are checked before the outputs are allocated.
  std::vector<int64_t> starts;
  auto count = [&](const paged_kv_t& kv, std::optional<int64_t> n) {
    starts = checked_token_starts(c, kv, n);
    return starts.back();
  };
  PreparedDecompress r = prepare_mla_decompress(c, kv_cache, block_tables, seq_lens, w_kv_b,
                                                kv_lora_rank, qk_nope_head_dim, v_head_dim,
                                                norm_weight, norm_eps, scale, num_tokens, count);
  MlaDecompressParams& p = r.params;
  p.token_start = starts.data();
  const int64_t T = p.num_tokens, H = p.num_heads, dn = p.qk_nope_head_dim, dv = p.v_head_dim;
  if (T == 0) return {r.key, r.value};
  Tensor& w = r.w_kv_b;
  Tensor lat = torch::stable::new_empty(w, {T, int64_t(p.kv_lora_rank)});
  dispatch_float_and_cache(p.w_format, p.kv.format, [&](auto wt, auto ct) {
    using W = typename decltype(wt)::type;
    gather_latents<W, typename decltype(ct)::type>(p, static_cast<W*>(lat.mutable_data_ptr()));
  });
  // [T, R] x [R, H * (dn + dv)]: every head's k_nope and v at once, then split into key and value.
  Tensor kv = torch::stable::matmul(lat, torch::stable::transpose(w, 0, 1));
  Tensor kv3 = torch::stable::view(kv, {T, H, dn + dv});
  Tensor key_nope = torch::stable::narrow(r.key, 2, 0, dn);
  torch::stable::copy_(key_nope, torch::stable::narrow(kv3, 2, 0, dn));
  torch::stable::copy_(r.value, torch::stable::narrow(kv3, 2, dn, dv));
  return {r.key, r.value};
}

}  // namespace
}  // namespace kvkernels::cpu

STABLE_TORCH_LIBRARY_IMPL(kvkernels, CPU, m) {
  m.impl("mla_decompress", TORCH_BOX(&kvkernels::cpu::mla_decompress_cpu));
}
