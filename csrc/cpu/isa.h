// Which SIMD instruction set the CPU kernels use. One build carries every path (the ISA-specific
// translation units compile their kernels under `#pragma GCC target`), and the choice is made at
// run time from the CPU's features. KVKERNELS_CPU_ISA=portable|avx2|avx512 forces a path (read on
// every call, so tests can switch paths in one process); asking for one the CPU lacks is an error.
#pragma once

namespace kvkernels::cpu {

enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(Isa isa);
bool isa_supported(Isa isa);  // by this build and this CPU
Isa active_isa();             // best supported, or KVKERNELS_CPU_ISA; throws on a bad value

}  // namespace kvkernels::cpu
