// The row kernels of rows.h, written once against Vec (vec_<isa>.h) and RowIo (row_io_<isa>.h)
// and compiled once per ISA: rows_<isa>.cpp defines KVK_ISA (the namespace of its Vec), opens its
// target region and includes this file, so every symbol here is distinct per ISA.
//
// Each op is a loop over rows and one conversion per row: full vectors, then one partial vector
// for a width that is not a multiple of Vec::N. Rows that need no conversion (same dtype, not
// fp8) are memcpy'd. When every head of a token (cache write) or every slot and head of a paged
// block (gather) is one contiguous run in both tensors and one scale covers it, the run is
// converted as a single row, so small head dims still stream whole vectors.
//
// Requires (included before the target region): <algorithm>, <cstring>, convert.h, rows.h,
// kvkernels/softmax.h.

namespace kvkernels::cpu::KVK_ISA {

constexpr int kN = Vec::N;

// src (float formats) -> cache row; fp8 caches store quantize(x / scale).
// Empty rows return first: an empty tensor's data pointer may be null, and memcpy with a null
// pointer is undefined even for 0 bytes.
template <typename S, typename C>
inline void write_row(const S* src, C* dst, int64_t n, float scale) {
  if (n <= 0) return;
  if constexpr (std::is_same_v<S, C>) {
    std::memcpy(static_cast<void*>(dst), src, sizeof(S) * size_t(n));
  } else if constexpr (is_fp8_type<C>) {
    const Vec s = Vec::set1(scale);
    int64_t i = 0;
    for (; i + kN <= n; i += kN) RowIo::quantize(dst + i, RowIo::load(src + i), s);
    if (i < n) RowIo::quantize(dst + i, RowIo::load(src + i, int(n - i)), s, int(n - i));
  } else {
    int64_t i = 0;
    for (; i + kN <= n; i += kN) RowIo::store(dst + i, RowIo::load(src + i));
    if (i < n) RowIo::store(dst + i, RowIo::load(src + i, int(n - i)), int(n - i));
  }
}

// cache row -> out row (float formats); fp8 caches are dequantized as float(x) * scale.
template <typename C, typename O>
inline void read_row(const C* src, O* dst, int64_t n, float scale) {
  if (n <= 0) return;
  if constexpr (std::is_same_v<C, O>) {  // O is never fp8
    std::memcpy(static_cast<void*>(dst), src, sizeof(C) * size_t(n));
  } else if constexpr (is_fp8_type<C>) {
    const Vec s = Vec::set1(scale);
    int64_t i = 0;
    for (; i + kN <= n; i += kN) RowIo::store(dst + i, RowIo::load(src + i) * s);
    if (i < n) RowIo::store(dst + i, RowIo::load(src + i, int(n - i)) * s, int(n - i));
  } else {
    int64_t i = 0;
    for (; i + kN <= n; i += kN) RowIo::store(dst + i, RowIo::load(src + i));
    if (i < n) RowIo::store(dst + i, RowIo::load(src + i, int(n - i)), int(n - i));
  }
}

// out = wa * a + wb * b, a side that is not read (ra / rb false: its lse marks it empty)
// contributing exactly 0 (merge_attention_states).
template <typename T>
inline void merge_row(const T* a, const T* b, T* out, int n, float wa, bool ra, float wb, bool rb) {
  int i = 0;
  for (; i + kN <= n; i += kN)
    RowIo::store(out + i, RowIo::weighted(wa, ra, RowIo::load(a + i)) +
                              RowIo::weighted(wb, rb, RowIo::load(b + i)));
  if (i < n) {
    const int m = n - i;
    RowIo::store(out + i, RowIo::weighted(wa, ra, RowIo::load(a + i, m)) +
                              RowIo::weighted(wb, rb, RowIo::load(b + i, m)), m);
  }
}

template <typename S, typename C>
void write_tokens_as(const CacheWriteParams& p, int64_t begin, int64_t end) {
  const S* src = static_cast<const S*>(p.src);
  C* cache = static_cast<C*>(p.cache);
  const bool per_head_scale = p.scale != nullptr && p.scale_per_head;
  const bool one_run = p.num_heads > 1 && !per_head_scale && p.col_offset == 0 &&
                       p.src_stride_head == p.width && p.cache_stride_head == p.width;
  const int rows = one_run ? 1 : p.num_heads;
  const int64_t width = one_run ? int64_t(p.num_heads) * p.width : p.width;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;  // padding token
    const int64_t block = slot / p.block_size, offset = slot % p.block_size;
    for (int h = 0; h < rows; ++h) {
      const float scale = p.scale ? p.scale[per_head_scale ? h : 0] : 1.0f;
      write_row(src + t * p.src_stride_token + h * p.src_stride_head,
                cache + block * p.cache_stride_block + offset * p.cache_stride_slot +
                    h * p.cache_stride_head + p.col_offset,
                width, scale);
    }
  }
}

