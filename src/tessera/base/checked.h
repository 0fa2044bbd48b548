// Overflow-checked integer arithmetic for sizes derived from files and requests: a value
// read from a config.json or a request body is multiplied into an allocation size only
// through these, so a hostile input gets an error naming its key, never a wrapped size.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "tessera/base/error.h"

namespace tessera {

// a * b, or fails "what: a * b overflows" (what names the key or quantity).
inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) fail(what, ": ", a, " * ", b, " overflows a 64-bit integer");
  return r;
}

inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) fail(what, ": ", a, " + ", b, " overflows a 64-bit integer");
  return r;
}

// The product of all factors, checked.
inline int64_t checked_product(std::initializer_list<int64_t> factors, std::string_view what) {
  int64_t r = 1;
  for (int64_t f : factors) r = checked_mul(r, f, what);
  return r;
}

// `v` if lo <= v <= hi, else fails "what must be in [lo, hi], got v".
inline int64_t checked_range(int64_t v, int64_t lo, int64_t hi, std::string_view what) {
  if (v < lo || v > hi) fail(what, " must be in [", lo, ", ", hi, "], got ", v);
  return v;
}

}  // namespace tessera
