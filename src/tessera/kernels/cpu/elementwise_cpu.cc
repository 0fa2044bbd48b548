// Elementwise helpers on the CPU. All are memory-bound: the AVX-512 versions exist so
// a row costs one pass at full vector width; the portable loops auto-vectorise.
#include "tessera/kernels/cpu/elementwise_cpu.h"

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/pointwise_common.h"

namespace tessera::kernels::cpu {
namespace {

namespace av = avx512;

// a[i] += b[i] for i < n; B is float or bf16.
template <typename B>
void add_row_scalar(float* a, const B* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += to_f32(b[i]);
}

template <typename B>
TESSERA_AVX512 void add_row_avx512(float* a, const B* b, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) av::store(a + i, _mm512_add_ps(av::load(a + i), av::load(b + i)));
  if (i < n) {
    const __mmask16 m = av::tail_mask(n - i);
    av::store(a + i, _mm512_add_ps(av::load(a + i, m), av::load(b + i, m)), m);
  }
}

void scale_scalar(float* a, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] *= s;
}

TESSERA_AVX512 void scale_avx512(float* a, float s, int64_t n) {
  const __m512 sv = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) av::store(a + i, _mm512_mul_ps(av::load(a + i), sv));
  if (i < n) {
    const __mmask16 m = av::tail_mask(n - i);
    av::store(a + i, _mm512_mul_ps(av::load(a + i, m), sv), m);
  }
}

template <typename B>
void add_row(bool vec, float* a, const B* b, int64_t n) {
  if (vec)
    add_row_avx512(a, b, n);
  else
    add_row_scalar(a, b, n);
}

}  // namespace

void add_inplace(Tensor& a, const Tensor& b) {
  const auto A = rows_of<float>(a);
  const auto B = rows_of<const float>(b);
  const bool vec = use_avx512();
  base::parallel_for(A.rows, grain_rows(A.cols), [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) add_row(vec, A.row(n), B.row(n), A.cols);
  });
}

void add_bias(Tensor& x, const Tensor& bias) {
  const auto X = rows_of<float>(x);
  const bool vec = use_avx512();
  with_param_type(bias, [&](const auto* b) {
    base::parallel_for(X.rows, grain_rows(X.cols), [&](int64_t r0, int64_t r1) {
      for (int64_t n = r0; n < r1; ++n) add_row(vec, X.row(n), b, X.cols);
    });
  });
}

void bias_backward(const Tensor& dout, Tensor& dbias) {
  const auto D = rows_of<const float>(dout);
  const bool vec = use_avx512();
  reduce_rows_into(D.rows, grain_rows(D.cols), {dbias.data<float>()}, D.cols,
                   [&](int64_t r0, int64_t r1, float* partial) {
                     for (int64_t n = r0; n < r1; ++n) add_row(vec, partial, D.row(n), D.cols);
                   });
}

void scale_inplace(Tensor& a, float s) {
  float* p = a.data<float>();
  const bool vec = use_avx512();
  base::parallel_for(a.numel(), int64_t{1} << 16, [&](int64_t b, int64_t e) {
    if (vec)
      scale_avx512(p + b, s, e - b);
    else
      scale_scalar(p + b, s, e - b);
  });
}

}  // namespace tessera::kernels::cpu
