// The CPU XLA FFI handlers of kvkernels.jax (kvkernels/jax/): paged_attention, reshape_and_cache,
// copy_blocks and gather_kv on the CPU kernels of csrc/cpu/ (the same sources and run-time ISA
// dispatch as the torch extension and the ONNX Runtime library; KVKERNELS_CPU_ISA forces a path),
// run on XLA's intra-op thread pool. Every check, index ranges included, runs before anything is
// written; a failed check returns an ffi::Error whose message names the argument
// ("kvkernels.<op>: <argument>: ..."), which JAX raises as a JaxRuntimeError.
//
// Cache updates are functional at the JAX level: the output caches alias the input caches
// (input_output_aliases), so XLA hands the handler one buffer for both. When it does not (a
// hand-written call without the alias), the handler copies the input into the output first.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "../cpu/attention_run.h"
#include "../cpu/block_copy.h"
#include "../cpu/rows.h"
#include "../index_checks.h"
#include "jax_args.h"

namespace kvkernels::jaxffi {
namespace {

// ---- the host of the CPU kernels: XLA's intra-op thread pool --------------------------------------

// Work shared by the calling thread and the tasks it schedules on the pool. A task that starts after
// every index has been claimed returns without touching `fn` (which lives on the caller's stack and
// is only guaranteed while the caller waits), so the caller never waits for tasks that have not
// started: no deadlock when the handler itself runs on a pool thread and the pool is busy.
struct ParallelState {
  std::atomic<int64_t> next{0};
  int64_t n = 0;
  std::atomic<int64_t> done{0};
  void (*call)(void*, int64_t) = nullptr;
  void* fn = nullptr;
  std::mutex mu;
  std::condition_variable cv;

