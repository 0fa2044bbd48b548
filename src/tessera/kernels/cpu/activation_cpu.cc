// SwiGLU, GELU (tanh) and row softmax on the CPU, AVX-512 with a portable fallback.
// Every kernel reads element i of each input before writing element i of its output,
// so outputs may alias inputs.
#include "tessera/kernels/cpu/activation_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/pointwise_common.h"

namespace tessera::kernels::cpu {
namespace {

namespace av = avx512;

constexpr int64_t kExpWork = int64_t{1} << 13;  // elements per task for exp-heavy rows
constexpr float kGeluK = 0.7978845608028654f;   // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
// exp argument cap in the GELU backward: e^88 is finite, so e * s^2 never becomes inf * 0.
constexpr float kExpArgMax = 88.0f;

// Runs fn(n) for every row, rows split over threads.
template <typename Fn>
void for_rows(int64_t rows, int64_t cols, int64_t work, Fn&& fn) {
  base::parallel_for(rows, grain_rows(cols, work), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) fn(n);
  });
}

// ---- SwiGLU: silu(g) = g / (1 + e^-g) as torch computes it.

void swiglu_row_scalar(const float* g, const float* u, float* o, int64_t F) {
  for (int64_t i = 0; i < F; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void swiglu_bwd_row_scalar(const float* d, const float* g, const float* u, float* dg, float* du,
                           int64_t F) {
  for (int64_t i = 0; i < F; ++i) {
    const float s = 1.0f / (1.0f + std::exp(-g[i]));
    const float dgi = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    du[i] = d[i] * (g[i] * s);
    dg[i] = dgi;
  }
}

TESSERA_AVX512 void swiglu_row_avx512(const float* g, const float* u, float* o, int64_t F) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    const __m512 gv = av::load(g + i, m);
    const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, av::exp(_mm512_sub_ps(zero, gv))));
    av::store(o + i, _mm512_mul_ps(silu, av::load(u + i, m)), m);
  }
}

TESSERA_AVX512 void swiglu_bwd_row_avx512(const float* d, const float* g, const float* u,
                                          float* dg, float* du, int64_t F) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    const __m512 dv = av::load(d + i, m), gv = av::load(g + i, m), uv = av::load(u + i, m);
    const __m512 s = av::sigmoid(gv);
    const __m512 t = _mm512_fmadd_ps(gv, _mm512_sub_ps(one, s), one);  // 1 + g (1 - s)
    const __m512 dgv = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(dv, uv), s), t);
    av::store(du + i, _mm512_mul_ps(dv, _mm512_mul_ps(gv, s)), m);
    av::store(dg + i, dgv, m);
  }
}

// ---- GELU (tanh): 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = k (x + c x^3). The
// sigmoid form needs one exp and has no cancellation for negative x. Derivative:
// s + 2 x s (1 - s) u', with 1 - s = e s, e = exp(-2u).

void gelu_row_scalar(const float* x, float* o, int64_t F) {
  for (int64_t i = 0; i < F; ++i) {
    const float v = x[i];
    const float u = kGeluK * (v + kGeluC * v * v * v);
    o[i] = v / (1.0f + std::exp(-2.0f * u));
  }
}

void gelu_bwd_row_scalar(const float* d, const float* x, float* dx, int64_t F) {
  for (int64_t i = 0; i < F; ++i) {
    const float v = x[i];
    const float u = kGeluK * (v + kGeluC * v * v * v);
    const float du = kGeluK * (1.0f + 3.0f * kGeluC * v * v);
    const float e = std::exp(std::min(-2.0f * u, kExpArgMax));
    const float s = 1.0f / (1.0f + e);
    dx[i] = d[i] * (s + 2.0f * v * (e * s * s) * du);
  }
}

TESSERA_AVX512 void gelu_row_avx512(const float* x, float* o, int64_t F) {
  const __m512 k = _mm512_set1_ps(kGeluK), c = _mm512_set1_ps(kGeluC);
  const __m512 one = _mm512_set1_ps(1.0f), m2 = _mm512_set1_ps(-2.0f);
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    const __m512 v = av::load(x + i, m);
    const __m512 v3 = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
    const __m512 u = _mm512_mul_ps(k, _mm512_fmadd_ps(c, v3, v));
    const __m512 e = av::exp(_mm512_mul_ps(m2, u));
    av::store(o + i, _mm512_div_ps(v, _mm512_add_ps(one, e)), m);
  }
}

