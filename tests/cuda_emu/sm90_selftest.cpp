// Self-tests of the emulator's sm_90 model (cuda_emu.h: wgmma, setmaxnreg, named barriers, mbarrier
// phases with cp.async arrivals) through the project's own wrappers (csrc/cuda/sm90_ptx.cuh), as
// torch.ops.kvkernels_emu.* for tests/test_cuda_emulated.py (test_sm90_*): small kernels whose results
// the test compares with a plain matmul / a known sequence, and kernels that each commit one misuse
// the emulator must report (the op raises RuntimeError with the emulator's message).
//
// The kernels place operands in shared memory with their own formulas (the classic "16-byte chunk
// XOR row" form of each swizzle on 1024-byte aligned tiles, core matrices for the interleaved
// layouts), independent of the emulator's descriptor decoding (the ISA's canonical layouts + the
// address XOR); the accumulator is read back with CUTLASS's CLayout_64xN formula.
#include "cuda_emu.h"

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "sm90_ptx.cuh"

namespace sm90_selftest {

using torch::stable::Tensor;
using kvkernels::sm90::Swizzle;
namespace s9 = kvkernels::sm90;

// Byte offset of element (row, k) of a [rows][16 k-columns per step] 16-bit operand tile stored
// "K-major": k contiguous. Each swizzle mode keeps rows of its width W (16 / 32 / 64 / 128 bytes):
// the 16 k of one step (32 bytes) fill a 32-byte row, half a 64-byte one, a quarter of a 128-byte one.
// For the test every k-step is its own set of rows, so (row, kstep) pick the row; the chunk XOR.
struct KLayout {
  int swz;  // 0 none, 1 128B, 2 64B, 3 32B
  int rows;
  uint32_t lbo, sbo;
  // tile of one k-step: with swizzle: rows of W bytes, 8-row groups SBO = 8 W apart; the k-step's 16
  // elements occupy bytes 0..31 of each row (the rest unused). Without: 8 x 16-byte core matrices,
  // k chunk 0 / 1 LBO apart, 8-row groups SBO apart.
  uint32_t step_bytes() const { return swz == 0 ? uint32_t(rows) * 32 : uint32_t(rows) * width(); }
  uint32_t width() const { return swz == 1 ? 128 : swz == 2 ? 64 : swz == 3 ? 32 : 16; }
  uint32_t off(int r, int k) const {
    if (swz == 0) return (r / 8) * sbo + (k / 8) * lbo + (r % 8) * 16 + (k % 8) * 2;
    const uint32_t w = width(), chunks = w / 16;
    // XOR of the 16-byte chunk with the row's position in the repeating pattern (8 rows of 128 B,
    // 4 pairs of rows of 64 B (two rows per 128-byte line), 2 quads of 32 B)
    const uint32_t line = ((r % 8) * w) / 128;  // 128-byte line of the row within its group
    const uint32_t chunk = (k / 8) ^ (line & (chunks - 1));
    return (r / 8) * sbo + (r % 8) * w + chunk * 16 + (k % 8) * 2;
  }
};

// "MN-major": mn contiguous. With swizzle: 8 k-rows of W bytes (W / 2 mn elements) per atom, atoms
// of the next W / 2 mn LBO apart, of the next 8 k SBO apart; chunk XOR as above. Without: core
// matrices of 8 k-rows x 8 mn (16 bytes), the next 8 mn SBO apart, the next 8 k LBO apart.
struct MNLayout {
  int swz;
  int mn;
  uint32_t lbo, sbo;
  uint32_t width() const { return swz == 1 ? 128 : swz == 2 ? 64 : swz == 3 ? 32 : 16; }
  uint32_t off(int m, int k) const {
    if (swz == 0) return (m / 8) * sbo + (k / 8) * lbo + (k % 8) * 16 + (m % 8) * 2;
    const uint32_t w = width(), per = w / 2, chunks = w / 16;
    const uint32_t line = ((k % 8) * w) / 128;
    const uint32_t chunk = ((m % per) / 8) ^ (line & (chunks - 1));
    return (m / per) * lbo + (k / 8) * sbo + (k % 8) * w + chunk * 16 + (m % 8) * 2;
  }
  uint32_t bytes() const {
    return swz == 0 ? uint32_t(mn / 8) * sbo : uint32_t((mn + int(width() / 2) - 1) / int(width() / 2)) * lbo;
  }
};

struct GemmArgs {
  const uint16_t* a;  // [64][K] row-major
  const uint16_t* b;  // [K][N] row-major
  float* d;           // [64][N]
  int n, ksteps, swz, a_mn, b_mn, a_regs, f16, mode;
};

uint32_t align1024(uint32_t x) { return (x + 1023u) & ~1023u; }

template <int N, typename T>
void issue(float (&acc)[N / 2], bool a_regs, bool a_mn, bool b_mn, uint64_t da, const uint32_t (&af)[4], uint64_t db,
           int scale_d) {
  if (a_regs) {
    if (b_mn) s9::wgmma_rs<N, T, 1>(acc, af, db, scale_d);
    else s9::wgmma_rs<N, T, 0>(acc, af, db, scale_d);
  } else if (a_mn) {
    if (b_mn) s9::wgmma_ss<N, T, 1, 1>(acc, da, db, scale_d);
    else s9::wgmma_ss<N, T, 1, 0>(acc, da, db, scale_d);
  } else {
    if (b_mn) s9::wgmma_ss<N, T, 0, 1>(acc, da, db, scale_d);
    else s9::wgmma_ss<N, T, 0, 0>(acc, da, db, scale_d);
  }
}

// One warpgroup: D = A B over `ksteps` k16 steps (chained on one accumulator: scale_d 0, then 1),
// A and B staged into shared memory in the requested layouts (A K-major or M-major, or A in
// registers; B K-major (B^T rows) or N-major), then written out through the CLayout formula.
// mode 1: D read before the wait (must be NaN: not visible yet).
template <int N, typename T>
__global__ void gemm_kernel(GemmArgs g) {
  unsigned char* smem = ::emu::dynamic_smem();  // (extern __shared__ in device code)
  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32;
  const uint32_t base = ::emu::smem_u32(smem);
  const uint32_t a0 = align1024(base);  // 1024-byte aligned tiles
  const int K = 16 * g.ksteps;
  // A: per k-step a tile of 64 rows
  KLayout ak{g.swz, 64, 0, 0};
  MNLayout am{g.swz, 64, 0, 0};
  if (g.swz == 0) ak.lbo = 128, ak.sbo = 256, am.lbo = 128, am.sbo = 256;  // two 8-wide chunks of 128 B per 8 rows
  else ak.sbo = 8 * ak.width(), am.sbo = 8 * am.width(), am.lbo = 16 * am.width();  // k-step: 2 atoms of 8 k-rows
  const uint32_t a_step = g.a_mn ? align1024(am.bytes()) : align1024(ak.step_bytes());
  KLayout bk{g.swz, N, 0, 0};
  MNLayout bm{g.swz, N, 0, 0};
  if (g.swz == 0) bk.lbo = uint32_t(N / 8) * 128, bk.sbo = 128, bm.lbo = 128, bm.sbo = 256;
  else bk.sbo = 8 * bk.width(), bm.sbo = 8 * bm.width(), bm.lbo = 16 * bm.width();
  if (g.swz == 0) bm.sbo = 256, bm.lbo = 128;
  const uint32_t b_step = g.b_mn ? align1024(bm.bytes()) : align1024(bk.step_bytes() > uint32_t(N) * 32 ? bk.step_bytes() : uint32_t(N) * 32);
  const uint32_t b0 = a0 + uint32_t(g.ksteps) * a_step;
  for (int i = tid; i < 64 * K; i += 128) {
    const int r = i / K, k = i % K, ks = k / 16, kk = k % 16;
    const uint32_t o = a0 + ks * a_step + (g.a_mn ? am.off(r, kk) : ak.off(r, kk));
    std::memcpy(::emu::shared_at(o, 2), g.a + i, 2);
  }
  for (int i = tid; i < K * N; i += 128) {
    const int k = i / N, c = i % N, ks = k / 16, kk = k % 16;
    const uint32_t o = b0 + ks * b_step + (g.b_mn ? bm.off(c, kk) : bk.off(c, kk));
    std::memcpy(::emu::shared_at(o, 2), g.b + i, 2);
  }
  s9::fence_proxy_async();
  s9::named_bar_sync(1, 128);
  float acc[N / 2];
  for (int i = 0; i < N / 2; ++i) acc[i] = 12345.0f;  // scale_d = 0 first: ignored
  const Swizzle sw = static_cast<Swizzle>(g.swz);
  uint32_t af[4][4];  // A fragments per k-step (registers; kept until the wait)
  s9::wgmma_fence();
  for (int ks = 0; ks < g.ksteps && ks < 4; ++ks) {
    const uint32_t at = a0 + ks * a_step, bt = b0 + ks * b_step;
    const uint64_t da = g.a_mn ? s9::make_desc(at, am.lbo, am.sbo, sw) : s9::make_desc(at, ak.lbo, ak.sbo, sw);
    const uint64_t db = g.b_mn ? s9::make_desc(bt, bm.lbo, bm.sbo, sw) : s9::make_desc(bt, bk.lbo, bk.sbo, sw);
    for (int j = 0; j < 4; ++j) {  // ALayout_64x16: register j = rows 16 w + g + 8 (j % 2), k 2 t + 8 (j / 2)
      const int m = 16 * w + lane / 4 + 8 * (j % 2), k = 16 * ks + 2 * (lane % 4) + 8 * (j / 2);
      af[ks][j] = uint32_t(g.a[m * K + k]) | (uint32_t(g.a[m * K + k + 1]) << 16);
    }
    issue<N, T>(acc, g.a_regs, g.a_mn, g.b_mn, da, af[ks], db, ks == 0 ? 0 : 1);
  }
  s9::wgmma_commit();
  auto store = [&] {
    for (int v = 0; v < N / 2; ++v) {  // CLayout_64xN: value v at row 16 w + g + 8 ((v / 2) % 2), column 8 (v / 4) + 2 t + v % 2
      const int m = 16 * w + lane / 4 + 8 * ((v / 2) % 2), c = 8 * (v / 4) + 2 * (lane % 4) + v % 2;
      g.d[m * N + c] = acc[v];
    }
  };
  if (g.mode == 1) store();  // before the wait: NaN
  s9::wgmma_wait<0>();
  s9::fence_regs(acc);
  if (g.mode != 1) store();
}

Tensor wgmma_gemm(Tensor a, Tensor b, int64_t swz, bool a_mn, bool b_mn, bool a_regs, int64_t mode) {
  const int64_t K = a.size(1), N = b.size(1);
  STD_TORCH_CHECK(a.size(0) == 64 && b.size(0) == K && K % 16 == 0 && K / 16 <= 4 && (N == 64 || N == 128),
                  "wgmma_gemm: a [64, 16 k], b [16 k, 64 | 128], k <= 4");
  Tensor d = torch::stable::new_empty(a, {64, N}, torch::headeronly::ScalarType::Float);
  const bool f16 = a.scalar_type() == torch::headeronly::ScalarType::Half;
  GemmArgs g{static_cast<const uint16_t*>(a.const_data_ptr()), static_cast<const uint16_t*>(b.const_data_ptr()),
             static_cast<float*>(d.mutable_data_ptr()), int(N), int(K / 16), int(swz), a_mn, b_mn, a_regs, f16,
             int(mode)};
  const size_t smem = 4 * 1024 + size_t(K / 16) * (2 * 16384 + 2048);
  auto run = [&](auto kernel) { ::emu::launch(kernel, dim3(1), dim3(128), smem, nullptr, g); };
  if (N == 64) f16 ? run(gemm_kernel<64, __half>) : run(gemm_kernel<64, __nv_bfloat16>);
  else f16 ? run(gemm_kernel<128, __half>) : run(gemm_kernel<128, __nv_bfloat16>);
  return d;
}

// ---- misuse: each kind breaks one rule; the launch must throw (or, kind 100, give NaN) ----------------
struct MisuseArgs {
  int kind;
  float* out;
};

__global__ void misuse_kernel(MisuseArgs m) {
  unsigned char* smem = ::emu::dynamic_smem();  // (extern __shared__ in device code)
  const int tid = threadIdx.x;
  const uint32_t base = align1024(::emu::smem_u32(smem));
  for (int i = tid; i < 4096; i += blockDim.x)  // bf16 ones
    smem[(base - ::emu::smem_u32(smem)) + 2 * i] = 0x80, smem[(base - ::emu::smem_u32(smem)) + 2 * i + 1] = 0x3f;
  __syncthreads();
  float acc[32];
  for (float& x : acc) x = 0.0f;
  uint32_t af[4] = {0, 0, 0, 0};
  const uint64_t desc = s9::make_desc(base, 16, 1024, Swizzle::k128B);
  switch (m.kind) {
    case 0:  // a descriptor start that is not 16-byte aligned
      (void)s9::make_desc(base + 8, 16, 1024, Swizzle::k128B);
      break;
    case 1:  // a 128B-swizzled operand starting in the second row of its pattern
      if (tid < 128) {
        s9::wgmma_fence();
        s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, s9::make_desc(base + 128, 16, 1024, Swizzle::k128B), desc, 0);
      }
      break;
    case 2:  // wait without commit_group
      if (tid < 128) {
        s9::wgmma_fence();
        s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, desc, desc, 0);
        s9::wgmma_wait<0>();
      }
      break;
    case 3:  // no wgmma.fence before the first wgmma
      if (tid < 128) s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, desc, desc, 0);
      break;
    case 4:  // no wgmma.fence between a wait (and register use) and the next wgmma
      if (tid < 128) {
        s9::wgmma_fence();
        s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, desc, desc, 0);
        s9::wgmma_commit();
        s9::wgmma_wait<0>();
        s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, desc, desc, 1);
      }
      break;
    case 5:  // a shared operand overwritten while the wgmma is in flight
      if (tid < 128) {
        s9::wgmma_fence();
        s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, desc, desc, 0);
        s9::wgmma_commit();
        if (tid == 0) ::emu::shared_at(base, 2)[1] = 0x40;  // 1.0 -> 4.0 (bf16 0x4080)
        s9::wgmma_wait<0>();
      }
      break;
    case 6:  // A registers changed while in flight
      if (tid < 128) {
        s9::wgmma_fence();
        s9::wgmma_rs<64, __nv_bfloat16, 0>(acc, af, desc, 0);
        s9::wgmma_commit();
        af[0] = 0x3f803f80u;
        s9::wgmma_wait<0>();
      }
      break;
    case 7:  // descriptors that differ within the warpgroup
      if (tid < 128) {
        s9::wgmma_fence();
        s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, tid == 5 ? s9::desc_add(desc, 32) : desc, desc, 0);
      }
      break;
    case 8:  // the CTA ends with a wgmma in flight
      if (tid < 128) {
        s9::wgmma_fence();
        s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, desc, desc, 0);
        s9::wgmma_commit();
      }
      break;
    case 10:  // named barrier: two counts in one phase
      s9::named_bar_sync(1, tid < 128 ? 256 : 128);
      break;
    case 11:  // named barrier: fewer threads than its count ever arrive (a hang on a GPU)
      if (tid < 128) s9::named_bar_sync(2, 256);
      break;
    case 12:  // named barrier left part-way at the end
      if (tid < 64) s9::named_bar_arrive(3, 128);
      break;
    case 13:  // named barrier count not a multiple of 32
      s9::named_bar_sync(1, 100);
      break;
    case 14:  // warpgroup 1 writes an operand of warpgroup 0's wgmma with no barrier between (a race)
    case 15:  // the same, warpgroup 0 writing and warpgroup 1 reading
      if (tid / 128 == (m.kind == 14 ? 1 : 0)) {
        if (tid % 128 == 0) ::emu::shared_at(base, 2)[1] = 0x40;  // 1.0 -> 4.0 (bf16 0x4080)
      } else {
        s9::wgmma_fence();
        s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, desc, desc, 0);
        s9::wgmma_commit();
        s9::wgmma_wait<0>();
      }
      break;
    case 20:  // setmaxnreg count not a multiple of 8 / outside 24..256 (the wrapper's static_assert
              // stops literal misuse; the model checks too)
      ::emu::setmaxnreg(false, 100);
      break;
    case 21:  // setmaxnreg that differs between the warps of a warpgroup
      ::emu::setmaxnreg(false, tid < 64 ? 40 : 48);
      break;
    case 22:  // every warpgroup asks for more registers and none gives any back: never granted
      s9::setmaxnreg_inc<240>();
      break;
    case 23:  // .dec above the current count
      s9::setmaxnreg_dec<40>();
      s9::setmaxnreg_dec<56>();
      break;
    case 30:  // mbarrier wait on a phase nobody completes
      if (tid == 0) {
        s9::mbar_init(base + 8192, 2);
        s9::mbar_arrive(base + 8192);
        s9::mbar_wait(base + 8192, 0);
      }
      break;
    case 31:  // more arrivals than the count while transactions are pending
      if (tid == 0) {
        s9::mbar_init(base + 8192, 1);
        ::emu::mbarrier_expect_tx(base + 8192, 16);
        s9::mbar_arrive(base + 8192);
        s9::mbar_arrive(base + 8192);
      }
      break;
    // Programmatic dependent launch (kinds 40-42 are launched with programmatic stream serialization): m.out
    // stands for the predecessor grid's output.
    case 40:  // a read of the predecessor's output before griddepcontrol.wait
      m.out[tid] = s9::griddep_read(m.out + tid) + 1.0f;
      s9::griddep_wait();
      break;
    case 41:  // a CTA that never waits (reads nothing through griddep_read, writes its own output)
      s9::griddep_launch_dependents();
      m.out[tid] = 1.0f;
      break;
    case 42:  // the rule kept: wait, then read (no report; out = 1)
      s9::griddep_wait();
      m.out[tid] = s9::griddep_read(m.out + tid) + 1.0f;
      break;
    case 100:  // reading the accumulators before the wait: NaN (the kernel writes them out)
      if (tid < 128) {
        s9::wgmma_fence();
        s9::wgmma_ss<64, __nv_bfloat16, 0, 0>(acc, desc, desc, 0);
        s9::wgmma_commit();
        m.out[tid] = acc[0];
        s9::wgmma_wait<0>();
      }
      break;
  }
}

