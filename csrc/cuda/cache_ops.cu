// Launchers of the CUDA cache-op kernels (declared in cache_ops.h): pick the element types and the
// vector width, size the grid, enqueue on the caller's stream. No torch, no allocation, no sync.
#include <algorithm>
#include <climits>

#include "block_copy.cuh"
#include "cache_ops.h"
#include "cache_write.cuh"
#include "common.cuh"
#include "gather.cuh"
#include "merge.cuh"

namespace kvkernels::cuda {
namespace {

constexpr int64_t kMaxIndex = INT32_MAX;  // kernels divide 32-bit indices (FastDiv)

Status launched() { return Status{cudaGetLastError(), nullptr}; }
Status too_large(const char* what) { return Status{cudaSuccess, what}; }

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Elements per vector access: 16 bytes of the wider of the two element types, if every value
// (element counts: widths, strides, offsets) is a multiple of it and both base pointers are
// aligned to the access; else 1. (Two variants per type pair keep compile time and binary small.)
template <typename A, typename B>
int vector_width(std::initializer_list<int64_t> element_counts, std::initializer_list<const void*> a_ptrs,
                 std::initializer_list<const void*> b_ptrs) {
  constexpr int n = 16 / int(std::max(sizeof(A), sizeof(B)));
  for (int64_t v : element_counts)
    if (v % n != 0) return 1;
  for (const void* p : a_ptrs)
    if (!aligned(p, n * sizeof(A))) return 1;
  for (const void* p : b_ptrs)
    if (!aligned(p, n * sizeof(B))) return 1;
  return n;
}

// ---- reshape_and_cache / concat_and_cache_mla ------------------------------------------------

template <typename S, typename C, int N>
Status launch_cache_write(CacheWriteLaunch l, int num_writes, cudaStream_t stream) {
  int64_t max_vecs = 1;
  for (int k = 0; k < num_writes; ++k) {
    const CacheWriteParams& w = l.w[k];
    const int64_t per_head = w.width / N;
    l.vecs_per_head[k] = FastDiv(static_cast<uint32_t>(per_head));
    l.vecs_per_token[k] = FastDiv(static_cast<uint32_t>(per_head * w.num_heads));
    max_vecs = std::max<int64_t>(max_vecs, per_head * w.num_heads);
  }
  if (max_vecs > kMaxIndex - kThreads) return too_large("a token row is too wide for the CUDA kernel");
  const int64_t total = l.w[0].num_tokens;
  // Tokens per launch: every thread's vector index (grid rounded up to whole CTAs) < 2^31.
  const int64_t chunk = (kMaxIndex - kThreads) / max_vecs;
  for (int64_t begin = 0; begin < total; begin += chunk) {
    l.token_begin = begin;
    l.num_tokens = std::min(chunk, total - begin);
    const dim3 grid(blocks_for(l.num_tokens * max_vecs, kThreads), num_writes);
    cache_write_kernel<S, C, N><<<grid, kThreads, 0, stream>>>(l);
    const Status s = launched();
    if (!s.ok()) return s;
  }
  return Status{};
}

}  // namespace

Status cache_write(const CacheWriteParams* writes, int num_writes, int64_t num_slots,
                   cudaStream_t stream) {
  if (num_writes < 1 || num_writes > kMaxWrites) return too_large("cache_write: 1 or 2 writes");
  if (writes[0].num_tokens == 0) return Status{};
  if (num_slots > kMaxIndex) return too_large("the CUDA kernels index at most 2^31 - 1 cache slots");
  CacheWriteLaunch l;
  for (int k = 0; k < num_writes; ++k) {
    l.w[k] = writes[k];
    if (writes[k].num_heads == 0 || writes[k].width == 0) return Status{};  // nothing to move
  }
  l.block_size = FastDiv(static_cast<uint32_t>(writes[0].block_size));
  l.num_slots = num_slots;
  return dispatch_float_and_cache(writes[0].src_format, writes[0].cache_format, [&](auto st, auto ct) {
    using S = typename decltype(st)::type;
    using C = typename decltype(ct)::type;
    bool vec = true;
    for (int k = 0; k < num_writes; ++k) {
      const CacheWriteParams& w = writes[k];
      vec = vec && vector_width<S, C>({w.width, w.src_stride_token, w.src_stride_head, w.col_offset,
                                       w.cache_stride_block, w.cache_stride_slot, w.cache_stride_head},
                                      {w.src}, {w.cache}) > 1;
    }
    constexpr int kN = 16 / int(std::max(sizeof(S), sizeof(C)));
    return vec ? launch_cache_write<S, C, kN>(l, num_writes, stream)
               : launch_cache_write<S, C, 1>(l, num_writes, stream);
  });
}

// ---- gather_kv -------------------------------------------------------------------------------

namespace {

template <typename C, typename O, int N>
Status launch_gather(GatherLaunch g, cudaStream_t stream) {
  const int64_t per_head = g.p.kv.head_dim / N;
  const int64_t per_token = per_head * g.p.kv.num_kv_heads;
  if (per_token > kMaxIndex / kMaxTileTokens) return too_large("a token row is too wide for the CUDA kernel");
  g.vecs_per_head = FastDiv(static_cast<uint32_t>(per_head));
  g.vecs_per_token = FastDiv(static_cast<uint32_t>(per_token));
  // About 4 accesses per thread per side: enough bytes in flight without starving small batches.
  g.tile_tokens = static_cast<int>(std::clamp<int64_t>(4 * kThreads / per_token, 1, kMaxTileTokens));
  g.token_begin = 0;
  g.num_tokens = g.p.num_tokens;
  const int64_t tiles = ceil_div(g.num_tokens, g.tile_tokens);
  if (tiles > kMaxIndex) return too_large("too many tokens for one gather_kv launch");
  gather_kernel<C, O, N><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(g);
  return launched();
}

}  // namespace

namespace {

// One gather launch over p's K and V, both head_dim wide (a null output is skipped).
Status gather_same_width(const GatherParams& p, const GatherLaunch& g, cudaStream_t stream) {
  if (p.kv.head_dim == 0) return Status{};
  return dispatch_cache(p.kv.format, [&](auto ct) {
    return dispatch_float(p.out_format, [&](auto ot) {
      using C = typename decltype(ct)::type;
      using O = typename decltype(ot)::type;
      const paged_kv_t& kv = p.kv;
      const bool vec = vector_width<C, O>({kv.head_dim, kv.k_stride_block, kv.k_stride_slot, kv.k_stride_head,
                                           kv.v_stride_block, kv.v_stride_slot, kv.v_stride_head},
                                          {kv.k, kv.v}, {p.key, p.value}) > 1;
      constexpr int kN = 16 / int(std::max(sizeof(C), sizeof(O)));
      return vec ? launch_gather<C, O, kN>(g, stream) : launch_gather<C, O, 1>(g, stream);
    });
  });
}

}  // namespace

Status gather_kv(const GatherParams& p, int64_t* token_start_scratch, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.kv.num_kv_heads == 0) return Status{};
  GatherLaunch g;
  g.p = p;
  g.p.token_start = token_start_scratch;
  if (p.kv.num_seqs > 0) {
    token_starts_kernel<<<1, kScanThreads, 0, stream>>>(p.kv.seq_lens, p.kv.num_seqs, token_start_scratch);
    const Status s = launched();
    if (!s.ok()) return s;
  }
  if (p.kv.head_dim_v == p.kv.head_dim) return gather_same_width(g.p, g, stream);
  // K and V of different head dims: one launch each, the other output null. The V launch sees
  // the value cache as its "K" side too (head_dim := head_dim_v), so every width it derives is V's.
  GatherLaunch gk = g, gv = g;
  gk.p.value = nullptr;
  gv.p.key = nullptr;
  gv.p.kv.head_dim = p.kv.head_dim_v;
  gv.p.kv.k = p.kv.v;
  gv.p.kv.k_stride_block = p.kv.v_stride_block;
  gv.p.kv.k_stride_slot = p.kv.v_stride_slot;
  gv.p.kv.k_stride_head = p.kv.v_stride_head;
  gk.p.kv.v = p.kv.k;
  gk.p.kv.v_stride_block = p.kv.k_stride_block;
  gk.p.kv.v_stride_slot = p.kv.k_stride_slot;
  gk.p.kv.v_stride_head = p.kv.k_stride_head;
  const Status s = gather_same_width(gk.p, gk, stream);
  if (!s.ok()) return s;
  return gather_same_width(gv.p, gv, stream);
}

