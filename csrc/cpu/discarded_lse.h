// Where the CPU kernels write the lse of an out= call without lse= (computed by every kernel, never
// returned to the caller): a grow-only buffer of the calling thread, so a decode step that passes
// only out= allocates nothing. Shared by attention.cpp and merge.cpp (an inline function's
// thread_local is one object per thread across translation units).
#pragma once

#include <cstdint>
#include <vector>

namespace kvkernels::cpu {

inline float* discarded_lse(int64_t rows) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(rows)) buffer.resize(static_cast<size_t>(rows));
  return buffer.data();
}

}  // namespace kvkernels::cpu
