// Attention forward / backward against the double-precision reference, over odd shapes,
// GQA groups, causal offsets and strided fused-QKV / KV-cache views; plus input checks.
#include "tessera/kernels/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/attention_cpu.h"
#include "tessera/kernels/reference/attention_ref.h"

namespace tessera::kernels {
namespace {

constexpr float kRtol = 1e-5f;
constexpr float kAtol = 2e-5f;
constexpr float kSentinel = 1234.5f;

struct Config {
  int64_t B, Tq, Tk, Hq, Hkv, D;
  bool causal;
  int64_t q_offset;
  int64_t window = 0;
  float softcap = 0.f;
  std::string str() const {
    std::ostringstream os;
    os << "B=" << B << " Tq=" << Tq << " Tk=" << Tk << " Hq=" << Hq << " Hkv=" << Hkv << " D=" << D
       << (causal ? " causal" : " full") << " q_offset=" << q_offset << " window=" << window << " softcap=" << softcap;
    return os.str();
  }
};

void fill_random(Tensor& t, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = dist(rng);
}

Tensor filled(const Shape& shape, float value) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  t.fill(value);
  return t;
}

// Elements of a (B, T, H, D) view, read through its strides.
std::vector<float> read4(const Tensor& t) {
  std::vector<float> out;
  const float* p = t.data<float>();
  for (int64_t a = 0; a < t.size(0); ++a)
    for (int64_t b = 0; b < t.size(1); ++b)
      for (int64_t c = 0; c < t.size(2); ++c)
        for (int64_t d = 0; d < t.size(3); ++d)
          out.push_back(p[a * t.stride(0) + b * t.stride(1) + c * t.stride(2) + d * t.stride(3)]);
  return out;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what, float atol = kAtol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= atol + kRtol * std::fabs(want[i]))) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": first mismatch at " << first << " got "
                    << (first >= 0 ? got[first] : 0.f) << " want "
                    << (first >= 0 ? want[first] : 0.f);
}

// Buffers laid out as the model lays them out: q, k, v are column slices of one fused
// (B*T, (Hq + 2 Hkv) D) buffer when Tq == Tk; otherwise q is a slice of a padded buffer and
// k, v are views of a KV cache (B, Tcap, 2, Hkv, D) with spare capacity.
struct Views {
  Tensor qbuf, kvbuf;
  Tensor q, k, v;
};

Views make_inputs(const Config& c, std::mt19937& rng) {
  Views w;
  const int64_t D = c.D;
  if (c.Tq == c.Tk) {
    const int64_t W = (c.Hq + 2 * c.Hkv) * D, T = c.Tq;
    w.qbuf = Tensor::empty({c.B * T, W}, DType::kF32);
    fill_random(w.qbuf, rng);
    w.q = w.qbuf.as_strided({c.B, T, c.Hq, D}, {T * W, W, D, 1}, 0);
    w.k = w.qbuf.as_strided({c.B, T, c.Hkv, D}, {T * W, W, D, 1}, c.Hq * D);
    w.v = w.qbuf.as_strided({c.B, T, c.Hkv, D}, {T * W, W, D, 1}, (c.Hq + c.Hkv) * D);
    return w;
  }
  const int64_t Wq = c.Hq * D + 3, Tcap = c.Tk + 5, Wkv = 2 * c.Hkv * D;
  w.qbuf = Tensor::empty({c.B * c.Tq, Wq}, DType::kF32);
  fill_random(w.qbuf, rng);
  w.q = w.qbuf.as_strided({c.B, c.Tq, c.Hq, D}, {c.Tq * Wq, Wq, D, 1}, 1);
  w.kvbuf = Tensor::empty({c.B * Tcap, Wkv}, DType::kF32);
  fill_random(w.kvbuf, rng);
  w.k = w.kvbuf.as_strided({c.B, c.Tk, c.Hkv, D}, {Tcap * Wkv, Wkv, D, 1}, 0);
  w.v = w.kvbuf.as_strided({c.B, c.Tk, c.Hkv, D}, {Tcap * Wkv, Wkv, D, 1}, c.Hkv * D);
  return w;
}

// A (B, T, H, D) view into a row-padded buffer filled with a sentinel, to catch stray writes.
Tensor padded_output(Tensor& buf, int64_t B, int64_t T, int64_t H, int64_t D) {
  const int64_t W = H * D + 7;
  buf = filled({B * T, W}, kSentinel);
  return buf.as_strided({B, T, H, D}, {T * W, W, D, 1}, 2);
}

int64_t count_sentinels(const Tensor& buf) {
  int64_t n = 0;
  const float* p = buf.data<float>();
  for (int64_t i = 0; i < buf.numel(); ++i) n += p[i] == kSentinel;
  return n;
}

