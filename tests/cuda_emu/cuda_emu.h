// A CPU stand-in for the CUDA execution model, enough to run the torch-free cache-op kernels and the
// paged-attention kernels (SIMT, tensor-core decode / prefill, split merge) of csrc/cuda with the
// host compiler (tests/test_cuda_emulated.py). It checks kernel *logic* (indexing, conversions,
// guards, vector-width choices, fragment layouts, pipeline ordering within a thread) without a GPU;
// it says nothing about timing, memory ordering between CTAs, the rounding order of real tensor
// cores, or hardware faults beyond the alignment checks of cp.async / ldmatrix below. Also runs the
// MLA kernels (mla_attention*, mla_merge, mla_decompress with its cp.async and TMA weight pipelines:
// ldmatrix .x2, a 2-D tiled tensor map with 128B swizzle, mbarrier init / arrive.expect_tx /
// try_wait.parity, cp.async.bulk.tensor.2d) and the sm_90 instructions of the Hopper wgmma prefill
// (csrc/cuda/sm90_ptx.cuh; section "sm_90" below): wgmma with shared-memory descriptors (K- / MN-major,
// swizzle none / 32B / 64B / 128B) or A from registers, its fence / commit / wait (results NaN until the
// wait, operands that change in flight reported), setmaxnreg with a per-CTA register pool, named
// barriers, blocking mbarrier waits with plain, expect_tx and cp.async arrivals; atomicAdd on unsigned
// (a plain read-modify-write: fibers switch only at barriers, CTAs run one after another) and
// __threadfence (a no-op: one memory). Not emulated: clusters / multicast, other atomics,
// warp-divergent collectives, other tensor-map modes (rank > 2,
// interleave, im2col, other swizzles), the async proxy (fence.proxy.async is a no-op), wgmma descriptor
// base offsets, fp8 / tf32 / integer wgmma. Programmatic dependent launch: cudaLaunchKernelEx accepts the
// programmatic-stream-serialization attribute; grids still run one after another, and the rule a GPU run depends
// on is checked instead (griddepcontrol.wait before a read of the predecessor's output; section PDL below).
//
// Each CTA runs as blockDim.x cooperative fibers (ucontext) on the calling thread; __syncthreads()
// switches to the next fiber, and a barrier completes when every live fiber of the CTA reached it.
// Which ready fiber runs next is an adverse order by default (Order, below: low-numbered threads run
// as far ahead as their barriers allow in even CTAs, high-numbered ones in odd CTAs), so that a read of
// shared memory that no barrier orders after another thread's write sees the old bytes.
// Threads blocked on an event (named barrier, mbarrier phase, setmaxnreg registers) resume when another
// thread causes it; when none can progress the launch fails with what each thread waits for (a kernel
// that would hang on a GPU). An exception a kernel thread throws (a detected misuse) ends the launch and
// is rethrown to the caller.
// Warp collectives (__shfl_up_sync, __shfl_xor_sync, __any_sync, __syncwarp, ldmatrix, mma.sync) go through an
// exchange array between two warp-level barriers (every live fiber of the warp; the kernels only
// use them with full warps). CTAs run one after another, blockIdx.x fastest (KVKERNELS_EMU_CTA_ORDER=reverse,
// read per launch: the last CTA first, blockIdx.x slowest to change then too, so that a kernel whose CTAs
// coordinate, such as the fused decode's last-arriving merge, is run in another order). Launch syntax is
// rewritten by the test (kernel<<<g, b, s, st>>>(args) -> emu::launch(kernel, g, b, s, st, args)).
//
// Shared memory: static `__shared__` arrays become function-local statics (every fiber of a CTA
// sees the same object; CTAs run one after another, so one object serves them all, uninitialized
// as on a GPU). The dynamic `extern __shared__ T name[];` cannot be spelled that way: build_emu.py
// rewrites it to a pointer to ::emu::dynamic_smem(), a per-CTA buffer of the launch's byte count,
// refilled with a poison byte (0xff: NaN as float, fp16 and bf16) before every CTA.
//
// The attention kernels' PTX wrappers (csrc/cuda/attention_common.cuh, KVKERNELS_CUDA_EMU branch)
// call the functions below: cp.async as per-thread deferred copies (a group lands only when its
// thread waits for it, so reading a stage before its wait reads poison), ldmatrix and mma.sync as
// warp collectives (operands exchanged between two warp barriers, PTX ISA fragment layouts), and
// shared addresses as byte offsets into the dynamic buffer.
//
// Must be included before the CUDA headers: the __global__/__device__/... keywords become empty.
#pragma once

#define __global__
#define __device__
#define __host__
#define __grid_constant__
#define __launch_bounds__(...)
#define __shared__ static
#ifndef KVKERNELS_CUDA_EMU
#define KVKERNELS_CUDA_EMU 1
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>  // CUtensorMap and the cuTensorMapEncodeTiled enums (nothing links libcuda)
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdlib>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

using std::max;
using std::min;

