// What every CUDA binding file (cache_ops_binding.cpp, attention_binding.cpp, ...) shares: the
// device and current-stream scope of an op call, the debug switch, launch-status checks and the
// host copies that debug-mode index checks read. Compiled with the host compiler (-DUSE_CUDA),
// against the LibTorch stable ABI only; kernels and launchers stay torch-free in *.cu/*.cuh.
//
// Each binding file registers its ops with its own STABLE_TORCH_LIBRARY_IMPL(kvkernels, CUDA, m)
// block: the macro makes a uniquely named static registrar per use (C10_UID), so any number of
// files may register CUDA kernels for the kvkernels namespace, one op each.
#pragma once

#include <cuda_runtime_api.h>
#include <torch/csrc/stable/accelerator.h>

#include <cstdint>
#include <vector>

#include "../checks.h"
#include "kvkernels/params.h"
#include "launch.h"

namespace kvkernels::cuda {

// For the duration of an op call: `t`'s CUDA device is current, and stream() is torch's current
// stream on it (what every kernel of the call is enqueued on; nothing synchronizes with it).
class DeviceScope {
 public:
  DeviceScope(const ArgCheck& c, const Tensor& t, const char* arg);
  cudaStream_t stream() const { return stream_; }
  int32_t device() const { return device_; }

 private:
  int32_t device_;
  torch::stable::accelerator::DeviceGuard guard_;
  cudaStream_t stream_ = nullptr;
};

// KVKERNELS_DEBUG=1 (read on every call): run the index-range checks that need device data on
// host copies before launching. Those copies synchronize the stream, so debug mode is neither
// asynchronous nor CUDA-graph capturable.
bool debug_mode();

// Throws "kvkernels.<op>: CUDA: <what>: <error>" for a failed launch or a size limit.
void check_launch(const ArgCheck& c, const Status& s, const char* what);

// `count` elements of device memory, copied on `stream` and waited for (a host sync).
template <typename T>
std::vector<T> to_host(const ArgCheck& c, const T* device_ptr, int64_t count, cudaStream_t stream);

// A paged_kv_t whose block_tables / seq_lens point at host copies (everything else unchanged),
// for the checks of index_checks.h. Synchronizes `stream`.
struct HostPagedKV {
  paged_kv_t kv;
  std::vector<int32_t> block_tables, seq_lens;
};
HostPagedKV host_paged_kv(const ArgCheck& c, const paged_kv_t& kv, cudaStream_t stream);

// Fails unless `t` is a CUDA tensor (the dispatcher picks the CUDA kernel when any argument is on
// CUDA; this names the argument that is not).
void expect_cuda(const ArgCheck& c, const Tensor& t, const char* arg);

}  // namespace kvkernels::cuda
