// Whether this CPU multiplies bf16 faster natively than widened to f32: the run-time fact
// behind matmul()'s widening rule and model::choose_bf16_mode's default without AMX.
#pragma once

namespace tessera::kernels {

// True with AMX-BF16. Without it but with AVX512-BF16, measured once per process (about
// 20 ms): a 512^3 bf16 product natively against the f32 product of the same operands;
// native must win by 1.3x (AMD Zen 5's vdpbf16ps runs at twice the f32 FMA rate, 2.0x;
// Intel's without AMX at half of it), so noise cannot flip a run's decision. False
// without AVX512-BF16. TESSERA_BF16_GEMM=native|widened skips the measurement.
bool bf16_native_gemm_faster();

}  // namespace tessera::kernels