namespace emu {

inline uint3 threadIdx_, blockIdx_;
inline dim3 gridDim_, blockDim_;

// kAtWgBarrier: the implicit synchronization of a warpgroup collective (wgmma, setmaxnreg: the
// 4 warps of 128 threads, warpgroup i = threads 128 i .. 128 i + 127). kBlocked: waiting for an event
// another thread causes (a named barrier, an mbarrier phase, registers for setmaxnreg.inc); what it
// waits for is in Scheduler::blocked_on, re-checked by release() (can_wake).
// kYielded: a thread that let the others run first (the completion of an asynchronous operation at
// its wait: wgmma.wait_group); it resumes only once no other thread can make progress, the latest a
// GPU could complete the operation, so that what other threads do meanwhile (refill a stage released
// too early) shows.
enum State { kReady, kAtBlockBarrier, kAtWarpBarrier, kAtWgBarrier, kBlocked, kYielded, kDone };
enum BlockKind { kNamedBarrier, kMbarrierPhase, kMaxnreg };
struct Blocker {
  BlockKind kind = kNamedBarrier;
  uint32_t a = 0, b = 0;  // named barrier: id; mbarrier: address, parity; setmaxnreg: warpgroup
};

struct Scheduler {
  std::vector<ucontext_t> fibers;
  std::vector<std::vector<char>> stacks;
  std::vector<int> state;
  ucontext_t main;
  void (*entry)(int) = nullptr;  // the launched kernel with its arguments bound
  int current = -1;
  std::vector<uint64_t> exchange;  // warp collectives: kSlots 64-bit slots per thread
  std::vector<unsigned char> smem_storage;  // dynamic shared memory of the current CTA
  unsigned char* smem = nullptr;            // 1024-byte aligned start inside smem_storage
  size_t smem_bytes = 0;
  std::vector<Blocker> blocked_on;          // per fiber, while kBlocked
  std::exception_ptr error;                 // an exception a fiber threw (rethrown by launch)
  bool woke = false;  // the running fiber made others ready (completed a named barrier): see Order
};
constexpr int kSlots = 8;
inline Scheduler sched;

// Suspends the current fiber at a barrier of the given kind (kAtBlockBarrier: __syncthreads;
// kAtWarpBarrier: the implicit synchronization of a full-warp shuffle).
inline void wait_at(State kind) {
  const int me = sched.current;
  sched.state[me] = kind;
  swapcontext(&sched.fibers[me], &sched.main);
  threadIdx_ = make_uint3(static_cast<unsigned>(me), 0, 0);
}

// Suspends the current fiber until can_wake(fiber) holds (see release()).
inline void block_on(Blocker b) {
  sched.blocked_on[sched.current] = b;
  wait_at(kBlocked);
}

// A kernel that throws (a misuse the emulator detects: misaligned operands, a wait that cannot
// complete, ...) ends its fiber with the exception stored; launch() abandons the CTA and rethrows it
// on the calling thread, so the op fails with the message instead of terminating the process.
template <typename K, typename... Args>
struct Entry {
  static inline K kernel;
  static inline std::tuple<Args...>* args;
  static void run(int me) {
    try {
      std::apply(kernel, *args);
    } catch (...) {
      if (!sched.error) sched.error = std::current_exception();
    }
    sched.state[me] = kDone;
  }
};

bool can_wake(int t);          // defined with the objects fibers block on (below)
void end_cta_checks(int n);    // state a CTA must not leave behind (below)
std::string waiting_report(int n);

inline void trampoline(int me) {
  sched.entry(me);  // returning ends the fiber (uc_link = main)
}

// Releases the fibers [w, w + width) of a warp (32, kAtWarpBarrier) or warpgroup (128, kAtWgBarrier)
// if every live one of them waits at that barrier; true if so.
inline bool release_group(int w, int width, State kind, int n) {
  bool all = true, live = false;
  for (int t = w; t < std::min(n, w + width); ++t) {
    if (sched.state[t] == kDone) continue;
    live = true;
    all = all && sched.state[t] == kind;
  }
  if (!live || !all) return false;
  if (kind == kAtWgBarrier)
    for (int t = w; t < w + width; ++t)
      if (t >= n || sched.state[t] == kDone)
        throw std::logic_error("emu: a warpgroup instruction without all 128 threads of the warpgroup");
  for (int t = w; t < std::min(n, w + width); ++t)
    if (sched.state[t] != kDone) sched.state[t] = kReady;
  return true;
}

// Releases every group whose live fibers all wait at the same kind of barrier; false if none.
inline bool release(int n) {
  bool released = false;
  bool all_block = true, any_live = false;
  for (int t = 0; t < n; ++t) {
    if (sched.state[t] == kDone) continue;
    any_live = true;
    all_block = all_block && sched.state[t] == kAtBlockBarrier;
  }
  if (any_live && all_block) {
    for (int t = 0; t < n; ++t)
      if (sched.state[t] != kDone) sched.state[t] = kReady;
    return true;
  }
  // Warp (32) and warpgroup (128) collectives: every live fiber of the group at that barrier.
  for (const auto& [width, kind] : {std::pair<int, State>{32, kAtWarpBarrier}, std::pair<int, State>{128, kAtWgBarrier}})
    for (int w = 0; w < n; w += width) released = release_group(w, width, kind, n) || released;
  for (int t = 0; t < n; ++t) {
    if (sched.state[t] == kBlocked && can_wake(t)) {
      sched.state[t] = kReady;
      released = true;
    }
  }
  return released;
}

// cp.async: the copies a thread issued, in issue order, performed when the thread waits for their
// commit group (cp.async.wait_group) or when an mbarrier that a cp.async.mbarrier.arrive of the
// thread tracks is waited on (the copies issued before that arrive land first).
struct AsyncCopy {
  void* dst;
  const void* src;
  int src_bytes;
};
struct AsyncState {
  std::deque<AsyncCopy> pending;    // issued, not yet landed, oldest first
  uint64_t issued = 0, landed = 0;  // copies issued / landed so far (sequence numbers)
  std::deque<uint64_t> group_ends;  // committed groups not yet waited: `issued` at each commit
};
inline std::vector<AsyncState> async_state;

// Performs thread t's copies up to sequence number `upto` (exclusive), oldest first.
inline void land_copies(int t, uint64_t upto) {
  AsyncState& st = async_state[t];
  while (st.landed < upto && !st.pending.empty()) {
    const AsyncCopy& c = st.pending.front();
    unsigned char* dst = static_cast<unsigned char*>(c.dst);
    if (c.src_bytes > 0) std::memcpy(dst, c.src, c.src_bytes);
    std::memset(dst + c.src_bytes, 0, 16 - c.src_bytes);
    st.pending.pop_front();
    ++st.landed;
  }
}

inline unsigned char* dynamic_smem() { return sched.smem; }

// mbarrier objects of the current CTA by shared address (TMA section below).
struct BulkCopy {
  unsigned char* dst;  // shared
  std::vector<std::pair<uint32_t, const unsigned char*>> chunks;  // (shared offset, 16 global bytes or null)
  uint32_t bytes;
};
struct Barrier {
  int count = 0, pending = 0;  // expected arrivals per phase, still missing in the current one
  int64_t tx = 0;              // transaction bytes still expected in the current phase
  unsigned phase = 0;          // parity of the current (incomplete) phase
  std::deque<BulkCopy> copies; // issued bulk copies that complete_tx on this barrier, oldest first
  // cp.async.mbarrier.arrive.noinc of thread t after its copy number seq - 1: (t, seq), oldest first
  std::deque<std::pair<int, uint64_t>> cp_arrivals;
};
inline std::map<uint32_t, Barrier> barriers;

void reset_sm90_state(int n);  // named barriers, wgmma groups, setmaxnreg pools (below)

// Prepares the per-CTA state: dynamic shared memory poisoned, no pending copies, no barriers.
inline void begin_cta(int n) {
  std::fill(sched.smem_storage.begin(), sched.smem_storage.end(), static_cast<unsigned char>(0xff));
  async_state.assign(n, AsyncState{});
  barriers.clear();
  reset_sm90_state(n);
}

// The order in which ready fibers run (the schedule). The data a kernel computes must not depend on it;
// a race between threads of a CTA (shared memory read without a barrier ordering it after the write)
// shows only if the reader can run before the writer, so the default is adverse:
//   kLowFirst:  the lowest-numbered ready fiber always runs next; a group released (a warp or warpgroup
//               collective whose last thread arrived, a named barrier completed) runs again at once.
//               Low warps and warpgroups run as far ahead of high ones as the barriers allow; threads
//               waiting for their wgmma (kYielded) resume one warpgroup at a time, the lowest first.
//   kHighFirst: the same from the highest-numbered fiber down: high warps run ahead.
//   kPass:      round-robin passes over all fibers, a group released only after every ready fiber has
//               run to its next blocking point (the emulator's schedule before the adverse ones; it
//               lets every writer of a pass finish before any group it synchronizes with moves on,
//               which hid a missing barrier between two consumer warpgroups).
// KVKERNELS_EMU_SCHEDULE = low | high | pass | alternate (default: even CTAs (linear index) low-first,
// odd ones high-first, so that a multi-CTA launch runs both; read at every launch).
enum class Order { kLowFirst, kHighFirst, kPass };
inline Order schedule_of_cta(uint64_t cta) {
  const char* e = std::getenv("KVKERNELS_EMU_SCHEDULE");
  const std::string v = e ? e : "";
  if (v == "low") return Order::kLowFirst;
  if (v == "high") return Order::kHighFirst;
  if (v == "pass") return Order::kPass;
  if (!v.empty() && v != "alternate")
    throw std::logic_error("emu: KVKERNELS_EMU_SCHEDULE must be low, high, pass or alternate, not " + v);
  return cta % 2 == 0 ? Order::kLowFirst : Order::kHighFirst;
}

template <typename K, typename... Args>
void launch(K kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t /*stream*/, Args... args) {
  if (block.y != 1 || block.z != 1) throw std::logic_error("emu: 1-D blocks only");
  if (block.x == 0 || block.x > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535)
    throw std::logic_error("emu: invalid launch configuration");
  sched.smem_storage.assign(smem + 1024, 0);
  {
    const uintptr_t at = reinterpret_cast<uintptr_t>(sched.smem_storage.data());
    sched.smem = sched.smem_storage.data() + ((1024 - at % 1024) % 1024);
    sched.smem_bytes = smem;
  }
  const int n = static_cast<int>(block.x);
  gridDim_ = grid;
  blockDim_ = block;
  std::tuple<Args...> packed(args...);
  using E = Entry<K, Args...>;
  E::kernel = kernel;
  E::args = &packed;
  sched.entry = &E::run;
  sched.fibers.resize(n);
  sched.stacks.resize(n);
  sched.state.assign(n, kReady);
  sched.blocked_on.assign(n, Blocker{});
  sched.error = nullptr;
  sched.exchange.assign(size_t(n) * kSlots, 0);
  const char* cta_order = std::getenv("KVKERNELS_EMU_CTA_ORDER");
  const bool reverse = cta_order != nullptr && std::strcmp(cta_order, "reverse") == 0;
  for (unsigned bz = 0; bz < grid.z; ++bz) {
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      blockIdx_ = reverse ? make_uint3(grid.x - 1 - bx, grid.y - 1 - by, grid.z - 1 - bz) : make_uint3(bx, by, bz);
      const Order order = schedule_of_cta((uint64_t(blockIdx_.z) * grid.y + blockIdx_.y) * grid.x + blockIdx_.x);
      begin_cta(n);
      for (int t = 0; t < n; ++t) {
        sched.state[t] = kReady;
        sched.stacks[t].resize(256 * 1024);
        getcontext(&sched.fibers[t]);
        sched.fibers[t].uc_stack.ss_sp = sched.stacks[t].data();
        sched.fibers[t].uc_stack.ss_size = sched.stacks[t].size();
        sched.fibers[t].uc_link = &sched.main;
        makecontext(&sched.fibers[t], reinterpret_cast<void (*)()>(&trampoline), 1, t);
      }
      // Run ready fibers up to their next barrier (or their end) in the CTA's order; then release the
      // groups whose fibers all arrived; until every fiber has ended.
      for (;;) {
        bool ran = false;
        for (int i = 0; i < n; ++i) {
          const int t = order == Order::kHighFirst ? n - 1 - i : i;
          if (sched.state[t] != kReady) continue;
          ran = true;
          sched.current = t;
          sched.woke = false;
          threadIdx_ = make_uint3(static_cast<unsigned>(t), 0, 0);
          swapcontext(&sched.main, &sched.fibers[t]);
          if (sched.error) {  // abandon the CTA (the other fibers' stacks are simply dropped)
            std::exception_ptr e = sched.error;
            sched.error = nullptr;
            std::rethrow_exception(e);
          }
          if (order == Order::kPass) continue;
          // Adverse orders: a warp / warpgroup whose last thread just arrived is released now, and the
          // scan restarts, so the first ready fiber in the order (the released ones, if first) runs next.
          // (Every fiber before t in the order is blocked: the scan restarts whenever one is woken.)
          bool again = sched.woke;
          if (sched.state[t] == kAtWarpBarrier) again = release_group(t - t % 32, 32, kAtWarpBarrier, n) || again;
          if (sched.state[t] == kAtWgBarrier) again = release_group(t - t % 128, 128, kAtWgBarrier, n) || again;
          if (again) i = -1;
        }
        if (release(n)) continue;
        if (!ran) {
          // Threads that yielded at the wait of an asynchronous operation resume once nothing else can run:
          // all of them in round-robin passes; in the adverse orders only the first warpgroup (in the order)
          // that has any, so the others' operations complete later still (legal: nothing bounds when an
          // in-flight wgmma completes) and the first may run on past a point the others have not passed.
          int first = -1;
          for (int i = 0; i < n && first < 0; ++i) {
            const int t = order == Order::kHighFirst ? n - 1 - i : i;
            if (sched.state[t] == kYielded) first = t;
          }
          bool resumed = false;
          for (int t = 0; t < n; ++t)
            if (sched.state[t] == kYielded && (order == Order::kPass || t / 128 == first / 128))
              sched.state[t] = kReady, resumed = true;
          if (resumed) continue;
          for (int t = 0; t < n; ++t)
            if (sched.state[t] != kDone)
              throw std::logic_error("emu: deadlock (would hang on a GPU): " + waiting_report(n));
          break;
        }
      }
      end_cta_checks(n);
    }
  }
  }
}

}  // namespace emu