AttentionParams params_for(const Config& c) {
  AttentionParams p;
  p.scale = 1.f / std::sqrt(static_cast<float>(c.D));
  p.causal = c.causal;
  p.q_offset = c.q_offset;
  p.window = c.window;
  p.softcap = c.softcap;
  return p;
}

// Runs forward + backward through the public API (or the portable kernels) and compares
// every output with the reference.
void check_config(const Config& c, uint32_t seed, bool scalar_isa = false) {
  SCOPED_TRACE(c.str() + (scalar_isa ? " [scalar]" : ""));
  std::mt19937 rng(seed);
  Views in = make_inputs(c, rng);
  const AttentionParams p = params_for(c);

  Tensor out_buf;
  Tensor out = padded_output(out_buf, c.B, c.Tq, c.Hq, c.D);
  Tensor lse = filled({c.B, c.Hq, c.Tq}, kSentinel);
  Tensor dout = Tensor::empty({c.B, c.Tq, c.Hq, c.D}, DType::kF32);
  fill_random(dout, rng);
  Tensor dq_buf, dk_buf, dv_buf;
  Tensor dq = padded_output(dq_buf, c.B, c.Tq, c.Hq, c.D);
  Tensor dk = padded_output(dk_buf, c.B, c.Tk, c.Hkv, c.D);
  Tensor dv = padded_output(dv_buf, c.B, c.Tk, c.Hkv, c.D);

  if (!scalar_isa) {
    attention_forward(in.q, in.k, in.v, out, &lse, p);
    attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, p);
  } else {
    auto view = [](const Tensor& t) {
      return cpu::AttnView{t.data<float>(), t.stride(0), t.stride(1)};
    };
    const cpu::AttnDims d{c.B, c.Tq, c.Tk, c.Hq, c.Hkv, c.D};
    const cpu::LseView lv{lse.data<float>(), lse.stride(0), lse.stride(1), lse.stride(2)};
    cpu::attention_forward_cpu(d, view(in.q), view(in.k), view(in.v), view(out), lv, p,
                               cpu::AttnIsa::kScalar);
    cpu::attention_backward_cpu(d, view(in.q), view(in.k), view(in.v), view(out), lv, view(dout),
                                view(dq), view(dk), view(dv), p, cpu::AttnIsa::kScalar);
  }

  Tensor out_ref = Tensor::empty({c.B, c.Tq, c.Hq, c.D}, DType::kF32);
  Tensor lse_ref = Tensor::empty({c.B, c.Hq, c.Tq}, DType::kF32);
  reference::attention_forward(in.q, in.k, in.v, out_ref, &lse_ref, p);
  expect_close(read4(out), read4(out_ref), "out");
  expect_close(lse.to_f32_vector(), lse_ref.to_f32_vector(), "lse");

  Tensor dq_ref = Tensor::empty(dq.shape(), DType::kF32);
  Tensor dk_ref = Tensor::empty(dk.shape(), DType::kF32);
  Tensor dv_ref = Tensor::empty(dv.shape(), DType::kF32);
  reference::attention_backward(in.q, in.k, in.v, dout, dq_ref, dk_ref, dv_ref, p);
  expect_close(read4(dq), read4(dq_ref), "dq");
  expect_close(read4(dk), read4(dk_ref), "dk");
  expect_close(read4(dv), read4(dv_ref), "dv");

  // Only the padding of the output buffers may still hold the sentinel.
  EXPECT_EQ(count_sentinels(out_buf), out_buf.numel() - out.numel());
  EXPECT_EQ(count_sentinels(dq_buf), dq_buf.numel() - dq.numel());
  EXPECT_EQ(count_sentinels(dk_buf), dk_buf.numel() - dk.numel());
  EXPECT_EQ(count_sentinels(dv_buf), dv_buf.numel() - dv.numel());
}

const int64_t kHeads[][2] = {{1, 1}, {4, 2}, {6, 1}, {12, 4}};

TEST(Attention, SelfAttentionMatchesReference) {
  uint32_t seed = 1;
  for (int64_t T : {1, 7, 64, 129})
    for (const auto& h : kHeads)
      for (int64_t D : {8, 16, 64, 80})
        for (bool causal : {true, false}) {
          // Two batches for the shorter sequences keeps the test fast while covering B > 1.
          const int64_t B = T <= 64 ? 2 : 1;
          check_config({B, T, T, h[0], h[1], D, causal, 0}, seed++);
        }
}

