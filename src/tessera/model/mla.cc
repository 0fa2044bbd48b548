// Multi-head latent attention: training passes and the absorbed latent-cache decode (mla.h).
#include "tessera/model/mla.h"

#include <algorithm>
#include <cmath>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/attention.h"
#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/norm.h"

namespace tessera::model {
namespace {

void check(const MlaSpec& s, const MlaWeights& w, int64_t H) {
  TESSERA_CHECK(s.heads > 0 && s.kv_lora_rank > 0 && s.qk_nope >= 0 && s.qk_rope > 0 && s.qk_rope % 2 == 0 &&
                    s.v_head > 0,
                "mla: heads ", s.heads, ", kv_lora_rank ", s.kv_lora_rank, ", qk_nope ", s.qk_nope, ", qk_rope ",
                s.qk_rope, " (even), v_head ", s.v_head, " must be positive");
  const int64_t qk = s.qk_dim();
  auto shape = [](const Tensor& t, const Shape& want, const char* name) {
    TESSERA_CHECK(t.defined() && t.shape() == want && t.dtype() == DType::kF32, "mla: ", name, " is ",
                  t.defined() ? t.describe() : std::string("missing"), ", expected ", shape_str(want), " f32");
  };
  if (s.q_lora_rank > 0) {
    shape(w.q_a, {s.q_lora_rank, H}, "q_a_proj");
    shape(w.q_a_norm, {s.q_lora_rank}, "q_a_layernorm");
    shape(w.q_b, {s.heads * qk, s.q_lora_rank}, "q_b_proj");
  } else {
    shape(w.q_proj, {s.heads * qk, H}, "q_proj");
  }
  shape(w.kv_a, {s.kv_lora_rank + s.qk_rope, H}, "kv_a_proj_with_mqa");
  shape(w.kv_a_norm, {s.kv_lora_rank}, "kv_a_layernorm");
  shape(w.kv_b, {s.heads * (s.qk_nope + s.v_head), s.kv_lora_rank}, "kv_b_proj");
  shape(w.o, {H, s.heads * s.v_head}, "o_proj");
}

// Rotates adjacent pairs of the spec's qk_rope columns starting at column `at` of each row
// of x (N rows, any row stride) by position x frequency i (theta^(-2i/rope), or the
// spec's scaled frequencies), scaled by its rope_mscale; inverse: by the negative angle
// (the transpose, for gradients).
void rope_pairs(const MlaSpec& spec, Tensor x, int64_t at, const Tensor& positions, bool inverse,
                int64_t heads = 1, int64_t head_stride = 0) {
  const int64_t N = x.size(0), ld = x.stride(0), rope = spec.qk_rope;
  std::vector<double> freq(rope / 2);
  for (int64_t i = 0; i < rope / 2; ++i)
    freq[i] = spec.inv_freq.empty() ? std::pow(spec.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(rope))
                                    : spec.inv_freq[i];
  float* p = x.data<float>();
  const int32_t* pos = positions.data<int32_t>();
  const double ms = spec.rope_mscale;
  base::parallel_for(N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t i = 0; i < rope / 2; ++i) {
        const double a = pos[n] * freq[i];
        const float c = static_cast<float>(ms * std::cos(a)), s = static_cast<float>(ms * (inverse ? -std::sin(a) : std::sin(a)));
        for (int64_t h = 0; h < heads; ++h) {
          float* r = p + n * ld + h * head_stride + at + 2 * i;
          const float x0 = r[0], x1 = r[1];
          r[0] = x0 * c - x1 * s;
          r[1] = x1 * c + x0 * s;
        }
      }
  });
}

