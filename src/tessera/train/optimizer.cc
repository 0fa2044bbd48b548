// Optimizer construction, checkpoint state, and the AdamW step: one fused pass per
// element over (param, grad, exp_avg, exp_avg_sq), parallel over fixed-size chunks.
#include "tessera/train/optimizer.h"

#include <cmath>
#include <map>
#include <set>

#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"

namespace tessera::train {
namespace {

// Elements per unit of parallel work: 4 arrays x 256 KiB, enough to amortise the
// scheduling and small enough that one 124M-parameter model splits into ~2000 chunks.
constexpr int64_t kChunkElements = int64_t{1} << 16;

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
    // Chunk edges on the parameter's whole groups of rows where it asks (a weight kept
    // packed is packed 16 rows at a time from each chunk's values).
    const int64_t align = std::max<int64_t>(1, r.chunk_align), n = r.param.numel();
    const int64_t step = align > 1 ? std::max(align, kChunkElements / align * align) : kChunkElements;
    const int64_t phase = ((r.chunk_phase % align) + align) % align;
    for (int64_t b = 0, next = phase ? align - phase : step; b < n; next = b + step) {
      const int64_t e = std::min(n, next);
      adamw_chunks_.push_back({static_cast<int64_t>(i), b, e});
      b = e;
    }
  }
}

void Optimizer::step(double lr_scale, const StepOptions& o) {
  TESSERA_CHECK(std::isfinite(lr_scale) && lr_scale >= 0.0, "optimizer: lr multiplier ",
                lr_scale, " must be a finite number >= 0");
  TESSERA_CHECK(std::isfinite(o.grad_scale) && o.grad_scale >= 0.0, "optimizer: gradient scale ",
                o.grad_scale, " must be a finite number >= 0");
  if (o.copies) {
    TESSERA_CHECK(o.copies->size() == params_.size(), "optimizer: ", o.copies->size(),
                  " sets of weight copies for ", params_.size(), " parameters");
    for (size_t i = 0; i < params_.size(); ++i) {
      const ParamCopies& c = (*o.copies)[i];
      const int64_t n = params_[i].param.numel();
      TESSERA_CHECK(!c.rounded.defined() || (c.rounded.dtype() == DType::kF32 && c.rounded.numel() == n &&
                                             c.rounded.is_contiguous()),
                    "optimizer: the rounded copy of '", params_[i].name, "' is not ", n, " contiguous f32");
      TESSERA_CHECK(!c.bf16.defined() || (c.bf16.dtype() == DType::kBF16 && c.bf16.numel() == n &&
                                          c.bf16.is_contiguous() && c.format == DType::kBF16),
                    "optimizer: the bf16 copy of '", params_[i].name, "' is not ", n, " contiguous bf16");
      TESSERA_CHECK(c.format == DType::kBF16 || c.format == DType::kF16, "optimizer: weight copies of '",
                    params_[i].name, "' round to ", dtype_name(c.format), ", not bf16 or f16");
    }
  }
  ++step_;
  step_adamw(config_.lr * lr_scale, o);
  if (config_.name == "muon") step_muon(config_.muon_lr * lr_scale, o);
}

void Optimizer::step_adamw(double lr, const StepOptions& o) {
  if (adamw_chunks_.empty()) return;
  // Weight decay differs per parameter (decay flag), the rest of the scalars do not.
  const AdamWScalars with_decay =
      adamw_scalars(lr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay, step_);
  AdamWScalars no_decay = with_decay;
  no_decay.decay = 1.0f;  // torch: p.mul_(1 - lr*0) multiplies by exactly 1
  const auto grad_scale = static_cast<float>(o.grad_scale);  // torch's clip: an f32 tensor
  base::parallel_for(static_cast<int64_t>(adamw_chunks_.size()), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const Chunk& ch = adamw_chunks_[c];
      const ParamRef& r = params_[ch.param];
      const State& st = state_[ch.param];
      const ParamCopies* pc = o.copies ? &(*o.copies)[ch.param] : nullptr;
      kernels::UpdateExtras x;
      if (pc) x = kernels::extras_of(*pc, ch.begin);
      x.grad_scale = grad_scale;
      // Weights kept packed: the bf16 values go to a scratch that stays in cache, then
      // from there to the bf16 copy and the packed ones (kernels::publish_bf16).
      thread_local std::vector<uint16_t> scratch;
      const bool packed = pc && pc->packed;
      if (packed) {
        if (scratch.size() < static_cast<size_t>(ch.end - ch.begin)) scratch.resize(ch.end - ch.begin);
        x.bf16 = scratch.data(), x.cache_bf16 = true;
      }
      adamw_update(r.param.data<float>() + ch.begin, r.grad.data<float>() + ch.begin,
                   st.exp_avg.data<float>() + ch.begin, st.exp_avg_sq.data<float>() + ch.begin,
                   ch.end - ch.begin, r.decay ? with_decay : no_decay, x);
      if (packed) kernels::publish_bf16(*pc, ch.begin, scratch.data(), ch.end - ch.begin);
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
