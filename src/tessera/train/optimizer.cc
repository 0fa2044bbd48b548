// Optimizer construction, checkpoint state, and the AdamW step: one fused pass per
// element over (param, grad, exp_avg, exp_avg_sq), parallel over fixed-size chunks.
#include "tessera/train/optimizer.h"

#include <atomic>
#include <cmath>
#include <map>
#include <set>

#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/pointwise_common.h"

namespace tessera::train {
namespace {

namespace av = kernels::cpu::avx512;

// Elements per unit of parallel work: 4 arrays x 256 KiB, enough to amortise the
// scheduling and small enough that one 124M-parameter model splits into ~2000 chunks.
constexpr int64_t kChunkElements = int64_t{1} << 16;

// torch 1.13's _single_tensor_adamw, op by op, with the roundings torch's CPU kernels
// use (checked element by element against torch on 1M random values):
//   param.mul_(1 - lr*wd)                          p * decay
//   exp_avg.mul_(b1).add_(g, alpha=1-b1)           fma(g, 1-b1, m*b1)   (add_ with alpha fuses)
//   exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2) fma((1-b2)*g, g, v*b2)
//   denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-step)    (-step*m) / denom + p
// The portable loop relies on the baseline x86-64 build having no FMA to contract
// p * decay into the final add; std::fma marks the two places torch does fuse.
void adamw_portable(float* p, const float* g, float* m, float* v, int64_t n,
                    const AdamWScalars& s) {
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i] * s.decay;
    const float gi = g[i];
    const float mi = std::fma(gi, s.one_minus_beta1, m[i] * s.beta1);
    const float vi = std::fma(s.one_minus_beta2 * gi, gi, v[i] * s.beta2);
    const float denom = std::sqrt(vi) / s.bias_correction2_sqrt + s.eps;
    p[i] = (s.neg_step_size * mi) / denom + pi;
    m[i] = mi;
    v[i] = vi;
  }
}

// A product rounded on its own. GCC contracts _mm512_mul_ps followed by _mm512_add_ps
// into an FMA (the intrinsics are plain vector arithmetic to it), which would skip the
// rounding torch does after p * (1 - lr*wd); the explicit-rounding form is never fused.
TESSERA_AVX512 inline __m512 mul_rn(__m512 a, __m512 b) {
  return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

TESSERA_AVX512 inline void adamw_vec(float* p, const float* g, float* m, float* v, __mmask16 k,
                                     bool full, __m512 decay, __m512 b1, __m512 omb1, __m512 b2,
                                     __m512 omb2, __m512 bc2s, __m512 nss, __m512 eps) {
  const __m512 pv = full ? av::load(p) : av::load(p, k);
  const __m512 gv = full ? av::load(g) : av::load(g, k);
  const __m512 mv = full ? av::load(m) : av::load(m, k);
  const __m512 vv = full ? av::load(v) : av::load(v, k);
  const __m512 pd = mul_rn(pv, decay);
  const __m512 m1 = _mm512_fmadd_ps(gv, omb1, mul_rn(mv, b1));
  const __m512 v1 = _mm512_fmadd_ps(mul_rn(omb2, gv), gv, mul_rn(vv, b2));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v1), bc2s), eps);
  const __m512 p1 = _mm512_add_ps(_mm512_div_ps(mul_rn(nss, m1), denom), pd);
  if (full) {
    av::store(p, p1), av::store(m, m1), av::store(v, v1);
  } else {
    av::store(p, p1, k), av::store(m, m1, k), av::store(v, v1, k);
  }
}

TESSERA_AVX512 void adamw_avx512(float* p, const float* g, float* m, float* v, int64_t n,
                                 const AdamWScalars& s) {
  const __m512 decay = _mm512_set1_ps(s.decay), b1 = _mm512_set1_ps(s.beta1),
               omb1 = _mm512_set1_ps(s.one_minus_beta1), b2 = _mm512_set1_ps(s.beta2),
               omb2 = _mm512_set1_ps(s.one_minus_beta2),
               bc2s = _mm512_set1_ps(s.bias_correction2_sqrt),
               nss = _mm512_set1_ps(s.neg_step_size), eps = _mm512_set1_ps(s.eps);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    adamw_vec(p + i, g + i, m + i, v + i, 0, true, decay, b1, omb1, b2, omb2, bc2s, nss, eps);
  if (i < n)
    adamw_vec(p + i, g + i, m + i, v + i, av::tail_mask(n - i), false, decay, b1, omb1, b2, omb2,
              bc2s, nss, eps);
}

// The same loop for CPUs with AVX2 + FMA but not AVX-512. AVX2 has no explicitly
// rounded multiply, so an empty asm makes each product opaque to GCC's contraction.
#define TESSERA_AVX2_FMA __attribute__((target("avx2,fma")))
TESSERA_AVX2_FMA inline __m256 rounded(__m256 x) {
  __asm__("" : "+x"(x));
  return x;
}

