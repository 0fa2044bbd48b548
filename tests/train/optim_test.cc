// Optimizers, clipping, loss scaling and LR schedules against PyTorch
// (tests/parity/optim_reference.py, run once into a temp dir) and closed-form values.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <numbers>
#include <string>
#include <vector>

#include "tessera/io/safetensors.h"
#include "tessera/kernels/cpu/pointwise_common.h"
#include "tessera/train/grad_utils.h"
#include "tessera/train/loss_scaler.h"
#include "tessera/train/optimizer.h"
#include "tessera/train/schedule.h"

namespace tessera::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using kernels::cpu::Isa;

// max |a - b| / max |ref|: the error relative to the scale of the reference tensor.
double rel_error(const Tensor& a, const Tensor& b, const Tensor& scale_of) {
  const auto va = a.to_f32_vector(), vb = b.to_f32_vector(), vs = scale_of.to_f32_vector();
  EXPECT_EQ(va.size(), vb.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < va.size() && i < vb.size(); ++i) {
    num = std::max(num, std::abs(double(va[i]) - double(vb[i])));
    den = std::max(den, std::abs(double(vs[i])));
  }
  if (std::getenv("TESSERA_TEST_VERBOSE"))
    std::fprintf(stderr, "rel_error: max|a-b| %.3e max|ref| %.3e n %zu\n", num, den, va.size());
  return den > 0 ? num / den : num;
}

Tensor minus(const Tensor& a, const Tensor& b) {
  Tensor d = a.clone();
  float* p = d.data<float>();
  const float* q = b.data<float>();
  for (int64_t i = 0; i < d.numel(); ++i) p[i] -= q[i];
  return d;
}

// Error of one optimizer step: max |got - want| over max |want - before| (the update's
// scale), where each element may also differ by one ulp of want (the rounding of
// p + update, which a last-bit difference in the update flips).
double update_error(const Tensor& got, const Tensor& want, const Tensor& before) {
  const auto g = got.to_f32_vector(), w = want.to_f32_vector(), b = before.to_f32_vector();
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double ulp = std::abs(double(std::nextafter(w[i], INFINITY)) - double(w[i]));
    num = std::max(num, std::max(0.0, std::abs(double(g[i]) - double(w[i])) - ulp));
    den = std::max(den, std::abs(double(w[i]) - double(b[i])));
  }
  if (std::getenv("TESSERA_TEST_VERBOSE"))
    std::fprintf(stderr, "update_error: max excess %.3e max|update| %.3e n %zu\n", num, den, g.size());
  return den > 0 ? num / den : num;
}

// The reference file, generated once for the whole binary.
class Reference {
 public:
  static Reference& get() {
    static Reference r;
    return r;
  }
  bool ok() const { return file_ != nullptr; }
  Tensor tensor(const std::string& name) const { return file_->get(name).clone(); }
  const json& config() const { return config_; }
  const json& results() const { return results_; }

  // ParamRefs over fresh copies of "<prefix>.init.<name>" with zeroed grads; the list
  // of names and flags is config[list]["params"] (list defaults to prefix).
  std::vector<ParamRef> params(const std::string& prefix, std::string list = "") const {
    std::vector<ParamRef> out;
    for (const auto& p : config_[list.empty() ? prefix : list]["params"]) {
      ParamRef r;
      r.name = p[0].get<std::string>();
      r.param = tensor(prefix + ".init." + r.name);
      r.grad = Tensor::zeros(r.param.shape(), DType::kF32);
      r.decay = p[2].get<bool>();
      r.muon = p.size() > 3 && p[3].get<bool>();
      out.push_back(r);
    }
    return out;
  }
  void load_grads(const std::string& prefix, int step, std::vector<ParamRef>& ps) const {
    for (auto& r : ps) r.grad.copy_from(file_->get(prefix + ".grad." + std::to_string(step) + "." + r.name));
  }