// The queries (N, heads qk), RoPE applied to each head's rope part.
Tensor queries(const MlaSpec& s, const MlaWeights& w, const Tensor& x, const Tensor& positions, MlaSaved* sv) {
  const int64_t N = x.size(0), qk = s.qk_dim();
  Tensor q = Tensor::empty({N, s.heads * qk}, DType::kF32);
  if (s.q_lora_rank > 0) {
    Tensor qa = Tensor::empty({N, s.q_lora_rank}, DType::kF32), qa_n = Tensor::empty({N, s.q_lora_rank}, DType::kF32);
    Tensor rstd = Tensor::empty({N}, DType::kF32);
    kernels::matmul(x, w.q_a, qa, false, true);
    kernels::rmsnorm_forward(qa, w.q_a_norm, s.norm_eps, qa_n, &rstd);
    kernels::matmul(qa_n, w.q_b, q, false, true);
    if (sv) sv->qa = qa, sv->qa_rstd = rstd, sv->qa_n = qa_n;
  } else {
    kernels::matmul(x, w.q_proj, q, false, true);
  }
  rope_pairs(s, q, s.qk_nope, positions, false, s.heads, qk);
  return q;
}

// kv_a's output (N, kv_lora + rope) with its rope part rotated, and the normalised latent.
void latents(const MlaSpec& s, const MlaWeights& w, const Tensor& x, const Tensor& positions, Tensor& ckv,
             Tensor& c_n, Tensor* rstd) {
  const int64_t N = x.size(0), L = s.kv_lora_rank;
  ckv = Tensor::empty({N, L + s.qk_rope}, DType::kF32);
  kernels::matmul(x, w.kv_a, ckv, false, true);
  c_n = Tensor::empty({N, L}, DType::kF32);
  kernels::rmsnorm_forward(ckv.slice(1, 0, L), w.kv_a_norm, s.norm_eps, c_n, rstd);
  rope_pairs(s, ckv, L, positions, false);
}

}  // namespace

float MlaSpec::softmax_scale() const {
  return scale > 0 ? scale : 1.f / std::sqrt(static_cast<float>(qk_dim()));
}

MlaWeights mla_zero_grads(const MlaWeights& w) {
  MlaWeights g;
  auto z = [](const Tensor& t) { return t.defined() ? Tensor::zeros(t.shape(), DType::kF32) : Tensor(); };
  g.q_proj = z(w.q_proj), g.q_a = z(w.q_a), g.q_a_norm = z(w.q_a_norm), g.q_b = z(w.q_b);
  g.kv_a = z(w.kv_a), g.kv_a_norm = z(w.kv_a_norm), g.kv_b = z(w.kv_b), g.o = z(w.o);
  return g;
}

void mla_forward(const MlaSpec& s, const MlaWeights& w, const Tensor& x, const Tensor& positions, int64_t B,
                 int64_t T, Tensor& out, MlaSaved* save) {
  const int64_t N = x.size(0), H = x.size(1), qk = s.qk_dim(), nv = s.qk_nope + s.v_head, L = s.kv_lora_rank;
  TESSERA_CHECK(N == B * T && positions.numel() == N, "mla_forward: ", N, " rows are not ", B, " x ", T);
  check(s, w, H);
  MlaSaved local;
  MlaSaved& sv = save ? *save : local;
  sv.B = B, sv.T = T, sv.x = x, sv.positions = positions;
  const Tensor q = queries(s, w, x, positions, &sv);
  sv.c_rstd = Tensor::empty({N}, DType::kF32);
  latents(s, w, x, positions, sv.ckv, sv.c_n, &sv.c_rstd);
  sv.kv = Tensor::empty({N, s.heads * nv}, DType::kF32);
  kernels::matmul(sv.c_n, w.kv_b, sv.kv, false, true);
  // The attention's operands, padded to one head size D (the kernel's q, k and v share it):
  // the zeros change no score and no output column that is kept.
  const int64_t D = std::max(qk, s.v_head);
  sv.qp = Tensor::zeros({B, T, s.heads, D}, DType::kF32);
  sv.kp = Tensor::zeros({B, T, s.heads, D}, DType::kF32);
  sv.vp = Tensor::zeros({B, T, s.heads, D}, DType::kF32);
  const Tensor q4 = q.view({B, T, s.heads, qk}), kv4 = sv.kv.view({B, T, s.heads, nv});
  sv.qp.slice(3, 0, qk).copy_from(q4);
  sv.kp.slice(3, 0, s.qk_nope).copy_from(kv4.slice(3, 0, s.qk_nope));
  sv.vp.slice(3, 0, s.v_head).copy_from(kv4.slice(3, s.qk_nope, nv));
  const Tensor kpe = sv.ckv.slice(1, L, L + s.qk_rope).contiguous().view({B, T, 1, s.qk_rope});
  for (int64_t h = 0; h < s.heads; ++h) sv.kp.slice(2, h, h + 1).slice(3, s.qk_nope, qk).copy_from(kpe);
  sv.outp = Tensor::empty({B, T, s.heads, D}, DType::kF32);
  sv.lse = Tensor::empty({B, s.heads, T}, DType::kF32);
  kernels::AttentionParams ap;
  ap.scale = s.softmax_scale();
  kernels::attention_forward(sv.qp, sv.kp, sv.vp, sv.outp, &sv.lse, ap);
  sv.att = Tensor::empty({N, s.heads * s.v_head}, DType::kF32);
  sv.att.view({B, T, s.heads, s.v_head}).copy_from(sv.outp.slice(3, 0, s.v_head));
  TESSERA_CHECK(out.shape() == (Shape{N, H}) && out.dtype() == DType::kF32, "mla_forward: out is ", out.describe());
  kernels::matmul(sv.att, w.o, out, false, true);
}

