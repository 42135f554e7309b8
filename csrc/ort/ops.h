// The ops of libkvkernels_ort.so (one OrtCustomOp each, alive for the process) and their domain.
#pragma once

#include "ort_host.h"

namespace kvkernels::ort {

constexpr const char* kDomain = "kvkernels";
OrtCustomOp* attention_op();  // PagedAttention (ops_attention.cpp)
OrtCustomOp* write_op();      // ReshapeAndCache (ops_cache.cpp)
OrtCustomOp* copy_op();       // CopyBlocks
OrtCustomOp* gather_op();     // GatherKV

}  // namespace kvkernels::ort
