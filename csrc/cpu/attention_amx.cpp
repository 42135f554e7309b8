// The attention kernel (attention_kernel.h) built for AVX-512 + VBMI + BF16 with AMX: the same
// kernel as attention_avx512bf16.cpp (vdpbf16ps decode), plus the AMX form of the tile kernels (attention_amx.h,
// KVK_AMX), which runs when the plan says so (plan.tiles == kAmx: bf16 queries over bf16 / fp8
// caches). Everything lives in namespace avx512amx; isa.cpp decides at run time whether it is
// called (the CPU has AMX and the OS granted this process the tile state).
#if defined(__x86_64__)
#include "x86_intrinsics.h"  // first: <immintrin.h> without GCC 12's false uninitialized warnings
#if defined(KVKERNELS_AMX_EMU)
#include "amx_emu.h"  // tests/amx_emu: the tile instructions emulated (make amx-emu-test only)
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_plan.h"
#include "convert.h"
#include "kvkernels/softmax.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")
#endif

#define KVK_ISA avx512amx
#define KVK_AVX512_VBMI 1
#define KVK_BF16 1
#define KVK_AMX 1
#include "vec_avx512.h"
#include "attention_kernel.h"
#undef KVK_AMX
#undef KVK_BF16
#undef KVK_AVX512_VBMI
#undef KVK_ISA

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kvkernels::cpu {
const AttentionKernels kAttentionAvx512Amx{&avx512amx::attend, &avx512amx::merge_splits};
}  // namespace kvkernels::cpu
#endif  // __x86_64__
