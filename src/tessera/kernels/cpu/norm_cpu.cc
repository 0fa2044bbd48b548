// RMSNorm / LayerNorm on the CPU: one row per task, AVX-512 row kernels with a
// portable fallback. Row statistics follow Hugging Face: f32 mean of squares (RMS),
// biased variance (LayerNorm), rstd = 1 / sqrt(var + eps).
#include "tessera/kernels/cpu/norm_cpu.h"

#include <cmath>
#include <type_traits>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/pointwise_common.h"

namespace tessera::kernels::cpu {
namespace {

namespace av = avx512;

// ---- portable path (sums in double: without -ffast-math the compiler keeps a serial
// f32 sum, whose error would grow with H).

template <typename W>
float rms_row_scalar(float* x, const float* delta, const W* w, int64_t H, float eps,
                     float* out) {
  if (delta)
    for (int64_t i = 0; i < H; ++i) x[i] += delta[i];
  double ss = 0;
  for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float rstd = 1.0f / std::sqrt(static_cast<float>(ss / H) + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = (x[i] * rstd) * to_f32(w[i]);
  return rstd;
}

template <typename W>
void ln_row_scalar(float* x, const float* delta, const W* w, const W* b, int64_t H, float eps,
                   float* out, float* mean_out, float* rstd_out) {
  if (delta)
    for (int64_t i = 0; i < H; ++i) x[i] += delta[i];
  double s = 0;
  for (int64_t i = 0; i < H; ++i) s += x[i];
  const float mean = static_cast<float>(s / H);
  double v = 0;
  for (int64_t i = 0; i < H; ++i) v += static_cast<double>(x[i] - mean) * (x[i] - mean);
  const float rstd = 1.0f / std::sqrt(static_cast<float>(v / H) + eps);
  for (int64_t i = 0; i < H; ++i)
    out[i] = (x[i] - mean) * rstd * to_f32(w[i]) + to_f32(b[i]);
  *mean_out = mean;
  *rstd_out = rstd;
}

template <typename W>
void rms_bwd_row_scalar(const float* dout, const float* x, const W* w, float rstd, int64_t H,
                        float* dx, float* dw) {
  double dot = 0;
  for (int64_t i = 0; i < H; ++i) dot += static_cast<double>(to_f32(w[i]) * dout[i]) * x[i];
  const float c = static_cast<float>(dot / H) * rstd * rstd;
  for (int64_t i = 0; i < H; ++i) {
    const float g = to_f32(w[i]) * dout[i];
    dw[i] += dout[i] * (x[i] * rstd);
    dx[i] = rstd * (g - x[i] * c);
  }
}

template <typename W>
void ln_bwd_row_scalar(const float* dout, const float* x, const W* w, float mean, float rstd,
                       int64_t H, float* dx, float* dw, float* db) {
  double s1 = 0, s2 = 0;
  for (int64_t i = 0; i < H; ++i) {
    const float g = to_f32(w[i]) * dout[i];
    s1 += g;
    s2 += static_cast<double>(g) * ((x[i] - mean) * rstd);
  }
  const float m1 = static_cast<float>(s1 / H), m2 = static_cast<float>(s2 / H);
  for (int64_t i = 0; i < H; ++i) {
    const float norm = (x[i] - mean) * rstd;
    const float g = to_f32(w[i]) * dout[i];
    db[i] += dout[i];
    dw[i] += norm * dout[i];
    dx[i] = (g - m1 - norm * m2) * rstd;
  }
}

// ---- AVX-512 path. Two accumulators in the reductions halve the dependency chain
// and the f32 rounding error.

template <typename W>
TESSERA_AVX512 float rms_row_avx512(float* x, const float* delta, const W* w, int64_t H,
                                    float eps, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= H; i += 32) {
    __m512 v0 = av::load(x + i), v1 = av::load(x + i + 16);
    if (delta) {
      v0 = _mm512_add_ps(v0, av::load(delta + i));
      v1 = _mm512_add_ps(v1, av::load(delta + i + 16));
      av::store(x + i, v0);
      av::store(x + i + 16, v1);
    }
    a0 = _mm512_fmadd_ps(v0, v0, a0);
    a1 = _mm512_fmadd_ps(v1, v1, a1);
  }
  for (; i < H; i += 16) {
    const __mmask16 m = av::tail_mask(H - i);
    __m512 v = av::load(x + i, m);
    if (delta) {
      v = _mm512_add_ps(v, av::load(delta + i, m));
      av::store(x + i, v, m);
    }
    a0 = _mm512_fmadd_ps(v, v, a0);
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  const __m512 r = _mm512_set1_ps(rstd);
  for (i = 0; i < H; i += 16) {
    const __mmask16 m = av::tail_mask(H - i);
    const __m512 v = _mm512_mul_ps(av::load(x + i, m), r);
    av::store(out + i, _mm512_mul_ps(v, av::load(w + i, m)), m);
  }
  return rstd;
}

template <typename W>
TESSERA_AVX512 void ln_row_avx512(float* x, const float* delta, const W* w, const W* b,
                                  int64_t H, float eps, float* out, float* mean_out,
                                  float* rstd_out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= H; i += 32) {
    __m512 v0 = av::load(x + i), v1 = av::load(x + i + 16);
    if (delta) {
      v0 = _mm512_add_ps(v0, av::load(delta + i));
      v1 = _mm512_add_ps(v1, av::load(delta + i + 16));
      av::store(x + i, v0);
      av::store(x + i + 16, v1);
    }
    a0 = _mm512_add_ps(a0, v0);
    a1 = _mm512_add_ps(a1, v1);
  }
  for (; i < H; i += 16) {
    const __mmask16 m = av::tail_mask(H - i);
    __m512 v = av::load(x + i, m);
    if (delta) {
      v = _mm512_add_ps(v, av::load(delta + i, m));
      av::store(x + i, v, m);
    }
    a0 = _mm512_add_ps(a0, v);
  }
  const float mean = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) / static_cast<float>(H);
  // Second pass over the (cached) row: the two-pass variance has no cancellation.
  const __m512 mv = _mm512_set1_ps(mean);
  a0 = _mm512_setzero_ps();
  for (i = 0; i < H; i += 16) {
    const __mmask16 m = av::tail_mask(H - i);
    const __m512 d = _mm512_maskz_sub_ps(m, av::load(x + i, m), mv);
    a0 = _mm512_fmadd_ps(d, d, a0);
  }
  const float var = _mm512_reduce_add_ps(a0) / static_cast<float>(H);
  const float rstd = 1.0f / std::sqrt(var + eps);
  const __m512 r = _mm512_set1_ps(rstd);
  for (i = 0; i < H; i += 16) {
    const __mmask16 m = av::tail_mask(H - i);
    const __m512 n = _mm512_mul_ps(_mm512_sub_ps(av::load(x + i, m), mv), r);
    av::store(out + i, _mm512_fmadd_ps(n, av::load(w + i, m), av::load(b + i, m)), m);
  }
  *mean_out = mean;
  *rstd_out = rstd;
}

template <typename W>
TESSERA_AVX512 void rms_bwd_row_avx512(const float* dout, const float* x, const W* w,
                                       float rstd, int64_t H, float* dx, float* dw) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = av::tail_mask(H - i);
    const __m512 g = _mm512_mul_ps(av::load(w + i, m), av::load(dout + i, m));
    acc = _mm512_fmadd_ps(g, av::load(x + i, m), acc);
  }
  const float c = _mm512_reduce_add_ps(acc) / static_cast<float>(H) * rstd * rstd;
  const __m512 r = _mm512_set1_ps(rstd), cv = _mm512_set1_ps(c);
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = av::tail_mask(H - i);
    const __m512 d = av::load(dout + i, m), xv = av::load(x + i, m);
    const __m512 g = _mm512_mul_ps(av::load(w + i, m), d);
    av::store(dw + i, _mm512_fmadd_ps(d, _mm512_mul_ps(xv, r), av::load(dw + i, m)), m);
    av::store(dx + i, _mm512_mul_ps(r, _mm512_fnmadd_ps(xv, cv, g)), m);
  }
}

