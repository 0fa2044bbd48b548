// Global gradient norm and clipping (see grad_utils.h).
#include "tessera/train/grad_utils.h"

#include <cmath>

#include "tessera/base/thread_pool.h"
#include "tessera/base/trace.h"
#include "tessera/kernels/optimizer_math.h"

namespace tessera::train {
namespace {

// Elements per block; blocks never straddle two tensors, and block sums are added in
// order, so the norm has the same bits for any thread count.
constexpr int64_t kBlock = int64_t{1} << 14;

struct Block {
  const float* data;
  int64_t n;
  double share = 1.0;  // ParamRef::norm_share
};

std::vector<Block> blocks_of(const std::vector<ParamRef>& params) {
  std::vector<Block> blocks;
  for (const ParamRef& p : params) {
    TESSERA_CHECK(p.grad.defined() && p.grad.dtype() == DType::kF32 && p.grad.is_contiguous() &&
                      p.grad.device() == Device::kCPU,
                  "grad norm: grad of '", p.name, "' ",
                  p.grad.defined() ? p.grad.describe() : "(undefined)",
                  " must be a contiguous f32 CPU tensor");
    const float* d = p.grad.data<float>();
    for (int64_t b = 0; b < p.grad.numel(); b += kBlock)
      blocks.push_back({d + b, std::min(kBlock, p.grad.numel() - b), p.norm_share});
  }
  return blocks;
}

}  // namespace

double grad_global_norm(const std::vector<ParamRef>& params) {
  base::TraceScope scope("grad_norm");
  const std::vector<Block> blocks = blocks_of(params);
  std::vector<double> partial(blocks.size(), 0.0);
  base::parallel_for(static_cast<int64_t>(blocks.size()), 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      partial[b] = blocks[b].share * kernels::sum_squares(blocks[b].data, blocks[b].n);
  });
  double s = 0;
  for (double p : partial) s += p;
  return std::sqrt(s);
}

GradClip grad_clip(const std::vector<ParamRef>& params, double max_norm,
                   const std::function<double(double)>& sum_across) {
  GradClip r;
  r.norm = grad_global_norm(params);
  if (sum_across) r.norm = std::sqrt(sum_across(r.norm * r.norm));
  if (!(max_norm > 0) || !std::isfinite(r.norm)) return r;
  const double coef = max_norm / (r.norm + 1e-6);
  if (coef < 1.0) r.coef = static_cast<float>(coef);  // torch multiplies by an f32 tensor
  return r;
}

double clip_grad_norm(const std::vector<ParamRef>& params, double max_norm,
                      const std::function<double(double)>& sum_across) {
  const GradClip clip = grad_clip(params, max_norm, sum_across);
  if (clip.coef == 1.f) return clip.norm;
  const float c = clip.coef;
  for (const ParamRef& p : params) {
    float* g = p.grad.data<float>();
    base::parallel_for(p.grad.numel(), int64_t{1} << 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) g[i] *= c;
    });
  }
  return clip.norm;
}

}  // namespace tessera::train
