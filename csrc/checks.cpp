#include "checks.h"

#include <climits>
#include <cstdint>
#include <vector>

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

Layout::Layout(const Tensor& t)
    : ptr(reinterpret_cast<uintptr_t>(t.const_data_ptr())),
      elem(static_cast<uint64_t>(t.element_size())),
      sizes(t.sizes()),
      strides(t.strides()) {
  const auto d = t.device();
  device_type = static_cast<int32_t>(d.type());
  device_index = static_cast<int32_t>(d.index());
}

bool Layout::empty() const {
  for (int64_t n : sizes)
    if (n == 0) return true;
  return false;
}

namespace {

uint64_t sat_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

uint64_t sat_add(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

// Bytes from t's first byte to one past its last, over the dims of size > 1 whose byte stride
// `modulus` does not divide (0: all of them); saturates at UINT64_MAX. Strides are never negative
// in torch.
uint64_t byte_extent(const Layout& t, uint64_t modulus) {
  uint64_t e = t.elem;
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (t.sizes[d] <= 1) continue;
    const uint64_t stride = sat_mul(static_cast<uint64_t>(t.strides[d]), t.elem);
    if (modulus != 0 && stride != UINT64_MAX && stride % modulus == 0) continue;
    e = sat_add(e, sat_mul(stride, static_cast<uint64_t>(t.sizes[d] - 1)));
  }
  return e;
}

}  // namespace

bool has_internal_overlap(const Layout& t) {
  if (t.empty()) return false;
  // (stride, size) of the dims of size > 1, sorted by stride (insertion sort: a handful of dims).
  constexpr size_t kInline = 16;
  std::pair<int64_t, int64_t> inline_dims[kInline];
  std::vector<std::pair<int64_t, int64_t>> heap_dims;
  std::pair<int64_t, int64_t>* dims = inline_dims;
  if (t.sizes.size() > kInline) {
    heap_dims.resize(t.sizes.size());
    dims = heap_dims.data();
  }
  size_t n = 0;
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (t.sizes[d] <= 1) continue;
    size_t i = n++;
    for (; i > 0 && dims[i - 1].first > t.strides[d]; --i) dims[i] = dims[i - 1];
    dims[i] = {t.strides[d], t.sizes[d]};
  }
  int64_t reach = 1;  // elements spanned by the dims already visited
  for (size_t i = 0; i < n; ++i) {
    const auto [stride, size] = dims[i];
    if (stride < reach) return true;
    int64_t step;
    if (__builtin_mul_overflow(stride, size - 1, &step) || __builtin_add_overflow(reach, step, &reach))
      return true;  // strides no allocation can have
  }
  return false;
}

bool may_overlap(const Layout& a, const Layout& b) {
  if (a.device_type != b.device_type || a.device_index != b.device_index) return false;
  if (a.empty() || b.empty()) return false;
  // The byte ranges [ptr, ptr + extent) first: distinct allocations end here, on every call.
  if (a.ptr >= b.ptr ? a.ptr - b.ptr >= byte_extent(b, 0) : b.ptr - a.ptr >= byte_extent(a, 0))
    return false;
  // Residues mod M, for M = each byte stride: the dims whose stride M divides add nothing, the
  // others reach at most byte_extent(., M) - 1 bytes past the first byte, so each tensor's bytes lie
  // in the cyclic interval [ptr mod M, ptr mod M + extent). Disjoint intervals: no shared byte.
  for (const Layout* t : {&a, &b}) {
    for (size_t d = 0; d < t->sizes.size(); ++d) {
      if (t->sizes[d] <= 1) continue;
      const uint64_t m = sat_mul(static_cast<uint64_t>(t->strides[d]), t->elem);
      if (m == 0 || m == UINT64_MAX) continue;
      const uint64_t ia = byte_extent(a, m), ib = byte_extent(b, m);
      if (ia >= m || ib >= m) continue;  // covers every residue
      const uint64_t ra = a.ptr % m, rb = b.ptr % m;
      const uint64_t b_after_a = rb >= ra ? rb - ra : m - (ra - rb);  // (rb - ra) mod m
      const uint64_t a_after_b = ra >= rb ? ra - rb : m - (rb - ra);
      if (b_after_a >= ia && a_after_b >= ib) return false;
    }
  }
  return true;
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

int ArgCheck::to_int(int64_t v, const char* arg, const std::string& what) const {
  if (v >= INT_MIN && v <= INT_MAX) return static_cast<int>(v);
  fail(arg, what, what.empty() ? "" : " = ", v, " exceeds the supported maximum ", INT_MAX);
}

void ArgCheck::writable(const Layout& out, const char* arg) const {
  if (!has_internal_overlap(out)) return;
  std::ostringstream sizes, strides;
  for (size_t d = 0; d < out.sizes.size(); ++d) {
    sizes << (d ? ", " : "") << out.sizes[d];
    strides << (d ? ", " : "") << out.strides[d];
  }
  fail(arg, "elements of this output share memory (shape [", sizes.str(), "], strides [",
       strides.str(), "]: a stride-0 dimension from expand(), or overlapping strides); every ",
       "element an op writes needs its own memory");
}

void ArgCheck::disjoint(const Layout& t, const char* arg, const Layout& out,
                        const char* out_arg) const {
  expect(!may_overlap(t, out), arg, "shares memory with ", out_arg, ", which this op writes ",
         "(an output must not overlap another output or an input)");
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
