// Runtime of the MSL emulator (included by msl_shim.h when MSL_EMULATOR is defined).
//
// A dispatch runs its threadgroups one after another on the calling OS thread. The threads of a
// group are fibers (ucontext) that run cooperatively: a thread runs until it reaches
// threadgroup_barrier, a SIMD-group function, or its end. When no thread can run, the scheduler
//   1. completes one SIMD-group collective per SIMD group: among the lanes of that SIMD group that
//      wait at a collective, those at the earliest call site (line, column) form the active set
//      (structured control flow reconverges at later lines); every active lane's result is
//      computed from the active lanes' inputs, reads of inactive lanes are reported;
//   2. otherwise releases the barrier when every live thread of the group waits at the same
//      barrier call site, and reports a divergent barrier when they wait at different sites or
//      some threads have already returned.
// Threads are started and resumed in forward, reverse or random order (the lane order; groups are
// visited in the same order), so a result that depends on the order exposes a missing barrier.
//
// Memory: every threadgroup array (the Python side rewrites each `threadgroup T a[N];` into a
// reference obtained from tg_alloc) lives in its own mapping, ending exactly at a PROT_NONE guard
// page, filled with 0xFF at the start of every group; the bytes before it hold a canary that is
// checked when the group ends. The total is limited to 32 KiB, as on Apple GPUs. Every buffer
// argument (a tensor's whole storage, or the bytes of a scalar/list argument) is copied into a
// mapping that also ends at a guard page and copied back when the dispatch succeeds. A fault
// during a dispatch (an access past a threadgroup array or buffer, a wild pointer, a fiber stack
// overflow) is caught with SIGSEGV/SIGBUS, reported, and the dispatch is abandoned with no
// buffer written back.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace emu {

constexpr int kSimdWidth = 32;
constexpr size_t kThreadgroupLimit = 32 * 1024;
constexpr size_t kStackBytes = 256 * 1024;

enum class State { kRunnable, kBarrier, kSimd, kDone };
enum class Order { kForward = 0, kReverse = 1, kRandom = 2 };

struct Thread;
struct SimdGroup {
  Thread* lanes[kSimdWidth] = {};
};
// Computes one active lane's result of a collective from the inputs of all active lanes.
using SimdCompute = void (*)(Thread& self, SimdGroup& sg, ulong active);

struct Site {
  const char* file = "";
  unsigned line = 0, col = 0;
  bool operator==(const Site& o) const { return line == o.line && col == o.col && std::strcmp(file, o.file) == 0; }
  bool operator<(const Site& o) const {
    int c = std::strcmp(file, o.file);
    if (c != 0) return c < 0;
    return line != o.line ? line < o.line : col < o.col;
  }
};

struct Thread {
  ucontext_t ctx;
  char* stack = nullptr;
  State state = State::kRunnable;
  Site site;
  const char* what = "";  // the barrier or collective waited at
  // builtins
  uint pos_grid[3], pos_group[3], group_pos[3], group_size[3], dispatch_group_size[3];
  uint grid_size[3], groups_per_grid[3];
  uint index_in_group = 0, lane = 0, simd_index = 0, simds_per_group = 0;
  // pending collective
  SimdCompute compute = nullptr;
  alignas(16) unsigned char in[64];
  alignas(16) unsigned char out[64];
  int arg = 0;
};

struct Region {  // a mapping whose data ends at a PROT_NONE guard page
  char* map = nullptr;
  size_t map_bytes = 0;
  char* data = nullptr;
  size_t bytes = 0;
  char* guard = nullptr;
};

struct TgArray {
  Region r;
  const char* name = "";
  bool used = false;
};

struct LaunchDesc {  // filled by kvkernels/metal/emulator.py (ctypes); keep the layouts equal
  int32_t num_args;
  int32_t order;
  uint64_t seed;
  uint32_t grid[3];
  uint32_t group[3];
  void** base;          // [num_args] start of each argument's storage (or bytes)
  int64_t* nbytes;      // [num_args] storage size in bytes
  int64_t* offset;      // [num_args] byte offset of the bound pointer into the storage
  int32_t* storage_id;  // [num_args] arguments with the same id share one storage
};

