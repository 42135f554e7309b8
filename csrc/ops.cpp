// The op inventory: every schema of torch.ops.kvkernels lives in this one block (docs/design.md §8).
// Backends register implementations in their own files (cpu/*.cpp, cuda/*.cu bindings).
//
// Written tensors carry their own alias set and the op returns (): without the annotations
// torch.compile may drop or reorder the call. Lengths that change between steps are tensors or
// SymInt, never int, so a compiled decode step does not recompile as sequences grow.
#include <Python.h>
#include <torch/csrc/stable/library.h>

#include <stdexcept>

#include "cpu/isa.h"
#if defined(KVKERNELS_AMX_EMU)
#include "amx_emu.h"
#endif

namespace {

// _C.cpu_isa() -> "avx512" | "avx2" | "portable": the path the CPU kernels take right now.
PyObject* cpu_isa(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(kvkernels::cpu::isa_name(kvkernels::cpu::active_isa()));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// _C.amx_emulated_dot_products() -> None, or in a build with the AMX emulator (make amx-emu-test)
// the number of emulated tdpbf16ps so far: tests check with it that the AMX path really ran.
PyObject* amx_emulated_dot_products(PyObject*, PyObject*) {
#if defined(KVKERNELS_AMX_EMU)
  return PyLong_FromLongLong(kvkernels::amx_emu::dot_products().load());
#else
  Py_RETURN_NONE;
#endif
}

PyMethodDef methods[] = {
    {"cpu_isa", cpu_isa, METH_NOARGS, "SIMD path of the CPU kernels (honours KVKERNELS_CPU_ISA)"},
    {"amx_emulated_dot_products", amx_emulated_dot_products, METH_NOARGS,
     "None, or (AMX-emulator builds) the emulated tdpbf16ps count"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

// Importing kvkernels._C runs the static registrations below; the module only reports the CPU ISA.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}

// The arguments of the attention and merge ops, shared by the allocating op and its *_out twin,
// which takes the same arguments and then `*, Tensor(a!) out, Tensor(b!)? lse=None` (written
// outputs, returns ()). An argument added here reaches both schemas.
// causal is `bool?` only so that None reaches the kernels and is refused there: through a plain `bool`
// the dispatcher turns None into False, and a caller forwarding an unset option would get non-causal
// attention silently. Its default stays True.
#define KVK_PAGED_ATTENTION_ARGS                                                                \
  "Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "  \
  "Tensor? query_start_loc=None, float? scale=None, int window_left=-1, float soft_cap=0.0, "   \
  "Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None, " \
  "bool? causal=True"
#define KVK_MLA_PAGED_ATTENTION_ARGS                                                          \
  "Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, int kv_lora_rank, "       \
  "float scale, Tensor? query_start_loc=None, Tensor? kv_scale=None"
#define KVK_MERGE_ARGS "Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b"
#define KVK_OUT_ARGS ", *, Tensor(a!) out, Tensor(b!)? lse=None) -> ()"

STABLE_TORCH_LIBRARY(kvkernels, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def("paged_attention(" KVK_PAGED_ATTENTION_ARGS ") -> (Tensor out, Tensor lse)");
  m.def("paged_attention_out(" KVK_PAGED_ATTENTION_ARGS KVK_OUT_ARGS);
  m.def("merge_attention_states(" KVK_MERGE_ARGS ") -> (Tensor out, Tensor lse)");
  m.def("merge_attention_states_out(" KVK_MERGE_ARGS KVK_OUT_ARGS);
  m.def("copy_blocks(Tensor(a!) cache, Tensor block_mapping, int block_dim=0) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping, int block_dim=0) -> ()");
  m.def(
      "gather_kv(Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor? k_scale=None, Tensor? v_scale=None, SymInt? num_tokens=None, "
      "ScalarType? out_dtype=None) -> (Tensor key, Tensor value)");
  m.def(
      "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor? scale=None) -> ()");
  m.def(
      "mla_decompress(Tensor kv_cache, Tensor block_tables, Tensor seq_lens, Tensor w_kv_b, "
      "int kv_lora_rank, int qk_nope_head_dim, int v_head_dim, Tensor? norm_weight=None, "
      "float norm_eps=1e-6, Tensor? scale=None, SymInt? num_tokens=None) "
      "-> (Tensor key, Tensor value)");
  m.def("mla_paged_attention(" KVK_MLA_PAGED_ATTENTION_ARGS ") -> (Tensor out, Tensor lse)");
  m.def("mla_paged_attention_out(" KVK_MLA_PAGED_ATTENTION_ARGS KVK_OUT_ARGS);
}