TESSERA_AVX2_FMA void adamw_avx2(float* p, const float* g, float* m, float* v, int64_t n,
                                 const AdamWScalars& s) {
  const __m256 decay = _mm256_set1_ps(s.decay), b1 = _mm256_set1_ps(s.beta1),
               omb1 = _mm256_set1_ps(s.one_minus_beta1), b2 = _mm256_set1_ps(s.beta2),
               omb2 = _mm256_set1_ps(s.one_minus_beta2),
               bc2s = _mm256_set1_ps(s.bias_correction2_sqrt),
               nss = _mm256_set1_ps(s.neg_step_size), eps = _mm256_set1_ps(s.eps);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 pd = rounded(_mm256_mul_ps(_mm256_loadu_ps(p + i), decay));
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 m1 = _mm256_fmadd_ps(gv, omb1, rounded(_mm256_mul_ps(_mm256_loadu_ps(m + i), b1)));
    const __m256 v1 = _mm256_fmadd_ps(rounded(_mm256_mul_ps(omb2, gv)), gv,
                                      rounded(_mm256_mul_ps(_mm256_loadu_ps(v + i), b2)));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v1), bc2s), eps);
    const __m256 step = rounded(_mm256_mul_ps(nss, m1));
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_div_ps(step, denom), pd));
    _mm256_storeu_ps(m + i, m1);
    _mm256_storeu_ps(v + i, v1);
  }
  if (i < n) adamw_portable(p + i, g + i, m + i, v + i, n - i, s);
}

std::atomic<AdamWKernel> g_adamw_kernel{AdamWKernel::kAuto};

AdamWKernel pick_adamw_kernel() {
  const auto& f = base::cpu_features();
  const bool avx2 = f.avx2 && f.fma;
  switch (g_adamw_kernel.load(std::memory_order_relaxed)) {
    case AdamWKernel::kAvx512:
      return kernels::cpu::use_avx512() ? AdamWKernel::kAvx512 : AdamWKernel::kPortable;
    case AdamWKernel::kAvx2:
      return avx2 ? AdamWKernel::kAvx2 : AdamWKernel::kPortable;
    case AdamWKernel::kPortable:
      return AdamWKernel::kPortable;
    case AdamWKernel::kAuto:
      break;
  }
  if (kernels::cpu::use_avx512()) return AdamWKernel::kAvx512;
  return avx2 ? AdamWKernel::kAvx2 : AdamWKernel::kPortable;
}

void check_unit_interval(double v, const char* key) {
  TESSERA_CHECK(std::isfinite(v) && v >= 0.0 && v < 1.0, "optimizer: ", key, " = ", v,
                " must be in [0, 1)");
}
void check_non_negative(double v, const char* key) {
  TESSERA_CHECK(std::isfinite(v) && v >= 0.0, "optimizer: ", key, " = ", v,
                " must be a finite number >= 0");
}

void check_param(const ParamRef& r) {
  TESSERA_CHECK(!r.name.empty(), "optimizer: a parameter has an empty name");
  for (const auto* t : {&r.param, &r.grad}) {
    const char* what = t == &r.param ? "param" : "grad";
    TESSERA_CHECK(t->defined(), "optimizer: parameter '", r.name, "': ", what, " is undefined");
    TESSERA_CHECK(t->device() == Device::kCPU && t->dtype() == DType::kF32 && t->is_contiguous(),
                  "optimizer: parameter '", r.name, "': ", what, " ", t->describe(),
                  " must be a contiguous f32 CPU tensor");
  }
  TESSERA_CHECK(r.param.shape() == r.grad.shape(), "optimizer: parameter '", r.name, "': grad ",
                r.grad.describe(), " does not match param ", r.param.describe());
}

}  // namespace

void validate_optimizer_config(const OptimizerConfig& c) {
  TESSERA_CHECK(c.name == "adamw" || c.name == "muon", "optimizer: name = '", c.name,
                "' is not one of adamw, muon");
  check_non_negative(c.lr, "lr");
  check_unit_interval(c.beta1, "beta1");
  check_unit_interval(c.beta2, "beta2");
  check_non_negative(c.eps, "eps");
  check_non_negative(c.weight_decay, "weight_decay");
  check_non_negative(c.muon_lr, "muon_lr");
  check_unit_interval(c.muon_momentum, "muon_momentum");
  check_non_negative(c.muon_weight_decay, "muon_weight_decay");
  TESSERA_CHECK(c.muon_ns_steps >= 1 && c.muon_ns_steps <= 100, "optimizer: muon_ns_steps = ",
                c.muon_ns_steps, " must be in [1, 100]");
}

AdamWScalars adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                           int64_t t) {
  // Python floats (doubles) in torch's formula, rounded to f32 where they meet a tensor.
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(t));
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.neg_step_size = static_cast<float>(-(lr / bc1));
  s.eps = static_cast<float>(eps);
  return s;
}