struct Launch {
  const LaunchDesc* desc = nullptr;
  void (*invoke)(Thread&) = nullptr;
  const char* kernel_name = "";
  std::vector<void*> bufs;  // what each kernel argument points at (inside the guarded copies)
  std::vector<Region> storages;
  std::vector<TgArray> tg;
  size_t tg_total = 0;
  std::vector<Thread> threads;
  std::vector<SimdGroup> simds;
  std::string errors;
  int num_errors = 0;
  bool abort = false;
  ucontext_t sched;
  Thread* cur = nullptr;
};

inline Launch*& current_launch() {
  static thread_local Launch* l = nullptr;
  return l;
}
inline Launch& L() { return *current_launch(); }
inline Thread& cur() { return *L().cur; }

inline size_t page_size() {
  static size_t p = size_t(sysconf(_SC_PAGESIZE));
  return p;
}

inline std::string where(const Thread& t) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "thread_position_in_grid (%u, %u, %u), threadgroup (%u, %u, %u), "
                "thread_index_in_threadgroup %u, simd lane %u of simdgroup %u",
                t.pos_grid[0], t.pos_grid[1], t.pos_grid[2], t.group_pos[0], t.group_pos[1], t.group_pos[2],
                t.index_in_group, t.lane, t.simd_index);
  return buf;
}
inline std::string site_str(const Site& s) {
  return std::string(s.file) + ":" + std::to_string(s.line) + ":" + std::to_string(s.col);
}

inline void report(const std::string& msg) {
  Launch& l = L();
  if (l.num_errors < 20) {
    l.errors += "[";
    l.errors += l.kernel_name;
    l.errors += "] ";
    l.errors += msg;
    l.errors += "\n";
  }
  ++l.num_errors;
}

// Give control back to the scheduler (from a fiber).
inline void yield() { swapcontext(&cur().ctx, &L().sched); }

// Stops the whole dispatch (from a fiber): the scheduler sees `abort` and unwinds.
[[noreturn]] inline void fatal(const std::string& msg) {
  report(msg);
  L().abort = true;
  for (;;) yield();
}

inline Region map_region(size_t bytes, size_t align) {
  Region r;
  const size_t ps = page_size();
  const size_t data_pages = (bytes + align + ps - 1) / ps;
  r.map_bytes = (data_pages + 1) * ps;
  void* p = mmap(nullptr, r.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Region{};
  r.map = static_cast<char*>(p);
  r.guard = r.map + data_pages * ps;
  mprotect(r.guard, ps, PROT_NONE);
  r.bytes = bytes;
  r.data = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(r.guard) - bytes) & ~uintptr_t(align - 1));
  return r;
}
inline void unmap_region(Region& r) {
  if (r.map) munmap(r.map, r.map_bytes);
  r = Region{};
}

constexpr unsigned char kPoison = 0xFF;  // threadgroup memory at group start (NaN for floats)
constexpr unsigned char kCanary = 0xA5;  // bytes in front of a threadgroup array

// Threadgroup memory: the rewritten declaration `threadgroup T a[N];` calls this (every thread of
// the group gets the same pointer).
inline void* tg_alloc(int id, size_t bytes, size_t align, const char* name) {
  Launch& l = L();
  if (id >= int(l.tg.size())) l.tg.resize(size_t(id) + 1);
  TgArray& a = l.tg[size_t(id)];
  if (!a.used) {
    l.tg_total += (bytes + 15) & ~size_t(15);
    if (l.tg_total > kThreadgroupLimit) {
      fatal("threadgroup memory of " + std::to_string(l.tg_total) + " bytes exceeds the 32 KiB limit (at array '" +
            name + "')");
    }
    a.r = map_region(bytes, std::max<size_t>(align, 1));
    if (!a.r.map) fatal("emulator: out of memory for threadgroup array");
    std::memset(a.r.map, kCanary, size_t(a.r.data - a.r.map));
    std::memset(a.r.data, kPoison, bytes);
    a.name = name;
    a.used = true;
  }
  return a.r.data;
}

// ---- builtins ---------------------------------------------------------------------------------
template <typename T>
inline T builtin(const uint* v) {
  if constexpr (std::is_arithmetic<T>::value) {
    return T(v[0]);
  } else {
    T r;
    for (int i = 0; i < T::K; ++i) r[i] = decltype(+r[0])(v[i]);
    return r;
  }
}

