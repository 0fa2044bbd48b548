// The CPU attention kernels with AMX-BF16 products (attention_amx.cc): the contracts of
// attention_forward_cpu / attention_backward_cpu, for AttentionParams::bf16_products on a
// CPU with AMX (cpu_has(IsaLevel::kAmx)). Internal to kernels/.
#pragma once
#include "tessera/kernels/cpu/attention_cpu.h"

namespace tessera::kernels::cpu {

// The head dims the tiles take: multiples of 32 up to 256.
bool amx_attention_supports(const AttnDims& d);

void attention_forward_amx(const AttnDims& dims, const AttnView& q, const AttnView& k, const AttnView& v,
                           const AttnView& out, const LseView& lse, const AttentionParams& params);
void attention_backward_amx(const AttnDims& dims, const AttnView& q, const AttnView& k, const AttnView& v,
                            const AttnView& out, const LseView& lse, const AttnView& dout, const AttnView& dq,
                            const AttnView& dk, const AttnView& dv, const AttentionParams& params);

}  // namespace tessera::kernels::cpu
