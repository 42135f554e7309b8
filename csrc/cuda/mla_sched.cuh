// The split-KV metadata pass of the wgmma MLA decode (KVKERNELS_CUDA_MLA_SCHED=metadata, opt-in; csrc/cuda/README.md,
// "MLA decode: split plan from a metadata pass"). Compiled and emulated, not run on a GPU.
//
// The shape-only plan gives every sequence the split count of the longest one a block-table row can describe,
// so a batch mixing one long and many short sequences runs many near-empty CTAs. Here a one-warp kernel reads
// seq_lens on the device and gives each of the decode's `parts` CTAs (per head chunk) a contiguous, equal
// share of the batch's work, in units: sequence s costs kSchedFixedCost + items(s) units, items(s) = its 64-key
// tiles (at least 1: an empty sequence still writes its rows), laid end to end in sequence order; CTA c owns
// the items whose unit falls in [c q, c q + q), q = ceil(total / parts). A sequence whose items fall to k > 1
// CTAs gets k pieces, each written as a float32 partial (2 parts partial rows at most: a CTA's range holds at
// most two pieces of sequences split with another CTA, its first and its last); a sequence inside one CTA is
// written to the output directly, and the merge (mla_merge.cuh) combines only the split ones.
// The grid (parts x head chunks) and the workspace come from shapes, so the launch stays capturable; the pass
// runs on the same stream before the decode, which starts early by programmatic dependent launch where the
// device has it (sm_90) and waits (griddepcontrol.wait) before it reads the pass's output; the merge likewise
// after the decode.
#pragma once

#include "mla_common.cuh"
#include "sm90_ptx.cuh"

