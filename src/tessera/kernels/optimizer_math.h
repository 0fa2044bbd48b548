// The element passes of the optimizer step, by ISA (AVX-512, AVX2 + FMA, portable): the
// fused AdamW update, the sum of squares the global gradient norm adds up, and the fp16
// loss scaler's unscale-and-check. train/ loops over tensors and calls these.
#pragma once
#include <cstdint>

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
// The fused one-pass AdamW update of n elements: AVX-512, else AVX2 + FMA, else a
// portable loop, all with the same roundings (bit-identical results).
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s);
enum class AdamWKernel { kAuto, kAvx512, kAvx2, kPortable };
// For tests and benchmarks: forces one loop (one the CPU lacks falls back to portable).
void set_adamw_kernel_for_testing(AdamWKernel k);

// Sum of x[i]^2 in double (AVX-512 where the CPU has it; the sum's order differs by ISA).
double sum_squares(const float* x, int64_t n);

// x *= inv over n floats; true when every x was finite beforehand.
bool unscale_check_finite(float* x, int64_t n, float inv);

}  // namespace tessera::kernels