// ---- merge_attention_states ------------------------------------------------------------------

namespace {

template <typename T, int N>
Status launch_merge(MergeLaunch m, cudaStream_t stream) {
  const int64_t per_row = m.p.head_dim / N;
  m.vecs_per_row = FastDiv(static_cast<uint32_t>(per_row));
  m.num_heads = FastDiv(static_cast<uint32_t>(m.p.num_heads));
  const int64_t rows = m.p.num_tokens * m.p.num_heads;
  if (rows > kMaxIndex || per_row > kMaxIndex) return too_large("too many rows for the CUDA merge kernel");
  const int64_t chunk = (kMaxIndex - kThreads) / per_row;  // rows per launch: vector index < 2^31
  for (int64_t begin = 0; begin < rows; begin += chunk) {
    m.row_begin = begin;
    m.num_rows = std::min(chunk, rows - begin);
    merge_kernel<T, N><<<blocks_for(m.num_rows * per_row, kThreads), kThreads, 0, stream>>>(m);
    const Status s = launched();
    if (!s.ok()) return s;
  }
  return Status{};
}

}  // namespace

Status merge_attention_states(const MergeParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_heads == 0 || p.head_dim == 0) return Status{};
  MergeLaunch m;
  m.p = p;
  return dispatch_float(p.format, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = vector_width<T, T>({p.head_dim, p.a_stride_token, p.a_stride_head, p.b_stride_token,
                                         p.b_stride_head},
                                        {p.out_a, p.out_b, p.out}, {}) > 1;
    constexpr int kN = 16 / int(sizeof(T));
    return vec ? launch_merge<T, kN>(m, stream) : launch_merge<T, 1>(m, stream);
  });
}