 private:
  // The script runs into a fresh temp dir; its output is then renamed into
  // TESSERA_PARITY_DIR, where later test processes (ctest runs one per test) reuse it
  // until the script changes.
  Reference() {
    const fs::path script = fs::path(TESSERA_SOURCE_DIR) / "tests/parity/optim_reference.py";
    const fs::path cached = fs::path(TESSERA_PARITY_DIR) / "optim_reference.safetensors";
    std::error_code ec;
    const bool fresh = fs::exists(cached) && fs::last_write_time(cached) >= fs::last_write_time(script);
    if (!fresh) {
      fs::create_directories(TESSERA_PARITY_DIR, ec);
      const fs::path tmp = fs::temp_directory_path() / ("tessera_optim_ref_" + std::to_string(getpid()));
      const std::string cmd = std::string(TESSERA_PYTHON) + " " + script.string() + " --out " +
                              tmp.string() + " > " + tmp.string() + ".log 2>&1";
      if (std::system(cmd.c_str()) != 0) {
        ADD_FAILURE() << "reference generation failed: " << cmd;
        return;
      }
      const fs::path made = tmp / "optim_reference.safetensors";
      fs::rename(made, cached, ec);  // atomic when /tmp and the build dir share a filesystem
      if (ec) {                      // else copy next to it, then rename
        const fs::path part = cached.string() + "." + std::to_string(getpid());
        fs::copy_file(made, part, fs::copy_options::overwrite_existing);
        fs::rename(part, cached);
      }
      fs::remove_all(tmp, ec);
      fs::remove(tmp.string() + ".log", ec);
    }
    file_ = io::SafetensorsFile::open(cached.string());
    config_ = json::parse(file_->header().metadata.at("config"));
    results_ = json::parse(file_->header().metadata.at("results"));
  }
  std::shared_ptr<io::SafetensorsFile> file_;
  json config_, results_;
};

OptimizerConfig adamw_config(const json& c) {
  OptimizerConfig o;
  o.lr = c["lr"];
  o.beta1 = c["beta1"];
  o.beta2 = c["beta2"];
  o.eps = c["eps"];
  o.weight_decay = c["weight_decay"];
  return o;
}

// Restores auto ISA detection after a test that forced the portable path.
struct IsaGuard {
  explicit IsaGuard(Isa isa) { kernels::cpu::set_pointwise_isa_for_testing(isa); }
  ~IsaGuard() { kernels::cpu::set_pointwise_isa_for_testing(Isa::kAvx512); }
};

struct AdamWKernelGuard {
  explicit AdamWKernelGuard(AdamWKernel k) { set_adamw_kernel_for_testing(k); }
  ~AdamWKernelGuard() { set_adamw_kernel_for_testing(AdamWKernel::kAuto); }
};

class AdamWParity : public ::testing::TestWithParam<AdamWKernel> {};

TEST_P(AdamWParity, ThreeStepsMatchTorchAdamW) {
  AdamWKernelGuard kernel(GetParam());
  const Reference& ref = Reference::get();
  ASSERT_TRUE(ref.ok());
  const json& c = ref.config()["adamw"];
  auto ps = ref.params("adamw");
  Optimizer opt(adamw_config(c), ps);
  for (int step = 0; step < 3; ++step) {
    ref.load_grads("adamw", step, ps);
    opt.step(c["lr_scales"][step].get<double>());
    for (const auto& r : ps) {
      const std::string s = std::to_string(step);
      const Tensor want = ref.tensor("adamw.out." + s + "." + r.name);
      const Tensor before =
          step == 0 ? ref.tensor("adamw.init." + r.name) : ref.tensor("adamw.out." + std::to_string(step - 1) + "." + r.name);
      // Compared on the update (param change) so a wrong update cannot hide in the params.
      EXPECT_LE(rel_error(r.param, want, minus(want, before)), 1e-6) << r.name << " step " << step;
    }
  }
  EXPECT_EQ(opt.step_count(), 3);
  for (const auto& [name, t] : opt.state_tensors())
    EXPECT_LE(rel_error(t, ref.tensor("adamw." + name), ref.tensor("adamw." + name)), 1e-6) << name;
}