// ---- signals: faults inside a dispatch ----------------------------------------------------------
struct FaultState {
  sigjmp_buf jmp;
  volatile sig_atomic_t active = 0;
  volatile uintptr_t addr = 0;
  struct sigaction old_segv, old_bus;
  stack_t old_stack;
  char* alt_stack = nullptr;
};
inline FaultState& fault_state() {
  static thread_local FaultState f;
  return f;
}
inline void on_fault(int sig, siginfo_t* info, void*) {
  FaultState& f = fault_state();
  if (!f.active) {  // not ours: restore the previous handler and let the fault repeat
    sigaction(SIGSEGV, &f.old_segv, nullptr);
    sigaction(SIGBUS, &f.old_bus, nullptr);
    return;
  }
  f.addr = reinterpret_cast<uintptr_t>(info->si_addr);
  (void)sig;
  siglongjmp(f.jmp, 1);
}

inline std::string describe_fault(Launch& l, uintptr_t addr) {
  auto in = [&](const Region& r, uintptr_t a) {
    return r.map && a >= reinterpret_cast<uintptr_t>(r.map) && a < reinterpret_cast<uintptr_t>(r.map) + r.map_bytes;
  };
  char buf[64];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(addr));
  for (const TgArray& a : l.tg) {
    if (a.used && in(a.r, addr)) {
      return "out-of-range threadgroup access: byte " +
             std::to_string(long(addr - reinterpret_cast<uintptr_t>(a.r.data))) + " of threadgroup array '" + a.name +
             "' (" + std::to_string(a.r.bytes) + " bytes)";
    }
  }
  for (size_t i = 0; i < l.storages.size(); ++i) {
    const Region& r = l.storages[i];
    if (in(r, addr)) {
      std::string args;
      for (int k = 0; k < l.desc->num_args; ++k) {
        if (l.desc->storage_id[k] == int(i)) args += (args.empty() ? "" : ", ") + std::to_string(k);
      }
      return "out-of-range device access: byte " + std::to_string(long(addr - reinterpret_cast<uintptr_t>(r.data))) +
             " of the buffer of argument(s) " + args + " (" + std::to_string(r.bytes) + " bytes)";
    }
  }
  for (const Thread& t : l.threads) {
    if (t.stack && addr >= reinterpret_cast<uintptr_t>(t.stack) &&
        addr < reinterpret_cast<uintptr_t>(t.stack) + page_size()) {
      return "stack overflow of an emulated thread";
    }
  }
  return std::string("invalid memory access at address ") + buf;
}

// ---- the scheduler ----------------------------------------------------------------------------
inline void fiber_main() {
  Launch& l = L();
  l.invoke(*l.cur);
  l.cur->state = State::kDone;
  // returning resumes uc_link (the scheduler)
}

inline std::vector<int> make_order(int n, Order order, std::mt19937_64& rng) {
  std::vector<int> idx(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) idx[size_t(i)] = i;
  if (order == Order::kReverse) std::reverse(idx.begin(), idx.end());
  if (order == Order::kRandom) std::shuffle(idx.begin(), idx.end(), rng);
  return idx;
}

