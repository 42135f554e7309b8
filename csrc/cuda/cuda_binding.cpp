#include "cuda_binding.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdlib>
#include <cstring>

namespace kvkernels::cuda {

namespace {

int32_t device_of(const ArgCheck& c, const Tensor& t, const char* arg) {
  expect_cuda(c, t, arg);
  return static_cast<int32_t>(t.device().index());
}

}  // namespace

void expect_cuda(const ArgCheck& c, const Tensor& t, const char* arg) {
  c.expect(t.is_cuda(), arg, "must be a CUDA tensor (this call runs the CUDA kernel)");
}

DeviceScope::DeviceScope(const ArgCheck& c, const Tensor& t, const char* arg)
    : device_(device_of(c, t, arg)), guard_(device_) {
  // The stable ABI's accelerator::getCurrentStream gives a raw handle only from torch 2.13; the
  // AOTI shim call exists in every version this build targets (2.10+).
  void* stream = nullptr;
  if (aoti_torch_get_current_cuda_stream(device_, &stream) != AOTI_TORCH_SUCCESS)
    c.fail("CUDA", "cannot get the current CUDA stream of device ", device_);
  stream_ = static_cast<cudaStream_t>(stream);
}

bool debug_mode() {
  const char* v = std::getenv("KVKERNELS_DEBUG");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

void check_launch(const ArgCheck& c, const Status& s, const char* what) {
  if (s.message != nullptr) c.fail("CUDA", what, ": ", s.message);
  if (s.error != cudaSuccess)
    c.fail("CUDA", what, ": ", cudaGetErrorName(s.error), " (", cudaGetErrorString(s.error), ")");
}

template <typename T>
std::vector<T> to_host(const ArgCheck& c, const T* device_ptr, int64_t count, cudaStream_t stream) {
  std::vector<T> host(static_cast<size_t>(count));
  if (count == 0) return host;
  cudaError_t e = cudaMemcpyAsync(host.data(), device_ptr, sizeof(T) * host.size(),
                                  cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  check_launch(c, Status{e, nullptr}, "copy of an index tensor to the host (debug checks)");
  return host;
}

template std::vector<int32_t> to_host(const ArgCheck&, const int32_t*, int64_t, cudaStream_t);
template std::vector<int64_t> to_host(const ArgCheck&, const int64_t*, int64_t, cudaStream_t);

HostPagedKV host_paged_kv(const ArgCheck& c, const paged_kv_t& kv, cudaStream_t stream) {
  HostPagedKV h;
  h.kv = kv;
  h.block_tables = to_host(c, kv.block_tables, kv.num_seqs * kv.max_blocks_per_seq, stream);
  h.seq_lens = to_host(c, kv.seq_lens, kv.num_seqs, stream);
  h.kv.block_tables = h.block_tables.data();
  h.kv.seq_lens = h.seq_lens.data();
  return h;
}

}  // namespace kvkernels::cuda