// Sliding windows (Mistral's): narrower and wider than a 64-key tile, over whole sequences
// and over queries at an offset (a prefill chunk, a decode), both kernel families.
TEST(Attention, SlidingWindowMatchesReference) {
  uint32_t seed = 500;
  for (int64_t window : {1, 5, 64, 100})
    for (bool scalar : {false, true}) {
      check_config({1, 200, 200, 4, 2, 16, true, 0, window}, seed++, scalar);
      check_config({2, 33, 33, 6, 1, 64, true, 0, window}, seed++, scalar);
      check_config({1, 40, 300, 4, 2, 16, true, 260, window}, seed++, scalar);
      check_config({2, 1, 257, 12, 4, 16, true, 256, window}, seed++, scalar);
    }
}

// Gemma 2's logit soft-capping (cap 0.5: most scores past it; 50: nearly linear), alone and
// with a sliding window, forward and backward on both kernel families.
TEST(Attention, SoftcapMatchesReference) {
  uint32_t seed = 600;
  for (float cap : {0.5f, 5.f, 50.f})
    for (bool scalar : {false, true}) {
      check_config({2, 33, 33, 4, 2, 16, true, 0, 0, cap}, seed++, scalar);
      check_config({1, 130, 130, 6, 1, 64, true, 0, 20, cap}, seed++, scalar);
      check_config({2, 1, 257, 8, 4, 16, true, 256, 0, cap}, seed++, scalar);
      check_config({1, 9, 40, 2, 2, 8, false, 0, 0, cap}, seed++, scalar);
    }
}

TEST(Attention, OffsetQueriesMatchReference) {
  // Decode (one query at the end of a KV cache), a chunk at the end, a chunk in the
  // middle (keys after q_offset + Tq exist but are hidden), and cross-attention shapes.
  const Config configs[] = {
      {1, 1, 37, 4, 2, 64, true, 36},
      {2, 1, 129, 12, 4, 16, true, 128},
      {2, 5, 37, 6, 1, 80, true, 32},
      {1, 5, 37, 1, 1, 8, true, 32},
      {2, 7, 64, 4, 2, 16, true, 10},
      {1, 64, 129, 12, 4, 64, true, 65},
      {2, 7, 129, 6, 1, 80, false, 0},
      {1, 1, 7, 4, 2, 8, false, 0},
      {1, 129, 64, 4, 2, 16, false, 0},
      {1, 3, 300, 8, 1, 64, true, 297},
      // Head dims off the usual sizes.
      {1, 7, 7, 2, 1, 3, true, 0},
      {2, 9, 9, 4, 4, 32, false, 0},
      {1, 33, 33, 2, 2, 128, true, 0},
      {1, 20, 20, 3, 3, 12, true, 0},
  };
  uint32_t seed = 1000;
  for (const Config& c : configs) check_config(c, seed++);
}

TEST(Attention, PortableKernelsMatchReference) {
  const Config configs[] = {
      {2, 7, 7, 4, 2, 16, true, 0},     {1, 129, 129, 6, 1, 80, true, 0},
      {1, 64, 64, 12, 4, 8, false, 0},  {2, 5, 37, 6, 1, 64, true, 32},
      {1, 1, 300, 4, 1, 64, true, 299},
  };
  uint32_t seed = 2000;
  for (const Config& c : configs) check_config(c, seed++, /*scalar_isa=*/true);
}

TEST(Attention, KeySplitAcrossManyThreadsMatchesReference) {
  // With more workers than row blocks the forward splits the keys and merges partial
  // softmaxes; some splits of early causal blocks are empty.
  const int saved = base::num_threads();
  base::set_num_threads(8);
  check_config({1, 300, 300, 1, 1, 16, true, 0}, 3000);
  check_config({1, 1, 700, 8, 2, 64, true, 699}, 3001);
  check_config({1, 2, 500, 2, 1, 12, false, 0}, 3002);
  base::set_num_threads(saved);
}

TEST(Attention, ForwardWithoutLse) {
  const Config c{1, 9, 9, 4, 2, 32, true, 0};
  std::mt19937 rng(7);
  Views in = make_inputs(c, rng);
  Tensor out = Tensor::empty({1, 9, 4, 32}, DType::kF32);
  Tensor out_ref = Tensor::empty({1, 9, 4, 32}, DType::kF32);
  attention_forward(in.q, in.k, in.v, out, nullptr, params_for(c));
  reference::attention_forward(in.q, in.k, in.v, out_ref, nullptr, params_for(c));
  expect_close(out.to_f32_vector(), out_ref.to_f32_vector(), "out");
}