// Runs one threadgroup to completion; false when the dispatch must stop.
inline bool run_group(Launch& l, const uint gpos[3], Order order, std::mt19937_64& rng) {
  const LaunchDesc& d = *l.desc;
  uint size[3];
  for (int k = 0; k < 3; ++k) size[k] = std::min(d.group[k], d.grid[k] - gpos[k] * d.group[k]);  // edge groups are smaller
  const int n = int(size[0] * size[1] * size[2]);
  const int nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  l.simds.assign(size_t(nsimd), SimdGroup{});
  for (TgArray& a : l.tg) {
    if (a.used) std::memset(a.r.data, kPoison, a.r.bytes);
  }
  for (int i = 0; i < n; ++i) {
    Thread& t = l.threads[size_t(i)];
    const uint tx = uint(i) % size[0], ty = (uint(i) / size[0]) % size[1], tz = uint(i) / (size[0] * size[1]);
    const uint tp[3] = {tx, ty, tz};
    for (int k = 0; k < 3; ++k) {
      t.pos_group[k] = tp[k];
      t.group_pos[k] = gpos[k];
      t.pos_grid[k] = gpos[k] * d.group[k] + tp[k];
      t.group_size[k] = size[k];
      t.dispatch_group_size[k] = d.group[k];
      t.grid_size[k] = d.grid[k];
      t.groups_per_grid[k] = (d.grid[k] + d.group[k] - 1) / d.group[k];
    }
    t.index_in_group = uint(i);
    t.lane = uint(i) % kSimdWidth;
    t.simd_index = uint(i) / kSimdWidth;
    t.simds_per_group = uint(nsimd);
    t.state = State::kRunnable;
    t.compute = nullptr;
    l.simds[t.simd_index].lanes[t.lane] = &t;
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack + page_size();
    t.ctx.uc_stack.ss_size = kStackBytes;
    t.ctx.uc_link = &l.sched;
    makecontext(&t.ctx, fiber_main, 0);
  }
  for (;;) {
    // 1. run every runnable thread until it blocks
    bool ran = false;
    for (int i : make_order(n, order, rng)) {
      Thread& t = l.threads[size_t(i)];
      if (t.state != State::kRunnable) continue;
      l.cur = &t;
      swapcontext(&l.sched, &t.ctx);
      l.cur = nullptr;
      ran = true;
      if (l.abort) return false;
    }
    (void)ran;
    // 2. complete one collective per SIMD group
    bool resolved = false;
    for (int s = 0; s < nsimd; ++s) {
      SimdGroup& sg = l.simds[size_t(s)];
      const Site* first = nullptr;
      for (Thread* t : sg.lanes) {
        if (t && t->state == State::kSimd && (!first || t->site < *first)) first = &t->site;
      }
      if (!first) continue;
      const Site site = *first;
      ulong active = 0;
      SimdCompute fn = nullptr;
      for (Thread* t : sg.lanes) {
        if (t && t->state == State::kSimd && t->site == site) {
          active |= ulong(1) << t->lane;
          if (fn && fn != t->compute) {
            report(std::string("lanes call different SIMD-group functions at ") + site_str(site));
            l.abort = true;
            return false;
          }
          fn = t->compute;
        }
      }
      for (Thread* t : sg.lanes) {
        if (t && (active >> t->lane & 1)) {
          l.cur = t;
          t->compute(*t, sg, active);
          l.cur = nullptr;
          t->state = State::kRunnable;
        }
      }
      resolved = true;
    }
    if (resolved) continue;
    // 3. barrier
    const Thread* waiting = nullptr;
    const Thread* exited = nullptr;
    int live = 0;
    for (int i = 0; i < n; ++i) {
      const Thread& t = l.threads[size_t(i)];
      if (t.state == State::kDone) {
        exited = &t;
      } else {
        ++live;
        if (!waiting) waiting = &t;
      }
    }
    if (live == 0) break;
    for (int i = 0; i < n; ++i) {
      const Thread& t = l.threads[size_t(i)];
      if (t.state == State::kBarrier && !(t.site == waiting->site)) {
        report("divergent barrier: threads of one threadgroup wait at different barriers: " + site_str(waiting->site) +
               " (" + where(*waiting) + ") and " + site_str(t.site) + " (" + where(t) + ")");
        return false;
      }
    }
    if (exited) {
      report("divergent barrier: " + std::string(waiting->what) + " at " + site_str(waiting->site) +
             " waits for threads that have returned (" + where(*exited) + "; waiting: " + where(*waiting) + ")");
      return false;
    }
    for (int i = 0; i < n; ++i) l.threads[size_t(i)].state = State::kRunnable;
  }
  for (TgArray& a : l.tg) {
    if (!a.used) continue;
    for (char* p = a.r.map; p < a.r.data; ++p) {
      if (static_cast<unsigned char>(*p) != kCanary) {
        report("out-of-range threadgroup access: write before the start of threadgroup array '" + std::string(a.name) +
               "' (byte " + std::to_string(long(p - a.r.data)) + ") in threadgroup (" + std::to_string(gpos[0]) + ", " +
               std::to_string(gpos[1]) + ", " + std::to_string(gpos[2]) + ")");
        return false;
      }
    }
  }
  return true;
}