#define threadIdx ::emu::threadIdx_
#define blockIdx ::emu::blockIdx_
#define gridDim ::emu::gridDim_
#define blockDim ::emu::blockDim_

inline void __syncthreads() { emu::wait_at(emu::kAtBlockBarrier); }

// ld.global.nc (read-only data cache), ld.global.cg (L2 only): plain loads here.
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}

// Atomics and fences (see the top of this file): fibers switch only at barriers and CTAs run one after
// another, so a read-modify-write is atomic, and there is one memory to order.
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline void __threadfence() {}

namespace emu {

// Slot i of thread t in the exchange array.
inline uint64_t& slot(int t, int i) { return sched.exchange[size_t(t) * kSlots + i]; }

template <typename T>
void put(int t, int i, const T& x) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "emu: exchanged values are at most 64 bits");
  uint64_t u = 0;
  std::memcpy(&u, &x, sizeof(T));
  slot(t, i) = u;
}

template <typename T>
T get(int t, int i) {
  T x;
  std::memcpy(&x, &slot(t, i), sizeof(T));
  return x;
}

// Full-warp shuffle: every thread publishes x, then reads the value of lane src_lane(lane).
template <typename T, typename F>
T shuffle(T x, F src_lane) {
  const int me = static_cast<int>(threadIdx_.x);
  put(me, 0, x);
  wait_at(kAtWarpBarrier);
  const int lane = me % 32, src = src_lane(lane);
  const int t = me - lane + src;
  if (src < 0 || src >= 32 || t >= static_cast<int>(blockDim_.x) || sched.state[t] == kDone)
    throw std::logic_error("emu: shuffle from a lane that is not in the warp");
  const T out = get<T>(t, 0);
  wait_at(kAtWarpBarrier);
  return out;
}

}  // namespace emu

template <typename T>
T __shfl_up_sync(unsigned /*mask*/, T x, unsigned d) {
  return emu::shuffle(x, [d](int lane) { return lane >= static_cast<int>(d) ? lane - static_cast<int>(d) : lane; });
}

// width 32 only (the kernels' use); lanes past the warp's end are an error above.
template <typename T>
T __shfl_xor_sync(unsigned /*mask*/, T x, int lane_mask, int width = 32) {
  if (width != 32) throw std::logic_error("emu: __shfl_xor_sync with width != 32");
  return emu::shuffle(x, [lane_mask](int lane) { return lane ^ (lane_mask & 31); });
}

// Any source lane of the same warp (width 32 only).
template <typename T>
T __shfl_sync(unsigned /*mask*/, T x, int src_lane, int width = 32) {
  if (width != 32) throw std::logic_error("emu: __shfl_sync with width != 32");
  return emu::shuffle(x, [src_lane](int) { return src_lane & 31; });
}

inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) { emu::wait_at(emu::kAtWarpBarrier); }

// vote.any over the full warp (mask 0xffffffff only, the kernels' use): every lane publishes its
// predicate, then reads all 32.
inline int __any_sync(unsigned mask, int pred) {
  if (mask != 0xffffffffu) throw std::logic_error("emu: __any_sync with a partial mask");
  const int me = static_cast<int>(emu::threadIdx_.x), lane = me % 32;
  emu::put(me, 0, pred != 0 ? 1 : 0);
  emu::wait_at(emu::kAtWarpBarrier);
  int any = 0;
  for (int l = 0; l < 32; ++l) {
    const int t = me - lane + l;
    if (t >= static_cast<int>(emu::blockDim_.x) || emu::sched.state[t] == emu::kDone)
      throw std::logic_error("emu: __any_sync with a lane that is not in the warp");
    any |= emu::get<int>(t, 0);
  }
  emu::wait_at(emu::kAtWarpBarrier);
  return any;
}

// __syncthreads that also ORs a predicate over the CTA's live threads: publish, barrier, read every
// thread's slot, barrier (so no thread overwrites its slot before all have read it).
inline int __syncthreads_or(int pred) {
  const int me = static_cast<int>(emu::threadIdx_.x);
  emu::put(me, emu::kSlots - 1, pred != 0 ? 1 : 0);
  emu::wait_at(emu::kAtBlockBarrier);
  int any = 0;
  for (int t = 0; t < static_cast<int>(emu::blockDim_.x); ++t)
    if (emu::sched.state[t] != emu::kDone && emu::get<int>(t, emu::kSlots - 1) != 0) any = 1;
  emu::wait_at(emu::kAtBlockBarrier);
  return any;
}

// Integer / bit intrinsics of the device math library the kernels use.
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
// PRMT default mode: byte i of the result is byte (s >> 4 i) & 7 of the 8-byte value {y, x}.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
// Per 16-bit half: 0xffff where equal, else 0.
inline unsigned __vcmpeq2(unsigned a, unsigned b) {
  unsigned r = 0;
  if ((a & 0xffffu) == (b & 0xffffu)) r |= 0xffffu;
  if ((a >> 16) == (b >> 16)) r |= 0xffff0000u;
  return r;
}

namespace emu {

// ---- cvt.rn.f16x2.e4m3x2 (sm_89+) -------------------------------------------------------------
// Two OCP e4m3 bytes (element 0 in the low byte of the low 16 bits) -> two fp16 of the same values
// (every e4m3 value is exact in fp16), element 0 in the low half; NaN (S.1111.111) -> fp16 NaN.
// Decoded here from the format's definition, not through the kernels' own bit conversion.
inline uint32_t cvt_f16x2_e4m3x2(uint32_t pair) {
  auto one = [](uint32_t b) -> uint32_t {
    const uint32_t e = (b >> 3) & 0xfu, m = b & 0x7u;
    float v;
    if (e == 0xfu && m == 0x7u) v = NAN;
    else if (e == 0) v = std::ldexp(float(m), -9);               // subnormal: m / 8 * 2^-6
    else v = std::ldexp(1.0f + float(m) / 8.0f, int(e) - 7);     // bias 7
    if (b & 0x80u) v = -v;
    return __half_as_ushort(__float2half_rn(v));
  };
  return one(pair & 0xffu) | (one((pair >> 8) & 0xffu) << 16);
}

// ---- shared addresses -------------------------------------------------------------------------
// A shared-window address is kSharedBase plus the byte offset into the CTA's dynamic shared memory.
// The base is a multiple of 128 but not of 1024, as nothing guarantees where dynamic shared memory
// starts in the window: a kernel that needs 1024-byte aligned swizzle atoms (TMA / wgmma 128B
// swizzle) must align them itself, from smem_u32, as it must on a GPU.
constexpr uint32_t kSharedBase = 384;
inline uint32_t smem_u32(const void* p) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c < sched.smem || c > sched.smem + sched.smem_bytes)
    throw std::logic_error("emu: shared address of a pointer outside the dynamic shared memory");
  return static_cast<uint32_t>(c - sched.smem) + kSharedBase;
}

inline unsigned char* shared_at(uint32_t addr, size_t bytes) {
  if (addr < kSharedBase || size_t(addr - kSharedBase) + bytes > sched.smem_bytes)
    throw std::logic_error("emu: shared access outside the dynamic shared memory");
  return sched.smem + (addr - kSharedBase);
}

// ---- cp.async ---------------------------------------------------------------------------------
// cp.async.cg.shared.global [smem], [gmem], 16, src_bytes: recorded, performed at the wait. The
// destination is poisoned (0xff: NaN in every float format) when the copy is issued, so a read of
// the old contents after the issue (a stage overwritten while another thread still reads it) sees
// NaN, and so does a read before the wait.
inline void cp_async16(void* smem, const void* gmem, int src_bytes) {
  if (src_bytes < 0 || src_bytes > 16) throw std::logic_error("emu: cp.async src-size outside 0..16");
  const uint32_t at = smem_u32(smem);
  shared_at(at, 16);
  if (at % 16 != 0 || (src_bytes > 0 && reinterpret_cast<uintptr_t>(gmem) % 16 != 0))
    throw std::logic_error("emu: cp.async of 16 bytes needs 16-byte aligned addresses");
  std::memset(smem, 0xff, 16);
  AsyncState& st = async_state[threadIdx_.x];
  st.pending.push_back(AsyncCopy{smem, gmem, src_bytes});
  ++st.issued;
}

