// <immintrin.h> for the SIMD translation units. GCC 12 reports its own AVX-512 intrinsics
// (_mm512_undefined_* passed as the pass-through operand of the unmasked forms) as
// "-Wuninitialized" at every inlined call, ~2,400 lines of build log. The warnings are silenced for
// the lines of the intrinsic headers only: GCC checks the diagnostic state at the innermost inlined
// location, which is in the header, so kvkernels code keeps -Wuninitialized and -Wmaybe-uninitialized.
// Include it first, before anything that may pull in <immintrin.h> unsilenced.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