TEST(Attention, LseThroughStrides) {
  // lse (B, Hq, Tq) as a transposed view of a (B, Tq, Hq) buffer, read back by the backward.
  const Config c{2, 9, 9, 4, 2, 16, true, 0};
  std::mt19937 rng(8);
  Views in = make_inputs(c, rng);
  const AttentionParams p = params_for(c);
  Tensor out = Tensor::empty({2, 9, 4, 16}, DType::kF32);
  Tensor lse_buf = Tensor::empty({2, 9, 4}, DType::kF32);
  Tensor lse = lse_buf.transpose(1, 2);
  attention_forward(in.q, in.k, in.v, out, &lse, p);
  Tensor out_ref = Tensor::empty({2, 9, 4, 16}, DType::kF32);
  Tensor lse_ref = Tensor::empty({2, 4, 9}, DType::kF32);
  reference::attention_forward(in.q, in.k, in.v, out_ref, &lse_ref, p);
  expect_close(lse.contiguous().to_f32_vector(), lse_ref.to_f32_vector(), "lse");

  Tensor dout = Tensor::empty({2, 9, 4, 16}, DType::kF32);
  fill_random(dout, rng);
  Tensor dq = Tensor::empty({2, 9, 4, 16}, DType::kF32);
  Tensor dk = Tensor::empty({2, 9, 2, 16}, DType::kF32);
  Tensor dv = Tensor::empty({2, 9, 2, 16}, DType::kF32);
  attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, p);
  Tensor dq_ref = Tensor::empty(dq.shape(), DType::kF32);
  Tensor dk_ref = Tensor::empty(dk.shape(), DType::kF32);
  Tensor dv_ref = Tensor::empty(dv.shape(), DType::kF32);
  reference::attention_backward(in.q, in.k, in.v, dout, dq_ref, dk_ref, dv_ref, p);
  expect_close(dq.to_f32_vector(), dq_ref.to_f32_vector(), "dq");
  expect_close(dk.to_f32_vector(), dk_ref.to_f32_vector(), "dk");
  expect_close(dv.to_f32_vector(), dv_ref.to_f32_vector(), "dv");
}

// The reference backward is the ground truth for the kernel, so check it against central
// differences of loss = sum(out * w) in double.
TEST(AttentionReference, BackwardMatchesFiniteDifferences) {
  for (bool causal : {true, false}) {
    const reference::AttnShape s{1, 3, 5, 4, 2, 3};
    AttentionParams p;
    p.scale = 0.7f;
    p.causal = causal;
    p.q_offset = 2;
    std::mt19937 rng(11);
    std::uniform_real_distribution<double> dist(-1.0, 1.0);
    auto rand_vec = [&](int64_t n) {
      std::vector<double> x(n);
      for (double& e : x) e = dist(rng);
      return x;
    };
    const int64_t nq = s.B * s.Tq * s.Hq * s.D, nk = s.B * s.Tk * s.Hkv * s.D;
    std::vector<double> q = rand_vec(nq), k = rand_vec(nk), v = rand_vec(nk), w = rand_vec(nq);
    auto loss = [&]() {
      std::vector<double> out(nq);
      reference::attention_forward_f64(s, q.data(), k.data(), v.data(), out.data(), nullptr, p);
      double l = 0;
      for (int64_t i = 0; i < nq; ++i) l += out[i] * w[i];
      return l;
    };
    std::vector<double> dq(nq), dk(nk), dv(nk);
    reference::attention_backward_f64(s, q.data(), k.data(), v.data(), w.data(), dq.data(),
                                      dk.data(), dv.data(), p);
    auto check = [&](std::vector<double>& x, const std::vector<double>& grad, const char* name) {
      const double h = 1e-6;
      for (size_t i = 0; i < x.size(); ++i) {
        const double saved = x[i];
        x[i] = saved + h;
        const double up = loss();
        x[i] = saved - h;
        const double down = loss();
        x[i] = saved;
        EXPECT_NEAR(grad[i], (up - down) / (2 * h), 1e-7) << name << "[" << i << "]";
      }
    };
    check(q, dq, "dq");
    check(k, dk, "dk");
    check(v, dv, "dv");
  }
}

// ---------------------------------------------------------------------------------------
// Packed documents (params.doc_positions).

// Positions (B, stride) of rows packed with documents of the given lengths (each row's
// lengths sum to T); the `stride - T` spare entries hold junk the kernel must not read.
std::vector<int32_t> doc_positions_for(const std::vector<std::vector<int64_t>>& rows, int64_t T,
                                       int64_t stride) {
  std::vector<int32_t> pos(rows.size() * stride, -77);
  for (size_t b = 0; b < rows.size(); ++b) {
    int64_t t = 0;
    for (int64_t len : rows[b])
      for (int64_t k = 0; k < len; ++k) pos[b * stride + t++] = static_cast<int32_t>(k);
    EXPECT_EQ(t, T) << "document lengths of row " << b;
  }
  return pos;
}

