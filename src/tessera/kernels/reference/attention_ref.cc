// Scalar double-precision attention reference (see attention_ref.h).
#include "tessera/kernels/reference/attention_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace tessera::kernels::reference {
namespace {

int64_t idx(int64_t b, int64_t t, int64_t h, int64_t e, int64_t T, int64_t H, int64_t D) {
  return ((b * T + t) * H + h) * D + e;
}

bool visible(const AttentionParams& p, int64_t i, int64_t j) {
  if (!p.causal) return true;
  return j <= p.q_offset + i && (p.window == 0 || j > p.q_offset + i - p.window);
}

// Softmax probabilities of query (b, i, h) over all keys (0 for hidden ones). cap_grad
// (optional): d capped score / d scaled score per key (1 without soft-capping).
std::vector<double> probs(const AttnShape& s, const double* q, const double* k, int64_t b,
                          int64_t i, int64_t h, const AttentionParams& p, double* lse_out,
                          std::vector<double>* cap_grad = nullptr) {
  if (cap_grad) cap_grad->assign(s.Tk, 1.0);
  const int64_t kvh = h / (s.Hq / s.Hkv);
  std::vector<double> sc(s.Tk, -std::numeric_limits<double>::infinity());
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < s.Tk; ++j) {
    if (!visible(p, i, j)) continue;
    double dot = 0;
    for (int64_t e = 0; e < s.D; ++e)
      dot += q[idx(b, i, h, e, s.Tq, s.Hq, s.D)] * k[idx(b, j, kvh, e, s.Tk, s.Hkv, s.D)];
    sc[j] = dot * p.scale;
    if (p.softcap > 0) {
      const double t = std::tanh(sc[j] / p.softcap);
      sc[j] = p.softcap * t;
      if (cap_grad) (*cap_grad)[j] = 1.0 - t * t;
    }
    mx = std::max(mx, sc[j]);
  }
  double sum = 0;
  for (int64_t j = 0; j < s.Tk; ++j) sum += visible(p, i, j) ? std::exp(sc[j] - mx) : 0.0;
  for (int64_t j = 0; j < s.Tk; ++j) sc[j] = visible(p, i, j) ? std::exp(sc[j] - mx) / sum : 0.0;
  if (lse_out) *lse_out = mx + std::log(sum);
  return sc;
}

// Strided f32 (B, T, H, D) tensor <-> contiguous double array.
std::vector<double> read(const Tensor& t) {
  std::vector<double> out(t.numel());
  const float* p = t.data<float>();
  int64_t n = 0;
  for (int64_t a = 0; a < t.size(0); ++a)
    for (int64_t b = 0; b < t.size(1); ++b)
      for (int64_t c = 0; c < t.size(2); ++c)
        for (int64_t d = 0; d < t.size(3); ++d)
          out[n++] = p[a * t.stride(0) + b * t.stride(1) + c * t.stride(2) + d * t.stride(3)];
  return out;
}

void write(const std::vector<double>& src, Tensor& t) {
  float* p = t.data<float>();
  int64_t n = 0;
  for (int64_t a = 0; a < t.size(0); ++a)
    for (int64_t b = 0; b < t.size(1); ++b)
      for (int64_t c = 0; c < t.size(2); ++c)
        for (int64_t d = 0; d < t.size(3); ++d)
          p[a * t.stride(0) + b * t.stride(1) + c * t.stride(2) + d * t.stride(3)] =
              static_cast<float>(src[n++]);
}

AttnShape shape_of(const Tensor& q, const Tensor& k) {
  TESSERA_CHECK(q.dim() == 4 && k.dim() == 4, "reference attention: q and k must be rank 4");
  return AttnShape{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
}

}  // namespace

