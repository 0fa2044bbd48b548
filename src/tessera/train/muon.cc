// Muon (Keller Jordan, github.com/KellerJordan/Muon): momentum with Nesterov, the update
// orthogonalised by a quintic Newton-Schulz iteration, decoupled weight decay.
// Runs in f32 on the CPU through kernels::matmul; the public implementation runs the
// iteration in bf16 on GPUs.
#include <cmath>

#include "tessera/base/thread_pool.h"
#include "tessera/comm/communicator.h"
#include "tessera/kernels/matmul.h"
#include "tessera/train/optimizer.h"

namespace tessera::train {
namespace {

constexpr float kNsA = 3.4445f, kNsB = -4.7750f, kNsC = 2.0315f;
constexpr int64_t kGrain = int64_t{1} << 15;

// torch.lerp's rounding (ATen's lerp(): self + w*(end-self) for w < 0.5, else
// end - (end-self)*(1-w), each fused on CPUs with FMA), so the momentum matches torch.
inline float lerp(float self, float end, float w) {
  const float d = end - self;
  return w < 0.5f ? std::fma(w, d, self) : std::fma(-d, 1.0f - w, end);
}

// dst (cols, rows) = src (rows, cols)^T, in 32 x 32 tiles.
void transpose(const float* src, float* dst, int64_t rows, int64_t cols) {
  constexpr int64_t T = 32;
  base::parallel_for((rows + T - 1) / T, std::max<int64_t>(1, kGrain / (T * cols)),
                     [&](int64_t b0, int64_t b1) {
                       for (int64_t rb = b0 * T; rb < std::min(rows, b1 * T); rb += T)
                         for (int64_t cb = 0; cb < cols; cb += T)
                           for (int64_t r = rb; r < std::min(rows, rb + T); ++r)
                             for (int64_t c = cb; c < std::min(cols, cb + T); ++c)
                               dst[c * rows + r] = src[r * cols + c];
                     });
}

// ||x||_2 over n floats, accumulated in f64 over fixed 4096-element blocks.
double frobenius_norm(const float* x, int64_t n) {
  constexpr int64_t B = 4096;
  const int64_t blocks = (n + B - 1) / B;
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  base::parallel_for(blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      double s = 0;
      for (int64_t i = b * B; i < std::min(n, (b + 1) * B); ++i) s += double(x[i]) * x[i];
      partial[b] = s;
    }
  });
  double s = 0;
  for (double p : partial) s += p;
  return std::sqrt(s);
}

}  // namespace

Tensor newton_schulz5(const Tensor& g, int steps) {
  TESSERA_CHECK(g.dim() == 2 && g.dtype() == DType::kF32 && g.is_contiguous(),
                "newton_schulz5: g ", g.describe(), " must be a contiguous 2-D f32 matrix");
  TESSERA_CHECK(steps >= 0, "newton_schulz5: steps ", steps, " is negative");
  const int64_t rows = g.size(0), cols = g.size(1);
  // The reference iterates on the wide orientation X (r, c), r <= c:
  //   A = X X^T;  B = b*A + c*A@A;  X' = a*X + B@X.
  // We keep its transpose Z = X^T (c, r) instead and run the same products transposed:
  //   A = Z^T Z;  Z' = a*Z + Z B^T  (= (B X)^T exactly, whether or not B's rounding
  // left it symmetric). oneDNN runs these layouts about twice as fast as B@X on
  // (768, 3072), and tall matrices (most of a transformer's) need no transpose at all.
  const bool tall = rows > cols;
  const int64_t r = tall ? cols : rows, c = tall ? rows : cols;
  Tensor z = Tensor::empty({c, r}, DType::kF32);  // X^T
  if (tall)
    z.copy_from(g);
  else
    transpose(g.data<float>(), z.data<float>(), rows, cols);
  // torch: X / (X.norm() + 1e-7) with the norm and the sum rounded to f32.
  const float denom = static_cast<float>(frobenius_norm(z.data<float>(), z.numel())) + 1e-7f;
  float* zp = z.data<float>();
  base::parallel_for(z.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) zp[i] /= denom;
  });
  Tensor a = Tensor::empty({r, r}, DType::kF32);  // X X^T
  Tensor b = Tensor::empty({r, r}, DType::kF32);  // b*A + c*A@A
  Tensor y = Tensor::empty({c, r}, DType::kF32);  // next Z
  for (int s = 0; s < steps; ++s) {
    kernels::matmul(z, z, a, true, false);               // A = Z^T Z
    b.copy_from(a);
    kernels::matmul(a, a, b, false, false, kNsC, kNsB);  // B = c*A@A + b*A
    y.copy_from(z);
    kernels::matmul(z, b, y, false, true, 1.f, kNsA);    // Z' = Z B^T + a*Z
    std::swap(z, y);
  }
  if (tall) return z;
  Tensor out = Tensor::empty({rows, cols}, DType::kF32);
  transpose(z.data<float>(), out.data<float>(), c, r);
  return out;
}