// Each loop where the CPU has it (else the case reruns the portable loop).
INSTANTIATE_TEST_SUITE_P(Kernel, AdamWParity,
                         ::testing::Values(AdamWKernel::kAvx512, AdamWKernel::kAvx2, AdamWKernel::kPortable),
                         [](const auto& info) {
                           return std::string(info.param == AdamWKernel::kAvx512 ? "avx512"
                                              : info.param == AdamWKernel::kAvx2 ? "avx2" : "portable");
                         });

TEST(AdamW, ResumedStateContinuesLikeTorch) {
  const Reference& ref = Reference::get();
  ASSERT_TRUE(ref.ok());
  const json& c = ref.config()["adamw"];
  auto ps = ref.params("adamw");
  Optimizer a(adamw_config(c), ps);
  for (int step = 0; step < 2; ++step) {
    ref.load_grads("adamw", step, ps);
    a.step(c["lr_scales"][step].get<double>());
  }
  std::vector<std::pair<std::string, Tensor>> saved;
  for (const auto& [name, t] : a.state_tensors()) saved.emplace_back(name, t.clone());
  EXPECT_EQ(saved.size(), 2 * ps.size());
  EXPECT_EQ(saved[0].first, "exp_avg." + ps[0].name);
  EXPECT_EQ(saved[1].first, "exp_avg_sq." + ps[0].name);

  // A fresh optimizer over copies of the params, with the saved state, takes step 3.
  std::vector<ParamRef> qs = ps;
  for (auto& r : qs) r.param = r.param.clone(), r.grad = r.grad.clone();
  Optimizer b(adamw_config(c), qs);
  b.load_state(saved, a.step_count());
  ref.load_grads("adamw", 2, qs);
  b.step(c["lr_scales"][2].get<double>());
  for (const auto& r : qs) {
    const Tensor want = ref.tensor("adamw.out.2." + r.name);
    EXPECT_LE(rel_error(r.param, want, minus(want, ref.tensor("adamw.out.1." + r.name))), 1e-6) << r.name;
  }
}