inline void cp_async_commit() {
  AsyncState& st = async_state[threadIdx_.x];
  st.group_ends.push_back(st.issued);  // an empty group is a group too
}

// cp.async.wait_group n: every committed group of this thread except the n most recent lands.
inline void cp_async_wait(int n) {
  const int me = static_cast<int>(threadIdx_.x);
  AsyncState& st = async_state[me];
  while (st.group_ends.size() > static_cast<size_t>(n)) {
    land_copies(me, st.group_ends.front());
    st.group_ends.pop_front();
  }
}

// ---- ldmatrix.sync.aligned.m8n8.{x2,x4}[.trans].shared.b16 ------------------------------------
// Lane 8 j + i gives the address of row i of matrix j (16 bytes); with .x2 only lanes 0-15 do
// (the other lanes' addresses are not read). Register j of lane l: without .trans the elements
// (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of matrix j, with .trans the elements
// (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4); the lower-indexed one in the low half.
inline void ldmatrix(uint32_t addr, uint32_t* r, int nmat, bool trans) {
  const int me = static_cast<int>(threadIdx_.x);
  put(me, 0, addr);
  wait_at(kAtWarpBarrier);
  const int lane = me % 32, w0 = me - lane;
  auto row = [&](int j, int i) -> const unsigned char* {
    const uint32_t a = get<uint32_t>(w0 + 8 * j + i, 0);
    if (a % 16 != 0) throw std::logic_error("emu: ldmatrix row address not 16-byte aligned");
    return shared_at(a, 16);
  };
  uint32_t out[4];
  for (int j = 0; j < nmat; ++j) {
    if (!trans) {
      std::memcpy(&out[j], row(j, lane / 4) + 4 * (lane % 4), 4);
    } else {
      uint16_t lo, hi;
      std::memcpy(&lo, row(j, 2 * (lane % 4)) + 2 * (lane / 4), 2);
      std::memcpy(&hi, row(j, 2 * (lane % 4) + 1) + 2 * (lane / 4), 2);
      out[j] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
  }
  wait_at(kAtWarpBarrier);
  for (int j = 0; j < nmat; ++j) r[j] = out[j];
}
inline void ldmatrix_x4(uint32_t addr, uint32_t* r, bool trans) { ldmatrix(addr, r, 4, trans); }
inline void ldmatrix_x2(uint32_t addr, uint32_t* r) { ldmatrix(addr, r, 2, false); }

// ---- mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 --------------------------
// g = lane / 4, t = lane % 4. A (16 x 16): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
// a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]. B (16 x 8, k x n): b0 = B[2t, 2t+1][g],
// b1 = B[2t+8, 2t+9][g]. C / D: d0 = C[g][2t], d1 = C[g][2t+1], d2 = C[g+8][2t], d3 = C[g+8][2t+1].
inline float half_bits_to_float(uint16_t h, bool f16) {
  if (f16) {
    __half_raw raw;
    raw.x = h;
    return __half2float(__half(raw));
  }
  return __uint_as_float(uint32_t(h) << 16);
}

inline void mma_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1, bool f16) {
  const int me = static_cast<int>(threadIdx_.x);
  for (int i = 0; i < 4; ++i) put(me, i, a[i]);
  put(me, 4, b0);
  put(me, 5, b1);
  wait_at(kAtWarpBarrier);
  const int lane = me % 32, w0 = me - lane, g = lane >> 2, t = lane & 3;
  auto element = [&](int owner_lane, int reg, int k) {
    const uint32_t v = get<uint32_t>(w0 + owner_lane, reg);
    return half_bits_to_float(static_cast<uint16_t>((k & 1) ? v >> 16 : v & 0xffffu), f16);
  };
  // A[m][k]: lane (m % 8) * 4 + (k % 8) / 2, register (m >= 8) + 2 (k >= 8).
  auto A = [&](int m, int k) { return element((m & 7) * 4 + ((k & 7) >> 1), (m >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), k); };
  // B[k][n]: lane n * 4 + (k % 8) / 2, register 4 + (k >= 8).
  auto B = [&](int k, int n) { return element(n * 4 + ((k & 7) >> 1), k >= 8 ? 5 : 4, k); };
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int m = g + (e >= 2 ? 8 : 0), n = 2 * t + (e & 1);
    float acc = 0.0f;
    for (int k = 0; k < 16; ++k) acc += A(m, k) * B(k, n);  // products exact in float
    out[e] = d[e] + acc;
  }
  wait_at(kAtWarpBarrier);
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}


// ---- TMA (sm_90): tensor maps, mbarriers, cp.async.bulk.tensor.{1..5}d ---------------------------
// cuTensorMapEncodeTiled (handed out by cudaGetDriverEntryPointByVersion below) stores the
// parameters of a tiled map of rank 1 to 5 in the opaque 128-byte CUtensorMap, with the driver's
// documented checks for what the emulator supports (no interleave, element strides 1, no OOB NaN
// fill, swizzle none or 128B; strides multiples of 16 below 2^40, box extents 1..256, the box's inner
// extent a multiple of 16 bytes and at most 128 with the 128B swizzle, dims 1..2^32; a row stride no
// smaller than the row). cp.async.bulk.tensor.<rank>d copies the box at coordinates (c0 innermost ..):
// box rows (box[0] elements) stored densely from the destination, dimension 1 fastest, then 2, ..;
// elements outside the tensor on any dimension (negative coordinates included) as zeros; with
// SWIZZLE_128B each 16-byte chunk at shared address a goes to a ^ (((a >> 7) & 7) << 4) (chunk bits
// [4:6] XOR 128-byte-row bits [7:9]; on a 1024-byte aligned box: chunk c of row r at c ^ (r % 8)).
// An instruction of another dimensionality than the map's rank is an error. Like cp.async the copy is
// deferred: its destination is poisoned when it is issued (a read of the old contents after the issue
// sees NaN) and it lands, completing its bytes on the mbarrier, when a thread waits on that barrier (a
// read before the wait sees poison).
constexpr int kTensorMapMaxRank = 5;
struct TensorMap {
  uint64_t magic;
  const unsigned char* base;
  uint64_t dims[kTensorMapMaxRank];         // elements, innermost first
  uint64_t strides[kTensorMapMaxRank - 1];  // bytes between consecutive indices of dims 1..rank-1
  uint32_t box[kTensorMapMaxRank];          // elements
  uint32_t rank, esz, swizzle128;           // esz: bytes per element
};
constexpr uint64_t kTensorMapMagic = 0x70614d726f736e54ull;
// Boxes copied by cp.async.bulk.tensor since the last tma_boxes_taken() (the tests' proof that a kernel
// took its TMA path rather than quietly gathering).
inline std::atomic<uint64_t> tma_boxes{0};
inline uint64_t tma_boxes_taken() { return tma_boxes.exchange(0); }
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap), "emu: the map fits the opaque CUtensorMap");

inline CUresult tensor_map_encode_tiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* addr,
                                        const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                        const cuuint32_t* elem_strides, CUtensorMapInterleave interleave,
                                        CUtensorMapSwizzle swizzle, CUtensorMapL2promotion,
                                        CUtensorMapFloatOOBfill oob) {
  uint32_t esz = 0;
  switch (type) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: esz = 1; break;
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: esz = 2; break;
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32: esz = 4; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  if (map == nullptr || rank < 1 || rank > uint32_t(kTensorMapMaxRank) || interleave != CU_TENSOR_MAP_INTERLEAVE_NONE ||
      oob != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE ||
      (swizzle != CU_TENSOR_MAP_SWIZZLE_NONE && swizzle != CU_TENSOR_MAP_SWIZZLE_128B))
    return CUDA_ERROR_INVALID_VALUE;
  if (reinterpret_cast<uintptr_t>(addr) % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
  for (uint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t(1) << 32) || box[i] == 0 || box[i] > 256 || elem_strides[i] != 1)
      return CUDA_ERROR_INVALID_VALUE;
    if (i > 0 && (strides[i - 1] % 16 != 0 || strides[i - 1] >= (uint64_t(1) << 40)))
      return CUDA_ERROR_INVALID_VALUE;
  }
  if (rank > 1 && strides[0] < dims[0] * esz) return CUDA_ERROR_INVALID_VALUE;
  if ((box[0] * esz) % 16 != 0) return CUDA_ERROR_INVALID_VALUE;
  if (swizzle == CU_TENSOR_MAP_SWIZZLE_128B && box[0] * esz > 128) return CUDA_ERROR_INVALID_VALUE;
  TensorMap m{};
  m.magic = kTensorMapMagic;
  m.base = static_cast<const unsigned char*>(addr);
  for (uint32_t i = 0; i < rank; ++i) {
    m.dims[i] = dims[i];
    m.box[i] = box[i];
    if (i > 0) m.strides[i - 1] = strides[i - 1];
  }
  m.rank = rank;
  m.esz = esz;
  m.swizzle128 = swizzle == CU_TENSOR_MAP_SWIZZLE_128B ? 1u : 0u;
  std::memset(map, 0, sizeof(CUtensorMap));
  std::memcpy(map, &m, sizeof(m));
  return CUDA_SUCCESS;
}

inline Barrier& barrier_at(uint32_t bar) {
  auto it = barriers.find(bar);
  if (it == barriers.end()) throw std::logic_error("emu: mbarrier used before mbarrier.init");
  return it->second;
}