inline int launch(const LaunchDesc* desc, void (*invoke)(Thread&), const char* name, char* err, int errlen) {
  Launch l;
  l.desc = desc;
  l.invoke = invoke;
  l.kernel_name = name;
  current_launch() = &l;
  const uint group_threads = desc->group[0] * desc->group[1] * desc->group[2];
  for (int k = 0; k < 3; ++k) {
    if (desc->group[k] == 0 || desc->grid[k] == 0) {
      std::snprintf(err, size_t(errlen), "[%s] grid and threadgroup sizes must be positive", name);
      current_launch() = nullptr;
      return 1;
    }
  }
  if (group_threads > 1024) {
    std::snprintf(err, size_t(errlen), "[%s] %u threads per threadgroup exceed the limit of 1024", name, group_threads);
    current_launch() = nullptr;
    return 1;
  }
  // Guarded copies of every storage.
  int nstorage = 0;
  for (int k = 0; k < desc->num_args; ++k) nstorage = std::max(nstorage, desc->storage_id[k] + 1);
  l.storages.resize(size_t(nstorage));
  std::vector<int> owner(size_t(nstorage), -1);
  for (int k = 0; k < desc->num_args; ++k) {
    const int s = desc->storage_id[k];
    if (owner[size_t(s)] < 0) {
      owner[size_t(s)] = k;
      l.storages[size_t(s)] = map_region(size_t(desc->nbytes[k]), 16);
      if (desc->nbytes[k] > 0) std::memcpy(l.storages[size_t(s)].data, desc->base[k], size_t(desc->nbytes[k]));
    }
    l.bufs.push_back(l.storages[size_t(s)].data + desc->offset[k]);
  }
  // Fiber stacks (a guard page below each).
  l.threads.resize(group_threads);
  for (Thread& t : l.threads) {
    void* p = mmap(nullptr, kStackBytes + page_size(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    t.stack = static_cast<char*>(p);
    mprotect(t.stack, page_size(), PROT_NONE);
  }
  // Fault handling on an alternate stack.
  FaultState& f = fault_state();
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  f.alt_stack = static_cast<char*>(std::malloc(1 << 16));
  stack_t ss;
  ss.ss_sp = f.alt_stack;
  ss.ss_size = 1 << 16;
  ss.ss_flags = 0;
  sigaltstack(&ss, &f.old_stack);
  sigaction(SIGSEGV, &sa, &f.old_segv);
  sigaction(SIGBUS, &sa, &f.old_bus);
  bool ok = true;
  if (sigsetjmp(f.jmp, 1) == 0) {
    f.active = 1;
    const uint ng[3] = {(desc->grid[0] + desc->group[0] - 1) / desc->group[0],
                        (desc->grid[1] + desc->group[1] - 1) / desc->group[1],
                        (desc->grid[2] + desc->group[2] - 1) / desc->group[2]};
    const Order order = Order(desc->order);
    std::mt19937_64 rng(desc->seed);
    const int total = int(ng[0] * ng[1] * ng[2]);
    for (int gi : make_order(total, order, rng)) {
      const uint g[3] = {uint(gi) % ng[0], (uint(gi) / ng[0]) % ng[1], uint(gi) / (ng[0] * ng[1])};
      if (!run_group(l, g, order, rng)) {
        ok = false;
        break;
      }
    }
  } else {
    ok = false;
    std::string who = l.cur ? " in " + where(*l.cur) : "";
    report(describe_fault(l, f.addr) + who);
  }
  f.active = 0;
  sigaction(SIGSEGV, &f.old_segv, nullptr);
  sigaction(SIGBUS, &f.old_bus, nullptr);
  sigaltstack(&f.old_stack, nullptr);
  std::free(f.alt_stack);
  if (ok && l.num_errors == 0) {
    for (int s = 0; s < nstorage; ++s) {
      const int k = owner[size_t(s)];
      if (desc->nbytes[k] > 0) std::memcpy(desc->base[k], l.storages[size_t(s)].data, size_t(desc->nbytes[k]));
    }
  }
  for (Region& r : l.storages) unmap_region(r);
  for (TgArray& a : l.tg) unmap_region(a.r);
  for (Thread& t : l.threads) munmap(t.stack, kStackBytes + page_size());
  if (l.num_errors > 20) l.errors += "... and " + std::to_string(l.num_errors - 20) + " more\n";
  std::snprintf(err, size_t(errlen), "%s", l.errors.c_str());
  current_launch() = nullptr;
  return (ok && l.num_errors == 0) ? 0 : 1;
}

// ---- collectives -------------------------------------------------------------------------------
template <typename T>
inline T& in_of(Thread& t) { return *reinterpret_cast<T*>(t.in); }
template <typename T>
inline T& out_of(Thread& t) { return *reinterpret_cast<T*>(t.out); }

template <typename T>
inline T collective(T x, int arg, SimdCompute fn, const char* what, const char* file, unsigned line, unsigned col) {
  static_assert(sizeof(T) <= 64, "collective on a type larger than 64 bytes");
  Thread& t = cur();
  std::memcpy(t.in, &x, sizeof(T));
  t.arg = arg;
  t.compute = fn;
  t.what = what;
  t.site = Site{file, line, col};
  t.state = State::kSimd;
  yield();
  T r;
  std::memcpy(&r, t.out, sizeof(T));
  return r;
}

inline void inactive_read(Thread& self, int src, ulong active, const char* what) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "0x%08llx", static_cast<unsigned long long>(active));
  report(std::string(what) + " at " + site_str(self.site) + " reads lane " + std::to_string(src) +
         ", which is not active (active lanes " + buf + "); " + where(self));
}

