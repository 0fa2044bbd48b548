// Shape / dtype / layout checks for the pointwise kernels' entry points.
#include "tessera/kernels/pointwise_checks.h"

#include <string>

namespace tessera::kernels::detail {
namespace {

void check_defined_cpu(const Tensor& t, const char* op, const char* name) {
  TESSERA_CHECK(t.defined(), op, ": ", name, " is undefined");
  TESSERA_CHECK(t.device() == Device::kCPU, op, ": ", name, " ", t.describe(),
                " is not on the CPU; only CPU kernels exist for this op");
}

std::string dtype_list(std::initializer_list<DType> dts) {
  std::string s;
  for (DType d : dts) {
    if (!s.empty()) s += " or ";
    s += dtype_name(d);
  }
  return s;
}

}  // namespace

void check_rows(const Tensor& t, const char* op, const char* name, DType dt) {
  check_defined_cpu(t, op, name);
  TESSERA_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D (N, F), got ", t.describe());
  TESSERA_CHECK(t.dtype() == dt, op, ": ", name, " must be ", dtype_name(dt), ", got ",
                t.describe());
  TESSERA_CHECK(t.stride(1) == 1 || t.size(1) <= 1, op, ": ", name, " ", t.describe(),
                " must have a contiguous last dim, stride is ", t.stride(1));
  TESSERA_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1), op, ": ", name, " ", t.describe(),
                " has overlapping rows (row stride ", t.stride(0), ")");
}

void check_rows(const Tensor& t, const char* op, const char* name, DType dt, int64_t rows,
                int64_t cols) {
  check_rows(t, op, name, dt);
  TESSERA_CHECK(t.size(0) == rows && t.size(1) == cols, op, ": ", name, " has shape ",
                shape_str(t.shape()), ", expected ", shape_str({rows, cols}));
}

void check_vector(const Tensor& t, const char* op, const char* name, int64_t n,
                  std::initializer_list<DType> dts) {
  check_defined_cpu(t, op, name);
  bool dtype_ok = false;
  for (DType d : dts) dtype_ok = dtype_ok || t.dtype() == d;
  TESSERA_CHECK(dtype_ok, op, ": ", name, " must be ", dtype_list(dts), ", got ", t.describe());
  TESSERA_CHECK(t.dim() == 1 && t.size(0) == n, op, ": ", name, " has shape ",
                shape_str(t.shape()), ", expected ", shape_str({n}));
  TESSERA_CHECK(t.is_contiguous(), op, ": ", name, " ", t.describe(), " must be contiguous");
}

void check_row_major(const Tensor& t, const char* op, const char* name) {
  check_defined_cpu(t, op, name);
  TESSERA_CHECK(t.dtype() == DType::kF32, op, ": ", name, " must be f32, got ", t.describe());
  TESSERA_CHECK(t.dim() >= 1, op, ": ", name, " must have at least one dim, got ",
                t.describe());
  const int nd = t.dim();
  TESSERA_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, op, ": ", name, " ", t.describe(),
                " must have a contiguous last dim, stride is ", t.stride(-1));
  // Leading dims must collapse into one row index with a single row stride.
  for (int d = 0; d + 2 < nd; ++d)
    TESSERA_CHECK(t.size(d) <= 1 || t.stride(d) == t.stride(d + 1) * t.size(d + 1), op, ": ",
                  name, " ", t.describe(), " has leading dims that do not collapse into rows");
  if (nd >= 2) {
    int64_t rows = 1;
    for (int d = 0; d + 1 < nd; ++d) rows *= t.size(d);
    TESSERA_CHECK(rows <= 1 || t.stride(nd - 2) >= t.size(-1), op, ": ", name, " ",
                  t.describe(), " has overlapping rows (row stride ", t.stride(nd - 2), ")");
  }
}

}  // namespace tessera::kernels::detail
