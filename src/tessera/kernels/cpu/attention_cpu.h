// Internal interface of the CPU attention kernels: raw strided views, already checked by
// kernels/attention.cc. Tests include it to run the portable path on AVX-512 machines.
#pragma once
#include <cstdint>

#include "tessera/kernels/attention.h"

namespace tessera::kernels::cpu {

// A (B, T, H, D) f32 tensor whose head stride is D and dim stride 1; batch and token
// strides are free (views into a fused QKV buffer or a KV cache).
struct AttnView {
  float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t token_stride = 0;
  float* row(int64_t b, int64_t t, int64_t h, int64_t D) const {
    return data + b * batch_stride + t * token_stride + h * D;
  }
};

// lse (B, Hq, Tq) f32, any strides.
struct LseView {
  float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t token_stride = 0;
  float& at(int64_t b, int64_t h, int64_t t) const {
    return data[b * batch_stride + h * head_stride + t * token_stride];
  }
};

struct AttnDims {
  int64_t B = 0, Tq = 0, Tk = 0, Hq = 0, Hkv = 0, D = 0;
};

enum class AttnIsa { kScalar, kAvx2, kAvx512 };
AttnIsa best_attention_isa();  // from base::cpu_features()
struct AttnTileOps;
const AttnTileOps& tile_ops(AttnIsa isa);  // attention_tile_ops.h's table for `isa`

// out (B, Tq, Hq, D); lse optional (data == nullptr to skip).
void attention_forward_cpu(const AttnDims& dims, const AttnView& q, const AttnView& k,
                           const AttnView& v, const AttnView& out, const LseView& lse,
                           const AttentionParams& params, AttnIsa isa);

// dq (B, Tq, Hq, D), dk / dv (B, Tk, Hkv, D): overwritten.
void attention_backward_cpu(const AttnDims& dims, const AttnView& q, const AttnView& k,
                            const AttnView& v, const AttnView& out, const LseView& lse,
                            const AttnView& dout, const AttnView& dq, const AttnView& dk,
                            const AttnView& dv, const AttentionParams& params, AttnIsa isa);

}  // namespace tessera::kernels::cpu