  void work() {
    for (int64_t i = next++; i < n; i = next++) {
      call(fn, i);
      if (++done == n) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

// The pool size the last handler call saw (kvkernels_jax_cpu_threads, for the tests and benchmarks).
std::atomic<int64_t> last_pool_threads{-1};

struct XlaHost {
  ffi::ThreadPool* pool;
  int64_t pool_threads;  // 0: no pool (the work runs on the calling thread)

  // KVKERNELS_JAX_CPU_THREADS=<n> (read on every call) caps the threads a call uses, as
  // torch.set_num_threads does for the torch ops (benchmarks/jax_decode.py compares both at 1 thread).
  XlaHost(ffi::ThreadPool* p, int64_t n) : pool(p), pool_threads(n) {
    if (const char* cap = std::getenv("KVKERNELS_JAX_CPU_THREADS"); cap != nullptr && cap[0] != '\0') {
      const long v = std::strtol(cap, nullptr, 10);
      if (v >= 1) pool_threads = std::min<int64_t>(std::max<int64_t>(n, 1), v);
    }
    last_pool_threads = pool_threads;
  }

  int64_t threads() const { return std::max<int64_t>(1, pool_threads); }

  template <typename F>
  void parallel_for(int64_t n, F f) const {
    if (n <= 0) return;
    const int64_t helpers = std::min<int64_t>(n, pool_threads) - 1;
    if (helpers <= 0) {
      for (int64_t i = 0; i < n; ++i) f(i, i + 1);
      return;
    }
    auto state = std::make_shared<ParallelState>();
    state->n = n;
    state->fn = &f;
    state->call = [](void* fn, int64_t i) { (*static_cast<F*>(fn))(i, i + 1); };
    for (int64_t t = 0; t < helpers; ++t) pool->Schedule([state] { state->work(); });
    state->work();
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done.load() == n; });
  }

  float* scratch(int slot, size_t n) const { return cpu::thread_scratch(slot, n); }
};

// The output of an op that updates `in` in place: XLA aliases the two (one buffer); if it did not,
// the input is copied first so that the result is still the updated input.
void alias_or_copy(const In& in, const In& out) {
  if (out.data != in.data && bytes(in) > 0) std::memcpy(out.data, in.data, bytes(in));
}

// An int32 or int64 index operand as int64 (widened into `buf` when it is int32).
const int64_t* as_int64(const In& t, std::vector<int64_t>& buf) {
  if (t.type == ffi::DataType::S64) return t.as<const int64_t>();
  const int32_t* src = t.as<const int32_t>();
  buf.assign(src, src + t.numel());
  return buf.data();
}

// ---- paged_attention --------------------------------------------------------------------------

// Optional inputs, in this order after seq_lens; attribute `optional_mask` bit i says input i is
// passed (kvkernels/jax/ops.py builds both).

ffi::Error paged_attention_cpu(ffi::ThreadPool pool, ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                               ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                               ffi::AnyBuffer seq_lens, ffi::RemainingArgs optional,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                               float scale, float soft_cap, int64_t window_left, bool causal,
                               int64_t optional_mask, int64_t batch_dims) try {
  const Check c("paged_attention");
  const AttentionCall call(c, query, key_cache, value_cache, block_tables, seq_lens, optional, out, lse,
                           optional_mask, batch_dims);
  const AttentionAttrs attrs{scale, soft_cap, window_left, causal};
  // Every example is checked (shapes, then index ranges) before the first one runs.
  std::vector<AttentionParams> params;
  for (int64_t b = 0; b < call.batch.count; ++b) {
    const AttentionParams p = attention_example(c, call, call.batch.index(b), attrs, kMaxHeadDimCpu);
    check_paged_kv_indices(c, p.kv);
    check_query_start_loc(c, p);
    params.push_back(p);
  }
  (void)cpu::active_isa();  // a bad KVKERNELS_CPU_ISA is an error before anything is written
  const XlaHost host(&pool, pool.num_threads());
  for (const AttentionParams& p : params)
    if (p.num_tokens > 0) cpu::run_attention_on(p, host);
  return ffi::Error::Success();
} catch (const std::exception& e) {
  return to_error(e);
}

// ---- reshape_and_cache ------------------------------------------------------------------------

ffi::Error reshape_and_cache_cpu(ffi::ThreadPool pool, ffi::AnyBuffer key, ffi::AnyBuffer value,
                                 ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                 ffi::AnyBuffer slot_mapping, ffi::RemainingArgs optional,
                                 ffi::Result<ffi::AnyBuffer> key_cache_out,
                                 ffi::Result<ffi::AnyBuffer> value_cache_out,
                                 int64_t optional_mask, int64_t batch_dims) try {
  const Check c("reshape_and_cache");
  const Operand k("key", key, batch_dims), v("value", value, batch_dims),
      kc("key_cache", key_cache, batch_dims), vc("value_cache", value_cache, batch_dims),
      sm("slot_mapping", slot_mapping, batch_dims), kco("key_cache", key_cache_out, batch_dims),
      vco("value_cache", value_cache_out, batch_dims);
  Operand scales[2];
  read_optional(c, optional, optional_mask, kScaleNames, 2, batch_dims, scales);
  const Batch batch =
      c.batch({&k, &v, &kc, &vc, &sm, &kco, &vco, &scales[0], &scales[1]}, batch_dims);
  for (const Operand* out : {&kco, &vco}) check_updated_cache_batch(c, *out, batch);
  struct Example {
    CacheWriteParams w[2];
    In caches[2], outs[2];
    std::vector<int64_t> slots;
  };
  std::vector<Example> examples(static_cast<size_t>(batch.count));
  for (int64_t b = 0; b < batch.count; ++b) {
    const std::vector<int64_t> idx = batch.index(b);
    Example& ex = examples[static_cast<size_t>(b)];
    const In slots = sm.at(idx);
    ex.caches[0] = kc.at(idx);
    ex.caches[1] = vc.at(idx);
    ex.outs[0] = kco.at(idx);
    ex.outs[1] = vco.at(idx);
    cache_write_params(c, k.at(idx), v.at(idx), ex.caches[0], ex.caches[1], slots,
                       scales[0].at(idx), scales[1].at(idx), ex.w);
    for (int i = 0; i < 2; ++i) check_updated_cache(c, ex.outs[i], ex.caches[i]);
    const int64_t* s = as_int64(slots, ex.slots);
    if (ex.slots.empty()) ex.slots.assign(s, s + slots.numel());
    check_slots(c, ex.slots.data(), slots.numel(), ex.caches[0].size(0) * ex.caches[0].size(1));
  }
  const cpu::RowKernels& kernels = cpu::row_kernels();  // throws on a bad KVKERNELS_CPU_ISA
  const XlaHost host(&pool, pool.num_threads());
  for (Example& ex : examples) {
    for (int i = 0; i < 2; ++i) {
      alias_or_copy(ex.caches[i], ex.outs[i]);
      CacheWriteParams& w = ex.w[i];
      w.cache = ex.outs[i].data;
      w.slot_mapping = ex.slots.data();
      if (w.num_tokens == 0 || w.num_heads == 0 || w.width == 0) continue;
      host.parallel_for(ceil_div(w.num_tokens, 16), [&](int64_t b, int64_t e) {
        kernels.write_tokens(w, b * 16, std::min(e * 16, w.num_tokens));
      });
    }
  }
  return ffi::Error::Success();
} catch (const std::exception& e) {
  return to_error(e);
}

// ---- copy_blocks ------------------------------------------------------------------------------

ffi::Error copy_blocks_cpu(ffi::ThreadPool pool, ffi::AnyBuffer cache, ffi::AnyBuffer block_mapping,
                           ffi::Result<ffi::AnyBuffer> cache_out, int64_t block_dim,
                           int64_t batch_dims) try {
  const Check c("copy_blocks");
  const Operand ca("cache", cache, batch_dims), bm("block_mapping", block_mapping, batch_dims),
      co("cache", cache_out, batch_dims);
  const Batch batch = c.batch({&ca, &bm, &co}, batch_dims);
  check_updated_cache_batch(c, co, batch);
  struct Example {
    BlockCopyParams p;
    In in, out;
    std::vector<int64_t> mapping;
  };
  std::vector<Example> examples(static_cast<size_t>(batch.count));
  for (int64_t b = 0; b < batch.count; ++b) {
    const std::vector<int64_t> idx = batch.index(b);
    Example& ex = examples[static_cast<size_t>(b)];
    ex.in = ca.at(idx);
    ex.out = co.at(idx);
    const In mapping = bm.at(idx);
    const int64_t blocks = block_copy_params(c, ex.in, mapping, block_dim, ex.p);
    check_updated_cache(c, ex.out, ex.in);
    const int64_t* m = as_int64(mapping, ex.mapping);
    if (ex.mapping.empty()) ex.mapping.assign(m, m + mapping.numel());
    check_block_mapping(c, ex.mapping.data(), ex.p.num_pairs, blocks, blocks, true);
  }
  const XlaHost host(&pool, pool.num_threads());
  for (Example& ex : examples) {
    alias_or_copy(ex.in, ex.out);
    BlockCopyParams& p = ex.p;
    if (ex.out.numel() == 0 || p.num_pairs == 0) continue;
    p.src = static_cast<const char*>(ex.out.data);
    p.dst = static_cast<char*>(ex.out.data);
    p.mapping = ex.mapping.data();
    host.parallel_for(p.num_pairs, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        cpu::copy_block(p, p.src + p.mapping[2 * i] * p.src_block_stride, p.src_strides,
                        p.dst + p.mapping[2 * i + 1] * p.dst_block_stride, p.dst_strides);
    });
  }
  return ffi::Error::Success();
} catch (const std::exception& e) {
  return to_error(e);
}

// ---- gather_kv --------------------------------------------------------------------------------

ffi::Error gather_kv_cpu(ffi::ThreadPool pool, ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                         ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                         ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> key,
                         ffi::Result<ffi::AnyBuffer> value, int64_t optional_mask,
                         int64_t batch_dims) try {
  const Check c("gather_kv");
  const Operand kc("key_cache", key_cache, batch_dims), vc("value_cache", value_cache, batch_dims),
      bt("block_tables", block_tables, batch_dims), sl("seq_lens", seq_lens, batch_dims),
      ko("key", key, batch_dims), vo("value", value, batch_dims);
  Operand scales[2];
  read_optional(c, optional, optional_mask, kScaleNames, 2, batch_dims, scales);
  const Batch batch = c.batch({&kc, &vc, &bt, &sl, &ko, &vo, &scales[0], &scales[1]}, batch_dims);
  struct Example {
    GatherParams p;
    std::vector<int64_t> starts;
  };
  std::vector<Example> examples(static_cast<size_t>(batch.count));
  for (int64_t b = 0; b < batch.count; ++b) {
    const std::vector<int64_t> idx = batch.index(b);
    Example& ex = examples[static_cast<size_t>(b)];
    ex.p = gather_params(c, kc.at(idx), vc.at(idx), bt.at(idx), sl.at(idx), scales[0].at(idx),
                         scales[1].at(idx), ko.at(idx), vo.at(idx));
    // The outputs' length is static in JAX (num_tokens): it must be sum(seq_lens).
    ex.starts = checked_token_starts(c, ex.p.kv, ex.p.num_tokens);
    ex.p.token_start = ex.starts.data();
  }
  const cpu::RowKernels& kernels = cpu::row_kernels();
  const XlaHost host(&pool, pool.num_threads());
  for (Example& ex : examples) {
    const GatherParams& p = ex.p;
    if (p.num_tokens == 0 || p.kv.num_kv_heads == 0 || (p.kv.head_dim == 0 && p.kv.head_dim_v == 0))
      continue;
    std::vector<cpu::GatherItem> items;
    for (int64_t s = 0; s < p.kv.num_seqs; ++s)
      for (int64_t blk = 0; blk < ceil_div(p.kv.seq_lens[s], p.kv.block_size); ++blk)
        items.push_back({s, blk});
    host.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t b, int64_t e) {
      kernels.gather(p, items.data(), b, e);
    });
  }
  return ffi::Error::Success();
} catch (const std::exception& e) {
  return to_error(e);
}

}  // namespace
}  // namespace kvkernels::jaxffi

