// The torch-free core of ArgCheck (checks.h): failures that name the offending argument,
// "kvkernels.<op>: <argument>: <what is wrong>", thrown as std::runtime_error. Kept apart from
// checks.h (which reads torch tensors) so the index checks (index_checks.h) also serve hosts
// without torch: the ONNX Runtime op library (csrc/ort/).
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace kvkernels {

class ArgError {
 public:
  explicit ArgError(const char* op) : op_(op) {}

  template <typename... Args>
  [[noreturn]] void fail(const char* arg, const Args&... what) const {
    std::ostringstream ss;
    ss << "kvkernels." << op_ << ": " << arg << ": ";
    (ss << ... << what);
    throw std::runtime_error(ss.str());
  }

  template <typename... Args>
  void expect(bool ok, const char* arg, const Args&... what) const {
    if (!ok) fail(arg, what...);
  }

  const char* op() const { return op_; }

 private:
  const char* op_;
};

// "1 block" / "4 blocks".
inline std::string plural(int64_t n, const char* noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

}  // namespace kvkernels
