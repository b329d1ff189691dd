// Internal helpers of the argument checks (src/validate.cpp, src/overlap.cpp): one definition of
// the error format "<argument>: <what>" and of the size arithmetic both files use.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>

#include "common/checked.h"
#include "mala/mala.h"

namespace mala {
namespace internal {

#define MALA_TRY(expr)            \
  do {                            \
    Status s_ = (expr);           \
    if (!s_) return s_;           \
  } while (0)

template <class T>
inline std::string str(T v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

inline Status fail(const std::string& name, const std::string& what) { return Status::error(name + ": " + what); }

// Bytes of a flat buffer holding the product of `factors` bytes; fails naming `name` when that
// does not fit in int64.
inline Status flat_bytes(const char* name, std::initializer_list<int64_t> factors, int64_t* bytes) {
  if (!checked::product(factors, bytes)) return fail(name, "its size in bytes overflows int64");
  return Status::success();
}

inline int64_t ceil_div(int64_t a, int64_t b) { return b > 0 ? a / b + (a % b != 0) : 0; }  // no a + b overflow

}  // namespace internal
}  // namespace mala
