// libkvkernels_ort.so: the kvkernels CPU kernels as ONNX Runtime custom ops, domain "kvkernels",
// version 1 (docs/onnx.md is the op reference): this file registers them; ops_*.cpp define them. Built by scripts/build_ort.sh from the same
// kernel sources as the torch extension; it links neither libtorch nor libonnxruntime (ORT hands
// its API table to RegisterCustomOps). Loaded with
// SessionOptions.register_custom_ops_library(path).
//
// Ops that update a cache (ReshapeAndCache, CopyBlocks) return it as an output that ORT aliases to
// the cache input (OrtCustomOp::GetAliasMap, the mechanism of ORT's own Reshape / Identity): the
// output *is* the input's buffer, so a step writes a few rows instead of copying the cache. A
// graph keeps a cache persistent by taking it as an input bound to a long-lived OrtValue (IOBinding
// or a numpy-backed OrtValue), feeding the updated output to the ops that read it, and never
// giving the cache input a second consumer (the alias makes the old contents unreadable).
#include <initializer_list>

#include "ops.h"

// The entry point ORT calls (SessionOptions.register_custom_ops_library): the ops live as long as
// the process (ORT keeps pointers to them), the domain too.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {  // an ORT older than the headers (API 21): report it through API 1
    const OrtApi* v1 = api_base->GetApi(1);
    return v1 == nullptr ? nullptr
                         : v1->CreateStatus(ORT_FAIL, "libkvkernels_ort.so needs ONNX Runtime 1.21 or "
                                                      "newer (ORT API 21)");
  }
  Ort::InitApi(api);
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* s = api->CreateCustomOpDomain(kvkernels::ort::kDomain, &domain)) return s;
  for (OrtCustomOp* op : {kvkernels::ort::attention_op(), kvkernels::ort::write_op(),
                          kvkernels::ort::copy_op(), kvkernels::ort::gather_op()})
    if (OrtStatus* s = api->CustomOpDomain_Add(domain, op)) return s;
  return api->AddCustomOpDomain(options, domain);
}