template <typename W>
TESSERA_AVX512 void ln_bwd_row_avx512(const float* dout, const float* x, const W* w,
                                      float mean, float rstd, int64_t H, float* dx, float* dw,
                                      float* db) {
  const __m512 mv = _mm512_set1_ps(mean), r = _mm512_set1_ps(rstd);
  __m512 s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = av::tail_mask(H - i);
    const __m512 norm = _mm512_mul_ps(_mm512_sub_ps(av::load(x + i, m), mv), r);
    const __m512 g = _mm512_mul_ps(av::load(w + i, m), av::load(dout + i, m));
    s1 = _mm512_add_ps(s1, g);
    s2 = _mm512_fmadd_ps(g, norm, s2);
  }
  const float inv_h = 1.0f / static_cast<float>(H);
  const __m512 m1 = _mm512_set1_ps(_mm512_reduce_add_ps(s1) * inv_h);
  const __m512 m2 = _mm512_set1_ps(_mm512_reduce_add_ps(s2) * inv_h);
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = av::tail_mask(H - i);
    const __m512 d = av::load(dout + i, m);
    const __m512 norm = _mm512_mul_ps(_mm512_sub_ps(av::load(x + i, m), mv), r);
    const __m512 g = _mm512_mul_ps(av::load(w + i, m), d);
    av::store(db + i, _mm512_add_ps(av::load(db + i, m), d), m);
    av::store(dw + i, _mm512_fmadd_ps(norm, d, av::load(dw + i, m)), m);
    const __m512 t = _mm512_fnmadd_ps(norm, m2, _mm512_sub_ps(g, m1));
    av::store(dx + i, _mm512_mul_ps(t, r), m);
  }
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor* delta, const Tensor& weight, float eps,
                     Tensor& out, Tensor* rstd) {
  const auto X = rows_of<float>(x), O = rows_of<float>(out);
  Rows<const float> D;
  if (delta) D = rows_of<const float>(*delta);
  float* R = rstd ? rstd->data<float>() : nullptr;
  const int64_t H = X.cols;
  const bool vec = use_avx512();
  with_param_type(weight, [&](const auto* w) {
    base::parallel_for(X.rows, grain_rows(H), [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        const float* d = delta ? D.row(n) : nullptr;
        const float r = vec ? rms_row_avx512(X.row(n), d, w, H, eps, O.row(n))
                            : rms_row_scalar(X.row(n), d, w, H, eps, O.row(n));
        if (R) R[n] = r;
      }
    });
  });
}