// ---- copy_blocks / swap_blocks ---------------------------------------------------------------

namespace {

// The canonical form of a block (see block_copy.cuh). Returns false when a block has no bytes.
bool make_plan(const BlockCopyParams& p, BlockCopyPlan* plan) {
  struct Dim {
    int64_t size, src, dst;
  };
  Dim dims[kMaxCopyDims];
  int n = 0;
  for (int d = 0; d < p.num_dims; ++d) {
    if (p.sizes[d] == 0) return false;
    if (p.sizes[d] != 1) dims[n++] = {p.sizes[d], p.src_strides[d], p.dst_strides[d]};
  }
  if (p.run_bytes == 0) return false;
  // Visiting the elements in any order copies the same bytes: order the outer dims by decreasing
  // source stride, so dims that are contiguous in memory end up next to each other.
  std::stable_sort(dims, dims + n, [](const Dim& a, const Dim& b) { return a.src > b.src; });
  int64_t run = p.run_bytes;
  while (n > 0 && dims[n - 1].src == run && dims[n - 1].dst == run) run *= dims[--n].size;
  int m = 0;
  for (int i = 0; i < n; ++i) {
    Dim& outer = dims[m > 0 ? m - 1 : 0];
    if (m > 0 && outer.src == dims[i].size * dims[i].src && outer.dst == dims[i].size * dims[i].dst) {
      outer = {outer.size * dims[i].size, dims[i].src, dims[i].dst};
    } else {
      dims[m++] = dims[i];
    }
  }
  *plan = BlockCopyPlan{};
  plan->src = p.src;
  plan->dst = p.dst;
  plan->mapping = p.mapping;
  plan->num_pairs = p.num_pairs;
  plan->src_block_stride = p.src_block_stride;
  plan->dst_block_stride = p.dst_block_stride;
  plan->num_dims = m;
  for (int d = 0; d < m; ++d) {
    plan->sizes[d] = dims[d].size;
    plan->src_strides[d] = dims[d].src;
    plan->dst_strides[d] = dims[d].dst;
  }
  plan->run_bytes = run;
  return true;
}

int64_t plan_rows(const BlockCopyPlan& plan) {
  int64_t rows = 1;
  for (int d = 0; d < plan.num_dims; ++d) rows *= plan.sizes[d];
  return rows;
}

// Strides of a block packed densely in the plan's dim order (a staging buffer's layout).
void packed_strides(const BlockCopyPlan& plan, int64_t* strides) {
  int64_t s = plan.run_bytes;
  for (int d = plan.num_dims - 1; d >= 0; --d) {
    strides[d] = s;
    s *= plan.sizes[d];
  }
}

template <int V>
Status launch_copy(const BlockCopyLaunch& l, cudaStream_t stream) {
  const int64_t items = l.plan.num_pairs * l.tiles_per_block;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(items, kMaxIndex));
  block_copy_kernel<V><<<grid, kThreads, 0, stream>>>(l);
  return launched();
}