Tensor Optimizer::orthogonalise_block(const ParamRef& ref, const Tensor& u) const {
  // Every rank's block and where it sits, gathered; the whole matrix assembled (a block
  // several ranks hold, a replicated kv head, lands twice with the same values); the
  // Newton-Schulz iterations on it, identically on every rank; this rank's block of them.
  comm::Communicator& g = *ref.tp_group;
  const int64_t n = u.numel(), rows = u.size(0), cols = u.size(1);
  TESSERA_CHECK(ref.block_offset.size() == 2 && ref.full_shape.size() == 2,
                "muon: ", ref.name, " has no 2-D block geometry under tensor parallelism");
  // Offsets travel as f32: exact below 2^24, which every matrix dim is (model::limits).
  Tensor mine = Tensor::empty({n + 2}, DType::kF32);
  mine.slice(0, 0, n).copy_from(u.view({n}));
  mine.data<float>()[n] = static_cast<float>(ref.block_offset[0]);
  mine.data<float>()[n + 1] = static_cast<float>(ref.block_offset[1]);
  Tensor all = Tensor::empty({(n + 2) * g.size()}, DType::kF32);
  g.all_gather(mine, all);
  Tensor whole = Tensor::zeros(ref.full_shape, DType::kF32);
  for (int r = 0; r < g.size(); ++r) {
    const float* src = all.data<float>() + r * (n + 2);
    const auto r0 = static_cast<int64_t>(src[n]), c0 = static_cast<int64_t>(src[n + 1]);
    TESSERA_CHECK(r0 >= 0 && c0 >= 0 && r0 + rows <= ref.full_shape[0] && c0 + cols <= ref.full_shape[1],
                  "muon: tp rank ", r, "'s block of ", ref.name, " lies outside ",
                  shape_str(ref.full_shape));
    whole.slice(0, r0, r0 + rows).slice(1, c0, c0 + cols).copy_from(
        all.slice(0, r * (n + 2), r * (n + 2) + n).view({rows, cols}));
  }
  const Tensor o = newton_schulz5(whole, config_.muon_ns_steps);
  const int64_t r0 = ref.block_offset[0], c0 = ref.block_offset[1];
  return o.slice(0, r0, r0 + rows).slice(1, c0, c0 + cols).contiguous();
}

void Optimizer::step_muon(double lr, const StepOptions& opts) {
  const float w_momentum = static_cast<float>(1.0 - config_.muon_momentum);
  const float w_nesterov = static_cast<float>(config_.muon_momentum);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!state_[i].use_muon) continue;
    const ParamRef& ref = params_[i];
    const int64_t n = ref.param.numel(), rows = ref.param.size(0), cols = ref.param.size(1);
    const float* g = ref.grad.data<float>();
    float* m = state_[i].momentum.data<float>();
    // momentum.lerp_(grad, 1 - beta); update = grad.lerp(momentum, beta) (Nesterov) or
    // momentum. Unlike the reference, the gradient itself is left untouched.
    Tensor u = Tensor::empty(ref.param.shape(), DType::kF32);  // (rows, cols)
    float* up = u.data<float>();
    const bool nesterov = config_.muon_nesterov;
    const auto gs = static_cast<float>(opts.grad_scale);  // the clip coefficient (StepOptions)
    base::parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
      for (int64_t k = i0; k < i1; ++k) {
        const float gk = gs == 1.f ? g[k] : g[k] * gs;
        m[k] = lerp(m[k], gk, w_momentum);
        up[k] = nesterov ? lerp(gk, m[k], w_nesterov) : m[k];
      }
    });
    const bool split = ref.tp_group && ref.full_shape != ref.param.shape();
    const Tensor o = split ? orthogonalise_block(ref, u) : newton_schulz5(u, config_.muon_ns_steps);
    // update *= sqrt(max(1, rows/cols)) of the whole matrix; p.mul_(1 - lr*wd);
    // p.add_(update, alpha=-lr).
    const double whole_rows = split ? double(ref.full_shape[0]) : double(rows);
    const double whole_cols = split ? double(ref.full_shape[1]) : double(cols);
    const float shape_scale = static_cast<float>(std::sqrt(std::max(1.0, whole_rows / whole_cols)));
    const float decay =
        static_cast<float>(1.0 - lr * (ref.decay ? config_.muon_weight_decay : 0.0));
    const float neg_lr = static_cast<float>(-lr);
    const float* op = o.data<float>();
    float* p = ref.param.data<float>();
    base::parallel_for(n, kGrain, [&](int64_t i0, int64_t i1) {
      for (int64_t k = i0; k < i1; ++k) p[k] = std::fma(op[k] * shape_scale, neg_lr, p[k] * decay);
      if (opts.copies && (*opts.copies)[i].any())
        kernels::publish_values((*opts.copies)[i], p + i0, i0, i1 - i0);
    });
  }
}

}  // namespace tessera::train