// Naive masked attention in double: builds the explicit (B, T, T) visibility mask (causal,
// window, same document) and takes the full softmax of every row. Inputs and outputs are
// contiguous (B, T, H, D) as read4 gives them; lse (B, Hq, T).
struct MaskedReference {
  int64_t B, T, Hq, Hkv, D;
  AttentionParams p;
  std::vector<char> mask;  // (B, T, T): query i sees key j

  MaskedReference(const Config& c, const AttentionParams& params)
      : B(c.B), T(c.Tq), Hq(c.Hq), Hkv(c.Hkv), D(c.D), p(params), mask(c.B * c.Tq * c.Tq, 0) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t start = i - p.doc_positions[b * p.doc_positions_stride + i];
        for (int64_t j = 0; j < T; ++j)
          mask[(b * T + i) * T + j] = j <= i && j >= start && (p.window == 0 || j > i - p.window);
      }
  }
  int64_t at(int64_t b, int64_t t, int64_t h, int64_t H) const { return ((b * T + t) * H + h) * D; }

  // Probabilities of query (b, i, h) over all keys; cap_grad: d capped / d scaled score.
  std::vector<double> probs(const std::vector<float>& q, const std::vector<float>& k, int64_t b,
                            int64_t i, int64_t h, double* lse, std::vector<double>* cap_grad) const {
    std::vector<double> s(T, 0.0);
    cap_grad->assign(T, 1.0);
    double mx = -INFINITY;
    for (int64_t j = 0; j < T; ++j) {
      if (!mask[(b * T + i) * T + j]) continue;
      double dot = 0;
      for (int64_t e = 0; e < D; ++e) dot += double(q[at(b, i, h, Hq) + e]) * k[at(b, j, h / (Hq / Hkv), Hkv) + e];
      s[j] = dot * p.scale;
      if (p.softcap > 0) {
        const double th = std::tanh(s[j] / p.softcap);
        s[j] = p.softcap * th;
        (*cap_grad)[j] = 1 - th * th;
      }
      mx = std::max(mx, s[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j < T; ++j) sum += mask[(b * T + i) * T + j] ? std::exp(s[j] - mx) : 0.0;
    for (int64_t j = 0; j < T; ++j) s[j] = mask[(b * T + i) * T + j] ? std::exp(s[j] - mx) / sum : 0.0;
    *lse = mx + std::log(sum);
    return s;
  }

  void run(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
           const std::vector<float>& dout, std::vector<float>& out, std::vector<float>& lse,
           std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv) const {
    out.assign(q.size(), 0.f), dq.assign(q.size(), 0.f), lse.assign(B * Hq * T, 0.f);
    std::vector<double> dqd(q.size(), 0.0), dkd(k.size(), 0.0), dvd(v.size(), 0.0), cap_grad;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < T; ++i)
        for (int64_t h = 0; h < Hq; ++h) {
          const int64_t kvh = h / (Hq / Hkv), qi = at(b, i, h, Hq);
          double l = 0;
          const std::vector<double> P = probs(q, k, b, i, h, &l, &cap_grad);
          lse[(b * Hq + h) * T + i] = static_cast<float>(l);
          std::vector<double> dP(T, 0.0);
          double weighted = 0;
          for (int64_t j = 0; j < T; ++j) {
            double dot = 0;
            for (int64_t e = 0; e < D; ++e) dot += double(dout[qi + e]) * v[at(b, j, kvh, Hkv) + e];
            dP[j] = dot;
            weighted += P[j] * dot;
          }
          for (int64_t e = 0; e < D; ++e) {
            double acc = 0;
            for (int64_t j = 0; j < T; ++j) acc += P[j] * v[at(b, j, kvh, Hkv) + e];
            out[qi + e] = static_cast<float>(acc);
          }
          for (int64_t j = 0; j < T; ++j) {
            if (!mask[(b * T + i) * T + j]) continue;
            const double dS = P[j] * (dP[j] - weighted) * cap_grad[j] * p.scale;
            const int64_t kj = at(b, j, kvh, Hkv);
            for (int64_t e = 0; e < D; ++e) {
              dqd[qi + e] += dS * k[kj + e];
              dkd[kj + e] += dS * q[qi + e];
              dvd[kj + e] += P[j] * dout[qi + e];
            }
          }
        }
    auto to_f32 = [](const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); };
    dq = to_f32(dqd), dk = to_f32(dkd), dv = to_f32(dvd);
  }
};

// Forward + backward through the public API or the portable kernels.
struct AttnRun {
  Tensor out_buf, dq_buf, dk_buf, dv_buf;
  Tensor out, lse, dq, dk, dv;
};