Status run_plan(const BlockCopyPlan& plan, cudaStream_t stream) {
  BlockCopyLaunch l;
  l.plan = plan;
  int64_t values[4 + 2 * kMaxCopyDims] = {static_cast<int64_t>(reinterpret_cast<uintptr_t>(plan.src)),
                                          static_cast<int64_t>(reinterpret_cast<uintptr_t>(plan.dst)),
                                          plan.src_block_stride, plan.dst_block_stride};
  int count = 4;
  for (int d = 0; d < plan.num_dims; ++d) {
    values[count++] = plan.src_strides[d];
    values[count++] = plan.dst_strides[d];
  }
  int v = common_alignment(values, count, 16);
  while (plan.run_bytes % v != 0) v /= 2;
  const int64_t run_accesses = plan.run_bytes / v;
  const int64_t rows = plan_rows(plan);
  if (run_accesses > kMaxIndex || rows > kMaxIndex / run_accesses)
    return too_large("a block sub-tensor is too large for the CUDA copy kernel (2^31 accesses)");
  for (int d = 0; d < plan.num_dims; ++d) l.sizes[d] = FastDiv(static_cast<uint32_t>(plan.sizes[d]));
  l.run_accesses = FastDiv(static_cast<uint32_t>(run_accesses));
  l.block_accesses = static_cast<uint32_t>(rows * run_accesses);
  l.tiles_per_block = static_cast<uint32_t>(ceil_div(l.block_accesses, kCopyTileAccesses));
  switch (v) {
    case 16: return launch_copy<16>(l, stream);
    case 8: return launch_copy<8>(l, stream);
    case 4: return launch_copy<4>(l, stream);
    case 2: return launch_copy<2>(l, stream);
    default: return launch_copy<1>(l, stream);
  }
}

}  // namespace

int64_t block_copy_block_bytes(const BlockCopyParams& p) {
  int64_t bytes = p.run_bytes;
  for (int d = 0; d < p.num_dims; ++d) bytes *= p.sizes[d];
  return bytes;
}

Status block_copy(const BlockCopyParams& p, int64_t src_num_blocks, int64_t dst_num_blocks,
                  cudaStream_t stream) {
  BlockCopyPlan plan;
  if (p.num_pairs == 0 || !make_plan(p, &plan)) return Status{};
  plan.src_num_blocks = src_num_blocks;
  plan.dst_num_blocks = dst_num_blocks;
  return run_plan(plan, stream);
}

