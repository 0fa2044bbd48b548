// The integer quantizer's pieces that round-to-nearest (quant.cc) and GPTQ (gptq.cc) share.
#pragma once
#include <cstdint>

namespace tessera::kernels {

// GPTQ's Quantizer.find_params for one group of n values: the range always includes 0;
// symmetric puts the zero at 2^(bits-1); f16 rounds the scale to the nearest f16 (what a
// checkpoint stores); a zero of 0 becomes 1 with the range [0, max] over 2^bits - 2 steps
// (AutoGPTQ's v1 format stores z - 1).
void int_params(const float* w, int64_t n, int bits, bool symmetric, bool f16, float& scale,
                float& zero);
// 4-bit codes q[0..in) into QuantWeight's int4 layout (runs of 32 in 16 bytes).
void pack_int4(const int32_t* q, int64_t in, uint8_t* dst);

}  // namespace tessera::kernels
