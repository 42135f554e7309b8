// What every CUDA launcher returns (torch-free, shared by all kernel families). The binding turns
// a failed Status into an exception that names the op (cuda_binding.h, check_launch).
#pragma once

#include <cuda_runtime_api.h>

namespace kvkernels::cuda {

// cudaSuccess, a launch/API error, or a size the kernels do not index (message set).
struct Status {
  cudaError_t error = cudaSuccess;
  const char* message = nullptr;  // static text; set for limits, nullptr for CUDA errors
  bool ok() const { return error == cudaSuccess && message == nullptr; }
};

}  // namespace kvkernels::cuda
