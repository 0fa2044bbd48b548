// The element passes of the optimizer step, by ISA (AVX-512, AVX2 + FMA, portable): the
// fused AdamW update, the sum of squares the global gradient norm adds up, and the fp16
// loss scaler's unscale-and-check. train/ loops over tensors and calls these.
#pragma once
#include <cstdint>

#include <memory>

#include "tessera/kernels/packed_b.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

// Per-step scalars of one AdamW update, rounded to f32 the way torch rounds Python
// scalars when they meet an f32 tensor.
struct AdamWScalars {
  float decay;     // 1 - lr * weight_decay
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
  float neg_step_size;          // -lr / (1 - beta1^t)
  float eps;
};
// What an update pass does besides the update, while the new values are in registers:
// the gradient norm clip's coefficient (g * grad_scale rounded to f32 first, the value
// torch's in-place clip_grad_norm_ leaves behind; the gradient itself is not written), and
// the model's copies of the new weights (what a mixed-precision wrapper would otherwise
// publish in a second pass over the masters).
struct UpdateExtras {
  float grad_scale = 1.f;
  float* rounded = nullptr;   // n floats: the new value rounded to bf16 (f16 when round_f16), widened
  bool round_f16 = false;
  uint16_t* bf16 = nullptr;   // n bf16 bits of the new value (round to nearest even)
  // The caller reads bf16 next (a scratch it packs from): plain stores, not streamed.
  bool cache_bf16 = false;
  bool copies() const { return rounded != nullptr || bf16 != nullptr; }
};
// The same copies as tensors, for one parameter of an optimizer step: where a wrapper keeps
// the weights the model computes with (DataParallel::piece_copies). Undefined: none.
struct ParamCopies {
  Tensor rounded;               // f32, the parameter's numel: its value rounded to `format`
  DType format = DType::kBF16;  // kBF16 or kF16
  Tensor bf16;                  // bf16, the parameter's numel
  // Packed copies of the weights the parameter is part of (kernels/packed_b.h): its
  // element i is the stacked weights' element packed_first + i. Null: none.
  std::shared_ptr<const PackTargets> packed;
  int64_t packed_first = 0;
  bool any() const { return rounded.defined() || bf16.defined() || packed; }
};
// Writes n new values p (f32) into `copies`' elements [begin, begin + n): the rounded and
// bf16 copies, and the packed ones from a bf16 scratch that stays in cache.
void publish_values(const ParamCopies& copies, const float* p, int64_t begin, int64_t n);
// The same from the values' bf16 bits (an update pass's cached scratch): into the bf16
// copy (streamed) and the packed copies.
void publish_bf16(const ParamCopies& copies, int64_t begin, const uint16_t* bits, int64_t n);
// extras for `copies`' elements [begin, begin + n) (grad_scale 1).
UpdateExtras extras_of(const ParamCopies& copies, int64_t begin);

// The fused one-pass AdamW update of n elements: AVX-512, else AVX2 + FMA, else a
// portable loop, all with the same roundings (bit-identical results).
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s,
                  const UpdateExtras& extras = {});
// Writes extras' copies (rounded, bf16) of n values p: what adamw_update writes, for values
// updated elsewhere (Muon, the router bias). grad_scale is not used.
void write_copies(const float* p, int64_t n, const UpdateExtras& extras);
enum class AdamWKernel { kAuto, kAvx512, kAvx2, kPortable };
// For tests and benchmarks: forces one loop (one the CPU lacks falls back to portable).
void set_adamw_kernel_for_testing(AdamWKernel k);

// Sum of x[i]^2 in double (AVX-512 where the CPU has it; the sum's order differs by ISA).
double sum_squares(const float* x, int64_t n);

// x *= inv over n floats; true when every x was finite beforehand.
bool unscale_check_finite(float* x, int64_t n, float inv);

}  // namespace tessera::kernels