AttnRun run_attention(const Config& c, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& dout, const AttentionParams& p, bool scalar_isa) {
  AttnRun r;
  r.out = padded_output(r.out_buf, c.B, c.Tq, c.Hq, c.D);
  r.lse = filled({c.B, c.Hq, c.Tq}, kSentinel);
  r.dq = padded_output(r.dq_buf, c.B, c.Tq, c.Hq, c.D);
  r.dk = padded_output(r.dk_buf, c.B, c.Tk, c.Hkv, c.D);
  r.dv = padded_output(r.dv_buf, c.B, c.Tk, c.Hkv, c.D);
  if (!scalar_isa) {
    attention_forward(q, k, v, r.out, &r.lse, p);
    attention_backward(q, k, v, r.out, r.lse, dout, r.dq, r.dk, r.dv, p);
    return r;
  }
  auto view = [](const Tensor& t) { return cpu::AttnView{t.data<float>(), t.stride(0), t.stride(1)}; };
  const cpu::AttnDims d{c.B, c.Tq, c.Tk, c.Hq, c.Hkv, c.D};
  const cpu::LseView lv{r.lse.data<float>(), r.lse.stride(0), r.lse.stride(1), r.lse.stride(2)};
  cpu::attention_forward_cpu(d, view(q), view(k), view(v), view(r.out), lv, p, cpu::AttnIsa::kScalar);
  cpu::attention_backward_cpu(d, view(q), view(k), view(v), view(r.out), lv, view(dout), view(r.dq),
                              view(r.dk), view(r.dv), p, cpu::AttnIsa::kScalar);
  return r;
}

// Rows packed with documents of the given lengths against the explicitly masked reference.
void check_packed(const Config& c, const std::vector<std::vector<int64_t>>& docs, uint32_t seed,
                  bool scalar_isa) {
  SCOPED_TRACE(c.str() + (scalar_isa ? " [scalar]" : ""));
  std::mt19937 rng(seed);
  Views in = make_inputs(c, rng);
  const int64_t stride = c.Tq + 3;
  const std::vector<int32_t> pos = doc_positions_for(docs, c.Tq, stride);
  AttentionParams p = params_for(c);
  p.doc_positions = pos.data();
  p.doc_positions_stride = stride;
  Tensor dout = Tensor::empty({c.B, c.Tq, c.Hq, c.D}, DType::kF32);
  fill_random(dout, rng);

  const AttnRun r = run_attention(c, in.q, in.k, in.v, dout, p, scalar_isa);
  std::vector<float> out, lse, dq, dk, dv;
  MaskedReference(c, p).run(read4(in.q), read4(in.k), read4(in.v), read4(dout), out, lse, dq, dk, dv);
  expect_close(read4(r.out), out, "out");
  expect_close(r.lse.to_f32_vector(), lse, "lse");
  expect_close(read4(r.dq), dq, "dq");
  expect_close(read4(r.dk), dk, "dk");
  expect_close(read4(r.dv), dv, "dv");
  EXPECT_EQ(count_sentinels(r.out_buf), r.out_buf.numel() - r.out.numel());
  EXPECT_EQ(count_sentinels(r.dq_buf), r.dq_buf.numel() - r.dq.numel());
  EXPECT_EQ(count_sentinels(r.dk_buf), r.dk_buf.numel() - r.dk.numel());
  EXPECT_EQ(count_sentinels(r.dv_buf), r.dv_buf.numel() - r.dv.numel());
}

// Uneven documents, a 1-token one among them, boundaries off the 64-key tiles and off the
// row blocks; GQA groups of 2 and 6; with and without a window, with soft-capping.
TEST(Attention, PackedDocumentsMatchMaskedReference) {
  const std::vector<std::vector<int64_t>> docs77 = {{30, 1, 46}, {77}};
  const std::vector<std::vector<int64_t>> docs300 = {{5, 1, 70, 130, 1, 93}};
  uint32_t seed = 4000;
  for (bool scalar : {false, true})
    for (int64_t window : {0, 20, 100})
      for (float cap : {0.f, 5.f}) {
        check_packed({2, 77, 77, 4, 2, 16, true, 0, window, cap}, docs77, seed++, scalar);
        check_packed({1, 300, 300, 6, 1, 64, true, 0, window, cap}, docs300, seed++, scalar);
      }
  // Every token its own document: each query sees only itself.
  check_packed({1, 70, 70, 4, 2, 8, true, 0}, {std::vector<int64_t>(70, 1)}, seed++, false);
}

