// The row kernels behind reshape_and_cache / concat_and_cache_mla (cache_write.cpp), gather_kv
// (gather.cpp) and merge_attention_states (merge.cpp): element-wise conversions of whole rows
// (quantize to fp8, dequantize, bf16/fp16 rounding, weighted merge), written once in
// rows_kernel.h and compiled per ISA in rows_<isa>.cpp. The op files keep validation and the
// parallel split and call one of these per parallel chunk; the element formats are resolved once
// per chunk inside, never per element.
#pragma once

#include <cstdint>

#include "kvkernels/params.h"

namespace kvkernels::cpu {

// One gather_kv work item: the tokens of logical block `block` of sequence `seq`.
struct GatherItem {
  int64_t seq = 0;
  int64_t block = 0;
};

struct RowKernels {
  // Writes tokens [begin, end) of one source into the cache (slots validated by the caller).
  void (*write_tokens)(const CacheWriteParams&, int64_t begin, int64_t end);
  // Copies items [begin, end) of the paged cache into p.key / p.value.
  void (*gather)(const GatherParams&, const GatherItem* items, int64_t begin, int64_t end);
  // Merges rows [begin, end) (row = token * num_heads + head), writes out and lse.
  void (*merge)(const MergeParams&, int64_t begin, int64_t end);
};

extern const RowKernels kRowsPortable;
#if defined(__x86_64__)
extern const RowKernels kRowsAvx2;
extern const RowKernels kRowsAvx512;
#endif

// The kernels of active_isa() (isa.h): call once per op, before anything is written (it throws
// on a bad KVKERNELS_CPU_ISA).
const RowKernels& row_kernels();

}  // namespace kvkernels::cpu