TEST(AdamW, LoadStateRejectsMismatches) {
  std::vector<ParamRef> ps = {{"w", Tensor::zeros({4, 3}, DType::kF32), Tensor::zeros({4, 3}, DType::kF32), true, false}};
  Optimizer opt(OptimizerConfig{}, ps);
  auto expect_error = [&](std::vector<std::pair<std::string, Tensor>> st, const std::string& needle) {
    try {
      opt.load_state(st, 1);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const Tensor ok = Tensor::zeros({4, 3}, DType::kF32);
  expect_error({{"exp_avg.w", ok}}, "'exp_avg_sq.w' is missing");
  expect_error({{"exp_avg.w", ok}, {"exp_avg_sq.w", Tensor::zeros({3, 4}, DType::kF32)}}, "(3, 4)");
  expect_error({{"exp_avg.w", ok}, {"exp_avg_sq.w", ok}, {"momentum.w", ok}}, "unexpected tensor 'momentum.w'");
  EXPECT_NO_THROW(opt.load_state({{"exp_avg.w", ok}, {"exp_avg_sq.w", ok}}, 7));
  EXPECT_EQ(opt.step_count(), 7);
}

TEST(Optimizer, RejectsBadConfigAndParams) {
  auto make = [](std::string name, Shape shape, bool muon) {
    OptimizerConfig c;
    c.name = std::move(name);
    return Optimizer(c, {{"p", Tensor::zeros(shape, DType::kF32), Tensor::zeros(shape, DType::kF32), true, muon}});
  };
  EXPECT_THROW(make("sgd", {4}, false), Error);
  EXPECT_THROW(make("muon", {4}, true), Error);       // Muon needs a matrix
  EXPECT_NO_THROW(make("adamw", {4}, true));          // adamw ignores the muon flag
  OptimizerConfig c;
  c.beta2 = 1.0;
  EXPECT_THROW(validate_optimizer_config(c), Error);
  std::vector<ParamRef> mismatched = {{"p", Tensor::zeros({4}, DType::kF32), Tensor::zeros({5}, DType::kF32), false, false}};
  EXPECT_THROW(Optimizer(OptimizerConfig{}, mismatched), Error);
  std::vector<ParamRef> twice = {{"p", Tensor::zeros({4}, DType::kF32), Tensor::zeros({4}, DType::kF32), false, false},
                                 {"p", Tensor::zeros({4}, DType::kF32), Tensor::zeros({4}, DType::kF32), false, false}};
  EXPECT_THROW(Optimizer(OptimizerConfig{}, twice), Error);
  Optimizer ok = make("adamw", {4}, false);
  EXPECT_THROW(ok.step(std::nan("")), Error);
}

TEST(Clip, MatchesTorchClipGradNorm) {
  const Reference& ref = Reference::get();
  ASSERT_TRUE(ref.ok());
  std::vector<ParamRef> ps;
  for (const auto& p : ref.config()["adamw"]["params"]) {
    const std::string name = p[0];
    ps.push_back({name, Tensor(), ref.tensor("clip.grad." + name), false, false});
  }
  const double norm = clip_grad_norm(ps, 1.0);
  EXPECT_NEAR(norm, ref.results()["clip.norm64"].get<double>(), 1e-12 * norm);
  EXPECT_NEAR(norm, ref.results()["clip.norm"].get<double>(), 1e-6 * norm);  // torch sums in f32
  for (const auto& r : ps) {
    const Tensor want = ref.tensor("clip.out." + r.name);
    EXPECT_LE(rel_error(r.grad, want, want), 2e-6) << r.name;
  }
  // Already within the limit (norm is now ~1): measured, untouched.
  const Tensor before = ps[0].grad.clone();
  const double after = clip_grad_norm(ps, 100.0);
  EXPECT_NEAR(after, 1.0, 1e-5);
  EXPECT_EQ(rel_error(ps[0].grad, before, before), 0.0);
  EXPECT_NEAR(clip_grad_norm(ps, 0.0), after, 1e-12);
}

TEST(Clip, NonFiniteNormIsReportedNotApplied) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    std::vector<ParamRef> ps = {{"a", Tensor(), Tensor::from_vector<float>({3, 4, 0}, {3}), false, false},
                                {"b", Tensor(), Tensor::from_vector<float>({1, bad}, {2}), false, false}};
    const double n = clip_grad_norm(ps, 1.0);
    EXPECT_FALSE(std::isfinite(n));
    EXPECT_EQ(ps[0].grad.item_f32(0), 3.f);
    EXPECT_EQ(ps[0].grad.item_f32(1), 4.f);
  }
  std::vector<ParamRef> ps = {{"a", Tensor(), Tensor::from_vector<float>({3, 4}, {2}), false, false}};
  EXPECT_DOUBLE_EQ(grad_global_norm(ps), 5.0);
  EXPECT_DOUBLE_EQ(clip_grad_norm(ps, 1.0), 5.0);
  EXPECT_FLOAT_EQ(ps[0].grad.item_f32(0), float(3.0 * (1.0 / (5.0 + 1e-6))));
}

// The trainer's way (folded: grad_clip's coefficient applied by the update pass, the
// gradients untouched) and the in-place clip_grad_norm both follow torch's recipe.
class ScaledAdamW : public ::testing::TestWithParam<bool> {};

