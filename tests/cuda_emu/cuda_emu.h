// A CPU stand-in for the CUDA execution model, enough to run the torch-free cache-op kernels of
// csrc/cuda/*.cuh with the host compiler (tests/test_cuda_emulated.py). It checks kernel *logic*
// (indexing, conversions, guards, vector-width choices) without a GPU; it says nothing about
// timing, memory ordering between CTAs, or hardware alignment faults.
//
// Each CTA runs as blockDim.x cooperative fibers (ucontext) on the calling thread; __syncthreads()
// switches to the next fiber, and a barrier completes when every live fiber of the CTA reached it.
// __shfl_up_sync goes through an exchange array between two warp-level barriers (every live fiber
// of the warp; the kernels only shuffle with full warps). CTAs run one after another. Launch syntax is rewritten by the
// test (kernel<<<g, b, s, st>>>(args) -> emu::launch(kernel, g, b, s, st, args)).
//
// Must be included before the CUDA headers: the __global__/__device__/... keywords become empty.
#pragma once

#define __global__
#define __device__
#define __host__
#define __grid_constant__
#define __launch_bounds__(...)
#define __shared__ static

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <tuple>
#include <vector>

using std::max;
using std::min;

namespace emu {

inline uint3 threadIdx_, blockIdx_;
inline dim3 gridDim_, blockDim_;

enum State { kReady, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Scheduler {
  std::vector<ucontext_t> fibers;
  std::vector<std::vector<char>> stacks;
  std::vector<int> state;
  ucontext_t main;
  void (*entry)(int) = nullptr;  // the launched kernel with its arguments bound
  int current = -1;
  std::vector<int64_t> exchange;  // __shfl_up_sync
};
inline Scheduler sched;

// Suspends the current fiber at a barrier of the given kind (kAtBlockBarrier: __syncthreads;
// kAtWarpBarrier: the implicit synchronization of a full-warp shuffle).
inline void wait_at(State kind) {
  const int me = sched.current;
  sched.state[me] = kind;
  swapcontext(&sched.fibers[me], &sched.main);
  threadIdx_ = make_uint3(static_cast<unsigned>(me), 0, 0);
}

template <typename K, typename... Args>
struct Entry {
  static inline K kernel;
  static inline std::tuple<Args...>* args;
  static void run(int me) {
    std::apply(kernel, *args);
    sched.state[me] = kDone;
  }
};

inline void trampoline(int me) {
  sched.entry(me);  // returning ends the fiber (uc_link = main)
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
  for (int w = 0; w < n; w += 32) {
    bool all_warp = true, live = false;
    for (int t = w; t < std::min(n, w + 32); ++t) {
      if (sched.state[t] == kDone) continue;
      live = true;
      all_warp = all_warp && sched.state[t] == kAtWarpBarrier;
    }
    if (live && all_warp) {
      for (int t = w; t < std::min(n, w + 32); ++t)
        if (sched.state[t] != kDone) sched.state[t] = kReady;
      released = true;
    }
  }
  return released;
}

template <typename K, typename... Args>
void launch(K kernel, dim3 grid, dim3 block, size_t /*smem*/, cudaStream_t /*stream*/, Args... args) {
  if (block.y != 1 || block.z != 1 || grid.z != 1) throw std::logic_error("emu: 1-D blocks, 2-D grids only");
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
  sched.exchange.assign(n, 0);
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      blockIdx_ = make_uint3(bx, by, 0);
      for (int t = 0; t < n; ++t) {
        sched.state[t] = kReady;
        sched.stacks[t].resize(64 * 1024);
        getcontext(&sched.fibers[t]);
        sched.fibers[t].uc_stack.ss_sp = sched.stacks[t].data();
        sched.fibers[t].uc_stack.ss_size = sched.stacks[t].size();
        sched.fibers[t].uc_link = &sched.main;
        makecontext(&sched.fibers[t], reinterpret_cast<void (*)()>(&trampoline), 1, t);
      }
      // Run every ready fiber up to its next barrier (or its end); then release the groups whose
      // fibers all arrived; until every fiber has ended.
      for (;;) {
        bool ran = false;
        for (int t = 0; t < n; ++t) {
          if (sched.state[t] != kReady) continue;
          ran = true;
          sched.current = t;
          threadIdx_ = make_uint3(static_cast<unsigned>(t), 0, 0);
          swapcontext(&sched.main, &sched.fibers[t]);
        }
        if (release(n)) continue;
        if (!ran) {
          for (int t = 0; t < n; ++t)
            if (sched.state[t] != kDone) throw std::logic_error("emu: barrier deadlock (divergent barriers)");
          break;
        }
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

template <typename T>
T __shfl_up_sync(unsigned /*mask*/, T x, unsigned d) {
  const int me = static_cast<int>(threadIdx.x);
  emu::sched.exchange[me] = static_cast<int64_t>(x);
  emu::wait_at(emu::kAtWarpBarrier);
  const int lane = me % 32;
  const T out = lane >= static_cast<int>(d) ? static_cast<T>(emu::sched.exchange[me - d]) : x;
  emu::wait_at(emu::kAtWarpBarrier);
  return out;
}

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
inline cudaError_t get_device(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t device_get_attribute(int* v, cudaDeviceAttr, int) {
  *v = 2147483647;  // cudaDevAttrMaxPitch on current GPUs
  return cudaSuccess;
}
}  // namespace emu

#define cudaGetLastError ::emu::get_last_error
#define cudaMemcpyAsync ::emu::memcpy_async
#define cudaMemcpy2DAsync ::emu::memcpy_2d_async
#define cudaGetDevice ::emu::get_device
#define cudaDeviceGetAttribute ::emu::device_get_attribute