Tensor sm90_misuse(Tensor like, int64_t kind, int64_t threads) {
  Tensor out = torch::stable::new_empty(like, {int64_t(threads)}, torch::headeronly::ScalarType::Float);
  std::memset(out.mutable_data_ptr(), 0, size_t(threads) * 4);
  const MisuseArgs args{int(kind), static_cast<float*>(out.mutable_data_ptr())};
  if (kind >= 40 && kind < 50) {  // through cudaLaunchKernelEx with programmatic stream serialization
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    const cudaLaunchConfig_t cfg = {dim3(1), dim3(unsigned(threads)), 16384, nullptr, attr, 1};
    cudaLaunchKernelEx(&cfg, misuse_kernel, args);
  } else {
    ::emu::launch(misuse_kernel, dim3(1), dim3(unsigned(threads)), 16384, nullptr, args);
  }
  return out;
}

// ---- a warp-specialized pipeline: producer warpgroup -> ring of stages -> two consumer warpgroups ----
// The producer gives registers back (setmaxnreg.dec), the consumers take them (.inc). Per item i the
// producer waits for the stage to be empty (phase of its previous use), fills it with cp.async from
// `src` row i (STAGES stages of 128 x 16 bytes: each producer thread one 16-byte chunk) and arrives on
// the stage's full barrier through cp.async.mbarrier.arrive.noinc (count 128). Each consumer warpgroup
// waits for the full phase, and the two take turns on named barriers 1 / 2 (ping-pong): each appends
// its item sums to `out` in turn order, then both arrive on the stage's empty barrier (count 256).
// out[2 i + c]: the sum of row i's 1024 int32 words as read by consumer c; order[j]: who was j-th.
struct PipeArgs {
  const int32_t* src;  // [items][512] int32 (2 KiB per item: 128 chunks of 16 bytes)
  int64_t* out;        // [items][2]
  int32_t* order;      // [2 items]
  int items, stages;
};