inline void mbarrier_init(uint32_t bar, uint32_t count) {
  if (bar % 8 != 0) throw std::logic_error("emu: mbarrier not 8-byte aligned");
  shared_at(bar, 8);
  if (count == 0) throw std::logic_error("emu: mbarrier.init with count 0");
  Barrier b;
  b.count = b.pending = static_cast<int>(count);
  barriers[bar] = b;
}

inline void complete_phase_if_done(Barrier& b) {
  if (b.pending == 0 && b.tx == 0) {
    b.phase ^= 1u;
    b.pending = b.count;
  }
}

inline void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  Barrier& b = barrier_at(bar);
  b.tx += bytes;
  if (--b.pending < 0) throw std::logic_error("emu: more mbarrier arrivals than its count");
  complete_phase_if_done(b);
}

// cp.async.bulk.tensor.<n>d.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [map, {c[0], ..}], [bar]
inline void bulk_tensor_load(uint32_t dst, const void* map_ptr, const int* c, int n, uint32_t bar) {
  TensorMap m;
  std::memcpy(&m, map_ptr, sizeof(m));
  if (m.magic != kTensorMapMagic) throw std::logic_error("emu: cp.async.bulk.tensor with a map that was not encoded");
  if (uint32_t(n) != m.rank)
    throw std::logic_error("emu: cp.async.bulk.tensor." + std::to_string(n) + "d with a map of rank " +
                           std::to_string(m.rank));
  if (dst % 128 != 0) throw std::logic_error("emu: cp.async.bulk.tensor destination not 128-byte aligned");
  Barrier& b = barrier_at(bar);
  uint32_t rows = 1;  // box rows: the product of the outer box extents
  for (uint32_t i = 1; i < m.rank; ++i) rows *= m.box[i];
  const uint32_t row_bytes = m.box[0] * m.esz, bytes = row_bytes * rows;
  unsigned char* base = shared_at(dst, bytes);
  BulkCopy copy{base, {}, bytes};
  for (uint32_t r = 0; r < rows; ++r) {
    // Row r's global coordinates on dims 1.. (dim 1 fastest) and whether they are inside the tensor.
    bool in_rows = true;
    uint64_t offset = 0;
    for (uint32_t i = 1, rest = r; i < m.rank; rest /= m.box[i], ++i) {
      const int64_t x = int64_t(c[i]) + rest % m.box[i];
      if (x < 0 || uint64_t(x) >= m.dims[i]) in_rows = false;
      else offset += uint64_t(x) * m.strides[i - 1];
    }
    for (uint32_t cb = 0; cb < row_bytes; cb += 16) {
      uint32_t a = dst + r * row_bytes + cb;
      if (m.swizzle128) a ^= ((a >> 7) & 7u) << 4;
      // A 16-byte chunk holds 16 / esz consecutive elements: wholly in or out of the tensor
      // (columns c0 a chunk multiple; a chunk straddling the edge is not emulated).
      const int64_t col = int64_t(c[0]) + cb / m.esz;
      const bool in = in_rows && col >= 0 && uint64_t(col) < m.dims[0];
      if (in && (uint64_t(col) + 16 / m.esz > m.dims[0]))
        throw std::logic_error("emu: cp.async.bulk.tensor chunk straddles the tensor's edge (not emulated)");
      if (!in && col < 0 && col + 16 / m.esz > 0)
        throw std::logic_error("emu: cp.async.bulk.tensor chunk straddles the tensor's edge (not emulated)");
      copy.chunks.emplace_back(a, in ? m.base + offset + uint64_t(col) * m.esz : nullptr);
    }
  }
  std::memset(base, 0xff, bytes);  // poisoned until the copy lands
  b.copies.push_back(std::move(copy));
  tma_boxes.fetch_add(1);
}

inline void bulk_tensor_load_2d(uint32_t dst, const void* map_ptr, int c0, int c1, uint32_t bar) {
  const int c[2] = {c0, c1};
  bulk_tensor_load(dst, map_ptr, c, 2, bar);
}

// Lets the barrier's phase of parity `parity` complete from what is already in flight: bulk copies
// land (complete_tx) and the cp.async.mbarrier.arrive of other threads fire once their copies have
// landed, oldest first, until that phase has completed or nothing in flight is left. True when the
// phase has completed.
inline bool mbarrier_progress(uint32_t bar, uint32_t parity) {
  Barrier& b = barrier_at(bar);
  while (b.phase == (parity & 1u) && (!b.copies.empty() || !b.cp_arrivals.empty())) {
    if (!b.copies.empty()) {
      BulkCopy c = std::move(b.copies.front());
      b.copies.pop_front();
      for (const auto& [a, src] : c.chunks) {
        unsigned char* d = shared_at(a, 16);
        if (src) std::memcpy(d, src, 16);
        else std::memset(d, 0, 16);
      }
      b.tx -= c.bytes;
    } else {
      const auto [t, seq] = b.cp_arrivals.front();
      b.cp_arrivals.pop_front();
      land_copies(t, seq);
      if (--b.pending < 0) throw std::logic_error("emu: more mbarrier arrivals than its count (cp.async.mbarrier.arrive)");
    }
    complete_phase_if_done(b);
  }
  return b.phase != (parity & 1u);
}

// mbarrier.try_wait.parity in a loop: returns once the phase of parity `parity` has completed.
// Copies in flight on the barrier land first (mbarrier_progress); a phase that needs arrivals other
// threads have not made yet blocks this fiber until they make them (a deadlock if none can).
inline void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
  if (mbarrier_progress(bar, parity)) return;
  block_on(Blocker{kMbarrierPhase, bar, parity & 1u});
}

// mbarrier.arrive.shared::cta.b64: one arrival.
inline void mbarrier_arrive(uint32_t bar) {
  Barrier& b = barrier_at(bar);
  if (--b.pending < 0) throw std::logic_error("emu: more mbarrier arrivals than its count");
  complete_phase_if_done(b);
}

// mbarrier.expect_tx: `bytes` more transaction bytes expected in the current phase (no arrival).
inline void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  Barrier& b = barrier_at(bar);
  b.tx += bytes;
}

// cp.async.mbarrier.arrive.noinc.shared::cta.b64: an arrival on the barrier once every cp.async this
// thread issued before it has completed; .noinc: the arrival counts against the barrier's expected
// count (which must include it). Here it fires when a thread waits on the barrier (the copies land
// then), or never if no thread does.
inline void cp_async_mbarrier_arrive_noinc(uint32_t bar) {
  const int me = static_cast<int>(threadIdx_.x);
  barrier_at(bar).cp_arrivals.emplace_back(me, async_state[me].issued);
}

// ---- sm_90: named barriers, setmaxnreg, wgmma --------------------------------------------------
// What the warp-specialized Hopper kernels (csrc/cuda/sm90_ptx.cuh) use beyond the mbarriers above.
// Each instruction is modelled from the PTX ISA (9.7.13 bar / barrier, 9.7.17 setmaxnreg, 9.7.15
// wgmma: "Register Fragments and Shared Memory Matrix Layouts", "Matrix Descriptor Format"), with the
// misuse the ISA leaves undefined (or that would hang) turned into an exception naming it.

// bar.sync / bar.arrive a, b (barrier.cta.{sync,arrive}.aligned): named barrier a (1..15 here: 0
// is __syncthreads' barrier) completes when b threads arrived, b a multiple of the warp size; sync
// waits for the completion, arrive does not. The hardware counts a warp's arrival as 32; here every
// thread arrives (the kernels use whole warps). The count of a phase is set by its first arrival; an
// arrival with another count is an error (on a GPU: undefined, a hang or a barrier that completes early).
struct NamedBarrier {
  int count = 0, arrived = 0;
  std::vector<int> waiters;
};
inline NamedBarrier named_barriers[16];

inline NamedBarrier& named_arrive(uint32_t id, uint32_t count) {
  if (id == 0 || id >= 16) throw std::logic_error("emu: named barrier id outside 1..15 (0 is __syncthreads')");
  if (count == 0 || count % 32 != 0 || count > blockDim_.x)
    throw std::logic_error("emu: named barrier thread count not a positive multiple of 32 within the CTA");
  NamedBarrier& b = named_barriers[id];
  if (b.arrived > 0 && b.count != int(count))
    throw std::logic_error("emu: named barrier " + std::to_string(id) + " count mismatch: " + std::to_string(count) +
                           " while the phase in progress expects " + std::to_string(b.count));
  b.count = int(count);
  ++b.arrived;
  return b;
}

// Completes the barrier's phase if every expected thread arrived: releases the waiters. True if so.
inline bool named_complete(NamedBarrier& b) {
  if (b.arrived < b.count) return false;
  for (int t : b.waiters) sched.state[t] = kReady;
  sched.woke = sched.woke || !b.waiters.empty();
  b.waiters.clear();
  b.arrived = b.count = 0;
  return true;
}

inline void named_bar_sync(uint32_t id, uint32_t count) {
  NamedBarrier& b = named_arrive(id, count);
  if (named_complete(b)) return;
  b.waiters.push_back(sched.current);
  block_on(Blocker{kNamedBarrier, id, 0});
}

