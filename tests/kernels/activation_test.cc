// activation.h: SwiGLU, GELU (tanh) and softmax kernels against the scalar reference on
// odd and strided shapes, backward passes against double-precision finite differences,
// saturation at extreme inputs, in-place use, and argument checks.
#include "tessera/kernels/activation.h"

#include <gtest/gtest.h>

#include <functional>
#include <limits>

#include "pointwise_test_util.h"
#include "tessera/kernels/reference/activation_ref.h"

namespace tessera::kernels {
namespace {

using namespace test_util;
namespace ref = reference;

// Puts saturating values at the start of every row, where the row is long enough.
void add_extremes(Tensor& t) {
  const float ext[] = {-100.f, 100.f, -30.f, 30.f, -9.f, 9.f, 0.f};
  for (int64_t n = 0; n < t.size(0); ++n) {
    float* row = t.data<float>() + n * t.stride(0);
    for (int64_t i = 0; i < std::min<int64_t>(7, t.size(1) / 8); ++i) row[i * 8] = ext[i];
  }
}

template <typename Fn>
void for_each_case(Fn&& fn) {
  for (cpu::Isa isa : isas_to_test())
    for (int64_t n : test_rows())
      for (int64_t f : test_cols())
        for (bool strided : {false, true}) {
          SCOPED_TRACE(std::string(isa_name(isa)) + " N=" + std::to_string(n) +
                       " F=" + std::to_string(f) + (strided ? " strided" : ""));
          ScopedIsa scoped(isa);
          fn(n, f, strided);
        }
}

// A gated activation (kernel forward / backward and their references) on every case.
using GatedFwd = void (*)(const Tensor&, const Tensor&, Tensor&);
using GatedBwd = void (*)(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&);

void check_gated(uint32_t seed, GatedFwd fwd, GatedBwd bwd, GatedFwd ref_fwd, GatedBwd ref_bwd) {
  std::mt19937 rng(seed);
  for_each_case([&](int64_t n, int64_t f, bool strided) {
    Mat gate = random_mat(n, f, rng, strided, -6.f, 6.f);
    add_extremes(gate.view);
    Mat up = random_mat(n, f, rng, strided), dout = random_mat(n, f, rng, strided);
    Mat out = random_mat(n, f, rng, strided), dgate = random_mat(n, f, rng, strided);
    Mat dup = random_mat(n, f, rng, strided);
    Tensor want = Tensor::empty({n, f}, DType::kF32), want_dg = want.clone(),
           want_du = want.clone();
    fwd(gate.view, up.view, out.view);
    ref_fwd(gate.view, up.view, want);
    EXPECT_TRUE(all_close(out.view, want, 1e-5, 1e-6));
    bwd(dout.view, gate.view, up.view, dgate.view, dup.view);
    ref_bwd(dout.view, gate.view, up.view, want_dg, want_du);
    EXPECT_TRUE(all_close(dgate.view, want_dg, 1e-5, 1e-6));
    EXPECT_TRUE(all_close(dup.view, want_du, 1e-5, 1e-6));
  });
}

TEST(ActivationTest, SwigluMatchesReference) {
  check_gated(21, swiglu_forward, swiglu_backward, ref::swiglu_forward, ref::swiglu_backward);
}

TEST(ActivationTest, GegluMatchesReference) {
  check_gated(23, geglu_forward, geglu_backward, ref::geglu_forward, ref::geglu_backward);
}

TEST(ActivationTest, GeluMatchesReference) {
  std::mt19937 rng(22);
  for_each_case([&](int64_t n, int64_t f, bool strided) {
    Mat x = random_mat(n, f, rng, strided, -6.f, 6.f);
    add_extremes(x.view);
    Mat dout = random_mat(n, f, rng, strided);
    Mat out = random_mat(n, f, rng, strided), dx = random_mat(n, f, rng, strided);
    Tensor want = Tensor::empty({n, f}, DType::kF32), want_dx = want.clone();
    gelu_forward(x.view, out.view);
    ref::gelu_forward(x.view, want);
    EXPECT_TRUE(all_close(out.view, want, 1e-5, 1e-6));
    gelu_backward(dout.view, x.view, dx.view);
    ref::gelu_backward(dout.view, x.view, want_dx);
    EXPECT_TRUE(all_close(dx.view, want_dx, 1e-5, 1e-6));
    // In place (out aliases x).
    gelu_forward(x.view, x.view);
    EXPECT_TRUE(all_close(x.view, want, 1e-5, 1e-6));
  });
}

TEST(ActivationTest, SoftmaxMatchesReference) {
  std::mt19937 rng(23);
  for_each_case([&](int64_t n, int64_t f, bool strided) {
    Mat x = random_mat(n, f, rng, strided, -10.f, 10.f);
    if (f > 3) x.view.data<float>()[2] = -std::numeric_limits<float>::infinity();  // a mask
    Mat dout = random_mat(n, f, rng, strided);
    Mat out = random_mat(n, f, rng, strided), dx = random_mat(n, f, rng, strided);
    Tensor want = Tensor::empty({n, f}, DType::kF32), want_dx = want.clone();
    softmax_forward(x.view, out.view);
    ref::softmax_forward(x.view, want);
    EXPECT_TRUE(all_close(out.view, want, 1e-5, 1e-7));
    for (int64_t r = 0; r < n; ++r) {
      double sum = 0;
      for (float p : values(out.view.select(0, r))) sum += p;
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
    softmax_backward(dout.view, want, dx.view);
    ref::softmax_backward(dout.view, want, want_dx);
    EXPECT_TRUE(all_close(dx.view, want_dx, 1e-5, 1e-6));
    softmax_forward(x.view, x.view);  // in place
    EXPECT_TRUE(all_close(x.view, want, 1e-5, 1e-7));
  });
}

// ---- Finite differences of L = sum(dout * f(x)) with f in double.

std::vector<double> fd_grad(const std::function<double(const std::vector<double>&)>& loss,
                            std::vector<double> x) {
  std::vector<double> g(x.size());
  const double h = 1e-5;
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double lp = loss(x);
    x[i] = keep - h;
    const double lm = loss(x);
    x[i] = keep;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

std::vector<double> as_double(const Tensor& t) {
  const auto v = values(t);
  return {v.begin(), v.end()};
}

Tensor as_tensor(const std::vector<double>& v, const Shape& s) {
  return Tensor::from_vector(std::vector<float>(v.begin(), v.end()), s);
}

TEST(ActivationTest, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(24);
  const int64_t N = 3, F = 21;
  const Tensor x = random_mat(N, F, rng, false, -4.f, 4.f).view;
  const Tensor up = random_mat(N, F, rng, false).view;
  const Tensor dout = random_mat(N, F, rng, false).view;
  const auto xd = as_double(x), ud = as_double(up), dd = as_double(dout);
  const double k = std::sqrt(2.0 / M_PI);

  auto gelu_loss = [&](const std::vector<double>& v) {
    double L = 0;
    for (size_t i = 0; i < v.size(); ++i)
      L += dd[i] * 0.5 * v[i] * (1 + std::tanh(k * (v[i] + 0.044715 * v[i] * v[i] * v[i])));
    return L;
  };
  auto swiglu_loss = [&](const std::vector<double>& g, const std::vector<double>& u) {
    double L = 0;
    for (size_t i = 0; i < g.size(); ++i) L += dd[i] * g[i] / (1 + std::exp(-g[i])) * u[i];
    return L;
  };
  auto geglu_loss = [&](const std::vector<double>& g, const std::vector<double>& u) {
    double L = 0;
    for (size_t i = 0; i < g.size(); ++i)
      L += dd[i] * 0.5 * g[i] * (1 + std::tanh(k * (g[i] + 0.044715 * g[i] * g[i] * g[i]))) * u[i];
    return L;
  };
  auto softmax_loss = [&](const std::vector<double>& v) {
    double L = 0;
    for (int64_t n = 0; n < N; ++n) {
      double mx = -1e300, sum = 0;
      for (int64_t i = 0; i < F; ++i) mx = std::max(mx, v[n * F + i]);
      for (int64_t i = 0; i < F; ++i) sum += std::exp(v[n * F + i] - mx);
      for (int64_t i = 0; i < F; ++i) L += dd[n * F + i] * std::exp(v[n * F + i] - mx) / sum;
    }
    return L;
  };
  const Tensor fd_gelu = as_tensor(fd_grad(gelu_loss, xd), {N, F});
  const Tensor fd_gate =
      as_tensor(fd_grad([&](const std::vector<double>& g) { return swiglu_loss(g, ud); }, xd),
                {N, F});
  const Tensor fd_up =
      as_tensor(fd_grad([&](const std::vector<double>& u) { return swiglu_loss(xd, u); }, ud),
                {N, F});
  const Tensor fd_softmax = as_tensor(fd_grad(softmax_loss, xd), {N, F});
  const Tensor fd_geglu_gate =
      as_tensor(fd_grad([&](const std::vector<double>& g) { return geglu_loss(g, ud); }, xd), {N, F});
  const Tensor fd_geglu_up =
      as_tensor(fd_grad([&](const std::vector<double>& u) { return geglu_loss(xd, u); }, ud), {N, F});

  for (int impl = 0; impl < 2; ++impl) {  // 0: reference, 1: kernel
    SCOPED_TRACE(impl ? "kernel" : "reference");
    Tensor a = Tensor::empty({N, F}, DType::kF32), b = a.clone(), y = a.clone();
    impl ? gelu_backward(dout, x, a) : ref::gelu_backward(dout, x, a);
    EXPECT_TRUE(all_close(a, fd_gelu, 1e-4, 1e-5));
    impl ? swiglu_backward(dout, x, up, a, b) : ref::swiglu_backward(dout, x, up, a, b);
    EXPECT_TRUE(all_close(a, fd_gate, 1e-4, 1e-5));
    EXPECT_TRUE(all_close(b, fd_up, 1e-4, 1e-5));
    impl ? geglu_backward(dout, x, up, a, b) : ref::geglu_backward(dout, x, up, a, b);
    EXPECT_TRUE(all_close(a, fd_geglu_gate, 1e-4, 1e-5));
    EXPECT_TRUE(all_close(b, fd_geglu_up, 1e-4, 1e-5));
    ref::softmax_forward(x, y);
    impl ? softmax_backward(dout, y, a) : ref::softmax_backward(dout, y, a);
    EXPECT_TRUE(all_close(a, fd_softmax, 1e-4, 1e-5));
  }
}

TEST(ActivationTest, BadArgumentsThrow) {
  Tensor a = Tensor::zeros({4, 8}, DType::kF32), b = a.clone();
  Tensor wrong = Tensor::zeros({4, 9}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { swiglu_forward(a, wrong, b); },
                           {"swiglu_forward", "up", "(4, 9)", "(4, 8)"}));
  EXPECT_TRUE(throws_error([&] { gelu_forward(a.to(DType::kBF16), b); },
                           {"gelu_forward", "x", "bf16(4, 8)"}));
  EXPECT_TRUE(throws_error([&] { gelu_backward(a, a, wrong); }, {"gelu_backward", "dx"}));
  Tensor empty = Tensor::zeros({4, 0}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { softmax_forward(empty, empty); }, {"softmax_forward", "x"}));
  Tensor vec = Tensor::zeros({8}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { softmax_backward(a, vec, b); }, {"out", "2-D"}));
}

}  // namespace
}  // namespace tessera::kernels