// Running the packed row gives, for each document, what attention over that document alone
// gives (out, lse and every gradient): nothing crosses a document boundary.
TEST(Attention, PackedDocumentsEqualSeparateRuns) {
  const Config c{2, 300, 300, 8, 2, 32, true, 0};
  const std::vector<std::vector<int64_t>> docs = {{1, 63, 64, 100, 1, 71}, {200, 17, 83}};
  uint32_t seed = 4100;
  for (bool scalar : {false, true})
    for (int64_t window : {0, 40})
      for (float cap : {0.f, 20.f}) {
        Config cw = c;
        cw.window = window, cw.softcap = cap;
        SCOPED_TRACE(cw.str() + (scalar ? " [scalar]" : ""));
        std::mt19937 rng(seed++);
        Views in = make_inputs(cw, rng);
        const std::vector<int32_t> pos = doc_positions_for(docs, c.Tq, c.Tq);
        AttentionParams p = params_for(cw);
        Tensor dout = Tensor::empty({c.B, c.Tq, c.Hq, c.D}, DType::kF32);
        fill_random(dout, rng);
        AttentionParams packed = p;
        packed.doc_positions = pos.data();
        packed.doc_positions_stride = c.Tq;
        const AttnRun all = run_attention(cw, in.q, in.k, in.v, dout, packed, scalar);
        for (int64_t b = 0; b < c.B; ++b) {
          int64_t t0 = 0;
          for (int64_t len : docs[b]) {
            SCOPED_TRACE("row " + std::to_string(b) + " document at " + std::to_string(t0));
            auto doc = [&](const Tensor& t) { return t.slice(0, b, b + 1).slice(1, t0, t0 + len); };
            Config one = cw;
            one.B = 1, one.Tq = one.Tk = len;
            const AttnRun sep = run_attention(one, doc(in.q), doc(in.k), doc(in.v), doc(dout), p, scalar);
            // Only the summation order differs (tiles start elsewhere): 1e-5.
            constexpr float kTight = 1e-5f;
            expect_close(read4(doc(all.out)), read4(sep.out), "out", kTight);
            expect_close(all.lse.slice(0, b, b + 1).slice(2, t0, t0 + len).contiguous().to_f32_vector(),
                         sep.lse.to_f32_vector(), "lse", kTight);
            expect_close(read4(doc(all.dq)), read4(sep.dq), "dq", kTight);
            expect_close(read4(doc(all.dk)), read4(sep.dk), "dk", kTight);
            expect_close(read4(doc(all.dv)), read4(sep.dv), "dv", kTight);
            t0 += len;
          }
        }
      }
}

TEST(Attention, RejectsBadDocPositions) {
  const Config c{2, 6, 6, 4, 2, 8, true, 0};
  std::mt19937 rng(9);
  Views in = make_inputs(c, rng);
  Tensor out = Tensor::empty({2, 6, 4, 8}, DType::kF32);
  Tensor lse = Tensor::empty({2, 4, 6}, DType::kF32);
  Tensor dout = Tensor::zeros({2, 6, 4, 8}, DType::kF32);
  Tensor dq = Tensor::empty({2, 6, 4, 8}, DType::kF32);
  Tensor dk = Tensor::empty({2, 6, 2, 8}, DType::kF32);
  Tensor dv = Tensor::empty({2, 6, 2, 8}, DType::kF32);
  std::vector<int32_t> pos = {0, 1, 2, 0, 1, 0, /* row 1 */ 0, 0, 1, 2, 3, 4};
  AttentionParams p = params_for(c);
  p.doc_positions = pos.data();
  p.doc_positions_stride = 6;
  EXPECT_NO_THROW(attention_forward(in.q, in.k, in.v, out, &lse, p));
  EXPECT_NO_THROW(attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, p));

  auto expect_rejected = [&](const AttentionParams& bad, const std::string& needle) {
    try {
      attention_forward(in.q, in.k, in.v, out, &lse, bad);
      ADD_FAILURE() << "forward accepted " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_THROW(attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, bad), Error);
  };
  pos[6 + 3] = 4;  // row 1, token 3: a document starting before the row
  expect_rejected(p, "batch row 1, token 3");
  pos[6 + 3] = 2;
  pos[4] = -1;  // row 0, token 4
  expect_rejected(p, "batch row 0, token 4");
  pos[4] = 1;
  pos[0] = 1;  // token 0 must be a document's first token
  expect_rejected(p, "batch row 0, token 0");
  pos[0] = 0;
  AttentionParams full = p;
  full.causal = false;
  expect_rejected(full, "causal");
  AttentionParams short_stride = p;
  short_stride.doc_positions_stride = 5;
  expect_rejected(short_stride, "doc_positions_stride");

  // Decode-like shapes (q_offset != 0, Tq != Tk) have no packed documents.
  const Config dec{1, 2, 6, 4, 2, 8, true, 4};
  Views din = make_inputs(dec, rng);
  Tensor dout2 = Tensor::empty({1, 2, 4, 8}, DType::kF32);
  AttentionParams dp = params_for(dec);
  dp.doc_positions = pos.data();
  dp.doc_positions_stride = 6;
  EXPECT_THROW(attention_forward(din.q, din.k, din.v, dout2, nullptr, dp), Error);
}