namespace kvkernels::mla_cuda {

// A CTA's fixed work in key-tile times (query tile load, pipeline fill, epilogue): the split model's
// (attention_common.cuh kCtaOverheadTiles).
constexpr int kSchedFixedCost = int(ac::kCtaOverheadTiles);
constexpr int kSchedCtaInts = 8;  // per CTA: begin seq, begin item, end seq, end item, first piece, 3 unused

// The workspace of a metadata launch, in floats: partials [2 parts][H][R] | partial lse [2 parts][H] | the
// pass's int32 output (per CTA kSchedCtaInts; per sequence items, first unit, pieces, first partial).
struct MlaSchedLayout {
  int64_t part_lse = 0, meta = 0, floats = 0;
};
__host__ __device__ inline int64_t sched_aligned8(int64_t n) { return (n + 7) / 8 * 8; }
__host__ __device__ inline MlaSchedLayout mla_sched_layout(int64_t num_seqs, int parts, int heads, int value_dim) {
  MlaSchedLayout l;
  const int64_t partials = 2 * int64_t(parts);
  l.part_lse = sched_aligned8(partials * heads * value_dim);
  l.meta = l.part_lse + sched_aligned8(partials * heads);
  l.floats = l.meta + sched_aligned8(int64_t(parts) * kSchedCtaInts + 4 * num_seqs);
  return l;
}

// The pass's output arrays.
struct MlaSchedView {
  int *cta, *items, *start, *pieces, *part_off;
  __host__ __device__ MlaSchedView(int* base, int64_t num_seqs, int parts)
      : cta(base), items(base + int64_t(parts) * kSchedCtaInts), start(items + num_seqs), pieces(start + num_seqs),
        part_off(pieces + num_seqs) {}
};

__device__ __forceinline__ int warp_inclusive_sum(int x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

// The first item whose unit is >= u, as (sequence, item); (num_seqs, 0) when there is none.
__device__ __forceinline__ void sched_item_at(const MlaSchedView& v, int num_seqs, int u, int* seq, int* item) {
  int lo = 0, hi = num_seqs;  // the first sequence whose last item's unit is >= u
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (v.start[mid] + kSchedFixedCost + v.items[mid] - 1 >= u) hi = mid; else lo = mid + 1;
  }
  *seq = lo;
  *item = lo < num_seqs ? max(0, u - (v.start[lo] + kSchedFixedCost)) : 0;
}

// One warp (grid 1 x 1): the work ranges of m.parts CTAs over the batch (top of this file). KT: key tile.
template <int KT>
__global__ void __launch_bounds__(32) mla_sched_kernel(const __grid_constant__ MlaArgs m) {
  const ac::AttnArgs& a = m.a;
  const int num_seqs = static_cast<int>(a.p.kv.num_seqs), parts = m.parts, lane = threadIdx.x & 31;
  const MlaSchedView v(m.sched, num_seqs, parts);
  // The decode's CTAs may be scheduled now: they wait for this grid's completion before reading its output.
  sm90::griddep_launch_dependents();
  // Items and first units (an exclusive prefix sum of the costs, 32 sequences per step).
  int total = 0;
  for (int s0 = 0; s0 < num_seqs; s0 += 32) {
    const int s = s0 + lane;
    int cost = 0;
    if (s < num_seqs) {
      ac::Work w;
      ac::make_work_at<KT>(a, w, s);  // the key tiles the decode would run (seq_lens read clamped there)
      const int items = max(w.tile_end - w.tile_begin, 1);
      v.items[s] = items;
      cost = kSchedFixedCost + items;
    }
    const int incl = warp_inclusive_sum(cost);
    if (s < num_seqs) v.start[s] = total + incl - cost;
    total += __shfl_sync(0xffffffffu, incl, 31);
  }
  const int share = max(1, (total + parts - 1) / parts);
  // Pieces per sequence (the CTAs its items fall to) and the first partial of each split one.
  int partials = 0;
  for (int s0 = 0; s0 < num_seqs; s0 += 32) {
    const int s = s0 + lane;
    int split = 0;
    if (s < num_seqs) {
      const int first = v.start[s] + kSchedFixedCost, last = first + v.items[s] - 1;
      const int pieces = last / share - first / share + 1;
      v.pieces[s] = pieces;
      split = pieces > 1 ? pieces : 0;
    }
    const int incl = warp_inclusive_sum(split);
    if (s < num_seqs) v.part_off[s] = partials + incl - split;
    partials += __shfl_sync(0xffffffffu, incl, 31);
  }
  __syncwarp();  // every lane's items / starts written before the searches below read them
  for (int c = lane; c < parts; c += 32) {
    int* r = v.cta + int64_t(c) * kSchedCtaInts;
    sched_item_at(v, num_seqs, c * share, &r[0], &r[1]);
    sched_item_at(v, num_seqs, (c + 1) * share, &r[2], &r[3]);
    // The piece of its first sequence this CTA runs: the CTAs before it that sequence's items fall to.
    r[4] = r[0] < num_seqs ? c - (v.start[r[0]] + kSchedFixedCost) / share : 0;
  }
}

// The pieces a CTA of the wgmma decode runs, one at a time (next_piece): under the shape-only plan the one work
// item of make_work; under the metadata plan its range, across sequence boundaries. The walk keeps only the next
// sequence in registers (the decode's consumers have none to spare); the range's end and the first piece's
// offsets are read from the pass's output when needed.
struct MlaWalk {
  int seq = -1;  // the next piece's sequence; -1 before the first piece
};

// Fills w with the CTA's next piece (its keys: tiles [w.tile_begin, w.tile_end); w.split: its piece number);
// false when none is left. Every read of the pass's output comes after the caller's griddep_wait (the decode may
// start before the pass has finished).
template <int KT>
__device__ __forceinline__ bool next_piece(const MlaArgs& m, MlaWalk& k, ac::Work& w) {
  const ac::AttnArgs& a = m.a;
  if (m.sched == nullptr) {
    if (k.seq >= 0 || !ac::make_work<KT>(a, w)) return false;
    k.seq = 0x7fffffff;  // (done)
    return true;
  }
  const int* r = m.sched + int64_t(blockIdx.x) * kSchedCtaInts;
  const bool first = k.seq < 0;
  const int s = first ? sm90::griddep_read(r) : k.seq;
  const int item = first ? sm90::griddep_read(r + 1) : 0;
  const int end_seq = sm90::griddep_read(r + 2), end_item = sm90::griddep_read(r + 3);
  if (s > end_seq || (s == end_seq && item >= end_item)) return false;
  const MlaSchedView v(m.sched, a.p.kv.num_seqs, m.parts);
  const int stop = s == end_seq ? end_item : sm90::griddep_read(v.items + s);
  ac::make_work_at<KT>(a, w, s);  // all of the sequence's tiles (num_splits is 1), then this piece's
  const int first_tile = w.tile_begin, tiles = w.tile_end - w.tile_begin;
  w.tile_begin = first_tile + min(item, tiles);
  w.tile_end = first_tile + min(stop, tiles);  // (an empty sequence's one item has no tile)
  w.split = first ? sm90::griddep_read(r + 4) : 0;
  k.seq = s + 1;
  return true;
}

// Where the rows of piece w go: false when it is its sequence's whole (rows to out / lse); else true, with
// *part_row0 such that query row `row` (token x H + head) has partial row *part_row0 + row (it may be negative).
__device__ __forceinline__ bool piece_partials(const MlaArgs& m, const ac::Work& w, int64_t* part_row0) {
  const ac::AttnArgs& a = m.a;
  const int64_t heads = a.p.num_heads;
  if (m.sched == nullptr) {
    *part_row0 = int64_t(w.split) * a.p.num_tokens * heads;
    return a.num_splits > 1;
  }
  const MlaSchedView v(m.sched, a.p.kv.num_seqs, m.parts);
  *part_row0 = (int64_t(sm90::griddep_read(v.part_off + w.seq)) + w.split - w.seq) * heads;
  return sm90::griddep_read(v.pieces + w.seq) > 1;
}

}  // namespace kvkernels::mla_cuda