TEST_P(ScaledAdamW, StepsMatchGradScaler) {
  const bool folded = GetParam();
  const Reference& ref = Reference::get();
  ASSERT_TRUE(ref.ok());
  const json& amp = ref.config()["amp"];
  const json& res = ref.results();
  auto ps = ref.params("amp", "adamw");
  Optimizer opt(adamw_config(ref.config()["adamw"]), ps);
  LossScaler scaler(amp["init_scale"], amp["growth_factor"], amp["backoff_factor"], amp["growth_interval"]);
  EXPECT_EQ(scaler.scale(), 65536.0);
  for (int step = 0; step < amp["steps"].get<int>(); ++step) {
    ref.load_grads("amp", step, ps);
    // The torch.cuda.amp recipe: unscale, clip, step unless inf/NaN, update.
    const bool finite = scaler.unscale_and_check(ps);
    StepOptions so;
    double norm = 0;
    if (folded) {
      const GradClip clip = grad_clip(ps, amp["max_norm"]);
      norm = clip.norm, so.grad_scale = clip.coef;
      if (finite) { EXPECT_LT(clip.coef, 1.f) << "step " << step; }  // the clip is in play
    } else {
      norm = clip_grad_norm(ps, amp["max_norm"]);
    }
    if (finite) opt.step(1.0, so);
    scaler.update(!finite);
    const bool want_skip = step == amp["inf_step"].get<int>() || step == amp["nan_step"].get<int>();
    EXPECT_EQ(finite, !want_skip) << "step " << step;
    if (finite)  // torch sums squares in f32: ~2e-6 off the f64 norm here
      EXPECT_NEAR(norm, res["amp.norm"][step].get<double>(), 5e-6 * norm) << "step " << step;
    else  // torch's norm is inf / nan too (written as a string)
      EXPECT_EQ(std::isnan(norm) ? "nan" : std::to_string(norm), res["amp.norm"][step].get<std::string>());
    EXPECT_EQ(scaler.scale(), res["amp.scale"][step].get<double>()) << "step " << step;
    EXPECT_EQ(scaler.growth_tracker(), res["amp.growth_tracker"][step].get<int64_t>()) << "step " << step;
    for (auto& r : ps) {
      const Tensor want = ref.tensor("amp.out." + std::to_string(step) + "." + r.name);
      const Tensor before = step == 0 ? ref.tensor("amp.init." + r.name)
                                      : ref.tensor("amp.out." + std::to_string(step - 1) + "." + r.name);
      if (want_skip) {  // both sides left the params alone
        EXPECT_EQ(rel_error(r.param, before, before), 0.0) << r.name << " step " << step;
        EXPECT_EQ(rel_error(want, before, before), 0.0) << r.name << " step " << step;
      } else {
        // The clip coefficients differ in the last bits (f64 vs torch's f32 norm).
        EXPECT_LE(update_error(r.param, want, before), 1e-5) << r.name << " step " << step;
      }
      r.param.copy_from(want);  // each step is compared on its own
    }
  }
  EXPECT_EQ(opt.step_count(), 4);
  EXPECT_EQ(scaler.skipped_steps(), 2);
  EXPECT_EQ(scaler.backoff_count(), 2);
  EXPECT_EQ(scaler.growth_count(), 1);
}

INSTANTIATE_TEST_SUITE_P(Clip, ScaledAdamW, ::testing::Values(false, true),
                         [](const auto& info) { return std::string(info.param ? "folded" : "in_place"); });