inline void named_bar_arrive(uint32_t id, uint32_t count) { named_complete(named_arrive(id, count)); }

// Warpgroup collectives: every thread publishes slots, then waits for the 128 threads of its
// warpgroup (all must be live: the .sync.aligned instructions need the whole warpgroup).
inline int wg_first(int me) { return me - me % 128; }
inline void wg_exchange_barrier() {
  const int me = static_cast<int>(threadIdx_.x);
  if (wg_first(me) + 128 > static_cast<int>(blockDim_.x))
    throw std::logic_error("emu: a warpgroup instruction in a CTA whose threads do not fill the warpgroup");
  wait_at(kAtWgBarrier);  // (release() checks that no thread of the warpgroup has exited)
}

// setmaxnreg.{inc,dec}.sync.aligned.u32 n: the per-thread register limit of each warp of the
// warpgroup becomes n (a multiple of 8 in 24..256, the same in all 128 threads). Registers come from
// a per-CTA pool holding what the launch gave the CTA (here: 65536 / threads, rounded down to 8,
// at most 256, per thread); .dec returns the difference to the pool, .inc takes it, waiting until the
// pool has it (a deadlock if no warp ever releases enough). .inc below / .dec above the current
// limit is an error. No effect on the emulated data.
inline int maxnreg_pool = 0;
inline std::vector<int> maxnreg_of_warp;

inline void setmaxnreg(bool inc, uint32_t n) {
  const int me = static_cast<int>(threadIdx_.x);
  if (n < 24 || n > 256 || n % 8 != 0)
    throw std::logic_error("emu: setmaxnreg count " + std::to_string(n) + " not a multiple of 8 in 24..256");
  put(me, 0, uint64_t(n) | (uint64_t(inc) << 32));
  wg_exchange_barrier();
  for (int t = wg_first(me); t < wg_first(me) + 128; ++t)
    if (get<uint64_t>(t, 0) != (uint64_t(n) | (uint64_t(inc) << 32)))
      throw std::logic_error("emu: setmaxnreg differs between the threads of a warpgroup");
  wg_exchange_barrier();  // every thread has read the slots
  if (me % 128 == 0) {    // the warpgroup's first thread moves its 4 warps' registers
    const int w0 = me / 32;
    int delta = 0;
    for (int w = w0; w < w0 + 4; ++w) {
      const int cur = maxnreg_of_warp[w];
      if (inc ? int(n) < cur : int(n) > cur)
        throw std::logic_error(std::string("emu: setmaxnreg.") + (inc ? "inc below" : "dec above") +
                               " the current register count " + std::to_string(cur));
      delta += (int(n) - cur) * 32;
    }
    if (delta > maxnreg_pool) block_on(Blocker{kMaxnreg, uint32_t(delta), 0});
    maxnreg_pool -= delta;
    for (int w = w0; w < w0 + 4; ++w) maxnreg_of_warp[w] = int(n);
  }
  wg_exchange_barrier();  // the warpgroup continues once its registers are granted
}

// ---- wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16} ------------------------------
// The matrix descriptor (PTX ISA "Matrix Descriptor Format"): bits 0-13 start address >> 4, 16-29
// leading dimension byte offset (LBO) >> 4, 32-45 stride dimension byte offset (SBO) >> 4, 49-51
// base offset, 62-63 swizzle (0 none, 1 128B, 2 64B, 3 32B); other bits 0 here. Base offsets other
// than 0 are not modelled (an error): a swizzled operand's repeating pattern must then start at a
// 1024 / 512 / 256-byte boundary of the shared window, which is checked below.
enum class Swz : int { kNone = 0, k128 = 1, k64 = 2, k32 = 3 };
struct SmemDesc {
  uint32_t start, lbo, sbo;
  Swz swz;
};
inline SmemDesc decode_desc(uint64_t d) {
  const uint64_t reserved = d & ~((0x3fffull) | (0x3fffull << 16) | (0x3fffull << 32) | (7ull << 49) | (3ull << 62));
  if (reserved != 0) throw std::logic_error("emu: wgmma descriptor with reserved bits set");
  if (((d >> 49) & 7) != 0) throw std::logic_error("emu: wgmma descriptor base offset != 0 (not modelled)");
  return SmemDesc{uint32_t(d & 0x3fff) << 4, uint32_t((d >> 16) & 0x3fff) << 4, uint32_t((d >> 32) & 0x3fff) << 4,
                  static_cast<Swz>(d >> 62)};
}
// Swizzle width (bytes of one swizzled row) and the XOR of the ISA's Swizzle<B, 4, 3> on a byte
// address: bits [7, 7 + B) XOR into bits [4, 4 + B), B = 3 / 2 / 1 for 128B / 64B / 32B (applied to
// the full shared-window address, which is why the patterns must be aligned).
inline uint32_t swz_width(Swz s) { return s == Swz::k128 ? 128 : s == Swz::k64 ? 64 : s == Swz::k32 ? 32 : 16; }
inline uint32_t swizzle_addr(uint32_t a, Swz s) {
  const uint32_t bits = s == Swz::k128 ? 7 : s == Swz::k64 ? 3 : s == Swz::k32 ? 1 : 0;
  return a ^ (((a >> 7) & bits) << 4);
}

// Byte address of element (mn, k) (mn: the row of A (M) or of B^T (N); k < 16) of a 16-bit operand,
// from the ISA's canonical layouts ("Canonical Layouts", CuTe notation, T = 8 16-bit elements per 16
// bytes, strides in elements, LBO / SBO in bytes):
//   K-major   none: ((8,m),(T,2k)):((1T,SBO),(1,LBO))   32B / 64B / 128B: ((8,m),(T,2k)):((2T|4T|8T,SBO),(1,T))
//   MN-major  none: ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))  swizzled W = 2 | 4 | 8 chunks per row:
//                   ((T,W,m),(8,k)):((1,T,LBO),(W T,SBO))
// then the swizzle XOR on the resulting address.
inline uint32_t operand_addr(const SmemDesc& d, bool mn_major, int mn, int k) {
  uint32_t off;
  const uint32_t w = swz_width(d.swz);
  if (!mn_major) {
    const uint32_t r0 = mn % 8, r1 = mn / 8, k0 = k % 8, k1 = k / 8;
    off = d.swz == Swz::kNone ? r0 * 16 + r1 * d.sbo + k0 * 2 + k1 * d.lbo : r0 * w + r1 * d.sbo + k * 2;
  } else {
    const uint32_t k0 = k % 8, k1 = k / 8;
    if (d.swz == Swz::kNone) {
      off = (mn % 8) * 2 + (mn / 8) * d.sbo + k0 * 16 + k1 * d.lbo;
    } else {
      const uint32_t per_row = w / 2;  // 16-bit elements per swizzled row
      off = (mn % per_row) * 2 + (mn / per_row) * d.lbo + k0 * w + k1 * d.sbo;
    }
  }
  return swizzle_addr(d.start + off, d.swz);
}
// The checks a descriptor must pass before it is read: a swizzled operand starts in the first row of
// its repeating pattern (base offset 0: the pattern is aligned to its 1024 / 512 / 256 bytes).
inline void check_desc(const SmemDesc& d) {
  if (d.swz != Swz::kNone) {
    const uint32_t pattern = 8 * swz_width(d.swz);
    if (d.start % pattern >= swz_width(d.swz))
      throw std::logic_error("emu: wgmma descriptor of a swizzled operand whose start is not in the first row of a "
                             "repeating pattern aligned to " + std::to_string(pattern) +
                             " bytes (base offset 0; the swizzle atoms must be aligned)");
  }
}

inline float bits16(uint16_t h, bool f16) { return half_bits_to_float(h, f16); }
inline float operand_elem(const SmemDesc& d, bool mn_major, int mn, int k, bool f16) {
  uint16_t h;
  std::memcpy(&h, shared_at(operand_addr(d, mn_major, mn, k), 2), 2);
  return bits16(h, f16);
}

// One issued wgmma of one thread: its inputs (to recompute it at the wait and compare: a shared
// operand or A register changed while in flight is an error) and its result (written to the
// accumulator registers at the wait; until then they hold NaN).
struct WgmmaOp {
  float* d;
  int n;
  bool f16, rs, ta, tb;
  int sa, sb;               // imm-scale-a / -b: 1 or -1
  uint64_t da, db;
  float a_rows[2][16];      // RS: this thread's two rows of A, gathered at the issue
  const uint32_t* a_regs;   // RS: the thread's own A registers, which must not change until the wait
  uint32_t a_snap[4];
  std::vector<float> d_in, result;
};
struct WgmmaThread {
  bool fenced = false;                       // wgmma.fence since the last wgmma.wait_group
  std::vector<WgmmaOp> open;                 // issued since the last commit_group
  std::deque<std::vector<WgmmaOp>> groups;   // committed, not yet waited; oldest first
  std::map<float*, int> in_flight;           // accumulator address -> ops in flight on it
};
inline std::vector<WgmmaThread> wgmma_state;