// The n tokens of one paged block (K or V side) into out [n, H, D].
template <typename C, typename O>
inline void gather_block(const C* block, int64_t stride_slot, int64_t stride_head,
                         const float* scale, bool per_head, int64_t n, int H, int D, O* out) {
  const bool split_scale = scale != nullptr && per_head;
  if (!split_scale && (H == 1 || stride_head == D) && (n == 1 || stride_slot == int64_t(H) * D)) {
    read_row(block, out, n * H * D, scale ? scale[0] : 1.0f);
    return;
  }
  for (int64_t j = 0; j < n; ++j)
    for (int h = 0; h < H; ++h)
      read_row(block + j * stride_slot + h * stride_head, out + (j * H + h) * D, D,
               scale ? scale[split_scale ? h : 0] : 1.0f);
}

template <typename C, typename O>
void gather_as(const GatherParams& p, const GatherItem* items, int64_t begin, int64_t end) {
  const paged_kv_t& kv = p.kv;
  const int H = kv.num_kv_heads, D = kv.head_dim, Dv = kv.head_dim_v;  // Dv may differ from D
  for (int64_t i = begin; i < end; ++i) {
    const int64_t s = items[i].seq, b = items[i].block;
    const int64_t block = kv.block_id(s, b);
    const int64_t first = b * kv.block_size;
    const int64_t n = std::min<int64_t>(kv.block_size, kv.seq_lens[s] - first);
    const int64_t row = (p.token_start[s] + first) * H;  // first output row (token x head)
    gather_block(static_cast<const C*>(kv.k) + kv.k_offset(block, 0, 0), kv.k_stride_slot,
                 kv.k_stride_head, kv.k_scale, kv.k_scale_per_head, n, H, D,
                 static_cast<O*>(p.key) + row * D);
    gather_block(static_cast<const C*>(kv.v) + kv.v_offset(block, 0, 0), kv.v_stride_slot,
                 kv.v_stride_head, kv.v_scale, kv.v_scale_per_head, n, H, Dv,
                 static_cast<O*>(p.value) + row * Dv);
  }
}

template <typename T>
void merge_as(const MergeParams& p, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t t = r / p.num_heads, h = r % p.num_heads;
    const float la = p.lse_a[t * p.lse_a_stride_token + h * p.lse_a_stride_head];
    const float lb = p.lse_b[t * p.lse_b_stride_token + h * p.lse_b_stride_head];
    float wa, wb;
    p.lse[r] = merge_weights(la, lb, &wa, &wb);
    merge_row(static_cast<const T*>(p.out_a) + t * p.a_stride_token + h * p.a_stride_head,
              static_cast<const T*>(p.out_b) + t * p.b_stride_token + h * p.b_stride_head,
              static_cast<T*>(p.out) + r * p.head_dim, p.head_dim, wa, !lse_empty(la), wb,
              !lse_empty(lb));
  }
}

// The entries of RowKernels: element formats resolved once per call (per parallel chunk).
void write_tokens(const CacheWriteParams& p, int64_t begin, int64_t end) {
  dispatch_float_and_cache(p.src_format, p.cache_format, [&](auto st, auto ct) {
    write_tokens_as<typename decltype(st)::type, typename decltype(ct)::type>(p, begin, end);
  });
}

void gather(const GatherParams& p, const GatherItem* items, int64_t begin, int64_t end) {
  dispatch_cache(p.kv.format, [&](auto ct) {
    dispatch_float(p.out_format, [&](auto ot) {
      gather_as<typename decltype(ct)::type, typename decltype(ot)::type>(p, items, begin, end);
    });
  });
}

void merge(const MergeParams& p, int64_t begin, int64_t end) {
  dispatch_float(p.format, [&](auto tag) { merge_as<typename decltype(tag)::type>(p, begin, end); });
}

}  // namespace kvkernels::cpu::KVK_ISA
