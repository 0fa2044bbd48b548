// Shared plumbing for the CPU pointwise kernels: which ISA they run, how finely rows
// are split across threads, row views of strided tensors, and a deterministic
// column reduction for weight / bias gradients.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>

#include "tessera/tensor/tensor.h"

namespace tessera::kernels::cpu {

enum class Isa { kScalar, kAvx512 };

// AVX-512 when the CPU has avx512f/bw/vl (and TESSERA_ISA does not cap it), else the
// portable path.
Isa pointwise_isa();
inline bool use_avx512() { return pointwise_isa() == Isa::kAvx512; }
// For tests: kScalar forces the portable path; kAvx512 returns to auto detection
// (which still falls back to scalar on CPUs without AVX-512).
void set_pointwise_isa_for_testing(Isa isa);

// Rows per parallel chunk so each chunk carries at least `work` elements; small
// inputs then run inline on the calling thread (no OpenMP fork).
inline int64_t grain_rows(int64_t cols, int64_t work = int64_t{1} << 15) {
  return std::max<int64_t>(1, work / std::max<int64_t>(cols, 1));
}

// A tensor seen as `rows` rows of `cols` contiguous elements, `pitch` apart.
template <typename T>
struct Rows {
  T* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t pitch = 0;
  T* row(int64_t n) const { return data + n * pitch; }
};

// Views a tensor as rows (checked layouts only: see detail::check_rows / check_row_major).
// Leading dims collapse into rows; a 1-D tensor is one row.
template <typename T>
Rows<T> rows_of(const Tensor& t) {
  Rows<T> r;
  r.data = static_cast<T*>(t.raw_data());
  const int nd = t.dim();
  r.cols = nd ? t.size(-1) : 1;
  r.rows = 1;
  for (int d = 0; d + 1 < nd; ++d) r.rows *= t.size(d);
  r.pitch = nd >= 2 ? t.stride(nd - 2) : r.cols;
  return r;
}

// Scalar reads of f32 / bf16 parameters, so row kernels can be templates on the weight type.
inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) { return bf16_to_f32(v.bits); }

// Calls fn(const T*) with t's data as float or bf16 (t already checked to be one of them).
template <typename Fn>
void with_param_type(const Tensor& t, Fn&& fn) {
  if (t.dtype() == DType::kBF16)
    fn(static_cast<const bf16*>(t.raw_data()));
  else
    fn(static_cast<const float*>(t.raw_data()));
}

// Column sums with a fixed summation order. The rows [0, rows) are cut into blocks
// whose boundaries depend only on (rows, grain), never on the thread count; fn(begin,
// end, partial) adds its rows into `partial` (accs.size() * width zeroed floats), and
// segment k of the partials is then added into accs[k] (width floats) in block order.
// The result is therefore the same bits for any number of threads, and no two threads
// write the same float.
void reduce_rows_into(int64_t rows, int64_t grain, std::initializer_list<float*> accs,
                      int64_t width, const std::function<void(int64_t, int64_t, float*)>& fn);

}  // namespace tessera::kernels::cpu
