// Whether this CPU multiplies bf16 faster natively than widened to f32: the fact
// behind matmul()'s widening rule and model::choose_bf16_mode's default without AMX.
#pragma once

namespace tessera::kernels {

// True with AMX-BF16; false without AVX512-BF16. With AVX512-BF16 alone it depends on the
// vendor, decided from cpuid rather than timed so that every process of a machine decides
// alike: AMD's (Zen 4/5) runs bf16 dot products at twice the f32 FMA rate (true); Intel's
// at half of it (false). TESSERA_BF16_GEMM=native|widened overrides.
bool bf16_native_gemm_faster();

}  // namespace tessera::kernels