// The update pass's extras against the plain pass followed by the separate steps they
// replace: torch's in-place clip (g * coef in f32) before, the rounding to bf16 / f16 and
// the bf16 conversion (f32_to_bf16, round to nearest even) after. Bit for bit, on every
// loop, over lengths with vector tails, with NaN and huge values among the results.
TEST(AdamW, FusedClipAndWeightCopiesAreTheSeparatePasses) {
  const int64_t n = 1000 + 13;
  std::vector<float> p0(n), g0(n), m0(n), v0(n);
  uint32_t seed = 7;
  auto rnd = [&] { seed = seed * 1664525u + 1013904223u; return static_cast<float>(seed >> 8) / 16777216.f - 0.5f; };
  for (int64_t i = 0; i < n; ++i) p0[i] = rnd() * 4, g0[i] = rnd(), m0[i] = rnd() * 0.1f, v0[i] = std::abs(rnd()) * 0.01f;
  p0[5] = std::nanf("");        // a NaN weight stays NaN in both copies
  p0[17] = 3.3e38f;             // rounds to inf in bf16 ... and f16
  p0[18] = 70000.f;             // beyond f16's range only
  const AdamWScalars s = adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
  const float coef = 0.3712f;
  for (AdamWKernel k : {AdamWKernel::kAvx512, AdamWKernel::kAvx2, AdamWKernel::kPortable}) {
    AdamWKernelGuard guard(k);
    for (bool f16 : {false, true}) {
      std::vector<float> p = p0, m = m0, v = v0, pw = p0, mw = m0, vw = v0, gw = g0;
      for (float& g : gw) g *= coef;  // torch: grad.mul_(clip_coef)
      adamw_update(pw.data(), gw.data(), mw.data(), vw.data(), n, s);
      std::vector<float> rounded(n, -1.f);
      std::vector<uint16_t> b16(n, 0);
      kernels::UpdateExtras x;
      x.grad_scale = coef;
      x.rounded = rounded.data();
      x.round_f16 = f16;
      if (!f16) x.bf16 = b16.data();
      adamw_update(p.data(), g0.data(), m.data(), v.data(), n, s, x);
      for (int64_t i = 0; i < n; ++i) {
        const std::string at = "kernel " + std::to_string(int(k)) + (f16 ? " f16" : " bf16") + " element " + std::to_string(i);
        ASSERT_EQ(std::memcmp(&p[i], &pw[i], 4), 0) << at;
        ASSERT_EQ(m[i], mw[i]) << at;
        ASSERT_EQ(v[i], vw[i]) << at;
        const float want = f16 ? f16_to_f32(f32_to_f16(pw[i])) : bf16_to_f32(f32_to_bf16(pw[i]));
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(rounded[i])) << at;
        } else {
          ASSERT_EQ(rounded[i], want) << at;
        }
        if (!f16) { ASSERT_EQ(b16[i], f32_to_bf16(pw[i])) << at; }
      }
      // write_copies (Muon, the router bias) gives the same copies of given values.
      std::vector<float> r2(n, -1.f);
      std::vector<uint16_t> b2(n, 0);
      x.rounded = r2.data();
      x.bf16 = f16 ? nullptr : b2.data();
      kernels::write_copies(p.data(), n, x);
      EXPECT_EQ(std::memcmp(r2.data(), rounded.data(), n * 4), 0);
      if (!f16) { EXPECT_EQ(b2, b16); }
    }
  }
}

TEST(LossScaler, UnscalesExactlyAndFindsNonFinite) {
  for (Isa isa : {Isa::kAvx512, Isa::kScalar}) {
    IsaGuard guard(isa);
    LossScaler s(1024.0);
    std::vector<float> v(37);
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(i) * 3.f - 20.f;
    std::vector<ParamRef> ps = {{"a", Tensor(), Tensor::from_vector(v, {37}), false, false}};
    EXPECT_TRUE(s.unscale_and_check(ps));
    for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(ps[0].grad.item_f32(i), v[i] / 1024.f);
    for (size_t pos : {size_t{0}, size_t{16}, size_t{36}}) {  // vector body and masked tail
      std::vector<float> w(v);
      w[pos] = pos == 16 ? std::nanf("") : -std::numeric_limits<float>::infinity();
      std::vector<ParamRef> qs = {{"a", Tensor(), Tensor::from_vector(w, {37}), false, false}};
      EXPECT_FALSE(s.unscale_and_check(qs)) << pos;
    }
    // The largest finite float is finite.
    std::vector<ParamRef> big = {{"a", Tensor(), Tensor::from_vector<float>({std::numeric_limits<float>::max()}, {1}), false, false}};
    EXPECT_TRUE(s.unscale_and_check(big));
  }
  LossScaler off(65536.0, 2.0, 0.5, 2000, false);
  std::vector<ParamRef> ps = {{"a", Tensor(), Tensor::from_vector<float>({std::nanf(""), 8.f}, {2}), false, false}};
  EXPECT_TRUE(off.unscale_and_check(ps));
  EXPECT_EQ(ps[0].grad.item_f32(1), 8.f);
  off.update(true);
  EXPECT_EQ(off.scale(), 1.0);
}