// The value of a thread's accumulators (rows r, r + 8 of its warp's 16, columns 8 i + 2 t + {0, 1};
// PTX ISA "Matrix Fragments for wgmma.mma_async.m64nNk16", Figure "accumulator matrix D"; CuTe's
// CLayout_64xN) computed from the operands: acc[v], v = 4 i + 2 h + e <-> row 16 w + g + 8 h,
// column 8 i + 2 t + e (w = warp of the warpgroup, g = lane / 4, t = lane % 4).
inline void wgmma_compute(const WgmmaOp& op, int me, std::vector<float>& acc) {
  const int lane = me % 32, w = (me % 128) / 32, g = lane / 4, t = lane % 4;
  const SmemDesc db = decode_desc(op.db);
  SmemDesc da{};
  if (!op.rs) da = decode_desc(op.da);
  acc.assign(op.n / 2, 0.0f);
  for (int h = 0; h < 2; ++h) {
    const int m = 16 * w + g + 8 * h;
    float a[16];
    for (int k = 0; k < 16; ++k) a[k] = (op.rs ? op.a_rows[h][k] : operand_elem(da, op.ta, m, k, op.f16)) * op.sa;
    for (int i = 0; i < op.n / 8; ++i) {
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * i + 2 * t + e;
        float s = 0.0f;
        for (int k = 0; k < 16; ++k) s += a[k] * (operand_elem(db, op.tb, col, k, op.f16) * op.sb);  // exact products
        acc[4 * i + 2 * h + e] = s;
      }
    }
  }
}

inline void wgmma_fence() { wgmma_state[threadIdx_.x].fenced = true; }

// wgmma.mma_async: d (n / 2 floats of this thread) = (scale_d ? d : 0) + A B, A 64 x 16 from shared
// memory (da; ta: M-major) or registers (a: 4 x 32 bits, the mma.sync m16n8k16 A layout of the
// thread's warp, rows 16 w ..: CuTe's ALayout_64x16), B 16 x n from shared memory (db; tb: N-major).
// The descriptors and the shape must be the same in the 128 threads. Needs a wgmma.fence since the
// last wgmma.wait_group of the thread (ISA: before the first wgmma and between register accesses
// and a wgmma that uses those registers).
inline void wgmma(int n, bool f16, bool rs, uint64_t da, const uint32_t* a, uint64_t db, float* d, int scale_d,
                  int sa, int sb, int ta, int tb) {
  const int me = static_cast<int>(threadIdx_.x);
  WgmmaThread& st = wgmma_state[me];
  if (n < 8 || n > 256 || n % 8 != 0) throw std::logic_error("emu: wgmma n not a multiple of 8 in 8..256");
  if (!st.fenced) throw std::logic_error("emu: wgmma.mma_async without a wgmma.fence after the last wgmma.wait_group");
  const uint64_t shape = uint64_t(n) | uint64_t(f16) << 16 | uint64_t(rs) << 17 | uint64_t(ta) << 18 |
                         uint64_t(tb) << 19 | uint64_t(sa < 0) << 20 | uint64_t(sb < 0) << 21 | uint64_t(scale_d != 0) << 22;
  put(me, 0, rs ? 0 : da);
  put(me, 1, db);
  put(me, 2, shape);
  if (rs) {
    put(me, 3, uint64_t(a[0]) | uint64_t(a[1]) << 32);
    put(me, 4, uint64_t(a[2]) | uint64_t(a[3]) << 32);
  }
  wg_exchange_barrier();
  const int w0 = wg_first(me);
  for (int t = w0; t < w0 + 128; ++t)
    if (get<uint64_t>(t, 0) != get<uint64_t>(me, 0) || get<uint64_t>(t, 1) != db || get<uint64_t>(t, 2) != shape)
      throw std::logic_error("emu: wgmma descriptors / shape / scale-d differ between the threads of a warpgroup");
  WgmmaOp op;
  op.d = d, op.n = n, op.f16 = f16, op.rs = rs, op.ta = ta != 0, op.tb = tb != 0, op.sa = sa, op.sb = sb;
  op.da = da, op.db = db, op.a_regs = a;
  if (!rs) check_desc(decode_desc(da));
  check_desc(decode_desc(db));
  if (rs) {
    std::memcpy(op.a_snap, a, sizeof(op.a_snap));
    // A[m][k] sits in thread (m / 16) * 32 + (m % 8) * 4 + (k % 8) / 2 of the warpgroup, register
    // (m % 16) / 8 + 2 (k / 8), half k % 2.
    const int lane = me % 32, w = (me % 128) / 32;
    for (int h = 0; h < 2; ++h) {
      const int m = 16 * w + lane / 4 + 8 * h;
      for (int k = 0; k < 16; ++k) {
        const int owner = w0 + (m / 16) * 32 + (m % 8) * 4 + (k % 8) / 2, reg = (m % 16) / 8 + 2 * (k / 8);
        const uint64_t pair = get<uint64_t>(owner, 3 + reg / 2);
        const uint32_t r32 = uint32_t(pair >> (32 * (reg % 2)));
        op.a_rows[h][k] = bits16(uint16_t((k % 2) ? r32 >> 16 : r32 & 0xffffu), f16);
      }
    }
  }
  wg_exchange_barrier();  // every thread has read the slots
  // The accumulator input: the pending result of an earlier wgmma on the same registers (in flight:
  // the registers hold NaN), else the registers.
  op.d_in.assign(n / 2, 0.0f);
  if (scale_d) {
    const std::vector<float>* last = nullptr;  // the newest op in flight on d (open ops are newer)
    for (const auto& grp : st.groups)
      for (const WgmmaOp& o : grp)
        if (o.d == d) last = &o.result;
    for (const WgmmaOp& o : st.open)
      if (o.d == d) last = &o.result;
    if (last) {
      if (int(last->size()) != n / 2) throw std::logic_error("emu: chained wgmma on the same registers with another n");
      op.d_in = *last;
    } else {
      for (int i = 0; i < n / 2; ++i) op.d_in[i] = d[i];
    }
  }
  std::vector<float> acc;
  wgmma_compute(op, me, acc);
  op.result.resize(n / 2);
  for (int i = 0; i < n / 2; ++i) op.result[i] = op.d_in[i] + acc[i];
  for (int i = 0; i < n / 2; ++i) d[i] = NAN;  // not visible before the wait
  ++st.in_flight[d];
  st.open.push_back(std::move(op));
}

inline void wgmma_commit() {
  WgmmaThread& st = wgmma_state[threadIdx_.x];
  st.groups.push_back(std::move(st.open));  // an empty group is a group too
  st.open.clear();
}

// wgmma.wait_group n: the groups of this thread older than its n most recent complete; their results
// reach the registers. Each op is recomputed from the shared memory and A registers as they are now:
// a difference from what it read at the issue means they changed while the wgmma was in flight (a
// stage released or overwritten too early, A registers reused), an error. Uncommitted wgmma at a
// wait are an error too (commit_group missing: they would belong to no group the wait could name).
inline void wgmma_wait(int n) {
  const int me = static_cast<int>(threadIdx_.x);
  if (!wgmma_state[me].open.empty())
    throw std::logic_error("emu: wgmma.wait_group with wgmma.mma_async not committed (commit_group missing)");
  // The products complete as late as possible: every other thread runs until it blocks first (a
  // producer refilling a stage released before this wait overwrites the operands, which the
  // recomputation below sees).
  wait_at(kYielded);
  WgmmaThread& st = wgmma_state[me];
  while (st.groups.size() > static_cast<size_t>(n)) {
    for (WgmmaOp& op : st.groups.front()) {
      if (op.rs && std::memcmp(op.a_regs, op.a_snap, sizeof(op.a_snap)) != 0)
        throw std::logic_error("emu: the A registers of a wgmma in flight changed before its wgmma.wait_group");
      std::vector<float> acc;
      wgmma_compute(op, me, acc);
      for (int i = 0; i < op.n / 2; ++i) {
        const float x = op.d_in[i] + acc[i];
        if (std::memcmp(&x, &op.result[i], 4) != 0 && !(std::isnan(x) && std::isnan(op.result[i])))
          throw std::logic_error("emu: shared memory read by a wgmma in flight changed before its wgmma.wait_group");
      }
      for (int i = 0; i < op.n / 2; ++i) op.d[i] = op.result[i];
      if (--st.in_flight[op.d] == 0) st.in_flight.erase(op.d);
    }
    st.groups.pop_front();
  }
  st.fenced = false;
}

// ---- programmatic dependent launch (PDL: griddepcontrol; csrc/cuda/sm90_ptx.cuh) -----------------------
// Grids run one after another here, so a dependent grid never overlaps its predecessor; what the model checks
// is the rule a GPU run depends on: in a grid launched with cudaLaunchAttributeProgrammaticStreamSerialization
// (launch_ex), every read of the predecessor's output (griddep_read) comes after the reading thread's
// griddepcontrol.wait, and every CTA executes griddepcontrol.wait in some thread (a CTA that never waits may
// run wholly before its predecessor's writes land). launch_dependents is counted, nothing else: it only lets
// the dependent start earlier, never makes the predecessor's writes visible.
struct PdlState {
  bool launched = false;        // the running grid was launched with programmatic stream serialization
  std::vector<char> waited;     // per thread of the current CTA: griddepcontrol.wait executed
  uint64_t pdl_launches = 0, triggers = 0;  // totals since the process started (emu_ops reports them)
};
inline PdlState pdl;
inline void griddep_wait() { pdl.waited[sched.current] = 1; }
inline void griddep_launch_dependents() { ++pdl.triggers; }
inline void griddep_check_read() {
  if (pdl.launched && !pdl.waited[sched.current])
    throw std::logic_error("emu: a grid launched with programmatic stream serialization read its predecessor's "
                           "output before griddepcontrol.wait (thread " + std::to_string(sched.current) + ")");
}

