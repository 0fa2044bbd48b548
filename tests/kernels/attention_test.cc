// Attention forward / backward against the double-precision reference, over odd shapes,
// GQA groups, causal offsets and strided fused-QKV / KV-cache views; plus input checks.
#include "tessera/kernels/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <sstream>
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
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= kAtol + kRtol * std::fabs(want[i]))) {
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
