// Shared by the comm tests: deterministic per-rank inputs that any rank can regenerate,
// and a reference computed on one rank in double (exact for integers).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "tessera/comm/communicator.h"
#include "tessera/tensor/dtype.h"
#include "tessera/tensor/tensor.h"

namespace tessera::comm::testing {

inline uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Element i of rank r's input for case `seed`, as the dtype stores it (so bf16/f16 values
// are already rounded), returned exactly as a double.
inline double input_value(DType dt, uint64_t seed, int r, int64_t i) {
  const uint64_t h = mix(seed * 1000003ull + static_cast<uint64_t>(r) * 7919ull + mix(i));
  const double u = static_cast<double>(h >> 11) / 9007199254740992.0 * 2 - 1;  // [-1, 1)
  switch (dt) {
    case DType::kF32:
      return static_cast<float>(u * 3);
    case DType::kBF16:
      return bf16_to_f32(f32_to_bf16(static_cast<float>(u * 3)));
    case DType::kF16:
      return f16_to_f32(f32_to_f16(static_cast<float>(u * 3)));
    case DType::kI32:
      return static_cast<int32_t>(u * 1000);
    case DType::kI64:
      return static_cast<double>(static_cast<int64_t>(u * 1e12));
    default:
      return 0;
  }
}

inline void set_value(Tensor& t, int64_t i, double v) {
  void* p = static_cast<char*>(t.raw_data()) + i * dtype_size(t.dtype());
  switch (t.dtype()) {
    case DType::kF32:
      *static_cast<float*>(p) = static_cast<float>(v);
      break;
    case DType::kBF16:
      *static_cast<uint16_t*>(p) = f32_to_bf16(static_cast<float>(v));
      break;
    case DType::kF16:
      *static_cast<uint16_t*>(p) = f32_to_f16(static_cast<float>(v));
      break;
    case DType::kI32:
      *static_cast<int32_t*>(p) = static_cast<int32_t>(v);
      break;
    case DType::kI64:
      *static_cast<int64_t*>(p) = static_cast<int64_t>(v);
      break;
    default:
      break;
  }
}

inline double get_value(const Tensor& t, int64_t i) {
  const void* p = static_cast<const char*>(t.raw_data()) + i * dtype_size(t.dtype());
  switch (t.dtype()) {
    case DType::kI32:
      return *static_cast<const int32_t*>(p);
    case DType::kI64:
      return static_cast<double>(*static_cast<const int64_t*>(p));
    default:
      return t.item_f32(i);
  }
}

// Rank r's input: n elements, elements [offset, offset + n) of the case's sequence.
inline Tensor make_input(DType dt, int64_t n, uint64_t seed, int r, int64_t offset = 0) {
  Tensor t = Tensor::empty({n}, dt);
  for (int64_t i = 0; i < n; ++i) set_value(t, i, input_value(dt, seed, r, offset + i));
  return t;
}

// The reduction of element i over `ranks` (group ranks mapped to the ids that seeded their
// inputs), and the tolerance allowed for it.
struct Expected {
  double value, tol;
};
inline Expected reduce_reference(DType dt, ReduceOp op, uint64_t seed, const std::vector<int>& ids,
                                 int64_t i) {
  double sum = 0, mag = 0, mx = -INFINITY;
  int64_t isum = 0;
  for (int id : ids) {
    const double v = input_value(dt, seed, id, i);
    sum += v;
    mag += std::fabs(v);
    mx = std::max(mx, v);
    isum += static_cast<int64_t>(v);
  }
  const int n = static_cast<int>(ids.size());
  if (dt == DType::kI32 || dt == DType::kI64) {
    if (op == ReduceOp::kMax) return {mx, 0};
    if (op == ReduceOp::kAvg) return {static_cast<double>(isum / n), 0};
    return {static_cast<double>(isum), 0};
  }
  if (op == ReduceOp::kMax) return {mx, 0};  // a max is exact in every dtype
  double value = sum;
  if (op == ReduceOp::kAvg) {
    value /= n;
    mag /= n;
  }
  // f32 accumulation (~1e-6 of the magnitudes summed) plus, for bf16/f16, one rounding of
  // the result (half an ulp: at most 2^-8 / 2^-11 relative; f16 subnormals 2^-25).
  double tol = 1e-6 * mag + 1e-30;
  if (dt == DType::kBF16) tol += std::fabs(value) * std::ldexp(1.0, -8);
  if (dt == DType::kF16) tol += std::fabs(value) * std::ldexp(1.0, -11) + std::ldexp(1.0, -24);
  return {value, tol};
}

inline const char* op_name(ReduceOp op) {
  return op == ReduceOp::kSum ? "sum" : op == ReduceOp::kAvg ? "avg" : "max";
}

}  // namespace tessera::comm::testing