TEST(Attention, RejectsBadInputs) {
  const Config c{1, 4, 4, 4, 2, 8, true, 0};
  std::mt19937 rng(5);
  Views in = make_inputs(c, rng);
  const AttentionParams p = params_for(c);
  Tensor out = Tensor::empty({1, 4, 4, 8}, DType::kF32);
  Tensor lse = Tensor::empty({1, 4, 4}, DType::kF32);
  auto fwd = [&](const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, Tensor* l,
                 const AttentionParams& pp) { attention_forward(q, k, v, o, l, pp); };

  EXPECT_NO_THROW(fwd(in.q, in.k, in.v, out, &lse, p));
  Tensor q3 = Tensor::empty({4, 4, 8}, DType::kF32);
  EXPECT_THROW(fwd(q3, in.k, in.v, out, &lse, p), Error);  // rank
  Tensor qbf = Tensor::zeros({1, 4, 4, 8}, DType::kBF16);
  EXPECT_THROW(fwd(qbf, in.k, in.v, out, &lse, p), Error);  // dtype
  Tensor q3h = Tensor::zeros({1, 4, 3, 8}, DType::kF32);
  Tensor out3h = Tensor::empty({1, 4, 3, 8}, DType::kF32);
  EXPECT_THROW(fwd(q3h, in.k, in.v, out3h, nullptr, p), Error);  // Hq % Hkv
  Tensor qd = Tensor::zeros({1, 4, 4, 16}, DType::kF32);
  Tensor outd = Tensor::empty({1, 4, 4, 16}, DType::kF32);
  EXPECT_THROW(fwd(qd, in.k, in.v, outd, nullptr, p), Error);  // D mismatch
  Tensor qb = Tensor::zeros({2, 4, 4, 8}, DType::kF32);
  Tensor outb = Tensor::empty({2, 4, 4, 8}, DType::kF32);
  EXPECT_THROW(fwd(qb, in.k, in.v, outb, nullptr, p), Error);            // B mismatch
  Tensor qt = Tensor::zeros({1, 4, 8, 4}, DType::kF32).transpose(2, 3);  // (1,4,4,8)
  EXPECT_THROW(fwd(qt, in.k, in.v, out, nullptr, p), Error);             // dim stride
  Tensor qh = Tensor::zeros({1, 4, 4, 16}, DType::kF32).slice(3, 0, 8);  // head stride 16
  EXPECT_THROW(fwd(qh, in.k, in.v, out, nullptr, p), Error);
  Tensor bad_lse = Tensor::empty({1, 4, 5}, DType::kF32);
  EXPECT_THROW(fwd(in.q, in.k, in.v, out, &bad_lse, p), Error);  // lse shape
  Tensor bad_out = Tensor::empty({1, 4, 4, 4}, DType::kF32);
  EXPECT_THROW(fwd(in.q, in.k, in.v, bad_out, nullptr, p), Error);  // out shape
  AttentionParams off = p;
  off.q_offset = 1;  // 1 + Tq > Tk
  EXPECT_THROW(fwd(in.q, in.k, in.v, out, nullptr, off), Error);
  off.q_offset = -1;
  EXPECT_THROW(fwd(in.q, in.k, in.v, out, nullptr, off), Error);
  AttentionParams noscale = p;
  noscale.scale = 0.f;
  EXPECT_THROW(fwd(in.q, in.k, in.v, out, nullptr, noscale), Error);
  try {
    fwd(q3h, in.k, in.v, out3h, nullptr, p);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(1, 4, 3, 8)"), std::string::npos) << e.what();
  }

  Tensor dout = Tensor::zeros({1, 4, 4, 8}, DType::kF32);
  Tensor dq = Tensor::empty({1, 4, 4, 8}, DType::kF32);
  Tensor dk = Tensor::empty({1, 4, 2, 8}, DType::kF32);
  Tensor dv = Tensor::empty({1, 4, 2, 8}, DType::kF32);
  EXPECT_NO_THROW(attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk, dv, p));
  Tensor dk_bad = Tensor::empty({1, 4, 4, 8}, DType::kF32);
  EXPECT_THROW(attention_backward(in.q, in.k, in.v, out, lse, dout, dq, dk_bad, dv, p), Error);
  EXPECT_THROW(attention_backward(in.q, in.k, in.v, out, bad_lse, dout, dq, dk, dv, p), Error);
  Tensor dout_bad = Tensor::zeros({1, 3, 4, 8}, DType::kF32);
  EXPECT_THROW(attention_backward(in.q, in.k, in.v, out, lse, dout_bad, dq, dk, dv, p), Error);
}

}  // namespace
}  // namespace tessera::kernels