namespace jf = kvkernels::jaxffi;
namespace xffi = xla::ffi;

// The handler symbols are what kvkernels/jax/_library.py looks up (the library is built with
// -fvisibility=hidden).
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvkernels_jax_paged_attention_cpu, jf::paged_attention_cpu,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::ThreadPool>()
                                  .Arg<xffi::AnyBuffer>()  // query
                                  .Arg<xffi::AnyBuffer>()  // key_cache
                                  .Arg<xffi::AnyBuffer>()  // value_cache
                                  .Arg<xffi::AnyBuffer>()  // block_tables
                                  .Arg<xffi::AnyBuffer>()  // seq_lens
                                  .RemainingArgs()         // the optional inputs (optional_mask)
                                  .Ret<xffi::AnyBuffer>()  // out
                                  .Ret<xffi::AnyBuffer>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window_left")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("optional_mask")
                                  .Attr<int64_t>("batch_dims"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvkernels_jax_reshape_and_cache_cpu, jf::reshape_and_cache_cpu,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::ThreadPool>()
                                  .Arg<xffi::AnyBuffer>()  // key
                                  .Arg<xffi::AnyBuffer>()  // value
                                  .Arg<xffi::AnyBuffer>()  // key_cache
                                  .Arg<xffi::AnyBuffer>()  // value_cache
                                  .Arg<xffi::AnyBuffer>()  // slot_mapping
                                  .RemainingArgs()         // k_scale, v_scale (optional_mask)
                                  .Ret<xffi::AnyBuffer>()  // key_cache (aliased)
                                  .Ret<xffi::AnyBuffer>()  // value_cache (aliased)
                                  .Attr<int64_t>("optional_mask")
                                  .Attr<int64_t>("batch_dims"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvkernels_jax_copy_blocks_cpu, jf::copy_blocks_cpu,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::ThreadPool>()
                                  .Arg<xffi::AnyBuffer>()  // cache
                                  .Arg<xffi::AnyBuffer>()  // block_mapping
                                  .Ret<xffi::AnyBuffer>()  // cache (aliased)
                                  .Attr<int64_t>("block_dim")
                                  .Attr<int64_t>("batch_dims"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kvkernels_jax_gather_kv_cpu, jf::gather_kv_cpu,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::ThreadPool>()
                                  .Arg<xffi::AnyBuffer>()  // key_cache
                                  .Arg<xffi::AnyBuffer>()  // value_cache
                                  .Arg<xffi::AnyBuffer>()  // block_tables
                                  .Arg<xffi::AnyBuffer>()  // seq_lens
                                  .RemainingArgs()         // k_scale, v_scale (optional_mask)
                                  .Ret<xffi::AnyBuffer>()  // key
                                  .Ret<xffi::AnyBuffer>()  // value
                                  .Attr<int64_t>("optional_mask")
                                  .Attr<int64_t>("batch_dims"));

#pragma GCC visibility pop

// The SIMD path the CPU handlers use now (KVKERNELS_CPU_ISA or the CPU's best), for kvkernels.jax.cpu_isa().
extern "C" __attribute__((visibility("default"))) const char* kvkernels_jax_cpu_isa(char* error,
                                                                                     int size) {
  try {
    return kvkernels::cpu::isa_name(kvkernels::cpu::active_isa());
  } catch (const std::exception& e) {
    std::snprintf(error, static_cast<size_t>(size), "%s", e.what());
    return nullptr;
  }
}

// The size of XLA's intra-op thread pool as the last CPU handler call saw it (-1: no call yet; 0: no
// pool, the kernels ran on the calling thread).
extern "C" __attribute__((visibility("default"))) int64_t kvkernels_jax_cpu_threads() {
  return kvkernels::jaxffi::last_pool_threads.load();
}
