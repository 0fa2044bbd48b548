// norm.h: the CPU kernels (AVX-512 and portable paths) against the scalar reference on
// odd and strided shapes, the reference backward against finite differences, the fused
// add + norm, thread-count independence of dweight, and argument checks.
#include "tessera/kernels/norm.h"

#include <gtest/gtest.h>

#include "pointwise_test_util.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/reference/norm_ref.h"

namespace tessera::kernels {
namespace {

using namespace test_util;
namespace ref = reference;

constexpr float kEps = 1e-5f;

struct Case {
  int64_t n, h;
  bool strided;
  DType wdt;
  cpu::Isa isa;
  std::string str() const {
    return "N=" + std::to_string(n) + " H=" + std::to_string(h) +
           (strided ? " strided" : "") + " w=" + dtype_name(wdt) + " " + isa_name(isa);
  }
};

template <typename Fn>
void for_each_case(Fn&& fn) {
  for (cpu::Isa isa : isas_to_test())
    for (DType wdt : {DType::kF32, DType::kBF16})
      for (int64_t n : test_rows())
        for (int64_t h : test_cols())
          for (bool strided : {false, true}) {
            const Case c{n, h, strided, wdt, isa};
            SCOPED_TRACE(c.str());
            ScopedIsa scoped(isa);
            fn(c);
          }
}

TEST(NormTest, RmsForwardMatchesReference) {
  std::mt19937 rng(1);
  for_each_case([&](const Case& c) {
    Mat x = random_mat(c.n, c.h, rng, c.strided);
    Tensor w = random_vec(c.h, rng, c.wdt, 0.5f, 1.5f);
    Mat out = random_mat(c.n, c.h, rng, c.strided);
    const Tensor pad_before = out.buf.clone();
    Tensor rstd = Tensor::empty({c.n}, DType::kF32);
    rmsnorm_forward(x.view, w, kEps, out.view, &rstd);
    Tensor want = Tensor::empty({c.n, c.h}, DType::kF32);
    Tensor want_rstd = Tensor::empty({c.n}, DType::kF32);
    ref::rmsnorm_forward(x.view, w, kEps, want, &want_rstd);
    EXPECT_TRUE(all_close(out.view, want, 1e-5, 1e-6));
    EXPECT_TRUE(all_close(rstd, want_rstd, 1e-5, 0));
    if (c.strided) {  // the padding columns of the output buffer are untouched
      EXPECT_TRUE(bitwise_equal(out.buf.slice(1, 0, 3), pad_before.slice(1, 0, 3)));
      EXPECT_TRUE(bitwise_equal(out.buf.slice(1, 3 + c.h, 5 + c.h),
                                pad_before.slice(1, 3 + c.h, 5 + c.h)));
    }
  });
}

TEST(NormTest, LayerForwardMatchesReference) {
  std::mt19937 rng(2);
  for_each_case([&](const Case& c) {
    Mat x = random_mat(c.n, c.h, rng, c.strided, 1.f, 3.f);  // nonzero mean
    Tensor w = random_vec(c.h, rng, c.wdt, 0.5f, 1.5f);
    Tensor b = random_vec(c.h, rng, c.wdt, -0.5f, 0.5f);
    Mat out = random_mat(c.n, c.h, rng, c.strided);
    Tensor mean = Tensor::empty({c.n}, DType::kF32), rstd = mean.clone();
    layernorm_forward(x.view, w, b, kEps, out.view, &mean, &rstd);
    Tensor want = Tensor::empty({c.n, c.h}, DType::kF32);
    Tensor want_mean = mean.clone(), want_rstd = rstd.clone();
    ref::layernorm_forward(x.view, w, b, kEps, want, &want_mean, &want_rstd);
    EXPECT_TRUE(all_close(out.view, want, 1e-5, 1e-5));
    EXPECT_TRUE(all_close(mean, want_mean, 1e-5, 1e-6));
    // H = 1: var = 0 and rstd = 1/sqrt(eps) is large, still f32-exact enough.
    EXPECT_TRUE(all_close(rstd, want_rstd, 1e-5, 0));
  });
}

TEST(NormTest, RmsBackwardMatchesReference) {
  std::mt19937 rng(3);
  for_each_case([&](const Case& c) {
    Mat x = random_mat(c.n, c.h, rng, c.strided);
    Mat dout = random_mat(c.n, c.h, rng, c.strided);
    Tensor w = random_vec(c.h, rng, c.wdt, 0.5f, 1.5f);
    Tensor rstd = Tensor::empty({c.n}, DType::kF32);
    Tensor y = Tensor::empty({c.n, c.h}, DType::kF32);
    ref::rmsnorm_forward(x.view, w, kEps, y, &rstd);
    Mat dx = random_mat(c.n, c.h, rng, c.strided);
    Tensor dw = random_vec(c.h, rng, DType::kF32, -1.f, 1.f);  // accumulated into
    Tensor want_dx = Tensor::empty({c.n, c.h}, DType::kF32), want_dw = dw.clone();
    rmsnorm_backward(dout.view, x.view, w, rstd, dx.view, dw);
    ref::rmsnorm_backward(dout.view, x.view, w, rstd, want_dx, want_dw);
    EXPECT_TRUE(all_close(dx.view, want_dx, 1e-5, 1e-5));
    EXPECT_TRUE(all_close(dw, want_dw, 1e-5, 1e-5));
  });
}

TEST(NormTest, LayerBackwardMatchesReference) {
  std::mt19937 rng(4);
  for_each_case([&](const Case& c) {
    Mat x = random_mat(c.n, c.h, rng, c.strided, -1.f, 2.f);
    Mat dout = random_mat(c.n, c.h, rng, c.strided);
    Tensor w = random_vec(c.h, rng, c.wdt, 0.5f, 1.5f);
    Tensor b = random_vec(c.h, rng, c.wdt, -0.5f, 0.5f);
    Tensor mean = Tensor::empty({c.n}, DType::kF32), rstd = mean.clone();
    Tensor y = Tensor::empty({c.n, c.h}, DType::kF32);
    ref::layernorm_forward(x.view, w, b, kEps, y, &mean, &rstd);
    Mat dx = random_mat(c.n, c.h, rng, c.strided);
    Tensor dw = random_vec(c.h, rng, DType::kF32, -1.f, 1.f);
    Tensor db = random_vec(c.h, rng, DType::kF32, -1.f, 1.f);
    Tensor want_dx = Tensor::empty({c.n, c.h}, DType::kF32);
    Tensor want_dw = dw.clone(), want_db = db.clone();
    layernorm_backward(dout.view, x.view, w, mean, rstd, dx.view, dw, db);
    ref::layernorm_backward(dout.view, x.view, w, mean, rstd, want_dx, want_dw, want_db);
    // dx = rstd * (a difference of O(1) terms): its rounding error scales with rstd, which
    // is 1/sqrt(eps) ~ 316 when H = 1 (zero variance; the exact dx is 0 there).
    double max_rstd = 1;
    for (float r : values(rstd)) max_rstd = std::max<double>(max_rstd, r);
    EXPECT_TRUE(all_close(dx.view, want_dx, 1e-5, 1e-5 * max_rstd));
    EXPECT_TRUE(all_close(dw, want_dw, 1e-5, 1e-5));
    EXPECT_TRUE(all_close(db, want_db, 1e-5, 1e-5));
  });
}

TEST(NormTest, FusedAddMatchesAddThenNorm) {
  std::mt19937 rng(5);
  for_each_case([&](const Case& c) {
    Mat res = random_mat(c.n, c.h, rng, c.strided);
    Mat delta = random_mat(c.n, c.h, rng, c.strided);
    Tensor w = random_vec(c.h, rng, c.wdt, 0.5f, 1.5f);
    Tensor b = random_vec(c.h, rng, c.wdt, -0.5f, 0.5f);
    Tensor out = Tensor::empty({c.n, c.h}, DType::kF32), want = out.clone();
    Tensor rstd = Tensor::empty({c.n}, DType::kF32), want_rstd = rstd.clone();
    Tensor mean = rstd.clone(), want_mean = rstd.clone();

    Tensor res_ref = res.view.clone();
    add_rmsnorm_forward(res.view, delta.view, w, kEps, out, &rstd);
    ref::add_rmsnorm_forward(res_ref, delta.view, w, kEps, want, &want_rstd);
    EXPECT_TRUE(bitwise_equal(res.view, res_ref));  // f32 adds are exact-same
    EXPECT_TRUE(all_close(out, want, 1e-5, 1e-6));
    EXPECT_TRUE(all_close(rstd, want_rstd, 1e-5, 0));

    add_layernorm_forward(res.view, delta.view, w, b, kEps, out, &mean, &rstd);
    ref::add_layernorm_forward(res_ref, delta.view, w, b, kEps, want, &want_mean, &want_rstd);
    EXPECT_TRUE(bitwise_equal(res.view, res_ref));
    EXPECT_TRUE(all_close(out, want, 1e-5, 1e-5));
    EXPECT_TRUE(all_close(mean, want_mean, 1e-5, 1e-6));
    EXPECT_TRUE(all_close(rstd, want_rstd, 1e-5, 0));
  });
}

// ---- Finite differences in double validate the reference (and the kernels) backward.

// L = sum(dout * norm(x)) in double; layer = false is RMSNorm.
double norm_loss(const std::vector<double>& x, const std::vector<double>& w,
                 const std::vector<double>& b, const std::vector<double>& dout, int64_t N,
                 int64_t H, bool layer) {
  double L = 0;
  for (int64_t n = 0; n < N; ++n) {
    const double* xr = &x[n * H];
    double mu = 0, v = 0;
    if (layer) {
      for (int64_t i = 0; i < H; ++i) mu += xr[i];
      mu /= H;
    }
    for (int64_t i = 0; i < H; ++i) v += (xr[i] - mu) * (xr[i] - mu);
    const double r = 1.0 / std::sqrt(v / H + kEps);
    for (int64_t i = 0; i < H; ++i)
      L += dout[n * H + i] * ((xr[i] - mu) * r * w[i] + (layer ? b[i] : 0.0));
  }
  return L;
}

std::vector<double> to_double(const Tensor& t) {
  const auto v = values(t);
  return {v.begin(), v.end()};
}

// Central differences of norm_loss with respect to `which` (0 = x, 1 = w, 2 = b).
std::vector<double> norm_fd(std::vector<double> x, std::vector<double> w, std::vector<double> b,
                            const std::vector<double>& dout, int64_t N, int64_t H, bool layer,
                            int which) {
  std::vector<double>* p = which == 0 ? &x : which == 1 ? &w : &b;
  std::vector<double> g(p->size());
  const double h = 1e-5;
  for (size_t i = 0; i < p->size(); ++i) {
    const double keep = (*p)[i];
    (*p)[i] = keep + h;
    const double lp = norm_loss(x, w, b, dout, N, H, layer);
    (*p)[i] = keep - h;
    const double lm = norm_loss(x, w, b, dout, N, H, layer);
    (*p)[i] = keep;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

Tensor from_doubles(const std::vector<double>& v, const Shape& s) {
  return Tensor::from_vector(std::vector<float>(v.begin(), v.end()), s);
}

TEST(NormTest, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(6);
  const int64_t N = 3, H = 37;
  for (bool layer : {false, true}) {
    SCOPED_TRACE(layer ? "layernorm" : "rmsnorm");
    Tensor x = random_mat(N, H, rng, false, -1.f, 2.f).view;
    Tensor dout = random_mat(N, H, rng, false).view;
    Tensor w = random_vec(H, rng, DType::kF32, 0.5f, 1.5f);
    Tensor b = random_vec(H, rng, DType::kF32, -0.5f, 0.5f);
    const auto xd = to_double(x), wd = to_double(w), bd = to_double(b), gd = to_double(dout);
    const Tensor fd_dx = from_doubles(norm_fd(xd, wd, bd, gd, N, H, layer, 0), {N, H});
    const Tensor fd_dw = from_doubles(norm_fd(xd, wd, bd, gd, N, H, layer, 1), {H});
    const Tensor fd_db = from_doubles(norm_fd(xd, wd, bd, gd, N, H, layer, 2), {H});

    Tensor y = Tensor::empty({N, H}, DType::kF32);
    Tensor mean = Tensor::empty({N}, DType::kF32), rstd = mean.clone();
    for (int impl = 0; impl < 2; ++impl) {  // 0: reference, 1: CPU kernel
      SCOPED_TRACE(impl ? "kernel" : "reference");
      Tensor dx = Tensor::empty({N, H}, DType::kF32);
      Tensor dw = Tensor::zeros({H}, DType::kF32), db = dw.clone();
      if (layer) {
        ref::layernorm_forward(x, w, b, kEps, y, &mean, &rstd);
        if (impl)
          layernorm_backward(dout, x, w, mean, rstd, dx, dw, db);
        else
          ref::layernorm_backward(dout, x, w, mean, rstd, dx, dw, db);
        EXPECT_TRUE(all_close(db, fd_db, 1e-4, 1e-4));
      } else {
        ref::rmsnorm_forward(x, w, kEps, y, &rstd);
        if (impl)
          rmsnorm_backward(dout, x, w, rstd, dx, dw);
        else
          ref::rmsnorm_backward(dout, x, w, rstd, dx, dw);
      }
      EXPECT_TRUE(all_close(dx, fd_dx, 1e-4, 1e-4));
      EXPECT_TRUE(all_close(dw, fd_dw, 1e-4, 1e-4));
    }
  }
}

TEST(NormTest, WeightGradientIsIndependentOfThreadCount) {
  std::mt19937 rng(7);
  const int64_t N = 2048, H = 96;
  Tensor x = random_mat(N, H, rng, false).view, dout = random_mat(N, H, rng, false).view;
  Tensor w = random_vec(H, rng, DType::kF32, 0.5f, 1.5f);
  Tensor b = random_vec(H, rng, DType::kF32, -0.5f, 0.5f);
  Tensor y = Tensor::empty({N, H}, DType::kF32);
  Tensor mean = Tensor::empty({N}, DType::kF32), rstd = mean.clone();
  layernorm_forward(x, w, b, kEps, y, &mean, &rstd);
  const int saved = base::num_threads();
  std::vector<Tensor> dws, dbs;
  for (int threads : {1, 2, 3}) {
    base::set_num_threads(threads);
    Tensor dx = Tensor::empty({N, H}, DType::kF32);
    Tensor dw = Tensor::zeros({H}, DType::kF32), db = dw.clone();
    layernorm_backward(dout, x, w, mean, rstd, dx, dw, db);
    rmsnorm_backward(dout, x, w, rstd, dx, dw);  // accumulates on top
    dws.push_back(dw);
    dbs.push_back(db);
  }
  base::set_num_threads(saved);
  for (size_t i = 1; i < dws.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(dws[i], dws[0]));
    EXPECT_TRUE(bitwise_equal(dbs[i], dbs[0]));
  }
}

TEST(NormTest, BadArgumentsThrow) {
  Tensor x = Tensor::zeros({4, 8}, DType::kF32), out = x.clone();
  Tensor w = Tensor::zeros({8}, DType::kF32), b = w.clone();
  Tensor rstd = Tensor::zeros({4}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { rmsnorm_forward(x, Tensor::zeros({7}, DType::kF32), kEps, out,
                                                 nullptr); },
                           {"rmsnorm_forward", "weight", "(7,)", "(8,)"}));
  EXPECT_TRUE(throws_error(
      [&] { rmsnorm_forward(x.to(DType::kBF16), w, kEps, out, nullptr); },
      {"rmsnorm_forward", "x", "bf16(4, 8)"}));
  Tensor out_t = Tensor::zeros({8, 4}, DType::kF32).transpose(0, 1);  // last dim strided
  EXPECT_TRUE(throws_error([&] { rmsnorm_forward(x, w, kEps, out_t, nullptr); },
                           {"out", "contiguous last dim"}));
  Tensor small = Tensor::zeros({4, 7}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { layernorm_forward(x, w, b, kEps, small, nullptr, nullptr); },
                           {"layernorm_forward", "out", "(4, 7)", "(4, 8)"}));
  Tensor bad_rstd = Tensor::zeros({5}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { rmsnorm_forward(x, w, kEps, out, &bad_rstd); },
                           {"rstd", "(5,)"}));
  EXPECT_TRUE(throws_error(
      [&] { layernorm_forward(x, w, b.to(DType::kBF16), kEps, out, nullptr, nullptr); },
      {"bias", "dtype of weight"}));
  Tensor dw_bf = Tensor::zeros({8}, DType::kBF16);
  EXPECT_TRUE(throws_error([&] { rmsnorm_backward(out, x, w, rstd, out, dw_bf); },
                           {"rmsnorm_backward", "dweight"}));
  Tensor delta = Tensor::zeros({3, 8}, DType::kF32);
  EXPECT_TRUE(throws_error([&] { add_rmsnorm_forward(x, delta, w, kEps, out, nullptr); },
                           {"add_rmsnorm_forward", "delta", "(3, 8)"}));
}

}  // namespace
}  // namespace tessera::kernels
