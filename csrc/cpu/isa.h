// Which SIMD instruction set the CPU kernels use. One build carries every path (the ISA-specific
// translation units compile their kernels under `#pragma GCC target`), and the choice is made at
// run time from the CPU's features. KVKERNELS_CPU_ISA=portable|avx2|avx512|avx512vbmi|avx512bf16|
// avx512amx forces a path (read on every call, so tests can switch paths in one process); asking for one the
// CPU lacks is an error. avx512vbmi is AVX-512 plus AVX512_VBMI (byte permutes, used as fp8 -> bf16
// lookup tables): Ice Lake and later, Zen 4 and later. avx512bf16 adds AVX512_BF16 (vdpbf16ps: 32
// bf16 multiply-adds into 16 floats per instruction), used for bf16-query attention over bf16 and
// fp8 caches: Zen 4 and later, Sapphire Rapids and later (Cooper Lake has BF16 without VBMI: it
// stays on avx512). avx512amx adds the AMX tile units (Sapphire Rapids and later), used for bf16
// prefill; Linux must grant the process the tile state (arch_prctl), which isa_supported asks for.
#pragma once

namespace kvkernels::cpu {

enum class Isa : int {
  kPortable = 0,
  kAvx2 = 1,
  kAvx512 = 2,
  kAvx512Vbmi = 3,
  kAvx512Bf16 = 4,
  kAvx512Amx = 5
};

const char* isa_name(Isa isa);
bool isa_supported(Isa isa);  // by this build and this CPU
Isa active_isa();             // best supported, or KVKERNELS_CPU_ISA; throws on a bad value

}  // namespace kvkernels::cpu