TESSERA_AVX512 void gelu_bwd_row_avx512(const float* d, const float* x, float* dx, int64_t F) {
  const __m512 k = _mm512_set1_ps(kGeluK), c = _mm512_set1_ps(kGeluC);
  const __m512 c3 = _mm512_set1_ps(3.0f * kGeluC), one = _mm512_set1_ps(1.0f);
  const __m512 m2 = _mm512_set1_ps(-2.0f), two = _mm512_set1_ps(2.0f);
  const __m512 cap = _mm512_set1_ps(kExpArgMax);
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    const __m512 v = av::load(x + i, m);
    const __m512 v2 = _mm512_mul_ps(v, v);
    const __m512 u = _mm512_mul_ps(k, _mm512_fmadd_ps(_mm512_mul_ps(c, v2), v, v));
    const __m512 du = _mm512_mul_ps(k, _mm512_fmadd_ps(c3, v2, one));
    const __m512 e = av::exp(_mm512_min_ps(cap, _mm512_mul_ps(m2, u)));
    const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __m512 ess = _mm512_mul_ps(e, _mm512_mul_ps(s, s));
    const __m512 grad = _mm512_fmadd_ps(_mm512_mul_ps(two, v), _mm512_mul_ps(ess, du), s);
    av::store(dx + i, _mm512_mul_ps(av::load(d + i, m), grad), m);
  }
}

// ---- GeGLU: o = gelu(g) u; do/dg = u gelu'(g), do/du = gelu(g) (the GELU rows above).

void geglu_row_scalar(const float* g, const float* u, float* o, int64_t F) {
  gelu_row_scalar(g, o, F);
  for (int64_t i = 0; i < F; ++i) o[i] *= u[i];
}

void geglu_bwd_row_scalar(const float* d, const float* g, const float* u, float* dg, float* du, int64_t F) {
  gelu_bwd_row_scalar(d, g, dg, F);  // d gelu'(g), then times u
  gelu_row_scalar(g, du, F);         // gelu(g), then times d
  for (int64_t i = 0; i < F; ++i) {
    dg[i] *= u[i];
    du[i] *= d[i];
  }
}

TESSERA_AVX512 void geglu_row_avx512(const float* g, const float* u, float* o, int64_t F) {
  gelu_row_avx512(g, o, F);
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    av::store(o + i, _mm512_mul_ps(av::load(o + i, m), av::load(u + i, m)), m);
  }
}

TESSERA_AVX512 void geglu_bwd_row_avx512(const float* d, const float* g, const float* u, float* dg, float* du,
                                         int64_t F) {
  gelu_bwd_row_avx512(d, g, dg, F);  // d gelu'(g), then times u
  gelu_row_avx512(g, du, F);         // gelu(g), then times d
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    av::store(dg + i, _mm512_mul_ps(av::load(dg + i, m), av::load(u + i, m)), m);
    av::store(du + i, _mm512_mul_ps(av::load(du + i, m), av::load(d + i, m)), m);
  }
}

// ---- Softmax over a row, max-subtracted.

void softmax_row_scalar(const float* x, float* o, int64_t F) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < F; ++i) mx = std::max(mx, x[i]);
  double sum = 0;
  for (int64_t i = 0; i < F; ++i) {
    o[i] = std::exp(x[i] - mx);
    sum += o[i];
  }
  const float inv = 1.0f / static_cast<float>(sum);
  for (int64_t i = 0; i < F; ++i) o[i] *= inv;
}

void softmax_bwd_row_scalar(const float* dy, const float* y, float* dx, int64_t F) {
  double dot = 0;
  for (int64_t i = 0; i < F; ++i) dot += static_cast<double>(dy[i]) * y[i];
  const float d = static_cast<float>(dot);
  for (int64_t i = 0; i < F; ++i) dx[i] = y[i] * (dy[i] - d);
}

TESSERA_AVX512 void softmax_row_avx512(const float* x, float* o, int64_t F) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv = ninf;
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, m, x + i));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= F; i += 32) {
    const __m512 e0 = av::exp(_mm512_sub_ps(av::load(x + i), mx));
    const __m512 e1 = av::exp(_mm512_sub_ps(av::load(x + i + 16), mx));
    av::store(o + i, e0);
    av::store(o + i + 16, e1);
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
  }
  for (; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    const __m512 e = av::exp(_mm512_sub_ps(av::load(x + i, m), mx));
    av::store(o + i, e, m);
    s0 = _mm512_mask_add_ps(s0, m, s0, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)));
  for (i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    av::store(o + i, _mm512_mul_ps(av::load(o + i, m), inv), m);
  }
}

