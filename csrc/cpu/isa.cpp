#include "isa.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvkernels::cpu {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vbmi: return "avx512vbmi";
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
  return avx512 && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

Isa active_isa() {
  const char* forced = std::getenv("KVKERNELS_CPU_ISA");
  if (forced == nullptr || forced[0] == '\0') {
    for (Isa isa : {Isa::kAvx512Vbmi, Isa::kAvx512, Isa::kAvx2})
      if (isa_supported(isa)) return isa;
    return Isa::kPortable;
  }
  for (Isa isa : {Isa::kAvx512Vbmi, Isa::kAvx512, Isa::kAvx2, Isa::kPortable}) {
    if (std::strcmp(forced, isa_name(isa)) != 0) continue;
    if (!isa_supported(isa))
      throw std::runtime_error(std::string("kvkernels: KVKERNELS_CPU_ISA=") + forced +
                               ": this CPU (or build) does not support it");
    return isa;
  }
  throw std::runtime_error(std::string("kvkernels: KVKERNELS_CPU_ISA=") + forced +
                           ": expected one of avx512vbmi, avx512, avx2, portable");
}

}  // namespace kvkernels::cpu
