#include "checks.h"

namespace kvkernels {

std::string shape_str(const Tensor& t) {
  std::ostringstream ss;
  ss << "[";
  for (int64_t d = 0; d < t.dim(); ++d) ss << (d ? ", " : "") << t.size(d);
  ss << "]";
  return ss.str();
}

bool is_fp8(ScalarType t) {
  return t == ScalarType::Float8_e4m3fn || t == ScalarType::Float8_e5m2;
}

bool is_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

void ArgCheck::dtype(const Tensor& t, const char* arg,
                     std::initializer_list<ScalarType> allowed) const {
  for (ScalarType s : allowed)
    if (t.scalar_type() == s) return;
  std::ostringstream ss;
  bool first = true;
  for (ScalarType s : allowed) {
    ss << (first ? "" : ", ") << torch::headeronly::toString(s);
    first = false;
  }
  fail(arg, "dtype ", torch::headeronly::toString(t.scalar_type()), " is not supported (expected ",
       ss.str(), ")");
}

// The passing case returns before any message is built: these run on every call of every op, and
// formatting the shape eagerly cost microseconds per call.
void ArgCheck::dim(const Tensor& t, const char* arg, int64_t ndim) const {
  if (t.dim() == ndim) return;
  fail(arg, "expected ", ndim, " dimensions, got shape ", shape_str(t));
}

void ArgCheck::size(const Tensor& t, const char* arg, int64_t d, int64_t expected,
                    const char* what) const {
  if (t.size(d) == expected) return;
  fail(arg, "dimension ", d, " of shape ", shape_str(t), " must be ", expected, " (", what, ")");
}

void ArgCheck::same_device(const Tensor& t, const char* arg, const Tensor& ref,
                           const char* ref_arg) const {
  const auto a = t.device();
  const auto b = ref.device();
  expect(a.type() == b.type() && a.index() == b.index(), arg, "must be on the device of ", ref_arg);
}

void ArgCheck::like(const Tensor& t, const char* arg, const Tensor& ref,
                    const char* ref_arg) const {
  same_device(t, arg, ref, ref_arg);
  expect(t.scalar_type() == ref.scalar_type(), arg, "dtype ",
         torch::headeronly::toString(t.scalar_type()), " must equal ", ref_arg, "'s dtype ",
         torch::headeronly::toString(ref.scalar_type()));
}

void ArgCheck::cache_dtype(const Tensor& cache, const char* arg, const Tensor& ref,
                           const char* ref_arg) const {
  expect(is_fp8(cache.scalar_type()) || cache.scalar_type() == ref.scalar_type(), arg, "dtype ",
         torch::headeronly::toString(cache.scalar_type()), " must equal ", ref_arg, "'s dtype ",
         torch::headeronly::toString(ref.scalar_type()), " (or be an fp8 type)");
}

void ArgCheck::last_dim_contiguous(const Tensor& t, const char* arg) const {
  expect(t.dim() == 0 || t.size(t.dim() - 1) <= 1 || t.stride(t.dim() - 1) == 1, arg,
         "the last dimension must have stride 1 (got ", t.stride(t.dim() - 1), ")");
}

bool ArgCheck::scale(const std::optional<Tensor>& t, const char* arg, const Tensor& ref,
                     const char* ref_arg, int64_t per_head) const {
  expect(t.has_value(), arg, "required for an fp8 ", ref_arg);
  dtype(*t, arg, {ScalarType::Float});
  same_device(*t, arg, ref, ref_arg);
  const int64_t n = t->numel();
  if (n == 1 || (per_head > 0 && n == per_head)) return n != 1;
  fail(arg, "expected 1",
       per_head > 0 ? " or " + std::to_string(per_head) + " (one per kv head)" : std::string(),
       " elements, got ", n);
}

}  // namespace kvkernels