Status block_copy_staged(const BlockCopyParams& p, int64_t src_num_blocks, int64_t dst_num_blocks,
                         char* staging, cudaStream_t stream) {
  BlockCopyPlan plan;
  if (p.num_pairs == 0 || !make_plan(p, &plan)) return Status{};
  plan.src_num_blocks = src_num_blocks;
  plan.dst_num_blocks = dst_num_blocks;
  int64_t packed[kMaxCopyDims];
  packed_strides(plan, packed);
  const int64_t block_bytes = plan.run_bytes * plan_rows(plan);

  // Gather: source block of pair i -> staging slot i. A pair whose destination is out of range is
  // staged anyway and dropped by the scatter, which checks it.
  BlockCopyPlan gather = plan;
  gather.dst = staging;
  gather.dst_id_is_pair = true;
  gather.dst_block_stride = block_bytes;
  gather.dst_num_blocks = plan.num_pairs;
  std::copy(packed, packed + plan.num_dims, gather.dst_strides);
  Status s = run_plan(gather, stream);
  if (!s.ok()) return s;

  // Scatter: staging slot i -> destination block of pair i (same stream: runs after the gather).
  BlockCopyPlan scatter = plan;
  scatter.src = staging;
  scatter.src_id_is_pair = true;
  scatter.src_block_stride = block_bytes;
  scatter.src_num_blocks = plan.num_pairs;
  std::copy(packed, packed + plan.num_dims, scatter.src_strides);
  return run_plan(scatter, stream);
}

Status block_copy_memcpy(const BlockCopyParams& p, cudaMemcpyKind kind, cudaStream_t stream) {
  BlockCopyPlan plan;
  if (p.num_pairs == 0 || !make_plan(p, &plan)) return Status{};
  int device = 0, max_pitch = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, device);
  if (e != cudaSuccess) return Status{e, nullptr};

  const int64_t* map = p.mapping;  // host memory
  const int64_t run = plan.run_bytes;
  auto copy = [&](const char* src, char* dst, int64_t bytes) {
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, stream);
  };
  if (plan.num_dims == 0) {
    // Whole blocks are single runs: pairs with consecutive source and destination ids in tensors
    // whose blocks are back to back become one copy.
    const bool packed = plan.src_block_stride == run && plan.dst_block_stride == run;
    for (int64_t i = 0; i < p.num_pairs;) {
      int64_t n = 1;
      while (packed && i + n < p.num_pairs && map[2 * (i + n)] == map[2 * i] + n &&
             map[2 * (i + n) + 1] == map[2 * i + 1] + n)
        ++n;
      e = copy(plan.src + map[2 * i] * plan.src_block_stride, plan.dst + map[2 * i + 1] * plan.dst_block_stride,
               n * run);
      if (e != cudaSuccess) return Status{e, nullptr};
      i += n;
    }
    return Status{};
  }
  // The innermost outer dim as one 2D copy (rows of `run` bytes at the two pitches) when the
  // pitches allow it; the other outer dims in a loop.
  const int inner = plan.num_dims - 1;
  const int64_t height = plan.sizes[inner], sp = plan.src_strides[inner], dp = plan.dst_strides[inner];
  const bool two_d = sp >= run && dp >= run && sp <= max_pitch && dp <= max_pitch;
  int64_t outer_rows = 1;
  for (int d = 0; d < inner; ++d) outer_rows *= plan.sizes[d];
  for (int64_t i = 0; i < p.num_pairs; ++i) {
    const char* src_block = plan.src + map[2 * i] * plan.src_block_stride;
    char* dst_block = plan.dst + map[2 * i + 1] * plan.dst_block_stride;
    int64_t idx[kMaxCopyDims] = {};
    for (int64_t r = 0; r < outer_rows; ++r) {
      int64_t so = 0, dof = 0;
      for (int d = 0; d < inner; ++d) {
        so += idx[d] * plan.src_strides[d];
        dof += idx[d] * plan.dst_strides[d];
      }
      if (two_d) {
        e = cudaMemcpy2DAsync(dst_block + dof, static_cast<size_t>(dp), src_block + so, static_cast<size_t>(sp),
                              static_cast<size_t>(run), static_cast<size_t>(height), kind, stream);
      } else {
        for (int64_t h = 0; h < height && e == cudaSuccess; ++h)
          e = copy(src_block + so + h * sp, dst_block + dof + h * dp, run);
      }
      if (e != cudaSuccess) return Status{e, nullptr};
      for (int d = inner - 1; d >= 0 && ++idx[d] == plan.sizes[d]; --d) idx[d] = 0;
    }
  }
  return Status{};
}

}  // namespace kvkernels::cuda
