// Cache writes and copies: reshape_and_cache, gather_kv, copy_blocks (docs/ops.md).
// Compiled after common.h with the variant's #defines (kvkernels/metal/source.py); each kernel has
// its own macros, so one compile unit holds every kernel (the others in their default variant):
//   reshape_and_cache: WRITE_SRC_T (key/value), WRITE_CACHE_T, WRITE_FP8 (0/1)
//   gather_kv:         GATHER_CACHE_T, GATHER_OUT_T, GATHER_FP8
//   copy_blocks:       COPY_ELEM_T (uchar/ushort/uint/ulong: the element size)
// Strides are in elements. Index tensors are validated on the host; the kernels still skip ids
// out of range instead of touching memory outside the cache.

#ifndef WRITE_SRC_T
#define WRITE_SRC_T float
#define WRITE_CACHE_T float
#define WRITE_FP8 0
#endif
#ifndef GATHER_CACHE_T
#define GATHER_CACHE_T float
#define GATHER_OUT_T float
#define GATHER_FP8 0
#endif
#ifndef COPY_ELEM_T
#define COPY_ELEM_T uint
#endif

struct WriteParams {
  long num_tokens;
  long num_heads;
  long head_dim;    // key's
  long head_dim_v;  // value's (may differ from the key's)
  long num_slots;  // num_blocks * block_size
  long block_size;
  long k_stride_t, k_stride_h, k_stride_d;  // key [T, H, D]
  long v_stride_t, v_stride_h, v_stride_d;
  long kc_stride_b, kc_stride_s, kc_stride_h;  // key_cache [N, B, H, D], unit stride along D
  long vc_stride_b, vc_stride_s, vc_stride_h;
  long k_scale_per_head;  // fp8: 1 if k_scale has one element per kv head
  long v_scale_per_head;
};

// One thread per (d, h, token): threads [max(head_dim, head_dim_v), num_heads, num_tokens].
kernel void reshape_and_cache(device const WRITE_SRC_T* key [[buffer(0)]],
                              device const WRITE_SRC_T* value [[buffer(1)]],
                              device WRITE_CACHE_T* key_cache [[buffer(2)]],
                              device WRITE_CACHE_T* value_cache [[buffer(3)]],
                              device const long* slot_mapping [[buffer(4)]],
                              device const float* k_scale [[buffer(5)]],  // fp8 only (else any buffer)
                              device const float* v_scale [[buffer(6)]],
                              constant WriteParams& p [[buffer(7)]],
                              uint3 gid [[thread_position_in_grid]]) {
  const long d = gid.x, h = gid.y, t = gid.z;
  const long slot = slot_mapping[t];
  if (slot < 0 || slot >= p.num_slots) return;  // negative: padding token, skipped
  const long blk = slot / p.block_size, off = slot % p.block_size;
  const long kdst = blk * p.kc_stride_b + off * p.kc_stride_s + h * p.kc_stride_h + d;
  const long vdst = blk * p.vc_stride_b + off * p.vc_stride_s + h * p.vc_stride_h + d;
  if (d < p.head_dim) {
    const WRITE_SRC_T k = key[t * p.k_stride_t + h * p.k_stride_h + d * p.k_stride_d];
#if WRITE_FP8
    key_cache[kdst] = quantize<WRITE_CACHE_T>(to_float(k), head_scale(k_scale, p.k_scale_per_head, h));
#else
    key_cache[kdst] = k;  // same type: the bits are copied
#endif
  }
  if (d < p.head_dim_v) {
    const WRITE_SRC_T v = value[t * p.v_stride_t + h * p.v_stride_h + d * p.v_stride_d];
#if WRITE_FP8
    value_cache[vdst] = quantize<WRITE_CACHE_T>(to_float(v), head_scale(v_scale, p.v_scale_per_head, h));
#else
    value_cache[vdst] = v;
#endif
  }
}