inline void reset_sm90_state(int n) {
  pdl.waited.assign(n, 0);
  for (NamedBarrier& b : named_barriers) b = NamedBarrier{};
  wgmma_state.assign(n, WgmmaThread{});
  const int warps = (n + 31) / 32;
  const int regs = std::min(256, (65536 / (warps * 32)) / 8 * 8);
  maxnreg_of_warp.assign(warps, regs);
  maxnreg_pool = 0;
}

inline bool can_wake(int t) {
  const Blocker& b = sched.blocked_on[t];
  switch (b.kind) {
    case kNamedBarrier: return false;  // released by the arrival that completes it
    case kMbarrierPhase: return mbarrier_progress(b.a, b.b);
    case kMaxnreg: return maxnreg_pool >= int(b.a);
  }
  return false;
}

// What each unfinished thread waits for, runs of equal states folded (the deadlock message).
inline std::string waiting_report(int n) {
  auto what = [](int t) -> std::string {
    switch (sched.state[t]) {
      case kAtBlockBarrier: return "__syncthreads";
      case kAtWarpBarrier: return "a warp collective";
      case kAtWgBarrier: return "a warpgroup collective";
      case kBlocked: {
        const Blocker& b = sched.blocked_on[t];
        if (b.kind == kNamedBarrier)
          return "named barrier " + std::to_string(b.a) + " (" + std::to_string(named_barriers[b.a].arrived) + " of " +
                 std::to_string(named_barriers[b.a].count) + " arrived)";
        if (b.kind == kMbarrierPhase) return "mbarrier @" + std::to_string(b.a) + " phase parity " + std::to_string(b.b);
        return "setmaxnreg.inc (registers)";
      }
      case kReady: return "ready";
      case kYielded: return "wgmma.wait_group";
      default: return "";
    }
  };
  std::string out;
  for (int t = 0; t < n;) {
    if (sched.state[t] == kDone) { ++t; continue; }
    const std::string w = what(t);
    int u = t + 1;
    while (u < n && sched.state[u] != kDone && what(u) == w) ++u;
    out += (out.empty() ? "" : "; ") + std::string("threads ") + std::to_string(t) + "-" + std::to_string(u - 1) + ": " + w;
    t = u;
  }
  return out;
}

// A CTA must not end with wgmma in flight or a named barrier phase half arrived.
inline void end_cta_checks(int n) {
  if (pdl.launched && std::none_of(pdl.waited.begin(), pdl.waited.end(), [](char c) { return c != 0; }))
    throw std::logic_error("emu: a CTA of a grid launched with programmatic stream serialization never executed "
                           "griddepcontrol.wait");
  for (int t = 0; t < n; ++t)
    if (!wgmma_state[t].open.empty() || !wgmma_state[t].groups.empty())
      throw std::logic_error("emu: a thread ended with wgmma.mma_async in flight (no wgmma.wait_group)");
  for (int id = 1; id < 16; ++id)
    if (named_barriers[id].arrived != 0)
      throw std::logic_error("emu: the CTA ended with named barrier " + std::to_string(id) + " part-way (" +
                             std::to_string(named_barriers[id].arrived) + " of " +
                             std::to_string(named_barriers[id].count) + " arrived)");
}

}  // namespace emu

inline float __fmul_rn(float a, float b) { return a * b; }  // built with -ffp-contract=off
inline float __fadd_rn(float a, float b) { return a + b; }

// Runtime calls the launchers make, on host memory.
namespace emu {
inline cudaError_t get_last_error() { return cudaSuccess; }
inline cudaError_t memcpy_async(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t) {
  std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t memcpy_2d_async(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                   size_t height, cudaMemcpyKind, cudaStream_t) {
  if (width > dpitch || width > spitch) return cudaErrorInvalidPitchValue;
  for (size_t h = 0; h < height; ++h)
    std::memmove(static_cast<char*>(dst) + h * dpitch, static_cast<const char*>(src) + h * spitch, width);
  return cudaSuccess;
}
inline cudaError_t memset_async(void* dst, int value, size_t n, cudaStream_t) {
  std::memset(dst, value, n);
  return cudaSuccess;
}
inline cudaError_t get_device(int* d) {
  *d = 0;
  return cudaSuccess;
}
// An integer from the environment, or `fallback` when unset or empty.
inline int env_int(const char* name, int fallback) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoi(e) : fallback;
}

// A small sm_90 part: few SMs so that the attention planner splits the keys of few work items
// (KVKERNELS_EMU_SM_COUNT overrides; attention.cu caches the value per process). Shared memory as on
// an H100 / H200 (227 KiB per block opt-in, 228 KiB per SM); KVKERNELS_EMU_SMEM_OPTIN /
// KVKERNELS_EMU_SMEM_PER_SM (bytes) model smaller parts (mla_decompress.cu reads them per call; the
// MLA attention planner caches its first answer per process).
inline int smem_optin() { return env_int("KVKERNELS_EMU_SMEM_OPTIN", 227 * 1024); }
inline cudaError_t device_get_attribute(int* v, cudaDeviceAttr attr, int) {
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: {
      const char* e = std::getenv("KVKERNELS_EMU_SM_COUNT");
      *v = e && *e ? std::atoi(e) : 4;
      break;
    }
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    case cudaDevAttrMaxPitch: *v = INT_MAX; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = smem_optin(); break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *v = env_int("KVKERNELS_EMU_SMEM_PER_SM", 228 * 1024); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
// Opt-in dynamic shared memory: sm_90 allows 227 KiB per block (or KVKERNELS_EMU_SMEM_OPTIN).
template <typename K>
cudaError_t func_set_attribute(K, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize && (value < 0 || value > smem_optin()))
    return cudaErrorInvalidValue;
  return cudaSuccess;
}
inline const char* get_error_string(cudaError_t e) {
  return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument" : "emulated CUDA error";
}
inline cudaError_t peek_at_last_error() { return cudaSuccess; }
// The PTX version of a kernel's device code (mla_decompress.cu reads it to decide whether the TMA
// variant was compiled for sm_90): 90, unless KVKERNELS_EMU_PTX_VERSION says otherwise (read at the
// launcher's first query; it caches the answer per device).
template <typename K>
cudaError_t func_get_attributes(cudaFuncAttributes* attr, K) {
  *attr = cudaFuncAttributes{};
  const char* e = std::getenv("KVKERNELS_EMU_PTX_VERSION");
  attr->ptxVersion = attr->binaryVersion = e && *e ? std::atoi(e) : 90;
  return cudaSuccess;
}
// cudaLaunchKernelEx: the launch configuration of `cfg` with its attributes; only programmatic stream
// serialization (PDL, above) is modelled, any other attribute fails the launch.
template <typename K, typename... Args>
cudaError_t launch_ex(const cudaLaunchConfig_t* cfg, K kernel, Args&&... args) {
  // (by position: gridDim / blockDim are macros here)
  const auto& [grid, block, smem, stream, attrs, num_attrs] = *cfg;
  bool serialization = false;
  for (unsigned i = 0; i < num_attrs; ++i) {
    const cudaLaunchAttribute& at = attrs[i];
    if (at.id != cudaLaunchAttributeProgrammaticStreamSerialization)
      throw std::logic_error("emu: cudaLaunchKernelEx with an attribute the emulator does not model");
    serialization = at.val.programmaticStreamSerializationAllowed != 0;
  }
  struct Reset {
    ~Reset() { pdl.launched = false; }
  } reset;
  pdl.launched = serialization;
  pdl.pdl_launches += serialization ? 1 : 0;
  launch(kernel, grid, block, smem, stream, std::forward<Args>(args)...);
  return cudaSuccess;
}
// Driver entry points: cuTensorMapEncodeTiled only (the emulator's, above).
inline cudaError_t get_driver_entry_point_by_version(const char* name, void** ptr, unsigned, unsigned long long,
                                                     cudaDriverEntryPointQueryResult* status) {
  const bool found = std::strcmp(name, "cuTensorMapEncodeTiled") == 0;
  *ptr = found ? reinterpret_cast<void*>(&tensor_map_encode_tiled) : nullptr;
  if (status) *status = found ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
}  // namespace emu

#define cudaGetLastError ::emu::get_last_error
#define cudaMemcpyAsync ::emu::memcpy_async
#define cudaMemsetAsync ::emu::memset_async
#define cudaMemcpy2DAsync ::emu::memcpy_2d_async
#define cudaGetDevice ::emu::get_device
#define cudaDeviceGetAttribute ::emu::device_get_attribute
#define cudaFuncSetAttribute ::emu::func_set_attribute
#define cudaGetErrorString ::emu::get_error_string
#define cudaPeekAtLastError ::emu::peek_at_last_error
#define cudaFuncGetAttributes ::emu::func_get_attributes
#define cudaLaunchKernelEx ::emu::launch_ex
#undef cudaGetDriverEntryPointByVersion
#define cudaGetDriverEntryPointByVersion ::emu::get_driver_entry_point_by_version