void attention_forward_f64(const AttnShape& s, const double* q, const double* k, const double* v,
                           double* out, double* lse, const AttentionParams& params) {
  const int64_t G = s.Hq / s.Hkv;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t i = 0; i < s.Tq; ++i)
      for (int64_t h = 0; h < s.Hq; ++h) {
        double l = 0;
        const std::vector<double> P = probs(s, q, k, b, i, h, params, &l);
        if (lse) lse[(b * s.Hq + h) * s.Tq + i] = l;
        for (int64_t e = 0; e < s.D; ++e) {
          double acc = 0;
          for (int64_t j = 0; j < s.Tk; ++j) acc += P[j] * v[idx(b, j, h / G, e, s.Tk, s.Hkv, s.D)];
          out[idx(b, i, h, e, s.Tq, s.Hq, s.D)] = acc;
        }
      }
}

void attention_backward_f64(const AttnShape& s, const double* q, const double* k, const double* v,
                            const double* dout, double* dq, double* dk, double* dv,
                            const AttentionParams& params) {
  const int64_t G = s.Hq / s.Hkv;
  std::fill_n(dq, s.B * s.Tq * s.Hq * s.D, 0.0);
  std::fill_n(dk, s.B * s.Tk * s.Hkv * s.D, 0.0);
  std::fill_n(dv, s.B * s.Tk * s.Hkv * s.D, 0.0);
  std::vector<double> dP(s.Tk), cap_grad;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t i = 0; i < s.Tq; ++i)
      for (int64_t h = 0; h < s.Hq; ++h) {
        const int64_t kvh = h / G;
        const std::vector<double> P = probs(s, q, k, b, i, h, params, nullptr, &cap_grad);
        // out = sum_j P_j v_j: dP_j = dout . v_j; dS_j = P_j (dP_j - sum_j' P_j' dP_j').
        double weighted = 0;
        for (int64_t j = 0; j < s.Tk; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < s.D; ++e)
            dot += dout[idx(b, i, h, e, s.Tq, s.Hq, s.D)] * v[idx(b, j, kvh, e, s.Tk, s.Hkv, s.D)];
          dP[j] = dot;
          weighted += P[j] * dot;
        }
        for (int64_t j = 0; j < s.Tk; ++j) {
          if (P[j] == 0.0) continue;
          const double dS = P[j] * (dP[j] - weighted) * cap_grad[j] * params.scale;
          for (int64_t e = 0; e < s.D; ++e) {
            const int64_t qi = idx(b, i, h, e, s.Tq, s.Hq, s.D);
            const int64_t kj = idx(b, j, kvh, e, s.Tk, s.Hkv, s.D);
            dq[qi] += dS * k[kj];
            dk[kj] += dS * q[qi];
            dv[kj] += P[j] * dout[qi];
          }
        }
      }
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor* lse,
                       const AttentionParams& params) {
  const AttnShape s = shape_of(q, k);
  const std::vector<double> qd = read(q), kd = read(k), vd = read(v);
  std::vector<double> od(qd.size()), ld(s.B * s.Hq * s.Tq);
  attention_forward_f64(s, qd.data(), kd.data(), vd.data(), od.data(), ld.data(), params);
  write(od, out);
  if (lse) {
    float* p = lse->data<float>();
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.Hq; ++h)
        for (int64_t i = 0; i < s.Tq; ++i)
          p[b * lse->stride(0) + h * lse->stride(1) + i * lse->stride(2)] =
              static_cast<float>(ld[(b * s.Hq + h) * s.Tq + i]);
  }
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                        Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& params) {
  const AttnShape s = shape_of(q, k);
  const std::vector<double> qd = read(q), kd = read(k), vd = read(v), dod = read(dout);
  std::vector<double> dqd(qd.size()), dkd(kd.size()), dvd(vd.size());
  attention_backward_f64(s, qd.data(), kd.data(), vd.data(), dod.data(), dqd.data(), dkd.data(),
                         dvd.data(), params);
  write(dqd, dq);
  write(dkd, dk);
  write(dvd, dv);
}

}  // namespace tessera::kernels::reference