void set_adamw_kernel_for_testing(AdamWKernel k) {
  g_adamw_kernel.store(k, std::memory_order_relaxed);
}

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s) {
  switch (pick_adamw_kernel()) {
    case AdamWKernel::kAvx512:
      adamw_avx512(p, g, m, v, n, s);
      break;
    case AdamWKernel::kAvx2:
      adamw_avx2(p, g, m, v, n, s);
      break;
    default:
      adamw_portable(p, g, m, v, n, s);
  }
}

Optimizer::Optimizer(OptimizerConfig config, std::vector<ParamRef> params)
    : config_(std::move(config)), params_(std::move(params)) {
  validate_optimizer_config(config_);
  std::set<std::string> names;
  const bool muon = config_.name == "muon";
  state_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamRef& r = params_[i];
    check_param(r);
    TESSERA_CHECK(names.insert(r.name).second, "optimizer: parameter name '", r.name,
                  "' appears twice");
    State& st = state_[i];
    st.use_muon = muon && r.muon;
    if (st.use_muon) {
      TESSERA_CHECK(r.param.dim() == 2, "optimizer: parameter '", r.name, "' ",
                    r.param.describe(), " is marked muon but Muon needs a 2-D matrix");
      st.momentum = Tensor::zeros(r.param.shape(), DType::kF32);
      continue;
    }
    st.exp_avg = Tensor::zeros(r.param.shape(), DType::kF32);
    st.exp_avg_sq = Tensor::zeros(r.param.shape(), DType::kF32);
    for (int64_t b = 0; b < r.param.numel(); b += kChunkElements)
      adamw_chunks_.push_back({static_cast<int64_t>(i), b,
                               std::min(r.param.numel(), b + kChunkElements)});
  }
}

void Optimizer::step(double lr_scale) {
  TESSERA_CHECK(std::isfinite(lr_scale) && lr_scale >= 0.0, "optimizer: lr multiplier ",
                lr_scale, " must be a finite number >= 0");
  ++step_;
  step_adamw(config_.lr * lr_scale);
  if (config_.name == "muon") step_muon(config_.muon_lr * lr_scale);
}

void Optimizer::step_adamw(double lr) {
  if (adamw_chunks_.empty()) return;
  // Weight decay differs per parameter (decay flag), the rest of the scalars do not.
  const AdamWScalars with_decay =
      adamw_scalars(lr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay, step_);
  AdamWScalars no_decay = with_decay;
  no_decay.decay = 1.0f;  // torch: p.mul_(1 - lr*0) multiplies by exactly 1
  base::parallel_for(static_cast<int64_t>(adamw_chunks_.size()), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const Chunk& ch = adamw_chunks_[c];
      const ParamRef& r = params_[ch.param];
      const State& st = state_[ch.param];
      adamw_update(r.param.data<float>() + ch.begin, r.grad.data<float>() + ch.begin,
                   st.exp_avg.data<float>() + ch.begin, st.exp_avg_sq.data<float>() + ch.begin,
                   ch.end - ch.begin, r.decay ? with_decay : no_decay);
    }
  });
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = params_[i].name;
    if (state_[i].use_muon) {
      out.emplace_back("momentum." + n, state_[i].momentum);
    } else {
      out.emplace_back("exp_avg." + n, state_[i].exp_avg);
      out.emplace_back("exp_avg_sq." + n, state_[i].exp_avg_sq);
    }
  }
  return out;
}

void Optimizer::load_state(const std::vector<std::pair<std::string, Tensor>>& tensors,
                           int64_t step_count) {
  TESSERA_CHECK(step_count >= 0, "optimizer state: step count ", step_count, " is negative");
  const auto mine = state_tensors();
  std::map<std::string, Tensor> given;
  for (const auto& [name, t] : tensors)
    TESSERA_CHECK(given.emplace(name, t).second, "optimizer state: tensor '", name,
                  "' appears twice");
  // Check everything before copying anything, so a bad checkpoint leaves the state intact.
  for (const auto& [name, dst] : mine) {
    auto it = given.find(name);
    TESSERA_CHECK(it != given.end(), "optimizer state: tensor '", name,
                  "' is missing (was the checkpoint saved with another optimizer or model?)");
    const Tensor& src = it->second;
    TESSERA_CHECK(src.defined() && src.shape() == dst.shape(), "optimizer state: tensor '", name,
                  "' has shape ", src.defined() ? shape_str(src.shape()) : "(undefined)",
                  ", expected ", shape_str(dst.shape()));
    TESSERA_CHECK(src.dtype() == DType::kF32 || src.dtype() == DType::kBF16 ||
                      src.dtype() == DType::kF16,
                  "optimizer state: tensor '", name, "' ", src.describe(), " is not a float tensor");
  }
  std::set<std::string> known;
  for (const auto& m : mine) known.insert(m.first);
  for (const auto& [name, t] : tensors) {
    TESSERA_CHECK(known.count(name), "optimizer state: unexpected tensor '", name,
                  "' (no such parameter, or a different optimizer)");
  }
  for (const auto& [name, dst] : mine) {
    Tensor d = dst;
    d.copy_from(given.at(name));
  }
  step_ = step_count;
}

}  // namespace tessera::train