TESSERA_AVX512 void softmax_bwd_row_avx512(const float* dy, const float* y, float* dx,
                                           int64_t F) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    acc = _mm512_fmadd_ps(av::load(dy + i, m), av::load(y + i, m), acc);
  }
  const __m512 d = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = av::tail_mask(F - i);
    av::store(dx + i, _mm512_mul_ps(av::load(y + i, m), _mm512_sub_ps(av::load(dy + i, m), d)),
              m);
  }
}

// A gated activation's rows: out = act(gate) * up, and its backward, by row function.
using GatedRow = void (*)(const float*, const float*, float*, int64_t);
using GatedBwdRow = void (*)(const float*, const float*, const float*, float*, float*, int64_t);

void gated_forward(const Tensor& gate, const Tensor& up, Tensor& out, GatedRow vec_row, GatedRow scalar_row) {
  const auto G = rows_of<const float>(gate), U = rows_of<const float>(up);
  const auto O = rows_of<float>(out);
  const GatedRow row = use_avx512() ? vec_row : scalar_row;
  for_rows(G.rows, G.cols, kExpWork, [&](int64_t n) { row(G.row(n), U.row(n), O.row(n), G.cols); });
}

void gated_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate, Tensor& dup,
                    GatedBwdRow vec_row, GatedBwdRow scalar_row) {
  const auto D = rows_of<const float>(dout), G = rows_of<const float>(gate);
  const auto U = rows_of<const float>(up);
  const auto DG = rows_of<float>(dgate), DU = rows_of<float>(dup);
  const GatedBwdRow row = use_avx512() ? vec_row : scalar_row;
  for_rows(G.rows, G.cols, kExpWork,
           [&](int64_t n) { row(D.row(n), G.row(n), U.row(n), DG.row(n), DU.row(n), G.cols); });
}

}  // namespace

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  gated_forward(gate, up, out, swiglu_row_avx512, swiglu_row_scalar);
}

void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup) {
  gated_backward(dout, gate, up, dgate, dup, swiglu_bwd_row_avx512, swiglu_bwd_row_scalar);
}

void geglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) {
  gated_forward(gate, up, out, geglu_row_avx512, geglu_row_scalar);
}

void geglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate,
                    Tensor& dup) {
  gated_backward(dout, gate, up, dgate, dup, geglu_bwd_row_avx512, geglu_bwd_row_scalar);
}

void gelu_forward(const Tensor& x, Tensor& out) {
  const auto X = rows_of<const float>(x);
  const auto O = rows_of<float>(out);
  const bool vec = use_avx512();
  for_rows(X.rows, X.cols, kExpWork, [&](int64_t n) {
    if (vec)
      gelu_row_avx512(X.row(n), O.row(n), X.cols);
    else
      gelu_row_scalar(X.row(n), O.row(n), X.cols);
  });
}

void gelu_backward(const Tensor& dout, const Tensor& x, Tensor& dx) {
  const auto D = rows_of<const float>(dout), X = rows_of<const float>(x);
  const auto DX = rows_of<float>(dx);
  const bool vec = use_avx512();
  for_rows(X.rows, X.cols, kExpWork, [&](int64_t n) {
    if (vec)
      gelu_bwd_row_avx512(D.row(n), X.row(n), DX.row(n), X.cols);
    else
      gelu_bwd_row_scalar(D.row(n), X.row(n), DX.row(n), X.cols);
  });
}

void softmax_forward(const Tensor& x, Tensor& out) {
  const auto X = rows_of<const float>(x);
  const auto O = rows_of<float>(out);
  const bool vec = use_avx512();
  for_rows(X.rows, X.cols, kExpWork, [&](int64_t n) {
    if (vec)
      softmax_row_avx512(X.row(n), O.row(n), X.cols);
    else
      softmax_row_scalar(X.row(n), O.row(n), X.cols);
  });
}

void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) {
  const auto D = rows_of<const float>(dout), Y = rows_of<const float>(out);
  const auto DX = rows_of<float>(dx);
  const bool vec = use_avx512();
  for_rows(Y.rows, Y.cols, int64_t{1} << 15, [&](int64_t n) {
    if (vec)
      softmax_bwd_row_avx512(D.row(n), Y.row(n), DX.row(n), Y.cols);
    else
      softmax_bwd_row_scalar(D.row(n), Y.row(n), DX.row(n), Y.cols);
  });
}

}  // namespace tessera::kernels::cpu
