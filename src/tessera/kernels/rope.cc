// Entry point of rope.h: checks the head layout and positions, then runs the CPU kernel.
#include "tessera/kernels/rope.h"
#include "tessera/kernels/dispatch.h"

#include <cmath>

#include "tessera/kernels/cpu/rope_cpu.h"
#include "tessera/kernels/pointwise_checks.h"

namespace tessera::kernels {

void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, const RopeFreqs& freqs,
                bool inverse) {
  const char* op = "rope_apply";
  detail::check_rows(x, op, "x", DType::kF32);
  TESSERA_CHECK(head_dim > 0 && head_dim % 2 == 0, op, ": head_dim must be positive and even, got ",
                head_dim);
  TESSERA_CHECK(x.size(1) % head_dim == 0, op, ": x ", x.describe(),
                " width is not a multiple of head_dim ", head_dim);
  TESSERA_CHECK(freqs.rotary_dim() > 0 && freqs.rotary_dim() <= head_dim, op, ": ", freqs.inv_freq.size(),
                " frequencies rotate ", freqs.rotary_dim(), " features, not within head_dim ", head_dim);
  TESSERA_CHECK(std::isfinite(freqs.attention_factor), op, ": attention_factor must be finite");
  detail::check_vector(positions, op, "positions", x.size(0), {DType::kI32});
  TESSERA_KERNEL(op, cpu::rope_apply(x, head_dim, positions, freqs, inverse), x, positions);
}

void rope_apply(Tensor& x, int64_t head_dim, const Tensor& positions, float theta, bool inverse) {
  TESSERA_CHECK(std::isfinite(theta) && theta > 0.f, "rope_apply: theta must be positive, got ", theta);
  TESSERA_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope_apply: head_dim must be positive and even, got ", head_dim);
  rope_apply(x, head_dim, positions, rope_default_freqs(head_dim, theta), inverse);
}

}  // namespace tessera::kernels