void layernorm_forward(const Tensor& x, const Tensor* delta, const Tensor& weight,
                       const Tensor& bias, float eps, Tensor& out, Tensor* mean, Tensor* rstd) {
  const auto X = rows_of<float>(x), O = rows_of<float>(out);
  Rows<const float> D;
  if (delta) D = rows_of<const float>(*delta);
  float* M = mean ? mean->data<float>() : nullptr;
  float* R = rstd ? rstd->data<float>() : nullptr;
  const int64_t H = X.cols;
  const bool vec = use_avx512();
  with_param_type(weight, [&](const auto* w) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(w)>>;
    const W* bp = static_cast<const W*>(bias.raw_data());
    base::parallel_for(X.rows, grain_rows(H), [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        const float* d = delta ? D.row(n) : nullptr;
        float mu, r;
        if (vec)
          ln_row_avx512(X.row(n), d, w, bp, H, eps, O.row(n), &mu, &r);
        else
          ln_row_scalar(X.row(n), d, w, bp, H, eps, O.row(n), &mu, &r);
        if (M) M[n] = mu;
        if (R) R[n] = r;
      }
    });
  });
}

void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                      const Tensor& rstd, Tensor& dx, Tensor& dweight) {
  const auto G = rows_of<const float>(dout), X = rows_of<const float>(x);
  const auto DX = rows_of<float>(dx);
  const float* R = rstd.data<float>();
  const int64_t H = X.cols;
  const bool vec = use_avx512();
  with_param_type(weight, [&](const auto* w) {
    reduce_rows_into(X.rows, grain_rows(H), {dweight.data<float>()}, H,
                     [&](int64_t b, int64_t e, float* dw) {
                       for (int64_t n = b; n < e; ++n) {
                         if (vec)
                           rms_bwd_row_avx512(G.row(n), X.row(n), w, R[n], H, DX.row(n), dw);
                         else
                           rms_bwd_row_scalar(G.row(n), X.row(n), w, R[n], H, DX.row(n), dw);
                       }
                     });
  });
}

void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dweight,
                        Tensor& dbias) {
  const auto G = rows_of<const float>(dout), X = rows_of<const float>(x);
  const auto DX = rows_of<float>(dx);
  const float* M = mean.data<float>();
  const float* R = rstd.data<float>();
  const int64_t H = X.cols;
  const bool vec = use_avx512();
  with_param_type(weight, [&](const auto* w) {
    reduce_rows_into(
        X.rows, grain_rows(H), {dweight.data<float>(), dbias.data<float>()}, H,
        [&](int64_t b, int64_t e, float* part) {
          for (int64_t n = b; n < e; ++n) {
            if (vec)
              ln_bwd_row_avx512(G.row(n), X.row(n), w, M[n], R[n], H, DX.row(n), part,
                                part + H);
            else
              ln_bwd_row_scalar(G.row(n), X.row(n), w, M[n], R[n], H, DX.row(n), part,
                                part + H);
          }
        });
  });
}

}  // namespace tessera::kernels::cpu
