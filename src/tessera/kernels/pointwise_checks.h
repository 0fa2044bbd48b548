// Argument checks shared by the entry points of the pointwise kernels (norm, rope,
// activations, elementwise, embedding, cross-entropy). Every failure throws
// tessera::Error naming the op, the argument and its shape.
#pragma once
#include <initializer_list>

#include "tessera/tensor/tensor.h"

namespace tessera::kernels::detail {

// t is a defined CPU tensor of dtype `dt`, 2-D (N, F), last dim contiguous, rows that
// do not overlap (stride(0) >= F unless N <= 1).
void check_rows(const Tensor& t, const char* op, const char* name, DType dt);
// As above, and the shape is (rows, cols).
void check_rows(const Tensor& t, const char* op, const char* name, DType dt, int64_t rows,
                int64_t cols);
// t is a defined, contiguous CPU tensor of shape (n) with one of the dtypes in `dts`.
void check_vector(const Tensor& t, const char* op, const char* name, int64_t n,
                  std::initializer_list<DType> dts);
// t (any rank >= 1, f32) can be walked as rows: last dim contiguous and the leading
// dims collapse into one row stride. Used by the elementwise helpers.
void check_row_major(const Tensor& t, const char* op, const char* name);

}  // namespace tessera::kernels::detail