__global__ void pipeline_kernel(PipeArgs p) {
  unsigned char* smem = ::emu::dynamic_smem();  // (extern __shared__ in device code)
  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  const uint32_t base = align1024(::emu::smem_u32(smem));
  const uint32_t bars = base + uint32_t(p.stages) * 2048;  // full[s] at bars + 16 s, empty[s] at + 8
  __shared__ int turn;
  if (tid == 0) {
    for (int s = 0; s < p.stages; ++s) {
      s9::mbar_init(bars + 16 * s, 128);
      s9::mbar_init(bars + 16 * s + 8, 256);
    }
    turn = 0;
    s9::mbar_init_fence();
  }
  __syncthreads();
  if (wg == 2) {  // producer
    s9::setmaxnreg_dec<40>();
    for (int i = 0; i < p.items; ++i) {
      const int s = i % p.stages, use = i / p.stages;
      if (use > 0) s9::mbar_wait(bars + 16 * s + 8, uint32_t(use - 1) & 1u);
      ::emu::cp_async16(::emu::shared_at(base + s * 2048 + t * 16, 16), p.src + int64_t(i) * 512 + t * 4, 16);
      s9::cp_async_mbar_arrive(bars + 16 * s);
    }
    return;
  }
  s9::setmaxnreg_inc<232>();
  if (wg == 1) s9::named_bar_arrive(1, 256);  // consumer 0 goes first
  for (int i = 0; i < p.items; ++i) {
    const int s = i % p.stages, use = i / p.stages;
    s9::mbar_wait(bars + 16 * s, uint32_t(use) & 1u);
    s9::named_bar_sync(1 + wg, 256);  // my turn
    if (t == 0) {
      int64_t sum = 0;
      const int32_t* words = reinterpret_cast<const int32_t*>(::emu::shared_at(base + s * 2048, 2048));
      for (int j = 0; j < 512; ++j) sum += words[j];
      p.out[2 * i + wg] = sum;
      p.order[turn++] = wg;
    }
    if (!(wg == 1 && i == p.items - 1)) s9::named_bar_arrive(2 - wg, 256);  // the other's turn
    s9::mbar_arrive(bars + 16 * s + 8);
  }
}

