// The copy of one block sub-tensor, shared by copy_blocks and swap_blocks (block_copy.cpp).
// Torch-free, so tests/test_reliability.py compiles it alone under UBSan.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvkernels/params.h"

namespace kvkernels::cpu {

// Copies one block sub-tensor: walks its outer dims and memcpys the contiguous innermost run.
inline void copy_block(const BlockCopyParams& p, const char* src, const int64_t* src_strides,
                       char* dst, const int64_t* dst_strides) {
  int64_t rows = 1;
  for (int d = 0; d < p.num_dims; ++d) rows *= p.sizes[d];
  // An empty block: no memcpy (a null data pointer is undefined there even for 0 bytes).
  if (rows == 0 || p.run_bytes == 0) return;
  int64_t idx[7] = {};
  for (int64_t r = 0; r < rows; ++r) {
    int64_t s = 0, t = 0;
    for (int d = 0; d < p.num_dims; ++d) {
      s += idx[d] * src_strides[d];
      t += idx[d] * dst_strides[d];
    }
    std::memcpy(dst + t, src + s, static_cast<size_t>(p.run_bytes));
    for (int d = p.num_dims - 1; d >= 0 && ++idx[d] == p.sizes[d]; --d) idx[d] = 0;
  }
}

}  // namespace kvkernels::cpu