void mla_backward(const MlaSpec& s, const MlaWeights& w, const MlaSaved& sv, const Tensor& dout, Tensor& dx,
                  MlaWeights& g, const MlaReduce& reduce) {
  const int64_t B = sv.B, T = sv.T, N = B * T, H = sv.x.size(1), qk = s.qk_dim(), nv = s.qk_nope + s.v_head;
  const int64_t L = s.kv_lora_rank, D = sv.qp.size(3);
  // o_proj, then the attention over the padded operands.
  Tensor datt = Tensor::empty({N, s.heads * s.v_head}, DType::kF32);
  kernels::matmul(dout, w.o, datt, false, false);
  kernels::matmul(dout, sv.att, g.o, true, false, 1.f, 1.f);
  Tensor doutp = Tensor::zeros({B, T, s.heads, D}, DType::kF32);
  doutp.slice(3, 0, s.v_head).copy_from(datt.view({B, T, s.heads, s.v_head}));
  Tensor dqp = Tensor::empty(sv.qp.shape(), DType::kF32), dkp = Tensor::empty(sv.kp.shape(), DType::kF32),
         dvp = Tensor::empty(sv.vp.shape(), DType::kF32);
  kernels::AttentionParams ap;
  ap.scale = s.softmax_scale();
  kernels::attention_backward(sv.qp, sv.kp, sv.vp, sv.outp, sv.lse, doutp, dqp, dkp, dvp, ap);
  // Back to q, the per-head k_nope / v (kv), and the shared rope key (summed over heads).
  Tensor dq = Tensor::empty({N, s.heads * qk}, DType::kF32);
  dq.view({B, T, s.heads, qk}).copy_from(dqp.slice(3, 0, qk));
  rope_pairs(s, dq, s.qk_nope, sv.positions, true, s.heads, qk);
  Tensor dkv = Tensor::empty({N, s.heads * nv}, DType::kF32);
  Tensor dkv4 = dkv.view({B, T, s.heads, nv});
  dkv4.slice(3, 0, s.qk_nope).copy_from(dkp.slice(3, 0, s.qk_nope));
  dkv4.slice(3, s.qk_nope, nv).copy_from(dvp.slice(3, 0, s.v_head));
  Tensor dckv = Tensor::zeros({N, L + s.qk_rope}, DType::kF32);
  {
    const float* k = dkp.data<float>();
    float* o = dckv.data<float>();
    base::parallel_for(N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t h = 0; h < s.heads; ++h)
          for (int64_t i = 0; i < s.qk_rope; ++i) o[n * (L + s.qk_rope) + L + i] += k[(n * s.heads + h) * D + s.qk_nope + i];
    });
  }
  rope_pairs(s, dckv, L, sv.positions, true);
  // The latent: kv = c_n kv_b^T, c_n = rmsnorm(c); then kv_a. (Under tp this rank's
  // heads give part of d c_n and of the rope key's gradient: summed before kv_a.)
  kernels::matmul(dkv, sv.c_n, g.kv_b, true, false, 1.f, 1.f);
  Tensor dc_n = Tensor::empty({N, L}, DType::kF32);
  kernels::matmul(dkv, w.kv_b, dc_n, false, false);
  if (reduce) {
    Tensor both = Tensor::empty({N, L + s.qk_rope}, DType::kF32);
    both.slice(1, 0, L).copy_from(dc_n);
    both.slice(1, L, L + s.qk_rope).copy_from(dckv.slice(1, L, L + s.qk_rope));
    reduce(both);
    dc_n.copy_from(both.slice(1, 0, L));
    dckv.slice(1, L, L + s.qk_rope).copy_from(both.slice(1, L, L + s.qk_rope));
  }
  Tensor dc = dckv.slice(1, 0, L);
  kernels::rmsnorm_backward(dc_n, sv.ckv.slice(1, 0, L), w.kv_a_norm, sv.c_rstd, dc, g.kv_a_norm);
  kernels::matmul(dckv, sv.x, g.kv_a, true, false, 1.f, 1.f);
  TESSERA_CHECK(dx.shape() == (Shape{N, H}) && dx.dtype() == DType::kF32, "mla_backward: dx is ", dx.describe());
  kernels::matmul(dckv, w.kv_a, dx, false, false);
  // The queries.
  if (s.q_lora_rank > 0) {
    kernels::matmul(dq, sv.qa_n, g.q_b, true, false, 1.f, 1.f);
    Tensor dqa_n = Tensor::empty({N, s.q_lora_rank}, DType::kF32), dqa = Tensor::empty({N, s.q_lora_rank}, DType::kF32);
    kernels::matmul(dq, w.q_b, dqa_n, false, false);
    if (reduce) reduce(dqa_n);  // (this rank's heads' part)
    kernels::rmsnorm_backward(dqa_n, sv.qa, w.q_a_norm, sv.qa_rstd, dqa, g.q_a_norm);
    kernels::matmul(dqa, sv.x, g.q_a, true, false, 1.f, 1.f);
    kernels::matmul(dqa, w.q_a, dx, false, false, 1.f, 1.f);
  } else {
    kernels::matmul(dq, sv.x, g.q_proj, true, false, 1.f, 1.f);
    if (!reduce) {
      kernels::matmul(dq, w.q_proj, dx, false, false, 1.f, 1.f);
    } else {  // this rank's heads' part of the input gradient, summed over the group
      Tensor dxq = Tensor::empty({N, H}, DType::kF32);
      kernels::matmul(dq, w.q_proj, dxq, false, false);
      reduce(dxq);
      kernels::add_inplace(dx, dxq);
    }
  }
}

