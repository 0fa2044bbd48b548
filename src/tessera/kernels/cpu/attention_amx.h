// The CPU attention kernels with AMX-BF16 products (attention_amx.cc): the contracts of
// attention_forward_cpu / attention_backward_cpu, for AttentionParams::bf16_products on a
// CPU with AMX (cpu_has(IsaLevel::kAmx)) and dims amx_attention_supports takes. Internal
// to kernels/.
#pragma once
#include "tessera/kernels/cpu/attention_cpu.h"

namespace tessera::kernels::cpu {

// Below this many keys the f32 kernels are as fast or faster: the packing per (batch, kv
// head) outweighs the products (attention_bench, 4 x 64 x 12 heads of 64: backward 0.46 ms
// in f32, 0.54 on AMX; at 128 keys 1.34 against 1.23).
constexpr int64_t kAmxMinKeys = 128;
// What the tiles take: head dims that are multiples of 32 up to 256, kAmxMinKeys keys or
// more, at most 32 query heads per kv head.
bool amx_attention_supports(const AttnDims& d);
// Tests: moves the key threshold (0: back to kAmxMinKeys), so a short sequence (a parity
// model's) runs the tiles end to end.
void set_amx_attention_min_keys_for_testing(int64_t keys);

void attention_forward_amx(const AttnDims& dims, const AttnView& q, const AttnView& k, const AttnView& v,
                           const AttnView& out, const LseView& lse, const AttentionParams& params);
void attention_backward_amx(const AttnDims& dims, const AttnView& q, const AttnView& k, const AttnView& v,
                            const AttnView& out, const LseView& lse, const AttnView& dout, const AttnView& dq,
                            const AttnView& dk, const AttnView& dv, const AttentionParams& params);

}  // namespace tessera::kernels::cpu