std::tuple<Tensor, Tensor> sm90_pipeline(Tensor src, int64_t stages) {
  const int64_t items = src.size(0);
  STD_TORCH_CHECK(src.size(1) == 512 && src.scalar_type() == torch::headeronly::ScalarType::Int, "src [items, 512] int32");
  Tensor out = torch::stable::new_empty(src, {items, 2}, torch::headeronly::ScalarType::Long);
  Tensor order = torch::stable::new_empty(src, {2 * items}, torch::headeronly::ScalarType::Int);
  std::memset(out.mutable_data_ptr(), 0xff, size_t(items) * 16);
  std::memset(order.mutable_data_ptr(), 0xff, size_t(items) * 8);
  PipeArgs p{static_cast<const int32_t*>(src.const_data_ptr()), static_cast<int64_t*>(out.mutable_data_ptr()),
             static_cast<int32_t*>(order.mutable_data_ptr()), int(items), int(stages)};
  ::emu::launch(pipeline_kernel, dim3(1), dim3(384), size_t(stages) * 2048 + 2048, nullptr, p);
  return {out, order};
}

// ---- TMA: one box of a tiled tensor map of rank 1..5 --------------------------------------------
// The map is encoded with the emulator's cuTensorMapEncodeTiled over `src`'s storage (dims, byte strides
// and box as given; element size from src's dtype: uint8 1, bf16 2, float32 4); one thread loads the box
// at `coords` with cp.async.bulk.tensor.<instr_rank>d (rank 2 and 4 through the kernels' wrappers
// tma_load_2d / tma_load_4d) into a 1024-byte aligned shared buffer, completing on an mbarrier with
// arrive.expect_tx of the box's bytes, waits, and returns the buffer's bytes (the test places the elements
// with its own formula: coordinates, zero fill outside the tensor, the 128B swizzle's chunk XOR).
struct TmaArgs {
  CUtensorMap map;
  int coords[5];
  int instr_rank;
  uint32_t bytes;
  unsigned char* out;
};