int64_t mla_cache_row(const MlaSpec& s) { return s.kv_lora_rank + s.qk_rope; }

void mla_project(const MlaSpec& s, const MlaWeights& w, const Tensor& x, const Tensor& positions, Tensor& q,
                 Tensor& rows) {
  const int64_t L = s.kv_lora_rank;
  check(s, w, x.size(1));
  TESSERA_CHECK(positions.numel() == x.size(0), "mla_project: ", positions.numel(), " positions for ", x.size(0),
                " rows");
  q = queries(s, w, x, positions, nullptr);
  Tensor c_n;
  latents(s, w, x, positions, rows, c_n, nullptr);  // rows = kv_a's output, its rope part rotated
  rows.slice(1, 0, L).copy_from(c_n);               // ... and the latent normalised
}

void mla_attend(const MlaSpec& s, const MlaWeights& w, const Tensor& q, const Tensor& cached, int64_t past,
                Tensor& att) {
  const int64_t n = q.size(0), qk = s.qk_dim(), nv = s.qk_nope + s.v_head, L = s.kv_lora_rank, D = L + s.qk_rope;
  const int64_t len = past + n, heads = s.heads;
  TESSERA_CHECK(cached.dim() == 2 && cached.size(0) >= len && cached.size(1) == D && cached.dtype() == DType::kF32,
                "mla_attend: cached rows ", cached.describe(), " must be f32 (>= ", len, ", ", D, ")");
  TESSERA_CHECK(att.shape() == (Shape{n, heads * s.v_head}), "mla_attend: att is ", att.describe());
  const Tensor rows = cached.slice(0, 0, len);
  // Absorbed queries (n, heads, D): W_k^T q_nope per head, then q_pe as it is.
  Tensor qa = Tensor::empty({n * heads, D}, DType::kF32);
  Tensor qa3 = qa.view({n, heads, D});
  for (int64_t h = 0; h < heads; ++h) {
    const Tensor wk = w.kv_b.slice(0, h * nv, h * nv + s.qk_nope);
    Tensor dst = qa3.select(1, h).slice(1, 0, L);
    if (s.qk_nope > 0) {
      kernels::matmul(q.slice(1, h * qk, h * qk + s.qk_nope), wk, dst, false, false);
    } else {
      dst.zero();
    }
    qa3.select(1, h).slice(1, L, D).copy_from(q.slice(1, h * qk + s.qk_nope, (h + 1) * qk));
  }
  Tensor scores = Tensor::empty({n * heads, len}, DType::kF32);
  kernels::matmul(qa, rows, scores, false, true, s.softmax_scale());
  float* sc = scores.data<float>();
  base::parallel_for(n * heads, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // causal softmax: query i sees the cache up to itself
      float* p = sc + r * len;
      const int64_t seen = past + r / heads + 1;
      const float m = *std::max_element(p, p + seen);
      float sum = 0.f;
      for (int64_t t = 0; t < seen; ++t) sum += (p[t] = std::exp(p[t] - m));
      for (int64_t t = 0; t < seen; ++t) p[t] /= sum;
      std::fill(p + seen, p + len, 0.f);
    }
  });
  Tensor ctx = Tensor::empty({n * heads, L}, DType::kF32);
  kernels::matmul(scores, rows.slice(1, 0, L), ctx, false, false);
  const Tensor ctx3 = ctx.view({n, heads, L});
  for (int64_t h = 0; h < heads; ++h) {  // the values: W_v (sum_t p_t c_t)
    const Tensor wv = w.kv_b.slice(0, h * nv + s.qk_nope, (h + 1) * nv);
    Tensor ah = att.slice(1, h * s.v_head, (h + 1) * s.v_head);
    kernels::matmul(ctx3.select(1, h), wv, ah, false, true);
  }
}