template <typename T, typename Op>
inline void reduce_into(Thread& self, SimdGroup& sg, ulong active, Op op, bool prefix, bool inclusive) {
  bool first = true;
  T acc{};
  for (int i = 0; i < kSimdWidth; ++i) {
    if (!(active >> i & 1)) continue;
    if (prefix && (inclusive ? i > int(self.lane) : i >= int(self.lane))) break;
    const T v = in_of<T>(*sg.lanes[i]);
    acc = first ? v : op(acc, v);
    first = false;
  }
  out_of<T>(self) = first ? T(0) : acc;
}

#define EMU_REDUCE(name, expr, prefix, inclusive)                                                    \
  template <typename T>                                                                            \
  inline void name##_fn(Thread& self, SimdGroup& sg, ulong active) {                               \
    reduce_into<T>(self, sg, active, [](T a, T b) { return T(expr); }, prefix, inclusive);         \
  }
EMU_REDUCE(sum, a + b, false, false)
EMU_REDUCE(product, a * b, false, false)
EMU_REDUCE(max, (a > b ? a : b), false, false)
EMU_REDUCE(min, (a < b ? a : b), false, false)
EMU_REDUCE(and, a & b, false, false)
EMU_REDUCE(or, a | b, false, false)
EMU_REDUCE(xor, a ^ b, false, false)
EMU_REDUCE(prefix_ex, a + b, true, false)
EMU_REDUCE(prefix_in, a + b, true, true)
#undef EMU_REDUCE

// Reads lane `src` (shuffles and broadcasts); `keep_own` returns the caller's own value for a
// source outside 0..31 (simd_shuffle_down/up at the edges).
template <typename T>
inline void read_lane(Thread& self, SimdGroup& sg, ulong active, int src, bool keep_own, const char* what) {
  if (src < 0 || src >= kSimdWidth) {
    if (keep_own) {
      out_of<T>(self) = in_of<T>(self);
      return;
    }
  }
  if (src < 0 || src >= kSimdWidth || !(active >> src & 1)) {
    inactive_read(self, src, active, what);
    std::memset(self.out, kPoison, sizeof(T));
    return;
  }
  out_of<T>(self) = in_of<T>(*sg.lanes[src]);
}
template <typename T>
inline void shuffle_fn(Thread& s, SimdGroup& sg, ulong a) { read_lane<T>(s, sg, a, s.arg, false, "simd_shuffle"); }
template <typename T>
inline void shuffle_xor_fn(Thread& s, SimdGroup& sg, ulong a) {
  read_lane<T>(s, sg, a, int(s.lane) ^ s.arg, false, "simd_shuffle_xor");
}
template <typename T>
inline void shuffle_down_fn(Thread& s, SimdGroup& sg, ulong a) {
  read_lane<T>(s, sg, a, int(s.lane) + s.arg, true, "simd_shuffle_down");
}
template <typename T>
inline void shuffle_up_fn(Thread& s, SimdGroup& sg, ulong a) {
  read_lane<T>(s, sg, a, int(s.lane) - s.arg, true, "simd_shuffle_up");
}
template <typename T>
inline void broadcast_fn(Thread& s, SimdGroup& sg, ulong a) { read_lane<T>(s, sg, a, s.arg, false, "simd_broadcast"); }
template <typename T>
inline void broadcast_first_fn(Thread& s, SimdGroup& sg, ulong a) {
  int first = 0;
  while (!(a >> first & 1)) ++first;
  out_of<T>(s) = in_of<T>(*sg.lanes[first]);
}
inline void ballot_fn(Thread& s, SimdGroup& sg, ulong a) {
  ulong v = 0;
  for (int i = 0; i < kSimdWidth; ++i) {
    if ((a >> i & 1) && in_of<ulong>(*sg.lanes[i]) != 0) v |= ulong(1) << i;
  }
  out_of<ulong>(s) = v;
}
inline void is_first_fn(Thread& s, SimdGroup&, ulong a) {
  int first = 0;
  while (!(a >> first & 1)) ++first;
  out_of<bool>(s) = int(s.lane) == first;
}
inline void sync_fn(Thread&, SimdGroup&, ulong) {}