__global__ void tma_box_kernel(const __grid_constant__ TmaArgs t) {
  unsigned char* smem = ::emu::dynamic_smem();
  const uint32_t base = align1024(::emu::smem_u32(smem)), bar = base + ((t.bytes + 15u) & ~15u);
  if (threadIdx.x != 0) return;
  s9::mbar_init(bar, 1);
  s9::mbar_init_fence();
  s9::mbar_arrive_expect_tx(bar, t.bytes);
  const int* c = t.coords;
  if (t.instr_rank == 2) s9::tma_load_2d(base, &t.map, c[0], c[1], bar);
  else if (t.instr_rank == 4) s9::tma_load_4d(base, &t.map, c[0], c[1], c[2], c[3], bar);
  else ::emu::bulk_tensor_load(base, &t.map, c, t.instr_rank, bar);
  s9::mbar_wait(bar, 0);
  std::memcpy(t.out, ::emu::shared_at(base, t.bytes), t.bytes);
}

Tensor tma_box(Tensor src, std::vector<int64_t> dims, std::vector<int64_t> strides, std::vector<int64_t> box,
               std::vector<int64_t> coords, bool swizzle128, int64_t instr_rank) {
  using torch::headeronly::ScalarType;
  const ScalarType st = src.scalar_type();
  const CUtensorMapDataType type = st == ScalarType::Byte       ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : st == ScalarType::BFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const int esz = st == ScalarType::Byte ? 1 : st == ScalarType::BFloat16 ? 2 : 4;
  const int rank = int(dims.size());
  STD_TORCH_CHECK(rank >= 1 && rank <= 5 && int(box.size()) == rank && int(strides.size()) == rank - 1 &&
                      int(coords.size()) == int(instr_rank) && instr_rank <= 5,
                  "tma_box: dims / box / coords of the rank, strides one fewer");
  cuuint64_t d[5] = {}, sb[4] = {};
  cuuint32_t bx[5] = {}, es[5] = {1, 1, 1, 1, 1};
  int64_t bytes = esz;
  for (int i = 0; i < rank; ++i) {
    d[i] = cuuint64_t(dims[i]);
    bx[i] = cuuint32_t(box[i]);
    bytes *= box[i];
    if (i > 0) sb[i - 1] = cuuint64_t(strides[i - 1]);
  }
  TmaArgs t{};
  const CUresult r = ::emu::tensor_map_encode_tiled(
      &t.map, type, cuuint32_t(rank), const_cast<void*>(src.const_data_ptr()), d, sb, bx, es,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  STD_TORCH_CHECK(r == CUDA_SUCCESS, "tma_box: cuTensorMapEncodeTiled rejected the map");
  for (int i = 0; i < int(instr_rank); ++i) t.coords[i] = int(coords[i]);
  t.instr_rank = int(instr_rank);
  t.bytes = uint32_t(bytes);
  Tensor out = torch::stable::new_empty(src, {bytes}, ScalarType::Byte);
  t.out = static_cast<unsigned char*>(out.mutable_data_ptr());
  ::emu::launch(tma_box_kernel, dim3(1), dim3(32), size_t(bytes) + 2048, nullptr, t);
  return out;
}

int64_t tma_boxes_taken(Tensor) { return int64_t(::emu::tma_boxes_taken()); }

}  // namespace sm90_selftest

STABLE_TORCH_LIBRARY_FRAGMENT(kvkernels_emu, m) {
  m.def("wgmma_gemm(Tensor a, Tensor b, int swizzle, bool a_mn, bool b_mn, bool a_regs, int mode) -> Tensor");
  m.def("sm90_misuse(Tensor like, int kind, int threads) -> Tensor");
  m.def("sm90_pipeline(Tensor src, int stages) -> (Tensor, Tensor)");
  m.def("tma_boxes_taken(Tensor like) -> int");
  m.def("tma_box(Tensor src, int[] dims, int[] strides, int[] box, int[] coords, bool swizzle128, int instr_rank) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(kvkernels_emu, CPU, m) {
  m.impl("wgmma_gemm", TORCH_BOX(&sm90_selftest::wgmma_gemm));
  m.impl("sm90_misuse", TORCH_BOX(&sm90_selftest::sm90_misuse));
  m.impl("sm90_pipeline", TORCH_BOX(&sm90_selftest::sm90_pipeline));
  m.impl("tma_box", TORCH_BOX(&sm90_selftest::tma_box));
  m.impl("tma_boxes_taken", TORCH_BOX(&sm90_selftest::tma_boxes_taken));
}