TEST(LossScaler, GrowthStopsAtFloatMaxAndStateRoundTrips) {
  LossScaler s(std::ldexp(1.0, 127), 2.0, 0.5, 1);
  s.update(false);  // 2^128 is inf in f32: the scale stays
  EXPECT_EQ(s.scale(), std::ldexp(1.0, 127));
  EXPECT_EQ(s.growth_count(), 0);
  LossScaler a(65536.0, 2.0, 0.5, 3);
  a.update(false), a.update(true), a.update(false), a.update(false);
  LossScaler b;
  b.load_json(a.to_json());
  EXPECT_EQ(b.scale(), 32768.0);
  EXPECT_EQ(b.growth_tracker(), 2);
  EXPECT_EQ(b.skipped_steps(), 1);
  b.update(false);
  EXPECT_EQ(b.scale(), 65536.0);  // growth_interval 3 came back too
  json j = a.to_json();
  j["extra"] = 1;
  EXPECT_THROW(b.load_json(j), Error);
  j = a.to_json();
  j["scale"] = "big";
  try {
    b.load_json(j);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'scale'"), std::string::npos) << e.what();
  }
}

TEST(Muon, NewtonSchulzMatchesReference) {
  const Reference& ref = Reference::get();
  ASSERT_TRUE(ref.ok());
  for (const char* tag : {"tall", "wide", "square"}) {
    const Tensor want = ref.tensor(std::string("ns.out.") + tag);
    const Tensor got = newton_schulz5(ref.tensor(std::string("ns.in.") + tag), 5);
    EXPECT_EQ(got.shape(), want.shape());
    EXPECT_LE(rel_error(got, want, want), 2e-5) << tag;
  }
}

class MuonParity : public ::testing::TestWithParam<std::string> {};

TEST_P(MuonParity, ThreeStepsMatchReferenceMuonPlusAdamW) {
  const std::string prefix = GetParam();  // muon: Nesterov; muon_plain: without
  const Reference& ref = Reference::get();
  ASSERT_TRUE(ref.ok());
  const json& c = ref.config()[prefix];
  OptimizerConfig oc = adamw_config(c);
  oc.name = "muon";
  oc.muon_lr = c["muon_lr"];
  oc.muon_momentum = c["muon_momentum"];
  oc.muon_nesterov = c["muon_nesterov"];
  oc.muon_ns_steps = c["muon_ns_steps"];
  oc.muon_weight_decay = c["muon_weight_decay"];
  auto ps = ref.params(prefix);
  Optimizer opt(oc, ps);
  for (int step = 0; step < 3; ++step) {
    ref.load_grads(prefix, step, ps);
    opt.step(c["lr_scales"][step].get<double>());
    for (auto& r : ps) {
      const Tensor want = ref.tensor(prefix + ".out." + std::to_string(step) + "." + r.name);
      const Tensor before = step == 0 ? ref.tensor(prefix + ".init." + r.name)
                                      : ref.tensor(prefix + ".out." + std::to_string(step - 1) + "." + r.name);
      // f32 Newton-Schulz through different GEMMs: the quintic's slope of 3.4 at small
      // singular values amplifies rounding differences over the 5 iterations.
      EXPECT_LE(update_error(r.param, want, before), r.muon ? 2e-5 : 1e-6)
          << r.name << " step " << step;
      // Continue from torch's params so each step's update is compared on its own.
      r.param.copy_from(want);
    }
  }
  int momenta = 0;
  for (const auto& [name, t] : opt.state_tensors()) {
    if (name.rfind("momentum.", 0) != 0) continue;
    ++momenta;
    const Tensor want = ref.tensor(prefix + "." + name);
    EXPECT_LE(rel_error(t, want, want), 1e-6) << name;
  }
  EXPECT_EQ(momenta, 2);
}