inline void barrier_wait(const char* what, const char* file, unsigned line, unsigned col) {
  Thread& t = cur();
  t.what = what;
  t.site = Site{file, line, col};
  t.state = State::kBarrier;
  yield();
}

}  // namespace emu

namespace metal {
#define EMU_SITE const char* msl_file = __builtin_FILE(), unsigned msl_line = __builtin_LINE(), \
                 unsigned msl_col = MSL_COLUMN
#define EMU_AT msl_file, msl_line, msl_col
inline void threadgroup_barrier(mem_flags, EMU_SITE) { emu::barrier_wait("threadgroup_barrier", EMU_AT); }
inline void simdgroup_barrier(mem_flags, EMU_SITE) {
  emu::collective<int>(0, 0, emu::sync_fn, "simdgroup_barrier", EMU_AT);
}
#define EMU_COLLECTIVE(name, fn)                                                                    \
  template <typename T>                                                                            \
  inline T name(T x, EMU_SITE) { return emu::collective<T>(x, 0, emu::fn<T>, #name, EMU_AT); }
EMU_COLLECTIVE(simd_sum, sum_fn)
EMU_COLLECTIVE(simd_product, product_fn)
EMU_COLLECTIVE(simd_max, max_fn)
EMU_COLLECTIVE(simd_min, min_fn)
EMU_COLLECTIVE(simd_and, and_fn)
EMU_COLLECTIVE(simd_or, or_fn)
EMU_COLLECTIVE(simd_xor, xor_fn)
EMU_COLLECTIVE(simd_prefix_exclusive_sum, prefix_ex_fn)
EMU_COLLECTIVE(simd_prefix_inclusive_sum, prefix_in_fn)
EMU_COLLECTIVE(simd_broadcast_first, broadcast_first_fn)
#undef EMU_COLLECTIVE
#define EMU_COLLECTIVE_ARG(name, fn)                                                                \
  template <typename T>                                                                            \
  inline T name(T x, ushort arg, EMU_SITE) { return emu::collective<T>(x, int(arg), emu::fn<T>, #name, EMU_AT); }
EMU_COLLECTIVE_ARG(simd_shuffle, shuffle_fn)
EMU_COLLECTIVE_ARG(simd_shuffle_xor, shuffle_xor_fn)
EMU_COLLECTIVE_ARG(simd_shuffle_down, shuffle_down_fn)
EMU_COLLECTIVE_ARG(simd_shuffle_up, shuffle_up_fn)
EMU_COLLECTIVE_ARG(simd_broadcast, broadcast_fn)
#undef EMU_COLLECTIVE_ARG
inline simd_vote simd_ballot(bool x, EMU_SITE) {
  simd_vote v;
  v.v = emu::collective<ulong>(ulong(x), 0, emu::ballot_fn, "simd_ballot", EMU_AT);
  return v;
}
inline bool simd_any(bool x, EMU_SITE) { return simd_ballot(x, EMU_AT).v != 0; }
inline bool simd_all(bool x, EMU_SITE) { return simd_ballot(!x, EMU_AT).v == 0; }
inline bool simd_is_first(EMU_SITE) { return emu::collective<bool>(false, 0, emu::is_first_fn, "simd_is_first", EMU_AT); }
inline bool simd_vote::all() const { return false; }  // not meaningful without the active mask
#undef EMU_AT
}  // namespace metal