struct GatherParams {
  long num_tokens;
  long num_seqs;
  long num_heads;
  long head_dim;    // key's
  long head_dim_v;  // value's (may differ from the key's)
  long block_size;
  long num_blocks;
  long table_stride;  // block_tables row stride
  long kc_stride_b, kc_stride_s, kc_stride_h;
  long vc_stride_b, vc_stride_s, vc_stride_h;
  long k_scale_per_head;
  long v_scale_per_head;
};

// The sequence that token t of the concatenation belongs to: cu[s] <= t < cu[s + 1].
inline long find_sequence(device const long* cu, long num_seqs, long t) {
  long lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const long mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One thread per (d, h, token) of the output: threads [max(head_dim, head_dim_v), num_heads,
// num_tokens].
kernel void gather_kv(device const GATHER_CACHE_T* key_cache [[buffer(0)]],
                      device const GATHER_CACHE_T* value_cache [[buffer(1)]],
                      device const int* block_tables [[buffer(2)]],
                      device const long* cu_seq_lens [[buffer(3)]],  // [num_seqs + 1], cu[0] = 0
                      device const float* k_scale [[buffer(4)]],
                      device const float* v_scale [[buffer(5)]],
                      device GATHER_OUT_T* key_out [[buffer(6)]],  // [num_tokens, H, D] contiguous
                      device GATHER_OUT_T* value_out [[buffer(7)]],
                      constant GatherParams& p [[buffer(8)]],
                      uint3 gid [[thread_position_in_grid]]) {
  const long d = gid.x, h = gid.y, t = gid.z;
  const long s = find_sequence(cu_seq_lens, p.num_seqs, t);
  const long pos = t - cu_seq_lens[s];
  const long blk = block_tables[s * p.table_stride + pos / p.block_size];
  const long off = pos % p.block_size;
  const long kout = (t * p.num_heads + h) * p.head_dim + d;
  const long vout = (t * p.num_heads + h) * p.head_dim_v + d;
  const bool valid = blk >= 0 && blk < p.num_blocks;
  if (d < p.head_dim) {
    float k = 0.0f;
    if (valid) {
      k = to_float(key_cache[blk * p.kc_stride_b + off * p.kc_stride_s + h * p.kc_stride_h + d]);
#if GATHER_FP8
      k *= head_scale(k_scale, p.k_scale_per_head, h);
#endif
    }
    key_out[kout] = from_float<GATHER_OUT_T>(k);
  }
  if (d < p.head_dim_v) {
    float v = 0.0f;
    if (valid) {
      v = to_float(value_cache[blk * p.vc_stride_b + off * p.vc_stride_s + h * p.vc_stride_h + d]);
#if GATHER_FP8
      v *= head_scale(v_scale, p.v_scale_per_head, h);
#endif
    }
    value_out[vout] = from_float<GATHER_OUT_T>(v);
  }
}

struct CopyParams {
  long num_pairs;
  long num_blocks;    // cache.shape[block_dim]
  long block_stride;  // cache.stride(block_dim)
  long block_numel;   // elements of one block (cache.select(block_dim, i))
  long ndim;          // dims of one block after merging contiguous ones, <= kCopyMaxDims
  long sizes[8];      // innermost last
  long strides[8];
};

// Threads [x, num_pairs]; thread x copies elements x, x + threads.x, ... of its pair's block.
kernel void copy_blocks(device COPY_ELEM_T* cache [[buffer(0)]],
                        device const long* block_mapping [[buffer(1)]],  // [num_pairs, 2] (src, dst)
                        constant CopyParams& p [[buffer(2)]],
                        uint2 gid [[thread_position_in_grid]],
                        uint2 grid [[threads_per_grid]]) {
  const long src = block_mapping[2 * long(gid.y)], dst = block_mapping[2 * long(gid.y) + 1];
  if (src < 0 || src >= p.num_blocks || dst < 0 || dst >= p.num_blocks) return;
  for (long i = gid.x; i < p.block_numel; i += grid.x) {
    long rest = i, off = 0;
    for (int k = int(p.ndim) - 1; k >= 0; --k) {
      off += (rest % p.sizes[k]) * p.strides[k];
      rest /= p.sizes[k];
    }
    cache[dst * p.block_stride + off] = cache[src * p.block_stride + off];
  }
}
