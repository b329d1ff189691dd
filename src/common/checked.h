// Size arithmetic that cannot overflow: the argument checks (src/validate.cpp) compute every
// element count and byte extent with these before anything is allocated or indexed, so a huge or
// hostile size is refused instead of wrapping to a small one.  Plain C++, no CUDA.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace mala {
namespace checked {

// *r = a * b; false when the product does not fit in int64.
inline bool mul(int64_t a, int64_t b, int64_t* r) { return !__builtin_mul_overflow(a, b, r); }
// *r = a + b; false on overflow.
inline bool add(int64_t a, int64_t b, int64_t* r) { return !__builtin_add_overflow(a, b, r); }
// The product of non-negative factors; false on overflow.
inline bool product(std::initializer_list<int64_t> factors, int64_t* r) {
  int64_t p = 1;
  for (int64_t f : factors)
    if (!mul(p, f, &p)) return false;
  *r = p;
  return true;
}

}  // namespace checked
}  // namespace mala
