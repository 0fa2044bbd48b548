// Gradient utilities of the training step: global L2 norm and norm clipping with
// torch.nn.utils.clip_grad_norm_ semantics.
#pragma once
#include <functional>
#include <vector>

#include "tessera/train/optimizer.h"

namespace tessera::train {

// sqrt(sum of g^2) over every grad, accumulated in f64 over fixed blocks, so the result
// does not depend on the thread count. Non-finite when any grad is.
double grad_global_norm(const std::vector<ParamRef>& params);

// The global norm and torch's clip coefficient for it, touching no gradient: coef =
// max_norm / (norm + 1e-6) as f32 when that is < 1, else 1 (also when max_norm <= 0 or
// the norm is not finite). An optimizer step given coef (StepOptions::grad_scale) then
// updates exactly as after clip_grad_norm's in-place scaling, without that pass.
// sum_across as for clip_grad_norm below.
struct GradClip {
  double norm = 0;
  float coef = 1.f;
};
GradClip grad_clip(const std::vector<ParamRef>& params, double max_norm,
                   const std::function<double(double)>& sum_across = {});

// Scales every grad by coef = max_norm / (norm + 1e-6) when coef < 1, as torch does;
// returns the pre-clip global norm. max_norm <= 0 only measures. A non-finite norm is
// returned without touching the grads (torch would multiply them by NaN); the caller
// reports it and, with a loss scaler, skips the step.
// With `sum_across` (sharded gradients: each rank holds a part), the squared norm of this
// rank's part is summed over the group through it before the coefficient is taken.
double clip_grad_norm(const std::vector<ParamRef>& params, double max_norm,
                      const std::function<double(double)>& sum_across = {});

}  // namespace tessera::train
