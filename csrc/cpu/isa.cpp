#include "isa.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvkernels::cpu {
namespace {

// AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), and the kernel's permission to use the
// tile data state: Linux hands it out per process on request (ARCH_REQ_XCOMP_PERM for feature 18,
// XTILEDATA); without it the first tile instruction kills the process. Asked once.
bool amx_granted() {
#if defined(KVKERNELS_AMX_EMU)
  return true;  // the tile instructions are emulated (tests/amx_emu): nothing to ask the CPU or OS
#elif defined(__x86_64__) && defined(__linux__)
  static const bool granted = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 22) & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Amx: return "avx512amx";
    case Isa::kAvx512Vbmi: return "avx512vbmi";
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kPortable: return "portable";
  }
  return "?";
}

bool isa_supported(Isa isa) {
  if (isa == Isa::kPortable) return true;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // libgcc's feature probe also checks that the OS saves the wide registers (XCR0).
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == Isa::kAvx2) return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  if (isa == Isa::kAvx512) return avx512;
  const bool vbmi = avx512 && __builtin_cpu_supports("avx512vbmi");
  if (isa == Isa::kAvx512Vbmi) return vbmi;
  const bool bf16 = vbmi && __builtin_cpu_supports("avx512bf16");
  if (isa == Isa::kAvx512Bf16) return bf16;
  return bf16 && amx_granted();
#else
  return false;
#endif
}

Isa active_isa() {
  const char* forced = std::getenv("KVKERNELS_CPU_ISA");
  if (forced == nullptr || forced[0] == '\0') {
    for (Isa isa : {Isa::kAvx512Amx, Isa::kAvx512Bf16, Isa::kAvx512Vbmi, Isa::kAvx512, Isa::kAvx2})
      if (isa_supported(isa)) return isa;
    return Isa::kPortable;
  }
  for (Isa isa : {Isa::kAvx512Amx, Isa::kAvx512Bf16, Isa::kAvx512Vbmi, Isa::kAvx512, Isa::kAvx2,
                  Isa::kPortable}) {
    if (std::strcmp(forced, isa_name(isa)) != 0) continue;
    if (!isa_supported(isa))
      throw std::runtime_error(std::string("kvkernels: KVKERNELS_CPU_ISA=") + forced +
                               ": this CPU (or build) does not support it");
    return isa;
  }
  throw std::runtime_error(std::string("kvkernels: KVKERNELS_CPU_ISA=") + forced +
                           ": expected one of avx512amx, avx512bf16, avx512vbmi, avx512, avx2, portable");
}

}  // namespace kvkernels::cpu