INSTANTIATE_TEST_SUITE_P(Muon, MuonParity, ::testing::Values("muon", "muon_plain"),
                         [](const auto& info) { return info.param == "muon" ? "nesterov" : "plain"; });

// --- schedules against closed-form values ---

TEST(Schedule, CosineWithWarmup) {
  ScheduleConfig s;
  s.kind = "cosine";
  s.warmup_steps = 10;
  s.total_steps = 110;
  s.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 0), 0.1);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 4), 0.5);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 9), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 10), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi / 100)));
  EXPECT_NEAR(lr_multiplier(s, 59), 0.55, 1e-15);  // half way: (1 + min) / 2
  EXPECT_NEAR(lr_multiplier(s, 84), 0.1 + 0.9 * 0.5 * (1 - std::sqrt(0.5)), 1e-15);  // q = 3/4
  EXPECT_NEAR(lr_multiplier(s, 109), 0.1, 1e-15);
  EXPECT_NEAR(lr_multiplier(s, 500), 0.1, 1e-15);
  for (int64_t t = 10; t < 110; ++t) EXPECT_LE(lr_multiplier(s, t), lr_multiplier(s, t - 1));
  s.warmup_steps = 0;
  EXPECT_NEAR(lr_multiplier(s, 0), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi / 110)), 1e-15);
}

TEST(Schedule, WarmupStableDecay) {
  ScheduleConfig s;
  s.kind = "wsd";
  s.warmup_steps = 10;
  s.total_steps = 100;
  s.min_lr_ratio = 0.1;
  s.decay_fraction = 0.2;  // decays over the last 20 steps: n in (80, 100]
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 1), 0.2);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 10), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 79), 1.0);
  EXPECT_NEAR(lr_multiplier(s, 80), 1.0 - 0.9 / 20, 1e-15);
  EXPECT_NEAR(lr_multiplier(s, 89), 0.55, 1e-15);
  EXPECT_NEAR(lr_multiplier(s, 99), 0.1, 1e-15);
  s.wsd_decay = "sqrt";
  EXPECT_NEAR(lr_multiplier(s, 89), 0.1 + 0.9 * (1 - std::sqrt(0.5)), 1e-15);
  EXPECT_NEAR(lr_multiplier(s, 84), 0.1 + 0.9 * (1 - std::sqrt(0.25)), 1e-15);
  EXPECT_NEAR(lr_multiplier(s, 99), 0.1, 1e-15);
  EXPECT_NEAR(lr_multiplier(s, 150), 0.1, 1e-15);
  s.decay_fraction = 0.0;
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 99), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 150), 1.0);
}

TEST(Schedule, ConstantAndValidation) {
  ScheduleConfig s;
  s.kind = "constant";
  s.warmup_steps = 4;
  s.total_steps = 10;
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 0), 0.25);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 3), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(s, 1000), 1.0);
  auto bad = [](auto edit) {
    ScheduleConfig c;
    c.total_steps = 10;
    edit(c);
    return c;
  };
  EXPECT_THROW(lr_multiplier(bad([](auto& c) { c.kind = "linear"; }), 0), Error);
  EXPECT_THROW(lr_multiplier(bad([](auto& c) { c.warmup_steps = 11; }), 0), Error);
  EXPECT_THROW(lr_multiplier(bad([](auto& c) { c.min_lr_ratio = 1.5; }), 0), Error);
  EXPECT_THROW(lr_multiplier(bad([](auto& c) { c.wsd_decay = "cos"; }), 0), Error);
  EXPECT_THROW(lr_multiplier(bad([](auto& c) { c.total_steps = 0; }), 0), Error);
  EXPECT_THROW(lr_multiplier(bad([](auto&) {}), -1), Error);
  try {
    validate_schedule(bad([](auto& c) { c.decay_fraction = -0.1; }));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("decay_fraction"), std::string::npos);
  }
}

}  // namespace
}  // namespace tessera::train