void mla_output(const MlaWeights& w, const Tensor& att, Tensor& out) {
  TESSERA_CHECK(out.shape() == (Shape{att.size(0), w.o.size(0)}) && out.dtype() == DType::kF32, "mla: out is ",
                out.describe());
  kernels::matmul(att, w.o, out, false, true);
}

MlaCache MlaCache::create(const MlaSpec& spec, int64_t capacity) {
  MlaCache c;
  c.rows = Tensor::empty({capacity, mla_cache_row(spec)}, DType::kF32);
  return c;
}

void mla_decode(const MlaSpec& s, const MlaWeights& w, const Tensor& x, MlaCache& cache, Tensor& out) {
  const int64_t n = x.size(0);
  const int64_t past = cache.length, len = past + n;
  TESSERA_CHECK(len <= cache.rows.size(0), "mla_decode: ", len, " tokens exceed the cache's ", cache.rows.size(0));
  Tensor positions = Tensor::empty({n}, DType::kI32);
  for (int64_t i = 0; i < n; ++i) positions.data<int32_t>()[i] = static_cast<int32_t>(past + i);
  Tensor q, rows;
  mla_project(s, w, x, positions, q, rows);
  cache.rows.slice(0, past, len).copy_from(rows);
  cache.length = len;
  Tensor att = Tensor::empty({n, s.heads * s.v_head}, DType::kF32);
  mla_attend(s, w, q, cache.rows, past, att);
  mla_output(w, att, out);
}

int64_t mla_cache_bytes_per_token(const MlaSpec& s, int64_t bytes) { return (s.kv_lora_rank + s.qk_rope) * bytes; }

int64_t mha_cache_bytes_per_token(const MlaSpec& s, int64_t bytes) {
  return s.heads * (s.qk_dim() + s.v_head) * bytes;
}

}  // namespace tessera::model
